//! An in-process software model of the verbs API the backend uses (test-only `emulator` feature).
//!
//! It is a second implementation of the [`Verbs`] traits next to `ffi.rs` (which every build still
//! compiles); an endpoint created with `device=emulated` runs on it, so the backend code above it
//! is exactly the code that runs on hardware. It models what the backend relies on, not a NIC:
//! - one device `emulated` (InfiniBand link layer, port 1 ACTIVE, LID 1); every endpoint in the
//!   process shares one fabric where QPs are found by number and memory regions by key;
//! - RC semantics: work requests execute in post order; RDMA WRITE checks the rkey, the PD and the
//!   bounds of the remote region (else `REM_ACCESS_ERR`); WRITE WITH IMMEDIATE and SEND consume a posted
//!   receive at the peer, and wait (RNR, order preserved) while none is posted; a SEND longer than the
//!   receive buffer fails; a peer QP that is gone or not ready gives `RETRY_EXC_ERR`;
//! - completions only for signalled requests and for every failed or flushed one; the first error
//!   moves the QP to ERR and flushes later requests, posted receives, and its requests still
//!   waiting at the peer;
//! - a deregistered region's key is gone at once: a later WRITE with it fails (`REM_ACCESS_ERR`);
//! - a request that reaches a QP in ERR (or RESET, INIT) is not executed: nothing is placed, and the
//!   sender gets `RETRY_EXC_ERR` (a real responder in ERR drops every packet, so the requester
//!   retries and gives up);
//! - a network partition ([`partition`], [`heal`], test hooks): while it lasts, posted requests are
//!   transmitted (their source bytes read at post time, as the DMA would) but held in the network;
//!   on healing they arrive in order and are executed against the receiving QP's state *then*. A
//!   sender whose QP enters ERR meanwhile gets its flush completions at once, but what it already
//!   transmitted stays in the network and still arrives (packets in flight do not depend on the
//!   sender's state): that is what a receiver's cut-off must stop;
//! - completion channel events fire once per arming, like `ibv_req_notify_cq`;
//! - a CQ overrun panics (the hardware would raise a fatal async event), so sizing bugs are loud.
//!
//! Requests complete at post time (data is copied synchronously), so this says nothing about timing,
//! bandwidth, or the device's limits.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Duration;

use ibverbs_sys as sys;
use kvxfer_core::{BackendError, MemDesc, MemError};

use crate::verbs::{
    ffi_error, Access, Completion, CompletionQueue, CqEvent, Device, DeviceCaps, EventChannel, MemoryRegion, OpenError,
    PortInfo, PostError, ProtectionDomain, QpCaps, QueuePair, SendKind, SendWr, Verbs,
};
use crate::NAME;

/// The model's only device.
pub(crate) const DEVICE: &str = "emulated";

/// The in-process model.
pub(crate) struct Emulated;

impl Verbs for Emulated {
    const EMULATED: bool = true;
    type Context = Context;
    type Pd = Pd;
    type Mr = Mr;
    type Channel = CompChannel;
    type Event = Event;
    type Cq = Cq;
    type Qp = Qp;

    fn status_str(status: u32) -> String {
        match status {
            S_OK => "success",
            S_LOC_LEN => "local length error",
            S_FLUSH => "Work Request Flushed Error",
            S_REM_INV => "remote invalid request error",
            S_REM_ACCESS => "remote access error",
            S_RETRY_EXC => "transport retry counter exceeded",
            _ => "unknown",
        }
        .to_string()
    }
}

const S_OK: u32 = 0;
const S_LOC_LEN: u32 = 1;
const S_FLUSH: u32 = 5;
const S_REM_INV: u32 = 9;
const S_REM_ACCESS: u32 = 10;
const S_RETRY_EXC: u32 = 12;
const OP_SEND: u32 = 0;
const OP_WRITE: u32 = 1;
const OP_RECV: u32 = 128;
const OP_RECV_IMM: u32 = 129;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Default)]
struct Fabric {
    qps: HashMap<u32, Weak<QpShared>>,
    mrs: HashMap<u32, Weak<MrShared>>,
    next_qpn: u32,
    next_key: u32,
    next_pd: u64,
}

