//! The endpoint: peers, posting, completions, the handshake listener and the side channels.
//!
//! Threads (std, so the endpoint works under any async runtime and `create` needs none):
//! - the poller sleeps on the completion channel (100 ms ticks to notice shutdown), drains the CQ that
//!   fired, completes writers' waits, retires registrations and turns receive completions into events;
//! - the listener accepts handshake connections (non-blocking accept, 50 ms ticks);
//! - one side-channel thread per peer reads credit and goodbye frames and reports the peer lost when
//!   the connection drops.
//!
//! Async methods never block a runtime thread on the network: `connect` runs its handshake in
//! `spawn_blocking`, and waits for completions, send-queue room and ring credits are futures with the
//! endpoint's deadline.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::io::{ErrorKind, Read};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvxfer_core::{
    BackendConfig, BackendError, BackendEvent, Capabilities, EndpointMetadata, HostBuffer, KvTransferBackend,
    MemRegion, Notification, PeerId, RegionId, WriteOp,
};
use tokio::sync::{mpsc, oneshot, Notify};

use crate::attrs::{self, LocalPort, RemoteQp, Timing};
use crate::ffi::{
    self, Access, CompChannel, Completion, Context, Cq, DeviceCaps, LocalSge, Mr, Pd, PortInfo, Qp, QpCaps, SendKind,
    SendWr,
};
use crate::proto::{Address, Frame, Hello, RemoteRegion, PROTO_VERSION};
use crate::ring::{self, Reassembler, RingRx, RingTx};
use crate::split::{self, Limits};
use crate::{Options, CAPABILITIES, NAME};

/// Out-of-band SEND fragments posted per round (the staging area holds this many).
const OOB_FRAGS: usize = 8;
/// `ibv_port_state` ACTIVE.
const PORT_ACTIVE: u32 = 4;
/// Region id the notification ring is announced under (never a caller's id in practice; only informative).
const RING_REGION: u32 = u32::MAX;
/// `ibv_wc_status` values with special meaning.
const WC_WR_FLUSH_ERR: u32 = 5;
const WC_RETRY_EXC_ERR: u32 = 12;
const WC_RNR_RETRY_EXC_ERR: u32 = 13;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock means a thread panicked while holding it; the data is plain bookkeeping and the
    // panic is already reported, so keep going rather than cascade.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn io_err(context: impl Into<String>, e: impl fmt::Display) -> BackendError {
    BackendError::Io { backend: NAME, context: context.into(), detail: e.to_string() }
}

/// Opens the configured device and checks its port (what `create` does first), then closes it.
pub(crate) fn probe(opts: &Options) -> Result<(), BackendError> {
    open(opts).map(|_| ())
}

fn open(opts: &Options) -> Result<(Arc<Context>, PortInfo, DeviceCaps, [u8; 16]), BackendError> {
    let ctx = Context::open(opts.device.as_deref())
        .map_err(|e| BackendError::NoDevice { backend: NAME, detail: e.to_string() })?;
    let port = ctx.query_port(opts.port).map_err(|e| BackendError::NoDevice {
        backend: NAME,
        detail: format!("device {} has no port {} (KVXFER_VERBS_PORT / option port): {e}", ctx.name(), opts.port),
    })?;
    if port.state != PORT_ACTIVE {
        return Err(BackendError::NoDevice {
            backend: NAME,
            detail: format!(
                "port {} of device {} is in state {} (not ACTIVE); check the link (`ibv_devinfo`)",
                opts.port,
                ctx.name(),
                port.state
            ),
        });
    }
    let caps = ctx.query_device()?;
    let gid = ctx.query_gid(opts.port, opts.gid_index)?;
    if port.link_layer == attrs::LINK_ETHERNET && gid == [0; 16] {
        return Err(BackendError::Config {
            backend: NAME,
            detail: format!(
                "GID index {} of {} port {} is empty; RoCE needs a populated GID (see `show_gids`, set KVXFER_VERBS_GID_INDEX)",
                opts.gid_index,
                ctx.name(),
                opts.port
            ),
        });
    }
    Ok((ctx, port, caps, gid))
}

/// What a work request was, for error messages.
#[derive(Debug, Clone)]
enum WrDesc {
    Write { bytes: u64, src: RegionId, src_offset: u64, dst: RegionId, dst_offset: u64 },
    Fragment { index: usize, of: usize, slot: u32 },
    Send { index: usize, of: usize },
}

impl fmt::Display for WrDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WrDesc::Write { bytes, src, src_offset, dst, dst_offset } => {
                write!(f, "RDMA WRITE of {bytes} bytes from local {src}+{src_offset} to remote {dst}+{dst_offset}")
            }
            WrDesc::Fragment { index, of, slot } => {
                write!(f, "RDMA WRITE WITH IMMEDIATE of notification fragment {}/{of} into ring slot {slot}", index + 1)
            }
            WrDesc::Send { index, of } => write!(f, "SEND of out-of-band notification fragment {}/{of}", index + 1),
        }
    }
}

type Waiter = oneshot::Sender<Result<(), BackendError>>;

struct Outstanding {
    wr_id: u64,
    desc: WrDesc,
    waiter: Option<Waiter>,
}

struct SendState {
    outstanding: VecDeque<Outstanding>,
    in_flight: u32,
    since_signal: u32,
    next_wr_id: u64,
    ring: RingTx,
    /// First error completion; the QP is in the error state after it.
    failed: Option<BackendError>,
    /// Why the peer is gone (side channel lost, goodbye, protocol violation, disconnect).
    lost: Option<String>,
}

struct RecvState {
    ring: RingRx,
    imm: Reassembler,
    send: Reassembler,
}

/// One connected peer: its RC queue pair and everything the connection owns.
struct Peer {
    // Field order is drop order: the QP goes first, then the CQs and registrations it used.
    qp: Qp,
    id: PeerId,
    identity: u64,
    label: String,
    send_cq: Arc<Cq>,
    recv_cq: Arc<Cq>,
    /// Keeps the ring registered (the peer writes into it) for the connection's life.
    _ring_mr: Arc<Mr>,
    ring_buf: HostBuffer,
    recv_mr: Arc<Mr>,
    recv_mem: HostBuffer,
    recv_count: u32,
    recv_size: u32,
    stage_mr: Arc<Mr>,
    stage_buf: HostBuffer,
    remote: Hello,
    remote_regions: HashMap<u32, RemoteRegion>,
    limits: Limits,
    sq_depth: u32,
    send: Mutex<SendState>,
    recv: Mutex<RecvState>,
    wake: Notify,
    post_lock: tokio::sync::Mutex<()>,
    oob_lock: tokio::sync::Mutex<()>,
    tcp: Mutex<TcpStream>,
    closing: AtomicBool,
}

