//! Fuzz entry points of the core's network decoders (the `notification` target of `fuzz/`).
//!
//! Shared by the libFuzzer targets (`fuzz/fuzz_targets/*.rs`, nightly) and by the stable replay and
//! proptest tests (`crates/core/tests/fuzz_corpus.rs`), so both check the same properties. Each entry
//! point takes arbitrary bytes, must never panic on them, and panics only when a property the decoder
//! promises is broken. Not part of the API.

use crate::notify::{Notification, NotificationBody, RequestId, MAX_REASON};
use crate::SenderKey;

/// Byte offset of the flag byte (bit 0 has-aux, bit 1 wants-digest) of a handoff notification
/// (after the 27-byte header).
const HANDOFF_FLAG: usize = 27;

/// The canonical form of an encoded notification that decodes (`n` is what it decoded to): the
/// encoder writes the aux slot of a handoff without aux as 0 (a receiver ignores it), and the lowest
/// wire version that expresses the notification (the decoder also reads a version-3 message that
/// uses nothing of version 3); everything else has exactly one encoding.
pub fn canonical_notification(data: &[u8], n: &Notification) -> Vec<u8> {
    let mut c = data.to_vec();
    c[1] = n.wire_version();
    if c.len() >= HANDOFF_FLAG + 5 && c[2] == 5 && c[HANDOFF_FLAG] & 1 == 0 {
        c[HANDOFF_FLAG + 1..HANDOFF_FLAG + 5].fill(0);
    }
    c
}

/// `notification`: [`Notification::decode`] never panics; whatever decodes displays, and re-encodes
/// to its canonical form ([`canonical_notification`]), which decodes to the same notification.
/// Returns whether `data` decoded.
pub fn notification(data: &[u8]) -> bool {
    let Ok(n) = Notification::decode(data) else { return false };
    let _ = n.to_string();
    let again = n.encode().expect("a decoded notification encodes");
    assert_eq!(again, canonical_notification(data, &n), "re-encoding {n:?} changed its bytes");
    assert_eq!(Notification::decode(&again).as_ref(), Ok(&n));
    true
}

/// Valid encodings made by the real encoder, named: the seed corpus of `notification`.
pub fn notification_seeds() -> Vec<(String, Vec<u8>)> {
    let key = SenderKey::from_u64(0x0001_0002_0003_0004);
    let r = RequestId(7);
    let bodies = [
        ("chunk", NotificationBody::KvChunk { chunk: 3, last: false }),
        ("chunk-last", NotificationBody::KvChunk { chunk: u32::MAX, last: true }),
        ("aux", NotificationBody::Aux(vec![1, 2, 3, 4])),
        ("aux-empty", NotificationBody::Aux(Vec::new())),
        ("state", NotificationBody::State((0..64).collect())),
        ("failure", NotificationBody::Failure("decode rank ran out of pages".into())),
        ("failure-utf8", NotificationBody::Failure("é€😀".into())),
        ("failure-max", NotificationBody::Failure("x".repeat(MAX_REASON))),
        ("handoff", NotificationBody::Handoff { pages: vec![0, 1, 2, 9], aux_slot: Some(5), digest: false }),
        ("handoff-noaux", NotificationBody::Handoff { pages: vec![4], aux_slot: None, digest: false }),
        ("handoff-digest", NotificationBody::Handoff { pages: vec![4, 5], aux_slot: None, digest: true }),
        ("handoff-aux-digest", NotificationBody::Handoff { pages: vec![6], aux_slot: Some(3), digest: true }),
        ("handoff-empty", NotificationBody::Handoff { pages: Vec::new(), aux_slot: None, digest: false }),
        ("abort", NotificationBody::Abort("cancelled by the client".into())),
        ("fenced", NotificationBody::Fenced),
        ("digest", NotificationBody::Digest(vec![1, 2, u64::MAX])),
    ];
    bodies
        .into_iter()
        .map(|(name, body)| {
            let n = Notification::new(r, key, body).with_generation(0x0102_0304_0506_0708);
            (name.to_owned(), n.encode().expect("seed encodes"))
        })
        .collect()
}
