//! The endpoint: registrations, peers, the handshake listener, the side channels and the poller.
//!
//! Threads (std, so the endpoint works under any async runtime and `create` needs none):
//! - the poller sleeps on the completion channel (100 ms ticks to notice shutdown), drains the CQ that
//!   fired, settles transfers and turns receive completions into events;
//! - the listener accepts handshake connections (non-blocking accept, 50 ms ticks), each on a thread
//!   of its own within `max_handshakes` in total and `max_handshakes_per_source` per source address
//!   until it authenticated (one beyond is answered at once with a `Reject` naming the limit), and
//!   each with `handshake_timeout_ms` from its accept to its authentication;
//! - one side-channel thread per peer reads credit, revoke and goodbye frames and reports the peer
//!   lost when the connection drops.
//!
//! Async methods never block a runtime thread on the device or the network: `register` pins pages
//! and a closing registration deregisters them in `spawn_blocking`, `connect` runs its handshake
//! there too, and every wait (notify, disconnect, revoke acknowledgements) has the endpoint's deadline.
//!
//! Authentication (see the README): every handshake starts with the exchange of [`proto::Open`],
//! [`proto::Challenge`] and [`Frame::Auth`]; no queue pair, ring or region of either side is
//! announced before it passed. With a cluster secret, a notification whose key is not the identity
//! its connection proved is dropped, counted ([`Counters::forged`]), and its sender lost and refused.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::io::{ErrorKind, Read};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvxfer_core::toolkit::{Drained, EventQueue, Fragmenter, PeerTable, Reassembler, RegionTable};
use kvxfer_core::{
    BackendError, BackendEvent, BoxFuture, Capabilities, CloseRegistration, CutOff, EndpointMetadata, HostBuffer,
    KvTransferBackend, Limits, MemDesc, Notification, PeerId, RegionId, Registration, Secret, Transfer, TransferState,
    TransferStatus, WriteOp,
};
use tokio::sync::Notify;

use crate::attrs::{self, LocalPort, RemoteQp, Timing};
use crate::limits::{HandshakeLimits, LimitRefusal, RefusalCounters, Slot};
use crate::proto::{self, Address, Challenge, Frame, Hello, Open, RemoteRegion, PROTO_VERSION};
use crate::ring::{self, RingRx, RingTx};
use crate::transfer::{
    lock, plan_writes, Aborter, Job, Peer, Pending, RecvState, SendState, WrDesc, WrLimits, OOB_FRAGS, RING_SOURCE,
    SEND_SOURCE,
};
use crate::verbs::{
    Access, Completion, CompletionQueue, CqEvent, Device, DeviceCaps, EventChannel, LocalSge, MemoryRegion, PortInfo,
    ProtectionDomain, QpCaps, QueuePair, SendKind, SendWr, Verbs,
};
use crate::{Settings, NAME};

/// `ibv_port_state` ACTIVE.
const PORT_ACTIVE: u32 = 4;
/// Region id the notification ring is announced under (informative only).
const RING_REGION: u32 = u32::MAX;
/// `ibv_wc_status` WR_FLUSH_ERR.
const WC_WR_FLUSH_ERR: u32 = 5;
/// Incomplete notifications a connection keeps while reassembling.
const MAX_PENDING_NOTIFICATIONS: usize = 64;

/// What every authentication refusal tells the operator to do.
const AUTH_FIX: &str = "configure the same cluster secret (KVXFER_SECRET or a secret file) on every rank";

/// Counters of an endpoint that outlive no one: shared with [`crate::VerbsBackend`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// Notifications dropped because their key was not the identity their connection proved.
    pub forged: AtomicU64,
    /// Incoming connections refused before their authentication, by reason.
    pub refusals: RefusalCounters,
}

fn io_err(context: impl Into<String>, e: impl fmt::Display) -> BackendError {
    BackendError::Io { backend: NAME, context: context.into(), detail: e.to_string() }
}

/// Opens the configured device and checks its port (what `create` does first), then closes it.
pub(crate) fn probe<V: Verbs>(opts: &Settings) -> Result<(), BackendError> {
    open::<V>(opts).map(|_| ())
}

/// An open device with its port checked.
struct Opened<V: Verbs> {
    ctx: Arc<V::Context>,
    port: PortInfo,
    caps: DeviceCaps,
    gid: [u8; 16],
}

fn open<V: Verbs>(opts: &Settings) -> Result<Opened<V>, BackendError> {
    let wanted = if V::EMULATED { None } else { opts.device.as_deref() };
    let ctx = V::Context::open(wanted).map_err(|e| BackendError::NoDevice { backend: NAME, detail: e.to_string() })?;
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
    Ok(Opened { ctx, port, caps, gid })
}

/// Half of a connection: local resources before the peer's Hello is known.
struct Half<V: Verbs> {
    qp: V::Qp,
    key: u64,
    /// Send queue depth the send CQ was sized for (the device may grant a deeper queue; we use no more).
    sq: u32,
    psn: u32,
    send_cq: Arc<V::Cq>,
    recv_cq: Arc<V::Cq>,
    ring_mr: Arc<V::Mr>,
    ring_mem: MemDesc,
    recv_mr: Arc<V::Mr>,
    recv_mem: MemDesc,
    recv_count: u32,
}

/// A closing registration waiting for the peers' acknowledgements of its revoke.
#[derive(Default)]
struct RevokeWait {
    /// Keys of the peers that have not answered yet.
    pending: Mutex<HashSet<u64>>,
    done: Notify,
}

impl RevokeWait {
    fn answered(&self, key: u64) {
        let mut p = lock(&self.pending);
        p.remove(&key);
        if p.is_empty() {
            self.done.notify_waiters();
        }
    }

    async fn wait(&self, deadline: Instant) -> bool {
        loop {
            let mut done = std::pin::pin!(self.done.notified());
            done.as_mut().enable();
            if lock(&self.pending).is_empty() {
                return true;
            }
            if tokio::time::timeout_at(deadline.into(), done).await.is_err() {
                return lock(&self.pending).is_empty();
            }
        }
    }
}

pub(crate) struct Inner<V: Verbs> {
    identity: u64,
    /// Random per endpoint: which incarnation of `identity` this is (bound into the proofs).
    instance: u64,
    /// The cluster secret; `None`: nothing is authenticated.
    secret: Option<Secret>,
    counters: Arc<Counters>,
    /// Incoming connections before their authentication, bounded in total and per source.
    limits: HandshakeLimits,
    /// (identity, instance) of peers refused for this endpoint's life (a forged notification).
    refused: Mutex<HashSet<(u64, u64)>>,
    /// (identity, instance) of peers this endpoint cut off ([`KvTransferBackend::cut_off`]): no
    /// handshake of theirs passes, in either direction. Held while a connection joins the peer table,
    /// so a cut-off either sees the connection (and moves its QP to ERR) or the connection sees it.
    cut: Mutex<HashSet<(u64, u64)>>,
    /// Peer ids of connections closed by a cut-off (a later cut-off of one of them is confirmed at once).
    cut_ids: Mutex<HashSet<PeerId>>,
    opts: Settings,
    ctx: Arc<V::Context>,
    pd: Arc<V::Pd>,
    channel: Arc<V::Channel>,
    port: PortInfo,
    local_port: LocalPort,
    gid: [u8; 16],
    caps: DeviceCaps,
    capabilities: Capabilities,
    timing: Timing,
    handshake: SocketAddr,
    regions: RegionTable,
    /// NIC registrations of the regions in `regions` (`None`: an empty region, nothing registered).
    mrs: Mutex<HashMap<RegionId, Option<Arc<V::Mr>>>>,
    peers: PeerTable<Peer<V>>,
    by_key: Mutex<HashMap<u64, Arc<Peer<V>>>>,
    next_key: AtomicU64,
    events: EventQueue,
    revokes: Mutex<HashMap<u64, Arc<RevokeWait>>>,
    next_revoke: AtomicU64,
    shutdown: AtomicBool,
}

