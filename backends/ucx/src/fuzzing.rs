//! Fuzz entry points of the UCX backend's decoders (target `ucx_wire` and its part of
//! `endpoint_metadata` in `fuzz/`).
//!
//! Shared by the libFuzzer targets (nightly) and the stable replay and proptest tests
//! (`backends/ucx/tests/fuzz_corpus.rs`). Each entry point takes arbitrary bytes, must never panic on
//! them, and panics only when a property of the wire format is broken; each returns whether the
//! input was accepted. The message entry point parses an active message the way the progress
//! thread's `on_message` does (`progress.rs`), without a UCX worker. Not part of the API.

use std::cell::RefCell;

use kvxfer_core::toolkit::RegionTable;
use kvxfer_core::{EndpointMetadata, HostBuffer, Notification, RegionId, RequestId, SenderKey};

use crate::liveness::ProcId;
use crate::wire::{self, DataMsg, Header, Hello, Kind, Payload, RegionMeta, COMMIT_ABORTED, GOODBYE_SHUTDOWN};
use crate::NAME;

/// Regions the fuzzed receiver has registered for the active-message data path: `(id, bytes)`.
pub const REGIONS: [(u32, usize); 2] = [(1, 64 << 10), (2, 4096)];

thread_local! {
    static RECEIVER: RefCell<Option<RegionTable>> = const { RefCell::new(None) };
}

/// Places one data message's segments as `on_data` does: every segment checked against the region
/// registered now through a write guard, refused (not placed) otherwise.
fn place(segs: &[(u32, u64, &[u8])]) -> bool {
    RECEIVER.with(|r| {
        let mut r = r.borrow_mut();
        let regions = r.get_or_insert_with(|| {
            let t = RegionTable::new(NAME, 64);
            for (id, len) in REGIONS {
                t.insert(RegionId(id), HostBuffer::zeroed(len).desc()).expect("fresh region");
            }
            t
        });
        for (region, off, bytes) in segs {
            let Ok(r) = regions.get(RegionId(*region), None) else { return false };
            let Ok(mut g) = r.desc().write_guard(*off, bytes.len() as u64) else { return false };
            g.as_mut_slice().copy_from_slice(bytes);
        }
        true
    })
}

/// Splits a fuzz input into an active message's header and data: the first byte is the header's
/// length (UCX delivers the two separately).
pub fn split(data: &[u8]) -> (&[u8], &[u8]) {
    let Some((&n, rest)) = data.split_first() else { return (&[], &[]) };
    rest.split_at(usize::from(n).min(rest.len()))
}

/// Joins a header and data into a fuzz input (the inverse of [`split`]).
pub fn join(header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut v = vec![header.len() as u8];
    v.extend_from_slice(header);
    v.extend_from_slice(data);
    v
}

/// `ucx_wire`: one active message ([`split`]), parsed as `on_message` parses it: the header
/// ([`Header::decode`], re-encoding to the same bytes), then by kind: notifications
/// ([`Notification::decode`]), the JSON hello and its hex worker address, the welcome's region ids,
/// data messages ([`wire::decode_data`], re-encoding to the same bytes, placed through write guards),
/// commits, acknowledgements, revokes and their acknowledgements, and the authentication exchange's
/// challenge, auth and refusal (each re-encoding to the same bytes).
pub fn message(data: &[u8]) -> bool {
    let (header, body) = split(data);
    let Ok(h) = Header::decode(header) else { return false };
    assert_eq!(h.encode(), header, "active-message header re-encodes to other bytes");
    match h.kind {
        Kind::Attached | Kind::OutOfBand => kvxfer_core::fuzzing::notification(body),
        Kind::Hello => {
            let Ok(hello) = serde_json::from_slice::<Hello>(body) else { return false };
            let again: Hello = serde_json::from_slice(&serde_json::to_vec(&hello).expect("encodes")).expect("parses");
            assert_eq!(again, hello);
            hex_round_trips(&hello.worker) && (hello.challenge.is_empty() || hex_round_trips(&hello.challenge))
        }
        Kind::Challenge => match wire::decode_challenge(body) {
            Ok((nonce, theirs, proof)) => {
                assert_eq!(wire::encode_challenge(nonce, &theirs, &proof), body, "challenge re-encodes to other bytes");
                true
            }
            Err(_) => false,
        },
        Kind::Auth => match wire::decode_auth(body) {
            Ok((nonce, proof)) => {
                assert_eq!(wire::encode_auth(nonce, &proof), body, "auth message re-encodes to other bytes");
                true
            }
            Err(_) => false,
        },
        Kind::Refused => match wire::decode_refused(body) {
            Ok((nonce, reason)) => {
                assert_eq!(wire::encode_refused(nonce, reason), body, "refusal re-encodes to other bytes");
                true
            }
            Err(_) => false,
        },
        Kind::Welcome => match wire::u64_at(body, 0) {
            Some(_nonce) => {
                let ids: Vec<u32> =
                    body[8..].chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
                ids.len() * 4 == body.len() - 8
            }
            None => false,
        },
        Kind::Data => {
            let Ok((seq, segs)) = wire::decode_data(body) else { return false };
            let mut again = seq.to_le_bytes().to_vec();
            again.extend_from_slice(&(segs.len() as u32).to_le_bytes());
            for (region, off, bytes) in &segs {
                again.extend_from_slice(&region.to_le_bytes());
                again.extend_from_slice(&off.to_le_bytes());
                again.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
                again.extend_from_slice(bytes);
            }
            assert_eq!(again, body, "data message re-encodes to other bytes");
            place(&segs)
        }
        Kind::Commit => match wire::u64_at(body, 0) {
            Some(_seq) if h.flags & COMMIT_ABORTED == 0 && body.len() > 8 => {
                kvxfer_core::fuzzing::notification(&body[8..])
            }
            Some(_) => true,
            None => false,
        },
        Kind::Ack => match (wire::u64_at(body, 0), body.get(8)) {
            (Some(_seq), Some(&status)) => {
                let _ = String::from_utf8_lossy(&body[9..]);
                status <= 2
            }
            _ => false,
        },
        Kind::Revoke => wire::u64_at(body, 0).is_some() && wire::u32_at(body, 8).is_some(),
        Kind::RevokeAck => wire::u64_at(body, 0).is_some(),
        Kind::Goodbye => h.flags & !GOODBYE_SHUTDOWN == 0,
    }
}

