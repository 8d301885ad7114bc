//! The [`KvTransferBackend`] over one libfabric RDM endpoint.
//!
//! - `post` validates everything under the endpoint lock, turns the ops into `fi_writemsg` posts
//!   (contiguous pieces coalesced, at most `iov_limit` ranges and `max_msg_size` bytes each) and
//!   queues them as a job; the caller's thread posts what the queue takes at once, the progress
//!   thread the rest. Writes carry `FI_DELIVERY_COMPLETE` where the provider grants it, so a job's
//!   completion means the bytes are in the peer's memory ([`Completion::Remote`]).
//! - A job runs in phases separated by barriers (every completion of a phase before the next is
//!   posted): the writes; then the attached notification, either a "staged" message plus the last
//!   write carrying remote CQ data (the receiver delivers when both arrived) or, without CQ data, a
//!   plain message. Notification phases of one peer go out in post order.
//! - Abort and failure stop posting the job's remaining pieces, then wait for the completions of
//!   what the provider already has (the providers of libfabric 1.17 cannot cancel writes), then make
//!   the transfer final.
//! - Closing a registration: out of the region table, wait for local jobs that hold it, revoke it at
//!   every peer that said hello (they acknowledge once their jobs writing into it are final), then
//!   `fi_close` the MR.
//! - Progress: a dedicated thread polls the completion queue; every call on the endpoint holds one
//!   mutex, which is what `FI_THREAD_DOMAIN` asks of the application.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvxfer_core::secret::{Exchange, NONCE_BYTES};
use kvxfer_core::toolkit::{self, EventQueue, Fragmenter, PeerTable, Reassembler, RegionRef, RegionTable};
use kvxfer_core::{
    AbortTransfer, BackendConfig, BackendError, BackendEvent, BoxFuture, Capabilities, CloseRegistration, Completion,
    CutOff, EndpointMetadata, KvTransferBackend, Limits, MemDesc, Notification, OptionDoc, PeerId, RegionId,
    Registration, Secret, Transfer, TransferState, TransferStatus, WriteOp,
};
use tokio::sync::oneshot;

use crate::ffi::{
    cma_permitted, env_flag, AvRemoved, Event, FiError, Hints, LocalRange, MrHandle, MrInfo, PostError, ProviderInfo,
    RdmEndpoint, RemoteIov, Waker,
};
use crate::wire::{self, Kind, Payload, RegionMeta, Staged, WIRE_VERSION};
use crate::NAME;

/// How attached notifications travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachedMode {
    /// Remote CQ data where the provider has it (cq_data_size >= 8), else a message.
    Auto,
    /// Always remote CQ data (an error at construction if the provider has none).
    CqData,
    /// Always a message sent after the writes completed.
    Message,
}

/// Every option the backend knows, with its default and what it does; any other is refused, naming
/// these. The list `kvxfer backends` prints.
pub const OPTIONS: &[OptionDoc] = &[
    OptionDoc::new(
        "provider",
        "tcp",
        "tcp (tcp;ofi_rxm), shm (same host) or any name fi_getinfo knows; unset: FI_PROVIDER, else tcp",
    ),
    OptionDoc::new("addr", "the provider's first interface", "local address (tcp), e.g. 127.0.0.1; ignored for shm"),
    OptionDoc::new(
        "timeout_ms",
        "30000",
        "deadline of each transfer, notify, connect, disconnect and a registration close (1..=86400000)",
    ),
    OptionDoc::new(
        "peer_timeout_ms",
        "5000",
        "silence after which a peer that connected here is reported lost (100..=86400000)",
    ),
    OptionDoc::new(
        "recv_buffers",
        "64",
        "receive buffers kept posted (1..=65536; larger notifications are fragmented)",
    ),
    OptionDoc::new("recv_buf_size", "65536", "bytes of each receive buffer (136..=16777216)"),
    OptionDoc::new(
        "attached",
        "auto",
        "attached notifications: cq-data, message, auto (remote CQ data where the provider has it, except tcp;ofi_rxm)",
    ),
    OptionDoc::new("wait", "fd (tcp), poll (shm)", "how the idle progress thread waits: fd (the CQ's wait fd) or poll"),
    OptionDoc::new("idle_poll_us", "200", "longest idle sleep of the progress thread in poll mode (1..=1000000)"),
];

/// Largest encoded notification (post and notify): the codec's largest payload plus its header;
/// larger is [`BackendError::Limit`] (the codec refuses larger payloads first).
pub const MAX_NOTIFICATION: usize = kvxfer_core::notify::MAX_PAYLOAD + 64;

/// Most write bytes posted and not completed at once, over all transfers of an endpoint: what an
/// abort waits for at most, and what the provider is asked to buffer.
pub const MAX_IN_FLIGHT: u64 = 16 << 20;

/// Largest single `fi_writemsg`: coalesced pieces stop here, so an abort has pieces to drop and
/// transfers to one peer interleave. 1 MiB, because that is where `tcp;ofi_rxm` over loopback is
/// fastest (2026-12-03, 1 GiB in shuffled 1 MiB blocks, two rounds: 4.2-4.3 GB/s with 8 MiB
/// posts, 5.1-5.2 with 2 MiB, 5.9-6.0 with 1 MiB, 4.7-5.2 with 512 KiB; 16 MiB blocks 3.5-3.6,
/// 5.0-5.2, 5.8-5.9 and 5.2-5.3), as a plain loopback socket is with 1 MiB sends (see
/// `benches/socket/loopback_poll.py`); shm measured the same at every size.
pub const MAX_PIECE: u64 = 1 << 20;

/// Parsed construction options (see the crate docs for the list).
#[derive(Debug, Clone)]
pub struct Options {
    /// libfabric provider name (`tcp` is expanded to `tcp;ofi_rxm`).
    pub provider: String,
    /// Local address to bind (`addr`), e.g. `127.0.0.1`.
    pub addr: Option<String>,
    /// Deadline of each transfer, `notify`, `connect`, `disconnect` and registration close.
    pub timeout: Duration,
    /// Receive buffers kept posted.
    pub recv_buffers: usize,
    /// Size of each receive buffer (the largest message a peer sends in one piece).
    pub recv_buf_size: usize,
    /// How attached notifications travel.
    pub attached: AttachedMode,
    /// Longest sleep of the idle progress thread.
    pub idle_poll: Duration,
    /// Silence after which a peer that connected to this endpoint is reported lost.
    pub peer_timeout: Duration,
    /// Let the idle progress thread block on the completion queue's wait fd (`wait=fd`) instead of
    /// polling with backoff (`wait=poll`).
    pub wait_fd: bool,
}

impl Options {
    /// How often an endpoint tells the peers it connected to that it is alive.
    pub fn heartbeat_interval(&self) -> Duration {
        (self.peer_timeout / 8).clamp(Duration::from_millis(20), Duration::from_secs(1))
    }

    /// Reads options from a config, with `KVXFER_FABRIC_<OPTION>` environment fallbacks (and
    /// `FI_PROVIDER` for the provider); unknown options are refused.
    pub fn from_config(config: &BackendConfig) -> Result<Self, BackendError> {
        let o = toolkit::Options::new(NAME, config, OPTIONS)?;
        let provider = o
            .get("provider")
            .or_else(|| std::env::var("FI_PROVIDER").ok())
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "tcp".to_owned());
        let provider = match provider.as_str() {
            "tcp" => "tcp;ofi_rxm".to_owned(),
            "verbs" => "verbs;ofi_rxm".to_owned(),
            _ => provider,
        };
        let shm = provider.starts_with("shm");
        // shm takes the node as the endpoint's name, not as an interface: one name for every endpoint
        // would collide (fi_enable: EBUSY), so an address is only used by network providers.
        let addr = o.get("addr").filter(|s| !s.is_empty() && !shm);
        let ms = Duration::from_millis;
        let timeout = ms(o.int_in("timeout_ms", 30_000u64, 1..=86_400_000)?);
        let peer_timeout = ms(o.int_in("peer_timeout_ms", 5_000u64, 100..=86_400_000)?);
        let recv_buffers = o.int_in("recv_buffers", 64usize, 1..=65_536)?;
        let min_buf = 4 * (wire::HEADER + toolkit::FRAGMENT_HEADER);
        let recv_buf_size = o.int_in("recv_buf_size", 64 * 1024usize, min_buf..=16 << 20)?;
        let attached = match o.choice("attached", "auto", &["auto", "cq-data", "message"])? {
            "cq-data" => AttachedMode::CqData,
            "message" => AttachedMode::Message,
            _ => AttachedMode::Auto,
        };
        let wait_fd = o.choice("wait", if shm { "poll" } else { "fd" }, &["fd", "poll"])? == "fd";
        let idle_poll = Duration::from_micros(o.int_in("idle_poll_us", 200u64, 1..=1_000_000)?);
        Ok(Self { provider, addr, timeout, recv_buffers, recv_buf_size, attached, idle_poll, peer_timeout, wait_fd })
    }
}

fn config_err(detail: String) -> BackendError {
    BackendError::Config { backend: NAME, detail }
}

/// What an endpoint with this provider can promise (see the README's provider table).
pub fn capabilities_for(info: &ProviderInfo, cq_data: bool, recv_buf_size: usize) -> Capabilities {
    let completion = if info.delivery_complete { Completion::Remote } else { Completion::Local };
    // An attached notification after local completions is only ordered after the bytes when it
    // rides on the last write and writes are ordered.
    let attached = completion == Completion::Remote || (cq_data && info.order_waw);
    let max_notification = MAX_NOTIFICATION.min(Fragmenter::new(recv_buf_size - wire::HEADER).max_message());
    Capabilities::new(attached, true, true, !info.provider.starts_with("shm"))
        .with_limits(Limits::new(u64::MAX, max_notification as u64, u64::MAX))
        .with_completion(completion)
}

struct Peer {
    identity: u64,
    fi_addr: u64,
    addr: Vec<u8>,
    nonce: u32,
    pid: u32,
    provider: String,
    cq_data: bool,
    frag: Arc<Fragmenter>,
    /// The peer's regions; a revoke removes one (under the endpoint lock, like every lookup).
    regions: Mutex<HashMap<u32, RegionMeta>>,
    lost: AtomicBool,
    /// The peer proved the cluster secret in the connect exchange (or there is none).
    authed: AtomicBool,
}

/// Whether process `pid` exists and is not a zombie (Linux `/proc`).
fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            !matches!(stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next()), Some('Z' | 'X'))
        }
        Err(_) => false,
    }
}

/// Why posting to an endpoint must not happen: it is in this process and was closed, or (shm, same
/// host) its process is gone. libfabric 1.17's shm provider spins forever on the lock of a dead
/// peer's queue, so a dead shm peer is never posted to.
fn unreachable(provider: &str, addr: &[u8], nonce: u32, pid: u32) -> Option<String> {
    if closed_set().as_ref().is_some_and(|c| c.contains(&(provider.to_owned(), addr.to_vec(), nonce))) {
        return Some("its endpoint (in this process) was closed".to_owned());
    }
    if provider == "shm" && pid != 0 && !process_alive(pid) {
        return Some(format!("its process {pid} is gone"));
    }
    None
}

impl Peer {
    fn gone(&self) -> Option<String> {
        unreachable(&self.provider, &self.addr, self.nonce, self.pid)
    }

    fn describe(&self, id: PeerId) -> String {
        format!("{id} (identity {:#x}, {})", self.identity, self.provider)
    }

    /// Marks the peer lost and reports it, once.
    fn lose(&self, events: &EventQueue, reason: String) {
        if !self.lost.swap(true, Ordering::AcqRel) {
            events.push(BackendEvent::PeerLost { identity: self.identity, reason });
        }
    }
}

/// One post to the provider.
enum Item {
    Write { local: Vec<LocalRange>, remote: Vec<RemoteIov>, data: Option<u64> },
    Send(Vec<u8>),
}

/// Items posted together; the next phase starts when every completion of this one arrived.
struct Phase {
    items: VecDeque<Item>,
    /// A notification phase: waits until every earlier job to the same peer posted everything, so
    /// notifications to a peer leave in post order.
    ordered: bool,
}

/// A posted transfer (or notification, or hello) in progress.
struct Job {
    peer: PeerId,
    target: Arc<Peer>,
    state: Arc<TransferState>,
    phases: VecDeque<Phase>,
    posted: usize,
    completed: usize,
    error: Option<BackendError>,
    /// No more posting (abort, failure, deadline).
    stopped: bool,
    /// Some piece was never posted.
    dropped: bool,
    deadline: Instant,
    /// The source regions, held until the job is final (a registration close waits for them).
    _refs: Vec<RegionRef>,
    /// Destination regions (a revoke from the peer waits for the jobs writing into it).
    dst: Vec<RegionId>,
    /// Write bytes posted and not completed.
    in_flight: u64,
}

