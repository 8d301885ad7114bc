//! The prefill side's request book (SEMANTICS §7): every rule of a prefill rank's requests, sans-IO.
//!
//! [`CompletionTracker`](crate::tracker::CompletionTracker) holds the decode side's rules; this book
//! holds the prefill side's: which decode ranks handed off which pages under which generation, the
//! handoffs and aborts that came before the engine created the sender (kept, bounded in count and
//! age), the chunk and layer progress of what the engine gave to send, the outcome, and the fence
//! owed to every decode rank that asked to abort.
//!
//! Events go in (`create`, `handle_handoff`, `handle_abort`, `init`, `reserve_part`, `reserve_aux`,
//! `part_done`, `abort`, `abort_open`, `poll_deadlines`, `release`), with the time passed in; what to
//! do comes out as [`Action`]s ([`PrefillBook::poll_action`]): notifications to send, transfers to
//! cancel, outcomes to count. The book does no IO and keeps no clock. Its driver (the engine's
//! `Agent`) feeds it the backend's events and the engine's calls under one lock, carries out the
//! actions, and keeps per request one value of its own (`X`: its cancel signal and the task handles
//! of layer parts), stored beside the request so that a request lives in one place.
//!
//! The rules, in short (SEMANTICS §7 states them in full):
//! - A request's receivers are the decode ranks this rank feeds (the topology); it is ready
//!   (`WaitingForInput`) once every one handed off and the driver says its links are up.
//! - A handoff or abort for a room with no request yet is kept (at most `early_max`, at most
//!   `early_ttl` old) and applied when the request is created: the latest handoff of each decode
//!   rank, and an abort of that very handoff's generation fails the request at once.
//! - Each chunk goes to every receiver at the same offset of its page list; the chunk that reaches
//!   the total is the last; layer-wise parts of one chunk give the same source pages and finish the
//!   chunk when every layer of the stage was sent.
//! - The request succeeds when the last chunk was posted, nothing is in flight, every aux went out,
//!   and nothing failed. It fails on the first failure (a part, an abort from either side, a lost
//!   peer, the deadline); once nothing of it is in flight every receiver is told once: `Fenced` if it
//!   asked to abort, the failure otherwise.
//! - An abort from a decode rank is answered with `Fenced` as soon as nothing of the request can
//!   land there: at once when the request finished, failed and told, or never existed here; after
//!   the transfers in flight settled otherwise.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::ops::Range;
use std::time::{Duration, Instant};

use crate::digest;
use crate::model::{RankId, SenderKey};
use crate::notify::{Notification, NotificationBody, RequestId, MAX_PAYLOAD};
use crate::phase::Phase;

/// What the book needs to know of its rank and of the engine's bounds.
#[derive(Debug, Clone)]
pub struct BookConfig {
    /// This prefill rank.
    pub rank: RankId,
    /// The decode ranks this rank feeds (from the topology): every request waits for a handoff of each.
    pub receivers: Vec<RankId>,
    /// Layers of this rank's pipeline stage (layer-wise sends name stage-local layers below it).
    pub stage_layers: u32,
    /// A request without an outcome this long after its creation fails (`Deadline`).
    pub request_timeout: Duration,
    /// At most this many early handoffs and aborts are kept (the oldest goes first).
    pub early_max: usize,
    /// An early handoff or abort older than this is dropped.
    pub early_ttl: Duration,
}

/// Why a request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailCause {
    /// The engine aborted it ([`PrefillBook::abort`] with this cause).
    Aborted,
    /// A decode rank aborted it.
    AbortedByPeer,
    /// A decode rank it needs was lost.
    PeerLost,
    /// It had no outcome within the request timeout.
    Deadline,
    /// A transfer (or the aux delivery) failed.
    Transfer,
    /// Connecting to the decode ranks failed.
    Connect,
    /// The rank shut down.
    Shutdown,
}

