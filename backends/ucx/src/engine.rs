//! The progress thread: it owns the UCX context and worker (a `UCS_THREAD_MODE_SINGLE` worker is
//! only ever touched by this thread), receives commands over a channel, answers through oneshot
//! channels, and drives `ucp_worker_progress`. Every wait it performs has a deadline.
//!
//! Idle strategy: the thread spins on `ucp_worker_progress` (yielding the CPU) for [`SPIN`] after
//! the last event; then, while anything is in flight or for [`HOT`] after the last event, it naps
//! on the command channel for [`NAP`] between progress calls, and after that for [`COLD`]. A
//! command always wakes it at once. On a busy host this keeps the thread from burning a core.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::rc::Rc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvxfer_core::{BackendError, BackendEvent, MemRegion, Notification, PeerId, RegionId, WriteOp};
use tokio::sync::{mpsc::UnboundedSender, oneshot};

use crate::liveness::ProcId;
use crate::ucp::{self, Context, Endpoint, MemHandle, Posted, RemoteKey, Request, UcxError, Worker};
use crate::wire::{self, Header, Hello, Kind, Payload, RegionMeta, GOODBYE_SHUTDOWN};
use crate::NAME;

/// How long the thread keeps spinning after the last activity.
const HOT: Duration = Duration::from_millis(20);
/// How long the thread spins (yielding) after the last event before it starts napping.
const SPIN: Duration = Duration::from_micros(200);
/// The nap between progress calls while something is in flight or shortly after activity.
const NAP: Duration = Duration::from_micros(50);
/// Longest sleep between progress calls when idle.
const COLD: Duration = Duration::from_millis(1);
/// How long shutdown waits for in-flight writes, then for goodbyes to be flushed.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(2);

/// Settings the thread starts with.
pub(crate) struct Settings {
    /// UCX configuration overrides (`TLS`, `NET_DEVICES`, ...).
    pub ucx: Vec<(String, String)>,
    /// Deadline of every operation.
    pub op_timeout: Duration,
    /// This endpoint's identity.
    pub identity: u64,
    /// This endpoint instance's random id.
    pub instance: u64,
    /// Which UCX error handling mode endpoints use.
    pub err_mode: ErrMode,
    /// How often peers UCX cannot watch are checked for liveness.
    pub keepalive: Duration,
    /// This process.
    pub proc: ProcId,
    /// Whether the transports are all shared-memory ones (no peer error handling in UCX 1.13).
    pub shm_only: bool,
    /// Whether writes go as active messages (the receiver places the bytes) instead of puts.
    pub am_data: bool,
}

/// Which UCX error handling mode endpoints use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ErrMode {
    /// Peer error handling, falling back to none when no transport supports it (shared memory).
    Auto,
    /// Always `UCP_ERR_HANDLING_MODE_PEER` (fails to connect over shared memory with UCX 1.13).
    Peer,
    /// Always `UCP_ERR_HANDLING_MODE_NONE` (liveness is then watched through `/proc` only).
    None,
}

/// What the thread publishes for `metadata()`.
pub(crate) struct LocalMeta {
    /// Worker address.
    pub worker: Vec<u8>,
    /// Registered regions.
    pub regions: BTreeMap<RegionId, RegionMeta>,
}

/// A command for the progress thread.
pub(crate) enum Cmd {
    Register { id: RegionId, mem: MemRegion, reply: SyncSender<Result<(), BackendError>> },
    Deregister { id: RegionId, reply: SyncSender<Result<(), BackendError>> },
    Connect { identity: u64, payload: Payload, reply: oneshot::Sender<Result<PeerId, BackendError>> },
    Write { peer: PeerId, ops: Vec<WriteOp>, notify: Option<Vec<u8>>, reply: oneshot::Sender<Result<(), BackendError>> },
    Notify { peer: PeerId, bytes: Vec<u8>, reply: oneshot::Sender<Result<(), BackendError>> },
    Disconnect { peer: PeerId, reply: oneshot::Sender<Result<(), BackendError>> },
    Shutdown,
}

fn ffi(e: UcxError, peer: &str) -> BackendError {
    BackendError::Ffi {
        backend: NAME,
        call: e.call,
        code: i64::from(e.status),
        detail: format!("{}; {peer}", e.text()),
    }
}

/// A registered local region: its UCX registration (which keeps the memory alive), or for a
/// zero-length region just its description.
enum Local {
    Mapped(Rc<MemHandle>),
    Empty,
}

impl Local {
    fn len(&self) -> u64 {
        match self {
            Local::Mapped(m) => m.region().len() as u64,
            Local::Empty => 0,
        }
    }
}

/// A peer's region, as we can write it.
struct Remote {
    addr: u64,
    len: u64,
    rkey: Option<Rc<RemoteKey>>,
}

enum Reply {
    Unit(oneshot::Sender<Result<(), BackendError>>),
    Peer(oneshot::Sender<Result<PeerId, BackendError>>, PeerId),
}

impl Reply {
    fn send(self, r: Result<(), BackendError>) {
        match self {
            Reply::Unit(tx) => {
                let _ = tx.send(r);
            }
            Reply::Peer(tx, id) => {
                let _ = tx.send(r.map(|()| id));
            }
        }
    }
}

