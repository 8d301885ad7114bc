//! Authentication with the cluster secret over the in-process verbs model (`--features emulator`):
//! what each refusal says, that nothing (no queue pair, ring or remote key) is announced to a
//! connector that did not prove the secret, and forged notifications on both notification paths
//! (write-with-immediate fragments into the ring, and out-of-band SENDs).

use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::secret::{NONCE_BYTES, PROOF_BYTES};
use kvxfer_core::{
    BackendConfig, BackendEvent, HostBuffer, KvTransferBackend, Notification, RankId, RegionId, RequestId, Secret,
    SenderKey, WriteOp,
};
use kvxfer_verbs::wire::{Address, Frame, Open, PROTO_VERSION};
use kvxfer_verbs::VerbsBackend;

fn endpoint(identity: u64, secret: Option<&str>) -> Arc<VerbsBackend> {
    let secret = secret.map(|s| Secret::new(s.as_bytes().to_vec()).unwrap());
    let c = BackendConfig::new(identity)
        .with("device", kvxfer_verbs::EMULATED_DEVICE)
        .with("timeout_ms", "10000")
        .with_secret(secret);
    Arc::new(VerbsBackend::new(&c).expect("creating a model endpoint"))
}

fn prefill(tp: u32) -> u64 {
    SenderKey::of(RankId::new(tp, 0)).to_u64()
}

/// Decode rank 9's endpoint identity (the one encoding: [`kvxfer_core::identity`]).
fn decode_identity() -> u64 {
    kvxfer_core::identity(kvxfer_core::Side::Decode, kvxfer_core::RankId::new(9, 0))
}

async fn events_until_lost(b: &VerbsBackend, identity: u64, within: Duration) -> Vec<BackendEvent> {
    let deadline = Instant::now() + within;
    let mut events = Vec::new();
    while Instant::now() < deadline
        && !events.iter().any(|e| matches!(e, BackendEvent::PeerLost { identity: i, .. } if *i == identity))
    {
        events.extend(b.recv(Duration::from_millis(50)).await.unwrap());
    }
    events
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_name_authentication_and_what_to_do() {
    let cases = [
        (Some("one"), Some("two"), "the secrets differ"),
        (None, Some("one"), "this endpoint none"),
        (Some("one"), None, "the peer has no cluster secret"),
    ];
    for (mine, theirs, says) in cases {
        let a = endpoint(prefill(1), mine);
        let b = endpoint(decode_identity(), theirs);
        let started = Instant::now();
        let e = a.connect(&b.metadata().unwrap()).await.expect_err("a mismatch must be refused");
        let text = e.to_string();
        assert!(text.contains("authentication"), "{text}");
        assert!(text.contains(says), "{text} (expected {says:?})");
        assert!(text.contains("KVXFER_SECRET"), "{text}");
        assert!(started.elapsed() < Duration::from_secs(5), "refused only after {:?}", started.elapsed());
        let late = b.recv(Duration::from_millis(200)).await.unwrap();
        assert!(late.is_empty(), "the accepting side reported {late:?}");
        assert_eq!(b.forged_notifications(), 0);
    }
}

/// A client that speaks the side channel by hand: it never learns the acceptor's queue pair, ring or
/// remote keys without proving the secret, and a hello before the exchange is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_announced_before_the_connector_proved_the_secret() {
    let b = endpoint(decode_identity(), Some("cluster"));
    let _r = b.register(RegionId(1), HostBuffer::zeroed(4096).desc()).await.unwrap();
    let addr = Address::from_payload(&b.metadata().unwrap().payload).unwrap();
    let dial = move || {
        let s = TcpStream::connect(&addr.handshake).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s
    };
    let open = Open { version: PROTO_VERSION, identity: prefill(1), instance: 1, nonce: [7; NONCE_BYTES] };
    tokio::task::spawn_blocking(move || {
        // A wrong proof.
        let mut s = dial();
        Frame::Open(open.clone()).write_to(&mut s).unwrap();
        match Frame::read_from(&mut s).unwrap() {
            Frame::Challenge(c) => assert!(c.proof.is_some(), "an acceptor with a secret proves it"),
            f => panic!("expected a challenge, got {f:?}"),
        }
        Frame::Auth(Some([0; PROOF_BYTES])).write_to(&mut s).unwrap();
        match Frame::read_from(&mut s).unwrap() {
            Frame::Reject(r) => assert!(r.contains("authentication failed") && r.contains("KVXFER_SECRET"), "{r}"),
            f => panic!("expected a refusal, got {f:?}"),
        }
        // No proof at all.
        let mut s = dial();
        Frame::Open(open.clone()).write_to(&mut s).unwrap();
        assert!(matches!(Frame::read_from(&mut s).unwrap(), Frame::Challenge(_)));
        Frame::Auth(None).write_to(&mut s).unwrap();
        assert!(matches!(Frame::read_from(&mut s).unwrap(), Frame::Reject(r) if r.contains("authentication")));
        // Skipping the proof and sending a hello: refused, never answered with the acceptor's hello.
        let mut s = dial();
        Frame::Open(open).write_to(&mut s).unwrap();
        assert!(matches!(Frame::read_from(&mut s).unwrap(), Frame::Challenge(_)));
        s.write_all(&Frame::Ready.encode()).unwrap();
        assert!(
            !matches!(Frame::read_from(&mut s), Ok(Frame::Hello(_))),
            "the acceptor announced its queue pair to an unauthenticated peer"
        );
    })
    .await
    .unwrap();
    let evs = b.recv(Duration::from_millis(200)).await.unwrap();
    assert!(evs.is_empty(), "{evs:?}");
}