impl Job {
    fn sealed(&self) -> bool {
        self.phases.iter().all(|p| p.items.is_empty())
    }

    fn stop(&mut self, error: Option<BackendError>) {
        self.stopped = true;
        if self.error.is_none() {
            self.error = error;
        }
    }
}

struct Live {
    identity: u64,
    last_seen: Instant,
    /// From its hello: where revokes go.
    fi_addr: Option<u64>,
    addr: Vec<u8>,
    pid: u32,
}

/// A revoke of ours waiting for acknowledgements.
struct RevokeWait {
    region: RegionId,
    waiting: HashSet<u32>,
    done: Option<oneshot::Sender<()>>,
}

/// A revoke from a peer, acknowledged once `jobs` are final.
struct AckDue {
    fi_addr: u64,
    dest: u32,
    seq: u64,
    jobs: Vec<u64>,
}

/// `user` value of control messages (no job waits for them).
const USER_CONTROL: u64 = 0;
const USER_SEND: u64 = 1;
/// A control message waiting for a transmit slot.
struct Control {
    to: u64,
    msg: Vec<u8>,
    since: Instant,
}

/// Why a job stopped posting for now.
#[derive(PartialEq, Eq)]
enum Stall {
    /// Nothing (all posted, or waiting at a barrier or for an earlier job).
    No,
    /// The provider refused a piece to this peer (`-FI_EAGAIN`): later jobs to it wait.
    Peer,
    /// The endpoint's in-flight window is full: no more writes this round.
    Window,
}

/// What [`State::cut_instance`] did, for the caller to wait on and answer.
struct Cutting {
    closed: usize,
    failed: usize,
    /// The transfers to the instance that were not final: answered once they are.
    states: Vec<Arc<TransferState>>,
    /// Why nothing it sent can be said not to land (`None`: confirmed).
    unconfirmed: Option<String>,
    provider: String,
}

/// Why a cut-off is not confirmed on `tcp;ofi_rxm` when this endpoint takes writes carrying remote
/// CQ data (`attached=cq-data`; `auto` chooses messages there for this reason). Closing a connection
/// on which such a write is half received makes libfabric 1.17's tcp provider report the cancelled
/// receive with no context, and `ofi_rxm` dereferences it (`rxm_handle_comp_error`): the process
/// dies of SIGSEGV inside `fi_av_remove`. Measured here: 3 of 3 cut-offs of a writer stopped in the
/// middle of a CQ-data write (`tests/cut_off.rs`, 2026-12-05); the chaos case
/// `presumed_dead_link_healed` met it in 1 run of 21. So the connection is left open and the cut-off
/// reported unconfirmed (the engine quarantines the pages) instead.
const CQ_DATA_CUT_OFF: &str =
    "tcp;ofi_rxm with attached=cq-data: the connection is not closed (libfabric 1.17 crashes \
     closing a connection on which a write carrying remote CQ data is half received), so a write accepted before the \
     cut-off may still be placed; use attached=auto or attached=message for confirmed cut-offs";

/// Whether `FI_AV_REMOVE_CLEANUP` was in the environment when this crate first opened an endpoint
/// in this process (libfabric reads it once, when it starts: with it, `fi_av_remove` makes
/// `tcp;ofi_rxm` close its connection to the removed peer).
fn av_remove_cleanup() -> bool {
    static CLEANUP: OnceLock<bool> = OnceLock::new();
    *CLEANUP.get_or_init(|| env_flag("FI_AV_REMOVE_CLEANUP"))
}

fn cut_refusal(nonce: u32) -> String {
    format!(
        "this endpoint cut off the peer endpoint with nonce {nonce:#x} (it gave up on that peer); a restarted process \
         is a new endpoint and may connect"
    )
}

/// Most control messages queued for a transmit slot before heartbeats are skipped.
const MAX_CONTROL: usize = 4096;

/// Most connections waiting for their authentication at once (more hellos are refused).
const MAX_PENDING_AUTH: usize = 256;

/// What every authentication refusal tells the operator to do.
const AUTH_FIX: &str = "configure the same cluster secret (KVXFER_SECRET) on every rank";

/// A hello whose sender has not proved the secret yet: the challenge went out, the proof is due.
struct PendingAuth {
    exchange: Exchange,
    deadline: Instant,
    fi_addr: u64,
    addr: Vec<u8>,
    pid: u32,
}

/// A `connect` of ours waiting for its answer (welcome, challenge or refusal).
struct Connecting {
    peer: Arc<Peer>,
    challenge: [u8; NONCE_BYTES],
    done: oneshot::Sender<Result<(), String>>,
    /// The remote keys the acceptor registered for us ([`Kind::Keys`]).
    keys: HashMap<u32, RegionMeta>,
    /// How many keys its welcome announced (`None`: no welcome yet).
    expected: Option<u32>,
}

/// A peer instance this endpoint cut off.
struct CutInfo {
    /// Why the cut-off is not confirmed (`None`: confirmed: nothing it sends can land).
    unconfirmed: Option<String>,
    /// Its address (to tell it once, on its first message since, that it is refused).
    addr: Vec<u8>,
    told: bool,
}

/// Everything behind the endpoint mutex. `ep` is declared first so it is closed before the rest drops.
struct State {
    ep: RdmEndpoint,
    mrs: HashMap<RegionId, (MrHandle, MrInfo)>,
    addrs: HashMap<Vec<u8>, u64>,
    jobs: BTreeMap<u64, Job>,
    next_job: u64,
    next_seq: u64,
    staged: Staged,
    reasm: Reassembler,
    scratch: Vec<Event>,
    dropped_messages: u64,
    stale_messages: u64,
    nonce: u32,
    identity: u64,
    events: Arc<EventQueue>,
    /// Peers that said hello to this endpoint (the ones that can write into its regions), by nonce.
    live: HashMap<u32, Live>,
    /// Control messages waiting for a transmit slot; sent before any further job piece.
    control: VecDeque<Control>,
    /// How long a control message may wait for a slot before it is dropped.
    control_ttl: Duration,
    revokes: HashMap<u64, RevokeWait>,
    acks_due: Vec<AckDue>,
    /// Write bytes posted and not completed (at most [`MAX_IN_FLIGHT`] beyond one piece).
    in_flight: u64,
    /// The cluster secret: every connection authenticates with it (see the crate docs).
    secret: Option<Secret>,
    /// Hellos waiting for their proof, by (sender nonce, connection id).
    pending: HashMap<(u32, u64), PendingAuth>,
    /// Our connects waiting for their answer, by connection id.
    connecting: HashMap<u64, Connecting>,
    /// Endpoint nonces refused for this endpoint's lifetime (they sent a forged notification).
    banned: HashSet<u32>,
    /// Notifications refused because their key was not the identity their sender proved.
    forged: u64,
    /// Messages dropped because their sender had not authenticated.
    unauthenticated: u64,
    /// Without a completion wait fd (shm), when this endpoint last sent a keep-hot heartbeat to
    /// each peer it has writes in flight to, by fabric address (see [`State::keep_targets_hot`]).
    hot_pings: Option<HashMap<u64, Instant>>,
    /// How long a transfer may take from its post (the `timeout_ms` option).
    transfer_timeout: Duration,
    /// Registrations of our regions for one writer instance each (by its nonce), whose keys were
    /// handed to it alone in its connect answer ([`Kind::Keys`]). Closed when the instance is cut
    /// off, says bye or goes away, and with their region.
    remote_mrs: HashMap<u32, HashMap<RegionId, (MrHandle, MrInfo)>>,
    /// What connectors announced in their hello's flags ([`wire::hello_flags`]): capabilities and
    /// receive buffer size, by nonce.
    writer_caps: HashMap<u32, (u8, usize)>,
    /// Instances cut off ([`KvTransferBackend::cut_off`]), by nonce: none of their messages is
    /// applied, none of their hellos admitted.
    cut: HashMap<u32, CutInfo>,
    /// Our peer ids of cut-off instances.
    cut_ids: HashMap<PeerId, u32>,
    /// Messages dropped because their sender was cut off.
    cut_dropped: u64,
}

/// Most writers' capabilities kept (each hello sends them; old entries of unknown senders go).
const MAX_WRITER_CAPS: usize = 65_536;

/// How often a writer without a completion wait fd pings the peers its writes are in flight to, so
/// their progress threads stay hot (less than the progress loop's hot window).
const HOT_PING: Duration = Duration::from_millis(1);

impl State {
    /// Keeps the targets of in-flight writes polling. With shm the target's progress moves the
    /// data (it copies incoming commands), yet RMA writes raise no completion there, so a target
    /// with nothing of its own to do went to sleep (backing off to `idle_poll_us`) and the writer
    /// waited for each batch of commands: 1 KiB writes moved 0.05-0.07 GB/s against 0.2-0.3 for a
    /// target that polls all the time. A heartbeat every [`HOT_PING`] to every peer with writes in
    /// flight is a completion there, which keeps its thread hot.
    fn keep_targets_hot(&mut self, now: Instant) {
        let Some(pings) = self.hot_pings.as_mut() else { return };
        if self.control.len() > MAX_CONTROL {
            return;
        }
        let mut due: Vec<(u64, u32)> = Vec::new();
        for job in self.jobs.values() {
            if job.stopped || job.posted == job.completed || job.target.lost.load(Ordering::Acquire) {
                continue;
            }
            let t = &job.target;
            if !pings.get(&t.fi_addr).is_some_and(|last| now.duration_since(*last) < HOT_PING) {
                pings.insert(t.fi_addr, now);
                due.push((t.fi_addr, t.nonce));
            }
        }
        if pings.len() > 4 * MAX_CONTROL {
            pings.retain(|_, last| now.duration_since(*last) < HOT_PING);
        }
        for (to, nonce) in due {
            let msg = wire::message(Kind::Heartbeat, self.nonce, nonce, self.identity, &[]);
            self.queue(to, msg);
        }
    }

    /// Polls the completion queue until it is empty (bounded) and dispatches what it reports.
    ///
    /// Returns the completions read, plus one when a poll that read none took long enough to have done
    /// work: a target of RMA writes sees no completions for them, yet its polls move their data (shm
    /// copies incoming commands, tcp drains sockets), and that traffic must keep the thread hot.
    fn pump(&mut self, inner: &Inner) -> usize {
        const WORKED: Duration = Duration::from_micros(20);
        let mut total = 0;
        // One clock read per pump, not per poll: only a first poll that read nothing is judged by it.
        let t = Instant::now();
        for _ in 0..16 {
            let mut out = std::mem::take(&mut self.scratch);
            let n = self.ep.poll(&mut out, 64).unwrap_or_else(|e| {
                tracing::warn!(target: "kvxfer_fabric", "{e}");
                0
            });
            for ev in out.drain(..) {
                self.dispatch(ev, inner);
            }
            self.scratch = out;
            total += n;
            if n == 0 {
                if total == 0 && t.elapsed() > WORKED {
                    total += 1;
                }
                break;
            }
        }
        total
    }

    /// One round of work: completions, control messages, posts, finished jobs, due acknowledgements.
    /// Returns what [`State::pump`] read and the clock reading the round used.
    fn advance(&mut self, inner: &Inner) -> (usize, Instant) {
        let n = self.pump(inner);
        let now = Instant::now();
        self.keep_targets_hot(now);
        self.post_jobs(now);
        self.finish_jobs(now);
        (n, now)
    }

    fn deliver(&mut self, bytes: &[u8]) {
        match Notification::decode(bytes) {
            Ok(n) => self.events.push(BackendEvent::Notification(n)),
            Err(e) => {
                self.dropped_messages += 1;
                tracing::warn!(target: "kvxfer_fabric", "dropping an undecodable notification: {e}");
            }
        }
    }

    fn malformed(&mut self, e: impl std::fmt::Display) {
        self.dropped_messages += 1;
        tracing::warn!(target: "kvxfer_fabric", "dropping a malformed message: {e}");
    }

