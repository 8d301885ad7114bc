//! The in-process reference backend: endpoints in one process copy between each other's registered
//! regions. It implements the whole [`KvTransferBackend`] contract (bounds checks before anything is
//! posted, access tokens, both notification styles, transfer handles that abort with a fence,
//! registrations whose close waits for every copy, peer loss when an endpoint is dropped) and is the
//! yardstick the other backends are measured against in the conformance suite.
//!
//! A posted transfer runs as a task on the caller's tokio runtime (inline when there is none),
//! copying segment by segment under the descriptors' read and write guards; an abort stops it
//! between two segments, so once the abort resolves no byte of it lands any more. Only one region
//! table is locked at a time, so an endpoint connected to itself, or two endpoints writing to each
//! other at once, cannot deadlock.
//!
//! **The cluster secret** ([`BackendConfig::secret`]): endpoints connect only when both have the same
//! secret or neither has one (a connect across a mismatch fails naming authentication). With a secret,
//! every notification must carry its sender's identity as its key ([`Notification::is_from`]); one
//! that does not is refused at the receiving endpoint: not delivered, counted
//! ([`LocalBackend::forged_notifications`]), the sender reported lost there (`PeerLost`), and the
//! sender refused from then on. Without a secret the backend trusts every endpoint of the process.
//!
//! **Cutting a peer off** ([`KvTransferBackend::cut_off`]): an endpoint keeps the ids of the
//! endpoints it cut off behind a read-write lock. Every copy step into an endpoint's memory, and
//! every delivery of a notification, holds that lock for reading and checks the set first; the
//! cut-off takes it for writing, so it returns only after the copy step under way (at most 1 MiB)
//! ended, and no later step, notification or connect of the cut-off endpoint gets through. CUDA
//! copies run on a stream after the step that queued them: each is admitted under the same lock and
//! counted until it completed, and the cut-off also waits for the cut-off endpoint's count to reach
//! zero (a copy that never completes keeps it from being confirmed: the pages stay quarantined).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use kvxfer_core::backend::EndpointMetadata;
use kvxfer_core::toolkit::{segments, EventQueue, Options, PeerTable, RegionRef, RegionTable};
use kvxfer_core::{
    AbortTransfer, BackendConfig, BackendError, BackendEvent, BoxFuture, Capabilities, CloseRegistration, CutOff,
    KvTransferBackend, Limits, MemDesc, Notification, OptionDoc, PeerId, RegionId, Registration, Secret, Transfer,
    TransferState, TransferStatus, WriteOp,
};
use serde::{Deserialize, Serialize};

mod cuda;

/// Registry name.
pub const NAME: &str = "local";

/// Bytes copied per step of a transfer task (an abort takes effect between two steps).
const STEP: u64 = 1 << 20;
/// How long a cut-off waits for the cut-off endpoint's device copies into this memory to end (one
/// plan's copies: a CUDA copy deadline of its own bounds each).
const CUT_OFF_DEVICE_WAIT: Duration = Duration::from_secs(30);

/// What the local backend supports.
pub const CAPABILITIES: Capabilities = Capabilities::new(true, true, false, false)
    .with_limits(Limits::new(1 << 20, kvxfer_core::notify::MAX_PAYLOAD as u64 + 64, 1 << 16))
    .with_indexed(true);

/// The local backend's options: none (any option is refused).
pub const OPTIONS: &[OptionDoc] = &[];

kvxfer_core::register_backend!(
    NAME,
    "in-process reference backend (memcpy between registered regions)",
    CAPABILITIES,
    OPTIONS,
    create
);

/// Creates an endpoint. No options; the secret, if any, is kept (see the crate docs).
pub fn create(config: &BackendConfig) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
    Options::new(NAME, config, OPTIONS)?;
    Ok(Arc::new(LocalBackend::with_secret(config.identity, config.secret.clone())))
}

fn endpoints() -> &'static Mutex<HashMap<u64, Weak<Endpoint>>> {
    static E: OnceLock<Mutex<HashMap<u64, Weak<Endpoint>>>> = OnceLock::new();
    E.get_or_init(Default::default)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Serialize, Deserialize)]
