//! Streams and copies: a [`CopyPlan`] lists copies between reserved ranges of registered memory, a
//! pinned staging buffer and imported IPC mappings; [`Stream::submit`] queues them and a host
//! function after them, and returns a [`Pending`] that holds everything the copies touch until that
//! host function ran (the copies completed).

use std::any::Any;
use std::ffi::c_void;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvxfer_core::{MemKind, Reservation};

use crate::ffi::{self, CuStream, Memcpy2D, CUDA_ERROR_NOT_READY, CUDA_SUCCESS};
use crate::ipc::IpcMapping;
use crate::{Context, CudaError, PinnedBuffer};

/// Most rows one 2-D copy call moves (larger shapes are cut; the driver documents no limit, this
/// stays far from any).
const MAX_ROWS: u64 = 1 << 15;

/// How long a dropped, unfinished [`Pending`] waits in the background before it gives up on its
/// copies and leaks what they touch (never frees memory a copy may still use).
const REAP_AFTER: Duration = Duration::from_secs(300);

/// A CUDA stream of this process (non-blocking: it does not wait for the legacy default stream),
/// destroyed on drop (queued work still completes).
pub struct Stream {
    ctx: Arc<Context>,
    raw: CuStream,
}

// SAFETY: a CUstream may be used from any thread with its context current (`enter` makes it so).
unsafe impl Send for Stream {}
// SAFETY: as above; queueing from several threads is thread-safe in the driver.
unsafe impl Sync for Stream {}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream(device {}, {:p})", self.ctx.device(), self.raw)
    }
}

impl Stream {
    /// A new stream on the context's device.
    pub fn new(ctx: &Arc<Context>) -> Result<Self, CudaError> {
        let d = ctx.enter()?;
        let mut raw: CuStream = std::ptr::null_mut();
        // SAFETY: FFI writing one handle we own.
        let r = unsafe { (d.api().stream_create)(&mut raw, ffi::CU_STREAM_NON_BLOCKING) };
        d.check(r, "cuStreamCreate", || format!("; device {}", ctx.device()))?;
        Ok(Self { ctx: Arc::clone(ctx), raw })
    }

    /// The device.
    pub fn device(&self) -> u32 {
        self.ctx.device()
    }

    /// The context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    #[cfg(all(test, feature = "emulation"))]
    pub(crate) fn raw_for_tests(&self) -> CuStream {
        self.raw
    }

    /// Queues the plan's copies, in order, then a host function that signals their completion.
    /// The returned [`Pending`] holds every reservation, mapping and buffer of the plan until then.
    /// An error means nothing of the plan is known to have been queued completely: the plan's
    /// holdings are kept until the stream drained what was queued (waited for in the background).
    pub fn submit(&self, plan: CopyPlan) -> Result<Pending, CudaError> {
        let what = format!("{} copies ({} bytes) on device {}", plan.ops.len(), plan.bytes, self.ctx.device());
        let d = self.ctx.enter()?;
        let signal = Arc::new(Signal::default());
        let mut pending = Pending { signal: Arc::clone(&signal), keep: Some(plan.keep), what, queued: false };
        let by_kernel = self.submit_kernel(d, &plan.ops);
        for op in plan.ops.iter().filter(|_| !by_kernel) {
            let mut rows = 0;
            while rows < op.height {
                let h = (op.height - rows).min(MAX_ROWS);
                let (src, dst) = (op.src + rows * op.src_pitch, op.dst + rows * op.dst_pitch);
                let r = if h == 1 || (op.src_pitch == op.width && op.dst_pitch == op.width) {
                    // SAFETY: FFI on addresses the plan holds valid until the copy completed
                    // (reservations of registered memory, its pinned buffer, imported mappings),
                    // each checked against its holder's bounds when the plan was built.
                    unsafe { (d.api().memcpy_async)(dst, src, (op.width * h) as usize, self.raw) }
                } else {
                    let p = op.memcpy_2d(src, dst, h);
                    // SAFETY: as above; the descriptor lives across the call (the driver reads it
                    // while queueing).
                    unsafe { (d.api().memcpy_2d_async)(&p, self.raw) }
                };
                if r != CUDA_SUCCESS {
                    let e = d.error(r, if h == 1 { "cuMemcpyAsync" } else { "cuMemcpy2DAsync" }, format!("; {op:?}"));
                    // What was queued may still run: hold the plan until the stream drained it.
                    pending.fence(self);
                    return Err(e);
                }
                rows += h;
            }
        }
        let user = Arc::into_raw(Arc::clone(&signal)) as *mut c_void;
        // SAFETY: FFI queueing `on_host` with a strong reference to the signal, which `on_host`
        // takes back exactly once when the driver runs it.
        let r = unsafe { (d.api().launch_host_func)(self.raw, on_host, user) };
        if r != CUDA_SUCCESS {
            // SAFETY: not queued: the reference made above is ours to take back.
            drop(unsafe { Arc::from_raw(user as *const Signal) });
            pending.fence(self);
            return Err(d.error(r, "cuLaunchHostFunc", format!("; after {}", pending.what)));
        }
        pending.queued = true;
        Ok(pending)
    }