    fn dispatch(&mut self, ev: Event, inner: &Inner) {
        match ev {
            Event::Message(bytes) => self.message(&bytes, inner),
            Event::RemoteData(token) => {
                if let Some(n) = self.staged.token(token) {
                    self.deliver(&n);
                }
            }
            Event::RecvError(e) => {
                self.dropped_messages += 1;
                tracing::warn!(target: "kvxfer_fabric", "a receive failed: {}", e.detail);
            }
            Event::Done { user, error, .. } if user >> 1 == USER_CONTROL => {
                if let Some(e) = error {
                    tracing::debug!(target: "kvxfer_fabric", "a control message failed: {}", e.detail);
                }
            }
            Event::Done { user, error, bytes } => {
                let send = user & USER_SEND != 0;
                let call = if send { "fi_send (completion)" } else { "fi_writemsg (completion)" };
                // A completion of an abandoned job (see `finish_jobs`) was taken out of the window then.
                let Some(job) = self.jobs.get_mut(&(user >> 1)) else { return };
                job.completed += 1;
                if !send {
                    job.in_flight -= bytes;
                    self.in_flight = self.in_flight.saturating_sub(bytes);
                }
                if let Some(e) = error {
                    let err = ffi_completion_error(call, &e, job.peer, job.target.identity);
                    if e.is_connection_loss() {
                        job.target.lose(&self.events, format!("{call} to {} failed: {}", job.peer, e.detail));
                    }
                    job.stop(Some(err));
                }
            }
        }
    }

    fn message(&mut self, bytes: &[u8], inner: &Inner) {
        let (h, body) = match wire::parse(bytes) {
            Ok(x) => x,
            Err(e) => return self.malformed(e),
        };
        if h.dest != self.nonce {
            // For an earlier owner of this (recycled) endpoint address.
            self.stale_messages += 1;
            return;
        }
        if self.cut.contains_key(&h.nonce) {
            return self.on_cut_message(h, body);
        }
        let now = Instant::now();
        // The connect exchange: matched by connection id, decided by the proofs in it.
        match h.kind {
            Kind::Hello => {
                if let Some(caps) = wire::split_hello_flags(h.flags) {
                    self.on_caps(h.nonce, caps);
                }
                return self.on_hello(h.nonce, h.seq, body, now, inner);
            }
            Kind::Auth => return self.on_auth(h.nonce, h.seq, body, inner),
            Kind::Challenge => return self.on_challenge(h.nonce, h.seq, body),
            Kind::Keys => return self.on_keys(h.nonce, h.seq, body),
            Kind::Welcome => return self.on_welcome(h.nonce, h.seq, body),
            Kind::Refused => return self.on_refused(h.nonce, h.seq, body, inner),
            _ => {}
        }
        // Everything else only from a peer that authenticated, under the identity it proved (with
        // a secret; without one every sender is taken at its word).
        let proved = if self.secret.is_some() {
            let Some(id) = self.proved(h.nonce, inner) else {
                self.unauthenticated += 1;
                return tracing::debug!(target: "kvxfer_fabric", "dropping a {:?} message from an endpoint that has not authenticated", h.kind);
            };
            if matches!(h.kind, Kind::Heartbeat | Kind::Bye | Kind::Gone) && h.seq != id {
                let what = format!("sent a {:?} message under identity {:#x}", h.kind, h.seq);
                return self.refuse_forged(h.nonce, id, what, inner);
            }
            Some(id)
        } else {
            None
        };
        if let Some(l) = self.live.get_mut(&h.nonce) {
            l.last_seen = now;
        }
        match h.kind {
            Kind::Hello | Kind::Auth | Kind::Challenge | Kind::Welcome | Kind::Refused | Kind::Keys => {}
            Kind::Heartbeat => {
                self.live.entry(h.nonce).or_insert(Live {
                    identity: proved.unwrap_or(h.seq),
                    last_seen: now,
                    fi_addr: None,
                    addr: Vec::new(),
                    pid: 0,
                });
            }
            Kind::Bye | Kind::Gone => {
                self.live.remove(&h.nonce);
                // It writes no more: its keys go.
                self.drop_writer_mrs(h.nonce);
                self.reasm.forget(u64::from(h.nonce));
                self.writer_gone(h.nonce);
                if h.kind == Kind::Gone {
                    self.events.push(BackendEvent::PeerLost {
                        identity: h.seq,
                        reason: format!("the peer endpoint (identity {:#x}) closed", h.seq),
                    });
                }
            }
            Kind::Revoke => {
                let Some((region, addr)) = wire::split_u32(body) else { return self.malformed("short revoke") };
                self.revoked(inner, h.nonce, h.seq, RegionId(region), addr);
            }
            Kind::RevokeAck => {
                if let Some(w) = self.revokes.get_mut(&h.seq) {
                    w.waiting.remove(&h.nonce);
                }
                self.resolve_revokes();
            }
            Kind::Notify | Kind::Staged => match self.reasm.push(u64::from(h.nonce), body, now) {
                Ok(Some(n)) if !self.bound(&n, h.nonce, proved, inner) => {}
                Ok(Some(n)) if h.kind == Kind::Notify => self.deliver(&n),
                Ok(Some(n)) => {
                    if let Some(n) = self.staged.notification(h.seq, n) {
                        self.deliver(&n);
                    }
                }
                Ok(None) => {}
                Err(e) => self.malformed(e),
            },
        }
    }

    /// With a secret: the identity the endpoint with `nonce` proved (it connected to us and
    /// authenticated, or we connected to it and it proved the secret), `None` if it did not.
    fn proved(&self, nonce: u32, inner: &Inner) -> Option<u64> {
        if self.banned.contains(&nonce) {
            return None;
        }
        if let Some(l) = self.live.get(&nonce) {
            return Some(l.identity);
        }
        inner
            .peers
            .all()
            .into_iter()
            .find(|(_, p)| p.nonce == nonce && p.authed.load(Ordering::Acquire))
            .map(|(_, p)| p.identity)
    }

    /// Whether notification `n` from `nonce` may be delivered: with a secret, its key must be the
    /// identity the sender proved; one that is not fails the sender's connection.
    fn bound(&mut self, n: &[u8], nonce: u32, proved: Option<u64>, inner: &Inner) -> bool {
        let Some(identity) = proved else { return true };
        match Notification::decode(n) {
            Ok(note) if !note.is_from(identity) => {
                let what =
                    format!("keyed a notification of {} with sender key {:#x}", note.request, note.sender.to_u64());
                self.refuse_forged(nonce, identity, what, inner);
                false
            }
            // Undecodable ones are counted where they are delivered.
            _ => true,
        }
    }

    /// A peer that proved `identity` broke the binding: nothing more of it is applied, it is told
    /// why, it is refused from now on, and `PeerLost` is reported with the identity it proved.
    fn refuse_forged(&mut self, nonce: u32, identity: u64, what: String, inner: &Inner) {
        self.forged += 1;
        let reason = format!(
            "forged notification refused: the peer proved identity {identity:#x} but {what}; its connection was closed"
        );
        tracing::warn!(target: "kvxfer_fabric", "{reason}");
        self.banned.insert(nonce);
        let forward: Vec<Arc<Peer>> =
            inner.peers.all().into_iter().filter(|(_, p)| p.nonce == nonce).map(|(_, p)| p).collect();
        let to = self.live.get(&nonce).and_then(|l| l.fi_addr).or_else(|| forward.first().map(|p| p.fi_addr));
        if let Some(a) = to {
            self.queue(a, wire::message(Kind::Refused, self.nonce, nonce, 0, &wire::refusal(&reason)));
        }
        self.live.remove(&nonce);
        self.drop_writer_mrs(nonce);
        self.reasm.forget(u64::from(nonce));
        self.pending.retain(|(n, _), _| *n != nonce);
        for p in forward {
            p.lost.store(true, Ordering::Release);
        }
        self.writer_gone(nonce);
        self.events.push(BackendEvent::PeerLost { identity, reason });
    }

    /// A peer that said hello (and, with a secret, proved it) may write into our regions from now
    /// on: it is told of revokes, including those under way.
    fn admit(&mut self, nonce: u32, identity: u64, fi_addr: Option<u64>, addr: &[u8], pid: u32, now: Instant) {
        self.live.insert(nonce, Live { identity, last_seen: now, fi_addr, addr: addr.to_vec(), pid });
        // A peer that connected with metadata taken before a close still under way: ask it too.
        if let Some(a) = fi_addr {
            let name = self.ep.name().to_vec();
            let mut asks = Vec::new();
            for (seq, w) in self.revokes.iter_mut() {
                w.waiting.insert(nonce);
                asks.push(wire::message(Kind::Revoke, self.nonce, nonce, *seq, &wire::hello(w.region.0, &name)));
            }
            for m in asks {
                self.queue(a, m);
            }
        }
    }

    fn refuse(&mut self, to: u64, dest: u32, conn: u64, reason: &str) {
        tracing::warn!(target: "kvxfer_fabric", "refusing a connection: {reason}");
        self.queue(to, wire::message(Kind::Refused, self.nonce, dest, conn, &wire::refusal(reason)));
    }

    /// A hello: admitted at once without a secret; with one, answered with a challenge.
    fn on_hello(&mut self, nonce: u32, identity: u64, body: &[u8], now: Instant, inner: &Inner) {
        let Some((pid, conn, challenge, addr)) = wire::split_greeting(body) else {
            return self.malformed("short hello");
        };
        let fi_addr = self.insert_addr(addr);
        let Some(secret) = self.secret.clone() else {
            self.admit(nonce, identity, fi_addr, addr, pid, now);
            if let Some(a) = fi_addr {
                self.answer_welcome(inner, a, nonce, conn);
            }
            return;
        };
        let Some(a) = fi_addr else { return };
        if self.banned.contains(&nonce) {
            let why = format!("this endpoint refuses identity {identity:#x} after a forged notification");
            return self.refuse(a, nonce, conn, &why);
        }
        if self.pending.len() >= MAX_PENDING_AUTH {
            let why = format!("{MAX_PENDING_AUTH} connections are already authenticating; try again");
            return self.refuse(a, nonce, conn, &why);
        }
        if self.live.get(&nonce).is_some_and(|l| l.identity != identity) {
            let why = format!("endpoint nonce {nonce:#x} is already connected under another identity");
            return self.refuse(a, nonce, conn, &why);
        }
        let acceptor_nonce = match kvxfer_core::secret::nonce() {
            Ok(n) => n,
            Err(e) => return tracing::warn!(target: "kvxfer_fabric", "no nonce for a connecting peer: {e}"),
        };
        let exchange = wire::exchange(challenge, acceptor_nonce, (identity, nonce), (self.identity, self.nonce));
        let body = wire::challenge(&acceptor_nonce, &exchange.acceptor_proof(&secret));
        self.queue(a, wire::message(Kind::Challenge, self.nonce, nonce, conn, &body));
        let deadline = now + self.control_ttl;
        self.pending.insert((nonce, conn), PendingAuth { exchange, deadline, fi_addr: a, addr: addr.to_vec(), pid });
    }

    /// The connector's proof: admitted (welcome) or refused.
    fn on_auth(&mut self, nonce: u32, conn: u64, body: &[u8], inner: &Inner) {
        let (Some(secret), Some(p)) = (self.secret.clone(), self.pending.remove(&(nonce, conn))) else {
            return tracing::debug!(target: "kvxfer_fabric", "dropping an auth message no challenge asked for");
        };
        if wire::split_auth(body).is_some_and(|proof| p.exchange.verify_connector(&secret, &proof)) {
            let identity = p.exchange.connector.0;
            self.admit(nonce, identity, Some(p.fi_addr), &p.addr, p.pid, Instant::now());
            self.answer_welcome(inner, p.fi_addr, nonce, conn);
            return;
        }
        let why = format!(
            "authentication failed: the connecting endpoint (identity {:#x}) did not prove this endpoint's cluster \
             secret; {AUTH_FIX}",
            p.exchange.connector.0
        );
        self.refuse(p.fi_addr, nonce, conn, &why);
    }

    /// Answers our connect `conn` (once).
    fn answer(&mut self, conn: u64, r: Result<(), String>) {
        if let Some(c) = self.connecting.remove(&conn) {
            let _ = c.done.send(r);
        }
    }

    /// The acceptor's challenge: verify its proof (it has our secret), then prove ours.
    fn on_challenge(&mut self, nonce: u32, conn: u64, body: &[u8]) {
        let Some(c) = self.connecting.get(&conn).filter(|c| c.peer.nonce == nonce) else {
            return tracing::debug!(target: "kvxfer_fabric", "dropping a challenge for no connect of ours");
        };
        let Some(secret) = self.secret.clone() else {
            let why =
                format!("authentication required: the peer has a cluster secret and this endpoint none; {AUTH_FIX}");
            return self.answer(conn, Err(why));
        };
        let Some((acceptor_nonce, proof)) = wire::split_challenge(body) else {
            self.malformed("short challenge");
            return self.answer(conn, Err("authentication failed: the peer's challenge is malformed".into()));
        };
        let exchange =
            wire::exchange(c.challenge, acceptor_nonce, (self.identity, self.nonce), (c.peer.identity, c.peer.nonce));
        if !exchange.verify_acceptor(&secret, &proof) {
            let why = format!(
                "authentication failed: the peer did not prove this endpoint's cluster secret (the secrets differ); \
                 {AUTH_FIX}"
            );
            return self.answer(conn, Err(why));
        }
        c.peer.authed.store(true, Ordering::Release);
        let to = c.peer.fi_addr;
        let msg = wire::message(Kind::Auth, self.nonce, nonce, conn, &exchange.connector_proof(&secret));
        self.queue(to, msg);
    }

