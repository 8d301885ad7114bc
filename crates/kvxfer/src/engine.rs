//! The engine API: a request's whole life in the library, driven per rank by a serving engine.
//!
//! One [`Agent`] per rank owns the backend endpoint, the registered KV pool, the connections to the
//! peer ranks it exchanges with, its membership in the cluster's metadata store, and one progress
//! task that drains backend events and routes them (notifications to the tracker or to the prefill
//! side's requests, lost peers to every request they touch). The engine calls are cheap and never
//! block a scheduler step: they return at once and report through [`RequestStatus`]; the `wait_*`
//! forms await a status with a deadline.
//!
//! The rules of a request's life are not here: they are the core's two sans-IO request books,
//! [`kvxfer_core::prefill::PrefillBook`] (SEMANTICS §7) and [`kvxfer_core::decode::DecodeBook`]
//! with its completion tracker (§5-§6). An agent holds its role's book and its peers (a prefill
//! agent's links to its decode ranks among them) behind its one lock, counts in atomics, feeds
//! the book the engine's calls and the backend's events, and carries out what it returns after
//! releasing the lock.
//!
//! # Mapping onto the engines
//!
//! | kvxfer | SGLang (`disaggregation/base/conn.py`) | vLLM (KV connector, worker side) |
//! |---|---|---|
//! | [`Agent::start`] | `BaseKVManager(args, mode, server_args)` | `register_kv_caches` |
//! | [`Agent::receiver`], [`Receiver::send_metadata`] | `BaseKVReceiver(..., bootstrap_room)`, `init(kv_indices, aux_index)` | `start_load_kv` (the request's block ids) |
//! | [`Agent::sender`], [`Sender::init`], [`Sender::send`] | `BaseKVSender(..., bootstrap_room)`, `init(num_kv_indices, aux_index)`, `send(kv_indices)` | `save_kv_layer` ([`Sender::send_layers`]) / `wait_for_save` |
//! | [`Receiver::status`], [`Sender::status`] | `poll() -> KVPoll` | `get_finished` |
//! | [`Receiver::abort`], [`Sender::abort`] | `abort()` (`failure_exception`) | request aborted |
//! | [`Receiver::release`], [`Sender::release`] | `clear()` | freeing the blocks |
//! | [`crate::bootstrap::BootstrapServer`] or etcd | `BaseKVBootstrapServer` | (side channel) |
//!
//! # A request's life (SEMANTICS §5-§6)
//!
//! A request is a room (the engine's request id) used once under a generation. The decode side
//! chooses the generation when it hands the request off ([`Receiver::send_metadata`]): from the rank's
//! membership epoch and a counter, so it is unique per use of the room, also across restarts. The
//! handoff (this decode rank's destination pages and aux slot) travels over the backend's control
//! channel to every prefill rank that feeds this decode rank; no per-request key is written to the
//! metadata store, so releasing a request leaves nothing behind anywhere.
//!
//! Prefill ranks keep handoffs that arrive before the engine created the sender for that room
//! (bounded by [`AgentConfig::early_max`] and [`AgentConfig::early_ttl`], counted in
//! [`AgentStats`]); the decode tracker keeps chunk notifications that arrive before their request is
//! registered the same way.
//!
//! States, as SGLang's `KVPoll` has them ([`Phase`]): `Bootstrapping` until the peers this rank needs
//! are connected (prefill: and until every decode rank's page list for the room arrived),
//! `WaitingForInput` until the engine hands off (decode) or sends the last chunk (prefill),
//! `Transferring` until every byte is confirmed, then `Success` or `Failed`. A failed or aborted
//! request passes through `Aborting`: until every sender that could still write into the destination
//! pages has confirmed it cannot any more (it finished, fenced, reported failure, or was cut off),
//! the pages are NOT free. [`RequestStatus::pages_reusable`] says when they are. A decode rank asks
//! every such sender to stop and fence; while a live sender's fence has not come it asks again
//! after 1 s, then 2, 4 and every 8 s (a prefill rank answers every ask), so a lost ask or answer
//! does not leave the request `Aborting` for ever; each repeated ask is a warning naming the rank
//! and counts in [`AgentStats::fence_reasks`].
//!
//! # Giving up on a peer (SEMANTICS §6, "known dead")
//!
//! A rank gives up on a peer when the peer's lease expires, when the transport reports it gone, when
//! a new process registers for the peer's rank (a new epoch), or when this rank loses its own
//! membership (the store unreachable past the lease; then it gives up on every peer and posts
//! nothing more). Giving up is not proof that the peer stopped: a SIGSTOPped process resumes and a
//! partition heals. So the agent first **cuts the peer off** ([`KvTransferBackend::cut_off`]:
//! every connection to and from that peer instance closed, its later frames and connections
//! refused, its remote keys useless) and only once the backend confirmed it does a request that the
//! peer could still write report `pages_reusable`. Until then it is `Aborting`. A cut-off not
//! confirmed within [`AgentConfig::cut_off_timeout`] leaves those pages **quarantined**: the request
//! stays `Aborting` with `pages_reusable == false` and a reason that names the peer, and
//! [`Agent::quarantined`] lists the peer; never reuse such pages (restart the process to reclaim
//! them). The time from giving up to the confirmation is logged and kept in [`AgentStats`]. A peer
//! that comes back under a new epoch is a new instance: it serves new requests only; a handoff
//! carrying an older epoch than the one the membership announced is refused and counted
//! ([`AgentStats::stale_refused`]).
//!
//! Reusing a room: a decode rank may hand a room off again (a new generation) once it released the
//! earlier use. On the prefill side a sender belongs to the use whose handoffs it finds when it is
//! created: if the only handoff a decode rank left for the room is one it already aborted, the sender
//! is that aborted use and fails at once (the decode side is already fenced); a later handoff of the
//! room is kept for the next sender. Engines whose request ids are unique (SGLang's bootstrap rooms,
//! vLLM's request ids) never meet this.
//!
//! # Memory
//!
//! [`KvMemory::Buffers`] hands the agent memory the engine owns (GPU or host). The engine must keep
//! it alive and must not free it before [`Agent::shutdown`] returned: until then a peer may write
//! into it (decode) or the backend may read it (prefill). Destination pages of a request may be
//! reused once its status is final and [`RequestStatus::pages_reusable`]; source pages once the
//! sender's status is final.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::join_all;
use kvxfer_core::{
    BackendConfig, BackendEvent, BufferRef, Feature, HostBuffer, KvTransferBackend, MemDesc, Notification,
    NotificationBody, NotifyStyle, PeerId, ProtocolRange, RankId, RequestId, Secret, SecretError, SenderKey, Side,
    Topology, TrackerConfig, TrackerStats,
};
use serde::{Deserialize, Serialize};

use kvxfer_core::decode::{Check, DecodeBook, DecodeCause, DecodeConfig};
use kvxfer_core::digest;
use kvxfer_core::plan::check_pages;
use kvxfer_core::plan::plan_sender;
use kvxfer_core::prefill::{
    Action as BookAction, BookConfig, CallError, FailCause, Handoff, HandoffOutcome, Part, PrefillBook,
};
use kvxfer_core::PairPlan;

use crate::bootstrap::{RankRegistration, WarmupRegion};
use crate::metadata::{MemberEvent, MemberWatch, Membership, MetadataAddr, MetadataStore};
use crate::metrics::{AgentMetrics, Cause, Recorder, Snapshot};
use crate::session::{Cancel, DecodeLink, KvPool, PoolBuffer, PoolMemory, SendPath, SessionError, Window};

use kvxfer_core::model::rank_of_key;
pub use kvxfer_core::model::{from_identity, identity, own_key};

/// The trace id of one decode rank's use of a room: the room in the high 64 bits, the generation
/// the decode rank chose for it in the low 64 (never 0). Both travel in the handoff and in every
/// notification of the request, so the decode rank and each prefill rank that feeds it log the same
/// id for the same transfer without exchanging anything more ([`Receiver::trace_id`],
/// [`Sender::trace_ids`]). Displayed as 32 hex digits (the W3C / OpenTelemetry trace-id form); every
/// request event the agent logs (target `kvxfer::request`, level `debug`) carries it as `trace_id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TraceId(pub u128);

impl TraceId {
    /// The trace id of `room` under `generation`.
    pub fn of(room: RequestId, generation: u64) -> Self {
        Self((u128::from(room.0) << 64) | u128::from(generation))
    }
}

impl fmt::Display for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// How one rank takes part in the cluster.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Prefill or decode.
    pub role: Side,
    /// This rank (TP rank, PP stage).
    pub rank: RankId,
    /// The cluster's configuration: both sides' KV layout and parallelism. Every peer is checked
    /// against it before any byte moves.
    pub topology: Topology,
    /// Backend registry name (`tcp`, `local`, `ucx`, `fabric`, `verbs`).
    pub backend: String,
    /// Backend options (`listen=...`, `tls=...`; see each backend's README).
    pub backend_options: BTreeMap<String, String>,
    /// How senders notify completion (attached to the data, or out of band after it completed).
    pub notify: NotifyStyle,
    /// The metadata store (`host:port` of a bootstrap service, or `etcd://...`).
    pub metadata: MetadataAddr,
    /// TTL of this rank's lease in the store: a rank that stops renewing it is reported lost. A rank
    /// restarted while its previous process's lease still runs (restarted at once after a crash)
    /// waits in [`Agent::start`] up to `lease_ttl` + 1 s for that lease to expire, then registers
    /// under a new epoch; if the record is still held then, another live process serves this rank
    /// and `start` fails naming it.
    pub lease_ttl: Duration,
    /// How long [`Agent::start`]'s background connect waits for the peer ranks to register.
    pub connect_timeout: Duration,
    /// Each request's deadline, counted from its handoff (decode) or its creation (prefill).
    pub request_timeout: Duration,
    /// Bounds of the decode tracker (early notifications, released-generation memory).
    pub tracker: TrackerConfig,
    /// Most handoffs a prefill rank keeps for rooms it has no sender for yet.
    pub early_max: usize,
    /// How long a prefill rank keeps such a handoff.
    pub early_ttl: Duration,
    /// Per (prefill, decode) pair in-flight window.
    pub window: Window,
    /// A label for this rank in peers' error messages (host, process id).
    pub label: String,
    /// How long the agent waits for the backend to confirm that a peer it gave up on is cut off
    /// ([`KvTransferBackend::cut_off`]); past it, the pages that peer could still write stay
    /// quarantined (see the module docs).
    pub cut_off_timeout: Duration,
    /// The cluster's shared secret: proved to the bootstrap service on every request, and given to
    /// the backend ([`BackendConfig::secret`]), which then admits only connections from ranks that
    /// prove it. `None` (the default of [`AgentConfig::new`]) trusts everyone who can reach the ports;
    /// [`AgentConfig::with_env_secret`] takes it from `KVXFER_SECRET`.
    pub secret: Option<Secret>,
    /// TLS to the bootstrap service ([`kvxfer_tls`]; the service must use the same cluster CA).
    /// The backend's own streams take TLS through its options (tcp: `tls=on`, see its README).
    pub bootstrap_tls: Option<kvxfer_tls::Tls>,
    /// Decode: verify an end-to-end digest of every request (off by default; [`kvxfer_core::digest`]).
    /// The handoff asks each prefill rank for the sums of XXH3-64 hashes over what it writes here;
    /// once every chunk and digest is in, this rank hashes the landed bytes (in a blocking task)
    /// and the request succeeds only if they agree. A mismatch fails it (`Failed`, pages reusable:
    /// every sender had finished) with a reason naming the prefill rank, the layer, the kind and
    /// the heads. Costs one read of the request's bytes on each side; needs host memory (refused at
    /// start otherwise) and prefill ranks that speak protocol 3 (a prefill rank that negotiates an
    /// older protocol is refused at connect, naming it: upgrade it or turn the digest off).
    /// Prefill ranks need no setting: they hash only for decode ranks that ask.
    pub digest: bool,
    /// The model whose KV cache this rank holds (name, revision, KV dtype), published with the
    /// rank's layout: a rank whose model differs from a registered rank's is refused at
    /// [`Agent::start`] (an error naming both), so two models of one shape never exchange KV.
    /// `None` (the default) compares nothing beyond the layout.
    pub model: Option<crate::bootstrap::ModelIdentity>,
    /// The newest kvxfer protocol this rank speaks ([`kvxfer_core::protocol`]); `None` (the
    /// default) is this build's newest, [`kvxfer_core::protocol::PROTOCOL`]. During a rolling
    /// upgrade, pinning it to the previous version ([`kvxfer_core::protocol::OLDEST_PROTOCOL`])
    /// makes an upgraded rank speak exactly as the previous release does (features of the newer
    /// protocol, such as [`Self::digest`], are refused at start); unpin once every rank is
    /// upgraded. Ranks always negotiate the highest version both speak, so pinning is needed only
    /// to rehearse or to keep a mixed cluster on the old wire. A version this build does not speak
    /// is refused at [`Agent::start`].
    pub protocol: Option<u16>,
    /// Prefill: warm each new connection to a decode rank before it counts as connected (on by
    /// default): one page's writes, twice, into a region the decode rank registered for it
    /// ([`crate::session::SendPath::warm_up`]; never its pool), so that the first request
    /// does not pay what the transport sets up on first use (UCX: several times a steady
    /// request's latency). Costs one page of host memory on each decode rank and a few
    /// milliseconds per connection. Decode ranks always offer the region (when their backend takes
    /// host memory); turning this off on a prefill rank skips its writes.
    pub warm_up: bool,
}