    /// Queues the plan's copies as one launch of the copy kernel ([`crate::kernel`]) when every copy
    /// is device to device, the kernel is available, and the plan is more than a few plain copies.
    /// `false`: nothing was queued that copies (the caller queues one driver call per copy).
    fn submit_kernel(&self, d: &crate::Driver, ops: &[Op]) -> bool {
        let worth = ops.len() > 4 || ops.iter().any(|o| o.height > 1);
        if !worth || ops.iter().any(|o| o.src_host || o.dst_host) {
            return false;
        }
        let (Some(k), Some(f)) = (d.kernels(), self.ctx.copy_kernel()) else { return false };
        let mut descs: Vec<crate::kernel::Desc> = Vec::with_capacity(ops.len());
        for o in ops {
            crate::kernel::push_descs(&mut descs, o.src, o.dst, o.width, o.height, o.src_pitch, o.dst_pitch);
        }
        if descs.is_empty() || descs.len() > u32::MAX as usize {
            return false;
        }
        let bytes = std::mem::size_of_val(descs.as_slice());
        let mut table: ffi::CuDevicePtr = 0;
        // SAFETY: FFI writing one device pointer we own; stream-ordered on our stream.
        let r = unsafe { (k.mem_alloc_async)(&mut table, bytes, self.raw) };
        if r != CUDA_SUCCESS {
            tracing::debug!(code = r, bytes, "cuMemAllocAsync for the copy table failed; one call per copy");
            return false;
        }
        // SAFETY: FFI reading `bytes` of our table (the driver stages a pageable source before it
        // returns) into the allocation just made, in stream order.
        let r = unsafe { (k.memcpy_htod_async)(table, descs.as_ptr() as *const c_void, bytes, self.raw) };
        let launched = r == CUDA_SUCCESS && {
            let (mut p_table, mut p_n) = (table, descs.len() as u32);
            let mut params = [&mut p_table as *mut u64 as *mut c_void, &mut p_n as *mut u32 as *mut c_void];
            let b = crate::kernel::BLOCK;
            // SAFETY: FFI launching the module's kernel with its two parameters (read during the call),
            // on our stream, after the table's copy; the copies it makes are the plan's (every
            // address checked against its holder when the plan was built, held until completion).
            let r = unsafe {
                (k.launch_kernel)(
                    f.raw(),
                    crate::kernel::grid(descs.len()),
                    1,
                    1,
                    b,
                    1,
                    1,
                    0,
                    self.raw,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            if r != CUDA_SUCCESS {
                tracing::warn!(code = r, "launching the copy kernel failed; one call per copy");
            }
            r == CUDA_SUCCESS
        };
        // SAFETY: FFI freeing, in stream order after the launch (or the failed copy), the table we
        // allocated.
        let r = unsafe { (k.mem_free_async)(table, self.raw) };
        if r != CUDA_SUCCESS {
            tracing::warn!(code = r, bytes, "cuMemFreeAsync of the copy table failed (leaked)");
        }
        launched
    }

    /// Makes every later copy on this stream wait for `event` (its most recent record), without
    /// blocking the host: no byte is read before the work recorded in the event completed.
    pub fn wait_event(&self, event: &Event) -> Result<(), CudaError> {
        let d = self.ctx.enter()?;
        // SAFETY: FFI with our stream and a live event (borrowed for the call).
        let r = unsafe { (d.api().stream_wait_event)(self.raw, event.raw, 0) };
        d.check(r, "cuStreamWaitEvent", || format!("; device {}", self.ctx.device()))
    }

    /// The raw `CUstream` (what an engine hands a [`kvxfer_core::CudaHandle`] for).
    pub fn raw(&self) -> u64 {
        self.raw as u64
    }

    /// Blocks until everything queued on the stream completed (for tests and teardown).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        let d = self.ctx.enter()?;
        // SAFETY: FFI with our stream.
        let r = unsafe { (d.api().stream_synchronize)(self.raw) };
        d.check(r, "cuStreamSynchronize", || format!("; device {}", self.ctx.device()))
    }

    /// `Ok` unless the stream reports an error of its queued work (`CUDA_ERROR_NOT_READY`, still
    /// running, is not an error).
    fn status(&self) -> Result<(), CudaError> {
        let d = self.ctx.enter()?;
        // SAFETY: FFI with our stream.
        let r = unsafe { (d.api().stream_query)(self.raw) };
        if r == CUDA_ERROR_NOT_READY {
            return Ok(());
        }
        d.check(r, "cuStreamQuery", || format!("; copies on device {}", self.ctx.device()))
    }
}

/// The raw handle of one of our streams (for the crate's own FFI).
pub(crate) fn raw_stream(s: &Stream) -> CuStream {
    s.raw
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Ok(d) = self.ctx.enter() {
            // SAFETY: FFI destroying our stream once; queued work completes first (driver contract).
            let r = unsafe { (d.api().stream_destroy)(self.raw) };
            if r != CUDA_SUCCESS {
                tracing::warn!(code = r, "cuStreamDestroy failed");
            }
        }
    }
}

