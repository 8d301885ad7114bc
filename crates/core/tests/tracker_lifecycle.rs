//! The completion tracker over a request's whole life (SEMANTICS §5-§6): generations, early
//! notifications, the fence and lost senders.
//!
//! `exhaustive_*`: for each small topology (1 or 2 expected sender keys, aux required or not) every
//! sequence of events drawn from a finite alphabet, up to a length, is run against the tracker and
//! against [`Model`], a reference written from SEMANTICS.md without the tracker's internals (received
//! sets, announced last chunks, the failure slot, fences, released generations, lost senders, the early
//! buffer with its TTL and its bound). Where SEMANTICS is silent the model takes the tracker's
//! documented choices: two different last chunks or a chunk after the last fail the request
//! (`InconsistentChunks`); a Fenced before any outcome fails it (the sender stopped); a notification
//! after the outcome changes nothing but a fence. After every event the tracker's answer to it, `status`, `fence`, `generation`,
//! `is_released`, `early_len`, `next_deadline`, `lost_senders`, `len` and every counter of `stats`
//! must equal the model's. Sequences are enumerated depth first; a letter that cannot apply (a copy
//! when nothing was sent yet, `sender_back` of a sender that is not lost, a cut-off of a key never
//! lost) is skipped. Giving up on a sender fences nothing (issue 32): a request it could still write
//! waits for the cut-off of that very loss, and a cut-off that failed quarantines it.
//!
//! The alphabet ([`Ev`]), for one room whose generation 1 was released before the sequence starts and
//! whose current generation is `cur` (2 at first, +1 at every release):
//! chunk c ∈ {0, 1} with or without `last` from each key, aux, a Failure and a Fenced from a key, a
//! chunk from a key outside the expected set, a copy of the latest notification (whatever its
//! generation), a late chunk of the released generation `cur - 1`, a chunk of the future generation
//! `cur + 1`, receiver abort, sender_lost(key), the cut-off of the key's latest loss confirmed
//! (`sender_cut_off`) or not (`sender_quarantined`), sender_back(key), release, expect (generation `cur`;
//! notifications before it are early), time past the deadline, time past `early_ttl` (the driver's
//! timer: each advance is followed by `poll_deadlines`).
//!
//! Suites (sequences checked, each prefix-closed: every length from 0 up to the maximum, the empty
//! one included; each suite also asserts which statuses, fences and answers it reached):
//!
//! | test | topology | letters | length | sequences |
//! |---|---|---|---|---|
//! | `exhaustive_one_key_full_alphabet` | 1 key | all 19 | ≤ 5 | 1,136,416 |
//! | `exhaustive_one_key_with_aux_full_alphabet` | 1 key, aux | all 20 | ≤ 5 | 1,526,776 |
//! | `exhaustive_two_keys_full_alphabet` | 2 keys | all 28 | ≤ 4 | 246,937 |
//! | `exhaustive_two_keys_with_aux_full_alphabet` | 2 keys, aux | all 29 | ≤ 4 | 293,793 |
//! | `exhaustive_one_key_lifecycle_to_six` | 1 key, aux | 10 (generations, early, loss) | ≤ 6 | 926,836 |
//! | `exhaustive_two_keys_fence_to_six` | 2 keys | 12 (failure, fence, loss, cut-off, quarantine) | ≤ 6 | 1,016,089 |
//! | `exhaustive_two_keys_early_to_six` | 2 keys, aux | 10 (early, generations, completion) | ≤ 6 | 952,537 |
//!
//! 6,099,384 sequences in all (the counts are asserted), about 16 s of CPU in the test profile, split
//! over seven tests that run in parallel. Early notifications expire lazily in the tracker (at
//! `poll_deadlines`, `expect` and the next early notification); the time letters poll, as a driver's
//! timer does, and `defect_3_early_notifications_expire_after_early_ttl_and_beyond_early_max` covers
//! an `expect` that comes late without a poll.
//!
//! The other tests are focused regressions, each of which failed on the tracker before generations,
//! early notifications, the fence and lost senders (the last, `a_sender_lost_after_delivering_early_*`,
//! on the tracker that checked lost senders before applying early notifications).

use std::collections::{BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use kvxfer_core::{
    CompletionTracker, ExpectSpec, Failure, Fence, Handled, Loss, Notification, NotificationBody, RequestId, SenderKey,
    Status, TrackerConfig, TrackerError, TrackerStats,
};

const R: RequestId = RequestId(7);
/// How long after `expect` a request's deadline falls.
const DEADLINE: Duration = Duration::from_secs(10);
/// How long an early notification is kept.
const TTL: Duration = Duration::from_secs(4);
/// How many early notifications are kept at once.
const EARLY_MAX: usize = 3;
/// Index of the key outside the expected set.
const ALIEN: usize = 2;
const FAIL_REASON: &str = "write failed";
const CUT_FAILED: &str = "cut-off not confirmed";

fn key(i: usize) -> SenderKey {
    // Index order is key order (the tracker names keys in key order).
    SenderKey { dp: 0, cp: 0, pp: 0, tp: if i == ALIEN { 9 } else { i as u16 } }
}

fn config() -> TrackerConfig {
    TrackerConfig { early_max: EARLY_MAX, early_ttl: TTL, ..TrackerConfig::default() }
}

// ---------------------------------------------------------------------------------------------
// The alphabet.

/// What a notification says, in the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Body {
    Chunk(u32, bool),
    Aux,
    Failure,
    Fenced,
}

/// A notification in the model: generation, sender index, body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Msg {
    gen: u64,
    from: usize,
    body: Body,
}

impl Msg {
    fn wire(self) -> Notification {
        let body = match self.body {
            Body::Chunk(chunk, last) => NotificationBody::KvChunk { chunk, last },
            Body::Aux => NotificationBody::Aux(vec![42]),
            Body::Failure => NotificationBody::Failure(FAIL_REASON.into()),
            Body::Fenced => NotificationBody::Fenced,
        };
        Notification::new(R, key(self.from), body).with_generation(self.gen)
    }
}

/// One event of a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ev {
    /// Chunk (key, chunk, last) of the current generation.
    Chunk(usize, u32, bool),
    /// Aux from a key, current generation.
    Aux(usize),
    /// Failure from a key, current generation.
    Fail(usize),
    /// Fenced from a key, current generation.
    Fenced(usize),
    /// Chunk 0 (last) of the current generation from a key outside the expected set.
    Alien,
    /// A copy of the latest notification, whatever its generation.
    Dup,
    /// Chunk 0 (last) from key 0 of generation `cur - 1`, released.
    Late,
    /// Chunk 0 (last) from key 0 of generation `cur + 1`, not expected yet.
    Future,
    /// Receiver abort.
    Abort,
    /// The driver gave up on a sender (lease expired, transport lost it).
    Lost(usize),
    /// The driver's cut-off of the sender's latest loss is confirmed.
    CutOff(usize),
    /// The driver's cut-off of the sender's latest loss could not be confirmed.
    Quarantine(usize),
    /// The sender is back.
    Back(usize),
    /// Release the room's tracked generation.
    Release,
    /// Expect generation `cur`.
    Expect,
    /// Time moves by [`DEADLINE`], then `poll_deadlines`.
    PastDeadline,
    /// Time moves by [`TTL`], then `poll_deadlines`.
    PastTtl,
}

