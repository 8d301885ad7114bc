//! Fuzz entry points of the ibverbs backend's decoders (target `verbs_wire` and its part of
//! `endpoint_metadata` in `fuzz/`).
//!
//! Shared by the libFuzzer targets (nightly) and the stable replay and proptest tests
//! (`backends/verbs/tests/fuzz_corpus.rs`). Each entry point takes arbitrary bytes, must never panic
//! on them, and panics only when a property of the wire format is broken; each returns whether the
//! input was accepted. Not part of the API.

use std::io::Cursor;
use std::time::Instant;

use kvxfer_core::secret::NONCE_BYTES;
use kvxfer_core::toolkit::{Fragmenter, Reassembler};
use kvxfer_core::{EndpointMetadata, Notification, RequestId, Secret, SenderKey};

use crate::ring::{self, Imm, RingRx, RingTx};
use crate::wire::{Address, Challenge, Frame, Hello, Open, RemoteRegion, PROTO_VERSION};
use crate::NAME;

/// Mode byte of a [`wire`] input: the rest is a side-channel byte stream.
pub const MODE_SIDE_CHANNEL: u8 = 0;
/// Mode byte of a [`wire`] input: the rest is a ring geometry and its completions.
pub const MODE_RING: u8 = 1;

/// Reassembler bounds of the endpoint (`peers.rs`).
const MAX_PENDING_NOTIFICATIONS: usize = 64;

/// `verbs_wire`: the first byte chooses what the rest is. [`MODE_SIDE_CHANNEL`] (even): the bytes of
/// the TCP side channel, read as the endpoint reads them ([`Frame::read_from`] during the handshake,
/// [`crate::wire::take_frame`] afterwards); every frame re-encodes to the same bytes (a hello to the same
/// value), a hello is validated for both link layers and its ring geometry used, credits applied,
/// and the authentication exchange checked as the endpoint checks it (a challenge's proof against
/// the open before it, an auth's against both, with a fixed secret; the seeds carry valid proofs).
/// [`MODE_RING`] (odd): `u16` slots, `u16` slot size, then records of `u32` immediate, `u32` byte
/// length and that many bytes (up to the slot size): write-with-immediate completions checked by
/// [`RingRx::accept`], their fragments reassembled into notifications.
pub fn wire(data: &[u8]) -> bool {
    let Some((&mode, rest)) = data.split_first() else { return false };
    if mode & 1 == MODE_SIDE_CHANNEL {
        side_channel(rest)
    } else {
        ring_completions(rest)
    }
}

/// The secret the seeds' proofs are made with.
fn fuzz_secret() -> Secret {
    Secret::new(b"fuzz seed secret".to_vec()).expect("non-empty")
}

/// The authentication exchange seen so far on one stream (what the endpoint keeps while it checks).
#[derive(Default)]
struct Auth {
    open: Option<Open>,
    challenge: Option<Challenge>,
    /// A proof that did not verify (the endpoint would refuse the connection).
    refused: bool,
}

impl Auth {
    fn see(&mut self, f: &Frame, secret: &Secret) {
        match f {
            Frame::Open(o) => *self = Auth { open: Some(o.clone()), challenge: None, refused: false },
            Frame::Challenge(c) => {
                if let (Some(o), Some(p)) = (&self.open, &c.proof) {
                    self.refused |= !crate::wire::exchange(o, c).verify_acceptor(secret, p);
                }
                self.challenge = Some(c.clone());
            }
            Frame::Auth(Some(p)) => {
                if let (Some(o), Some(c)) = (&self.open, &self.challenge) {
                    let x = crate::wire::exchange(o, c);
                    let ok = x.verify_connector(secret, p);
                    assert!(!(ok && x.verify_acceptor(secret, p)), "a proof verified in both directions");
                    self.refused |= !ok;
                }
            }
            _ => {}
        }
    }
}