impl AgentConfig {
    /// The protocol range this rank publishes (`None`: this build does not speak the pinned
    /// version).
    fn protocol_range(&self) -> ProtocolRange {
        self.protocol.and_then(ProtocolRange::pinned).unwrap_or(ProtocolRange::THIS_BUILD)
    }

    /// A configuration with the defaults: the `tcp` backend, attached notifications, a 10 s lease,
    /// 60 s to connect and per request.
    pub fn new(role: Side, rank: RankId, topology: Topology, metadata: MetadataAddr) -> Self {
        Self {
            role,
            rank,
            topology,
            backend: "tcp".into(),
            backend_options: BTreeMap::new(),
            notify: NotifyStyle::Attached,
            metadata,
            lease_ttl: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(60),
            request_timeout: Duration::from_secs(60),
            tracker: TrackerConfig::default(),
            early_max: 65_536,
            early_ttl: Duration::from_secs(60),
            window: Window::default(),
            label: format!("pid {}", std::process::id()),
            cut_off_timeout: Duration::from_secs(10),
            secret: None,
            bootstrap_tls: None,
            warm_up: true,
            digest: false,
            model: None,
            protocol: None,
        }
    }

    /// Sets [`Self::secret`] from `KVXFER_SECRET` when that is set (an empty one is an error).
    pub fn with_env_secret(mut self) -> Result<Self, SecretError> {
        if let Some(s) = Secret::from_env()? {
            self.secret = Some(s);
        }
        Ok(self)
    }
}

/// The KV memory a rank registers.
pub enum KvMemory {
    /// Host buffers the agent allocates and registers, one per (stage-local layer, kind), each
    /// `pages` pages, filled with `fill` (tests, the demo, CPU engines).
    Host {
        /// Pages per buffer.
        pages: u32,
        /// The initial byte of every buffer.
        fill: u8,
    },
    /// Memory the engine owns, one descriptor per (stage-local layer, kind) buffer, each at least
    /// `pages` pages. Keep it alive until [`Agent::shutdown`] returned.
    Buffers {
        /// Pages per buffer.
        pages: u32,
        /// The buffers.
        buffers: Vec<(BufferRef, MemDesc)>,
    },
}

impl fmt::Debug for KvMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvMemory::Host { pages, fill } => write!(f, "Host {{ pages: {pages}, fill: {fill} }}"),
            KvMemory::Buffers { pages, buffers } => {
                write!(f, "Buffers {{ pages: {pages}, {} buffers }}", buffers.len())
            }
        }
    }
}

/// A failure of the engine API, naming the rank, the request and the peer where they apply, and
/// saying what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// The configuration, the memory or the cluster is not usable: fix the configuration.
    #[error("{role} rank {rank}: {detail}")]
    Setup {
        /// Side.
        role: Side,
        /// Rank.
        rank: RankId,
        /// What failed.
        detail: String,
    },
    /// The metadata store could not be reached, or did not answer, while this rank started. No agent
    /// was made (its endpoint was closed again): start again once the store is up (an engine may start a rank before the bootstrap service listens). Every other
    /// start failure is [`EngineError::Setup`], which a retry does not fix.
    #[error("{role} rank {rank}: {detail}")]
    StoreUnreachable {
        /// Side.
        role: Side,
        /// Rank.
        rank: RankId,
        /// The store, the call and the cause.
        detail: String,
    },
    /// The call does not fit this rank's role.
    #[error("{role} rank {rank}: {call} is a {needs} call")]
    WrongRole {
        /// Side.
        role: Side,
        /// Rank.
        rank: RankId,
        /// The call.
        call: &'static str,
        /// The side it belongs to.
        needs: Side,
    },
    /// The room is already in use on this rank: release it first, or use another room.
    #[error("{role} rank {rank}: request {room} is already active here; release it before reusing the room")]
    RoomInUse {
        /// Side.
        role: Side,
        /// Rank.
        rank: RankId,
        /// The room.
        room: RequestId,
    },
    /// The call is not valid in the request's current state.
    #[error("{role} rank {rank}: request {room}: {detail}")]
    InvalidCall {
        /// Side.
        role: Side,
        /// Rank.
        rank: RankId,
        /// The room.
        room: RequestId,
        /// What is wrong and what to do.
        detail: String,
    },
    /// The request failed; `reason` names the rank, the peer and the cause.
    #[error("{role} rank {rank}: request {room} failed: {reason}")]
    Failed {
        /// Side.
        role: Side,
        /// Rank.
        rank: RankId,
        /// The room.
        room: RequestId,
        /// Why.
        reason: String,
    },
    /// A wait ran past its deadline; the request is still in `phase`.
    #[error("{role} rank {rank}: request {room} still {phase} after {after:?}")]
    Timeout {
        /// Side.
        role: Side,
        /// Rank.
        rank: RankId,
        /// The room.
        room: RequestId,
        /// Where it stands.
        phase: Phase,
        /// How long was waited.
        after: Duration,
    },
}

pub use kvxfer_core::Phase;

/// A request's status on one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestStatus {
    /// Where it stands.
    pub phase: Phase,
    /// Why it failed (`Aborting`, `Failed`): names the rank, the peer and the cause.
    pub reason: Option<String>,
    /// Whether the request's pages (decode: destination; prefill: source) may be reused now: true
    /// once nothing of the request can read or write them any more.
    pub pages_reusable: bool,
}

impl RequestStatus {
    fn of(phase: Phase, reason: Option<String>, pages_reusable: bool) -> Self {
        Self { phase, reason, pages_reusable }
    }
}

/// Counters of one agent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentStats {
    /// Requests that reached `Success` here.
    pub succeeded: u64,
    /// Requests that reached `Failed` here (aborted ones included).
    pub failed: u64,
    /// Requests aborted by this rank's engine.
    pub aborted: u64,
    /// Handoffs a prefill rank kept for rooms it had no sender for yet.
    pub early_handoffs_kept: u64,
    /// Such handoffs, and aborts kept the same way (an abort for a room with no sender yet), that
    /// were dropped: too old, or too many kept.
    pub early_handoffs_expired: u64,
    /// Abort requests received from the other side.
    pub aborts_received: u64,
    /// Fences sent (prefill) or received (decode).
    pub fences: u64,
    /// Decode: asks to abort sent again because a sender's fence had not come (see the module
    /// docs' abort section); above zero means an ask or a fence was lost or a prefill rank did not
    /// answer: its warnings (`kvxfer::request`) name the request and the rank.
    pub fence_reasks: u64,
    /// Prefill: connections warmed ([`crate::session::SendPath::warm_up`]: one page's writes,
    /// twice, into the decode rank's warm-up region, right after connecting).
    pub warm_ups: u64,
    /// Prefill: warm-ups that failed (warned under `kvxfer::engine`; the connection stays, and
    /// its first request reports whatever is wrong with it).
    pub warm_up_failures: u64,
    /// Peers given up on (left the cluster, lease expired, transport lost them, replaced by a new
    /// epoch, or this rank's own membership lost).
    pub peers_lost: u64,
    /// Peers given up on whose cut-off the backend confirmed.
    pub cut_offs: u64,
    /// The longest time from giving up on a peer to the backend's confirmation that it is cut
    /// off, in microseconds.
    pub cut_off_max_us: u64,
    /// Peers given up on whose cut-off could not be confirmed: the pages they could write are
    /// quarantined ([`Agent::quarantined`]).
    pub quarantined: u64,
    /// Handoffs and aborts refused because they carried an older epoch of their decode rank than
    /// the membership announced (a process that resumed after it was replaced).
    pub stale_refused: u64,
    /// Notifications of a kind this side does not take, dropped.
    pub protocol_errors: u64,
    /// Bytes this rank hashed for end-to-end digests ([`AgentConfig::digest`]): what it wrote
    /// for decode ranks that asked (prefill) or what landed (decode). 0 when nobody asked.
    pub digest_bytes: u64,
    /// Requests whose digest check failed here (decode).
    pub digest_mismatches: u64,
    /// Decode tracker counters.
    #[serde(skip)]
    pub tracker: TrackerStats,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A spawned part of a layer-wise chunk.
type PartHandle = tokio::task::JoinHandle<Result<(), String>>;

/// What the driver keeps per prefill request beside the book's state: the request's cancel signal
/// (aborts its transfers in flight) and the task handles of the layer parts of the chunk in progress
/// (the part that finishes the chunk waits for them before its notification).
#[derive(Debug, Default)]
struct SendIo {
    cancel: Cancel,
    parts: Vec<PartHandle>,
}

/// What the agent knows of one peer rank.
#[derive(Debug, Clone)]
struct Peer {
    id: Option<PeerId>,
    /// A prefill agent's link to this decode rank (its peer and pool), what its sends and
    /// notifications go over; `None` on the decode side and while not connected.
    link: Option<DecodeLink>,
    epoch: u64,
    lost: Option<String>,
}

struct Inner {
    cfg: AgentConfig,
    topo: Topology,
    backend: Arc<dyn KvTransferBackend>,
    /// What only this rank's role holds: the prefill side's session and request book, or the
    /// decode side's request book.
    half: Half,
    connected: AtomicBool,
    /// Why the initial connect failed (set once; every request fails with it).
    connect_error: std::sync::OnceLock<String>,
    epoch: u64,
    /// The agent's own counters ([`Agent::stats`] adds the book's and the tracker's to them).
    stats: Counters,
    /// Latency, bytes and failure causes, recorded as requests end (see [`crate::metrics`]).
    recorder: Recorder,
    /// Pages of this rank's pool (a handoff's pages are checked against it).
    pool_pages: u32,
    /// Bytes of one page across this rank's pool (every layer of its stage, every kind).
    page_bytes: u64,
    /// Bytes of KV pool registered with the backend.
    registered_bytes: u64,
    /// This rank's pool buffers, for hashing them ([`AgentConfig::digest`]; offsets 0).
    views: Arc<HashMap<BufferRef, MemDesc>>,
    wake: tokio::sync::Notify,
    stop: Cancel,
    handle: tokio::runtime::Handle,
}

/// What only one role's agent holds, typed: a prefill agent drives a [`SendPath`] and a
/// [`PrefillBook`], a decode agent a [`DecodeBook`]; neither holds the other's. The request handles
/// ([`Sender`], [`Receiver`]) keep their own half, so no call reaches for the other role's.
///
/// The half's [`State`] mutex is the agent's one lock: the book and the peers sit behind it
/// together (a prefill agent's links to its decode ranks with them: its [`SendPath`] keeps no
/// connection table and no lock of its own) and the counters are atomics. It is never held
/// across an await, and nothing that locks it is called while it is held (the book's actions are
/// carried out after it is released, see [`Inner::book`]).
enum Half {
    Prefill(Arc<PrefillHalf>),
    /// The decode side's requests, with the completion tracker (every rule of their life), and
    /// the peers.
    Decode(Arc<Mutex<State<DecodeBook>>>),
}