async fn forged_case(attached: bool) {
    let what = if attached { "attached (ring)" } else { "out of band (SEND)" };
    let a = endpoint(prefill(1), Some("cluster"));
    let b = endpoint(decode_identity(), Some("cluster"));
    let src = HostBuffer::from_slice(&[7u8; 4096]).desc();
    let _s = a.register(RegionId(1), src).await.unwrap();
    let _d = b.register(RegionId(2), HostBuffer::zeroed(4096).desc()).await.unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.expect("one secret connects");
    let forged_key = SenderKey::of(RankId::new(5, 0));
    let forged = Notification::chunk(RequestId(3), forged_key, 0, true);
    let started = Instant::now();
    if attached {
        let ops = [WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 4096)];
        let t = a.post(peer, &ops, Some(&forged)).unwrap();
        let _ = t.wait(Instant::now() + Duration::from_secs(10)).await;
    } else {
        let _ = a.notify(peer, &forged).await;
    }
    let events = events_until_lost(&b, prefill(1), Duration::from_secs(5)).await;
    assert!(started.elapsed() < Duration::from_secs(5), "{what}: named after {:?}", started.elapsed());
    assert!(!events.iter().any(|e| matches!(e, BackendEvent::Notification(_))), "{what}: delivered: {events:?}");
    let reason = events
        .iter()
        .find_map(|e| match e {
            BackendEvent::PeerLost { identity, reason } if *identity == prefill(1) => Some(reason.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("{what}: no PeerLost: {events:?}"));
    let key = format!("{:#x}", forged_key.to_u64());
    assert!(reason.contains("forged") && reason.contains(&key), "{what}: {reason}");
    assert_eq!(b.forged_notifications(), 1, "{what}");
    // The sender is told (its side channel is closed with the reason) ...
    let told = events_until_lost(&a, decode_identity(), Duration::from_secs(5)).await;
    assert!(
        told.iter().any(|e| matches!(e, BackendEvent::PeerLost { reason, .. } if reason.contains("forged"))),
        "{what}: the sender was not told: {told:?}"
    );
    // ... nothing more of it is delivered, and this endpoint of it cannot connect again.
    let again = a.connect(&b.metadata().unwrap()).await.expect_err("a refused endpoint reconnected");
    assert!(again.to_string().contains("forged notification"), "{what}: {again}");
    let late = b.recv(Duration::from_millis(300)).await.unwrap();
    assert!(!late.iter().any(|e| matches!(e, BackendEvent::Notification(_))), "{what}: {late:?}");
    // A different endpoint with the secret is still admitted.
    let c = endpoint(prefill(2), Some("cluster"));
    let p = c.connect(&b.metadata().unwrap()).await.expect("another endpoint connects");
    let genuine = Notification::chunk(RequestId(4), SenderKey::of(RankId::new(2, 0)), 0, true);
    c.notify(p, &genuine).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut got = Vec::new();
    while Instant::now() < deadline && got.is_empty() {
        got.extend(b.recv(Duration::from_millis(50)).await.unwrap());
    }
    assert!(got.iter().any(|e| matches!(e, BackendEvent::Notification(n) if *n == genuine)), "{what}: {got:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_attached_notification_fails_the_connection_and_is_counted() {
    forged_case(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_out_of_band_notification_fails_the_connection_and_is_counted() {
    forged_case(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_secret_keys_are_not_checked() {
    let a = endpoint(prefill(1), None);
    let b = endpoint(decode_identity(), None);
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    let other = Notification::chunk(RequestId(3), SenderKey::of(RankId::new(5, 0)), 0, true);
    a.notify(peer, &other).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut got = Vec::new();
    while Instant::now() < deadline && got.is_empty() {
        got.extend(b.recv(Duration::from_millis(50)).await.unwrap());
    }
    assert!(matches!(&got[..], [BackendEvent::Notification(n)] if *n == other), "{got:?}");
    assert_eq!(b.forged_notifications(), 0);
}