struct Payload {
    endpoint: u64,
    token: u64,
}

struct Endpoint {
    id: u64,
    identity: u64,
    token: u64,
    regions: RegionTable,
    events: EventQueue,
    /// Endpoints that connected to us, or that we connected to: told when we go away.
    linked: Mutex<Vec<Weak<Endpoint>>>,
    /// The cluster secret, if any.
    secret: Option<Secret>,
    /// Endpoints (by id) refused after a forged notification.
    refused: Mutex<Vec<u64>>,
    /// Endpoints (by id) this one cut off: no copy into our memory, notification or connect of
    /// theirs gets through. Readers hold it across each copy step into our memory.
    cut: std::sync::RwLock<std::collections::HashSet<u64>>,
    /// Device copies into our memory queued and not yet complete, by source endpoint id. CUDA
    /// copies run after the step that queued them, so a cut-off also waits for these to end.
    device_writes: Mutex<HashMap<u64, usize>>,
    /// Signalled whenever a device copy into our memory ended.
    device_write_ended: tokio::sync::Notify,
    /// Forged notifications refused.
    forged: AtomicU64,
}

/// One device copy of endpoint `from` into `ep`'s memory, admitted by [`Endpoint::begin_device_write`]
/// and under way until dropped (drop it only once the copy completed).
pub(crate) struct DeviceWrite {
    ep: Arc<Endpoint>,
    from: u64,
}

impl Drop for DeviceWrite {
    fn drop(&mut self) {
        let mut m = lock(&self.ep.device_writes);
        if let Some(n) = m.get_mut(&self.from) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.from);
            }
        }
        drop(m);
        self.ep.device_write_ended.notify_waiters();
    }
}

impl Endpoint {
    /// Admits one device copy of `from` into this endpoint's memory, refused once this endpoint cut
    /// `from` off. Hold the returned guard until the copy completed.
    pub(crate) fn begin_device_write(self: &Arc<Self>, from: &Endpoint) -> Result<DeviceWrite, BackendError> {
        let cut = self.cut.read().unwrap_or_else(|p| p.into_inner());
        if cut.contains(&from.id) {
            return Err(cut_off_error(self, from));
        }
        *lock(&self.device_writes).entry(from.id).or_default() += 1;
        Ok(DeviceWrite { ep: Arc::clone(self), from: from.id })
    }

    /// Whether every device copy of endpoint `from` into this memory ended by `deadline` (called
    /// once `from` is cut off, so that no new one is admitted).
    async fn device_writes_ended(&self, from: u64, deadline: Instant) -> bool {
        loop {
            let ended = self.device_write_ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            if !lock(&self.device_writes).contains_key(&from) {
                return true;
            }
            if tokio::time::timeout_at(deadline.into(), ended).await.is_err() {
                return !lock(&self.device_writes).contains_key(&from);
            }
        }
    }

    /// Delivers `n` from `from` (what the receiving side of a connection does): with a secret, a
    /// notification not keyed with the sender's identity is refused and the sender cut off.
    fn deliver(&self, from: &Endpoint, n: Notification) -> Result<(), BackendError> {
        let cut = self.cut.read().unwrap_or_else(|p| p.into_inner());
        if cut.contains(&from.id) {
            return Err(cut_off_error(self, from));
        }
        if self.secret.is_some() {
            if lock(&self.refused).contains(&from.id) {
                return Err(BackendError::Protocol {
                    backend: NAME,
                    peer: format!("local endpoint {} (identity {:#x})", self.id, self.identity),
                    detail: "this endpoint refused the connection after a forged notification".into(),
                });
            }
            if !n.is_from(from.identity) {
                lock(&self.refused).push(from.id);
                self.forged.fetch_add(1, Ordering::Relaxed);
                let reason = format!(
                    "forged notification: endpoint {} proved identity {:#x} but keyed a notification of request {} \
                     with sender {} ({:#x}); connection refused",
                    from.id,
                    from.identity,
                    n.request,
                    n.sender,
                    n.sender.to_u64()
                );
                tracing::warn!(target: "kvxfer_local", "{reason}");
                self.events.push(BackendEvent::PeerLost { identity: from.identity, reason: reason.clone() });
                return Err(BackendError::Protocol {
                    backend: NAME,
                    peer: format!("local endpoint {} (identity {:#x})", self.id, self.identity),
                    detail: reason,
                });
            }
        }
        self.events.push(BackendEvent::Notification(n));
        Ok(())
    }
}

