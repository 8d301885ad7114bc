//! Sender and receiver sessions: the planner, the completion tracker and a backend, driven per request.
//!
//! The flow of one request (SGLang's room) is decode-initiated: the decode rank allocates destination
//! pages, calls [`ReceiverSession::expect`], and hands the page list to the prefill ranks (through the
//! engine's own scheduler or kvxfer's bootstrap). Each prefill rank then calls
//! [`SenderSession::send_chunk`] for every chunk; the session plans its pairs, posts the writes, and
//! notifies with its sender key, attached to the data or out of band after completion, as the
//! session's [`NotifyStyle`] says. The decode rank polls [`ReceiverSession::status`] or awaits
//! [`ReceiverSession::wait`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::join_all;
use kvxfer_core::plan::{check_pages, plan_sender, PairPlan};
use kvxfer_core::{
    BackendError, BackendEvent, BufferRef, CompletionTracker, ConfigError, EndpointMetadata, ExpectSpec, Failure,
    HostBuffer, KvTransferBackend, Notification, NotificationBody, NotifyStyle, PeerId, PlanError, RankId, RegionId,
    RequestId, SenderKey, Side, Status, Topology, TrackerError, TrackerStats, WriteOp,
};
use serde::{Deserialize, Serialize};

/// Ops handed to the backend per `write` call (bounds memory; a plan is never materialised whole).
pub const WRITE_BATCH: usize = 1024;

/// A session-level failure, naming the request, the rank and the peer rank where it applies.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// Invalid topology or rank.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A chunk that cannot be planned.
    #[error("request {request} on {side} rank {rank}: {source}")]
    Plan {
        /// Request.
        request: RequestId,
        /// Which side.
        side: Side,
        /// Rank.
        rank: RankId,
        /// Cause.
        source: PlanError,
    },
    /// The pool does not describe the buffers the topology needs.
    #[error("{side} rank {rank}: KV pool: {detail}")]
    Pool {
        /// Side.
        side: Side,
        /// Rank.
        rank: RankId,
        /// What is wrong.
        detail: String,
    },
    /// A backend call failed.
    #[error("{}{side} rank {rank}{}: {source}", request.map(|r| format!("request {r}: ")).unwrap_or_default(), peer.map(|p| format!(" -> decode rank {p}")).unwrap_or_default())]
    Backend {
        /// Request, if any.
        request: Option<RequestId>,
        /// Side.
        side: Side,
        /// Local rank.
        rank: RankId,
        /// Peer rank, if any.
        peer: Option<RankId>,
        /// Cause.
        source: BackendError,
    },
    /// The sender has no connection to a decode rank it must write.
    #[error("prefill rank {rank} is not connected to decode rank {dst}; call connect first")]
    NotConnected {
        /// Local rank.
        rank: RankId,
        /// Missing peer.
        dst: RankId,
    },
    /// A send ran past its deadline.
    #[error("request {request}: prefill rank {rank} -> decode rank {dst} did not finish before its deadline")]
    SendTimeout {
        /// Request.
        request: RequestId,
        /// Local rank.
        rank: RankId,
        /// Peer rank.
        dst: RankId,
    },
    /// The tracker refused.
    #[error("decode rank {rank}: {source}")]
    Tracker {
        /// Local rank.
        rank: RankId,
        /// Cause.
        source: TrackerError,
    },
    /// The request failed on the decode side.
    #[error("request {request} failed on decode rank {rank}: {failure}")]
    Failed {
        /// Request.
        request: RequestId,
        /// Local rank.
        rank: RankId,
        /// Why.
        failure: Failure,
    },
    /// The request is not tracked.
    #[error("request {request} is not tracked on decode rank {rank}")]
    UnknownRequest {
        /// Request.
        request: RequestId,
        /// Local rank.
        rank: RankId,
    },
}

/// One buffer of a rank's KV pool: where a (rank-local layer, kind) lives in registered memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolBuffer {
    /// The buffer.
    pub buffer: BufferRef,
    /// The registered region holding it.
    pub region: RegionId,
    /// Byte offset of the buffer inside the region.
    pub offset: u64,
    /// Bytes available from `offset`.
    pub len: u64,
}

