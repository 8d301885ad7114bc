//! The safe wrapper over the UCP C API: the only module of this crate with `unsafe` code.
//!
//! Why `unsafe` is allowed here: UCX is a C library; every call crosses FFI. Each handle is owned by
//! one Rust type whose `Drop` releases it, and children keep their parents alive through `Rc`, so
//! the release order is always right: remote keys before their endpoint, endpoints before their
//! worker, memory handles and workers before the context. All of these types are `!Send` (they hold
//! `Rc`s): they live on the one progress thread that owns the worker, which is how a
//! `UCS_THREAD_MODE_SINGLE` worker must be used. Callbacks never unwind into C (`catch_unwind`).
#![allow(unsafe_code)]

use std::ffi::{c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::sync::mpsc;

use kvxfer_core::{MemDesc, MemKind};
use kvxfer_ucx_sys as sys;
use sys::zeroed;

/// A UCX status code (`ucs_status_t`, a signed byte; 0 is `UCS_OK`, negative values are errors).
pub(crate) type Status = sys::ucs_status_t;

/// A failed UCX call: which one and its status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct UcxError {
    /// The C function.
    pub call: &'static str,
    /// Its status.
    pub status: Status,
}

impl UcxError {
    /// UCX's own text for the status.
    pub fn text(&self) -> String {
        status_text(self.status)
    }
}

/// UCX's text for a status (`ucs_status_string`).
pub(crate) fn status_text(status: Status) -> String {
    // SAFETY: ucs_status_string returns a pointer to a static NUL-terminated string for every value
    // (unknown values map to a generic text); it is never freed.
    let p = unsafe { sys::ucs_status_string(status) };
    if p.is_null() {
        return format!("status {status}");
    }
    // SAFETY: non-null, NUL-terminated, static (see above).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn check(call: &'static str, status: Status) -> Result<(), UcxError> {
    if status == sys::UCS_OK as Status {
        Ok(())
    } else {
        Err(UcxError { call, status })
    }
}