fn cut_off_error(by: &Endpoint, of: &Endpoint) -> BackendError {
    BackendError::PeerLost {
        backend: NAME,
        peer: format!("local endpoint {} (identity {:#x})", by.id, by.identity),
        detail: format!("it cut off endpoint {} (identity {:#x})", of.id, of.identity),
    }
}

struct Peer {
    ep: Weak<Endpoint>,
    /// Transfers to this peer that may not be final yet.
    inflight: Mutex<Vec<Arc<TransferState>>>,
}

/// An in-process endpoint.
pub struct LocalBackend {
    ep: Arc<Endpoint>,
    peers: PeerTable<Peer>,
}

impl LocalBackend {
    /// `post_ordered` of `n` writes (each checked before anything is posted; an `Err` item is
    /// returned as it is, nothing posted).
    fn post_writes(
        &self,
        peer: PeerId,
        n: usize,
        ops: impl Iterator<Item = Result<WriteOp, BackendError>>,
        notify: Option<&Notification>,
        order: kvxfer_core::GpuOrder,
    ) -> Result<Transfer, BackendError> {
        // The send's GPU order, captured now: no source byte is read before it completed.
        let gate = kvxfer_cuda::order::send_gate(NAME, order)?;
        let (p, other) = self.peer(peer)?;
        let note_len = match notify {
            Some(n) => n.encode().map_err(|source| BackendError::Codec { backend: NAME, source })?.len(),
            None => 0,
        };
        CAPABILITIES.check_post(NAME, n, note_len)?;
        // Resolve and check every op before anything is posted; one table locked at a time.
        let mut resolved = Vec::with_capacity(n);
        let mut bytes = 0u64;
        for op in ops {
            let op = op?;
            let src = self.ep.regions.get(op.src, None)?;
            op.check_src(NAME, None, src.len())?;
            let dst = other.regions.get(op.dst, Some(peer))?;
            op.check_dst(NAME, Some(peer), dst.len())?;
            bytes += op.bytes();
            resolved.push(Resolved { src, dst, op });
        }
        let state = TransferState::new(NAME, peer);
        {
            let mut inflight = lock(&p.inflight);
            inflight.retain(|s| !s.status().is_final());
            inflight.push(state.clone());
        }
        let (from, to, note) = (Arc::clone(&self.ep), Arc::downgrade(&other), notify.cloned());
        let task: BoxFuture<'static, ()> = if cuda::touches_device(&resolved) {
            Box::pin(cuda::run(state.clone(), resolved, from, to, note, gate))
        } else {
            Box::pin(cuda::after_gate(gate, state.clone(), run(state.clone(), resolved, from, to, note)))
        };
        match tokio::runtime::Handle::try_current() {
            Ok(h) => drop(h.spawn(task)),
            Err(_) => futures::executor::block_on(task),
        }
        Ok(Transfer::new(state, Arc::new(Abort), bytes))
    }

    /// A new endpoint with the given identity and no secret.
    pub fn new(identity: u64) -> Self {
        Self::with_secret(identity, None)
    }

    /// A new endpoint with the given identity and cluster secret (see the crate docs).
    pub fn with_secret(identity: u64, secret: Option<Secret>) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let ep = Arc::new(Endpoint {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            identity,
            token: rand::random(),
            regions: RegionTable::new(NAME, CAPABILITIES.limits.max_regions),
            events: EventQueue::new(),
            linked: Mutex::new(Vec::new()),
            secret,
            refused: Mutex::new(Vec::new()),
            cut: std::sync::RwLock::new(std::collections::HashSet::new()),
            device_writes: Mutex::new(HashMap::new()),
            device_write_ended: tokio::sync::Notify::new(),
            forged: AtomicU64::new(0),
        });
        lock(endpoints()).insert(ep.id, Arc::downgrade(&ep));
        Self { ep, peers: PeerTable::new(NAME) }
    }

    /// Forged notifications this endpoint refused (see the crate docs).
    pub fn forged_notifications(&self) -> u64 {
        self.ep.forged.load(Ordering::Relaxed)
    }

    fn peer(&self, peer: PeerId) -> Result<(Arc<Peer>, Arc<Endpoint>), BackendError> {
        let p = self.peers.get(peer)?;
        let ep = p.ep.upgrade().ok_or_else(|| BackendError::PeerLost {
            backend: NAME,
            peer: peer.to_string(),
            detail: "the peer endpoint was dropped".into(),
        })?;
        Ok((p, ep))
    }
}

