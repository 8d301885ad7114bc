//! The TCP backend over real loopback sockets: data path, both notification styles, striping, the
//! wire-safety and peer-loss cases (hostile clients, wrong token, malformed frames), and memory
//! lifetime (close during a frame, abort then reuse, overlapping frames on two streams).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::{
    BackendConfig, BackendError, BackendEvent, EndpointMetadata, HostBuffer, KvTransferBackend, MemDesc, Notification,
    RegionId, RequestId, SenderKey, TransferStatus, WriteOp,
};
use kvxfer_tcp::wire::{self, FrameType, Header, Hello, OpDesc, StreamKind};
use kvxfer_tcp::TcpMetadata;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn ep(identity: u64, connections: u32) -> Arc<dyn KvTransferBackend> {
    kvxfer_tcp::create(
        &BackendConfig::new(identity).with("connections", connections.to_string()).with("timeout_s", "10"),
    )
    .expect("endpoint")
}

fn pattern_vec(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| ((i as u8).wrapping_mul(31) ^ (i >> 9) as u8).wrapping_add(seed)).collect()
}

fn pattern(len: usize, seed: u8) -> HostBuffer {
    HostBuffer::from_slice(&pattern_vec(len, seed))
}

fn deadline(s: u64) -> Instant {
    Instant::now() + Duration::from_secs(s)
}

/// The bytes of registered memory, read through a guard (refused while a write is under way).
fn view(d: &MemDesc) -> Vec<u8> {
    d.read_guard(0, d.len() as u64).expect("no write under way").as_slice().to_vec()
}

/// Waits for events until `pred` matches one, up to 5 s.
async fn wait_event(b: &Arc<dyn KvTransferBackend>, pred: impl Fn(&BackendEvent) -> bool) -> BackendEvent {
    let end = Instant::now() + Duration::from_secs(5);
    while Instant::now() < end {
        for e in b.recv(Duration::from_millis(100)).await.unwrap() {
            if pred(&e) {
                return e;
            }
        }
    }
    panic!("no matching event within 5 s");
}

fn note(req: u64, chunk: u32) -> Notification {
    Notification::chunk(RequestId(req), SenderKey::from_u64(7), chunk, true)
}