/// A CUDA event of this process (timing disabled), destroyed on drop.
pub struct Event {
    ctx: Arc<Context>,
    raw: ffi::CuEvent,
}

// SAFETY: as for Stream.
unsafe impl Send for Event {}
// SAFETY: as for Stream.
unsafe impl Sync for Event {}

impl Event {
    /// A new event on the context.
    pub fn new(ctx: &Arc<Context>) -> Result<Self, CudaError> {
        let d = ctx.enter()?;
        let mut raw: ffi::CuEvent = std::ptr::null_mut();
        // SAFETY: FFI writing one handle we own.
        let r = unsafe { (d.api().event_create)(&mut raw, ffi::CU_EVENT_DISABLE_TIMING) };
        d.check(r, "cuEventCreate", || format!("; device {}", ctx.device()))?;
        Ok(Self { ctx: Arc::clone(ctx), raw })
    }

    /// Records the event after the work queued on `stream` so far.
    pub fn record(&self, stream: &Stream) -> Result<(), CudaError> {
        let d = self.ctx.enter()?;
        // SAFETY: FFI with our event and stream.
        let r = unsafe { (d.api().event_record)(self.raw, stream.raw) };
        d.check(r, "cuEventRecord", String::new)
    }

    /// The raw `CUevent` (what an engine hands a [`kvxfer_core::CudaHandle`] for).
    pub fn raw(&self) -> u64 {
        self.raw as u64
    }