/// One write (or connect, or out-of-band notification) in flight on a peer.
///
/// Order of events: requests posted at creation (`reqs`: puts are released at once, the hello of a
/// connect is kept), then `flush` (remote completion of everything before it on the endpoint),
/// then the active message `am`, posted only after the flush completed and after every earlier
/// job's message of the same peer was posted, so notifications keep their order and never
/// overtake the data they cover.
struct Job {
    reqs: Vec<(&'static str, Request)>,
    flush: Option<Request>,
    flushed: bool,
    am: Option<(Vec<u8>, Vec<u8>)>,
    am_req: Option<Request>,
    error: Option<BackendError>,
    reply: Option<Reply>,
    deadline: Instant,
    what: &'static str,
    /// Whether the caller was answered with success (a connect that failed removes its peer).
    ok: Option<bool>,
    /// Active-message data path: the sequence number whose acknowledgement completes the job.
    awaiting_ack: Option<u64>,
    /// Source registrations and remote keys the posted puts use, kept until the flush completes.
    sources: Vec<Rc<MemHandle>>,
    rkeys: Vec<Rc<RemoteKey>>,
}

impl Drop for Job {
    fn drop(&mut self) {
        let in_flight = self.flush.as_ref().is_some_and(|f| f.poll("ucp_ep_flush_nbx").is_none());
        if in_flight {
            // UCX may still read the sources: never release them (a leak, only on a give-up path).
            for m in self.sources.drain(..) {
                std::mem::forget(m);
            }
        }
        if let Some(r) = self.reply.take() {
            r.send(Err(BackendError::Closed { backend: NAME }));
        }
    }
}

impl Job {
    fn new(what: &'static str, reply: Reply, deadline: Instant) -> Self {
        Self {
            reqs: Vec::new(),
            flush: None,
            flushed: false,
            am: None,
            am_req: None,
            error: None,
            reply: Some(reply),
            deadline,
            what,
            ok: None,
            awaiting_ack: None,
            sources: Vec::new(),
            rkeys: Vec::new(),
        }
    }

    fn fail(&mut self, e: BackendError) {
        if self.error.is_none() {
            self.error = Some(e);
        }
    }

    fn post_flush(&mut self, ep: &Endpoint, desc: &str) {
        match ep.flush() {
            Ok(Posted::Done) => self.flushed = true,
            Ok(Posted::Pending(r)) => self.flush = Some(r),
            Err(e) => {
                self.flushed = true;
                self.fail(ffi(e, desc))
            }
        }
    }

    /// Whether the job's message is still to be posted (later messages must wait for it).
    fn am_waiting(&self) -> bool {
        self.am.is_some() && self.error.is_none()
    }

    /// Whether the job holds no request any more and its caller has an answer.
    fn finished(&self) -> bool {
        self.reply.is_none() && self.reqs.is_empty() && self.flush.is_none() && self.am_req.is_none()
    }

