//! Resizing large blocks without a copy: grown or shrunk in place, or moved by `mremap`. Each
//! takes the value's runtime, `None` before the large path initialised.

use std::alloc::Layout;
use std::ptr::NonNull;

use crate::guard::Inside;
use crate::runtime::route;
use crate::runtime::Runtime;

/// Tells the large path that its block at `ptr` is being reallocated: resized, grown by moving
/// its pages, or copied (read whole) into another.
pub(super) fn reallocating(rt: Option<&Runtime>, ptr: *mut u8) {
    if let Some(rt) = rt {
        rt.blocks.reallocating(ptr as usize);
    }
}

/// Grows a large block without copying its bytes, when the large path can (see
/// `Blocks::grow_without_copy`); `None`: move by copying instead.
pub(super) fn grow_without_copy(
    rt: Option<&Runtime>,
    ptr: *mut u8,
    new: Layout,
) -> Option<NonNull<u8>> {
    let (Some(rt), Some(_inside)) = (rt, Inside::enter()) else {
        return None;
    };
    rt.blocks
        .grow_without_copy(ptr as usize, new, &route::target(rt))
}

/// Resizes a live block where it lies, when the large path can (see `Blocks::resize_in_place`).
pub(super) fn in_place(rt: Option<&Runtime>, ptr: *mut u8, new: Layout) -> bool {
    let (Some(rt), Some(_inside)) = (rt, Inside::enter()) else {
        return false;
    };
    rt.blocks
        .resize_in_place(ptr as usize, new, route::likely_node(rt))
}