impl Drop for LocalBackend {
    fn drop(&mut self) {
        lock(endpoints()).remove(&self.ep.id);
        for (_, p) in self.peers.drain() {
            for s in lock(&p.inflight).drain(..) {
                s.fail(BackendError::Closed { backend: NAME });
            }
        }
        for w in lock(&self.ep.linked).drain(..) {
            if let Some(other) = w.upgrade() {
                other.events.push(BackendEvent::PeerLost {
                    identity: self.ep.identity,
                    reason: format!("local endpoint {} was dropped", self.ep.id),
                });
            }
        }
    }
}

struct Close {
    ep: Weak<Endpoint>,
    id: RegionId,
}

impl CloseRegistration for Close {
    fn close(self: Box<Self>) -> BoxFuture<'static, Result<(), BackendError>> {
        Box::pin(async move {
            // Every copy into or out of the region holds a RegionRef of this table (remote writers
            // too: they resolve our regions through it), so the drain is the whole fence.
            let Some(ep) = self.ep.upgrade() else { return Ok(()) };
            let drained = ep.regions.remove(self.id)?;
            drop(ep);
            drained.wait().await;
            Ok(())
        })
    }

    fn close_detached(self: Box<Self>) {
        if let Some(ep) = self.ep.upgrade() {
            // Removing is enough: running copies keep the descriptor (and so the memory of a
            // HostBuffer) alive until they end.
            let _ = ep.regions.remove(self.id);
        }
    }
}

/// One resolved op: source and destination regions held until the copy ends.
struct Resolved {
    src: RegionRef,
    dst: RegionRef,
    op: WriteOp,
}

struct Abort;

impl AbortTransfer for Abort {
    fn abort(&self, _state: &Arc<TransferState>) {
        // The copy task checks `abort_requested` between steps and marks the state itself; a copy
        // step under way finishes first (it cannot be interrupted), which the fence waits for.
    }
}

fn copy_step(from: &MemDesc, so: u64, to: &MemDesc, d: u64, len: u64) -> Result<(), BackendError> {
    from.copy_to(so, to, d, len).map_err(|e| BackendError::Protocol {
        backend: NAME,
        peer: "local peer".into(),
        detail: format!("copy refused: {e}"),
    })
}

/// Runs a transfer to its end: copies, then the attached notification, then the final state.
async fn run(
    state: Arc<TransferState>,
    ops: Vec<Resolved>,
    from: Arc<Endpoint>,
    to: Weak<Endpoint>,
    notify: Option<Notification>,
) {
    let plain: Vec<WriteOp> = ops.iter().map(|r| r.op).collect();
    let mut since_yield = 0;
    for seg in segments(&plain, STEP) {
        if state.abort_requested() {
            state.aborted();
            return;
        }
        let r = &ops[seg.op];
        let Some(dst_ep) = to.upgrade() else {
            state.fail(BackendError::PeerLost {
                backend: NAME,
                peer: "local peer".into(),
                detail: "dropped during the transfer".into(),
            });
            return;
        };
        let step = {
            // Held across the step: a cut-off of this endpoint by the destination waits for it.
            let cut = dst_ep.cut.read().unwrap_or_else(|p| p.into_inner());
            if cut.contains(&from.id) {
                Err(cut_off_error(&dst_ep, &from))
            } else {
                copy_step(r.src.desc(), seg.src_offset, r.dst.desc(), seg.dst_offset, seg.len)
            }
        };
        if let Err(e) = step {
            state.fail(e);
            return;
        }
        since_yield += seg.len;
        if since_yield >= 8 * STEP {
            since_yield = 0;
            tokio::task::yield_now().await;
        }
    }
    drop(ops);
    if state.abort_requested() && notify.is_some() {
        // Every byte landed, but the notification is not sent: the transfer ends as aborted.
        state.aborted();
        return;
    }
    if let Some(n) = notify {
        match to.upgrade() {
            Some(ep) => {
                if let Err(e) = ep.deliver(&from, n) {
                    state.fail(e);
                    return;
                }
            }
            None => {
                state.fail(BackendError::PeerLost {
                    backend: NAME,
                    peer: "local peer".into(),
                    detail: "dropped before the notification".into(),
                });
                return;
            }
        }
    }
    state.complete();
}

