//! The only module that makes raw placement syscalls (in progress).
