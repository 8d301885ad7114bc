//! Backend-specific behaviour over the in-process verbs model (`--features emulator`, endpoints made
//! with `device=emulated`): the notification ring's credits with more fragments than slots, large
//! out-of-band notifications in many SENDs, small SGE limits, error completions that name the
//! request and the peer, peer loss, and the v2 contract: closing a registration while writes land,
//! aborting a transfer and reusing its pages.
//! The model implements the verbs semantics the backend relies on; see src/emu.rs for what it does not.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::{
    BackendConfig, BackendError, BackendEvent, EndpointMetadata, HostBuffer, KvTransferBackend, MemDesc, Notification,
    NotificationBody, PeerId, RegionId, RequestId, SenderKey, TransferStatus, WriteOp,
};

fn endpoint(identity: u64, opts: &[(&str, &str)]) -> Arc<dyn KvTransferBackend> {
    let mut cfg = BackendConfig::new(identity);
    for (k, v) in opts {
        cfg = cfg.with(k, *v);
    }
    kvxfer_verbs::create_emulated(&cfg).expect("the emulated device opens")
}

fn aux(request: u64, len: usize) -> Notification {
    let payload = (0..len).map(|i| (i as u64 * 31 + request) as u8).collect();
    Notification {
        generation: 0,
        request: RequestId(request),
        sender: SenderKey::from_u64(9),
        body: NotificationBody::Aux(payload),
    }
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

async fn write(
    a: &Arc<dyn KvTransferBackend>,
    peer: PeerId,
    ops: &[WriteOp],
    n: Option<&Notification>,
) -> Result<(), BackendError> {
    a.post(peer, ops, n)?.wait(soon()).await
}

fn bytes(view: &MemDesc) -> Vec<u8> {
    view.read_guard(0, view.len() as u64).expect("readable").as_slice().to_vec()
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
    let mut src = HostBuffer::filled(4096, 0xab);
    let mut dst = HostBuffer::zeroed(4096);
    let _s = a.register(RegionId(1), src.desc()).await.unwrap();
    let view = dst.desc();
    let _d = b.register(RegionId(2), view.clone()).await.unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    // 40 notifications of 300 bytes: 7 fragments each over a 2-slot ring, so the sender must wait for
    // credits inside a single notification.
    let mut sent = Vec::new();
    for i in 0..40u64 {
        let n = aux(i, 300);
        let op = WriteOp::contiguous(RegionId(1), i * 100, RegionId(2), i * 100, 100);
        write(&a, peer, &[op], Some(&n)).await.unwrap();
        sent.push(n);
    }
    assert_eq!(notifications(events(&b, 40, Duration::from_secs(10)).await), sent);
    let d = bytes(&view);
    assert!(d[..4000].iter().all(|&x| x == 0xab));
    assert!(d[4000..].iter().all(|&x| x == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_out_of_band_notifications_arrive_whole() {
    let a = endpoint(1, &[("recv_buf", "64")]);
    let b = endpoint(2, &[("recv_buf", "64")]);
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    // 200 KB over 64-byte SEND fragments: thousands of SENDs in rounds, more than the receive queue.
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
    let data: Vec<u8> = (0..1u32 << 16).map(|i| (i % 251) as u8).collect();
    let mut src = HostBuffer::from_slice(&data);
    let mut dst = HostBuffer::filled(1 << 16, 0xee);
    let _s = a.register(RegionId(1), src.desc()).await.unwrap();
    let view = dst.desc();
    let _d = b.register(RegionId(7), view.clone()).await.unwrap();
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
    write(&a, peer, &[op], None).await.unwrap();
    let mut expect = vec![0xee; 1 << 16];
    for (so, dso, l) in op.ranges() {
        expect[dso as usize..(dso + l) as usize].copy_from_slice(&data[so as usize..(so + l) as usize]);
    }
    assert!(bytes(&view) == expect, "destination differs from the oracle");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_completion_names_the_request_and_the_peer_and_poisons_the_connection() {
    let a = endpoint(1, &[]);
    let b = endpoint(2, &[]);
    let mut src = HostBuffer::filled(256, 1);
    let mut dst = HostBuffer::zeroed(256);
    let _s = a.register(RegionId(1), src.desc()).await.unwrap();
    let view = dst.desc();
    let _d = b.register(RegionId(2), view.clone()).await.unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    // The peer's NIC forgets the key without a revoke (as if it crashed mid-close): the write reaches
    // the NIC and fails remotely.
    assert!(kvxfer_verbs::emulated_invalidate_keys_at(view.addr()) >= 1);
    let e = write(&a, peer, &[WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 128)], None).await.unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, BackendError::Ffi { call: "ibv_poll_cq", .. }), "{text}");
    assert!(text.contains("work request") && text.contains("RDMA WRITE of 128 bytes"), "{text}");
    assert!(text.contains("identity 2"), "names the peer: {text}");
    assert!(text.contains("remote access"), "names the status: {text}");
    let again = a.post(peer, &[WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 8)], None).unwrap_err();
    assert!(again.to_string().contains("error state"), "{again}");
    assert!(bytes(&view).iter().all(|&x| x == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounds_and_unknown_regions_are_rejected_before_anything_moves() {
    let a = endpoint(1, &[]);
    let b = endpoint(2, &[]);
    let mut src = HostBuffer::filled(100, 1);
    let mut dst = HostBuffer::zeroed(100);
    let _s = a.register(RegionId(1), src.desc()).await.unwrap();
    let view = dst.desc();
    let _d = b.register(RegionId(2), view.clone()).await.unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    let good = WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 10);
    let past = WriteOp { count: 11, src_stride: 0, dst_stride: 10, ..good };
    let e = a.post(peer, &[good, past], None).unwrap_err();
    assert!(matches!(e, BackendError::OutOfBounds { side: "destination", .. }), "{e}");
    let e = a.post(peer, &[WriteOp { dst: RegionId(3), ..good }], None).unwrap_err();
    assert!(matches!(e, BackendError::UnknownRegion { peer: Some(_), .. }), "{e}");
    let e = a.post(peer, &[WriteOp { src: RegionId(3), ..good }], None).unwrap_err();
    assert!(matches!(e, BackendError::UnknownRegion { peer: None, .. }), "{e}");
    let e = a.post(PeerId(999), &[good], None).unwrap_err();
    assert!(matches!(e, BackendError::UnknownPeer { .. }), "{e}");
    assert!(bytes(&view).iter().all(|&x| x == 0), "nothing of the batch moved");
    assert!(matches!(a.register(RegionId(1), src.desc()).await, Err(BackendError::RegionInUse { .. })));
    // Only host memory is claimed (the conformance suite checks that other kinds are refused).
    assert_eq!(a.capabilities().memory.names(), vec!["host"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_are_stated_and_enforced() {
    let a = endpoint(1, &[("max_ops_per_post", "4"), ("max_regions", "2")]);
    let b = endpoint(2, &[]);
    let caps = a.capabilities();
    assert_eq!((caps.limits.max_ops_per_post, caps.limits.max_regions), (4, 2));
    assert!(!caps.cross_process, "the model cannot leave the process");
    let mut bufs: Vec<HostBuffer> = (0..3).map(|_| HostBuffer::zeroed(64)).collect();
    let r1 = a.register(RegionId(1), bufs[0].desc()).await.unwrap();
    let _r2 = a.register(RegionId(2), bufs[1].desc()).await.unwrap();
    assert!(matches!(a.register(RegionId(3), bufs[2].desc()).await, Err(BackendError::Limit { .. })));
    let mut dst = HostBuffer::zeroed(64);
    let _d = b.register(RegionId(5), dst.desc()).await.unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    let op = WriteOp::contiguous(RegionId(1), 0, RegionId(5), 0, 8);
    assert!(matches!(a.post(peer, &[op; 5], None), Err(BackendError::Limit { what: "ops per post", .. })));
    write(&a, peer, &[op; 4], None).await.unwrap();
    r1.close(soon()).await.unwrap();
    let _r3 = a.register(RegionId(3), bufs[2].desc()).await.expect("a closed region frees its slot");
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
    let mut src = HostBuffer::filled(1 << 16, 5);
    let mut dst = HostBuffer::zeroed(1 << 16);
    let _s = a.register(RegionId(1), src.desc()).await.unwrap();
    let view = dst.desc();
    let _d = b.register(RegionId(2), view.clone()).await.unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    let mut tasks = Vec::new();
    for t in 0..8u64 {
        let a = a.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..15u64 {
                let req = t * 1000 + i;
                let off = (t * 15 + i) * 512;
                let op = WriteOp::contiguous(RegionId(1), off, RegionId(2), off, 512);
                write(&a, peer, &[op], Some(&aux(req, 150))).await.unwrap();
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
    assert!(bytes(&view)[..120 * 512].iter().all(|&x| x == 5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_regions_register_and_only_empty_ops_use_them() {
    let a = endpoint(1, &[]);
    let b = endpoint(2, &[]);
    let mut empty = HostBuffer::zeroed(0);
    let ra = a.register(RegionId(1), empty.desc()).await.unwrap();
    let _rb = b.register(RegionId(2), empty.desc()).await.unwrap();
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
    write(&a, peer, &[none], Some(&aux(1, 3))).await.unwrap();
    assert_eq!(notifications(events(&b, 1, Duration::from_secs(5)).await), vec![aux(1, 3)]);
    let one = WriteOp { len: 1, ..none };
    assert!(matches!(a.post(peer, &[one], None), Err(BackendError::OutOfBounds { side: "source", .. })));
    ra.close(soon()).await.unwrap();
}

/// 16384 ranges of 200 bytes every 256 bytes of a 4 MiB region: through a 4-deep send queue (one
/// request per batch), 16384 work requests posted over as many completion round trips.
fn long_transfer(src: RegionId, dst: RegionId) -> WriteOp {
    WriteOp { src, src_offset: 0, dst, dst_offset: 0, len: 200, count: 16384, src_stride: 256, dst_stride: 256 }
}

/// Whether byte `i` of the destination is written by [`long_transfer`].
fn covered(i: usize) -> bool {
    i % 256 < 200
}

const SLOW: [(&str, &str); 3] = [("sq_depth", "4"), ("max_sge", "1"), ("signal_every", "2")];

/// Waits (briefly) until no descriptor of `buf` is alive. `RegionRef::drop` in kvxfer-core wakes a
/// registration's close before the reference's own descriptor clone is dropped, so the last clone
/// can outlive `close` by a thread switch; it never touches the memory.
async fn unshared(buf: &HostBuffer) -> usize {
    let t0 = Instant::now();
    while buf.descriptors() > 0 && t0.elapsed() < Duration::from_secs(1) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    buf.descriptors()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_while_writes_are_in_flight_waits_and_no_byte_changes_afterwards() {
    let a = endpoint(1, &SLOW);
    let b = endpoint(2, &SLOW);
    let len = 4 << 20;
    let mut src = HostBuffer::filled(len, 0x5a);
    let mut dst = HostBuffer::zeroed(len);
    let src_reg = a.register(RegionId(1), src.desc()).await.unwrap();
    let dst_reg = b.register(RegionId(2), dst.desc()).await.unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    let op = long_transfer(RegionId(1), RegionId(2));
    let t = a.post(peer, &[op], None).unwrap();
    let s = t.status();
    assert_eq!(s, TransferStatus::InFlight, "the transfer is still moving when the close starts: {s:?}");
    // The receiver closes the destination: the revoke waits until the writer's transfer is final.
    dst_reg.close(soon()).await.unwrap();
    assert!(t.status().is_final(), "close resolved while a write into the region was in flight");
    assert_eq!(unshared(&dst).await, 0, "no descriptor of the buffer is left after close");
    let after = dst.to_vec().unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(dst.to_vec().unwrap(), after, "a byte changed after close resolved");
    assert_eq!(t.wait(soon()).await, Ok(()), "the writer's transfer was allowed to finish");
    assert!(after.iter().enumerate().all(|(i, &x)| x == if covered(i) { 0x5a } else { 0 }));
    // The writer forgot the region: a new write is refused, nothing written.
    let e = a.post(peer, &[WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 8)], None).unwrap_err();
    assert!(matches!(e, BackendError::UnknownRegion { peer: Some(_), .. }), "{e}");

    // The sender closes its source while its own transfer reads it: the close waits for the transfer.
    let mut dst2 = HostBuffer::zeroed(len);
    let _d2 = b.register(RegionId(3), dst2.desc()).await.unwrap();
    let peer2 = a.connect(&b.metadata().unwrap()).await.unwrap();
    let t2 = a.post(peer2, &[WriteOp { dst: RegionId(3), ..op }], None).unwrap();
    assert_eq!(t2.status(), TransferStatus::InFlight);
    src_reg.close(soon()).await.unwrap();
    assert!(t2.status().is_final(), "the source closed while the NIC could still read it");
    assert_eq!(unshared(&src).await, 0, "no descriptor of the source is left after close");
    src.as_mut_slice().expect("the source buffer is ours again").fill(0);
    assert_eq!(t2.wait(soon()).await, Ok(()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_then_reuse_verifies() {
    let a = endpoint(1, &SLOW);
    let b = endpoint(2, &SLOW);
    let len = 4 << 20;
    let mut first = HostBuffer::filled(len, 0x11);
    let mut second = HostBuffer::filled(len, 0x22);
    let mut dst = HostBuffer::zeroed(len);
    let _f = a.register(RegionId(1), first.desc()).await.unwrap();
    let _s = a.register(RegionId(2), second.desc()).await.unwrap();
    let view = dst.desc();
    let _d = b.register(RegionId(9), view.clone()).await.unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    let op = long_transfer(RegionId(1), RegionId(9));
    let t1 = a.post(peer, &[op], Some(&aux(1, 10))).unwrap();
    let status = t1.abort(soon()).await.unwrap();
    assert_eq!(status, TransferStatus::Aborted, "aborted mid-way (RC waits for the posted writes only)");
    assert_eq!(t1.wait(soon()).await, Err(BackendError::Aborted { backend: "verbs", peer }));
    // Reuse the pages at once for another request with another pattern.
    let t2 = a.post(peer, &[WriteOp { src: RegionId(2), ..op }], Some(&aux(2, 10))).unwrap();
    t2.wait(soon()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let d = bytes(&view);
    let ok = d.iter().enumerate().all(|(i, &x)| x == if covered(i) { 0x22 } else { 0 });
    assert!(ok, "a byte of the aborted transfer landed after the abort resolved");
    // Only the second request's notification is delivered (the first one's was never posted).
    let got = notifications(events(&b, 2, Duration::from_secs(2)).await);
    assert_eq!(got, vec![aux(2, 10)]);
    // Aborting a finished transfer is a no-op.
    assert_eq!(t2.abort(soon()).await, Ok(TransferStatus::Done));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_waits_for_every_transfer_to_be_final() {
    let a = endpoint(1, &SLOW);
    let b = endpoint(2, &SLOW);
    let len = 4 << 20;
    let mut src = HostBuffer::filled(len, 3);
    let mut dst = HostBuffer::zeroed(len);
    let _s = a.register(RegionId(1), src.desc()).await.unwrap();
    let _d = b.register(RegionId(2), dst.desc()).await.unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    let op = long_transfer(RegionId(1), RegionId(2));
    let ts: Vec<_> = (0..3).map(|_| a.post(peer, &[op], None).unwrap()).collect();
    a.disconnect(peer).await.unwrap();
    for t in &ts {
        assert!(t.status().is_final(), "disconnect resolved before {t:?} was final");
    }
    assert!(matches!(a.post(peer, &[op], None), Err(BackendError::UnknownPeer { .. })));
}
