//! Loopback tests of the libfabric backend, each run with the `tcp` (tcp;ofi_rxm) and `shm` providers:
//! registered regions, contiguous and strided writes, out-of-bounds rejection, attached notifications
//! over remote CQ data and over messages, out-of-band and fragmented notifications, peer loss.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::{
    BackendConfig, BackendError, BackendEvent, HostBuffer, KvTransferBackend, Notification, NotificationBody, PeerId,
    RegionId, RequestId, SenderKey, WriteOp,
};
use kvxfer_fabric::FabricBackend;

const PROVIDERS: [&str; 2] = ["tcp", "shm"];

fn config(provider: &str, identity: u64, extra: &[(&str, &str)]) -> BackendConfig {
    let mut c = BackendConfig::new(identity).with("provider", provider).with("timeout_ms", "5000");
    if provider == "tcp" {
        c = c.with("addr", "127.0.0.1");
    }
    for (k, v) in extra {
        c = c.with(k, *v);
    }
    c
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1).collect()
}

struct Pair {
    a: Arc<FabricBackend>,
    b: Arc<FabricBackend>,
    src: HostBuffer,
    dst: HostBuffer,
    peer: PeerId,
}

const LEN: usize = 1 << 20;

async fn pair(provider: &str, extra: &[(&str, &str)]) -> Pair {
    let a = Arc::new(FabricBackend::new(&config(provider, 1, extra)).expect("open sender"));
    let b = Arc::new(FabricBackend::new(&config(provider, 2, extra)).expect("open receiver"));
    let src = HostBuffer::zeroed(LEN);
    src.region().write(0, &pattern(LEN, 7)).unwrap();
    let dst = HostBuffer::zeroed(LEN);
    a.register(RegionId(1), src.region()).unwrap();
    b.register(RegionId(9), dst.region()).unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.expect("connect");
    Pair { a, b, src, dst, peer }
}

