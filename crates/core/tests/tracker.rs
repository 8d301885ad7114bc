//! The completion tracker, sans-IO: table tests over the delivery space and property tests over
//! arbitrary orders, duplicates and interleavings.

use std::time::{Duration, Instant};

use kvxfer_core::{
    CompletionTracker, ExpectSpec, Failure, Handled, Notification, NotificationBody, RequestId, SenderKey, Status,
    TrackerConfig, TrackerError,
};
use proptest::prelude::*;

fn key(tp: u16, pp: u16) -> SenderKey {
    SenderKey { dp: 0, cp: 0, pp, tp }
}

fn spec(keys: &[SenderKey], t0: Instant) -> ExpectSpec {
    ExpectSpec {
        generation: 0,
        senders: keys.to_vec(),
        aux: false,
        state: false,
        digest: false,
        deadline: t0 + Duration::from_secs(10),
    }
}

const R: RequestId = RequestId(7);

#[test]
fn completes_only_when_every_key_sent_every_chunk() {
    let t0 = Instant::now();
    let keys = [key(0, 0), key(1, 0), key(0, 1), key(1, 1)];
    let mut t = CompletionTracker::new();
    t.expect(R, spec(&keys, t0), t0).unwrap();
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(t.handle(&Notification::chunk(R, *k, 0, false), t0), Handled::Progress);
        let h = t.handle(&Notification::chunk(R, *k, 1, true), t0);
        assert_eq!(h, if i == 3 { Handled::Completed } else { Handled::Progress });
    }
    assert_eq!(t.status(R, t0), Some(Status::Done));
}

#[test]
fn a_pp2_prefill_with_tp_keyed_notifications_would_not_complete_but_ours_do() {
    // SGLang keyed NIXL notifications by TP rank: both stages say "tp0" and the decode waits forever.
    let t0 = Instant::now();
    let mut t = CompletionTracker::new();
    t.expect(R, spec(&[key(0, 0), key(0, 1)], t0), t0).unwrap();
    t.handle(&Notification::chunk(R, key(0, 0), 0, true), t0);
    assert_eq!(t.handle(&Notification::chunk(R, key(0, 0), 0, true), t0), Handled::Duplicate);
    assert_eq!(t.status(R, t0), Some(Status::Pending));
    assert_eq!(t.handle(&Notification::chunk(R, key(0, 1), 0, true), t0), Handled::Completed);
}

#[test]
fn last_chunk_first_then_the_rest() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new();
    t.expect(R, spec(&[key(0, 0)], t0), t0).unwrap();
    assert_eq!(t.handle(&Notification::chunk(R, key(0, 0), 2, true), t0), Handled::Progress);
    assert_eq!(t.handle(&Notification::chunk(R, key(0, 0), 0, false), t0), Handled::Progress);
    assert_eq!(t.handle(&Notification::chunk(R, key(0, 0), 1, false), t0), Handled::Completed);
}

/// SEMANTICS §5: a notification for a request not expected yet is kept (bounded in count and age) and
/// applied when the request is expected; one that is never expected expires after `early_ttl`,
/// counted; one for a released (room, generation) is counted and dropped at once.
#[test]
fn unknown_requests_are_kept_until_expected_and_released_ones_are_counted_and_dropped() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new();
    assert_eq!(t.handle(&Notification::chunk(RequestId(1), key(0, 0), 0, true), t0), Handled::Early);
    assert_eq!((t.early_len(), t.status(RequestId(1), t0)), (1, None));
    // Applied when expected: it completes the request at once.
    assert_eq!(t.expect(RequestId(1), spec(&[key(0, 0)], t0), t0), Ok(1));
    assert_eq!(t.status(RequestId(1), t0), Some(Status::Done));
    assert_eq!(t.early_len(), 0);
    t.expect(R, spec(&[key(0, 0)], t0), t0).unwrap();
    t.handle(&Notification::chunk(R, key(0, 0), 0, true), t0);
    assert_eq!(t.release(R, t0), Some(Status::Done));
    assert_eq!(t.handle(&Notification::chunk(R, key(0, 0), 0, true), t0), Handled::Released);
    assert_eq!(t.early_len(), 0, "a notification of a released generation is not kept");
    // One that is never expected is kept for `early_ttl`, then dropped and counted.
    assert_eq!(t.handle(&Notification::chunk(RequestId(2), key(0, 0), 0, true), t0), Handled::Early);
    assert!(t.poll_deadlines(t0 + Duration::from_secs(59)).is_empty());
    assert_eq!(t.early_len(), 1);
    t.poll_deadlines(t0 + Duration::from_secs(60));
    assert_eq!(t.early_len(), 0);
    let s = t.stats();
    assert_eq!((s.early_kept, s.early_applied, s.early_expired, s.released), (2, 1, 1, 1));
    assert_eq!(t.len(), 1, "only request 1 is still tracked");
    assert_eq!(t.release(RequestId(1), t0), Some(Status::Done));
    assert!(t.is_empty());
    // Expecting request 2 after its notification expired: nothing is applied.
    assert_eq!(t.expect(RequestId(2), spec(&[key(0, 0)], t0), t0 + Duration::from_secs(61)), Ok(0));
    assert_eq!(t.status(RequestId(2), t0 + Duration::from_secs(1)), Some(Status::Pending));
}