/// One decode rank's page list for a request, as this prefill rank received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handoff {
    /// The decode rank's generation of the request (one use of the room).
    pub generation: u64,
    /// Its destination pages, in token order.
    pub pages: Vec<u32>,
    /// Its aux slot, when it wants aux data.
    pub aux_slot: Option<u32>,
    /// Whether it verifies a digest of what this rank writes there.
    pub digest: bool,
}

/// One receiver's share of a reserved part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartTarget {
    /// The decode rank.
    pub rank: RankId,
    /// Its generation (goes on the notification).
    pub generation: u64,
    /// Its destination pages for this chunk.
    pub dst_pages: Vec<u32>,
    /// Whether it verifies a digest.
    pub digest: bool,
}

/// A part the book accepted: the driver posts it to every target and reports it with
/// [`PrefillBook::part_done`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    /// The chunk index.
    pub chunk: u32,
    /// Whether the chunk is the request's last.
    pub last: bool,
    /// Whether this part finishes the chunk (its completion notification follows the writes). A
    /// layer-wise part that finishes a chunk goes after every earlier part of the chunk.
    pub finish: bool,
    /// Per receiver, where the part lands.
    pub targets: Vec<PartTarget>,
}

/// What the driver must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Send `note` to decode rank `to`. `after_link`: first wait (bounded) until this rank's own
    /// connection to `to` is up (a decode rank connects on its own, so its abort may arrive first,
    /// and a fence sent before would be dropped).
    Notify {
        /// The decode rank.
        to: RankId,
        /// The notification (failure, `Fenced`, digest).
        note: Notification,
        /// Whether to wait for the link first.
        after_link: bool,
    },
    /// Abort the request's transfers in flight (its cancel signal), with `reason`.
    Cancel {
        /// The request.
        room: RequestId,
        /// Why.
        reason: String,
    },
    /// The request succeeded here: every write completed, every aux went out.
    Succeeded {
        /// The request.
        room: RequestId,
        /// When its first part was posted (where the prefill latency starts), if any was.
        started: Option<Instant>,
        /// Its receivers: (decode rank, generation, digest asked).
        receivers: Vec<(RankId, u64, bool)>,
    },
    /// The request failed here and nothing of it is in flight; its receivers are told (the
    /// `Notify` actions queued beside this one).
    Failed {
        /// The request.
        room: RequestId,
        /// When its first part was posted, if any was.
        started: Option<Instant>,
        /// Why, as a cause.
        cause: FailCause,
        /// Why, in words (names this rank).
        why: String,
        /// Its receivers: (decode rank, generation, told `Fenced`).
        receivers: Vec<(RankId, u64, bool)>,
    },
}

/// Why the book refused an engine call; the call changed nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallError {
    /// No request under that room (released, or never created).
    Unknown,
    /// The room has a request already (release it first).
    RoomInUse,
    /// The call does not fit the request's state; says why and what to do.
    Refused(String),
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CallError::Unknown => f.write_str("the request was released; create a new sender"),
            CallError::RoomInUse => f.write_str("the room has a sender already; release it first"),
            CallError::Refused(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for CallError {}

/// A request's status on this rank, as either book reports it (the engine's `RequestStatus`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BookStatus {
    /// Where it stands.
    pub phase: Phase,
    /// Why it failed (`Aborting`, `Failed`).
    pub reason: Option<String>,
    /// Whether the request's pages may be reused: prefill: its source pages (nothing of it is in
    /// flight); decode: its destination pages (nothing of it can land any more).
    pub pages_reusable: bool,
}

impl BookStatus {
    fn of(phase: Phase, reason: Option<String>, pages_reusable: bool) -> Self {
        Self { phase, reason, pages_reusable }
    }
}

/// What a handoff did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandoffOutcome {
    /// From a decode rank this rank does not feed: dropped (a protocol error).
    NotFed,
    /// Joined its request.
    Attached,
    /// The same generation from the same rank again: nothing changed.
    Duplicate,
    /// Joined a request that failed and told its receivers already: the failure goes to it at once.
    AnsweredFailure,
    /// No request for it (yet): kept for one created later.
    Kept,
}

