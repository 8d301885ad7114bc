//! The safe layer over libibverbs: the only module of this crate with `unsafe` code.
//!
//! `unsafe` is allowed here (and nowhere else in the crate) because every libibverbs call is a C call
//! on raw handles. Each handle is owned by one type whose `Drop` releases it, and children hold their
//! parents alive through `Arc`, so destruction always runs in the order libibverbs requires:
//! queue pair, then completion queues and memory regions, then the protection domain and the
//! completion channel, then the device context.
//!
//! Memory the NIC reads or writes is pinned by keeping the owning [`Mr`] alive: a queue pair keeps an
//! `Arc<Mr>` for every work request it posted until `retire_through` says the request completed
//! (or until the queue pair is destroyed), so deregistration never races an in-flight request.
//!
//! This module is compiled (and linted) in every build; the test-only model in `emu.rs` is a second
//! implementation of the same [`Verbs`] traits, chosen at run time, not a replacement.
#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::ffi::CStr;
use std::os::raw::{c_int, c_void};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ibverbs_sys as sys;
use kvxfer_core::{BackendError, MemDesc};

use crate::verbs::{
    ffi_error, Access, Completion, CompletionQueue, CqEvent, Device, DeviceCaps, EventChannel, MemoryRegion, OpenError,
    PortInfo, PostError, ProtectionDomain, QpCaps, QueuePair, SendKind, SendWr, Verbs,
};
use crate::NAME;

/// libibverbs, through `ibverbs-sys`.
pub(crate) struct Ibv;

impl Verbs for Ibv {
    const EMULATED: bool = false;
    type Context = Context;
    type Pd = Pd;
    type Mr = Mr;
    type Channel = CompChannel;
    type Event = Event;
    type Cq = Cq;
    type Qp = Qp;

