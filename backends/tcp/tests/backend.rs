//! The TCP backend over real loopback sockets: data path, both notification styles, striping, and
//! the wire-safety and peer-loss cases (hostile clients, wrong token, malformed frames).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::{
    BackendConfig, BackendEvent, EndpointMetadata, HostBuffer, KvTransferBackend, Notification, RegionId, RequestId,
    SenderKey, WriteOp,
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

fn pattern(len: usize, seed: u8) -> HostBuffer {
    let b = HostBuffer::zeroed(len);
    let v: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
    b.region().write(0, &v).unwrap();
    b
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contiguous_and_strided_writes_land_exactly() {
    let (a, b) = (ep(1, 3), ep(2, 1));
    let src = pattern(1 << 20, 3);
    let dst = HostBuffer::filled(1 << 20, 0xEE);
    a.register(RegionId(0), src.region()).unwrap();
    b.register(RegionId(5), dst.region()).unwrap();
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
    a.write(peer, &ops, Some(&note(1, 0))).await.unwrap();
    let got = dst.to_vec();
    let s = src.to_vec();
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
    // Short ranges travel through staging buffers, long ones straight from/to registered memory;
    // interleave them (and cross the staging size) so every piece boundary is exercised.
    let (a, b) = (ep(1, 1), ep(2, 1));
    let src = pattern(4 << 20, 5);
    let dst = HostBuffer::filled(4 << 20, 0xEE);
    a.register(RegionId(0), src.region()).unwrap();
    b.register(RegionId(0), dst.region()).unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    let mut ops = Vec::new();
    let mut want = vec![0xEEu8; 4 << 20];
    let s = src.to_vec();
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
    a.write(peer, &ops, None).await.unwrap();
    assert!(dst.to_vec() == want, "destination differs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attached_notification_is_delivered_after_all_striped_data() {
    let (a, b) = (ep(1, 4), ep(2, 1));
    let src = pattern(8 << 20, 9);
    let dst = HostBuffer::zeroed(8 << 20);
    a.register(RegionId(0), src.region()).unwrap();
    b.register(RegionId(0), dst.region()).unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    // Many 4 KiB blocks in reverse order: every stream gets parts.
    let ops: Vec<WriteOp> = (0..2048u64)
        .map(|i| WriteOp::contiguous(RegionId(0), i * 4096, RegionId(0), (2047 - i) * 4096, 4096))
        .collect();
    let a2 = Arc::clone(&a);
    let send = tokio::spawn(async move { a2.write(peer, &ops, Some(&note(9, 0))).await });
    let e = wait_event(&b, |e| matches!(e, BackendEvent::Notification(_))).await;
    // When the notification is seen, every byte must be in place.
    let got = dst.to_vec();
    let s = src.to_vec();
    for i in 0..2048usize {
        assert_eq!(&got[(2047 - i) * 4096..(2048 - i) * 4096], &s[i * 4096..(i + 1) * 4096], "block {i}");
    }
    assert_eq!(e, BackendEvent::Notification(note(9, 0)));
    send.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_band_notifications_and_empty_writes() {
    let (a, b) = (ep(1, 2), ep(2, 2));
    let src = pattern(4096, 1);
    let dst = HostBuffer::zeroed(4096);
    a.register(RegionId(0), src.region()).unwrap();
    b.register(RegionId(0), dst.region()).unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    a.write(peer, &[WriteOp::contiguous(RegionId(0), 0, RegionId(0), 0, 4096)], None).await.unwrap();
    // write returned: remote completion, so the bytes are there before any notification.
    assert_eq!(dst.to_vec(), src.to_vec());
    a.notify(peer, &note(3, 0)).await.unwrap();
    a.notify(peer, &Notification::failure(RequestId(4), SenderKey::from_u64(7), "disk on fire")).await.unwrap();
    a.write(peer, &[], Some(&note(5, 1))).await.unwrap();
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
    let src = pattern(4096, 1);
    let dst = HostBuffer::filled(4096, 0x5A);
    a.register(RegionId(0), src.region()).unwrap();
    b.register(RegionId(0), dst.region()).unwrap();
    assert!(a.register(RegionId(0), src.region()).is_err());
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
        let e = a.write(peer, &[good, bad], None).await.unwrap_err();
        assert!(e.to_string().contains(what), "{e}");
    }
    assert_eq!(dst.to_vec(), vec![0x5A; 4096], "a rejected batch moved bytes");
    a.deregister(RegionId(0)).unwrap();
    assert!(a.deregister(RegionId(0)).is_err());
    // The link still works after rejected batches.
    a.register(RegionId(0), src.region()).unwrap();
    a.write(peer, &[good], None).await.unwrap();
    assert_eq!(&dst.to_vec()[..1024], &src.to_vec()[..1024]);
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
    let h = Hello { kind: StreamKind::Data, index: 0, token, link, identity: 0xbad, streams: 1 };
    s.write_all(&h.encode()).await.unwrap();
    let mut rep = [0u8; wire::HELLO_REPLY_LEN];
    s.read_exact(&mut rep).await.unwrap();
    let (_, rejected, len) = wire::decode_hello_reply(&rep).unwrap();
    let mut reason = vec![0u8; len as usize];
    s.read_exact(&mut reason).await.unwrap();
    (s, !rejected)
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
    let dst = HostBuffer::filled(4096, 0x5A);
    b.register(RegionId(0), dst.region()).unwrap();
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
    assert_eq!(dst.to_vec(), vec![0x5A; 4096], "a rejected frame changed decode memory");

    // A well-formed frame from the same raw client does land (the checks are not over-strict).
    let (mut s, _) = raw(&meta, token).await;
    s.write_all(&write_frame(&[op(8, 4, 2, 16)], 8, &[1, 2, 3, 4, 5, 6, 7, 8])).await.unwrap();
    let mut hb = [0u8; wire::HEADER_LEN];
    s.read_exact(&mut hb).await.unwrap();
    assert_eq!(Header::decode(&hb).unwrap().ty, FrameType::Ack);
    let got = dst.to_vec();
    assert_eq!(&got[8..12], &[1, 2, 3, 4]);
    assert_eq!(&got[24..28], &[5, 6, 7, 8]);
    assert_eq!(got.iter().filter(|x| **x != 0x5A).count(), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_garbage_handshake_is_rejected() {
    let b = ep(2, 1);
    let m = TcpMetadata::from_envelope(&b.metadata().unwrap()).unwrap();
    let mut s = TcpStream::connect(&m.addr).await.unwrap();
    s.write_all(&[0x47; wire::HELLO_LEN]).await.unwrap();
    let mut rep = [0u8; wire::HELLO_REPLY_LEN];
    s.read_exact(&mut rep).await.unwrap();
    let (_, rejected, _) = wire::decode_hello_reply(&rep).unwrap();
    assert!(rejected);
}

// ----- peer loss ----------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_receiver_fails_the_sender_with_peer_and_cause() {
    let (a, b) = (ep(1, 2), ep(2, 2));
    let src = pattern(1 << 16, 1);
    let dst = HostBuffer::zeroed(1 << 16);
    a.register(RegionId(0), src.region()).unwrap();
    b.register(RegionId(0), dst.region()).unwrap();
    let meta = b.metadata().unwrap();
    let addr = TcpMetadata::from_envelope(&meta).unwrap().addr;
    let peer = a.connect(&meta).await.unwrap();
    a.write(peer, &[WriteOp::contiguous(RegionId(0), 0, RegionId(0), 0, 1024)], None).await.unwrap();
    drop(b);
    let started = Instant::now();
    let mut err = None;
    while started.elapsed() < Duration::from_secs(5) {
        match a.write(peer, &[WriteOp::contiguous(RegionId(0), 0, RegionId(0), 0, 1024)], None).await {
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
    let src = pattern(4096, 1);
    let dst = HostBuffer::zeroed(4096);
    a.register(RegionId(0), src.region()).unwrap();
    b.register(RegionId(0), dst.region()).unwrap();
    let meta = b.metadata().unwrap();
    // A graceful disconnect is not a loss.
    let p = a.connect(&meta).await.unwrap();
    a.write(p, &[WriteOp::contiguous(RegionId(0), 0, RegionId(0), 0, 8)], None).await.unwrap();
    a.disconnect(p).await.unwrap();
    assert!(a.write(p, &[], None).await.unwrap_err().to_string().contains("unknown peer"));
    let evs = b.recv(Duration::from_millis(300)).await.unwrap();
    assert!(evs.is_empty(), "graceful disconnect produced {evs:?}");
    // Dropping the sending endpoint is.
    let _p = a.connect(&meta).await.unwrap();
    drop(a);
    let e = wait_event(&b, |e| matches!(e, BackendEvent::PeerLost { .. })).await;
    assert!(matches!(e, BackendEvent::PeerLost { identity: 0x10_0003, .. }), "{e:?}");
}
