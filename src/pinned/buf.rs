//! [`PinnedBuf`]: a page-locked buffer from a [`NumaGpuAlloc`] that cudarc's safe copies use
//! asynchronously and safely, as cudarc's own `PinnedHostSlice` does: each copy waits for the
//! buffer's earlier uses and records an event after itself; host access waits for that event;
//! dropping hands the event to the arena, which reuses the block only once it completed.
//!
//! Unsafe code here relies on the buffer owning its block (allocated with its layout, freed once
//! in `Drop`) and on `len` initialised elements in it.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaEvent, CudaStream, DeviceRepr, HostSlice, SyncOnDrop, ValidAsZeroBits};

use crate::alloc::RecordedEvent;
use crate::cuda::{event, FORKED_REASON};
use crate::{fork, Error, NumaGpuAlloc, Result};

/// A fixed-length, page-locked buffer of `T` on the GPU's NUMA node, for cudarc's copies
/// (`memcpy_htod`, `memcpy_dtoh`, `clone_htod`) without blocking and without races.
///
/// ## Synchronisation
/// - A copy (`stream.memcpy_htod(&buf, ..)`, `memcpy_dtoh(.., &mut buf)`, `clone_htod(&buf)`,
///   or with a part: `memcpy_dtoh(.., &mut buf.slice_mut(a..b))`) first makes `stream` wait for
///   the buffer's earlier copies on other streams, then records the buffer's event after
///   itself; it does not block the host.
/// - Host access ([`Deref`](std::ops::Deref), [`DerefMut`](std::ops::DerefMut),
///   [`as_slice`](Self::as_slice), [`as_mut_slice`](Self::as_mut_slice), iteration) first waits
///   for that event: the host never reads a copy's destination early nor changes a source a copy
///   still reads.
/// - Dropping never waits for copies: the block goes to the allocator's pending list and is
///   reused only once the event completed (`cuEventQuery` on the allocation path).
/// - On the default or per-thread stream, or when cudarc does not track events (no stream of
///   its own created, or event tracking turned off), a copy synchronises its stream before
///   returning, as cudarc does for pageable memory. A stream wrapped with cudarc's
///   `wrap_borrowed_stream` is not supported while no other stream exists.
///
/// ## Never hand a plain slice to cudarc
/// `&buf[..]`, `buf.as_slice()` and the like are `[T]`, which cudarc treats as pageable: a copy
/// with one is asynchronous (the memory is page-locked) and nobody waits for it. Copy with the
/// buffer itself or with [`slice_mut`](Self::slice_mut).
///
/// ## Threads
/// `Send`, not `Sync`: one thread at a time queues copies and touches the elements, so that each
/// copy's wait and record pair up with the host's waits.
///
/// ```compile_fail
/// fn shared_between_threads<T: Sync>() {}
/// shared_between_threads::<numa_gpu_alloc::PinnedBuf<'static, u8>>();
/// ```
///
/// The allocator must pin (`.pin(PinMode::On)` or `NUMA_GPU_ALLOC=pin=on`). A buffer takes at
/// least the allocator's threshold (2 MiB by default), even for no element, so that it is always
/// a block of the large path.
pub struct PinnedBuf<'a, T, A: GlobalAlloc = System> {
    ptr: NonNull<T>,
    len: usize,
    layout: Layout,
    alloc: &'a NumaGpuAlloc<A>,
    /// Created on the first copy, in that stream's context.
    event: OnceLock<CudaEvent>,
    /// A copy recorded the event since the host last waited for it.
    in_flight: AtomicBool,
    /// The fork generation that made it: in a child forked since, no CUDA call is made (the GPU
    /// writes the parent's pages, never the child's copy) and the event is left alone.
    generation: u32,
}

