//! The check lines of the guest programs (`guest_alloc`, `guest_routes`): `PASS <prefix>.<name>`
//! or `FAIL <prefix>.<name>: expected X, got Y`, printed as they happen, and the page census that
//! tells where an allocation's pages are. Included with `#[path]`.

use std::process::ExitCode;
use std::ptr::NonNull;

use numa_gpu_alloc::unstable::sys::{self, PageCensus};

/// Prints the check lines as they happen, so that a crash still leaves the earlier ones.
pub struct Report {
    /// `global`, `limit` or `routes`: the first part of each check's name.
    prefix: &'static str,
    passed: usize,
    failed: usize,
}

impl Report {
    /// A report whose checks are named `<prefix>.<name>`.
    pub fn new(prefix: &'static str) -> Report {
        Report {
            prefix,
            passed: 0,
            failed: 0,
        }
    }

    /// Prints the `<prefix>: N passed, M failed` line; failure if any check failed.
    pub fn finish(self) -> ExitCode {
        println!(
            "{}: {} passed, {} failed",
            self.prefix, self.passed, self.failed
        );
        if self.failed == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    }

    pub fn check(&mut self, name: &str, ok: bool, expected: impl FnOnce() -> String, got: String) {
        let prefix = self.prefix;
        if ok {
            self.passed += 1;
            println!("PASS {prefix}.{name}");
        } else {
            self.failed += 1;
            println!("FAIL {prefix}.{name}: expected {}, got {got}", expected());
        }
    }

    pub fn eq<T: PartialEq + std::fmt::Debug>(&mut self, name: &str, expected: T, got: T) {
        let ok = expected == got;
        self.check(name, ok, || format!("{expected:?}"), format!("{got:?}"));
    }

    /// All pages of `ptr..ptr+len` are present on `node`.
    pub fn on_node(&mut self, name: &str, ptr: *const u8, len: usize, node: usize) {
        let pages = len.div_ceil(sys::page_size());
        let expected = || format!("{pages} pages on node {node}");
        match census(ptr, len, node) {
            Ok(c) => {
                let ok = c.pages == pages && c.on_node == pages;
                self.check(name, ok, expected, describe(&c));
            }
            Err(e) => self.check(name, false, expected, e),
        }
    }
}

/// Where the pages of a live allocation of this process are.
fn census(ptr: *const u8, len: usize, node: usize) -> Result<PageCensus, String> {
    let ptr = NonNull::new(ptr.cast_mut()).ok_or("a null pointer")?;
    // SAFETY: `ptr..ptr+len` lies in a live large block of this process (page-aligned, mapped);
    // move_pages without target nodes only reads the page tables.
    unsafe { sys::census(ptr, len, node) }.map_err(|e| format!("census: {e}"))
}

fn describe(c: &PageCensus) -> String {
    format!(
        "{} of {} pages there, {} elsewhere, {} absent",
        c.on_node, c.pages, c.elsewhere, c.absent
    )
}