/// Every letter for `n` keys (aux letters only when aux is required).
fn full_alphabet(n: usize, aux: bool) -> Vec<Ev> {
    let mut a = Vec::new();
    for k in 0..n {
        for c in 0..2 {
            for last in [false, true] {
                a.push(Ev::Chunk(k, c, last));
            }
        }
    }
    if aux {
        a.push(Ev::Aux(0));
    }
    for k in 0..n {
        a.extend([Ev::Fail(k), Ev::Fenced(k), Ev::Lost(k), Ev::CutOff(k), Ev::Quarantine(k), Ev::Back(k)]);
    }
    if n == 1 {
        a.push(Ev::Alien);
    }
    a.extend([Ev::Dup, Ev::Late, Ev::Future, Ev::Abort, Ev::Release, Ev::Expect, Ev::PastDeadline, Ev::PastTtl]);
    a
}

// ---------------------------------------------------------------------------------------------
// The reference model (SEMANTICS §5-§6), written without looking at the tracker's state.

/// An outcome in the model.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Out {
    Done,
    /// A Failure (or an unsolicited Fenced: the sender stopped) from this key.
    Notified(usize),
    Unexpected,
    Inconsistent(usize),
    /// Keys whose chunks are missing, and whether aux is missing.
    Deadline(Vec<usize>, bool),
    PeerLost(usize),
    Aborted,
    SenderDown(usize),
}

#[derive(Debug, Clone)]
struct MReq {
    gen: u64,
    deadline: Duration,
    /// Chunks received per key (bit c: chunk c).
    got: [u32; 2],
    /// Chunks announced as last per key, by any copy (bit c: chunk c).
    lasts: [u32; 2],
    aux: bool,
    /// Keys that confirmed none of their writes can land any more (Failure, Fenced, cut off).
    fenced: [bool; 2],
    /// Keys given up on while they could still write: the loss whose cut-off they wait on, and
    /// whether that cut-off could not be confirmed (quarantined).
    cut: [Option<(u64, bool)>; 2],
    out: Option<Out>,
}

impl MReq {
    /// `received[key] == {0..expected[key]-1}` with `expected[key]` set by a last chunk.
    fn complete(&self, k: usize) -> bool {
        self.lasts[k].count_ones() == 1 && self.got[k] == (self.lasts[k] << 1) - 1
    }
}

#[derive(Debug, Clone)]
struct Model {
    n: usize,
    aux_req: bool,
    now: Duration,
    /// The generation of the room's current (or next) use.
    cur: u64,
    released: BTreeSet<u64>,
    lost: BTreeSet<usize>,
    /// Each key's latest loss id (kept after it is back: a cut-off may confirm it later).
    last_loss: [Option<u64>; 2],
    loss_seq: u64,
    req: Option<MReq>,
    early: VecDeque<(Msg, Duration)>,
    st: TrackerStats,
    latest: Option<Msg>,
}

impl Model {
    fn new(n: usize, aux_req: bool) -> Self {
        Self {
            n,
            aux_req,
            now: Duration::ZERO,
            cur: 2,
            released: BTreeSet::from([1]),
            lost: BTreeSet::new(),
            last_loss: [None; 2],
            loss_seq: 0,
            req: None,
            early: VecDeque::new(),
            st: TrackerStats::default(),
            latest: None,
        }
    }

    fn done(&self, r: &MReq) -> bool {
        (0..self.n).all(|k| r.complete(k)) && (!self.aux_req || r.aux)
    }

    /// A pending request whose deadline passed fails, naming what is missing.
    fn settle_deadline(&mut self) {
        let done = self.req.as_ref().is_some_and(|r| self.done(r));
        let (n, aux_req, now) = (self.n, self.aux_req, self.now);
        if let Some(r) = self.req.as_mut().filter(|r| r.out.is_none() && now >= r.deadline) {
            r.out = Some(if done {
                Out::Done
            } else {
                Out::Deadline((0..n).filter(|k| !r.complete(*k)).collect(), aux_req && !r.aux)
            });
        }
    }

    fn expire_early(&mut self) {
        while self.early.front().is_some_and(|(_, at)| self.now - *at >= TTL) {
            self.early.pop_front();
            self.st.early_expired += 1;
        }
    }

    fn handle(&mut self, m: Msg) -> Handled {
        if self.released.contains(&m.gen) {
            self.st.released += 1;
            return Handled::Released;
        }
        if !matches!(&self.req, Some(r) if r.gen == m.gen) {
            self.expire_early();
            if self.early.len() >= EARLY_MAX {
                self.early.pop_front();
                self.st.early_expired += 1;
            }
            self.early.push_back((m, self.now));
            self.st.early_kept += 1;
            return Handled::Early;
        }
        self.settle_deadline();
        let n = self.n;
        let r = self.req.as_mut().unwrap();
        if m.from >= n {
            if r.out.is_some() {
                self.st.after_outcome += 1;
                return Handled::AfterOutcome;
            }
            r.out = Some(Out::Unexpected);
            return Handled::Failed;
        }
        let k = m.from;
        if matches!(m.body, Body::Failure | Body::Fenced) {
            r.fenced[k] = true;
        }
        if r.out.is_some() {
            self.st.after_outcome += 1;
            return Handled::AfterOutcome;
        }
        let fresh = match m.body {
            Body::Chunk(c, last) => {
                let got = r.got[k] | 1 << c;
                let lasts = r.lasts[k] | u32::from(last) << c;
                // Two different last chunks, or a chunk after the last: never `{0..expected-1}`.
                if lasts.count_ones() > 1 || (lasts != 0 && got >= lasts << 1) {
                    r.out = Some(Out::Inconsistent(k));
                    return Handled::Failed;
                }
                let fresh = got != r.got[k] || lasts != r.lasts[k];
                r.got[k] = got;
                r.lasts[k] = lasts;
                fresh
            }
            Body::Aux => !std::mem::replace(&mut r.aux, true),
            Body::Failure | Body::Fenced => {
                r.out = Some(Out::Notified(k));
                self.st.accepted += 1;
                return Handled::Failed;
            }
        };
        if !fresh {
            self.st.duplicates += 1;
            return Handled::Duplicate;
        }
        self.st.accepted += 1;
        let r = self.req.as_ref().unwrap();
        if self.done(r) {
            self.req.as_mut().unwrap().out = Some(Out::Done);
            Handled::Completed
        } else {
            Handled::Progress
        }
    }