/// The UCX library version string.
pub(crate) fn version() -> String {
    // SAFETY: returns a static NUL-terminated string.
    let p = unsafe { sys::ucp_get_version_string() };
    if p.is_null() {
        return "unknown".into();
    }
    // SAFETY: as above.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// A read UCX configuration (`ucp_config_t`), released on drop.
struct Config {
    raw: *mut sys::ucp_config_t,
}

impl Config {
    fn read() -> Result<Self, UcxError> {
        let mut raw = ptr::null_mut();
        // SAFETY: NULL env prefix and filename are allowed (defaults); `raw` receives the config.
        check("ucp_config_read", unsafe { sys::ucp_config_read(ptr::null(), ptr::null(), &mut raw) })?;
        Ok(Self { raw })
    }

    fn modify(&mut self, name: &str, value: &str) -> Result<(), UcxError> {
        let n = CString::new(name)
            .map_err(|_| UcxError { call: "ucp_config_modify", status: sys::UCS_ERR_INVALID_PARAM as Status })?;
        let v = CString::new(value)
            .map_err(|_| UcxError { call: "ucp_config_modify", status: sys::UCS_ERR_INVALID_PARAM as Status })?;
        // SAFETY: `raw` is a live config; both strings are NUL-terminated and outlive the call
        // (UCX copies the value).
        check("ucp_config_modify", unsafe { sys::ucp_config_modify(self.raw, n.as_ptr(), v.as_ptr()) })
    }
}

impl Drop for Config {
    fn drop(&mut self) {
        // SAFETY: `raw` came from ucp_config_read and is released once.
        unsafe { sys::ucp_config_release(self.raw) }
    }
}

/// A UCP context (`ucp_context_h`), cleaned up on drop after everything that holds it.
pub(crate) struct Context {
    raw: sys::ucp_context_h,
}

impl Context {
    /// Creates a context with the RMA and AM features (and the wakeup feature with `wakeup`) and
    /// the given UCX configuration overrides (e.g. `("TLS", "tcp")`). Wakeup lets the progress
    /// thread sleep on the worker's event descriptor ([`Worker::event_fd`]) when idle.
    pub fn new(settings: &[(String, String)], wakeup: bool) -> Result<Rc<Self>, UcxError> {
        let mut config = Config::read()?;
        for (k, v) in settings {
            config.modify(k, v)?;
        }
        let mut params: sys::ucp_params_t = zeroed();
        params.field_mask = (sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_NAME) as u64;
        let mut features = sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_AM;
        if wakeup {
            features |= sys::UCP_FEATURE_WAKEUP;
        }
        params.features = features as u64;
        let name = c"kvxfer";
        params.name = name.as_ptr();
        let mut raw = ptr::null_mut();
        // SAFETY: params is fully initialised for the fields named in field_mask; the config is live
        // for the call; `raw` receives the context. ucp_init is a header-inline wrapper of this.
        check("ucp_init", unsafe {
            sys::ucp_init_version(sys::UCP_API_MAJOR, sys::UCP_API_MINOR, &params, config.raw, &mut raw)
        })?;
        Ok(Rc::new(Self { raw }))
    }
}

impl Context {
    /// Whether the context can register CUDA device memory (`ucp_context_query`, memory types).
    /// Debian's UCX is built without CUDA, so this is normally false.
    pub fn supports_cuda(&self) -> bool {
        let mut attr: sys::ucp_context_attr_t = zeroed();
        attr.field_mask = sys::UCP_ATTR_FIELD_MEMORY_TYPES as u64;
        // SAFETY: the context is live; attr is a zeroed struct with the queried field named.
        let r = check("ucp_context_query", unsafe { sys::ucp_context_query(self.raw, &mut attr) });
        r.is_ok() && attr.memory_types & (1u64 << sys::UCS_MEMORY_TYPE_CUDA) != 0
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every worker and memory handle holds an Rc to this context, so none is left.
        unsafe { sys::ucp_cleanup(self.raw) }
    }
}

/// An active message as received: its header (copied) and its data.
pub(crate) struct AmMessage {
    /// The user header.
    pub header: Vec<u8>,
    /// The payload.
    pub data: AmData,
}

/// Payloads at least this large are kept in UCX's own buffer until handled (no copy out of it).
const HOLD_MIN: usize = 64 << 10;

/// The payload of a received active message: copied out of UCX's buffers (small messages), or
/// UCX's own buffer (`UCP_AM_RECV_ATTR_FLAG_DATA`), released with `ucp_am_data_release` when this
/// value drops; it keeps the worker alive until then.
pub(crate) struct AmData(DataInner);

enum DataInner {
    Owned(Vec<u8>),
    Held { ptr: *mut c_void, len: usize, worker: Rc<Worker> },
}

impl std::ops::Deref for AmData {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match &self.0 {
            DataInner::Owned(v) => v,
            // SAFETY: UCX handed us `len` readable bytes at `ptr` and keeps them until the release
            // in Drop (the callback returned UCS_INPROGRESS for them); the worker is alive (held).
            DataInner::Held { ptr, len, .. } => unsafe { std::slice::from_raw_parts(*ptr as *const u8, *len) },
        }
    }
}

impl Drop for AmData {
    fn drop(&mut self) {
        if let DataInner::Held { ptr, worker, .. } = &self.0 {
            // SAFETY: `ptr` is data UCX let us keep (returned INPROGRESS for), released once, on
            // the worker's own thread (AmData is !Send), while the worker is alive (held).
            unsafe { sys::ucp_am_data_release(worker.raw, *ptr) }
        }
    }
}

/// What a callback queues: an [`Event`] whose held data is still a bare pointer.
enum RawEvent {
    Message { header: Vec<u8>, data: RawData },
    EpError(u64, Status),
    DroppedRndv,
}

enum RawData {
    Owned(Vec<u8>),
    /// UCX's buffer, kept by returning `UCS_INPROGRESS` from the callback.
    Held(*mut c_void, usize),
}

/// What callbacks running inside `ucp_worker_progress` leave for the progress loop. They go
/// through a channel, so a callback never finds its queue borrowed and never drops anything.
pub(crate) enum Event {
    /// An active message.
    Message(AmMessage),
    /// An endpoint failed: (endpoint token, status).
    EpError(u64, Status),
    /// A message that UCX offered as rendezvous (kvxfer peers send eager: a protocol error).
    DroppedRndv,
}

/// The active message id kvxfer uses (one id; the first header byte says what the message is).
pub(crate) const AM_ID: u32 = 0x6b76;

/// `UCS_ERR_UNREACHABLE`: no transport can reach the peer (with the requested error mode).
pub(crate) const ERR_UNREACHABLE: Status = sys::UCS_ERR_UNREACHABLE as Status;

