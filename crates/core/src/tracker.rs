//! The completion tracker (SEMANTICS §5): sans-IO. Notifications and the current time go in; request
//! status comes out. It never reads a clock, never blocks and never panics on bad input.
//!
//! ```text
//! done   <=> not failed and |expected| == N and for every key: received[key] == {0..expected[key]-1}
//!            and (aux not required or aux received) and (state not required or state from all N keys)
//!            and (digest not required or a digest from all N keys; the driver then verifies it)
//! failed <=> a failure notification arrived, or a notification from a key outside the expected set,
//!            or the deadline passed (the error names the keys still missing)
//! ```
//!
//! Generations, early notifications and the fence (SEMANTICS §5-§6):
//!
//! - a request is tracked as (room, generation); a notification of another generation never counts
//!   for it. One for a released (room, generation) is dropped at once ([`Handled::Released`]);
//! - a notification for a (room, generation) not tracked yet is kept ([`Handled::Early`]), bounded in
//!   count and age ([`TrackerConfig`]), and applied in arrival order when that generation is expected;
//! - a failed request is not yet safe: its destination pages may be reused only once every sender
//!   has fenced ([`CompletionTracker::fence`]): it finished all its chunks, reported failure (a sender
//!   fails a request only after its own transfers settled), answered an abort with `Fenced`, or was
//!   given up on **and cut off**;
//! - giving up on a sender ([`CompletionTracker::sender_lost`]: its lease expired, the store is
//!   unreachable, the transport reported it gone) fails the requests that wait on it but fences
//!   nothing: a stopped process resumes, a partition heals. The driver cuts the sender off
//!   (`KvTransferBackend::cut_off`) and reports the confirmation
//!   ([`CompletionTracker::sender_cut_off`]); only then are those requests' pages reusable. A cut-off
//!   that could not be confirmed quarantines them ([`CompletionTracker::sender_quarantined`],
//!   [`Fence::Quarantined`]) until a later cut-off of the same loss succeeds;
//! - a lost sender stays lost until [`CompletionTracker::sender_back`]: requests expected meanwhile that
//!   need it fail at once (and are fenced for it at once: the driver hands no request off to a lost
//!   sender, so it holds none of their pages).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::time::{Duration, Instant};

use crate::error::TrackerError;
use crate::model::SenderKey;
use crate::notify::{Notification, NotificationBody, RequestId};

/// What the receiver expects for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpectSpec {
    /// Which use of the room this is (every notification of it carries the same generation).
    pub generation: u64,
    /// Every sender key that must report (from [`crate::Topology::expected_senders`]).
    pub senders: Vec<SenderKey>,
    /// Whether an aux notification is required.
    pub aux: bool,
    /// Whether a state notification from every sender is required.
    pub state: bool,
    /// Whether a digest ([`NotificationBody::Digest`]) from every sender is required.
    pub digest: bool,
    /// When the request fails if not done.
    pub deadline: Instant,
}

/// Why a request failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// A sender reported failure.
    Notified {
        /// The sender.
        key: SenderKey,
        /// Its reason.
        reason: String,
    },
    /// A notification from a key that is not an expected sender of this request.
    UnexpectedKey {
        /// The key.
        key: SenderKey,
    },
    /// A chunk beyond the sender's announced last chunk, or two different last chunks.
    InconsistentChunks {
        /// The sender.
        key: SenderKey,
        /// What was inconsistent.
        detail: String,
    },
    /// The deadline passed; these keys (and flags) were still missing.
    DeadlineExceeded {
        /// Keys whose chunks are not all in.
        missing: Vec<SenderKey>,
        /// Keys whose state is missing (when state is required).
        missing_state: Vec<SenderKey>,
        /// Keys whose digest is missing (when digests are required).
        missing_digest: Vec<SenderKey>,
        /// Whether aux was required and is missing.
        missing_aux: bool,
    },
    /// The transport lost the connection to a sender.
    PeerLost {
        /// The sender.
        key: SenderKey,
        /// What the transport said.
        reason: String,
    },
    /// The receiver aborted the request.
    Aborted {
        /// Why.
        reason: String,
    },
    /// The sender was already known lost when the request was expected.
    SenderDown {
        /// The sender.
        key: SenderKey,
        /// What was known of the loss.
        reason: String,
    },
}