fn frame(f: &Frame, raw: &[u8]) {
    let enc = f.encode();
    match f {
        Frame::Hello(h) => {
            assert_eq!(Frame::decode(&enc[4..]).as_ref(), Ok(f), "hello does not round-trip");
            for link_layer in [1, 2] {
                if h.validate(link_layer).is_ok() {
                    let mut tx = RingTx::new(h.ring_slots, h.slot_size);
                    while let Some(g) = tx.grant(h.slot_size as usize) {
                        assert!(g.offset + u64::from(h.slot_size) <= h.ring.len);
                        assert_eq!(Imm::decode(g.imm).map(|i| u32::from(i.len)), Some(h.slot_size));
                        if tx.free() == 0 || g.slot > 64 {
                            break;
                        }
                    }
                }
            }
        }
        Frame::Credit(n) => {
            let mut tx = RingTx::new(4, 64);
            for _ in 0..4 {
                tx.grant(64).expect("free slot");
            }
            let _ = tx.credit(*n);
            assert_eq!(enc, raw);
        }
        _ => assert_eq!(enc, raw, "frame re-encodes to other bytes"),
    }
}

fn side_channel(stream: &[u8]) -> bool {
    // During the handshake: blocking reads of whole frames.
    let secret = fuzz_secret();
    let mut auth = Auth::default();
    let mut r = Cursor::new(stream);
    loop {
        let at = r.position() as usize;
        match Frame::read_from(&mut r) {
            Ok(f) => {
                frame(&f, &stream[at..r.position() as usize]);
                auth.see(&f, &secret);
            }
            Err(_) => break,
        }
    }

    // Afterwards: frames taken off a buffer of what was read so far.
    let mut buf = stream.to_vec();
    loop {
        let before = buf.clone();
        match crate::wire::take_frame(&mut buf) {
            Ok(Some(f)) => frame(&f, &before[..before.len() - buf.len()]),
            Ok(None) => return buf.is_empty() && !auth.refused,
            Err(_) => return false,
        }
    }
}

fn ring_completions(data: &[u8]) -> bool {
    let Some((geometry, mut rest)) = data.split_first_chunk::<4>() else { return false };
    let slots = u32::from(u16::from_le_bytes([geometry[0], geometry[1]]));
    let slot_size = u32::from(u16::from_le_bytes([geometry[2], geometry[3]]));
    if ring::check_geometry(slots, slot_size).is_err() {
        return false;
    }
    let mut rx = RingRx::new(slots, slot_size);
    let mut reasm = Reassembler::new(ring::MAX_MESSAGE, MAX_PENDING_NOTIFICATIONS);
    let now = Instant::now();
    let mut accepted = true;
    while let Some((rec, tail)) = rest.split_first_chunk::<8>() {
        let imm = u32::from_le_bytes(rec[..4].try_into().expect("4 bytes"));
        let byte_len = u32::from_le_bytes(rec[4..].try_into().expect("4 bytes"));
        let n = (byte_len.min(slot_size) as usize).min(tail.len());
        let (bytes, tail) = tail.split_at(n);
        rest = tail;
        match rx.accept(imm, byte_len) {
            Ok(f) => {
                assert!(f.offset + f.len as u64 <= u64::from(slots) * u64::from(slot_size));
                assert_eq!(f.len as u32, byte_len);
                match reasm.push(0, &bytes[..f.len.min(bytes.len())], now) {
                    Ok(Some(m)) => accepted &= kvxfer_core::fuzzing::notification(&m),
                    Ok(None) => {}
                    Err(_) => accepted = false,
                }
            }
            Err(_) => accepted = false,
        }
        let _ = rx.credit_due();
    }
    accepted && rest.is_empty()
}

/// `endpoint_metadata` for ibverbs: [`Address::from_payload`] on the input as a JSON envelope's
/// payload (after the envelope check) and as a bare payload; whatever parses re-serializes to an
/// equal address.
pub fn metadata(data: &[u8]) -> bool {
    let mut envs = Vec::new();
    if let Ok(m) = serde_json::from_slice::<EndpointMetadata>(data) {
        envs.push(m);
    }
    envs.push(EndpointMetadata::new(NAME, 7, data.to_vec()));
    let mut accepted = false;
    for env in envs {
        if env.check(NAME).is_err() {
            continue;
        }
        if let Ok(a) = Address::from_payload(&env.payload) {
            assert_eq!(Address::from_payload(&a.to_payload()).as_ref(), Ok(&a));
            accepted = true;
        }
    }
    accepted
}

/// The seeds' open: what a connecting endpoint sends first.
fn seed_open() -> Open {
    Open {
        version: PROTO_VERSION,
        identity: 0x0001_0000_0000_0002,
        instance: 0x1111_2222_3333_4444,
        nonce: [0xc1; NONCE_BYTES],
    }
}

