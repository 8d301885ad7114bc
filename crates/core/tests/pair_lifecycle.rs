//! Both machines together: prefill request books and a decode rank's request book (with its
//! completion tracker), joined by message queues, over every interleaving of a small request's life (SEMANTICS §5-§7).
//!
//! The world: one decode rank that expects one or two prefill sender keys (P1 -> D1, P2 -> D1), one
//! room, a request of one page. Messages go through one FIFO per link and direction (each link is
//! one ordered connection): the decode rank's handoff and abort to each prefill rank, and each prefill
//! rank's chunk notification, failure and `Fenced` to the decode rank. A prefill part is in flight
//! from its `reserve_part` until it completes (its chunk notification is queued with its completion,
//! as the attached style does) or fails (the transfer's abort resolved: nothing of it can land).
//! The drivers' duties are done as the engine does them: the decode book's timer (`poll`) says which
//! senders to ask to abort (again on its re-ask schedule while a fence is missing), and a prefill
//! book's actions go on the queue to the decode rank.
//!
//! Letters: the decode rank hands off, aborts; each prefill rank creates its request (with `init`),
//! sends the chunk, completes or fails its oldest part, aborts (prefill rank 0 only); delivery of
//! the next message on each link; time past both sides' deadlines. A letter that cannot apply (a
//! second handoff, a delivery on an empty link) is skipped. Every sequence up to its length is then
//! driven to quiescence (every message delivered, every part completed, time past the deadlines).
//!
//! What must hold, on every prefix and at the end:
//! - **Safety**: once the decode rank says the pages are reusable (`Done`, or failed with the fence
//!   `Closed`), no prefill part for the request is in flight and none is accepted later: no byte can
//!   land in reused pages.
//! - **Liveness**: after quiescence the decode request is final with its fence closed, and every
//!   prefill request created is final.
//! - **Agreement**: the decode rank is `Done` only if every prefill rank succeeded; a prefill rank
//!   that succeeded delivered its chunk (the decode rank may still fail for another sender).
//!
//! | test | senders | letters | length | sequences |
//! |---|---|---|---|---|
//! | `one_sender_every_interleaving` | 1 | 10 | ≤ 10 | 695,820 |
//! | `two_senders_every_interleaving` | 2 | 16 | ≤ 8 | 593,475 |
//!
//! 1,289,295 sequences (the counts are asserted), each also driven to quiescence; about 8 s in the
//! test profile. A book that fences a decode rank's abort while a part is in flight fails the safety
//! check; one that does not answer the abort of a finished request never reaches quiescence (the
//! decode rank stays `Aborting`, asking again).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvxfer_core::decode::{DecodeBook, DecodeConfig};
use kvxfer_core::prefill::{Action, BookConfig, FailCause, Handoff, PrefillBook};
use kvxfer_core::{Notification, Phase, RankId, RequestId, SenderKey, TrackerConfig};

const R: RequestId = RequestId(3);
const GEN: u64 = 1;
const TIMEOUT: Duration = Duration::from_secs(10);

fn decode() -> RankId {
    RankId::new(0, 0)
}