#[test]
fn failures() {
    let t0 = Instant::now();
    let cases: Vec<(Vec<Notification>, Failure)> = vec![
        (
            vec![Notification::failure(R, key(1, 0), "disk on fire")],
            Failure::Notified { key: key(1, 0), reason: "disk on fire".into() },
        ),
        (vec![Notification::chunk(R, key(5, 0), 0, true)], Failure::UnexpectedKey { key: key(5, 0) }),
        (
            vec![Notification::chunk(R, key(0, 0), 1, true), Notification::chunk(R, key(0, 0), 2, false)],
            Failure::InconsistentChunks { key: key(0, 0), detail: "chunk 2 after last chunk 1".into() },
        ),
        (
            vec![Notification::chunk(R, key(0, 0), 3, false), Notification::chunk(R, key(0, 0), 1, true)],
            Failure::InconsistentChunks { key: key(0, 0), detail: "last chunk 1 but chunk 3 already arrived".into() },
        ),
    ];
    for (ns, want) in cases {
        let mut t = CompletionTracker::new();
        t.expect(R, spec(&[key(0, 0), key(1, 0)], t0), t0).unwrap();
        for n in &ns {
            t.handle(n, t0);
        }
        assert_eq!(t.status(R, t0), Some(Status::Failed(want.clone())));
        // An outcome is final.
        assert_eq!(t.handle(&Notification::chunk(R, key(0, 0), 0, true), t0), Handled::AfterOutcome);
        assert_eq!(t.status(R, t0), Some(Status::Failed(want)));
    }
}

#[test]
fn deadline_names_the_missing_keys() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new();
    let mut s = spec(&[key(0, 0), key(1, 0), key(2, 0)], t0);
    s.aux = true;
    t.expect(R, s, t0).unwrap();
    t.handle(&Notification::chunk(R, key(1, 0), 0, true), t0);
    t.handle(&Notification::chunk(R, key(2, 0), 0, false), t0);
    assert_eq!(t.status(R, t0 + Duration::from_secs(9)), Some(Status::Pending));
    assert_eq!(t.next_deadline(), Some(t0 + Duration::from_secs(10)));
    let late = t0 + Duration::from_secs(10);
    assert_eq!(t.poll_deadlines(late), vec![R]);
    let Some(Status::Failed(f)) = t.status(R, late) else { panic!() };
    assert_eq!(
        f,
        Failure::DeadlineExceeded {
            missing: vec![key(0, 0), key(2, 0)],
            missing_state: vec![],
            missing_digest: vec![],
            missing_aux: true
        }
    );
    assert!(f.to_string().contains("tp0.pp0, tp2.pp0") && f.to_string().contains("aux"), "{f}");
}

#[test]
fn aux_and_state_requirements() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new();
    let mut s = spec(&[key(0, 0), key(1, 0)], t0);
    s.aux = true;
    s.state = true;
    t.expect(R, s, t0).unwrap();
    for k in [key(0, 0), key(1, 0)] {
        t.handle(&Notification::chunk(R, k, 0, true), t0);
    }
    t.handle(&Notification::new(R, key(0, 0), NotificationBody::State(vec![1])), t0);
    t.handle(&Notification::new(R, key(0, 0), NotificationBody::Aux(vec![42])), t0);
    assert_eq!(t.status(R, t0), Some(Status::Pending));
    let h = t.handle(&Notification::new(R, key(1, 0), NotificationBody::State(vec![2])), t0);
    assert_eq!(h, Handled::Completed);
    assert_eq!(t.aux(R), Some(&[42u8][..]));
    assert_eq!(t.state(R, key(1, 0)), Some(&[2u8][..]));
}