fn hello() -> Hello {
    Hello {
        version: PROTO_VERSION,
        identity: 0x0001_0000_0000_0002,
        qp_num: 0x11,
        psn: 0x22,
        lid: 3,
        gid: [9; 16],
        link_layer: 1,
        mtu: 5,
        ring: RemoteRegion { id: u32::MAX, addr: 0x1000, len: 64 * 4096, rkey: 77 },
        ring_slots: 64,
        slot_size: 4096,
        recv_buf: 4096,
        regions: vec![RemoteRegion { id: 1, addr: 0x7f00_0000_0000, len: 1 << 30, rkey: 5 }],
    }
}

/// Valid side-channel streams and ring completions made by the real encoders: the seed corpus of
/// `verbs_wire`.
pub fn wire_seeds() -> Vec<(String, Vec<u8>)> {
    let stream = |frames: &[Frame]| {
        let mut v = vec![MODE_SIDE_CHANNEL];
        for f in frames {
            v.extend_from_slice(&f.encode());
        }
        v
    };
    let note = Notification::chunk(RequestId(3), SenderKey::from_u64(0x0001_0000_0000_0002), 1, true)
        .encode()
        .expect("encodes");
    let (slots, slot_size) = (4u16, 64u16);
    let mut ring = vec![MODE_RING];
    ring.extend_from_slice(&slots.to_le_bytes());
    ring.extend_from_slice(&slot_size.to_le_bytes());
    let mut tx = RingTx::new(slots.into(), slot_size.into());
    for frag in Fragmenter::new(usize::from(slot_size) / 2).split(&note).expect("splits") {
        let g = tx.grant(frag.len()).expect("a slot");
        ring.extend_from_slice(&g.imm.to_le_bytes());
        ring.extend_from_slice(&(frag.len() as u32).to_le_bytes());
        ring.extend_from_slice(&frag);
    }
    let secret = fuzz_secret();
    let open = seed_open();
    let mut challenge = Challenge {
        identity: 0x8000_0000_0000_0007,
        instance: 0x5555_6666_7777_8888,
        nonce: [0xa2; NONCE_BYTES],
        proof: None,
    };
    let x = crate::wire::exchange(&open, &challenge);
    let unauthenticated = stream(&[
        Frame::Open(open.clone()),
        Frame::Challenge(challenge.clone()),
        Frame::Auth(None),
        Frame::Hello(hello()),
        Frame::Ready,
    ]);
    challenge.proof = Some(x.acceptor_proof(&secret));
    vec![
        (
            "handshake".to_owned(),
            stream(&[
                Frame::Open(open.clone()),
                Frame::Challenge(challenge.clone()),
                Frame::Auth(Some(x.connector_proof(&secret))),
                Frame::Hello(hello()),
                Frame::Ready,
            ]),
        ),
        ("handshake-no-secret".to_owned(), unauthenticated),
        (
            "auth-refused".to_owned(),
            stream(&[
                Frame::Open(open),
                Frame::Challenge(challenge),
                Frame::Reject(
                    "authentication failed: the peer did not prove this endpoint's cluster secret (the secrets \
                     differ); configure the same cluster secret (KVXFER_SECRET or a secret file) on every rank"
                        .into(),
                ),
            ]),
        ),
        (
            "session".to_owned(),
            stream(&[
                Frame::Credit(16),
                Frame::Revoke { seq: 1, region: 1 },
                Frame::RevokeAck(1),
                Frame::Bye("closing".into()),
            ]),
        ),
        ("reject".to_owned(), stream(&[Frame::Reject("link layers differ".into())])),
        ("ring".to_owned(), ring),
    ]
}

/// Valid ibverbs metadata (envelope and bare payload) made by the real encoders: seeds of
/// `endpoint_metadata`.
pub fn metadata_seeds() -> Vec<(String, Vec<u8>)> {
    let a = Address {
        version: PROTO_VERSION,
        handshake: "10.0.0.2:4791".into(),
        device: "mlx5_0".into(),
        port: 1,
        lid: 0,
        gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
        link_layer: 2,
        mtu: 3,
    };
    let env = EndpointMetadata::new(NAME, 0x0001_0000_0000_0002, a.to_payload());
    vec![
        ("verbs-envelope".to_owned(), serde_json::to_vec(&env).expect("encodes")),
        ("verbs-payload".to_owned(), a.to_payload()),
    ]
}
