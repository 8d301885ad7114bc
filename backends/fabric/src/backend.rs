//! The [`KvTransferBackend`] over one libfabric RDM endpoint.
//!
//! - Writes: `fi_writemsg` per group of at most `iov_limit` ranges (a strided op becomes iovs; a
//!   contiguous one a single range), with `FI_DELIVERY_COMPLETE` when the provider offers it.
//!   `write` returns after every write's completion.
//! - Attached notifications: the notification travels as a "staged" message, and the batch's last write
//!   carries remote CQ data (a token) with `fi_writemsg(FI_REMOTE_CQ_DATA)` (i.e. `fi_writedata`), posted
//!   after every other write of the batch completed; the receiver delivers the notification when both
//!   the message and the token's completion have arrived, so never before the data. Where the provider
//!   has no CQ data (or `attached=message`), the notification is a message sent after the writes completed.
//! - Out-of-band notifications: `fi_send` messages into receive buffers the endpoint keeps posted,
//!   fragmented to the receiver's buffer size.
//! - Progress: a dedicated thread polls the completion queue (hot while operations are in flight,
//!   backing off to `idle_poll_us` when idle); every call on the endpoint holds one mutex, which is
//!   what `FI_THREAD_DOMAIN` asks of the application.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvxfer_core::{
    BackendConfig, BackendError, BackendEvent, Capabilities, EndpointMetadata, KvTransferBackend, MemRegion,
    Notification, PeerId, RegionId, WriteOp,
};
use tokio::sync::{mpsc, oneshot};

use crate::ffi::{
    Event, FiError, Hints, LocalRange, MrHandle, MrInfo, PostError, ProviderInfo, RdmEndpoint, RemoteIov, Waker,
};
use crate::wire::{self, Kind, Payload, Reassembly, RegionMeta, WIRE_VERSION};
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

/// Parsed construction options (see the crate docs for the list).
#[derive(Debug, Clone)]
pub struct Options {
    /// libfabric provider name (`tcp` is expanded to `tcp;ofi_rxm`).
    pub provider: String,
    /// Local address to bind (`addr`), e.g. `127.0.0.1`.
    pub addr: Option<String>,
    /// Deadline of each `write` and `notify`.
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
}

fn config_err(detail: String) -> BackendError {
    BackendError::Config { backend: NAME, detail }
}

impl Options {
    /// Reads options (with their env fallbacks) from a config.
    pub fn from_config(config: &BackendConfig) -> Result<Self, BackendError> {
        let provider = config
            .options
            .get("provider")
            .cloned()
            .or_else(|| std::env::var("FI_PROVIDER").ok().filter(|s| !s.is_empty()))
            .unwrap_or_else(|| "tcp".to_owned());
        let provider = match provider.as_str() {
            "tcp" => "tcp;ofi_rxm".to_owned(),
            "verbs" => "verbs;ofi_rxm".to_owned(),
            _ => provider,
        };
        let addr = config
            .options
            .get("addr")
            .cloned()
            .or_else(|| std::env::var("KVXFER_FABRIC_ADDR").ok().filter(|s| !s.is_empty()));
        // shm takes the node as the endpoint's name, not as an interface: one name for every endpoint
        // would collide (fi_enable: EBUSY), so an address is only used by network providers.
        let addr = if provider.starts_with("shm") { None } else { addr };
        let timeout = Duration::from_millis(config.parse_or(NAME, "timeout_ms", 30_000u64)?);
        let recv_buffers: usize = config.parse_or(NAME, "recv_buffers", 64)?;
        let recv_buf_size: usize = config.parse_or(NAME, "recv_buf_size", 64 * 1024)?;
        if recv_buffers == 0 || recv_buf_size < 4 * wire::HEADER {
            return Err(config_err(format!(
                "recv_buffers={recv_buffers} recv_buf_size={recv_buf_size}: need at least 1 buffer of at least {} bytes",
                4 * wire::HEADER
            )));
        }
        let attached = match config.options.get("attached").map(String::as_str) {
            None | Some("auto") => AttachedMode::Auto,
            Some("cq-data") => AttachedMode::CqData,
            Some("message") => AttachedMode::Message,
            Some(v) => return Err(config_err(format!("attached={v}: use auto, cq-data or message"))),
        };
        let idle_poll = Duration::from_micros(config.parse_or(NAME, "idle_poll_us", 200u64)?.max(1));
        let peer_timeout = Duration::from_millis(config.parse_or(NAME, "peer_timeout_ms", 5_000u64)?.max(100));
        let wait = config.options.get("wait").cloned().or_else(|| std::env::var("KVXFER_FABRIC_WAIT").ok());
        let wait_fd = match wait.as_deref() {
            None => !provider.starts_with("shm"),
            Some("fd") => true,
            Some("poll") => false,
            Some(v) => return Err(config_err(format!("wait={v}: use fd or poll"))),
        };
        Ok(Self { provider, addr, timeout, recv_buffers, recv_buf_size, attached, idle_poll, peer_timeout, wait_fd })
    }
}

