//! The completion tracker, sans-IO: table tests over the delivery space and property tests over
//! arbitrary orders, duplicates and interleavings.

use std::time::{Duration, Instant};

use kvxfer_core::{
    CompletionTracker, ExpectSpec, Failure, Handled, Notification, NotificationBody, RequestId, SenderKey, Status,
};
use proptest::prelude::*;

fn key(tp: u16, pp: u16) -> SenderKey {
    SenderKey { dp: 0, cp: 0, pp, tp }
}

fn spec(keys: &[SenderKey], t0: Instant) -> ExpectSpec {
    ExpectSpec { senders: keys.to_vec(), aux: false, state: false, deadline: t0 + Duration::from_secs(10) }
}

const R: RequestId = RequestId(7);

#[test]
fn completes_only_when_every_key_sent_every_chunk() {
    let t0 = Instant::now();
    let keys = [key(0, 0), key(1, 0), key(0, 1), key(1, 1)];
    let mut t = CompletionTracker::new();
    t.expect(R, spec(&keys, t0)).unwrap();
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
    t.expect(R, spec(&[key(0, 0), key(0, 1)], t0)).unwrap();
    t.handle(&Notification::chunk(R, key(0, 0), 0, true), t0);
    assert_eq!(t.handle(&Notification::chunk(R, key(0, 0), 0, true), t0), Handled::Duplicate);
    assert_eq!(t.status(R, t0), Some(Status::Pending));
    assert_eq!(t.handle(&Notification::chunk(R, key(0, 1), 0, true), t0), Handled::Completed);
}

#[test]
fn last_chunk_first_then_the_rest() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new();
    t.expect(R, spec(&[key(0, 0)], t0)).unwrap();
    assert_eq!(t.handle(&Notification::chunk(R, key(0, 0), 2, true), t0), Handled::Progress);
    assert_eq!(t.handle(&Notification::chunk(R, key(0, 0), 0, false), t0), Handled::Progress);
    assert_eq!(t.handle(&Notification::chunk(R, key(0, 0), 1, false), t0), Handled::Completed);
}

#[test]
fn unknown_and_released_requests_are_counted_and_dropped() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new();
    assert_eq!(t.handle(&Notification::chunk(RequestId(1), key(0, 0), 0, true), t0), Handled::UnknownRequest);
    t.expect(R, spec(&[key(0, 0)], t0)).unwrap();
    t.handle(&Notification::chunk(R, key(0, 0), 0, true), t0);
    assert_eq!(t.release(R, t0), Some(Status::Done));
    assert_eq!(t.handle(&Notification::chunk(R, key(0, 0), 0, true), t0), Handled::Released);
    let s = t.stats();
    assert_eq!((s.unknown_request, s.released), (1, 1));
    assert!(t.is_empty());
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
        t.expect(R, spec(&[key(0, 0), key(1, 0)], t0)).unwrap();
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
    t.expect(R, s).unwrap();
    t.handle(&Notification::chunk(R, key(1, 0), 0, true), t0);
    t.handle(&Notification::chunk(R, key(2, 0), 0, false), t0);
    assert_eq!(t.status(R, t0 + Duration::from_secs(9)), Some(Status::Pending));
    assert_eq!(t.next_deadline(), Some(t0 + Duration::from_secs(10)));
    let late = t0 + Duration::from_secs(10);
    assert_eq!(t.poll_deadlines(late), vec![R]);
    let Some(Status::Failed(f)) = t.status(R, late) else { panic!() };
    assert_eq!(
        f,
        Failure::DeadlineExceeded { missing: vec![key(0, 0), key(2, 0)], missing_state: vec![], missing_aux: true }
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
    t.expect(R, s).unwrap();
    for k in [key(0, 0), key(1, 0)] {
        t.handle(&Notification::chunk(R, k, 0, true), t0);
    }
    t.handle(&Notification { request: R, sender: key(0, 0), body: NotificationBody::State(vec![1]) }, t0);
    t.handle(&Notification { request: R, sender: key(0, 0), body: NotificationBody::Aux(vec![42]) }, t0);
    assert_eq!(t.status(R, t0), Some(Status::Pending));
    let h = t.handle(&Notification { request: R, sender: key(1, 0), body: NotificationBody::State(vec![2]) }, t0);
    assert_eq!(h, Handled::Completed);
    assert_eq!(t.aux(R), Some(&[42u8][..]));
    assert_eq!(t.state(R, key(1, 0)), Some(&[2u8][..]));
}

#[test]
fn lost_sender_fails_only_requests_waiting_on_it() {
    let t0 = Instant::now();
    let mut t = CompletionTracker::new();
    t.expect(RequestId(1), spec(&[key(0, 0), key(1, 0)], t0)).unwrap();
    t.expect(RequestId(2), spec(&[key(1, 0)], t0)).unwrap();
    t.expect(RequestId(3), spec(&[key(0, 0), key(1, 0)], t0)).unwrap();
    t.handle(&Notification::chunk(RequestId(3), key(0, 0), 0, true), t0);
    assert_eq!(t.sender_lost(key(0, 0), "connection reset"), vec![RequestId(1)]);
    assert_eq!(t.status(RequestId(2), t0), Some(Status::Pending));
    assert_eq!(t.status(RequestId(3), t0), Some(Status::Pending));
    assert!(t.expect(RequestId(2), spec(&[key(1, 0)], t0)).is_err());
    assert!(t.expect(RequestId(9), spec(&[], t0)).is_err());
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
        t.expect(R, spec(&keys, t0)).unwrap();
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
