//! The prefill request book over a request's whole life (SEMANTICS §7): handoffs and aborts early
//! and late, generations, chunks and layer parts, aux, failures from every side, the fence, the
//! deadline and release.
//!
//! `exhaustive_*`: for each small topology (1 or 2 decode ranks fed, aux asked or not) every sequence
//! of events drawn from a finite alphabet, up to a length, is run against the book and against
//! [`Model`], a reference written from SEMANTICS §7 without the book's internals. After every event
//! the book's answer, the notifications and outcomes it queued, and its `status`, `len`,
//! `early_len`, `open_count`, `in_flight`, `settling`, `next_deadline` and `stats` must equal the
//! model's. Beside the equality, three rules are checked on the book's own output, whatever the
//! model says: a `Fenced` for a handoff the request holds goes out only when nothing of the request
//! is in flight; when a failure is told, every receiver that handed off is told once (`Fenced` if it
//! asked to abort, the failure otherwise); and no part is accepted after a decode rank asked to abort
//! or after the request failed.
//!
//! The alphabet ([`Ev`]), for one room and a book whose total is two pages (one page per chunk) on
//! a stage of two layers: create, a handoff and an abort from each fed decode rank under generation 1
//! or 2, a handoff from a rank not fed, init, a whole chunk, layer 0 or 1 of the chunk in progress
//! (or of the next one), a part settling (ok or failed: the oldest in flight), aux, the engine's
//! abort, a lost decode rank (every open request fails), release, and time past the early TTL or
//! past the request deadline (each followed by `poll_deadlines`, as the driver's timer does). A
//! letter that cannot apply (a part settling when none is in flight) is skipped.
//!
//! | test | receivers | letters | prelude | length | sequences |
//! |---|---|---|---|---|---|
//! | `exhaustive_one_receiver` | 1 | all 18 | none | ≤ 5 | 1,119,045 |
//! | `exhaustive_one_receiver_with_aux_from_create` | 1, aux | 16 (no create, no handoff of generation 2) | create, init, handoff | ≤ 6 | 10,470,375 |
//! | `exhaustive_two_receivers` | 2 | all 22 | create | ≤ 5 | 3,369,781 |
//! | `exhaustive_two_receivers_sending` | 2 | 12 (sending, aborts, settling) | create, init, both handoffs | ≤ 6 | 1,485,041 |
//!
//! 16,444,242 sequences in all (each suite is prefix-closed: every length from 0 up to the maximum;
//! the counts are asserted), about 27 s of wall time in the test profile (on 2 cores, beside a build) over four tests that run in parallel.
//! Each suite also asserts which phases and which actions it reached.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use kvxfer_core::prefill::{
    AbortOutcome, Action, BookConfig, BookStats, BookStatus, CallError, FailCause, Handoff, HandoffOutcome, Part,
    PartTarget, PrefillBook,
};
use kvxfer_core::{NotificationBody, Phase, RankId, RequestId};

const R: RequestId = RequestId(7);
const TIMEOUT: Duration = Duration::from_secs(10);
const TTL: Duration = Duration::from_secs(4);
const EARLY_MAX: usize = 2;
const TOTAL: u32 = 2;
const LAYERS: u32 = 2;
/// The rank this book's prefill rank does not feed.
const NOT_FED: usize = 9;

fn rank(i: usize) -> RankId {
    RankId::new(i as u32, 0)
}

/// Decode rank `d`'s pages for generation `g` (distinct per rank and generation, so a target's
/// pages say whose handoff they came from).
fn pages(d: usize, g: u64) -> Vec<u32> {
    (0..TOTAL).map(|i| 100 * d as u32 + 10 * g as u32 + i).collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ev {
    Create,
    Handoff(usize, u64),
    Abort(usize, u64),
    NotFedHandoff,
    Init,
    Whole,
    Layer(u32),
    Settle(bool),
    Aux,
    EngineAbort,
    Lost,
    Release,
    PastTtl,
    PastDeadline,
}

/// What one event answered, in the model's terms.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Answer {
    None,
    Call(Result<(), CallError>),
    Part(Result<Part, CallError>),
    Aux(Result<Vec<(RankId, u64)>, CallError>),
    Handoff(HandoffOutcome),
    Abort(AbortOutcome),
    Bool(bool),
    Count(usize),
    Released(Result<BookStatus, CallError>),
}