/// Posts and waits (what `write` did before transfer handles).
async fn write(
    b: &Arc<dyn KvTransferBackend>,
    peer: kvxfer_core::PeerId,
    ops: &[WriteOp],
    n: Option<&Notification>,
) -> Result<(), BackendError> {
    b.post(peer, ops, n)?.wait(deadline(10)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contiguous_and_strided_writes_land_exactly() {
    let (a, b) = (ep(1, 3), ep(2, 1));
    let mut src = pattern(1 << 20, 3);
    let mut dst = HostBuffer::filled(1 << 20, 0xEE);
    let s = src.to_vec().unwrap();
    let _rs = a.register(RegionId(0), src.desc()).await.unwrap();
    let d = dst.desc();
    let _rd = b.register(RegionId(5), d.clone()).await.unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    let ops = [
        WriteOp::contiguous(RegionId(0), 100, RegionId(5), 1000, 300_000),
        // strided: 64 ranges of 32 bytes, source stride 128, destination stride 64
        WriteOp {
            src: RegionId(0),
            src_offset: 500_000,
            dst: RegionId(5),
            dst_offset: 600_000,
            len: 32,
            count: 64,
            src_stride: 128,
            dst_stride: 64,
        },
    ];
    write(&a, peer, &ops, Some(&note(1, 0))).await.unwrap();
    let got = view(&d);
    let mut want = vec![0xEEu8; 1 << 20];
    want[1000..301_000].copy_from_slice(&s[100..300_100]);
    for i in 0..64 {
        want[600_000 + i * 64..600_000 + i * 64 + 32].copy_from_slice(&s[500_000 + i * 128..500_000 + i * 128 + 32]);
    }
    assert!(got == want, "destination differs from the expected bytes");
    let e = wait_event(&b, |e| matches!(e, BackendEvent::Notification(_))).await;
    assert_eq!(e, BackendEvent::Notification(note(1, 0)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_and_long_ranges_interleaved_land_exactly() {
    // Short strided ranges and long contiguous ones interleaved, crossing guard-piece and frame
    // boundaries, so every piece boundary is exercised.
    let (a, b) = (ep(1, 1), ep(2, 1));
    let mut src = pattern(4 << 20, 5);
    let mut dst = HostBuffer::filled(4 << 20, 0xEE);
    let s = src.to_vec().unwrap();
    let _rs = a.register(RegionId(0), src.desc()).await.unwrap();
    let dv = dst.desc();
    let _rd = b.register(RegionId(0), dv.clone()).await.unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    let mut ops = Vec::new();
    let mut want = vec![0xEEu8; 4 << 20];
    let (mut so, mut d) = (0u64, 0u64);
    for i in 0..40u64 {
        let (len, count) = if i % 3 == 2 { (5000, 1) } else { (24 + i, 700) };
        let op = WriteOp {
            src: RegionId(0),
            src_offset: so,
            dst: RegionId(0),
            dst_offset: d,
            len,
            count,
            src_stride: len + 3,
            dst_stride: len + 1,
        };
        for (x, y, l) in op.ranges() {
            want[y as usize..(y + l) as usize].copy_from_slice(&s[x as usize..(x + l) as usize]);
        }
        so += (len + 3) * count;
        d += (len + 1) * count;
        ops.push(op);
    }
    assert!(d < 4 << 20 && so < 4 << 20);
    write(&a, peer, &ops, None).await.unwrap();
    assert!(view(&dv) == want, "destination differs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attached_notification_is_delivered_after_all_striped_data() {
    let (a, b) = (ep(1, 4), ep(2, 1));
    let mut src = pattern(8 << 20, 9);
    let mut dst = HostBuffer::zeroed(8 << 20);
    let s = src.to_vec().unwrap();
    let _rs = a.register(RegionId(0), src.desc()).await.unwrap();
    let d = dst.desc();
    let _rd = b.register(RegionId(0), d.clone()).await.unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    // Many 4 KiB blocks in reverse order: every stream gets parts.
    let ops: Vec<WriteOp> = (0..2048u64)
        .map(|i| WriteOp::contiguous(RegionId(0), i * 4096, RegionId(0), (2047 - i) * 4096, 4096))
        .collect();
    let t = a.post(peer, &ops, Some(&note(9, 0))).unwrap();
    let e = wait_event(&b, |e| matches!(e, BackendEvent::Notification(_))).await;
    // When the notification is seen, every byte must be in place.
    let got = view(&d);
    for i in 0..2048usize {
        assert_eq!(&got[(2047 - i) * 4096..(2048 - i) * 4096], &s[i * 4096..(i + 1) * 4096], "block {i}");
    }
    assert_eq!(e, BackendEvent::Notification(note(9, 0)));
    t.wait(deadline(10)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_band_notifications_and_empty_writes() {
    let (a, b) = (ep(1, 2), ep(2, 2));
    let mut src = pattern(4096, 1);
    let mut dst = HostBuffer::zeroed(4096);
    let s = src.to_vec().unwrap();
    let _rs = a.register(RegionId(0), src.desc()).await.unwrap();
    let d = dst.desc();
    let _rd = b.register(RegionId(0), d.clone()).await.unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    write(&a, peer, &[WriteOp::contiguous(RegionId(0), 0, RegionId(0), 0, 4096)], None).await.unwrap();
    // The transfer is Done: remote completion, so the bytes are there before any notification.
    assert_eq!(view(&d), s);
    a.notify(peer, &note(3, 0)).await.unwrap();
    a.notify(peer, &Notification::failure(RequestId(4), SenderKey::from_u64(7), "disk on fire")).await.unwrap();
    write(&a, peer, &[], Some(&note(5, 1))).await.unwrap();
    assert_eq!(a.post(peer, &[], None).unwrap().status(), TransferStatus::Done, "an empty post is done at once");
    let mut seen = Vec::new();
    let end = Instant::now() + Duration::from_secs(5);
    while seen.len() < 3 && Instant::now() < end {
        for e in b.recv(Duration::from_millis(100)).await.unwrap() {
            if let BackendEvent::Notification(n) = e {
                seen.push(n.request.0);
            }
        }
    }
    seen.sort_unstable();
    assert_eq!(seen, vec![3, 4, 5]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sender_side_bounds_and_regions_are_checked_before_any_byte() {
    let (a, b) = (ep(1, 2), ep(2, 2));
    let mut src = pattern(4096, 1);
    let mut dst = HostBuffer::filled(4096, 0x5A);
    let s = src.to_vec().unwrap();
    let rs = a.register(RegionId(0), src.desc()).await.unwrap();
    let d = dst.desc();
    let _rd = b.register(RegionId(0), d.clone()).await.unwrap();
    assert!(matches!(a.register(RegionId(0), src.desc()).await, Err(BackendError::RegionInUse { .. })));
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    let good = WriteOp::contiguous(RegionId(0), 0, RegionId(0), 0, 1024);
    let cases = [
        (WriteOp::contiguous(RegionId(0), 0, RegionId(0), 4000, 200), "out of bounds"),
        (WriteOp::contiguous(RegionId(0), 4000, RegionId(0), 0, 200), "out of bounds"),
        (
            WriteOp {
                count: 5,
                src_stride: 16,
                dst_stride: 1024,
                ..WriteOp::contiguous(RegionId(0), 0, RegionId(0), 0, 8)
            },
            "out of bounds",
        ),
        (WriteOp::contiguous(RegionId(0), 0, RegionId(9), 0, 8), "not registered"),
        (WriteOp::contiguous(RegionId(9), 0, RegionId(0), 0, 8), "not registered"),
        (WriteOp::contiguous(RegionId(0), 0, RegionId(0), 512, 1024), "overlapping"),
    ];
    for (bad, what) in cases {
        let e = a.post(peer, &[good, bad], None).unwrap_err();
        assert!(e.to_string().contains(what), "{e}");
    }
    // Over the ops-per-post limit: refused before anything is looked at.
    let many = vec![good; kvxfer_tcp::MAX_OPS_PER_POST as usize + 1];
    assert!(matches!(a.post(peer, &many, None), Err(BackendError::Limit { .. })));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(view(&d), vec![0x5A; 4096], "a rejected batch moved bytes");
    rs.close(deadline(5)).await.unwrap();
    let e = a.post(peer, &[good], None).unwrap_err();
    assert!(matches!(e, BackendError::UnknownRegion { region: RegionId(0), peer: None, .. }), "{e}");
    // The link still works after rejected batches.
    let _rs = a.register(RegionId(0), src.desc()).await.unwrap();
    write(&a, peer, &[good], None).await.unwrap();
    assert_eq!(&view(&d)[..1024], &s[..1024]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_of_another_backend_or_version_is_rejected() {
    let a = ep(1, 1);
    let b = ep(2, 1);
    let mut m = b.metadata().unwrap();
    m.backend = "ucx".into();
    assert!(a.connect(&m).await.unwrap_err().to_string().contains("unusable peer metadata"));
    let mut m = b.metadata().unwrap();
    m.version = 99;
    assert!(a.connect(&m).await.is_err());
    let mut m = b.metadata().unwrap();
    m.identity = 77;
    assert!(a.connect(&m).await.unwrap_err().to_string().contains("stale metadata"));
    let m = EndpointMetadata { payload: b"{}".to_vec(), ..b.metadata().unwrap() };
    assert!(a.connect(&m).await.is_err());
}

// ----- hostile peers -------------------------------------------------------------------------

/// Opens a raw stream to `meta` with `token`; returns it and whether the handshake was accepted.
async fn raw(meta: &EndpointMetadata, token: [u8; 16]) -> (TcpStream, bool) {
    let m = TcpMetadata::from_envelope(meta).unwrap();
    let mut s = TcpStream::connect(&m.addr).await.unwrap();
    static LINK: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(100);
    let link = LINK.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut challenge = [0u8; wire::CHALLENGE_LEN];
    s.read_exact(&mut challenge).await.unwrap();
    assert!(!wire::Challenge::decode(&challenge).unwrap().secret);
    let h = Hello {
        kind: StreamKind::Data,
        index: 0,
        token,
        link,
        identity: 0xbad,
        streams: 1,
        nonce: [1; wire::NONCE_BYTES],
        instance: 0xbad,
        proof: None,
    };
    s.write_all(&h.encode()).await.unwrap();
    let mut rep = [0u8; wire::HELLO_REPLY_LEN];
    s.read_exact(&mut rep).await.unwrap();
    let head = wire::decode_hello_reply(&rep).unwrap();
    let mut reason = vec![0u8; head.reason_len as usize];
    s.read_exact(&mut reason).await.unwrap();
    (s, !head.rejected)
}

/// Reads what the endpoint answers until it closes: the ERROR message, if any.
async fn answer(s: &mut TcpStream) -> Option<String> {
    let mut hb = [0u8; wire::HEADER_LEN];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut hb)).await.expect("answer in time").ok()?;
    let h = Header::decode(&hb).unwrap();
    assert_eq!(h.ty, FrameType::Error);
    let mut msg = vec![0u8; h.n as usize];
    s.read_exact(&mut msg).await.unwrap();
    // Then the stream is closed.
    let mut rest = [0u8; 1];
    assert_eq!(tokio::time::timeout(Duration::from_secs(5), s.read(&mut rest)).await.unwrap().unwrap_or(0), 0);
    Some(String::from_utf8(msg).unwrap())
}

fn write_frame(ops: &[OpDesc], payload_len: u64, payload: &[u8]) -> Vec<u8> {
    let mut h = Header::new(FrameType::Write, 1);
    h.n = ops.len() as u32;
    h.payload = payload_len;
    h.flags = wire::FLAG_LAST;
    let mut v = h.encode().to_vec();
    for o in ops {
        o.encode_into(&mut v);
    }
    v.extend_from_slice(payload);
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_clients_cannot_write_and_nothing_changes() {
    let b = ep(2, 1);
    let mut dst = HostBuffer::filled(4096, 0x5A);
    let d = dst.desc();
    let _rd = b.register(RegionId(0), d.clone()).await.unwrap();
    let meta = b.metadata().unwrap();
    let token = TcpMetadata::from_envelope(&meta).unwrap().token_bytes().unwrap();

    // Wrong token: rejected at the handshake.
    let mut bad = token;
    bad[0] ^= 1;
    let (mut s, ok) = raw(&meta, bad).await;
    assert!(!ok, "a wrong token was accepted");
    let _ = s
        .write_all(&write_frame(&[OpDesc { region: RegionId(0), offset: 0, len: 4, count: 1, stride: 4 }], 4, &[1; 4]))
        .await;

    let op = |offset, len, count, stride| OpDesc { region: RegionId(0), offset, len, count, stride };
    let mut raw_frames: Vec<(&str, Vec<u8>)> = vec![
        ("out of bounds", write_frame(&[op(4090, 8, 1, 8)], 8, &[1; 8])),
        ("out of bounds", write_frame(&[op(0, 8, 2, 4090)], 16, &[1; 16])),
        ("out of bounds", write_frame(&[op(u64::MAX - 3, 8, 1, 8)], 8, &[1; 8])),
        ("not registered", write_frame(&[op(0, 8, 1, 8)].map(|o| OpDesc { region: RegionId(3), ..o }), 8, &[1; 8])),
        ("payload", write_frame(&[op(0, 8, 1, 8)], 9, &[1; 9])),
        ("overlap", write_frame(&[op(0, 8, 1, 8), op(4, 8, 1, 8)], 16, &[1; 16])),
        ("op descriptors", {
            let mut h = Header::new(FrameType::Write, 1);
            h.n = wire::MAX_OPS + 1;
            h.encode().to_vec()
        }),
        ("magic", vec![0xFF; 64]),
        ("frame type", {
            let mut v = Header::new(FrameType::Bye, 0).encode().to_vec();
            v[0] = 0x77;
            v
        }),
        ("only travel", Header::new(FrameType::Ack, 3).encode().to_vec()),
        ("pieces", write_frame(&[op(0, 1, 2048, 2); 33], 33 * 2048, &[])),
        ("DROP", {
            let mut h = Header::new(FrameType::Drop, 3);
            h.flags = 3;
            h.encode().to_vec()
        }),
        ("bad notification", {
            let mut h = Header::new(FrameType::Note, 0);
            h.n = 5;
            let mut v = h.encode().to_vec();
            v.extend_from_slice(&[0x4b, 1, 9, 9, 9]);
            v
        }),
    ];
    // A valid frame then a truncated one (the peer dies mid-frame): the first lands, the second
    // is reported as a lost peer, not written past what arrived.
    raw_frames.push(("", write_frame(&[op(0, 8, 1, 8)], 8, &[]))); // header only, payload never comes
    for (i, (what, frame)) in raw_frames.into_iter().enumerate() {
        let (mut s, ok) = raw(&meta, token).await;
        assert!(ok);
        s.write_all(&frame).await.unwrap();
        if what.is_empty() {
            drop(s); // closes mid-frame
            let e = wait_event(&b, |e| matches!(e, BackendEvent::PeerLost { .. })).await;
            assert!(matches!(e, BackendEvent::PeerLost { identity: 0xbad, .. }), "case {i}: {e:?}");
            continue;
        }
        let msg = answer(&mut s).await.unwrap_or_else(|| panic!("case {i} ({what}): no ERROR frame"));
        assert!(msg.contains(what), "case {i}: expected {what:?} in {msg:?}");
        let e = wait_event(&b, |e| matches!(e, BackendEvent::PeerLost { .. })).await;
        match e {
            BackendEvent::PeerLost { identity, reason } => {
                assert_eq!(identity, 0xbad);
                assert!(reason.contains("protocol error"), "{reason}");
            }
            _ => unreachable!(),
        }
    }
    assert_eq!(view(&d), vec![0x5A; 4096], "a rejected frame changed decode memory");

    // A well-formed frame from the same raw client does land (the checks are not over-strict).
    let (mut s, _) = raw(&meta, token).await;
    s.write_all(&write_frame(&[op(8, 4, 2, 16)], 8, &[1, 2, 3, 4, 5, 6, 7, 8])).await.unwrap();
    let mut hb = [0u8; wire::HEADER_LEN];
    s.read_exact(&mut hb).await.unwrap();
    assert_eq!(Header::decode(&hb).unwrap().ty, FrameType::Ack);
    let got = view(&d);
    assert_eq!(&got[8..12], &[1, 2, 3, 4]);
    assert_eq!(&got[24..28], &[5, 6, 7, 8]);
    assert_eq!(got.iter().filter(|x| **x != 0x5A).count(), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_garbage_handshake_is_rejected() {
    let b = ep(2, 1);
    let m = TcpMetadata::from_envelope(&b.metadata().unwrap()).unwrap();
    let mut s = TcpStream::connect(&m.addr).await.unwrap();
    let mut challenge = [0u8; wire::CHALLENGE_LEN];
    s.read_exact(&mut challenge).await.unwrap();
    s.write_all(&[0x47; wire::HELLO_LEN]).await.unwrap();
    let mut rep = [0u8; wire::HELLO_REPLY_LEN];
    s.read_exact(&mut rep).await.unwrap();
    assert!(wire::decode_hello_reply(&rep).unwrap().rejected);
}

// ----- peer loss ----------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_receiver_fails_the_sender_with_peer_and_cause() {
    let (a, b) = (ep(1, 2), ep(2, 2));
    let mut src = pattern(1 << 16, 1);
    let mut dst = HostBuffer::zeroed(1 << 16);
    let _rs = a.register(RegionId(0), src.desc()).await.unwrap();
    let _rd = b.register(RegionId(0), dst.desc()).await.unwrap();
    let meta = b.metadata().unwrap();
    let addr = TcpMetadata::from_envelope(&meta).unwrap().addr;
    let peer = a.connect(&meta).await.unwrap();
    write(&a, peer, &[WriteOp::contiguous(RegionId(0), 0, RegionId(0), 0, 1024)], None).await.unwrap();
    drop(b);
    let started = Instant::now();
    let mut err = None;
    while started.elapsed() < Duration::from_secs(5) {
        match write(&a, peer, &[WriteOp::contiguous(RegionId(0), 0, RegionId(0), 0, 1024)], None).await {
            Ok(()) => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(e) => {
                err = Some(e);
                break;
            }
        }
    }
    let e = err.expect("writes to a dropped peer kept succeeding").to_string();
    assert!(e.contains(&addr) && e.contains("lost"), "{e}");
    // The sender's own event queue reports the lost receiver too (without having to write).
    let ev = wait_event(&a, |e| matches!(e, BackendEvent::PeerLost { .. })).await;
    assert!(matches!(ev, BackendEvent::PeerLost { identity: 2, .. }), "{ev:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_sender_reports_peer_lost_with_its_identity_and_disconnect_does_not() {
    let (a, b) = (ep(0x10_0003, 2), ep(2, 2));
    let mut src = pattern(1 << 20, 1);
    let mut dst = HostBuffer::zeroed(1 << 20);
    let _rs = a.register(RegionId(0), src.desc()).await.unwrap();
    let _rd = b.register(RegionId(0), dst.desc()).await.unwrap();
    let meta = b.metadata().unwrap();
    // A graceful disconnect is not a loss, and it resolves after every transfer to the peer is final.
    let p = a.connect(&meta).await.unwrap();
    write(&a, p, &[WriteOp::contiguous(RegionId(0), 0, RegionId(0), 0, 8)], None).await.unwrap();
    let pending: Vec<_> = (0..4u64)
        .map(|k| a.post(p, &[WriteOp::contiguous(RegionId(0), 0, RegionId(0), k << 18, 1 << 18)], None).unwrap())
        .collect();
    a.disconnect(p).await.unwrap();
    for t in &pending {
        assert_eq!(t.status(), TransferStatus::Done, "disconnect left a transfer unfinished");
    }
    assert!(a.post(p, &[], None).unwrap_err().to_string().contains("unknown peer"));
    let evs = b.recv(Duration::from_millis(300)).await.unwrap();
    assert!(evs.is_empty(), "graceful disconnect produced {evs:?}");
    // Dropping the sending endpoint is.
    let _p = a.connect(&meta).await.unwrap();
    drop(a);
    let e = wait_event(&b, |e| matches!(e, BackendEvent::PeerLost { .. })).await;
    assert!(matches!(e, BackendEvent::PeerLost { identity: 0x10_0003, .. }), "{e:?}");
}

// ----- memory lifetime and abort --------------------------------------------------------------

/// A raw WRITE frame's header and descriptors (the payload is sent separately).
fn frame_head(ops: &[OpDesc], payload: u64) -> Vec<u8> {
    write_frame(ops, payload, &[])
}

/// Reads one frame header from a raw stream.
async fn next_frame(s: &mut TcpStream) -> Header {
    let mut hb = [0u8; wire::HEADER_LEN];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut hb)).await.expect("an answer in time").unwrap();
    Header::decode(&hb).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_a_registration_waits_for_the_frame_in_progress_and_nothing_changes_after() {
    let b = ep(2, 1);
    let mut dst = HostBuffer::filled(8192, 0x5A);
    let reg = b.register(RegionId(0), dst.desc()).await.unwrap();
    let meta = b.metadata().unwrap();
    let token = TcpMetadata::from_envelope(&meta).unwrap().token_bytes().unwrap();
    let (mut s, ok) = raw(&meta, token).await;
    assert!(ok);
    let payload = pattern_vec(4096, 9);
    let op = OpDesc { region: RegionId(0), offset: 1024, len: 4096, count: 1, stride: 4096 };
    s.write_all(&frame_head(&[op], 4096)).await.unwrap();
    s.write_all(&payload[..1000]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The frame holds the region: the close waits for it.
    let close = tokio::spawn(reg.close(deadline(10)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!close.is_finished(), "close resolved while a frame was being received into the region");
    s.write_all(&payload[1000..]).await.unwrap();
    close.await.unwrap().unwrap();
    assert_eq!(next_frame(&mut s).await.ty, FrameType::Ack);
    // Closed: the backend holds no descriptor any more, and the frame landed whole.
    let got = dst.to_vec().expect("the backend let go of the memory");
    assert_eq!(&got[1024..5120], &payload[..]);
    assert!(got[..1024].iter().chain(&got[5120..]).all(|x| *x == 0x5A));
    // A frame into the closed region is refused, nothing written, and nothing changes later.
    s.write_all(&write_frame(&[OpDesc { offset: 0, ..op }], 4096, &[7; 4096])).await.unwrap();
    let msg = answer(&mut s).await.expect("an ERROR frame");
    assert!(msg.contains("not registered"), "{msg}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(dst.to_vec().unwrap(), got, "a byte changed after the close resolved");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_frames_on_two_streams_are_refused() {
    let b = ep(2, 1);
    let mut dst = HostBuffer::filled(16384, 0x5A);
    let d = dst.desc();
    let _rd = b.register(RegionId(0), d.clone()).await.unwrap();
    let meta = b.metadata().unwrap();
    let token = TcpMetadata::from_envelope(&meta).unwrap().token_bytes().unwrap();
    let op = |offset, len| OpDesc { region: RegionId(0), offset, len, count: 1, stride: len };
    // Stream 1: a frame into [0, 4096), payload only partly sent: its guard is held.
    let (mut s1, _) = raw(&meta, token).await;
    let first = pattern_vec(4096, 1);
    s1.write_all(&frame_head(&[op(0, 4096)], 4096)).await.unwrap();
    s1.write_all(&first[..100]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Stream 2: a frame into [1024, 2048) overlaps it: refused as a protocol error, nothing written.
    let (mut s2, _) = raw(&meta, token).await;
    s2.write_all(&write_frame(&[op(1024, 1024)], 1024, &[0xC3; 1024])).await.unwrap();
    let msg = answer(&mut s2).await.expect("an ERROR frame");
    assert!(msg.contains("overlap"), "{msg}");
    // A strided frame interleaving with nothing in flight on a third stream is fine.
    let (mut s3, _) = raw(&meta, token).await;
    let strided = OpDesc { region: RegionId(0), offset: 8192, len: 16, count: 4, stride: 64 };
    s3.write_all(&write_frame(&[strided], 64, &[0x11; 64])).await.unwrap();
    assert_eq!(next_frame(&mut s3).await.ty, FrameType::Ack);
    // The first frame completes and lands whole.
    s1.write_all(&first[100..]).await.unwrap();
    assert_eq!(next_frame(&mut s1).await.ty, FrameType::Ack);
    let got = view(&d);
    assert_eq!(&got[..4096], &first[..], "the refused frame wrote into the first one's range");
    assert_eq!(got[8192..8448].iter().filter(|x| **x == 0x11).count(), 64);
    assert!(got[4096..8192].iter().all(|x| *x == 0x5A));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_mid_transfer_then_reuse_the_destination() {
    const TOTAL: usize = 64 << 20;
    const BLOCK: usize = 16 << 10;
    let blocks = (TOTAL / BLOCK) as u64;
    let (a, b) = (ep(1, 2), ep(2, 1));
    let mut one = pattern(TOTAL, 4);
    let mut two = pattern(TOTAL, 5);
    let second = two.to_vec().unwrap();
    let mut dst = HostBuffer::filled(TOTAL, 0x5A);
    let _r1 = a.register(RegionId(1), one.desc()).await.unwrap();
    let _r2 = a.register(RegionId(2), two.desc()).await.unwrap();
    let d = dst.desc();
    let rd = b.register(RegionId(3), d.clone()).await.unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    let ops = |src: u32| -> Vec<WriteOp> {
        (0..blocks)
            .map(|k| {
                let to = (k * 7 + 3) % blocks;
                WriteOp::contiguous(RegionId(src), k * BLOCK as u64, RegionId(3), to * BLOCK as u64, BLOCK as u64)
            })
            .collect()
    };
    // The aborted transfer carries an attached notification: it must never be delivered.
    let t = a.post(peer, &ops(1), Some(&note(40, 0))).unwrap();
    let status = t.abort(deadline(10)).await.unwrap();
    assert!(matches!(status, TransferStatus::Aborted | TransferStatus::Done), "{status:?}");
    assert_eq!(t.status(), status);
    assert!(t.wait(deadline(1)).await.is_err() || status == TransferStatus::Done);
    // Fenced: no write is under way and nothing changes over a pause.
    let snap = view(&d);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(view(&d) == snap, "a byte of the aborted transfer landed after its abort resolved");
    // Reuse the pages at once with another pattern; its notification is the only one delivered.
    a.post(peer, &ops(2), Some(&note(41, 0))).unwrap().wait(deadline(30)).await.unwrap();
    let e = wait_event(&b, |e| matches!(e, BackendEvent::Notification(_))).await;
    if status == TransferStatus::Aborted {
        assert_eq!(e, BackendEvent::Notification(note(41, 0)), "the aborted transfer's notification was delivered");
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(d);
    rd.close(deadline(10)).await.unwrap();
    let got = dst.to_vec().unwrap();
    for k in 0..blocks as usize {
        let to = (k * 7 + 3) % blocks as usize;
        assert!(
            got[to * BLOCK..(to + 1) * BLOCK] == second[k * BLOCK..(k + 1) * BLOCK],
            "block {k} is not the second transfer's"
        );
    }
    // Later transfers on the link still deliver their notifications (the aborted batch left no books).
    let _rd = b.register(RegionId(4), HostBuffer::zeroed(16).desc()).await.unwrap();
    write(&a, peer, &[], Some(&note(42, 0))).await.unwrap();
    let e = wait_event(&b, |e| matches!(e, BackendEvent::Notification(_))).await;
    assert_eq!(e, BackendEvent::Notification(note(42, 0)));
}

/// Throughput over loopback (run with `--ignored --nocapture`): contiguous 1 MiB ops and strided
/// 256-byte ranges (a per-token head slice), through posts of 1024 ops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, not a check"]
async fn throughput() {
    const LEN: usize = 256 << 20;
    let (a, b) = (ep(1, 2), ep(2, 2));
    let mut src = pattern(LEN, 1);
    let mut dst = HostBuffer::zeroed(LEN);
    let _rs = a.register(RegionId(0), src.desc()).await.unwrap();
    let _rd = b.register(RegionId(0), dst.desc()).await.unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    let contiguous: Vec<WriteOp> =
        (0..256u64).map(|k| WriteOp::contiguous(RegionId(0), k << 20, RegionId(0), (255 - k) << 20, 1 << 20)).collect();
    let strided: Vec<WriteOp> = (0..2048u64)
        .map(|k| WriteOp {
            src: RegionId(0),
            src_offset: (k * 128) << 10,
            dst: RegionId(0),
            dst_offset: ((2047 - k) * 128) << 10,
            len: 256,
            count: 256,
            src_stride: 512,
            dst_stride: 512,
        })
        .collect();
    for (what, ops) in [("contiguous 1 MiB", &contiguous), ("strided 256 B", &strided)] {
        let bytes: u64 = ops.iter().map(WriteOp::bytes).sum();
        write(&a, peer, ops, None).await.unwrap();
        let t = Instant::now();
        for _ in 0..4 {
            for c in ops.chunks(1024) {
                write(&a, peer, c, None).await.unwrap();
            }
        }
        let s = t.elapsed().as_secs_f64();
        println!("{what}: {:.2} GB/s", 4.0 * bytes as f64 / s / 1e9);
    }
}