// SAFETY: the buffer owns its elements like a `Box<[T]>`; the event and the allocator reference
// are `Send + Sync` (cudarc's events are; `NumaGpuAlloc` is shared by design when its inner
// allocator is `Sync`). It is not `Sync`
// (the `OnceLock` and `Cell`-like flag stay on one thread at a time): two threads queueing copies
// through `&buf` could interleave one copy's wait with another's record.
unsafe impl<T: Send, A: GlobalAlloc + Sync> Send for PinnedBuf<'_, T, A> {}

impl<'a, T: DeviceRepr + ValidAsZeroBits, A: GlobalAlloc> PinnedBuf<'a, T, A> {
    /// `len` zeroed elements from `alloc`.
    ///
    /// Errors: when `alloc`'s blocks are not page-locked, why (as
    /// [`Placement::pinning_off`](crate::Placement::pinning_off) says): [`Error::PinningOff`]
    /// (`pin=off`), [`Error::DriverUnusable`], [`Error::GpuNotFound`] (no device matches the
    /// selector), [`Error::CudaUnavailable`] (no device visible, or a forked child),
    /// [`Error::NodeTarget`]; [`Error::BufferAllocation`] when the block cannot be allocated.
    pub fn zeroed(alloc: &'a NumaGpuAlloc<A>, len: usize) -> Result<Self> {
        Self::allocate(alloc, len, true)
    }
}

impl<'a, T: DeviceRepr + Copy, A: GlobalAlloc> PinnedBuf<'a, T, A> {
    /// A copy of `data` in a buffer from `alloc`; errors as [`zeroed`](Self::zeroed)'s.
    pub fn from_slice(alloc: &'a NumaGpuAlloc<A>, data: &[T]) -> Result<Self> {
        let buf = Self::allocate(alloc, data.len(), false)?;
        // SAFETY: the block holds room for `data.len()` elements, is ours alone, and does not
        // overlap `data`; from here every element is initialised.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf.ptr.as_ptr(), data.len()) };
        Ok(buf)
    }
}

impl<'a, T, A: GlobalAlloc> PinnedBuf<'a, T, A> {
    /// Allocates room for `len` elements, zeroed when `zeroed` (callers guarantee that zero bits
    /// are a valid `T`, or initialise every element before any read).
    fn allocate(alloc: &'a NumaGpuAlloc<A>, len: usize, zeroed: bool) -> Result<Self> {
        let placement = alloc.placement();
        if !placement.pinning {
            // Each cause has its own error: what to change differs (the setting, the driver,
            // the GPU selector, the process).
            return Err(placement.pinning_off.unwrap_or(Error::CudaUnavailable {
                reason: "the allocator's blocks are not page-locked",
            }));
        }
        let failed = |reason| Error::BufferAllocation {
            len,
            element_size: size_of::<T>(),
            reason,
        };
        let bytes = len
            .checked_mul(size_of::<T>())
            .ok_or_else(|| failed("size overflows usize"))?;
        let size = bytes.max(alloc.config().threshold);
        let layout = Layout::from_size_align(size, align_of::<T>())
            .map_err(|_| failed("size overflows usize"))?;
        let ptr = NonNull::new(alloc.allocate(layout, zeroed))
            .ok_or_else(|| failed("the allocator returned null"))?
            .cast::<T>();
        Ok(PinnedBuf {
            ptr,
            len,
            layout,
            alloc,
            event: OnceLock::new(),
            in_flight: AtomicBool::new(false),
            generation: fork::generation(),
        })
    }

    /// The elements' address, without waiting for copies (reading through it is the caller's
    /// business).
    pub fn as_ptr(&self) -> *const T {
        self.ptr.as_ptr()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The elements, after waiting for the copies recorded on the buffer. In a forked child, an
    /// error: what the copies wrote is not in the child's memory, and the driver may have kept
    /// the page-locked range out of the child altogether.
    pub fn as_slice(&self) -> Result<&[T]> {
        self.wait_for_copies()?;
        Ok(self.elements())
    }

    /// The elements for writing, after waiting for the copies recorded on the buffer.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.wait_for_copies()?;
        Ok(self.elements_mut())
    }