    /// Advances the job.
    fn poll(
        &mut self,
        ep: &Endpoint,
        may_post_am: bool,
        lost: Option<&str>,
        desc: &str,
        timeout: Duration,
        now: Instant,
    ) {
        let err = |e: UcxError| match lost {
            Some(reason) => BackendError::PeerLost {
                backend: NAME,
                peer: desc.to_owned(),
                detail: format!("{reason}; {} failed: {}", e.call, e.text()),
            },
            None => ffi(e, desc),
        };
        let mut i = 0;
        while i < self.reqs.len() {
            match self.reqs[i].1.poll(self.reqs[i].0) {
                None => i += 1,
                Some(r) => {
                    if let Err(e) = r {
                        let e = err(e);
                        self.fail(e);
                    }
                    self.reqs.swap_remove(i);
                }
            }
        }
        if let Some(r) = self.flush.as_ref().and_then(|f| f.poll("ucp_ep_flush_nbx")) {
            self.flush = None;
            self.flushed = true;
            // The puts are complete: their sources may go.
            self.sources.clear();
            self.rkeys.clear();
            if let Err(e) = r {
                let e = err(e);
                self.fail(e);
            }
        }
        if self.flushed && self.reqs.is_empty() && self.error.is_none() && may_post_am {
            if let Some((h, d)) = self.am.take() {
                match ep.am_send(h, d) {
                    Ok(Posted::Done) => {}
                    Ok(Posted::Pending(r)) => self.am_req = Some(r),
                    Err(e) => {
                        let e = err(e);
                        self.fail(e)
                    }
                }
            }
        }
        if let Some(r) = self.am_req.as_ref().and_then(|a| a.poll("ucp_am_send_nbx")) {
            self.am_req = None;
            if let Err(e) = r {
                let e = err(e);
                self.fail(e);
            }
        }
        let idle = self.reqs.is_empty() && self.flush.is_none() && self.am_req.is_none();
        let complete =
            self.error.is_some() || (idle && self.flushed && self.am.is_none() && self.awaiting_ack.is_none());
        if complete || now >= self.deadline {
            if let Some(reply) = self.reply.take() {
                let r = match self.error.take() {
                    Some(e) => Err(e),
                    None if complete => Ok(()),
                    None => Err(BackendError::Timeout {
                        backend: NAME,
                        what: format!("{} to {desc}", self.what),
                        after: timeout,
                    }),
                };
                self.ok = Some(r.is_ok());
                reply.send(r);
            }
        }
        if self.reply.is_none() && !complete {
            // The caller gave up (deadline): a message not yet posted is not sent late.
            self.am = None;
        }
    }
}

struct Peer {
    identity: u64,
    instance: u64,
    proc: ProcId,
    regions: HashMap<RegionId, Remote>,
    lost: Option<String>,
    jobs: VecDeque<Job>,
    /// Set once the connect job succeeded; a failed connect removes the peer.
    connected: bool,
    ep: Rc<Endpoint>,
}

fn desc(id: PeerId, identity: u64) -> String {
    format!("{id} (identity {identity:#x})")
}

impl Peer {
    /// Advances the peer's jobs in order; returns whether any is in flight.
    fn poll(&mut self, pid: PeerId, timeout: Duration, now: Instant) -> bool {
        let d = desc(pid, self.identity);
        let mut may_post = true;
        let lost = self.lost.clone();
        if let Some(reason) = &lost {
            // Nothing in flight to a lost peer can still succeed (an acknowledgement will not come;
            // with error mode none UCX may never complete a request): answer the callers now.
            for j in self.jobs.iter_mut().filter(|j| j.reply.is_some()) {
                j.fail(BackendError::PeerLost { backend: NAME, peer: d.clone(), detail: reason.clone() });
            }
        }
        for j in self.jobs.iter_mut() {
            j.poll(&self.ep, may_post, lost.as_deref(), &d, timeout, now);
            if j.what == "connect" {
                match j.ok {
                    Some(true) => self.connected = true,
                    Some(false) => {
                        self.lost.get_or_insert_with(|| "connecting failed".into());
                    }
                    None => {}
                }
            }
            if j.am_waiting() {
                may_post = false;
            }
        }
        // A lost peer's jobs go once their callers have an answer: UCX may never complete their
        // requests (error mode none); dropping a job with requests in flight leaks, never frees,
        // what they use.
        let lost = self.lost.is_some();
        self.jobs.retain(|j| !(j.finished() || (lost && j.reply.is_none())));
        !self.jobs.is_empty()
    }
}

/// An endpoint back to a peer that connected to us (from its hello): how we notice it going away.
struct Reverse {
    identity: u64,
    proc: ProcId,
    ep: Rc<Endpoint>,
}

enum Token {
    Forward(PeerId),
    Reverse(u64),
}

/// The progress thread's state. Field order is drop order: peers (remote keys, endpoints) first,
/// then registrations, the worker, the context.
struct Engine {
    peers: BTreeMap<PeerId, Peer>,
    closing: Vec<(PeerId, Peer, Instant)>,
    reverse: HashMap<u64, Reverse>,
    regions: HashMap<RegionId, Local>,
    worker: Rc<Worker>,
    ctx: Rc<Context>,
    tokens: HashMap<u64, Token>,
    next_token: u64,
    next_peer: u64,
    lost_instances: HashSet<u64>,
    last_liveness: Instant,
    next_seq: u64,
    /// Active-message data path, receiving side: writes that could not be placed, by (instance, seq).
    refused: HashMap<(u64, u64), String>,
    /// Requests nobody waits for (acknowledgements), kept until UCX is done with their buffers.
    loose: Vec<Request>,
    settings: Settings,
    events: UnboundedSender<BackendEvent>,
    meta: Arc<Mutex<LocalMeta>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Starts the progress thread; returns once the worker exists (or failed to start).
pub(crate) fn start(
    settings: Settings,
    rx: Receiver<Cmd>,
    events: UnboundedSender<BackendEvent>,
    meta: Arc<Mutex<LocalMeta>>,
) -> Result<std::thread::JoinHandle<()>, BackendError> {
    let (init_tx, init_rx) = std::sync::mpsc::sync_channel::<Result<(), BackendError>>(1);
    let handle = std::thread::Builder::new()
        .name(format!("kvxfer-ucx-{:x}", settings.identity))
        .spawn(move || {
            let built = (|| -> Result<Engine, BackendError> {
                let ctx = Context::new(&settings.ucx).map_err(|e| ffi(e, "creating the local context"))?;
                let worker = Worker::new(&ctx).map_err(|e| ffi(e, "creating the local worker"))?;
                let addr = worker.address().map_err(|e| ffi(e, "local worker"))?;
                lock(&meta).worker = addr;
                Ok(Engine {
                    peers: BTreeMap::new(),
                    closing: Vec::new(),
                    reverse: HashMap::new(),
                    regions: HashMap::new(),
                    worker,
                    ctx,
                    tokens: HashMap::new(),
                    next_token: 1,
                    next_peer: 1,
                    lost_instances: HashSet::new(),
                    last_liveness: Instant::now(),
                    next_seq: 1,
                    refused: HashMap::new(),
                    loose: Vec::new(),
                    settings,
                    events,
                    meta,
                })
            })();
            match built {
                Ok(mut engine) => {
                    let _ = init_tx.send(Ok(()));
                    engine.run(&rx);
                    engine.shutdown(&rx);
                }
                Err(e) => {
                    let _ = init_tx.send(Err(e));
                }
            }
        })
        .map_err(|e| BackendError::Io {
            backend: NAME,
            context: "spawning the UCX progress thread".into(),
            detail: e.to_string(),
        })?;
    let wait = Duration::from_secs(30);
    match init_rx.recv_timeout(wait) {
        Ok(Ok(())) => Ok(handle),
        Ok(Err(e)) => {
            let _ = handle.join();
            Err(e)
        }
        Err(_) => Err(BackendError::Timeout {
            backend: NAME,
            what: "creating the UCX context and worker".into(),
            after: wait,
        }),
    }
}

impl Engine {
    fn run(&mut self, rx: &Receiver<Cmd>) {
        let mut last_busy = Instant::now();
        loop {
            let mut busy = self.progress_all();
            loop {
                match rx.try_recv() {
                    Ok(Cmd::Shutdown) | Err(TryRecvError::Disconnected) => return,
                    Ok(cmd) => {
                        busy = true;
                        self.handle(cmd);
                    }
                    Err(TryRecvError::Empty) => break,
                }
            }
            let in_flight = self.poll_jobs();
            let now = Instant::now();
            if now.duration_since(self.last_liveness) >= self.settings.keepalive {
                self.last_liveness = now;
                self.check_liveness();
            }
            if busy {
                last_busy = now;
                continue;
            }
            let quiet = now.duration_since(last_busy);
            if quiet < SPIN {
                std::thread::yield_now();
                continue;
            }
            // Napping on the channel: a command wakes the thread at once.
            let nap = if in_flight || quiet < HOT { NAP } else { COLD };
            match rx.recv_timeout(nap) {
                Ok(Cmd::Shutdown) | Err(RecvTimeoutError::Disconnected) => return,
                Ok(cmd) => {
                    self.handle(cmd);
                    last_busy = Instant::now();
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
    }

    /// Progresses the worker until it has nothing more to do (bounded), then handles what the
    /// callbacks left. Returns whether anything happened.
    fn progress_all(&mut self) -> bool {
        let mut any = false;
        for _ in 0..1024 {
            if self.worker.progress() == 0 {
                break;
            }
            any = true;
        }
        let inbox = self.worker.take_inbox();
        if inbox.dropped_rndv > 0 {
            any = true;
            tracing::warn!(
                count = inbox.dropped_rndv,
                "ucx: dropped rendezvous active messages (kvxfer peers send eager)"
            );
        }
        for (token, status) in inbox.ep_errors {
            any = true;
            self.on_ep_error(token, status);
        }
        for m in inbox.messages {
            any = true;
            self.on_message(m);
        }
        any
    }

    fn emit(&self, e: BackendEvent) {
        let _ = self.events.send(e);
    }

    fn emit_lost(&mut self, instance: u64, identity: u64, reason: String) {
        if self.lost_instances.insert(instance) {
            self.emit(BackendEvent::PeerLost { identity, reason });
        }
    }

    fn on_ep_error(&mut self, token: u64, status: ucp::Status) {
        let text = ucp::status_text(status);
        match self.tokens.get(&token) {
            Some(Token::Forward(pid)) => {
                let pid = *pid;
                if let Some(p) = self.peers.get_mut(&pid) {
                    p.ep.mark_failed();
                    let reason = format!("UCX reported the endpoint failed: {text}");
                    p.lost.get_or_insert(reason.clone());
                    let (inst, ident, connected) = (p.instance, p.identity, p.connected);
                    if connected {
                        self.emit_lost(inst, ident, format!("{}: {reason}", desc(pid, ident)));
                    }
                } else if let Some((_, p, _)) = self.closing.iter().find(|(id, _, _)| *id == pid) {
                    p.ep.mark_failed();
                }
            }
            Some(Token::Reverse(instance)) => {
                let instance = *instance;
                if let Some(r) = self.reverse.remove(&instance) {
                    r.ep.mark_failed();
                    let reason =
                        format!("peer with identity {:#x}: UCX reported the endpoint failed: {text}", r.identity);
                    self.emit_lost(instance, r.identity, reason);
                }
            }
            None => {}
        }
    }

    fn on_message(&mut self, m: ucp::AmMessage) {
        let h = match Header::decode(&m.header) {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!("ucx: dropping active message: {e}");
                return;
            }
        };
        match h.kind {
            Kind::Attached | Kind::OutOfBand => match Notification::decode(&m.data) {
                Ok(n) => self.emit(BackendEvent::Notification(n)),
                Err(e) => tracing::warn!(identity = h.identity, "ucx: dropping undecodable notification: {e}"),
            },
            Kind::Hello => {
                if self.reverse.contains_key(&h.instance) || h.instance == self.settings.instance {
                    return;
                }
                let hello = match serde_json::from_slice::<Hello>(&m.data)
                    .map_err(|e| e.to_string())
                    .and_then(|h| Ok((wire::unhex(&h.worker)?, h.proc)))
                {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!(identity = h.identity, "ucx: dropping a malformed hello: {e}");
                        return;
                    }
                };
                self.lost_instances.remove(&h.instance);
                let token = self.token(Token::Reverse(h.instance));
                match self.open_ep(&hello.0, token) {
                    Ok(ep) => {
                        self.reverse.insert(h.instance, Reverse { identity: h.identity, proc: hello.1, ep });
                    }
                    Err(e) => {
                        self.tokens.remove(&token);
                        tracing::warn!(
                            identity = h.identity,
                            "ucx: cannot watch a connecting peer: {} failed: {}",
                            e.call,
                            e.text()
                        );
                    }
                }
            }
            Kind::Data => self.on_data(h, &m.data),
            Kind::Commit => self.on_commit(h, &m.data),
            Kind::Ack => self.on_ack(h, &m.data),
            Kind::Revoke => {
                let Ok(id) = <[u8; 4]>::try_from(&m.data[..]).map(u32::from_le_bytes) else {
                    tracing::warn!(identity = h.identity, "ucx: dropping a malformed revoke");
                    return;
                };
                for p in self.peers.values_mut().filter(|p| p.instance == h.instance) {
                    p.regions.remove(&RegionId(id));
                }
            }
            Kind::Goodbye => {
                if let Some(r) = self.reverse.remove(&h.instance) {
                    // The peer is going away: no close handshake with it.
                    r.ep.mark_failed();
                }
                if h.flags & GOODBYE_SHUTDOWN != 0 {
                    for p in self.peers.values_mut() {
                        if p.instance == h.instance && p.lost.is_none() {
                            p.lost = Some("the peer endpoint shut down".into());
                            p.ep.mark_failed();
                        }
                    }
                    let reason = format!("peer with identity {:#x} shut down its UCX endpoint", h.identity);
                    self.emit_lost(h.instance, h.identity, reason);
                }
            }
        }
    }

    /// Tells every peer that knows this endpoint (connected either way) to forget a deregistered
    /// region's remote key, so their later writes naming it fail with `UnknownRegion` instead of
    /// landing in memory that may be freed. Best effort: a write already posted is not recalled.
    fn revoke(&mut self, id: RegionId) {
        let header = self.header(Kind::Revoke, 0);
        let mut told = HashSet::new();
        let eps: Vec<(u64, Rc<Endpoint>)> = self
            .reverse
            .iter()
            .map(|(i, r)| (*i, r.ep.clone()))
            .chain(self.peers.values().filter(|p| p.lost.is_none()).map(|p| (p.instance, p.ep.clone())))
            .collect();
        for (instance, ep) in eps {
            if instance == self.settings.instance {
                // Connected to ourselves: forget it directly.
                for p in self.peers.values_mut().filter(|p| p.instance == instance) {
                    p.regions.remove(&id);
                }
                continue;
            }
            if !told.insert(instance) {
                continue;
            }
            if let Ok(Posted::Pending(r)) = ep.am_send(header.clone(), id.0.to_le_bytes().to_vec()) {
                self.loose.push(r);
            }
        }
    }

    /// Active-message data path: places the bytes of a data message into registered memory,
    /// checking every segment against the region (a write outside it is refused, never placed).
    fn on_data(&mut self, h: Header, body: &[u8]) {
        let (seq, region, segs) = match wire::decode_data(body) {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(identity = h.identity, "ucx: dropping a malformed data message: {e}");
                return;
            }
        };
        if self.refused.contains_key(&(h.instance, seq)) {
            return;
        }
        let id = RegionId(region);
        let mem = match self.regions.get(&id) {
            Some(Local::Mapped(m)) => Some(m.region().clone()),
            Some(Local::Empty) => None,
            None => {
                self.refused.insert((h.instance, seq), format!("{id} is not registered at the receiver"));
                return;
            }
        };
        for (off, bytes) in segs {
            let r = match &mem {
                Some(m) => m.write(off, bytes),
                None if bytes.is_empty() => Ok(()),
                None => Err(kvxfer_core::MemError { offset: off, len: bytes.len() as u64, region_len: 0 }),
            };
            if let Err(e) = r {
                self.refused.insert((h.instance, seq), format!("write into {id} refused by the receiver: {e}"));
                return;
            }
        }
    }