/// What an abort from a decode rank did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbortOutcome {
    /// The request was running: it failed; the fence follows once nothing of it is in flight.
    Aborted,
    /// Failed already with transfers in flight: the fence follows once they settle.
    FenceFollows,
    /// Nothing of it can land (finished, settled, or not started here): fenced at once.
    FencedNow,
}

/// Counters of the book.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BookStats {
    /// Handoffs kept for requests not created yet.
    pub early_kept: u64,
    /// Early handoffs and aborts dropped (too old, or beyond `early_max`).
    pub early_expired: u64,
    /// Handoffs from decode ranks this rank does not feed.
    pub not_fed: u64,
    /// Requests that succeeded.
    pub succeeded: u64,
    /// Requests that failed.
    pub failed: u64,
}

#[derive(Debug, Clone)]
enum EarlyBody {
    Handoff(Handoff),
    Abort { generation: u64, reason: String },
}

#[derive(Debug, Clone)]
struct Early {
    from: RankId,
    room: RequestId,
    body: EarlyBody,
    at: Instant,
}

#[derive(Debug, Clone)]
struct Req<X> {
    handoffs: BTreeMap<RankId, Handoff>,
    total: Option<u32>,
    sent_pages: u32,
    next_chunk: u32,
    /// Layer-wise: the chunk being sent (its source pages and the layers sent so far).
    layerwise: Option<(Vec<u32>, BTreeSet<u32>)>,
    outstanding: u32,
    last_posted: bool,
    aux_sent: bool,
    failure: Option<(String, FailCause)>,
    /// Decode ranks that asked to abort: they get `Fenced` once nothing is in flight.
    abort_from: BTreeSet<RankId>,
    /// Whether the failure went out to the receivers.
    told: bool,
    created: Instant,
    first_post: Option<Instant>,
    done: bool,
    digests: BTreeMap<RankId, Vec<u64>>,
    digests_sent: bool,
    io: X,
}

impl<X> Req<X> {
    fn open(&self) -> bool {
        !self.done && self.failure.is_none()
    }

    fn aux_ok(&self) -> bool {
        self.aux_sent || self.handoffs.values().all(|h| h.aux_slot.is_none())
    }
}

/// The prefill side's requests of one rank (see the module docs). `X` is the driver's own value per
/// request (given at [`Self::create`], reached with [`Self::io_mut`]).
#[derive(Debug, Clone)]
pub struct PrefillBook<X = ()> {
    cfg: BookConfig,
    reqs: HashMap<RequestId, Req<X>>,
    early: VecDeque<Early>,
    actions: VecDeque<Action>,
    stats: BookStats,
}

impl<X> PrefillBook<X> {
    /// An empty book.
    pub fn new(cfg: BookConfig) -> Self {
        Self {
            cfg,
            reqs: HashMap::new(),
            early: VecDeque::new(),
            actions: VecDeque::new(),
            stats: BookStats::default(),
        }
    }

    fn me(&self) -> SenderKey {
        SenderKey::of(self.cfg.rank)
    }

    fn keep_early(&mut self, e: Early) {
        while self.early.len() >= self.cfg.early_max.max(1) {
            self.early.pop_front();
            self.stats.early_expired += 1;
        }
        self.early.push_back(e);
    }