/// A UCP worker (`ucp_worker_h`) in single-thread mode, destroyed on drop.
pub(crate) struct Worker {
    raw: sys::ucp_worker_h,
    waker: Arc<Waker>,
    sink: Box<mpsc::Sender<RawEvent>>,
    inbox: mpsc::Receiver<RawEvent>,
    _ctx: Rc<Context>,
}

/// Hands an event from a callback to the progress loop; false when it could not be queued.
fn deliver(sink: *const mpsc::Sender<RawEvent>, e: RawEvent) -> bool {
    // SAFETY: `sink` is the worker's boxed sender, which outlives every callback (it is dropped after
    // ucp_worker_destroy); callbacks run on the progress thread.
    let sink = unsafe { &*sink };
    if sink.send(e).is_err() {
        // Only when the receiver is gone, i.e. while the worker itself is being destroyed.
        tracing::warn!("ucx: an event arrived while the worker was being destroyed");
        return false;
    }
    true
}

unsafe extern "C" fn am_recv_cb(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> Status {
    let r = catch_unwind(AssertUnwindSafe(|| {
        let sink = arg as *const mpsc::Sender<RawEvent>;
        // SAFETY: param is valid for the duration of the callback per the UCP API.
        let attr = if param.is_null() { 0 } else { unsafe { (*param).recv_attr } };
        if attr & sys::UCP_AM_RECV_ATTR_FLAG_RNDV as u64 != 0 {
            // Returning UCS_OK without receiving drops the rendezvous data; the loop logs it.
            deliver(sink, RawEvent::DroppedRndv);
            return false;
        }
        let copy = |p: *const c_void, n: usize| -> Vec<u8> {
            if p.is_null() || n == 0 {
                Vec::new()
            } else {
                // SAFETY: UCX hands us `n` readable bytes at `p` for the duration of the callback.
                unsafe { std::slice::from_raw_parts(p as *const u8, n) }.to_vec()
            }
        };
        // A large payload UCX lets us keep stays in its buffer (no copy); the loop releases it.
        let hold = attr & sys::UCP_AM_RECV_ATTR_FLAG_DATA as u64 != 0 && !data.is_null() && length >= HOLD_MIN;
        let body = if hold { RawData::Held(data, length) } else { RawData::Owned(copy(data, length)) };
        deliver(sink, RawEvent::Message { header: copy(header, header_length), data: body }) && hold
    }));
    match r {
        // UCS_INPROGRESS keeps the data until ucp_am_data_release (when the AmData drops).
        Ok(true) => sys::UCS_INPROGRESS as Status,
        Ok(false) => sys::UCS_OK as Status,
        Err(_) => {
            tracing::error!("ucx: the active-message handler panicked; the message is lost");
            sys::UCS_OK as Status
        }
    }
}

impl Worker {
    /// Creates a single-threaded worker and installs kvxfer's active-message handler.
    pub fn new(ctx: &Rc<Context>) -> Result<Rc<Self>, UcxError> {
        let mut params: sys::ucp_worker_params_t = zeroed();
        params.field_mask = sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64;
        params.thread_mode = sys::UCS_THREAD_MODE_SINGLE;
        let mut raw = ptr::null_mut();
        // SAFETY: ctx is live; params initialised for the named field; raw receives the worker.
        check("ucp_worker_create", unsafe { sys::ucp_worker_create(ctx.raw, &params, &mut raw) })?;
        let (tx, inbox) = mpsc::channel();
        let waker = Arc::new(Waker(std::sync::Mutex::new(Some(SignalTarget(raw)))));
        let worker = Rc::new(Self { raw, waker, sink: Box::new(tx), inbox, _ctx: ctx.clone() });
        let mut hp: sys::ucp_am_handler_param_t = zeroed();
        hp.field_mask = (sys::UCP_AM_HANDLER_PARAM_FIELD_ID
            | sys::UCP_AM_HANDLER_PARAM_FIELD_FLAGS
            | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
            | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG) as u64;
        hp.id = AM_ID;
        hp.flags = sys::UCP_AM_FLAG_WHOLE_MSG;
        hp.cb = Some(am_recv_cb);
        hp.arg = worker.error_sink() as *mut c_void;
        // SAFETY: the worker is live; the arg (boxed sender) lives as long as the worker.
        check("ucp_worker_set_am_recv_handler", unsafe { sys::ucp_worker_set_am_recv_handler(worker.raw, &hp) })?;
        Ok(worker)
    }

    /// Drives communication; returns how many events were processed.
    pub fn progress(&self) -> u32 {
        // SAFETY: the worker is live and only used from this (owning) thread.
        unsafe { sys::ucp_worker_progress(self.raw) }
    }

    /// The worker's event descriptor: readable when network activity (or [`WorkerSignal::signal`])
    /// wants [`Self::progress`], once armed ([`Self::arm`]).
    pub fn event_fd(&self) -> Result<std::os::fd::RawFd, UcxError> {
        let mut fd: std::os::raw::c_int = -1;
        // SAFETY: the worker is live (created with the wakeup feature); `fd` receives the descriptor,
        // which the worker owns.
        check("ucp_worker_get_efd", unsafe { sys::ucp_worker_get_efd(self.raw, &mut fd) })?;
        Ok(fd)
    }

    /// Arms the event descriptor: `Ok(true)` when armed (sleeping on it is safe), `Ok(false)`
    /// when events are pending (progress first, then arm again).
    pub fn arm(&self) -> Result<bool, UcxError> {
        // SAFETY: the worker is live and only used from this (owning) thread.
        let status = unsafe { sys::ucp_worker_arm(self.raw) };
        if status == sys::UCS_ERR_BUSY as Status {
            return Ok(false);
        }
        check("ucp_worker_arm", status).map(|()| true)
    }

    /// What other threads use to wake a thread sleeping on [`Self::event_fd`]; a no-op once
    /// this worker is destroyed.
    pub fn waker(&self) -> Arc<Waker> {
        self.waker.clone()
    }

    /// What callbacks left since the last call.
    pub fn take_events(self: &Rc<Self>) -> Vec<Event> {
        self.inbox
            .try_iter()
            .map(|e| match e {
                RawEvent::Message { header, data } => Event::Message(AmMessage {
                    header,
                    data: AmData(match data {
                        RawData::Owned(v) => DataInner::Owned(v),
                        RawData::Held(ptr, len) => DataInner::Held { ptr, len, worker: self.clone() },
                    }),
                }),
                RawEvent::EpError(token, status) => Event::EpError(token, status),
                RawEvent::DroppedRndv => Event::DroppedRndv,
            })
            .collect()
    }

    /// This worker's address, for peers to connect to.
    pub fn address(&self) -> Result<Vec<u8>, UcxError> {
        let mut addr = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: worker live; out pointers valid.
        check("ucp_worker_get_address", unsafe { sys::ucp_worker_get_address(self.raw, &mut addr, &mut len) })?;
        // SAFETY: UCX returned `len` readable bytes at `addr`, valid until released below.
        let v = unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
        // SAFETY: `addr` came from ucp_worker_get_address on this worker and is released once.
        unsafe { sys::ucp_worker_release_address(self.raw, addr) };
        Ok(v)
    }

    fn error_sink(&self) -> *const mpsc::Sender<RawEvent> {
        &*self.sink
    }
}

/// The worker a [`Waker`] signals, while it lives.
struct SignalTarget(sys::ucp_worker_h);

// SAFETY: the pointer is only used for `ucp_worker_signal`, which UCX documents as callable from
// any thread (also on a UCS_THREAD_MODE_SINGLE worker), and only under the `Waker`'s lock, which
// the worker's Drop takes to clear it before destroying the worker.
unsafe impl Send for SignalTarget {}

/// Wakes a worker's sleeping progress thread from any thread ([`Worker::waker`]).
pub(crate) struct Waker(std::sync::Mutex<Option<SignalTarget>>);

impl Waker {
    /// Makes the worker's event descriptor readable (the sleeping thread wakes); nothing once the
    /// worker is destroyed.
    pub fn signal(&self) {
        let target = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = target.as_ref() {
            // SAFETY: the worker is live (its Drop clears the target under this lock first);
            // ucp_worker_signal is thread-safe.
            let status = unsafe { sys::ucp_worker_signal(t.0) };
            if status != sys::UCS_OK as Status {
                tracing::debug!("ucx: ucp_worker_signal failed: {}", status_text(status));
            }
        }
    }
}

/// Waits until `fd` is readable or `timeout` passed; `Ok(true)` when readable. An interrupted
/// wait counts as a timeout (the caller loops).
pub(crate) fn wait_readable(fd: std::os::fd::RawFd, timeout: Duration) -> std::io::Result<bool> {
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    let ms = timeout.as_millis().clamp(0, i32::MAX as u128) as libc::c_int;
    // SAFETY: one valid pollfd for the duration of the call.
    let n = unsafe { libc::poll(&mut pfd, 1, ms) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        return if e.kind() == std::io::ErrorKind::Interrupted { Ok(false) } else { Err(e) };
    }
    Ok(n > 0)
}

impl Drop for Worker {
    fn drop(&mut self) {
        // No thread may signal the worker from here on.
        *self.waker.0.lock().unwrap_or_else(|p| p.into_inner()) = None;
        // Data still queued and held in UCX's buffers goes back before the worker does.
        for e in self.inbox.try_iter() {
            if let RawEvent::Message { data: RawData::Held(ptr, _), .. } = e {
                // SAFETY: data this worker let us keep, not yet wrapped (so not yet released).
                unsafe { sys::ucp_am_data_release(self.raw, ptr) }
            }
        }
        // SAFETY: every endpoint holds an Rc to this worker, so none is left; destroyed once. The
        // sink box is dropped after this body, so no callback can see it freed.
        unsafe { sys::ucp_worker_destroy(self.raw) }
    }
}

/// A UCP request handle (from a `*_nbx` call), freed on drop; owns the buffers UCX may still read.
pub(crate) struct Request {
    raw: *mut c_void,
    keep: Vec<Vec<u8>>,
    _worker: Rc<Worker>,
}

/// What a non-blocking call returned.
pub(crate) enum Posted {
    /// Completed in the call.
    Done,
    /// In flight.
    Pending(Request),
}

impl Posted {
    fn from_ptr(
        call: &'static str,
        p: sys::ucs_status_ptr_t,
        keep: Vec<Vec<u8>>,
        worker: &Rc<Worker>,
    ) -> Result<Self, UcxError> {
        if p.is_null() {
            Ok(Posted::Done)
        } else if sys::ucs_ptr_is_err(p) {
            Err(UcxError { call, status: sys::ucs_ptr_raw_status(p) })
        } else {
            Ok(Posted::Pending(Request { raw: p, keep, _worker: worker.clone() }))
        }
    }
}

impl Request {
    /// Asks UCX to cancel the request (`ucp_request_cancel`); it then completes, cancelled or
    /// done, and must still be polled to its end. UCX cancels what it can (receives, and sends not
    /// yet handed to a transport); a put already under way completes normally.
    pub fn cancel(&self) {
        // SAFETY: raw is a live request of this worker (freed only in Drop).
        unsafe { sys::ucp_request_cancel(self._worker.raw, self.raw) }
    }

    /// `None` while in flight; then `Ok` or the error status.
    pub fn poll(&self, call: &'static str) -> Option<Result<(), UcxError>> {
        // SAFETY: raw is a live request (freed only in Drop).
        let s = unsafe { sys::ucp_request_check_status(self.raw) };
        if s == sys::UCS_INPROGRESS as Status {
            None
        } else {
            Some(check(call, s))
        }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        // SAFETY: raw came from an nbx call; freed once. If still in flight, UCX completes it and
        // releases it itself; the buffers it may still read are then leaked, never freed early.
        let in_flight = unsafe { sys::ucp_request_check_status(self.raw) } == sys::UCS_INPROGRESS as Status;
        // SAFETY: as above.
        unsafe { sys::ucp_request_free(self.raw) };
        if in_flight {
            for b in std::mem::take(&mut self.keep) {
                std::mem::forget(b);
            }
        }
    }
}

struct ErrArg {
    token: u64,
    sink: *const mpsc::Sender<RawEvent>,
}

unsafe extern "C" fn ep_err_cb(arg: *mut c_void, _ep: sys::ucp_ep_h, status: Status) {
    let r = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `arg` is the endpoint's boxed ErrArg, alive until the endpoint is closed (or
        // leaked if closing did not finish); its sink is the worker's, which outlives every
        // endpoint (they hold Rc<Worker>). Runs on the progress thread.
        let a = unsafe { &*(arg as *const ErrArg) };
        deliver(a.sink, RawEvent::EpError(a.token, status));
    }));
    if r.is_err() {
        tracing::error!("ucx: the endpoint error handler panicked");
    }
}

