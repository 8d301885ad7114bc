//! Fuzz entry points of the TCP backend's decoders (targets `tcp_frame`, `tcp_handshake` and, with
//! the other backends, `endpoint_metadata` of `fuzz/`).
//!
//! Shared by the libFuzzer targets (nightly) and the stable replay and proptest tests
//! (`backends/tcp/tests/fuzz_corpus.rs`). Each entry point takes arbitrary bytes, must never panic on
//! them, and panics only when a property of the wire format is broken; each returns whether the
//! input was accepted as a whole. Not part of the API.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Duration;

use kvxfer_core::toolkit::{EventQueue, RegionTable};
use kvxfer_core::{EndpointMetadata, HostBuffer, Notification, NotificationBody, RegionId, RequestId, SenderKey};

use crate::recv::{admit_write, Shared};
use crate::wire::{self, Challenge, FrameType, Header, Hello, OpDesc, StreamKind};
use crate::{TcpMetadata, NAME};

/// Regions the fuzzed receiver has registered: `(id, bytes)`.
pub const REGIONS: [(u32, usize); 2] = [(1, 64 << 10), (2, 4096)];

thread_local! {
    /// A receiver's shared state with [`REGIONS`] registered (real host memory, so the payload of an
    /// admitted WRITE is written through its guards as the receiver does).
    static RECEIVER: RefCell<Option<Shared>> = const { RefCell::new(None) };
}

fn with_receiver<T>(f: impl FnOnce(&Shared) -> T) -> T {
    RECEIVER.with(|r| {
        let mut r = r.borrow_mut();
        let shared = r.get_or_insert_with(|| {
            let regions = RegionTable::new(NAME, 64);
            for (id, len) in REGIONS {
                let mut buf = HostBuffer::zeroed(len);
                regions.insert(RegionId(id), buf.desc()).expect("fresh region");
            }
            Shared::new(1, [0; wire::TOKEN_LEN], 2, regions, Arc::new(EventQueue::new()), Duration::from_secs(1))
        });
        f(shared)
    })
}

fn take<'a>(data: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    let (head, rest) = data.split_at_checked(n)?;
    *data = rest;
    Some(head)
}

/// `tcp_frame`: `data` is what a stream carries after the handshake, read as the receiver reads it
/// (`recv.rs`): frame headers ([`Header::decode`]), WRITE op descriptors ([`OpDesc::decode`]) admitted
/// by the receiver's own `admit_write` against [`REGIONS`] (bounds, overlaps, payload length, guard
/// pieces) with the payload written through the guards, NOTE bodies ([`Notification::decode`]) and
/// ERROR messages (as the sender reads them). Whatever decodes re-encodes to the same bytes.
pub fn frames(mut data: &[u8]) -> bool {
    while !data.is_empty() {
        let Some(hb) = take(&mut data, wire::HEADER_LEN) else { return false };
        let hb: &[u8; wire::HEADER_LEN] = hb.try_into().expect("header length");
        let Ok(h) = Header::decode(hb) else { return false };
        assert_eq!(&h.encode(), hb, "frame header re-encodes to other bytes");
        match h.ty {
            FrameType::Write => {
                // The receiver allocates this before reading: bounded by the header check.
                assert!(h.n <= wire::MAX_OPS);
                let Some(descs) = take(&mut data, h.n as usize * wire::OP_LEN) else { return false };
                let Ok(ops) = descs.chunks_exact(wire::OP_LEN).map(OpDesc::decode).collect::<Result<Vec<_>, _>>()
                else {
                    return false;
                };
                let mut again = Vec::with_capacity(descs.len());
                for op in &ops {
                    op.encode_into(&mut again);
                }
                assert_eq!(again, descs, "op descriptors re-encode to other bytes");
                let placed = with_receiver(|shared| {
                    let Ok((_refs, mut guards)) = admit_write(shared, &ops, h.payload) else { return false };
                    let total: u64 = guards.iter().map(|g| g.bytes()).sum();
                    assert_eq!(total, h.payload, "admitted guards cover other than the payload");
                    for g in &mut guards {
                        for piece in g.pieces_mut() {
                            let n = piece.len().min(data.len());
                            piece[..n].copy_from_slice(&data[..n]);
                            data = &data[n..];
                        }
                    }
                    true
                });
                if !placed {
                    return false;
                }
            }
            FrameType::Note => {
                assert!(h.n <= wire::MAX_NOTE);
                let Some(body) = take(&mut data, h.n as usize) else { return false };
                if !kvxfer_core::fuzzing::notification(body) {
                    return false;
                }
            }
            FrameType::Error => {
                assert!(h.n <= wire::MAX_MESSAGE);
                let Some(msg) = take(&mut data, h.n as usize) else { return false };
                let _ = String::from_utf8_lossy(msg);
            }
            FrameType::Drop | FrameType::Bye | FrameType::Ack => {}
        }
    }
    true
}

