//! Events: `cuEventQuery`'s answers read as done, running or an error.

use std::ffi::c_void;

use super::fake;
use crate::cuda::event::outcome;
use crate::cuda::*;

#[test]
fn event_query_reads_done_running_and_errors() {
    // The fake event's handle is the code cuEventQuery answers.
    let api = fake::api(true, true);
    let query = |code: usize| outcome(api, code as *mut c_void);
    assert_eq!(query(0), Ok(true));
    assert_eq!(query(600), Ok(false), "CUDA_ERROR_NOT_READY: still running");
    assert_eq!(
        query(700),
        Err(Error::Cuda {
            call: "cuEventQuery",
            code: 700,
            name: "CUDA_ERROR_ILLEGAL_ADDRESS"
        }),
        "an error is not completion"
    );
}
