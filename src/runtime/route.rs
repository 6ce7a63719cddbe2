//! Per-thread routing: a thread (or a scope) bound to a GPU or a node has its large allocations
//! placed there, through the global allocator and through every allocator value whose own target
//! is the default one.

use std::cell::Cell;
use std::marker::PhantomData;

use super::{Resolved, Runtime};
use crate::config::{GpuSelector, Target};
use crate::{cuda, process, sys};

/// Where a bound thread's large allocations go (see [`bind_thread`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Route {
    /// The host node nearest this GPU; with pinning on, blocks are registered through its
    /// context.
    Gpu(GpuSelector),
    /// This NUMA node (no GPU); a node without memory gives its nearest node with memory.
    Node(usize),
    /// The node of the CPU the thread runs on, read at each large allocation.
    LocalNode,
}

thread_local! {
    /// The calling thread's route. Const-initialised without `Drop`: readable on the allocation
    /// path, even while the thread's other locals are destroyed.
    static ROUTE: Cell<Option<Route>> = const { Cell::new(None) };
    /// The last route this thread resolved, for which runtime: a large allocation on a bound
    /// thread costs this read.
    static RESOLVED: Cell<Option<(u64, Route, Resolved)>> = const { Cell::new(None) };
}

/// Binds the calling thread to `route` until the guard drops (then the previous binding, if
/// any, is back).
///
/// # Precedence
///
/// A binding applies to allocator values whose target is the default one ([`Target::Default`],
/// `NumaGpuAlloc::new()`), `node=local` or `gpu=current`; a value built with an explicit
/// [`node`](crate::NumaGpuAlloc::node) or [`gpu`](crate::NumaGpuAlloc::gpu) target, in code or
/// through `NUMA_GPU_ALLOC`, keeps it whatever the thread's binding: what a value names
/// explicitly is never overridden from elsewhere. Unbound threads keep the value's target.
///
/// # Pinning
///
/// With pinning on, a block is registered once, `CU_MEMHOSTREGISTER_PORTABLE`, through the
/// retained primary context of the GPU it was made for: every GPU's context may use it. Freed, it
/// goes back to its node's arena (shared by every allocator value in the process) and serves any
/// later request routed to that node with the same settings (policy, pinning), whichever GPU it
/// is for.
///
/// # Example: a thread per GPU
///
/// ```
/// use numa_gpu_alloc::{bind_thread, GpuSelector, NumaGpuAlloc, Route};
///
/// #[global_allocator]
/// static ALLOC: NumaGpuAlloc = NumaGpuAlloc::new().threshold(4 << 20);
///
/// let loaders: Vec<_> = (0..2u32)
///     .map(|gpu| {
///         std::thread::spawn(move || {
///             // Every large buffer of this thread lands on the node nearest GPU `gpu` (without
///             // a driver or that GPU, on the node the allocator would choose anyway).
///             let _bound = bind_thread(Route::Gpu(GpuSelector::Ordinal(gpu)));
///             let batch = vec![gpu as u8; 8 << 20];
///             batch.iter().map(|&b| u64::from(b)).sum::<u64>()
///         })
///     })
///     .collect();
/// for loader in loaders {
///     loader.join().unwrap();
/// }
/// ```
pub fn bind_thread(route: Route) -> RouteGuard {
    RouteGuard {
        previous: ROUTE.replace(Some(route)),
        _not_send: PhantomData,
    }
}

/// Runs `f` with the calling thread bound to `route` (see [`bind_thread`]).
pub fn with_route<R>(route: Route, f: impl FnOnce() -> R) -> R {
    let _bound = bind_thread(route);
    f()
}

/// The calling thread's route, if it is bound.
pub fn thread_route() -> Option<Route> {
    ROUTE.try_with(Cell::get).ok().flatten()
}

/// Restores the thread's previous route when dropped. Not `Send`: a binding belongs to the
/// thread that made it.
///
/// ```compile_fail
/// let guard = numa_gpu_alloc::bind_thread(numa_gpu_alloc::Route::Node(0));
/// std::thread::spawn(move || drop(guard));
/// ```
#[must_use = "the binding ends when the guard drops"]
#[derive(Debug)]
pub struct RouteGuard {
    previous: Option<Route>,
    _not_send: PhantomData<*const ()>,
}

impl Drop for RouteGuard {
    fn drop(&mut self) {
        let _ = ROUTE.try_with(|route| route.set(self.previous));
    }
}

/// The node a block freed on this thread most likely lives on, to search first: the node of
/// the last route this thread resolved for `rt`, else `rt`'s own. Resolves nothing (no CUDA
/// call, no `getcpu`, no lock): a free only needs a good first guess.
pub(crate) fn likely_node(rt: &Runtime) -> usize {
    match RESOLVED.try_with(Cell::get).ok().flatten() {
        Some((id, _, resolved)) if id == rt.id => resolved.host_node,
        _ => rt.default.host_node,
    }
}

/// Where the calling thread's next block from `rt` goes: the runtime's own target, or the
/// thread's route (see [`bind_thread`] on precedence). Must be called inside the re-entrancy
/// guard (a route's first use resolves it, which allocates).
pub(crate) fn target(rt: &Runtime) -> Resolved {
    // What the value does on unbound threads: its own target, or follow the thread.
    let own = match rt.config.target {
        Target::Default => None,
        Target::LocalNode => Some(Route::LocalNode),
        Target::Gpu(GpuSelector::Current) => Some(Route::Gpu(GpuSelector::Current)),
        Target::Node(_) | Target::Gpu(_) => return rt.default,
    };
    let Some(route) = thread_route().or(own) else {
        return rt.default;
    };
    let route = match route {
        // Unknown (getcpu refused): the node chosen at initialisation.
        Route::LocalNode => match sys::current_node() {
            Ok(node) => Route::Node(node),
            Err(_) => return rt.default,
        },
        // No current context (or a forked child, which never calls CUDA): the default.
        Route::Gpu(GpuSelector::Current) if process::in_child() => return rt.default,
        Route::Gpu(GpuSelector::Current) => match cuda::current_ordinal() {
            Some(ordinal) => Route::Gpu(GpuSelector::Ordinal(ordinal)),
            None => return rt.default,
        },
        other => other,
    };
    let cached = RESOLVED.try_with(Cell::get).ok().flatten();
    if let Some((id, r, resolved)) = cached {
        if id == rt.id && r == route {
            return resolved;
        }
    }
    let resolved = rt.resolve(route);
    let _ = RESOLVED.try_with(|c| c.set(Some((rt.id, route, resolved))));
    resolved
}
