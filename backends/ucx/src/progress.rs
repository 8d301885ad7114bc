//! The progress thread: it owns the UCX context and worker (a `UCS_THREAD_MODE_SINGLE` worker is
//! only ever touched by this thread), receives commands over a channel, answers through oneshot
//! channels or transfer states, and drives `ucp_worker_progress`. Every wait has a deadline.
//!
//! Idle strategy: the thread spins on `ucp_worker_progress` (yielding the CPU) for [`SPIN`] after
//! the last event; then, while anything is in flight or for [`HOT`] after the last event, it naps
//! on the command channel for [`NAP`] between progress calls. After that it naps for [`COLD_NAP`]
//! at a time (the default, `idle=poll`: a message to an idle endpoint waits up to that long), or,
//! with `idle=event`, sleeps on the worker's event descriptor (armed with `ucp_worker_arm`) for up
//! to [`COLD`]: network activity wakes it at once, and so does a command (the sender signals the
//! worker when the thread is parked). Where UCX cannot arm the worker, it naps as with `poll`. After a
//! busy turn with transfers in flight it pauses for [`BUSY_PAUSES`] `spin_loop` hints before the
//! next progress call.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvxfer_core::secret::{Exchange, NONCE_BYTES};
use kvxfer_core::toolkit::{Drained, EventQueue, RegionRef, RegionTable, Segment};
use kvxfer_core::{BackendError, BackendEvent, CutOff, MemDesc, Notification, PeerId, RegionId, Secret, TransferState};
use tokio::sync::oneshot;

use crate::liveness::ProcId;
use crate::ucp::{
    self, ClosingEndpoint, Context, Endpoint, Event, MemHandle, Posted, RemoteKey, Request, UcxError, Waker, Worker,
};
use crate::wire::{self, Header, Hello, Kind, Payload, RegionMeta, COMMIT_ABORTED, GOODBYE_SHUTDOWN};
use crate::NAME;

const HOT: Duration = Duration::from_millis(20);
const SPIN: Duration = Duration::from_micros(200);
const NAP: Duration = Duration::from_micros(50);
/// `spin_loop` hints after a busy turn while anything is in flight (a few hundred nanoseconds).
const BUSY_PAUSES: u32 = 8;
/// Longest sleep on the event descriptor (timers and liveness checks run at least this often).
const COLD: Duration = Duration::from_millis(10);
/// The nap when the worker cannot be armed: a message that arrives meanwhile waits up to this long.
const COLD_NAP: Duration = Duration::from_millis(1);
/// How long shutdown waits for in-flight transfers and region closes, then for goodbyes.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(2);
/// Most requests (puts or data messages) one transfer has in flight; the rest wait, so an abort
/// stops them.
const WINDOW: usize = 64;
/// Most pieces one transfer posts per turn of the progress loop.
const BURST: usize = 64;
/// Most connections waiting for their authentication at once (more hellos are refused).
const MAX_PENDING_AUTH: usize = 256;
/// What every authentication refusal tells the operator to do.
pub(crate) const AUTH_FIX: &str = "configure the same cluster secret (KVXFER_SECRET) on every rank";

/// Settings the thread starts with.
pub(crate) struct Settings {
    pub ucx: Vec<(String, String)>,
    pub op_timeout: Duration,
    pub identity: u64,
    pub instance: u64,
    pub err_mode: ErrMode,
    pub keepalive: Duration,
    pub proc: ProcId,
    /// Only shared-memory transports (no peer error handling in UCX 1.13).
    pub shm_only: bool,
    /// Transfers go as active messages (the receiver places the bytes) instead of puts.
    pub am_data: bool,
    /// The cluster secret: every connection authenticates with it (see the crate docs).
    pub secret: Option<Secret>,
    /// Shared-memory segment size in effect ([`crate::mmseg`]); peers on this host must match. 0:
    /// no shared-memory transport opens.
    pub mm_seg: u64,
    /// `idle=event`: the context has `UCP_FEATURE_WAKEUP` and an idle thread sleeps on the worker's
    /// event descriptor; otherwise it naps [`COLD_NAP`] at a time.
    pub wakeup: bool,
}

/// Which UCX error handling mode endpoints use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ErrMode {
    Auto,
    Peer,
    None,
}

/// What the API side and the progress thread share.
pub(crate) struct Shared {
    pub regions: RegionTable,
    pub events: EventQueue,
    pub worker: Mutex<Vec<u8>>,
    pub meta: Mutex<BTreeMap<RegionId, RegionMeta>>,
    pub cmds: Mutex<std::sync::mpsc::Sender<Cmd>>,
    /// Set once the progress thread has shut down (every region was closed then).
    pub closed: AtomicBool,
    /// Notifications refused because their key was not the identity their connection proved.
    pub forged: AtomicU64,
    /// Messages dropped because their sender had not authenticated (with a secret).
    pub unauthenticated: AtomicU64,
    /// Messages dropped because their sender's instance was cut off.
    pub cut_dropped: AtomicU64,
    /// The progress thread sleeps on the worker's event descriptor (see the module docs).
    pub parked: AtomicBool,
    /// Wakes it (set once the worker exists; a no-op once it is destroyed).
    pub waker: std::sync::OnceLock<Arc<Waker>>,
}

impl Shared {
    /// Queues a command for the progress thread and wakes it if it sleeps.
    pub fn send(&self, cmd: Cmd) -> Result<(), BackendError> {
        lock(&self.cmds).send(cmd).map_err(|_| BackendError::Closed { backend: NAME })?;
        // Pairs with the fence in `Engine::sleep`: either the thread sees this command before it
        // sleeps, or this sees it parked and signals.
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.parked.load(Ordering::SeqCst) {
            if let Some(w) = self.waker.get() {
                w.signal();
            }
        }
        Ok(())
    }
}

/// A connected peer as the API side sees it.
pub(crate) struct PeerShared {
    pub identity: u64,
    /// The peer's regions and their lengths (a revoked region disappears).
    pub regions: Mutex<HashMap<RegionId, u64>>,
    pub lost: Mutex<Option<String>>,
}

/// A transfer, validated by `post`.
pub(crate) struct Post {
    pub peer: PeerId,
    pub job: u64,
    pub segs: Vec<Segment>,
    pub srcs: Vec<RegionRef>,
    pub notify: Option<Vec<u8>>,
    pub state: Arc<TransferState>,
}

type Reply<T = ()> = oneshot::Sender<Result<T, BackendError>>;

/// A command for the progress thread.
pub(crate) enum Cmd {
    Register { id: RegionId, desc: MemDesc, reply: Reply },
    Close { id: RegionId, drained: Drained, reply: Option<Reply> },
    Connect { pid: PeerId, shared: Arc<PeerShared>, identity: u64, payload: Payload, reply: Reply },
    Post(Box<Post>),
    Abort { peer: PeerId, job: u64 },
    Notify { peer: PeerId, bytes: Vec<u8>, reply: Reply },
    Disconnect { peer: PeerId, reply: Reply },
    CutOff { peer: PeerId, reason: String, reply: Reply<CutOff> },
    Shutdown,
}

/// How long a cut-off waits for this endpoint's own requests to the peer that may still read our
/// memory (puts), at most (and at most the operation timeout).
const CUT_OFF_WAIT: Duration = Duration::from_secs(30);
/// How long a closing endpoint is polled before it is let go.
const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// A peer instance this endpoint cut off.
struct CutInfo {
    /// Its worker address (to tell it once that it is refused).
    addr: Option<Vec<u8>>,
    /// It was told (after its first message since the cut-off).
    told: bool,
    /// Its revokes to acknowledge once our transfers to it are final (`None`: they are; answer at
    /// once).
    acks: Option<Vec<u64>>,
    /// Nothing it sends can land here: every connection it made to us said it writes with active
    /// messages, which this endpoint places itself (and drops from a cut-off instance).
    confirmable: bool,
    /// Its process, to notice it exit.
    proc: Option<ProcId>,
    /// It said goodbye with the shutdown flag: it ended its side of every connection (as for a
    /// peer not cut off, closing regions stop waiting for it). Not proof that none of its puts is
    /// still on the way (they may be queued in its UCX behind the goodbye), so no confirmation.
    shut_down: bool,
    /// Its process exited (boot id, pid and start time through `/proc`): it transmits nothing
    /// more; what it transmitted before is placed by our progress.
    dead: bool,
    /// `dead`, and our worker was progressed until it had nothing left to do afterwards: every put
    /// the instance ever transmitted is placed.
    drained: bool,
}

impl CutInfo {
    /// Nothing the instance sent or will send can land here any more.
    fn confirmed(&self) -> bool {
        self.confirmable || self.drained
    }

    /// Closing regions no longer wait for its acknowledgement.
    fn done_with(&self) -> bool {
        self.confirmed() || self.shut_down
    }
}

/// A cut-off waiting for our own requests to the peer that may still read our memory.
struct CutWait {
    reply: Option<Reply<CutOff>>,
    deadline: Instant,
    instance: u64,
    /// Put requests (and flushes) still in flight: the device or UCX may still read their source.
    reqs: Vec<Request>,
    /// The peer's jobs, made final (failed) once `reqs` are done.
    jobs: Vec<Job>,
    /// Disconnects of the peer under way, answered then too.
    disconnects: Vec<Reply>,
    why: String,
    closed: usize,
    failed: usize,
}