/// The secret the handshake target proves and verifies with (the seeds are signed with it).
fn fuzz_secret() -> kvxfer_core::Secret {
    kvxfer_core::Secret::new(b"kvxfer fuzz secret".to_vec()).expect("non-empty")
}

/// The challenge the signed seeds answer.
fn seed_challenge() -> [u8; wire::CHALLENGE_LEN] {
    Challenge { identity: 42, secret: true, nonce: [0x3c; wire::NONCE_BYTES] }.encode()
}

/// `tcp_handshake`: `data` read as a CHALLENGE ([`Challenge::decode`], as the client reads it), as a
/// HELLO ([`Hello::decode`], as the server reads it, its proof verified against `seed_challenge`
/// and the fuzz secret; the signed seeds verify) and as a HELLO reply with its reason
/// ([`wire::decode_hello_reply`], as the client reads it, a proof verified the same way). Whatever
/// decodes re-encodes to the same bytes.
pub fn handshake(data: &[u8]) -> bool {
    let mut accepted = false;
    if let Some(b) = data.get(..wire::CHALLENGE_LEN) {
        let b: &[u8; wire::CHALLENGE_LEN] = b.try_into().expect("challenge length");
        if let Ok(c) = Challenge::decode(b) {
            assert_eq!(&c.encode(), b, "CHALLENGE re-encodes to other bytes");
            accepted |= data.len() == wire::CHALLENGE_LEN;
        }
    }
    if let Some(b) = data.get(..wire::HELLO_LEN) {
        let b: &[u8; wire::HELLO_LEN] = b.try_into().expect("hello length");
        if let Ok(h) = Hello::decode(b) {
            assert_eq!(&h.encode(), b, "HELLO re-encodes to other bytes");
            let verified = h.verify(&fuzz_secret(), &seed_challenge());
            assert!(!verified || h.proof.is_some(), "a HELLO without a proof verified");
            if verified {
                let again = Hello { proof: None, ..h }.sign(&fuzz_secret(), &seed_challenge());
                assert_eq!(again, h, "a verified proof is not the one signing makes");
            }
            accepted |= data.len() == wire::HELLO_LEN;
        }
    }
    if let Some(b) = data.get(..wire::HELLO_REPLY_LEN) {
        let b: &[u8; wire::HELLO_REPLY_LEN] = b.try_into().expect("reply length");
        if let Ok(head) = wire::decode_hello_reply(b) {
            assert!(head.reason_len <= wire::MAX_MESSAGE);
            assert!(!(head.rejected && head.proof.is_some()), "a rejection with a proof decoded");
            let reason = &data[wire::HELLO_REPLY_LEN..];
            let Some(reason) = reason.get(..head.reason_len as usize) else { return accepted };
            let _ = String::from_utf8_lossy(reason);
            if head.proof.is_none() {
                if let Ok(s) = std::str::from_utf8(reason) {
                    let again = wire::encode_hello_reply(head.identity, head.rejected.then_some(s));
                    assert_eq!(again, data[..wire::HELLO_REPLY_LEN + reason.len()], "reply re-encodes otherwise");
                }
            } else {
                let hello = seed_hello(StreamKind::Data, 0, 2, true);
                if wire::verify_reply(&fuzz_secret(), &seed_challenge(), &hello, b) {
                    let again = wire::encode_proved_reply(head.identity, &fuzz_secret(), &seed_challenge(), &hello);
                    assert_eq!(&again, b, "a verified reply is not the one the server makes");
                }
            }
            accepted |= data.len() == wire::HELLO_REPLY_LEN + reason.len();
        }
    }
    accepted
}