fn fabric() -> MutexGuard<'static, Fabric> {
    static F: OnceLock<Mutex<Fabric>> = OnceLock::new();
    lock(F.get_or_init(|| Mutex::new(Fabric { next_qpn: 0x100, next_key: 0x1000, next_pd: 1, ..Default::default() })))
}

/// The emulated device context.
pub(crate) struct Context {
    name: String,
}

impl Device<Emulated> for Context {
    /// Opens the model's device (the only one).
    fn open(wanted: Option<&str>) -> Result<Arc<Context>, OpenError> {
        match wanted {
            Some(w) if w != DEVICE => {
                Err(OpenError::NotFound { wanted: Some(w.to_owned()), available: vec![DEVICE.into()] })
            }
            _ => Ok(Arc::new(Context { name: DEVICE.into() })),
        }
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn query_device(&self) -> Result<DeviceCaps, BackendError> {
        Ok(DeviceCaps { max_qp_wr: 16384, max_sge: 30, max_cqe: 1 << 20, max_mr: 1 << 16 })
    }

    /// Port properties (port 1 only).
    fn query_port(&self, port: u8) -> Result<PortInfo, BackendError> {
        if port != 1 {
            return Err(ffi_error("ibv_query_port", -libc::EINVAL, format!("device {DEVICE} has only port 1")));
        }
        Ok(PortInfo { state: 4, lid: 1, active_mtu: 5, link_layer: crate::attrs::LINK_IB, max_msg_sz: 1 << 31 })
    }

    /// A GID (all zero: the model routes by QP number).
    fn query_gid(&self, _port: u8, _index: u8) -> Result<[u8; 16], BackendError> {
        Ok([0; 16])
    }
}

/// Test hook: invalidates the key of every model registration of memory starting at `addr`, as if
/// the peer's NIC had deregistered it without a revoke (a peer that crashed mid-close). A later
/// RDMA WRITE with that key fails with a remote access error. Returns how many keys it removed.
pub fn invalidate_keys_at(addr: *const u8) -> usize {
    let mut f = fabric();
    let before = f.mrs.len();
    f.mrs.retain(|_, m| m.upgrade().is_some_and(|m| !std::ptr::eq(m.mem.addr(), addr)));
    before - f.mrs.len()
}

/// A request transmitted during a partition, held in the network until [`heal`].
struct OnWire {
    from: Arc<QpShared>,
    dest: u32,
    wr_id: u64,
    signaled: bool,
    kind: SendKind,
    data: Vec<u8>,
    /// The sender's QP entered ERR meanwhile: its completion (a flush) was given already.
    flushed: bool,
}

/// `Some` while the network is partitioned: what was transmitted meanwhile, in order.
fn wire() -> MutexGuard<'static, Option<VecDeque<OnWire>>> {
    static W: OnceLock<Mutex<Option<VecDeque<OnWire>>>> = OnceLock::new();
    lock(W.get_or_init(|| Mutex::new(None)))
}

/// Test hook: partitions the model's network (every endpoint of the process). Requests posted from
/// now on are transmitted but held in the network until [`heal`]; no completion comes for them
/// meanwhile (unless their sender's QP enters ERR, which flushes them at the sender).
pub fn partition() {
    wire().get_or_insert_with(VecDeque::new);
}