fn keys(ks: &[SenderKey]) -> String {
    ks.iter().map(|k| k.to_string()).collect::<Vec<_>>().join(", ")
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Notified { key, reason } => write!(f, "sender {key} reported failure: {reason}"),
            Failure::UnexpectedKey { key } => {
                write!(f, "notification from {key}, which is not an expected sender (topology mismatch?)")
            }
            Failure::InconsistentChunks { key, detail } => write!(f, "sender {key}: {detail}"),
            Failure::DeadlineExceeded { missing, missing_state, missing_digest, missing_aux } => {
                write!(f, "deadline passed; still missing chunks from [{}]", keys(missing))?;
                if !missing_state.is_empty() {
                    write!(f, ", state from [{}]", keys(missing_state))?;
                }
                if !missing_digest.is_empty() {
                    write!(
                        f,
                        ", digest from [{}] (does that prefill rank run a kvxfer without digests?)",
                        keys(missing_digest)
                    )?;
                }
                if *missing_aux {
                    write!(f, ", aux")?;
                }
                Ok(())
            }
            Failure::PeerLost { key, reason } => write!(f, "lost sender {key}: {reason}"),
            Failure::Aborted { reason } => write!(f, "aborted: {reason}"),
            Failure::SenderDown { key, reason } => {
                write!(f, "sender {key} was lost before the request was registered ({reason}); it has not come back")
            }
        }
    }
}

/// The status of a tracked request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    /// Still waiting.
    Pending,
    /// Every expected byte has landed.
    Done,
    /// Failed, with the reason.
    Failed(Failure),
}

/// What [`CompletionTracker::handle`] did with a notification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handled {
    /// Recorded; the request is still pending.
    Progress,
    /// Recorded, and it completed the request.
    Completed,
    /// Already seen (idempotent).
    Duplicate,
    /// It failed the request.
    Failed,
    /// The request already has an outcome; ignored (a fence is still recorded).
    AfterOutcome,
    /// For a (room, generation) not tracked yet: kept until it is expected (bounded by count and age).
    Early,
    /// For a (room, generation) released earlier: counted and dropped.
    Released,
    /// A kind the tracker does not take (handoff or abort: decode-to-prefill messages): dropped.
    NotForReceiver,
}

/// Counters of what the tracker did with notifications.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TrackerStats {
    /// Notifications recorded.
    pub accepted: u64,
    /// Duplicates ignored.
    pub duplicates: u64,
    /// Notifications kept because their (room, generation) was not tracked yet.
    pub early_kept: u64,
    /// Kept notifications applied when their request was expected.
    pub early_applied: u64,
    /// Kept notifications dropped because they grew too old or too many were kept.
    pub early_expired: u64,
    /// For requests already released.
    pub released: u64,
    /// For requests that already had an outcome.
    pub after_outcome: u64,
    /// Kinds a receiver does not take.
    pub not_for_receiver: u64,
}

/// Bounds of the tracker's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrackerConfig {
    /// Most early notifications kept at once; the oldest is dropped (and counted) beyond it.
    pub early_max: usize,
    /// How long an early notification is kept.
    pub early_ttl: Duration,
    /// How many released (room, generation) pairs are remembered to drop their late notifications.
    pub released_memory: usize,
}

impl Default for TrackerConfig {
    fn default() -> Self {
        Self { early_max: 65_536, early_ttl: Duration::from_secs(60), released_memory: 65_536 }
    }
}

#[derive(Debug, Clone, Default)]
struct KeyState {
    received: BTreeSet<u32>,
    expected: Option<u32>,
    state: bool,
    digest: bool,
    fenced: bool,
    /// The sender was given up on while it could still write this request's pages: fenced only
    /// once the cut-off of that loss is confirmed.
    cut: Option<Cut>,
}

/// A cut-off a request's key waits on.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Cut {
    /// Loss `id`: the cut-off is under way.
    Waiting(u64),
    /// Loss `id`: the cut-off could not be confirmed (why).
    Quarantined(u64, String),
}