    fn on_welcome(&mut self, nonce: u32, conn: u64, body: &[u8]) {
        let Some(c) = self.connecting.get_mut(&conn).filter(|c| c.peer.nonce == nonce) else { return };
        if self.secret.is_some() && !c.peer.authed.load(Ordering::Acquire) {
            let why = format!("authentication failed: the peer has no cluster secret and cannot prove one; {AUTH_FIX}");
            return self.answer(conn, Err(why));
        }
        let Some((total, first)) = wire::split_welcome(body) else {
            self.malformed("welcome");
            return self.answer(conn, Err("the peer's welcome is malformed".into()));
        };
        c.peer.authed.store(true, Ordering::Release);
        c.keys.extend(first.into_iter().map(|k| (k.id, k)));
        c.expected = Some(total);
        self.keys_complete(conn);
    }

    /// Remote keys for one of our connects.
    fn on_keys(&mut self, nonce: u32, conn: u64, body: &[u8]) {
        let Some(c) = self.connecting.get_mut(&conn).filter(|c| c.peer.nonce == nonce) else { return };
        let Some(keys) = wire::split_keys(body) else { return self.malformed("keys") };
        c.keys.extend(keys.into_iter().map(|k| (k.id, k)));
        self.keys_complete(conn);
    }

    /// Answers connect `conn` once its welcome and every key it announced arrived: the peer's regions
    /// are the ones it registered for us.
    fn keys_complete(&mut self, conn: u64) {
        let Some(c) = self.connecting.get_mut(&conn) else { return };
        if c.expected != Some(c.keys.len() as u32) {
            return;
        }
        *lock(&c.peer.regions) = std::mem::take(&mut c.keys);
        self.answer(conn, Ok(()));
    }

    /// What a connector announced in its hello's flags: capabilities and receive buffer size.
    fn on_caps(&mut self, nonce: u32, caps: (u8, usize)) {
        if self.writer_caps.len() < MAX_WRITER_CAPS || self.writer_caps.contains_key(&nonce) {
            self.writer_caps.insert(nonce, caps);
        }
    }

    /// Answers an admitted connection: a registration of each region for the connecting instance
    /// alone (made at its first connection, reused by later ones), and their keys in the welcome,
    /// sized to the connector's receive buffers (those that do not fit go first, in [`Kind::Keys`]
    /// messages: one message in the usual case, as before per-peer keys).
    fn answer_welcome(&mut self, inner: &Inner, to: u64, nonce: u32, conn: u64) {
        let mut entries = Vec::new();
        let State { ep, mrs, remote_mrs, .. } = self;
        let mine = remote_mrs.entry(nonce).or_default();
        for (id, len) in inner.regions.snapshot() {
            // A region being closed left the table already; one whose registration is gone is skipped.
            let Some((base, _)) = mrs.get(&id) else { continue };
            let info = match mine.get(&id) {
                Some((_, i)) => *i,
                None => match ep.reg_remote(*base) {
                    Ok((h, i)) => {
                        mine.insert(id, (h, i));
                        i
                    }
                    Err(e) => {
                        tracing::warn!(target: "kvxfer_fabric", "registering {id} for a connecting peer: {e}");
                        continue;
                    }
                },
            };
            entries.push(RegionMeta { id: id.0, len, key: info.key, base: info.base });
        }
        let min_buf = 4 * (wire::HEADER + toolkit::FRAGMENT_HEADER);
        let buf = self.writer_caps.get(&nonce).map_or(min_buf, |c| c.1.max(min_buf));
        let per = ((buf - wire::HEADER - 4) / wire::KEY_ENTRY).max(1);
        let total = entries.len() as u32;
        let (first, rest) = entries.split_at(entries.len().min(per));
        for chunk in rest.chunks(per) {
            self.queue(to, wire::message(Kind::Keys, self.nonce, nonce, conn, &wire::keys(chunk)));
        }
        self.queue(to, wire::message(Kind::Welcome, self.nonce, nonce, conn, &wire::welcome(total, first)));
    }

    /// Closes the registrations a writer instance was given (its keys are invalid from now on).
    fn drop_writer_mrs(&mut self, nonce: u32) {
        if let Some(m) = self.remote_mrs.remove(&nonce) {
            for (_, (h, _)) in m {
                self.ep.dereg(h);
            }
        }
    }

    /// A message of a cut-off instance: nothing of it is applied. A hello is refused (its connect
    /// fails at once), and the first other message since the cut-off gets one refusal, so that the
    /// instance fails its transfers instead of waiting for them.
    fn on_cut_message(&mut self, h: wire::Header, body: &[u8]) {
        self.cut_dropped += 1;
        let why = cut_refusal(h.nonce);
        match h.kind {
            Kind::Hello => {
                if let Some((_, conn, _, addr)) = wire::split_greeting(body) {
                    if let Some(a) = self.insert_addr(addr) {
                        self.refuse(a, h.nonce, conn, &why);
                    }
                }
            }
            Kind::Revoke => {
                // It closes a region of its own: we write nothing into it any more (every transfer
                // to it was stopped), which the acknowledgement says once those are final.
                let Some((region, owner_addr)) = wire::split_u32(body) else { return };
                let Some(fi_addr) = self.insert_addr(owner_addr) else { return };
                let cut_ids: HashSet<PeerId> =
                    self.cut_ids.iter().filter(|(_, n)| **n == h.nonce).map(|(id, _)| *id).collect();
                let jobs = self.jobs.iter().filter(|(_, j)| cut_ids.contains(&j.peer)).map(|(k, _)| *k).collect();
                tracing::debug!(target: "kvxfer_fabric", "acknowledging region {region} of a cut-off peer");
                self.acks_due.push(AckDue { fi_addr, dest: h.nonce, seq: h.seq, jobs });
            }
            Kind::Refused | Kind::RevokeAck => {}
            _ => {
                let Some(c) = self.cut.get_mut(&h.nonce) else { return };
                if std::mem::replace(&mut c.told, true) || c.addr.is_empty() {
                    return;
                }
                let addr = c.addr.clone();
                if let Some(a) = self.insert_addr(&addr) {
                    self.queue(a, wire::message(Kind::Refused, self.nonce, h.nonce, 0, &wire::refusal(&why)));
                }
            }
        }
    }

    /// Cuts off the instance with endpoint nonce `nonce` (see the crate README, "Cutting a peer
    /// off"): its keys are closed, connections of the provider to it closed where that is how
    /// writes already past the key check are stopped, every connection state dropped, every
    /// transfer to it stopped.
    fn cut_instance(&mut self, inner: &Inner, nonce: u32, reason: &str) -> Cutting {
        let why = format!("cut off: {reason}");
        let provider = self.ep.info().provider.clone();
        let forward: Vec<(PeerId, Arc<Peer>)> =
            inner.peers.all().into_iter().filter(|(_, p)| p.nonce == nonce).collect();
        let live = self.live.remove(&nonce);
        let keys_given = self.remote_mrs.contains_key(&nonce);
        let pid = live.as_ref().map(|l| l.pid).filter(|p| *p != 0).or_else(|| forward.first().map(|(_, p)| p.pid));
        let addr = live
            .as_ref()
            .map(|l| l.addr.clone())
            .filter(|a| !a.is_empty())
            .or_else(|| forward.first().map(|(_, p)| p.addr.clone()))
            .unwrap_or_default();
        let mut fi_addrs: HashSet<u64> = forward.iter().map(|(_, p)| p.fi_addr).collect();
        fi_addrs.extend(live.as_ref().and_then(|l| l.fi_addr));
        fi_addrs.extend(self.pending.iter().filter(|((n, _), _)| *n == nonce).map(|(_, p)| p.fi_addr));
        // Its keys: every write with them that reaches the key check from now on fails it.
        self.drop_writer_mrs(nonce);
        // Nothing more goes to it, but for acknowledgements of its revokes (it waits for them to
        // close its regions; they promise what is true from now on: we write nothing into them).
        let mut acks = Vec::new();
        self.control.retain(|c| {
            if !fi_addrs.contains(&c.to) {
                return true;
            }
            if c.msg.get(1) == Some(&(Kind::RevokeAck as u8)) {
                acks.push(c.msg.clone());
            }
            false
        });
        if let Some(h) = self.hot_pings.as_mut() {
            h.retain(|a, _| !fi_addrs.contains(a));
        }
        // Writes already past the key check.
        let unconfirmed = if keys_given {
            self.stop_accepted_writes(&provider, inner.cq_data_local, nonce, pid, &fi_addrs)
        } else {
            None
        };
        for (id, p) in &forward {
            let _ = inner.peers.remove(*id);
            self.cut_ids.insert(*id, nonce);
            p.lost.store(true, Ordering::Release);
        }
        let answers: Vec<u64> =
            self.connecting.iter().filter(|(_, c)| c.peer.nonce == nonce).map(|(k, _)| *k).collect();
        for conn in answers {
            self.answer(conn, Err(why.clone()));
        }
        self.pending.retain(|(n, _), _| *n != nonce);
        self.reasm.forget(u64::from(nonce));
        // Its revokes waiting for our transfers to it: still acknowledged once those are final
        // (to its address inserted anew where the cut-off removed it).
        if !acks.is_empty() || self.acks_due.iter().any(|a| a.dest == nonce) {
            let to = if addr.is_empty() { None } else { self.insert_addr(&addr) };
            match to {
                Some(to) => {
                    for a in self.acks_due.iter_mut().filter(|a| a.dest == nonce) {
                        a.fi_addr = to;
                    }
                    for msg in acks {
                        self.queue(to, msg);
                    }
                }
                None => self.acks_due.retain(|a| a.dest != nonce),
            }
        }
        if unconfirmed.is_none() {
            // It writes nothing any more: closing regions stop waiting for it. (Unconfirmed, they
            // keep waiting, time out, and the memory is not freed.)
            self.writer_gone(nonce);
        }
        let ids: HashSet<PeerId> = forward.iter().map(|(id, _)| *id).collect();
        let mut states = Vec::new();
        for j in self.jobs.values_mut().filter(|j| ids.contains(&j.peer)) {
            let e = BackendError::PeerLost { backend: NAME, peer: j.target.describe(j.peer), detail: why.clone() };
            j.stop(Some(e));
            states.push(j.state.clone());
        }
        let closed = forward.len() + usize::from(live.is_some());
        self.cut.insert(nonce, CutInfo { unconfirmed: unconfirmed.clone(), addr, told: false });
        Cutting { closed, failed: states.len(), states, unconfirmed, provider }
    }

    /// Stops the instance's writes that passed the key check before its keys were closed; returns
    /// why that cannot be confirmed, if it cannot.
    fn stop_accepted_writes(
        &mut self,
        provider: &str,
        cq_data: bool,
        nonce: u32,
        pid: Option<u32>,
        fi_addrs: &HashSet<u64>,
    ) -> Option<String> {
        match provider {
            "tcp;ofi_rxm" if cq_data => Some(CQ_DATA_CUT_OFF.to_owned()),
            "tcp;ofi_rxm" => {
                if !av_remove_cleanup() {
                    return Some(
                        "tcp;ofi_rxm: a write whose header passed the key check before the cut-off keeps being \
                         placed as its payload arrives, and only closing the connection stops it, which \
                         fi_av_remove does only with FI_AV_REMOVE_CLEANUP=1 in the environment when libfabric \
                         starts (it was not)"
                            .to_owned(),
                    );
                }
                let mut failed = Vec::new();
                for a in fi_addrs {
                    // The probe, if the provider may hold no connection to it (see `av_remove`): a
                    // heartbeat, harmless wherever it lands.
                    let probe = wire::message(Kind::Heartbeat, self.nonce, nonce, self.identity, &[]);
                    match self.ep.av_remove(*a, probe, USER_CONTROL) {
                        Ok(AvRemoved::Removed) => {}
                        Ok(AvRemoved::NoConnection) => tracing::info!(
                            target: "kvxfer_fabric",
                            "cut-off of instance {nonce:#x}: no connection to close at address {a} (a post to it fails at once)"
                        ),
                        Err(e) => failed.push(e.to_string()),
                    }
                    self.addrs.retain(|_, v| v != a);
                }
                (!failed.is_empty()).then(|| format!("tcp;ofi_rxm: fi_av_remove failed: {}", failed.join("; ")))
            }
            "shm" => {
                let caps = self.writer_caps.get(&nonce).map_or(0, |c| c.0);
                let mut why = Vec::new();
                if caps & wire::CAP_DELIVERY_COMPLETE == 0 {
                    why.push("its writes may take shm's fast path (CMA by the writer, no key check here)");
                }
                if caps & wire::CAP_CMA == 0 {
                    why.push("it may not use cross-memory attach towards this endpoint");
                }
                if env_flag("FI_SHM_DISABLE_CMA") || env_flag("FI_SHM_USE_DSA_SAR") {
                    why.push("FI_SHM_DISABLE_CMA or FI_SHM_USE_DSA_SAR is set here");
                }
                if !pid.is_some_and(cma_permitted) {
                    why.push("this process may not use cross-memory attach on it");
                }
                (!why.is_empty()).then(|| {
                    format!(
                        "shm: {} (a write larger than one segment could then be copied in several rounds, the \
                         later ones after its key was closed)",
                        why.join("; ")
                    )
                })
            }
            other => Some(format!(
                "provider {other}: whether a write accepted before its key was closed can still be placed is not \
                 verified for it"
            )),
        }
    }