/// A prefill agent's own half.
struct PrefillHalf {
    /// Posts this rank's writes and notifications to its decode ranks, over the links kept in
    /// the peers (behind `state`).
    path: SendPath,
    /// The requests (every rule of their life: [`PrefillBook`]) and the peers.
    state: Mutex<State<PrefillBook<SendIo>>>,
}

/// What sits behind an agent's one lock: its role's request book and what it knows of its peers.
struct State<B> {
    book: B,
    peers: Peers,
}

impl<B> State<B> {
    fn new(book: B, peers: Peers) -> Mutex<Self> {
        Mutex::new(State { book, peers })
    }
}

/// What an agent knows of the peer ranks it exchanges with.
#[derive(Debug, Default)]
struct Peers {
    /// By rank: every rank of the other role this rank exchanges with, connected or not.
    by_rank: BTreeMap<RankId, Peer>,
    /// Peers whose cut-off could not be confirmed, with why (see the module docs).
    quarantine: BTreeMap<RankId, String>,
}

impl Peers {
    /// The ranks connected now (not lost).
    fn connected(&self) -> BTreeSet<RankId> {
        self.by_rank.iter().filter(|(_, p)| p.id.is_some() && p.lost.is_none()).map(|(r, _)| *r).collect()
    }
}

/// Declares [`Counters`]: one atomic per named field of [`AgentStats`], and the snapshot of them
/// as an `AgentStats` (the tracker's left at zero; the struct literal names every other field, so a
/// counter added to `AgentStats` and not here does not compile).
macro_rules! counters {
    ($($field:ident),* $(,)?) => {
        /// An agent's own counters, each an atomic: any task counts without a lock.
        #[derive(Debug, Default)]
        struct Counters {
            $($field: AtomicU64,)*
        }

        impl Counters {
            fn snapshot(&self) -> AgentStats {
                AgentStats { $($field: self.$field.load(Ordering::Relaxed),)* tracker: Default::default() }
            }
        }
    };
}

counters!(
    succeeded,
    failed,
    aborted,
    early_handoffs_kept,
    early_handoffs_expired,
    aborts_received,
    fences,
    fence_reasks,
    warm_ups,
    warm_up_failures,
    peers_lost,
    cut_offs,
    cut_off_max_us,
    quarantined,
    stale_refused,
    protocol_errors,
    digest_bytes,
    digest_mismatches,
);

/// Adds `n` to a counter.
fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

/// One rank's transfer agent. Create with [`Agent::start`] inside a tokio runtime (multi-threaded);
/// the agent spawns its progress tasks there.
pub struct Agent {
    inner: Arc<Inner>,
    membership: Option<Membership>,
    memory: Vec<PoolMemory>,
    registrations: Vec<kvxfer_core::Registration>,
    /// A decode rank's warm-up region (closed at shutdown, before its buffer is freed).
    warmup: Option<(HostBuffer, kvxfer_core::Registration)>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    metrics: AgentMetrics,
}

impl fmt::Debug for Agent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Agent({} rank {} on {})", self.inner.cfg.role, self.inner.cfg.rank, self.inner.backend.name())
    }
}

/// How long [`Agent::start`] waits for a previous process's record of this rank to expire: its
/// lease TTL (taken to be this rank's `lease_ttl`) and 1 s for the store's expiry.
/// Rounds of one page's writes a prefill rank sends to warm a new connection (measured in
/// docs/performance/2026-12-07-warm-connections.md: one round leaves part of UCX's first-use cost).
const WARM_UP_ROUNDS: u32 = 2;
/// Longest a warm-up may take (bounded further by [`AgentConfig::request_timeout`]).
const WARM_UP_WAIT: Duration = Duration::from_secs(5);

fn rejoin_wait(cfg: &AgentConfig) -> Duration {
    cfg.lease_ttl + Duration::from_secs(1)
}

/// How often the progress task wakes when nothing arrives (deadlines, early-buffer ages).
const TICK: Duration = Duration::from_millis(20);
impl Agent {
    /// Creates the backend endpoint, registers the KV memory, joins the cluster's metadata store
    /// under a lease, and starts the progress task and a background connect to the peer ranks
    /// (requests are `Bootstrapping` until it finished; [`Agent::wait_connected`] awaits it).
    pub async fn start(cfg: AgentConfig, memory: KvMemory) -> Result<Agent, EngineError> {
        let (role, rank) = (cfg.role, cfg.rank);
        let setup = |detail: String| EngineError::Setup { role, rank, detail };
        let topo = cfg.topology;
        topo.check_rank(role, rank).map_err(|e| setup(e.to_string()))?;
        if let Some(v) = cfg.protocol {
            let range = ProtocolRange::pinned(v).ok_or_else(|| {
                setup(format!(
                    "protocol {v}: this build speaks kvxfer protocol {} (pin one of those, or leave it unset)",
                    ProtocolRange::THIS_BUILD
                ))
            })?;
            if cfg.digest && role == Side::Decode && range.newest < Feature::Digest.since() {
                return Err(setup(format!(
                    "digest needs kvxfer protocol {} or later, and this rank is pinned to protocol {v}: unpin it \
                     once every rank is upgraded, or turn the digest off",
                    Feature::Digest.since()
                )));
            }
        }
        let bcfg = BackendConfig {
            identity: identity(role, rank),
            options: cfg.backend_options.clone(),
            secret: cfg.secret.clone(),
        };
        let backend = crate::backends::create(&cfg.backend, &bcfg).map_err(|e| setup(e.to_string()))?;
        backend.capabilities().check_style(backend.name(), cfg.notify).map_err(|e| setup(e.to_string()))?;
        let mut views = HashMap::new();
        let (pool, pool_memory, registrations) = match memory {
            KvMemory::Host { pages, fill } => {
                let init = move |_: BufferRef, b: &mut [u8]| b.fill(fill);
                let (pool, mem) = KvPool::allocate(&topo, role, rank, pages, &*backend, &init)
                    .await
                    .map_err(|e| setup(e.to_string()))?;
                views.extend(mem.iter().map(|m| (m.buffer, m.desc().clone())));
                (pool, mem, Vec::new())
            }
            KvMemory::Buffers { pages, buffers } => {
                let mut pool = KvPool { pages, buffers: Vec::new() };
                let mut regs = Vec::new();
                for (b, desc) in buffers {
                    if cfg.digest && desc.kind() != kvxfer_core::MemKind::Host {
                        return Err(setup(format!(
                            "digest: the buffer of layer {} {} is {} memory; end-to-end digests hash the pool on \
                             the host and need host memory (turn digest off for device pools)",
                            b.layer,
                            b.kind,
                            desc.kind()
                        )));
                    }
                    views.insert(b, desc.clone());
                    let region = crate::session::region_id(b);
                    let len = desc.len();
                    let reg = backend.register(region, desc).await.map_err(|e| setup(e.to_string()))?;
                    pool.buffers.push(PoolBuffer { buffer: b, region, offset: 0, len: len as u64 });
                    regs.push(reg);
                }
                (pool, Vec::new(), regs)
            }
        };
        let page_bytes: u64 = pool.buffers.iter().map(|b| topo.buffer_bytes(role, b.buffer.kind, 1)).sum();
        // A decode rank's warm-up region: host memory, one page of its pool, for its senders'
        // first writes (`SendPath::warm_up`); not for a backend that takes no host memory.
        let warmup = if role == Side::Decode && backend.capabilities().memory.contains(&kvxfer_core::MemKind::Host) {
            let len = crate::session::warmup_bytes(&topo, rank);
            let mut host = HostBuffer::zeroed(len as usize);
            let reg = backend
                .register(crate::session::WARMUP_REGION, host.desc())
                .await
                .map_err(|e| setup(format!("registering the warm-up region ({len} bytes): {e}")))?;
            Some((host, reg))
        } else {
            None
        };
        let registered_bytes: u64 = pool.buffers.iter().map(|b| b.len).sum();
        let pool_pages = pool.pages;
        let session = match role {
            Side::Prefill => Some(
                SendPath::new(Arc::clone(&backend), topo, rank, pool.clone(), cfg.notify)
                    .map_err(|e| setup(e.to_string()))?
                    .with_window(cfg.window),
            ),
            Side::Decode => {
                pool.validate(&topo, Side::Decode, rank).map_err(|e| setup(e.to_string()))?;
                None
            }
        };
        let store = crate::metadata::connect_secured(
            &cfg.metadata,
            crate::metadata::DEFAULT_OP_TIMEOUT,
            cfg.secret.clone(),
            cfg.bootstrap_tls.clone(),
        )
        .await
        .map_err(|e| setup(e.to_string()))?;
        let me = RankRegistration {
            role,
            rank,
            backend: cfg.backend.clone(),
            endpoint: backend.metadata().map_err(|e| setup(e.to_string()))?,
            pool,
            spec: topo.side(role),
            label: cfg.label.clone(),
            model: cfg.model.clone(),
            protocol: cfg.protocol_range(),
            warmup: warmup
                .as_ref()
                .map(|(h, _)| WarmupRegion { region: crate::session::WARMUP_REGION, len: h.len() as u64 }),
        };
        // A rank restarted right after a crash finds its old record until the old lease expires.
        // An unreachable store is the one start failure a retry can fix: it says so by its variant.
        let store_failed = |e: &crate::metadata::StoreError| match e {
            crate::metadata::StoreError::Unavailable { .. } | crate::metadata::StoreError::Timeout { .. } => {
                EngineError::StoreUnreachable { role, rank, detail: e.to_string() }
            }
            e => setup(e.to_string()),
        };
        let membership = Membership::join_waiting(Arc::clone(&store), me.clone(), cfg.lease_ttl, rejoin_wait(&cfg))
            .await
            .map_err(|e| match &e {
                crate::metadata::MetadataError::Store(se) => store_failed(se),
                _ => setup(e.to_string()),
            })?;
        let (watch, _) = MemberWatch::start(Arc::clone(&store)).await.map_err(|e| store_failed(&e))?;
        let epoch = membership.epoch();
        let by_rank: BTreeMap<RankId, Peer> = match role {
            Side::Prefill => topo.receivers(rank),
            Side::Decode => topo.senders(rank),
        }
        .into_iter()
        .map(|r| (r, Peer { id: None, link: None, epoch: 0, lost: None }))
        .collect();
        let peers = Peers { by_rank, quarantine: BTreeMap::new() };
        let half = match session {
            Some(path) => Half::Prefill(Arc::new(PrefillHalf {
                path,
                state: State::new(
                    PrefillBook::new(BookConfig {
                        rank,
                        receivers: topo.receivers(rank),
                        stage_layers: topo.stage_layers(role, rank.pp),
                        request_timeout: cfg.request_timeout,
                        early_max: cfg.early_max,
                        early_ttl: cfg.early_ttl,
                    }),
                    peers,
                ),
            })),
            None => Half::Decode(Arc::new(State::new(
                DecodeBook::new(DecodeConfig {
                    rank,
                    senders: topo.expected_senders(rank),
                    epoch,
                    request_timeout: cfg.request_timeout,
                    digest: cfg.digest,
                    tracker: cfg.tracker,
                }),
                peers,
            ))),
        };
        let inner = Arc::new(Inner {
            topo,
            backend,
            half,
            connected: AtomicBool::new(false),
            connect_error: std::sync::OnceLock::new(),
            pool_pages,
            epoch,
            stats: Counters::default(),
            recorder: Recorder::new(),
            page_bytes,
            registered_bytes,
            views: Arc::new(views),
            wake: tokio::sync::Notify::new(),
            stop: Cancel::new(),
            handle: tokio::runtime::Handle::current(),
            cfg,
        });
        let tasks = vec![
            tokio::spawn(Arc::clone(&inner).progress()),
            tokio::spawn(Arc::clone(&inner).connect_and_watch(store, me, watch)),
            tokio::spawn(Arc::clone(&inner).watch_health(membership.health())),
        ];
        let metrics = AgentMetrics::new(role, rank, &inner.recorder, &inner);
        Ok(Agent { inner, membership: Some(membership), memory: pool_memory, registrations, warmup, tasks, metrics })
    }

    /// This rank's side.
    pub fn role(&self) -> Side {
        self.inner.cfg.role
    }

    /// This rank.
    pub fn rank(&self) -> RankId {
        self.inner.cfg.rank
    }

    /// The cluster topology.
    pub fn topology(&self) -> &Topology {
        &self.inner.topo
    }