impl KeyState {
    fn chunks_complete(&self) -> bool {
        self.expected.is_some_and(|n| self.received.len() as u64 == u64::from(n))
    }
}

#[derive(Debug, Clone)]
struct Req {
    generation: u64,
    keys: BTreeMap<SenderKey, KeyState>,
    aux_required: bool,
    state_required: bool,
    digest_required: bool,
    aux: Option<Vec<u8>>,
    states: BTreeMap<SenderKey, Vec<u8>>,
    digests: BTreeMap<SenderKey, Vec<u64>>,
    deadline: Instant,
    outcome: Option<Status>,
}

impl Req {
    /// Whether key state `k` still waits for something (chunks, state, digest).
    fn waiting(&self, k: &KeyState) -> bool {
        !k.chunks_complete() || (self.state_required && !k.state) || (self.digest_required && !k.digest)
    }

    fn is_done(&self) -> bool {
        self.keys.values().all(|k| !self.waiting(k)) && (!self.aux_required || self.aux.is_some())
    }

    fn deadline_failure(&self) -> Failure {
        Failure::DeadlineExceeded {
            missing: self.keys.iter().filter(|(_, s)| !s.chunks_complete()).map(|(k, _)| *k).collect(),
            missing_state: if self.state_required {
                self.keys.iter().filter(|(_, s)| !s.state).map(|(k, _)| *k).collect()
            } else {
                Vec::new()
            },
            missing_digest: if self.digest_required {
                self.keys.iter().filter(|(_, s)| !s.digest).map(|(k, _)| *k).collect()
            } else {
                Vec::new()
            },
            missing_aux: self.aux_required && self.aux.is_none(),
        }
    }

    fn check_deadline(&mut self, now: Instant) {
        if self.outcome.is_none() && now >= self.deadline {
            // Every state change settles a request that is done, so one still pending here misses
            // something and the failure names it; settle a done one as done all the same.
            self.outcome = Some(if self.is_done() { Status::Done } else { Status::Failed(self.deadline_failure()) });
        }
    }

    /// Senders that may still write into the request's pages.
    fn unfenced(&self) -> Vec<SenderKey> {
        self.keys.iter().filter(|(_, s)| !s.fenced && !s.chunks_complete()).map(|(k, _)| *k).collect()
    }

    /// Senders given up on whose cut-off could not be confirmed, with why.
    fn quarantined(&self) -> Vec<(SenderKey, String)> {
        self.keys
            .iter()
            .filter(|(_, s)| !s.fenced && !s.chunks_complete())
            .filter_map(|(k, s)| match &s.cut {
                Some(Cut::Quarantined(_, why)) => Some((*k, why.clone())),
                _ => None,
            })
            .collect()
    }
}

/// A sender given up on ([`CompletionTracker::sender_lost`]), until it is back.
#[derive(Debug, Clone, PartialEq, Eq)]
struct LostSender {
    reason: String,
    /// The loss's id: what [`CompletionTracker::sender_cut_off`] confirms.
    loss: u64,
}

/// What [`CompletionTracker::sender_lost`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loss {
    /// This loss's id: pass it to [`CompletionTracker::sender_cut_off`] (or
    /// [`CompletionTracker::sender_quarantined`]) once the driver's cut-off of the sender instance
    /// it gave up on is confirmed (or could not be). A sender already lost keeps its id.
    pub id: u64,
    /// Requests this loss failed, sorted.
    pub failed: Vec<RequestId>,
}

/// Where a request's fence stands (SEMANTICS §6).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fence {
    /// Still pending: senders may write.
    Open,
    /// The request has an outcome; these senders have not yet confirmed that none of their writes
    /// can land, or (for a sender given up on) their cut-off is under way. Never empty.
    Closing(Vec<SenderKey>),
    /// The request has an outcome; these senders were given up on and cutting them off could not
    /// be confirmed (why): they may still write into the pages, which must not be reused. It
    /// becomes [`Fence::Closed`] only if a later cut-off of the same loss is confirmed.
    Quarantined(Vec<(SenderKey, String)>),
    /// No write of the request can land any more: its destination pages may be reused.
    Closed,
}