fn ffi(e: UcxError, peer: &str) -> BackendError {
    BackendError::Ffi {
        backend: NAME,
        call: e.call,
        code: i64::from(e.status),
        detail: format!("{}; {peer}", e.text()),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A registered local region: its UCX registration, or nothing for a zero-length region.
type Local = Option<Rc<MemHandle>>;

/// A peer's region, as we can write it.
struct Remote {
    addr: u64,
    rkey: Option<Rc<RemoteKey>>,
}

/// Who is told when a job is final.
enum Done {
    State(Arc<TransferState>),
    Reply(Reply),
}

/// How a job ended.
enum Outcome {
    Done,
    Aborted,
    Failed(BackendError),
}

/// One transfer or out-of-band notification on a peer's endpoint.
///
/// A job starts posting once every earlier job of its peer has posted all its pieces, posts at
/// most [`WINDOW`] requests at a time, then seals: the put path posts a flush (remote completion)
/// and, after it, the attached notification (in job order per peer); the active-message path
/// posts a commit and waits for the receiver's acknowledgement. Abort stops the posting, cancels
/// what UCX can cancel, and waits for that flush or acknowledgement: the fence.
struct Job {
    id: u64,
    done: Option<Done>,
    segs: VecDeque<Segment>,
    srcs: HashMap<RegionId, RegionRef>,
    maps: HashMap<RegionId, Rc<MemHandle>>,
    dsts: HashMap<RegionId, Rc<Remote>>,
    /// The last (source, destination) pair `post_put` looked up: consecutive pieces mostly share
    /// their regions, so most pieces skip both lookups. Cleared with `dsts` entries on a revoke.
    hot: Option<(RegionId, RegionId, Rc<MemHandle>, Rc<Remote>)>,
    reqs: Vec<Request>,
    started: bool,
    posted: bool,
    flush: Option<Request>,
    flushed: bool,
    am: Option<(Vec<u8>, Vec<u8>)>,
    am_sent: bool,
    am_req: Option<Request>,
    /// Active-message path: the sequence number of this job's commit.
    seq: Option<u64>,
    /// Active-message path: the receiver's answer (`Ok(aborted)` or the refusal).
    acked: Option<Result<bool, String>>,
    notify: Option<Vec<u8>>,
    abort: bool,
    error: Option<BackendError>,
    deadline: Option<Instant>,
    /// Pieces posted since the progress loop last looked: the loop keeps going without a nap
    /// while a transfer is posting (posting alone makes `ucp_worker_progress` report nothing
    /// when puts complete in the call, as UCX 1.13's emulated puts over shared memory do once
    /// copied into the peer's FIFO).
    worked: bool,
}

impl Job {
    fn new(id: u64, done: Done) -> Self {
        Self {
            id,
            done: Some(done),
            segs: VecDeque::new(),
            srcs: HashMap::new(),
            maps: HashMap::new(),
            dsts: HashMap::new(),
            hot: None,
            reqs: Vec::new(),
            started: false,
            posted: false,
            flush: None,
            flushed: false,
            am: None,
            am_sent: false,
            am_req: None,
            seq: None,
            acked: None,
            notify: None,
            abort: false,
            error: None,
            deadline: None,
            worked: false,
        }
    }

    fn fail(&mut self, e: BackendError) {
        self.error.get_or_insert(e);
    }

    fn quiet(&self) -> bool {
        self.reqs.is_empty() && self.flush.is_none() && self.am_req.is_none()
    }

    /// Whether this job's notification is still to be posted (later ones wait for it).
    fn am_waiting(&self) -> bool {
        self.am.is_some() && self.done.is_some() && !self.abort && self.error.is_none()
    }

    fn finish(&mut self, o: Outcome) {
        self.segs.clear();
        self.am = None;
        match self.done.take() {
            Some(Done::State(s)) => {
                match o {
                    Outcome::Done => s.complete(),
                    Outcome::Aborted => s.aborted(),
                    Outcome::Failed(e) => s.fail(e),
                };
            }
            Some(Done::Reply(r)) => {
                let _ = r.send(match o {
                    Outcome::Done => Ok(()),
                    Outcome::Aborted => Err(BackendError::Closed { backend: NAME }),
                    Outcome::Failed(e) => Err(e),
                });
            }
            None => {}
        }
    }
}

/// What one job poll needs from its peer.
struct Ctx<'a> {
    ep: &'a Endpoint,
    desc: &'a str,
    am_data: bool,
    may_start: bool,
    may_post_am: bool,
    headers: &'a Headers,
}

/// The headers this endpoint sends.
struct Headers {
    data: Vec<u8>,
    commit: Vec<u8>,
    commit_aborted: Vec<u8>,
}

impl Job {
    fn poll(&mut self, c: &Ctx<'_>) {
        let mut errs = Vec::new();
        self.reqs.retain(|r| match r.poll("ucp_put_nbx/ucp_am_send_nbx") {
            None => true,
            Some(Ok(())) => false,
            Some(Err(e)) => {
                errs.push(e);
                false
            }
        });
        if let Some(r) = self.flush.as_ref().and_then(|f| f.poll("ucp_ep_flush_nbx")) {
            self.flush = None;
            self.flushed = true;
            if let Err(e) = r {
                errs.push(e);
            }
        }
        if let Some(r) = self.am_req.as_ref().and_then(|a| a.poll("ucp_am_send_nbx")) {
            self.am_req = None;
            if let Err(e) = r {
                errs.push(e);
            }
        }
        for e in errs {
            self.fail(ffi(e, c.desc));
        }
        if self.done.is_none() {
            return;
        }
        if !self.started && c.may_start {
            self.started = true;
        }
        if self.started && !self.posted {
            self.post_pieces(c);
        }
        // The put path's attached notification (or an out-of-band one): after the flush, in order.
        if self.posted && self.flushed && self.reqs.is_empty() && c.may_post_am && self.am_waiting() {
            if let Some((h, d)) = self.am.take() {
                self.am_sent = true;
                match c.ep.am_send(h, d) {
                    Ok(Posted::Done) => {}
                    Ok(Posted::Pending(r)) => self.am_req = Some(r),
                    Err(e) => self.fail(ffi(e, c.desc)),
                }
            }
        }
        if self.deadline.is_some_and(|d| Instant::now() >= d) && self.error.is_none() {
            self.fail(BackendError::Timeout {
                backend: NAME,
                what: format!("notification to {}", c.desc),
                after: Duration::ZERO,
            });
        }
        if !(self.posted && self.quiet()) {
            return;
        }
        if c.am_data && self.seq.is_some() {
            // Active-message path: final on the receiver's acknowledgement (the fence).
            match self.acked.take() {
                None => {}
                Some(Ok(aborted)) => self.finish(match (&self.error, aborted) {
                    (Some(e), _) => Outcome::Failed(e.clone()),
                    (None, true) => Outcome::Aborted,
                    (None, false) => Outcome::Done,
                }),
                Some(Err(reason)) => self.finish(Outcome::Failed(BackendError::Protocol {
                    backend: NAME,
                    peer: c.desc.to_owned(),
                    detail: reason,
                })),
            }
            return;
        }
        if !self.flushed {
            return;
        }
        if let Some(e) = self.error.clone() {
            self.finish(if self.abort { Outcome::Aborted } else { Outcome::Failed(e) });
        } else if self.abort && !self.am_sent {
            self.finish(Outcome::Aborted);
        } else if self.am.is_none() {
            self.finish(Outcome::Done);
        }
    }

    /// Posts pieces within the window; seals the job when none is left (or it stopped).
    fn post_pieces(&mut self, c: &Ctx<'_>) {
        let mut burst = 0;
        while !self.segs.is_empty() && self.reqs.len() < WINDOW && !self.abort && self.error.is_none() {
            if burst == BURST {
                // Let the loop see incoming messages (revokes) and commands (aborts) in between.
                return;
            }
            burst += 1;
            self.worked = true;
            let r = if c.am_data { self.post_data(c) } else { self.post_put(c) };
            match r {
                Ok(Posted::Done) => {}
                Ok(Posted::Pending(r)) => self.reqs.push(r),
                Err(e) => self.fail(e),
            }
        }
        if !(self.segs.is_empty() || self.abort || self.error.is_some()) {
            return;
        }
        self.posted = true;
        self.segs.clear();
        if self.abort {
            for r in &self.reqs {
                r.cancel();
            }
        }
        if c.am_data && self.seq.is_some() {
            let seq = self.seq.expect("checked");
            let stop = self.abort || self.error.is_some();
            let mut body = seq.to_le_bytes().to_vec();
            let header = if stop { c.headers.commit_aborted.clone() } else { c.headers.commit.clone() };
            if !stop {
                body.extend_from_slice(&self.notify.take().unwrap_or_default());
            }
            match c.ep.am_send(header, body) {
                Ok(Posted::Done) => {}
                Ok(Posted::Pending(r)) => self.reqs.push(r),
                Err(e) => {
                    // No acknowledgement will come: the job ends when its requests do.
                    self.seq = None;
                    self.flushed = true;
                    self.fail(ffi(e, c.desc));
                }
            }
        } else if !self.flushed {
            match c.ep.flush() {
                Ok(Posted::Done) => self.flushed = true,
                Ok(Posted::Pending(r)) => self.flush = Some(r),
                Err(e) => {
                    self.flushed = true;
                    self.fail(ffi(e, c.desc));
                }
            }
        }
    }

    fn post_put(&mut self, c: &Ctx<'_>) -> Result<Posted, BackendError> {
        let s = self.segs.pop_front().expect("checked");
        if !matches!(&self.hot, Some((src, dst, ..)) if *src == s.src && *dst == s.dst) {
            let (Some(memh), Some(dst)) = (self.maps.get(&s.src), self.dsts.get(&s.dst)) else {
                return Ok(Posted::Done);
            };
            self.hot = Some((s.src, s.dst, memh.clone(), dst.clone()));
        }
        let (_, _, memh, dst) = self.hot.as_ref().expect("just set");
        let Some(rkey) = &dst.rkey else { return Ok(Posted::Done) };
        // SAFETY (of the call below, see `Endpoint::put`): the job holds the source registration
        // and its RegionRef until it is final, which is after the flush posted when it seals;
        // the destination range was checked against the region the peer published, and the peer
        // keeps it mapped until we acknowledged its revoke, which we do only after a flush of
        // this endpoint completed.
        #[allow(unsafe_code)]
        let r = unsafe { c.ep.put(memh, s.src_offset, s.len, dst.addr + s.dst_offset, rkey) };
        r.map_err(|e| ffi(e, c.desc))
    }

    /// Active-message path: posts one data message of the next pieces, copied out of the source
    /// memory under read guards into one buffer. (A gathered send straight from the source memory,
    /// UCP's iov datatype, measured no faster over UCX 1.13's tcp transport at 4-16 KiB pieces and
    /// 0.4-0.6x this at 32 KiB to 1 MiB, where UCX sends the iov piecewise.)
    fn post_data(&mut self, c: &Ctx<'_>) -> Result<Posted, BackendError> {
        let mut m = wire::DataMsg::new(self.seq.expect("active-message jobs have a seq"));
        while let Some(s) = self.segs.front_mut() {
            let n = (s.len as usize).min(m.room());
            if n == 0 {
                break;
            }
            let src = self.srcs.get(&s.src).ok_or(BackendError::UnknownRegion {
                backend: NAME,
                region: s.src,
                peer: None,
            })?;
            let g = src.desc().read_guard(s.src_offset, n as u64).map_err(|e| BackendError::Io {
                backend: NAME,
                context: format!("reading {} for {}", s.src, c.desc),
                detail: e.to_string(),
            })?;
            m.push_bytes(s.dst.0, s.dst_offset, g.as_slice());
            s.len -= n as u64;
            s.src_offset += n as u64;
            s.dst_offset += n as u64;
            if s.len == 0 {
                self.segs.pop_front();
            }
        }
        c.ep.am_send(c.headers.data.clone(), m.finish()).map_err(|e| ffi(e, c.desc))
    }
}

/// A peer we connected to.
struct Peer {
    identity: u64,
    instance: u64,
    /// Its worker address.
    addr: Vec<u8>,
    proc: ProcId,
    shared: Arc<PeerShared>,
    remote: HashMap<RegionId, Rc<Remote>>,
    lost: Option<String>,
    jobs: VecDeque<Job>,
    /// Waiting for the welcome: (nonce, reply, deadline).
    connecting: Option<(u64, Reply, Instant)>,
    /// Our challenge nonce of the hello (the authentication exchange).
    challenge: [u8; NONCE_BYTES],
    /// The peer proved the cluster secret (or there is none, or it is ourselves).
    authed: bool,
    /// The disconnect waiting for this peer's jobs: (reply, deadline, goodbye flush).
    closing: Option<(Reply, Instant, Option<Request>, bool)>,
    ep: Rc<Endpoint>,
    /// How errors name this peer (`desc(pid, identity)`), made once: the progress loop polls the
    /// peer every turn.
    desc: String,
}

fn desc(id: PeerId, identity: u64) -> String {
    format!("{id} (identity {identity:#x})")
}

impl Peer {
    fn set_lost(&mut self, reason: String) {
        self.ep.mark_failed();
        *lock(&self.shared.lost) = Some(reason.clone());
        self.lost.get_or_insert(reason);
    }

    /// Advances the jobs in order; returns whether any is in flight.
    fn poll(&mut self, am_data: bool, headers: &Headers) -> bool {
        self.poll_jobs(am_data, headers).0
    }

    /// [`Peer::poll`], also returning whether any job posted pieces.
    fn poll_jobs(&mut self, am_data: bool, headers: &Headers) -> (bool, bool) {
        let d = &self.desc;
        if let Some(reason) = self.lost.clone() {
            // Nothing can land at a lost peer any more; UCX may never complete its requests
            // (error mode none). Answer every job now; requests are freed when the job goes.
            for j in self.jobs.iter_mut() {
                let e = BackendError::PeerLost { backend: NAME, peer: d.clone(), detail: reason.clone() };
                j.finish(if j.abort { Outcome::Aborted } else { Outcome::Failed(e) });
            }
            self.jobs.clear();
            return (false, false);
        }
        let mut may_start = true;
        let mut may_post_am = true;
        let mut worked = false;
        for j in self.jobs.iter_mut() {
            let c = Ctx { ep: &self.ep, desc: d, am_data, may_start, may_post_am, headers };
            j.poll(&c);
            worked |= std::mem::take(&mut j.worked);
            may_start &= j.posted || j.done.is_none();
            may_post_am &= !j.am_waiting();
        }
        let before = self.jobs.len();
        self.jobs.retain(|j| !(j.done.is_none() && j.quiet()));
        // A job that went lets the next one post (or send its notification) on the next turn.
        worked |= self.jobs.len() != before;
        (!self.jobs.is_empty(), worked)
    }
}

/// An endpoint back to a peer that connected to us (from its hello): how we answer it, revoke
/// regions at it, and notice it going away. `refs` counts its connections to us.
struct Reverse {
    identity: u64,
    proc: ProcId,
    /// Its worker address (from its hello).
    addr: Vec<u8>,
    ep: Rc<Endpoint>,
    refs: u32,
    /// With a secret: the peer proved it on one of its connections (its messages are applied
    /// only then). Without a secret: always.
    authed: bool,
}

/// A connection whose authentication is under way: the challenge was sent, the proof not yet
/// received. Keyed by (instance, hello nonce).
struct PendingAuth {
    exchange: Exchange,
    deadline: Instant,
}

/// A local region being closed.
struct Closing {
    id: RegionId,
    drained: Option<Drained>,
    seq: u64,
    /// Instances that must acknowledge the revoke (`None`: not sent yet).
    waiting: Option<HashSet<u64>>,
    reply: Option<Reply>,
    deadline: Instant,
}

/// A revoke we received: acknowledged once these flushes completed.
struct PendingAck {
    instance: u64,
    seq: u64,
    flushes: Vec<Request>,
    ep: Option<Rc<Endpoint>>,
}

enum Token {
    Forward(PeerId),
    Reverse(u64),
}

/// The progress thread's state. Field order is drop order: peers (remote keys, endpoints) first,
/// then registrations, the worker, the context.
struct Engine {
    /// The worker's event descriptor, while the thread may sleep on it.
    efd: Option<std::os::fd::RawFd>,
    peers: BTreeMap<PeerId, Peer>,
    reverse: HashMap<u64, Reverse>,
    acks: Vec<PendingAck>,
    loose: Vec<Request>,
    closes: Vec<Closing>,
    locals: HashMap<RegionId, Local>,
    worker: Rc<Worker>,
    ctx: Rc<Context>,
    tokens: HashMap<u64, Token>,
    next_token: u64,
    next_seq: u64,
    lost_instances: HashSet<u64>,
    last_liveness: Instant,
    /// A transfer posted pieces (or one finished) in the last [`Engine::poll_all`]: no nap.
    worked: bool,
    /// Active-message path, receiving side: transfers that could not be placed, by (instance, seq).
    refused: HashMap<(u64, u64), String>,
    /// Connections waiting for the connector's proof, by (instance, hello nonce).
    pending: HashMap<(u64, u64), PendingAuth>,
    /// Instances refused for the endpoint's lifetime (they sent a forged notification).
    banned: HashSet<u64>,
    /// Instances cut off ([`Engine::cut_off`]): nothing of theirs is applied any more.
    cut: HashMap<u64, CutInfo>,
    /// Our peer ids of cut-off instances.
    cut_pids: HashMap<PeerId, u64>,
    /// Instances that said hello without `am`: they write into our memory with `ucp_put_nbx`.
    put_instances: HashSet<u64>,
    /// Instances that said goodbye with the shutdown flag.
    shut_down: HashSet<u64>,
    /// Instances whose process exited.
    dead: HashSet<u64>,
    /// Cut-offs waiting for our own puts to the peer.
    cut_waits: Vec<CutWait>,
    /// Endpoints whose close is under way, polled until done or their deadline.
    closing_eps: Vec<(ClosingEndpoint, Instant)>,
    headers: Headers,
    settings: Settings,
    shared: Arc<Shared>,
}

/// Starts the progress thread; returns once the worker exists, with whether the context can
/// register CUDA memory.
pub(crate) fn start(
    settings: Settings,
    rx: Receiver<Cmd>,
    shared: Arc<Shared>,
) -> Result<(std::thread::JoinHandle<()>, bool), BackendError> {
    let (init_tx, init_rx) = std::sync::mpsc::sync_channel::<Result<bool, BackendError>>(1);
    let handle = std::thread::Builder::new()
        .name(format!("kvxfer-ucx-{:x}", settings.identity))
        .spawn(move || {
            let built = (|| -> Result<Engine, BackendError> {
                let ctx =
                    Context::new(&settings.ucx, settings.wakeup).map_err(|e| ffi(e, "creating the local context"))?;
                let worker = Worker::new(&ctx).map_err(|e| ffi(e, "creating the local worker"))?;
                *lock(&shared.worker) = worker.address().map_err(|e| ffi(e, "local worker"))?;
                let h = |kind, flags| {
                    Header { kind, flags, instance: settings.instance, identity: settings.identity }.encode()
                };
                let headers = Headers {
                    data: h(Kind::Data, 0),
                    commit: h(Kind::Commit, 0),
                    commit_aborted: h(Kind::Commit, COMMIT_ABORTED),
                };
                let efd = match settings.wakeup.then(|| worker.event_fd()).transpose() {
                    Ok(Some(fd)) => {
                        let _ = shared.waker.set(worker.waker());
                        Some(fd)
                    }
                    Ok(None) => None,
                    Err(e) => {
                        tracing::debug!("ucx: no worker event descriptor ({}: {}); idle polling", e.call, e.text());
                        None
                    }
                };
                Ok(Engine {
                    efd,
                    peers: BTreeMap::new(),
                    reverse: HashMap::new(),
                    acks: Vec::new(),
                    loose: Vec::new(),
                    closes: Vec::new(),
                    locals: HashMap::new(),
                    worker,
                    ctx,
                    tokens: HashMap::new(),
                    next_token: 1,
                    next_seq: 1,
                    lost_instances: HashSet::new(),
                    last_liveness: Instant::now(),
                    worked: false,
                    refused: HashMap::new(),
                    pending: HashMap::new(),
                    banned: HashSet::new(),
                    cut: HashMap::new(),
                    cut_pids: HashMap::new(),
                    put_instances: HashSet::new(),
                    shut_down: HashSet::new(),
                    dead: HashSet::new(),
                    cut_waits: Vec::new(),
                    closing_eps: Vec::new(),
                    headers,
                    settings,
                    shared,
                })
            })();
            match built {
                Ok(mut engine) => {
                    let _ = init_tx.send(Ok(engine.ctx.supports_cuda()));
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
        Ok(Ok(cuda)) => Ok((handle, cuda)),
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
            let in_flight = self.poll_all();
            busy |= std::mem::take(&mut self.worked);
            let now = Instant::now();
            if now.duration_since(self.last_liveness) >= self.settings.keepalive {
                self.last_liveness = now;
                self.check_liveness();
            }
            if busy {
                last_busy = now;
                if in_flight {
                    // Let the peer's UCX work through what this turn handed it before we poll
                    // again. Without this pause, once the turn itself got cheaper (no string
                    // built per turn), the emulated shared-memory puts got 25-30% slower on a
                    // busy 2-core host (the sender's back-to-back turns contend with the
                    // receiver, which does the second copy); with it, 5-8% faster than before.
                    for _ in 0..BUSY_PAUSES {
                        std::hint::spin_loop();
                    }
                }
                continue;
            }
            let quiet = now.duration_since(last_busy);
            if quiet < SPIN {
                std::thread::yield_now();
                continue;
            }
            if !in_flight && quiet >= HOT && self.efd.is_some() {
                match self.sleep(rx) {
                    Some(Ok(cmd)) => {
                        if matches!(cmd, Cmd::Shutdown) {
                            return;
                        }
                        self.handle(cmd);
                        last_busy = Instant::now();
                    }
                    Some(Err(())) => return,
                    None => {}
                }
                continue;
            }
            let nap = if in_flight || quiet < HOT { NAP } else { COLD_NAP };
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

    /// Sleeps on the worker's event descriptor until network activity, a command or [`COLD`].
    /// Returns a command that was already queued (`Some(Err)`: the channel closed), or `None`
    /// after the sleep (the caller progresses again).
    fn sleep(&mut self, rx: &Receiver<Cmd>) -> Option<Result<Cmd, ()>> {
        let efd = self.efd?;
        self.shared.parked.store(true, Ordering::SeqCst);
        // Pairs with the fence in `Shared::send`.
        std::sync::atomic::fence(Ordering::SeqCst);
        let queued = match rx.try_recv() {
            Ok(cmd) => Some(Ok(cmd)),
            Err(TryRecvError::Disconnected) => Some(Err(())),
            Err(TryRecvError::Empty) => None,
        };
        if queued.is_none() {
            match self.worker.arm() {
                Ok(true) => {
                    if let Err(e) = ucp::wait_readable(efd, COLD) {
                        tracing::warn!("ucx: waiting on the worker's event descriptor failed ({e}); polling instead");
                        self.efd = None;
                    }
                }
                // Events pending: progress first.
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!("ucx: {} failed: {}; polling instead of sleeping", e.call, e.text());
                    self.efd = None;
                }
            }
        }
        self.shared.parked.store(false, Ordering::SeqCst);
        queued
    }

    /// Progresses the worker until it has nothing more to do (bounded), then handles every event
    /// the callbacks queued. Returns whether anything happened.
    fn progress_all(&mut self) -> bool {
        let mut any = false;
        for _ in 0..1024 {
            if self.worker.progress() == 0 {
                break;
            }
            any = true;
        }
        for e in self.worker.take_events() {
            any = true;
            match e {
                Event::Message(m) => self.on_message(m),
                Event::EpError(token, status) => self.on_ep_error(token, status),
                Event::DroppedRndv => {
                    tracing::warn!("ucx: dropped a rendezvous active message (kvxfer peers send eager)")
                }
            }
        }
        any
    }

    fn emit_lost(&mut self, instance: u64, identity: u64, reason: String) {
        if self.lost_instances.insert(instance) {
            self.shared.events.push(BackendEvent::PeerLost { identity, reason });
        }
    }

    fn on_ep_error(&mut self, token: u64, status: ucp::Status) {
        let text = ucp::status_text(status);
        match self.tokens.get(&token) {
            Some(Token::Forward(pid)) => {
                let pid = *pid;
                if let Some(p) = self.peers.get_mut(&pid) {
                    let reason = format!("UCX reported the endpoint failed: {text}");
                    p.set_lost(reason.clone());
                    if let Some((_, reply, _)) = p.connecting.take() {
                        let _ = reply.send(Err(BackendError::Connect {
                            backend: NAME,
                            peer: format!("identity {:#x}", p.identity),
                            detail: reason,
                        }));
                    } else if p.closing.is_none() {
                        let (inst, ident) = (p.instance, p.identity);
                        self.emit_lost(inst, ident, format!("{}: {reason}", desc(pid, ident)));
                    }
                }
            }
            Some(Token::Reverse(instance)) => {
                let instance = *instance;
                if let Some(r) = self.reverse.remove(&instance) {
                    r.ep.mark_failed();
                    self.pending.retain(|(i, _), _| *i != instance);
                    let reason =
                        format!("peer with identity {:#x}: UCX reported the endpoint failed: {text}", r.identity);
                    if r.authed {
                        self.emit_lost(instance, r.identity, reason);
                    }
                }
            }
            None => tracing::debug!("ucx: error {text} on an endpoint that is already gone"),
        }
    }

    fn on_message(&mut self, m: ucp::AmMessage) {
        let h = match Header::decode(&m.header) {
            Ok(h) => h,
            Err(e) => return tracing::warn!("ucx: dropping an active message: {e}"),
        };
        if self.cut.contains_key(&h.instance) {
            return self.on_cut_message(h, &m.data);
        }
        let bad = |what: &str| tracing::warn!(identity = h.identity, "ucx: dropping a malformed {what}");
        // The connect-time exchange: answers are matched to our hello by instance and nonce, and
        // the proofs in them decide.
        match h.kind {
            Kind::Hello => return self.on_hello(h, &m.data),
            Kind::Welcome => {
                return match wire::u64_at(&m.data, 0) {
                    Some(nonce) => self.on_welcome(h, nonce, &m.data[8..]),
                    None => bad("welcome"),
                }
            }
            Kind::Challenge => {
                return match wire::decode_challenge(&m.data) {
                    Ok((nonce, theirs, proof)) => self.on_challenge(h, nonce, theirs, &proof),
                    Err(e) => bad(&e),
                }
            }
            Kind::Auth => {
                return match wire::decode_auth(&m.data) {
                    Ok((nonce, proof)) => self.on_auth(h, nonce, &proof),
                    Err(e) => bad(&e),
                }
            }
            Kind::Refused => {
                return match wire::decode_refused(&m.data) {
                    Ok((nonce, reason)) => self.on_refused(h, nonce, reason),
                    Err(e) => bad(&e),
                }
            }
            _ => {}
        }
        // Everything else is applied only from a peer that authenticated, under the identity it
        // proved (with a secret; without one every sender is taken at its word).
        let Some(proved) = self.sender(&h) else {
            self.shared.unauthenticated.fetch_add(1, Ordering::Relaxed);
            return tracing::debug!(
                identity = h.identity,
                instance = h.instance,
                "ucx: dropping a {:?} message from a peer that has not authenticated",
                h.kind
            );
        };
        if h.identity != proved {
            let what = format!("sent a {:?} message under identity {:#x}", h.kind, h.identity);
            return self.refuse_forged(h.instance, proved, what);
        }
        match h.kind {
            Kind::Attached | Kind::OutOfBand => {
                self.deliver(h, &m.data);
            }
            Kind::Data => self.on_data(h, &m.data),
            Kind::Commit => self.on_commit(h, &m.data),
            Kind::Ack => self.on_ack(h, &m.data),
            Kind::Revoke => match (wire::u64_at(&m.data, 0), wire::u32_at(&m.data, 8)) {
                (Some(seq), Some(id)) => self.on_revoke(h.instance, seq, RegionId(id)),
                _ => bad("revoke"),
            },
            Kind::RevokeAck => match wire::u64_at(&m.data, 0) {
                Some(seq) => self.on_revoke_ack(h.instance, seq),
                None => bad("revoke acknowledgement"),
            },
            Kind::Goodbye => self.on_goodbye(h),
            Kind::Hello | Kind::Welcome | Kind::Challenge | Kind::Auth | Kind::Refused => {}
        }
    }

    /// The identity the sender of `h` proved: with a secret, only an instance that authenticated
    /// (as the peer of a connection we accepted, or one we made) or ourselves; without one, the
    /// identity the header claims.
    fn sender(&self, h: &Header) -> Option<u64> {
        if self.settings.secret.is_none() {
            return Some(h.identity);
        }
        if self.banned.contains(&h.instance) {
            return None;
        }
        if h.instance == self.settings.instance {
            return Some(self.settings.identity);
        }
        if let Some(r) = self.reverse.get(&h.instance).filter(|r| r.authed) {
            return Some(r.identity);
        }
        self.peers.values().find(|p| p.instance == h.instance && p.authed && p.lost.is_none()).map(|p| p.identity)
    }

    /// Delivers a notification from an authenticated sender; with a secret, one whose key is not
    /// the identity the sender proved fails its connection instead. Returns whether it was
    /// delivered (or undecodable and dropped).
    fn deliver(&mut self, h: Header, body: &[u8]) -> bool {
        match Notification::decode(body) {
            Ok(n) if self.settings.secret.is_some() && !n.is_from(h.identity) => {
                let what = format!("keyed a notification of {} with sender key {:#x}", n.request, n.sender.to_u64());
                self.refuse_forged(h.instance, h.identity, what);
                return false;
            }
            Ok(n) => self.shared.events.push(BackendEvent::Notification(n)),
            Err(e) => tracing::warn!(identity = h.identity, "ucx: dropping an undecodable notification: {e}"),
        }
        true
    }

    /// A peer that proved `identity` broke the binding (a forged notification): nothing more of it
    /// is applied, it is told why, every connection with it is failed, and `PeerLost` reported.
    fn refuse_forged(&mut self, instance: u64, identity: u64, what: String) {
        self.shared.forged.fetch_add(1, Ordering::Relaxed);
        let reason = format!(
            "forged notification refused: the peer proved identity {identity:#x} but {what}; its connection was closed"
        );
        tracing::warn!("ucx: {reason}");
        self.banned.insert(instance);
        if let Some(ep) = self.ep_to(instance) {
            self.send_loose(&ep, self.header(Kind::Refused, 0), wire::encode_refused(0, &reason));
        }
        // Dropped without marking it failed: the endpoint flushes the refusal before it closes.
        if let Some(r) = self.reverse.remove(&instance) {
            self.tokens.retain(|_, t| !matches!(t, Token::Reverse(i) if *i == instance));
            drop(r);
        }
        self.pending.retain(|(i, _), _| *i != instance);
        for p in self.peers.values_mut().filter(|p| p.instance == instance && p.lost.is_none()) {
            p.set_lost(reason.clone());
        }
        self.emit_lost(instance, identity, reason);
    }

    fn on_hello(&mut self, h: Header, body: &[u8]) {
        let hello = match serde_json::from_slice::<Hello>(body)
            .map_err(|e| e.to_string())
            .and_then(|x| Ok((x.nonce, wire::unhex(&x.worker)?, x.proc, wire::unhex(&x.challenge)?, x.mm_seg, x.am)))
        {
            Ok(x) => x,
            Err(e) => return tracing::warn!(identity = h.identity, "ucx: dropping a malformed hello: {e}"),
        };
        let (nonce, addr, proc, challenge, mm_seg, am) = hello;
        if !am {
            // It may write into our memory with puts, which no cut-off of ours can stop.
            self.put_instances.insert(h.instance);
        }
        if proc.host == self.settings.proc.host && !crate::mmseg::compatible(self.settings.mm_seg, mm_seg) {
            let why = crate::mmseg::mismatch(self.settings.mm_seg, mm_seg);
            return self.refuse_hello(h, &addr, nonce, &why);
        }
        if let Some(secret) = self.settings.secret.clone() {
            return self.on_hello_authenticated(h, nonce, &addr, proc, &challenge, &secret);
        }
        self.lost_instances.remove(&h.instance);
        if let Some(r) = self.reverse.get_mut(&h.instance) {
            r.refs += 1;
        } else if self.open_reverse(h, &addr, proc, true).is_none() {
            return;
        }
        self.welcome(h.instance, nonce);
    }

    /// Opens the endpoint back to a connecting peer (its first connection to us).
    fn open_reverse(&mut self, h: Header, addr: &[u8], proc: ProcId, authed: bool) -> Option<Rc<Endpoint>> {
        let token = self.token(Token::Reverse(h.instance));
        match self.open_ep(addr, token) {
            Ok(ep) => {
                let reverse =
                    Reverse { identity: h.identity, proc, addr: addr.to_vec(), ep: ep.clone(), refs: 1, authed };
                self.reverse.insert(h.instance, reverse);
                Some(ep)
            }
            Err(e) => {
                self.tokens.remove(&token);
                tracing::warn!(
                    identity = h.identity,
                    "ucx: cannot answer a connecting peer: {} failed: {}",
                    e.call,
                    e.text()
                );
                None
            }
        }
    }

    /// The welcome lists the regions registered now; it goes on the endpoint later revokes take,
    /// so the peer never holds a key we closed without telling it.
    fn welcome(&mut self, instance: u64, nonce: u64) {
        let mut body = nonce.to_le_bytes().to_vec();
        for (id, _) in self.shared.regions.snapshot() {
            body.extend_from_slice(&id.0.to_le_bytes());
        }
        let ep = self.reverse[&instance].ep.clone();
        self.send_loose(&ep, self.header(Kind::Welcome, 0), body);
    }

    /// Answers a hello that is refused before any state is kept for it: on a short-lived endpoint
    /// to the address it gave (closed after a flush).
    fn refuse_hello(&mut self, h: Header, addr: &[u8], nonce: u64, reason: &str) {
        tracing::warn!(identity = h.identity, "ucx: refusing a connection: {reason}");
        self.send_once(addr, self.header(Kind::Refused, 0), wire::encode_refused(nonce, reason));
    }

    /// Sends one message on a short-lived endpoint to the worker at `addr`, closed (after the
    /// message left) without blocking the loop.
    fn send_once(&mut self, addr: &[u8], header: Vec<u8>, body: Vec<u8>) {
        let token = self.token(Token::Reverse(u64::MAX));
        if let Ok(ep) = self.open_ep(addr, token) {
            self.send_loose(&ep, header, body);
            match Rc::try_unwrap(ep) {
                Ok(ep) => {
                    // Flushed: the message goes before the endpoint.
                    if let Some(c) = ep.close_nb(false) {
                        self.closing_eps.push((c, Instant::now() + CLOSE_WAIT));
                    }
                }
                Err(rc) => drop(rc),
            }
        }
        self.tokens.remove(&token);
    }

    /// With a secret: a hello starts the exchange (see [`Exchange`]). Nothing of the peer is applied
    /// until its proof arrived and verified; the pending exchange expires after the operation
    /// timeout.
    fn on_hello_authenticated(
        &mut self,
        h: Header,
        nonce: u64,
        addr: &[u8],
        proc: ProcId,
        challenge: &[u8],
        secret: &Secret,
    ) {
        if self.banned.contains(&h.instance) {
            let why = format!(
                "this endpoint refuses identity {:#x} (instance {:#x}) after a forged notification",
                h.identity, h.instance
            );
            return self.refuse_hello(h, addr, nonce, &why);
        }
        let Ok(connector_nonce) = <[u8; NONCE_BYTES]>::try_from(challenge) else {
            let why = format!(
                "authentication required: this endpoint has a cluster secret and the connecting endpoint sent no                  challenge (a build without authentication?); {AUTH_FIX}"
            );
            return self.refuse_hello(h, addr, nonce, &why);
        };
        if self.pending.len() >= MAX_PENDING_AUTH {
            let why = format!("{MAX_PENDING_AUTH} connections are already authenticating; try again");
            return self.refuse_hello(h, addr, nonce, &why);
        }
        if self.reverse.get(&h.instance).is_some_and(|r| r.identity != h.identity) {
            let why = format!("instance {:#x} already connected under another identity", h.instance);
            return self.refuse_hello(h, addr, nonce, &why);
        }
        let acceptor_nonce = match kvxfer_core::secret::nonce() {
            Ok(n) => n,
            Err(e) => return tracing::warn!("ucx: no nonce for a connecting peer: {e}"),
        };
        self.lost_instances.remove(&h.instance);
        let ep = match self.reverse.get_mut(&h.instance) {
            Some(r) => {
                r.refs += 1;
                r.ep.clone()
            }
            None => match self.open_reverse(h, addr, proc, false) {
                Some(ep) => ep,
                None => return,
            },
        };
        let exchange = wire::exchange(
            connector_nonce,
            acceptor_nonce,
            (h.identity, h.instance),
            (self.settings.identity, self.settings.instance),
        );
        let body = wire::encode_challenge(nonce, &acceptor_nonce, &exchange.acceptor_proof(secret));
        let deadline = Instant::now() + self.settings.op_timeout;
        self.pending.insert((h.instance, nonce), PendingAuth { exchange, deadline });
        self.send_loose(&ep, self.header(Kind::Challenge, 0), body);
    }

    /// The connector's proof (with a secret): the connection is admitted (welcome) or refused.
    fn on_auth(&mut self, h: Header, nonce: u64, proof: &[u8]) {
        let (Some(secret), Some(p)) = (self.settings.secret.clone(), self.pending.remove(&(h.instance, nonce))) else {
            return tracing::debug!(identity = h.identity, "ucx: dropping an auth message no challenge asked for");
        };
        if !self.reverse.contains_key(&h.instance) {
            return;
        }
        if h.identity == p.exchange.connector.0 && p.exchange.verify_connector(&secret, proof) {
            if let Some(r) = self.reverse.get_mut(&h.instance) {
                r.authed = true;
            }
            self.welcome(h.instance, nonce);
            return;
        }
        let why = format!(
            "authentication failed: the connecting endpoint (identity {:#x}) did not prove this endpoint's cluster              secret; {AUTH_FIX}",
            h.identity
        );
        tracing::warn!("ucx: {why}");
        let ep = self.reverse[&h.instance].ep.clone();
        self.send_loose(&ep, self.header(Kind::Refused, 0), wire::encode_refused(nonce, &why));
        self.release_reverse(h.instance);
    }

    /// One connection of `instance` ended before it authenticated: the endpoint back to it goes
    /// with its last connection.
    fn release_reverse(&mut self, instance: u64) {
        if let Some(r) = self.reverse.get_mut(&instance) {
            r.refs = r.refs.saturating_sub(1);
            if r.refs == 0 {
                self.reverse.remove(&instance);
            }
        }
    }

    /// Expires exchanges whose proof did not come in time.
    fn expire_pending(&mut self) {
        let now = Instant::now();
        let expired: Vec<(u64, u64)> =
            self.pending.iter().filter(|(_, p)| now >= p.deadline).map(|(k, _)| *k).collect();
        for k in expired {
            self.pending.remove(&k);
            tracing::debug!(instance = k.0, "ucx: a connecting peer did not authenticate in time");
            self.release_reverse(k.0);
        }
    }

    /// Fails a connect still waiting for its answer, and forgets the peer.
    fn fail_connect(&mut self, pid: PeerId, detail: String) {
        let Some(mut p) = self.peers.remove(&pid) else { return };
        if let Some((_, reply, _)) = p.connecting.take() {
            let _ = reply.send(Err(BackendError::Connect {
                backend: NAME,
                peer: format!("identity {:#x}", p.identity),
                detail,
            }));
        }
        // Tell the peer this connection ends (a peer without a secret counts it), then close.
        self.send_loose(&p.ep.clone(), self.header(Kind::Goodbye, 0), Vec::new());
        self.tokens.retain(|_, t| !matches!(t, Token::Forward(x) if *x == pid));
        drop(p);
    }

    /// The connecting peer with `instance` waiting for the answer to hello `nonce`.
    fn connecting(&self, instance: u64, nonce: u64) -> Option<PeerId> {
        self.peers
            .iter()
            .find(|(_, p)| p.instance == instance && p.connecting.as_ref().is_some_and(|(n, _, _)| *n == nonce))
            .map(|(pid, _)| *pid)
    }

    /// The acceptor's challenge: verify its proof (it has our secret), then prove ours.
    fn on_challenge(&mut self, h: Header, nonce: u64, theirs: [u8; NONCE_BYTES], proof: &[u8]) {
        let Some(pid) = self.connecting(h.instance, nonce) else {
            return tracing::debug!(identity = h.identity, "ucx: dropping a challenge for no connect of ours");
        };
        let Some(secret) = self.settings.secret.clone() else {
            let why =
                format!("authentication required: the peer has a cluster secret and this endpoint none; {AUTH_FIX}");
            return self.fail_connect(pid, why);
        };
        let p = &self.peers[&pid];
        let exchange = wire::exchange(
            p.challenge,
            theirs,
            (self.settings.identity, self.settings.instance),
            (p.identity, p.instance),
        );
        if h.identity != p.identity || !exchange.verify_acceptor(&secret, proof) {
            let why = format!(
                "authentication failed: the peer did not prove this endpoint's cluster secret (the secrets differ);                  {AUTH_FIX}"
            );
            return self.fail_connect(pid, why);
        }
        let body = wire::encode_auth(nonce, &exchange.connector_proof(&secret));
        let header = self.header(Kind::Auth, 0);
        let p = self.peers.get_mut(&pid).expect("found above");
        p.authed = true;
        let ep = p.ep.clone();
        self.send_loose(&ep, header, body);
    }

    /// A refusal: of our connect (matched by nonce), or of an established connection (nonce 0,
    /// from a peer that authenticated, or any peer without a secret).
    fn on_refused(&mut self, h: Header, nonce: u64, reason: &str) {
        if let Some(pid) = self.connecting(h.instance, nonce) {
            return self.fail_connect(pid, format!("the peer refused the connection: {reason}"));
        }
        let Some(identity) = self.sender(&h).filter(|_| nonce == 0) else { return };
        let why = format!("the peer with identity {identity:#x} closed the connection: {reason}");
        let mut any = false;
        for p in self.peers.values_mut().filter(|p| p.instance == h.instance && p.lost.is_none()) {
            p.set_lost(why.clone());
            any = true;
        }
        if any {
            self.emit_lost(h.instance, identity, why);
        }
    }

    fn on_welcome(&mut self, h: Header, nonce: u64, ids: &[u8]) {
        let Some(pid) = self.connecting(h.instance, nonce) else { return };
        if self.settings.secret.is_some() && !self.peers[&pid].authed {
            let why = format!("authentication failed: the peer has no cluster secret and cannot prove one; {AUTH_FIX}");
            return self.fail_connect(pid, why);
        }
        let keep: HashSet<RegionId> =
            ids.chunks_exact(4).map(|c| RegionId(u32::from_le_bytes(c.try_into().expect("4 bytes")))).collect();
        let p = self.peers.get_mut(&pid).expect("found above");
        let (_, reply, _) = p.connecting.take().expect("checked");
        p.remote.retain(|id, _| keep.contains(id));
        lock(&p.shared.regions).retain(|id, _| keep.contains(id));
        let _ = reply.send(Ok(()));
    }

    fn on_goodbye(&mut self, h: Header) {
        let shutdown = h.flags & GOODBYE_SHUTDOWN != 0;
        if let Some(r) = self.reverse.get_mut(&h.instance) {
            r.refs = r.refs.saturating_sub(1);
            if shutdown || r.refs == 0 {
                // The peer closes its side: no close handshake with it.
                r.ep.mark_failed();
                self.reverse.remove(&h.instance);
            }
        }
        if shutdown {
            self.shut_down.insert(h.instance);
            for p in self.peers.values_mut().filter(|p| p.instance == h.instance && p.lost.is_none()) {
                p.set_lost("the peer endpoint shut down".into());
            }
            let reason = format!("peer with identity {:#x} shut down its UCX endpoint", h.identity);
            self.emit_lost(h.instance, h.identity, reason);
        }
    }

    /// A peer closes one of its regions: forget the key, stop posting into it, flush every
    /// endpoint to it, and acknowledge once those flushes completed (no put into the region is
    /// then in flight, and none will follow).
    fn on_revoke(&mut self, instance: u64, seq: u64, id: RegionId) {
        let mut flushes = Vec::new();
        let mut ep = None;
        for (pid, p) in self.peers.iter_mut().filter(|(_, p)| p.instance == instance) {
            p.remote.remove(&id);
            lock(&p.shared.regions).remove(&id);
            // Every job that could still post into the region, started or still queued (a queued
            // job already holds the region's key): its puts after our acknowledgement would land
            // in memory the peer considers closed.
            for j in p.jobs.iter_mut().filter(|j| !j.posted && j.dsts.contains_key(&id)) {
                j.dsts.remove(&id);
                j.hot = None;
                j.fail(BackendError::UnknownRegion { backend: NAME, region: id, peer: Some(*pid) });
            }
            if p.lost.is_none() {
                match p.ep.flush() {
                    Ok(Posted::Pending(r)) => flushes.push(r),
                    Ok(Posted::Done) => {}
                    Err(e) => tracing::debug!("ucx: flush for a revoke failed: {}", e.text()),
                }
                ep.get_or_insert_with(|| p.ep.clone());
            }
        }
        let ep = ep.or_else(|| self.reverse.get(&instance).map(|r| r.ep.clone()));
        self.acks.push(PendingAck { instance, seq, flushes, ep });
    }

    fn on_revoke_ack(&mut self, instance: u64, seq: u64) {
        for c in self.closes.iter_mut().filter(|c| c.seq == seq) {
            if let Some(w) = &mut c.waiting {
                w.remove(&instance);
            }
        }
    }

    /// Active-message path: places the bytes of a data message into registered memory, checking
    /// every segment against the region registered now (anything else is refused, never placed).
    fn on_data(&mut self, h: Header, body: &[u8]) {
        let (seq, segs) = match wire::decode_data(body) {
            Ok(x) => x,
            Err(e) => return tracing::warn!(identity = h.identity, "ucx: dropping a malformed data message: {e}"),
        };
        if self.refused.contains_key(&(h.instance, seq)) {
            return;
        }
        for (region, off, bytes) in segs {
            let id = RegionId(region);
            let r = self.shared.regions.get(id, None).map_err(|e| e.to_string()).and_then(|r| {
                let mut g = r.desc().write_guard(off, bytes.len() as u64).map_err(|e| e.to_string())?;
                g.as_mut_slice().copy_from_slice(bytes);
                Ok(())
            });
            if let Err(e) = r {
                self.refused.insert((h.instance, seq), format!("write into {id} refused by the receiver: {e}"));
                return;
            }
        }
    }

    /// Active-message path: a transfer ended; deliver its notification and acknowledge on the
    /// endpoint back to the sender (the acknowledgement of an aborted commit is the abort fence).
    fn on_commit(&mut self, h: Header, body: &[u8]) {
        let Some(seq) = wire::u64_at(body, 0) else {
            return tracing::warn!(identity = h.identity, "ucx: dropping a malformed commit");
        };
        let aborted = h.flags & COMMIT_ABORTED != 0;
        let refused = self.refused.remove(&(h.instance, seq));
        if refused.is_none() && !aborted && body.len() > 8 && !self.deliver(h, &body[8..]) {
            // A forged notification: the connection was failed, nothing is acknowledged.
            return;
        }
        let mut ack = seq.to_le_bytes().to_vec();
        match &refused {
            None => ack.push(if aborted { 2 } else { 1 }),
            Some(reason) => {
                ack.push(0);
                ack.extend_from_slice(reason.as_bytes());
            }
        }
        let ep = self.ep_to(h.instance);
        match ep {
            Some(ep) => self.send_loose(&ep, self.header(Kind::Ack, 0), ack),
            None => {
                tracing::warn!(identity = h.identity, "ucx: cannot acknowledge a transfer: no endpoint to the sender")
            }
        }
    }

    /// Active-message path, sending side: the receiver placed (or refused) transfer `seq`.
    fn on_ack(&mut self, h: Header, body: &[u8]) {
        let (Some(seq), Some(&status)) = (wire::u64_at(body, 0), body.get(8)) else {
            return tracing::warn!(identity = h.identity, "ucx: dropping a malformed acknowledgement");
        };
        let reason = String::from_utf8_lossy(&body[9..]).into_owned();
        for p in self.peers.values_mut().filter(|p| p.instance == h.instance) {
            for j in p.jobs.iter_mut().filter(|j| j.seq == Some(seq)) {
                j.acked = Some(if status == 0 { Err(reason.clone()) } else { Ok(status == 2) });
            }
        }
    }

    /// An endpoint to `instance`: one we connected with, else the one back from its hello.
    fn ep_to(&self, instance: u64) -> Option<Rc<Endpoint>> {
        self.reverse
            .get(&instance)
            .map(|r| r.ep.clone())
            .or_else(|| self.peers.values().find(|p| p.instance == instance && p.lost.is_none()).map(|p| p.ep.clone()))
    }

    fn send_loose(&mut self, ep: &Endpoint, header: Vec<u8>, body: Vec<u8>) {
        match ep.am_send(header, body) {
            Ok(Posted::Pending(r)) => self.loose.push(r),
            Ok(Posted::Done) => {}
            Err(e) => tracing::debug!("ucx: sending a control message failed: {} {}", e.call, e.text()),
        }
    }

    fn open_ep(&mut self, addr: &[u8], token: u64) -> Result<Rc<Endpoint>, UcxError> {
        match self.settings.err_mode {
            ErrMode::Peer => Endpoint::connect(&self.worker, addr, token, true),
            ErrMode::None => Endpoint::connect(&self.worker, addr, token, false),
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
            if !p.ep.peer_errors() && p.lost.is_none() && p.proc.alive(&me) == Some(false) {
                p.set_lost(format!("peer process {} exited", p.proc.pid));
                if p.connecting.is_none() && p.closing.is_none() {
                    let reason = format!("{}: its process {} exited", desc(*pid, p.identity), p.proc.pid);
                    lost.push((p.instance, p.identity, reason));
                }
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
                r.ep.mark_failed();
                self.pending.retain(|(x, _), _| *x != i);
                if !r.authed {
                    continue;
                }
                lost.push((
                    i,
                    r.identity,
                    format!("peer with identity {:#x}: its process {} exited", r.identity, r.proc.pid),
                ));
            }
        }
        for (instance, identity, reason) in lost {
            self.dead.insert(instance);
            self.emit_lost(instance, identity, reason);
        }
        for c in self.cut.values_mut().filter(|c| !c.dead) {
            if c.proc.as_ref().is_some_and(|p| p.alive(&me) == Some(false)) {
                c.dead = true;
            }
        }
    }

    /// A message from a cut-off instance: nothing of it is applied. A hello is refused (its
    /// connect fails at once); the first other message since the cut-off gets a refusal, so the
    /// instance fails its transfers to us instead of waiting for acknowledgements.
    fn on_cut_message(&mut self, h: Header, body: &[u8]) {
        self.shared.cut_dropped.fetch_add(1, Ordering::Relaxed);
        let why = cut_refusal(h.identity, h.instance);
        if h.kind == Kind::Hello {
            if let Ok(x) = serde_json::from_slice::<Hello>(body) {
                if let Ok(addr) = wire::unhex(&x.worker) {
                    self.refuse_hello(h, &addr, x.nonce, &why);
                }
            }
            return;
        }
        let Some(c) = self.cut.get_mut(&h.instance) else { return };
        match h.kind {
            Kind::Goodbye if h.flags & GOODBYE_SHUTDOWN != 0 => c.shut_down = true,
            Kind::Revoke => {
                // It closes a region: we write nothing into it any more (every transfer to it
                // failed), which the acknowledgement says once those transfers are final.
                let Some(seq) = wire::u64_at(body, 0) else { return };
                match &mut c.acks {
                    Some(later) => later.push(seq),
                    None => {
                        if let Some(addr) = c.addr.clone() {
                            self.send_once(&addr, self.header(Kind::RevokeAck, 0), seq.to_le_bytes().to_vec());
                        }
                    }
                }
            }
            Kind::RevokeAck | Kind::Refused | Kind::Goodbye => {}
            _ => {
                if std::mem::replace(&mut c.told, true) {
                    return;
                }
                if let Some(addr) = c.addr.clone() {
                    self.refuse_hello(h, &addr, 0, &why);
                }
            }
        }
    }

    /// Cuts off the instance `pid` is connected to (see the crate README, "Cutting a peer off"):
    /// from this call on nothing of it is applied (every message of it is dropped before it is
    /// looked at: no data is placed, no notification delivered, no hello admitted); every endpoint
    /// to it (ours and the one back to it) is closed; every transfer to it fails. Answered once no
    /// put of ours to it is in flight: `Ok` when every connection it made to us said it writes
    /// with active messages, else `Unsupported` (its `ucp_put_nbx` writes cannot be refused here).
    fn cut_off(&mut self, pid: PeerId, reason: &str, reply: Reply<CutOff>) {
        let instance = match (self.peers.get(&pid), self.cut_pids.get(&pid)) {
            (Some(p), _) => p.instance,
            (None, Some(i)) => {
                let r = match self.cut.get(i) {
                    Some(c) if c.confirmed() => Ok(CutOff { closed: 0, failed_transfers: 0, how: "already cut off" }),
                    _ => Err(unconfirmed(*i)),
                };
                return drop(reply.send(r));
            }
            (None, None) => return drop(reply.send(Err(BackendError::UnknownPeer { backend: NAME, peer: pid }))),
        };
        if instance == self.settings.instance {
            return drop(reply.send(Err(BackendError::Unsupported {
                backend: NAME,
                what: "cutting off this endpoint itself (a connection to itself)".into(),
            })));
        }
        let why = format!("cut off: {reason}");
        tracing::info!(instance, %reason, "ucx: cutting off a peer instance");
        let confirmable = !self.put_instances.contains(&instance);
        let proc = self.peers.values().find(|p| p.instance == instance).map(|p| p.proc.clone());
        let proc = proc.or_else(|| self.reverse.get(&instance).map(|r| r.proc.clone()));
        let me = self.settings.proc.clone();
        let shut_down = self.shut_down.contains(&instance);
        let dead = self.dead.contains(&instance) || proc.as_ref().is_some_and(|p| p.alive(&me) == Some(false));
        // No loss is reported for it any more: the caller gave up on it already.
        self.lost_instances.insert(instance);
        self.pending.retain(|(i, _), _| *i != instance);
        // Its revokes still waiting for our flushes: acknowledged once our transfers to it are final
        // (below), on an endpoint of their own (ours to it are closed).
        let revokes: Vec<u64> = self.acks.iter().filter(|a| a.instance == instance).map(|a| a.seq).collect();
        self.acks.retain(|a| a.instance != instance);
        self.refused.retain(|(i, _), _| *i != instance);
        let mut addr = None;
        let (mut closed, mut failed) = (0, 0);
        let (mut reqs, mut jobs, mut disconnects) = (Vec::new(), Vec::new(), Vec::new());
        let pids: Vec<PeerId> = self.peers.iter().filter(|(_, p)| p.instance == instance).map(|(k, _)| *k).collect();
        for q in pids {
            let Some(mut p) = self.peers.remove(&q) else { continue };
            self.cut_pids.insert(q, instance);
            self.tokens.retain(|_, t| !matches!(t, Token::Forward(x) if *x == q));
            addr.get_or_insert_with(|| p.addr.clone());
            *lock(&p.shared.lost) = Some(why.clone());
            if let Some((_, r, _)) = p.connecting.take() {
                let detail = cut_refusal(p.identity, instance);
                let _ = r.send(Err(BackendError::Connect { backend: NAME, peer: desc(q, p.identity), detail }));
            }
            if let Some((r, ..)) = p.closing.take() {
                disconnects.push(r);
            }
            for mut j in p.jobs.drain(..) {
                if matches!(j.done, Some(Done::State(_))) {
                    failed += 1;
                }
                j.segs.clear();
                j.am = None;
                // The remote keys go before the endpoint.
                j.dsts.clear();
                j.hot = None;
                if !self.settings.am_data {
                    // Puts may still read the source (pending in UCX, or zero-copy on the wire).
                    reqs.append(&mut j.reqs);
                    reqs.extend(j.flush.take());
                }
                // Active-message requests read only their own buffers (copied at post): released
                // with the job (a request still in flight keeps its buffers until UCX is done).
                j.reqs.clear();
                j.am_req = None;
                jobs.push(j);
            }
            p.remote.clear();
            let ep = p.ep.clone();
            drop(p);
            self.close_ep(ep);
            closed += 1;
        }
        if let Some(r) = self.reverse.remove(&instance) {
            addr.get_or_insert_with(|| r.addr.clone());
            self.tokens.retain(|_, t| !matches!(t, Token::Reverse(i) if *i == instance));
            self.close_ep(r.ep);
            closed += 1;
        }
        let info =
            CutInfo { addr, told: false, acks: Some(revokes), confirmable, proc, shut_down, dead, drained: false };
        self.cut.insert(instance, info);
        let deadline = Instant::now() + self.settings.op_timeout.min(CUT_OFF_WAIT);
        self.cut_waits.push(CutWait {
            reply: Some(reply),
            deadline,
            instance,
            reqs,
            jobs,
            disconnects,
            why,
            closed,
            failed,
        });
        self.poll_cut_offs();
    }

    /// Closes an endpoint without blocking the loop (force-closed in peer error mode).
    fn close_ep(&mut self, ep: Rc<Endpoint>) {
        ep.mark_failed();
        match Rc::try_unwrap(ep) {
            Ok(ep) => {
                if let Some(c) = ep.close_nb(true) {
                    self.closing_eps.push((c, Instant::now() + CLOSE_WAIT));
                }
            }
            // Still held (a control message under way): closed when the last holder lets go.
            Err(rc) => drop(rc),
        }
    }

    /// Answers cut-offs whose own puts are done (or past their deadline); polls closing endpoints.
    fn poll_cut_offs(&mut self) -> bool {
        let now = Instant::now();
        self.closing_eps.retain(|(c, deadline)| !c.done() && now < *deadline);
        if self.cut.values().any(|c| c.dead && !c.drained) {
            // A dead instance transmits nothing more: once the worker has nothing left to do, every
            // put it transmitted was placed (emulated puts are placed inside ucp_worker_progress).
            let drained = (0..100_000).any(|_| self.worker.progress() == 0);
            if drained {
                for c in self.cut.values_mut().filter(|c| c.dead) {
                    c.drained = true;
                }
            }
        }
        let cut = &mut self.cut;
        let mut acks = Vec::new();
        self.cut_waits.retain_mut(|w| {
            w.reqs.retain(|r| r.poll("ucp_put_nbx/ucp_ep_flush_nbx").is_none());
            if w.reqs.is_empty() {
                // Our transfers to it are final: its revokes can be acknowledged.
                if let Some(c) = cut.get_mut(&w.instance) {
                    if let (Some(later), Some(addr)) = (c.acks.take(), c.addr.clone()) {
                        acks.extend(later.into_iter().map(|seq| (addr.clone(), seq)));
                    }
                }
            }
            let settling = cut.get(&w.instance).is_some_and(|c| c.dead && !c.drained);
            if w.reqs.is_empty() && !settling {
                finish_cut_jobs(std::mem::take(&mut w.jobs), &w.why);
                for d in w.disconnects.drain(..) {
                    let _ = d.send(Ok(()));
                }
                if let Some(r) = w.reply.take() {
                    let confirmed = cut.get(&w.instance).is_some_and(CutInfo::confirmed);
                    let _ = r.send(if confirmed {
                        Ok(CutOff {
                            closed: w.closed,
                            failed_transfers: w.failed,
                            how: "instance refused (its messages dropped before they are applied: active-message \
                                  data placed by this endpoint only), endpoints closed",
                        })
                    } else {
                        Err(unconfirmed(w.instance))
                    });
                }
                return false;
            }
            if now >= w.deadline {
                if let Some(r) = w.reply.take() {
                    let _ = r.send(Err(BackendError::Timeout {
                        backend: NAME,
                        what: format!(
                            "{} put(s) of this endpoint to the cut-off instance {:#x} still in flight (they may still \
                             read their source memory)",
                            w.reqs.len(),
                            w.instance
                        ),
                        after: CUT_OFF_WAIT,
                    }));
                }
            }
            true
        });
        for (addr, seq) in acks {
            self.send_once(&addr, self.header(Kind::RevokeAck, 0), seq.to_le_bytes().to_vec());
        }
        !self.cut_waits.is_empty() || !self.closing_eps.is_empty()
    }

    fn token(&mut self, t: Token) -> u64 {
        let id = self.next_token;
        self.next_token += 1;
        self.tokens.insert(id, t);
        id
    }

    fn header(&self, kind: Kind, flags: u8) -> Vec<u8> {
        Header { kind, flags, instance: self.settings.instance, identity: self.settings.identity }.encode()
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Register { id, desc, reply } => {
                let _ = reply.send(self.register(id, desc));
            }
            Cmd::Close { id, drained, reply } => {
                let seq = self.next_seq;
                self.next_seq += 1;
                let deadline = Instant::now() + self.settings.op_timeout;
                self.closes.push(Closing { id, drained: Some(drained), seq, waiting: None, reply, deadline });
            }
            Cmd::Connect { pid, shared, identity, payload, reply } => {
                self.connect(pid, shared, identity, payload, reply)
            }
            Cmd::Post(p) => self.post(*p),
            Cmd::Abort { peer, job } => {
                if let Some(j) = self.peers.get_mut(&peer).and_then(|p| p.jobs.iter_mut().find(|j| j.id == job)) {
                    j.abort = true;
                }
            }
            Cmd::Notify { peer, bytes, reply } => {
                let header = self.header(Kind::OutOfBand, 0);
                let deadline = Instant::now() + self.settings.op_timeout;
                match self.peers.get_mut(&peer) {
                    Some(p) if p.closing.is_none() => {
                        let mut j = Job::new(0, Done::Reply(reply));
                        j.flushed = true;
                        j.am = Some((header, bytes));
                        j.deadline = Some(deadline);
                        p.jobs.push_back(j);
                    }
                    _ => drop(reply.send(Err(BackendError::UnknownPeer { backend: NAME, peer }))),
                }
            }
            Cmd::Disconnect { peer, reply } => match self.peers.get_mut(&peer) {
                Some(p) if p.closing.is_none() => {
                    p.closing = Some((reply, Instant::now() + self.settings.op_timeout, None, false));
                }
                _ => drop(reply.send(Err(BackendError::UnknownPeer { backend: NAME, peer }))),
            },
            Cmd::CutOff { peer, reason, reply } => self.cut_off(peer, &reason, reply),
            Cmd::Shutdown => {}
        }
    }

    fn register(&mut self, id: RegionId, desc: MemDesc) -> Result<(), BackendError> {
        if self.locals.contains_key(&id) || self.closes.iter().any(|c| c.id == id) {
            return Err(BackendError::RegionInUse { backend: NAME, region: id });
        }
        let (local, rkey) = if desc.is_empty() {
            (None, String::new())
        } else {
            let m = MemHandle::map(&self.ctx, &desc).map_err(|e| ffi(e, &format!("registering {id}")))?;
            let rkey = wire::hex(m.packed_rkey());
            (Some(Rc::new(m)), rkey)
        };
        // The table refuses a duplicate id or one over the limit; the mapping is undone then.
        self.shared.regions.insert(id, desc.clone())?;
        let meta = RegionMeta { id: id.0, addr: desc.addr() as u64, len: desc.len() as u64, rkey };
        lock(&self.shared.meta).insert(id, meta);
        self.locals.insert(id, local);
        Ok(())
    }

    fn connect(&mut self, pid: PeerId, shared: Arc<PeerShared>, identity: u64, payload: Payload, reply: Reply) {
        let d = desc(pid, identity);
        let fail =
            |detail: String| BackendError::Connect { backend: NAME, peer: format!("identity {identity:#x}"), detail };
        let bad = |detail: String| BackendError::BadMetadata { backend: NAME, detail };
        let worker_addr = match wire::unhex(&payload.worker) {
            Ok(a) if !a.is_empty() => a,
            Ok(_) => return drop(reply.send(Err(bad("empty worker address".into())))),
            Err(e) => return drop(reply.send(Err(bad(format!("worker address: {e}"))))),
        };
        if payload.proc.host == self.settings.proc.host
            && !crate::mmseg::compatible(self.settings.mm_seg, payload.mm_seg)
        {
            return drop(reply.send(Err(fail(crate::mmseg::mismatch(self.settings.mm_seg, payload.mm_seg)))));
        }
        if self.cut.contains_key(&payload.instance) {
            return drop(reply.send(Err(fail(cut_refusal(identity, payload.instance)))));
        }
        let token = self.token(Token::Forward(pid));
        let ep = match self.open_ep(&worker_addr, token) {
            Ok(ep) => ep,
            Err(e) => {
                self.tokens.remove(&token);
                return drop(reply.send(Err(fail(format!("{} failed: {}", e.call, e.text())))));
            }
        };
        let own = payload.instance == self.settings.instance;
        let mut remote = HashMap::new();
        let mut lens = HashMap::new();
        for r in &payload.regions {
            if own && !self.locals.contains_key(&RegionId(r.id)) {
                continue;
            }
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
            remote.insert(RegionId(r.id), Rc::new(Remote { addr: r.addr, rkey }));
            lens.insert(RegionId(r.id), r.len);
        }
        *lock(&shared.regions) = lens;
        let mut connecting = None;
        let mut challenge = [0u8; NONCE_BYTES];
        if own {
            // Connected to ourselves: the regions were filtered against our own table above.
            let _ = reply.send(Ok(()));
        } else {
            // Introduce ourselves; the connection is up when the peer's welcome arrives.
            let nonce: u64 = rand::random::<u64>().max(1);
            challenge = match kvxfer_core::secret::nonce() {
                Ok(n) => n,
                Err(e) => return drop(reply.send(Err(fail(format!("no challenge nonce: {e}"))))),
            };
            let body = Hello {
                nonce,
                worker: wire::hex(&lock(&self.shared.worker)),
                proc: self.settings.proc.clone(),
                challenge: wire::hex(&challenge),
                mm_seg: self.settings.mm_seg,
                am: self.settings.am_data,
            };
            let body = serde_json::to_vec(&body).expect("a hello always encodes");
            if let Err(e) = ep.am_send(self.header(Kind::Hello, 0), body).map(|p| match p {
                Posted::Pending(r) => self.loose.push(r),
                Posted::Done => {}
            }) {
                ep.mark_failed();
                return drop(reply.send(Err(fail(format!("{} failed: {}", e.call, e.text())))));
            }
            connecting = Some((nonce, reply, Instant::now() + self.settings.op_timeout));
        }
        let peer = Peer {
            identity,
            instance: payload.instance,
            addr: worker_addr,
            proc: payload.proc,
            shared,
            remote,
            lost: None,
            jobs: VecDeque::new(),
            connecting,
            challenge,
            authed: own || self.settings.secret.is_none(),
            closing: None,
            ep,
            desc: d,
        };
        self.peers.insert(pid, peer);
    }

    fn post(&mut self, p: Post) {
        let Post { peer, job, segs, srcs, notify, state } = p;
        let am_data = self.settings.am_data;
        let attached = self.header(Kind::Attached, 0);
        let Some(pe) = self.peers.get_mut(&peer) else {
            state.fail(BackendError::UnknownPeer { backend: NAME, peer });
            return;
        };
        if let Some(reason) = &pe.lost {
            let d = desc(peer, pe.identity);
            state.fail(BackendError::PeerLost { backend: NAME, peer: d, detail: reason.clone() });
            return;
        }
        let mut j = Job::new(job, Done::State(state));
        let mut last = None;
        for s in &segs {
            if last == Some((s.src, s.dst)) {
                continue;
            }
            last = Some((s.src, s.dst));
            if let std::collections::hash_map::Entry::Vacant(v) = j.dsts.entry(s.dst) {
                match pe.remote.get(&s.dst) {
                    Some(r) => drop(v.insert(r.clone())),
                    // Revoked after `post` checked it: nothing is posted.
                    None => {
                        j.error = Some(BackendError::UnknownRegion { backend: NAME, region: s.dst, peer: Some(peer) })
                    }
                }
            }
            if !am_data && !j.maps.contains_key(&s.src) {
                if let Some(Some(m)) = self.locals.get(&s.src) {
                    j.maps.insert(s.src, m.clone());
                }
            }
        }
        j.srcs = srcs.into_iter().map(|r| (r.id(), r)).collect();
        if j.error.is_some() {
            j.posted = true;
            j.flushed = true;
        } else {
            j.segs = segs.into();
            if am_data {
                j.seq = Some(self.next_seq);
                self.next_seq += 1;
                j.notify = notify;
            } else {
                j.am = notify.map(|n| (attached, n));
            }
        }
        pe.jobs.push_back(j);
    }

    /// Advances every peer, disconnect, region close and revoke acknowledgement; returns whether
    /// anything is in flight.
    fn poll_all(&mut self) -> bool {
        let am_data = self.settings.am_data;
        let mut in_flight = false;
        let mut gone = Vec::new();
        let now = Instant::now();
        let bye = self.header(Kind::Goodbye, 0);
        for (pid, p) in self.peers.iter_mut() {
            let (busy, worked) = p.poll_jobs(am_data, &self.headers);
            in_flight |= busy;
            self.worked |= worked;
            if let Some((_, _, deadline)) = &p.connecting {
                if now >= *deadline || p.lost.is_some() {
                    let (_, reply, _) = p.connecting.take().expect("checked");
                    let _ = reply.send(Err(BackendError::Timeout {
                        backend: NAME,
                        what: format!("connecting to {} (no welcome)", desc(*pid, p.identity)),
                        after: self.settings.op_timeout,
                    }));
                    p.set_lost("connecting failed".into());
                    gone.push(*pid);
                }
                in_flight = true;
                continue;
            }
            let Some((_, deadline, ..)) = &p.closing else { continue };
            in_flight = true;
            if now >= *deadline && !p.jobs.is_empty() {
                p.set_lost("disconnected before its transfers finished".into());
                p.poll(am_data, &self.headers);
            }
            let Some((_, deadline, flush, said_bye)) = &mut p.closing else { continue };
            if p.jobs.is_empty() && !*said_bye && p.lost.is_none() {
                // Tell the peer this connection ends, so it stops counting on us for revokes.
                *said_bye = true;
                if let Ok(Posted::Pending(r)) = p.ep.am_send(bye.clone(), Vec::new()) {
                    self.loose.push(r);
                }
                if let Ok(Posted::Pending(r)) = p.ep.flush() {
                    *flush = Some(r);
                }
            }
            let flushed = flush.as_ref().map_or(true, |f| f.poll("ucp_ep_flush_nbx").is_some());
            if p.jobs.is_empty() && (flushed || now >= *deadline || p.lost.is_some()) {
                gone.push(*pid);
            }
        }
        for pid in gone {
            if let Some(mut p) = self.peers.remove(&pid) {
                if let Some((reply, _, flush, _)) = p.closing.take() {
                    drop(flush);
                    let _ = reply.send(Ok(()));
                }
                if p.lost.is_some() {
                    p.ep.mark_failed();
                }
            }
        }
        self.loose.retain(|r| r.poll("ucp_am_send_nbx").is_none());
        // Revokes we received: acknowledge once their flushes completed.
        let ack = self.header(Kind::RevokeAck, 0);
        let mut i = 0;
        while i < self.acks.len() {
            self.acks[i].flushes.retain(|r| r.poll("ucp_ep_flush_nbx").is_none());
            if !self.acks[i].flushes.is_empty() {
                in_flight = true;
                i += 1;
                continue;
            }
            let a = self.acks.swap_remove(i);
            if a.instance == self.settings.instance {
                self.on_revoke_ack(a.instance, a.seq);
            } else if let Some(ep) = a.ep {
                self.send_loose(&ep, ack.clone(), a.seq.to_le_bytes().to_vec());
            }
        }
        in_flight |= self.poll_closes();
        in_flight |= self.poll_cut_offs();
        if !self.pending.is_empty() {
            self.expire_pending();
            in_flight = true;
        }
        in_flight || !self.loose.is_empty()
    }

    /// Advances region closes: drained of local operations, revoked at every connected peer,
    /// acknowledged (or the peer lost), then unmapped.
    fn poll_closes(&mut self) -> bool {
        let now = Instant::now();
        let me = self.settings.instance;
        let mut i = 0;
        while i < self.closes.len() {
            let c = &mut self.closes[i];
            if c.waiting.is_none() && c.drained.as_ref().is_some_and(|d| d.in_use() == 0) {
                let (id, seq) = (c.id, c.seq);
                let mut targets: HashSet<u64> = self.reverse.keys().copied().collect();
                let header = self.header(Kind::Revoke, 0);
                let mut body = seq.to_le_bytes().to_vec();
                body.extend_from_slice(&id.0.to_le_bytes());
                let eps: Vec<Rc<Endpoint>> = self.reverse.values().map(|r| r.ep.clone()).collect();
                for ep in eps {
                    self.send_loose(&ep, header.clone(), body.clone());
                }
                if self.peers.values().any(|p| p.instance == me) {
                    targets.insert(me);
                    self.on_revoke(me, seq, id);
                }
                self.closes[i].waiting = Some(targets);
            }
            let connected_to_me = self.peers.values().any(|p| p.instance == me && p.lost.is_none());
            let reverse = &self.reverse;
            let cut = &self.cut;
            let c = &mut self.closes[i];
            if let Some(w) = &mut c.waiting {
                // A cut-off instance whose puts could still land keeps the close waiting (it answers
                // nothing any more, so the close times out and the memory is not freed).
                let unconfirmed = |inst: &u64| cut.get(inst).is_some_and(|c| !c.done_with());
                w.retain(
                    |inst| {
                        if *inst == me {
                            connected_to_me
                        } else {
                            reverse.contains_key(inst) || unconfirmed(inst)
                        }
                    },
                );
                if w.is_empty() {
                    let c = self.closes.swap_remove(i);
                    // Unmapped when the last job holding it is gone (none: the region drained).
                    self.locals.remove(&c.id);
                    drop(c.drained);
                    if let Some(r) = c.reply {
                        let _ = r.send(Ok(()));
                    }
                    continue;
                }
            }
            if now >= c.deadline {
                if let Some(r) = c.reply.take() {
                    let what = match &c.waiting {
                        None => format!("closing {}: operations still hold it", c.id),
                        Some(w) => format!("closing {}: {} peer(s) did not acknowledge the revoke", c.id, w.len()),
                    };
                    let _ = r.send(Err(BackendError::Timeout { backend: NAME, what, after: self.settings.op_timeout }));
                }
            }
            i += 1;
        }
        !self.closes.is_empty()
    }

    fn shutdown(&mut self, rx: &Receiver<Cmd>) {
        self.efd = None;
        while let Ok(cmd) = rx.try_recv() {
            self.refuse(cmd);
        }
        // Close every region still registered: peers acknowledge they no longer write into it.
        for (id, _) in self.shared.regions.snapshot() {
            if let Ok(drained) = self.shared.regions.remove(id) {
                lock(&self.shared.meta).remove(&id);
                self.handle(Cmd::Close { id, drained, reply: None });
            }
        }
        self.shared.closed.store(true, Ordering::Release);
        let deadline = Instant::now() + SHUTDOWN_WAIT;
        while Instant::now() < deadline {
            self.progress_all();
            let busy = self.poll_all();
            // Endpoints closing after one message (refusals, acknowledgements) finish their close
            // too: a peer still answering such an endpoint's wireup when this worker is gone fails
            // to connect back, and UCX 1.13 aborts that peer's process on the reply it then purges
            // (ucp_request.c: "got REP message"; the assertion was removed in later UCX releases).
            let idle =
                self.closes.is_empty() && self.peers.values().all(|p| p.jobs.is_empty()) && self.closing_eps.is_empty();
            if !busy || idle {
                break;
            }
        }
        for c in self.closes.drain(..) {
            if let Some(r) = c.reply {
                let _ = r.send(Err(BackendError::Closed { backend: NAME }));
            }
        }
        for w in self.cut_waits.drain(..) {
            let CutWait { reply, reqs, jobs, disconnects, why, .. } = w;
            // The worker is going away: requests still in flight are released with it.
            drop(reqs);
            finish_cut_jobs(jobs, &why);
            if let Some(r) = reply {
                let _ = r.send(Err(BackendError::Closed { backend: NAME }));
            }
            for d in disconnects {
                let _ = d.send(Ok(()));
            }
        }
        let bye = self.header(Kind::Goodbye, GOODBYE_SHUTDOWN);
        let mut told = HashSet::new();
        let mut pending = Vec::new();
        let eps: Vec<(u64, Rc<Endpoint>)> = self
            .peers
            .values()
            .filter(|p| p.lost.is_none())
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
        for (_, ep) in &eps {
            ep.mark_failed();
        }
        drop(eps);
        for p in self.peers.values_mut() {
            p.set_lost("the endpoint shut down".into());
            p.poll(self.settings.am_data, &self.headers);
            if let Some((_, reply, _)) = p.connecting.take() {
                let _ = reply.send(Err(BackendError::Closed { backend: NAME }));
            }
            if let Some((reply, ..)) = p.closing.take() {
                let _ = reply.send(Ok(()));
            }
        }
        self.peers.clear();
        self.reverse.clear();
        self.acks.clear();
        self.loose.clear();
        while let Ok(cmd) = rx.try_recv() {
            self.refuse(cmd);
        }
    }

    fn refuse(&mut self, cmd: Cmd) {
        let closed = || BackendError::Closed { backend: NAME };
        match cmd {
            Cmd::Register { reply, .. }
            | Cmd::Connect { reply, .. }
            | Cmd::Notify { reply, .. }
            | Cmd::Disconnect { reply, .. } => drop(reply.send(Err(closed()))),
            Cmd::CutOff { reply, .. } => drop(reply.send(Err(closed()))),
            Cmd::Post(p) => drop(p.state.fail(closed())),
            // Region closes still go through the fence in shutdown.
            c @ Cmd::Close { .. } => self.handle(c),
            Cmd::Abort { .. } | Cmd::Shutdown => {}
        }
    }
}

/// Fails the jobs of a cut-off peer (an aborted one ends `Aborted`).
fn finish_cut_jobs(jobs: Vec<Job>, why: &str) {
    for mut j in jobs {
        let e = BackendError::PeerLost { backend: NAME, peer: "a cut-off peer".into(), detail: why.to_owned() };
        j.finish(if j.abort { Outcome::Aborted } else { Outcome::Failed(e) });
    }
}

fn cut_refusal(identity: u64, instance: u64) -> String {
    format!(
        "this endpoint cut off identity {identity:#x} instance {instance:#x} (it gave up on that peer); a restarted \
         process is a new instance and may connect"
    )
}

/// Why the cut-off of `instance` is not confirmed: it writes with puts.
fn unconfirmed(instance: u64) -> BackendError {
    BackendError::Unsupported {
        backend: NAME,
        what: format!(
            "confirming the cut-off of instance {instance:#x}: it writes into this endpoint with ucp_put_nbx \
             (data=put), and UCX 1.13 places those writes without a check this endpoint can make fail (emulated \
             puts: ucp_put_handler does not check the remote key, and takes the writes of an endpoint that was \
             closed; see the crate README, \"Cutting a peer off\"). Its connections are closed and it is refused, \
             but the memory it could write must stay quarantined; run every rank with data=am for cut-offs that \
             are confirmed"
        ),
    }
}