impl Peer {
    fn oob_offset(&self) -> u64 {
        u64::from(self.remote.ring_slots) * u64::from(self.remote.slot_size)
    }

    /// The error a new request gets when the peer cannot take it.
    fn unusable(&self, st: &SendState) -> Option<BackendError> {
        if let Some(reason) = &st.lost {
            return Some(BackendError::PeerLost { backend: NAME, peer: self.label.clone(), detail: reason.clone() });
        }
        st.failed.clone()
    }

    fn error_for(
        &self,
        c: &Completion,
        desc: &WrDesc,
        first: Option<&BackendError>,
        lost: Option<&str>,
    ) -> BackendError {
        let status = ffi::status_str(c.status);
        if c.status == WC_WR_FLUSH_ERR {
            let why = match (first, lost) {
                (Some(e), _) => format!("an earlier request failed: {e}"),
                (None, Some(l)) => format!("the peer was lost: {l}"),
                (None, None) => "the queue pair entered the error state".to_string(),
            };
            return BackendError::PeerLost {
                backend: NAME,
                peer: self.label.clone(),
                detail: format!("work request {} ({desc}) was flushed because {why}", c.wr_id),
            };
        }
        let detail = format!(
            "work request {} ({desc}) to {} completed with {status} (status {}, vendor error 0x{:x}); the queue pair \
             is now in the error state: disconnect and reconnect",
            c.wr_id, self.label, c.status, c.vendor_err
        );
        if c.status == WC_RETRY_EXC_ERR || c.status == WC_RNR_RETRY_EXC_ERR {
            BackendError::PeerLost { backend: NAME, peer: self.label.clone(), detail }
        } else {
            BackendError::Ffi { backend: NAME, call: "ibv_poll_cq", code: i64::from(c.status), detail }
        }
    }

    fn send_frame(&self, f: &Frame) -> std::io::Result<()> {
        f.write_to(&mut *lock(&self.tcp))
    }
}

/// Half of a connection: local resources before the peer's Hello is known.
struct Half {
    qp: Qp,
    key: u64,
    /// Send queue depth the send CQ was sized for (the device may grant a deeper queue; we use no more).
    sq: u32,
    psn: u32,
    send_cq: Arc<Cq>,
    recv_cq: Arc<Cq>,
    ring_mr: Arc<Mr>,
    ring_buf: HostBuffer,
    recv_mr: Arc<Mr>,
    recv_mem: HostBuffer,
    recv_count: u32,
}

struct Inner {
    identity: u64,
    opts: Options,
    ctx: Arc<Context>,
    pd: Arc<Pd>,
    channel: Arc<CompChannel>,
    port: PortInfo,
    local_port: LocalPort,
    gid: [u8; 16],
    caps: DeviceCaps,
    timing: Timing,
    handshake: SocketAddr,
    /// Registered regions; `None` for an empty region (nothing to register with the NIC).
    regions: Mutex<BTreeMap<RegionId, Option<Arc<Mr>>>>,
    peers: Mutex<HashMap<PeerId, Arc<Peer>>>,
    by_key: Mutex<HashMap<u64, Arc<Peer>>>,
    next_peer: AtomicU64,
    next_key: AtomicU64,
    events_tx: mpsc::UnboundedSender<BackendEvent>,
    events_rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<BackendEvent>>,
    shutdown: AtomicBool,
}

/// The verbs endpoint (see the crate docs).
pub struct VerbsBackend {
    inner: Arc<Inner>,
}

impl fmt::Debug for VerbsBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "VerbsBackend({} port {}, handshake {})",
            self.inner.ctx.name(),
            self.inner.opts.port,
            self.inner.handshake
        )
    }
}

impl VerbsBackend {
    /// Opens the device, allocates the protection domain and completion channel, binds the handshake
    /// listener and starts the poller and listener threads.
    pub fn new(config: &BackendConfig) -> Result<Self, BackendError> {
        let opts = Options::from_config(config)?;
        if crate::EMULATED {
            tracing::warn!("kvxfer-verbs was built with the test-only `emulator` feature: this endpoint is an in-process model, not RDMA");
        }
        let (ctx, port, caps, gid) = open(&opts)?;
        let pd = Pd::new(&ctx)?;
        let channel = CompChannel::new(&ctx)?;
        let listener = TcpListener::bind(opts.listen).map_err(|e| {
            io_err(format!("binding the handshake listener on {} (KVXFER_VERBS_LISTEN)", opts.listen), e)
        })?;
        listener.set_nonblocking(true).map_err(|e| io_err("making the handshake listener non-blocking", e))?;
        let handshake = listener.local_addr().map_err(|e| io_err("reading the listener address", e))?;
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        let local_port = LocalPort {
            port_num: opts.port,
            gid_index: opts.gid_index,
            link_layer: port.link_layer,
            active_mtu: port.active_mtu,
        };
        let inner = Arc::new(Inner {
            identity: config.identity,
            opts,
            ctx,
            pd,
            channel,
            port,
            local_port,
            gid,
            caps,
            timing: Timing::default(),
            handshake,
            regions: Mutex::new(BTreeMap::new()),
            peers: Mutex::new(HashMap::new()),
            by_key: Mutex::new(HashMap::new()),
            next_peer: AtomicU64::new(1),
            next_key: AtomicU64::new(1),
            events_tx,
            events_rx: tokio::sync::Mutex::new(events_rx),
            shutdown: AtomicBool::new(false),
        });
        let poller = inner.clone();
        std::thread::Builder::new()
            .name("kvxfer-verbs-poll".into())
            .spawn(move || poller.poll_loop())
            .map_err(|e| io_err("starting the completion poller thread", e))?;
        let acceptor = inner.clone();
        std::thread::Builder::new()
            .name("kvxfer-verbs-listen".into())
            .spawn(move || acceptor.accept_loop(listener))
            .map_err(|e| io_err("starting the handshake listener thread", e))?;
        Ok(Self { inner })
    }
}