/// A rank's KV pool as the planner's buffers map onto registered regions. Travels to peers (bootstrap).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvPool {
    /// Pages each buffer holds.
    pub pages: u32,
    /// Every (layer, kind) buffer.
    pub buffers: Vec<PoolBuffer>,
}

/// The region id [`KvPool::allocate`] gives a buffer.
pub fn region_id(b: BufferRef) -> RegionId {
    RegionId(b.layer * 4 + b.kind.index())
}

impl KvPool {
    /// Finds a buffer.
    pub fn get(&self, b: BufferRef) -> Option<&PoolBuffer> {
        self.buffers.iter().find(|x| x.buffer == b)
    }

    /// Checks that every buffer `side`'s `rank` needs exists and is large enough for `pages` pages.
    pub fn validate(&self, topo: &Topology, side: Side, rank: RankId) -> Result<(), SessionError> {
        topo.check_rank(side, rank)?;
        for layer in 0..topo.stage_layers(side) {
            for &kind in topo.kv().kinds() {
                let b = BufferRef { layer, kind };
                let need = topo.buffer_bytes(side, kind, self.pages);
                match self.get(b) {
                    None => {
                        return Err(SessionError::Pool {
                            side,
                            rank,
                            detail: format!("no buffer for layer {layer} {kind}"),
                        })
                    }
                    Some(pb) if pb.len < need => {
                        return Err(SessionError::Pool {
                            side,
                            rank,
                            detail: format!(
                                "buffer for layer {layer} {kind} has {} bytes, {} pages need {need}",
                                pb.len, self.pages
                            ),
                        })
                    }
                    Some(_) => {}
                }
            }
        }
        Ok(())
    }

    /// Allocates one host buffer per (layer, kind) of `rank`, lets `init` fill it, and registers each
    /// with `backend` under [`region_id`]. Returns the pool and the buffers (keep them alive).
    pub fn allocate(
        topo: &Topology,
        side: Side,
        rank: RankId,
        pages: u32,
        backend: &dyn KvTransferBackend,
        init: &dyn Fn(BufferRef, &HostBuffer),
    ) -> Result<(KvPool, Vec<(BufferRef, HostBuffer)>), SessionError> {
        topo.check_rank(side, rank)?;
        let mut buffers = Vec::new();
        let mut pool = KvPool { pages, buffers: Vec::new() };
        for layer in 0..topo.stage_layers(side) {
            for &kind in topo.kv().kinds() {
                let b = BufferRef { layer, kind };
                let len = topo.buffer_bytes(side, kind, pages);
                let host = HostBuffer::zeroed(len as usize);
                init(b, &host);
                let region = region_id(b);
                backend.register(region, host.region()).map_err(|source| SessionError::Backend {
                    request: None,
                    side,
                    rank,
                    peer: None,
                    source,
                })?;
                pool.buffers.push(PoolBuffer { buffer: b, region, offset: 0, len });
                buffers.push((b, host));
            }
        }
        Ok((pool, buffers))
    }
}

/// One chunk of a request: source pages on the prefill rank, destination pages on the decode ranks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chunk {
    /// Chunk index (0-based).
    pub index: u32,
    /// Whether it is the last chunk.
    pub last: bool,
    /// Prefill pool pages, in token order.
    pub src_pages: Vec<u32>,
    /// Decode pool pages, in token order.
    pub dst_pages: Vec<u32>,
}

/// What one `send_chunk` moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendStats {
    /// Bytes written.
    pub bytes: u64,
    /// Strided ops posted.
    pub ops: u64,
    /// Decode ranks notified.
    pub receivers: u64,
}

struct Receiver {
    peer: PeerId,
    pool: KvPool,
}