/// Whether `s` is hex that [`wire::unhex`] reads back to bytes [`wire::hex`] writes as `s` (any case).
fn hex_round_trips(s: &str) -> bool {
    match wire::unhex(s) {
        Ok(b) => {
            assert_eq!(wire::hex(&b), s.to_ascii_lowercase(), "hex {s:?} does not round-trip");
            true
        }
        Err(_) => false,
    }
}

/// The envelope parsing of `endpoint_metadata`: `data` as the JSON envelope (it must re-serialize to
/// an equal envelope) and, wrapped in a valid envelope for this backend, as the raw payload.
fn envelopes(data: &[u8]) -> Vec<EndpointMetadata> {
    let mut out = Vec::new();
    if let Ok(m) = serde_json::from_slice::<EndpointMetadata>(data) {
        let again: EndpointMetadata =
            serde_json::from_slice(&serde_json::to_vec(&m).expect("metadata serializes")).expect("reparses");
        assert_eq!(again, m);
        out.push(m);
    }
    out.push(EndpointMetadata::new(NAME, 7, data.to_vec()));
    out
}

/// `endpoint_metadata` for UCX: what `connect` reads of a peer's metadata before calling UCX (the
/// envelope check, the JSON payload and its version, the hex worker address and remote keys).
pub fn metadata(data: &[u8]) -> bool {
    let mut accepted = false;
    for env in envelopes(data) {
        if env.check(NAME).is_err() {
            continue;
        }
        let Ok(p) = serde_json::from_slice::<Payload>(&env.payload) else { continue };
        let again: Payload = serde_json::from_slice(&serde_json::to_vec(&p).expect("encodes")).expect("parses");
        assert_eq!(again, p);
        if p.v != wire::PAYLOAD_VERSION {
            continue;
        }
        let worker = hex_round_trips(&p.worker) && !p.worker.is_empty();
        let keys = p.regions.iter().filter(|r| r.len > 0).all(|r| hex_round_trips(&r.rkey) && !r.rkey.is_empty());
        accepted |= worker && keys;
    }
    accepted
}

fn header(kind: Kind, flags: u8) -> Vec<u8> {
    Header { kind, flags, instance: 0x1111_2222_3333_4444, identity: 0x0001_0000_0000_0003 }.encode()
}

fn proc_id() -> ProcId {
    ProcId { host: "0f4c2b0e-5a4f-4e56-9d0a-3c2d1b0a9f8e".into(), pid: 4242, start: 123_456 }
}