    fn expect(&mut self) -> Result<usize, TrackerError> {
        if let Some(r) = &self.req {
            return Err(TrackerError::AlreadyTracked { request: R, generation: r.gen });
        }
        self.req = Some(MReq {
            gen: self.cur,
            deadline: self.now + DEADLINE,
            got: [0; 2],
            lasts: [0; 2],
            aux: false,
            fenced: [false; 2],
            cut: [None; 2],
            out: None,
        });
        self.expire_early();
        // Early notifications of this generation apply in arrival order, as if they came now.
        let (mine, rest): (Vec<_>, Vec<_>) = self.early.drain(..).partition(|(m, _)| m.gen == self.cur);
        self.early = rest.into_iter().collect();
        for (m, _) in &mine {
            self.st.early_applied += 1;
            self.handle(*m);
        }
        // A sender still lost that the request still needs fails it at once; a lost sender holds
        // none of its pages (nothing is handed off to it), so it is fenced.
        let r = self.req.as_mut().unwrap();
        for k in 0..self.n {
            if self.lost.contains(&k) {
                r.fenced[k] = true;
                if r.out.is_none() && !r.complete(k) {
                    r.out = Some(Out::SenderDown(k));
                }
            }
        }
        Ok(mine.len())
    }

    /// Giving up fences nothing: a request the sender could still write waits for the cut-off.
    fn lost(&mut self, k: usize) -> Loss {
        if self.lost.insert(k) {
            self.loss_seq += 1;
            self.last_loss[k] = Some(self.loss_seq);
        }
        let id = self.last_loss[k].unwrap();
        let Some(r) = self.req.as_mut() else { return Loss { id, failed: vec![] } };
        if !r.fenced[k] && !r.complete(k) && r.cut[k].is_none() {
            r.cut[k] = Some((id, false));
        }
        if r.out.is_none() && !r.complete(k) {
            r.out = Some(Out::PeerLost(k));
            return Loss { id, failed: vec![R] };
        }
        Loss { id, failed: vec![] }
    }

    /// The cut-off of `k`'s latest loss: requests waiting on that loss are fenced for `k`.
    fn cut_off(&mut self, k: usize) -> Vec<RequestId> {
        let id = self.last_loss[k];
        match self.req.as_mut() {
            Some(r) if r.cut[k].is_some_and(|(l, _)| Some(l) == id) => {
                r.cut[k] = None;
                r.fenced[k] = true;
                vec![R]
            }
            _ => vec![],
        }
    }

    /// The cut-off of `k`'s latest loss failed: requests waiting on it are quarantined.
    fn quarantine(&mut self, k: usize) -> Vec<RequestId> {
        let id = self.last_loss[k];
        match self.req.as_mut() {
            Some(r) if r.cut[k].is_some_and(|(l, _)| Some(l) == id) => {
                r.cut[k] = Some((id.unwrap(), true));
                vec![R]
            }
            _ => vec![],
        }
    }

    fn release(&mut self) -> Option<Option<Out>> {
        self.settle_deadline();
        let r = self.req.take()?;
        self.released.insert(r.gen);
        self.cur = r.gen + 1;
        Some(r.out)
    }

    fn advance(&mut self, d: Duration) -> Vec<RequestId> {
        self.now += d;
        let was_pending = self.req.as_ref().is_some_and(|r| r.out.is_none());
        self.settle_deadline();
        self.expire_early();
        if was_pending && self.req.as_ref().is_some_and(|r| r.out.is_some()) {
            vec![R]
        } else {
            vec![]
        }
    }

    fn fence(&mut self) -> Option<Fence> {
        self.settle_deadline();
        let r = self.req.as_ref()?;
        Some(match &r.out {
            None => Fence::Open,
            Some(Out::Done) => Fence::Closed,
            Some(_) => {
                // A sender that delivered all its chunks has nothing in flight.
                let open: Vec<usize> = (0..self.n).filter(|k| !r.fenced[*k] && !r.complete(*k)).collect();
                let quarantined: Vec<(SenderKey, String)> = open
                    .iter()
                    .filter(|k| r.cut[**k].is_some_and(|(_, q)| q))
                    .map(|k| (key(*k), CUT_FAILED.to_owned()))
                    .collect();
                if !quarantined.is_empty() {
                    Fence::Quarantined(quarantined)
                } else if open.is_empty() {
                    Fence::Closed
                } else {
                    Fence::Closing(open.into_iter().map(key).collect())
                }
            }
        })
    }
}

/// The tracker's status in the model's words (`None`: pending).
fn out_of(s: Status, n: usize) -> Option<Out> {
    let ix = |k: SenderKey| (0..=ALIEN).find(|i| key(*i) == k).expect("a known key");
    match s {
        Status::Pending => None,
        Status::Done => Some(Out::Done),
        Status::Failed(f) => Some(match f {
            Failure::Notified { key, .. } => Out::Notified(ix(key)),
            Failure::UnexpectedKey { key } => {
                assert_eq!(ix(key), ALIEN);
                Out::Unexpected
            }
            Failure::InconsistentChunks { key, .. } => Out::Inconsistent(ix(key)),
            Failure::DeadlineExceeded { missing, missing_state, missing_aux, .. } => {
                assert!(missing_state.is_empty());
                assert!(!missing.is_empty() || missing_aux, "a deadline error names what is missing");
                assert!(missing.iter().all(|k| ix(*k) < n));
                Out::Deadline(missing.into_iter().map(ix).collect(), missing_aux)
            }
            Failure::PeerLost { key, .. } => Out::PeerLost(ix(key)),
            Failure::Aborted { .. } => Out::Aborted,
            Failure::SenderDown { key, .. } => Out::SenderDown(ix(key)),
        }),
    }
}

// ---------------------------------------------------------------------------------------------
// Running a sequence.

/// What a suite reached at least once (so that an alphabet that never gets somewhere is noticed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    Progress,
    Completed,
    Duplicate,
    Failed,
    AfterOutcome,
    Early,
    Released,
    Pending,
    Done,
    Notified,
    Unexpected,
    Inconsistent,
    Deadline,
    PeerLost,
    Aborted,
    SenderDown,
    Open,
    Closing,
    Quarantined,
    Closed,
    /// `expect` applied early notifications.
    Applied,
    /// An early notification expired (TTL or bound).
    Expired,
    /// `expect` of a room already tracked.
    AlreadyTracked,
}

const ALL_SEEN: [Seen; 23] = [
    Seen::Progress,
    Seen::Completed,
    Seen::Duplicate,
    Seen::Failed,
    Seen::AfterOutcome,
    Seen::Early,
    Seen::Released,
    Seen::Pending,
    Seen::Done,
    Seen::Notified,
    Seen::Unexpected,
    Seen::Inconsistent,
    Seen::Deadline,
    Seen::PeerLost,
    Seen::Aborted,
    Seen::SenderDown,
    Seen::Open,
    Seen::Closing,
    Seen::Quarantined,
    Seen::Closed,
    Seen::Applied,
    Seen::Expired,
    Seen::AlreadyTracked,
];