/// The prefill side of one rank.
pub struct SenderSession {
    backend: Arc<dyn KvTransferBackend>,
    topo: Topology,
    rank: RankId,
    key: SenderKey,
    pool: KvPool,
    style: NotifyStyle,
    peers: Mutex<HashMap<RankId, Arc<Receiver>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl SenderSession {
    /// A session for prefill `rank`, whose buffers `pool` describes, notifying in `style`.
    pub fn new(
        backend: Arc<dyn KvTransferBackend>,
        topo: Topology,
        rank: RankId,
        pool: KvPool,
        style: NotifyStyle,
    ) -> Result<Self, SessionError> {
        pool.validate(&topo, Side::Prefill, rank)?;
        if !backend.capabilities().supports(style) {
            return Err(SessionError::Backend {
                request: None,
                side: Side::Prefill,
                rank,
                peer: None,
                source: BackendError::Unsupported { backend: backend.name(), what: format!("{style} notifications") },
            });
        }
        Ok(Self { backend, topo, rank, key: SenderKey::of(rank), pool, style, peers: Mutex::new(HashMap::new()) })
    }

    /// The key this rank notifies with.
    pub fn key(&self) -> SenderKey {
        self.key
    }

    /// The decode ranks this rank writes to.
    pub fn receivers(&self) -> Vec<RankId> {
        self.topo.receivers(self.rank)
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn KvTransferBackend> {
        &self.backend
    }

    /// Connects to decode rank `dst` from its endpoint metadata and pool description.
    pub async fn connect(&self, dst: RankId, meta: &EndpointMetadata, dst_pool: KvPool) -> Result<(), SessionError> {
        self.topo.check_rank(Side::Decode, dst)?;
        dst_pool.validate(&self.topo, Side::Decode, dst)?;
        let err = |source| SessionError::Backend {
            request: None,
            side: Side::Prefill,
            rank: self.rank,
            peer: Some(dst),
            source,
        };
        let peer = self.backend.connect(meta).await.map_err(err)?;
        lock(&self.peers).insert(dst, Arc::new(Receiver { peer, pool: dst_pool }));
        Ok(())
    }

    fn receiver(&self, dst: RankId) -> Result<Arc<Receiver>, SessionError> {
        lock(&self.peers).get(&dst).cloned().ok_or(SessionError::NotConnected { rank: self.rank, dst })
    }

    /// Plans and sends one chunk to every decode rank this rank feeds, then notifies each. On any
    /// failure every receiver is told (a failure notification) before the error is returned.
    pub async fn send_chunk(
        &self,
        request: RequestId,
        chunk: &Chunk,
        deadline: Instant,
    ) -> Result<SendStats, SessionError> {
        let plan_err = |source| SessionError::Plan { request, side: Side::Prefill, rank: self.rank, source };
        let pairs = plan_sender(&self.topo, self.rank, &chunk.src_pages, &chunk.dst_pages).map_err(plan_err)?;
        check_pages(Side::Prefill, self.rank, &chunk.src_pages, self.pool.pages).map_err(plan_err)?;
        let mut targets = Vec::with_capacity(pairs.len());
        for pair in &pairs {
            let rx = self.receiver(pair.dst)?;
            check_pages(Side::Decode, pair.dst, &chunk.dst_pages, rx.pool.pages).map_err(plan_err)?;
            targets.push((pair, rx));
        }
        let note = Notification::chunk(request, self.key, chunk.index, chunk.last);
        let sends = targets.iter().map(|(pair, rx)| self.send_pair(request, pair, rx, &note, deadline));
        let results = join_all(sends).await;
        let mut stats = SendStats::default();
        let mut first_err = None;
        for r in results {
            match r {
                Ok(s) => {
                    stats.bytes += s.bytes;
                    stats.ops += s.ops;
                    stats.receivers += 1;
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_err {
            self.fail(request, &e.to_string()).await;
            return Err(e);
        }
        Ok(stats)
    }

    async fn send_pair(
        &self,
        request: RequestId,
        pair: &PairPlan,
        rx: &Receiver,
        note: &Notification,
        deadline: Instant,
    ) -> Result<SendStats, SessionError> {
        let fut = async {
            let err = |source| SessionError::Backend {
                request: Some(request),
                side: Side::Prefill,
                rank: self.rank,
                peer: Some(pair.dst),
                source,
            };
            let mut stats = SendStats::default();
            let mut batch = Vec::with_capacity(WRITE_BATCH.min(pair.op_count() as usize));
            let mut ops = pair.ops().peekable();
            while let Some(op) = ops.next() {
                let s = self
                    .pool
                    .get(op.src_region)
                    .ok_or_else(|| self.missing(Side::Prefill, self.rank, op.src_region))?;
                let d =
                    rx.pool.get(op.dst_region).ok_or_else(|| self.missing(Side::Decode, pair.dst, op.dst_region))?;
                batch.push(WriteOp {
                    src: s.region,
                    src_offset: s.offset + op.src_offset,
                    dst: d.region,
                    dst_offset: d.offset + op.dst_offset,
                    len: op.len,
                    count: op.count,
                    src_stride: op.src_stride,
                    dst_stride: op.dst_stride,
                });
                stats.bytes += op.bytes();
                stats.ops += 1;
                let last = ops.peek().is_none();
                if batch.len() == WRITE_BATCH || last {
                    let attach = (last && self.style == NotifyStyle::Attached).then_some(note);
                    self.backend.write(rx.peer, &batch, attach).await.map_err(err)?;
                    batch.clear();
                }
            }
            match self.style {
                // No ops: the notification alone, ordered after earlier writes.
                NotifyStyle::Attached if stats.ops == 0 => {
                    self.backend.write(rx.peer, &[], Some(note)).await.map_err(err)?
                }
                NotifyStyle::Attached => {}
                NotifyStyle::OutOfBand => self.backend.notify(rx.peer, note).await.map_err(err)?,
            }
            Ok(stats)
        };
        match tokio::time::timeout_at(deadline.into(), fut).await {
            Ok(r) => r,
            Err(_) => Err(SessionError::SendTimeout { request, rank: self.rank, dst: pair.dst }),
        }
    }

    fn missing(&self, side: Side, rank: RankId, b: BufferRef) -> SessionError {
        SessionError::Pool { side, rank, detail: format!("no buffer for layer {} {}", b.layer, b.kind) }
    }

    /// Sends aux data (e.g. the first output token) to every receiver, out of band.
    pub async fn send_aux(&self, request: RequestId, data: Vec<u8>) -> Result<(), SessionError> {
        self.broadcast(request, NotificationBody::Aux(data)).await
    }

    /// Sends per-request state to every receiver, out of band.
    pub async fn send_state(&self, request: RequestId, data: Vec<u8>) -> Result<(), SessionError> {
        self.broadcast(request, NotificationBody::State(data)).await
    }

    async fn broadcast(&self, request: RequestId, body: NotificationBody) -> Result<(), SessionError> {
        self.notify_receivers(&Notification { request, sender: self.key, body }).await
    }

    /// Sends `n` as it is, out of band, to every decode rank this rank feeds (for engines that carry
    /// their own notifications, and for tests that replay or forge them).
    pub async fn notify_receivers(&self, n: &Notification) -> Result<(), SessionError> {
        let request = n.request;
        for dst in self.receivers() {
            let rx = self.receiver(dst)?;
            self.backend.notify(rx.peer, n).await.map_err(|source| SessionError::Backend {
                request: Some(request),
                side: Side::Prefill,
                rank: self.rank,
                peer: Some(dst),
                source,
            })?;
        }
        Ok(())
    }

    /// Tells every connected receiver that this rank failed `request` (best effort, each bounded to
    /// one second), so decode learns at once instead of at its deadline.
    pub async fn fail(&self, request: RequestId, reason: &str) {
        let n = Notification::failure(request, self.key, reason);
        let peers: Vec<_> = self.receivers().into_iter().filter_map(|d| self.receiver(d).ok()).collect();
        let sends =
            peers.iter().map(|rx| tokio::time::timeout(Duration::from_secs(1), self.backend.notify(rx.peer, &n)));
        for r in join_all(sends).await {
            if let Ok(Err(e)) | Err(e) = r.map_err(|_| BackendError::Timeout {
                backend: self.backend.name(),
                what: "failure notification".into(),
                after: Duration::from_secs(1),
            }) {
                tracing::warn!(%request, rank = %self.rank, error = %e, "could not deliver failure notification");
            }
        }
    }
}

/// What the receiver requires beyond the KV chunks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExpectOptions {
    /// An aux notification is required.
    pub aux: bool,
    /// A state notification from every sender is required.
    pub state: bool,
}

/// The decode side of one rank.
pub struct ReceiverSession {
    backend: Arc<dyn KvTransferBackend>,
    topo: Topology,
    rank: RankId,
    pool: KvPool,
    tracker: Mutex<CompletionTracker>,
    pumping: tokio::sync::Mutex<()>,
    wake: tokio::sync::Notify,
}

/// How long one receive poll waits before re-checking status and deadlines.
const POLL: Duration = Duration::from_millis(20);

impl ReceiverSession {
    /// A session for decode `rank`, whose registered buffers `pool` describes.
    pub fn new(
        backend: Arc<dyn KvTransferBackend>,
        topo: Topology,
        rank: RankId,
        pool: KvPool,
    ) -> Result<Self, SessionError> {
        pool.validate(&topo, Side::Decode, rank)?;
        Ok(Self {
            backend,
            topo,
            rank,
            pool,
            tracker: Mutex::new(CompletionTracker::new()),
            pumping: tokio::sync::Mutex::new(()),
            wake: tokio::sync::Notify::new(),
        })
    }

    /// The sender keys every request of this rank waits for.
    pub fn expected_senders(&self) -> Vec<SenderKey> {
        self.topo.expected_senders(self.rank)
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn KvTransferBackend> {
        &self.backend
    }

    /// The pool description to publish to senders.
    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    /// Starts tracking `request`, whose bytes land in `dst_pages`, failing at `deadline`.
    pub fn expect(
        &self,
        request: RequestId,
        dst_pages: &[u32],
        options: ExpectOptions,
        deadline: Instant,
    ) -> Result<(), SessionError> {
        check_pages(Side::Decode, self.rank, dst_pages, self.pool.pages).map_err(|source| SessionError::Plan {
            request,
            side: Side::Decode,
            rank: self.rank,
            source,
        })?;
        let spec = ExpectSpec { senders: self.expected_senders(), aux: options.aux, state: options.state, deadline };
        lock(&self.tracker).expect(request, spec).map_err(|source| SessionError::Tracker { rank: self.rank, source })
    }

    /// The request's status now (a passed deadline fails it).
    pub fn status(&self, request: RequestId) -> Option<Status> {
        lock(&self.tracker).status(request, Instant::now())
    }

    /// Receives events for up to `max_wait` and feeds them to the tracker. Returns how many.
    pub async fn pump(&self, max_wait: Duration) -> Result<usize, SessionError> {
        let events = self.backend.recv(max_wait).await.map_err(|source| SessionError::Backend {
            request: None,
            side: Side::Decode,
            rank: self.rank,
            peer: None,
            source,
        })?;
        let now = Instant::now();
        let mut t = lock(&self.tracker);
        for e in &events {
            match e {
                BackendEvent::Notification(n) => {
                    let h = t.handle(n, now);
                    tracing::trace!(rank = %self.rank, notification = %n, handled = ?h);
                }
                BackendEvent::PeerLost { identity, reason } => {
                    let key = SenderKey::from_u64(*identity);
                    let failed = t.sender_lost(key, reason);
                    tracing::debug!(rank = %self.rank, %key, ?failed, "sender lost");
                }
            }
        }
        Ok(events.len())
    }

    /// Waits until `request` is done (Ok) or failed (an error with the reason). Never waits past the
    /// deadline given to [`Self::expect`].
    pub async fn wait(&self, request: RequestId) -> Result<(), SessionError> {
        loop {
            match self.status(request) {
                None => return Err(SessionError::UnknownRequest { request, rank: self.rank }),
                Some(Status::Done) => return Ok(()),
                Some(Status::Failed(failure)) => {
                    return Err(SessionError::Failed { request, rank: self.rank, failure })
                }
                Some(Status::Pending) => {}
            }
            match self.pumping.try_lock() {
                Ok(_guard) => {
                    let r = self.pump(POLL).await;
                    self.wake.notify_waiters();
                    r?;
                }
                Err(_) => {
                    let _ = tokio::time::timeout(POLL, self.wake.notified()).await;
                }
            }
        }
    }

    /// Aborts a pending request on the receiver side.
    pub fn abort(&self, request: RequestId, reason: &str) {
        lock(&self.tracker).abort(request, reason);
    }

    /// Stops tracking `request` and returns its final status.
    pub fn release(&self, request: RequestId) -> Option<Status> {
        lock(&self.tracker).release(request, Instant::now())
    }

    /// The aux payload of a request, once received.
    pub fn aux(&self, request: RequestId) -> Option<Vec<u8>> {
        lock(&self.tracker).aux(request).map(<[u8]>::to_vec)
    }

    /// Tracker counters (dropped duplicates, unknown requests...).
    pub fn stats(&self) -> TrackerStats {
        lock(&self.tracker).stats()
    }
}
