//! Finding devices: the probe without a driver, UUIDs, the current context's device, local ranks.

use std::collections::HashMap;
use std::ffi::c_char;

use super::fake;
use crate::config::GpuSelector;
use crate::cuda::device::*;
use crate::cuda::driver::*;
use crate::cuda::*;

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    move |k| map.get(k).cloned()
}

#[test]
fn no_driver_here_and_no_panic() {
    // This machine has no libcuda; on a GPU machine the same calls must simply succeed.
    let present = driver_present();
    assert_eq!(present, crate::cuda_driver_present());
    assert_eq!(present, crate::cuda_unavailable_reason().is_none());
    assert_eq!(present, driver_present(), "decided once");
    if !present {
        // No library here (CudaUnavailable); on a GPU machine with CUDA_VISIBLE_DEVICES empty,
        // cuInit's own error (CUDA_ERROR_NO_DEVICE).
        for selector in [
            GpuSelector::Auto,
            GpuSelector::Ordinal(0),
            GpuSelector::Uuid([0; 16]),
        ] {
            match Device::find(selector) {
                Err(Error::CudaUnavailable { reason }) => assert!(!reason.is_empty()),
                Err(Error::Cuda { call: "cuInit", .. }) => {}
                other => panic!("expected the probe's error, got {other:?}"),
            }
        }
    }
}

#[test]
fn open_beyond_device_count_is_not_found() {
    if !driver_present() {
        return;
    }
    match Device::find(GpuSelector::Ordinal(u32::MAX)) {
        Err(Error::GpuNotFound { selector, .. }) => assert_eq!(selector, "4294967295"),
        other => panic!("expected GpuNotFound, got {other:?}"),
    }
}

#[test]
fn the_current_contexts_device_is_looked_up_once_per_context() {
    let api = fake::api(true, true);
    fake::CURRENT_CTX.with(|c| c.set(0));
    assert_eq!(current_ordinal_in(api), None, "no current context");
    for ctx in [0x1000, 0x1000, 0x2000, 0x2000] {
        fake::CURRENT_CTX.with(|c| c.set(ctx));
        assert_eq!(current_ordinal_in(api), Some(0));
    }
    let lookups = fake::take_log();
    assert_eq!(
        lookups,
        ["ctx_get_device", "ctx_get_device"],
        "one per context"
    );
}

#[test]
fn uuid_matches_either_entry_point() {
    let both = fake::api(true, true);
    assert_eq!(raw::uuid_matches(both, 0, &[0xab; 16]), Ok(true));
    assert_eq!(raw::uuid_matches(both, 0, &[0xcd; 16]), Ok(true));
    assert_eq!(raw::uuid_matches(both, 0, &[0x00; 16]), Ok(false));
    let v2 = fake::api(true, false);
    assert_eq!(raw::uuid_matches(v2, 0, &[0xab; 16]), Ok(true));
    assert_eq!(raw::uuid_matches(v2, 0, &[0xcd; 16]), Ok(false));
    let v1 = fake::api(false, true);
    assert_eq!(raw::uuid_matches(v1, 0, &[0xcd; 16]), Ok(true));
    assert_eq!(raw::uuid_matches(v1, 0, &[0xab; 16]), Ok(false));
    assert!(matches!(
        raw::uuid_matches(fake::api(false, false), 0, &[0xab; 16]),
        Err(Error::CudaUnavailable { .. })
    ));
}

#[test]
fn local_rank_first_that_parses() {
    assert_eq!(local_rank(env(&[])), None);
    assert_eq!(local_rank(env(&[("SLURM_LOCALID", "3")])), Some(3));
    assert_eq!(
        local_rank(env(&[("LOCAL_RANK", "1"), ("SLURM_LOCALID", "3")])),
        Some(1)
    );
    assert_eq!(
        local_rank(env(&[("LOCAL_RANK", "x"), ("MPI_LOCALRANKID", " 5 ")])),
        Some(5)
    );
    assert_eq!(
        local_rank(env(&[("OMPI_COMM_WORLD_LOCAL_RANK", "-1")])),
        None
    );
    assert_eq!(auto_ordinal(env(&[("LOCAL_RANK", "5")]), 4), 1);
    assert_eq!(auto_ordinal(env(&[("LOCAL_RANK", "5")]), 0), 0);
    assert_eq!(auto_ordinal(env(&[]), 8), 0);
    assert_eq!(auto_ordinal(env(&[("SLURM_LOCALID", "7")]), 8), 7);
}

#[test]
fn selector_texts() {
    assert_eq!(selector_text(&GpuSelector::Auto), "auto");
    assert_eq!(selector_text(&GpuSelector::Ordinal(3)), "3");
    let mut bytes = [0u8; 16];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = (i as u8) * 0x11;
    }
    assert_eq!(
        selector_text(&GpuSelector::Uuid(bytes)),
        "GPU-00112233-4455-6677-8899-aabbccddeeff"
    );
    assert_eq!(
        c_buf_text(&[b'a' as c_char, b'b' as c_char, 0, b'c' as c_char]),
        "ab"
    );
    assert_eq!(c_buf_text(&[b'a' as c_char]), "a");
}