/// Test hook: ends a [`partition`]. The held requests arrive in the order they were transmitted and
/// execute against the receiving QP's state now (a QP in ERR drops them; a revoked key fails them).
/// Returns how many were held.
pub fn heal() -> usize {
    let held = wire().take().unwrap_or_default();
    let n = held.len();
    let mut failed: Vec<Arc<QpShared>> = Vec::new();
    for w in held {
        let gone_wrong = failed.iter().any(|f| Arc::ptr_eq(f, &w.from));
        if gone_wrong {
            // Later requests of a sender whose earlier one failed: out of sequence at the receiver.
            if !w.flushed {
                w.from.send_cq.push(completion(w.wr_id, S_FLUSH, send_opcode(&w.kind), w.from.qpn));
            }
            continue;
        }
        let remote = fabric().qps.get(&w.dest).and_then(Weak::upgrade);
        let result = match &remote {
            None => Err(S_RETRY_EXC),
            Some(r) => {
                let mut rs = lock(&r.st);
                let ready = rs.state == sys::ibv_qp_state::IBV_QPS_RTR || rs.state == sys::ibv_qp_state::IBV_QPS_RTS;
                if !ready {
                    Err(S_RETRY_EXC)
                } else if !rs.pending.is_empty() || (needs_recv(&w.kind) && rs.recvs.is_empty()) {
                    if w.flushed {
                        // Receiver not ready and the sender stopped retrying: never executed.
                        continue;
                    }
                    rs.pending.push_back(Inbound {
                        from: w.from.clone(),
                        wr_id: w.wr_id,
                        signaled: w.signaled,
                        kind: w.kind,
                        data: w.data,
                    });
                    continue;
                } else {
                    r.deliver(&mut rs, w.kind, &w.data)
                }
            }
        };
        if w.flushed {
            continue;
        }
        match result {
            Ok(()) if w.signaled => w.from.send_cq.push(completion(w.wr_id, S_OK, send_opcode(&w.kind), w.from.qpn)),
            Ok(()) => {}
            Err(status) => {
                w.from.send_cq.push(completion(w.wr_id, status, send_opcode(&w.kind), w.from.qpn));
                failed.push(w.from.clone());
            }
        }
    }
    for f in failed {
        f.enter_error();
    }
    n
}

/// A protection domain.
pub(crate) struct Pd {
    id: u64,
    _ctx: Arc<Context>,
}

impl ProtectionDomain<Emulated> for Pd {
    fn alloc(ctx: &Arc<Context>) -> Result<Arc<Pd>, BackendError> {
        let mut f = fabric();
        let id = f.next_pd;
        f.next_pd += 1;
        Ok(Arc::new(Pd { id, _ctx: ctx.clone() }))
    }
}

struct MrShared {
    mem: MemDesc,
    pd: u64,
    remote_write: bool,
}

/// How long a model access waits for an overlapping local access (another QP's copy) to finish.
const BUSY_WAIT: Duration = Duration::from_secs(2);

impl MrShared {
    /// Copies `data` in at `offset` (what the NIC's DMA write does), under a write guard.
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), MemError> {
        let start = std::time::Instant::now();
        loop {
            match self.mem.write_guard(offset, data.len() as u64) {
                Ok(mut g) => {
                    g.as_mut_slice().copy_from_slice(data);
                    return Ok(());
                }
                Err(MemError::Busy { .. }) if start.elapsed() < BUSY_WAIT => std::thread::yield_now(),
                Err(e) => return Err(e),
            }
        }
    }

    /// Copies `out.len()` bytes out from `offset` (the NIC's DMA read), under a read guard.
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), MemError> {
        let start = std::time::Instant::now();
        loop {
            match self.mem.read_guard(offset, out.len() as u64) {
                Ok(g) => {
                    out.copy_from_slice(g.as_slice());
                    return Ok(());
                }
                Err(MemError::Busy { .. }) if start.elapsed() < BUSY_WAIT => std::thread::yield_now(),
                Err(e) => return Err(e),
            }
        }
    }
}

/// A registered memory region.
pub(crate) struct Mr {
    shared: Arc<MrShared>,
    addr: u64,
    len: usize,
    key: u32,
    _pd: Arc<Pd>,
}

impl MemoryRegion<Emulated> for Mr {
    fn register(pd: &Arc<Pd>, mem: MemDesc, access: Access) -> Result<Mr, BackendError> {
        let addr = mem.addr() as u64;
        let len = mem.len();
        let shared = Arc::new(MrShared { mem, pd: pd.id, remote_write: access == Access::RemoteWrite });
        let mut f = fabric();
        let key = f.next_key;
        f.next_key += 1;
        f.mrs.insert(key, Arc::downgrade(&shared));
        Ok(Mr { shared, addr, len, key, _pd: pd.clone() })
    }

    fn addr(&self) -> u64 {
        self.addr
    }

    fn len(&self) -> usize {
        self.len
    }

    fn rkey(&self) -> u32 {
        self.key
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // Like ibv_dereg_mr: the key is invalid from now on.
        fabric().mrs.remove(&self.key);
    }
}

/// A completion channel.
pub(crate) struct CompChannel {
    q: Mutex<VecDeque<u64>>,
    cv: Condvar,
    _ctx: Arc<Context>,
}