/// An action without the parts the model does not predict (instants, reasons' words).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Out {
    Fenced(usize, u64),
    Failure(usize, u64),
    Succeeded,
    Failed(String, Vec<(usize, bool)>),
    Cancel,
}

fn out_of(a: &Action) -> Out {
    match a {
        Action::Notify { to, note, .. } => match note.body {
            NotificationBody::Fenced => Out::Fenced(to.tp as usize, note.generation),
            NotificationBody::Failure(_) => Out::Failure(to.tp as usize, note.generation),
            ref b => panic!("the book sent {b:?}, which these letters never cause"),
        },
        Action::Succeeded { .. } => Out::Succeeded,
        Action::Failed { cause, receivers, .. } => {
            Out::Failed(format!("{cause:?}"), receivers.iter().map(|(d, _, f)| (d.tp as usize, *f)).collect())
        }
        Action::Cancel { .. } => Out::Cancel,
    }
}

// ---------------------------------------------------------------------------------------------
// The model, from SEMANTICS §7.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EarlyKind {
    Handoff(u64),
    Abort(u64),
}

/// The request, while one exists.
#[derive(Debug, Clone, Default)]
struct Req {
    created: Duration,
    /// Decode rank -> generation of its handoff.
    handoffs: BTreeMap<usize, u64>,
    total: Option<u32>,
    /// Pages given to send (one per chunk).
    given: u32,
    /// Layers sent of the chunk in progress (layer-wise).
    layers: Option<BTreeSet<u32>>,
    in_flight: u32,
    last_posted: bool,
    aux_sent: bool,
    failed: Option<FailCause>,
    /// Decode ranks that asked to abort (their handoff's generation).
    asked: BTreeSet<usize>,
    told: bool,
    done: bool,
}

#[derive(Debug, Clone)]
struct Model {
    receivers: Vec<usize>,
    aux: bool,
    now: Duration,
    req: Option<Req>,
    early: VecDeque<(usize, EarlyKind, Duration)>,
    stats: BookStats,
    out: Vec<Out>,
}

impl Model {
    fn new(receivers: Vec<usize>, aux: bool) -> Self {
        Self {
            receivers,
            aux,
            now: Duration::ZERO,
            req: None,
            early: VecDeque::new(),
            stats: BookStats::default(),
            out: Vec::new(),
        }
    }

    fn keep(&mut self, d: usize, k: EarlyKind) {
        while self.early.len() >= EARLY_MAX {
            self.early.pop_front();
            self.stats.early_expired += 1;
        }
        self.early.push_back((d, k, self.now));
    }

    fn ready(&self, q: &Req) -> bool {
        self.receivers.iter().all(|d| q.handoffs.contains_key(d))
    }

    /// The request fails with `cause` unless it has an outcome; cancels; settles.
    fn fail(&mut self, cause: FailCause) -> bool {
        let Some(q) = &mut self.req else { return false };
        if q.done || q.failed.is_some() {
            return false;
        }
        q.failed = Some(cause);
        self.out.push(Out::Cancel);
        self.settle();
        true
    }

    /// A failed request with nothing in flight tells every receiver, once.
    fn settle(&mut self) {
        let Some(q) = &mut self.req else { return };
        let Some(cause) = q.failed else { return };
        if q.in_flight > 0 || q.told {
            return;
        }
        q.told = true;
        self.stats.failed += 1;
        let mut told = Vec::new();
        for (d, g) in &q.handoffs {
            let fenced = q.asked.contains(d);
            self.out.push(if fenced { Out::Fenced(*d, *g) } else { Out::Failure(*d, *g) });
            told.push((*d, fenced));
        }
        self.out.push(Out::Failed(format!("{cause:?}"), told));
    }

    fn status(&self) -> (Phase, bool) {
        let Some(q) = &self.req else { return (Phase::Failed, true) };
        if q.failed.is_some() {
            return if q.in_flight == 0 { (Phase::Failed, true) } else { (Phase::Aborting, false) };
        }
        if q.done {
            return (Phase::Success, true);
        }
        if q.last_posted {
            return (Phase::Transferring, false);
        }
        let phase = if self.ready(q) { Phase::WaitingForInput } else { Phase::Bootstrapping };
        (phase, q.in_flight == 0)
    }