struct Region {
    mem: MemRegion,
    mr: MrHandle,
    info: MrInfo,
}

struct Peer {
    identity: u64,
    fi_addr: u64,
    addr: Vec<u8>,
    nonce: u32,
    pid: u32,
    provider: String,
    recv_buf: usize,
    cq_data: bool,
    regions: HashMap<u32, RegionMeta>,
    lost: bool,
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

impl Peer {
    /// Why posting to this peer must not happen: its endpoint in this process was closed, or (shm, same
    /// host) its process is gone. libfabric 1.17's shm provider spins forever on the lock of a dead
    /// peer's queue, so a dead shm peer is never posted to.
    fn gone(&self) -> Option<String> {
        if closed_set().as_ref().is_some_and(|c| c.contains(&self.closed_key())) {
            return Some("its endpoint (in this process) was closed".to_owned());
        }
        if self.provider == "shm" && self.pid != 0 && !process_alive(self.pid) {
            return Some(format!("its process {} is gone", self.pid));
        }
        None
    }

    fn closed_key(&self) -> ClosedKey {
        (self.provider.clone(), self.addr.clone(), self.nonce)
    }

    fn describe(&self, id: PeerId) -> String {
        format!("{id} (identity {:#x}, {})", self.identity, self.provider)
    }
}

struct Batch {
    peer: PeerId,
    identity: u64,
    posted: usize,
    completed: usize,
    sealed: bool,
    error: Option<BackendError>,
    done: Option<oneshot::Sender<Result<(), BackendError>>>,
}

impl Batch {
    fn maybe_finish(&mut self) -> bool {
        if self.sealed && self.completed >= self.posted {
            if let Some(tx) = self.done.take() {
                let _ = tx.send(self.error.take().map_or(Ok(()), Err));
            }
            true
        } else {
            false
        }
    }
}

/// Everything behind the endpoint mutex. `ep` is declared first so it is closed before the rest drops.
struct State {
    ep: RdmEndpoint,
    regions: HashMap<RegionId, Region>,
    peers: HashMap<PeerId, Peer>,
    addrs: HashMap<Vec<u8>, u64>,
    next_peer: u64,
    batches: HashMap<u64, Batch>,
    next_batch: u64,
    next_seq: u64,
    reasm: Reassembly,
    scratch: Vec<Event>,
    dropped_messages: u64,
    stale_messages: u64,
    /// This endpoint's nonce and identity (for liveness messages).
    nonce: u32,
    identity: u64,
    /// Peers that connected to this endpoint, by their nonce: identity and when last heard.
    live: HashMap<u32, Live>,
    /// Peers whose heartbeat met a full transmit queue; sent before further writes.
    heartbeat_due: HashSet<PeerId>,
}

struct Live {
    identity: u64,
    last_seen: Instant,
}

/// `user` value of liveness messages (no batch waits for them).
const USER_CONTROL: u64 = 0;

const USER_SEND: u64 = 1;

impl State {
    /// Polls the completion queue until it is empty (bounded) and dispatches what it reports.
    ///
    /// Returns the completions read, plus one when a poll that read none took long enough to have done
    /// work: a target of RMA writes sees no completions for them, yet its polls move their data (shm
    /// copies incoming commands, tcp drains sockets), and that traffic must keep the thread hot.
    fn pump(&mut self, events: &mpsc::UnboundedSender<BackendEvent>) -> usize {
        const WORKED: Duration = Duration::from_micros(20);
        self.flush_heartbeats();
        let mut total = 0;
        for _ in 0..16 {
            let mut out = std::mem::take(&mut self.scratch);
            let t = Instant::now();
            let n = match self.ep.poll(&mut out, 64) {
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!(target: "kvxfer_fabric", "{e}");
                    0
                }
            };
            for ev in out.drain(..) {
                self.dispatch(ev, events);
            }
            self.scratch = out;
            total += n;
            if n == 0 {
                if t.elapsed() > WORKED {
                    total += 1;
                }
                break;
            }
        }
        total
    }

    fn deliver(&mut self, bytes: Vec<u8>, events: &mpsc::UnboundedSender<BackendEvent>) {
        match Notification::decode(&bytes) {
            Ok(n) => {
                let _ = events.send(BackendEvent::Notification(n));
            }
            Err(e) => {
                self.dropped_messages += 1;
                tracing::warn!(target: "kvxfer_fabric", "dropping an undecodable notification: {e}");
            }
        }
    }