    /// Creates the request of `room` (the engine's sender) at `now`, with the driver's value `io`.
    /// The handoffs kept for the room join it (the latest of each decode rank); a kept abort of one
    /// of those handoffs fails it at once (the decode side was fenced then).
    pub fn create(&mut self, room: RequestId, io: X, now: Instant) -> Result<(), CallError> {
        if self.reqs.contains_key(&room) {
            return Err(CallError::RoomInUse);
        }
        let mut handoffs = BTreeMap::new();
        let mut aborts = Vec::new();
        self.early.retain(|e| {
            if e.room != room {
                return true;
            }
            match &e.body {
                EarlyBody::Handoff(h) => {
                    handoffs.insert(e.from, h.clone());
                }
                EarlyBody::Abort { generation, reason } => aborts.push((e.from, *generation, reason.clone())),
            }
            false
        });
        let mut q = Req {
            handoffs,
            total: None,
            sent_pages: 0,
            next_chunk: 0,
            layerwise: None,
            outstanding: 0,
            last_posted: false,
            aux_sent: false,
            failure: None,
            abort_from: BTreeSet::new(),
            told: false,
            created: now,
            first_post: None,
            done: false,
            digests: BTreeMap::new(),
            digests_sent: false,
            io,
        };
        for (d, generation, reason) in aborts {
            if q.handoffs.get(&d).is_some_and(|h| h.generation == generation) {
                q.abort_from.insert(d);
                if q.failure.is_none() {
                    let why = format!("prefill rank {}: decode rank {d} aborted the request: {reason}", self.cfg.rank);
                    q.failure = Some((why, FailCause::AbortedByPeer));
                }
            }
        }
        self.reqs.insert(room, q);
        self.settle(room);
        Ok(())
    }

    /// A handoff from decode rank `d` (its page list for `room` under `h.generation`), at `now`.
    pub fn handle_handoff(&mut self, d: RankId, room: RequestId, h: Handoff, now: Instant) -> HandoffOutcome {
        if !self.cfg.receivers.contains(&d) {
            self.stats.not_fed += 1;
            return HandoffOutcome::NotFed;
        }
        let rank = self.cfg.rank;
        let me = self.me();
        if let Some(q) = self.reqs.get_mut(&room) {
            match q.handoffs.get(&d) {
                None if q.open() => {
                    let generation = h.generation;
                    q.handoffs.insert(d, h);
                    // Its abort came first (it was fenced then): nothing may be sent for it.
                    let aborted = self.early.iter().find_map(|e| match &e.body {
                        EarlyBody::Abort { generation: g, reason }
                            if e.from == d && e.room == room && *g == generation =>
                        {
                            Some(reason.clone())
                        }
                        _ => None,
                    });
                    if let Some(why) = aborted {
                        q.abort_from.insert(d);
                        let why = format!("prefill rank {rank}: decode rank {d} aborted the request: {why}");
                        self.fail(room, why, FailCause::AbortedByPeer);
                    }
                    return HandoffOutcome::Attached;
                }
                // Failed here and lacks this rank's handoff: it belongs to this use; answer it with
                // the failure at once (once told) instead of leaving it to its deadline.
                None if !q.done => {
                    let generation = h.generation;
                    q.handoffs.insert(d, h);
                    if q.told {
                        let why = q.failure.as_ref().map(|f| f.0.clone()).unwrap_or_default();
                        let note =
                            Notification::new(room, me, NotificationBody::Failure(why)).with_generation(generation);
                        self.actions.push_back(Action::Notify { to: d, note, after_link: false });
                        return HandoffOutcome::AnsweredFailure;
                    }
                    return HandoffOutcome::Attached;
                }
                Some(old) if old.generation == h.generation => return HandoffOutcome::Duplicate,
                // Done, or another use of the room: kept for a later sender.
                _ => {}
            }
        }
        self.keep_early(Early { from: d, room, body: EarlyBody::Handoff(h), at: now });
        self.stats.early_kept += 1;
        HandoffOutcome::Kept
    }