#[test]
fn lost_sender_fails_only_requests_waiting_on_it() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new();
    t.expect(RequestId(1), spec(&[key(0, 0), key(1, 0)], t0), t0).unwrap();
    t.expect(RequestId(2), spec(&[key(1, 0)], t0), t0).unwrap();
    t.expect(RequestId(3), spec(&[key(0, 0), key(1, 0)], t0), t0).unwrap();
    t.handle(&Notification::chunk(RequestId(3), key(0, 0), 0, true), t0);
    assert_eq!(t.sender_lost(key(0, 0), "connection reset").failed, vec![RequestId(1)]);
    assert_eq!(t.status(RequestId(2), t0), Some(Status::Pending));
    assert_eq!(t.status(RequestId(3), t0), Some(Status::Pending));
    assert_eq!(
        t.expect(RequestId(2), spec(&[key(1, 0)], t0), t0),
        Err(TrackerError::AlreadyTracked { request: RequestId(2), generation: 0 })
    );
    assert_eq!(t.expect(RequestId(9), spec(&[], t0), t0), Err(TrackerError::NoSenders(RequestId(9))));
}

proptest! {
    /// Any order, any duplication: complete exactly when the last missing (key, chunk) arrives.
    #[test]
    fn any_order_any_duplicates(
        nkeys in 1usize..5, chunks in proptest::collection::vec(1u32..4, 4),
        order in proptest::collection::vec(any::<prop::sample::Index>(), 0..40), seed in any::<u64>(),
    ) {
        let t0 = Instant::now();
        let keys: Vec<SenderKey> = (0..nkeys as u16).map(|i| key(i, i % 2)).collect();
        let mut all: Vec<Notification> = keys.iter().enumerate().flat_map(|(i, k)| {
            let n = chunks[i % 4];
            (0..n).map(move |c| Notification::chunk(R, *k, c, c + 1 == n))
        }).collect();
        // Shuffle deterministically, then add duplicates drawn from `order`.
        let mut x = seed | 1;
        for i in (1..all.len()).rev() { x ^= x << 13; x ^= x >> 7; x ^= x << 17; all.swap(i, (x % (i as u64 + 1)) as usize); }
        let dups: Vec<Notification> = order.iter().map(|ix| all[ix.index(all.len())].clone()).collect();
        let mut stream = all.clone();
        for (i, d) in dups.into_iter().enumerate() { let at = (i * 7) % (stream.len() + 1); stream.insert(at, d); }
        let mut t = CompletionTracker::new();
        t.expect(R, spec(&keys, t0), t0).unwrap();
        let mut seen = std::collections::HashSet::new();
        let mut completed = 0;
        for n in &stream {
            let fresh = seen.insert(format!("{n:?}"));
            let h = t.handle(n, t0);
            if seen.len() == all.len() && fresh { prop_assert_eq!(h, Handled::Completed); completed += 1; }
            else if fresh { prop_assert_eq!(h, Handled::Progress); }
            else { prop_assert!(h == Handled::Duplicate || h == Handled::AfterOutcome); }
        }
        prop_assert_eq!(completed, 1);
        prop_assert_eq!(t.status(R, t0), Some(Status::Done));
    }
}