    fn dispatch(&mut self, ev: Event, events: &mpsc::UnboundedSender<BackendEvent>) {
        match ev {
            Event::Message(bytes) => {
                let h = match wire::parse(&bytes) {
                    Ok((h, _)) => h,
                    Err(e) => {
                        self.dropped_messages += 1;
                        tracing::warn!(target: "kvxfer_fabric", "dropping a malformed message: {e}");
                        return;
                    }
                };
                if h.dest != self.nonce {
                    // For an earlier owner of this (recycled) endpoint address.
                    self.stale_messages += 1;
                    return;
                }
                let now = Instant::now();
                match h.kind {
                    Kind::Heartbeat => {
                        self.live.entry(h.nonce).or_insert(Live { identity: h.seq, last_seen: now }).last_seen = now;
                        return;
                    }
                    Kind::Bye => {
                        self.live.remove(&h.nonce);
                        return;
                    }
                    Kind::Gone => {
                        self.live.remove(&h.nonce);
                        let _ = events.send(BackendEvent::PeerLost {
                            identity: h.seq,
                            reason: format!("the peer endpoint (identity {:#x}) closed", h.seq),
                        });
                        return;
                    }
                    Kind::Notify | Kind::Staged => {
                        if let Some(l) = self.live.get_mut(&h.nonce) {
                            l.last_seen = now;
                        }
                    }
                }
                match self.reasm.frame(&bytes) {
                    Ok(Some(n)) => self.deliver(n, events),
                    Ok(None) => {}
                    Err(e) => {
                        self.dropped_messages += 1;
                        tracing::warn!(target: "kvxfer_fabric", "dropping a malformed message: {e}");
                    }
                }
            }
            Event::RemoteData(token) => {
                if let Some(n) = self.reasm.token(token) {
                    self.deliver(n, events);
                }
            }
            Event::RecvError(e) => {
                self.dropped_messages += 1;
                tracing::warn!(target: "kvxfer_fabric", "a receive failed: {}", e.detail);
            }
            Event::Done { user: USER_CONTROL, error } => {
                if let Some(e) = error {
                    tracing::debug!(target: "kvxfer_fabric", "a liveness message failed: {}", e.detail);
                }
            }
            Event::Done { user, error } => {
                let id = user >> 1;
                let call = if user & USER_SEND != 0 { "fi_send (completion)" } else { "fi_writemsg (completion)" };
                let Some(b) = self.batches.get_mut(&id) else { return };
                b.completed += 1;
                if let Some(e) = error {
                    let (peer, identity) = (b.peer, b.identity);
                    if b.error.is_none() {
                        b.error = Some(ffi_completion_error(call, &e, peer, identity));
                    }
                    if e.is_connection_loss() {
                        if let Some(p) = self.peers.get_mut(&peer) {
                            if !p.lost {
                                p.lost = true;
                                let _ = events.send(BackendEvent::PeerLost {
                                    identity,
                                    reason: format!("{call} to {peer} failed: {}", e.detail),
                                });
                            }
                        }
                    }
                }
                let b = self.batches.get_mut(&id).expect("present above");
                if b.maybe_finish() {
                    self.batches.remove(&id);
                }
            }
        }
    }
}

impl State {
    /// Posts a liveness message to every connected peer. A heartbeat that meets a full queue stays
    /// pending and goes out before any further write to that peer (see [`Self::flush_heartbeats`]), so
    /// a sender busy filling the queue is not mistaken for a dead one.
    fn send_control(&mut self, kind: Kind) -> usize {
        let targets: Vec<(PeerId, u64, u32)> = self
            .peers
            .iter()
            .filter(|(_, p)| !p.lost && p.gone().is_none())
            .map(|(id, p)| (*id, p.fi_addr, p.nonce))
            .collect();
        let mut posted = 0;
        for (id, a, dest) in targets {
            match self.ep.send(a, wire::control(kind, self.nonce, dest, self.identity), USER_CONTROL) {
                Ok(()) => {
                    posted += 1;
                    self.heartbeat_due.remove(&id);
                }
                Err(PostError::Again) if kind == Kind::Heartbeat => {
                    self.heartbeat_due.insert(id);
                }
                Err(_) => {}
            }
        }
        posted
    }

    /// Retries heartbeats that met a full queue; `true` when none is left pending.
    fn flush_heartbeats(&mut self) -> bool {
        if self.heartbeat_due.is_empty() {
            return true;
        }
        let due: Vec<PeerId> = self.heartbeat_due.iter().copied().collect();
        for id in due {
            let Some(p) = self.peers.get(&id) else {
                self.heartbeat_due.remove(&id);
                continue;
            };
            let msg = wire::control(Kind::Heartbeat, self.nonce, p.nonce, self.identity);
            match self.ep.send(p.fi_addr, msg, USER_CONTROL) {
                Err(PostError::Again) => {}
                _ => {
                    self.heartbeat_due.remove(&id);
                }
            }
        }
        self.heartbeat_due.is_empty()
    }