impl EventChannel<Emulated> for CompChannel {
    fn create(ctx: &Arc<Context>) -> Result<Arc<CompChannel>, BackendError> {
        Ok(Arc::new(CompChannel { q: Mutex::new(VecDeque::new()), cv: Condvar::new(), _ctx: ctx.clone() }))
    }

    fn next_event(&self, timeout: Duration) -> Result<Option<Event>, BackendError> {
        let q = lock(&self.q);
        let (mut q, _) = self.cv.wait_timeout_while(q, timeout, |q| q.is_empty()).unwrap_or_else(|p| p.into_inner());
        Ok(q.pop_front().map(|key| Event { key }))
    }
}

impl CompChannel {
    fn fire(&self, key: u64) {
        lock(&self.q).push_back(key);
        self.cv.notify_all();
    }
}

/// One completion event (acknowledging is a no-op in the model).
pub(crate) struct Event {
    key: u64,
}

impl CqEvent for Event {
    fn key(&self) -> u64 {
        self.key
    }
}

struct CqShared {
    key: u64,
    cap: usize,
    entries: Mutex<VecDeque<Completion>>,
    armed: AtomicBool,
    channel: Arc<CompChannel>,
}

impl CqShared {
    fn push(&self, c: Completion) {
        {
            let mut e = lock(&self.entries);
            e.push_back(c);
            assert!(e.len() <= self.cap, "emulated CQ {} overrun: {} entries > {}", self.key, e.len(), self.cap);
        }
        if self.armed.swap(false, Ordering::SeqCst) {
            self.channel.fire(self.key);
        }
    }
}

/// A completion queue.
pub(crate) struct Cq {
    shared: Arc<CqShared>,
}

impl CompletionQueue<Emulated> for Cq {
    fn create(_ctx: &Arc<Context>, channel: &Arc<CompChannel>, depth: u32, key: u64) -> Result<Arc<Cq>, BackendError> {
        let shared = Arc::new(CqShared {
            key,
            cap: depth as usize,
            entries: Mutex::new(VecDeque::new()),
            armed: AtomicBool::new(true),
            channel: channel.clone(),
        });
        Ok(Arc::new(Cq { shared }))
    }

    fn arm(&self) -> Result<(), BackendError> {
        self.shared.armed.store(true, Ordering::SeqCst);
        Ok(())
    }

    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize, BackendError> {
        let mut e = lock(&self.shared.entries);
        let n = e.len().min(max.max(1));
        out.extend(e.drain(..n));
        Ok(n)
    }
}

struct Recv {
    wr_id: u64,
    mr: Arc<MrShared>,
    offset: u64,
    len: u32,
}

struct Inbound {
    from: Arc<QpShared>,
    wr_id: u64,
    signaled: bool,
    kind: SendKind,
    data: Vec<u8>,
}

struct QpState {
    state: u32,
    dest: u32,
    recvs: VecDeque<Recv>,
    pending: VecDeque<Inbound>,
}

struct QpShared {
    qpn: u32,
    pd: u64,
    send_cq: Arc<CqShared>,
    recv_cq: Arc<CqShared>,
    st: Mutex<QpState>,
}

fn completion(wr_id: u64, status: u32, opcode: u32, qp_num: u32) -> Completion {
    Completion { wr_id, status, vendor_err: 0, opcode, byte_len: 0, imm: None, qp_num }
}

fn send_opcode(kind: &SendKind) -> u32 {
    match kind {
        SendKind::Send => OP_SEND,
        _ => OP_WRITE,
    }
}

fn needs_recv(kind: &SendKind) -> bool {
    !matches!(kind, SendKind::Write { .. })
}