/// A UCP endpoint (`ucp_ep_h`) to a peer worker, created with peer error handling; closed on drop.
pub(crate) struct Endpoint {
    raw: sys::ucp_ep_h,
    err: *mut ErrArg,
    failed: std::cell::Cell<bool>,
    peer_errors: bool,
    worker: Rc<Worker>,
}

/// How long dropping an endpoint waits for its close to complete.
const CLOSE_WAIT: Duration = Duration::from_secs(2);

impl Endpoint {
    /// Connects to a peer worker by its address. With `peer_errors`, the endpoint uses
    /// `UCP_ERR_HANDLING_MODE_PEER` and reports failures under `token`; without, it uses
    /// `UCP_ERR_HANDLING_MODE_NONE` (UCX 1.13's shared-memory transports support nothing else).
    pub fn connect(worker: &Rc<Worker>, address: &[u8], token: u64, peer_errors: bool) -> Result<Rc<Self>, UcxError> {
        let err = Box::into_raw(Box::new(ErrArg { token, sink: worker.error_sink() }));
        let mut params: sys::ucp_ep_params_t = zeroed();
        params.field_mask = sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS as u64;
        params.address = address.as_ptr() as *const sys::ucp_address_t;
        if peer_errors {
            params.field_mask |=
                (sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER) as u64;
            params.err_mode = sys::UCP_ERR_HANDLING_MODE_PEER;
            params.err_handler.cb = Some(ep_err_cb);
            params.err_handler.arg = err as *mut c_void;
        }
        let mut raw = ptr::null_mut();
        // SAFETY: worker live; the address bytes are a worker address the peer published (UCX
        // validates and copies what it needs during the call); err arg outlives the endpoint.
        let r = check("ucp_ep_create", unsafe { sys::ucp_ep_create(worker.raw, &params, &mut raw) });
        if let Err(e) = r {
            // SAFETY: creation failed, so UCX holds no reference to `err`; reclaim it.
            drop(unsafe { Box::from_raw(err) });
            return Err(e);
        }
        Ok(Rc::new(Self { raw, err, failed: std::cell::Cell::new(false), peer_errors, worker: worker.clone() }))
    }