    /// An abort from decode rank `d` of its handoff `generation` of `room`, at `now`.
    pub fn handle_abort(
        &mut self,
        d: RankId,
        room: RequestId,
        generation: u64,
        reason: &str,
        now: Instant,
    ) -> AbortOutcome {
        let mine = match self.reqs.get_mut(&room) {
            Some(q) if q.handoffs.get(&d).is_some_and(|h| h.generation == generation) => {
                q.abort_from.insert(d);
                Some(!(q.done || q.told))
            }
            _ => None,
        };
        match mine {
            Some(true) => {
                let why = format!("decode rank {d} aborted the request: {reason}");
                return if self.abort(room, why, FailCause::AbortedByPeer) {
                    AbortOutcome::Aborted
                } else {
                    // Failed already: its settle fences `d` (in `abort_from`).
                    AbortOutcome::FenceFollows
                };
            }
            Some(false) => {}
            None => {
                // Nothing of it was posted here. Kept with the early handoffs: a sender created
                // later for the room, or the handoff itself if the abort overtook it, then fails at
                // once instead of writing into fenced pages.
                self.keep_early(Early {
                    from: d,
                    room,
                    body: EarlyBody::Abort { generation, reason: reason.to_owned() },
                    at: now,
                });
            }
        }
        let note = Notification::new(room, self.me(), NotificationBody::Fenced).with_generation(generation);
        self.actions.push_back(Action::Notify { to: d, note, after_link: true });
        AbortOutcome::FencedNow
    }

    /// Sets the request's total page count (SGLang's `init`). Once only.
    pub fn init(&mut self, room: RequestId, total_pages: u32) -> Result<(), CallError> {
        let q = self.reqs.get_mut(&room).ok_or(CallError::Unknown)?;
        if q.total.is_some() {
            return Err(CallError::Refused("init was already called".into()));
        }
        q.total = Some(total_pages);
        Ok(())
    }

    fn ready(&self, q: &Req<X>, connected: bool) -> bool {
        connected && self.cfg.receivers.iter().all(|d| q.handoffs.contains_key(d))
    }

    /// Reserves the next part at `now`: a whole chunk (`whole`, every layer of the stage) or layers
    /// `layers` of the chunk made of `src_pages`. `connected`: the driver's links to the receivers are
    /// up. A refusal changes nothing.
    pub fn reserve_part(
        &mut self,
        room: RequestId,
        src_pages: &[u32],
        layers: Range<u32>,
        whole: bool,
        connected: bool,
        now: Instant,
    ) -> Result<Part, CallError> {
        let stage_layers = self.cfg.stage_layers;
        let refuse = |s: String| Err(CallError::Refused(s));
        let q = self.reqs.get(&room).ok_or(CallError::Unknown)?;
        if let Some((f, _)) = &q.failure {
            return refuse(format!("the request failed: {f}"));
        }
        if !self.ready(q, connected) {
            return refuse(format!(
                "not ready: waiting for the page lists of decode ranks {:?} (poll until WaitingForInput)",
                self.cfg.receivers.iter().filter(|d| !q.handoffs.contains_key(d)).collect::<Vec<_>>()
            ));
        }
        let Some(total) = q.total else { return refuse("call init(total_pages) before sending".into()) };
        if q.last_posted {
            return refuse("the last chunk was already sent".into());
        }
        if layers.start >= layers.end || layers.end > stage_layers {
            return refuse(format!("layer range {layers:?} is empty or outside this stage's {stage_layers} layers"));
        }
        let continuing = match &q.layerwise {
            Some(_) if whole => return refuse("a layer-wise chunk is in progress; finish it with send_layers".into()),
            Some((pages, done)) => {
                if pages.as_slice() != src_pages {
                    return refuse("layer-wise: every call of one chunk must give the same source pages".into());
                }
                if layers.clone().any(|l| done.contains(&l)) {
                    return refuse(format!("layer-wise: layers {layers:?} of this chunk were already sent"));
                }
                true
            }
            None => false,
        };
        let n = src_pages.len() as u32;
        if !continuing && u64::from(q.sent_pages) + u64::from(n) > u64::from(total) {
            return refuse(format!("{} pages sent + {n} exceed the total of {total}", q.sent_pages));
        }
        for (d, h) in &q.handoffs {
            if h.pages.len() != total as usize {
                return refuse(format!(
                    "decode rank {d} handed off {} pages but init said {total}; both sides must agree",
                    h.pages.len()
                ));
            }
        }
        // Accepted: from here on the request changes.
        let q = self.reqs.get_mut(&room).expect("looked up above");
        let start = if continuing { q.sent_pages - n } else { q.sent_pages };
        let targets = q
            .handoffs
            .iter()
            .map(|(d, h)| PartTarget {
                rank: *d,
                generation: h.generation,
                dst_pages: h.pages[start as usize..(start + n) as usize].to_vec(),
                digest: h.digest,
            })
            .collect();
        if !continuing {
            q.sent_pages += n;
        }
        let last = q.sent_pages == total;
        let chunk = if continuing { q.next_chunk - 1 } else { q.next_chunk };
        if !continuing {
            q.next_chunk += 1;
        }
        let finish = if whole {
            true
        } else {
            let entry = q.layerwise.get_or_insert_with(|| (src_pages.to_vec(), BTreeSet::new()));
            entry.1.extend(layers);
            let finished = entry.1.len() as u32 == stage_layers;
            if finished {
                q.layerwise = None;
            }
            finished
        };
        if finish && last {
            q.last_posted = true;
        }
        q.outstanding += 1;
        q.first_post.get_or_insert(now);
        Ok(Part { chunk, last, finish, targets })
    }