impl Drop for VerbsBackend {
    fn drop(&mut self) {
        self.inner.shutdown.store(true, Ordering::SeqCst);
        let peers: Vec<_> = lock(&self.inner.peers).drain().map(|(_, p)| p).collect();
        lock(&self.inner.by_key).clear();
        for p in peers {
            self.inner.close_peer(&p, "the endpoint was dropped");
        }
        // Deregister now rather than when the threads notice the shutdown (in-flight requests keep
        // their own references until they retire).
        lock(&self.inner.regions).clear();
    }
}

impl Inner {
    fn timeout_error(&self, what: impl Into<String>) -> BackendError {
        BackendError::Timeout { backend: NAME, what: what.into(), after: self.opts.timeout }
    }

    fn peer(&self, id: PeerId) -> Result<Arc<Peer>, BackendError> {
        lock(&self.peers).get(&id).cloned().ok_or(BackendError::UnknownPeer { backend: NAME, peer: id })
    }

    fn closed(&self) -> Result<(), BackendError> {
        if self.shutdown.load(Ordering::SeqCst) {
            return Err(BackendError::Closed { backend: NAME });
        }
        Ok(())
    }

    fn address(&self) -> Address {
        Address {
            version: PROTO_VERSION,
            handshake: self.handshake.to_string(),
            device: self.ctx.name().to_owned(),
            port: self.opts.port,
            lid: self.port.lid,
            gid: self.gid,
            link_layer: self.port.link_layer,
            mtu: self.port.active_mtu,
        }
    }

    // ---- connection setup ----

    /// Creates the CQs, the QP (moved to INIT), the ring and the receive buffers (all posted).
    fn new_half(&self) -> Result<Half, BackendError> {
        let o = &self.opts;
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        let max_wr = self.caps.max_qp_wr.max(4);
        let sq = o.sq_depth.min(max_wr);
        let recv_count = (o.ring_slots + OOB_FRAGS as u32 + 8).min(max_wr);
        let cq_max = self.caps.max_cqe.max(8);
        let send_cq = Cq::new(&self.ctx, &self.channel, (sq + 8).min(cq_max), key << 1)?;
        let recv_cq = Cq::new(&self.ctx, &self.channel, (recv_count + 8).min(cq_max), (key << 1) | 1)?;
        let want = QpCaps {
            max_send_wr: sq,
            max_recv_wr: recv_count,
            max_send_sge: o.max_sge.min(self.caps.max_sge.max(1)),
            max_inline: o.max_inline,
        };
        let qp = Qp::new_rc(&self.pd, &send_cq, &recv_cq, want)?;
        let (a, m) = attrs::init(&self.local_port);
        qp.modify(&a, m, "RESET to INIT")?;
        let ring_buf = HostBuffer::zeroed((o.ring_slots * o.slot_size) as usize);
        let ring_mr = Arc::new(Mr::register(&self.pd, ring_buf.region(), Access::RemoteWrite)?);
        let recv_mem = HostBuffer::zeroed(recv_count as usize * o.recv_buf as usize);
        let recv_mr = Arc::new(Mr::register(&self.pd, recv_mem.region(), Access::Local)?);
        for i in 0..recv_count {
            qp.post_recv(u64::from(i), &recv_mr, u64::from(i) * u64::from(o.recv_buf), o.recv_buf)?;
        }
        let psn = rand::random::<u32>() & 0x00ff_ffff;
        Ok(Half { qp, key, sq, psn, send_cq, recv_cq, ring_mr, ring_buf, recv_mr, recv_mem, recv_count })
    }

    fn hello(&self, half: &Half) -> Hello {
        let regions = lock(&self.regions)
            .iter()
            .map(|(id, mr)| match mr {
                Some(mr) => RemoteRegion { id: id.0, addr: mr.addr(), len: mr.len() as u64, rkey: mr.rkey() },
                None => RemoteRegion { id: id.0, addr: 0, len: 0, rkey: 0 },
            })
            .collect();
        Hello {
            version: PROTO_VERSION,
            identity: self.identity,
            qp_num: half.qp.qp_num(),
            psn: half.psn,
            lid: self.port.lid,
            gid: self.gid,
            link_layer: self.port.link_layer,
            mtu: self.port.active_mtu,
            ring: RemoteRegion {
                id: RING_REGION,
                addr: half.ring_mr.addr(),
                len: half.ring_mr.len() as u64,
                rkey: half.ring_mr.rkey(),
            },
            ring_slots: self.opts.ring_slots,
            slot_size: self.opts.slot_size,
            recv_buf: self.opts.recv_buf,
            regions,
        }
    }