    fn status_str(status: u32) -> String {
        // SAFETY: ibv_wc_status_str returns a static NUL-terminated string for any value.
        let p = unsafe { sys::ibv_wc_status_str(status) };
        if p.is_null() {
            return format!("status {status}");
        }
        // SAFETY: static string.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// The bytes of a GID.
#[cfg(test)]
pub(crate) fn gid_bytes(g: sys::ibv_gid) -> [u8; 16] {
    // SAFETY: both views of the union are plain bytes; every bit pattern is a valid `[u8; 16]`.
    unsafe { g.raw }
}

fn device_name(dev: *mut sys::ibv_device) -> String {
    // SAFETY: `dev` is a live entry of a device list; the name is a NUL-terminated string owned by it.
    let p = unsafe { sys::ibv_get_device_name(dev) };
    if p.is_null() {
        return String::from("?");
    }
    // SAFETY: non-null, NUL-terminated, valid while the list lives (we copy it out at once).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// An open device context (`ibv_context`).
pub(crate) struct Context {
    ptr: NonNull<sys::ibv_context>,
    name: String,
}

// SAFETY: libibverbs contexts are thread safe (the library serialises what needs it); we only pass the
// pointer to libibverbs calls.
unsafe impl Send for Context {}
// SAFETY: as for Send.
unsafe impl Sync for Context {}

impl Device<Ibv> for Context {
    /// Opens the device named `wanted`, or the first device. Errors say what was found.
    fn open(wanted: Option<&str>) -> Result<Arc<Context>, OpenError> {
        let mut n: c_int = 0;
        // SAFETY: valid out-pointer; list freed below.
        let list = unsafe { sys::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(OpenError::List { errno: errno() });
        }
        let mut names = Vec::new();
        let mut chosen = None;
        for i in 0..usize::try_from(n).unwrap_or(0) {
            // SAFETY: index within the `n` entries of the list.
            let dev = unsafe { *list.add(i) };
            if dev.is_null() {
                break;
            }
            let name = device_name(dev);
            if chosen.is_none() && wanted.is_none_or(|w| w == name) {
                chosen = Some((dev, name.clone()));
            }
            names.push(name);
        }
        let result = match chosen {
            None => Err(OpenError::NotFound { wanted: wanted.map(str::to_owned), available: names }),
            Some((dev, name)) => {
                // SAFETY: `dev` is a live entry of the list; an opened context stays valid after the
                // list is freed (documented by libibverbs).
                let ctx = unsafe { sys::ibv_open_device(dev) };
                match NonNull::new(ctx) {
                    Some(ptr) => Ok(Arc::new(Context { ptr, name })),
                    None => Err(OpenError::Open { name, errno: errno() }),
                }
            }
        };
        // SAFETY: freed exactly once; contexts opened from it remain valid.
        unsafe { sys::ibv_free_device_list(list) };
        result
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn query_device(&self) -> Result<DeviceCaps, BackendError> {
        let mut attr = sys::ibv_device_attr::default();
        // SAFETY: live context; `attr` is a valid out-struct of the right type.
        let rc = unsafe { sys::ibv_query_device(self.ptr.as_ptr(), &mut attr) };
        if rc != 0 {
            return Err(ffi_error("ibv_query_device", rc, format!("device {}", self.name)));
        }
        Ok(DeviceCaps {
            max_qp_wr: attr.max_qp_wr.max(0) as u32,
            max_sge: attr.max_sge.max(0) as u32,
            max_cqe: attr.max_cqe.max(0) as u32,
            max_mr: attr.max_mr.max(0) as u32,
        })
    }

    fn query_port(&self, port: u8) -> Result<PortInfo, BackendError> {
        let mut attr = sys::ibv_port_attr::default();
        // SAFETY: the exported ibv_query_port fills the compat prefix of `ibv_port_attr` (the full
        // struct is larger than the compat one, so the write stays inside `attr`).
        let rc = unsafe { sys::ibv_query_port(self.ptr.as_ptr(), port, (&mut attr as *mut sys::ibv_port_attr).cast()) };
        if rc != 0 {
            return Err(ffi_error("ibv_query_port", rc, format!("device {} port {port}", self.name)));
        }
        Ok(PortInfo {
            state: attr.state,
            lid: attr.lid,
            active_mtu: attr.active_mtu,
            link_layer: attr.link_layer,
            max_msg_sz: attr.max_msg_sz,
        })
    }

    fn query_gid(&self, port: u8, index: u8) -> Result<[u8; 16], BackendError> {
        let mut gid = sys::ibv_gid { raw: [0; 16] };
        // SAFETY: live context; `gid` is a valid out-union.
        let rc = unsafe { sys::ibv_query_gid(self.ptr.as_ptr(), port, c_int::from(index), &mut gid) };
        if rc != 0 {
            return Err(ffi_error("ibv_query_gid", rc, format!("device {} port {port} gid index {index}", self.name)));
        }
        // SAFETY: every bit pattern of the union is a valid `[u8; 16]`.
        Ok(unsafe { gid.raw })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every child (PD, channel, CQ, QP, MR) holds an Arc to this context, so none is left.
        let rc = unsafe { sys::ibv_close_device(self.ptr.as_ptr()) };
        if rc != 0 {
            tracing::warn!(device = %self.name, rc, "ibv_close_device failed");
        }
    }
}

/// A protection domain.
pub(crate) struct Pd {
    ptr: NonNull<sys::ibv_pd>,
    ctx: Arc<Context>,
}

// SAFETY: PDs are used only through thread-safe libibverbs calls.
unsafe impl Send for Pd {}
// SAFETY: as for Send.
unsafe impl Sync for Pd {}

impl ProtectionDomain<Ibv> for Pd {
    fn alloc(ctx: &Arc<Context>) -> Result<Arc<Pd>, BackendError> {
        // SAFETY: live context.
        let p = unsafe { sys::ibv_alloc_pd(ctx.ptr.as_ptr()) };
        let ptr = NonNull::new(p).ok_or_else(|| ffi_error("ibv_alloc_pd", errno(), format!("device {}", ctx.name)))?;
        Ok(Arc::new(Pd { ptr, ctx: ctx.clone() }))
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: MRs and QPs hold an Arc to this PD, so none is left.
        let rc = unsafe { sys::ibv_dealloc_pd(self.ptr.as_ptr()) };
        if rc != 0 {
            tracing::warn!(device = %self.ctx.name, rc, "ibv_dealloc_pd failed");
        }
    }
}

/// A registered memory region (`ibv_mr`).
pub(crate) struct Mr {
    ptr: NonNull<sys::ibv_mr>,
    addr: u64,
    len: usize,
    lkey: u32,
    rkey: u32,
    _pd: Arc<Pd>,
    /// Keeps the description (and a [`kvxfer_core::HostBuffer`]'s allocation) alive while registered.
    _mem: MemDesc,
}

// SAFETY: the MR is an immutable description after registration; libibverbs calls on it are thread safe.
unsafe impl Send for Mr {}
// SAFETY: as for Send.
unsafe impl Sync for Mr {}

impl MemoryRegion<Ibv> for Mr {
    /// Registers the described memory for `access` (`ibv_reg_mr`, which pins the pages).
    fn register(pd: &Arc<Pd>, mem: MemDesc, access: Access) -> Result<Mr, BackendError> {
        let (addr, len) = (mem.addr(), mem.len());
        // SAFETY: live PD. `MemDesc::from_raw_parts`'s contract (or a HostBuffer allocation, kept alive
        // by the descriptor stored in the Mr) keeps `[addr, addr + len)` valid until the registration
        // is closed, which drops this Mr (ibv_dereg_mr) before the engine may free the memory; bytes a
        // peer writes with RemoteWrite are reserved for transfers by the same contract.
        let p = unsafe { sys::ibv_reg_mr(pd.ptr.as_ptr(), addr.cast::<c_void>(), len, access.flags()) };
        let ptr = NonNull::new(p).ok_or_else(|| {
            ffi_error("ibv_reg_mr", errno(), format!("{len} bytes at {addr:p} on device {}", pd.ctx.name))
        })?;
        // SAFETY: `ptr` is the MR libibverbs just returned; its key fields are immutable.
        let (lkey, rkey) = unsafe { ((*ptr.as_ptr()).lkey, (*ptr.as_ptr()).rkey) };
        Ok(Mr { ptr, addr: addr as u64, len, lkey, rkey, _pd: pd.clone(), _mem: mem })
    }

    fn addr(&self) -> u64 {
        self.addr
    }

    fn len(&self) -> usize {
        self.len
    }

    fn rkey(&self) -> u32 {
        self.rkey
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: no posted work request still references this MR (QPs keep an Arc until retirement).
        // After this call the rkey is invalid: a peer's RDMA WRITE with it fails at the NIC.
        let rc = unsafe { sys::ibv_dereg_mr(self.ptr.as_ptr()) };
        if rc != 0 {
            tracing::warn!(rc, len = self.len, "ibv_dereg_mr failed");
        }
    }
}

/// A completion channel: the fd the poller thread sleeps on.
pub(crate) struct CompChannel {
    ptr: NonNull<sys::ibv_comp_channel>,
    _ctx: Arc<Context>,
}

// SAFETY: the channel is only read by the poller thread through libibverbs; creation/destruction are
// serialised by ownership.
unsafe impl Send for CompChannel {}
// SAFETY: as for Send.
unsafe impl Sync for CompChannel {}

impl EventChannel<Ibv> for CompChannel {
    /// Creates a channel with a non-blocking fd.
    fn create(ctx: &Arc<Context>) -> Result<Arc<CompChannel>, BackendError> {
        // SAFETY: live context.
        let p = unsafe { sys::ibv_create_comp_channel(ctx.ptr.as_ptr()) };
        let ptr = NonNull::new(p)
            .ok_or_else(|| ffi_error("ibv_create_comp_channel", errno(), format!("device {}", ctx.name)))?;
        let ch = Arc::new(CompChannel { ptr, _ctx: ctx.clone() });
        let fd = ch.fd();
        // SAFETY: fcntl on an fd we own (through the channel); no memory is passed.
        let rc = unsafe {
            let fl = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK)
        };
        if rc < 0 {
            return Err(ffi_error("fcntl(O_NONBLOCK)", errno(), "completion channel fd"));
        }
        Ok(ch)
    }

    fn next_event(&self, timeout: Duration) -> Result<Option<Event>, BackendError> {
        let mut pfd = libc::pollfd { fd: self.fd(), events: libc::POLLIN, revents: 0 };
        let ms = c_int::try_from(timeout.as_millis()).unwrap_or(c_int::MAX);
        // SAFETY: one valid pollfd.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc < 0 {
            let e = errno();
            if e == libc::EINTR {
                return Ok(None);
            }
            return Err(ffi_error("poll", e, "completion channel"));
        }
        if rc == 0 {
            return Ok(None);
        }
        let mut cq: *mut sys::ibv_cq = std::ptr::null_mut();
        let mut cq_ctx: *mut c_void = std::ptr::null_mut();
        // SAFETY: live channel with a non-blocking fd; out-pointers are valid.
        let rc = unsafe { sys::ibv_get_cq_event(self.ptr.as_ptr(), &mut cq, &mut cq_ctx) };
        if rc != 0 {
            let e = errno();
            if e == libc::EAGAIN || e == libc::EINTR {
                return Ok(None);
            }
            return Err(ffi_error("ibv_get_cq_event", e, "completion channel"));
        }
        Ok(NonNull::new(cq).map(|cq| Event { cq, key: cq_ctx as usize as u64 }))
    }
}

impl CompChannel {
    fn fd(&self) -> c_int {
        // SAFETY: the channel is live; `fd` is immutable after creation.
        unsafe { (*self.ptr.as_ptr()).fd }
    }
}

impl Drop for CompChannel {
    fn drop(&mut self) {
        // SAFETY: every CQ using this channel holds an Arc to it, so none is left.
        let rc = unsafe { sys::ibv_destroy_comp_channel(self.ptr.as_ptr()) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_destroy_comp_channel failed");
        }
    }
}

/// One completion event; dropping it acknowledges it (`ibv_ack_cq_events`).
///
/// Look the CQ's owner up by [`CqEvent::key`] (taking a strong reference) *before* dropping the event:
/// `ibv_destroy_cq` blocks until every event it reported is acknowledged, so the CQ memory stays valid
/// until this drop, and afterwards only the looked-up owner keeps it alive.
pub(crate) struct Event {
    cq: NonNull<sys::ibv_cq>,
    key: u64,
}

impl CqEvent for Event {
    /// The `cq_context` the CQ was created with.
    fn key(&self) -> u64 {
        self.key
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the CQ cannot have been freed: ibv_destroy_cq waits for this acknowledgement.
        unsafe { sys::ibv_ack_cq_events(self.cq.as_ptr(), 1) };
    }
}

/// A completion queue bound to a completion channel.
pub(crate) struct Cq {
    ptr: NonNull<sys::ibv_cq>,
    _channel: Arc<CompChannel>,
}

// SAFETY: polling and arming are thread-safe libibverbs operations; we poll from one thread at a time
// (the poller) but nothing breaks if others do.
unsafe impl Send for Cq {}
// SAFETY: as for Send.
unsafe impl Sync for Cq {}

impl CompletionQueue<Ibv> for Cq {
    /// Creates a CQ of at least `depth` entries reporting to `channel`, tagged with `key`.
    fn create(ctx: &Arc<Context>, channel: &Arc<CompChannel>, depth: u32, key: u64) -> Result<Arc<Cq>, BackendError> {
        let depth_c = c_int::try_from(depth).unwrap_or(c_int::MAX);
        // SAFETY: live context and channel; cq_context is an opaque integer we only read back.
        let p = unsafe {
            sys::ibv_create_cq(ctx.ptr.as_ptr(), depth_c, key as usize as *mut c_void, channel.ptr.as_ptr(), 0)
        };
        let ptr = NonNull::new(p)
            .ok_or_else(|| ffi_error("ibv_create_cq", errno(), format!("{depth} entries on device {}", ctx.name)))?;
        let cq = Arc::new(Cq { ptr, _channel: channel.clone() });
        cq.arm()?;
        Ok(cq)
    }

    /// Requests an event for the next completion (`ibv_req_notify_cq`).
    fn arm(&self) -> Result<(), BackendError> {
        // SAFETY: live CQ; the provider's op is the body of the static-inline ibv_req_notify_cq.
        let rc = unsafe {
            let cq = self.ptr.as_ptr();
            match (*(*cq).context).ops.req_notify_cq {
                Some(f) => f(cq, 0),
                None => libc::ENOSYS,
            }
        };
        if rc != 0 {
            return Err(ffi_error("ibv_req_notify_cq", rc, "completion queue"));
        }
        Ok(())
    }

    /// Polls up to `max` completions into `out`; returns how many.
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize, BackendError> {
        let mut wcs = vec![sys::ibv_wc::default(); max.clamp(1, 64)];
        // SAFETY: live CQ; `wcs` has room for the count passed; body of the static-inline ibv_poll_cq.
        let n = unsafe {
            let cq = self.ptr.as_ptr();
            match (*(*cq).context).ops.poll_cq {
                Some(f) => f(cq, wcs.len() as c_int, wcs.as_mut_ptr()),
                None => -libc::ENOSYS,
            }
        };
        if n < 0 {
            return Err(ffi_error("ibv_poll_cq", n, "completion queue"));
        }
        for wc in &wcs[..n as usize] {
            let (status, vendor_err) = wc.error().unwrap_or((sys::ibv_wc_status::IBV_WC_SUCCESS, 0));
            out.push(Completion {
                wr_id: wc.wr_id(),
                status,
                vendor_err,
                opcode: wc.opcode(),
                byte_len: wc.len() as u32,
                imm: wc.imm_data().map(u32::from_be),
                qp_num: wc.qp_num,
            });
        }
        Ok(n as usize)
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: QPs using this CQ hold an Arc to it, so none is left; ibv_destroy_cq waits for
        // outstanding event acknowledgements.
        let rc = unsafe { sys::ibv_destroy_cq(self.ptr.as_ptr()) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_destroy_cq failed");
        }
    }
}

/// A reliable-connected queue pair.
pub(crate) struct Qp {
    ptr: NonNull<sys::ibv_qp>,
    caps: QpCaps,
    /// Registrations referenced by posted send requests, with the id of the request, in post order.
    inflight: Mutex<VecDeque<(u64, Vec<Arc<Mr>>)>>,
    /// Receive-buffer registrations (kept for the QP's life).
    recv_keep: Mutex<Vec<Arc<Mr>>>,
    _pd: Arc<Pd>,
    _send_cq: Arc<Cq>,
    _recv_cq: Arc<Cq>,
}

// SAFETY: posting and modifying are thread-safe libibverbs operations; the Rust-side state is in Mutexes.
unsafe impl Send for Qp {}
// SAFETY: as for Send.
unsafe impl Sync for Qp {}

impl QueuePair<Ibv> for Qp {
    /// Creates an RC queue pair in RESET state. If the device rejects the inline size, retries without
    /// inline data.
    fn create(pd: &Arc<Pd>, send_cq: &Arc<Cq>, recv_cq: &Arc<Cq>, want: QpCaps) -> Result<Qp, BackendError> {
        let mut last_err = 0;
        for inline in [want.max_inline, 0] {
            let mut init = sys::ibv_qp_init_attr {
                qp_context: std::ptr::null_mut(),
                send_cq: send_cq.ptr.as_ptr(),
                recv_cq: recv_cq.ptr.as_ptr(),
                srq: std::ptr::null_mut(),
                cap: sys::ibv_qp_cap {
                    max_send_wr: want.max_send_wr,
                    max_recv_wr: want.max_recv_wr,
                    max_send_sge: want.max_send_sge,
                    max_recv_sge: 1,
                    max_inline_data: inline,
                },
                qp_type: sys::ibv_qp_type::IBV_QPT_RC,
                sq_sig_all: 0,
            };
            // SAFETY: live PD and CQs; `init` is valid and libibverbs writes the granted caps back into it.
            let p = unsafe { sys::ibv_create_qp(pd.ptr.as_ptr(), &mut init) };
            if let Some(ptr) = NonNull::new(p) {
                let caps = QpCaps {
                    max_send_wr: init.cap.max_send_wr,
                    max_recv_wr: init.cap.max_recv_wr,
                    max_send_sge: init.cap.max_send_sge,
                    max_inline: init.cap.max_inline_data,
                };
                return Ok(Qp {
                    ptr,
                    caps,
                    inflight: Mutex::new(VecDeque::new()),
                    recv_keep: Mutex::new(Vec::new()),
                    _pd: pd.clone(),
                    _send_cq: send_cq.clone(),
                    _recv_cq: recv_cq.clone(),
                });
            }
            last_err = errno();
            if inline == 0 {
                break;
            }
        }
        Err(ffi_error("ibv_create_qp", last_err, format!("RC queue pair with {want:?} on device {}", pd.ctx.name)))
    }

    fn caps(&self) -> QpCaps {
        self.caps
    }

    fn qp_num(&self) -> u32 {
        // SAFETY: live QP; qp_num is immutable.
        unsafe { (*self.ptr.as_ptr()).qp_num }
    }

    /// Applies a state transition (`ibv_modify_qp`).
    fn modify(&self, attr: &sys::ibv_qp_attr, mask: sys::ibv_qp_attr_mask, what: &str) -> Result<(), BackendError> {
        let mut a = *attr;
        // SAFETY: live QP; `a` is a valid attribute struct; the mask names the fields that are set.
        let rc = unsafe { sys::ibv_modify_qp(self.ptr.as_ptr(), &mut a, mask.0 as c_int) };
        if rc != 0 {
            return Err(ffi_error("ibv_modify_qp", rc, format!("{what} (qp {})", self.qp_num())));
        }
        Ok(())
    }

    /// Posts a chain of send work requests. Every SGE is checked against its registration; the
    /// registrations stay referenced until `retire_through` passes the request's id. Ids must
    /// increase across calls (completions retire in post order).
    fn post_send(&self, wrs: &[SendWr<Ibv>]) -> Result<(), PostError> {
        if wrs.is_empty() {
            return Ok(());
        }
        let mut sges: Vec<Vec<sys::ibv_sge>> = Vec::with_capacity(wrs.len());
        for (i, wr) in wrs.iter().enumerate() {
            if wr.sges.len() > self.caps.max_send_sge as usize {
                return Err(refused(BackendError::Protocol {
                    backend: NAME,
                    peer: format!("qp {}", self.qp_num()),
                    detail: format!(
                        "work request {i} has {} SGEs, the QP allows {}",
                        wr.sges.len(),
                        self.caps.max_send_sge
                    ),
                }));
            }
            let mut v = Vec::with_capacity(wr.sges.len());
            for s in &wr.sges {
                let in_bounds = s.offset.checked_add(u64::from(s.len)).is_some_and(|e| e <= s.mr.len as u64);
                if !in_bounds {
                    return Err(refused(BackendError::Protocol {
                        backend: NAME,
                        peer: format!("qp {}", self.qp_num()),
                        detail: format!(
                            "work request {} SGE of {} bytes at offset {} is outside its registration of {} bytes",
                            wr.wr_id, s.len, s.offset, s.mr.len
                        ),
                    }));
                }
                v.push(sys::ibv_sge { addr: s.mr.addr + s.offset, length: s.len, lkey: s.mr.lkey });
            }
            sges.push(v);
        }
        let mut raw: Vec<sys::ibv_send_wr> = Vec::with_capacity(wrs.len());
        for (wr, sg) in wrs.iter().zip(sges.iter_mut()) {
            let mut w = sys::ibv_send_wr {
                wr_id: wr.wr_id,
                sg_list: if sg.is_empty() { std::ptr::null_mut() } else { sg.as_mut_ptr() },
                num_sge: sg.len() as c_int,
                ..Default::default()
            };
            let mut flags = 0;
            if wr.signaled {
                flags |= sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
            if wr.inline {
                flags |= sys::ibv_send_flags::IBV_SEND_INLINE.0;
            }
            w.send_flags = flags;
            match wr.kind {
                SendKind::Write { remote_addr, rkey } => {
                    w.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
                    w.wr.rdma = sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey };
                }
                SendKind::WriteImm { remote_addr, rkey, imm } => {
                    w.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
                    w.wr.rdma = sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey };
                    w.__bindgen_anon_1.imm_data = imm.to_be();
                }
                SendKind::Send => w.opcode = sys::ibv_wr_opcode::IBV_WR_SEND,
            }
            raw.push(w);
        }
        // Chain after the vector stops moving.
        let base = raw.as_mut_ptr();
        for i in 0..raw.len().saturating_sub(1) {
            // SAFETY: i + 1 < len, so the pointer stays inside the vector.
            raw[i].next = unsafe { base.add(i + 1) };
        }
        {
            let mut inflight = lock(&self.inflight);
            for wr in wrs {
                inflight.push_back((wr.wr_id, wr.sges.iter().map(|s| s.mr.clone()).collect()));
            }
        }
        let mut bad: *mut sys::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: live QP; the chain and its SGE arrays live until the call returns (inline data is copied,
        // other data is DMA-read later from registrations kept alive in `inflight`). This is the body of
        // the static-inline ibv_post_send.
        let rc = unsafe {
            let qp = self.ptr.as_ptr();
            match (*(*qp).context).ops.post_send {
                Some(f) => f(qp, base, &mut bad),
                None => libc::ENOSYS,
            }
        };
        if rc != 0 {
            let idx = if bad.is_null() {
                0
            } else {
                (bad as usize - base as usize) / std::mem::size_of::<sys::ibv_send_wr>()
            };
            // Requests before `idx` were posted; their registrations stay in `inflight` until retired.
            let mut inflight = lock(&self.inflight);
            for _ in idx..wrs.len() {
                inflight.pop_back();
            }
            let error = ffi_error(
                "ibv_post_send",
                rc,
                format!(
                    "work request {} of {} (wr_id {}) on qp {}",
                    idx,
                    wrs.len(),
                    wrs.get(idx).map_or(0, |w| w.wr_id),
                    self.qp_num()
                ),
            );
            return Err(PostError { posted: idx, error });
        }
        Ok(())
    }

    /// Releases the registrations of every posted send request up to and including `wr_id`.
    fn retire_through(&self, wr_id: u64) {
        let mut inflight = lock(&self.inflight);
        if !inflight.iter().any(|(id, _)| *id == wr_id) {
            return;
        }
        while let Some((id, _)) = inflight.pop_front() {
            if id == wr_id {
                break;
            }
        }
    }

    /// Posts one receive buffer: `len` bytes at `offset` of `mr`, reported as `wr_id`.
    fn post_recv(&self, wr_id: u64, mr: &Arc<Mr>, offset: u64, len: u32) -> Result<(), BackendError> {
        if offset.checked_add(u64::from(len)).is_none_or(|e| e > mr.len as u64) {
            return Err(BackendError::Protocol {
                backend: NAME,
                peer: format!("qp {}", self.qp_num()),
                detail: format!("receive buffer of {len} bytes at offset {offset} is outside its registration"),
            });
        }
        {
            let mut keep = lock(&self.recv_keep);
            if !keep.iter().any(|m| Arc::ptr_eq(m, mr)) {
                keep.push(mr.clone());
            }
        }
        let mut sge = sys::ibv_sge { addr: mr.addr + offset, length: len, lkey: mr.lkey };
        let mut wr = sys::ibv_recv_wr { wr_id, next: std::ptr::null_mut(), sg_list: &mut sge, num_sge: 1 };
        let mut bad: *mut sys::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: live QP; the buffer is inside a registration this QP keeps for its lifetime; body of the
        // static-inline ibv_post_recv.
        let rc = unsafe {
            let qp = self.ptr.as_ptr();
            match (*(*qp).context).ops.post_recv {
                Some(f) => f(qp, &mut wr, &mut bad),
                None => libc::ENOSYS,
            }
        };
        if rc != 0 {
            return Err(ffi_error("ibv_post_recv", rc, format!("wr_id {wr_id} on qp {}", self.qp_num())));
        }
        Ok(())
    }
}

/// A post refused before anything was handed to the device.
fn refused(error: BackendError) -> PostError {
    PostError { posted: 0, error }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: live QP, destroyed once; its CQs and PD are still alive (fields drop after this).
        let rc = unsafe { sys::ibv_destroy_qp(self.ptr.as_ptr()) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_destroy_qp failed");
        }
    }
}