    /// Reports peers not heard from within `timeout` as lost (once).
    fn check_liveness(&mut self, timeout: Duration, events: &mpsc::UnboundedSender<BackendEvent>) {
        let now = Instant::now();
        let dead: Vec<u32> =
            self.live.iter().filter(|(_, l)| now.duration_since(l.last_seen) > timeout).map(|(n, _)| *n).collect();
        for n in dead {
            if let Some(l) = self.live.remove(&n) {
                let _ = events.send(BackendEvent::PeerLost {
                    identity: l.identity,
                    reason: format!("no heartbeat from identity {:#x} for {timeout:?}", l.identity),
                });
            }
        }
    }

    /// Whether a `write` or `notify` is waiting for completions.
    fn waiting(&self) -> bool {
        self.batches.values().any(|b| b.done.is_some())
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

struct Shared {
    state: Mutex<State>,
    events: mpsc::UnboundedSender<BackendEvent>,
    stop: AtomicBool,
    /// Wakes the progress thread when it blocks on the completion queue's wait fd.
    waker: Waker,
    /// Set while the progress thread is (about to be) blocked.
    sleeping: AtomicBool,
}

impl Shared {
    /// Makes sure the progress thread looks at the endpoint soon (after a post).
    fn wake(&self, thread: &std::thread::Thread) {
        if self.sleeping.load(Ordering::SeqCst) {
            self.waker.poke();
        }
        thread.unpark();
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain bookkeeping behind; keep serving.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn progress_loop(shared: Arc<Shared>, opts: Options) {
    const HOT: Duration = Duration::from_millis(2);
    let min_sleep = Duration::from_micros(10);
    let idle_max = opts.idle_poll;
    let beat = opts.heartbeat_interval();
    let mut sleep = min_sleep;
    let mut last_active = Instant::now();
    let mut last_beat = Instant::now();
    let use_park = !shared.lock().ep.has_wait_fd();
    while !shared.stop.load(Ordering::Acquire) {
        let (n, busy) = {
            let mut st = shared.lock();
            let n = st.pump(&shared.events);
            if last_beat.elapsed() >= beat {
                last_beat = Instant::now();
                st.send_control(Kind::Heartbeat);
                st.check_liveness(opts.peer_timeout, &shared.events);
            }
            (n, st.waiting())
        };
        if n > 0 || busy {
            last_active = Instant::now();
            sleep = min_sleep;
            std::thread::yield_now();
        } else if last_active.elapsed() < HOT {
            std::thread::yield_now();
        } else {
            // Idle. With a wait fd, block on it (and on the wake pipe) until the provider has work, a
            // post wakes us, or the next heartbeat is due; else sleep with backoff.
            shared.sleeping.store(true, Ordering::SeqCst);
            let fd = {
                let mut st = shared.lock();
                if st.waiting() {
                    None
                } else {
                    st.ep.try_wait()
                }
            };
            match fd {
                Some(fd) => shared.waker.wait(fd, beat.saturating_sub(last_beat.elapsed())),
                None if use_park => {
                    std::thread::park_timeout(sleep);
                    sleep = (sleep * 2).min(idle_max);
                }
                None => {}
            }
            shared.sleeping.store(false, Ordering::SeqCst);
        }
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
    CLOSED_IN_PROCESS.lock().unwrap_or_else(|p| p.into_inner())
}

/// One item of a batch.
enum Item {
    Write { local: Vec<LocalRange>, remote: Vec<RemoteIov>, data: Option<u64> },
    Send(Vec<u8>),
}

/// The libfabric backend endpoint.
pub struct FabricBackend {
    shared: Arc<Shared>,
    events: tokio::sync::Mutex<mpsc::UnboundedReceiver<BackendEvent>>,
    thread: Option<JoinHandle<()>>,
    waker: std::thread::Thread,
    identity: u64,
    nonce: u32,
    opts: Options,
    info: ProviderInfo,
    cq_data_local: bool,
}

impl Drop for FabricBackend {
    fn drop(&mut self) {
        let name = self.shared.lock().ep.name().to_vec();
        closed_set().get_or_insert_with(HashSet::new).insert((self.info.provider.clone(), name, self.nonce));
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake(&self.waker);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // Tell the peers this endpoint connected to that it is going away, and give those messages a
        // moment to leave (bounded) before the endpoint closes.
        let mut st = self.shared.lock();
        let before = st.ep.tx_in_flight();
        if st.send_control(Kind::Gone) > 0 {
            let end = Instant::now() + Duration::from_millis(200);
            while st.ep.tx_in_flight() > before && Instant::now() < end {
                st.pump(&self.shared.events);
                std::thread::yield_now();
            }
        }
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
        let hints = Hints { provider: Some(opts.provider.clone()), node: opts.addr.clone(), wait_fd: opts.wait_fd };
        let mut ep = RdmEndpoint::open(&hints)?;
        let info = ep.info().clone();
        let cq_data_local = match opts.attached {
            AttachedMode::Message => false,
            AttachedMode::Auto => info.cq_data_size >= 8,
            AttachedMode::CqData if info.cq_data_size >= 8 => true,
            AttachedMode::CqData => {
                return Err(config_err(format!(
                    "attached=cq-data, but provider {} carries {} bytes of remote CQ data (need 8)",
                    info.provider, info.cq_data_size
                )))
            }
        };
        ep.post_receives(opts.recv_buffers, opts.recv_buf_size)?;
        tracing::debug!(
            target: "kvxfer_fabric",
            "opened {} ({} / {}): mr_mode {}, delivery_complete {}, order_saw {}, cq_data {} bytes, rma_event {}, rx_cq_data {}, iov_limit {}",
            info.provider, info.fabric, info.domain, info.mr_mode, info.delivery_complete, info.order_saw,
            info.cq_data_size, info.rma_event, info.rx_cq_data, info.iov_limit
        );
        let (tx, rx) = mpsc::unbounded_channel();
        let nonce = nonce();
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                ep,
                regions: HashMap::new(),
                peers: HashMap::new(),
                addrs: HashMap::new(),
                next_peer: 1,
                batches: HashMap::new(),
                next_batch: 1,
                next_seq: 1,
                reasm: Reassembly::default(),
                scratch: Vec::new(),
                dropped_messages: 0,
                stale_messages: 0,
                nonce,
                identity: config.identity,
                live: HashMap::new(),
                heartbeat_due: HashSet::new(),
            }),
            events: tx,
            stop: AtomicBool::new(false),
            waker: Waker::new()?,
            sleeping: AtomicBool::new(false),
        });
        let s2 = shared.clone();
        let o2 = opts.clone();
        let thread = std::thread::Builder::new()
            .name("kvxfer-fabric-progress".into())
            .spawn(move || progress_loop(s2, o2))
            .map_err(|e| BackendError::Io {
                backend: NAME,
                context: "spawning the progress thread".into(),
                detail: e.to_string(),
            })?;
        let waker = thread.thread().clone();
        Ok(Self {
            shared,
            events: tokio::sync::Mutex::new(rx),
            thread: Some(thread),
            waker,
            identity: config.identity,
            nonce,
            opts,
            info,
            cq_data_local,
        })
    }

    /// What the provider offers (name, mr_mode, completion semantics, limits).
    pub fn provider_info(&self) -> &ProviderInfo {
        &self.info
    }

    /// Whether attached notifications use remote CQ data on this endpoint (towards peers that accept it).
    pub fn attached_uses_cq_data(&self) -> bool {
        self.cq_data_local
    }

    /// Messages dropped because they were malformed, undecodable, or their receive failed.
    pub fn dropped_messages(&self) -> u64 {
        self.shared.lock().dropped_messages
    }

    /// Messages addressed to an earlier owner of this endpoint's (recycled) address, dropped.
    pub fn stale_messages(&self) -> u64 {
        self.shared.lock().stale_messages
    }

    /// Validates `ops` against local and peer regions and turns them into posts of at most `iov_limit`
    /// ranges and `max_msg_size` bytes each. Nothing is posted if any op is out of bounds.
    fn plan(&self, st: &State, peer_id: PeerId, ops: &[WriteOp]) -> Result<Vec<Item>, BackendError> {
        let peer = st.peers.get(&peer_id).ok_or(BackendError::UnknownPeer { backend: NAME, peer: peer_id })?;
        let iov_limit = self.info.iov_limit;
        let max_piece = self.info.max_msg_size.clamp(1, 1 << 30);
        let mut checked = Vec::with_capacity(ops.len());
        for op in ops {
            let src = st.regions.get(&op.src).ok_or(BackendError::UnknownRegion {
                backend: NAME,
                region: op.src,
                peer: None,
            })?;
            let dst = peer.regions.get(&op.dst.0).ok_or(BackendError::UnknownRegion {
                backend: NAME,
                region: op.dst,
                peer: Some(peer_id),
            })?;
            op.check_src(NAME, None, src.mem.len() as u64)?;
            op.check_dst(NAME, Some(peer_id), dst.len)?;
            checked.push((op, src, dst));
        }
        let mut items = Vec::new();
        let mut local = Vec::new();
        let mut remote = Vec::new();
        let mut bytes = 0u64;
        let mut flush = |local: &mut Vec<LocalRange>, remote: &mut Vec<RemoteIov>, bytes: &mut u64| {
            if !local.is_empty() {
                items.push(Item::Write { local: std::mem::take(local), remote: std::mem::take(remote), data: None });
            }
            *bytes = 0;
        };
        for (op, src, dst) in checked {
            let contiguous = op.count == 1 || (op.src_stride == op.len && op.dst_stride == op.len);
            let ranges: Box<dyn Iterator<Item = (u64, u64, u64)>> = if contiguous {
                Box::new(std::iter::once((op.src_offset, op.dst_offset, op.bytes())))
            } else {
                Box::new(op.ranges())
            };
            for (s, d, len) in ranges {
                let mut done = 0;
                while done < len {
                    let piece = (len - done).min(max_piece);
                    if local.len() == iov_limit || bytes + piece > self.info.max_msg_size {
                        flush(&mut local, &mut remote, &mut bytes);
                    }
                    local.push(LocalRange { mr: src.mr, offset: s + done, len: piece });
                    remote.push(RemoteIov { addr: dst.base + d + done, len: piece, key: dst.key });
                    bytes += piece;
                    done += piece;
                }
            }
        }
        flush(&mut local, &mut remote, &mut bytes);
        Ok(items)
    }

    /// Posts `items` to a peer as one batch and waits (until `deadline`) for all their completions.
    async fn run_batch(&self, peer: PeerId, items: Vec<Item>, deadline: Instant) -> Result<(), BackendError> {
        if items.is_empty() {
            return Ok(());
        }
        let count = items.len();
        let (tx, rx) = oneshot::channel();
        let (id, fi_addr, identity) = {
            let mut st = self.shared.lock();
            let p = st.peers.get_mut(&peer).ok_or(BackendError::UnknownPeer { backend: NAME, peer })?;
            let (fi_addr, identity) = (p.fi_addr, p.identity);
            if let Some(detail) = p.gone() {
                if !p.lost {
                    p.lost = true;
                    let _ = self.shared.events.send(BackendEvent::PeerLost { identity, reason: detail.clone() });
                }
                return Err(BackendError::PeerLost { backend: NAME, peer: p.describe(peer), detail });
            }
            let id = st.next_batch;
            st.next_batch += 1;
            st.batches.insert(
                id,
                Batch { peer, identity, posted: 0, completed: 0, sealed: false, error: None, done: Some(tx) },
            );
            (id, fi_addr, identity)
        };
        let mut failure = None;
        'items: for item in items {
            let mut item = Some(item);
            loop {
                let r = {
                    let mut st = self.shared.lock();
                    // A heartbeat waiting for a queue slot goes first.
                    let heartbeat_waits = !st.flush_heartbeats();
                    let r = match item.as_ref().expect("item present until posted") {
                        _ if heartbeat_waits => Err(PostError::Again),
                        Item::Write { local, remote, data } => st.ep.write(fi_addr, local, remote, *data, id << 1),
                        Item::Send(_) => match item.take() {
                            Some(Item::Send(msg)) => {
                                let keep = msg.clone();
                                let r = st.ep.send(fi_addr, msg, (id << 1) | USER_SEND);
                                if matches!(r, Err(PostError::Again)) {
                                    item = Some(Item::Send(keep));
                                }
                                r
                            }
                            _ => unreachable!("matched Send above"),
                        },
                    };
                    match &r {
                        Ok(()) => {
                            if let Some(b) = st.batches.get_mut(&id) {
                                b.posted += 1;
                            }
                        }
                        Err(PostError::Again) => {
                            st.pump(&self.shared.events);
                        }
                        Err(PostError::Failed(_)) => {}
                    }
                    r
                };
                match r {
                    Ok(()) => {
                        self.shared.wake(&self.waker);
                        continue 'items;
                    }
                    Err(PostError::Failed(e)) => {
                        failure = Some(e);
                        break 'items;
                    }
                    Err(PostError::Again) => {
                        if Instant::now() >= deadline {
                            failure = Some(BackendError::Timeout {
                                backend: NAME,
                                what: format!("posting to {peer} (identity {identity:#x}): the transmit queue stayed full (peer unreachable or gone?)"),
                                after: self.opts.timeout,
                            });
                            break 'items;
                        }
                        self.shared.wake(&self.waker);
                        tokio::task::yield_now().await;
                    }
                }
            }
        }
        {
            let mut st = self.shared.lock();
            if let Some(b) = st.batches.get_mut(&id) {
                b.sealed = true;
                if let Some(e) = failure.take() {
                    // Posted operations still complete; the batch drains without a waiter.
                    b.done = None;
                    if b.maybe_finish() {
                        st.batches.remove(&id);
                    }
                    return Err(e);
                }
                if b.maybe_finish() {
                    st.batches.remove(&id);
                }
            }
        }
        let wait = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(wait, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(BackendError::Closed { backend: NAME }),
            Err(_) => {
                let mut st = self.shared.lock();
                let (posted, completed) = st
                    .batches
                    .get_mut(&id)
                    .map(|b| {
                        b.done = None;
                        (b.posted, b.completed)
                    })
                    .unwrap_or((count, count));
                Err(BackendError::Timeout {
                    backend: NAME,
                    what: format!(
                        "{} of {posted} operations to {peer} (identity {identity:#x}) completing",
                        posted.saturating_sub(completed)
                    ),
                    after: self.opts.timeout,
                })
            }
        }
    }