    /// Records the event after the work queued so far on the engine's stream `raw` (a
    /// [`kvxfer_core::CudaHandle`]'s value, whose contract makes it live during the call).
    pub(crate) fn record_raw(&self, raw: u64) -> Result<(), CudaError> {
        let d = self.ctx.enter()?;
        // SAFETY: FFI with our event and a stream the caller vouches for (`CudaHandle::from_raw`).
        let r = unsafe { (d.api().event_record)(self.raw, raw as CuStream) };
        d.check(r, "cuEventRecord", || format!("; on the send's CUDA stream {raw:#x}"))
    }

    /// Whether the recorded work completed.
    pub fn is_done(&self) -> Result<bool, CudaError> {
        let d = self.ctx.enter()?;
        // SAFETY: FFI with our event.
        let r = unsafe { (d.api().event_query)(self.raw) };
        if r == CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        d.check(r, "cuEventQuery", String::new).map(|()| true)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Ok(d) = self.ctx.enter() {
            // SAFETY: FFI destroying our event once.
            unsafe { (d.api().event_destroy)(self.raw) };
        }
    }
}

#[derive(Default)]
struct Signal {
    done: Mutex<bool>,
    cv: Condvar,
    wake: tokio::sync::Notify,
}

impl Signal {
    fn set(&self) {
        *self.done.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.cv.notify_all();
        self.wake.notify_waiters();
    }

    fn is_set(&self) -> bool {
        *self.done.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Blocks until set or `deadline`; whether it was set.
    fn wait_blocking(&self, deadline: Instant) -> bool {
        let mut g = self.done.lock().unwrap_or_else(|p| p.into_inner());
        while !*g {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            g = self.cv.wait_timeout(g, left).unwrap_or_else(|p| p.into_inner()).0;
        }
        true
    }
}

/// The host function queued after a plan's copies: marks them complete.
unsafe extern "C" fn on_host(user: *mut c_void) {
    // SAFETY: `user` is the strong reference `Stream::submit` made with `Arc::into_raw` for this
    // one call; the driver calls a queued host function exactly once.
    let s = unsafe { Arc::from_raw(user as *const Signal) };
    // No panic may cross into the driver's thread.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.set()));
}

/// What a plan holds until its copies completed.
#[derive(Default)]
struct Keep {
    reservations: Vec<Reservation>,
    mappings: Vec<Arc<IpcMapping>>,
    pinned: Option<PinnedBuffer>,
    other: Vec<Box<dyn Any + Send + Sync>>,
}

/// Copies queued on a stream. Await [`Pending::wait`], then take the plan's pinned buffer back
/// with [`Pending::finish`]. Dropped before its copies completed, it hands what they touch to a
/// background thread that releases it once they did (or leaks it, should they never complete).
pub struct Pending {
    signal: Arc<Signal>,
    keep: Option<Keep>,
    what: String,
    queued: bool,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pending({}, done: {})", self.what, self.is_done())
    }
}

/// What a completed plan gives back.
#[derive(Debug)]
pub struct Done {
    /// The plan's pinned buffer, if it had one.
    pub pinned: Option<PinnedBuffer>,
}

impl Pending {
    /// Whether the copies completed.
    pub fn is_done(&self) -> bool {
        self.queued && self.signal.is_set()
    }