/// Tracks completion of every request of one decode rank.
#[derive(Debug, Clone, Default)]
pub struct CompletionTracker {
    config: TrackerConfig,
    reqs: HashMap<RequestId, Req>,
    /// Released (room, generation) pairs, each with the sequence number of its release.
    released: HashMap<(RequestId, u64), u64>,
    /// Releases, oldest first, bounded by `config.released_memory`. An entry whose sequence number is
    /// no longer its pair's is stale and evicts nothing.
    released_order: VecDeque<((RequestId, u64), u64)>,
    release_seq: u64,
    /// Notifications for (room, generation) pairs not tracked yet, oldest first, with arrival times.
    early: VecDeque<(Notification, Instant)>,
    /// Senders given up on, until they come back.
    lost: BTreeMap<SenderKey, LostSender>,
    /// The last loss id handed out.
    loss_seq: u64,
    stats: TrackerStats,
}

impl CompletionTracker {
    /// An empty tracker with the default bounds.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty tracker with these bounds.
    pub fn with_config(config: TrackerConfig) -> Self {
        Self { config, ..Self::default() }
    }

    /// Starts tracking a request (room and generation). Early notifications kept for this pair are
    /// applied at once, in arrival order; then a sender known lost that the request still waits on
    /// fails it at once ([`Failure::SenderDown`]).
    pub fn expect(&mut self, request: RequestId, spec: ExpectSpec, now: Instant) -> Result<usize, TrackerError> {
        if let Some(r) = self.reqs.get(&request) {
            return Err(TrackerError::AlreadyTracked { request, generation: r.generation });
        }
        if spec.senders.is_empty() {
            return Err(TrackerError::NoSenders(request));
        }
        if self.released.contains_key(&(request, spec.generation)) {
            return Err(TrackerError::GenerationReleased { request, generation: spec.generation });
        }
        let generation = spec.generation;
        let keys = spec.senders.iter().map(|k| (*k, KeyState::default())).collect();
        let req = Req {
            generation,
            keys,
            aux_required: spec.aux,
            state_required: spec.state,
            digest_required: spec.digest,
            aux: None,
            states: BTreeMap::new(),
            digests: BTreeMap::new(),
            deadline: spec.deadline,
            outcome: None,
        };
        self.reqs.insert(request, req);
        self.expire_early(now);
        let (mine, rest): (VecDeque<_>, VecDeque<_>) = std::mem::take(&mut self.early)
            .into_iter()
            .partition(|(n, _)| n.request == request && n.generation == generation);
        self.early = rest;
        let applied = mine.len();
        for (n, _) in mine {
            self.stats.early_applied += 1;
            self.handle(&n, now);
        }
        // A sender known lost holds none of this request's pages (the driver hands nothing off to a
        // lost sender), so it is fenced for it; one the request still waits on fails it at once.
        // Checked after the early notifications: what a sender delivered before it was lost counts,
        // exactly as for a request tracked when the loss happened (`sender_lost`).
        if let Some(req) = self.reqs.get_mut(&request) {
            let mut down = None;
            for (k, s) in req.keys.iter() {
                let Some(lost) = self.lost.get(k) else { continue };
                if down.is_none() && req.waiting(s) {
                    down = Some((*k, lost.reason.clone()));
                }
            }
            for (k, s) in req.keys.iter_mut() {
                if self.lost.contains_key(k) {
                    s.fenced = true;
                }
            }
            if let (None, Some((key, reason))) = (&req.outcome, down) {
                req.outcome = Some(Status::Failed(Failure::SenderDown { key, reason }));
            }
        }
        Ok(applied)
    }

    fn expire_early(&mut self, now: Instant) {
        let ttl = self.config.early_ttl;
        while self.early.front().is_some_and(|(_, t)| now.saturating_duration_since(*t) >= ttl) {
            self.early.pop_front();
            self.stats.early_expired += 1;
        }
    }

