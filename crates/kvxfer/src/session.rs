//! Sender and receiver sessions: the planner, the completion tracker and a backend, driven per request.
//!
//! The flow of one request (SGLang's room) is decode-initiated: the decode rank allocates destination
//! pages, calls [`ReceiverSession::expect`], and hands the page list to the prefill ranks (through the
//! engine's own scheduler or kvxfer's bootstrap). Each prefill rank then calls
//! [`SenderSession::send_chunk`] for every chunk; the session plans its pairs, posts the writes, and
//! notifies with its sender key, attached to the data or out of band after completion, as the
//! session's [`NotifyStyle`] says. The decode rank polls [`ReceiverSession::status`] or awaits
//! [`ReceiverSession::wait`].
//!
//! The engine API ([`crate::engine::Agent`]) posts through a [`SendPath`], the data path a
//! [`SenderSession`] wraps: its prefill agents keep their [`DecodeLink`]s with the rest of what
//! they know of their peers, behind their one lock. Its decode side is the core's
//! [`kvxfer_core::decode::DecodeBook`], not a [`ReceiverSession`]. [`SenderSession`] (a send path
//! and a map of its links) and [`ReceiverSession`] serve callers without membership or request
//! lifecycle: the conformance suite and `kvxfer bench --model`.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::join_all;
use kvxfer_core::plan::{check_pages, plan_sender, PairPlan};
use kvxfer_core::IndexedOp;
use kvxfer_core::{
    BackendError, BackendEvent, BufferRef, CompletionTracker, ConfigError, EndpointMetadata, ExpectSpec, Failure,
    Fence, HostBuffer, KvTransferBackend, MemDesc, MemError, Notification, NotificationBody, NotifyStyle, PeerId,
    PlanError, RankId, RegionId, Registration, RequestId, SenderKey, Side, Status, Topology, TrackerConfig,
    TrackerError, TrackerStats, Transfer, WriteOp,
};
use serde::{Deserialize, Serialize};

/// Most ops handed to the backend per `post` (fewer when the backend's limit is lower); a plan is
/// never materialised whole.
pub const WRITE_BATCH: usize = 4096;

/// The smallest byte budget of a batch ([`Window::batch_bytes`]): a small window does not make a
/// post per page.
pub const MIN_BATCH_BYTES: u64 = 1 << 20;

/// How much of one (prefill, decode) pair's traffic may be in flight at once: posted batches whose
/// transfers are not final yet. The session waits for the oldest batch before posting past either
/// bound, so memory held by the backend stays bounded while the transport is kept busy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Window {
    /// Bytes in flight per pair.
    pub bytes: u64,
    /// Ops in flight per pair.
    pub ops: u64,
}

impl Window {
    /// Bytes after which a batch is posted: a quarter of the window, so that batches keep the
    /// transport busy while the oldest completes, and at least [`MIN_BATCH_BYTES`] (a page run
    /// longer than that is a batch of its own).
    pub fn batch_bytes(&self) -> u64 {
        (self.bytes / 4).max(MIN_BATCH_BYTES)
    }
}