/// Issue 10, defect 1 (SEMANTICS §5: "a `last` flag seen on any copy sets expected[key]"): chunk 0 then
/// chunk 0 with `last`, in either order, completes the same way; a deadline error always names what is missing.
#[test]
fn a_last_flag_on_a_resent_chunk_completes_in_either_order() {
    let t0 = Instant::now();
    let k = key(0, 0);
    for order in [[false, true], [true, false]] {
        let mut t = CompletionTracker::new();
        t.expect(R, spec(&[k], t0), t0).unwrap();
        let hs: Vec<Handled> = order.iter().map(|last| t.handle(&Notification::chunk(R, k, 0, *last), t0)).collect();
        assert!(hs.contains(&Handled::Completed), "order {order:?}: {hs:?}");
        assert_eq!(t.status(R, t0), Some(Status::Done), "order {order:?}");
        // Once the flag has been seen, a further copy of either kind is a duplicate.
        assert_eq!(t.handle(&Notification::chunk(R, k, 0, true), t0), Handled::AfterOutcome);
    }
    // With two senders, the re-sent chunk with `last` is progress, not a duplicate, and a later
    // deadline names only the sender still missing.
    let mut t = CompletionTracker::new();
    t.expect(R, spec(&[key(0, 0), key(1, 0)], t0), t0).unwrap();
    assert_eq!(t.handle(&Notification::chunk(R, key(0, 0), 0, false), t0), Handled::Progress);
    assert_eq!(t.handle(&Notification::chunk(R, key(0, 0), 0, true), t0), Handled::Progress);
    assert_eq!(t.handle(&Notification::chunk(R, key(0, 0), 0, false), t0), Handled::Duplicate);
    assert_eq!(t.stats().accepted, 2);
    let late = t0 + Duration::from_secs(10);
    let Some(Status::Failed(f)) = t.status(R, late) else { panic!("expected the deadline to fail the request") };
    assert_eq!(
        f,
        Failure::DeadlineExceeded {
            missing: vec![key(1, 0)],
            missing_state: vec![],
            missing_digest: vec![],
            missing_aux: false
        }
    );
}

/// A deadline error never says "missing []": whatever keeps a request pending is named.
#[test]
fn a_deadline_error_always_names_what_is_missing() {
    let t0 = Instant::now();
    let late = t0 + Duration::from_secs(10);
    let k = key(0, 0);
    let streams: Vec<Vec<(u32, bool)>> = vec![
        vec![],
        vec![(0, false)],
        vec![(1, true)],
        vec![(0, false), (0, false)],
        vec![(0, false), (0, true)],
        vec![(2, true), (0, false)],
        vec![(0, false), (2, true), (0, true)],
    ];
    for s in streams {
        let mut t = CompletionTracker::new();
        t.expect(R, spec(&[k], t0), t0).unwrap();
        for (c, last) in &s {
            t.handle(&Notification::chunk(R, k, *c, *last), t0);
        }
        match t.status(R, late) {
            Some(Status::Failed(f @ Failure::DeadlineExceeded { .. })) => {
                let Failure::DeadlineExceeded { missing, missing_state, missing_aux, .. } = &f else { unreachable!() };
                assert!(!missing.is_empty() || !missing_state.is_empty() || *missing_aux, "{s:?}: {f}");
            }
            other => assert!(matches!(other, Some(Status::Done | Status::Failed(_))), "{s:?}: {other:?}"),
        }
    }
}

/// Issue 10, defect 6: a released (room, generation) is remembered for as long as its release is among
/// the last `released_memory` releases (4096 here), however often the room was reused; then it is
/// forgotten (bounded memory) and a late notification of it is treated as one for an unknown request.
#[test]
fn a_reused_id_is_remembered_from_its_latest_release() {
    let t0 = Instant::now();
    let k = key(0, 0);
    let mut t = CompletionTracker::with_config(TrackerConfig { released_memory: 4096, ..TrackerConfig::default() });
    let cycle = |t: &mut CompletionTracker, id: RequestId, generation: u64| {
        t.expect(id, ExpectSpec { generation, ..spec(&[k], t0) }, t0).unwrap();
        t.handle(&Notification::chunk(id, k, 0, true).with_generation(generation), t0);
        assert_eq!(t.release(id, t0), Some(Status::Done));
    };
    let late = |g: u64| Notification::chunk(R, k, 0, true).with_generation(g);
    cycle(&mut t, R, 1);
    cycle(&mut t, R, 2);
    // A released generation cannot be expected again while it is remembered.
    assert_eq!(
        t.expect(R, ExpectSpec { generation: 2, ..spec(&[k], t0) }, t0),
        Err(TrackerError::GenerationReleased { request: R, generation: 2 })
    );
    // 4095 other releases: R's latest release is still among the last 4096, its first one is not.
    for i in 0..4095 {
        cycle(&mut t, RequestId(1_000_000 + i), 0);
    }
    let before = t.stats();
    assert_eq!(t.handle(&late(2), t0), Handled::Released);
    assert_eq!((t.stats().released, t.stats().early_kept), (before.released + 1, before.early_kept));
    assert!(t.is_released(R, 2) && !t.is_released(R, 1));
    // One more release pushes R's out of the memory: then it is unknown (bounded memory) and kept.
    cycle(&mut t, RequestId(2_000_000), 0);
    assert!(!t.is_released(R, 2));
    assert_eq!(t.handle(&late(2), t0), Handled::Early);
    assert_eq!(t.stats().early_kept, before.early_kept + 1);
    // And a re-used id that is tracked again under a new generation is not "released" while tracked;
    // the old generation still is.
    cycle(&mut t, RequestId(3), 1);
    t.expect(RequestId(3), ExpectSpec { generation: 2, ..spec(&[k], t0) }, t0).unwrap();
    assert_eq!(t.handle(&Notification::chunk(RequestId(3), k, 0, false).with_generation(2), t0), Handled::Progress);
    assert_eq!(t.handle(&Notification::chunk(RequestId(3), k, 0, true).with_generation(1), t0), Handled::Released);
    assert_eq!(t.status(RequestId(3), t0), Some(Status::Pending));
}

