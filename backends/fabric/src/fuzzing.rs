//! Fuzz entry points of the libfabric backend's decoders (target `fabric_wire` and its part of
//! `endpoint_metadata` in `fuzz/`).
//!
//! Shared by the libFuzzer targets (nightly) and the stable replay and proptest tests
//! (`backends/fabric/tests/fuzz_corpus.rs`). Each entry point takes arbitrary bytes, must never panic
//! on them, and panics only when a property of the wire format is broken; each returns whether the
//! input was accepted. The message entry point reads messages the way the progress thread's
//! `message` does (`progress.rs`), without a libfabric endpoint. Not part of the API.

use std::time::Instant;

use kvxfer_core::toolkit::{self, Fragmenter, Reassembler};
use kvxfer_core::{EndpointMetadata, Notification, NotificationBody, RequestId, SenderKey};

use crate::wire::{self, Kind, Payload, RegionMeta, Staged, WIRE_VERSION};
use crate::{MAX_NOTIFICATION, NAME};

/// The canonical form of a message that parses: bytes 2 and 3 of the header are reserved, written
/// as 0 and ignored when read.
pub fn canonical_message(frame: &[u8]) -> Vec<u8> {
    let mut c = frame.to_vec();
    if c.len() >= 4 {
        c[2..4].fill(0);
    }
    c
}

/// Splits a fuzz input into messages: each is a `u16` little-endian length and that many bytes
/// (the last one takes what is left). libfabric delivers messages whole, one per receive buffer.
pub fn split(mut data: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    while let Some((len, rest)) = data.split_first_chunk::<2>() {
        let n = usize::from(u16::from_le_bytes(*len)).min(rest.len());
        let (m, rest) = rest.split_at(n);
        out.push(m);
        data = rest;
    }
    out
}

/// Joins messages into a fuzz input (the inverse of [`split`]).
pub fn join(messages: &[Vec<u8>]) -> Vec<u8> {
    let mut v = Vec::new();
    for m in messages {
        v.extend_from_slice(&(m.len() as u16).to_le_bytes());
        v.extend_from_slice(m);
    }
    v
}