    /// Whether UCX reports this endpoint's failures (peer error handling mode).
    pub fn peer_errors(&self) -> bool {
        self.peer_errors
    }

    /// Marks the endpoint failed (after its error callback): it will be force-closed.
    pub fn mark_failed(&self) {
        self.failed.set(true);
    }

    fn params_with_memh(memh: Option<&MemHandle>) -> sys::ucp_request_param_t {
        let mut p: sys::ucp_request_param_t = zeroed();
        if let Some(m) = memh {
            p.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_MEMH;
            p.memh = m.raw;
        }
        p
    }

    /// Posts a put of `len` bytes at `offset` of the registered region `src` to `remote_addr` of
    /// the peer, under `rkey`. The source range is bounds-checked here.
    ///
    /// # Safety
    /// - `src` (the handle, hence its memory) must stay alive and its bytes unmodified until a later
    ///   flush of this endpoint completes (the caller keeps an `Rc` to it until then);
    /// - `remote_addr..remote_addr+len` must lie inside a region the peer registered and still has
    ///   registered (for a peer in this very process, that is memory of this process).
    pub unsafe fn put(
        &self,
        src: &MemHandle,
        offset: u64,
        len: u64,
        remote_addr: u64,
        rkey: &RemoteKey,
    ) -> Result<Posted, UcxError> {
        if src.mem.check(offset, len).is_err() {
            return Err(UcxError { call: "ucp_put_nbx", status: sys::UCS_ERR_INVALID_PARAM as Status });
        }
        let params = Self::params_with_memh(Some(src));
        // SAFETY: the source range is inside the registered region (checked above); endpoint and rkey
        // are live; the caller guarantees lifetimes and the remote range (see # Safety).
        let local = unsafe { src.mem.addr().add(offset as usize) } as *const c_void;
        // SAFETY: as above.
        let p = unsafe { sys::ucp_put_nbx(self.raw, local, len as usize, remote_addr, rkey.raw, &params) };
        Posted::from_ptr("ucp_put_nbx", p, Vec::new(), &self.worker)
    }

