//! Loopback tests of the UCX backend, each run over tcp (on `lo`) and over shared memory.
//!
//! Registered memory cannot be read from safe code, so a test reads a destination after closing
//! its registration (which is also what an engine does before reusing pages).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::{
    BackendConfig, BackendError, BackendEvent, HostBuffer, KvTransferBackend, MemDesc, MemKind, Notification,
    NotificationBody, PeerId, RegionId, Registration, RequestId, SenderKey, Transfer, TransferStatus, WriteOp,
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

fn bytes(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1).collect()
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

fn note(request: u64, chunk: u32) -> Notification {
    Notification::chunk(RequestId(request), SenderKey::from_u64(7), chunk, false)
}

/// Receiver-side notifications until `n` arrived (or the deadline).
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
    src_reg: Option<Registration>,
    dst_reg: Option<Registration>,
    peer: PeerId,
    data: Vec<u8>,
}

impl Pair {
    /// Closes the destination registration and returns its bytes.
    async fn dst_bytes(&mut self) -> Vec<u8> {
        if let Some(r) = self.dst_reg.take() {
            r.close(soon()).await.unwrap();
        }
        self.dst.to_vec().unwrap()
    }

    fn post(&self, ops: &[WriteOp], n: Option<&Notification>) -> Result<Transfer, BackendError> {
        self.tx.post(self.peer, ops, n)
    }
}