    /// Active-message data path: a write is complete; deliver its notification and acknowledge.
    fn on_commit(&mut self, h: Header, body: &[u8]) {
        if body.len() < 8 {
            tracing::warn!(identity = h.identity, "ucx: dropping a malformed commit");
            return;
        }
        let seq = u64::from_le_bytes(body[..8].try_into().expect("8"));
        let refused = self.refused.remove(&(h.instance, seq));
        if refused.is_none() && body.len() > 8 {
            match Notification::decode(&body[8..]) {
                Ok(n) => self.emit(BackendEvent::Notification(n)),
                Err(e) => tracing::warn!(identity = h.identity, "ucx: dropping undecodable notification: {e}"),
            }
        }
        let mut ack = seq.to_le_bytes().to_vec();
        match &refused {
            None => ack.push(1),
            Some(reason) => {
                ack.push(0);
                ack.extend_from_slice(reason.as_bytes());
            }
        }
        let ep = self
            .reverse
            .get(&h.instance)
            .map(|r| r.ep.clone())
            .or_else(|| self.peers.values().find(|p| p.instance == h.instance).map(|p| p.ep.clone()));
        let Some(ep) = ep else {
            tracing::warn!(identity = h.identity, "ucx: cannot acknowledge a write: no endpoint back to the sender");
            return;
        };
        match ep.am_send(self.header(Kind::Ack, 0), ack) {
            Ok(Posted::Pending(r)) => self.loose.push(r),
            Ok(Posted::Done) => {}
            Err(e) => tracing::debug!("ucx: acknowledging a write failed: {} {}", e.call, e.text()),
        }
    }