    /// Posts a flush: completes when every earlier operation on this endpoint is complete at the peer.
    pub fn flush(&self) -> Result<Posted, UcxError> {
        let params: sys::ucp_request_param_t = zeroed();
        // SAFETY: endpoint live; params all-zero means no callback, default datatype.
        let p = unsafe { sys::ucp_ep_flush_nbx(self.raw, &params) };
        Posted::from_ptr("ucp_ep_flush_nbx", p, Vec::new(), &self.worker)
    }

    /// Posts an eager active message with kvxfer's id. The buffers move into the request and live
    /// until UCX is done with them.
    pub fn am_send(&self, header: Vec<u8>, data: Vec<u8>) -> Result<Posted, UcxError> {
        let mut params: sys::ucp_request_param_t = zeroed();
        params.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
        params.flags = sys::UCP_AM_SEND_FLAG_EAGER;
        // SAFETY: endpoint live; header and data are heap buffers that move into the Request (their
        // heap addresses do not change when the Vecs move) and stay alive until it completes.
        let p = unsafe {
            sys::ucp_am_send_nbx(
                self.raw,
                AM_ID,
                header.as_ptr() as *const c_void,
                header.len(),
                data.as_ptr() as *const c_void,
                data.len(),
                &params,
            )
        };
        Posted::from_ptr("ucp_am_send_nbx", p, vec![header, data], &self.worker)
    }
}