/// `fabric_wire`: a sequence of messages ([`split`]) read as the receiving endpoint reads them:
/// [`wire::parse`] (re-encoding to the canonical form, [`canonical_message`]), hello bodies
/// ([`wire::split_greeting`]), revoke bodies ([`wire::split_u32`]), the authentication exchange's
/// challenge, auth, welcome and refusal bodies, notification fragments through one [`Reassembler`] (bounded as the backend
/// bounds it) into [`Notification::decode`], staged notifications paired by [`Staged`], and the
/// peer-gone messages that drop a peer's partial notifications. Returns whether every message was
/// accepted.
pub fn messages(data: &[u8]) -> bool {
    let mut reasm = Reassembler::new(MAX_NOTIFICATION, 4096);
    let mut staged = Staged::default();
    let now = Instant::now();
    let mut accepted = true;
    for frame in split(data) {
        let Ok((h, body)) = wire::parse(frame) else {
            accepted = false;
            continue;
        };
        let again = wire::message(h.kind, h.nonce, h.dest, h.seq, body);
        assert_eq!(again, canonical_message(frame), "message re-encodes to other bytes");
        match h.kind {
            Kind::Heartbeat | Kind::RevokeAck => {}
            Kind::Hello => match wire::split_greeting(body) {
                Some((pid, conn, challenge, addr)) => assert_eq!(wire::greeting(pid, conn, &challenge, addr), body),
                None => accepted = false,
            },
            Kind::Revoke => match wire::split_u32(body) {
                Some((n, addr)) => assert_eq!(wire::hello(n, addr), body),
                None => accepted = false,
            },
            Kind::Challenge => match wire::split_challenge(body) {
                Some((nonce, proof)) => assert_eq!(wire::challenge(&nonce, &proof), body),
                None => accepted = false,
            },
            Kind::Auth => accepted &= wire::split_auth(body).is_some(),
            Kind::Welcome => match wire::split_welcome(body) {
                Some((total, first)) => assert_eq!(wire::welcome(total, &first), body),
                None => accepted = false,
            },
            Kind::Keys => match wire::split_keys(body) {
                Some(k) => assert_eq!(wire::keys(&k), body),
                None => accepted = false,
            },

            Kind::Refused => match wire::split_refusal(body) {
                Some(reason) => assert_eq!(wire::refusal(reason), body),
                None => accepted = false,
            },
            Kind::Bye | Kind::Gone => reasm.forget(u64::from(h.nonce)),
            Kind::Notify | Kind::Staged => match reasm.push(u64::from(h.nonce), body, now) {
                Ok(Some(n)) => {
                    assert!(n.len() <= MAX_NOTIFICATION);
                    let n = if h.kind == Kind::Staged {
                        // Its remote-CQ-data token arrives on its own; here, right after it.
                        assert!(staged.notification(h.seq, n).is_none());
                        staged.token(h.seq).expect("staged notification released by its token")
                    } else {
                        n
                    };
                    accepted &= kvxfer_core::fuzzing::notification(&n);
                }
                Ok(None) => {}
                Err(_) => accepted = false,
            },
        }
    }
    accepted
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

/// `endpoint_metadata` for libfabric: what `connect` reads of a peer's metadata before calling
/// libfabric (the envelope check, the JSON payload, its wire version, the address and receive buffer
/// size), and the fragmenter it then sizes from the peer's receive buffers.
pub fn metadata(data: &[u8]) -> bool {
    let mut accepted = false;
    for env in envelopes(data) {
        if env.check(NAME).is_err() {
            continue;
        }
        let Ok(p) = serde_json::from_slice::<Payload>(&env.payload) else { continue };
        let again: Payload = serde_json::from_slice(&serde_json::to_vec(&p).expect("encodes")).expect("parses");
        assert_eq!(again, p);
        let min_buf = 4 * (wire::HEADER + toolkit::FRAGMENT_HEADER);
        if p.wire != WIRE_VERSION || p.addr.is_empty() || (p.recv_buf as usize) < min_buf {
            continue;
        }
        let frag = Fragmenter::new(p.recv_buf as usize - wire::HEADER);
        assert!(frag.max_message() >= toolkit::FRAGMENT_HEADER);
        let parts = frag.split(&[7; 300]).expect("a small message splits");
        assert!(parts.iter().all(|f| f.len() + wire::HEADER <= p.recv_buf as usize));
        accepted = true;
    }
    accepted
}

/// Valid message sequences made by the real encoders: the seed corpus of `fabric_wire`.
pub fn message_seeds() -> Vec<(String, Vec<u8>)> {
    let (nonce, dest) = (0x1234_5678, 0x9abc_def0);
    let note = |body| {
        Notification::new(RequestId(11), SenderKey::from_u64(0x0001_0000_0000_0002), body).encode().expect("encodes")
    };
    let msg = |kind, seq, body: &[u8]| wire::message(kind, nonce, dest, seq, body);
    let chunk = note(NotificationBody::KvChunk { chunk: 0, last: true });
    let aux = note(NotificationBody::Aux((0..200).map(|i| i as u8).collect()));
    let whole = Fragmenter::new(4096).split(&chunk).expect("splits");
    let small = Fragmenter::new(toolkit::FRAGMENT_HEADER + 48).split(&aux).expect("splits");
    let mut fragmented: Vec<Vec<u8>> = small.iter().rev().map(|f| msg(Kind::Notify, 0, f)).collect();
    fragmented.push(msg(Kind::Heartbeat, 0x0001_0000_0000_0002, &[]));
    let hello = wire::greeting(4242, 0x0c0c_0c0c, &[0xc1; kvxfer_core::secret::NONCE_BYTES], &[0xfe; 24]);
    let exchange = wire::exchange(
        [0xc1; kvxfer_core::secret::NONCE_BYTES],
        [0xa2; kvxfer_core::secret::NONCE_BYTES],
        (2, nonce),
        (0x8000_0000_0000_0007, dest),
    );
    let secret = kvxfer_core::Secret::new(b"fuzz seed secret".to_vec()).expect("non-empty");
    let challenge = wire::challenge(&exchange.acceptor_nonce, &exchange.acceptor_proof(&secret));
    let proof = exchange.connector_proof(&secret);
    // The per-instance remote keys of a welcome and the keys that did not fit in it.
    let region_keys: Vec<wire::RegionMeta> = (0..3u32)
        .map(|i| wire::RegionMeta {
            id: i,
            len: 1 << 20,
            key: 0x00c0_ffee_0000 + u64::from(i),
            base: 0x7f00_0000_0000 + u64::from(i) * (1 << 20),
        })
        .collect();
    vec![
        ("notify".to_owned(), join(&[msg(Kind::Notify, 0, &whole[0])])),
        ("notify-fragmented".to_owned(), join(&fragmented)),
        ("staged".to_owned(), join(&[msg(Kind::Staged, 0xfeed, &whole[0])])),
        ("hello-heartbeat".to_owned(), join(&[msg(Kind::Hello, 2, &hello), msg(Kind::Heartbeat, 2, &[])])),
        (
            "revoke".to_owned(),
            join(&[msg(Kind::Revoke, 5, &wire::hello(3, &[0xfe; 24])), msg(Kind::RevokeAck, 5, &[])]),
        ),
        (
            "auth-exchange".to_owned(),
            join(&[
                msg(Kind::Challenge, 0x0c0c_0c0c, &challenge),
                msg(Kind::Auth, 0x0c0c_0c0c, &proof),
                msg(Kind::Welcome, 0x0c0c_0c0c, &[]),
            ]),
        ),
        (
            "welcome-keys".to_owned(),
            join(&[
                msg(Kind::Welcome, 0x0c0c_0c0c, &wire::welcome(3, &region_keys[..2])),
                msg(Kind::Keys, 0x0c0c_0c0c, &wire::keys(&region_keys[2..])),
            ]),
        ),
        (
            "refused".to_owned(),
            join(&[
                msg(Kind::Refused, 0x0c0c_0c0c, &wire::refusal("authentication failed: the secrets differ")),
                msg(Kind::Refused, 0, &wire::refusal("forged notification refused")),
            ]),
        ),
        (
            "bye-gone".to_owned(),
            join(&[msg(Kind::Notify, 0, &small[0]), msg(Kind::Bye, 2, &[]), msg(Kind::Gone, 2, &[])]),
        ),
    ]
}

/// Valid libfabric metadata (envelope and bare payload) made by the real encoders: seeds of
/// `endpoint_metadata`.
pub fn metadata_seeds() -> Vec<(String, Vec<u8>)> {
    let p = Payload {
        wire: WIRE_VERSION,
        provider: "tcp;ofi_rxm".into(),
        addr: vec![0x02, 0x00, 0x9c, 0x40, 127, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0],
        recv_buf: 8192,
        cq_data: true,
        nonce: 0x1234_5678,
        pid: 4242,
        regions: vec![RegionMeta { id: 1, len: 1 << 20, key: 0xdead_beef, base: 0x7f00_0000_0000 }],
    };
    let payload = serde_json::to_vec(&p).expect("encodes");
    let env = EndpointMetadata::new(NAME, 0x0001_0000_0000_0002, payload.clone());
    vec![
        ("fabric-envelope".to_owned(), serde_json::to_vec(&env).expect("encodes")),
        ("fabric-payload".to_owned(), payload),
    ]
}