    /// Active-message data path, sending side: the receiver placed (or refused) write `seq`.
    fn on_ack(&mut self, h: Header, body: &[u8]) {
        if body.len() < 9 {
            tracing::warn!(identity = h.identity, "ucx: dropping a malformed acknowledgement");
            return;
        }
        let seq = u64::from_le_bytes(body[..8].try_into().expect("8"));
        let ok = body[8] == 1;
        let reason = String::from_utf8_lossy(&body[9..]).into_owned();
        for (pid, p) in self.peers.iter_mut().chain(self.closing.iter_mut().map(|(i, p, _)| (&*i, p))) {
            if p.instance != h.instance {
                continue;
            }
            for j in p.jobs.iter_mut().filter(|j| j.awaiting_ack == Some(seq)) {
                j.awaiting_ack = None;
                if !ok {
                    j.fail(BackendError::Protocol {
                        backend: NAME,
                        peer: desc(*pid, p.identity),
                        detail: reason.clone(),
                    });
                }
            }
        }
    }

    /// Opens an endpoint to a worker address in the configured error mode (see [`ErrMode`]).
    fn open_ep(&mut self, addr: &[u8], token: u64) -> Result<Rc<Endpoint>, UcxError> {
        match self.settings.err_mode {
            ErrMode::Peer => Endpoint::connect(&self.worker, addr, token, true),
            ErrMode::None => Endpoint::connect(&self.worker, addr, token, false),
            // Shared memory only: UCX 1.13 has no peer error handling there; do not even ask.
            ErrMode::Auto if self.settings.shm_only => Endpoint::connect(&self.worker, addr, token, false),
            ErrMode::Auto => match Endpoint::connect(&self.worker, addr, token, true) {
                Err(e) if e.status == ucp::ERR_UNREACHABLE => Endpoint::connect(&self.worker, addr, token, false),
                r => r,
            },
        }
    }

