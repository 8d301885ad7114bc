//! Loopback tests of the UCX backend, each run over tcp (on `lo`) and over shared memory.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::{
    BackendConfig, BackendError, BackendEvent, HostBuffer, KvTransferBackend, Notification, NotificationBody, PeerId,
    RegionId, RequestId, SenderKey, WriteOp,
};

/// (name, transports[;data path]): tcp takes the active-message data path, shared memory puts;
/// the third entry runs the active-message data path over shared memory too.
const TRANSPORTS: [(&str, &str); 3] =
    [("tcp", "tcp"), ("shm", "posix,sysv,cma,self"), ("shm+am", "posix,sysv,cma,self;am")];

fn config(spec: &str, identity: u64) -> BackendConfig {
    let (tls, data) = spec.split_once(';').unwrap_or((spec, "auto"));
    let c = BackendConfig::new(identity).with("tls", tls).with("timeout_ms", "10000").with("data", data);
    if tls.contains("tcp") {
        c.with("net_devices", "lo")
    } else {
        c
    }
}

fn endpoint(tls: &str, identity: u64) -> Arc<dyn KvTransferBackend> {
    kvxfer_ucx::create(&config(tls, identity)).expect("creating a UCX endpoint")
}

fn pattern(len: usize, seed: u8) -> HostBuffer {
    let b = HostBuffer::zeroed(len);
    let data: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1).collect();
    b.region().write(0, &data).unwrap();
    b
}

fn note(request: u64, chunk: u32) -> Notification {
    Notification::chunk(RequestId(request), SenderKey::from_u64(7), chunk, false)
}

/// Receiver-side events until `n` notifications arrived (or the deadline).
async fn notifications(rx: &dyn KvTransferBackend, n: usize, within: Duration) -> Vec<Notification> {
    let deadline = Instant::now() + within;
    let mut out = Vec::new();
    while out.len() < n && Instant::now() < deadline {
        for e in rx.recv(Duration::from_millis(100)).await.unwrap() {
            if let BackendEvent::Notification(x) = e {
                out.push(x);
            }
        }
    }
    out
}

struct Pair {
    tx: Arc<dyn KvTransferBackend>,
    rx: Arc<dyn KvTransferBackend>,
    src: HostBuffer,
    dst: HostBuffer,
    peer: PeerId,
}