    /// Feeds one notification received at `now`.
    pub fn handle(&mut self, n: &Notification, now: Instant) -> Handled {
        if matches!(n.body, NotificationBody::Handoff { .. } | NotificationBody::Abort(_)) {
            self.stats.not_for_receiver += 1;
            return Handled::NotForReceiver;
        }
        if self.released.contains_key(&(n.request, n.generation)) {
            self.stats.released += 1;
            return Handled::Released;
        }
        let Some(req) = self.reqs.get_mut(&n.request).filter(|r| r.generation == n.generation) else {
            self.expire_early(now);
            if self.config.early_max == 0 {
                self.stats.early_expired += 1;
                return Handled::Early;
            }
            while self.early.len() >= self.config.early_max {
                self.early.pop_front();
                self.stats.early_expired += 1;
            }
            self.early.push_back((n.clone(), now));
            self.stats.early_kept += 1;
            return Handled::Early;
        };
        req.check_deadline(now);
        let Some(ks) = req.keys.get_mut(&n.sender) else {
            if req.outcome.is_some() {
                self.stats.after_outcome += 1;
                return Handled::AfterOutcome;
            }
            req.outcome = Some(Status::Failed(Failure::UnexpectedKey { key: n.sender }));
            return Handled::Failed;
        };
        // A fence counts whatever the outcome: it is what makes a failed request's pages reusable.
        if matches!(n.body, NotificationBody::Fenced | NotificationBody::Failure(_)) {
            ks.fenced = true;
        }
        if req.outcome.is_some() {
            self.stats.after_outcome += 1;
            return Handled::AfterOutcome;
        }
        let fresh = match &n.body {
            NotificationBody::KvChunk { chunk, last } => {
                let (chunk, last) = (*chunk, *last);
                let inconsistent = match ks.expected {
                    Some(e) if chunk >= e => Some(format!("chunk {chunk} after last chunk {}", e - 1)),
                    Some(e) if last && chunk.saturating_add(1) != e => {
                        Some(format!("last chunk {chunk} after last chunk {} was announced", e - 1))
                    }
                    None if last && ks.received.iter().next_back().is_some_and(|m| *m > chunk) => Some(format!(
                        "last chunk {chunk} but chunk {} already arrived",
                        ks.received.iter().next_back().copied().unwrap_or(0)
                    )),
                    _ => None,
                };
                if let Some(detail) = inconsistent {
                    req.outcome = Some(Status::Failed(Failure::InconsistentChunks { key: n.sender, detail }));
                    return Handled::Failed;
                }
                // A `last` flag on any copy sets expected[key] (SEMANTICS §5): a copy that brings the
                // flag is news even when the chunk itself already arrived.
                let announces = last && ks.expected.is_none();
                if last {
                    ks.expected = Some(chunk.saturating_add(1));
                }
                ks.received.insert(chunk) | announces
            }
            NotificationBody::Aux(p) => {
                let fresh = req.aux.is_none();
                if fresh {
                    req.aux = Some(p.clone());
                }
                fresh
            }
            NotificationBody::State(p) => {
                let fresh = !ks.state;
                ks.state = true;
                req.states.entry(n.sender).or_insert_with(|| p.clone());
                fresh
            }
            NotificationBody::Digest(d) => {
                let fresh = !ks.digest;
                ks.digest = true;
                req.digests.entry(n.sender).or_insert_with(|| d.clone());
                fresh
            }
            NotificationBody::Failure(reason) => {
                req.outcome = Some(Status::Failed(Failure::Notified { key: n.sender, reason: reason.clone() }));
                self.stats.accepted += 1;
                return Handled::Failed;
            }
            // A fence before any outcome: the sender stopped (it heard of an abort we did not make,
            // or it gave up); nothing more will come from it, so the request cannot complete.
            NotificationBody::Fenced => {
                req.outcome = Some(Status::Failed(Failure::Notified {
                    key: n.sender,
                    reason: "the sender stopped the request (fenced) before finishing it".into(),
                }));
                self.stats.accepted += 1;
                return Handled::Failed;
            }
            NotificationBody::Handoff { .. } | NotificationBody::Abort(_) => unreachable!("filtered above"),
        };
        if !fresh {
            self.stats.duplicates += 1;
            return Handled::Duplicate;
        }
        self.stats.accepted += 1;
        if req.is_done() {
            req.outcome = Some(Status::Done);
            Handled::Completed
        } else {
            Handled::Progress
        }
    }