    /// Checks peers UCX does not watch (error mode none) for process death.
    fn check_liveness(&mut self) {
        let me = self.settings.proc.clone();
        let mut lost = Vec::new();
        for (pid, p) in self.peers.iter_mut() {
            if !p.ep.peer_errors() && p.lost.is_none() && p.connected && p.proc.alive(&me) == Some(false) {
                let reason = format!("peer process {} exited", p.proc.pid);
                // UCX will not fail what is in flight to it (error mode none): fail it here.
                for j in p.jobs.iter_mut().filter(|j| j.reply.is_some()) {
                    j.fail(BackendError::PeerLost {
                        backend: NAME,
                        peer: desc(*pid, p.identity),
                        detail: reason.clone(),
                    });
                }
                p.lost = Some(reason);
                lost.push((
                    p.instance,
                    p.identity,
                    format!("{}: its process {} exited", desc(*pid, p.identity), p.proc.pid),
                ));
            }
        }
        let dead: Vec<u64> = self
            .reverse
            .iter()
            .filter(|(_, r)| !r.ep.peer_errors() && r.proc.alive(&me) == Some(false))
            .map(|(i, _)| *i)
            .collect();
        for i in dead {
            if let Some(r) = self.reverse.remove(&i) {
                let reason = format!("peer with identity {:#x}: its process {} exited", r.identity, r.proc.pid);
                lost.push((i, r.identity, reason));
            }
        }
        for (instance, identity, reason) in lost {
            self.emit_lost(instance, identity, reason);
        }
    }

    fn token(&mut self, t: Token) -> u64 {
        let id = self.next_token;
        self.next_token += 1;
        self.tokens.insert(id, t);
        id
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.settings.op_timeout
    }

    fn header(&self, kind: Kind, flags: u8) -> Vec<u8> {
        Header { kind, flags, instance: self.settings.instance, identity: self.settings.identity }.encode()
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Register { id, mem, reply } => {
                let _ = reply.send(self.register(id, mem));
            }
            Cmd::Deregister { id, reply } => {
                let r = match self.regions.remove(&id) {
                    Some(_) => {
                        lock(&self.meta).regions.remove(&id);
                        self.revoke(id);
                        Ok(())
                    }
                    None => Err(BackendError::UnknownRegion { backend: NAME, region: id, peer: None }),
                };
                let _ = reply.send(r);
            }
            Cmd::Connect { identity, payload, reply } => self.connect(identity, payload, reply),
            Cmd::Write { peer, ops, notify, reply } => self.write(peer, &ops, notify, reply),
            Cmd::Notify { peer, bytes, reply } => self.notify(peer, bytes, reply),
            Cmd::Disconnect { peer, reply } => {
                let r = match self.peers.remove(&peer) {
                    Some(p) => {
                        let d = self.deadline();
                        self.closing.push((peer, p, d));
                        Ok(())
                    }
                    None => Err(BackendError::UnknownPeer { backend: NAME, peer }),
                };
                let _ = reply.send(r);
            }
            Cmd::Shutdown => {}
        }
    }

    fn register(&mut self, id: RegionId, mem: MemRegion) -> Result<(), BackendError> {
        if self.regions.contains_key(&id) {
            return Err(BackendError::RegionInUse { backend: NAME, region: id });
        }
        let (local, rkey) = if mem.is_empty() {
            (Local::Empty, String::new())
        } else {
            let m = MemHandle::map(&self.ctx, &mem).map_err(|e| ffi(e, &format!("registering {id}")))?;
            let rkey = wire::hex(m.packed_rkey());
            (Local::Mapped(Rc::new(m)), rkey)
        };
        let meta = RegionMeta { id: id.0, addr: mem.as_ptr() as u64, len: mem.len() as u64, rkey };
        lock(&self.meta).regions.insert(id, meta);
        self.regions.insert(id, local);
        Ok(())
    }

    fn connect(&mut self, identity: u64, payload: Payload, reply: oneshot::Sender<Result<PeerId, BackendError>>) {
        let pid = PeerId(self.next_peer);
        self.next_peer += 1;
        let d = desc(pid, identity);
        let fail =
            |detail: String| BackendError::Connect { backend: NAME, peer: format!("identity {identity:#x}"), detail };
        let bad = |detail: String| BackendError::BadMetadata { backend: NAME, detail };
        let worker_addr = match wire::unhex(&payload.worker) {
            Ok(a) if !a.is_empty() => a,
            Ok(_) => return drop(reply.send(Err(bad("empty worker address".into())))),
            Err(e) => return drop(reply.send(Err(bad(format!("worker address: {e}"))))),
        };
        let token = self.token(Token::Forward(pid));
        let ep = match self.open_ep(&worker_addr, token) {
            Ok(ep) => ep,
            Err(e) => {
                self.tokens.remove(&token);
                return drop(reply.send(Err(fail(format!("{} failed: {}", e.call, e.text())))));
            }
        };
        let mut regions = HashMap::new();
        for r in &payload.regions {
            let rkey = if r.len == 0 {
                None
            } else {
                let packed = match wire::unhex(&r.rkey) {
                    Ok(p) if !p.is_empty() => p,
                    Ok(_) => return drop(reply.send(Err(bad(format!("region {} has no remote key", r.id))))),
                    Err(e) => return drop(reply.send(Err(bad(format!("remote key of region {}: {e}", r.id))))),
                };
                match RemoteKey::unpack(&ep, &packed) {
                    Ok(k) => Some(Rc::new(k)),
                    Err(e) => return drop(reply.send(Err(ffi(e, &format!("{d}, region {}", r.id))))),
                }
            };
            regions.insert(RegionId(r.id), Remote { addr: r.addr, len: r.len, rkey });
        }
        let mut job = Job::new("connect", Reply::Peer(reply, pid), self.deadline());
        // Introduce ourselves so the peer can watch us (and report us lost), then flush: the
        // connection is up when the flush completes.
        let hello = self.header(Kind::Hello, 0);
        let body = Hello { worker: wire::hex(&lock(&self.meta).worker), proc: self.settings.proc.clone() };
        let body = serde_json::to_vec(&body).expect("a hello always encodes");
        match ep.am_send(hello, body) {
            Ok(Posted::Done) => {}
            Ok(Posted::Pending(r)) => job.reqs.push(("ucp_am_send_nbx", r)),
            Err(e) => job.fail(fail(format!("{} failed: {}", e.call, e.text()))),
        }
        job.post_flush(&ep, &d);
        let peer = Peer {
            identity,
            instance: payload.instance,
            proc: payload.proc,
            regions,
            lost: None,
            jobs: VecDeque::from([job]),
            connected: false,
            ep,
        };
        self.peers.insert(pid, peer);
    }

