//! Authentication with the cluster secret, over tcp (active-message data path) and shared memory
//! (puts): what each refusal says, and a forged notification attached to a transfer (the commit
//! of the active-message path, the notification after the flush of the put path).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::{
    BackendConfig, BackendEvent, HostBuffer, KvTransferBackend, Notification, RankId, RegionId, RequestId, Secret,
    SenderKey, WriteOp,
};
use kvxfer_ucx::UcxBackend;

const TRANSPORTS: [&str; 2] = ["tcp", "posix,sysv,cma,self"];

fn endpoint(tls: &str, identity: u64, secret: Option<&str>) -> Arc<UcxBackend> {
    let mut c = BackendConfig::new(identity).with("tls", tls).with("timeout_ms", "10000");
    if tls.contains("tcp") {
        c = c.with("net_devices", "lo");
    }
    let secret = secret.map(|s| Secret::new(s.as_bytes().to_vec()).unwrap());
    Arc::new(UcxBackend::new(&c.with_secret(secret)).expect("creating a UCX endpoint"))
}

fn prefill(tp: u32) -> u64 {
    SenderKey::of(RankId::new(tp, 0)).to_u64()
}

/// Decode rank 9's endpoint identity (the one encoding: [`kvxfer_core::identity`]).
fn decode_identity() -> u64 {
    kvxfer_core::identity(kvxfer_core::Side::Decode, kvxfer_core::RankId::new(9, 0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_name_authentication_and_what_to_do() {
    for tls in TRANSPORTS {
        let cases = [
            (Some("one"), Some("two"), "the secrets differ"),
            (None, Some("one"), "this endpoint none"),
            (Some("one"), None, "the peer has no cluster secret"),
        ];
        for (mine, theirs, says) in cases {
            let a = endpoint(tls, prefill(1), mine);
            let b = endpoint(tls, decode_identity(), theirs);
            let started = Instant::now();
            let e = a.connect(&b.metadata().unwrap()).await.expect_err("a mismatch must be refused");
            let text = e.to_string();
            assert!(text.contains("authentication"), "{tls}: {text}");
            assert!(text.contains(says), "{tls}: {text} (expected {says:?})");
            assert!(text.contains("KVXFER_SECRET"), "{tls}: {text}");
            assert!(started.elapsed() < Duration::from_secs(5), "{tls}: refused only after {:?}", started.elapsed());
            assert_eq!(b.forged_notifications(), 0);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_attached_notification_fails_the_connection_and_is_counted() {
    for tls in TRANSPORTS {
        let a = endpoint(tls, prefill(1), Some("cluster"));
        let b = endpoint(tls, decode_identity(), Some("cluster"));
        let src = HostBuffer::from_slice(&[7u8; 4096]).desc();
        let _s = a.register(RegionId(1), src).await.unwrap();
        let _d = b.register(RegionId(2), HostBuffer::zeroed(4096).desc()).await.unwrap();
        let peer = a.connect(&b.metadata().unwrap()).await.expect("one secret connects");
        let ops = [WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 4096)];
        let forged = Notification::chunk(RequestId(3), SenderKey::of(RankId::new(5, 0)), 0, true);
        let t = a.post(peer, &ops, Some(&forged)).unwrap();
        // The put path completes the write before the notification; the active-message path gets
        // no acknowledgement, then the refusal.
        let _ = t.wait(Instant::now() + Duration::from_secs(10)).await;
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut events = Vec::new();
        while Instant::now() < deadline && !events.iter().any(|e| matches!(e, BackendEvent::PeerLost { .. })) {
            events.extend(b.recv(Duration::from_millis(100)).await.unwrap());
        }
        assert!(
            !events.iter().any(|e| matches!(e, BackendEvent::Notification(_))),
            "{tls}: forged notification delivered: {events:?}"
        );
        let reason = events
            .iter()
            .find_map(|e| match e {
                BackendEvent::PeerLost { identity, reason } if *identity == prefill(1) => Some(reason.clone()),
                _ => None,
            })
            .unwrap_or_else(|| panic!("{tls}: no PeerLost: {events:?}"));
        assert!(reason.contains("forged") && reason.contains("0x5"), "{tls}: {reason}");
        assert_eq!(b.forged_notifications(), 1, "{tls}");
        // Nothing more of that endpoint is applied, and it cannot connect again.
        let again = a.connect(&b.metadata().unwrap()).await;
        assert!(again.is_err(), "{tls}: a refused endpoint reconnected");
        let late = b.recv(Duration::from_millis(300)).await.unwrap();
        assert!(!late.iter().any(|e| matches!(e, BackendEvent::Notification(_))), "{tls}: {late:?}");
    }
}