/// Aborts every transfer to a removed peer and waits for each fence (a copy task ends within one
/// step once asked to). Returns how many did not finish (one whose copy ended before the abort took hold is not counted).
async fn abort_all(p: &Peer, peer: PeerId) -> Result<usize, BackendError> {
    let pending: Vec<_> = lock(&p.inflight).drain(..).collect();
    let mut n = 0;
    for s in pending {
        if !s.status().is_final() {
            let t = Transfer::new(s, Arc::new(Abort), 0);
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            match t.abort(deadline).await {
                Ok(TransferStatus::InFlight) | Err(_) => {
                    return Err(BackendError::Timeout {
                        backend: NAME,
                        what: format!("fencing transfers to {peer}"),
                        after: Duration::from_secs(30),
                    })
                }
                // Its copy task finished between the look and the abort: it did not fail.
                Ok(TransferStatus::Done) => {}
                Ok(_) => n += 1,
            }
        }
    }
    Ok(n)
}

#[async_trait::async_trait]
impl KvTransferBackend for LocalBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        // CUDA memory (copied by the CUDA copy engine, see cuda.rs) where a driver sees a device.
        CAPABILITIES.with_memory(kvxfer_cuda::memory_kinds())
    }

    async fn register(&self, id: RegionId, mem: MemDesc) -> Result<Registration, BackendError> {
        kvxfer_cuda::check_register(NAME, &mem)?;
        self.ep.regions.insert(id, mem.clone())?;
        Ok(Registration::new(NAME, id, &mem, Box::new(Close { ep: Arc::downgrade(&self.ep), id })))
    }

    fn metadata(&self) -> Result<EndpointMetadata, BackendError> {
        let payload = serde_json::to_vec(&Payload { endpoint: self.ep.id, token: self.ep.token })
            .map_err(|e| BackendError::BadMetadata { backend: NAME, detail: e.to_string() })?;
        Ok(EndpointMetadata::new(NAME, self.ep.identity, payload))
    }

    async fn connect(&self, peer: &EndpointMetadata) -> Result<PeerId, BackendError> {
        peer.check(NAME)?;
        let p: Payload = serde_json::from_slice(&peer.payload)
            .map_err(|e| BackendError::BadMetadata { backend: NAME, detail: format!("payload: {e}") })?;
        let other =
            lock(endpoints()).get(&p.endpoint).and_then(Weak::upgrade).ok_or_else(|| BackendError::Connect {
                backend: NAME,
                peer: format!("local endpoint {}", p.endpoint),
                detail: "no such endpoint in this process (the local backend cannot cross processes)".into(),
            })?;
        let mismatch = match (&self.ep.secret, &other.secret) {
            (None, None) => None,
            (Some(a), Some(b)) if a == b => None,
            (Some(_), Some(_)) => Some("authentication failed: the endpoints have different cluster secrets"),
            (None, Some(_)) => Some("authentication required: the peer has a cluster secret and this endpoint none"),
            (Some(_), None) => Some("authentication failed: the peer has no cluster secret and cannot prove one"),
        };
        if let Some(why) = mismatch {
            return Err(BackendError::Connect {
                backend: NAME,
                peer: format!("local endpoint {}", p.endpoint),
                detail: format!("{why}; configure the same cluster secret (KVXFER_SECRET) on every rank"),
            });
        }
        let cut_here = self.ep.cut.read().unwrap_or_else(|p| p.into_inner()).contains(&other.id);
        let cut_there = other.cut.read().unwrap_or_else(|p| p.into_inner()).contains(&self.ep.id);
        if cut_here || cut_there {
            let (by, of) = if cut_here { (&self.ep, &other) } else { (&other, &self.ep) };
            return Err(BackendError::Connect {
                backend: NAME,
                peer: format!("local endpoint {}", p.endpoint),
                detail: format!(
                    "endpoint {} cut off endpoint {}; a new endpoint (a restarted rank) may connect",
                    by.id, of.id
                ),
            });
        }
        if other.token != p.token {
            return Err(BackendError::Connect {
                backend: NAME,
                peer: format!("local endpoint {}", p.endpoint),
                detail: "access token does not match the endpoint's".into(),
            });
        }
        if !Arc::ptr_eq(&other, &self.ep) {
            lock(&other.linked).push(Arc::downgrade(&self.ep));
            lock(&self.ep.linked).push(Arc::downgrade(&other));
        }
        Ok(self.peers.insert(Peer { ep: Arc::downgrade(&other), inflight: Mutex::new(Vec::new()) }))
    }

    fn post(&self, peer: PeerId, ops: &[WriteOp], notify: Option<&Notification>) -> Result<Transfer, BackendError> {
        self.post_ordered(peer, ops, notify, kvxfer_core::GpuOrder::Ready)
    }

    fn post_ordered(
        &self,
        peer: PeerId,
        ops: &[WriteOp],
        notify: Option<&Notification>,
        order: kvxfer_core::GpuOrder,
    ) -> Result<Transfer, BackendError> {
        self.post_writes(peer, ops.len(), ops.iter().map(|op| Ok(*op)), notify, order)
    }

    /// Native: the copy task is handed each run's ranges as they come (no [`WriteOp`] list in
    /// between).
    fn post_indexed(
        &self,
        peer: PeerId,
        ops: &[kvxfer_core::IndexedOp],
        notify: Option<&Notification>,
    ) -> Result<Transfer, BackendError> {
        let n = ops.iter().map(kvxfer_core::IndexedOp::write_ops).sum();
        let writes = ops.iter().flat_map(|op| op.writes(NAME, Some(peer)));
        self.post_writes(peer, n, writes, notify, kvxfer_core::GpuOrder::Ready)
    }

    async fn notify(&self, peer: PeerId, notification: &Notification) -> Result<(), BackendError> {
        let (_, ep) = self.peer(peer)?;
        let len = notification.encode().map_err(|source| BackendError::Codec { backend: NAME, source })?.len();
        CAPABILITIES.check_post(NAME, 0, len)?;
        ep.deliver(&self.ep, notification.clone())
    }

    async fn recv(&self, max_wait: Duration) -> Result<Vec<BackendEvent>, BackendError> {
        Ok(self.ep.events.recv(max_wait).await)
    }

    async fn cut_off(&self, peer: PeerId, reason: &str) -> Result<CutOff, BackendError> {
        let p = self.peers.remove(peer)?;
        tracing::debug!(target: "kvxfer_local", %peer, %reason, "cutting off");
        // Our copy tasks into the peer: aborted, and waited for (a task stops at its next step, so
        // once its state is final it reads none of our memory).
        let failed = abort_all(&p, peer).await?;
        if let Some(other) = p.ep.upgrade() {
            // Waits for a copy step of the peer into our memory under way, then refuses every later one.
            self.ep.cut.write().unwrap_or_else(|p| p.into_inner()).insert(other.id);
            // Device copies of the peer's already queued on a CUDA stream: waited for.
            if !self.ep.device_writes_ended(other.id, Instant::now() + CUT_OFF_DEVICE_WAIT).await {
                return Err(BackendError::Timeout {
                    backend: NAME,
                    what: format!("the CUDA copies of cut-off endpoint {} into this memory", other.id),
                    after: CUT_OFF_DEVICE_WAIT,
                });
            }
        }
        Ok(CutOff { closed: 1, failed_transfers: failed, how: "peer endpoint refused under the copy lock" })
    }

    async fn disconnect(&self, peer: PeerId) -> Result<(), BackendError> {
        let p = self.peers.remove(peer)?;
        abort_all(&p, peer).await.map(|_| ())
    }
}