    /// Moves the QP to RTR and RTS towards `remote` and builds the peer (not yet published).
    fn finish(&self, half: Half, remote: Hello, tcp: TcpStream, label: String) -> Result<Arc<Peer>, BackendError> {
        let rq = RemoteQp { qp_num: remote.qp_num, psn: remote.psn, lid: remote.lid, gid: remote.gid, mtu: remote.mtu };
        let (a, m) = attrs::rtr(&self.local_port, &rq, &self.timing);
        half.qp.modify(&a, m, &format!("INIT to RTR towards {label}"))?;
        let (a, m) = attrs::rts(half.psn, &self.timing);
        half.qp.modify(&a, m, &format!("RTR to RTS towards {label}"))?;
        let stage_len = remote.ring_slots as usize * remote.slot_size as usize + OOB_FRAGS * remote.recv_buf as usize;
        let stage_buf = HostBuffer::zeroed(stage_len);
        let stage_mr = Arc::new(Mr::register(&self.pd, stage_buf.region(), Access::Local)?);
        let caps = half.qp.caps();
        let limits = Limits {
            max_sge: caps.max_send_sge.max(1) as usize,
            max_msg: if self.port.max_msg_sz == 0 { 1 << 30 } else { u64::from(self.port.max_msg_sz) },
            max_inline: caps.max_inline,
        };
        let remote_regions = remote.regions.iter().map(|r| (r.id, *r)).collect();
        let peer = Peer {
            id: PeerId(self.next_peer.fetch_add(1, Ordering::Relaxed)),
            identity: remote.identity,
            label,
            send_cq: half.send_cq,
            recv_cq: half.recv_cq,
            _ring_mr: half.ring_mr,
            ring_buf: half.ring_buf,
            recv_mr: half.recv_mr,
            recv_mem: half.recv_mem,
            recv_count: half.recv_count,
            recv_size: self.opts.recv_buf,
            stage_mr,
            stage_buf,
            remote_regions,
            limits,
            sq_depth: caps.max_send_wr.min(half.sq).max(1),
            send: Mutex::new(SendState {
                outstanding: VecDeque::new(),
                in_flight: 0,
                since_signal: 0,
                next_wr_id: 1,
                ring: RingTx::new(remote.ring_slots, remote.slot_size),
                failed: None,
                lost: None,
            }),
            recv: Mutex::new(RecvState {
                ring: RingRx::new(self.opts.ring_slots, self.opts.slot_size),
                imm: Reassembler::default(),
                send: Reassembler::default(),
            }),
            remote,
            wake: Notify::new(),
            post_lock: tokio::sync::Mutex::new(()),
            oob_lock: tokio::sync::Mutex::new(()),
            tcp: Mutex::new(tcp),
            closing: AtomicBool::new(false),
            qp: half.qp,
        };
        let peer = Arc::new(peer);
        lock(&self.by_key).insert(half.key, peer.clone());
        Ok(peer)
    }