/// What the two-key full alphabets reach: everything but a key outside the set (a one-key letter).
const BUT_ALIEN: [Seen; 22] = [
    Seen::Progress,
    Seen::Completed,
    Seen::Duplicate,
    Seen::Failed,
    Seen::AfterOutcome,
    Seen::Early,
    Seen::Released,
    Seen::Pending,
    Seen::Done,
    Seen::Notified,
    Seen::Inconsistent,
    Seen::Deadline,
    Seen::PeerLost,
    Seen::Aborted,
    Seen::SenderDown,
    Seen::Open,
    Seen::Closing,
    Seen::Quarantined,
    Seen::Closed,
    Seen::Applied,
    Seen::Expired,
    Seen::AlreadyTracked,
];

const LIFECYCLE: [Seen; 19] = [
    Seen::Progress,
    Seen::Completed,
    Seen::Duplicate,
    Seen::Failed,
    Seen::AfterOutcome,
    Seen::Early,
    Seen::Released,
    Seen::Pending,
    Seen::Done,
    Seen::Notified,
    Seen::Deadline,
    Seen::PeerLost,
    Seen::SenderDown,
    Seen::Open,
    Seen::Closing,
    Seen::Closed,
    Seen::Applied,
    Seen::Expired,
    Seen::AlreadyTracked,
];

const FENCE: [Seen; 20] = [
    Seen::Progress,
    Seen::Completed,
    Seen::Duplicate,
    Seen::Failed,
    Seen::AfterOutcome,
    Seen::Early,
    Seen::Pending,
    Seen::Done,
    Seen::Notified,
    Seen::Deadline,
    Seen::PeerLost,
    Seen::Aborted,
    Seen::SenderDown,
    Seen::Open,
    Seen::Closing,
    Seen::Quarantined,
    Seen::Closed,
    Seen::Applied,
    Seen::Expired,
    Seen::AlreadyTracked,
];

const EARLY: [Seen; 18] = [
    Seen::Progress,
    Seen::Completed,
    Seen::Duplicate,
    Seen::Failed,
    Seen::AfterOutcome,
    Seen::Early,
    Seen::Released,
    Seen::Pending,
    Seen::Done,
    Seen::Notified,
    Seen::Inconsistent,
    Seen::Deadline,
    Seen::Open,
    Seen::Closing,
    Seen::Closed,
    Seen::Applied,
    Seen::Expired,
    Seen::AlreadyTracked,
];

fn bit(s: Seen) -> u32 {
    1 << s as u32
}

/// The tracker and the model side by side.
struct Run {
    t: CompletionTracker,
    m: Model,
    t0: Instant,
    seen: u32,
}

impl Run {
    fn new(n: usize, aux: bool, t0: Instant) -> Self {
        let mut t = CompletionTracker::with_config(config());
        // Generation 1 of the room was used and released before the sequence starts.
        let spec =
            ExpectSpec { generation: 1, senders: vec![key(0)], aux: false, state: false, digest: false, deadline: t0 };
        t.expect(R, spec, t0).unwrap();
        t.release(R, t0);
        Self { t, m: Model::new(n, aux), t0, seen: 0 }
    }

    fn now(&self) -> Instant {
        self.t0 + self.m.now
    }

    fn applicable(&self, ev: Ev) -> bool {
        match ev {
            Ev::Dup => self.m.latest.is_some(),
            Ev::Back(k) => self.m.lost.contains(&k),
            Ev::CutOff(k) | Ev::Quarantine(k) => self.m.last_loss[k].is_some(),
            _ => true,
        }
    }

    fn send(&mut self, msg: Msg) {
        self.m.latest = Some(msg);
        let now = self.now();
        let got = self.t.handle(&msg.wire(), now);
        let want = self.m.handle(msg);
        assert_eq!(got, want, "handled {msg:?}");
        self.seen |= bit(match got {
            Handled::Progress => Seen::Progress,
            Handled::Completed => Seen::Completed,
            Handled::Duplicate => Seen::Duplicate,
            Handled::Failed => Seen::Failed,
            Handled::AfterOutcome => Seen::AfterOutcome,
            Handled::Early => Seen::Early,
            Handled::Released => Seen::Released,
            Handled::NotForReceiver => unreachable!("no such letter"),
        });
    }

    /// Applies one event to both; panics (with context added by the caller) on any difference.
    fn step(&mut self, ev: Ev) {
        let (cur, now) = (self.m.cur, self.now());
        let msg = |gen, from, body| Msg { gen, from, body };
        match ev {
            Ev::Chunk(k, c, last) => self.send(msg(cur, k, Body::Chunk(c, last))),
            Ev::Aux(k) => self.send(msg(cur, k, Body::Aux)),
            Ev::Fail(k) => self.send(msg(cur, k, Body::Failure)),
            Ev::Fenced(k) => self.send(msg(cur, k, Body::Fenced)),
            Ev::Alien => self.send(msg(cur, ALIEN, Body::Chunk(0, true))),
            Ev::Dup => self.send(self.m.latest.unwrap()),
            Ev::Late => self.send(msg(cur - 1, 0, Body::Chunk(0, true))),
            Ev::Future => self.send(msg(cur + 1, 0, Body::Chunk(0, true))),
            Ev::Abort => {
                self.t.abort(R, "receiver aborted");
                if let Some(r) = self.m.req.as_mut().filter(|r| r.out.is_none()) {
                    r.out = Some(Out::Aborted);
                }
            }
            Ev::Lost(k) => assert_eq!(self.t.sender_lost(key(k), "connection reset"), self.m.lost(k), "sender_lost"),
            Ev::CutOff(k) => {
                let loss = self.m.last_loss[k].unwrap();
                assert_eq!(self.t.sender_cut_off(key(k), loss), self.m.cut_off(k), "sender_cut_off");
            }
            Ev::Quarantine(k) => {
                let loss = self.m.last_loss[k].unwrap();
                assert_eq!(
                    self.t.sender_quarantined(key(k), loss, CUT_FAILED),
                    self.m.quarantine(k),
                    "sender_quarantined"
                );
            }
            Ev::Back(k) => {
                self.t.sender_back(key(k));
                self.m.lost.remove(&k);
            }
            Ev::Release => {
                let got = self.t.release(R, now).map(|s| out_of(s, self.m.n));
                assert_eq!(got, self.m.release(), "release");
            }
            Ev::Expect => {
                let spec = ExpectSpec {
                    generation: cur,
                    senders: (0..self.m.n).map(key).collect(),
                    aux: self.m.aux_req,
                    state: false,
                    digest: false,
                    deadline: now + DEADLINE,
                };
                let got = self.t.expect(R, spec, now);
                assert_eq!(got, self.m.expect(), "expect");
                match got {
                    Ok(0) => {}
                    Ok(_) => self.seen |= bit(Seen::Applied),
                    Err(_) => self.seen |= bit(Seen::AlreadyTracked),
                }
            }
            Ev::PastDeadline | Ev::PastTtl => {
                let d = if ev == Ev::PastDeadline { DEADLINE } else { TTL };
                let want = self.m.advance(d);
                assert_eq!(self.t.poll_deadlines(self.now()), want, "poll_deadlines");
            }
        }
    }

