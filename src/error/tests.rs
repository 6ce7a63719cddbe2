//! The error texts name the values that made the operation fail.
use super::*;

#[test]
fn display_names_the_values() {
    let e = Error::UnknownNode {
        node: 7,
        node_count: 2,
    };
    assert_eq!(
        e.to_string(),
        "node 7 is not one of the topology's 2 online nodes"
    );
    let e = Error::NumaUnavailable {
        call: "mbind",
        errno: libc::EPERM,
    };
    assert!(e.to_string().contains("mbind"));
    assert!(e.to_string().contains("errno 1"));
    let e = Error::DistanceMatrixSize {
        node_count: 2,
        entries: 3,
    };
    assert_eq!(
        e.to_string(),
        "distance matrix for 2 nodes needs 4 entries, got 3"
    );
}
