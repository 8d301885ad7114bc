//! Backend-specific behaviour over the emulated verbs layer (`--features emulator`): the notification
//! ring's credits with more fragments than slots, large out-of-band notifications in many SENDs,
//! small SGE limits, error completions that name the request and the peer, and peer loss.
//! The emulator models the verbs semantics the backend relies on; see src/emu.rs for what it does not.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::{
    BackendConfig, BackendError, BackendEvent, EndpointMetadata, HostBuffer, KvTransferBackend, Notification,
    NotificationBody, RegionId, RequestId, SenderKey, WriteOp,
};

fn endpoint(identity: u64, opts: &[(&str, &str)]) -> Arc<dyn KvTransferBackend> {
    let mut cfg = BackendConfig::new(identity);
    for (k, v) in opts {
        cfg = cfg.with(k, *v);
    }
    kvxfer_verbs::create(&cfg).expect("the emulated device opens")
}

fn aux(request: u64, len: usize) -> Notification {
    let payload = (0..len).map(|i| (i as u64 * 31 + request) as u8).collect();
    Notification { request: RequestId(request), sender: SenderKey::from_u64(9), body: NotificationBody::Aux(payload) }
}

async fn events(b: &Arc<dyn KvTransferBackend>, n: usize, within: Duration) -> Vec<BackendEvent> {
    let deadline = Instant::now() + within;
    let mut got = Vec::new();
    while got.len() < n && Instant::now() < deadline {
        got.extend(b.recv(Duration::from_millis(50)).await.unwrap());
    }
    got
}