/// Collects notifications until `count` arrived or `within` passed.
async fn notifications(b: &FabricBackend, count: usize, within: Duration) -> Vec<Notification> {
    let end = Instant::now() + within;
    let mut out = Vec::new();
    while out.len() < count && Instant::now() < end {
        for e in b.recv(Duration::from_millis(50)).await.unwrap() {
            match e {
                BackendEvent::Notification(n) => out.push(n),
                other => panic!("unexpected event {other:?}"),
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contiguous_and_strided_writes_move_exactly_their_bytes() {
    for prov in PROVIDERS {
        let p = pair(prov, &[]).await;
        eprintln!("{prov}: {:?}", p.a.provider_info());
        let src = p.src.to_vec();
        // Contiguous 256 KiB at offset 1000 -> 5000.
        p.a.write(p.peer, &[WriteOp::contiguous(RegionId(1), 1000, RegionId(9), 5000, 256 * 1024)], None)
            .await
            .unwrap();
        let mut want = vec![0u8; LEN];
        want[5000..5000 + 256 * 1024].copy_from_slice(&src[1000..1000 + 256 * 1024]);
        assert_eq!(p.dst.to_vec(), want, "{prov}: contiguous");
        // Strided: 37 ranges of 100 bytes, source stride 300, destination stride 200, beyond the iov limit.
        let op = WriteOp {
            src: RegionId(1),
            src_offset: 600_000,
            dst: RegionId(9),
            dst_offset: 700_000,
            len: 100,
            count: 37,
            src_stride: 300,
            dst_stride: 200,
        };
        // Two ops in one batch, plus a zero-length one that moves nothing.
        let tail = WriteOp::contiguous(RegionId(1), 0, RegionId(9), LEN as u64 - 10, 10);
        let empty = WriteOp::contiguous(RegionId(1), 0, RegionId(9), 0, 0);
        p.a.write(p.peer, &[op, tail, empty], None).await.unwrap();
        for (s, d, l) in op.ranges() {
            want[d as usize..(d + l) as usize].copy_from_slice(&src[s as usize..(s + l) as usize]);
        }
        want[LEN - 10..].copy_from_slice(&src[..10]);
        assert_eq!(p.dst.to_vec(), want, "{prov}: strided");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_bounds_and_unknown_regions_fail_before_any_byte_moves() {
    for prov in PROVIDERS {
        let p = pair(prov, &[]).await;
        let good = WriteOp::contiguous(RegionId(1), 0, RegionId(9), 0, 64);
        let cases = [
            WriteOp::contiguous(RegionId(1), LEN as u64 - 8, RegionId(9), 0, 64),
            WriteOp::contiguous(RegionId(1), 0, RegionId(9), LEN as u64 - 8, 64),
            WriteOp { count: 3, src_stride: 8, dst_stride: LEN as u64 / 2, ..good },
            WriteOp::contiguous(RegionId(1), u64::MAX - 4, RegionId(9), 0, 64),
            WriteOp { count: 0, ..good },
        ];
        for bad in cases {
            let e = p.a.write(p.peer, &[good, bad], None).await.unwrap_err();
            assert!(matches!(e, BackendError::OutOfBounds { .. }), "{prov}: {bad:?} gave {e}");
        }
        let e = p.a.write(p.peer, &[good, WriteOp { src: RegionId(2), ..good }], None).await.unwrap_err();
        assert!(matches!(e, BackendError::UnknownRegion { peer: None, .. }), "{prov}: {e}");
        let e = p.a.write(p.peer, &[good, WriteOp { dst: RegionId(8), ..good }], None).await.unwrap_err();
        assert!(matches!(e, BackendError::UnknownRegion { peer: Some(_), .. }), "{prov}: {e}");
        let e = p.a.write(PeerId(999), &[good], None).await.unwrap_err();
        assert!(matches!(e, BackendError::UnknownPeer { .. }), "{prov}: {e}");
        assert!(p.dst.to_vec().iter().all(|b| *b == 0), "{prov}: a rejected batch wrote bytes");
        // Region bookkeeping.
        assert!(matches!(p.a.register(RegionId(1), p.src.region()), Err(BackendError::RegionInUse { .. })));
        p.a.deregister(RegionId(1)).unwrap();
        let e = p.a.write(p.peer, &[good], None).await.unwrap_err();
        assert!(matches!(e, BackendError::UnknownRegion { .. }), "{prov}: {e}");
        assert!(p.a.deregister(RegionId(1)).is_err());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attached_notifications_arrive_after_their_bytes_in_both_modes() {
    for prov in PROVIDERS {
        for mode in ["cq-data", "message"] {
            let p = pair(prov, &[("attached", mode)]).await;
            assert_eq!(p.a.attached_uses_cq_data(), mode == "cq-data", "{prov}/{mode}");
            let src = p.src.to_vec();
            let key = SenderKey::from_u64(0x0001_0002_0003_0004);
            for chunk in 0..8u32 {
                let off = chunk as u64 * 65536;
                let ops = [
                    WriteOp::contiguous(RegionId(1), off, RegionId(9), off, 60000),
                    WriteOp {
                        src: RegionId(1),
                        src_offset: off + 60000,
                        dst: RegionId(9),
                        dst_offset: off + 60000,
                        len: 50,
                        count: 9,
                        src_stride: 100,
                        dst_stride: 100,
                    },
                ];
                let n = Notification::chunk(RequestId(42), key, chunk, chunk == 7);
                p.a.write(p.peer, &ops, Some(&n)).await.unwrap();
                let got = notifications(&p.b, 1, Duration::from_secs(5)).await;
                assert_eq!(got, vec![n], "{prov}/{mode}");
                // The bytes are there when the notification is.
                let d = p.dst.to_vec();
                assert_eq!(&d[off as usize..off as usize + 60000], &src[off as usize..off as usize + 60000]);
                for (s, dd, l) in ops[1].ranges() {
                    assert_eq!(&d[dd as usize..(dd + l) as usize], &src[s as usize..(s + l) as usize]);
                }
            }
            // A notification with no ops, and nothing else pending.
            let n = Notification::chunk(RequestId(43), key, 0, true);
            p.a.write(p.peer, &[], Some(&n)).await.unwrap();
            assert_eq!(notifications(&p.b, 1, Duration::from_secs(5)).await, vec![n]);
            assert!(p.b.recv(Duration::from_millis(100)).await.unwrap().is_empty());
            assert_eq!(p.b.dropped_messages(), 0);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_band_and_large_notifications_in_order() {
    for prov in PROVIDERS {
        let p = pair(prov, &[("recv_buf_size", "4096"), ("recv_buffers", "8")]).await;
        let key = SenderKey::from_u64(5);
        let big: Vec<u8> = pattern(300_000, 3);
        let sent = vec![
            Notification::chunk(RequestId(1), key, 0, false),
            Notification { request: RequestId(1), sender: key, body: NotificationBody::Aux(big.clone()) },
            Notification::failure(RequestId(2), key, "prefill rank 3 lost its GPU"),
            Notification { request: RequestId(1), sender: key, body: NotificationBody::State(vec![9; 5000]) },
        ];
        for n in &sent {
            p.a.notify(p.peer, n).await.unwrap();
        }
        let got = notifications(&p.b, sent.len(), Duration::from_secs(10)).await;
        assert_eq!(got, sent, "{prov}");
        assert_eq!(p.b.dropped_messages(), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_of_another_provider_or_backend_is_rejected() {
    let tcp = FabricBackend::new(&config("tcp", 1, &[])).unwrap();
    let shm = FabricBackend::new(&config("shm", 2, &[])).unwrap();
    let e = tcp.connect(&shm.metadata().unwrap()).await.unwrap_err();
    assert!(matches!(e, BackendError::BadMetadata { .. }) && e.to_string().contains("shm"), "{e}");
    let mut m = shm.metadata().unwrap();
    m.backend = "ucx".into();
    assert!(matches!(shm.connect(&m).await, Err(BackendError::BadMetadata { .. })));
    let mut m = shm.metadata().unwrap();
    m.payload.truncate(5);
    assert!(matches!(shm.connect(&m).await, Err(BackendError::BadMetadata { .. })));
    assert!(matches!(
        FabricBackend::new(&BackendConfig::new(1).with("provider", "no-such-provider")),
        Err(BackendError::Ffi { call: "fi_getinfo", .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_receiver_fails_the_sender_within_its_deadline() {
    for prov in PROVIDERS {
        let p = pair(prov, &[("timeout_ms", "3000")]).await;
        p.a.write(p.peer, &[WriteOp::contiguous(RegionId(1), 0, RegionId(9), 0, 4096)], None).await.unwrap();
        let Pair { a, b, peer, .. } = p;
        drop(b);
        let t = Instant::now();
        let mut failed = None;
        for _ in 0..3 {
            match a.write(peer, &[WriteOp::contiguous(RegionId(1), 0, RegionId(9), 0, 512 * 1024)], None).await {
                Ok(()) => tokio::time::sleep(Duration::from_millis(200)).await,
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        let e = failed.unwrap_or_else(|| panic!("{prov}: writes to a closed endpoint kept succeeding"));
        eprintln!("{prov}: dead peer -> {e} after {:?}", t.elapsed());
        assert!(t.elapsed() < Duration::from_secs(12), "{prov}: took {:?}", t.elapsed());
        assert!(
            matches!(e, BackendError::Ffi { .. } | BackendError::Timeout { .. } | BackendError::PeerLost { .. }),
            "{prov}: {e}"
        );
        let e2 = a.notify(peer, &Notification::chunk(RequestId(1), SenderKey::from_u64(1), 0, true)).await;
        eprintln!("{prov}: notify to dead peer -> {e2:?}");
    }
}