    fn part(&mut self, layer: Option<u32>) -> Result<Part, CallError> {
        let refused = |s: &str| Err(CallError::Refused(s.into()));
        let Some(q) = &self.req else { return Err(CallError::Unknown) };
        if q.failed.is_some() {
            return refused("failed");
        }
        if !self.ready(q) {
            return refused("not ready");
        }
        let Some(total) = q.total else { return refused("no init") };
        if q.last_posted {
            return refused("last sent");
        }
        let continuing = match (&q.layers, layer) {
            (Some(_), None) => return refused("layer-wise chunk in progress"),
            (Some(done), Some(l)) if done.contains(&l) => return refused("layer sent"),
            (Some(_), Some(_)) => true,
            (None, _) => false,
        };
        if !continuing && q.given + 1 > total {
            return refused("beyond the total");
        }
        let q = self.req.as_mut().unwrap();
        if !continuing {
            q.given += 1;
        }
        let chunk = q.given - 1;
        let last = q.given == total;
        let finish = match layer {
            None => true,
            Some(l) => {
                let set = q.layers.get_or_insert_with(BTreeSet::new);
                set.insert(l);
                let full = set.len() as u32 == LAYERS;
                if full {
                    q.layers = None;
                }
                full
            }
        };
        if finish && last {
            q.last_posted = true;
        }
        q.in_flight += 1;
        let targets = q
            .handoffs
            .iter()
            .map(|(d, g)| PartTarget {
                rank: rank(*d),
                generation: *g,
                dst_pages: vec![pages(*d, *g)[chunk as usize]],
                digest: false,
            })
            .collect();
        Ok(Part { chunk, last, finish, targets })
    }