    fn publish(self: &Arc<Self>, peer: Arc<Peer>, reader: TcpStream) -> PeerId {
        let id = peer.id;
        lock(&self.peers).insert(id, peer.clone());
        let inner = self.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("kvxfer-verbs-peer{}", id.0))
            .spawn(move || inner.side_channel_loop(peer, reader));
        if let Err(e) = spawned {
            tracing::error!(error = %e, "could not start a side-channel thread; peer loss will only show on send errors");
        }
        id
    }

    fn forget_key(&self, peer: &Arc<Peer>) {
        lock(&self.by_key).retain(|_, p| !Arc::ptr_eq(p, peer));
    }

    /// Connecting side of the handshake (blocking; run in `spawn_blocking`).
    fn dial(self: &Arc<Self>, addr: Address, expected_identity: u64) -> Result<PeerId, BackendError> {
        let deadline = Instant::now() + self.opts.timeout;
        let target: SocketAddr = addr.handshake.parse().map_err(|_| BackendError::BadMetadata {
            backend: NAME,
            detail: format!("handshake address {:?}", addr.handshake),
        })?;
        let label = format!("identity {expected_identity} at {target}");
        let conn_err = |detail: String| BackendError::Connect { backend: NAME, peer: label.clone(), detail };
        let stream = TcpStream::connect_timeout(&target, self.opts.timeout)
            .map_err(|e| conn_err(format!("TCP connect to the handshake listener: {e}")))?;
        let _ = stream.set_nodelay(true);
        set_deadline(&stream, deadline).map_err(|e| conn_err(e.to_string()))?;
        let mut s = stream;
        let half = self.new_half()?;
        let key = half.key;
        let result = (|| {
            Frame::Hello(self.hello(&half)).write_to(&mut s).map_err(|e| conn_err(format!("sending hello: {e}")))?;
            let remote =
                match Frame::read_from(&mut s).map_err(|e| conn_err(format!("waiting for the peer's hello: {e}")))? {
                    Frame::Hello(h) => h,
                    Frame::Reject(r) => return Err(conn_err(format!("the peer refused: {r}"))),
                    f => return Err(conn_err(format!("expected a hello, got {f:?}"))),
                };
            remote
                .validate(self.port.link_layer)
                .map_err(|e| BackendError::BadMetadata { backend: NAME, detail: e })?;
            if remote.identity != expected_identity {
                return Err(conn_err(format!(
                    "the metadata names identity {expected_identity} but the endpoint answered as {}",
                    remote.identity
                )));
            }
            let reader = s.try_clone().map_err(|e| conn_err(format!("cloning the side channel: {e}")))?;
            let peer = self.finish(half, remote, s.try_clone().map_err(|e| conn_err(e.to_string()))?, label.clone())?;
            if let Err(e) = Frame::Ready.write_to(&mut s) {
                self.forget_key(&peer);
                return Err(conn_err(format!("sending ready: {e}")));
            }
            clear_deadline(&s);
            Ok(self.publish(peer, reader))
        })();
        if result.is_err() {
            lock(&self.by_key).remove(&key);
        }
        result
    }

    fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        while !self.shutdown.load(Ordering::SeqCst) {
            match listener.accept() {
                Ok((stream, from)) => {
                    let inner = self.clone();
                    let spawned = std::thread::Builder::new()
                        .name("kvxfer-verbs-hs".into())
                        .spawn(move || inner.serve_handshake(stream, from));
                    if let Err(e) = spawned {
                        tracing::warn!(error = %e, %from, "could not start a handshake thread");
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "handshake accept failed");
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }

    /// Listening side of the handshake, then the connection's side-channel loop.
    fn serve_handshake(self: Arc<Self>, stream: TcpStream, from: SocketAddr) {
        let deadline = Instant::now() + self.opts.timeout;
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_nodelay(true);
        if let Err(e) = set_deadline(&stream, deadline) {
            tracing::warn!(error = %e, %from, "handshake socket setup failed");
            return;
        }
        let mut s = stream;
        let remote = match Frame::read_from(&mut s) {
            Ok(Frame::Hello(h)) => h,
            Ok(f) => {
                tracing::warn!(%from, frame = ?f, "handshake did not start with a hello");
                return;
            }
            Err(e) => {
                tracing::warn!(%from, error = %e, "handshake read failed");
                return;
            }
        };
        if let Err(e) = remote.validate(self.port.link_layer) {
            let _ = Frame::Reject(e).write_to(&mut s);
            return;
        }
        let label = format!("identity {} at {from}", remote.identity);
        let setup = |s: &mut TcpStream| -> Result<(Arc<Peer>, TcpStream, u64), BackendError> {
            let half = self.new_half()?;
            let key = half.key;
            let hello = self.hello(&half);
            let writer = s.try_clone().map_err(|e| io_err("cloning the side channel", e))?;
            let reader = s.try_clone().map_err(|e| io_err("cloning the side channel", e))?;
            let peer = self.finish(half, remote, writer, label.clone())?;
            // Our QP is in RTS before the peer learns its number; the peer sends nothing before it is
            // in RTS itself, and we send nothing before its Ready.
            if let Err(e) = Frame::Hello(hello).write_to(s) {
                lock(&self.by_key).remove(&key);
                return Err(io_err("sending hello", e));
            }
            Ok((peer, reader, key))
        };
        let (peer, reader, key) = match setup(&mut s) {
            Ok(x) => x,
            Err(e) => {
                let _ = Frame::Reject(e.to_string()).write_to(&mut s);
                tracing::warn!(%from, error = %e, "handshake failed");
                return;
            }
        };
        match Frame::read_from(&mut s) {
            Ok(Frame::Ready) => {}
            other => {
                tracing::warn!(%from, result = ?other.map(|f| format!("{f:?}")), "peer did not confirm the connection");
                lock(&self.by_key).remove(&key);
                return;
            }
        }
        clear_deadline(&s);
        self.publish(peer, reader);
    }

    // ---- side channel ----

    fn side_channel_loop(self: Arc<Self>, peer: Arc<Peer>, mut reader: TcpStream) {
        let _ = reader.set_read_timeout(Some(Duration::from_millis(200)));
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        let reason = loop {
            if self.shutdown.load(Ordering::SeqCst) || peer.closing.load(Ordering::SeqCst) {
                return;
            }
            match reader.read(&mut chunk) {
                Ok(0) => {
                    break "the side channel was closed (the peer process exited or dropped its endpoint)".to_string()
                }
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {
                    continue
                }
                Err(e) => break format!("the side channel failed: {e}"),
            }
            let mut stop = None;
            loop {
                match crate::proto::take_frame(&mut buf) {
                    Ok(None) => break,
                    Ok(Some(Frame::Credit(n))) => {
                        let r = lock(&peer.send).ring.credit(n);
                        peer.wake.notify_waiters();
                        if let Err(e) = r {
                            stop = Some(format!("protocol violation: {e}"));
                            break;
                        }
                    }
                    Ok(Some(Frame::Bye(r))) => {
                        stop = Some(format!("the peer disconnected: {r}"));
                        break;
                    }
                    Ok(Some(f)) => {
                        stop = Some(format!("protocol violation: unexpected {f:?} on the side channel"));
                        break;
                    }
                    Err(e) => {
                        stop = Some(format!("protocol violation on the side channel: {e}"));
                        break;
                    }
                }
            }
            if let Some(r) = stop {
                break r;
            }
        };
        self.lose(&peer, reason);
    }

    /// Marks a peer lost (once), flushes its QP and reports it.
    fn lose(&self, peer: &Arc<Peer>, reason: String) {
        if peer.closing.load(Ordering::SeqCst) {
            return;
        }
        {
            let mut st = lock(&peer.send);
            if st.lost.is_some() {
                return;
            }
            st.lost = Some(reason.clone());
        }
        let (a, m) = attrs::error();
        if let Err(e) = peer.qp.modify(&a, m, "to ERR after losing the peer") {
            tracing::warn!(error = %e, peer = %peer.label, "could not flush the queue pair");
        }
        peer.wake.notify_waiters();
        tracing::info!(peer = %peer.label, %reason, "peer lost");
        let _ = self.events_tx.send(BackendEvent::PeerLost { identity: peer.identity, reason });
    }

    /// Tears a connection down from our side: goodbye, fail waiters, flush.
    fn close_peer(&self, peer: &Arc<Peer>, why: &str) {
        if peer.closing.swap(true, Ordering::SeqCst) {
            return;
        }
        let _ = peer.send_frame(&Frame::Bye(why.to_owned()));
        let _ = lock(&peer.tcp).shutdown(Shutdown::Both);
        let (a, m) = attrs::error();
        let _ = peer.qp.modify(&a, m, "to ERR on disconnect");
        let mut st = lock(&peer.send);
        if st.lost.is_none() {
            st.lost = Some(format!("disconnected locally: {why}"));
        }
        for r in st.outstanding.drain(..) {
            if let Some(w) = r.waiter {
                let _ = w.send(Err(BackendError::PeerLost {
                    backend: NAME,
                    peer: peer.label.clone(),
                    detail: format!("work request {} ({}) abandoned: {why}", r.wr_id, r.desc),
                }));
            }
        }
        st.in_flight = 0;
        drop(st);
        peer.wake.notify_waiters();
    }

    // ---- completions ----

    fn poll_loop(self: Arc<Self>) {
        let mut wcs = Vec::with_capacity(64);
        while !self.shutdown.load(Ordering::SeqCst) {
            let ev = match self.channel.next_event(Duration::from_millis(100)) {
                Ok(Some(ev)) => ev,
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "completion channel");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            let key = ev.key();
            // Look the owner up before acknowledging (see CqEvent).
            let peer = lock(&self.by_key).get(&(key >> 1)).cloned();
            drop(ev);
            let Some(peer) = peer else { continue };
            let is_recv = key & 1 == 1;
            let cq = if is_recv { &peer.recv_cq } else { &peer.send_cq };
            if let Err(e) = cq.arm() {
                tracing::warn!(error = %e, peer = %peer.label, "re-arming a completion queue");
            }
            loop {
                wcs.clear();
                match cq.poll(&mut wcs, 64) {
                    Ok(0) => break,
                    Ok(_) => {
                        for c in &wcs {
                            if is_recv {
                                self.on_recv(&peer, c);
                            } else {
                                self.on_send(&peer, c);
                            }
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, peer = %peer.label, "polling a completion queue");
                        break;
                    }
                }
            }
        }
    }

    fn on_send(&self, peer: &Arc<Peer>, c: &Completion) {
        let mut st = lock(&peer.send);
        let Some(pos) = st.outstanding.iter().position(|r| r.wr_id == c.wr_id) else {
            drop(st);
            peer.qp.retire_through(c.wr_id);
            return;
        };
        let done: Vec<Outstanding> = st.outstanding.drain(..=pos).collect();
        st.in_flight = st.in_flight.saturating_sub(done.len() as u32);
        let mut failure = None;
        for r in done {
            let res = if r.wr_id == c.wr_id && !c.ok() {
                let e = peer.error_for(c, &r.desc, st.failed.as_ref(), st.lost.as_deref());
                if st.failed.is_none() && c.status != WC_WR_FLUSH_ERR {
                    st.failed = Some(e.clone());
                }
                failure = Some(e.clone());
                Err(e)
            } else {
                // Completions arrive in post order: everything before a reported request is done.
                Ok(())
            };
            if let Some(w) = r.waiter {
                let _ = w.send(res);
            }
        }
        drop(st);
        peer.qp.retire_through(c.wr_id);
        peer.wake.notify_waiters();
        if let Some(e) = failure {
            tracing::warn!(error = %e, "work request failed");
        }
    }

    fn on_recv(&self, peer: &Arc<Peer>, c: &Completion) {
        if !c.ok() {
            if c.status != WC_WR_FLUSH_ERR {
                self.lose(
                    peer,
                    format!("receive completion error: {} (status {})", ffi::status_str(c.status), c.status),
                );
            }
            return;
        }
        let idx = c.wr_id;
        let outcome: Result<Option<Vec<u8>>, String> = if c.is_recv_imm() {
            let mut rs = lock(&peer.recv);
            let r = match rs.ring.accept(c.imm.unwrap_or(0), c.byte_len) {
                Ok(f) => {
                    let mut bytes = vec![0u8; f.len];
                    match peer.ring_buf.region().read(f.offset, &mut bytes) {
                        Ok(()) => rs.imm.push(&bytes, f.more).map_err(|e| e.0),
                        Err(e) => Err(e.to_string()),
                    }
                }
                Err(e) => Err(e.0),
            };
            let credit = rs.ring.credit_due();
            drop(rs);
            if let Some(n) = credit {
                if let Err(e) = peer.send_frame(&Frame::Credit(n)) {
                    tracing::debug!(error = %e, peer = %peer.label, "credit report not sent");
                }
            }
            r
        } else if c.is_recv_send() {
            let len = (c.byte_len as usize).min(peer.recv_size as usize);
            let mut bytes = vec![0u8; len];
            let off = idx * u64::from(peer.recv_size);
            match peer.recv_mem.region().read(off, &mut bytes) {
                Ok(()) => match ring::parse_send(&bytes) {
                    Ok((more, payload)) => lock(&peer.recv).send.push(payload, more).map_err(|e| e.0),
                    Err(e) => Err(e.0),
                },
                Err(e) => Err(e.to_string()),
            }
        } else {
            Err(format!("unexpected receive completion opcode {}", c.opcode))
        };
        if idx < u64::from(peer.recv_count) {
            let off = idx * u64::from(peer.recv_size);
            if let Err(e) = peer.qp.post_recv(idx, &peer.recv_mr, off, peer.recv_size) {
                self.lose(peer, format!("reposting a receive buffer failed: {e}"));
                return;
            }
        }
        match outcome {
            Ok(None) => {}
            Ok(Some(msg)) => match Notification::decode(&msg) {
                Ok(n) => {
                    let _ = self.events_tx.send(BackendEvent::Notification(n));
                }
                Err(e) => tracing::warn!(error = %e, peer = %peer.label, "dropping an undecodable notification"),
            },
            Err(e) => self.lose(peer, format!("protocol violation: {e}")),
        }
    }

    // ---- posting ----

    /// Waits until `ready` holds for the peer's send state (or the peer fails, or the deadline passes).
    async fn wait_until(
        &self,
        peer: &Peer,
        deadline: tokio::time::Instant,
        what: &str,
        ready: impl Fn(&SendState) -> bool,
    ) -> Result<(), BackendError> {
        loop {
            let notified = peer.wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let st = lock(&peer.send);
                if let Some(e) = peer.unusable(&st) {
                    return Err(e);
                }
                if ready(&st) {
                    return Ok(());
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(self.timeout_error(format!("{what} for {}", peer.label)));
            }
        }
    }

    /// Posts `wrs` (ids assigned here) with the signalling policy; the last one carries `waiter`.
    fn post(&self, peer: &Peer, mut wrs: Vec<(SendWr, WrDesc)>, waiter: Option<Waiter>) -> Result<(), BackendError> {
        let mut st = lock(&peer.send);
        if let Some(e) = peer.unusable(&st) {
            return Err(e);
        }
        let n = wrs.len();
        let mut waiter = waiter;
        let mut raw = Vec::with_capacity(n);
        for (i, (mut wr, desc)) in wrs.drain(..).enumerate() {
            wr.wr_id = st.next_wr_id;
            st.next_wr_id += 1;
            st.since_signal += 1;
            wr.signaled = i + 1 == n || st.since_signal >= self.opts.signal_every;
            if wr.signaled {
                st.since_signal = 0;
            }
            let w = if i + 1 == n { waiter.take() } else { None };
            st.outstanding.push_back(Outstanding { wr_id: wr.wr_id, desc, waiter: w });
            raw.push(wr);
        }
        st.in_flight += n as u32;
        if let Err(e) = peer.qp.post_send(&raw) {
            // Treat a refused post as fatal for the connection: flush what was accepted.
            if st.failed.is_none() {
                st.failed = Some(e.clone());
            }
            drop(st);
            let (a, m) = attrs::error();
            let _ = peer.qp.modify(&a, m, "to ERR after a failed post");
            return Err(e);
        }
        Ok(())
    }

    async fn write(&self, peer_id: PeerId, ops: &[WriteOp], notify: Option<&Notification>) -> Result<(), BackendError> {
        self.closed()?;
        let peer = self.peer(peer_id)?;
        // Validate everything before any byte moves.
        let mut srcs: Vec<Option<Arc<Mr>>> = Vec::with_capacity(ops.len());
        let mut dsts: Vec<RemoteRegion> = Vec::with_capacity(ops.len());
        {
            let regions = lock(&self.regions);
            for op in ops {
                let mr = regions.get(&op.src).ok_or(BackendError::UnknownRegion {
                    backend: NAME,
                    region: op.src,
                    peer: None,
                })?;
                let src_len = mr.as_ref().map_or(0, |m| m.len() as u64);
                op.check_src(NAME, Some(peer_id), src_len)?;
                let dst = peer.remote_regions.get(&op.dst.0).ok_or(BackendError::UnknownRegion {
                    backend: NAME,
                    region: op.dst,
                    peer: Some(peer_id),
                })?;
                op.check_dst(NAME, Some(peer_id), dst.len)?;
                srcs.push(mr.clone());
                dsts.push(*dst);
            }
        }
        let encoded =
            notify.map(|n| n.encode()).transpose().map_err(|source| BackendError::Codec { backend: NAME, source })?;
        {
            let st = lock(&peer.send);
            if let Some(e) = peer.unusable(&st) {
                return Err(e);
            }
        }
        let plans = split::split_ops(ops, &peer.limits);
        let slot_size = peer.remote.slot_size as usize;
        let frags = encoded.as_ref().map(|b| ring::fragments(b.len(), slot_size)).unwrap_or_default();
        let total = plans.len() + frags.len();
        if total == 0 {
            return Ok(());
        }
        let deadline = tokio::time::Instant::now() + self.opts.timeout;
        let (tx, rx) = oneshot::channel();
        let mut tx = Some(tx);
        {
            let _posting = tokio::time::timeout_at(deadline, peer.post_lock.lock())
                .await
                .map_err(|_| self.timeout_error(format!("waiting to post to {}", peer.label)))?;
            let batch_max = (peer.sq_depth / 4).max(1) as usize;
            let mut next = 0usize;
            // If this future fails or is dropped after some fragments of the notification were posted
            // but not the last, the receiver's reassembly would splice the next notification onto them:
            // the guard marks the connection failed instead.
            let mut cut = FragmentGuard { peer: &peer, posted: 0, of: frags.len() };
            while next < total {
                self.wait_until(&peer, deadline, "send queue room", |st| st.in_flight < peer.sq_depth).await?;
                let is_frag = next >= plans.len();
                if is_frag {
                    self.wait_until(&peer, deadline, "notification ring credit", |st| st.ring.free() > 0).await?;
                }
                let mut batch = Vec::new();
                {
                    let mut st = lock(&peer.send);
                    let room = (peer.sq_depth - st.in_flight.min(peer.sq_depth)) as usize;
                    while next < total && batch.len() < batch_max.min(room) {
                        if next < plans.len() {
                            let p = &plans[next];
                            let op = &ops[p.op];
                            // Plans exist only for non-empty ranges, which the bounds check refuses for an
                            // empty (unregistered) region.
                            let mr = srcs[p.op].as_ref().expect("a non-empty range lies in a registered region");
                            let dst = &dsts[p.op];
                            let sges = p
                                .pieces
                                .iter()
                                .map(|pc| LocalSge { mr: mr.clone(), offset: pc.src_offset, len: pc.len })
                                .collect();
                            batch.push((
                                SendWr {
                                    wr_id: 0,
                                    kind: SendKind::Write { remote_addr: dst.addr + p.dst_offset, rkey: dst.rkey },
                                    sges,
                                    signaled: false,
                                    inline: p.inline,
                                },
                                WrDesc::Write {
                                    bytes: p.len,
                                    src: op.src,
                                    src_offset: p.pieces[0].src_offset,
                                    dst: op.dst,
                                    dst_offset: p.dst_offset,
                                },
                            ));
                        } else {
                            let fi = next - plans.len();
                            let (s, e, more) = frags[fi];
                            let Some(g) = st.ring.grant(e - s, more) else { break };
                            let bytes = &encoded.as_ref().expect("fragments imply an encoding")[s..e];
                            let stage_off = g.offset;
                            if let Err(err) = peer.stage_buf.region().write(stage_off, bytes) {
                                return Err(BackendError::Protocol {
                                    backend: NAME,
                                    peer: peer.label.clone(),
                                    detail: format!("staging a notification fragment: {err}"),
                                });
                            }
                            batch.push((
                                SendWr {
                                    wr_id: 0,
                                    kind: SendKind::WriteImm {
                                        remote_addr: peer.remote.ring.addr + g.offset,
                                        rkey: peer.remote.ring.rkey,
                                        imm: g.imm,
                                    },
                                    sges: vec![LocalSge {
                                        mr: peer.stage_mr.clone(),
                                        offset: stage_off,
                                        len: (e - s) as u32,
                                    }],
                                    signaled: false,
                                    inline: (e - s) as u64 <= u64::from(peer.limits.max_inline),
                                },
                                WrDesc::Fragment { index: fi, of: frags.len(), slot: g.slot },
                            ));
                        }
                        next += 1;
                    }
                }
                if batch.is_empty() {
                    continue;
                }
                let w = if next == total { tx.take() } else { None };
                self.post(&peer, batch, w)?;
                cut.posted = next.saturating_sub(plans.len());
            }
        }
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(BackendError::PeerLost {
                backend: NAME,
                peer: peer.label.clone(),
                detail: "the connection was torn down before the write completed".into(),
            }),
            Err(_) => Err(self.timeout_error(format!("{total} work requests to {}", peer.label))),
        }
    }

    async fn notify(&self, peer_id: PeerId, n: &Notification) -> Result<(), BackendError> {
        self.closed()?;
        let peer = self.peer(peer_id)?;
        let bytes = n.encode().map_err(|source| BackendError::Codec { backend: NAME, source })?;
        let frag = peer.remote.recv_buf as usize - 1;
        let frags = ring::fragments(bytes.len(), frag);
        let deadline = tokio::time::Instant::now() + self.opts.timeout;
        let _oob = tokio::time::timeout_at(deadline, peer.oob_lock.lock())
            .await
            .map_err(|_| self.timeout_error(format!("waiting to send to {}", peer.label)))?;
        let of = frags.len();
        for (round_no, round) in frags.chunks(OOB_FRAGS).enumerate() {
            let (tx, rx) = oneshot::channel();
            {
                let _posting = tokio::time::timeout_at(deadline, peer.post_lock.lock())
                    .await
                    .map_err(|_| self.timeout_error(format!("waiting to post to {}", peer.label)))?;
                let need = round.len() as u32;
                self.wait_until(&peer, deadline, "send queue room", |st| {
                    peer.sq_depth - st.in_flight.min(peer.sq_depth) >= need
                })
                .await?;
                let mut batch = Vec::with_capacity(round.len());
                for (j, &(s, e, more)) in round.iter().enumerate() {
                    let off = peer.oob_offset() + (j as u64) * u64::from(peer.remote.recv_buf);
                    let mut frame = Vec::with_capacity(e - s + 1);
                    frame.push(ring::send_header(more));
                    frame.extend_from_slice(&bytes[s..e]);
                    peer.stage_buf.region().write(off, &frame).map_err(|err| BackendError::Protocol {
                        backend: NAME,
                        peer: peer.label.clone(),
                        detail: format!("staging a SEND fragment: {err}"),
                    })?;
                    batch.push((
                        SendWr {
                            wr_id: 0,
                            kind: SendKind::Send,
                            sges: vec![LocalSge { mr: peer.stage_mr.clone(), offset: off, len: frame.len() as u32 }],
                            signaled: false,
                            inline: frame.len() as u64 <= u64::from(peer.limits.max_inline),
                        },
                        WrDesc::Send { index: round_no * OOB_FRAGS + j, of },
                    ));
                }
                self.post(&peer, batch, Some(tx))?;
            }
            match tokio::time::timeout_at(deadline, rx).await {
                Ok(Ok(r)) => r?,
                Ok(Err(_)) => {
                    return Err(BackendError::PeerLost {
                        backend: NAME,
                        peer: peer.label.clone(),
                        detail: "the connection was torn down before the notification was sent".into(),
                    })
                }
                Err(_) => return Err(self.timeout_error(format!("an out-of-band notification to {}", peer.label))),
            }
        }
        Ok(())
    }
}