    fn write(
        &mut self,
        pid: PeerId,
        ops: &[WriteOp],
        notify: Option<Vec<u8>>,
        reply: oneshot::Sender<Result<(), BackendError>>,
    ) {
        // See what already arrived (a goodbye, an endpoint error) before touching peer memory.
        self.progress_all();
        let deadline = self.deadline();
        let header = self.header(Kind::Attached, 0);
        let regions = &self.regions;
        let Some(peer) = self.peers.get_mut(&pid) else {
            return drop(reply.send(Err(BackendError::UnknownPeer { backend: NAME, peer: pid })));
        };
        let d = desc(pid, peer.identity);
        if !peer.ep.peer_errors() && peer.lost.is_none() && peer.proc.alive(&self.settings.proc) == Some(false) {
            // Never post one-sided writes into a process that is gone (UCX cannot tell us here).
            peer.lost = Some(format!("peer process {} exited", peer.proc.pid));
        }
        if let Some(reason) = &peer.lost {
            return drop(reply.send(Err(BackendError::PeerLost { backend: NAME, peer: d, detail: reason.clone() })));
        }
        // Validate every op before any byte moves.
        let mut plan = Vec::with_capacity(ops.len());
        for op in ops {
            let Some(src) = regions.get(&op.src) else {
                return drop(reply.send(Err(BackendError::UnknownRegion {
                    backend: NAME,
                    region: op.src,
                    peer: None,
                })));
            };
            let Some(dst) = peer.regions.get(&op.dst) else {
                let e = BackendError::UnknownRegion { backend: NAME, region: op.dst, peer: Some(pid) };
                return drop(reply.send(Err(e)));
            };
            if let Err(e) = op.check_src(NAME, None, src.len()).and_then(|()| op.check_dst(NAME, Some(pid), dst.len)) {
                return drop(reply.send(Err(e)));
            }
            plan.push((src, dst, *op));
        }
        let mut job = Job::new("write", Reply::Unit(reply), deadline);
        if self.settings.am_data {
            let seq = self.next_seq;
            self.next_seq += 1;
            let (data_h, commit_h) = (
                Header { kind: Kind::Data, ..Header::decode(&header).expect("own header") }.encode(),
                Header { kind: Kind::Commit, ..Header::decode(&header).expect("own header") }.encode(),
            );
            if let Err(e) = post_am_data(&peer.ep, &plan, seq, data_h, commit_h, notify, &mut job) {
                job.fail(ffi(e, &d));
            }
            job.flushed = true;
            job.awaiting_ack = Some(seq);
        } else {
            if let Err(e) = post_puts(&peer.ep, &plan, &mut job) {
                job.fail(ffi(e, &d));
            }
            job.post_flush(&peer.ep, &d);
            job.am = notify.map(|n| (header, n));
        }
        peer.jobs.push_back(job);
    }

    fn notify(&mut self, pid: PeerId, bytes: Vec<u8>, reply: oneshot::Sender<Result<(), BackendError>>) {
        self.progress_all();
        let deadline = self.deadline();
        let header = self.header(Kind::OutOfBand, 0);
        let Some(peer) = self.peers.get_mut(&pid) else {
            return drop(reply.send(Err(BackendError::UnknownPeer { backend: NAME, peer: pid })));
        };
        if let Some(reason) = &peer.lost {
            let e = BackendError::PeerLost { backend: NAME, peer: desc(pid, peer.identity), detail: reason.clone() };
            return drop(reply.send(Err(e)));
        }
        let mut job = Job::new("notify", Reply::Unit(reply), deadline);
        job.flushed = true;
        job.am = Some((header, bytes));
        peer.jobs.push_back(job);
    }

    /// Advances every job; returns whether any is still in flight.
    fn poll_jobs(&mut self) -> bool {
        let now = Instant::now();
        let timeout = self.settings.op_timeout;
        let mut in_flight = false;
        let mut failed = Vec::new();
        for (pid, p) in self.peers.iter_mut() {
            in_flight |= p.poll(*pid, timeout, now);
            if !p.connected && p.jobs.is_empty() {
                failed.push(*pid);
            }
        }
        for pid in failed {
            if let Some(p) = self.peers.remove(&pid) {
                p.ep.mark_failed();
            }
        }
        self.loose.retain(|r| r.poll("ucp_am_send_nbx").is_none());
        let mut i = 0;
        while i < self.closing.len() {
            let (pid, p, deadline) = &mut self.closing[i];
            in_flight |= p.poll(*pid, timeout, now);
            if p.jobs.is_empty() || now >= *deadline {
                let (_, p, _) = self.closing.swap_remove(i);
                if !p.jobs.is_empty() {
                    p.ep.mark_failed();
                }
            } else {
                i += 1;
            }
        }
        in_flight
    }