async fn pair(tls: &str, len: usize) -> Pair {
    let tx = endpoint(tls, 1);
    let rx = endpoint(tls, 2);
    let src = pattern(len, 3);
    let dst = HostBuffer::zeroed(len);
    tx.register(RegionId(1), src.region()).unwrap();
    rx.register(RegionId(9), dst.region()).unwrap();
    let peer = tx.connect(&rx.metadata().unwrap()).await.unwrap();
    Pair { tx, rx, src, dst, peer }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contiguous_write_with_attached_notification() {
    for (name, tls) in TRANSPORTS {
        let p = pair(tls, 1 << 20).await;
        let op = WriteOp::contiguous(RegionId(1), 4096, RegionId(9), 8192, 300_000);
        p.tx.write(p.peer, &[op], Some(&note(1, 0))).await.unwrap();
        // write returned: the bytes are already there.
        let (s, d) = (p.src.to_vec(), p.dst.to_vec());
        assert_eq!(&d[8192..8192 + 300_000], &s[4096..4096 + 300_000], "{name}");
        assert!(d[..8192].iter().all(|&b| b == 0) && d[8192 + 300_000..].iter().all(|&b| b == 0), "{name}");
        let got = notifications(&*p.rx, 1, Duration::from_secs(5)).await;
        assert_eq!(got, vec![note(1, 0)], "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strided_ops_move_exactly_their_ranges() {
    for (name, tls) in TRANSPORTS {
        let p = pair(tls, 64 * 1024).await;
        // 16 ranges of 96 bytes: source stride 512, destination stride 256.
        let op = WriteOp {
            src: RegionId(1),
            src_offset: 100,
            dst: RegionId(9),
            dst_offset: 40,
            len: 96,
            count: 16,
            src_stride: 512,
            dst_stride: 256,
        };
        // And a contiguous multi-range op (strides equal to len) that becomes one put.
        let whole = WriteOp {
            src_offset: 20_000,
            dst_offset: 30_000,
            len: 64,
            count: 50,
            src_stride: 64,
            dst_stride: 64,
            ..op
        };
        p.tx.write(p.peer, &[op, whole], None).await.unwrap();
        let s = p.src.to_vec();
        let mut expect = vec![0u8; 64 * 1024];
        for o in [op, whole] {
            for (so, d, l) in o.ranges() {
                expect[d as usize..(d + l) as usize].copy_from_slice(&s[so as usize..(so + l) as usize]);
            }
        }
        assert_eq!(p.dst.to_vec(), expect, "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_bounds_and_unknown_regions_are_rejected_before_any_byte_moves() {
    for (name, tls) in TRANSPORTS {
        let p = pair(tls, 4096).await;
        let good = WriteOp::contiguous(RegionId(1), 0, RegionId(9), 0, 1024);
        let cases: Vec<(WriteOp, &str)> = vec![
            (WriteOp::contiguous(RegionId(1), 0, RegionId(9), 4000, 97), "destination"),
            (WriteOp::contiguous(RegionId(1), 4095, RegionId(9), 0, 2), "source"),
            (
                WriteOp {
                    count: 5,
                    dst_stride: 1000,
                    src_stride: 10,
                    ..WriteOp::contiguous(RegionId(1), 0, RegionId(9), 0, 100)
                },
                "destination",
            ),
            (WriteOp { count: 0, ..good }, "destination-or-source"),
            (WriteOp::contiguous(RegionId(1), u64::MAX - 1, RegionId(9), 0, 4), "source"),
        ];
        for (bad, side) in cases {
            // The good op comes first in the batch: it must not move either.
            let e = p.tx.write(p.peer, &[good, bad], Some(&note(2, 0))).await.unwrap_err();
            match &e {
                BackendError::OutOfBounds { side: s, .. } => assert!(side.contains(s), "{name}: {e}"),
                other => panic!("{name}: expected OutOfBounds, got {other}"),
            }
        }
        let e = p.tx.write(p.peer, &[WriteOp::contiguous(RegionId(1), 0, RegionId(5), 0, 8)], None).await.unwrap_err();
        assert!(matches!(e, BackendError::UnknownRegion { region: RegionId(5), peer: Some(_), .. }), "{name}: {e}");
        let e = p.tx.write(p.peer, &[WriteOp::contiguous(RegionId(4), 0, RegionId(9), 0, 8)], None).await.unwrap_err();
        assert!(matches!(e, BackendError::UnknownRegion { region: RegionId(4), peer: None, .. }), "{name}: {e}");
        let e = p.tx.write(PeerId(999), &[good], None).await.unwrap_err();
        assert!(matches!(e, BackendError::UnknownPeer { .. }), "{name}: {e}");
        assert!(p.dst.to_vec().iter().all(|&b| b == 0), "{name}: a rejected batch moved bytes");
        assert!(
            notifications(&*p.rx, 1, Duration::from_millis(300)).await.is_empty(),
            "{name}: notified a rejected write"
        );
        // Registration errors.
        assert!(matches!(p.tx.register(RegionId(1), p.src.region()), Err(BackendError::RegionInUse { .. })), "{name}");
        p.tx.deregister(RegionId(1)).unwrap();
        assert!(matches!(p.tx.deregister(RegionId(1)), Err(BackendError::UnknownRegion { .. })), "{name}");
        let e = p.tx.write(p.peer, &[good], None).await.unwrap_err();
        assert!(matches!(e, BackendError::UnknownRegion { region: RegionId(1), .. }), "{name}: {e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_keep_their_order_in_both_styles() {
    for (name, tls) in TRANSPORTS {
        let p = pair(tls, 1 << 16).await;
        let mut sent = Vec::new();
        for i in 0..40u32 {
            let n = note(3, i);
            if i % 3 == 0 {
                let op = WriteOp::contiguous(RegionId(1), u64::from(i) * 1000, RegionId(9), u64::from(i) * 1000, 1000);
                p.tx.write(p.peer, &[op], Some(&n)).await.unwrap();
            } else if i % 3 == 1 {
                // Empty write with a notification: ordered after earlier writes.
                p.tx.write(p.peer, &[], Some(&n)).await.unwrap();
            } else {
                p.tx.notify(p.peer, &n).await.unwrap();
            }
            sent.push(n);
        }
        let aux = Notification {
            request: RequestId(3),
            sender: SenderKey::from_u64(7),
            body: NotificationBody::Aux(vec![5; 100_000]),
        };
        p.tx.notify(p.peer, &aux).await.unwrap();
        sent.push(aux);
        let got = notifications(&*p.rx, sent.len(), Duration::from_secs(10)).await;
        assert_eq!(got, sent, "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writes_from_many_tasks() {
    for (name, tls) in TRANSPORTS {
        let p = pair(tls, 1 << 20).await;
        let mut tasks = Vec::new();
        for t in 0..8u64 {
            let tx = p.tx.clone();
            let peer = p.peer;
            tasks.push(tokio::spawn(async move {
                for k in 0..8u64 {
                    let off = (t * 8 + k) * 16384;
                    let op = WriteOp::contiguous(RegionId(1), off, RegionId(9), off, 16384);
                    tx.write(peer, &[op], Some(&note(100 + t, k as u32))).await.unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(p.dst.to_vec(), p.src.to_vec(), "{name}");
        let got = notifications(&*p.rx, 64, Duration::from_secs(10)).await;
        assert_eq!(got.len(), 64, "{name}");
        // Per task, chunks arrive in order.
        for t in 0..8u64 {
            let chunks: Vec<u32> = got
                .iter()
                .filter(|n| n.request == RequestId(100 + t))
                .map(|n| match n.body {
                    NotificationBody::KvChunk { chunk, .. } => chunk,
                    _ => unreachable!(),
                })
                .collect();
            assert_eq!(chunks, (0..8).collect::<Vec<_>>(), "{name}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_of_another_backend_is_rejected() {
    let tx = endpoint("tcp", 1);
    let mut m = tx.metadata().unwrap();
    m.backend = "tcp".into();
    assert!(matches!(tx.connect(&m).await, Err(BackendError::BadMetadata { .. })));
    let mut m = tx.metadata().unwrap();
    m.payload = b"{not json".to_vec();
    assert!(matches!(tx.connect(&m).await, Err(BackendError::BadMetadata { .. })));
    assert!(matches!(kvxfer_ucx::create(&BackendConfig::new(1).with("tsl", "tcp")), Err(BackendError::Config { .. })));
    assert!(matches!(
        kvxfer_ucx::create(&BackendConfig::new(1).with("tls", "no-such-transport")),
        Err(BackendError::Ffi { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_receiver_fails_the_sender_and_dropped_sender_is_reported() {
    for (name, tls) in TRANSPORTS {
        // Receiver goes away: the sender's next write fails with PeerLost, promptly.
        let p = pair(tls, 1 << 16).await;
        let op = WriteOp::contiguous(RegionId(1), 0, RegionId(9), 0, 4096);
        p.tx.write(p.peer, &[op], None).await.unwrap();
        let Pair { tx, rx, src: _src, dst: _dst, peer } = p;
        drop(rx);
        let t0 = Instant::now();
        let e = tx.write(peer, &[op], Some(&note(4, 0))).await.unwrap_err();
        assert!(matches!(e, BackendError::PeerLost { .. }), "{name}: {e}");
        assert!(t0.elapsed() < Duration::from_secs(5), "{name}: took {:?}", t0.elapsed());
        // The sender also hears about it.
        let ev = tx.recv(Duration::from_secs(2)).await.unwrap();
        assert!(ev.iter().any(|e| matches!(e, BackendEvent::PeerLost { identity: 2, .. })), "{name}: {ev:?}");

        // Sender goes away: the receiver reports PeerLost with the sender's identity.
        let p = pair(tls, 1 << 16).await;
        p.tx.write(p.peer, &[op], Some(&note(5, 0))).await.unwrap();
        let Pair { tx, rx, .. } = p;
        drop(tx);
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut lost = None;
        while lost.is_none() && Instant::now() < deadline {
            for e in rx.recv(Duration::from_millis(200)).await.unwrap() {
                if let BackendEvent::PeerLost { identity, reason } = e {
                    lost = Some((identity, reason));
                }
            }
        }
        let (identity, reason) = lost.unwrap_or_else(|| panic!("{name}: no PeerLost"));
        assert_eq!(identity, 1, "{name}: {reason}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_forgets_the_peer_and_reconnect_works() {
    for (name, tls) in TRANSPORTS {
        let p = pair(tls, 1 << 16).await;
        p.tx.disconnect(p.peer).await.unwrap();
        let op = WriteOp::contiguous(RegionId(1), 0, RegionId(9), 0, 4096);
        assert!(matches!(p.tx.write(p.peer, &[op], None).await, Err(BackendError::UnknownPeer { .. })), "{name}");
        assert!(matches!(p.tx.disconnect(p.peer).await, Err(BackendError::UnknownPeer { .. })), "{name}");
        let again = p.tx.connect(&p.rx.metadata().unwrap()).await.unwrap();
        p.tx.write(again, &[op], Some(&note(6, 0))).await.unwrap();
        assert_eq!(&p.dst.to_vec()[..4096], &p.src.to_vec()[..4096], "{name}");
        assert_eq!(notifications(&*p.rx, 1, Duration::from_secs(5)).await, vec![note(6, 0)], "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deregistered_destination_is_revoked_at_connected_peers() {
    for (name, tls) in TRANSPORTS {
        let p = pair(tls, 1 << 16).await;
        let op = WriteOp::contiguous(RegionId(1), 0, RegionId(9), 0, 4096);
        p.tx.write(p.peer, &[op], None).await.unwrap();
        p.rx.deregister(RegionId(9)).unwrap();
        // The revocation is a message: it arrives within a moment.
        let deadline = Instant::now() + Duration::from_secs(5);
        let e = loop {
            match p.tx.write(p.peer, &[op], None).await {
                Err(e) => break e,
                Ok(()) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(10)).await,
                Ok(()) => panic!("{name}: writes into a deregistered region kept succeeding"),
            }
        };
        // Either the sender already forgot the region, or (active-message data path) the receiver
        // refused the bytes itself; never a silent write.
        let ok = match &e {
            BackendError::UnknownRegion { region: RegionId(9), peer: Some(_), .. } => true,
            BackendError::Protocol { detail, .. } => detail.contains("region 9"),
            _ => false,
        };
        assert!(ok, "{name}: {e}");
        // The receiver sends the revocation before it acknowledges (or refuses) anything after
        // the deregistration, on the same endpoint: from now on the sender knows.
        let e = p.tx.write(p.peer, &[op], None).await.unwrap_err();
        assert!(matches!(e, BackendError::UnknownRegion { region: RegionId(9), .. }), "{name}: {e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_can_write_to_itself() {
    for (name, tls) in TRANSPORTS {
        let ep = endpoint(tls, 3);
        let a = pattern(8192, 9);
        let b = HostBuffer::zeroed(8192);
        ep.register(RegionId(1), a.region()).unwrap();
        ep.register(RegionId(2), b.region()).unwrap();
        let me = ep.connect(&ep.metadata().unwrap()).await.unwrap();
        ep.write(me, &[WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 8192)], Some(&note(7, 0))).await.unwrap();
        assert_eq!(a.to_vec(), b.to_vec(), "{name}");
        assert_eq!(notifications(&*ep, 1, Duration::from_secs(5)).await, vec![note(7, 0)], "{name}");
    }
}