    /// Everything observable must equal the model.
    fn check(&mut self) {
        let now = self.now();
        let n = self.m.n;
        let fence = self.t.fence(R, now);
        assert_eq!(fence, self.m.fence(), "fence");
        let status = self.t.status(R, now).map(|s| out_of(s, n));
        assert_eq!(status, self.m.req.as_ref().map(|r| r.out.clone()), "status");
        assert_eq!(self.t.generation(R), self.m.req.as_ref().map(|r| r.gen), "generation");
        for g in 0..=self.m.cur + 1 {
            assert_eq!(self.t.is_released(R, g), self.m.released.contains(&g), "is_released({g})");
        }
        assert_eq!(self.t.early_len(), self.m.early.len(), "early_len");
        assert_eq!(self.t.stats(), self.m.st, "stats");
        let next = self.m.req.as_ref().filter(|r| r.out.is_none()).map(|r| self.t0 + r.deadline);
        assert_eq!(self.t.next_deadline(), next, "next_deadline");
        assert_eq!(self.t.lost_senders(), self.m.lost.iter().map(|k| key(*k)).collect::<Vec<_>>(), "lost_senders");
        assert_eq!(self.t.len(), usize::from(self.m.req.is_some()), "len");
        assert_eq!(self.t.is_empty(), self.m.req.is_none(), "is_empty");
        if let Some(f) = fence {
            self.seen |= bit(match f {
                Fence::Open => Seen::Open,
                Fence::Closing(_) => Seen::Closing,
                Fence::Quarantined(_) => Seen::Quarantined,
                Fence::Closed => Seen::Closed,
            });
        }
        if let Some(s) = status {
            self.seen |= bit(match s {
                None => Seen::Pending,
                Some(Out::Done) => Seen::Done,
                Some(Out::Notified(_)) => Seen::Notified,
                Some(Out::Unexpected) => Seen::Unexpected,
                Some(Out::Inconsistent(_)) => Seen::Inconsistent,
                Some(Out::Deadline(..)) => Seen::Deadline,
                Some(Out::PeerLost(_)) => Seen::PeerLost,
                Some(Out::Aborted) => Seen::Aborted,
                Some(Out::SenderDown(_)) => Seen::SenderDown,
            });
        }
        if self.m.st.early_expired > 0 {
            self.seen |= bit(Seen::Expired);
        }
    }
}

/// Replays `seq` (already checked up to its last event), then checks its last event. Returns what
/// the last event reached, or `None` when it cannot apply.
fn run_last(n: usize, aux: bool, t0: Instant, seq: &[Ev]) -> Option<u32> {
    let mut run = Run::new(n, aux, t0);
    let (last, prefix) = seq.split_last().expect("a non-empty sequence");
    for ev in prefix {
        run.step(*ev);
    }
    if !run.applicable(*last) {
        return None;
    }
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run.step(*last);
        run.check();
    }));
    if let Err(e) = r {
        let msg = e
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        panic!("{n} key(s), aux {aux}: after {seq:?}:\n{msg}");
    }
    Some(run.seen)
}

/// Checks every applicable sequence over `alphabet` of length at most `max`; returns how many (with
/// the empty one) and asserts that they reached everything in `reach`.
fn exhaust(n: usize, aux: bool, alphabet: &[Ev], max: usize, reach: &[Seen]) -> u64 {
    struct Walk<'a> {
        n: usize,
        aux: bool,
        t0: Instant,
        alphabet: &'a [Ev],
        max: usize,
        count: u64,
        seen: u32,
    }
    fn go(w: &mut Walk<'_>, seq: &mut Vec<Ev>) {
        if seq.len() == w.max {
            return;
        }
        for ev in w.alphabet {
            seq.push(*ev);
            if let Some(seen) = run_last(w.n, w.aux, w.t0, seq) {
                w.count += 1;
                w.seen |= seen;
                go(w, seq);
            }
            seq.pop();
        }
    }
    let t0 = Instant::now();
    let mut first = Run::new(n, aux, t0);
    first.check();
    let mut w = Walk { n, aux, t0, alphabet, max, count: 1, seen: 0 };
    go(&mut w, &mut Vec::new());
    let missed: Vec<Seen> = reach.iter().copied().filter(|s| w.seen & bit(*s) == 0).collect();
    let unlisted: Vec<Seen> =
        ALL_SEEN.iter().copied().filter(|s| w.seen & bit(*s) != 0 && !reach.contains(s)).collect();
    assert!(missed.is_empty(), "the suite never reached {missed:?}");
    assert!(unlisted.is_empty(), "the suite also reaches {unlisted:?}: list it");
    w.count
}

#[test]
fn exhaustive_one_key_full_alphabet() {
    let a = full_alphabet(1, false);
    assert_eq!(a.len(), 19);
    assert_eq!(exhaust(1, false, &a, 5, &ALL_SEEN), 1_136_416);
}

#[test]
fn exhaustive_one_key_with_aux_full_alphabet() {
    let a = full_alphabet(1, true);
    assert_eq!(a.len(), 20);
    assert_eq!(exhaust(1, true, &a, 5, &ALL_SEEN), 1_526_776);
}

#[test]
fn exhaustive_two_keys_full_alphabet() {
    let a = full_alphabet(2, false);
    assert_eq!(a.len(), 28);
    assert_eq!(exhaust(2, false, &a, 4, &BUT_ALIEN), 246_937);
}

#[test]
fn exhaustive_two_keys_with_aux_full_alphabet() {
    let a = full_alphabet(2, true);
    assert_eq!(a.len(), 29);
    assert_eq!(exhaust(2, true, &a, 4, &BUT_ALIEN), 293_793);
}

/// Generations, early notifications and the fence of one key to six events.
#[test]
fn exhaustive_one_key_lifecycle_to_six() {
    let a = [
        Ev::Chunk(0, 0, true),
        Ev::Aux(0),
        Ev::Fail(0),
        Ev::Dup,
        Ev::Late,
        Ev::Future,
        Ev::Release,
        Ev::Expect,
        Ev::PastTtl,
        Ev::Lost(0),
    ];
    assert_eq!(exhaust(1, true, &a, 6, &LIFECYCLE), 926_836);
}

/// Failure, fence and loss with two keys to six events.
#[test]
fn exhaustive_two_keys_fence_to_six() {
    let a = [
        Ev::Chunk(0, 0, true),
        Ev::Chunk(1, 0, true),
        Ev::Fail(0),
        Ev::Fenced(1),
        Ev::Abort,
        Ev::Lost(1),
        Ev::CutOff(1),
        Ev::Quarantine(1),
        Ev::Back(1),
        Ev::Expect,
        Ev::Release,
        Ev::PastDeadline,
    ];
    assert_eq!(exhaust(2, false, &a, 6, &FENCE), 1_016_089);
}