    /// A refusal: of our connect `conn`, or (conn 0) of an established connection by a peer that
    /// authenticated (or any peer without a secret).
    fn on_refused(&mut self, nonce: u32, conn: u64, body: &[u8], inner: &Inner) {
        let Some(reason) = wire::split_refusal(body).map(str::to_owned) else {
            return self.malformed("refusal reason");
        };
        if conn != 0 {
            if self.connecting.get(&conn).is_some_and(|c| c.peer.nonce == nonce) {
                self.answer(conn, Err(format!("the peer refused the connection: {reason}")));
            }
            return;
        }
        if self.secret.is_some() && self.proved(nonce, inner).is_none() {
            return;
        }
        for (_, p) in inner.peers.all().into_iter().filter(|(_, p)| p.nonce == nonce) {
            p.lose(&self.events, format!("the peer (identity {:#x}) closed the connection: {reason}", p.identity));
        }
    }

    fn insert_addr(&mut self, addr: &[u8]) -> Option<u64> {
        if let Some(a) = self.addrs.get(addr) {
            return Some(*a);
        }
        match self.ep.av_insert(addr) {
            Ok(a) => {
                self.addrs.insert(addr.to_vec(), a);
                Some(a)
            }
            Err(e) => {
                tracing::warn!(target: "kvxfer_fabric", "cannot address a peer that said hello: {e}");
                None
            }
        }
    }

    /// A peer (`owner`) revoked its region: forget it, and acknowledge once every job that may write
    /// into it is final.
    fn revoked(&mut self, inner: &Inner, owner: u32, seq: u64, region: RegionId, owner_addr: &[u8]) {
        let mut ids = HashSet::new();
        let mut fi_addr = None;
        for (id, p) in inner.peers.all() {
            if p.nonce == owner {
                lock(&p.regions).remove(&region.0);
                ids.insert(id);
                fi_addr = Some(p.fi_addr);
            }
        }
        let Some(fi_addr) = fi_addr.or_else(|| self.insert_addr(owner_addr)) else { return };
        // Transfers into the region cannot complete any more: they stop posting and fail once what
        // they posted completed; the acknowledgement waits for that.
        let mut jobs = Vec::new();
        for (k, j) in self.jobs.iter_mut().filter(|(_, j)| ids.contains(&j.peer) && j.dst.contains(&region)) {
            j.stop(Some(BackendError::UnknownRegion { backend: NAME, region, peer: Some(j.peer) }));
            jobs.push(*k);
        }
        self.acks_due.push(AckDue { fi_addr, dest: owner, seq, jobs });
    }

    /// Sends the revoke of `region` to every peer that said hello; the receiver resolves when all
    /// acknowledged (or were lost). `None` when no peer can write.
    fn revoke(&mut self, region: RegionId) -> Option<oneshot::Receiver<()>> {
        let seq = self.next_seq;
        self.next_seq += 1;
        let body = wire::hello(region.0, self.ep.name());
        let provider = self.ep.info().provider.clone();
        let mut waiting = HashSet::new();
        for (nonce, l) in &self.live {
            let Some(a) = l.fi_addr else { continue };
            if let Some(why) = unreachable(&provider, &l.addr, *nonce, l.pid) {
                tracing::debug!(target: "kvxfer_fabric", "not revoking {region} at identity {:#x}: {why}", l.identity);
                continue;
            }
            waiting.insert(*nonce);
            let msg = wire::message(Kind::Revoke, self.nonce, *nonce, seq, &body);
            self.control.push_back(Control { to: a, msg, since: Instant::now() });
        }
        if waiting.is_empty() {
            return None;
        }
        let (tx, rx) = oneshot::channel();
        self.revokes.insert(seq, RevokeWait { region, waiting, done: Some(tx) });
        Some(rx)
    }

    /// A writer is gone (bye, gone, silent): it acknowledges nothing any more and writes nothing.
    fn writer_gone(&mut self, nonce: u32) {
        for w in self.revokes.values_mut() {
            w.waiting.remove(&nonce);
        }
        self.resolve_revokes();
    }

    fn resolve_revokes(&mut self) {
        self.revokes.retain(|_, w| {
            if w.waiting.is_empty() {
                if let Some(tx) = w.done.take() {
                    let _ = tx.send(());
                }
                false
            } else {
                true
            }
        });
    }

    /// Queues a heartbeat to every peer this endpoint connected to.
    fn heartbeats(&mut self, inner: &Inner) {
        if self.control.len() > MAX_CONTROL {
            return;
        }
        for (_, p) in inner.peers.all() {
            if !p.lost.load(Ordering::Acquire) && p.gone().is_none() {
                self.queue(p.fi_addr, wire::message(Kind::Heartbeat, self.nonce, p.nonce, self.identity, &[]));
            }
        }
    }

    /// Queues a control message (sent before any further job piece to that peer).
    fn queue(&mut self, to: u64, msg: Vec<u8>) {
        self.control.push_back(Control { to, msg, since: Instant::now() });
    }

    /// Sends queued control messages, in order per destination; returns the destinations whose
    /// messages still wait for a slot (jobs to them wait too). A message that waited longer than
    /// `control_ttl` is dropped.
    fn flush_control(&mut self, now: Instant) -> HashSet<u64> {
        let mut blocked = HashSet::new();
        if self.control.is_empty() {
            return blocked;
        }
        let mut keep = VecDeque::new();
        while let Some(c) = self.control.pop_front() {
            if blocked.contains(&c.to) {
                keep.push_back(c);
                continue;
            }
            match self.ep.send(c.to, c.msg.clone(), USER_CONTROL) {
                Err(PostError::Again) if now.duration_since(c.since) > self.control_ttl => {
                    tracing::debug!(target: "kvxfer_fabric", "dropping a control message that found no slot for {:?}", self.control_ttl);
                }
                Err(PostError::Again) => {
                    blocked.insert(c.to);
                    keep.push_back(c);
                }
                Err(PostError::Failed(e)) => tracing::debug!(target: "kvxfer_fabric", "a control message failed: {e}"),
                Ok(()) => {}
            }
        }
        self.control = keep;
        blocked
    }

    /// Posts what the jobs have ready, in job order, until the transmit queue is full.
    fn post_jobs(&mut self, now: Instant) {
        let mut blocked = self.flush_control(now);
        let mut full = false;
        let mut unsealed: HashSet<PeerId> = HashSet::new();
        let State { ep, jobs, in_flight, transfer_timeout, .. } = self;
        for (&id, job) in jobs.iter_mut() {
            if !job.stopped {
                if job.state.abort_requested() {
                    job.stop(None);
                } else if now >= job.deadline {
                    let left: usize = job.phases.iter().map(|p| p.items.len()).sum();
                    job.stop(Some(BackendError::Timeout {
                        backend: NAME,
                        what: format!(
                            "a transfer to {}: {left} pieces not posted, {} of {} posted not completed",
                            job.peer,
                            job.posted - job.completed,
                            job.posted
                        ),
                        after: *transfer_timeout,
                    }));
                }
            }
            if job.stopped {
                if !job.sealed() {
                    job.dropped = true;
                    job.phases.clear();
                }
            } else if !full && !blocked.contains(&job.target.fi_addr) {
                match post_job(ep, in_flight, id, job, unsealed.contains(&job.peer)) {
                    Stall::No => {}
                    Stall::Peer => {
                        blocked.insert(job.target.fi_addr);
                    }
                    Stall::Window => full = true,
                }
            }
            if !job.sealed() {
                unsealed.insert(job.peer);
            }
        }
    }

    /// Makes jobs final whose pieces are all posted (or dropped) and completed, and sends the
    /// revoke acknowledgements that were waiting for them.
    ///
    /// A stopped job whose posted pieces did not complete within a second deadline is abandoned
    /// with a `Timeout`: the provider lost them (libfabric 1.17's shm drops a write to a closed key
    /// without an error completion). The endpoint keeps their memory descriptors until the
    /// completions come or the endpoint is closed.
    fn finish_jobs(&mut self, now: Instant) {
        let grace = self.control_ttl;
        let done: Vec<u64> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.sealed() && (j.completed >= j.posted || now > j.deadline + grace))
            .map(|(k, _)| *k)
            .collect();
        for id in done {
            let mut j = self.jobs.remove(&id).expect("listed above");
            if j.completed < j.posted {
                tracing::warn!(target: "kvxfer_fabric", "abandoning {} writes to {} that never completed", j.posted - j.completed, j.peer);
                self.in_flight = self.in_flight.saturating_sub(j.in_flight);
                j.error = Some(BackendError::Timeout {
                    backend: NAME,
                    what: format!(
                        "{} of {} posted pieces of a transfer to {} completing",
                        j.posted - j.completed,
                        j.posted,
                        j.peer
                    ),
                    after: grace * 2,
                });
            }
            match j.error {
                Some(e) => j.state.fail(e),
                None if j.dropped => j.state.aborted(),
                None => j.state.complete(),
            };
        }
        if !self.acks_due.is_empty() {
            let jobs = &self.jobs;
            let (ready, wait): (Vec<AckDue>, Vec<AckDue>) = std::mem::take(&mut self.acks_due)
                .into_iter()
                .partition(|a| a.jobs.iter().all(|j| !jobs.contains_key(j)));
            self.acks_due = wait;
            for a in ready {
                self.queue(a.fi_addr, wire::message(Kind::RevokeAck, self.nonce, a.dest, a.seq, &[]));
            }
        }
    }

    /// Reports peers not heard from within `timeout` as lost (once).
    fn check_liveness(&mut self, timeout: Duration) {
        let now = Instant::now();
        self.pending.retain(|_, p| now < p.deadline);
        let dead: Vec<u32> =
            self.live.iter().filter(|(_, l)| now.duration_since(l.last_seen) > timeout).map(|(n, _)| *n).collect();
        for n in dead {
            if let Some(l) = self.live.remove(&n) {
                self.events.push(BackendEvent::PeerLost {
                    identity: l.identity,
                    reason: format!("no heartbeat from identity {:#x} for {timeout:?}", l.identity),
                });
            }
            self.writer_gone(n);
        }
    }

    /// Whether anything waits for progress.
    fn busy(&self) -> bool {
        !self.jobs.is_empty() || !self.control.is_empty() || !self.revokes.is_empty() || !self.acks_due.is_empty()
    }
}

/// Posts `job`'s ready pieces, until it waits or stalls.
fn post_job(ep: &mut RdmEndpoint, in_flight: &mut u64, id: u64, job: &mut Job, earlier_unsealed: bool) -> Stall {
    loop {
        let Some(phase) = job.phases.front_mut() else { return Stall::No };
        if phase.items.is_empty() {
            if job.completed < job.posted {
                return Stall::No; // barrier
            }
            job.phases.pop_front();
            if job.phases.front().is_some_and(|p| !p.items.is_empty()) {
                if let Some(why) = job.target.gone() {
                    let e = BackendError::PeerLost { backend: NAME, peer: job.target.describe(job.peer), detail: why };
                    job.stop(Some(e));
                    job.dropped = true;
                    job.phases.clear();
                    return Stall::No;
                }
            }
            continue;
        }
        if phase.ordered && earlier_unsealed {
            return Stall::No;
        }
        let dest = job.target.fi_addr;
        while let Some(item) = phase.items.pop_front() {
            let mut bytes = 0;
            let r = match &item {
                Item::Write { local, remote, data } => {
                    bytes = local.iter().map(|l| l.len).sum();
                    if *in_flight > 0 && *in_flight + bytes > MAX_IN_FLIGHT {
                        phase.items.push_front(item);
                        return Stall::Window;
                    }
                    ep.write(dest, local, remote, *data, id << 1)
                }
                Item::Send(msg) => ep.send(dest, msg.clone(), (id << 1) | USER_SEND),
            };
            match r {
                Ok(()) => {
                    job.posted += 1;
                    job.in_flight += bytes;
                    *in_flight += bytes;
                }
                Err(PostError::Again) => {
                    phase.items.push_front(item);
                    return Stall::Peer;
                }
                Err(PostError::Failed(e)) => {
                    job.stop(Some(e));
                    job.dropped = true;
                    job.phases.clear();
                    return Stall::No;
                }
            }
        }
    }
}

