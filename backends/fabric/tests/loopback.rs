//! Loopback tests of the libfabric backend, each run with the `tcp` (tcp;ofi_rxm) and `shm` providers:
//! registered regions, contiguous and strided writes, out-of-bounds rejection, attached notifications
//! over remote CQ data and over messages, out-of-band and fragmented notifications, peer loss,
//! capabilities, registration close while writes are in flight, abort and reuse, disconnect.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::{
    BackendConfig, BackendError, BackendEvent, Completion, HostBuffer, KvTransferBackend, MemDesc, Notification,
    NotificationBody, NotifyStyle, PeerId, RegionId, Registration, RequestId, SenderKey, TransferStatus, WriteOp,
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

fn within(s: u64) -> Instant {
    Instant::now() + Duration::from_secs(s)
}

/// A copy of a registered region's bytes (through a read guard: the provider writes without one).
fn read(mem: &MemDesc) -> Vec<u8> {
    mem.read_guard(0, mem.len() as u64).expect("no local writer").as_slice().to_vec()
}

struct Pair {
    a: Arc<FabricBackend>,
    b: Arc<FabricBackend>,
    src: Vec<u8>,
    dst: MemDesc,
    src_reg: Option<Registration>,
    dst_reg: Option<Registration>,
    peer: PeerId,
}

const LEN: usize = 1 << 20;

async fn pair_len(provider: &str, extra: &[(&str, &str)], len: usize) -> Pair {
    let a = Arc::new(FabricBackend::new(&config(provider, 1, extra)).expect("open sender"));
    let b = Arc::new(FabricBackend::new(&config(provider, 2, extra)).expect("open receiver"));
    let src = pattern(len, 7);
    let dst = HostBuffer::zeroed(len).desc();
    let src_reg = a.register(RegionId(1), HostBuffer::from_slice(&src).desc()).await.unwrap();
    let dst_reg = b.register(RegionId(9), dst.clone()).await.unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.expect("connect");
    Pair { a, b, src, dst, src_reg: Some(src_reg), dst_reg: Some(dst_reg), peer }
}

async fn pair(provider: &str, extra: &[(&str, &str)]) -> Pair {
    pair_len(provider, extra, LEN).await
}