    /// The driver gave up on sender `key` (its lease expired, the store is unreachable, the
    /// transport reported it gone): fails every pending request that still waits on it, and fails
    /// requests expected later that need it until [`Self::sender_back`]. It fences nothing: every
    /// request the sender could still write (it has not fenced and not finished its chunks) waits
    /// for the cut-off of this loss ([`Self::sender_cut_off`] with the returned id) before its
    /// pages are reusable. Giving up on a sender already given up on changes nothing and returns
    /// the same id.
    pub fn sender_lost(&mut self, key: SenderKey, reason: &str) -> Loss {
        let id = match self.lost.get(&key) {
            Some(l) => l.loss,
            None => {
                self.loss_seq += 1;
                self.lost.insert(key, LostSender { reason: reason.to_owned(), loss: self.loss_seq });
                self.loss_seq
            }
        };
        let mut failed = Vec::new();
        for (rid, req) in &mut self.reqs {
            let Some(s) = req.keys.get(&key) else { continue };
            let waiting = req.waiting(s);
            let Some(s) = req.keys.get_mut(&key) else { continue };
            if !s.fenced && !s.chunks_complete() && s.cut.is_none() {
                s.cut = Some(Cut::Waiting(id));
            }
            if req.outcome.is_none() && waiting {
                req.outcome = Some(Status::Failed(Failure::PeerLost { key, reason: reason.to_owned() }));
                failed.push(*rid);
            }
        }
        failed.sort();
        Loss { id, failed }
    }

    /// The cut-off of loss `loss` of sender `key` is confirmed: the sender instance given up on can
    /// no longer write into this rank's memory. Every request that waited on it is fenced for
    /// `key`. Returns those requests, sorted. An unknown loss changes nothing.
    pub fn sender_cut_off(&mut self, key: SenderKey, loss: u64) -> Vec<RequestId> {
        let mut fenced = Vec::new();
        for (rid, req) in &mut self.reqs {
            let Some(s) = req.keys.get_mut(&key) else { continue };
            if matches!(&s.cut, Some(Cut::Waiting(l) | Cut::Quarantined(l, _)) if *l == loss) {
                s.cut = None;
                s.fenced = true;
                fenced.push(*rid);
            }
        }
        fenced.sort();
        fenced
    }

    /// The cut-off of loss `loss` of sender `key` could not be confirmed (`why`): the requests that
    /// wait on it are quarantined ([`Fence::Quarantined`]) until a later [`Self::sender_cut_off`] of
    /// the same loss. Returns them, sorted.
    pub fn sender_quarantined(&mut self, key: SenderKey, loss: u64, why: &str) -> Vec<RequestId> {
        let mut out = Vec::new();
        for (rid, req) in &mut self.reqs {
            let Some(s) = req.keys.get_mut(&key) else { continue };
            if matches!(&s.cut, Some(Cut::Waiting(l) | Cut::Quarantined(l, _)) if *l == loss) {
                s.cut = Some(Cut::Quarantined(loss, why.to_owned()));
                out.push(*rid);
            }
        }
        out.sort();
        out
    }

    /// Sender `key` is back (registered again under a new epoch, a new instance): requests expected
    /// from now on may use it. Requests that wait on the cut-off of its earlier instance still do.
    pub fn sender_back(&mut self, key: SenderKey) {
        self.lost.remove(&key);
    }

    /// Senders known lost.
    pub fn lost_senders(&self) -> Vec<SenderKey> {
        self.lost.keys().copied().collect()
    }

    /// The id of the current loss of sender `key`, while it is lost.
    pub fn loss_of(&self, key: SenderKey) -> Option<u64> {
        self.lost.get(&key).map(|l| l.loss)
    }

    /// Fails a pending request (receiver-side abort). No effect on a request with an outcome. The
    /// caller must then ask every sender in [`Self::fence`] to stop and fence.
    pub fn abort(&mut self, request: RequestId, reason: &str) {
        if let Some(req) = self.reqs.get_mut(&request) {
            if req.outcome.is_none() {
                req.outcome = Some(Status::Failed(Failure::Aborted { reason: reason.to_owned() }));
            }
        }
    }