fn ffi_completion_error(call: &'static str, e: &FiError, peer: PeerId, identity: u64) -> BackendError {
    BackendError::Ffi {
        backend: NAME,
        call,
        code: -i64::from(e.code),
        detail: format!("{}; to {peer} (identity {identity:#x})", e.detail),
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a lock leaves plain bookkeeping behind; keep serving.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What the backend, its progress thread, registrations and transfer handles share.
struct Inner {
    state: Mutex<State>,
    events: Arc<EventQueue>,
    regions: RegionTable,
    peers: PeerTable<Peer>,
    /// One fragmenter per receive-buffer size, so message ids to one receiver never repeat.
    frags: Mutex<HashMap<usize, Arc<Fragmenter>>>,
    stop: AtomicBool,
    /// Wakes the progress thread when it blocks on the completion queue's wait fd.
    waker: Waker,
    /// Set while the progress thread is (about to be) blocked.
    sleeping: AtomicBool,
    thread: OnceLock<std::thread::Thread>,
    opts: Options,
    info: ProviderInfo,
    caps: Capabilities,
    cq_data_local: bool,
    nonce: u32,
    identity: u64,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Makes sure the progress thread looks at the endpoint soon.
    fn wake(&self) {
        if self.sleeping.load(Ordering::SeqCst) {
            self.waker.poke();
        }
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }

    fn fragmenter(&self, recv_buf: usize) -> Arc<Fragmenter> {
        lock(&self.frags).entry(recv_buf).or_insert_with(|| Arc::new(Fragmenter::new(recv_buf - wire::HEADER))).clone()
    }

    /// Adds a job, posts what the queue takes now, and wakes the progress thread for the rest.
    fn submit(
        &self,
        st: &mut State,
        peer: PeerId,
        target: Arc<Peer>,
        phases: Vec<Phase>,
        refs: Vec<RegionRef>,
        dst: Vec<RegionId>,
    ) -> Arc<TransferState> {
        let state = TransferState::new(NAME, peer);
        let id = st.next_job;
        st.next_job += 1;
        st.jobs.insert(
            id,
            Job {
                peer,
                target,
                state: state.clone(),
                phases: phases.into(),
                posted: 0,
                completed: 0,
                error: None,
                stopped: false,
                dropped: false,
                deadline: Instant::now() + self.opts.timeout,
                _refs: refs,
                dst,
                in_flight: 0,
            },
        );
        st.post_jobs(Instant::now());
        self.wake();
        state
    }

    /// Validates `ops` (every region known and every range in bounds, on both sides) and lowers them
    /// into posts: contiguous pieces that follow each other on both sides are coalesced into one
    /// range, and up to `iov_limit` ranges (within `max_msg_size`) share one `fi_writemsg`.
    #[allow(clippy::type_complexity)]
    fn plan(
        &self,
        st: &State,
        peer: PeerId,
        target: &Peer,
        ops: &[WriteOp],
    ) -> Result<(Vec<RegionRef>, Vec<RegionId>, Vec<Item>), BackendError> {
        let theirs = lock(&target.regions);
        let mut refs: Vec<RegionRef> = Vec::new();
        let mut dst = Vec::new();
        for op in ops {
            let src_len = match refs.iter().find(|r| r.id() == op.src) {
                Some(r) => r.len(),
                None => {
                    let r = self.regions.get(op.src, None)?;
                    let len = r.len();
                    refs.push(r);
                    len
                }
            };
            let d = theirs.get(&op.dst.0).ok_or(BackendError::UnknownRegion {
                backend: NAME,
                region: op.dst,
                peer: Some(peer),
            })?;
            op.check_src(NAME, None, src_len)?;
            op.check_dst(NAME, Some(peer), d.len)?;
            if !dst.contains(&op.dst) {
                dst.push(op.dst);
            }
        }
        let iov_limit = self.info.iov_limit;
        let max_msg = self.info.max_msg_size.clamp(1, MAX_PIECE);
        let mut items = Vec::new();
        let (mut local, mut remote): (Vec<LocalRange>, Vec<RemoteIov>) = (Vec::new(), Vec::new());
        let mut bytes = 0u64;
        for s in toolkit::segments(ops, max_msg) {
            let mr = st.mrs.get(&s.src).map(|m| m.0).ok_or(BackendError::UnknownRegion {
                backend: NAME,
                region: s.src,
                peer: None,
            })?;
            let meta = &theirs[&s.dst.0];
            let (addr, key) = (meta.base + s.dst_offset, meta.key);
            if let (Some(l), Some(r)) = (local.last_mut(), remote.last_mut()) {
                if l.mr == mr
                    && l.offset + l.len == s.src_offset
                    && r.key == key
                    && r.addr + r.len == addr
                    && bytes + s.len <= max_msg
                {
                    l.len += s.len;
                    r.len += s.len;
                    bytes += s.len;
                    continue;
                }
            }
            if local.len() == iov_limit || bytes + s.len > max_msg {
                items.push(Item::Write {
                    local: std::mem::take(&mut local),
                    remote: std::mem::take(&mut remote),
                    data: None,
                });
                bytes = 0;
            }
            local.push(LocalRange { mr, offset: s.src_offset, len: s.len });
            remote.push(RemoteIov { addr, len: s.len, key });
            bytes += s.len;
        }
        if !local.is_empty() {
            items.push(Item::Write { local, remote, data: None });
        }
        Ok((refs, dst, items))
    }

    fn frames(&self, target: &Peer, kind: Kind, seq: u64, body: &[u8]) -> Result<Vec<Item>, BackendError> {
        let parts = target.frag.split(body).map_err(|source| BackendError::Codec { backend: NAME, source })?;
        Ok(parts.iter().map(|f| Item::Send(wire::message(kind, self.nonce, target.nonce, seq, f))).collect())
    }

    fn encode(&self, n: &Notification, ops: usize) -> Result<Vec<u8>, BackendError> {
        let body = n.encode().map_err(|source| BackendError::Codec { backend: NAME, source })?;
        self.caps.check_post(NAME, ops, body.len())?;
        Ok(body)
    }

    /// The peer, unless it is unknown or unreachable (reported lost once).
    fn target(&self, peer: PeerId) -> Result<Arc<Peer>, BackendError> {
        let p = self.peers.get(peer)?;
        if let Some(detail) = p.gone() {
            p.lose(&self.events, detail.clone());
            return Err(BackendError::PeerLost { backend: NAME, peer: p.describe(peer), detail });
        }
        Ok(p)
    }
}

/// Addresses of endpoints of this process that were closed, per provider.
///
/// libfabric's shm provider (1.17) crashes (SIGSEGV in `fi_writemsg`) when an endpoint writes to a peer
/// endpoint of the same process that was closed, so posts to such a peer fail with `PeerLost` instead.
/// Peers in other processes are unaffected: their writes fail or run into the deadline.
static CLOSED_IN_PROCESS: Mutex<Option<HashSet<ClosedKey>>> = Mutex::new(None);

/// Provider, address and nonce of an endpoint instance.
type ClosedKey = (String, Vec<u8>, u32);

fn closed_set() -> MutexGuard<'static, Option<HashSet<ClosedKey>>> {
    lock(&CLOSED_IN_PROCESS)
}

fn progress_loop(inner: Arc<Inner>) {
    const HOT: Duration = Duration::from_millis(2);
    let min_sleep = Duration::from_micros(10);
    let idle_max = inner.opts.idle_poll;
    let beat = inner.opts.heartbeat_interval();
    let mut sleep = min_sleep;
    let mut last_active = Instant::now();
    let mut last_beat = Instant::now();
    let use_park = !inner.lock().ep.has_wait_fd();
    while !inner.stop.load(Ordering::Acquire) {
        // One clock reading per round (busy rounds are back to back, and each reading costs).
        let (n, busy, now) = {
            let mut st = inner.lock();
            let (n, now) = st.advance(&inner);
            if now.duration_since(last_beat) >= beat {
                last_beat = now;
                st.heartbeats(&inner);
                st.check_liveness(inner.opts.peer_timeout);
            }
            (n, st.busy(), now)
        };
        if n > 0 || busy {
            last_active = now;
            sleep = min_sleep;
            std::thread::yield_now();
        } else if now.duration_since(last_active) < HOT {
            std::thread::yield_now();
        } else {
            // Idle. With a wait fd, block on it (and on the wake pipe) until the provider has work, a
            // post wakes us, or the next heartbeat is due; else sleep with backoff.
            inner.sleeping.store(true, Ordering::SeqCst);
            let fd = {
                let mut st = inner.lock();
                if st.busy() {
                    None
                } else {
                    st.ep.try_wait()
                }
            };
            match fd {
                Some(fd) => inner.waker.wait(fd, beat.saturating_sub(last_beat.elapsed())),
                None if use_park => {
                    std::thread::park_timeout(sleep);
                    sleep = (sleep * 2).min(idle_max);
                }
                None => {}
            }
            inner.sleeping.store(false, Ordering::SeqCst);
        }
    }
}

/// Aborts a job: the progress thread sees `abort_requested` on its state, stops posting, and makes
/// it final once what was posted completed.
struct Aborter(Weak<Inner>);

impl AbortTransfer for Aborter {
    fn abort(&self, _state: &Arc<TransferState>) {
        if let Some(inner) = self.0.upgrade() {
            inner.wake();
        }
    }
}

/// Closes one registration (see the module docs for the steps).
struct Closer {
    inner: Weak<Inner>,
    id: RegionId,
}

async fn close_region(inner: Weak<Inner>, id: RegionId) -> Result<(), BackendError> {
    // The endpoint is gone: closing it closed (or, for shm, recycled) every registration.
    let Some(inner) = inner.upgrade() else { return Ok(()) };
    let drained = inner.regions.remove(id)?;
    let deadline = tokio::time::Instant::now() + inner.opts.timeout;
    let timeout = |what: String| BackendError::Timeout { backend: NAME, what, after: inner.opts.timeout };
    if tokio::time::timeout_at(deadline, drained.wait()).await.is_err() {
        return Err(timeout(format!("closing {id}: transfers from it still in flight")));
    }
    let rx = {
        let mut st = inner.lock();
        // Take in what already arrived first: a peer whose connect returned has had its hello
        // delivered here, but the progress thread may not have read it yet, and a peer we do not
        // know of would get no revoke.
        st.advance(&inner);
        st.revoke(id)
    };
    inner.wake();
    if let Some(rx) = rx {
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(BackendError::Closed { backend: NAME }),
            Err(_) => return Err(timeout(format!("closing {id}: peers acknowledging its revoke"))),
        }
    }
    let mut st = inner.lock();
    if let Some((mr, _)) = st.mrs.remove(&id) {
        st.ep.dereg(mr);
    }
    let per_peer: Vec<MrHandle> = st.remote_mrs.values_mut().filter_map(|m| m.remove(&id)).map(|(h, _)| h).collect();
    for h in per_peer {
        st.ep.dereg(h);
    }
    Ok(())
}

impl CloseRegistration for Closer {
    fn close(self: Box<Self>) -> BoxFuture<'static, Result<(), BackendError>> {
        Box::pin(close_region(self.inner, self.id))
    }

    fn close_detached(self: Box<Self>) {
        let (id, fut) = (self.id, close_region(self.inner, self.id));
        let report = move |r: Result<(), BackendError>| {
            if let Err(e) = r {
                tracing::warn!(target: "kvxfer_fabric", "closing dropped registration {id}: {e}");
            }
        };
        if let Ok(h) = tokio::runtime::Handle::try_current() {
            h.spawn(async move { report(fut.await) });
            return;
        }
        let spawned = std::thread::Builder::new().name("kvxfer-fabric-close".into()).spawn(move || {
            match tokio::runtime::Builder::new_current_thread().enable_time().build() {
                Ok(rt) => report(rt.block_on(fut)),
                Err(e) => tracing::warn!(target: "kvxfer_fabric", "closing dropped registration {id}: no runtime: {e}"),
            }
        });
        if let Err(e) = spawned {
            tracing::warn!(target: "kvxfer_fabric", "closing dropped registration {id}: no thread: {e}");
        }
    }
}