    /// The backend endpoint (for benchmarks and diagnostics).
    pub fn backend(&self) -> &Arc<dyn KvTransferBackend> {
        &self.inner.backend
    }

    /// This rank's membership epoch (higher after every restart).
    pub fn epoch(&self) -> u64 {
        self.inner.epoch
    }

    /// The host buffers [`KvMemory::Host`] allocated (empty for [`KvMemory::Buffers`]): read or
    /// write a request's pages through them once its status allows.
    pub fn host_memory(&self) -> &[PoolMemory] {
        &self.memory
    }

    /// Whether every peer rank this rank needs is connected.
    pub fn is_connected(&self) -> bool {
        self.inner.connected.load(Ordering::Acquire)
    }

    /// Waits until every peer rank this rank needs is connected, or the background connect failed
    /// (its error), or `deadline`.
    pub async fn wait_connected(&self, deadline: Instant) -> Result<(), EngineError> {
        loop {
            let notified = self.inner.wake.notified();
            if self.is_connected() {
                return Ok(());
            }
            if let Some(e) = self.inner.connect_error.get().cloned() {
                return Err(self.inner.setup(e));
            }
            if Instant::now() >= deadline {
                return Err(self.inner.setup(format!(
                    "peers not connected before the deadline; waiting for {}",
                    self.inner.missing_peers()
                )));
            }
            let _ = tokio::time::timeout(TICK * 5, notified).await;
        }
    }

    /// A decode-side request for `room` (SGLang's `KVReceiver`). It is `Bootstrapping` until the
    /// prefill ranks are connected, then `WaitingForInput` until [`Receiver::send_metadata`].
    pub fn receiver(&self, room: RequestId) -> Result<Receiver, EngineError> {
        let Half::Decode(state) = &self.inner.half else {
            return Err(self.inner.wrong_role(Side::Decode, "receiver"));
        };
        lock(state).book.create(room).map_err(|_| EngineError::RoomInUse {
            role: Side::Decode,
            rank: self.rank(),
            room,
        })?;
        Ok(Receiver { inner: Arc::clone(&self.inner), state: Arc::clone(state), room })
    }

    /// A prefill-side request for `room` (SGLang's `KVSender`). It is `Bootstrapping` until every
    /// decode rank it feeds has handed off its page list, then `WaitingForInput`.
    pub fn sender(&self, room: RequestId) -> Result<Sender, EngineError> {
        let Half::Prefill(half) = &self.inner.half else {
            return Err(self.inner.wrong_role(Side::Prefill, "sender"));
        };
        let inner = &self.inner;
        inner
            .book(half, |b| b.create(room, SendIo::default(), Instant::now()))
            .map_err(|_| EngineError::RoomInUse { role: Side::Prefill, rank: self.rank(), room })?;
        Ok(Sender { inner: Arc::clone(inner), half: Arc::clone(half), room })
    }

    /// Counters.
    pub fn stats(&self) -> AgentStats {
        self.inner.stats_now()
    }

    /// Peer ranks this rank gave up on whose cut-off the backend could not confirm, with why. The
    /// pages those peers could write (the destination pages of the requests they were feeding)
    /// are quarantined: their requests stay `Aborting` and must never be reused (restart the
    /// process to reclaim the memory). Empty in a healthy cluster.
    pub fn quarantined(&self) -> Vec<(RankId, String)> {
        self.inner.peers(|p| p.quarantine.iter().map(|(r, w)| (*r, w.clone())).collect())
    }

    /// Requests active on this rank (created and not released).
    pub fn active_requests(&self) -> usize {
        match &self.inner.half {
            Half::Prefill(p) => lock(&p.state).book.len(),
            Half::Decode(d) => lock(d).book.len(),
        }
    }

    /// Every metric of this agent now, in the OpenMetrics text format (what Prometheus scrapes;
    /// ends with `# EOF`). Names, types and meanings: [`crate::metrics::METRICS`]. Cheap enough to
    /// call on every scrape (it locks the agent's tables briefly, like [`Agent::stats`]).
    pub fn metrics(&self) -> String {
        self.metrics.encode()
    }

    /// Stops: fails every active request (telling peers), leaves the cluster (peers see the rank
    /// `left`, not lost), stops the progress tasks, and closes the registrations (waits, until
    /// `deadline`, until no peer can touch the memory). After it returns the engine may free the
    /// memory it registered.
    pub async fn shutdown(mut self, deadline: Instant) -> Result<(), EngineError> {
        match &self.inner.half {
            Half::Prefill(p) => {
                self.inner.book(p, |b| b.abort_open("the prefill rank shut down", FailCause::Shutdown));
                // Let the aborts and fences go out (bounded).
                let until = Instant::now() + Duration::from_millis(500);
                while Instant::now() < until && lock(&p.state).book.settling() {
                    tokio::time::sleep(TICK).await;
                }
            }
            Half::Decode(d) => {
                let rooms: Vec<RequestId> = lock(d).book.rooms();
                for room in rooms {
                    self.inner.receiver_abort(d, room, "the decode rank shut down".into());
                }
            }
        }
        self.inner.stop.cancel("shutdown");
        // The tasks end at the cancel, unless one is inside a store or backend call that has not
        // answered (an unreachable store): all of them together get at most 2 s, never past the
        // deadline; one still running is aborted.
        let tasks_until = tokio::time::Instant::from_std(deadline.min(Instant::now() + Duration::from_secs(2)));
        for t in self.tasks.drain(..) {
            let abort = t.abort_handle();
            if tokio::time::timeout_at(tasks_until, t).await.is_err() {
                abort.abort();
            }
        }
        let mut first: Option<EngineError> = None;
        if let Some(m) = self.membership.take() {
            // With the store unreachable for a lease TTL already, leaving gets at most 1 s (the
            // lease expires by itself); otherwise what is left of the deadline.
            let unhealthy = m.health().borrow().is_some();
            let bound =
                if unhealthy { Duration::from_secs(1) } else { deadline.saturating_duration_since(Instant::now()) };
            match tokio::time::timeout(bound.max(Duration::from_millis(100)), m.leave()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    first.get_or_insert(self.inner.setup(format!("leaving the metadata store: {e}")));
                }
                Err(_) => {
                    first.get_or_insert(
                        self.inner.setup(format!("leaving the metadata store: no answer within {bound:?}")),
                    );
                }
            }
        }
        for m in std::mem::take(&mut self.memory) {
            if let Err(e) = m.close(deadline).await {
                first.get_or_insert(self.inner.setup(format!("closing a registration: {e}")));
            }
        }
        for r in std::mem::take(&mut self.registrations) {
            if let Err(e) = r.close(deadline).await {
                first.get_or_insert(self.inner.setup(format!("closing a registration: {e}")));
            }
        }
        if let Some((host, r)) = self.warmup.take() {
            if let Err(e) = r.close(deadline).await {
                first.get_or_insert(self.inner.setup(format!("closing the warm-up region: {e}")));
            }
            drop(host);
        }
        first.map_or(Ok(()), Err)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.inner.stop.cancel("agent dropped");
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl crate::metrics::Source for Inner {
    fn snapshot(&self) -> Snapshot {
        let stats = self.stats_now();
        let peers = |p: &Peers| (p.by_rank.len() as u64, p.connected().len() as u64, p.quarantine.len() as u64);
        let ((peers, peers_connected, quarantined_peers), active_requests, in_flight, early_queued) = match &self.half {
            Half::Prefill(p) => {
                let st = lock(&p.state);
                let b = &st.book;
                (peers(&st.peers), b.len() as u64, b.in_flight() as u64, b.early_len() as u64)
            }
            Half::Decode(d) => {
                let st = lock(d);
                (peers(&st.peers), st.book.len() as u64, st.book.in_flight() as u64, 0)
            }
        };
        Snapshot {
            stats,
            peers,
            peers_connected,
            quarantined_peers,
            active_requests,
            in_flight,
            early_queued,
            registered_bytes: self.registered_bytes,
        }
    }
}

impl fmt::Debug for Inner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Inner({} rank {})", self.cfg.role, self.cfg.rank)
    }
}

/// A decode-side request (SGLang's `KVReceiver`, vLLM's load of one request).
#[derive(Clone)]
pub struct Receiver {
    inner: Arc<Inner>,
    /// The agent's decode half (its book and peers).
    state: Arc<Mutex<State<DecodeBook>>>,
    room: RequestId,
}

impl fmt::Debug for Receiver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Receiver({} on decode rank {})", self.room, self.inner.cfg.rank)
    }
}

impl fmt::Debug for Sender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Sender({} on prefill rank {})", self.room, self.inner.cfg.rank)
    }
}

impl Receiver {
    /// The room.
    pub fn room(&self) -> RequestId {
        self.room
    }

    /// The generation of this use of the room, once handed off.
    pub fn generation(&self) -> Option<u64> {
        lock(&self.state).book.generation(self.room)
    }

    /// The trace id of this use of the room ([`TraceId`]), once handed off: the id this rank and
    /// its prefill ranks log the request's steps under.
    pub fn trace_id(&self) -> Option<TraceId> {
        self.generation().map(|g| TraceId::of(self.room, g))
    }

    /// Hands the request off: the destination page indices on this rank (in token order) and,
    /// optionally, an aux slot. Registers the request with the tracker under a new generation (any
    /// notification kept for it is applied), then sends the page list to every prefill rank that
    /// feeds this rank, in the background. Returns at once. Errors: pages outside the pool or
    /// repeated, a second call, a released request.
    pub fn send_metadata(&self, pages: &[u32], aux_slot: Option<u32>) -> Result<(), EngineError> {
        let inner = &self.inner;
        let invalid = |detail: String| EngineError::InvalidCall {
            role: Side::Decode,
            rank: inner.cfg.rank,
            room: self.room,
            detail,
        };
        if pages.len() > kvxfer_core::notify::MAX_HANDOFF_PAGES {
            return Err(invalid(format!(
                "{} pages exceed the {} one handoff carries",
                pages.len(),
                kvxfer_core::notify::MAX_HANDOFF_PAGES
            )));
        }
        check_pages(Side::Decode, inner.cfg.rank, pages, inner.pool_pages).map_err(|e| invalid(e.to_string()))?;
        let bytes = pages.len() as u64 * inner.page_bytes;
        let generation = lock(&self.state)
            .book
            .hand_off(self.room, pages, aux_slot.is_some(), bytes, Instant::now())
            .map_err(|e| match e {
            CallError::Unknown => invalid("the request was released; create a new receiver".into()),
            e => invalid(e.to_string()),
        })?;
        let note = Notification::new(
            self.room,
            own_key(Side::Decode, inner.cfg.rank),
            NotificationBody::Handoff { pages: pages.to_vec(), aux_slot, digest: inner.cfg.digest },
        )
        .with_generation(generation);
        tracing::debug!(
            target: "kvxfer::request", trace_id = %TraceId::of(self.room, generation), room = %self.room,
            rank = %inner.cfg.rank, role = "decode", pages = pages.len(), digest = inner.cfg.digest,
            "handoff: sending the page list to prefill ranks {}",
            inner.topo.senders(inner.cfg.rank).iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
        );
        let inner2 = Arc::clone(inner);
        inner.handle.spawn(async move { inner2.hand_off(note).await });
        Ok(())
    }

    /// The request's status now; never blocks.
    pub fn status(&self) -> RequestStatus {
        self.inner.receiver_status(&self.state, self.room)
    }

    /// Waits until the request is final (`Success` or `Failed`), at most until `deadline`.
    pub async fn wait(&self, deadline: Instant) -> Result<RequestStatus, EngineError> {
        self.inner.wait_for(self.room, Side::Decode, deadline, || self.status(), |s| s.phase.is_final()).await
    }

    /// Aborts the request: every prefill rank that could still write is told at once and asked to
    /// fence; the request is `Aborting` until each confirmed (or is known dead), then `Failed` with
    /// [`RequestStatus::pages_reusable`]. Aborting a final request changes nothing.
    pub fn abort(&self, reason: &str) {
        if self.inner.receiver_abort(&self.state, self.room, reason.to_owned()) {
            add(&self.inner.stats.aborted, 1);
        }
    }

    /// The aux payload, once received.
    pub fn aux(&self) -> Option<Vec<u8>> {
        lock(&self.state).book.aux(self.room)
    }