    /// Reserves the aux delivery of `len` bytes: the receivers that handed off an aux slot, with
    /// their generations. Report it with [`Self::part_done`] like a part.
    pub fn reserve_aux(
        &mut self,
        room: RequestId,
        len: usize,
        connected: bool,
    ) -> Result<Vec<(RankId, u64)>, CallError> {
        let q = self.reqs.get(&room).ok_or(CallError::Unknown)?;
        if let Some((f, _)) = &q.failure {
            return Err(CallError::Refused(format!("the request failed: {f}")));
        }
        if !self.ready(q, connected) {
            return Err(CallError::Refused("not ready: not every decode rank has handed off yet".into()));
        }
        if q.aux_sent {
            return Err(CallError::Refused("aux was already sent".into()));
        }
        if len > MAX_PAYLOAD {
            return Err(CallError::Refused(format!("{len} aux bytes exceed {MAX_PAYLOAD}")));
        }
        let q = self.reqs.get_mut(&room).expect("looked up above");
        q.aux_sent = true;
        q.outstanding += 1;
        Ok(q.handoffs.iter().filter(|(_, h)| h.aux_slot.is_some()).map(|(d, h)| (*d, h.generation)).collect())
    }

    /// A reserved part (or the aux delivery) settled: `Ok` once every write of it completed, `Err`
    /// with why otherwise; `digests`: per receiver that asked, the digest of what the part wrote.
    pub fn part_done(&mut self, room: RequestId, result: Result<(), String>, digests: &[(RankId, Vec<u64>)]) {
        let rank = self.cfg.rank;
        let me = self.me();
        let Some(q) = self.reqs.get_mut(&room) else { return };
        q.outstanding = q.outstanding.saturating_sub(1);
        for (d, part) in digests {
            digest::merge(q.digests.entry(*d).or_default(), part);
        }
        if let Err(e) = result {
            if q.failure.is_none() {
                q.failure = Some((format!("prefill rank {rank}: {e}"), FailCause::Transfer));
                self.actions.push_back(Action::Cancel { room, reason: e });
            }
        }
        let finished = q.failure.is_none() && q.last_posted && q.outstanding == 0;
        // Every part completed: the decode ranks that asked get the sums of them all.
        if finished && !q.digests_sent {
            q.digests_sent = true;
            for (d, h) in q.handoffs.iter().filter(|(_, h)| h.digest) {
                let body = NotificationBody::Digest(q.digests.get(d).cloned().unwrap_or_default());
                let note = Notification::new(room, me, body).with_generation(h.generation);
                self.actions.push_back(Action::Notify { to: *d, note, after_link: false });
            }
        }
        if finished && !q.done && q.aux_ok() {
            q.done = true;
            self.stats.succeeded += 1;
            let receivers = q.handoffs.iter().map(|(d, h)| (*d, h.generation, h.digest)).collect();
            self.actions.push_back(Action::Succeeded { room, started: q.first_post, receivers });
        }
        self.settle(room);
    }