    fn step(&mut self, ev: Ev) -> Answer {
        match ev {
            Ev::Create => {
                if self.req.is_some() {
                    return Answer::Call(Err(CallError::RoomInUse));
                }
                let mut q = Req { created: self.now, ..Req::default() };
                let mut aborts = Vec::new();
                for (d, k, _) in std::mem::take(&mut self.early) {
                    match k {
                        EarlyKind::Handoff(g) => {
                            q.handoffs.insert(d, g);
                        }
                        EarlyKind::Abort(g) => aborts.push((d, g)),
                    }
                }
                for (d, g) in aborts {
                    if q.handoffs.get(&d) == Some(&g) {
                        q.asked.insert(d);
                        q.failed.get_or_insert(FailCause::AbortedByPeer);
                    }
                }
                self.req = Some(q);
                self.settle();
                Answer::Call(Ok(()))
            }
            Ev::NotFedHandoff => {
                self.stats.not_fed += 1;
                Answer::Handoff(HandoffOutcome::NotFed)
            }
            Ev::Handoff(d, g) => {
                if let Some(q) = &mut self.req {
                    match q.handoffs.get(&d) {
                        None if !q.done && q.failed.is_none() => {
                            q.handoffs.insert(d, g);
                            if self.early.iter().any(|(e, k, _)| *e == d && *k == EarlyKind::Abort(g)) {
                                self.req.as_mut().unwrap().asked.insert(d);
                                self.fail(FailCause::AbortedByPeer);
                            }
                            return Answer::Handoff(HandoffOutcome::Attached);
                        }
                        None if !q.done => {
                            q.handoffs.insert(d, g);
                            if q.told {
                                self.out.push(Out::Failure(d, g));
                                return Answer::Handoff(HandoffOutcome::AnsweredFailure);
                            }
                            return Answer::Handoff(HandoffOutcome::Attached);
                        }
                        Some(old) if *old == g => return Answer::Handoff(HandoffOutcome::Duplicate),
                        _ => {}
                    }
                }
                self.keep(d, EarlyKind::Handoff(g));
                self.stats.early_kept += 1;
                Answer::Handoff(HandoffOutcome::Kept)
            }
            Ev::Abort(d, g) => {
                let mine = self.req.as_ref().is_some_and(|q| q.handoffs.get(&d) == Some(&g));
                if mine {
                    let q = self.req.as_mut().unwrap();
                    q.asked.insert(d);
                    if !(q.done || q.told) {
                        let took = self.fail(FailCause::AbortedByPeer);
                        return Answer::Abort(if took { AbortOutcome::Aborted } else { AbortOutcome::FenceFollows });
                    }
                } else {
                    self.keep(d, EarlyKind::Abort(g));
                }
                self.out.push(Out::Fenced(d, g));
                Answer::Abort(AbortOutcome::FencedNow)
            }
            Ev::Init => match &mut self.req {
                None => Answer::Call(Err(CallError::Unknown)),
                Some(q) if q.total.is_some() => Answer::Call(Err(CallError::Refused("twice".into()))),
                Some(q) => {
                    q.total = Some(TOTAL);
                    Answer::Call(Ok(()))
                }
            },
            Ev::Whole => Answer::Part(self.part(None)),
            Ev::Layer(l) => Answer::Part(self.part(Some(l))),
            Ev::Settle(ok) => {
                let q = self.req.as_mut().expect("applies only with parts in flight");
                q.in_flight -= 1;
                if !ok && q.failed.is_none() {
                    q.failed = Some(FailCause::Transfer);
                    self.out.push(Out::Cancel);
                }
                let q = self.req.as_mut().unwrap();
                let aux_ok = q.aux_sent || !self.aux;
                if q.failed.is_none() && q.last_posted && q.in_flight == 0 && !q.done && aux_ok {
                    q.done = true;
                    self.stats.succeeded += 1;
                    self.out.push(Out::Succeeded);
                }
                self.settle();
                Answer::None
            }
            Ev::Aux => {
                let refused = |s: &str| Answer::Aux(Err(CallError::Refused(s.into())));
                let Some(q) = &self.req else { return Answer::Aux(Err(CallError::Unknown)) };
                if q.failed.is_some() {
                    return refused("failed");
                }
                if !self.ready(q) {
                    return refused("not ready");
                }
                if q.aux_sent {
                    return refused("twice");
                }
                let q = self.req.as_mut().unwrap();
                q.aux_sent = true;
                q.in_flight += 1;
                let to = if self.aux { q.handoffs.iter().map(|(d, g)| (rank(*d), *g)).collect() } else { Vec::new() };
                Answer::Aux(Ok(to))
            }
            Ev::EngineAbort => Answer::Bool(self.fail(FailCause::Aborted)),
            Ev::Lost => Answer::Count(usize::from(self.fail(FailCause::PeerLost))),
            Ev::Release => {
                if self.req.is_none() {
                    return Answer::Released(Err(CallError::Unknown));
                }
                let (phase, reusable) = self.status();
                let q = self.req.as_ref().unwrap();
                let idle = matches!(phase, Phase::Bootstrapping | Phase::WaitingForInput);
                if q.in_flight > 0 || !(phase.is_final() || idle) {
                    return Answer::Released(Err(CallError::Refused("in flight".into())));
                }
                self.req = None;
                Answer::Released(Ok(BookStatus { phase, reason: None, pages_reusable: reusable }))
            }
            Ev::PastTtl | Ev::PastDeadline => {
                self.now += if ev == Ev::PastTtl { TTL } else { TIMEOUT };
                let now = self.now;
                let before = self.early.len();
                self.early.retain(|(_, _, at)| now - *at < TTL);
                self.stats.early_expired += (before - self.early.len()) as u64;
                let late =
                    self.req.as_ref().is_some_and(|q| !q.done && q.failed.is_none() && now >= q.created + TIMEOUT);
                if late {
                    self.fail(FailCause::Deadline);
                }
                Answer::None
            }
        }
    }

    fn next_deadline(&self) -> Option<Duration> {
        let req = self.req.as_ref().filter(|q| !q.done && q.failed.is_none()).map(|q| q.created + TIMEOUT);
        req.into_iter().chain(self.early.iter().map(|(_, _, at)| *at + TTL)).min()
    }

    fn in_flight(&self) -> u32 {
        self.req.as_ref().map_or(0, |q| q.in_flight)
    }
}

// ---------------------------------------------------------------------------------------------
// The book under test, driven as the engine drives it.

#[derive(Clone)]
struct Driven {
    book: PrefillBook,
    t0: Instant,
    now: Duration,
}

/// Normalizes a refusal to its kind: the model does not predict the words.
fn kind<T>(r: Result<T, CallError>) -> Result<T, CallError> {
    r.map_err(|e| match e {
        CallError::Refused(_) => CallError::Refused(String::new()),
        e => e,
    })
}

/// The model's answer with its refusals' words dropped, as [`kind`] does to the book's.
fn norm(a: Answer) -> Answer {
    match a {
        Answer::Call(r) => Answer::Call(kind(r)),
        Answer::Part(r) => Answer::Part(kind(r)),
        Answer::Aux(r) => Answer::Aux(kind(r)),
        Answer::Released(r) => Answer::Released(kind(r)),
        a => a,
    }
}