/// Marks the connection failed if a notification's fragments were only partly posted.
struct FragmentGuard<'a> {
    peer: &'a Peer,
    posted: usize,
    of: usize,
}

impl Drop for FragmentGuard<'_> {
    fn drop(&mut self) {
        if self.posted > 0 && self.posted < self.of {
            let mut st = lock(&self.peer.send);
            if st.failed.is_none() {
                st.failed = Some(BackendError::Protocol {
                    backend: NAME,
                    peer: self.peer.label.clone(),
                    detail: format!(
                        "a notification was cut off after fragment {} of {}; the connection cannot carry \
                         notifications any more: disconnect and reconnect",
                        self.posted, self.of
                    ),
                });
            }
            drop(st);
            self.peer.wake.notify_waiters();
        }
    }
}

fn set_deadline(s: &TcpStream, deadline: Instant) -> std::io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    s.set_read_timeout(Some(left))?;
    s.set_write_timeout(Some(left))
}

fn clear_deadline(s: &TcpStream) {
    let _ = s.set_read_timeout(None);
    let _ = s.set_write_timeout(Some(Duration::from_secs(5)));
}

#[async_trait::async_trait]
impl KvTransferBackend for VerbsBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn register(&self, id: RegionId, mem: MemRegion) -> Result<(), BackendError> {
        self.inner.closed()?;
        let mut regions = lock(&self.inner.regions);
        if regions.contains_key(&id) {
            return Err(BackendError::RegionInUse { backend: NAME, region: id });
        }
        // Some providers refuse to register zero bytes; an empty region needs no registration.
        let mr =
            if mem.is_empty() { None } else { Some(Arc::new(Mr::register(&self.inner.pd, mem, Access::RemoteWrite)?)) };
        regions.insert(id, mr);
        Ok(())
    }

    fn deregister(&self, id: RegionId) -> Result<(), BackendError> {
        // In-flight requests keep their registration alive until they complete (see ffi::Qp).
        lock(&self.inner.regions).remove(&id).map(|_| ()).ok_or(BackendError::UnknownRegion {
            backend: NAME,
            region: id,
            peer: None,
        })
    }

    fn metadata(&self) -> Result<EndpointMetadata, BackendError> {
        self.inner.closed()?;
        Ok(EndpointMetadata::new(NAME, self.inner.identity, self.inner.address().to_payload()))
    }

    async fn connect(&self, peer: &EndpointMetadata) -> Result<PeerId, BackendError> {
        self.inner.closed()?;
        peer.check(NAME)?;
        let addr = Address::from_payload(&peer.payload)
            .map_err(|detail| BackendError::BadMetadata { backend: NAME, detail })?;
        if addr.link_layer != self.inner.port.link_layer {
            return Err(BackendError::BadMetadata {
                backend: NAME,
                detail: format!(
                    "peer's link layer is {} and ours is {} (1 InfiniBand, 2 Ethernet)",
                    addr.link_layer, self.inner.port.link_layer
                ),
            });
        }
        let inner = self.inner.clone();
        let identity = peer.identity;
        tokio::task::spawn_blocking(move || inner.dial(addr, identity))
            .await
            .map_err(|e| io_err("the handshake task", e))?
    }

    async fn write(&self, peer: PeerId, ops: &[WriteOp], notify: Option<&Notification>) -> Result<(), BackendError> {
        self.inner.write(peer, ops, notify).await
    }

    async fn notify(&self, peer: PeerId, notification: &Notification) -> Result<(), BackendError> {
        self.inner.notify(peer, notification).await
    }

    async fn recv(&self, max_wait: Duration) -> Result<Vec<BackendEvent>, BackendError> {
        let mut rx = self.inner.events_rx.lock().await;
        let mut out = Vec::new();
        match tokio::time::timeout(max_wait, rx.recv()).await {
            Ok(Some(e)) => out.push(e),
            Ok(None) => return Err(BackendError::Closed { backend: NAME }),
            Err(_) => return Ok(out),
        }
        while let Ok(e) = rx.try_recv() {
            out.push(e);
        }
        Ok(out)
    }

    async fn disconnect(&self, peer: PeerId) -> Result<(), BackendError> {
        let p = lock(&self.inner.peers).remove(&peer).ok_or(BackendError::UnknownPeer { backend: NAME, peer })?;
        self.inner.forget_key(&p);
        self.inner.close_peer(&p, "disconnect requested");
        Ok(())
    }
}