    fn next_seq(&self) -> u64 {
        let mut st = self.shared.lock();
        let s = st.next_seq;
        st.next_seq += 1;
        s
    }

    fn peer_limits(&self, peer: PeerId) -> Result<(usize, bool, u32), BackendError> {
        let st = self.shared.lock();
        let p = st.peers.get(&peer).ok_or(BackendError::UnknownPeer { backend: NAME, peer })?;
        Ok((p.recv_buf, p.cq_data, p.nonce))
    }

    fn encode(n: &Notification) -> Result<Vec<u8>, BackendError> {
        n.encode().map_err(|source| BackendError::Codec { backend: NAME, source })
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
        Capabilities { attached: true, out_of_band: true, cross_process: true, cross_host: self.info.provider != "shm" }
    }

    fn register(&self, id: RegionId, mem: MemRegion) -> Result<(), BackendError> {
        let mut st = self.shared.lock();
        if st.regions.contains_key(&id) {
            return Err(BackendError::RegionInUse { backend: NAME, region: id });
        }
        let (mr, info) = st.ep.reg(&mem)?;
        st.regions.insert(id, Region { mem, mr, info });
        Ok(())
    }

    fn deregister(&self, id: RegionId) -> Result<(), BackendError> {
        let mut st = self.shared.lock();
        let r = st.regions.remove(&id).ok_or(BackendError::UnknownRegion { backend: NAME, region: id, peer: None })?;
        st.ep.dereg(r.mr);
        Ok(())
    }