    /// The status of a request at `now` (a passed deadline fails it). `None` for an unknown request.
    pub fn status(&mut self, request: RequestId, now: Instant) -> Option<Status> {
        let req = self.reqs.get_mut(&request)?;
        req.check_deadline(now);
        Some(req.outcome.clone().unwrap_or(Status::Pending))
    }

    /// The generation tracked for a room.
    pub fn generation(&self, request: RequestId) -> Option<u64> {
        self.reqs.get(&request).map(|r| r.generation)
    }

    /// Where the request's fence stands at `now`: [`Fence::Closed`] when its pages may be reused.
    pub fn fence(&mut self, request: RequestId, now: Instant) -> Option<Fence> {
        let req = self.reqs.get_mut(&request)?;
        req.check_deadline(now);
        Some(match &req.outcome {
            None => Fence::Open,
            Some(Status::Done) => Fence::Closed,
            Some(_) => match (req.quarantined(), req.unfenced()) {
                (q, _) if !q.is_empty() => Fence::Quarantined(q),
                (_, v) if v.is_empty() => Fence::Closed,
                (_, v) => Fence::Closing(v),
            },
        })
    }

    /// Fails every request whose deadline passed; returns them.
    pub fn poll_deadlines(&mut self, now: Instant) -> Vec<RequestId> {
        let mut out = Vec::new();
        for (id, req) in &mut self.reqs {
            if req.outcome.is_none() {
                req.check_deadline(now);
                if req.outcome.is_some() {
                    out.push(*id);
                }
            }
        }
        self.expire_early(now);
        out.sort();
        out
    }

    /// The earliest deadline of a pending request.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.reqs.values().filter(|r| r.outcome.is_none()).map(|r| r.deadline).min()
    }

    /// The aux payload of a request, once received.
    pub fn aux(&self, request: RequestId) -> Option<&[u8]> {
        self.reqs.get(&request)?.aux.as_deref()
    }

    /// The digest a sender sent for a request (the first one, when it came twice).
    pub fn digest(&self, request: RequestId, key: SenderKey) -> Option<&[u64]> {
        self.reqs.get(&request)?.digests.get(&key).map(Vec::as_slice)
    }

    /// The state payload a sender sent for a request.
    pub fn state(&self, request: RequestId, key: SenderKey) -> Option<&[u8]> {
        self.reqs.get(&request)?.states.get(&key).map(Vec::as_slice)
    }

    /// Stops tracking a request and returns its final status. Later notifications of that
    /// (room, generation) are counted as released and dropped; the room may be expected again under
    /// another generation. Release a failed request only once its [`Self::fence`] is closed.
    pub fn release(&mut self, request: RequestId, now: Instant) -> Option<Status> {
        let status = self.status(request, now);
        if let Some(req) = self.reqs.remove(&request) {
            let pair = (request, req.generation);
            let seq = self.release_seq;
            self.release_seq += 1;
            self.released.insert(pair, seq);
            self.released_order.push_back((pair, seq));
            self.early.retain(|(n, _)| (n.request, n.generation) != pair);
            while self.released_order.len() > self.config.released_memory {
                if let Some((old, old_seq)) = self.released_order.pop_front() {
                    // Forget the pair only if this was its latest release.
                    if self.released.get(&old) == Some(&old_seq) {
                        self.released.remove(&old);
                    }
                }
            }
        }
        status
    }

    /// Whether (room, generation) was released (and is still remembered).
    pub fn is_released(&self, request: RequestId, generation: u64) -> bool {
        self.released.contains_key(&(request, generation))
    }

    /// Early notifications kept now.
    pub fn early_len(&self) -> usize {
        self.early.len()
    }

    /// Requests currently tracked.
    pub fn len(&self) -> usize {
        self.reqs.len()
    }

    /// Whether no request is tracked.
    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    /// Counters.
    pub fn stats(&self) -> TrackerStats {
        self.stats
    }
}