fn prefill(i: usize) -> RankId {
    RankId::new(i as u32, 0)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ev {
    HandOff,
    DecodeAbort,
    Create(usize),
    Send(usize),
    Complete(usize, bool),
    PrefillAbort(usize),
    ToPrefill(usize),
    ToDecode(usize),
    PastDeadlines,
}

#[derive(Debug, Clone)]
enum ToP {
    Handoff,
    Abort,
}

#[derive(Clone)]
struct World {
    t0: Instant,
    now: Instant,
    decode: DecodeBook,
    books: Vec<PrefillBook>,
    created: Vec<bool>,
    to_p: Vec<VecDeque<ToP>>,
    to_d: Vec<VecDeque<Notification>>,
    /// Per prefill rank: its parts in flight (whether each finishes the chunk, and its `last`).
    parts: Vec<VecDeque<(bool, bool)>>,
    handed_off: bool,
    decode_aborted: bool,
    /// Set once the decode rank said its pages are reusable.
    reusable: bool,
}

impl World {
    fn new(senders: usize) -> Self {
        let t0 = Instant::now();
        let books = (0..senders)
            .map(|i| {
                PrefillBook::new(BookConfig {
                    rank: prefill(i),
                    receivers: vec![decode()],
                    stage_layers: 1,
                    request_timeout: TIMEOUT,
                    early_max: 8,
                    early_ttl: TIMEOUT * 4,
                })
            })
            .collect();
        Self {
            t0,
            now: t0,
            decode: DecodeBook::new(DecodeConfig {
                rank: decode(),
                senders: (0..senders).map(|i| SenderKey::of(prefill(i))).collect(),
                epoch: 0,
                request_timeout: TIMEOUT,
                digest: false,
                tracker: TrackerConfig::default(),
            }),
            books,
            created: vec![false; senders],
            to_p: vec![VecDeque::new(); senders],
            to_d: vec![VecDeque::new(); senders],
            parts: vec![VecDeque::new(); senders],
            handed_off: false,
            decode_aborted: false,
            reusable: false,
        }
    }

    fn senders(&self) -> usize {
        self.books.len()
    }

    fn applies(&self, ev: Ev) -> bool {
        match ev {
            Ev::HandOff => !self.handed_off,
            Ev::DecodeAbort => self.handed_off && !self.decode_aborted,
            Ev::Create(i) => !self.created[i],
            Ev::Send(i) | Ev::PrefillAbort(i) => self.created[i],
            Ev::Complete(i, _) => !self.parts[i].is_empty(),
            Ev::ToPrefill(i) => !self.to_p[i].is_empty(),
            Ev::ToDecode(i) => !self.to_d[i].is_empty(),
            Ev::PastDeadlines => self.now == self.t0,
        }
    }

    /// The decode driver's timer: deadlines, and the asks that every sender whose fence is missing
    /// stop and fence (repeated on the book's schedule).
    fn ask_closing(&mut self) {
        for a in self.decode.poll(self.now, |_| true) {
            assert_eq!(a.generation, GEN);
            self.to_p[a.key.tp as usize].push_back(ToP::Abort);
        }
    }

    /// The prefill driver: each book's notifications go on its link to the decode rank.
    fn carry_out(&mut self, i: usize) {
        while let Some(a) = self.books[i].poll_action() {
            if let Action::Notify { to, note, .. } = a {
                assert_eq!(to, decode());
                self.to_d[i].push_back(note);
            }
        }
    }

    fn step(&mut self, ev: Ev, trail: &[Ev]) {
        match ev {
            Ev::HandOff => {
                self.handed_off = true;
                self.decode.create(R).expect("create");
                let generation = self.decode.hand_off(R, &[40], false, 4096, self.now).expect("hand off");
                assert_eq!(generation, GEN);
                for q in &mut self.to_p {
                    q.push_back(ToP::Handoff);
                }
            }
            Ev::DecodeAbort => {
                self.decode_aborted = true;
                self.decode.abort(R, "engine", self.now);
                self.ask_closing();
            }
            Ev::Create(i) => {
                self.created[i] = true;
                self.books[i].create(R, (), self.now).expect("create");
                self.books[i].init(R, 1).expect("init");
            }
            Ev::Send(i) => {
                if let Ok(p) = self.books[i].reserve_part(R, &[0], 0..1, true, true, self.now) {
                    assert!(
                        !self.reusable,
                        "prefill rank {i} accepted a part after the pages were reusable: {trail:?}"
                    );
                    self.parts[i].push_back((p.finish, p.last));
                }
            }
            Ev::Complete(i, ok) => {
                let (finish, last) = self.parts[i].pop_front().expect("applies");
                if ok {
                    if finish {
                        let n = Notification::chunk(R, SenderKey::of(prefill(i)), 0, last).with_generation(GEN);
                        self.to_d[i].push_back(n);
                    }
                    self.books[i].part_done(R, Ok(()), &[]);
                } else {
                    self.books[i].part_done(R, Err("write failed".into()), &[]);
                }
            }
            Ev::PrefillAbort(i) => {
                self.books[i].abort(R, "engine".into(), FailCause::Aborted);
            }
            Ev::ToPrefill(i) => {
                let m = self.to_p[i].pop_front().expect("applies");
                let h = Handoff { generation: GEN, pages: vec![40], aux_slot: None, digest: false };
                match m {
                    ToP::Handoff => {
                        self.books[i].handle_handoff(decode(), R, h, self.now);
                    }
                    ToP::Abort => {
                        self.books[i].handle_abort(decode(), R, GEN, "decode aborted", self.now);
                    }
                }
            }
            Ev::ToDecode(i) => {
                let n = self.to_d[i].pop_front().expect("applies");
                self.decode.handle(&n, self.now);
            }
            Ev::PastDeadlines => {
                self.now += TIMEOUT + Duration::from_secs(1);
                for b in &mut self.books {
                    b.poll_deadlines(self.now, |_| true);
                }
                self.ask_closing();
            }
        }
        for i in 0..self.senders() {
            self.carry_out(i);
        }
        self.check(trail, ev);
    }

    /// The decode request's phase and whether its pages are reusable (`None` before the handoff).
    fn decode_state(&mut self) -> Option<(Phase, bool)> {
        if !self.handed_off {
            return None;
        }
        let s = self.decode.status(R, None, true, self.now);
        Some((s.phase, s.pages_reusable))
    }

    /// Safety after every event.
    fn check(&mut self, trail: &[Ev], ev: Ev) {
        let reusable = matches!(self.decode_state(), Some((p, true)) if p.is_final());
        if reusable {
            self.reusable = true;
        }
        if self.reusable {
            for (i, b) in self.books.iter().enumerate() {
                assert!(
                    self.parts[i].is_empty() && b.in_flight() == 0,
                    "decode pages reusable with a part of prefill rank {i} in flight: {trail:?} then {ev:?}"
                );
            }
        }
    }

    /// Drives the world to quiescence: deliveries, completions (a cancelled part fails), the
    /// deadlines and the decode rank's re-asks.
    fn settle(&mut self, trail: &[Ev]) {
        for round in 0..50 {
            let mut moved = false;
            for i in 0..self.senders() {
                while !self.parts[i].is_empty() {
                    let cancelled = self.books[i].status(R, true).phase == Phase::Aborting;
                    self.step(Ev::Complete(i, !cancelled), trail);
                    moved = true;
                }
                while !self.to_p[i].is_empty() {
                    self.step(Ev::ToPrefill(i), trail);
                    moved = true;
                }
                while !self.to_d[i].is_empty() {
                    self.step(Ev::ToDecode(i), trail);
                    moved = true;
                }
            }
            if !moved {
                // Quiet: time passes (the deadlines, and the decode rank's re-asks on its timer)
                // while anything is not final yet.
                let decode_open = matches!(self.decode_state(), Some((p, r)) if !(p.is_final() && r));
                let prefill_open =
                    (0..self.senders()).any(|i| self.created[i] && !self.books[i].status(R, true).phase.is_final());
                if decode_open || prefill_open {
                    self.step(Ev::PastDeadlines, trail);
                    continue;
                }
                return;
            }
            assert!(round < 49, "no quiescence after {trail:?}");
        }
        panic!("no quiescence after {trail:?}");
    }

    /// Liveness and agreement at quiescence.
    fn check_final(&mut self, trail: &[Ev]) {
        if let Some((phase, reusable)) = self.decode_state() {
            match phase {
                // Every sender's last write landed and was notified. A prefill rank whose engine
                // aborted while that write was completing says `Failed` (its abort did not take in
                // time); the decode rank's bytes are whole either way.
                Phase::Success => {
                    assert!(reusable);
                    for (i, b) in self.books.iter().enumerate() {
                        let p = b.status(R, true).phase;
                        assert!(
                            p == Phase::Success || (p == Phase::Failed && trail.contains(&Ev::PrefillAbort(i))),
                            "decode done, prefill {i} {p}: {trail:?}"
                        );
                    }
                }
                Phase::Failed => assert!(reusable, "decode failed, fence not closed: {trail:?}"),
                p => panic!("decode not final at quiescence ({p}): {trail:?}"),
            }
        }
        for (i, b) in self.books.iter().enumerate() {
            if self.created[i] {
                let s = b.status(R, true);
                assert!(s.phase.is_final(), "prefill {i} not final at quiescence ({s:?}): {trail:?}");
                assert!(s.pages_reusable);
            }
        }
    }
}

#[derive(Default)]
struct Reached {
    sequences: u64,
    done: u64,
    failed: u64,
}

fn walk(w: &World, letters: &[Ev], max: usize, trail: &mut Vec<Ev>, reached: &mut Reached) {
    reached.sequences += 1;
    let mut end = w.clone();
    end.settle(trail);
    end.check_final(trail);
    match end.decode_state() {
        Some((Phase::Success, _)) => reached.done += 1,
        Some((Phase::Failed, _)) => reached.failed += 1,
        _ => {}
    }
    if trail.len() == max {
        return;
    }
    for &ev in letters {
        if !w.applies(ev) {
            continue;
        }
        let mut next = w.clone();
        next.step(ev, trail);
        trail.push(ev);
        walk(&next, letters, max, trail, reached);
        trail.pop();
    }
}

fn letters(senders: usize) -> Vec<Ev> {
    let mut v = vec![Ev::HandOff, Ev::DecodeAbort, Ev::PastDeadlines, Ev::PrefillAbort(0)];
    for i in 0..senders {
        v.extend([
            Ev::Create(i),
            Ev::Send(i),
            Ev::Complete(i, true),
            Ev::Complete(i, false),
            Ev::ToPrefill(i),
            Ev::ToDecode(i),
        ]);
    }
    v
}

#[test]
fn one_sender_every_interleaving() {
    let letters = letters(1);
    assert_eq!(letters.len(), 10);
    let mut reached = Reached::default();
    walk(&World::new(1), &letters, 10, &mut Vec::new(), &mut reached);
    assert!(reached.done > 0 && reached.failed > 0);
    assert_eq!(reached.sequences, 695_820, "the suite's size changed: update the table in the module docs");
}

#[test]
fn two_senders_every_interleaving() {
    let letters = letters(2);
    assert_eq!(letters.len(), 16);
    let mut reached = Reached::default();
    walk(&World::new(2), &letters, 8, &mut Vec::new(), &mut reached);
    assert!(reached.done > 0 && reached.failed > 0);
    assert_eq!(reached.sequences, 593_475, "the suite's size changed: update the table in the module docs");
}