    fn metadata(&self) -> Result<EndpointMetadata, BackendError> {
        let st = self.shared.lock();
        let mut regions: Vec<RegionMeta> = st
            .regions
            .iter()
            .map(|(id, r)| RegionMeta { id: id.0, len: r.mem.len() as u64, key: r.info.key, base: r.info.base })
            .collect();
        regions.sort_by_key(|r| r.id);
        let payload = Payload {
            wire: WIRE_VERSION,
            provider: self.info.provider.clone(),
            addr: st.ep.name().to_vec(),
            virt_addr: self.info.mr_mode.virt_addr,
            recv_buf: st.ep.recv_buf_size() as u32,
            cq_data: self.cq_data_local,
            nonce: self.nonce,
            pid: std::process::id(),
            regions,
        };
        let payload = serde_json::to_vec(&payload).map_err(|e| BackendError::Io {
            backend: NAME,
            context: "encoding metadata".into(),
            detail: e.to_string(),
        })?;
        Ok(EndpointMetadata::new(NAME, self.identity, payload))
    }

    async fn connect(&self, peer: &EndpointMetadata) -> Result<PeerId, BackendError> {
        let bad = |detail: String| BackendError::BadMetadata { backend: NAME, detail };
        peer.check(NAME)?;
        let p: Payload =
            serde_json::from_slice(&peer.payload).map_err(|e| bad(format!("payload does not parse: {e}")))?;
        if p.wire != WIRE_VERSION {
            return Err(bad(format!("wire version {}, this build speaks {WIRE_VERSION}", p.wire)));
        }
        if p.provider != self.info.provider {
            return Err(bad(format!(
                "peer uses provider {:?}, this endpoint {:?}; set the same provider on both",
                p.provider, self.info.provider
            )));
        }
        if p.addr.is_empty() || (p.recv_buf as usize) < 4 * wire::HEADER {
            return Err(bad(format!("empty address or receive buffers of {} bytes", p.recv_buf)));
        }
        let (id, hello) = {
            let mut st = self.shared.lock();
            let fi_addr = match st.addrs.get(&p.addr) {
                Some(a) => *a,
                None => {
                    let a = st.ep.av_insert(&p.addr).map_err(|e| BackendError::Connect {
                        backend: NAME,
                        peer: format!("identity {:#x}", peer.identity),
                        detail: e.to_string(),
                    })?;
                    st.addrs.insert(p.addr.clone(), a);
                    a
                }
            };
            let id = PeerId(st.next_peer);
            st.next_peer += 1;
            st.peers.insert(
                id,
                Peer {
                    identity: peer.identity,
                    fi_addr,
                    addr: p.addr,
                    nonce: p.nonce,
                    pid: p.pid,
                    provider: p.provider,
                    recv_buf: p.recv_buf as usize,
                    cq_data: p.cq_data,
                    regions: p.regions.into_iter().map(|r| (r.id, r)).collect(),
                    lost: false,
                },
            );
            tracing::debug!(target: "kvxfer_fabric", "connected {}", st.peers[&id].describe(id));
            let hello = wire::control(Kind::Heartbeat, self.nonce, st.peers[&id].nonce, self.identity);
            (id, hello)
        };
        // Introduce ourselves (the first heartbeat) and wait for it to be delivered: the peer then
        // knows us and reports us lost if we go away, and an unreachable peer fails here.
        let deadline = Instant::now() + self.opts.timeout;
        if let Err(e) = self.run_batch(id, vec![Item::Send(hello)], deadline).await {
            self.shared.lock().peers.remove(&id);
            return Err(BackendError::Connect {
                backend: NAME,
                peer: format!("identity {:#x}", peer.identity),
                detail: format!("the first message did not arrive: {e}"),
            });
        }
        Ok(id)
    }