impl Default for Window {
    /// 64 MiB and 16 batches' worth of ops per pair.
    fn default() -> Self {
        Self { bytes: 64 << 20, ops: 16 * WRITE_BATCH as u64 }
    }
}

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
    /// The host pool [`KvPool::allocate`] was asked for does not fit in the memory this machine has
    /// available: refused before anything is allocated. Ask for fewer pages (requests x tokens),
    /// fewer layers, or a smaller page size or model; or pass the engine's own memory.
    #[error(
        "{side} rank {rank}: a host KV pool of {needed} bytes ({:.1} GiB: {pages} pages x {layers} layers) does not fit in the {available} bytes ({:.1} GiB) this machine has available (MemAvailable); nothing was allocated. Use fewer pages (requests x tokens), fewer layers, or a smaller page size or model",
        *needed as f64 / GIB, *available as f64 / GIB
    )]
    PoolTooLarge {
        /// Side.
        side: Side,
        /// Rank.
        rank: RankId,
        /// Bytes the pool would need (every layer of the rank's stage, K and V).
        needed: u64,
        /// Bytes available for new allocations when it was asked.
        available: u64,
        /// Pages asked for.
        pages: u32,
        /// Layers of the rank's stage.
        layers: u32,
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
    /// The send was cancelled (the request was aborted); its transfers were aborted first.
    #[error("request {request}: prefill rank {rank} -> decode rank {dst}: cancelled ({reason}); its in-flight writes were aborted")]
    Cancelled {
        /// Request.
        request: RequestId,
        /// Local rank.
        rank: RankId,
        /// Peer rank.
        dst: RankId,
        /// Why.
        reason: String,
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

/// The region a decode rank registers for its peers' warm-up writes ([`SenderSession::warm_up`]):
/// never a pool buffer ([`region_id`] gives those `layer * 4 + kind`).
pub const WARMUP_REGION: RegionId = RegionId(u32::MAX);

/// Bytes of decode `rank`'s warm-up region: one page of each of its buffers, back to back (what
/// a one-page request writes to that rank, from all its senders together).
pub fn warmup_bytes(topo: &Topology, rank: RankId) -> u64 {
    warmup_pool(topo, rank, WARMUP_REGION).buffers.iter().map(|b| b.len).sum()
}

/// Decode `rank`'s buffers as one page each, back to back in `region`.
fn warmup_pool(topo: &Topology, rank: RankId, region: RegionId) -> KvPool {
    let mut pool = KvPool { pages: 1, buffers: Vec::new() };
    let mut offset = 0;
    for layer in 0..topo.stage_layers(Side::Decode, rank.pp) {
        for &kind in topo.kv().kinds() {
            let len = topo.buffer_bytes(Side::Decode, kind, 1);
            pool.buffers.push(PoolBuffer { buffer: BufferRef { layer, kind }, region, offset, len });
            offset += len;
        }
    }
    pool
}

impl KvPool {
    /// Finds a buffer.
    pub fn get(&self, b: BufferRef) -> Option<&PoolBuffer> {
        self.buffers.iter().find(|x| x.buffer == b)
    }

    /// Checks that every buffer `side`'s `rank` needs exists and is large enough for `pages` pages.
    pub fn validate(&self, topo: &Topology, side: Side, rank: RankId) -> Result<(), SessionError> {
        topo.check_rank(side, rank)?;
        for layer in 0..topo.stage_layers(side, rank.pp) {
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
    /// with `backend` under [`region_id`]. Returns the pool and its memory (keep it alive while the
    /// pool is in use; [`PoolMemory::close`] gives a buffer back).
    pub async fn allocate(
        topo: &Topology,
        side: Side,
        rank: RankId,
        pages: u32,
        backend: &dyn KvTransferBackend,
        init: &(dyn Fn(BufferRef, &mut [u8]) + Sync),
    ) -> Result<(KvPool, Vec<PoolMemory>), SessionError> {
        topo.check_rank(side, rank)?;
        let needed = topo.checked_pool_bytes(side, rank.pp, pages)?;
        check_fits(needed, available_memory(), side, rank, pages, topo.stage_layers(side, rank.pp))?;
        let mut memory = Vec::new();
        let mut pool = KvPool { pages, buffers: Vec::new() };
        for layer in 0..topo.stage_layers(side, rank.pp) {
            for &kind in topo.kv().kinds() {
                let b = BufferRef { layer, kind };
                let len = topo.buffer_bytes(side, kind, pages);
                let mut host = HostBuffer::zeroed(len as usize);
                init(b, host.as_mut_slice().expect("a fresh buffer has no descriptor"));
                let region = region_id(b);
                let desc = host.desc();
                let registration = backend
                    .register(region, desc.clone())
                    .await
                    .map_err(|source| SessionError::Backend { request: None, side, rank, peer: None, source })?;
                pool.buffers.push(PoolBuffer { buffer: b, region, offset: 0, len });
                memory.push(PoolMemory { buffer: b, host, desc, registration });
            }
        }
        Ok((pool, memory))
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// Bytes this machine has available for new allocations without swapping (`MemAvailable` of
/// `/proc/meminfo`); `None` where that is not known (not Linux, no procfs), and then nothing is
/// refused up front.
pub fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&info)
}

fn parse_mem_available(info: &str) -> Option<u64> {
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.trim_start_matches("MemAvailable:").trim().trim_end_matches("kB").trim().parse().ok()?;
    kib.checked_mul(1024)
}

/// Refuses a pool of `needed` bytes that does not fit in `available` (when known).
fn check_fits(
    needed: u64,
    available: Option<u64>,
    side: Side,
    rank: RankId,
    pages: u32,
    layers: u32,
) -> Result<(), SessionError> {
    match available {
        Some(available) if needed > available => {
            Err(SessionError::PoolTooLarge { side, rank, needed, available, pages, layers })
        }
        _ => Ok(()),
    }
}

/// One registered buffer of a pool made by [`KvPool::allocate`].
pub struct PoolMemory {
    /// Which (layer, kind) it holds.
    pub buffer: BufferRef,
    host: HostBuffer,
    desc: MemDesc,
    registration: Registration,
}

impl std::fmt::Debug for PoolMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PoolMemory(layer {} {}, {:?})", self.buffer.layer, self.buffer.kind, self.registration)
    }
}

impl PoolMemory {
    /// The registered memory, for reading pages in place through [`MemDesc::read_guard`]. Read only
    /// pages no transfer writes any more: those of a completed request, or of one whose transfers
    /// all ended.
    pub fn desc(&self) -> &MemDesc {
        &self.desc
    }

    /// Copies `out.len()` bytes at `offset` out of the registered buffer: the engine reading its
    /// own pool (decode pages of a completed request). Refused while an in-process transfer writes
    /// an overlapping range; pages that a peer may still write one-sidedly must not be read.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), MemError> {
        out.copy_from_slice(self.desc.read_guard(offset, out.len() as u64)?.as_slice());
        Ok(())
    }

    /// Copies `data` into the registered buffer at `offset`: the engine writing its own pool (the
    /// KV cache prefill computes, pages decode frees). Refused while an in-process transfer touches
    /// an overlapping range; never write pages a transfer may still read or write.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), MemError> {
        self.desc.write_guard(offset, data.len() as u64)?.as_mut_slice().copy_from_slice(data);
        Ok(())
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.desc.len() as u64
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.desc.is_empty()
    }

    /// The registration.
    pub fn registration(&self) -> &Registration {
        &self.registration
    }

    /// Closes the registration (waiting, up to `deadline`, until nothing local or remote can touch
    /// the buffer) and gives the buffer back, readable and writable again.
    pub async fn close(self, deadline: Instant) -> Result<HostBuffer, BackendError> {
        let PoolMemory { host, desc, registration, .. } = self;
        drop(desc);
        registration.close(deadline).await?;
        Ok(host)
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

/// A connection to one decode rank as the send path uses it: the rank, its backend peer and its
/// pool's description. Cheap to clone (the pool is shared). [`SendPath::open`] makes one; who
/// keeps it decides which connection a send uses: the engine's agent keeps its links with the rest
/// of what it knows of its peers, behind its one lock, and [`SenderSession`] keeps a map of them.
#[derive(Debug, Clone)]
pub struct DecodeLink {
    rank: RankId,
    peer: PeerId,
    pool: Arc<KvPool>,
}

impl DecodeLink {
    /// The decode rank.
    pub fn rank(&self) -> RankId {
        self.rank
    }

    /// Its backend peer.
    pub fn peer(&self) -> PeerId {
        self.peer
    }

    /// Its pool, as its registration described it.
    pub fn pool(&self) -> &KvPool {
        &self.pool
    }
}

/// The request id [`SenderSession::warm_up`]'s errors name (no request of an engine's).
pub const WARMUP_REQUEST: RequestId = RequestId(u64::MAX);

/// The data path of one prefill rank: plans a (request, decode rank) pair's writes, posts them in
/// a window, and notifies, over [`DecodeLink`]s its caller keeps. It holds no connection table and
/// no lock: the engine's agent keeps its links under its one lock, and [`SenderSession`] (for
/// callers without an agent) keeps a map of them.
pub struct SendPath {
    backend: Arc<dyn KvTransferBackend>,
    topo: Topology,
    rank: RankId,
    key: SenderKey,
    pool: KvPool,
    style: NotifyStyle,
    window: Window,
}

/// The prefill side of one rank for callers without an engine agent (the conformance suite,
/// `kvxfer bench --model`): a [`SendPath`] and the decode ranks it connected to, by rank.
pub struct SenderSession {
    path: SendPath,
    links: Mutex<HashMap<RankId, DecodeLink>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl SendPath {
    /// A send path for prefill `rank`, whose buffers `pool` describes, notifying in `style`.
    pub fn new(
        backend: Arc<dyn KvTransferBackend>,
        topo: Topology,
        rank: RankId,
        pool: KvPool,
        style: NotifyStyle,
    ) -> Result<Self, SessionError> {
        pool.validate(&topo, Side::Prefill, rank)?;
        backend.capabilities().check_style(backend.name(), style).map_err(|source| SessionError::Backend {
            request: None,
            side: Side::Prefill,
            rank,
            peer: None,
            source,
        })?;
        Ok(Self { backend, topo, rank, key: SenderKey::of(rank), pool, style, window: Window::default() })
    }

    /// The same path with another in-flight window per pair.
    pub fn with_window(mut self, window: Window) -> Self {
        self.window = Window { bytes: window.bytes.max(1), ops: window.ops.max(1) };
        self
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

    /// Connects to decode rank `dst` from its endpoint metadata and pool description; the caller
    /// keeps the link (nothing here remembers it).
    pub async fn open(
        &self,
        dst: RankId,
        meta: &EndpointMetadata,
        dst_pool: KvPool,
    ) -> Result<DecodeLink, SessionError> {
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
        Ok(DecodeLink { rank: dst, peer, pool: Arc::new(dst_pool) })
    }

    /// Warms the connection `link` to a decode rank (made by [`Self::open`]): writes what a
    /// one-page request writes to it (page 0 of this rank's pool, the same ops and sizes)
    /// `rounds` times into the warm-up region `region` of `len` bytes that the decode rank
    /// registered for it ([`WARMUP_REGION`], [`warmup_bytes`]), with no notification. A backend's
    /// first transfers on a connection pay for what it sets up lazily (buffer pools, protocol
    /// state); this moves that cost from the first request to connect time. Nothing of the decode
    /// rank's pool is touched, and the source pages are only read. Fails (and posts nothing) when
    /// `len` is too small for one page; a transfer error is returned after this rank's writes
    /// were fenced.
    pub async fn warm_up(
        &self,
        link: &DecodeLink,
        region: RegionId,
        len: u64,
        rounds: u32,
        deadline: Instant,
    ) -> Result<SendStats, SessionError> {
        let dst = link.rank;
        let pool = warmup_pool(&self.topo, dst, region);
        let need: u64 = pool.buffers.iter().map(|b| b.len).sum();
        if len < need {
            return Err(SessionError::Pool {
                side: Side::Decode,
                rank: dst,
                detail: format!("its warm-up region has {len} bytes; one page of its pool needs {need}"),
            });
        }
        let mut stats = SendStats::default();
        if self.pool.pages == 0 {
            return Ok(stats);
        }
        let plan_err =
            |source| SessionError::Plan { request: WARMUP_REQUEST, side: Side::Prefill, rank: self.rank, source };
        let pairs = plan_sender(&self.topo, self.rank, &[0], &[0]).map_err(plan_err)?;
        let Some(pair) = pairs.iter().find(|p| p.dst == dst) else {
            return Err(plan_err(PlanError::NotAReceiver { src: self.rank, dst }));
        };
        let scratch = DecodeLink { rank: dst, peer: link.peer, pool: Arc::new(pool) };
        let never = Cancel::new();
        for _ in 0..rounds {
            let s = self.send_pair(WARMUP_REQUEST, pair, 0..pair.layers, &scratch, None, deadline, &never).await?;
            stats.bytes += s.bytes;
            stats.ops += s.ops;
        }
        stats.receivers = 1;
        Ok(stats)
    }

    /// Sends part of one chunk to ONE decode rank: the layers `layers` (stage-local) of the pages
    /// `src_pages` into that rank's `dst_pages`, then, when `note` is given, that notification
    /// (attached to the last batch after every earlier batch completed, or out of band after the
    /// writes completed). This is what the engine API drives per (request, decode rank), each with its
    /// own generation and page list. `cancel` aborts it: in-flight transfers are aborted and fenced,
    /// then [`SessionError::Cancelled`] is returned. Nothing is posted on a plan or range error.
    #[allow(clippy::too_many_arguments)]
    pub async fn send_to(
        &self,
        request: RequestId,
        link: &DecodeLink,
        src_pages: &[u32],
        dst_pages: &[u32],
        layers: std::ops::Range<u32>,
        note: Option<&Notification>,
        deadline: Instant,
        cancel: &Cancel,
    ) -> Result<SendStats, SessionError> {
        let plan_err = |source| SessionError::Plan { request, side: Side::Prefill, rank: self.rank, source };
        check_pages(Side::Prefill, self.rank, src_pages, self.pool.pages).map_err(plan_err)?;
        let (dst, rx) = (link.rank, link);
        check_pages(Side::Decode, dst, dst_pages, rx.pool.pages).map_err(plan_err)?;
        let pairs = plan_sender(&self.topo, self.rank, src_pages, dst_pages).map_err(plan_err)?;
        let Some(pair) = pairs.iter().find(|p| p.dst == dst) else {
            return Err(SessionError::Plan {
                request,
                side: Side::Prefill,
                rank: self.rank,
                source: PlanError::NotAReceiver { src: self.rank, dst },
            });
        };
        if layers.end > pair.layers || layers.start > layers.end {
            return Err(SessionError::Pool {
                side: Side::Prefill,
                rank: self.rank,
                detail: format!("layer range {layers:?} is outside this stage's {} layers", pair.layers),
            });
        }
        self.send_pair(request, pair, layers, rx, note, deadline, cancel).await
    }

    #[allow(clippy::too_many_arguments)]
    async fn send_pair(
        &self,
        request: RequestId,
        pair: &PairPlan,
        layers: std::ops::Range<u32>,
        rx: &DecodeLink,
        note: Option<&Notification>,
        deadline: Instant,
        cancel: &Cancel,
    ) -> Result<SendStats, SessionError> {
        let mut inflight = Inflight::default();
        let r = tokio::select! {
            r = self.pipeline(request, pair, layers, rx, note, deadline, &mut inflight) => r,
            reason = cancel.cancelled() => Err(SessionError::Cancelled { request, rank: self.rank, dst: pair.dst, reason }),
        };
        if r.is_err() {
            // Fence before reporting: nothing of this pair may still read the source or land at
            // the peer once the caller hears of the failure (bounded: a transfer that does not
            // fence in time is the backend's peer failure, reported by the backend).
            inflight.abort_all(Instant::now() + ABORT_FENCE).await;
        }
        r
    }

    /// Posts a pair's batches, keeping up to the window in flight; the attached notification rides
    /// on the last batch, posted only after every earlier batch completed.
    #[allow(clippy::too_many_arguments)]
    async fn pipeline(
        &self,
        request: RequestId,
        pair: &PairPlan,
        layers: std::ops::Range<u32>,
        rx: &DecodeLink,
        note: Option<&Notification>,
        deadline: Instant,
        inflight: &mut Inflight,
    ) -> Result<SendStats, SessionError> {
        let err = |source| match source {
            BackendError::Timeout { .. } => SessionError::SendTimeout { request, rank: self.rank, dst: pair.dst },
            source => SessionError::Backend {
                request: Some(request),
                side: Side::Prefill,
                rank: self.rank,
                peer: Some(pair.dst),
                source,
            },
        };
        let per_post = (WRITE_BATCH as u64).min(self.backend.capabilities().limits.max_ops_per_post).max(1) as usize;
        // One indexed op per (layer, slice): the page template at every run of the pair (a few
        // hundred at most), cut into posts of `per_post` writes or the window's batch bytes.
        let mut ops = Vec::new();
        for l in layers.filter(|_| pair.writes()) {
            for slice in &pair.slices {
                let t = pair.page_template(l, slice);
                let s =
                    self.pool.get(t.src_region).ok_or_else(|| self.missing(Side::Prefill, self.rank, t.src_region))?;
                let d = rx.pool.get(t.dst_region).ok_or_else(|| self.missing(Side::Decode, pair.dst, t.dst_region))?;
                let template = WriteOp {
                    src: s.region,
                    src_offset: s.offset + t.src_offset,
                    dst: d.region,
                    dst_offset: d.offset + t.dst_offset,
                    len: t.len,
                    count: t.count,
                    src_stride: t.src_stride,
                    dst_stride: t.dst_stride,
                };
                ops.push(IndexedOp::new(template, Arc::clone(&pair.runs)));
            }
        }
        let mut stats = SendStats::default();
        let batches = IndexedOp::batches(ops, per_post, self.window.batch_bytes());
        let n = batches.len();
        for (i, batch) in batches.into_iter().enumerate() {
            let batch_bytes: u64 = batch.iter().map(IndexedOp::bytes).sum();
            let batch_writes = batch.iter().map(IndexedOp::write_ops).sum::<usize>() as u64;
            stats.bytes += batch_bytes;
            stats.ops += batch_writes;
            let attach = i + 1 == n && self.style == NotifyStyle::Attached && note.is_some();
            if attach {
                inflight.drain(deadline).await.map_err(err)?;
            } else {
                inflight.make_room(batch_bytes, batch_writes, self.window, deadline).await.map_err(err)?;
            }
            let t = self.backend.post_indexed(rx.peer, &batch, if attach { note } else { None }).map_err(err)?;
            inflight.push(t, batch_bytes, batch_writes);
        }
        inflight.drain(deadline).await.map_err(err)?;
        let Some(note) = note else { return Ok(stats) };
        match self.style {
            // No ops: the notification alone, ordered after the (completed) earlier writes.
            NotifyStyle::Attached if stats.ops == 0 => {
                let t = self.backend.post(rx.peer, &[], Some(note)).map_err(err)?;
                inflight.push(t, 0, 0);
                inflight.drain(deadline).await.map_err(err)?;
            }
            NotifyStyle::Attached => {}
            NotifyStyle::OutOfBand => tokio::time::timeout_at(deadline.into(), self.backend.notify(rx.peer, note))
                .await
                .map_err(|_| SessionError::SendTimeout { request, rank: self.rank, dst: pair.dst })?
                .map_err(err)?,
        }
        Ok(stats)
    }

    fn missing(&self, side: Side, rank: RankId, b: BufferRef) -> SessionError {
        SessionError::Pool { side, rank, detail: format!("no buffer for layer {} {}", b.layer, b.kind) }
    }

    /// Sends one notification to the decode rank of `link`, out of band, bounded by
    /// [`NOTIFY_TIMEOUT`].
    pub async fn notify(&self, link: &DecodeLink, n: &Notification) -> Result<(), SessionError> {
        let (peer, dst, request) = (link.peer, link.rank, n.request);
        match tokio::time::timeout(NOTIFY_TIMEOUT, self.backend.notify(peer, n)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(source)) => Err(SessionError::Backend {
                request: Some(request),
                side: Side::Prefill,
                rank: self.rank,
                peer: Some(dst),
                source,
            }),
            Err(_) => Err(SessionError::SendTimeout { request, rank: self.rank, dst }),
        }
    }
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
        Ok(Self { path: SendPath::new(backend, topo, rank, pool, style)?, links: Mutex::new(HashMap::new()) })
    }

    /// The same session with another in-flight window per pair.
    pub fn with_window(mut self, window: Window) -> Self {
        self.path = self.path.with_window(window);
        self
    }

    /// Its data path.
    pub fn path(&self) -> &SendPath {
        &self.path
    }

    /// The key this rank notifies with.
    pub fn key(&self) -> SenderKey {
        self.path.key
    }

    /// The decode ranks this rank writes to.
    pub fn receivers(&self) -> Vec<RankId> {
        self.path.receivers()
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn KvTransferBackend> {
        &self.path.backend
    }

    /// Connects to decode rank `dst` from its endpoint metadata and pool description (replacing an
    /// earlier connection to it in this session's map).
    pub async fn connect(&self, dst: RankId, meta: &EndpointMetadata, dst_pool: KvPool) -> Result<(), SessionError> {
        let link = self.path.open(dst, meta, dst_pool).await?;
        lock(&self.links).insert(dst, link);
        Ok(())
    }

    /// [`SendPath::warm_up`] on the connection to decode rank `dst`.
    pub async fn warm_up(
        &self,
        dst: RankId,
        region: RegionId,
        len: u64,
        rounds: u32,
        deadline: Instant,
    ) -> Result<SendStats, SessionError> {
        let link = self.link(dst)?;
        self.path.warm_up(&link, region, len, rounds, deadline).await
    }

    /// The backend peer of a connected decode rank.
    pub fn peer_of(&self, dst: RankId) -> Option<PeerId> {
        lock(&self.links).get(&dst).map(|l| l.peer)
    }

    fn link(&self, dst: RankId) -> Result<DecodeLink, SessionError> {
        lock(&self.links).get(&dst).cloned().ok_or(SessionError::NotConnected { rank: self.path.rank, dst })
    }

    /// Plans and sends one chunk to every decode rank this rank feeds, then notifies each. On any
    /// failure (a plan error, a page out of range, a missing connection, a transfer error) every
    /// connected receiver is told (a failure notification, after this rank's own transfers settled)
    /// before the error is returned.
    pub async fn send_chunk(
        &self,
        request: RequestId,
        chunk: &Chunk,
        deadline: Instant,
    ) -> Result<SendStats, SessionError> {
        match self.send_chunk_inner(request, chunk, deadline).await {
            Ok(s) => Ok(s),
            Err(e) => {
                self.fail(request, &e.to_string()).await;
                Err(e)
            }
        }
    }

    async fn send_chunk_inner(
        &self,
        request: RequestId,
        chunk: &Chunk,
        deadline: Instant,
    ) -> Result<SendStats, SessionError> {
        let plan_err = |source| SessionError::Plan { request, side: Side::Prefill, rank: self.path.rank, source };
        let pairs =
            plan_sender(&self.path.topo, self.path.rank, &chunk.src_pages, &chunk.dst_pages).map_err(plan_err)?;
        check_pages(Side::Prefill, self.path.rank, &chunk.src_pages, self.path.pool.pages).map_err(plan_err)?;
        let mut targets = Vec::with_capacity(pairs.len());
        for pair in &pairs {
            let rx = self.link(pair.dst)?;
            check_pages(Side::Decode, pair.dst, &chunk.dst_pages, rx.pool.pages).map_err(plan_err)?;
            targets.push((pair, rx));
        }
        let note = Notification::chunk(request, self.path.key, chunk.index, chunk.last);
        let never = Cancel::new();
        let sends = targets.iter().map(|(pair, rx)| {
            let layers = 0..pair.layers;
            self.path.send_pair(request, pair, layers, rx, Some(&note), deadline, &never)
        });
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
        match first_err {
            Some(e) => Err(e),
            None => Ok(stats),
        }
    }

    /// [`SendPath::send_to`] on the connection to decode rank `dst`.
    #[allow(clippy::too_many_arguments)]
    pub async fn send_to(
        &self,
        request: RequestId,
        dst: RankId,
        src_pages: &[u32],
        dst_pages: &[u32],
        layers: std::ops::Range<u32>,
        note: Option<&Notification>,
        deadline: Instant,
        cancel: &Cancel,
    ) -> Result<SendStats, SessionError> {
        let link = self.link(dst)?;
        self.path.send_to(request, &link, src_pages, dst_pages, layers, note, deadline, cancel).await
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
        self.notify_receivers(&Notification::new(request, self.path.key, body)).await
    }

    /// Sends `n` as it is, out of band, to every decode rank this rank feeds (for engines that carry
    /// their own notifications, and for tests that replay or forge them). Every receiver is tried,
    /// each bounded by [`NOTIFY_TIMEOUT`]; the first error is returned after all were tried.
    pub async fn notify_receivers(&self, n: &Notification) -> Result<(), SessionError> {
        let request = n.request;
        let mut first = None;
        for dst in self.receivers() {
            let r = match self.link(dst) {
                Ok(link) => self.path.notify(&link, n).await,
                Err(e) => Err(e),
            };
            if let Err(e) = r {
                tracing::warn!(%request, rank = %self.path.rank, %dst, error = %e, "could not notify receiver");
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Sends one notification to one connected decode rank, bounded by [`NOTIFY_TIMEOUT`].
    pub async fn notify_rank(&self, dst: RankId, n: &Notification) -> Result<(), SessionError> {
        let link = self.link(dst)?;
        self.path.notify(&link, n).await
    }

    /// Tells every connected receiver that this rank failed `request` (best effort, each bounded by
    /// [`NOTIFY_TIMEOUT`]), so decode learns at once instead of at its deadline. Call it only after
    /// this rank's transfers of the request settled: the failure also counts as this rank's fence.
    pub async fn fail(&self, request: RequestId, reason: &str) {
        let n = Notification::failure(request, self.path.key, reason);
        let links: Vec<_> = self.receivers().into_iter().filter_map(|d| self.link(d).ok()).collect();
        let sends = links.iter().map(|l| self.path.notify(l, &n));
        for r in join_all(sends).await {
            if let Err(e) = r {
                tracing::warn!(%request, rank = %self.path.rank, error = %e, "could not deliver failure notification");
            }
        }
    }
}

/// Bound on one out-of-band notification (failure, abort, fence, handoff).
pub const NOTIFY_TIMEOUT: Duration = Duration::from_secs(5);

/// A cancellation signal for [`SenderSession::send_to`]: once cancelled (with a reason), every send
/// watching it aborts its in-flight transfers and returns [`SessionError::Cancelled`]. Cheap to
/// clone; all clones share the signal.
#[derive(Clone, Debug, Default)]
pub struct Cancel {
    inner: Arc<CancelInner>,
}

#[derive(Debug, Default)]
struct CancelInner {
    /// Set once, by the first [`Cancel::cancel`] (no lock: a request's cancel is read on every
    /// send of it).
    reason: std::sync::OnceLock<String>,
    notify: tokio::sync::Notify,
}

impl Cancel {
    /// A signal not cancelled yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Cancels, with a reason (the first reason wins). Returns whether this call cancelled it.
    pub fn cancel(&self, reason: impl Into<String>) -> bool {
        if self.inner.reason.set(reason.into()).is_err() {
            return false;
        }
        self.inner.notify.notify_waiters();
        true
    }

    /// The reason, once cancelled.
    pub fn reason(&self) -> Option<String> {
        self.inner.reason.get().cloned()
    }

    /// Resolves (with the reason) once cancelled.
    pub async fn cancelled(&self) -> String {
        loop {
            let notified = self.inner.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(r) = self.reason() {
                return r;
            }
            notified.await;
        }
    }
}

/// How long a failed send waits for its in-flight transfers to fence before it reports.
const ABORT_FENCE: Duration = Duration::from_secs(10);

/// One pair's transfers in flight, oldest first.
#[derive(Default)]
struct Inflight {
    queue: VecDeque<(Transfer, u64, u64)>,
    bytes: u64,
    ops: u64,
}

impl Inflight {
    fn push(&mut self, t: Transfer, bytes: u64, ops: u64) {
        self.bytes += bytes;
        self.ops += ops;
        self.queue.push_back((t, bytes, ops));
    }

    async fn pop_wait(&mut self, deadline: Instant) -> Result<(), BackendError> {
        if let Some((t, bytes, ops)) = self.queue.front() {
            t.wait(deadline).await?;
            self.bytes -= bytes;
            self.ops -= ops;
            self.queue.pop_front();
        }
        Ok(())
    }

    /// Waits for the oldest transfers until `bytes` and `ops` more fit the window.
    async fn make_room(&mut self, bytes: u64, ops: u64, w: Window, deadline: Instant) -> Result<(), BackendError> {
        while !self.queue.is_empty() && (self.bytes + bytes > w.bytes || self.ops + ops > w.ops) {
            self.pop_wait(deadline).await?;
        }
        Ok(())
    }

    async fn drain(&mut self, deadline: Instant) -> Result<(), BackendError> {
        while !self.queue.is_empty() {
            self.pop_wait(deadline).await?;
        }
        Ok(())
    }

    /// Aborts every transfer still in flight and waits for their fences.
    async fn abort_all(&mut self, deadline: Instant) {
        let aborts = self.queue.iter().map(|(t, _, _)| t.abort(deadline));
        for r in join_all(aborts).await {
            if let Err(e) = r {
                tracing::warn!(error = %e, "a transfer did not fence after a failed send");
            }
        }
        self.queue.clear();
        self.bytes = 0;
        self.ops = 0;
    }
}

/// What the receiver requires beyond the KV chunks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExpectOptions {
    /// An aux notification is required.
    pub aux: bool,
    /// A state notification from every sender is required.
    pub state: bool,
    /// A digest from every sender is required ([`kvxfer_core::digest`]; the caller verifies it
    /// once the request is done).
    pub digest: bool,
    /// Wait for these senders instead of every sender the topology gives this rank: for runs that
    /// start only part of the prefill side (`kvxfer bench --model` runs prefill rank 0 alone). A
    /// notification from any other key still fails the request. `None` (the default) is what a
    /// serving engine wants.
    pub only_senders: Option<Vec<SenderKey>>,
    /// Which use of the room this is: every notification of it must carry the same generation, so
    /// nothing of an earlier use of the room can complete or fail this one. 0 for callers that never
    /// reuse a request id.
    pub generation: u64,
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

    /// The same session with other tracker bounds (early notifications, released generations).
    pub fn with_tracker_config(self, config: TrackerConfig) -> Self {
        *lock(&self.tracker) = CompletionTracker::with_config(config);
        self
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
        let senders = match options.only_senders {
            Some(keys) => keys,
            None => self.expected_senders(),
        };
        let spec = ExpectSpec {
            generation: options.generation,
            senders,
            aux: options.aux,
            state: options.state,
            digest: options.digest,
            deadline,
        };
        lock(&self.tracker)
            .expect(request, spec, Instant::now())
            .map(|_| ())
            .map_err(|source| SessionError::Tracker { rank: self.rank, source })
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

    /// Where the request's fence stands: [`Fence::Closed`] when its pages may be reused.
    pub fn fence(&self, request: RequestId) -> Option<Fence> {
        lock(&self.tracker).fence(request, Instant::now())
    }

    /// Tracker counters (dropped duplicates, early notifications...).
    pub fn stats(&self) -> TrackerStats {
        lock(&self.tracker).stats()
    }
}

#[cfg(test)]
mod memory_tests {
    use super::*;

    #[test]
    fn mem_available_is_read_in_bytes() {
        let info = "MemTotal:       24576000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(parse_mem_available(info), Some(20_000_000 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 5 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: lots kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: 18446744073709551615 kB\n"), None, "overflow is not a size");
    }

    #[test]
    fn a_pool_is_refused_only_when_it_does_not_fit() {
        let r = RankId::new(0, 0);
        assert!(check_fits(10, Some(10), Side::Decode, r, 1, 1).is_ok());
        assert!(check_fits(10, None, Side::Decode, r, 1, 1).is_ok(), "unknown memory refuses nothing");
        let e = check_fits(11, Some(10), Side::Prefill, r, 3, 2).unwrap_err();
        assert!(matches!(e, SessionError::PoolTooLarge { needed: 11, available: 10, pages: 3, layers: 2, .. }));
    }
}