/// Early notifications, generations and completion with two keys and aux to six events.
#[test]
fn exhaustive_two_keys_early_to_six() {
    let a = [
        Ev::Chunk(0, 0, false),
        Ev::Chunk(0, 1, true),
        Ev::Chunk(1, 0, true),
        Ev::Aux(0),
        Ev::Fail(1),
        Ev::Dup,
        Ev::Future,
        Ev::Release,
        Ev::Expect,
        Ev::PastTtl,
    ];
    assert_eq!(exhaust(2, true, &a, 6, &EARLY), 952_537);
}

// ---------------------------------------------------------------------------------------------
// Focused regressions.

fn spec(keys: &[SenderKey], generation: u64, t0: Instant) -> ExpectSpec {
    ExpectSpec { generation, senders: keys.to_vec(), aux: false, state: false, digest: false, deadline: t0 + DEADLINE }
}

fn chunk(request: RequestId, generation: u64, k: SenderKey, c: u32, last: bool) -> Notification {
    Notification::chunk(request, k, c, last).with_generation(generation)
}

/// Defect 2: a late or duplicated notification of a released request must not complete (or fail) a
/// new request that reuses the room: generation 1 released, generation 2 expected, generation 1's
/// full chunk set replayed (twice, with a late failure): generation 2 stays pending, and every one of
/// them is counted as released.
#[test]
fn defect_2_a_late_notification_of_a_released_request_does_not_complete_the_reused_room() {
    let t0 = Instant::now();
    let keys = [key(0), key(1)];
    let mut t = CompletionTracker::new();
    let gen1: Vec<Notification> =
        keys.iter().flat_map(|k| [chunk(R, 1, *k, 0, false), chunk(R, 1, *k, 1, true)]).collect();
    t.expect(R, spec(&keys, 1, t0), t0).unwrap();
    for n in &gen1 {
        t.handle(n, t0);
    }
    assert_eq!(t.release(R, t0), Some(Status::Done));
    assert_eq!(t.expect(R, spec(&keys, 2, t0), t0), Ok(0));
    let mut replay: Vec<Notification> = gen1.iter().chain(&gen1).cloned().collect();
    replay.push(Notification::failure(R, keys[0], "late failure").with_generation(1));
    replay.push(Notification::new(R, keys[1], NotificationBody::Fenced).with_generation(1));
    for n in &replay {
        assert_eq!(t.handle(n, t0), Handled::Released, "{n}");
    }
    assert_eq!(t.status(R, t0), Some(Status::Pending));
    assert_eq!(t.fence(R, t0), Some(Fence::Open));
    assert_eq!(t.generation(R), Some(2));
    let s = t.stats();
    assert_eq!((s.released, s.accepted, s.early_kept), (replay.len() as u64, 4, 0));
    assert_eq!(t.early_len(), 0, "a notification of a released generation is dropped, not kept");
    assert!(t.is_released(R, 1) && !t.is_released(R, 2));
    // A released generation cannot be expected again.
    t.release(R, t0);
    assert_eq!(
        t.expect(R, spec(&keys, 1, t0), t0),
        Err(TrackerError::GenerationReleased { request: R, generation: 1 })
    );
    // Generation 3 completes on its own notifications only.
    t.expect(R, spec(&keys, 3, t0), t0).unwrap();
    assert_eq!(t.handle(&chunk(R, 2, keys[0], 0, true), t0), Handled::Released);
    assert_eq!(t.handle(&chunk(R, 3, keys[0], 0, true), t0), Handled::Progress);
    assert_eq!(t.handle(&chunk(R, 3, keys[1], 0, true), t0), Handled::Completed);
}

/// Defect 3: notifications that arrive before `expect` (a fast prefill) are kept and applied when the
/// request is expected: chunks complete it, and a Failure fails it at once instead of at its deadline.
#[test]
fn defect_3_notifications_before_expect_are_kept_and_applied() {
    let t0 = Instant::now();
    let keys = [key(0), key(1)];
    let mut t = CompletionTracker::with_config(config());
    assert_eq!(t.handle(&chunk(R, 1, keys[0], 0, true), t0), Handled::Early);
    assert_eq!(t.handle(&Notification::failure(R, keys[1], "disk on fire").with_generation(1), t0), Handled::Early);
    assert_eq!((t.early_len(), t.status(R, t0)), (2, None));
    let t1 = t0 + Duration::from_secs(1);
    let failed = Status::Failed(Failure::Notified { key: keys[1], reason: "disk on fire".into() });
    assert_eq!(t.expect(R, spec(&keys, 1, t1), t1), Ok(2));
    assert_eq!(t.status(R, t1), Some(failed.clone()), "failed at once, not at the deadline");
    // Key 0 delivered all its chunks, key 1 failed (which fences it): the pages are reusable.
    assert_eq!(t.fence(R, t1), Some(Fence::Closed));
    assert_eq!(t.release(R, t1), Some(failed.clone()));
    // Applied in arrival order: the failure first, then key 0's chunk comes after the outcome and is
    // not recorded, so key 0 is still asked to fence (conservative; as when they arrive after expect).
    assert_eq!(t.handle(&Notification::failure(R, keys[1], "disk on fire").with_generation(2), t1), Handled::Early);
    assert_eq!(t.handle(&chunk(R, 2, keys[0], 0, true), t1), Handled::Early);
    assert_eq!(t.expect(R, spec(&keys, 2, t1), t1), Ok(2));
    assert_eq!(t.status(R, t1), Some(failed));
    assert_eq!(t.fence(R, t1), Some(Fence::Closing(vec![keys[0]])));
    // Every chunk before expect: done when expected, in arrival order (last chunk first is fine).
    let r8 = RequestId(8);
    for n in [chunk(r8, 5, keys[0], 1, true), chunk(r8, 5, keys[1], 0, true), chunk(r8, 5, keys[0], 0, false)] {
        assert_eq!(t.handle(&n, t1), Handled::Early);
    }
    assert_eq!(t.expect(r8, spec(&keys, 5, t1), t1), Ok(3));
    assert_eq!(t.status(r8, t1), Some(Status::Done));
    assert_eq!(t.fence(r8, t1), Some(Fence::Closed));
    let s = t.stats();
    assert_eq!((s.early_kept, s.early_applied, s.early_expired, s.accepted), (7, 7, 0, 6));
    assert_eq!(t.early_len(), 0);
}