    async fn write(&self, peer: PeerId, ops: &[WriteOp], notify: Option<&Notification>) -> Result<(), BackendError> {
        let deadline = Instant::now() + self.opts.timeout;
        let mut items = {
            let st = self.shared.lock();
            self.plan(&st, peer, ops)?
        };
        let Some(n) = notify else {
            return self.run_batch(peer, items, deadline).await;
        };
        let body = Self::encode(n)?;
        let (recv_buf, peer_cq_data, dest) = self.peer_limits(peer)?;
        if self.cq_data_local && peer_cq_data && !items.is_empty() {
            let mut last = items.pop().expect("non-empty");
            self.run_batch(peer, items, deadline).await?;
            let token = (u64::from(self.nonce) << 32) | (self.next_seq() & 0xffff_ffff);
            if let Item::Write { data, .. } = &mut last {
                *data = Some(token);
            }
            let mut batch: Vec<Item> = wire::frames(Kind::Staged, self.nonce, dest, token, &body, recv_buf)
                .into_iter()
                .map(Item::Send)
                .collect();
            batch.push(last);
            self.run_batch(peer, batch, deadline).await
        } else {
            self.run_batch(peer, items, deadline).await?;
            let seq = self.next_seq();
            let frames = wire::frames(Kind::Notify, self.nonce, dest, seq, &body, recv_buf)
                .into_iter()
                .map(Item::Send)
                .collect();
            self.run_batch(peer, frames, deadline).await
        }
    }