impl Driven {
    fn new(receivers: &[usize]) -> Self {
        let book = PrefillBook::new(BookConfig {
            rank: RankId::new(0, 0),
            receivers: receivers.iter().map(|d| rank(*d)).collect(),
            stage_layers: LAYERS,
            request_timeout: TIMEOUT,
            early_max: EARLY_MAX,
            early_ttl: TTL,
        });
        Self { book, t0: Instant::now(), now: Duration::ZERO }
    }

    fn at(&self) -> Instant {
        self.t0 + self.now
    }

    fn handoff(d: usize, g: u64, aux: bool) -> Handoff {
        Handoff { generation: g, pages: pages(d, g), aux_slot: aux.then_some(3), digest: false }
    }

    /// The source pages of a part: the page index of its chunk.
    fn src(&self, layer: Option<u32>, m: &Model) -> Vec<u32> {
        let q = m.req.as_ref();
        let in_progress = q.is_some_and(|q| q.layers.is_some());
        let given = q.map_or(0, |q| q.given);
        match layer {
            Some(_) if in_progress => vec![given - 1],
            _ => vec![given],
        }
    }

    fn step(&mut self, ev: Ev, aux: bool, m: &Model) -> Answer {
        let now = self.at();
        match ev {
            Ev::Create => Answer::Call(self.book.create(R, (), now)),
            Ev::Handoff(d, g) => Answer::Handoff(self.book.handle_handoff(rank(d), R, Self::handoff(d, g, aux), now)),
            Ev::NotFedHandoff => {
                Answer::Handoff(self.book.handle_handoff(rank(NOT_FED), R, Self::handoff(NOT_FED, 1, aux), now))
            }
            Ev::Abort(d, g) => Answer::Abort(self.book.handle_abort(rank(d), R, g, "user", now)),
            Ev::Init => Answer::Call(kind(self.book.init(R, TOTAL))),
            Ev::Whole => {
                let src = self.src(None, m);
                Answer::Part(kind(self.book.reserve_part(R, &src, 0..LAYERS, true, true, now)))
            }
            Ev::Layer(l) => {
                let src = self.src(Some(l), m);
                Answer::Part(kind(self.book.reserve_part(R, &src, l..l + 1, false, true, now)))
            }
            Ev::Settle(ok) => {
                let r = if ok { Ok(()) } else { Err("write failed".to_string()) };
                self.book.part_done(R, r, &[]);
                Answer::None
            }
            Ev::Aux => Answer::Aux(kind(self.book.reserve_aux(R, 8, true))),
            Ev::EngineAbort => Answer::Bool(self.book.abort(R, "engine".into(), FailCause::Aborted)),
            Ev::Lost => Answer::Count(self.book.abort_open("lost decode rank", FailCause::PeerLost)),
            Ev::Release => Answer::Released(kind(self.book.release(R, true).map(|(mut s, ())| {
                s.reason = None;
                s
            }))),
            Ev::PastTtl | Ev::PastDeadline => {
                self.now += if ev == Ev::PastTtl { TTL } else { TIMEOUT };
                let now = self.at();
                self.book.poll_deadlines(now, |_| true);
                Answer::None
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The enumeration.

struct Suite {
    receivers: Vec<usize>,
    aux: bool,
    letters: Vec<Ev>,
    prelude: Vec<Ev>,
    max_len: usize,
}

#[derive(Default)]
struct Reached {
    sequences: u64,
    phases: BTreeSet<String>,
    outs: BTreeSet<String>,
}

fn check_same(b: &mut Driven, m: &mut Model, ev: Ev, aux: bool, trail: &[Ev]) {
    // The model's state before the event, for the book's source pages.
    let before = m.clone();
    m.out.clear();
    let want = norm(m.step(ev));
    let got = b.step(ev, aux, &before);
    assert_eq!(got, want, "answer to {ev:?} after {trail:?}");
    let mut outs = Vec::new();
    while let Some(a) = b.book.poll_action() {
        // Rule 1: a fence for a handoff the request holds goes out only with nothing in flight.
        if let Action::Notify { to, note, .. } = &a {
            if matches!(note.body, NotificationBody::Fenced) {
                let held = m.req.as_ref().is_some_and(|q| q.handoffs.get(&(to.tp as usize)) == Some(&note.generation));
                assert!(!held || m.in_flight() == 0, "fenced with parts in flight after {trail:?} {ev:?}");
            }
        }
        // Rule 2: a failure told goes to every receiver that handed off, once.
        if let Action::Failed { receivers, .. } = &a {
            let q = m.req.as_ref().expect("a request failed");
            let told: Vec<usize> = receivers.iter().map(|(d, _, _)| d.tp as usize).collect();
            assert_eq!(told, q.handoffs.keys().copied().collect::<Vec<_>>(), "told after {trail:?} {ev:?}");
            for (d, _, fenced) in receivers {
                assert_eq!(*fenced, q.asked.contains(&(d.tp as usize)), "fence of {d} after {trail:?} {ev:?}");
            }
        }
        outs.push(out_of(&a));
    }
    assert_eq!(outs, m.out, "actions of {ev:?} after {trail:?}");
    // Rule 3: no part after an abort from a decode rank or a failure.
    if let Answer::Part(Ok(_)) = &want {
        let q = before.req.as_ref().unwrap();
        assert!(q.asked.is_empty() && q.failed.is_none(), "a part accepted after an abort: {trail:?} {ev:?}");
    }
    let s = b.book.status(R, true);
    assert_eq!((s.phase, s.pages_reusable), m.status(), "status after {trail:?} {ev:?}");
    assert_eq!(s.reason.is_some(), m.req.as_ref().is_some_and(|q| q.failed.is_some()) || m.req.is_none());
    assert_eq!(b.book.len(), usize::from(m.req.is_some()), "len after {trail:?} {ev:?}");
    assert_eq!(b.book.early_len(), m.early.len(), "early_len after {trail:?} {ev:?}");
    let open = m.req.as_ref().is_some_and(|q| !q.done && q.failed.is_none());
    assert_eq!(b.book.open_count(), usize::from(open));
    assert_eq!(b.book.in_flight(), usize::from(m.in_flight() > 0));
    let settling = m.req.as_ref().is_some_and(|q| q.in_flight > 0 || (q.failed.is_some() && !q.told));
    assert_eq!(b.book.settling(), settling, "settling after {trail:?} {ev:?}");
    assert_eq!(b.book.next_deadline(), m.next_deadline().map(|d| b.t0 + d), "next_deadline after {trail:?} {ev:?}");
    assert_eq!(b.book.stats(), m.stats, "stats after {trail:?} {ev:?}");
}

fn applies(m: &Model, ev: Ev) -> bool {
    match ev {
        Ev::Settle(_) => m.in_flight() > 0,
        _ => true,
    }
}

fn walk(s: &Suite, b: &Driven, m: &Model, trail: &mut Vec<Ev>, reached: &mut Reached) {
    reached.sequences += 1;
    reached.phases.insert(format!("{:?}", m.status()));
    if trail.len() == s.max_len {
        return;
    }
    for &ev in &s.letters {
        if !applies(m, ev) {
            continue;
        }
        let (mut b2, mut m2) = (b.clone(), m.clone());
        check_same(&mut b2, &mut m2, ev, s.aux, trail);
        for o in &m2.out {
            reached.outs.insert(format!("{o:?}").split('(').next().unwrap().to_string());
        }
        trail.push(ev);
        walk(s, &b2, &m2, trail, reached);
        trail.pop();
    }
}

fn run(s: Suite) -> Reached {
    let mut b = Driven::new(&s.receivers);
    let mut m = Model::new(s.receivers.clone(), s.aux);
    for &ev in &s.prelude {
        check_same(&mut b, &mut m, ev, s.aux, &[]);
    }
    let mut reached = Reached::default();
    walk(&s, &b, &m, &mut Vec::new(), &mut reached);
    reached
}

fn letters(receivers: &[usize]) -> Vec<Ev> {
    let mut v = vec![Ev::Create, Ev::NotFedHandoff, Ev::Init, Ev::Whole, Ev::Layer(0), Ev::Layer(1)];
    for &d in receivers {
        v.extend([Ev::Handoff(d, 1), Ev::Handoff(d, 2), Ev::Abort(d, 1), Ev::Abort(d, 2)]);
    }
    v.extend([
        Ev::Settle(true),
        Ev::Settle(false),
        Ev::Aux,
        Ev::EngineAbort,
        Ev::Lost,
        Ev::Release,
        Ev::PastTtl,
        Ev::PastDeadline,
    ]);
    v
}

fn assert_reached(r: &Reached, phases: &[&str], outs: &[&str]) {
    for p in phases {
        assert!(r.phases.iter().any(|x| x.contains(p)), "phase {p} never reached: {:?}", r.phases);
    }
    for o in outs {
        assert!(r.outs.contains(*o), "{o} never emitted: {:?}", r.outs);
    }
}

#[test]
fn exhaustive_one_receiver() {
    let letters = letters(&[0]);
    assert_eq!(letters.len(), 18);
    let r = run(Suite { receivers: vec![0], aux: false, letters, prelude: vec![], max_len: 5 });
    assert_eq!(r.sequences, 1_119_045, "the suite's size changed: update the table in the module docs");
    assert_reached(
        &r,
        // Success takes 7 events (two chunks, two settles): the suites with a prelude reach it.
        &["Bootstrapping", "WaitingForInput", "Transferring", "Aborting", "Failed"],
        &["Fenced", "Failure", "Failed", "Cancel"],
    );
}

#[test]
fn exhaustive_one_receiver_with_aux_from_create() {
    let letters: Vec<Ev> = letters(&[0]).into_iter().filter(|e| !matches!(e, Ev::Handoff(_, 2) | Ev::Create)).collect();
    assert_eq!(letters.len(), 16);
    let r = run(Suite {
        receivers: vec![0],
        aux: true,
        letters,
        prelude: vec![Ev::Create, Ev::Init, Ev::Handoff(0, 1)],
        max_len: 6,
    });
    assert_eq!(r.sequences, 10_470_375, "the suite's size changed: update the table in the module docs");
    assert_reached(
        &r,
        &["WaitingForInput", "Transferring", "Success", "Aborting", "Failed"],
        &["Fenced", "Failure", "Succeeded", "Failed", "Cancel"],
    );
}

#[test]
fn exhaustive_two_receivers() {
    let letters = letters(&[0, 1]);
    assert_eq!(letters.len(), 22);
    let r = run(Suite { receivers: vec![0, 1], aux: false, letters, prelude: vec![Ev::Create], max_len: 5 });
    assert_eq!(r.sequences, 3_369_781, "the suite's size changed: update the table in the module docs");
    assert_reached(&r, &["Bootstrapping", "WaitingForInput", "Aborting", "Failed"], &["Fenced", "Failure", "Failed"]);
}

#[test]
fn exhaustive_two_receivers_sending() {
    let letters = vec![
        Ev::Whole,
        Ev::Layer(0),
        Ev::Layer(1),
        Ev::Settle(true),
        Ev::Settle(false),
        Ev::Abort(0, 1),
        Ev::Abort(1, 1),
        Ev::Handoff(1, 2),
        Ev::EngineAbort,
        Ev::Lost,
        Ev::Release,
        Ev::PastDeadline,
    ];
    let prelude = vec![Ev::Create, Ev::Init, Ev::Handoff(0, 1), Ev::Handoff(1, 1)];
    let r = run(Suite { receivers: vec![0, 1], aux: false, letters, prelude, max_len: 6 });
    assert_eq!(r.sequences, 1_485_041, "the suite's size changed: update the table in the module docs");
    assert_reached(
        &r,
        &["WaitingForInput", "Transferring", "Success", "Aborting", "Failed"],
        &["Fenced", "Failure", "Succeeded", "Failed", "Cancel"],
    );
}

/// A refused part changes nothing: a whole chunk asked for while a layer-wise chunk is in progress
/// (the engine before the book counted its pages anyway, and the request could never finish).
#[test]
fn a_refused_whole_chunk_during_a_layer_wise_chunk_changes_nothing() {
    let mut b = Driven::new(&[0]);
    let now = b.at();
    b.book.create(R, (), now).unwrap();
    b.book.handle_handoff(rank(0), R, Driven::handoff(0, 1, false), now);
    b.book.init(R, TOTAL).unwrap();
    let p = b.book.reserve_part(R, &[0], 0..1, false, true, now).unwrap();
    assert!(!p.finish);
    assert!(matches!(b.book.reserve_part(R, &[1], 0..LAYERS, true, true, now), Err(CallError::Refused(_))));
    let p = b.book.reserve_part(R, &[0], 1..2, false, true, now).unwrap();
    assert_eq!((p.chunk, p.last, p.finish), (0, false, true));
    let p = b.book.reserve_part(R, &[1], 0..LAYERS, true, true, now).unwrap();
    assert_eq!((p.chunk, p.last, p.finish), (1, true, true));
}