/// The libfabric backend endpoint.
pub struct FabricBackend {
    inner: Arc<Inner>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for FabricBackend {
    fn drop(&mut self) {
        let inner = &self.inner;
        let name = inner.lock().ep.name().to_vec();
        closed_set().get_or_insert_with(HashSet::new).insert((inner.info.provider.clone(), name, inner.nonce));
        inner.stop.store(true, Ordering::Release);
        inner.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // Tell the peers this endpoint connected to that it is going away, and give those messages a
        // moment to leave (bounded) before the endpoint closes.
        let mut st = inner.lock();
        let before = st.ep.tx_in_flight();
        for (_, p) in inner.peers.drain() {
            if !p.lost.load(Ordering::Acquire) && p.gone().is_none() {
                st.queue(p.fi_addr, wire::message(Kind::Gone, inner.nonce, p.nonce, inner.identity, &[]));
            }
        }
        let end = Instant::now() + Duration::from_millis(200);
        while (!st.control.is_empty() || st.ep.tx_in_flight() > before) && Instant::now() < end {
            st.flush_control(Instant::now());
            st.pump(inner);
            std::thread::yield_now();
        }
        for (_, j) in std::mem::take(&mut st.jobs) {
            j.state.fail(BackendError::Closed { backend: NAME });
        }
        st.revokes.clear();
    }
}

fn nonce() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos());
    h.write_u32(std::process::id());
    h.finish() as u32
}

impl FabricBackend {
    /// Opens an endpoint with the given options.
    pub fn new(config: &BackendConfig) -> Result<Self, BackendError> {
        let opts = Options::from_config(config)?;
        // Before libfabric starts (it reads the variable once).
        av_remove_cleanup();
        let hints = Hints { provider: Some(opts.provider.clone()), node: opts.addr.clone(), wait_fd: opts.wait_fd };
        let mut ep = RdmEndpoint::open(&hints)?;
        let info = ep.info().clone();
        let cq_data_local = match opts.attached {
            AttachedMode::Message => false,
            // Not on tcp;ofi_rxm: see `CQ_DATA_CUT_OFF`.
            AttachedMode::Auto => info.cq_data_size >= 8 && info.provider != "tcp;ofi_rxm",
            AttachedMode::CqData if info.cq_data_size >= 8 => true,
            AttachedMode::CqData => {
                return Err(config_err(format!(
                    "attached=cq-data, but provider {} carries {} bytes of remote CQ data (need 8)",
                    info.provider, info.cq_data_size
                )))
            }
        };
        ep.post_receives(opts.recv_buffers, opts.recv_buf_size)?;
        // A cut-off of a live peer is confirmable on tcp;ofi_rxm with FI_AV_REMOVE_CLEANUP=1 (its
        // connection is closed) and on shm without what lets a write bypass the key check here;
        // elsewhere it is refused and the engine quarantines (see `stop_accepted_writes`).
        let cut_off_live = match info.provider.as_str() {
            "tcp;ofi_rxm" => av_remove_cleanup() && !cq_data_local,
            "shm" => !(env_flag("FI_SHM_DISABLE_CMA") || env_flag("FI_SHM_USE_DSA_SAR")),
            _ => false,
        };
        let caps = capabilities_for(&info, cq_data_local, opts.recv_buf_size).with_cut_off_live(cut_off_live);
        tracing::debug!(
            target: "kvxfer_fabric",
            "opened {} ({} / {}): mr_mode {}, delivery_complete {}, order_saw {}, order_waw {}, cq_data {} bytes, rma_event {}, rx_cq_data {}, iov_limit {} -> {:?}",
            info.provider, info.fabric, info.domain, info.mr_mode, info.delivery_complete, info.order_saw,
            info.order_waw, info.cq_data_size, info.rma_event, info.rx_cq_data, info.iov_limit, caps
        );
        let nonce = nonce();
        let events = Arc::new(EventQueue::new());
        let hot_pings = (!ep.has_wait_fd()).then(HashMap::new);
        let inner = Arc::new(Inner {
            state: Mutex::new(State {
                ep,
                mrs: HashMap::new(),
                addrs: HashMap::new(),
                jobs: BTreeMap::new(),
                next_job: 1,
                next_seq: 1,
                staged: Staged::default(),
                reasm: Reassembler::new(MAX_NOTIFICATION, 4096),
                scratch: Vec::new(),
                dropped_messages: 0,
                stale_messages: 0,
                nonce,
                identity: config.identity,
                events: events.clone(),
                live: HashMap::new(),
                control: VecDeque::new(),
                control_ttl: opts.timeout,
                revokes: HashMap::new(),
                acks_due: Vec::new(),
                in_flight: 0,
                secret: config.secret.clone(),
                pending: HashMap::new(),
                connecting: HashMap::new(),
                banned: HashSet::new(),
                forged: 0,
                unauthenticated: 0,
                hot_pings,
                transfer_timeout: opts.timeout,
                remote_mrs: HashMap::new(),
                writer_caps: HashMap::new(),
                cut: HashMap::new(),
                cut_ids: HashMap::new(),
                cut_dropped: 0,
            }),
            events,
            regions: RegionTable::new(NAME, caps.limits.max_regions),
            peers: PeerTable::new(NAME),
            frags: Mutex::new(HashMap::new()),
            stop: AtomicBool::new(false),
            waker: Waker::new()?,
            sleeping: AtomicBool::new(false),
            thread: OnceLock::new(),
            opts,
            info,
            caps,
            cq_data_local,
            nonce,
            identity: config.identity,
        });
        let i2 = inner.clone();
        let thread = std::thread::Builder::new()
            .name("kvxfer-fabric-progress".into())
            .spawn(move || progress_loop(i2))
            .map_err(|e| BackendError::Io {
                backend: NAME,
                context: "spawning the progress thread".into(),
                detail: e.to_string(),
            })?;
        let _ = inner.thread.set(thread.thread().clone());
        Ok(Self { inner, thread: Some(thread) })
    }

    /// What the provider offers (name, mr_mode, completion semantics, limits).
    pub fn provider_info(&self) -> &ProviderInfo {
        &self.inner.info
    }

    /// Whether attached notifications use remote CQ data on this endpoint (towards peers that accept it).
    pub fn attached_uses_cq_data(&self) -> bool {
        self.inner.cq_data_local
    }

    /// Messages dropped because they were malformed, undecodable, or their receive failed.
    pub fn dropped_messages(&self) -> u64 {
        self.inner.lock().dropped_messages
    }

    /// Notifications refused because their key was not the identity their sender's connection
    /// proved (with a cluster secret; each one failed that connection).
    pub fn forged_notifications(&self) -> u64 {
        self.inner.lock().forged
    }

    /// Messages dropped because their sender had not authenticated (with a cluster secret).
    pub fn unauthenticated_messages(&self) -> u64 {
        self.inner.lock().unauthenticated
    }

    /// Messages addressed to an earlier owner of this endpoint's (recycled) address, dropped.
    pub fn stale_messages(&self) -> u64 {
        self.inner.lock().stale_messages
    }

    /// Messages dropped because their sender was cut off ([`KvTransferBackend::cut_off`]).
    pub fn cut_off_messages(&self) -> u64 {
        self.inner.lock().cut_dropped
    }

    /// Test hook: holds the endpoint lock for `d`, so the progress thread reads nothing from the
    /// provider meanwhile (a receiver that falls behind: the writer's socket fills and a write stays
    /// half sent). Blocks the calling thread.
    #[doc(hidden)]
    pub fn stall_progress(&self, d: Duration) {
        let _st = self.inner.lock();
        std::thread::sleep(d);
    }

    /// One try of [`KvTransferBackend::connect`] (`p`: the peer's validated payload).
    async fn connect_once(&self, peer: &EndpointMetadata, p: Payload) -> Result<PeerId, Attempt> {
        let connect_err = |detail: String| BackendError::Connect {
            backend: NAME,
            peer: format!("identity {:#x}", peer.identity),
            detail,
        };
        let challenge = kvxfer_core::secret::nonce()
            .map_err(|e| Attempt::Failed(connect_err(format!("no challenge nonce: {e}"))))?;
        let conn = u64::from_le_bytes(
            kvxfer_core::secret::nonce().map_err(|e| Attempt::Failed(connect_err(format!("no connection id: {e}"))))?
                [..8]
                .try_into()
                .expect("8 bytes"),
        )
        .max(1);
        let (done, answer) = oneshot::channel();
        let (id, target, state) = {
            let mut st = self.inner.lock();
            let fi_addr = match st.addrs.get(&p.addr) {
                Some(a) => *a,
                None => {
                    let a = st.ep.av_insert(&p.addr).map_err(|e| Attempt::Failed(connect_err(e.to_string())))?;
                    st.addrs.insert(p.addr.clone(), a);
                    a
                }
            };
            let target = Peer {
                identity: peer.identity,
                fi_addr,
                addr: p.addr,
                nonce: p.nonce,
                pid: p.pid,
                provider: p.provider,
                cq_data: p.cq_data,
                frag: self.inner.fragmenter(p.recv_buf as usize),
                // The keys come with the answer (registered for us alone); the metadata's are local.
                regions: Mutex::new(HashMap::new()),
                lost: AtomicBool::new(false),
                authed: AtomicBool::new(false),
            };
            // Known from now on (the caller learns the id only when the hello arrived).
            let id = self.inner.peers.reserve();
            self.inner.peers.insert_at(id, target);
            let target = self.inner.peers.get(id).map_err(Attempt::Failed)?;
            // Introduce ourselves (pid and address, so the peer can revoke its regions here, and a
            // fresh challenge) and wait for the hello to be delivered: an unreachable peer fails here.
            let mut caps = 0;
            if st.ep.delivery_complete_requested() {
                caps |= wire::CAP_DELIVERY_COMPLETE;
            }
            let shm = self.inner.info.provider == "shm";
            if shm && !env_flag("FI_SHM_DISABLE_CMA") && !env_flag("FI_SHM_USE_DSA_SAR") && cma_permitted(target.pid) {
                caps |= wire::CAP_CMA;
            }
            let hello = wire::message_flagged(
                Kind::Hello,
                wire::hello_flags(caps, st.ep.recv_buf_size()),
                self.inner.nonce,
                target.nonce,
                self.inner.identity,
                &wire::greeting(std::process::id(), conn, &challenge, st.ep.name()),
            );
            st.connecting.insert(
                conn,
                Connecting { peer: target.clone(), challenge, done, keys: HashMap::new(), expected: None },
            );
            let phases = vec![Phase { items: VecDeque::from([Item::Send(hello)]), ordered: true }];
            let state = self.inner.submit(&mut st, id, target.clone(), phases, Vec::new(), Vec::new());
            (id, target, state)
        };
        let fail = |detail: String| {
            let _ = self.inner.peers.remove(id);
            let mut st = self.inner.lock();
            st.connecting.remove(&conn);
            // A peer without a secret admitted us already: tell it this connection ends.
            if !self.inner.peers.all().iter().any(|(_, q)| q.fi_addr == target.fi_addr) && target.gone().is_none() {
                st.queue(
                    target.fi_addr,
                    wire::message(Kind::Bye, self.inner.nonce, target.nonce, self.inner.identity, &[]),
                );
            }
            drop(st);
            self.inner.wake();
            connect_err(detail)
        };
        if let Err(e) = self.settle(&state, id, "the hello to a new peer").await {
            // `lost` is set only by a completion that reported a connection loss.
            let closed = target.lost.load(Ordering::Acquire);
            let e = fail(format!("the first message did not arrive: {e}"));
            return Err(if closed { Attempt::LinkClosed(e) } else { Attempt::Failed(e) });
        }
        // The answer: a welcome, or (with a secret) the exchange first; bounded by the timeout.
        match tokio::time::timeout(self.inner.opts.timeout, answer).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(why))) => return Err(Attempt::Failed(fail(why))),
            Ok(Err(_)) => return Err(Attempt::Failed(fail("the endpoint closed while connecting".into()))),
            Err(_) => {
                let why = format!("no answer to the hello within {:?}", self.inner.opts.timeout);
                return Err(Attempt::Failed(fail(why)));
            }
        }
        tracing::debug!(target: "kvxfer_fabric", "connected {}", target.describe(id));
        Ok(id)
    }

    /// Waits for a job's state; the error of a job that did not finish by the deadline.
    async fn settle(&self, state: &TransferState, peer: PeerId, what: &str) -> Result<(), BackendError> {
        // The job has the same deadline and stops itself; allow its completions a moment beyond it.
        let deadline = Instant::now() + self.inner.opts.timeout + Duration::from_secs(1);
        match state.settled(deadline).await {
            TransferStatus::Done => Ok(()),
            TransferStatus::Failed(e) => Err(e),
            TransferStatus::Aborted => Err(BackendError::Aborted { backend: NAME, peer }),
            TransferStatus::InFlight => {
                Err(BackendError::Timeout { backend: NAME, what: what.to_owned(), after: self.inner.opts.timeout })
            }
        }
    }
}