    /// Frees every trace of the request (tracker entry, generation). Refused while writes of it may
    /// still land (the status is not final or its pages are not reusable): abort and wait first.
    /// Afterwards the room may be used again, and late notifications of this use are dropped.
    pub fn release(self) -> Result<RequestStatus, EngineError> {
        let inner = &self.inner;
        // Counted before it goes (the progress task counts final requests on its next tick, which
        // a request released at once would miss).
        inner.count_outcomes(&self.state);
        let connect_error = inner.connect_error.get().map(String::as_str);
        let connected = inner.connected.load(Ordering::Acquire);
        let r = lock(&self.state).book.release(self.room, connect_error, connected, Instant::now());
        let s = r.map_err(|e| EngineError::InvalidCall {
            role: Side::Decode,
            rank: inner.cfg.rank,
            room: self.room,
            detail: e.to_string(),
        })?;
        Ok(RequestStatus::of(s.phase, s.reason, s.pages_reusable))
    }
}

/// A prefill-side request (SGLang's `KVSender`, vLLM's save of one request).
#[derive(Clone)]
pub struct Sender {
    inner: Arc<Inner>,
    /// The agent's prefill half (session and book).
    half: Arc<PrefillHalf>,
    room: RequestId,
}

impl Sender {
    /// The room.
    pub fn room(&self) -> RequestId {
        self.room
    }

    /// The trace ids of the transfers this request makes, one per decode rank that handed off so
    /// far ([`TraceId`]; each decode rank chooses its own generation).
    pub fn trace_ids(&self) -> Vec<(RankId, TraceId)> {
        let handoffs = lock(&self.half.state).book.handoffs(self.room);
        handoffs.into_iter().map(|(d, g)| (d, TraceId::of(self.room, g))).collect()
    }

    /// Sets the request's total page count (SGLang's `init(num_kv_indices)`): the chunk whose pages
    /// reach it is the last. Every decode rank's page list must have this many pages.
    pub fn init(&self, total_pages: u32) -> Result<(), EngineError> {
        let r = lock(&self.half.state).book.init(self.room, total_pages);
        r.map_err(|e| self.inner.call_error(self.room, e))
    }

    /// Sends the next chunk: the source pages (in token order) that follow the pages sent so far;
    /// the chunk that reaches the total is the last. Posts in the background and returns at once.
    /// Errors (nothing is posted): not `WaitingForInput` yet, no `init`, more pages than the total,
    /// a source page outside the pool.
    pub fn send(&self, src_pages: &[u32]) -> Result<(), EngineError> {
        let stage_layers = self.inner.stage_layers();
        self.inner.send_part(&self.half, self.room, src_pages, 0..stage_layers, true)
    }

    /// Layer-wise sending (vLLM's `save_kv_layer`): sends layers `layers` (stage-local) of the chunk
    /// made of `src_pages`, as soon as they are computed. Every call of one chunk gives the same
    /// pages; once every layer of the stage was sent, the chunk's completion notification follows
    /// the writes (completion is still counted per chunk) and the next call starts the next chunk.
    pub fn send_layers(&self, src_pages: &[u32], layers: std::ops::Range<u32>) -> Result<(), EngineError> {
        self.inner.send_part(&self.half, self.room, src_pages, layers, false)
    }

    /// Sends the request's aux data (SGLang's metadata row: first output token and the like) to
    /// every decode rank that handed off an aux slot, out of band; it lands as that rank's
    /// [`Receiver::aux`]. Required before `Success` when any decode rank asked for aux. At most
    /// [`kvxfer_core::notify::MAX_PAYLOAD`] bytes.
    pub fn send_aux(&self, data: Vec<u8>) -> Result<(), EngineError> {
        let inner = &self.inner;
        let room = self.room;
        let connected = inner.connected.load(Ordering::Acquire);
        let targets = inner
            .book(&self.half, |b| b.reserve_aux(room, data.len(), connected))
            .map_err(|e| inner.call_error(room, e))?;
        let (this, half) = (Arc::clone(inner), Arc::clone(&self.half));
        inner.handle.spawn(async move {
            let me = SenderKey::of(this.cfg.rank);
            let mut first = None;
            for (d, generation) in targets {
                let n = Notification::new(room, me, NotificationBody::Aux(data.clone())).with_generation(generation);
                if let Err(e) = this.notify_rank(&half.path, d, &n).await {
                    first.get_or_insert(e.to_string());
                }
            }
            this.book(&half, |b| b.part_done(room, first.map_or(Ok(()), Err), &[]));
        });
        Ok(())
    }

    /// The request's status now; never blocks.
    pub fn status(&self) -> RequestStatus {
        self.inner.sender_status(&self.half, self.room)
    }

    /// Waits until the request leaves `Bootstrapping`, at most until `deadline`: every decode rank
    /// it feeds handed off, so [`Self::send`] is accepted (`WaitingForInput`), or it already has an
    /// outcome (a decode rank aborted it, a peer was lost: `Aborting`/`Failed`). Returns that
    /// status; a `Timeout` error leaves the request as it is (abort it, or wait again).
    ///
    /// For an engine with a task per request: it wakes when the last handoff arrives instead of
    /// polling [`Self::status`] on a timer (an engine loop that polls every step needs neither).
    pub async fn wait_ready(&self, deadline: Instant) -> Result<RequestStatus, EngineError> {
        self.inner
            .wait_for(self.room, Side::Prefill, deadline, || self.status(), |s| s.phase != Phase::Bootstrapping)
            .await
    }

    /// Waits until the request is final, at most until `deadline`.
    pub async fn wait(&self, deadline: Instant) -> Result<RequestStatus, EngineError> {
        self.inner.wait_for(self.room, Side::Prefill, deadline, || self.status(), |s| s.phase.is_final()).await
    }

    /// Aborts: stops posting, aborts the transfers in flight, then tells every decode rank (a
    /// failure notification, which is also this rank's fence). `Aborting` until the transfers
    /// settled, then `Failed`.
    pub fn abort(&self, reason: &str) {
        if self.inner.book(&self.half, |b| b.abort(self.room, reason.to_owned(), FailCause::Aborted)) {
            add(&self.inner.stats.aborted, 1);
        }
    }

    /// Frees the request. Refused while transfers of it are in flight (abort and wait first).
    pub fn release(self) -> Result<RequestStatus, EngineError> {
        let connected = self.inner.connected.load(Ordering::Acquire);
        let r = lock(&self.half.state).book.release(self.room, connected);
        let (s, io) = r.map_err(|e| self.inner.call_error(self.room, e))?;
        drop(io);
        Ok(RequestStatus::of(s.phase, s.reason, s.pages_reusable))
    }
}

impl Inner {
    fn setup(&self, detail: String) -> EngineError {
        EngineError::Setup { role: self.cfg.role, rank: self.cfg.rank, detail }
    }

    /// The error of a call this rank's role does not take.
    fn wrong_role(&self, needs: Side, call: &'static str) -> EngineError {
        EngineError::WrongRole { role: self.cfg.role, rank: self.cfg.rank, call, needs }
    }

    fn stage_layers(&self) -> u32 {
        self.topo.stage_layers(self.cfg.role, self.cfg.rank.pp)
    }

    /// Runs `f` on the peers, under the agent's lock.
    fn peers<R>(&self, f: impl FnOnce(&mut Peers) -> R) -> R {
        match &self.half {
            Half::Prefill(p) => f(&mut lock(&p.state).peers),
            Half::Decode(d) => f(&mut lock(d).peers),
        }
    }

    fn missing_peers(&self) -> String {
        let v: Vec<String> = self.peers(|p| {
            p.by_rank
                .iter()
                .filter(|(_, p)| p.id.is_none() || p.lost.is_some())
                .map(|(r, p)| match &p.lost {
                    Some(why) => format!("{} rank {r} (lost: {why})", self.other()),
                    None => format!("{} rank {r}", self.other()),
                })
                .collect()
        });
        v.join(", ")
    }

    fn other(&self) -> Side {
        match self.cfg.role {
            Side::Prefill => Side::Decode,
            Side::Decode => Side::Prefill,
        }
    }

    fn peer_id(&self, r: RankId) -> Option<PeerId> {
        self.peers(|p| p.by_rank.get(&r).filter(|p| p.lost.is_none()).and_then(|p| p.id))
    }

    /// A prefill agent's link to decode rank `d`, while connected and not lost.
    fn link(&self, d: RankId) -> Result<DecodeLink, SessionError> {
        self.peers(|p| p.by_rank.get(&d).filter(|p| p.lost.is_none()).and_then(|p| p.link.clone()))
            .ok_or(SessionError::NotConnected { rank: self.cfg.rank, dst: d })
    }

    /// Sends `n` to decode rank `d` over its link ([`SendPath::notify`]).
    async fn notify_rank(&self, s: &SendPath, d: RankId, n: &Notification) -> Result<(), SessionError> {
        let link = self.link(d)?;
        s.notify(&link, n).await
    }

    // ---------------------------------------------------------------- connect and membership

    async fn connect_and_watch(
        self: Arc<Self>,
        store: Arc<dyn MetadataStore>,
        me: RankRegistration,
        watch: MemberWatch,
    ) {
        let other = self.other();
        // Only the ranks this one exchanges with: one that feeds nobody may finish and leave first.
        let need: Vec<RankId> = self.peers(|p| p.by_rank.keys().copied().collect());
        let r = tokio::select! {
            r = crate::metadata::handshake_among(&*store, &me, other, &need, self.cfg.connect_timeout) => r,
            _ = self.stop.cancelled() => return,
        };
        match r {
            Ok((members, topo)) if topo == self.topo => {
                for m in members {
                    if let Err(e) = self.connect_peer(&m.registration, m.epoch).await {
                        self.fail_connect(e);
                        self.wake.notify_waiters();
                        return;
                    }
                }
                self.update_connected();
            }
            Ok((_, topo)) => {
                self.fail_connect(format!(
                    "the peers' configuration {topo:?} differs from this rank's {:?}; start every rank with the same model and parallelism",
                    self.topo
                ));
            }
            Err(e) => self.fail_connect(e.to_string()),
        }
        self.wake.notify_waiters();
        self.watch_members(watch).await;
    }

    /// Records why the initial connect failed (the first reason stays).
    fn fail_connect(&self, why: String) {
        let _ = self.connect_error.set(why);
    }

    fn update_connected(&self) {
        let all = self.peers(|p| p.by_rank.values().all(|p| p.id.is_some() && p.lost.is_none()));
        self.connected.store(all, Ordering::Release);
        self.wake.notify_waiters();
    }

    /// Connects to one peer rank (if this rank exchanges with it), replacing an older epoch's
    /// connection.
    async fn connect_peer(self: &Arc<Self>, reg: &RankRegistration, epoch: u64) -> Result<(), String> {
        if reg.role != self.other() || !self.peers(|p| p.by_rank.contains_key(&reg.rank)) {
            return Ok(());
        }
        // The layout check refused ranks that share no protocol version; the features follow from
        // the version they share.
        let who = if reg.role == Side::Prefill { "the prefill rank" } else { "the decode rank" };
        let negotiated = self.cfg.protocol_range().negotiate(reg.protocol, who).map_err(|e| e.to_string())?;
        if self.cfg.digest && self.cfg.role == Side::Decode && !negotiated.has(Feature::Digest) {
            return Err(format!(
                "digest: {} rank {} ({}) speaks kvxfer protocol {}, which has no digest (protocol {} or later has): \
                 upgrade it (or unpin its protocol), or turn the digest off on this decode rank",
                reg.role,
                reg.rank,
                reg.label,
                reg.protocol,
                Feature::Digest.since()
            ));
        }
        tracing::debug!(
            target: "kvxfer::engine", rank = %self.cfg.rank, peer = %reg.rank, protocol = negotiated.version,
            "negotiated kvxfer protocol with {} rank {}", reg.role, reg.rank
        );
        // (live: connected and not lost; its epoch)
        let known = self.peers(|p| p.by_rank.get(&reg.rank).map(|p| (p.id.is_some() && p.lost.is_none(), p.epoch)));
        let replaced = match known {
            Some((true, e)) if e >= epoch => return Ok(()),
            Some((live, e)) => live && e < epoch,
            None => false,
        };
        // A new process took the rank over while the old one was never declared lost (it restarted
        // faster than its lease expired, or two processes claimed the rank): give up on the old
        // instance, which cuts it off, before the new one serves anything.
        if replaced {
            self.peer_lost(reg.rank, format!("{} rank {} was replaced under epoch {epoch}", reg.role, reg.rank));
        }
        let (id, link) = match &self.half {
            Half::Prefill(p) => {
                let s = &p.path;
                let link = s.open(reg.rank, &reg.endpoint, reg.pool.clone()).await.map_err(|e| e.to_string())?;
                if let (Some(w), true) = (reg.warmup, self.cfg.warm_up) {
                    self.warm_up(s, &link, reg, w).await;
                }
                (Some(link.peer()), Some(link))
            }
            Half::Decode(d) => {
                let id =
                    self.backend.connect(&reg.endpoint).await.map_err(|e| {
                        format!("decode rank {} -> prefill rank {}: connect: {e}", self.cfg.rank, reg.rank)
                    })?;
                lock(d).book.sender_back(SenderKey::of(reg.rank));
                (Some(id), None)
            }
        };
        // The old instance (if any) was given up on and is being cut off by `peer_lost`.
        self.peers(|p| p.by_rank.insert(reg.rank, Peer { id, link, epoch, lost: None }));
        Ok(())
    }