/// A HELLO of the seed corpus (signed with the fuzz secret over [`seed_challenge`] when `signed`).
fn seed_hello(kind: StreamKind, index: u8, streams: u32, signed: bool) -> [u8; wire::HELLO_LEN] {
    let h = Hello {
        kind,
        index,
        token: [0xab; wire::TOKEN_LEN],
        link: 0x1122_3344_5566_7788,
        identity: 42,
        streams,
        nonce: [0xc3; wire::NONCE_BYTES],
        instance: 0x5eed,
        proof: None,
    };
    if signed { h.sign(&fuzz_secret(), &seed_challenge()) } else { h }.encode()
}

/// The envelope and payload parsing every backend's `endpoint_metadata` entry shares: `data` as the
/// JSON envelope (as the bootstrap hands it to `connect`; it must re-serialize to an equal envelope)
/// and, wrapped in a valid envelope for `backend`, as the raw payload. Returns the envelopes to give
/// the backend's payload parser.
pub fn envelopes(data: &[u8], backend: &'static str) -> Vec<EndpointMetadata> {
    let mut out = Vec::new();
    if let Ok(m) = serde_json::from_slice::<EndpointMetadata>(data) {
        let again: EndpointMetadata =
            serde_json::from_slice(&serde_json::to_vec(&m).expect("metadata serializes")).expect("reparses");
        assert_eq!(again, m);
        for b in ["tcp", "ucx", "fabric", "verbs", "local"] {
            let _ = m.check(b);
        }
        out.push(m);
    }
    out.push(EndpointMetadata::new(backend, 7, data.to_vec()));
    out
}

/// `endpoint_metadata` for TCP: [`TcpMetadata::from_envelope`] and the token on every envelope of
/// [`envelopes`]; whatever parses re-serializes to equal metadata.
pub fn metadata(data: &[u8]) -> bool {
    let mut accepted = false;
    for env in envelopes(data, NAME) {
        let Ok(m) = TcpMetadata::from_envelope(&env) else { continue };
        let again: TcpMetadata = serde_json::from_slice(&serde_json::to_vec(&m).expect("serializes")).expect("parses");
        assert_eq!(again, m);
        if let Ok(token) = m.token_bytes() {
            assert_eq!(crate::hex(&token), m.token.to_ascii_lowercase());
            accepted = true;
        }
    }
    accepted
}