    fn fail(&mut self, room: RequestId, why: String, cause: FailCause) -> bool {
        let Some(q) = self.reqs.get_mut(&room) else { return false };
        if !q.open() {
            return false;
        }
        q.failure = Some((why.clone(), cause));
        self.actions.push_back(Action::Cancel { room, reason: why });
        self.settle(room);
        true
    }

    /// Fails the request of `room` with `reason` (this rank's name is put before it) unless it has an
    /// outcome already; its transfers in flight are cancelled, and its receivers told once they
    /// settled. Returns whether this call failed it.
    pub fn abort(&mut self, room: RequestId, reason: String, cause: FailCause) -> bool {
        let why = format!("prefill rank {}: {reason}", self.cfg.rank);
        self.fail(room, why, cause)
    }

    /// Fails every request without an outcome (a lost decode rank, a failed connect, a shutdown).
    /// Returns how many it failed.
    pub fn abort_open(&mut self, reason: &str, cause: FailCause) -> usize {
        let mut rooms: Vec<RequestId> = self.reqs.iter().filter(|(_, q)| q.open()).map(|(k, _)| *k).collect();
        rooms.sort_unstable();
        rooms.into_iter().filter(|room| self.abort(*room, reason.to_owned(), cause)).count()
    }

    /// Once a failed request has nothing in flight: tells every receiver once (`Fenced` to one that
    /// asked to abort, the failure otherwise).
    fn settle(&mut self, room: RequestId) {
        let me = self.me();
        let Some(q) = self.reqs.get_mut(&room) else { return };
        let Some((why, cause)) = q.failure.clone() else { return };
        if q.outstanding > 0 || q.told {
            return;
        }
        q.told = true;
        self.stats.failed += 1;
        let mut receivers = Vec::with_capacity(q.handoffs.len());
        for (d, h) in &q.handoffs {
            let fenced = q.abort_from.contains(d);
            let body = if fenced { NotificationBody::Fenced } else { NotificationBody::Failure(why.clone()) };
            let note = Notification::new(room, me, body).with_generation(h.generation);
            self.actions.push_back(Action::Notify { to: *d, note, after_link: true });
            receivers.push((*d, h.generation, fenced));
        }
        self.actions.push_back(Action::Failed { room, started: q.first_post, cause, why, receivers });
    }

    /// Drops early handoffs and aborts older than `early_ttl` and fails every request past its
    /// deadline, naming what it waits for (`connected(d)`: whether the driver is connected to
    /// decode rank `d`, for the message).
    pub fn poll_deadlines(&mut self, now: Instant, connected: impl Fn(RankId) -> bool) {
        let ttl = self.cfg.early_ttl;
        let before = self.early.len();
        self.early.retain(|e| now.saturating_duration_since(e.at) < ttl);
        self.stats.early_expired += (before - self.early.len()) as u64;
        let timeout = self.cfg.request_timeout;
        let mut late: Vec<(RequestId, String)> = self
            .reqs
            .iter()
            .filter(|(_, q)| q.open() && now >= q.created + timeout)
            .map(|(room, q)| (*room, self.waiting_for(q, &connected)))
            .collect();
        late.sort_unstable_by_key(|(room, _)| *room);
        for (room, waiting) in late {
            self.abort(room, format!("not finished within {timeout:?}: {waiting}"), FailCause::Deadline);
        }
    }

    /// The earliest time at which [`Self::poll_deadlines`] has something to do.
    pub fn next_deadline(&self) -> Option<Instant> {
        let requests = self.reqs.values().filter(|q| q.open()).map(|q| q.created + self.cfg.request_timeout);
        let early = self.early.iter().map(|e| e.at + self.cfg.early_ttl);
        requests.chain(early).min()
    }