/// The verbs endpoint (see the crate docs), on libibverbs or on the in-process model.
pub(crate) struct Endpoint<V: Verbs> {
    inner: Arc<Inner<V>>,
}

impl<V: Verbs> fmt::Debug for Endpoint<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "VerbsEndpoint({} port {}, handshake {})",
            self.inner.ctx.name(),
            self.inner.opts.port,
            self.inner.handshake
        )
    }
}

/// Opens an endpoint on verbs implementation `V`; returns it and its counters.
pub(crate) fn create<V: Verbs>(
    identity: u64,
    secret: Option<Secret>,
    opts: Settings,
) -> Result<(Arc<dyn KvTransferBackend>, Arc<Counters>), BackendError> {
    let ep = Endpoint::<V>::new(identity, secret, opts)?;
    let counters = ep.inner.counters.clone();
    Ok((Arc::new(ep), counters))
}

impl<V: Verbs> Endpoint<V> {
    /// Opens the device, allocates the protection domain and completion channel, binds the handshake
    /// listener and starts the poller and listener threads.
    fn new(identity: u64, secret: Option<Secret>, opts: Settings) -> Result<Self, BackendError> {
        if V::EMULATED {
            tracing::warn!("kvxfer-verbs endpoint on the test-only in-process verbs model (device=emulated), not RDMA");
        }
        let Opened { ctx, port, caps, gid } = open::<V>(&opts)?;
        let pd = V::Pd::alloc(&ctx)?;
        let channel = V::Channel::create(&ctx)?;
        let listener = TcpListener::bind(opts.listen).map_err(|e| {
            io_err(format!("binding the handshake listener on {} (KVXFER_VERBS_LISTEN)", opts.listen), e)
        })?;
        listener.set_nonblocking(true).map_err(|e| io_err("making the handshake listener non-blocking", e))?;
        let handshake = listener.local_addr().map_err(|e| io_err("reading the listener address", e))?;
        let local_port = LocalPort {
            port_num: opts.port,
            gid_index: opts.gid_index,
            link_layer: port.link_layer,
            active_mtu: port.active_mtu,
        };
        // Each connection registers three buffers of its own; leave the device room for them.
        let max_regions = opts.max_regions.min(u64::from(caps.max_mr / 2).max(1));
        let limits = Limits::new(
            opts.max_ops_per_post,
            crate::max_notification_bytes(opts.slot_size.min(opts.recv_buf)),
            max_regions,
        );
        // The model's fabric is one process: its endpoints cannot reach another one.
        let reach = !V::EMULATED;
        let mut capabilities = crate::CAPABILITIES.with_limits(limits);
        capabilities.cross_process = reach;
        capabilities.cross_host = reach;
        let inner = Arc::new(Inner {
            identity,
            instance: rand::random(),
            secret,
            counters: Arc::new(Counters::default()),
            limits: HandshakeLimits::new(opts.max_handshakes, opts.max_handshakes_per_source, "handshake_timeout_ms"),
            refused: Mutex::new(HashSet::new()),
            cut: Mutex::new(HashSet::new()),
            cut_ids: Mutex::new(HashSet::new()),
            ctx,
            pd,
            channel,
            port,
            local_port,
            gid,
            caps,
            capabilities,
            timing: Timing::default(),
            handshake,
            regions: RegionTable::new(NAME, max_regions),
            mrs: Mutex::new(HashMap::new()),
            peers: PeerTable::new(NAME),
            by_key: Mutex::new(HashMap::new()),
            next_key: AtomicU64::new(1),
            events: EventQueue::new(),
            revokes: Mutex::new(HashMap::new()),
            next_revoke: AtomicU64::new(1),
            shutdown: AtomicBool::new(false),
            opts,
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

impl<V: Verbs> Drop for Endpoint<V> {
    fn drop(&mut self) {
        let inner = &self.inner;
        inner.shutdown.store(true, Ordering::SeqCst);
        for (_, p) in inner.peers.drain() {
            inner.close_peer(&p, "the endpoint was dropped");
            // The QP is in the error state: nothing more is sent; the poller stops now, so no
            // completion will settle what is left.
            p.abandon("the endpoint was dropped");
        }
        lock(&inner.by_key).clear();
        for (_, w) in lock(&inner.revokes).drain() {
            lock(&w.pending).clear();
            w.done.notify_waiters();
        }
    }
}

impl<V: Verbs> Inner<V> {
    fn closed(&self) -> Result<(), BackendError> {
        if self.shutdown.load(Ordering::SeqCst) {
            return Err(BackendError::Closed { backend: NAME });
        }
        Ok(())
    }

    fn timeout_error(&self, what: impl Into<String>) -> BackendError {
        BackendError::Timeout { backend: NAME, what: what.into(), after: self.opts.timeout }
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

    // ---- registrations ----

    /// Makes region `id` unknown to new operations; returns the drain of the operations holding it.
    fn unregister(&self, id: RegionId) -> Option<Drained> {
        let mut mrs = lock(&self.mrs);
        mrs.remove(&id);
        self.regions.remove(id).ok()
    }

    /// Tells every usable peer to forget region `id`; returns what to wait on for their answers.
    fn revoke(&self, id: RegionId) -> (u64, Arc<RevokeWait>) {
        let seq = self.next_revoke.fetch_add(1, Ordering::Relaxed);
        let wait = Arc::new(RevokeWait::default());
        // Only connections past their handshake: a frame must not land between Hello and Ready. (A
        // peer still in its handshake may hold the key from our Hello; its writes with it fail at the
        // NIC once the region is deregistered.)
        let peers: Vec<_> = self
            .peers
            .all()
            .into_iter()
            .filter(|(_, p)| {
                p.ready.load(Ordering::SeqCst) && !p.closing.load(Ordering::SeqCst) && lock(&p.send).lost.is_none()
            })
            .collect();
        lock(&wait.pending).extend(peers.iter().map(|(_, p)| p.key));
        lock(&self.revokes).insert(seq, wait.clone());
        for (_, p) in peers {
            if let Err(e) = p.send_frame(&Frame::Revoke { seq, region: id.0 }) {
                tracing::debug!(error = %e, peer = %p.label, "revoke not sent; the peer is going away");
                wait.answered(p.key);
            }
        }
        (seq, wait)
    }

    /// A peer is gone: closing registrations stop waiting for its answer.
    fn forget_in_revokes(&self, key: u64) {
        for w in lock(&self.revokes).values() {
            w.answered(key);
        }
    }

    // ---- connection setup ----

    /// Creates the CQs, the QP (moved to INIT), the ring and the receive buffers (all posted).
    fn new_half(&self) -> Result<Half<V>, BackendError> {
        let o = &self.opts;
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        let max_wr = self.caps.max_qp_wr.max(4);
        let sq = o.sq_depth.min(max_wr);
        let recv_count = (o.ring_slots + OOB_FRAGS as u32 + 8).min(max_wr);
        let cq_max = self.caps.max_cqe.max(8);
        let send_cq = V::Cq::create(&self.ctx, &self.channel, (sq + 8).min(cq_max), key << 1)?;
        let recv_cq = V::Cq::create(&self.ctx, &self.channel, (recv_count + 8).min(cq_max), (key << 1) | 1)?;
        let want = QpCaps {
            max_send_wr: sq,
            max_recv_wr: recv_count,
            max_send_sge: o.max_sge.min(self.caps.max_sge.max(1)),
            max_inline: o.max_inline,
        };
        let qp = V::Qp::create(&self.pd, &send_cq, &recv_cq, want)?;
        let (a, m) = attrs::init(&self.local_port);
        qp.modify(&a, m, "RESET to INIT")?;
        let ring_mem = HostBuffer::zeroed((o.ring_slots * o.slot_size) as usize).desc();
        let ring_mr = Arc::new(V::Mr::register(&self.pd, ring_mem.clone(), Access::RemoteWrite)?);
        let recv_mem = HostBuffer::zeroed(recv_count as usize * o.recv_buf as usize).desc();
        let recv_mr = Arc::new(V::Mr::register(&self.pd, recv_mem.clone(), Access::Local)?);
        for i in 0..recv_count {
            qp.post_recv(u64::from(i), &recv_mr, u64::from(i) * u64::from(o.recv_buf), o.recv_buf)?;
        }
        let psn = rand::random::<u32>() & 0x00ff_ffff;
        Ok(Half { qp, key, sq, psn, send_cq, recv_cq, ring_mr, ring_mem, recv_mr, recv_mem, recv_count })
    }

    fn hello(&self, half: &Half<V>) -> Hello {
        let regions = lock(&self.mrs)
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

    /// Moves the QP to RTR and RTS towards `remote` and adds the peer (completions find it from now
    /// on; the caller publishes it or takes it back).
    fn finish(
        &self,
        half: Half<V>,
        remote: Hello,
        instance: u64,
        tcp: TcpStream,
        label: String,
    ) -> Result<Arc<Peer<V>>, BackendError> {
        if let Some(why) = self.cut_refusal(remote.identity, instance) {
            return Err(BackendError::Connect { backend: NAME, peer: label, detail: why });
        }
        let rq = RemoteQp { qp_num: remote.qp_num, psn: remote.psn, lid: remote.lid, gid: remote.gid, mtu: remote.mtu };
        let (a, m) = attrs::rtr(&self.local_port, &rq, &self.timing);
        half.qp.modify(&a, m, &format!("INIT to RTR towards {label}"))?;
        let (a, m) = attrs::rts(half.psn, &self.timing);
        half.qp.modify(&a, m, &format!("RTR to RTS towards {label}"))?;
        let stage_len = remote.ring_slots as usize * remote.slot_size as usize + OOB_FRAGS * remote.recv_buf as usize;
        let stage_mem = HostBuffer::zeroed(stage_len).desc();
        let stage_mr = Arc::new(V::Mr::register(&self.pd, stage_mem.clone(), Access::Local)?);
        let caps = half.qp.caps();
        let limits = WrLimits {
            max_sge: caps.max_send_sge.max(1) as usize,
            max_msg: if self.port.max_msg_sz == 0 { 1 << 30 } else { u64::from(self.port.max_msg_sz) },
            max_inline: caps.max_inline,
        };
        let sq_depth = caps.max_send_wr.min(half.sq).max(1);
        let id = self.peers.reserve();
        let peer = Peer {
            id,
            key: half.key,
            identity: remote.identity,
            instance,
            refused: AtomicBool::new(false),
            label,
            send_cq: half.send_cq,
            recv_cq: half.recv_cq,
            _ring_mr: half.ring_mr,
            ring_mem: half.ring_mem,
            recv_mr: half.recv_mr,
            recv_mem: half.recv_mem,
            recv_count: half.recv_count,
            recv_size: self.opts.recv_buf,
            stage_mr,
            stage_mem,
            remote_regions: Mutex::new(remote.regions.iter().map(|r| (r.id, *r)).collect()),
            limits,
            sq_depth,
            signal_every: self.opts.signal_every.min(sq_depth / 2).max(1),
            ring_frag: Fragmenter::new(remote.slot_size as usize),
            oob_frag: Fragmenter::new(remote.recv_buf as usize),
            send: Mutex::new(SendState::new(RingTx::new(remote.ring_slots, remote.slot_size))),
            recv: Mutex::new(RecvState {
                ring: RingRx::new(self.opts.ring_slots, self.opts.slot_size),
                reasm: Reassembler::new(ring::MAX_MESSAGE, MAX_PENDING_NOTIFICATIONS),
            }),
            remote,
            idle: Notify::new(),
            oob_lock: tokio::sync::Mutex::new(()),
            tcp: Mutex::new(tcp),
            ready: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            qp: half.qp,
        };
        {
            // Under the cut-off lock: a cut-off of this instance either finds the connection in the
            // table or is seen here.
            let cut = lock(&self.cut);
            if cut.contains(&(peer.identity, instance)) {
                drop(cut);
                let (a, m) = attrs::error();
                let _ = <V::Qp as QueuePair<V>>::modify(&peer.qp, &a, m, "to ERR: cut off during its handshake");
                return Err(BackendError::Connect {
                    backend: NAME,
                    peer: peer.label.clone(),
                    detail: cut_refusal(peer.identity, instance),
                });
            }
            self.peers.insert_at(id, peer);
        }
        let peer = self.peers.get(id)?;
        lock(&self.by_key).insert(half.key, peer.clone());
        Ok(peer)
    }

    /// Takes back a peer whose handshake did not complete.
    fn withdraw(&self, peer: &Arc<Peer<V>>) {
        let _ = self.peers.remove(peer.id);
        self.forget_key(peer);
    }

    fn publish(self: &Arc<Self>, peer: Arc<Peer<V>>, reader: TcpStream) -> PeerId {
        let id = peer.id;
        peer.ready.store(true, Ordering::SeqCst);
        let inner = self.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("kvxfer-verbs-peer{}", id.0))
            .spawn(move || inner.side_channel_loop(peer, reader));
        if let Err(e) = spawned {
            tracing::error!(error = %e, "could not start a side-channel thread; peer loss will only show on send errors");
        }
        id
    }

    fn forget_key(&self, peer: &Arc<Peer<V>>) {
        lock(&self.by_key).remove(&peer.key);
    }

    /// Connecting side of the handshake (blocking; run in `spawn_blocking`): the authentication
    /// exchange, then the hellos, then ready.
    fn dial(self: &Arc<Self>, addr: Address, expected_identity: u64) -> Result<PeerId, BackendError> {
        let deadline = Instant::now() + self.opts.timeout;
        let target: SocketAddr = addr.handshake.parse().map_err(|_| BackendError::BadMetadata {
            backend: NAME,
            detail: format!("handshake address {:?}", addr.handshake),
        })?;
        let label = format!("identity {expected_identity} at {target}");
        let conn_err = |detail: String| BackendError::Connect { backend: NAME, peer: label.clone(), detail };
        let mut s = TcpStream::connect_timeout(&target, self.opts.timeout)
            .map_err(|e| conn_err(format!("TCP connect to the handshake listener: {e}")))?;
        let _ = s.set_nodelay(true);
        set_deadline(&s, deadline).map_err(|e| conn_err(e.to_string()))?;
        let instance = self.authenticate(&mut s, expected_identity).map_err(conn_err)?;
        let half = self.new_half()?;
        Frame::Hello(self.hello(&half)).write_to(&mut s).map_err(|e| conn_err(format!("sending hello: {e}")))?;
        let remote =
            match Frame::read_from(&mut s).map_err(|e| conn_err(format!("waiting for the peer's hello: {e}")))? {
                Frame::Hello(h) => h,
                Frame::Reject(r) => return Err(conn_err(format!("the peer refused: {r}"))),
                f => return Err(conn_err(format!("expected a hello, got {f:?}"))),
            };
        remote.validate(self.port.link_layer).map_err(|e| BackendError::BadMetadata { backend: NAME, detail: e })?;
        if remote.identity != expected_identity {
            return Err(conn_err(format!(
                "the metadata names identity {expected_identity} but the endpoint answered as {}",
                remote.identity
            )));
        }
        let reader = s.try_clone().map_err(|e| conn_err(format!("cloning the side channel: {e}")))?;
        let tcp = s.try_clone().map_err(|e| conn_err(e.to_string()))?;
        let peer = self.finish(half, remote, instance, tcp, label.clone())?;
        if let Err(e) = Frame::Ready.write_to(&mut s) {
            self.withdraw(&peer);
            return Err(conn_err(format!("sending ready: {e}")));
        }
        // The acceptor's Ready: it counts us as a peer now, so a region it closes from here on is
        // revoked at us (returning before it, a close right after `connect` could resolve while
        // our first writes were still landing).
        match Frame::read_from(&mut s) {
            Ok(Frame::Ready) => {}
            Ok(Frame::Reject(r)) => {
                self.withdraw(&peer);
                return Err(conn_err(format!("the peer refused: {r}")));
            }
            Ok(f) => {
                self.withdraw(&peer);
                return Err(conn_err(format!("expected the peer's ready, got {f:?}")));
            }
            Err(e) => {
                self.withdraw(&peer);
                return Err(conn_err(format!("waiting for the peer's ready: {e}")));
            }
        }
        clear_deadline(&s);
        Ok(self.publish(peer, reader))
    }

    /// The connector's part of the exchange (open, challenge, auth); returns the acceptor's instance.
    /// A refusal is told to the acceptor (so it stops waiting) and returned with what to do.
    fn authenticate(&self, s: &mut TcpStream, expected_identity: u64) -> Result<u64, String> {
        let nonce = kvxfer_core::secret::nonce().map_err(|e| format!("drawing a challenge nonce: {e}"))?;
        let open = Open { version: PROTO_VERSION, identity: self.identity, instance: self.instance, nonce };
        Frame::Open(open.clone()).write_to(s).map_err(|e| format!("sending open: {e}"))?;
        let challenge = match Frame::read_bounded(s, proto::MAX_AUTH_FRAME)
            .map_err(|e| format!("waiting for the peer's challenge: {e}"))?
        {
            Frame::Challenge(c) => c,
            Frame::Reject(r) => return Err(format!("the peer refused: {r}")),
            f => return Err(format!("expected a challenge, got {f:?}")),
        };
        let refuse = |s: &mut TcpStream, why: String| {
            let _ = Frame::Reject(why.clone()).write_to(s);
            Err(why)
        };
        if challenge.identity != expected_identity {
            let why = format!(
                "the metadata names identity {expected_identity} but the endpoint answered as {}",
                challenge.identity
            );
            return refuse(s, why);
        }
        if lock(&self.refused).contains(&(challenge.identity, challenge.instance)) {
            return refuse(s, "this endpoint refused the peer after a forged notification".to_owned());
        }
        if let Some(why) = self.cut_refusal(challenge.identity, challenge.instance) {
            return refuse(s, why);
        }
        let x = proto::exchange(&open, &challenge);
        let proof = match (&self.secret, &challenge.proof) {
            (None, None) => None,
            (Some(secret), Some(p)) if x.verify_acceptor(secret, p) => Some(x.connector_proof(secret)),
            (Some(_), Some(_)) => {
                let why = "authentication failed: the peer did not prove this endpoint's cluster secret (the secrets \
                           differ)";
                return refuse(s, format!("{why}; {AUTH_FIX}"));
            }
            (None, Some(_)) => {
                let why = "authentication required: the peer has a cluster secret and this endpoint none";
                return refuse(s, format!("{why}; {AUTH_FIX}"));
            }
            (Some(_), None) => {
                let why = "authentication failed: the peer has no cluster secret and cannot prove one";
                return refuse(s, format!("{why}; {AUTH_FIX}"));
            }
        };
        Frame::Auth(proof).write_to(s).map_err(|e| format!("sending auth: {e}"))?;
        Ok(challenge.instance)
    }

    fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        while !self.shutdown.load(Ordering::SeqCst) {
            match listener.accept() {
                Ok((stream, from)) => match self.limits.admit(from.ip()) {
                    Ok(slot) => {
                        let inner = self.clone();
                        let spawned = std::thread::Builder::new()
                            .name("kvxfer-verbs-hs".into())
                            .spawn(move || inner.serve_handshake(stream, from, slot));
                        if let Err(e) = spawned {
                            tracing::warn!(error = %e, %from, "could not start a handshake thread");
                        }
                    }
                    Err(why) => self.refuse_at_limit(stream, from, why),
                },
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

    /// Answers a connection beyond a limit at once with a `Reject` naming it, on the listener's
    /// thread (a fresh socket's send buffer takes the frame whole; the write is bounded anyway), and
    /// closes it. The write side is shut first, so the connector sees the refusal and then an end of
    /// stream (a FIN) even if its own bytes arrive later and the close turns into a reset; what it
    /// already sent is read off before the close (seen in CI: without the shutdown, an open that
    /// landed between the drain and the close made the close a bare reset).
    fn refuse_at_limit(&self, mut stream: TcpStream, from: SocketAddr, why: LimitRefusal) {
        self.counters.refusals.limit(&why);
        tracing::warn!(%from, reason = %why, "handshake connection refused at a limit");
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
        let _ = Frame::Reject(why.to_string()).write_to(&mut stream);
        let _ = stream.shutdown(Shutdown::Write);
        if stream.set_nonblocking(true).is_ok() {
            let mut sink = [0u8; 4096];
            for _ in 0..4 {
                if !matches!(stream.read(&mut sink), Ok(n) if n > 0) {
                    break;
                }
            }
        }
    }

    /// Listening side of the handshake, then the connection's side-channel loop. `slot` is the
    /// connection's place among those not authenticated yet, given back once it authenticated.
    fn serve_handshake(self: Arc<Self>, stream: TcpStream, from: SocketAddr, slot: Slot) {
        let accepted = Instant::now();
        let deadline = accepted + self.opts.timeout;
        let unauthenticated = accepted + self.opts.handshake_timeout.min(self.opts.timeout);
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_nodelay(true);
        if let Err(e) = set_deadline(&stream, unauthenticated) {
            tracing::warn!(error = %e, %from, "handshake socket setup failed");
            return;
        }
        let mut s = stream;
        let open = self.challenge(&mut s, from, unauthenticated);
        drop(slot);
        let Some(open) = open else { return };
        if let Err(e) = set_deadline(&s, deadline) {
            tracing::warn!(error = %e, %from, "handshake socket setup failed");
            return;
        }
        let remote = match Frame::read_from(&mut s) {
            Ok(Frame::Hello(h)) if h.identity == open.identity => h,
            Ok(Frame::Hello(h)) => {
                let why = format!(
                    "the hello names identity {} but the connection authenticated as {}",
                    h.identity, open.identity
                );
                let _ = Frame::Reject(why).write_to(&mut s);
                return;
            }
            Ok(f) => {
                tracing::warn!(%from, frame = ?f, "expected the peer's hello after its authentication");
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
        let setup = |s: &mut TcpStream| -> Result<(Arc<Peer<V>>, TcpStream), BackendError> {
            let half = self.new_half()?;
            let hello = self.hello(&half);
            let writer = s.try_clone().map_err(|e| io_err("cloning the side channel", e))?;
            let reader = s.try_clone().map_err(|e| io_err("cloning the side channel", e))?;
            let peer = self.finish(half, remote, open.instance, writer, label.clone())?;
            // Our QP is in RTS before the peer learns its number; the peer sends nothing before it is
            // in RTS itself, and we send nothing before its Ready.
            if let Err(e) = Frame::Hello(hello).write_to(s) {
                self.withdraw(&peer);
                return Err(io_err("sending hello", e));
            }
            Ok((peer, reader))
        };
        let (peer, reader) = match setup(&mut s) {
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
                self.withdraw(&peer);
                return;
            }
        }
        // Our Ready. The peer is marked ready first, under the side channel's writer lock: a revoke
        // that sees it not ready started before the connector could read this Ready (so before its
        // `connect` returned); one that sees it ready queues its frame on the writer lock, after
        // this Ready. (Marked after the write, a close right after `connect` returned could find the
        // peer not ready yet and resolve while its first writes were still landing: seen under load.)
        let confirmed = {
            let mut w = lock(&peer.tcp);
            peer.ready.store(true, Ordering::SeqCst);
            let r = Frame::Ready.write_to(&mut *w);
            if r.is_err() {
                peer.ready.store(false, Ordering::SeqCst);
            }
            r
        };
        if let Err(e) = confirmed {
            tracing::warn!(%from, error = %e, "could not confirm the connection");
            self.withdraw(&peer);
            return;
        }
        clear_deadline(&s);
        self.publish(peer, reader);
    }

    /// The acceptor's part of the exchange: reads the open, answers the challenge, checks the
    /// connector's proof. Returns the open once the connector may go on (with a secret: proved it);
    /// `None` when the connection was refused (told to the connector with the reason) or dropped.
    /// Every read is bounded by `until` as a whole (see [`Until`]); one cut off by it is counted.
    fn challenge(&self, s: &mut TcpStream, from: SocketAddr, until: Instant) -> Option<Open> {
        let refusals = &self.counters.refusals;
        let refuse = |s: &mut TcpStream, why: String| {
            refusals.rejected.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%from, reason = %why, "connection refused");
            let _ = Frame::Reject(why).write_to(s);
            None
        };
        let timed_out = |e: &std::io::Error| {
            if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
                refusals.timed_out.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    %from,
                    "not authenticated within {:?} (handshake_timeout_ms); closing",
                    self.opts.handshake_timeout.min(self.opts.timeout)
                );
                true
            } else {
                false
            }
        };
        let open = match Frame::read_bounded(&mut Until { s, deadline: until }, proto::MAX_AUTH_FRAME) {
            Ok(Frame::Open(o)) => o,
            Ok(Frame::Hello(_)) => {
                let why = format!(
                    "the peer started with a hello: this endpoint speaks verbs handshake version {PROTO_VERSION}, \
                     which starts with the authentication exchange (run the same kvxfer build on every rank)"
                );
                return refuse(s, why);
            }
            Ok(f) => {
                tracing::warn!(%from, frame = ?f, "handshake did not start with an open");
                return None;
            }
            Err(e) => {
                if !timed_out(&e) {
                    tracing::warn!(%from, error = %e, "handshake read failed");
                }
                return None;
            }
        };
        if open.version != PROTO_VERSION {
            return refuse(s, format!("handshake version {} (this build speaks {PROTO_VERSION})", open.version));
        }
        if lock(&self.refused).contains(&(open.identity, open.instance)) {
            let why = format!(
                "this endpoint refused identity {:#x} (this instance of it) after a forged notification",
                open.identity
            );
            return refuse(s, why);
        }
        if let Some(why) = self.cut_refusal(open.identity, open.instance) {
            return refuse(s, why);
        }
        let nonce = match kvxfer_core::secret::nonce() {
            Ok(n) => n,
            Err(e) => return refuse(s, format!("the accepting endpoint could not draw a challenge nonce: {e}")),
        };
        let mut challenge = Challenge { identity: self.identity, instance: self.instance, nonce, proof: None };
        let x = proto::exchange(&open, &challenge);
        challenge.proof = self.secret.as_ref().map(|secret| x.acceptor_proof(secret));
        if let Err(e) = Frame::Challenge(challenge).write_to(s) {
            tracing::warn!(%from, error = %e, "sending the challenge failed");
            return None;
        }
        let proof = match Frame::read_bounded(&mut Until { s, deadline: until }, proto::MAX_AUTH_FRAME) {
            Ok(Frame::Auth(p)) => p,
            Ok(Frame::Reject(r)) => {
                tracing::info!(%from, reason = %r, "the connecting endpoint gave up the connection");
                return None;
            }
            Ok(f) => {
                tracing::warn!(%from, frame = ?f, "expected the peer's auth");
                return None;
            }
            Err(e) => {
                if !timed_out(&e) {
                    tracing::warn!(%from, error = %e, "waiting for the peer's auth failed");
                }
                return None;
            }
        };
        match (&self.secret, proof) {
            // Without a secret nothing is checked (a connector with one refused our challenge).
            (None, _) => Some(open),
            (Some(secret), Some(p)) if x.verify_connector(secret, &p) => Some(open),
            (Some(_), _) => {
                let why = format!(
                    "authentication failed: the connecting endpoint (identity {:#x}) did not prove this endpoint's \
                     cluster secret; {AUTH_FIX}",
                    open.identity
                );
                refuse(s, why)
            }
        }
    }

    // ---- side channel ----

    fn side_channel_loop(self: Arc<Self>, peer: Arc<Peer<V>>, mut reader: TcpStream) {
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
            let stop = loop {
                match crate::proto::take_frame(&mut buf) {
                    Ok(None) => break None,
                    Ok(Some(Frame::Credit(n))) => {
                        let r = peer.with_send(|st| {
                            let r = st.ring.credit(n);
                            peer.pump(st);
                            r
                        });
                        if let Err(e) = r {
                            break Some(format!("protocol violation: {e}"));
                        }
                    }
                    Ok(Some(Frame::Revoke { seq, region })) => peer.revoke(seq, region),
                    Ok(Some(Frame::RevokeAck(seq))) => {
                        if let Some(w) = lock(&self.revokes).get(&seq) {
                            w.answered(peer.key);
                        }
                    }
                    Ok(Some(Frame::Bye(r))) => break Some(format!("the peer disconnected: {r}")),
                    Ok(Some(f)) => break Some(format!("protocol violation: unexpected {f:?} on the side channel")),
                    Err(e) => break Some(format!("protocol violation on the side channel: {e}")),
                }
            };
            if let Some(r) = stop {
                break r;
            }
        };
        self.lose(&peer, reason);
    }

    /// Marks a peer lost (once), flushes its QP and reports it. Posted requests end with the flush;
    /// queued ones fail at once.
    fn lose(&self, peer: &Arc<Peer<V>>, reason: String) {
        if peer.closing.load(Ordering::SeqCst) {
            return;
        }
        let first = peer.with_send(|st| {
            if st.lost.is_some() {
                return false;
            }
            st.lost = Some(reason.clone());
            peer.fail_unposted(st);
            true
        });
        if !first {
            return;
        }
        let (a, m) = attrs::error();
        if let Err(e) = peer.qp.modify(&a, m, "to ERR after losing the peer") {
            tracing::warn!(error = %e, peer = %peer.label, "could not flush the queue pair");
        }
        self.forget_in_revokes(peer.key);
        tracing::info!(peer = %peer.label, %reason, "peer lost");
        self.events.push(BackendEvent::PeerLost { identity: peer.identity, reason });
    }

    /// A peer that proved its identity sent a notification keyed with another one: it is not
    /// delivered, counted, the peer is refused for this endpoint's life (this instance of it), its
    /// connection failed and told why, and `PeerLost` names the forged key.
    fn refuse_forged(&self, peer: &Arc<Peer<V>>, n: &Notification) {
        self.counters.forged.fetch_add(1, Ordering::Relaxed);
        peer.refused.store(true, Ordering::SeqCst);
        lock(&self.refused).insert((peer.identity, peer.instance));
        let reason = format!(
            "forged notification refused: {} proved identity {:#x} but keyed a notification of request {} with \
             sender {} ({:#x}); its connection was closed and it is refused",
            peer.label,
            peer.identity,
            n.request,
            n.sender,
            n.sender.to_u64()
        );
        tracing::warn!(peer = %peer.label, "{reason}");
        self.lose(peer, reason.clone());
        let _ = peer.send_frame(&Frame::Bye(reason));
        let _ = lock(&peer.tcp).shutdown(Shutdown::Both);
    }

    /// Why a handshake with (`identity`, `instance`) is refused: this endpoint cut that instance off.
    fn cut_refusal(&self, identity: u64, instance: u64) -> Option<String> {
        lock(&self.cut).contains(&(identity, instance)).then(|| cut_refusal(identity, instance))
    }

    /// Cuts one connection of a cut-off instance: its QP to ERR (from the `ibv_modify_qp`'s return
    /// on, the NIC places none of the writes that arrive on it), its side channel shut (no more
    /// frames either way, no goodbye), unposted requests dropped; posted ones end with their flush
    /// completions. No loss is reported: the caller gave up on the peer already. Returns how many
    /// jobs were not final.
    fn cut_peer(&self, peer: &Arc<Peer<V>>, why: &str) -> Result<usize, BackendError> {
        // First: the side-channel loop and `lose` then leave the peer alone.
        peer.closing.store(true, Ordering::SeqCst);
        let (a, m) = attrs::error();
        peer.qp.modify(&a, m, &format!("to ERR: cutting off {}", peer.label))?;
        let jobs = peer.cut(&format!("cut off: {why}"));
        let _ = lock(&peer.tcp).shutdown(Shutdown::Both);
        self.forget_in_revokes(peer.key);
        Ok(jobs)
    }

    /// Tears a connection down from our side: goodbye, flush (posted requests end with their flush
    /// completions), fail what was not posted.
    fn close_peer(&self, peer: &Arc<Peer<V>>, why: &str) {
        if peer.closing.swap(true, Ordering::SeqCst) {
            return;
        }
        let _ = peer.send_frame(&Frame::Bye(why.to_owned()));
        let _ = lock(&peer.tcp).shutdown(Shutdown::Both);
        let (a, m) = attrs::error();
        let _ = peer.qp.modify(&a, m, "to ERR on disconnect");
        peer.with_send(|st| {
            st.lost.get_or_insert_with(|| format!("disconnected locally: {why}"));
            peer.fail_unposted(st);
        });
        self.forget_in_revokes(peer.key);
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
                                peer.on_send(c);
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

    fn on_recv(&self, peer: &Arc<Peer<V>>, c: &Completion) {
        if !c.ok() {
            if c.status != WC_WR_FLUSH_ERR {
                self.lose(peer, format!("receive completion error: {} (status {})", V::status_str(c.status), c.status));
            }
            return;
        }
        let idx = c.wr_id;
        let now = Instant::now();
        let outcome: Result<Option<Vec<u8>>, String> = if c.is_recv_imm() {
            let mut rs = lock(&peer.recv);
            let RecvState { ring, reasm } = &mut *rs;
            let r = match ring.accept(c.imm.unwrap_or(0), c.byte_len) {
                Ok(f) => match peer.ring_mem.read_guard(f.offset, f.len as u64) {
                    Ok(g) => reasm.push(RING_SOURCE, g.as_slice(), now).map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                },
                Err(e) => Err(e.0),
            };
            let credit = ring.credit_due();
            drop(rs);
            if let Some(n) = credit {
                if let Err(e) = peer.send_frame(&Frame::Credit(n)) {
                    tracing::debug!(error = %e, peer = %peer.label, "credit report not sent");
                }
            }
            r
        } else if c.is_recv_send() {
            let len = u64::from(c.byte_len.min(peer.recv_size));
            match peer.recv_mem.read_guard(idx * u64::from(peer.recv_size), len) {
                Ok(g) => lock(&peer.recv).reasm.push(SEND_SOURCE, g.as_slice(), now).map_err(|e| e.to_string()),
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
            Ok(Some(_)) if peer.refused.load(Ordering::SeqCst) => {}
            Ok(Some(msg)) => match Notification::decode(&msg) {
                Ok(n) if self.secret.is_some() && !n.is_from(peer.identity) => self.refuse_forged(peer, &n),
                Ok(n) => self.events.push(BackendEvent::Notification(n)),
                Err(e) => tracing::warn!(error = %e, peer = %peer.label, "dropping an undecodable notification"),
            },
            Err(e) => self.lose(peer, format!("protocol violation: {e}")),
        }
    }

    // ---- posting ----

    fn post(&self, peer_id: PeerId, ops: &[WriteOp], notify: Option<&Notification>) -> Result<Transfer, BackendError> {
        self.closed()?;
        let peer = self.peers.get(peer_id)?;
        let encoded =
            notify.map(|n| n.encode()).transpose().map_err(|source| BackendError::Codec { backend: NAME, source })?;
        let note_len = encoded.as_ref().map_or(0, Vec::len);
        self.capabilities.check_post(NAME, ops.len(), note_len)?;
        if note_len > peer.ring_frag.max_message() {
            let limit = peer.ring_frag.max_message() as u64;
            return Err(BackendError::Limit {
                backend: NAME,
                what: "notification bytes",
                asked: note_len as u64,
                limit,
            });
        }
        // Validate everything before anything is queued.
        let mut refs = Vec::new();
        let mut srcs = Vec::with_capacity(ops.len());
        let mut dsts: Vec<RemoteRegion> = Vec::with_capacity(ops.len());
        {
            let mrs = lock(&self.mrs);
            let remote = lock(&peer.remote_regions);
            for op in ops {
                if !refs.iter().any(|r: &kvxfer_core::toolkit::RegionRef| r.id() == op.src) {
                    refs.push(self.regions.get(op.src, None)?);
                }
                let mr = mrs.get(&op.src).ok_or(BackendError::UnknownRegion {
                    backend: NAME,
                    region: op.src,
                    peer: None,
                })?;
                op.check_src(NAME, Some(peer_id), mr.as_ref().map_or(0, |m| m.len() as u64))?;
                let dst = remote.get(&op.dst.0).ok_or(BackendError::UnknownRegion {
                    backend: NAME,
                    region: op.dst,
                    peer: Some(peer_id),
                })?;
                op.check_dst(NAME, Some(peer_id), dst.len)?;
                srcs.push(mr.clone());
                dsts.push(*dst);
            }
        }
        let mut pending = VecDeque::new();
        for p in plan_writes(ops, &peer.limits) {
            let op = &ops[p.op];
            // Plans exist only for non-empty ranges, which the bounds check refuses in an empty region.
            let mr =
                srcs[p.op].as_ref().ok_or(BackendError::UnknownRegion { backend: NAME, region: op.src, peer: None })?;
            let dst = &dsts[p.op];
            let desc = WrDesc::Write {
                bytes: p.len,
                src: op.src,
                src_offset: p.pieces[0].0,
                dst: op.dst,
                dst_offset: p.dst_offset,
            };
            let sges = p.pieces.iter().map(|&(offset, len)| LocalSge { mr: mr.clone(), offset, len }).collect();
            let kind = SendKind::Write { remote_addr: dst.addr + p.dst_offset, rkey: dst.rkey };
            let inline = p.len <= u64::from(peer.limits.max_inline);
            pending.push_back(Pending::Ready(SendWr { wr_id: 0, kind, sges, signaled: false, inline }, desc));
        }
        if let Some(bytes) = &encoded {
            let frags = peer.ring_frag.split(bytes).map_err(|source| BackendError::Codec { backend: NAME, source })?;
            let of = frags.len();
            pending.extend(frags.into_iter().enumerate().map(|(index, bytes)| Pending::Fragment { bytes, index, of }));
        }
        let bytes: u64 = ops.iter().map(WriteOp::bytes).sum();
        if pending.is_empty() {
            return Ok(Transfer::finished(NAME, peer_id, TransferStatus::Done, bytes));
        }
        let mut targets: Vec<u32> = dsts.iter().map(|d| d.id).collect();
        targets.sort_unstable();
        targets.dedup();
        let state = TransferState::new(NAME, peer_id);
        let job = peer.enqueue(Job::new(state.clone(), pending, refs, targets))?;
        Ok(Transfer::new(state, Arc::new(Aborter { peer: Arc::downgrade(&peer), job }), bytes))
    }

    async fn notify(&self, peer_id: PeerId, n: &Notification) -> Result<(), BackendError> {
        self.closed()?;
        let peer = self.peers.get(peer_id)?;
        let bytes = n.encode().map_err(|source| BackendError::Codec { backend: NAME, source })?;
        self.capabilities.check_post(NAME, 0, bytes.len())?;
        let frags = peer.oob_frag.split(&bytes).map_err(|source| BackendError::Codec { backend: NAME, source })?;
        let deadline = Instant::now() + self.opts.timeout;
        let _oob = tokio::time::timeout_at(deadline.into(), peer.oob_lock.lock())
            .await
            .map_err(|_| self.timeout_error(format!("waiting to send to {}", peer.label)))?;
        let of = frags.len();
        for (round_no, round) in frags.chunks(OOB_FRAGS).enumerate() {
            let mut pending = VecDeque::with_capacity(round.len());
            for (j, frag) in round.iter().enumerate() {
                let off = peer.oob_offset() + (j as u64) * u64::from(peer.remote.recv_buf);
                // The previous round's SENDs completed, so the staging area is ours.
                let mut g = peer.stage_mem.write_guard(off, frag.len() as u64).map_err(|e| BackendError::Protocol {
                    backend: NAME,
                    peer: peer.label.clone(),
                    detail: format!("staging a SEND fragment: {e}"),
                })?;
                g.as_mut_slice().copy_from_slice(frag);
                drop(g);
                let wr = SendWr {
                    wr_id: 0,
                    kind: SendKind::Send,
                    sges: vec![LocalSge { mr: peer.stage_mr.clone(), offset: off, len: frag.len() as u32 }],
                    signaled: false,
                    inline: frag.len() as u64 <= u64::from(peer.limits.max_inline),
                };
                pending.push_back(Pending::Ready(wr, WrDesc::Send { index: round_no * OOB_FRAGS + j, of }));
            }
            let state = TransferState::new(NAME, peer_id);
            peer.enqueue(Job::new(state.clone(), pending, Vec::new(), Vec::new()))?;
            match state.settled(deadline).await {
                TransferStatus::Done => {}
                TransferStatus::Failed(e) => return Err(e),
                TransferStatus::Aborted => return Err(BackendError::Aborted { backend: NAME, peer: peer_id }),
                TransferStatus::InFlight => {
                    // The staging area is still in use: nothing may reuse it, so the connection is done.
                    let e = self.timeout_error(format!("an out-of-band notification to {}", peer.label));
                    peer.with_send(|st| {
                        st.failed.get_or_insert(e.clone());
                    });
                    return Err(e);
                }
            }
        }
        Ok(())
    }
}

/// Closes one registration (see [`Registration`]).
struct Closer<V: Verbs> {
    inner: Arc<Inner<V>>,
    id: RegionId,
    mr: Option<Arc<V::Mr>>,
    rt: tokio::runtime::Handle,
}

impl<V: Verbs> Closer<V> {
    /// Remove from the table (new ops fail), tell peers to drop the rkey, wait for local ops and the
    /// peers' answers, then deregister: after `ibv_dereg_mr` the rkey is invalid, so even a peer that
    /// did not answer cannot write into the memory any more (its RDMA WRITE fails at the NIC).
    async fn run(self) -> Result<(), BackendError> {
        let Closer { inner, id, mr, .. } = self;
        let drained = inner.unregister(id);
        let (seq, answers) = inner.revoke(id);
        if let Some(d) = drained {
            d.wait().await;
        }
        let answered = answers.wait(Instant::now() + inner.opts.timeout).await;
        lock(&inner.revokes).remove(&seq);
        if !answered {
            tracing::warn!(region = %id, "not every peer acknowledged the revoke in time; deregistering anyway");
        }
        drop(inner);
        match (mr, tokio::runtime::Handle::try_current()) {
            (Some(mr), Ok(rt)) => {
                rt.spawn_blocking(move || deregister::<V>(mr)).await.map_err(|e| io_err("deregistering", e))?
            }
            (Some(mr), Err(_)) => deregister::<V>(mr),
            (None, _) => {}
        }
        Ok(())
    }
}

/// Drops the last reference of a registration (`ibv_dereg_mr`). Completions release the queue
/// pairs' references just before the transfers end, so this waits a moment at most.
fn deregister<V: Verbs>(mut mr: Arc<V::Mr>) {
    let start = Instant::now();
    loop {
        match Arc::try_unwrap(mr) {
            Ok(m) => return drop(m),
            Err(shared) if start.elapsed() < Duration::from_secs(5) => {
                mr = shared;
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(_) => {
                tracing::warn!("a registration is still referenced after 5 s; it is deregistered when released");
                return;
            }
        }
    }
}

impl<V: Verbs> CloseRegistration for Closer<V> {
    fn close(self: Box<Self>) -> BoxFuture<'static, Result<(), BackendError>> {
        Box::pin(self.run())
    }

    fn close_detached(self: Box<Self>) {
        let rt = self.rt.clone();
        rt.spawn(async move {
            if let Err(e) = self.run().await {
                tracing::warn!(error = %e, "closing a dropped registration");
            }
        });
    }
}

fn cut_refusal(identity: u64, instance: u64) -> String {
    format!(
        "this endpoint cut off identity {identity:#x} instance {instance:#x} (it gave up on that peer); a restarted \
         process is a new instance and may connect"
    )
}

/// Reads from a socket until a deadline however the bytes trickle in: each read waits at most what
/// is left (its receive timeout set anew), and none starts once the deadline passed.
struct Until<'a> {
    s: &'a mut TcpStream,
    deadline: Instant,
}

impl Read for Until<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(ErrorKind::TimedOut, "the handshake deadline passed"));
        }
        self.s.set_read_timeout(Some(left))?;
        self.s.read(buf)
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
impl<V: Verbs> KvTransferBackend for Endpoint<V> {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities
    }

    async fn register(&self, id: RegionId, mem: MemDesc) -> Result<Registration, BackendError> {
        let inner = &self.inner;
        inner.closed()?;
        inner.capabilities.check_memory(NAME, &mem.kind())?;
        let rt = tokio::runtime::Handle::try_current().map_err(|e| BackendError::Unsupported {
            backend: NAME,
            what: format!("registering outside a tokio runtime ({e})"),
        })?;
        if lock(&inner.mrs).contains_key(&id) {
            return Err(BackendError::RegionInUse { backend: NAME, region: id });
        }
        let limit = inner.capabilities.limits.max_regions;
        if inner.regions.len() as u64 >= limit {
            let asked = inner.regions.len() as u64 + 1;
            return Err(BackendError::Limit { backend: NAME, what: "registered regions", asked, limit });
        }
        // Some providers refuse to register zero bytes; an empty region needs no registration.
        let mr = if mem.is_empty() {
            None
        } else {
            // Pinning pages can take long: not on the runtime's threads.
            let (pd, m) = (inner.pd.clone(), mem.clone());
            let mr = rt
                .spawn_blocking(move || V::Mr::register(&pd, m, Access::RemoteWrite))
                .await
                .map_err(|e| io_err("the registration task", e))??;
            Some(Arc::new(mr))
        };
        {
            let mut mrs = lock(&inner.mrs);
            inner.regions.insert(id, mem.clone())?;
            mrs.insert(id, mr.clone());
        }
        let closer = Closer { inner: inner.clone(), id, mr, rt };
        Ok(Registration::new(NAME, id, &mem, Box::new(closer)))
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

    fn post(&self, peer: PeerId, ops: &[WriteOp], notify: Option<&Notification>) -> Result<Transfer, BackendError> {
        self.inner.post(peer, ops, notify)
    }

    async fn notify(&self, peer: PeerId, notification: &Notification) -> Result<(), BackendError> {
        self.inner.notify(peer, notification).await
    }

    async fn recv(&self, max_wait: Duration) -> Result<Vec<BackendEvent>, BackendError> {
        Ok(self.inner.events.recv(max_wait).await)
    }

    /// Cuts the peer's instance off (see the crate README, "Cutting a peer off"): every queue pair
    /// of that instance, in both directions, goes to ERR (the NIC drops every write that arrives on
    /// it afterwards, and its remote keys reach our memory through no other queue pair), its side
    /// channels are shut and its handshakes refused for this endpoint's life; the call resolves once
    /// every transfer to it is final (their posted requests flushed: the NIC reads no more of our
    /// memory for them), bounded by `timeout_ms`.
    async fn cut_off(&self, peer: PeerId, reason: &str) -> Result<CutOff, BackendError> {
        let inner = &self.inner;
        let p = match inner.peers.get(peer) {
            Ok(p) => p,
            // Cut off already (this id, or another connection of the same instance): still confirmed.
            Err(_) if lock(&inner.cut_ids).contains(&peer) => {
                return Ok(CutOff { closed: 0, failed_transfers: 0, how: "already cut off" });
            }
            Err(e) => return Err(e),
        };
        let who = (p.identity, p.instance);
        let victims: Vec<Arc<Peer<V>>> = {
            let mut cut = lock(&inner.cut);
            cut.insert(who);
            inner.peers.all().into_iter().filter(|(_, q)| (q.identity, q.instance) == who).map(|(_, q)| q).collect()
        };
        tracing::info!(peer = %p.label, instance = who.1, %reason, connections = victims.len(), "cutting off");
        let mut failed = 0;
        let mut error = None;
        lock(&inner.cut_ids).extend(victims.iter().map(|q| q.id));
        for q in &victims {
            let _ = inner.peers.remove(q.id);
            match inner.cut_peer(q, reason) {
                Ok(n) => failed += n,
                Err(e) => {
                    error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = error {
            // A queue pair that did not reach ERR may still take writes: not confirmed.
            return Err(e);
        }
        let deadline = Instant::now() + inner.opts.timeout;
        for q in &victims {
            if !q.wait_idle(deadline).await {
                return Err(inner.timeout_error(format!(
                    "the flush completions of the transfers to the cut-off {} (the device may still read their \
                     source memory)",
                    q.label
                )));
            }
            inner.forget_key(q);
        }
        Ok(CutOff {
            closed: victims.len(),
            failed_transfers: failed,
            how: "queue pairs moved to the error state, side channels shut, instance refused at the handshake",
        })
    }

    async fn disconnect(&self, peer: PeerId) -> Result<(), BackendError> {
        let p = self.inner.peers.remove(peer)?;
        self.inner.close_peer(&p, "disconnect requested");
        // Posted requests end with their flush completions (the QP is in the error state).
        let settled = p.wait_idle(Instant::now() + self.inner.opts.timeout).await;
        self.inner.forget_key(&p);
        if !settled {
            let n = p.abandon("their flush did not arrive before the disconnect deadline");
            return Err(self.inner.timeout_error(format!("the flush of {n} transfers to {}", p.label)));
        }
        Ok(())
    }
}
