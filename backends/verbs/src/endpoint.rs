//! The endpoint: the device it opens, its shared state ([`Inner`]) and the threads it starts. Its
//! roles live in `peers` (connecting, the handshake listener, side channels, cut-off), `regions`
//! (revokes, closing a registration) and `progress` (posting, the poller); its trait impl in lib.rs.
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
//! Authentication (see the README): every handshake starts with the exchange of
//! [`wire::Open`](crate::wire::Open), [`wire::Challenge`](crate::wire::Challenge) and
//! [`Frame::Auth`](crate::wire::Frame::Auth); no queue pair, ring or region of either side is
//! announced before it passed. With a cluster secret, a notification whose key is not the identity
//! its connection proved is dropped, counted ([`Counters::forged`]), and its sender lost and refused.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kvxfer_core::toolkit::{EventQueue, PeerTable, RegionTable};
use kvxfer_core::{BackendError, Capabilities, KvTransferBackend, Limits, PeerId, RegionId, Secret};

use crate::attrs::{self, LocalPort, Timing};
use crate::limits::{HandshakeLimits, RefusalCounters};
use crate::regions::RevokeWait;
use crate::transfer::{lock, Peer};
use crate::verbs::{Device, DeviceCaps, EventChannel, PortInfo, ProtectionDomain, Verbs};
use crate::wire::{Address, PROTO_VERSION};
use crate::{Settings, NAME};

/// `ibv_port_state` ACTIVE.
const PORT_ACTIVE: u32 = 4;

/// Counters of an endpoint that outlive no one: shared with [`crate::VerbsBackend`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// Notifications dropped because their key was not the identity their connection proved.
    pub forged: AtomicU64,
    /// Incoming connections refused before their authentication, by reason.
    pub refusals: RefusalCounters,
}

pub(crate) fn io_err(context: impl Into<String>, e: impl fmt::Display) -> BackendError {
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

pub(crate) struct Inner<V: Verbs> {
    pub(crate) identity: u64,
    /// Random per endpoint: which incarnation of `identity` this is (bound into the proofs).
    pub(crate) instance: u64,
    /// The cluster secret; `None`: nothing is authenticated.
    pub(crate) secret: Option<Secret>,
    pub(crate) counters: Arc<Counters>,
    /// Incoming connections before their authentication, bounded in total and per source.
    pub(crate) limits: HandshakeLimits,
    /// (identity, instance) of peers refused for this endpoint's life (a forged notification).
    pub(crate) refused: Mutex<HashSet<(u64, u64)>>,
    /// (identity, instance) of peers this endpoint cut off ([`KvTransferBackend::cut_off`]): no
    /// handshake of theirs passes, in either direction. Held while a connection joins the peer table,
    /// so a cut-off either sees the connection (and moves its QP to ERR) or the connection sees it.
    pub(crate) cut: Mutex<HashSet<(u64, u64)>>,
    /// Peer ids of connections closed by a cut-off (a later cut-off of one of them is confirmed at once).
    pub(crate) cut_ids: Mutex<HashSet<PeerId>>,
    pub(crate) opts: Settings,
    pub(crate) ctx: Arc<V::Context>,
    pub(crate) pd: Arc<V::Pd>,
    pub(crate) channel: Arc<V::Channel>,
    pub(crate) port: PortInfo,
    pub(crate) local_port: LocalPort,
    pub(crate) gid: [u8; 16],
    pub(crate) caps: DeviceCaps,
    pub(crate) capabilities: Capabilities,
    pub(crate) timing: Timing,
    pub(crate) handshake: SocketAddr,
    pub(crate) regions: RegionTable,
    /// NIC registrations of the regions in `regions` (`None`: an empty region, nothing registered).
    pub(crate) mrs: Mutex<HashMap<RegionId, Option<Arc<V::Mr>>>>,
    pub(crate) peers: PeerTable<Peer<V>>,
    pub(crate) by_key: Mutex<HashMap<u64, Arc<Peer<V>>>>,
    pub(crate) next_key: AtomicU64,
    pub(crate) events: EventQueue,
    pub(crate) revokes: Mutex<HashMap<u64, Arc<RevokeWait>>>,
    pub(crate) next_revoke: AtomicU64,
    pub(crate) shutdown: AtomicBool,
}

/// The verbs endpoint (see the crate docs), on libibverbs or on the in-process model.
pub(crate) struct Endpoint<V: Verbs> {
    pub(crate) inner: Arc<Inner<V>>,
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
    pub(crate) fn closed(&self) -> Result<(), BackendError> {
        if self.shutdown.load(Ordering::SeqCst) {
            return Err(BackendError::Closed { backend: NAME });
        }
        Ok(())
    }

    pub(crate) fn timeout_error(&self, what: impl Into<String>) -> BackendError {
        BackendError::Timeout { backend: NAME, what: what.into(), after: self.opts.timeout }
    }

    pub(crate) fn address(&self) -> Address {
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
}