    /// What an unfinished request still waits for.
    fn waiting_for(&self, q: &Req<X>, connected: &impl Fn(RankId) -> bool) -> String {
        let missing: Vec<String> = self
            .cfg
            .receivers
            .iter()
            .filter(|d| !q.handoffs.contains_key(d))
            .map(|d| if connected(*d) { format!("{d}") } else { format!("{d} (not connected)") })
            .collect();
        if !missing.is_empty() {
            return format!(
                "waiting for the page list of decode rank(s) {} (did the decode side call send_metadata for this room?)",
                missing.join(", ")
            );
        }
        match q.total {
            None => "waiting for init (the request's page count)".into(),
            Some(t) if q.sent_pages < t => format!("waiting for input: {} of {t} pages given to send", q.sent_pages),
            Some(_) if q.outstanding > 0 => {
                format!("waiting for {} posted transfer(s) to be acknowledged by the decode side", q.outstanding)
            }
            Some(_) if !q.last_posted => "waiting for the remaining layers of the last chunk".into(),
            Some(_) if !q.aux_ok() => "waiting for send_aux (a decode rank asked for aux data)".into(),
            Some(_) => "every page was sent; waiting for the outcome to be told to the decode side".into(),
        }
    }

    /// The request's status (`connected`: the driver's links to the receivers are up).
    pub fn status(&self, room: RequestId, connected: bool) -> BookStatus {
        let Some(q) = self.reqs.get(&room) else {
            return BookStatus::of(Phase::Failed, Some("the request was released or never created".into()), true);
        };
        if let Some((f, _)) = &q.failure {
            return if q.outstanding == 0 {
                BookStatus::of(Phase::Failed, Some(f.clone()), true)
            } else {
                BookStatus::of(Phase::Aborting, Some(f.clone()), false)
            };
        }
        if q.done {
            return BookStatus::of(Phase::Success, None, true);
        }
        if q.last_posted {
            return BookStatus::of(Phase::Transferring, None, false);
        }
        if !self.ready(q, connected) {
            return BookStatus::of(Phase::Bootstrapping, None, q.outstanding == 0);
        }
        BookStatus::of(Phase::WaitingForInput, None, q.outstanding == 0)
    }

    /// Frees the request; refused (changing nothing) while transfers of it are in flight.
    pub fn release(&mut self, room: RequestId, connected: bool) -> Result<(BookStatus, X), CallError> {
        let s = self.status(room, connected);
        let q = self.reqs.get(&room).ok_or(CallError::Unknown)?;
        if q.outstanding > 0
            || (!s.phase.is_final() && s.phase != Phase::Bootstrapping && s.phase != Phase::WaitingForInput)
        {
            return Err(CallError::Refused(format!(
                "cannot release while {}: transfers are in flight; abort and wait first",
                s.phase
            )));
        }
        let q = self.reqs.remove(&room).expect("looked up above");
        Ok((s, q.io))
    }

    /// The receivers that handed off so far, with their generations.
    pub fn handoffs(&self, room: RequestId) -> Vec<(RankId, u64)> {
        self.reqs.get(&room).map(|q| q.handoffs.iter().map(|(d, h)| (*d, h.generation)).collect()).unwrap_or_default()
    }

    /// The driver's value of the request.
    pub fn io_mut(&mut self, room: RequestId) -> Option<&mut X> {
        self.reqs.get_mut(&room).map(|q| &mut q.io)
    }

    /// The next action to carry out, oldest first.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Requests created and not released.
    pub fn len(&self) -> usize {
        self.reqs.len()
    }

    /// Whether no request is held.
    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    /// Requests without an outcome.
    pub fn open_count(&self) -> usize {
        self.reqs.values().filter(|q| q.open()).count()
    }

    /// Requests with parts in flight.
    pub fn in_flight(&self) -> usize {
        self.reqs.values().filter(|q| q.outstanding > 0).count()
    }

    /// Whether some request still has parts in flight or a failure not told yet.
    pub fn settling(&self) -> bool {
        self.reqs.values().any(|q| q.outstanding > 0 || (q.failure.is_some() && !q.told))
    }

    /// Early handoffs and aborts kept now.
    pub fn early_len(&self) -> usize {
        self.early.len()
    }

    /// The counters.
    pub fn stats(&self) -> BookStats {
        self.stats
    }
}