    /// Warms the new connection to decode rank `reg` before it counts as connected (see
    /// [`SendPath::warm_up`]). A failure is warned about and counted, not fatal: the
    /// connection stays, and a real request on it reports whatever is wrong.
    async fn warm_up(&self, s: &SendPath, link: &DecodeLink, reg: &RankRegistration, w: WarmupRegion) {
        let deadline = Instant::now() + WARM_UP_WAIT.min(self.cfg.request_timeout);
        let t0 = Instant::now();
        match s.warm_up(link, w.region, w.len, WARM_UP_ROUNDS, deadline).await {
            Ok(st) => {
                add(&self.stats.warm_ups, 1);
                tracing::debug!(
                    target: "kvxfer::engine", rank = %self.cfg.rank, peer = %reg.rank, bytes = st.bytes, ops = st.ops,
                    "warmed the connection to decode rank {} in {:?}", reg.rank, t0.elapsed()
                );
            }
            Err(e) => {
                add(&self.stats.warm_up_failures, 1);
                tracing::warn!(
                    target: "kvxfer::engine", rank = %self.cfg.rank, peer = %reg.rank,
                    "warming the connection to decode rank {} ({}) failed after {:?}: {e}; the connection stays \
                     (its first request pays the transport's first-use costs, and reports any real fault)",
                    reg.rank, reg.label, t0.elapsed()
                );
            }
        }
    }

    /// This rank's own lease: once the store says it is gone, or no keep-alive succeeded for a
    /// whole TTL, the peers consider this rank lost (and fail what it shares with them); so does
    /// this rank: every peer is lost (requests fail, connections close) until the rank is
    /// restarted under a new epoch.
    async fn watch_health(self: Arc<Self>, mut health: tokio::sync::watch::Receiver<Option<String>>) {
        loop {
            let why = health.borrow_and_update().clone();
            if let Some(why) = why {
                let ranks: Vec<RankId> = self.peers(|p| p.by_rank.keys().copied().collect());
                for r in ranks {
                    self.peer_lost(r, format!("this rank's own membership is lost ({why})"));
                }
                return;
            }
            tokio::select! {
                r = health.changed() => if r.is_err() { return },
                _ = self.stop.cancelled() => return,
            }
        }
    }