/// Defect 3, the bounds: an early notification that is never expected expires after `early_ttl`
/// (whether the driver polls or the request is expected late), and beyond `early_max` the oldest is
/// dropped; every expiry is counted.
#[test]
fn defect_3_early_notifications_expire_after_early_ttl_and_beyond_early_max() {
    let t0 = Instant::now();
    let k = key(0);
    let mut t = CompletionTracker::with_config(config());
    // TTL, seen by the driver's poll.
    assert_eq!(t.handle(&Notification::failure(R, k, "gone").with_generation(1), t0), Handled::Early);
    t.poll_deadlines(t0 + TTL - Duration::from_millis(1));
    assert_eq!(t.early_len(), 1);
    t.poll_deadlines(t0 + TTL);
    assert_eq!((t.early_len(), t.stats().early_expired), (0, 1));
    assert_eq!(t.expect(R, spec(&[k], 1, t0 + TTL), t0 + TTL), Ok(0));
    assert_eq!(t.status(R, t0 + TTL), Some(Status::Pending), "an expired failure fails nothing");
    // TTL, seen by `expect` without a poll in between.
    let r8 = RequestId(8);
    assert_eq!(t.handle(&chunk(r8, 1, k, 0, true), t0), Handled::Early);
    assert_eq!(t.expect(r8, spec(&[k], 1, t0 + TTL), t0 + TTL), Ok(0));
    assert_eq!((t.status(r8, t0 + TTL), t.stats().early_expired), (Some(Status::Pending), 2));
    // The count bound: EARLY_MAX kept, the oldest dropped beyond it.
    let r9 = RequestId(9);
    for c in 0..=EARLY_MAX as u32 {
        assert_eq!(t.handle(&chunk(r9, 1, k, c, c == EARLY_MAX as u32), t0), Handled::Early);
    }
    assert_eq!((t.early_len(), t.stats().early_expired), (EARLY_MAX, 3));
    assert_eq!(t.expect(r9, spec(&[k], 1, t0), t0), Ok(EARLY_MAX));
    assert_eq!(t.status(r9, t0), Some(Status::Pending), "chunk 0 was dropped");
    assert_eq!(t.handle(&chunk(r9, 1, k, 0, false), t0), Handled::Completed);
    let s = t.stats();
    assert_eq!((s.early_kept, s.early_applied, s.early_expired), (2 + EARLY_MAX as u64 + 1, EARLY_MAX as u64, 3));
}

/// The fence (SEMANTICS §6): a request failed by one sender's Failure is `Closing` over the other
/// senders until each of them sent Fenced or was cut off; then `Closed`.
#[test]
fn fence_a_failed_request_closes_when_every_other_sender_fenced_or_is_cut_off() {
    let t0 = Instant::now();
    let keys = [key(0), key(1), key(3)];
    let mut t = CompletionTracker::new();
    t.expect(R, spec(&keys, 1, t0), t0).unwrap();
    assert_eq!(t.fence(R, t0), Some(Fence::Open));
    assert_eq!(t.handle(&Notification::failure(R, keys[0], "write failed").with_generation(1), t0), Handled::Failed);
    assert_eq!(t.fence(R, t0), Some(Fence::Closing(vec![keys[1], keys[2]])));
    // A chunk after the outcome is no fence; Fenced is.
    assert_eq!(t.handle(&chunk(R, 1, keys[1], 0, false), t0), Handled::AfterOutcome);
    assert_eq!(t.fence(R, t0), Some(Fence::Closing(vec![keys[1], keys[2]])));
    let fenced = Notification::new(R, keys[1], NotificationBody::Fenced).with_generation(1);
    assert_eq!(t.handle(&fenced, t0), Handled::AfterOutcome);
    assert_eq!(t.fence(R, t0), Some(Fence::Closing(vec![keys[2]])));
    let loss = t.sender_lost(keys[2], "connection closed");
    assert_eq!(loss.failed, Vec::<RequestId>::new());
    // Giving up is no fence (issue 32): until the cut-off is confirmed, key 2 may still write.
    assert_eq!(t.fence(R, t0), Some(Fence::Closing(vec![keys[2]])));
    assert_eq!(t.sender_cut_off(keys[2], loss.id), vec![R]);
    assert_eq!(t.fence(R, t0), Some(Fence::Closed));
    assert_eq!(
        t.status(R, t0),
        Some(Status::Failed(Failure::Notified { key: keys[0], reason: "write failed".into() }))
    );
}

/// The fence: a Done request is closed (every sender delivered everything).
#[test]
fn fence_a_done_request_is_closed() {
    let t0 = Instant::now();
    let keys = [key(0), key(1)];
    let mut t = CompletionTracker::new();
    t.expect(R, spec(&keys, 1, t0), t0).unwrap();
    t.handle(&chunk(R, 1, keys[0], 0, true), t0);
    assert_eq!(t.fence(R, t0), Some(Fence::Open));
    assert_eq!(t.handle(&chunk(R, 1, keys[1], 0, true), t0), Handled::Completed);
    assert_eq!(t.fence(R, t0), Some(Fence::Closed));
    // Past the deadline it stays done and closed.
    assert_eq!(t.fence(R, t0 + DEADLINE), Some(Fence::Closed));
    assert_eq!(t.status(R, t0 + DEADLINE), Some(Status::Done));
}

/// The fence: a request aborted by the receiver before any notification waits for every sender;
/// one that had delivered all its chunks before the abort is not waited for.
#[test]
fn fence_a_request_aborted_with_no_notification_is_closing_over_every_sender() {
    let t0 = Instant::now();
    let keys = [key(0), key(1), key(3)];
    let mut t = CompletionTracker::new();
    t.expect(R, spec(&keys, 1, t0), t0).unwrap();
    t.abort(R, "client went away");
    assert_eq!(t.status(R, t0), Some(Status::Failed(Failure::Aborted { reason: "client went away".into() })));
    assert_eq!(t.fence(R, t0), Some(Fence::Closing(keys.to_vec())));
    let fenced = |k| Notification::new(R, k, NotificationBody::Fenced).with_generation(1);
    t.handle(&fenced(keys[2]), t0);
    assert_eq!(t.fence(R, t0), Some(Fence::Closing(vec![keys[0], keys[1]])));
    // A sender that had already failed the request answers with its failure: that fences it too.
    t.handle(&Notification::failure(R, keys[0], "aborted").with_generation(1), t0);
    t.handle(&fenced(keys[1]), t0);
    assert_eq!(t.fence(R, t0), Some(Fence::Closed));
    // The status stays the abort.
    assert_eq!(t.status(R, t0), Some(Status::Failed(Failure::Aborted { reason: "client went away".into() })));

    let r8 = RequestId(8);
    t.expect(r8, spec(&keys, 1, t0), t0).unwrap();
    t.handle(&chunk(r8, 1, keys[1], 0, true), t0);
    t.abort(r8, "client went away");
    assert_eq!(t.fence(r8, t0), Some(Fence::Closing(vec![keys[0], keys[2]])));
    // The deadline does not close a fence either.
    assert_eq!(t.fence(r8, t0 + DEADLINE), Some(Fence::Closing(vec![keys[0], keys[2]])));
}