/// The events of the exhaustive check: what one sender may emit about the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ev {
    /// Chunk 0 without `last`.
    C0,
    /// Chunk 0 with `last`.
    C0Last,
    /// Chunk 1 with `last`.
    C1Last,
    /// A copy of the `i`-th event of the sequence so far (of any sender).
    Dup(usize),
}

/// An independent model of SEMANTICS §5 for one request: per key, the chunks received and the last
/// chunk announced by any copy; inconsistent chunk sets fail.
#[derive(Debug, Clone, Default)]
struct Model {
    received: [Vec<u32>; 2],
    last: [Option<u32>; 2],
    failed: bool,
    done: bool,
}

impl Model {
    fn apply(&mut self, k: usize, chunk: u32, last: bool) {
        if self.failed || self.done {
            return;
        }
        if !self.received[k].contains(&chunk) {
            self.received[k].push(chunk);
        }
        if last {
            match self.last[k] {
                Some(l) if l != chunk => {
                    self.failed = true;
                    return;
                }
                _ => self.last[k] = Some(chunk),
            }
        }
        if let Some(l) = self.last[k] {
            if self.received[k].iter().any(|c| *c > l) {
                self.failed = true;
                return;
            }
        }
        self.done = (0..2).all(|k| {
            self.last[k].is_some_and(|l| (0..=l).all(|c| self.received[k].contains(&c)))
                && self.received[k].len() as u32 == self.last[k].unwrap_or(0) + 1
        });
    }
}

/// Every interleaving of up to 5 events from two senders, drawn from {chunk 0, chunk 0 with `last`,
/// chunk 1 with `last`, a copy of an earlier event}: the tracker ends Done exactly when both senders'
/// chunks 0..=last arrived with a `last` seen, Failed only on inconsistent chunks, else Pending; and it
/// reports Completed exactly once, on the event that completes it.
#[test]
fn exhaustive_two_senders_up_to_five_events() {
    let t0 = Instant::now();
    let keys = [key(0, 0), key(1, 0)];
    // Each step: (sender, event); a duplicate's sender is the copied event's.
    fn extend(seqs: &mut Vec<Vec<(usize, Ev)>>, cur: &mut Vec<(usize, Ev)>, max: usize) {
        seqs.push(cur.clone());
        if cur.len() == max {
            return;
        }
        for s in 0..2 {
            for ev in [Ev::C0, Ev::C0Last, Ev::C1Last] {
                cur.push((s, ev));
                extend(seqs, cur, max);
                cur.pop();
            }
        }
        for i in 0..cur.len() {
            cur.push((cur[i].0, Ev::Dup(i)));
            extend(seqs, cur, max);
            cur.pop();
        }
    }
    let mut seqs = Vec::new();
    extend(&mut seqs, &mut Vec::new(), 5);
    let mut outcomes = [0usize; 3];
    for seq in &seqs {
        // Resolve duplicates to the concrete (sender, chunk, last) they copy.
        let mut concrete: Vec<(usize, u32, bool)> = Vec::new();
        for (s, ev) in seq {
            concrete.push(match ev {
                Ev::C0 => (*s, 0, false),
                Ev::C0Last => (*s, 0, true),
                Ev::C1Last => (*s, 1, true),
                Ev::Dup(i) => concrete[*i],
            });
        }
        let mut t = CompletionTracker::new();
        t.expect(R, spec(&keys, t0), t0).unwrap();
        let mut m = Model::default();
        let mut completed = 0;
        for (s, c, last) in &concrete {
            let was_done = m.done;
            m.apply(*s, *c, *last);
            let h = t.handle(&Notification::chunk(R, keys[*s], *c, *last), t0);
            if h == Handled::Completed {
                completed += 1;
                assert!(m.done && !was_done, "{concrete:?}: Completed at the wrong event");
            }
            if m.done && !was_done {
                assert_eq!(h, Handled::Completed, "{concrete:?}");
            }
        }
        let want = if m.failed {
            outcomes[2] += 1;
            "failed"
        } else if m.done {
            outcomes[1] += 1;
            "done"
        } else {
            outcomes[0] += 1;
            "pending"
        };
        let got = match t.status(R, t0) {
            Some(Status::Pending) => "pending",
            Some(Status::Done) => "done",
            Some(Status::Failed(Failure::InconsistentChunks { .. })) => "failed",
            other => panic!("{concrete:?}: {other:?}"),
        };
        assert_eq!(got, want, "{concrete:?}");
        assert_eq!(completed, usize::from(m.done), "{concrete:?}");
        // A pending request fails at its deadline naming at least one missing key.
        if want == "pending" {
            let Some(Status::Failed(Failure::DeadlineExceeded { missing, .. })) =
                t.status(R, t0 + Duration::from_secs(10))
            else {
                panic!("{concrete:?}: deadline did not fail it")
            };
            assert!(!missing.is_empty(), "{concrete:?}: deadline names no missing key");
        }
    }
    // The space really covers all three outcomes.
    assert!(outcomes.iter().all(|n| *n > 0), "{outcomes:?}");
}