impl QpShared {
    /// Moves to ERR: flushes posted receives and fails requests waiting to be delivered here.
    fn enter_error(self: &Arc<Self>) {
        let (recvs, pending, dest) = {
            let mut st = lock(&self.st);
            st.state = sys::ibv_qp_state::IBV_QPS_ERR;
            (std::mem::take(&mut st.recvs), std::mem::take(&mut st.pending), st.dest)
        };
        for r in recvs {
            self.recv_cq.push(completion(r.wr_id, S_FLUSH, OP_RECV, self.qpn));
        }
        // Requests of ours held in a partitioned network: flushed here, still on their way there.
        if let Some(w) = wire().as_mut() {
            for held in w.iter_mut().filter(|h| Arc::ptr_eq(&h.from, self) && !h.flushed) {
                held.flushed = true;
                self.send_cq.push(completion(held.wr_id, S_FLUSH, send_opcode(&held.kind), self.qpn));
            }
        }
        // Our own requests still waiting at the peer (RNR) are flushed with the send queue.
        let remote = fabric().qps.get(&dest).and_then(Weak::upgrade);
        if let Some(r) = remote.filter(|r| !Arc::ptr_eq(r, self)) {
            let mine: VecDeque<Inbound> = {
                let mut rs = lock(&r.st);
                let (mine, rest) =
                    std::mem::take(&mut rs.pending).into_iter().partition(|p| Arc::ptr_eq(&p.from, self));
                rs.pending = rest;
                mine
            };
            for p in mine {
                self.send_cq.push(completion(p.wr_id, S_FLUSH, send_opcode(&p.kind), self.qpn));
            }
        }
        let mut failed_senders: Vec<Arc<QpShared>> = Vec::new();
        for p in pending {
            let first = !failed_senders.iter().any(|s| Arc::ptr_eq(s, &p.from));
            let status = if first { S_RETRY_EXC } else { S_FLUSH };
            p.from.send_cq.push(completion(p.wr_id, status, send_opcode(&p.kind), p.from.qpn));
            if first {
                failed_senders.push(p.from.clone());
            }
        }
        for s in failed_senders {
            if !Arc::ptr_eq(&s, self) {
                s.enter_error();
            }
        }
    }

    /// Executes one inbound request at this (receiving) QP; `Err(status)` is the sender's status.
    fn deliver(&self, st: &mut QpState, kind: SendKind, data: &[u8]) -> Result<(), u32> {
        match kind {
            SendKind::Write { remote_addr, rkey } => self.write_local(remote_addr, rkey, data),
            SendKind::WriteImm { remote_addr, rkey, imm } => {
                self.write_local(remote_addr, rkey, data)?;
                let r = st.recvs.pop_front().expect("caller checked a receive is posted");
                self.recv_cq.push(Completion {
                    wr_id: r.wr_id,
                    status: S_OK,
                    vendor_err: 0,
                    opcode: OP_RECV_IMM,
                    byte_len: data.len() as u32,
                    imm: Some(imm),
                    qp_num: self.qpn,
                });
                Ok(())
            }
            SendKind::Send => {
                let r = st.recvs.pop_front().expect("caller checked a receive is posted");
                if data.len() > r.len as usize {
                    self.recv_cq.push(completion(r.wr_id, S_LOC_LEN, OP_RECV, self.qpn));
                    return Err(S_REM_INV);
                }
                r.mr.write(r.offset, data).map_err(|_| S_REM_INV)?;
                self.recv_cq.push(Completion {
                    wr_id: r.wr_id,
                    status: S_OK,
                    vendor_err: 0,
                    opcode: OP_RECV,
                    byte_len: data.len() as u32,
                    imm: None,
                    qp_num: self.qpn,
                });
                Ok(())
            }
        }
    }

    fn write_local(&self, remote_addr: u64, rkey: u32, data: &[u8]) -> Result<(), u32> {
        let mr = fabric().mrs.get(&rkey).and_then(Weak::upgrade).ok_or(S_REM_ACCESS)?;
        if !mr.remote_write || mr.pd != self.pd {
            return Err(S_REM_ACCESS);
        }
        let base = mr.mem.addr() as u64;
        let off = remote_addr.checked_sub(base).ok_or(S_REM_ACCESS)?;
        mr.write(off, data).map_err(|_| S_REM_ACCESS)
    }
}

/// An RC queue pair.
pub(crate) struct Qp {
    shared: Arc<QpShared>,
    caps: QpCaps,
    _pd: Arc<Pd>,
    _send_cq: Arc<Cq>,
    _recv_cq: Arc<Cq>,
}