async fn write(b: &FabricBackend, peer: PeerId, ops: &[WriteOp], n: Option<&Notification>) -> Result<(), BackendError> {
    b.post(peer, ops, n)?.wait(within(10)).await
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
        let src = &p.src;
        // Contiguous 256 KiB at offset 1000 -> 5000.
        write(&p.a, p.peer, &[WriteOp::contiguous(RegionId(1), 1000, RegionId(9), 5000, 256 * 1024)], None)
            .await
            .unwrap();
        let mut want = vec![0u8; LEN];
        want[5000..5000 + 256 * 1024].copy_from_slice(&src[1000..1000 + 256 * 1024]);
        assert_eq!(read(&p.dst), want, "{prov}: contiguous");
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
        write(&p.a, p.peer, &[op, tail, empty], None).await.unwrap();
        for (s, d, l) in op.ranges() {
            want[d as usize..(d + l) as usize].copy_from_slice(&src[s as usize..(s + l) as usize]);
        }
        want[LEN - 10..].copy_from_slice(&src[..10]);
        assert_eq!(read(&p.dst), want, "{prov}: strided");
        // 256 page-sized ops that follow each other on both sides (coalesced into few posts), in
        // several transfers in flight at once.
        let pages: Vec<WriteOp> =
            (0..256u64).map(|i| WriteOp::contiguous(RegionId(1), 4096 * i, RegionId(9), 4096 * i, 4096)).collect();
        let ts: Vec<_> = pages.chunks(64).map(|c| p.a.post(p.peer, c, None).unwrap()).collect();
        for t in ts {
            t.wait(within(10)).await.unwrap();
        }
        assert_eq!(read(&p.dst), src[..], "{prov}: pages");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_bounds_and_unknown_regions_fail_before_any_byte_moves() {
    for prov in PROVIDERS {
        let mut p = pair(prov, &[]).await;
        let good = WriteOp::contiguous(RegionId(1), 0, RegionId(9), 0, 64);
        let cases = [
            WriteOp::contiguous(RegionId(1), LEN as u64 - 8, RegionId(9), 0, 64),
            WriteOp::contiguous(RegionId(1), 0, RegionId(9), LEN as u64 - 8, 64),
            WriteOp { count: 3, src_stride: 8, dst_stride: LEN as u64 / 2, ..good },
            WriteOp::contiguous(RegionId(1), u64::MAX - 4, RegionId(9), 0, 64),
            WriteOp { count: 0, ..good },
        ];
        for bad in cases {
            let e = p.a.post(p.peer, &[good, bad], None).unwrap_err();
            assert!(matches!(e, BackendError::OutOfBounds { .. }), "{prov}: {bad:?} gave {e}");
        }
        let e = p.a.post(p.peer, &[good, WriteOp { src: RegionId(2), ..good }], None).unwrap_err();
        assert!(matches!(e, BackendError::UnknownRegion { peer: None, .. }), "{prov}: {e}");
        let e = p.a.post(p.peer, &[good, WriteOp { dst: RegionId(8), ..good }], None).unwrap_err();
        assert!(matches!(e, BackendError::UnknownRegion { peer: Some(_), .. }), "{prov}: {e}");
        let e = p.a.post(PeerId(999), &[good], None).unwrap_err();
        assert!(matches!(e, BackendError::UnknownPeer { .. }), "{prov}: {e}");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(read(&p.dst).iter().all(|b| *b == 0), "{prov}: a rejected batch wrote bytes");
        // Region bookkeeping: a taken id, then a closed one is unknown and free again.
        let mut other = HostBuffer::zeroed(64);
        let e = p.a.register(RegionId(1), other.desc()).await.unwrap_err();
        assert!(matches!(e, BackendError::RegionInUse { .. }), "{prov}: {e}");
        p.src_reg.take().unwrap().close(within(10)).await.unwrap();
        let e = p.a.post(p.peer, &[good], None).unwrap_err();
        assert!(matches!(e, BackendError::UnknownRegion { .. }), "{prov}: {e}");
        let r = p.a.register(RegionId(1), other.desc()).await.expect("a closed id is free again");
        r.close(within(10)).await.unwrap();
        assert!(other.as_slice().is_ok(), "{prov}: every descriptor is released after close");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attached_notifications_arrive_after_their_bytes_in_both_modes() {
    for prov in PROVIDERS {
        for mode in ["cq-data", "message"] {
            let p = pair(prov, &[("attached", mode)]).await;
            assert_eq!(p.a.attached_uses_cq_data(), mode == "cq-data", "{prov}/{mode}");
            let src = &p.src;
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
                let t = p.a.post(p.peer, &ops, Some(&n)).unwrap();
                let got = notifications(&p.b, 1, Duration::from_secs(5)).await;
                assert_eq!(got, vec![n], "{prov}/{mode}");
                // The bytes are there when the notification is.
                let d = read(&p.dst);
                assert_eq!(&d[off as usize..off as usize + 60000], &src[off as usize..off as usize + 60000]);
                for (s, dd, l) in ops[1].ranges() {
                    assert_eq!(&d[dd as usize..(dd + l) as usize], &src[s as usize..(s + l) as usize]);
                }
                t.wait(within(5)).await.unwrap();
            }
            // A notification with no ops, and nothing else pending.
            let n = Notification::chunk(RequestId(43), key, 0, true);
            write(&p.a, p.peer, &[], Some(&n)).await.unwrap();
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
            Notification {
                generation: 0,
                request: RequestId(1),
                sender: key,
                body: NotificationBody::Aux(big.clone()),
            },
            Notification::failure(RequestId(2), key, "prefill rank 3 lost its GPU"),
            Notification {
                generation: 0,
                request: RequestId(1),
                sender: key,
                body: NotificationBody::State(vec![9; 5000]),
            },
        ];
        for n in &sent {
            p.a.notify(p.peer, n).await.unwrap();
        }
        let got = notifications(&p.b, sent.len(), Duration::from_secs(10)).await;
        assert_eq!(got, sent, "{prov}");
        assert_eq!(p.b.dropped_messages(), 0);
        // The largest payload the codec takes goes through (in ~250 fragments); a larger one is refused
        // before anything is sent.
        let limit = p.a.capabilities().limits.max_notification_bytes as usize;
        let max = kvxfer_core::notify::MAX_PAYLOAD;
        assert!(limit > max, "{prov}: {limit}");
        let n = Notification {
            generation: 0,
            request: RequestId(3),
            sender: key,
            body: NotificationBody::Aux(pattern(max, 9)),
        };
        p.a.notify(p.peer, &n).await.unwrap();
        assert_eq!(notifications(&p.b, 1, Duration::from_secs(10)).await, vec![n], "{prov}");
        let huge = Notification {
            generation: 0,
            request: RequestId(3),
            sender: key,
            body: NotificationBody::Aux(vec![1; max + 1]),
        };
        let e = p.a.notify(p.peer, &huge).await.unwrap_err();
        assert!(matches!(e, BackendError::Limit { .. } | BackendError::Codec { .. }), "{prov}: {e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_of_another_provider_or_backend_and_unknown_options_are_rejected() {
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
    let e = FabricBackend::new(&config("tcp", 1, &[("timeout", "5")])).err().expect("unknown option refused");
    let s = e.to_string();
    assert!(matches!(e, BackendError::Config { .. }) && s.contains("\"timeout\"") && s.contains("timeout_ms"), "{s}");
    for (k, v) in [("attached", "sometimes"), ("wait", "spin"), ("recv_buffers", "0"), ("timeout_ms", "-1")] {
        let e = FabricBackend::new(&config("shm", 1, &[(k, v)])).err().expect("bad value refused");
        assert!(matches!(e, BackendError::Config { .. }) && e.to_string().contains(k), "{k}={v}: {e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capabilities_state_what_each_provider_gives() {
    for prov in PROVIDERS {
        let b = FabricBackend::new(&config(prov, 1, &[])).unwrap();
        let (info, caps) = (b.provider_info(), b.capabilities());
        eprintln!("{prov}: delivery_complete {} -> {caps:?}", info.delivery_complete);
        let remote = info.delivery_complete;
        assert_eq!(caps.completion == Completion::Remote, remote, "{prov}");
        assert_eq!(caps.supports(NotifyStyle::OutOfBand), remote, "{prov}: out-of-band only with remote completion");
        assert_eq!(caps.cross_host, prov == "tcp", "{prov}");
        assert!(caps.cross_process && caps.supports(NotifyStyle::Attached), "{prov}");
        // Both providers of libfabric 1.17 grant FI_DELIVERY_COMPLETE (tests/completion.rs checks
        // what it means).
        assert!(remote, "{prov}: libfabric 1.17 {prov} should grant FI_DELIVERY_COMPLETE");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_receiver_fails_the_sender_within_its_deadline() {
    for prov in PROVIDERS {
        let p = pair(prov, &[("timeout_ms", "3000")]).await;
        write(&p.a, p.peer, &[WriteOp::contiguous(RegionId(1), 0, RegionId(9), 0, 4096)], None).await.unwrap();
        let Pair { a, b, peer, src_reg, dst_reg, .. } = p;
        drop(dst_reg);
        drop(b);
        let t = Instant::now();
        let mut failed = None;
        for _ in 0..3 {
            match write(&a, peer, &[WriteOp::contiguous(RegionId(1), 0, RegionId(9), 0, 512 * 1024)], None).await {
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
        // The source registration still closes within its deadline.
        src_reg.unwrap().close(within(10)).await.unwrap();
    }
}

/// Writes of `piece` bytes covering the destination, source piece `i` to destination piece `n-1-i`
/// (so they cannot be coalesced: each is a post of its own).
fn sweep(len: usize, piece: usize) -> Vec<WriteOp> {
    let n = len / piece;
    (0..n)
        .map(|i| {
            let d = (n - 1 - i) * piece;
            WriteOp::contiguous(RegionId(1), (i * piece) as u64, RegionId(9), d as u64, piece as u64)
        })
        .collect()
}

/// What the destination holds after `sweep` from `src`.
fn swept(src: &[u8], piece: usize) -> Vec<u8> {
    src.chunks(piece).rev().flatten().copied().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_a_registration_while_writes_are_in_flight_waits_and_no_byte_changes_afterwards() {
    const BIG: usize = 16 << 20;
    for prov in PROVIDERS {
        // Destination side: the receiver closes while the sender keeps posting into it.
        let mut p = pair_len(prov, &[], BIG).await;
        let ops = sweep(BIG, 64 << 10);
        let mut ts = Vec::new();
        for _ in 0..4 {
            ts.push(p.a.post(p.peer, &ops, None).unwrap());
        }
        let t = Instant::now();
        p.dst_reg.take().unwrap().close(within(20)).await.expect("close resolves");
        let closed_after = t.elapsed();
        let snapshot = read(&p.dst);
        // The sender forgot the region (the revoke), and its earlier transfers are final.
        let e = p.a.post(p.peer, &ops[..1], None).unwrap_err();
        assert!(matches!(e, BackendError::UnknownRegion { peer: Some(_), .. }), "{prov}: {e}");
        let states: Vec<TransferStatus> = ts.iter().map(|t| t.status()).collect();
        assert!(states.iter().all(TransferStatus::is_final), "{prov}: {states:?}");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(read(&p.dst) == snapshot, "{prov}: bytes changed after close resolved");
        eprintln!("{prov}: destination close took {closed_after:?}; transfers {states:?}");

        // Source side: close waits until no transfer reads the source any more.
        let mut p = pair_len(prov, &[], BIG).await;
        let t = p.a.post(p.peer, &ops, None).unwrap();
        p.src_reg.take().unwrap().close(within(20)).await.expect("close resolves");
        assert!(t.status().is_final(), "{prov}: source closed while its transfer is {:?}", t.status());
        assert_eq!(t.wait(within(1)).await, Ok(()), "{prov}");
        assert!(read(&p.dst) == swept(&p.src, 64 << 10), "{prov}: the transfer that held the source finished");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_then_reuse_of_the_destination_pages_verifies() {
    const BIG: usize = 32 << 20;
    for prov in PROVIDERS {
        let p = pair_len(prov, &[], BIG).await;
        // A second source with another pattern.
        let other = pattern(BIG, 101);
        let _r2 = p.a.register(RegionId(2), HostBuffer::from_slice(&other).desc()).await.unwrap();
        let ops = sweep(BIG, 64 << 10);
        let mut aborted = 0;
        // At least three rounds; more (up to 20) until one abort catches its transfer in flight,
        // which depends on scheduling (on a loaded machine the first rounds may all finish first).
        let mut rounds = 0;
        for round in 0..20u64 {
            if round >= 3 && aborted > 0 {
                break;
            }
            rounds += 1;
            let first = p.a.post(p.peer, &ops, None).unwrap();
            tokio::time::sleep(Duration::from_micros(200 * (round % 3))).await;
            let status = first.abort(within(10)).await.expect("abort resolves");
            assert!(matches!(status, TransferStatus::Aborted | TransferStatus::Done), "{prov}: {status:?}");
            aborted += usize::from(status == TransferStatus::Aborted);
            // Abort of a final transfer is a no-op.
            assert_eq!(first.abort(within(1)).await.unwrap(), status);
            // Reuse the pages at once for another request.
            let second: Vec<WriteOp> = ops.iter().map(|o| WriteOp { src: RegionId(2), ..*o }).collect();
            write(&p.a, p.peer, &second, None).await.unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
            let want = swept(&other, 64 << 10);
            assert!(read(&p.dst) == want, "{prov}: round {round}: a byte of the aborted transfer landed late");
            // Back to the first pattern for the next round.
            write(&p.a, p.peer, &ops, None).await.unwrap();
        }
        eprintln!("{prov}: {aborted} of {rounds} aborts caught their transfer in flight");
        assert!(aborted > 0, "{prov}: no abort in {rounds} rounds caught a 32 MiB transfer in flight");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_resolves_after_every_transfer_to_the_peer_is_final() {
    for prov in PROVIDERS {
        let p = pair_len(prov, &[], 8 << 20).await;
        let ops = sweep(8 << 20, 64 << 10);
        let ts: Vec<_> = (0..3).map(|_| p.a.post(p.peer, &ops, None).unwrap()).collect();
        p.a.disconnect(p.peer).await.unwrap();
        assert!(ts.iter().all(|t| t.status().is_final()), "{prov}");
        assert!(matches!(p.a.post(p.peer, &ops, None), Err(BackendError::UnknownPeer { .. })), "{prov}");
        // The receiver heard a bye, not a loss.
        let ev = p.b.recv(Duration::from_millis(300)).await.unwrap();
        assert!(ev.is_empty(), "{prov}: {ev:?}");
        let _ = (p.src_reg, p.dst_reg);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_endpoints_connected_both_ways_write_to_each_other() {
    for prov in PROVIDERS {
        let p = pair(prov, &[]).await;
        let src_b = pattern(LEN, 55);
        let dst_a = HostBuffer::zeroed(LEN).desc();
        let _r1 = p.b.register(RegionId(1), HostBuffer::from_slice(&src_b).desc()).await.unwrap();
        let _r2 = p.a.register(RegionId(9), dst_a.clone()).await.unwrap();
        let back = tokio::time::timeout(Duration::from_secs(10), p.b.connect(&p.a.metadata().unwrap()))
            .await
            .unwrap_or_else(|_| panic!("{prov}: connect back hangs"))
            .unwrap_or_else(|e| panic!("{prov}: connect back: {e}"));
        let ops: Vec<WriteOp> =
            (0..64).map(|k| WriteOp::contiguous(RegionId(1), k * 16384, RegionId(9), k * 16384, 16384)).collect();
        for round in 0..5 {
            let ta = p.a.post(p.peer, &ops, None).unwrap();
            let tb = p.b.post(back, &ops, None).unwrap();
            ta.wait(within(10)).await.unwrap_or_else(|e| panic!("{prov} round {round} a->b: {e}"));
            tb.wait(within(10)).await.unwrap_or_else(|e| panic!("{prov} round {round} b->a: {e}"));
        }
        assert!(read(&p.dst) == p.src, "{prov}");
        assert!(read(&dst_a) == src_b, "{prov}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_metadata_of_a_closed_region_writes_nothing() {
    for prov in PROVIDERS {
        let a = FabricBackend::new(&config(prov, 1, &[])).unwrap();
        let b = FabricBackend::new(&config(prov, 2, &[])).unwrap();
        let _src = a.register(RegionId(1), HostBuffer::filled(LEN, 3).desc()).await.unwrap();
        let dst = HostBuffer::zeroed(LEN).desc();
        let reg = b.register(RegionId(9), dst.clone()).await.unwrap();
        let stale = b.metadata().unwrap();
        reg.close(within(10)).await.unwrap();
        let peer = a.connect(&stale).await.unwrap();
        // The keys come with the connect's answer, registered for this peer: a region closed before
        // it has none, and the post is refused before anything moves. (Before per-peer keys, the
        // stale metadata's key was used and the provider refused the write: shm drops such a write
        // without an error completion, so the transfer failed by its deadline.)
        let r = match a.post(peer, &[WriteOp::contiguous(RegionId(1), 0, RegionId(9), 0, LEN as u64)], None) {
            Ok(t) => t.wait(within(15)).await,
            Err(e) => {
                assert!(matches!(e, BackendError::UnknownRegion { .. }), "{prov}: {e}");
                Err(e)
            }
        };
        eprintln!("{prov}: write into a region closed before the connect -> {r:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(r.is_err(), "{prov}: a write with a closed key succeeded");
        assert!(read(&dst).iter().all(|x| *x == 0), "{prov}: a closed region changed");
    }
}