impl Endpoint {
    /// Starts closing the endpoint without waiting: with `force` (and in peer error mode, the only
    /// one where UCX allows it) its lanes are discarded at once, what it still had to send is lost;
    /// otherwise a flush close (what it has to send goes first). The returned [`ClosingEndpoint`]
    /// is polled to its end. `None` when the close completed in the call.
    pub fn close_nb(self, force: bool) -> Option<ClosingEndpoint> {
        let this = std::mem::ManuallyDrop::new(self);
        let mut params: sys::ucp_request_param_t = zeroed();
        params.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
        params.flags = if force && this.peer_errors { sys::UCP_EP_CLOSE_FLAG_FORCE } else { 0 };
        // SAFETY: the endpoint is live and closed once (ManuallyDrop: its Drop does not run); it is
        // uniquely owned here, so no RemoteKey of it is left (each holds an Rc to it).
        let p = unsafe { sys::ucp_ep_close_nbx(this.raw, &params) };
        // SAFETY: moved out once; `this` is never used or dropped afterwards.
        let worker = unsafe { std::ptr::read(&this.worker) };
        if sys::ucs_ptr_is_ptr(p) {
            return Some(ClosingEndpoint { req: p, err: this.err, worker });
        }
        // SAFETY: the close completed (or failed) in the call: UCX will not call the handler again.
        drop(unsafe { Box::from_raw(this.err) });
        None
    }
}

/// An endpoint whose close is under way ([`Endpoint::close_nb`]).
pub(crate) struct ClosingEndpoint {
    req: sys::ucs_status_ptr_t,
    err: *mut ErrArg,
    worker: Rc<Worker>,
}

impl ClosingEndpoint {
    /// Whether the close completed.
    pub fn done(&self) -> bool {
        // SAFETY: req is a live request until freed in Drop.
        unsafe { sys::ucp_request_check_status(self.req) != sys::UCS_INPROGRESS as Status }
    }
}

impl Drop for ClosingEndpoint {
    fn drop(&mut self) {
        let done = self.done();
        // SAFETY: req came from ucp_ep_close_nbx; freed once (UCX finishes it itself if pending).
        unsafe { sys::ucp_request_free(self.req) };
        if done {
            // SAFETY: the endpoint is closed, UCX will not call its error handler again.
            drop(unsafe { Box::from_raw(self.err) });
        }
        // Otherwise the ErrArg is leaked: UCX may still call the handler until the worker is destroyed.
        let _ = &self.worker;
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        let mut params: sys::ucp_request_param_t = zeroed();
        params.op_attr_mask = sys::UCP_OP_ATTR_FIELD_FLAGS;
        // A failed endpoint must be force-closed; a healthy one flushes first (bounded below). Force
        // is only allowed in peer error mode.
        params.flags = if self.failed.get() && self.peer_errors { sys::UCP_EP_CLOSE_FLAG_FORCE } else { 0 };
        // SAFETY: the endpoint is live and closed once; every RemoteKey of it holds an Rc to it and
        // is therefore already destroyed.
        let p = unsafe { sys::ucp_ep_close_nbx(self.raw, &params) };
        let mut done = true;
        if sys::ucs_ptr_is_ptr(p) {
            let deadline = Instant::now() + CLOSE_WAIT;
            loop {
                // SAFETY: p is a live request until freed below.
                let s = unsafe { sys::ucp_request_check_status(p) };
                if s != sys::UCS_INPROGRESS as Status {
                    break;
                }
                if Instant::now() > deadline {
                    done = false;
                    break;
                }
                self.worker.progress();
            }
            // SAFETY: p came from ucp_ep_close_nbx; freed once (UCX finishes it itself if pending).
            unsafe { sys::ucp_request_free(p) };
        }
        if done {
            // SAFETY: the endpoint is closed, UCX will not call its error handler again.
            drop(unsafe { Box::from_raw(self.err) });
        }
        // Otherwise the ErrArg is leaked: UCX may still call the handler until the worker is destroyed.
    }
}