impl QueuePair<Emulated> for Qp {
    /// Creates an RC queue pair in RESET.
    fn create(pd: &Arc<Pd>, send_cq: &Arc<Cq>, recv_cq: &Arc<Cq>, want: QpCaps) -> Result<Qp, BackendError> {
        let mut f = fabric();
        let qpn = f.next_qpn;
        f.next_qpn += 1;
        let shared = Arc::new(QpShared {
            qpn,
            pd: pd.id,
            send_cq: send_cq.shared.clone(),
            recv_cq: recv_cq.shared.clone(),
            st: Mutex::new(QpState {
                state: sys::ibv_qp_state::IBV_QPS_RESET,
                dest: 0,
                recvs: VecDeque::new(),
                pending: VecDeque::new(),
            }),
        });
        f.qps.insert(qpn, Arc::downgrade(&shared));
        Ok(Qp { shared, caps: want, _pd: pd.clone(), _send_cq: send_cq.clone(), _recv_cq: recv_cq.clone() })
    }

    /// Granted sizes (as requested).
    fn caps(&self) -> QpCaps {
        self.caps
    }

    fn qp_num(&self) -> u32 {
        self.shared.qpn
    }

    /// Applies a transition; only RESET→INIT→RTR→RTS and any→ERR are accepted.
    fn modify(&self, attr: &sys::ibv_qp_attr, mask: sys::ibv_qp_attr_mask, what: &str) -> Result<(), BackendError> {
        use sys::ibv_qp_state as S;
        if mask.0 & sys::ibv_qp_attr_mask::IBV_QP_STATE.0 == 0 {
            return Err(ffi_error("ibv_modify_qp", -libc::EINVAL, format!("{what}: no state in the mask")));
        }
        if attr.qp_state == S::IBV_QPS_ERR {
            self.shared.enter_error();
            return Ok(());
        }
        let mut st = lock(&self.shared.st);
        let ok = matches!(
            (st.state, attr.qp_state),
            (S::IBV_QPS_RESET, S::IBV_QPS_INIT) | (S::IBV_QPS_INIT, S::IBV_QPS_RTR) | (S::IBV_QPS_RTR, S::IBV_QPS_RTS)
        );
        if !ok {
            return Err(ffi_error(
                "ibv_modify_qp",
                -libc::EINVAL,
                format!("{what}: transition {} -> {} (qp {})", st.state, attr.qp_state, self.shared.qpn),
            ));
        }
        if attr.qp_state == S::IBV_QPS_RTR {
            st.dest = attr.dest_qp_num;
        }
        st.state = attr.qp_state;
        Ok(())
    }