    fn shutdown(&mut self, rx: &Receiver<Cmd>) {
        // Answer everything still queued.
        while let Ok(cmd) = rx.try_recv() {
            refuse(cmd);
        }
        // Let in-flight writes finish (bounded).
        let deadline = Instant::now() + SHUTDOWN_WAIT;
        while Instant::now() < deadline {
            self.progress_all();
            if !self.poll_jobs() {
                break;
            }
        }
        // Tell every live peer (those we connected to and those that connected to us) we are going.
        let bye = self.header(Kind::Goodbye, GOODBYE_SHUTDOWN);
        let mut told = HashSet::new();
        let mut pending = Vec::new();
        let eps: Vec<(u64, Rc<Endpoint>)> = self
            .peers
            .values()
            .filter(|p| p.lost.is_none() && p.connected)
            .map(|p| (p.instance, p.ep.clone()))
            .chain(self.reverse.iter().map(|(i, r)| (*i, r.ep.clone())))
            .collect();
        for (instance, ep) in &eps {
            if !told.insert(*instance) {
                continue;
            }
            if let Ok(Posted::Pending(r)) = ep.am_send(bye.clone(), Vec::new()) {
                pending.push(r);
            }
            if let Ok(Posted::Pending(r)) = ep.flush() {
                pending.push(r);
            }
        }
        let deadline = Instant::now() + SHUTDOWN_WAIT;
        while !pending.is_empty() && Instant::now() < deadline {
            self.worker.progress();
            pending.retain(|r| r.poll("ucp_ep_flush_nbx").is_none());
        }
        drop(pending);
        // Close every endpoint without a handshake (peers were told), remote keys first.
        for (_, ep) in &eps {
            ep.mark_failed();
        }
        drop(eps);
        for p in self.peers.values().chain(self.closing.iter().map(|(_, p, _)| p)) {
            p.ep.mark_failed();
        }
        self.peers.clear();
        self.closing.clear();
        self.reverse.clear();
        self.loose.clear();
        while let Ok(cmd) = rx.try_recv() {
            refuse(cmd);
        }
    }
}

fn refuse(cmd: Cmd) {
    let closed = || BackendError::Closed { backend: NAME };
    match cmd {
        Cmd::Register { reply, .. } | Cmd::Deregister { reply, .. } => drop(reply.send(Err(closed()))),
        Cmd::Connect { reply, .. } => drop(reply.send(Err(closed()))),
        Cmd::Write { reply, .. } | Cmd::Notify { reply, .. } | Cmd::Disconnect { reply, .. } => {
            drop(reply.send(Err(closed())))
        }
        Cmd::Shutdown => {}
    }
}

/// Active-message data path: sends the bytes of validated ops in data messages (copied out of the
/// source region), then a commit that carries the notification; all on one endpoint, so they
/// arrive in this order and the receiver places the bytes before it sees the commit.
fn post_am_data(
    ep: &Endpoint,
    plan: &[(&Local, &Remote, WriteOp)],
    seq: u64,
    data_header: Vec<u8>,
    commit_header: Vec<u8>,
    notify: Option<Vec<u8>>,
    job: &mut Job,
) -> Result<(), UcxError> {
    let mut b = wire::DataBuilder::new(seq);
    for (src, _, op) in plan {
        let Local::Mapped(memh) = src else { continue };
        if op.len == 0 {
            continue;
        }
        let mem = memh.region();
        let whole = op.count > 1 && op.src_stride == op.len && op.dst_stride == op.len;
        let ranges: Box<dyn Iterator<Item = (u64, u64, u64)>> = if whole {
            Box::new(std::iter::once((op.src_offset, op.dst_offset, op.len * op.count)))
        } else {
            Box::new(op.ranges())
        };
        for (so, dof, len) in ranges {
            b.add(op.dst.0, dof, len, |at, out| mem.read(so + at, out).expect("source range checked in write"));
        }
    }
    for msg in b.finish() {
        if let Posted::Pending(r) = ep.am_send(data_header.clone(), msg)? {
            job.reqs.push(("ucp_am_send_nbx", r));
        }
    }
    let mut commit = seq.to_le_bytes().to_vec();
    commit.extend_from_slice(&notify.unwrap_or_default());
    if let Posted::Pending(r) = ep.am_send(commit_header, commit)? {
        job.reqs.push(("ucp_am_send_nbx", r));
    }
    Ok(())
}

/// Posts the puts of validated ops; the job keeps their sources and remote keys until its flush
/// completes.
// The one `unsafe` outside `ucp.rs`: `Endpoint::put` cannot check the remote side of a one-sided
// write by itself; this function is where the conditions it states are established.
#[allow(unsafe_code)]
fn post_puts(ep: &Endpoint, plan: &[(&Local, &Remote, WriteOp)], job: &mut Job) -> Result<(), UcxError> {
    for (src, dst, op) in plan {
        let (Local::Mapped(memh), Some(rkey)) = (src, &dst.rkey) else {
            // A zero-length region on either side: bounds checks passed, so every range is empty.
            continue;
        };
        if op.len == 0 {
            continue;
        }
        job.sources.push(memh.clone());
        job.rkeys.push(rkey.clone());
        // Both sides contiguous: one put for the whole op.
        let whole = op.count > 1 && op.src_stride == op.len && op.dst_stride == op.len;
        let ranges: Box<dyn Iterator<Item = (u64, u64, u64)>> = if whole {
            Box::new(std::iter::once((op.src_offset, op.dst_offset, op.len * op.count)))
        } else {
            Box::new(op.ranges())
        };
        for (so, dof, len) in ranges {
            // SAFETY: `job` holds the source registration (hence its memory) and the remote key
            // until the flush posted after these puts completes (Job::poll clears them only then;
            // Job's Drop leaks them if it never completes). The destination range was checked
            // against the region the peer published (check_bounds in `write`); the peer keeps it
            // registered for as long as it lets connected peers write (see the crate docs).
            match unsafe { ep.put(memh, so, len, dst.addr + dof, rkey) }? {
                Posted::Done => {}
                p @ Posted::Pending(_) => p.release(),
            }
        }
    }
    Ok(())
}