/// Registered memory (`ucp_mem_h`) and its packed remote key; unmapped on drop, before the
/// region description it keeps alive is released.
pub(crate) struct MemHandle {
    raw: sys::ucp_mem_h,
    rkey: Vec<u8>,
    ctx: Rc<Context>,
    mem: MemDesc,
}

impl MemHandle {
    /// Registers a (non-empty) memory region; the handle keeps the descriptor alive.
    pub fn map(ctx: &Rc<Context>, mem: &MemDesc) -> Result<Self, UcxError> {
        let mut params: sys::ucp_mem_map_params_t = zeroed();
        params.field_mask = (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH) as u64;
        params.address = mem.addr() as *mut c_void;
        params.length = mem.len();
        if let MemKind::Cuda { .. } = mem.kind() {
            params.field_mask |= sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE as u64;
            params.memory_type = sys::UCS_MEMORY_TYPE_CUDA;
        }
        let mut raw = ptr::null_mut();
        // SAFETY: context live; MemDesc::from_raw_parts' contract keeps the memory valid while
        // the descriptor (a clone stored in the handle) is registered, i.e. until after
        // ucp_mem_unmap in Drop.
        check("ucp_mem_map", unsafe { sys::ucp_mem_map(ctx.raw, &params, &mut raw) })?;
        let mut buf = ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: context and memh live; out pointers valid.
        let r = check("ucp_rkey_pack", unsafe { sys::ucp_rkey_pack(ctx.raw, raw, &mut buf, &mut size) });
        if let Err(e) = r {
            // SAFETY: raw is the handle just mapped; unmapped once.
            unsafe { sys::ucp_mem_unmap(ctx.raw, raw) };
            return Err(e);
        }
        // SAFETY: UCX returned `size` readable bytes at `buf`, released right after the copy.
        let rkey = unsafe { std::slice::from_raw_parts(buf as *const u8, size) }.to_vec();
        // SAFETY: buf came from ucp_rkey_pack; released once.
        unsafe { sys::ucp_rkey_buffer_release(buf) };
        Ok(Self { raw, rkey, ctx: ctx.clone(), mem: mem.clone() })
    }

    /// The packed remote key peers unpack to write into this memory.
    pub fn packed_rkey(&self) -> &[u8] {
        &self.rkey
    }
}

impl Drop for MemHandle {
    fn drop(&mut self) {
        // SAFETY: raw is a live handle of this context, unmapped once. Writes that used it hold an Rc.
        let _ = unsafe { sys::ucp_mem_unmap(self.ctx.raw, self.raw) };
    }
}

/// An unpacked remote key (`ucp_rkey_h`) for one endpoint; destroyed on drop, before its endpoint.
pub(crate) struct RemoteKey {
    raw: sys::ucp_rkey_h,
    _ep: Rc<Endpoint>,
}

impl RemoteKey {
    /// Unpacks a peer's packed key for use on `ep`.
    pub fn unpack(ep: &Rc<Endpoint>, packed: &[u8]) -> Result<Self, UcxError> {
        let mut raw = ptr::null_mut();
        // SAFETY: endpoint live; UCX parses the packed bytes (which it validates) during the call.
        check("ucp_ep_rkey_unpack", unsafe {
            sys::ucp_ep_rkey_unpack(ep.raw, packed.as_ptr() as *const c_void, &mut raw)
        })?;
        Ok(Self { raw, _ep: ep.clone() })
    }
}

impl Drop for RemoteKey {
    fn drop(&mut self) {
        // SAFETY: raw came from ucp_ep_rkey_unpack; destroyed once, while its endpoint is alive.
        unsafe { sys::ucp_rkey_destroy(self.raw) }
    }
}