    /// Executes a chain of send requests in order.
    fn post_send(&self, wrs: &[SendWr<Emulated>]) -> Result<(), PostError> {
        let me = &self.shared;
        let (state, dest) = {
            let st = lock(&me.st);
            (st.state, st.dest)
        };
        if state == sys::ibv_qp_state::IBV_QPS_ERR {
            for wr in wrs {
                me.send_cq.push(completion(wr.wr_id, S_FLUSH, send_opcode(&wr.kind), me.qpn));
            }
            return Ok(());
        }
        let refused = |error| PostError { posted: 0, error };
        if state != sys::ibv_qp_state::IBV_QPS_RTS {
            return Err(refused(ffi_error("ibv_post_send", libc::EINVAL, format!("qp {} is not in RTS", me.qpn))));
        }
        let mut datas = Vec::with_capacity(wrs.len());
        for wr in wrs {
            if wr.sges.len() > self.caps.max_send_sge as usize {
                return Err(refused(ffi_error("ibv_post_send", libc::EINVAL, format!("{} SGEs", wr.sges.len()))));
            }
            let bytes: u64 = wr.sges.iter().map(|s| u64::from(s.len)).sum();
            if wr.inline && bytes > u64::from(self.caps.max_inline) {
                return Err(refused(ffi_error(
                    "ibv_post_send",
                    libc::EINVAL,
                    format!("{bytes} inline bytes > {}", self.caps.max_inline),
                )));
            }
            let mut data = Vec::new();
            for s in &wr.sges {
                let start = data.len();
                data.resize(start + s.len as usize, 0);
                if s.mr.len < (s.offset + u64::from(s.len)) as usize {
                    return Err(refused(BackendError::Protocol {
                        backend: NAME,
                        peer: format!("qp {}", me.qpn),
                        detail: format!("work request {} SGE outside its registration", wr.wr_id),
                    }));
                }
                s.mr.shared.read(s.offset, &mut data[start..]).map_err(|e| {
                    refused(BackendError::Protocol {
                        backend: NAME,
                        peer: format!("qp {}", me.qpn),
                        detail: format!("work request {} SGE: {e}", wr.wr_id),
                    })
                })?;
            }
            datas.push(data);
        }
        if let Some(w) = wire().as_mut() {
            for (wr, data) in wrs.iter().zip(datas) {
                w.push_back(OnWire {
                    from: me.clone(),
                    dest,
                    wr_id: wr.wr_id,
                    signaled: wr.signaled,
                    kind: wr.kind,
                    data,
                    flushed: false,
                });
            }
            return Ok(());
        }
        let remote = fabric().qps.get(&dest).and_then(Weak::upgrade);
        let mut failed = false;
        for (wr, data) in wrs.iter().zip(datas) {
            if failed {
                me.send_cq.push(completion(wr.wr_id, S_FLUSH, send_opcode(&wr.kind), me.qpn));
                continue;
            }
            let result = match &remote {
                None => Err(S_RETRY_EXC),
                Some(r) => {
                    let mut rs = lock(&r.st);
                    let ready =
                        rs.state == sys::ibv_qp_state::IBV_QPS_RTR || rs.state == sys::ibv_qp_state::IBV_QPS_RTS;
                    if !ready {
                        Err(S_RETRY_EXC)
                    } else if !rs.pending.is_empty() || (needs_recv(&wr.kind) && rs.recvs.is_empty()) {
                        // Receiver not ready: the request waits (RNR retry), in order, completing later.
                        rs.pending.push_back(Inbound {
                            from: me.clone(),
                            wr_id: wr.wr_id,
                            signaled: wr.signaled,
                            kind: wr.kind,
                            data,
                        });
                        continue;
                    } else {
                        r.deliver(&mut rs, wr.kind, &data)
                    }
                }
            };
            match result {
                Ok(()) => {
                    if wr.signaled {
                        me.send_cq.push(completion(wr.wr_id, S_OK, send_opcode(&wr.kind), me.qpn));
                    }
                }
                Err(status) => {
                    me.send_cq.push(completion(wr.wr_id, status, send_opcode(&wr.kind), me.qpn));
                    failed = true;
                }
            }
        }
        if failed {
            me.enter_error();
        }
        Ok(())
    }

    /// Nothing to release: the model copies data at post time.
    fn retire_through(&self, _wr_id: u64) {}

    /// Posts one receive buffer, then delivers requests that were waiting for one.
    fn post_recv(&self, wr_id: u64, mr: &Arc<Mr>, offset: u64, len: u32) -> Result<(), BackendError> {
        if offset.checked_add(u64::from(len)).is_none_or(|e| e > mr.len as u64) {
            return Err(ffi_error("ibv_post_recv", libc::EINVAL, "buffer outside its registration"));
        }
        let me = &self.shared;
        let mut failed_senders = Vec::new();
        {
            let mut st = lock(&me.st);
            if st.state == sys::ibv_qp_state::IBV_QPS_ERR {
                drop(st);
                me.recv_cq.push(completion(wr_id, S_FLUSH, OP_RECV, me.qpn));
                return Ok(());
            }
            st.recvs.push_back(Recv { wr_id, mr: mr.shared.clone(), offset, len });
            while let Some(front) = st.pending.front() {
                if needs_recv(&front.kind) && st.recvs.is_empty() {
                    break;
                }
                let inb = st.pending.pop_front().expect("front exists");
                match me.deliver(&mut st, inb.kind, &inb.data) {
                    Ok(()) => {
                        if inb.signaled {
                            inb.from.send_cq.push(completion(inb.wr_id, S_OK, send_opcode(&inb.kind), inb.from.qpn));
                        }
                    }
                    Err(status) => {
                        inb.from.send_cq.push(completion(inb.wr_id, status, send_opcode(&inb.kind), inb.from.qpn));
                        failed_senders.push(inb.from.clone());
                    }
                }
            }
        }
        for s in failed_senders {
            s.enter_error();
        }
        Ok(())
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        fabric().qps.remove(&self.shared.qpn);
        self.shared.enter_error();
    }
}