    async fn notify(&self, peer: PeerId, notification: &Notification) -> Result<(), BackendError> {
        let deadline = Instant::now() + self.opts.timeout;
        let body = Self::encode(notification)?;
        let (recv_buf, _, dest) = self.peer_limits(peer)?;
        let seq = self.next_seq();
        let frames =
            wire::frames(Kind::Notify, self.nonce, dest, seq, &body, recv_buf).into_iter().map(Item::Send).collect();
        self.run_batch(peer, frames, deadline).await
    }

    async fn recv(&self, max_wait: Duration) -> Result<Vec<BackendEvent>, BackendError> {
        let mut rx = self.events.lock().await;
        let mut out = Vec::new();
        while let Ok(e) = rx.try_recv() {
            out.push(e);
        }
        if out.is_empty() {
            match tokio::time::timeout(max_wait, rx.recv()).await {
                Ok(Some(e)) => out.push(e),
                Ok(None) => return Err(BackendError::Closed { backend: NAME }),
                Err(_) => return Ok(out),
            }
            while let Ok(e) = rx.try_recv() {
                out.push(e);
            }
        }
        Ok(out)
    }

    async fn disconnect(&self, peer: PeerId) -> Result<(), BackendError> {
        let mut st = self.shared.lock();
        let p = st.peers.remove(&peer).ok_or(BackendError::UnknownPeer { backend: NAME, peer })?;
        if !st.peers.values().any(|q| q.fi_addr == p.fi_addr) {
            let bye = wire::control(Kind::Bye, self.nonce, p.nonce, self.identity);
            let _ = st.ep.send(p.fi_addr, bye, USER_CONTROL);
        }
        Ok(())
    }
}