    async fn watch_members(self: Arc<Self>, mut watch: MemberWatch) {
        loop {
            let evs = tokio::select! {
                r = watch.next(Duration::from_secs(1)) => r,
                _ = self.stop.cancelled() => return,
            };
            match evs {
                Ok(evs) => {
                    for ev in evs {
                        match ev {
                            MemberEvent::Joined(m) => {
                                let r = &m.registration;
                                if r.role == self.other() {
                                    if let Err(e) = self.connect_peer(r, m.epoch).await {
                                        tracing::warn!(rank = %self.cfg.rank, peer = %r.rank, error = %e, "reconnect failed");
                                    }
                                    self.update_connected();
                                }
                            }
                            MemberEvent::Lost(m) | MemberEvent::Left(m) => {
                                let r = &m.registration;
                                if r.role == self.other() {
                                    let why = format!(
                                        "{} rank {} ({}) left or lost its lease in the metadata store",
                                        r.role, r.rank, r.label
                                    );
                                    self.peer_lost(r.rank, why);
                                }
                            }
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(rank = %self.cfg.rank, error = %e, "membership watch failed; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                        _ = self.stop.cancelled() => return,
                    }
                }
            }
        }
    }

    /// This rank gives up on a peer rank: every request that needs it fails at once, then the
    /// peer instance is cut off ([`Self::cut_off`]); on the decode side the pages it could still
    /// write become reusable only once the backend confirmed the cut-off.
    fn peer_lost(self: &Arc<Self>, r: RankId, why: String) {
        let id = self.peers(|peers| {
            let p = peers.by_rank.get_mut(&r).filter(|p| p.lost.is_none())?;
            p.lost = Some(why.clone());
            p.link = None;
            Some(p.id.take())
        });
        let Some(id) = id else { return };
        let given_up = Instant::now();
        add(&self.stats.peers_lost, 1);
        self.connected.store(false, Ordering::Release);
        let active = match &self.half {
            Half::Decode(d) => lock(d).book.len(),
            Half::Prefill(p) => lock(&p.state).book.open_count(),
        };
        // A peer that leaves when nothing needs it (a normal shutdown) is no warning.
        if active > 0 {
            tracing::warn!(rank = %self.cfg.rank, peer = %r, active, "lost {} rank {r}: {why}", self.other());
        } else {
            tracing::info!(rank = %self.cfg.rank, peer = %r, "lost {} rank {r}: {why}", self.other());
        }
        let loss = match &self.half {
            Half::Decode(d) => Some(lock(d).book.sender_lost(SenderKey::of(r), &why).id),
            Half::Prefill(p) => {
                // Stop posting at once: every open send to it fails (its transfers are failed by the
                // cut-off below, which makes their source pages reusable).
                self.book(p, |b| b.abort_open(&format!("lost decode rank {r}: {why}"), FailCause::PeerLost));
                None
            }
        };
        let this = Arc::clone(self);
        self.handle.spawn(async move { this.cut_off(r, id, loss, why, given_up, active > 0).await });
        self.wake.notify_waiters();
    }

    /// Cuts off the instance of peer rank `r` that `id` is connected to, and reports the outcome
    /// to the decode tracker (`loss`): confirmed, the requests it could write are fenced for it;
    /// not confirmed within [`AgentConfig::cut_off_timeout`], they stay quarantined. A peer that
    /// was never connected (`id` is `None`) was handed nothing and holds nothing of this rank's.
    /// `loud`: requests needed the peer, so the confirmation is a warning too, beside the loss (an
    /// operator sees when the pages became reusable).
    async fn cut_off(
        self: Arc<Self>,
        r: RankId,
        id: Option<PeerId>,
        loss: Option<u64>,
        why: String,
        given_up: Instant,
        loud: bool,
    ) {
        let bound = self.cfg.cut_off_timeout;
        let outcome = match id {
            None => Ok("never connected: it was handed nothing".to_owned()),
            Some(id) => match tokio::time::timeout(bound, self.backend.cut_off(id, &why)).await {
                Ok(Ok(c)) => Ok(format!(
                    "{}; {} connection(s) closed, {} transfer(s) failed",
                    c.how, c.closed, c.failed_transfers
                )),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("the {} backend did not confirm within {bound:?}", self.backend.name())),
            },
        };
        let took = given_up.elapsed();
        let key = SenderKey::of(r);
        match outcome {
            Ok(how) => {
                if let (Some(loss), Half::Decode(d)) = (loss, &self.half) {
                    lock(d).book.sender_cut_off(key, loss);
                }
                add(&self.stats.cut_offs, 1);
                self.stats.cut_off_max_us.fetch_max(took.as_micros() as u64, Ordering::Relaxed);
                self.peers(|p| p.quarantine.remove(&r));
                let (ms, other) = (took.as_secs_f64() * 1e3, self.other());
                if loud {
                    tracing::warn!(rank = %self.cfg.rank, peer = %r, "cut off {other} rank {r} {ms:.1} ms after giving up on it ({how})");
                } else {
                    tracing::info!(rank = %self.cfg.rank, peer = %r, "cut off {other} rank {r} {ms:.1} ms after giving up on it ({how})");
                }
            }
            Err(e) => {
                let what = format!(
                    "{} rank {r} was given up on ({why}) but cutting it off failed: {e}; the pages it could write \
                     are quarantined",
                    self.other()
                );
                if let (Some(loss), Half::Decode(d)) = (loss, &self.half) {
                    lock(d).book.sender_quarantined(key, loss, &what);
                }
                add(&self.stats.quarantined, 1);
                self.peers(|p| p.quarantine.insert(r, what.clone()));
                tracing::error!(rank = %self.cfg.rank, peer = %r, "{what}");
            }
        }
        self.wake.notify_waiters();
    }

    // ---------------------------------------------------------------- progress

    async fn progress(self: Arc<Self>) {
        loop {
            let events = tokio::select! {
                r = self.backend.recv(TICK) => r,
                _ = self.stop.cancelled() => return,
            };
            match events {
                Ok(events) => {
                    for e in events {
                        self.route(e);
                    }
                }
                Err(e) => {
                    tracing::warn!(rank = %self.cfg.rank, error = %e, "backend recv failed");
                    tokio::time::sleep(TICK).await;
                }
            }
            self.housekeeping();
            self.wake.notify_waiters();
        }
    }

    fn route(self: &Arc<Self>, e: BackendEvent) {
        match e {
            BackendEvent::Notification(n) => match &self.half {
                Half::Decode(state) => match &n.body {
                    NotificationBody::Handoff { .. } | NotificationBody::Abort(_) => {
                        add(&self.stats.protocol_errors, 1);
                    }
                    body => {
                        tracing::debug!(
                            target: "kvxfer::request", trace_id = %TraceId::of(n.request, n.generation),
                            room = %n.request, rank = %self.cfg.rank, role = "decode", from = %n.sender,
                            "received {n}"
                        );
                        if matches!(body, NotificationBody::Fenced) {
                            add(&self.stats.fences, 1);
                        }
                        lock(state).book.handle(&n, Instant::now());
                    }
                },
                Half::Prefill(p) => {
                    let d = rank_of_key(n.sender);
                    // A decode rank's generations carry its membership epoch (`send_metadata`): one
                    // older than the epoch the membership announced for that rank comes from a
                    // process that was replaced (it resumed after a stop): refused.
                    let known = self.peers(|p| p.by_rank.get(&d).map_or(0, |p| p.epoch));
                    if n.generation >> 32 < known {
                        add(&self.stats.stale_refused, 1);
                        tracing::warn!(
                            rank = %self.cfg.rank, from = %d, request = %n.request,
                            "refused {n} of decode rank {d}: it carries epoch {}, the rank is at epoch {known}",
                            n.generation >> 32
                        );
                        return;
                    }
                    match n.body {
                        NotificationBody::Handoff { pages, aux_slot, digest } => {
                            let h = Handoff { generation: n.generation, pages, aux_slot, digest };
                            self.on_handoff(p, d, n.request, h);
                        }
                        NotificationBody::Abort(reason) => self.on_abort(p, d, n.request, n.generation, &reason),
                        _ => add(&self.stats.protocol_errors, 1),
                    }
                }
            },
            BackendEvent::PeerLost { identity, reason } => {
                let (side, r) = from_identity(identity);
                if side == self.other() {
                    self.peer_lost(r, format!("the transport lost {side} rank {r}: {reason}"));
                }
            }
        }
    }

    fn housekeeping(self: &Arc<Self>) {
        let now = Instant::now();
        match &self.half {
            Half::Decode(state) => {
                // Deadlines; failed requests: ask every sender that may still write to stop and
                // fence (again while its fence is missing).
                let asks = {
                    let mut st = lock(state);
                    let connected = st.peers.connected();
                    st.book.poll(now, |k| connected.contains(&rank_of_key(k)))
                };
                for a in asks {
                    if a.repeated > 0 {
                        add(&self.stats.fence_reasks, 1);
                        tracing::warn!(
                            target: "kvxfer::request", trace_id = %TraceId::of(a.room, a.generation), room = %a.room,
                            rank = %self.cfg.rank, role = "decode", prefill = %rank_of_key(a.key), asks = a.repeated + 1,
                            "no fence from prefill rank {} for a failed request: asking it again to stop and fence",
                            rank_of_key(a.key)
                        );
                    }
                    let note = Notification::new(
                        a.room,
                        own_key(Side::Decode, self.cfg.rank),
                        NotificationBody::Abort(a.reason),
                    )
                    .with_generation(a.generation);
                    let this = Arc::clone(self);
                    self.handle.spawn(async move { this.to_prefill(rank_of_key(a.key), &note).await });
                }
                if self.cfg.digest {
                    self.start_checks(state);
                }
                self.count_outcomes(state);
            }
            Half::Prefill(p) => {
                // The initial connect failed: every request fails with it at once.
                let failed = self.connect_error.get().cloned();
                if let Some(e) = failed {
                    let why = format!("connecting to the decode ranks failed: {e}");
                    self.book(p, |b| b.abort_open(&why, FailCause::Connect));
                }
                // A request that needs a lost decode rank fails at once, also one created after the
                // loss, until the rank is back.
                let lost: Option<(RankId, String)> =
                    self.peers(|p| p.by_rank.iter().find_map(|(r, p)| p.lost.clone().map(|w| (*r, w))));
                if let Some((r, why)) = lost {
                    self.book(p, |b| b.abort_open(&format!("decode rank {r} is lost: {why}"), FailCause::PeerLost));
                }
                // Requests past their deadline fail; early handoffs and aborts expire.
                self.book_with_peers(p, |b, peers| {
                    let connected = peers.connected();
                    b.poll_deadlines(now, |d| connected.contains(&d))
                });
            }
        }
    }

    /// Counts and logs the decode requests that became final since the last call. The lines are
    /// written and the metrics and counters recorded under the agent's lock, so that once any
    /// call returns (the progress task's or [`Receiver::release`]'s), every request it found
    /// final has its final line written, whichever of the two took it.
    fn count_outcomes(&self, state: &Mutex<State<DecodeBook>>) {
        let connect_error = self.connect_error.get().map(String::as_str);
        let connected = self.connected.load(Ordering::Acquire);
        let mut st = lock(state);
        let outcomes = st.book.take_outcomes(connect_error, connected, Instant::now());
        let (mut done, mut failed) = (0, 0);
        for o in outcomes {
            let elapsed = o.handed_off.map(|(t, _)| t.elapsed().as_secs_f64());
            tracing::debug!(
                target: "kvxfer::request", trace_id = %o.generation.map_or(TraceId(0), |g| TraceId::of(o.room, g)),
                room = %o.room, rank = %self.cfg.rank, role = "decode", seconds = elapsed.unwrap_or(0.0),
                "final: {}{}", o.phase, o.reason.as_ref().map(|w| format!(": {w}")).unwrap_or_default()
            );
            match o.cause {
                None => {
                    done += 1;
                    self.recorder.succeeded(elapsed.unwrap_or(0.0));
                    self.recorder.moved(o.handed_off.map_or(0, |(_, b)| b), 0);
                }
                Some(c) => {
                    failed += 1;
                    let cause = match c {
                        DecodeCause::AbortedEarly => Cause::Aborted,
                        DecodeCause::Connect => Cause::Connect,
                        DecodeCause::Digest => Cause::Digest,
                        DecodeCause::Tracker(f) => Cause::of_failure(&f),
                        DecodeCause::Untracked => Cause::Protocol,
                    };
                    self.recorder.failed(elapsed, cause);
                }
            }
        }
        add(&self.stats.succeeded, done);
        add(&self.stats.failed, failed);
        drop(st);
    }

    // ---------------------------------------------------------------- decode side

    /// Starts the digest check of every request whose tracker has all chunks and digests.
    fn start_checks(self: &Arc<Self>, state: &Arc<Mutex<State<DecodeBook>>>) {
        let jobs = lock(state).book.take_checks(Instant::now());
        for Check { room, generation, pages, sent } in jobs {
            let (this, state) = (Arc::clone(self), Arc::clone(state));
            let (topo, me) = (self.topo, self.cfg.rank);
            let pages = Arc::new(pages);
            // One blocking task per sender: they hash disjoint bytes, in parallel where cores are free.
            let checks: Vec<_> = sent
                .into_iter()
                .map(|(k, d)| {
                    let (views, pages) = (Arc::clone(&self.views), Arc::clone(&pages));
                    let one = (rank_of_key(k), d);
                    tokio::task::spawn_blocking(move || check_digests(&topo, me, &views, &pages, vec![one]))
                })
                .collect();
            self.handle.spawn(async move {
                let mut result = Ok(());
                let mut bytes = 0;
                for c in join_all(checks).await {
                    let (r, b) =
                        c.unwrap_or_else(|e| (Err(format!("the digest check of decode rank {me} failed: {e}")), 0));
                    bytes += b;
                    if result.is_ok() {
                        result = r;
                    }
                }
                add(&this.stats.digest_bytes, bytes);
                add(&this.stats.digest_mismatches, u64::from(result.is_err()));
                if let Err(why) = &result {
                    tracing::warn!(rank = %this.cfg.rank, %room, "{why}");
                }
                tracing::debug!(
                    target: "kvxfer::request", trace_id = %TraceId::of(room, generation),
                    room = %room, rank = %this.cfg.rank, role = "decode", bytes, ok = result.is_ok(), "digest checked"
                );
                lock(&state).book.check_done(room, generation, result);
                this.wake.notify_waiters();
            });
        }
    }

    async fn to_prefill(self: &Arc<Self>, p: RankId, note: &Notification) {
        let Some(peer) = self.peer_id(p) else {
            tracing::debug!(rank = %self.cfg.rank, prefill = %p, "no live connection for {note}");
            return;
        };
        match tokio::time::timeout(crate::session::NOTIFY_TIMEOUT, self.backend.notify(peer, note)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => self.peer_lost(p, format!("notifying prefill rank {p} failed: {e}")),
            Err(_) => self.peer_lost(
                p,
                format!("notifying prefill rank {p} took more than {:?}", crate::session::NOTIFY_TIMEOUT),
            ),
        }
    }

    async fn hand_off(self: Arc<Self>, note: Notification) {
        // Bootstrapping: wait (bounded by the request's deadline) for the connections.
        let deadline = Instant::now() + self.cfg.request_timeout;
        while !self.connected.load(Ordering::Acquire) && Instant::now() < deadline {
            if self.connect_error.get().is_some() || self.stop.reason().is_some() {
                break;
            }
            let notified = self.wake.notified();
            let _ = tokio::time::timeout(TICK * 5, notified).await;
        }
        if self.connect_error.get().is_some() || !self.connected.load(Ordering::Acquire) {
            // Not every sender is connected (the connect failed, a sender is lost, or the wait hit
            // the request's deadline): the request cannot succeed, so nothing is sent and nothing
            // can land. It fails with the connect error (`receiver_phase`), the lost sender (the
            // tracker) or its deadline.
            self.wake.notify_waiters();
            return;
        }
        let senders = self.topo.senders(self.cfg.rank);
        let sends = senders.iter().map(|p| self.to_prefill(*p, &note));
        join_all(sends).await;
        self.wake.notify_waiters();
    }

    fn receiver_status(&self, state: &Mutex<State<DecodeBook>>, room: RequestId) -> RequestStatus {
        let connect_error = self.connect_error.get().map(String::as_str);
        let connected = self.connected.load(Ordering::Acquire);
        let s = lock(state).book.status(room, connect_error, connected, Instant::now());
        RequestStatus::of(s.phase, s.reason, s.pages_reusable)
    }

    /// Returns whether this call aborted a request that had no outcome.
    fn receiver_abort(&self, state: &Mutex<State<DecodeBook>>, room: RequestId, reason: String) -> bool {
        let generation = lock(state).book.generation(room);
        tracing::debug!(
            target: "kvxfer::request", trace_id = %generation.map_or(TraceId(0), |g| TraceId::of(room, g)),
            room = %room, rank = %self.cfg.rank, role = "decode", "abort: {reason}"
        );
        let aborted = lock(state).book.abort(room, &reason, Instant::now());
        self.wake.notify_waiters();
        aborted
    }

    // ---------------------------------------------------------------- prefill side

    /// Runs `f` on the request book under its lock, then carries out the actions it queued
    /// (cancels under the lock, as they only signal; notifications and counting after it) and
    /// wakes the waiters.
    fn book<R>(self: &Arc<Self>, half: &Arc<PrefillHalf>, f: impl FnOnce(&mut PrefillBook<SendIo>) -> R) -> R {
        self.book_with_peers(half, |b, _| f(b))
    }

    /// [`Self::book`], with the peers (read under the same lock).
    fn book_with_peers<R>(
        self: &Arc<Self>,
        half: &Arc<PrefillHalf>,
        f: impl FnOnce(&mut PrefillBook<SendIo>, &Peers) -> R,
    ) -> R {
        let (r, actions) = {
            let mut st = lock(&half.state);
            let State { book: b, peers } = &mut *st;
            let r = f(b, peers);
            let mut actions = Vec::new();
            while let Some(a) = b.poll_action() {
                match a {
                    BookAction::Cancel { room, reason } => {
                        if let Some(io) = b.io_mut(room) {
                            io.cancel.cancel(reason);
                        }
                    }
                    a => actions.push(a),
                }
            }
            (r, actions)
        };
        if !actions.is_empty() {
            self.carry_out(half, actions);
        }
        self.wake.notify_waiters();
        r
    }

    /// Carries out the book's notifications (in order, in one task) and counts its outcomes.
    fn carry_out(self: &Arc<Self>, half: &Arc<PrefillHalf>, actions: Vec<BookAction>) {
        let mut notes = Vec::new();
        let now = Instant::now();
        for a in actions {
            match a {
                BookAction::Notify { to, note, after_link } => notes.push((to, note, after_link)),
                BookAction::Succeeded { room, started, receivers } => {
                    let seconds = started.map(|t| now.saturating_duration_since(t).as_secs_f64());
                    for (d, generation, digest) in receivers {
                        tracing::debug!(
                            target: "kvxfer::request", trace_id = %TraceId::of(room, generation), room = %room,
                            rank = %self.cfg.rank, role = "prefill", dst = %d, seconds = seconds.unwrap_or(0.0),
                            digest, "final: succeeded"
                        );
                    }
                    if let Some(t) = seconds {
                        self.recorder.succeeded(t);
                    }
                }
                BookAction::Failed { room, started, cause, why, receivers } => {
                    for (d, generation, fenced) in receivers {
                        tracing::debug!(
                            target: "kvxfer::request", trace_id = %TraceId::of(room, generation), room = %room,
                            rank = %self.cfg.rank, role = "prefill", dst = %d, fenced, "final: failed: {why}"
                        );
                    }
                    let seconds = started.map(|t| now.saturating_duration_since(t).as_secs_f64());
                    self.recorder.failed(seconds, cause_of(cause));
                }
                BookAction::Cancel { .. } => {}
            }
        }
        if notes.is_empty() {
            return;
        }
        let (this, half) = (Arc::clone(self), Arc::clone(half));
        self.handle.spawn(async move {
            let s = &half.path;
            for (d, n, after_link) in notes {
                if after_link {
                    this.link_to(d).await;
                }
                match this.notify_rank(s, d, &n).await {
                    Ok(()) if matches!(n.body, NotificationBody::Fenced) => add(&this.stats.fences, 1),
                    Ok(()) => {}
                    // Not delivered: the decode rank fails the request at its deadline, naming
                    // this rank.
                    Err(e) => tracing::warn!(
                        rank = %this.cfg.rank, room = %n.request, dst = %d, error = %e, "could not tell decode: {n}"
                    ),
                }
            }
        });
    }

    /// The engine error of a call the book refused.
    fn call_error(&self, room: RequestId, e: CallError) -> EngineError {
        match e {
            CallError::RoomInUse => EngineError::RoomInUse { role: Side::Prefill, rank: self.cfg.rank, room },
            e => EngineError::InvalidCall { role: Side::Prefill, rank: self.cfg.rank, room, detail: e.to_string() },
        }
    }

    /// The counters now: the agent's, the book's and the tracker's.
    fn stats_now(&self) -> AgentStats {
        let mut s = self.stats.snapshot();
        match &self.half {
            Half::Decode(d) => s.tracker = lock(d).book.tracker_stats(),
            Half::Prefill(p) => {
                let b = lock(&p.state).book.stats();
                s.early_handoffs_kept += b.early_kept;
                s.early_handoffs_expired += b.early_expired;
                s.protocol_errors += b.not_fed;
                // Prefill outcomes are the book's counts (the decode side's are counted as they end).
                s.succeeded += b.succeeded;
                s.failed += b.failed;
            }
        }
        s
    }

    fn on_handoff(self: &Arc<Self>, half: &Arc<PrefillHalf>, d: RankId, room: RequestId, h: Handoff) {
        tracing::debug!(
            target: "kvxfer::request", trace_id = %TraceId::of(room, h.generation), room = %room,
            rank = %self.cfg.rank, role = "prefill", from = %d, pages = h.pages.len(), digest = h.digest,
            "handoff received"
        );
        if self.book(half, |b| b.handle_handoff(d, room, h, Instant::now())) == HandoffOutcome::NotFed {
            tracing::warn!(rank = %self.cfg.rank, from = %d, "handoff from a decode rank this rank does not feed");
        }
    }

    fn on_abort(self: &Arc<Self>, half: &Arc<PrefillHalf>, d: RankId, room: RequestId, generation: u64, reason: &str) {
        add(&self.stats.aborts_received, 1);
        tracing::debug!(
            target: "kvxfer::request", trace_id = %TraceId::of(room, generation), room = %room,
            rank = %self.cfg.rank, role = "prefill", from = %d, "abort received: {reason}"
        );
        // The book decides, under its one lock, whether the fence goes now or once the transfers in
        // flight settled (a write completing beside the abort cannot leave it unfenced).
        let outcome = self.book(half, |b| b.handle_abort(d, room, generation, reason, Instant::now()));
        tracing::debug!(
            target: "kvxfer::request", trace_id = %TraceId::of(room, generation), room = %room,
            rank = %self.cfg.rank, role = "prefill", dst = %d, ?outcome, "abort handled"
        );
    }

    /// Waits (bounded by the request timeout) until this prefill rank's own connection to decode
    /// rank `d` is up: `d` connects to this rank on its own, so its abort may arrive first, and a
    /// fence sent before would be dropped (the decode rank would stay `Aborting`).
    async fn link_to(&self, d: RankId) {
        let until = Instant::now() + self.cfg.request_timeout;
        // Until the link is up, or the peer is given up on (then the note fails at once).
        let waiting = || self.peers(|p| p.by_rank.get(&d).is_some_and(|p| p.link.is_none() && p.lost.is_none()));
        while waiting() && Instant::now() < until && self.stop.reason().is_none() && self.connect_error.get().is_none()
        {
            tokio::time::sleep(TICK).await;
        }
    }

    fn send_part(
        self: &Arc<Self>,
        half: &Arc<PrefillHalf>,
        room: RequestId,
        src_pages: &[u32],
        layers: std::ops::Range<u32>,
        whole: bool,
    ) -> Result<(), EngineError> {
        let me = SenderKey::of(self.cfg.rank);
        let connected = self.connected.load(Ordering::Acquire);
        // Reserved in the book (which refuses, changing nothing, what does not fit the request);
        // posted in the background. A layer part that finishes its chunk takes the handles of the
        // chunk's earlier parts, to send the notification after them.
        let (part, cancel, earlier) = self
            .book(half, |b| {
                let part = b.reserve_part(room, src_pages, layers.clone(), whole, connected, Instant::now())?;
                let io = b.io_mut(room).expect("reserved");
                let earlier = if !whole && part.finish { std::mem::take(&mut io.parts) } else { Vec::new() };
                Ok((part, io.cancel.clone(), earlier))
            })
            .map_err(|e| self.call_error(room, e))?;
        let Part { chunk, last, finish, targets } = part;
        for t in &targets {
            tracing::debug!(
                target: "kvxfer::request", trace_id = %TraceId::of(room, t.generation), room = %room,
                rank = %self.cfg.rank, role = "prefill", dst = %t.rank, chunk, last, finish, pages = t.dst_pages.len(),
                layers = ?layers, "posting"
            );
        }
        let span = tracing::debug_span!(target: "kvxfer::request", "kvxfer_send_part", room = %room, rank = %self.cfg.rank, chunk);
        let deadline = Instant::now() + self.cfg.request_timeout;
        let (this, half2) = (Arc::clone(self), Arc::clone(half));
        let src = src_pages.to_vec();
        let part = async move {
            let s = &half2.path;
            // Layer-wise: the notification follows every earlier part of the chunk.
            for h in earlier {
                match h.await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return Err(e),
                    Err(e) => return Err(format!("a layer part did not finish: {e}")),
                }
            }
            let sends = targets.iter().map(|t| {
                let note = Notification::chunk(room, me, chunk, last).with_generation(t.generation);
                let layers = layers.clone();
                let note = if finish { Some(note) } else { None };
                let (src, cancel) = (&src, &cancel);
                let link = this.link(t.rank);
                async move { s.send_to(room, &link?, src, &t.dst_pages, layers, note.as_ref(), deadline, cancel).await }
            });
            // Decode ranks that verify digests: hash what this part writes there, beside the sends
            // (the source bytes stay as they are until the request's status is final).
            let wanted: Vec<(RankId, Vec<u32>)> =
                targets.iter().filter(|t| t.digest).map(|t| (t.rank, t.dst_pages.clone())).collect();
            let hashing = this.hash_part(&src, wanted, layers.clone());
            let (hashed, results) = futures::future::join(hashing, join_all(sends)).await;
            let mut first = None;
            for r in results {
                match r {
                    Ok(st) => this.recorder.moved(st.bytes, st.ops),
                    Err(e) => {
                        first.get_or_insert(e.to_string());
                    }
                }
            }
            if let Some(e) = first {
                return Err(e);
            }
            hashed
        };
        let (this, half2) = (Arc::clone(self), Arc::clone(half));
        let part = tracing::Instrument::instrument(part, span);
        let handle = self.handle.spawn(async move {
            let (r, digests) = match part.await {
                Ok(d) => (Ok(()), d),
                Err(e) => (Err(e), Vec::new()),
            };
            this.book(&half2, |b| b.part_done(room, r.clone(), &digests));
            r
        });
        if !whole && !finish {
            if let Some(io) = lock(&half.state).book.io_mut(room) {
                io.parts.push(handle);
            }
        }
        Ok(())
    }