async fn pair(tls: &str, len: usize) -> Pair {
    let tx = endpoint(tls, 1);
    let rx = endpoint(tls, 2);
    let data = bytes(len, 3);
    let mut src = HostBuffer::from_slice(&data);
    let mut dst = HostBuffer::zeroed(len);
    let src_reg = tx.register(RegionId(1), src.desc()).await.unwrap();
    let dst_reg = rx.register(RegionId(9), dst.desc()).await.unwrap();
    let peer = tx.connect(&rx.metadata().unwrap()).await.unwrap();
    Pair { tx, rx, src, dst, src_reg: Some(src_reg), dst_reg: Some(dst_reg), peer, data }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contiguous_write_with_attached_notification() {
    for (name, tls) in TRANSPORTS {
        let mut p = pair(tls, 1 << 20).await;
        let op = WriteOp::contiguous(RegionId(1), 4096, RegionId(9), 8192, 300_000);
        let t = p.post(&[op], Some(&note(1, 0))).unwrap();
        assert_eq!(t.bytes(), 300_000);
        t.wait(soon()).await.unwrap();
        // Done: the bytes are already there (remote completion) and the notification follows.
        let got = notifications(&*p.rx, 1, Duration::from_secs(5)).await;
        assert_eq!(got, vec![note(1, 0)], "{name}");
        let (s, d) = (p.data.clone(), p.dst_bytes().await);
        assert_eq!(&d[8192..8192 + 300_000], &s[4096..4096 + 300_000], "{name}");
        assert!(d[..8192].iter().all(|&b| b == 0) && d[8192 + 300_000..].iter().all(|&b| b == 0), "{name}");
        assert!(p.src.to_vec().is_err(), "{name}: the source is still registered");
    }
}

/// `idle=event`: both progress threads sleep on their worker's event descriptor once idle; writes
/// and notifications after idle gaps (each longer than the 20 ms the threads stay hot) still land,
/// woken by the message (receiver) and by the command (sender).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_event_threads_wake_for_messages_and_commands() {
    for (name, tls) in TRANSPORTS {
        let tx = kvxfer_ucx::create(&config(tls, 1).with("idle", "event")).unwrap();
        let rx = kvxfer_ucx::create(&config(tls, 2).with("idle", "event")).unwrap();
        let data = bytes(1 << 20, 5);
        let mut src = HostBuffer::from_slice(&data);
        let mut dst = HostBuffer::zeroed(1 << 20);
        let src_reg = tx.register(RegionId(1), src.desc()).await.unwrap();
        let dst_reg = rx.register(RegionId(9), dst.desc()).await.unwrap();
        let peer = tx.connect(&rx.metadata().unwrap()).await.unwrap();
        for i in 0..4u64 {
            tokio::time::sleep(Duration::from_millis(60)).await;
            let op = WriteOp::contiguous(RegionId(1), i << 18, RegionId(9), i << 18, 1 << 18);
            let t0 = Instant::now();
            tx.post(peer, &[op], Some(&note(i + 1, 0))).unwrap().wait(soon()).await.unwrap();
            let got = notifications(&*rx, 1, Duration::from_secs(5)).await;
            assert_eq!(got, vec![note(i + 1, 0)], "{name}: write {i}");
            // Woken, not timed out: far below the 10 s transport deadline.
            assert!(t0.elapsed() < Duration::from_secs(2), "{name}: write {i} took {:?}", t0.elapsed());
        }
        dst_reg.close(soon()).await.unwrap();
        src_reg.close(soon()).await.unwrap();
        assert_eq!(dst.to_vec().unwrap(), data, "{name}");
        drop(src);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strided_ops_move_exactly_their_ranges() {
    for (name, tls) in TRANSPORTS {
        let mut p = pair(tls, 64 * 1024).await;
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
        p.post(&[op, whole], None).unwrap().wait(soon()).await.unwrap();
        let mut expect = vec![0u8; 64 * 1024];
        for o in [op, whole] {
            for (so, d, l) in o.ranges() {
                expect[d as usize..(d + l) as usize].copy_from_slice(&p.data[so as usize..(so + l) as usize]);
            }
        }
        assert_eq!(p.dst_bytes().await, expect, "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_bounds_and_unknown_regions_are_rejected_before_any_byte_moves() {
    for (name, tls) in TRANSPORTS {
        let mut p = pair(tls, 4096).await;
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
            let e = p.post(&[good, bad], Some(&note(2, 0))).unwrap_err();
            match &e {
                BackendError::OutOfBounds { side: s, .. } => assert!(side.contains(s), "{name}: {e}"),
                other => panic!("{name}: expected OutOfBounds, got {other}"),
            }
        }
        let e = p.post(&[WriteOp::contiguous(RegionId(1), 0, RegionId(5), 0, 8)], None).unwrap_err();
        assert!(matches!(e, BackendError::UnknownRegion { region: RegionId(5), peer: Some(_), .. }), "{name}: {e}");
        let e = p.post(&[WriteOp::contiguous(RegionId(4), 0, RegionId(9), 0, 8)], None).unwrap_err();
        assert!(matches!(e, BackendError::UnknownRegion { region: RegionId(4), peer: None, .. }), "{name}: {e}");
        let e = p.tx.post(PeerId(999), &[good], None).unwrap_err();
        assert!(matches!(e, BackendError::UnknownPeer { .. }), "{name}: {e}");
        assert!(
            notifications(&*p.rx, 1, Duration::from_millis(300)).await.is_empty(),
            "{name}: notified a rejected post"
        );
        // Registration errors: a duplicate id; a closed region is unknown to new posts.
        let mut other = HostBuffer::zeroed(64);
        let e = p.tx.register(RegionId(1), other.desc()).await.unwrap_err();
        assert!(matches!(e, BackendError::RegionInUse { .. }), "{name}: {e}");
        p.src_reg.take().unwrap().close(soon()).await.unwrap();
        let e = p.post(&[good], None).unwrap_err();
        assert!(matches!(e, BackendError::UnknownRegion { region: RegionId(1), .. }), "{name}: {e}");
        assert_eq!(p.src.to_vec().unwrap(), p.data, "{name}: the closed source is readable again");
        assert!(p.dst_bytes().await.iter().all(|&b| b == 0), "{name}: a rejected batch moved bytes");
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
                p.post(&[op], Some(&n)).unwrap().wait(soon()).await.unwrap();
            } else if i % 3 == 1 {
                // Empty post with a notification: ordered after earlier transfers.
                p.post(&[], Some(&n)).unwrap().wait(soon()).await.unwrap();
            } else {
                p.tx.notify(p.peer, &n).await.unwrap();
            }
            sent.push(n);
        }
        // The largest notification the codec makes fits the claimed limit and arrives whole.
        let aux = Notification {
            generation: 0,
            request: RequestId(3),
            sender: SenderKey::from_u64(7),
            body: NotificationBody::Aux(vec![5; kvxfer_core::notify::MAX_PAYLOAD]),
        };
        assert!(aux.encode().unwrap().len() as u64 <= p.tx.capabilities().limits.max_notification_bytes);
        p.tx.notify(p.peer, &aux).await.unwrap();
        sent.push(aux.clone());
        p.post(&[], Some(&aux)).unwrap().wait(soon()).await.unwrap();
        sent.push(aux);
        let got = notifications(&*p.rx, sent.len(), Duration::from_secs(10)).await;
        assert_eq!(got, sent, "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_transfers_from_many_tasks() {
    for (name, tls) in TRANSPORTS {
        let mut p = pair(tls, 1 << 20).await;
        let mut tasks = Vec::new();
        for t in 0..8u64 {
            let tx = p.tx.clone();
            let peer = p.peer;
            tasks.push(tokio::spawn(async move {
                // Several in flight per task, awaited at the end.
                let mut pending = Vec::new();
                for k in 0..8u64 {
                    let off = (t * 8 + k) * 16384;
                    let op = WriteOp::contiguous(RegionId(1), off, RegionId(9), off, 16384);
                    pending.push(tx.post(peer, &[op], Some(&note(100 + t, k as u32))).unwrap());
                }
                for x in pending {
                    x.wait(soon()).await.unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
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
        let data = p.data.clone();
        assert_eq!(p.dst_bytes().await, data, "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_of_another_backend_and_bad_options_are_rejected() {
    let tx = endpoint("tcp", 1);
    let mut m = tx.metadata().unwrap();
    m.backend = "tcp".into();
    assert!(matches!(tx.connect(&m).await, Err(BackendError::BadMetadata { .. })));
    let mut m = tx.metadata().unwrap();
    m.payload = b"{not json".to_vec();
    assert!(matches!(tx.connect(&m).await, Err(BackendError::BadMetadata { .. })));
    let e = kvxfer_ucx::create(&BackendConfig::new(1).with("tsl", "tcp")).err().unwrap().to_string();
    assert!(e.contains("tsl") && e.contains("tls") && e.contains("timeout_ms"), "{e}");
    let e = kvxfer_ucx::create(&BackendConfig::new(1).with("timeout_ms", "0")).err().unwrap();
    assert!(matches!(e, BackendError::Config { .. }), "{e}");
    let e = kvxfer_ucx::create(&BackendConfig::new(1).with("data", "rdma")).err().unwrap();
    assert!(e.to_string().contains("put"), "{e}");
    assert!(matches!(
        kvxfer_ucx::create(&BackendConfig::new(1).with("tls", "no-such-transport")),
        Err(BackendError::Ffi { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capabilities_are_per_instance_and_honest() {
    for (name, tls) in TRANSPORTS {
        let ep = endpoint(tls, 1);
        let c = ep.capabilities();
        assert!(c.attached && c.out_of_band && c.cross_process, "{name}");
        assert_eq!(c.cross_host, name == "tcp", "{name}: shared memory does not leave the host");
        assert_eq!(c.completion, kvxfer_core::Completion::Remote, "{name}");
        // Debian's UCX has no CUDA support: device memory is not claimed, and refused.
        let mut b = HostBuffer::zeroed(64);
        let host = b.desc();
        // SAFETY: the descriptor only carries a kind; register refuses it before using the address.
        #[allow(unsafe_code)]
        let dev = unsafe {
            MemDesc::from_raw_parts(std::ptr::NonNull::new(host.addr()).unwrap(), 64, MemKind::Cuda { device: 0 })
        };
        if !c.memory.contains(&dev.kind()) {
            let e = ep.register(RegionId(1), dev).await.unwrap_err();
            assert!(matches!(e, BackendError::Unsupported { .. }), "{name}: {e}");
        }
        // Over the ops limit: nothing posted, a typed error.
        let rx = endpoint(tls, 2);
        let reg = rx.register(RegionId(2), host).await.unwrap();
        let peer = ep.connect(&rx.metadata().unwrap()).await.unwrap();
        let ops = vec![WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 1); c.limits.max_ops_per_post as usize + 1];
        assert!(matches!(ep.post(peer, &ops, None), Err(BackendError::Limit { .. })), "{name}");
        reg.close(soon()).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_receiver_fails_the_sender_and_dropped_sender_is_reported() {
    for (name, tls) in TRANSPORTS {
        // Receiver goes away: the sender's next transfer fails with PeerLost, promptly.
        let p = pair(tls, 1 << 16).await;
        let op = WriteOp::contiguous(RegionId(1), 0, RegionId(9), 0, 4096);
        p.post(&[op], None).unwrap().wait(soon()).await.unwrap();
        let Pair { tx, rx, peer, dst_reg, .. } = p;
        drop(dst_reg);
        drop(rx);
        let t0 = Instant::now();
        let e = match tx.post(peer, &[op], Some(&note(4, 0))) {
            Err(e) => e,
            Ok(t) => t.wait(soon()).await.unwrap_err(),
        };
        assert!(matches!(e, BackendError::PeerLost { .. } | BackendError::UnknownRegion { .. }), "{name}: {e}");
        assert!(t0.elapsed() < Duration::from_secs(5), "{name}: took {:?}", t0.elapsed());
        // The sender also hears about it.
        let ev = tx.recv(Duration::from_secs(2)).await.unwrap();
        assert!(ev.iter().any(|e| matches!(e, BackendEvent::PeerLost { identity: 2, .. })), "{name}: {ev:?}");

        // Sender goes away: the receiver reports PeerLost with the sender's identity.
        let p = pair(tls, 1 << 16).await;
        p.post(&[op], Some(&note(5, 0))).unwrap().wait(soon()).await.unwrap();
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
async fn disconnect_waits_for_transfers_and_reconnect_works() {
    for (name, tls) in TRANSPORTS {
        let mut p = pair(tls, 8 << 20).await;
        let op = WriteOp::contiguous(RegionId(1), 0, RegionId(9), 0, 8 << 20);
        let t = p.post(&[op], None).unwrap();
        p.tx.disconnect(p.peer).await.unwrap();
        assert!(t.status().is_final(), "{name}: disconnect resolved with a transfer in flight");
        assert!(matches!(p.post(&[op], None), Err(BackendError::UnknownPeer { .. })), "{name}");
        assert!(matches!(p.tx.disconnect(p.peer).await, Err(BackendError::UnknownPeer { .. })), "{name}");
        let again = p.tx.connect(&p.rx.metadata().unwrap()).await.unwrap();
        let small = WriteOp::contiguous(RegionId(1), 0, RegionId(9), 0, 4096);
        p.tx.post(again, &[small], Some(&note(6, 0))).unwrap().wait(soon()).await.unwrap();
        assert_eq!(notifications(&*p.rx, 1, Duration::from_secs(5)).await, vec![note(6, 0)], "{name}");
        let data = p.data.clone();
        assert_eq!(&p.dst_bytes().await[..4096], &data[..4096], "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_a_destination_is_acknowledged_by_connected_peers() {
    for (name, tls) in TRANSPORTS {
        let mut p = pair(tls, 1 << 16).await;
        // A second sender, connected too: it must acknowledge as well.
        let tx2 = endpoint(tls, 5);
        let peer2 = tx2.connect(&p.rx.metadata().unwrap()).await.unwrap();
        let op = WriteOp::contiguous(RegionId(1), 0, RegionId(9), 0, 4096);
        p.post(&[op], None).unwrap().wait(soon()).await.unwrap();
        let t0 = Instant::now();
        p.dst_reg.take().unwrap().close(soon()).await.unwrap();
        assert!(t0.elapsed() < Duration::from_secs(5), "{name}: close took {:?}", t0.elapsed());
        // close resolved only after every peer acknowledged the revoke, and a peer acknowledges
        // after it forgot the region: the very next post is refused before anything moves.
        let e = p.post(&[op], None).unwrap_err();
        assert!(matches!(e, BackendError::UnknownRegion { region: RegionId(9), peer: Some(_), .. }), "{name}: {e}");
        let e = tx2.post(peer2, &[WriteOp { src: RegionId(1), ..op }], None).unwrap_err();
        assert!(matches!(e, BackendError::UnknownRegion { .. }), "{name}: {e}");
        assert_eq!(&p.dst.to_vec().unwrap()[..4096], &p.data[..4096], "{name}");
        // A peer that connects later does not see the closed region either.
        let tx3 = endpoint(tls, 6);
        let peer3 = tx3.connect(&p.rx.metadata().unwrap()).await.unwrap();
        let mut b = HostBuffer::zeroed(4096);
        let _r = tx3.register(RegionId(1), b.desc()).await.unwrap();
        assert!(matches!(tx3.post(peer3, &[op], None), Err(BackendError::UnknownRegion { .. })), "{name}");
    }
}

/// Closing while transfers into the region are in flight: close waits, and no byte changes after
/// it resolved. Also the source side: close waits for the transfers reading it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_with_transfers_in_flight_waits_and_nothing_changes_afterwards() {
    const LEN: usize = 16 << 20;
    for (name, tls) in TRANSPORTS {
        let mut p = pair(tls, LEN).await;
        let op = WriteOp::contiguous(RegionId(1), 0, RegionId(9), 0, LEN as u64);
        let ts: Vec<Transfer> = (0..16).map(|_| p.post(&[op], None).unwrap()).collect();
        p.dst_reg.take().unwrap().close(soon()).await.unwrap();
        let first = p.dst.to_vec().unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(first == p.dst.to_vec().unwrap(), "{name}: bytes changed after close resolved");
        let refused = ts.iter().filter(|t| matches!(t.status(), TransferStatus::Failed(_))).count();
        eprintln!("{name}: close resolved with {refused} of {} transfers refused (revoked region)", ts.len());
        for t in &ts {
            let s = t.wait(soon()).await;
            assert!(
                matches!(s, Ok(()) | Err(BackendError::UnknownRegion { .. }) | Err(BackendError::Protocol { .. })),
                "{name}: {s:?}"
            );
        }
        assert!(p.dst.to_vec().unwrap() == first, "{name}: bytes changed after the transfers ended");
        // Whatever landed is the source's bytes.
        assert!(first.iter().zip(&p.data).all(|(d, s)| *d == 0 || d == s), "{name}: foreign bytes");

        // Source side: close waits until no transfer reads the source any more.
        let mut dst2 = HostBuffer::zeroed(LEN);
        let _r = p.rx.register(RegionId(10), dst2.desc()).await.unwrap();
        let peer = p.tx.connect(&p.rx.metadata().unwrap()).await.unwrap();
        let op = WriteOp { dst: RegionId(10), ..op };
        let ts: Vec<Transfer> = (0..4).map(|_| p.tx.post(peer, &[op], None).unwrap()).collect();
        p.src_reg.take().unwrap().close(soon()).await.unwrap();
        assert!(ts.iter().all(|t| t.status().is_final()), "{name}: source closed while a transfer reads it");
        assert_eq!(p.src.to_vec().unwrap(), p.data, "{name}");
    }
}

/// Abort mid-way, then reuse the destination pages at once for another transfer with another
/// pattern: it verifies byte for byte, so no byte of the aborted transfer landed after the abort.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_then_reuse_of_the_destination_verifies() {
    const LEN: usize = 32 << 20;
    for (name, tls) in TRANSPORTS {
        let mut p = pair(tls, LEN).await;
        let second = bytes(LEN, 101);
        let mut src2 = HostBuffer::from_slice(&second);
        let _r2 = p.tx.register(RegionId(2), src2.desc()).await.unwrap();
        let mut aborted = 0;
        for round in 0..3u64 {
            let op = WriteOp::contiguous(RegionId(1), 0, RegionId(9), 0, LEN as u64);
            let ts: Vec<Transfer> = (0..3).map(|_| p.post(&[op], Some(&note(8, round as u32))).unwrap()).collect();
            tokio::time::sleep(Duration::from_millis(round)).await;
            for t in &ts {
                match t.abort(soon()).await.unwrap() {
                    TransferStatus::Aborted => aborted += 1,
                    TransferStatus::Done => {}
                    s => panic!("{name}: abort ended as {s:?}"),
                }
            }
            let op2 = WriteOp { src: RegionId(2), ..op };
            p.post(&[op2], None).unwrap().wait(soon()).await.unwrap();
        }
        // Abort of a finished transfer is a no-op.
        let t = p.post(&[WriteOp::contiguous(RegionId(2), 0, RegionId(9), 0, 4096)], None).unwrap();
        t.wait(soon()).await.unwrap();
        assert_eq!(t.abort(soon()).await.unwrap(), TransferStatus::Done, "{name}");
        let got = p.dst_bytes().await;
        assert!(got == second, "{name}: the reused pages do not hold the second pattern");
        eprintln!("{name}: {aborted} of 9 transfers aborted before they finished");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_can_write_to_itself() {
    for (name, tls) in TRANSPORTS {
        let ep = endpoint(tls, 3);
        let data = bytes(8192, 9);
        let mut a = HostBuffer::from_slice(&data);
        let mut b = HostBuffer::zeroed(8192);
        let ra = ep.register(RegionId(1), a.desc()).await.unwrap();
        let rb = ep.register(RegionId(2), b.desc()).await.unwrap();
        let me = ep.connect(&ep.metadata().unwrap()).await.unwrap();
        let op = WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 8192);
        ep.post(me, &[op], Some(&note(7, 0))).unwrap().wait(soon()).await.unwrap();
        assert_eq!(notifications(&*ep, 1, Duration::from_secs(5)).await, vec![note(7, 0)], "{name}");
        // Closing with a connection to ourselves: we acknowledge our own revoke.
        rb.close(soon()).await.unwrap();
        assert!(matches!(ep.post(me, &[op], None), Err(BackendError::UnknownRegion { .. })), "{name}");
        ra.close(soon()).await.unwrap();
        assert_eq!(b.to_vec().unwrap(), data, "{name}");
        assert_eq!(a.to_vec().unwrap(), data, "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_registrations_and_the_endpoint_releases_the_memory() {
    for (name, tls) in TRANSPORTS {
        let mut p = pair(tls, 1 << 16).await;
        let op = WriteOp::contiguous(RegionId(1), 0, RegionId(9), 0, 4096);
        p.post(&[op], None).unwrap().wait(soon()).await.unwrap();
        // Dropped without close: closed in the background (peers acknowledge, then unmapped).
        drop(p.dst_reg.take());
        let deadline = Instant::now() + Duration::from_secs(10);
        while p.dst.descriptors() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(&p.dst.to_vec().unwrap()[..4096], &p.data[..4096], "{name}");
        // Dropping the endpoint closes what is still registered.
        let Pair { tx, src, src_reg, .. } = p;
        drop(tx);
        assert_eq!(src.descriptors(), 0, "{name}: the endpoint kept the source registered");
        // Closing the registration afterwards is fine.
        src_reg.unwrap().close(soon()).await.unwrap();
    }
}

/// The shared-memory segment size: the backend's default unless set, refused out of range, and a
/// same-host peer with another size is refused at connect (by the connector from the metadata,
/// and by the acceptor from the hello), before any byte moves. Equal non-default sizes work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_memory_segment_sizes_must_match_on_one_host() {
    let shm = "posix,sysv,cma,self";
    let with_seg = |identity: u64, seg: &str| {
        let c = config(shm, identity).with("ucx.MM_SEG_SIZE", seg);
        kvxfer_ucx::create(&c).expect("creating a UCX endpoint")
    };
    let a = kvxfer_ucx::UcxBackend::new(&config(shm, 1)).unwrap();
    assert_eq!(a.mm_seg_size(), kvxfer_ucx::mmseg::DEFAULT);
    // No shared-memory transport: nothing to match (and no UCX setting it would warn about).
    assert_eq!(kvxfer_ucx::UcxBackend::new(&config("tcp", 1)).unwrap().mm_seg_size(), 0);
    let e = kvxfer_ucx::create(&config(shm, 1).with("ucx.MM_SEG_SIZE", "65600")).err().unwrap();
    assert!(matches!(e, BackendError::Config { .. }) && e.to_string().contains("16 bits"), "{e}");
    let e = kvxfer_ucx::create(&config(shm, 1).with("ucx.SYSV_SEG_SIZE", "16k")).err().unwrap();
    assert!(e.to_string().contains("ucx.MM_SEG_SIZE"), "{e}");

    // Connector side: the metadata says the acceptor's size differs.
    let tx = endpoint(shm, 1);
    let rx = with_seg(2, "16k");
    let e = tx.connect(&rx.metadata().unwrap()).await.unwrap_err();
    assert!(matches!(e, BackendError::Connect { .. }) && e.to_string().contains("segment sizes differ"), "{e}");
    assert!(e.to_string().contains("16384") && e.to_string().contains("32832"), "{e}");

    // Acceptor side: metadata edited to match the connector, the hello gives the truth away.
    let mut m = rx.metadata().unwrap();
    let mut v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
    v["mm_seg"] = serde_json::json!(kvxfer_ucx::mmseg::DEFAULT);
    m.payload = serde_json::to_vec(&v).unwrap();
    let e = tx.connect(&m).await.unwrap_err();
    assert!(e.to_string().contains("segment sizes differ"), "{e}");

    // Equal sizes: bytes move and verify.
    let tx = with_seg(3, "16k");
    let data = bytes(1 << 20, 5);
    let mut src = HostBuffer::from_slice(&data);
    let mut dst = HostBuffer::zeroed(1 << 20);
    let src_reg = tx.register(RegionId(1), src.desc()).await.unwrap();
    let dst_reg = rx.register(RegionId(2), dst.desc()).await.unwrap();
    let peer = tx.connect(&rx.metadata().unwrap()).await.unwrap();
    let op = WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 1 << 20);
    tx.post(peer, &[op], None).unwrap().wait(soon()).await.unwrap();
    src_reg.close(soon()).await.unwrap();
    dst_reg.close(soon()).await.unwrap();
    assert_eq!(dst.as_mut_slice().unwrap(), &data[..]);
}