    /// Waits until every copy recorded on the buffer has completed.
    pub fn synchronize(&self) -> Result<()> {
        self.wait_for_copies()
    }

    fn forked(&self) -> bool {
        self.generation != fork::generation()
    }

    fn wait_for_copies(&self) -> Result<()> {
        if self.forked() {
            return Err(Error::CudaUnavailable {
                reason: FORKED_REASON,
            });
        }
        if self.in_flight.load(Ordering::Acquire) {
            if let Some(event) = self.event.get() {
                event::wait(event)?;
            }
            self.in_flight.store(false, Ordering::Release);
        }
        Ok(())
    }

    /// A part of the buffer that cudarc's copies track like the whole buffer (for a copy to or
    /// from an offset).
    ///
    /// # Panics
    /// When `range` is out of bounds, as slicing does.
    pub fn slice_mut(&mut self, range: std::ops::Range<usize>) -> PinnedSliceMut<'_, 'a, T, A> {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "PinnedBuf::slice_mut: range {range:?} out of bounds for length {}",
            self.len
        );
        PinnedSliceMut { buf: self, range }
    }

    fn elements(&self) -> &[T] {
        // SAFETY: `ptr` holds `len` initialised elements (zeroed or copied in) for the buffer's
        // life; callers have waited for copies that write them.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn elements_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `elements`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Orders `stream` after the buffer's earlier copies and says how cudarc is to follow the
    /// copy it is about to queue.
    fn before_copy<'b>(&'b self, stream: &'b CudaStream) -> SyncOnDrop<'b> {
        let ctx = stream.context();
        // The default, legacy (0x1) and per-thread (0x2) streams do not count as cudarc's
        // streams: the mode could change before cudarc records the event.
        let shared_stream = matches!(stream.cu_stream() as usize, 0..=2);
        if shared_stream || !ctx.is_managing_stream_synchronization() {
            // cudarc would not record the event: synchronise the stream after the copy.
            let _ = self.wait_for_copies();
            return SyncOnDrop::Sync(Some(stream));
        }
        if self.event.get().is_none() {
            if let Ok(event) = event::take_event(ctx) {
                // Not `Sync`, so nothing else sets it; were it lost, the pool takes the event
                // back (cudarc's `Drop` would call the driver outside the exit gate).
                if let Err(lost) = self.event.set(event) {
                    event::give_back(lost);
                }
            }
        }
        match self.event.get() {
            Some(event) if Arc::ptr_eq(event.context(), ctx) => {
                match event::stream_wait(stream, event) {
                    Ok(waited) => {
                        // Errors are kept by cudarc in the context and returned by its next call.
                        ctx.record_err(waited);
                        self.in_flight.store(true, Ordering::Release);
                        SyncOnDrop::Record(Some((event, stream)))
                    }
                    // The process is exiting (the driver may be tearing down): no call of ours
                    // after the copy either (the copy itself is cudarc's call). Marked in flight,
                    // so the host's next wait for the buffer fails (the gate refuses it) and a
                    // freed block stays pending, never reused.
                    Err(_) => {
                        self.in_flight.store(true, Ordering::Release);
                        SyncOnDrop::Sync(None)
                    }
                }
            }
            // No event, or one of another context: wait here, synchronise after the copy.
            _ => {
                let _ = self.wait_for_copies();
                SyncOnDrop::Sync(Some(stream))
            }
        }
    }
}

impl<T, A: GlobalAlloc> HostSlice<T> for PinnedBuf<'_, T, A> {
    fn len(&self) -> usize {
        self.len
    }

    unsafe fn stream_synced_slice<'b>(
        &'b self,
        stream: &'b CudaStream,
    ) -> (&'b [T], SyncOnDrop<'b>) {
        let sync = self.before_copy(stream);
        (self.elements(), sync)
    }

    unsafe fn stream_synced_mut_slice<'b>(
        &'b mut self,
        stream: &'b CudaStream,
    ) -> (&'b mut [T], SyncOnDrop<'b>) {
        let this: &'b Self = self;
        let sync = this.before_copy(stream);
        // SAFETY: `self` is borrowed mutably for 'b, so this is the only reference to the
        // elements; the copy the caller queues is ordered by `sync`.
        let elements = unsafe { std::slice::from_raw_parts_mut(this.ptr.as_ptr(), this.len) };
        (elements, sync)
    }
}