/// Issue 30: with digests required, a request is done only when every sender's digest is in too
/// (early, duplicate and late ones as for any notification); a missing one fails it at the deadline
/// by name; a lost sender that sent its chunks but not its digest fails it.
#[test]
fn a_required_digest_from_every_sender_completes_the_request() {
    let t0 = Instant::now();
    let keys = [key(0, 0), key(1, 0)];
    let digest = |k, d: Vec<u64>| Notification::new(R, k, NotificationBody::Digest(d));
    let mut t = CompletionTracker::new();
    // Sender 1's digest comes before the request is expected: kept, then applied.
    assert_eq!(t.handle(&digest(keys[1], vec![9]), t0), Handled::Early);
    t.expect(R, ExpectSpec { digest: true, ..spec(&keys, t0) }, t0).unwrap();
    for k in keys {
        assert_eq!(t.handle(&Notification::chunk(R, k, 0, true), t0), Handled::Progress);
    }
    assert_eq!(t.status(R, t0), Some(Status::Pending));
    assert_eq!(t.handle(&digest(keys[0], vec![1, 2]), t0), Handled::Completed);
    assert_eq!(t.handle(&digest(keys[0], vec![3]), t0), Handled::AfterOutcome);
    assert_eq!(t.digest(R, keys[0]), Some(&[1u64, 2][..]));
    assert_eq!(t.digest(R, keys[1]), Some(&[9u64][..]));

    let mut t = CompletionTracker::new();
    t.expect(R, ExpectSpec { digest: true, ..spec(&keys, t0) }, t0).unwrap();
    for k in keys {
        t.handle(&Notification::chunk(R, k, 0, true), t0);
    }
    t.handle(&digest(keys[0], vec![]), t0);
    let late = t0 + Duration::from_secs(10);
    let Some(Status::Failed(f)) = t.status(R, late) else { panic!("not failed") };
    assert_eq!(
        f,
        Failure::DeadlineExceeded {
            missing: vec![],
            missing_state: vec![],
            missing_digest: vec![keys[1]],
            missing_aux: false
        }
    );
    assert!(f.to_string().contains("digest from [") && f.to_string().contains("without digests"), "{f}");

    let mut t = CompletionTracker::new();
    t.expect(R, ExpectSpec { digest: true, ..spec(&keys, t0) }, t0).unwrap();
    for k in keys {
        t.handle(&Notification::chunk(R, k, 0, true), t0);
    }
    let loss = t.sender_lost(keys[1], "lease expired");
    assert_eq!(loss.failed, vec![R]);
    // Its chunks were all in: nothing of it can land, so the fence is closed without a cut-off.
    assert_eq!(t.fence(R, t0), Some(kvxfer_core::Fence::Closed));
}