/// Valid active messages made by the real encoders: the seed corpus of `ucx_wire`.
pub fn message_seeds() -> Vec<(String, Vec<u8>)> {
    let note = Notification::chunk(RequestId(5), SenderKey::from_u64(0x0001_0000_0000_0003), 2, true)
        .encode()
        .expect("encodes");
    let hello = Hello {
        nonce: 99,
        worker: wire::hex(&[0x10, 0x20, 0xfe, 0x01]),
        proc: proc_id(),
        challenge: wire::hex(&[0xc1; kvxfer_core::secret::NONCE_BYTES]),
        mm_seg: crate::mmseg::DEFAULT,
        am: false,
    };
    let exchange = wire::exchange(
        [0xc1; kvxfer_core::secret::NONCE_BYTES],
        [0xa2; kvxfer_core::secret::NONCE_BYTES],
        (0x0001_0000_0000_0003, 0x1111_2222_3333_4444),
        (0x8000_0000_0000_0007, 0x5555_6666_7777_8888),
    );
    let secret = kvxfer_core::Secret::new(b"fuzz seed secret".to_vec()).expect("non-empty");
    let challenge = wire::encode_challenge(99, &exchange.acceptor_nonce, &exchange.acceptor_proof(&secret));
    let auth = wire::encode_auth(99, &exchange.connector_proof(&secret));
    let refused = wire::encode_refused(99, "authentication failed: the secrets differ");
    let mut data = DataMsg::new(17);
    data.push(1, 4096, 32, |b| -> Result<(), ()> {
        b.fill(0x5a);
        Ok(())
    })
    .expect("fills");
    data.push(2, 4000, 96, |b| -> Result<(), ()> {
        b.fill(1);
        Ok(())
    })
    .expect("fills");
    let mut welcome = 99u64.to_le_bytes().to_vec();
    welcome.extend_from_slice(&1u32.to_le_bytes());
    welcome.extend_from_slice(&2u32.to_le_bytes());
    let mut commit = 17u64.to_le_bytes().to_vec();
    commit.extend_from_slice(&note);
    let mut ack = 17u64.to_le_bytes().to_vec();
    ack.push(0);
    ack.extend_from_slice(b"write into region 9 refused by the receiver");
    let mut revoke = 3u64.to_le_bytes().to_vec();
    revoke.extend_from_slice(&1u32.to_le_bytes());
    vec![
        ("attached".to_owned(), join(&header(Kind::Attached, 0), &note)),
        ("out-of-band".to_owned(), join(&header(Kind::OutOfBand, 0), &note)),
        ("hello".to_owned(), join(&header(Kind::Hello, 0), &serde_json::to_vec(&hello).expect("encodes"))),
        ("welcome".to_owned(), join(&header(Kind::Welcome, 0), &welcome)),
        ("data".to_owned(), join(&header(Kind::Data, 0), &data.finish())),
        ("commit".to_owned(), join(&header(Kind::Commit, 0), &commit)),
        ("commit-aborted".to_owned(), join(&header(Kind::Commit, COMMIT_ABORTED), &17u64.to_le_bytes())),
        ("ack".to_owned(), join(&header(Kind::Ack, 0), &ack)),
        ("revoke".to_owned(), join(&header(Kind::Revoke, 0), &revoke)),
        ("revoke-ack".to_owned(), join(&header(Kind::RevokeAck, 0), &3u64.to_le_bytes())),
        ("goodbye".to_owned(), join(&header(Kind::Goodbye, GOODBYE_SHUTDOWN), &[])),
        ("challenge".to_owned(), join(&header(Kind::Challenge, 0), &challenge)),
        ("auth".to_owned(), join(&header(Kind::Auth, 0), &auth)),
        ("refused".to_owned(), join(&header(Kind::Refused, 0), &refused)),
    ]
}

/// Valid UCX metadata (envelope and bare payload) made by the real encoders: seeds of
/// `endpoint_metadata`.
pub fn metadata_seeds() -> Vec<(String, Vec<u8>)> {
    let p = Payload {
        v: wire::PAYLOAD_VERSION,
        instance: 0x1111_2222_3333_4444,
        ucx: "1.13.1".into(),
        worker: wire::hex(&[0x80, 0x00, 0x12, 0x34, 0xab, 0xcd]),
        regions: vec![
            RegionMeta { id: 1, addr: 0x7f00_0000_0000, len: 1 << 20, rkey: wire::hex(&[1, 2, 3, 4, 5]) },
            RegionMeta { id: 2, addr: 0, len: 0, rkey: String::new() },
        ],
        proc: proc_id(),
        mm_seg: crate::mmseg::DEFAULT,
    };
    let payload = serde_json::to_vec(&p).expect("encodes");
    let env = EndpointMetadata::new(NAME, 0x0001_0000_0000_0003, payload.clone());
    vec![("ucx-envelope".to_owned(), serde_json::to_vec(&env).expect("encodes")), ("ucx-payload".to_owned(), payload)]
}