/// A part of a [`PinnedBuf`] for cudarc's copies, tracked with the whole buffer's event (from
/// [`PinnedBuf::slice_mut`]).
pub struct PinnedSliceMut<'b, 'a, T, A: GlobalAlloc = System> {
    buf: &'b mut PinnedBuf<'a, T, A>,
    range: std::ops::Range<usize>,
}

impl<T, A: GlobalAlloc> HostSlice<T> for PinnedSliceMut<'_, '_, T, A> {
    fn len(&self) -> usize {
        self.range.len()
    }

    unsafe fn stream_synced_slice<'c>(
        &'c self,
        stream: &'c CudaStream,
    ) -> (&'c [T], SyncOnDrop<'c>) {
        // SAFETY: forwarded from the caller (the slice is used with `stream` only).
        let (all, sync) = unsafe { self.buf.stream_synced_slice(stream) };
        (&all[self.range.clone()], sync)
    }

    unsafe fn stream_synced_mut_slice<'c>(
        &'c mut self,
        stream: &'c CudaStream,
    ) -> (&'c mut [T], SyncOnDrop<'c>) {
        let range = self.range.clone();
        // SAFETY: forwarded from the caller (the slice is used with `stream` only).
        let (all, sync) = unsafe { self.buf.stream_synced_mut_slice(stream) };
        (&mut all[range], sync)
    }
}

impl<T, A: GlobalAlloc> std::ops::Deref for PinnedBuf<'_, T, A> {
    type Target = [T];

    /// # Panics
    /// When waiting for the buffer's copies fails (the CUDA context is broken); use
    /// [`PinnedBuf::as_slice`] to get the error instead.
    fn deref(&self) -> &[T] {
        match self.as_slice() {
            Ok(elements) => elements,
            Err(e) => panic!("PinnedBuf: waiting for its copies failed: {e}"),
        }
    }
}

impl<T, A: GlobalAlloc> std::ops::DerefMut for PinnedBuf<'_, T, A> {
    /// # Panics
    /// As [`Deref`](std::ops::Deref).
    fn deref_mut(&mut self) -> &mut [T] {
        if let Err(e) = self.wait_for_copies() {
            panic!("PinnedBuf: waiting for its copies failed: {e}");
        }
        self.elements_mut()
    }
}

impl<'b, T, A: GlobalAlloc> IntoIterator for &'b PinnedBuf<'_, T, A> {
    type Item = &'b T;
    type IntoIter = std::slice::Iter<'b, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<T: std::fmt::Debug, A: GlobalAlloc> std::fmt::Debug for PinnedBuf<'_, T, A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuf")
            .field("len", &self.len)
            .field("in_flight", &self.in_flight.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl<T, A: GlobalAlloc> Drop for PinnedBuf<'_, T, A> {
    fn drop(&mut self) {
        if self.forked() {
            std::mem::forget(self.event.take());
        } else if let Some(event) = self.event.take() {
            if *self.in_flight.get_mut() {
                let work = Box::new(RecordedEvent::new(event));
                // Not a block of the allocator's large path (cannot happen: sized at the
                // threshold): wait here rather than free memory a copy may still use, and when
                // the wait fails (the process is exiting, the context broke), leave the block
                // allocated: a copy may still read or write it.
                if let Err(mut work) = self.alloc.record_in_flight(self.ptr.as_ptr().cast(), work) {
                    if !work.wait() {
                        return;
                    }
                }
            } else {
                event::give_back(event);
            }
        }
        // SAFETY: allocated by `self.alloc` with `self.layout`, and no longer used.
        unsafe { self.alloc.deallocate(self.ptr.as_ptr().cast(), self.layout) };
    }
}