fn notifications(ev: Vec<BackendEvent>) -> Vec<Notification> {
    ev.into_iter()
        .map(|e| match e {
            BackendEvent::Notification(n) => n,
            other => panic!("unexpected event {other:?}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attached_notifications_larger_than_the_ring_flow_with_credits() {
    let small = [("ring_slots", "2"), ("slot_size", "64")];
    let a = endpoint(1, &small);
    let b = endpoint(2, &small);
    let src = HostBuffer::filled(4096, 0xab);
    let dst = HostBuffer::zeroed(4096);
    a.register(RegionId(1), src.region()).unwrap();
    b.register(RegionId(2), dst.region()).unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    // 40 notifications of 300 bytes: 6 fragments each over a 2-slot ring, so the sender must wait for
    // credits inside a single notification.
    let mut sent = Vec::new();
    for i in 0..40u64 {
        let n = aux(i, 300);
        let op = WriteOp::contiguous(RegionId(1), i * 100, RegionId(2), i * 100, 100);
        a.write(peer, &[op], Some(&n)).await.unwrap();
        sent.push(n);
    }
    assert_eq!(notifications(events(&b, 40, Duration::from_secs(10)).await), sent);
    assert!(dst.to_vec()[..4000].iter().all(|&x| x == 0xab));
    assert!(dst.to_vec()[4000..].iter().all(|&x| x == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_out_of_band_notifications_arrive_whole() {
    let a = endpoint(1, &[("recv_buf", "64")]);
    let b = endpoint(2, &[("recv_buf", "64")]);
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    // 200 KB over 63-byte SEND fragments: thousands of SENDs in rounds, more than the receive queue.
    let big = aux(1, 200_000);
    let small = aux(2, 0);
    a.notify(peer, &big).await.unwrap();
    a.notify(peer, &small).await.unwrap();
    assert_eq!(notifications(events(&b, 2, Duration::from_secs(20)).await), vec![big, small]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strided_writes_with_one_sge_and_no_inline_move_exactly_their_bytes() {
    let opts = [("max_sge", "1"), ("max_inline", "0"), ("sq_depth", "8"), ("signal_every", "3")];
    let a = endpoint(1, &opts);
    let b = endpoint(2, &opts);
    let src = HostBuffer::zeroed(1 << 16);
    src.region().write(0, &(0..1u32 << 16).map(|i| (i % 251) as u8).collect::<Vec<_>>()).unwrap();
    let dst = HostBuffer::filled(1 << 16, 0xee);
    a.register(RegionId(1), src.region()).unwrap();
    b.register(RegionId(7), dst.region()).unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    // 100 ranges of 24 bytes: source stride 40, destination stride 24 (contiguous destination gathered
    // from strided source: one SGE per request forces 100 requests through an 8-deep send queue).
    let op = WriteOp {
        src: RegionId(1),
        src_offset: 8,
        dst: RegionId(7),
        dst_offset: 1000,
        len: 24,
        count: 100,
        src_stride: 40,
        dst_stride: 24,
    };
    a.write(peer, &[op], None).await.unwrap();
    let s = src.to_vec();
    let d = dst.to_vec();
    let mut expect = vec![0xee; 1 << 16];
    for (so, dso, l) in op.ranges() {
        expect[dso as usize..(dso + l) as usize].copy_from_slice(&s[so as usize..(so + l) as usize]);
    }
    assert!(d == expect, "destination differs from the oracle");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_completion_names_the_request_and_the_peer_and_poisons_the_connection() {
    let a = endpoint(1, &[]);
    let b = endpoint(2, &[]);
    let src = HostBuffer::filled(256, 1);
    let dst = HostBuffer::zeroed(256);
    a.register(RegionId(1), src.region()).unwrap();
    b.register(RegionId(2), dst.region()).unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    // The peer deregisters after publishing its key: the write reaches the NIC and fails remotely.
    b.deregister(RegionId(2)).unwrap();
    let e = a.write(peer, &[WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 128)], None).await.unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, BackendError::Ffi { call: "ibv_poll_cq", .. }), "{text}");
    assert!(text.contains("work request") && text.contains("RDMA WRITE of 128 bytes"), "{text}");
    assert!(text.contains("identity 2"), "names the peer: {text}");
    assert!(text.contains("remote access"), "names the status: {text}");
    let again = a.write(peer, &[WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 8)], None).await.unwrap_err();
    assert!(again.to_string().contains("error state"), "{again}");
    assert!(dst.to_vec().iter().all(|&x| x == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounds_and_unknown_regions_are_rejected_before_anything_moves() {
    let a = endpoint(1, &[]);
    let b = endpoint(2, &[]);
    let src = HostBuffer::filled(100, 1);
    let dst = HostBuffer::zeroed(100);
    a.register(RegionId(1), src.region()).unwrap();
    b.register(RegionId(2), dst.region()).unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    let good = WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 10);
    let past = WriteOp { count: 11, src_stride: 0, dst_stride: 10, ..good };
    let e = a.write(peer, &[good, past], None).await.unwrap_err();
    assert!(matches!(e, BackendError::OutOfBounds { side: "destination", .. }), "{e}");
    let e = a.write(peer, &[WriteOp { dst: RegionId(3), ..good }], None).await.unwrap_err();
    assert!(matches!(e, BackendError::UnknownRegion { peer: Some(_), .. }), "{e}");
    let e = a.write(peer, &[WriteOp { src: RegionId(3), ..good }], None).await.unwrap_err();
    assert!(matches!(e, BackendError::UnknownRegion { peer: None, .. }), "{e}");
    assert!(dst.to_vec().iter().all(|&x| x == 0), "nothing of the batch moved");
    assert!(matches!(a.register(RegionId(1), src.region()), Err(BackendError::RegionInUse { .. })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_and_drop_are_reported_as_peer_loss() {
    let a = endpoint(11, &[]);
    let b = endpoint(22, &[]);
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    a.disconnect(peer).await.unwrap();
    let ev = events(&b, 1, Duration::from_secs(5)).await;
    assert!(matches!(&ev[..], [BackendEvent::PeerLost { identity: 11, .. }]), "{ev:?}");
    assert!(matches!(a.notify(peer, &aux(1, 1)).await, Err(BackendError::UnknownPeer { .. })));

    let c = endpoint(33, &[]);
    let peer = a.connect(&c.metadata().unwrap()).await.unwrap();
    drop(c);
    let ev = events(&a, 1, Duration::from_secs(5)).await;
    assert!(matches!(&ev[..], [BackendEvent::PeerLost { identity: 33, .. }]), "{ev:?}");
    let t = Instant::now();
    let e = a.notify(peer, &aux(1, 1)).await.unwrap_err();
    assert!(matches!(e, BackendError::PeerLost { .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(1), "a lost peer fails at once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_or_broken_metadata_is_refused() {
    let a = endpoint(1, &[]);
    let b = endpoint(2, &[]);
    let good = b.metadata().unwrap();
    let tcp = EndpointMetadata { backend: "tcp".into(), ..good.clone() };
    assert!(matches!(a.connect(&tcp).await, Err(BackendError::BadMetadata { .. })));
    let garbage = EndpointMetadata { payload: b"not json".to_vec(), ..good.clone() };
    assert!(matches!(a.connect(&garbage).await, Err(BackendError::BadMetadata { .. })));
    let wrong_identity = EndpointMetadata { identity: 99, ..good };
    let e = a.connect(&wrong_identity).await.unwrap_err();
    assert!(e.to_string().contains("answered as 2"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writers_on_one_connection_keep_their_notifications_whole() {
    let opts = [("ring_slots", "4"), ("slot_size", "64"), ("sq_depth", "16")];
    let a = endpoint(1, &opts);
    let b = endpoint(2, &opts);
    let src = HostBuffer::filled(1 << 16, 5);
    let dst = HostBuffer::zeroed(1 << 16);
    a.register(RegionId(1), src.region()).unwrap();
    b.register(RegionId(2), dst.region()).unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    let mut tasks = Vec::new();
    for t in 0..8u64 {
        let a = a.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..15u64 {
                let req = t * 1000 + i;
                let off = (t * 15 + i) * 512;
                let op = WriteOp::contiguous(RegionId(1), off, RegionId(2), off, 512);
                a.write(peer, &[op], Some(&aux(req, 150))).await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let got = notifications(events(&b, 120, Duration::from_secs(10)).await);
    assert_eq!(got.len(), 120);
    for t in 0..8u64 {
        let mine: Vec<_> = got.iter().filter(|n| n.request.0 / 1000 == t).cloned().collect();
        let expect: Vec<_> = (0..15).map(|i| aux(t * 1000 + i, 150)).collect();
        assert_eq!(mine, expect, "writer {t}'s notifications arrive whole and in its order");
    }
    assert!(dst.to_vec()[..120 * 512].iter().all(|&x| x == 5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_regions_register_and_only_empty_ops_use_them() {
    let a = endpoint(1, &[]);
    let b = endpoint(2, &[]);
    let empty = HostBuffer::zeroed(0);
    a.register(RegionId(1), empty.region()).unwrap();
    b.register(RegionId(2), empty.region()).unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    let none = WriteOp {
        src: RegionId(1),
        src_offset: 0,
        dst: RegionId(2),
        dst_offset: 0,
        len: 0,
        count: 1,
        src_stride: 0,
        dst_stride: 0,
    };
    a.write(peer, &[none], Some(&aux(1, 3))).await.unwrap();
    assert_eq!(notifications(events(&b, 1, Duration::from_secs(5)).await), vec![aux(1, 3)]);
    let one = WriteOp { len: 1, ..none };
    assert!(matches!(a.write(peer, &[one], None).await, Err(BackendError::OutOfBounds { side: "source", .. })));
    a.deregister(RegionId(1)).unwrap();
}