    /// The digests of what one part writes into each decode rank in `wanted` (its pages there),
    /// for `layers`: hashed in a blocking task. Nothing is hashed when nobody asked.
    async fn hash_part(
        self: &Arc<Self>,
        src: &[u32],
        wanted: Vec<(RankId, Vec<u32>)>,
        layers: std::ops::Range<u32>,
    ) -> Result<Vec<(RankId, Vec<u64>)>, String> {
        if wanted.is_empty() {
            return Ok(Vec::new());
        }
        let (topo, me, views, src) = (self.topo, self.cfg.rank, Arc::clone(&self.views), src.to_vec());
        let hashed = tokio::task::spawn_blocking(move || {
            let mut out = Vec::with_capacity(wanted.len());
            let mut bytes = 0;
            for (d, dst) in wanted {
                let pair = plan_sender(&topo, me, &src, &dst)
                    .map_err(|e| format!("digest for decode rank {d}: {e}"))?
                    .into_iter()
                    .find(|p| p.dst == d)
                    .ok_or_else(|| format!("digest: prefill rank {me} does not feed decode rank {d}"))?;
                let (acc, b) = digest_pair(&views, &pair, Side::Prefill, layers.clone())?;
                bytes += b;
                out.push((d, acc));
            }
            Ok::<_, String>((out, bytes))
        })
        .await
        .map_err(|e| format!("the digest task failed: {e}"))??;
        add(&self.stats.digest_bytes, hashed.1);
        Ok(hashed.0)
    }

    fn sender_status(&self, half: &PrefillHalf, room: RequestId) -> RequestStatus {
        let s = lock(&half.state).book.status(room, self.connected.load(Ordering::Acquire));
        RequestStatus::of(s.phase, s.reason, s.pages_reusable)
    }

    async fn wait_for(
        &self,
        room: RequestId,
        side: Side,
        deadline: Instant,
        status: impl Fn() -> RequestStatus,
        done: impl Fn(&RequestStatus) -> bool,
    ) -> Result<RequestStatus, EngineError> {
        let start = Instant::now();
        loop {
            let notified = self.wake.notified();
            let s = status();
            if done(&s) {
                return Ok(s);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(EngineError::Timeout {
                    role: side,
                    rank: self.cfg.rank,
                    room,
                    phase: s.phase,
                    after: now - start,
                });
            }
            let _ = tokio::time::timeout((deadline - now).min(TICK * 5), notified).await;
        }
    }
}

/// The metrics' cause of a failure the prefill book reports.
fn cause_of(c: FailCause) -> Cause {
    match c {
        FailCause::Aborted => Cause::Aborted,
        FailCause::AbortedByPeer => Cause::AbortedByPeer,
        FailCause::PeerLost => Cause::PeerLost,
        FailCause::Deadline => Cause::Deadline,
        FailCause::Transfer => Cause::Transfer,
        FailCause::Connect => Cause::Connect,
        FailCause::Shutdown => Cause::Shutdown,
    }
}

/// The digest of what `pair` writes for `layers`, read from this rank's pool on `side`, and the
/// bytes hashed.
fn digest_pair(
    views: &HashMap<BufferRef, MemDesc>,
    pair: &PairPlan,
    side: Side,
    layers: std::ops::Range<u32>,
) -> Result<(Vec<u64>, u64), String> {
    let mut acc = vec![0; digest::entries(pair)];
    let mut hash = |p: &digest::Piece, seed: u64| -> Result<u64, String> {
        let m = views
            .get(&p.buffer)
            .ok_or_else(|| format!("digest: no buffer for layer {} {}", p.buffer.layer, p.buffer.kind))?;
        let g = m
            .read_guard(p.offset, p.end() - p.offset)
            .map_err(|e| format!("digest: reading layer {} {} at {}: {e}", p.buffer.layer, p.buffer.kind, p.offset))?;
        Ok(digest::hash_span(g.as_slice(), p, seed))
    };
    let bytes = digest::accumulate(pair, side, layers, &mut acc, &mut hash)?;
    Ok((acc, bytes))
}

/// Decode rank `me`'s check of a done request: every sender's digest against this rank's own over
/// the bytes that landed in `pages`. Returns the verdict (the first sender whose digest differs,
/// with the first bad range) and the bytes hashed.
fn check_digests(
    topo: &Topology,
    me: RankId,
    views: &HashMap<BufferRef, MemDesc>,
    pages: &[u32],
    sent: Vec<(RankId, Option<Vec<u64>>)>,
) -> (Result<(), String>, u64) {
    let mut bytes = 0;
    let verdict = (|| {
        for (p, digest) in sent {
            let Some(digest) = digest else {
                return Err(format!("digest: prefill rank {p} sent no digest (decode rank {me})"));
            };
            // Only the destination side of the plan matters here: the source pages are stand-ins.
            let pair = plan_sender(topo, p, pages, pages)
                .map_err(|e| format!("digest: planning prefill rank {p}: {e}"))?
                .into_iter()
                .find(|x| x.dst == me)
                .ok_or_else(|| format!("digest: prefill rank {p} does not feed decode rank {me}"))?;
            let (landed, b) = digest_pair(views, &pair, Side::Decode, 0..pair.layers)?;
            bytes += b;
            match digest::compare(&pair, &digest, &landed) {
                Err(e) => return Err(format!("digest from prefill rank {p}: {e} (decode rank {me})")),
                Ok(Some(m)) => {
                    return Err(format!(
                        "digest mismatch: what prefill rank {p} wrote is not what landed on decode rank {me}; {m}"
                    ))
                }
                Ok(None) => {}
            }
        }
        Ok(())
    })();
    (verdict, bytes)
}