    /// Waits until the copies completed, or `deadline` ([`CudaError::Timeout`]). `stream` is the
    /// stream they were queued on: its error state is checked once they completed.
    pub async fn wait(&self, stream: &Stream, deadline: Instant) -> Result<(), CudaError> {
        if tokio::runtime::Handle::try_current().is_err() {
            // No runtime (a caller driving the future with a plain executor): no timers either.
            return self.wait_blocking(stream, deadline);
        }
        loop {
            let mut woken = std::pin::pin!(self.signal.wake.notified());
            woken.as_mut().enable();
            if self.is_done() {
                return stream.status();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if tokio::time::timeout(left, woken).await.is_err() {
                return Err(CudaError::Timeout { what: self.what.clone(), after: left });
            }
        }
    }

    /// Blocks until the copies completed, or `deadline` (for callers without a runtime).
    pub fn wait_blocking(&self, stream: &Stream, deadline: Instant) -> Result<(), CudaError> {
        if !self.queued || !self.signal.wait_blocking(deadline) {
            return Err(CudaError::Timeout {
                what: self.what.clone(),
                after: deadline.saturating_duration_since(Instant::now()),
            });
        }
        stream.status()
    }

    /// Releases the plan's holdings and gives its pinned buffer back, once the copies completed
    /// (`Err(self)` before).
    pub fn finish(mut self) -> Result<Done, Box<Pending>> {
        if !self.is_done() {
            return Err(Box::new(self));
        }
        let keep = self.keep.take().unwrap_or_default();
        Ok(Done { pinned: keep.pinned })
    }

    /// After a failed submit: waits (blocking, an error path) until the stream ran what was
    /// queued, then releases the holdings.
    fn fence(&mut self, stream: &Stream) {
        self.queued = false;
        if let Err(e) = stream.synchronize() {
            tracing::warn!(error = %e, what = %self.what, "draining a stream after a failed submit");
        }
        drop(self.keep.take());
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let Some(keep) = self.keep.take() else { return };
        if self.is_done() || !self.queued {
            return drop(keep);
        }
        let (signal, what) = (Arc::clone(&self.signal), self.what.clone());
        std::thread::spawn(move || {
            if signal.wait_blocking(Instant::now() + REAP_AFTER) {
                drop(keep);
            } else {
                tracing::error!(%what, "copies did not complete in {REAP_AFTER:?}; leaking what they touch");
                std::mem::forget(keep);
            }
        });
    }
}

/// Which part of a reservation a copy covers: `count` rows of `len` bytes, `stride` apart, from
/// `offset` (relative to the reservation's first byte).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Offset of the first row from the reservation's start.
    pub offset: u64,
    /// Bytes per row.
    pub len: u64,
    /// Rows.
    pub count: u64,
    /// Distance between row starts.
    pub stride: u64,
}

impl Shape {
    /// The whole reservation, row for row.
    pub fn of(r: &Reservation) -> Self {
        Shape { offset: 0, len: r.len(), count: r.count(), stride: r.stride() }
    }

    /// `len` contiguous bytes at `offset`.
    pub fn contiguous(offset: u64, len: u64) -> Self {
        Shape { offset, len, count: 1, stride: len }
    }

    fn bytes(&self) -> u64 {
        self.len * self.count
    }
}

/// One row copy (or `height` of them): addresses and pitches, with the memory type of each side.
#[derive(Debug, Clone, Copy)]
struct Op {
    dst: u64,
    dst_host: bool,
    dst_pitch: u64,
    src: u64,
    src_host: bool,
    src_pitch: u64,
    width: u64,
    height: u64,
}

impl Op {
    fn memcpy_2d(&self, src: u64, dst: u64, height: u64) -> Memcpy2D {
        let ty = |host: bool| if host { ffi::CU_MEMORYTYPE_HOST } else { ffi::CU_MEMORYTYPE_DEVICE };
        Memcpy2D {
            src_x_in_bytes: 0,
            src_y: 0,
            src_memory_type: ty(self.src_host),
            src_host: if self.src_host { src as *const c_void } else { std::ptr::null() },
            src_device: if self.src_host { 0 } else { src },
            src_array: std::ptr::null_mut(),
            src_pitch: self.src_pitch as usize,
            dst_x_in_bytes: 0,
            dst_y: 0,
            dst_memory_type: ty(self.dst_host),
            dst_host: if self.dst_host { dst as *mut c_void } else { std::ptr::null_mut() },
            dst_device: if self.dst_host { 0 } else { dst },
            dst_array: std::ptr::null_mut(),
            dst_pitch: self.dst_pitch as usize,
            width_in_bytes: self.width as usize,
            height: height as usize,
        }
    }
}

/// A side of a copy: a start address, row pitch and whether it is host memory.
#[derive(Debug, Clone, Copy)]
struct Side {
    addr: u64,
    pitch: u64,
    host: bool,
}