/// How one connect try ended, when it failed.
enum Attempt {
    /// The hello failed on a connection the peer had closed: worth one more try.
    LinkClosed(BackendError),
    /// Anything else: final.
    Failed(BackendError),
}

impl Attempt {
    fn into_error(self) -> BackendError {
        match self {
            Attempt::LinkClosed(e) | Attempt::Failed(e) => e,
        }
    }
}

/// Builds a backend endpoint (the registry's constructor).
pub fn create_backend(config: &BackendConfig) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
    Ok(Arc::new(FabricBackend::new(config)?))
}

#[async_trait::async_trait]
impl KvTransferBackend for FabricBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.caps
    }

    async fn register(&self, id: RegionId, mem: MemDesc) -> Result<Registration, BackendError> {
        if let kvxfer_core::MemKind::Cuda { device } = mem.kind() {
            // FI_HMEM registration is not implemented: say what is needed and what to use.
            return Err(BackendError::Unsupported {
                backend: NAME,
                what: format!(
                    "registering {} (FI_HMEM_CUDA registration with fi_mr_regattr needs a libfabric built with CUDA \
                     and a provider that reports FI_HMEM (verbs;ofi_rxm, efa, cxi; provider here: {}), and is not \
                     implemented in this build; on this host: {}; use the tcp backend, which stages CUDA memory \
                     through pinned buffers, or cuda-ipc between processes of one node)",
                    mem.kind(),
                    self.inner.info.provider,
                    kvxfer_cuda::dmabuf::gpudirect_status(device)
                ),
            });
        }
        self.inner.caps.check_memory(NAME, &mem.kind())?;
        {
            let mut st = self.inner.lock();
            if st.mrs.contains_key(&id) {
                // Still closing: the id is taken until its MR is closed.
                return Err(BackendError::RegionInUse { backend: NAME, region: id });
            }
            // For our own writes only: peers get registrations of their own (see `answer_welcome`).
            let (mr, info) = st.ep.reg_local(&mem)?;
            if let Err(e) = self.inner.regions.insert(id, mem.clone()) {
                st.ep.dereg(mr);
                return Err(e);
            }
            st.mrs.insert(id, (mr, info));
        }
        Ok(Registration::new(NAME, id, &mem, Box::new(Closer { inner: Arc::downgrade(&self.inner), id })))
    }

    fn metadata(&self) -> Result<EndpointMetadata, BackendError> {
        let st = self.inner.lock();
        let regions: Vec<RegionMeta> = self
            .inner
            .regions
            .snapshot()
            .into_iter()
            .filter_map(|(id, len)| {
                st.mrs.get(&id).map(|(_, i)| RegionMeta { id: id.0, len, key: i.key, base: i.base })
            })
            .collect();
        let payload = Payload {
            wire: WIRE_VERSION,
            provider: self.inner.info.provider.clone(),
            addr: st.ep.name().to_vec(),
            recv_buf: st.ep.recv_buf_size() as u32,
            cq_data: self.inner.cq_data_local,
            nonce: self.inner.nonce,
            pid: std::process::id(),
            regions,
        };
        let payload = serde_json::to_vec(&payload).map_err(|e| BackendError::Io {
            backend: NAME,
            context: "encoding metadata".into(),
            detail: e.to_string(),
        })?;
        Ok(EndpointMetadata::new(NAME, self.inner.identity, payload))
    }

    async fn connect(&self, peer: &EndpointMetadata) -> Result<PeerId, BackendError> {
        let bad = |detail: String| BackendError::BadMetadata { backend: NAME, detail };
        peer.check(NAME)?;
        let p: Payload =
            serde_json::from_slice(&peer.payload).map_err(|e| bad(format!("payload does not parse: {e}")))?;
        if p.wire != WIRE_VERSION {
            return Err(bad(format!("wire version {}, this build speaks {WIRE_VERSION}", p.wire)));
        }
        if p.provider != self.inner.info.provider {
            return Err(bad(format!(
                "peer uses provider {:?}, this endpoint {:?}; set the same provider on both",
                p.provider, self.inner.info.provider
            )));
        }
        let min_buf = 4 * (wire::HEADER + toolkit::FRAGMENT_HEADER);
        if p.addr.is_empty() || (p.recv_buf as usize) < min_buf {
            return Err(bad(format!("empty address or receive buffers of {} bytes", p.recv_buf)));
        }
        // A hello that went out on a connection the peer had closed (it cut this instance off, or
        // closed its side of the link) can fail with a connection error before ofi_rxm has taken
        // the close in; sent again, it opens a new connection and gets the peer's real answer (a
        // welcome, or a refusal that says why).
        match self.connect_once(peer, p.clone()).await {
            Err(Attempt::LinkClosed(e)) => {
                tracing::debug!(target: "kvxfer_fabric", "the hello met a closed connection ({e}); sending it again");
                tokio::time::sleep(Duration::from_millis(50)).await;
                self.connect_once(peer, p).await.map_err(Attempt::into_error)
            }
            other => other.map_err(Attempt::into_error),
        }
    }

    fn post(&self, peer: PeerId, ops: &[WriteOp], notify: Option<&Notification>) -> Result<Transfer, BackendError> {
        let inner = &self.inner;
        let body = notify.map(|n| inner.encode(n, ops.len())).transpose()?;
        if body.is_none() {
            inner.caps.check_post(NAME, ops.len(), 0)?;
        }
        let target = inner.target(peer)?;
        let bytes: u64 = ops.iter().map(WriteOp::bytes).sum();
        let mut st = inner.lock();
        // Validated under the endpoint lock: a revoke from the peer changes its regions under it too.
        let (refs, dst, mut items) = inner.plan(&st, peer, &target, ops)?;
        let mut phases = Vec::new();
        match body {
            None if items.is_empty() => {
                return Ok(Transfer::finished(NAME, peer, TransferStatus::Done, 0));
            }
            None => phases.push(Phase { items: items.into(), ordered: false }),
            Some(body) if inner.cq_data_local && target.cq_data && !items.is_empty() => {
                let mut last = items.pop().expect("non-empty");
                let token = (u64::from(inner.nonce) << 32) | (st.next_seq & 0xffff_ffff);
                st.next_seq += 1;
                if let Item::Write { data, .. } = &mut last {
                    *data = Some(token);
                }
                let mut tail: VecDeque<Item> = inner.frames(&target, Kind::Staged, token, &body)?.into();
                tail.push_back(last);
                phases.push(Phase { items: items.into(), ordered: false });
                phases.push(Phase { items: tail, ordered: true });
            }
            Some(body) => {
                let frames = inner.frames(&target, Kind::Notify, 0, &body)?;
                phases.push(Phase { items: items.into(), ordered: false });
                phases.push(Phase { items: frames.into(), ordered: true });
            }
        }
        let state = inner.submit(&mut st, peer, target, phases, refs, dst);
        Ok(Transfer::new(state, Arc::new(Aborter(Arc::downgrade(inner))), bytes))
    }

    async fn notify(&self, peer: PeerId, notification: &Notification) -> Result<(), BackendError> {
        let body = self.inner.encode(notification, 0)?;
        let target = self.inner.target(peer)?;
        let frames = self.inner.frames(&target, Kind::Notify, 0, &body)?;
        let phases = vec![Phase { items: frames.into(), ordered: true }];
        let state = {
            let mut st = self.inner.lock();
            self.inner.submit(&mut st, peer, target, phases, Vec::new(), Vec::new())
        };
        self.settle(&state, peer, &format!("a notification to {peer}")).await
    }

    async fn recv(&self, max_wait: Duration) -> Result<Vec<BackendEvent>, BackendError> {
        Ok(self.inner.events.recv(max_wait).await)
    }

    /// See the crate README, "Cutting a peer off".
    async fn cut_off(&self, peer: PeerId, reason: &str) -> Result<CutOff, BackendError> {
        let inner = &self.inner;
        let cut = {
            let mut st = inner.lock();
            // Take in what already arrived first (its announcements, a hello under way).
            st.advance(inner);
            match inner.peers.get(peer) {
                Ok(p) => st.cut_instance(inner, p.nonce, reason),
                Err(e) => {
                    return match st.cut_ids.get(&peer).and_then(|n| st.cut.get(n)) {
                        Some(CutInfo { unconfirmed: None, .. }) => {
                            Ok(CutOff { closed: 0, failed_transfers: 0, how: "already cut off" })
                        }
                        Some(CutInfo { unconfirmed: Some(why), .. }) => Err(unconfirmed(why)),
                        None => Err(e),
                    }
                }
            }
        };
        inner.wake();
        tracing::info!(target: "kvxfer_fabric", %peer, %reason, "cut off (closed {}, failing {})", cut.closed, cut.failed);
        // Our transfers to it: final once every completion of what was posted arrived (until then
        // the provider may still read their source memory).
        let wait = inner.opts.timeout.min(Duration::from_secs(30));
        let deadline = Instant::now() + wait;
        for s in &cut.states {
            s.settled(deadline).await;
        }
        let open = cut.states.iter().filter(|s| !s.status().is_final()).count();
        if open > 0 {
            return Err(BackendError::Timeout {
                backend: NAME,
                what: format!(
                    "{open} transfer(s) to the cut-off {peer} completing (the provider may still read their source)"
                ),
                after: wait,
            });
        }
        if let Some(why) = &cut.unconfirmed {
            return Err(unconfirmed(why));
        }
        let how = if cut.provider == "tcp;ofi_rxm" {
            "per-peer keys closed, connection closed (fi_av_remove with FI_AV_REMOVE_CLEANUP), instance refused"
        } else {
            "per-peer keys closed (every later command fails the target's key check), instance refused"
        };
        Ok(CutOff { closed: cut.closed, failed_transfers: cut.failed, how })
    }

    async fn disconnect(&self, peer: PeerId) -> Result<(), BackendError> {
        let p = self.inner.peers.remove(peer)?;
        let states: Vec<Arc<TransferState>> =
            self.inner.lock().jobs.values().filter(|j| j.peer == peer).map(|j| j.state.clone()).collect();
        // Let them finish (each has its deadline, after which it stops and waits for what it posted).
        let deadline = Instant::now() + self.inner.opts.timeout + Duration::from_secs(1);
        for s in &states {
            if !s.settled(deadline).await.is_final() {
                return Err(BackendError::Timeout {
                    backend: NAME,
                    what: format!("disconnecting {}: its transfers becoming final", p.describe(peer)),
                    after: self.inner.opts.timeout,
                });
            }
        }
        let shared = self.inner.peers.all().iter().any(|(_, q)| q.fi_addr == p.fi_addr);
        if !shared && !p.lost.load(Ordering::Acquire) && p.gone().is_none() {
            let mut st = self.inner.lock();
            st.queue(p.fi_addr, wire::message(Kind::Bye, self.inner.nonce, p.nonce, self.inner.identity, &[]));
            st.flush_control(Instant::now());
        }
        self.inner.wake();
        Ok(())
    }
}

fn unconfirmed(why: &str) -> BackendError {
    BackendError::Unsupported {
        backend: NAME,
        what: format!(
            "confirming a cut-off: the peer's keys are closed and it is refused, but {why}; the memory it could \
             write must stay quarantined (see the crate README, \"Cutting a peer off\")"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every option whose documented default is a value parses, set to it, to what leaving it unset
    /// gives (`addr` and `wait` have computed defaults; `provider` falls back to `FI_PROVIDER`).
    #[test]
    fn documented_defaults_are_the_defaults() {
        let mut phrases = vec!["addr", "wait"];
        if std::env::var_os("FI_PROVIDER").is_some() {
            phrases.push("provider");
        }
        let parsed = |c: &BackendConfig| format!("{:?}", Options::from_config(c).unwrap());
        let unset = parsed(&BackendConfig::new(1));
        let mut all = BackendConfig::new(1);
        for d in OPTIONS.iter().filter(|d| !phrases.contains(&d.name)) {
            assert_eq!(parsed(&BackendConfig::new(1).with(d.name, d.default)), unset, "{}={}", d.name, d.default);
            all = all.with(d.name, d.default);
        }
        assert_eq!(parsed(&all), unset);
        let e = Options::from_config(&BackendConfig::new(1).with("bogus", "1")).unwrap_err().to_string();
        assert!(e.contains("known options: provider, addr, timeout_ms, peer_timeout_ms, recv_buffers"), "{e}");
    }
}