/// Valid streams of frames made by the real encoders: the seed corpus of `tcp_frame`.
pub fn frame_seeds() -> Vec<(String, Vec<u8>)> {
    let mut seeds = Vec::new();
    let write = |ops: &[OpDesc], flags: u8, batch: u64| {
        let payload: u64 = ops.iter().map(|o| o.len * o.count).sum();
        let h = Header { ty: FrameType::Write, flags, n: ops.len() as u32, batch, payload, parts: 0 };
        let mut b = h.encode().to_vec();
        for o in ops {
            o.encode_into(&mut b);
        }
        b.extend((0..payload).map(|i| i as u8));
        b
    };
    let op = |region, offset, len, count, stride| OpDesc { region: RegionId(region), offset, len, count, stride };
    seeds.push(("write".to_owned(), write(&[op(1, 0, 64, 1, 64)], wire::FLAG_LAST, 1)));
    seeds.push((
        "write-strided".to_owned(),
        write(&[op(1, 128, 16, 4, 64), op(2, 0, 32, 2, 32)], wire::FLAG_LAST | wire::FLAG_NOTE_FOLLOWS, 2),
    ));
    seeds.push(("write-region-end".to_owned(), write(&[op(2, 4000, 96, 1, 0)], 0, 3)));
    let note =
        Notification::new(RequestId(9), SenderKey::from_u64(3), NotificationBody::KvChunk { chunk: 0, last: true })
            .encode()
            .expect("encodes");
    let mut h = Header::new(FrameType::Note, 2);
    h.n = note.len() as u32;
    h.parts = 2;
    let mut b = h.encode().to_vec();
    b.extend_from_slice(&note);
    seeds.push(("note".to_owned(), b.clone()));
    let mut stream = write(&[op(1, 0, 8, 1, 8)], wire::FLAG_LAST | wire::FLAG_NOTE_FOLLOWS, 2);
    stream.extend_from_slice(&b);
    let mut drop_part = Header::new(FrameType::Drop, 4);
    drop_part.flags = wire::DROP_PART;
    stream.extend_from_slice(&drop_part.encode());
    let mut drop_note = Header::new(FrameType::Drop, 4);
    drop_note.flags = wire::DROP_NOTE;
    drop_note.parts = 1;
    stream.extend_from_slice(&drop_note.encode());
    stream.extend_from_slice(&Header::new(FrameType::Bye, 0).encode());
    seeds.push(("stream".to_owned(), stream));
    let mut ack = Header::new(FrameType::Ack, 1).encode().to_vec();
    let msg = "op 0 into region 9 is out of bounds";
    let mut err = Header::new(FrameType::Error, 0);
    err.n = msg.len() as u32;
    ack.extend_from_slice(&err.encode());
    ack.extend_from_slice(msg.as_bytes());
    seeds.push(("ack-error".to_owned(), ack));
    seeds
}

/// Valid handshakes made by the real encoders: the seed corpus of `tcp_handshake`.
pub fn handshake_seeds() -> Vec<(String, Vec<u8>)> {
    let secret = fuzz_secret();
    let signed = seed_hello(StreamKind::Data, 0, 2, true);
    vec![
        ("challenge-secret".to_owned(), seed_challenge().to_vec()),
        (
            "challenge-open".to_owned(),
            Challenge { identity: 42, secret: false, nonce: [0x5c; wire::NONCE_BYTES] }.encode().to_vec(),
        ),
        ("hello-data".to_owned(), signed.to_vec()),
        ("hello-control".to_owned(), seed_hello(StreamKind::Control, 64, 64, false).to_vec()),
        ("reply-accepted".to_owned(), wire::encode_hello_reply(42, None)),
        ("reply-proved".to_owned(), wire::encode_proved_reply(42, &secret, &seed_challenge(), &signed).to_vec()),
        ("reply-rejected".to_owned(), wire::encode_hello_reply(42, Some(&wire::AuthFailure::ProofInvalid.to_string()))),
    ]
}

/// Valid TCP metadata (envelope and bare payload) made by the real encoders: seeds of
/// `endpoint_metadata`.
pub fn metadata_seeds() -> Vec<(String, Vec<u8>)> {
    let m = TcpMetadata {
        protocol: wire::PROTOCOL_VERSION,
        addr: "127.0.0.1:40123".into(),
        token: crate::hex(&[0x5a; wire::TOKEN_LEN]),
        regions: vec![(1, 1 << 20), (7, 4096)],
        tls: false,
        instance: 0x5eed,
    };
    let payload = serde_json::to_vec(&m).expect("serializes");
    let env = EndpointMetadata::new(NAME, 0x0001_0000_0000_0002, payload.clone());
    vec![
        ("tcp-envelope".to_owned(), serde_json::to_vec(&env).expect("serializes")),
        ("tcp-payload".to_owned(), payload),
    ]
}