/// Copies to queue together, and everything they touch (see the module docs). Build it, then
/// [`Stream::submit`] it.
#[derive(Default)]
pub struct CopyPlan {
    ops: Vec<Op>,
    keep: Keep,
    bytes: u64,
}

impl std::fmt::Debug for CopyPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CopyPlan({} copies, {} bytes)", self.ops.len(), self.bytes)
    }
}

impl CopyPlan {
    /// An empty plan.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty plan that holds `pinned` (its staging slot) and gives it back through [`Done`].
    pub fn with_pinned(pinned: PinnedBuffer) -> Self {
        Self { keep: Keep { pinned: Some(pinned), ..Keep::default() }, ..Self::default() }
    }

    /// Bytes the plan copies.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether the plan copies nothing.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Holds `t` until the copies completed (e.g. the region handles a close waits for).
    pub fn keep<T: Send + Sync + 'static>(&mut self, t: T) {
        self.keep.other.push(Box::new(t));
    }

    /// The side of `r` that `shape` covers, checked: inside the reservation (for a strided
    /// reservation, exactly its own rows), written only through a write reservation, memory a copy
    /// engine can reach.
    fn side(r: &Reservation, shape: Shape, write: bool) -> Result<Side, CudaError> {
        if write && !r.is_write() {
            return Err(CudaError::invalid(format!("a copy would write through a read reservation ({r:?})")));
        }
        let host = match r.kind() {
            MemKind::Host => true,
            MemKind::Cuda { .. } => false,
            other => return Err(CudaError::invalid(format!("{other} cannot be copied by the CUDA copy engine"))),
        };
        let inside = if r.count() == 1 {
            let extent = shape
                .count
                .checked_sub(1)
                .and_then(|c| c.checked_mul(shape.stride))
                .and_then(|x| x.checked_add(shape.offset))
                .and_then(|x| x.checked_add(shape.len));
            shape.count >= 1 && extent.is_some_and(|e| e <= r.len()) && (shape.count == 1 || shape.stride >= shape.len)
        } else {
            shape == Shape::of(r)
        };
        if !inside {
            return Err(CudaError::invalid(format!("copy rows {shape:?} reach outside {r:?}")));
        }
        Ok(Side { addr: r.addr() + shape.offset, pitch: shape.stride, host })
    }

    fn push(&mut self, dst: Side, src: Side, len: u64, count: u64) {
        if len == 0 || count == 0 {
            return;
        }
        self.bytes += len * count;
        self.ops.push(Op {
            dst: dst.addr,
            dst_host: dst.host,
            dst_pitch: if count == 1 { len } else { dst.pitch },
            src: src.addr,
            src_host: src.host,
            src_pitch: if count == 1 { len } else { src.pitch },
            width: len,
            height: count,
        });
    }

    fn slot(&self, offset: u64, bytes: u64) -> Result<Side, CudaError> {
        let p = self
            .keep
            .pinned
            .as_ref()
            .ok_or_else(|| CudaError::invalid("a staging copy in a plan without a pinned buffer"))?;
        if !offset.checked_add(bytes).is_some_and(|e| e <= p.len() as u64) {
            return Err(CudaError::invalid(format!(
                "{bytes} bytes at offset {offset} of a {}-byte staging buffer",
                p.len()
            )));
        }
        Ok(Side { addr: p.addr() + offset, pitch: 0, host: true })
    }

    /// Copies the rows `shape` of `src` (device or host memory) into the pinned buffer at
    /// `offset`, packed (row after row). The plan holds `src` until the copy completed.
    pub fn to_pinned(&mut self, src: Reservation, shape: Shape, offset: u64) -> Result<(), CudaError> {
        let s = Self::side(&src, shape, false)?;
        let mut d = self.slot(offset, shape.bytes())?;
        d.pitch = shape.len;
        self.push(d, s, shape.len, shape.count);
        self.keep.reservations.push(src);
        Ok(())
    }

    /// Copies packed rows from the pinned buffer at `offset` into the rows `shape` of `dst` (a
    /// write reservation). The plan holds `dst` until the copy completed.
    pub fn from_pinned(&mut self, offset: u64, dst: Reservation, shape: Shape) -> Result<(), CudaError> {
        let d = Self::side(&dst, shape, true)?;
        let mut s = self.slot(offset, shape.bytes())?;
        s.pitch = shape.len;
        self.push(d, s, shape.len, shape.count);
        self.keep.reservations.push(dst);
        Ok(())
    }

    /// Copies the rows `src_shape` of `src` into the rows `dst_shape` of `dst` (same row length
    /// and count). Either side may be host or device memory.
    pub fn copy(
        &mut self,
        src: Reservation,
        src_shape: Shape,
        dst: Reservation,
        dst_shape: Shape,
    ) -> Result<(), CudaError> {
        if (src_shape.len, src_shape.count) != (dst_shape.len, dst_shape.count) {
            return Err(CudaError::invalid(format!("copy between different shapes: {src_shape:?} -> {dst_shape:?}")));
        }
        let s = Self::side(&src, src_shape, false)?;
        let d = Self::side(&dst, dst_shape, true)?;
        self.push(d, s, src_shape.len, src_shape.count);
        self.keep.reservations.push(src);
        self.keep.reservations.push(dst);
        Ok(())
    }

    /// Copies `len` bytes at `offset` of `src` into the write reservation `dst` without reserving
    /// `src`: a snapshot that may race the backend's own copies into it (the device mirror's read of
    /// memory a transfer may be writing; the host side is never raced). The plan keeps `src` alive.
    #[cfg(feature = "mirror")]
    pub(crate) fn snapshot(
        &mut self,
        src: &kvxfer_core::MemDesc,
        offset: u64,
        len: u64,
        dst: Reservation,
    ) -> Result<(), CudaError> {
        let host = match src.kind() {
            MemKind::Host => true,
            MemKind::Cuda { .. } => false,
            other => return Err(CudaError::invalid(format!("{other} cannot be copied by the CUDA copy engine"))),
        };
        if !offset.checked_add(len).is_some_and(|e| e <= src.len() as u64) {
            return Err(CudaError::invalid(format!("a snapshot of {len} bytes at {offset} of {src:?}")));
        }
        let d = Self::side(&dst, Shape::contiguous(0, len), true)?;
        self.push(d, Side { addr: src.addr() as u64 + offset, pitch: len, host }, len, 1);
        self.keep.reservations.push(dst);
        self.keep(src.clone());
        Ok(())
    }

    /// Copies the rows `shape` of `src` into an imported IPC mapping: rows of the same length,
    /// `dst_stride` apart, from `dst_offset` of the mapping. The plan holds both until the copy
    /// completed.
    pub fn to_mapping(
        &mut self,
        src: Reservation,
        shape: Shape,
        dst: &Arc<IpcMapping>,
        dst_offset: u64,
        dst_stride: u64,
    ) -> Result<(), CudaError> {
        let s = Self::side(&src, shape, false)?;
        let end = shape
            .count
            .checked_sub(1)
            .and_then(|c| c.checked_mul(dst_stride))
            .and_then(|x| x.checked_add(dst_offset))
            .and_then(|x| x.checked_add(shape.len));
        if shape.count == 0 || !end.is_some_and(|e| e <= dst.len()) || (shape.count > 1 && dst_stride < shape.len) {
            return Err(CudaError::invalid(format!(
                "{} rows of {} bytes {dst_stride} apart at offset {dst_offset} do not fit the {}-byte mapping",
                shape.count,
                shape.len,
                dst.len()
            )));
        }
        let d = Side { addr: dst.addr() + dst_offset, pitch: dst_stride, host: false };
        self.push(d, s, shape.len, shape.count);
        self.keep.reservations.push(src);
        if !self.keep.mappings.iter().any(|m| Arc::ptr_eq(m, dst)) {
            self.keep.mappings.push(Arc::clone(dst));
        }
        Ok(())
    }
}