/// A lost sender fails the requests expected after the loss at once (`Failure::SenderDown`), not at
/// their deadline, until `sender_back`; requests that do not need it are unaffected.
#[test]
fn a_lost_sender_fails_requests_expected_after_the_loss_until_it_is_back() {
    let t0 = Instant::now();
    let keys = [key(0), key(1)];
    let mut t = CompletionTracker::new();
    assert_eq!(t.sender_lost(keys[1], "connection reset").failed, Vec::<RequestId>::new());
    assert_eq!(t.lost_senders(), vec![keys[1]]);
    assert_eq!(t.expect(R, spec(&keys, 1, t0), t0), Ok(0));
    let down = Failure::SenderDown { key: keys[1], reason: "connection reset".into() };
    assert_eq!(t.status(R, t0), Some(Status::Failed(down.clone())));
    assert!(down.to_string().contains("connection reset"), "{down}");
    // Nothing was handed off to the lost sender: only key 0 may still write.
    assert_eq!(t.fence(R, t0), Some(Fence::Closing(vec![keys[0]])));
    assert_eq!(t.next_deadline(), None);
    // A request that does not need the lost sender is unaffected.
    t.expect(RequestId(8), spec(&keys[..1], 1, t0), t0).unwrap();
    assert_eq!(t.status(RequestId(8), t0), Some(Status::Pending));
    // Still lost for a later request, until it is back.
    t.expect(RequestId(9), spec(&keys, 1, t0), t0).unwrap();
    assert_eq!(t.status(RequestId(9), t0), Some(Status::Failed(down)));
    t.sender_back(keys[1]);
    assert!(t.lost_senders().is_empty());
    let r10 = RequestId(10);
    t.expect(r10, spec(&keys, 1, t0), t0).unwrap();
    assert_eq!(t.status(r10, t0), Some(Status::Pending));
    t.handle(&chunk(r10, 1, keys[0], 0, true), t0);
    assert_eq!(t.handle(&chunk(r10, 1, keys[1], 0, true), t0), Handled::Completed);
}

/// What a sender delivered before it was lost still counts when the request is expected after the
/// loss (as it does for a request tracked when the loss happens): its early notifications are applied
/// before the lost senders are looked at, and a lost sender with nothing missing fails nothing.
#[test]
fn a_sender_lost_after_delivering_early_does_not_fail_the_request() {
    let t0 = Instant::now();
    let keys = [key(0), key(1)];
    let mut t = CompletionTracker::new();
    assert_eq!(t.handle(&chunk(R, 1, keys[1], 0, true), t0), Handled::Early);
    t.sender_lost(keys[1], "finished and hung up");
    assert_eq!(t.expect(R, spec(&keys, 1, t0), t0), Ok(1));
    assert_eq!(t.status(R, t0), Some(Status::Pending));
    assert_eq!(t.handle(&chunk(R, 1, keys[0], 0, true), t0), Handled::Completed);
    // Same with one key: done at once.
    let r8 = RequestId(8);
    assert_eq!(t.handle(&chunk(r8, 1, keys[1], 0, true), t0), Handled::Early);
    assert_eq!(t.expect(r8, spec(&keys[1..], 1, t0), t0), Ok(1));
    assert_eq!(t.status(r8, t0), Some(Status::Done));
    // And a request failed for another reason is fenced by the lost sender.
    let r9 = RequestId(9);
    assert_eq!(t.handle(&Notification::failure(r9, keys[0], "oom").with_generation(1), t0), Handled::Early);
    assert_eq!(t.expect(r9, spec(&keys, 1, t0), t0), Ok(1));
    assert_eq!(t.status(r9, t0), Some(Status::Failed(Failure::Notified { key: keys[0], reason: "oom".into() })));
    assert_eq!(t.fence(r9, t0), Some(Fence::Closed));
}

/// Issue 32: a sender given up on (its lease expired while it was only stopped) may resume and
/// write. The requests it could still write fail at once but stay `Closing` until the driver's
/// cut-off of that loss is confirmed; a cut-off that cannot be confirmed quarantines them (named),
/// and only a later confirmation of the same loss closes them. A later loss of the sender's next
/// instance is confirmed on its own: confirming the old loss does not fence the new one.
#[test]
fn issue_32_giving_up_on_a_sender_fences_nothing_until_its_cut_off_is_confirmed() {
    let t0 = Instant::now();
    let keys = [key(0), key(1)];
    let mut t = CompletionTracker::new();
    t.expect(R, spec(&keys, 1, t0), t0).unwrap();
    t.handle(&chunk(R, 1, keys[0], 0, true), t0);
    let first = t.sender_lost(keys[1], "lease expired");
    assert_eq!(first.failed, vec![R]);
    assert_eq!(
        t.status(R, t0),
        Some(Status::Failed(Failure::PeerLost { key: keys[1], reason: "lease expired".into() }))
    );
    assert_eq!(t.fence(R, t0), Some(Fence::Closing(vec![keys[1]])), "giving up is no fence");
    assert_eq!(t.sender_lost(keys[1], "store unreachable"), Loss { id: first.id, failed: vec![] }, "idempotent");
    // The cut-off timed out: quarantined, naming the sender and why.
    assert_eq!(t.sender_quarantined(keys[1], first.id, "no confirmation within 10 s"), vec![R]);
    assert_eq!(t.fence(R, t0), Some(Fence::Quarantined(vec![(keys[1], "no confirmation within 10 s".into())])));
    // The sender comes back (a new instance) and serves a new request; it is lost again.
    t.sender_back(keys[1]);
    let r8 = RequestId(8);
    t.expect(r8, spec(&keys, 1, t0), t0).unwrap();
    let second = t.sender_lost(keys[1], "lease expired again");
    assert_ne!(second.id, first.id);
    assert_eq!(second.failed, vec![r8]);
    // Confirming the first loss fences only what waited on it.
    assert_eq!(t.sender_cut_off(keys[1], first.id), vec![R]);
    assert_eq!(t.fence(R, t0), Some(Fence::Closed));
    assert_eq!(t.fence(r8, t0), Some(Fence::Closing(vec![keys[0], keys[1]])));
    assert_eq!(t.sender_cut_off(keys[1], second.id), vec![r8]);
    assert_eq!(t.fence(r8, t0), Some(Fence::Closing(vec![keys[0]])));
    // A sender that finished its chunks before it was given up on writes nothing more: no wait.
    let r9 = RequestId(9);
    t.sender_back(keys[1]);
    t.expect(r9, spec(&keys, 1, t0), t0).unwrap();
    t.handle(&chunk(r9, 1, keys[1], 0, true), t0);
    t.abort(r9, "client went away");
    let third = t.sender_lost(keys[1], "lease expired");
    assert_eq!(third.failed, Vec::<RequestId>::new());
    assert_eq!(t.fence(r9, t0), Some(Fence::Closing(vec![keys[0]])));
    assert_eq!(t.loss_of(keys[1]), Some(third.id));
}
