//! Typed notifications and their compact, versioned binary encoding.
//!
//! Wire format (little endian), versions 2 and 3 (the [kvxfer protocol](crate::protocol)):
//! ```text
//! 0      u8   magic 0xKV (0x4b)
//! 1      u8   version (2, or 3 for a message that uses the digest)
//! 2      u8   kind: 1 kv-chunk, 2 aux, 3 state, 4 failure, 5 handoff, 6 abort, 7 fenced, 8 digest
//! 3..11  u64  request id (the room)
//! 11..19 u64  generation (unique per use of a room)
//! 19..27 u64  sender key (16 bits each: dp, cp, pp, tp) of the rank that sent it (prefill or decode)
//! kv-chunk: u32 chunk index, u8 last (0 or 1)
//! aux, state: u32 length, payload bytes (at most MAX_PAYLOAD)
//! failure, abort: u16 length, UTF-8 reason (at most MAX_REASON bytes)
//! handoff: u8 flags (bit 0 has-aux, bit 1 wants-digest), u32 aux slot, u32 page count, that many u32
//!          pages (payload at most MAX_PAYLOAD) (the aux slot is written as 0 when has-aux is 0, and
//!          ignored by the decoder)
//! fenced: nothing
//! digest: u32 entry count, that many u64 (at most MAX_PAYLOAD / 8)
//! ```
//!
//! Kind 8 and the wants-digest flag came with the opt-in digest in protocol 3. A message is written
//! in the lowest version that expresses it: one that uses neither is version 2, byte for byte what
//! a protocol-2 build writes (so it reads it), one that uses either is version 3 (a protocol-2 build
//! refuses it naming the version). A decode rank sets the flag only towards prefill ranks that
//! negotiated protocol 3, and a prefill rank sends kind 8 only to a decode rank that set it. The
//! decoder reads versions 2 and 3, and refuses the flag or kind 8 in a version-2 message.
//!
//! Kinds 1-4, 7 and 8 travel from a prefill rank to a decode rank; 5 (the decode rank's destination pages
//! for one request) and 6 (the decode rank aborted the request: stop writing, then answer `fenced`)
//! travel from a decode rank to a prefill rank.
//! The decoder rejects truncation, unknown magic, version or kind, flag bytes other than 0 and 1,
//! over-long payloads, invalid UTF-8 and trailing bytes.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::CodecError;
use crate::model::SenderKey;

/// A request (SGLang's room, vLLM's request id): one sequence's KV transfer. An engine may reuse a
/// room after it released it; the generation in every [`Notification`] tells the uses apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// What a notification says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum NotificationBody {
    /// Chunk `chunk` of the request has landed; `last` marks the final chunk (the sender's count is `chunk + 1`).
    KvChunk {
        /// Chunk index.
        chunk: u32,
        /// Whether this is the last chunk.
        last: bool,
    },
    /// Auxiliary data (e.g. the first output token); required when the receiver asked for it.
    Aux(Vec<u8>),
    /// Per-request state (e.g. linear-attention state) from one sender.
    State(Vec<u8>),
    /// The sender failed this request. A sender sends it only after its own transfers for the request
    /// are finished or aborted (it also counts as that sender's fence).
    Failure(String),
    /// Decode to prefill: where this decode rank's bytes of the request land (its destination page
    /// indices in token order) and, optionally, its aux slot.
    Handoff {
        /// Destination pages on the decode rank, in token order.
        pages: Vec<u32>,
        /// The decode rank's aux slot for the request, if it wants aux data.
        aux_slot: Option<u32>,
        /// Whether the decode rank verifies an end-to-end digest ([`NotificationBody::Digest`]).
        digest: bool,
    },
    /// Decode to prefill: the decode rank aborted the request; stop posting, abort what is in flight,
    /// then answer [`NotificationBody::Fenced`].
    Abort(String),
    /// Prefill to decode: no write of this sender for the request can land any more.
    Fenced,
    /// Prefill to decode, to a decode rank whose handoff asked for it, once every write of this
    /// sender for the request completed: the sums of [`crate::digest`] over what it wrote there,
    /// one per (stage-local layer, kind slice).
    Digest(Vec<u64>),
}

/// One notification from a sender about a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Notification {
    /// The request (room).
    pub request: RequestId,
    /// Which use of the room: unique per use, chosen by the decode side when it registers the request
    /// (0 for callers that never reuse a room id).
    pub generation: u64,
    /// The key of the rank that sent it.
    pub sender: SenderKey,
    /// The content.
    pub body: NotificationBody,
}

const MAGIC: u8 = 0x4b;
/// The newest wire version this build encodes and decodes (= [`crate::protocol::PROTOCOL`]).
pub const VERSION: u8 = 3;
/// The oldest wire version this build encodes and decodes (= [`crate::protocol::OLDEST_PROTOCOL`]).
pub const OLDEST_VERSION: u8 = 2;
/// Largest aux or state payload.
pub const MAX_PAYLOAD: usize = 1 << 20;
/// Largest failure reason in bytes (longer reasons are truncated at a char boundary when encoding).
pub const MAX_REASON: usize = 4096;
const HEADER: usize = 27;

impl Notification {
    /// A kv-chunk notification.
    pub fn chunk(request: RequestId, sender: SenderKey, chunk: u32, last: bool) -> Self {
        Self::new(request, sender, NotificationBody::KvChunk { chunk, last })
    }

    /// A failure notification.
    pub fn failure(request: RequestId, sender: SenderKey, reason: impl Into<String>) -> Self {
        Self::new(request, sender, NotificationBody::Failure(reason.into()))
    }

    /// A notification of generation 0.
    pub fn new(request: RequestId, sender: SenderKey, body: NotificationBody) -> Self {
        Self { request, generation: 0, sender, body }
    }

    /// Whether this notification's sender key names the rank `identity`: its [`SenderKey::to_u64`]
    /// equals it. A rank puts its own identity as the key of every notification it sends, so a
    /// backend that authenticated a connection as `identity` refuses, as a protocol error of that
    /// connection, every notification on it for which this is false (a forged sender).
    pub fn is_from(&self, identity: u64) -> bool {
        self.sender.to_u64() == identity
    }

    /// The same notification for another generation of its room.
    pub fn with_generation(mut self, generation: u64) -> Self {
        self.generation = generation;
        self
    }

    /// Encodes into bytes. Aux/state payloads over [`MAX_PAYLOAD`] are an error; failure reasons are
    /// truncated to [`MAX_REASON`] bytes.
    pub fn encode(&self) -> Result<Vec<u8>, CodecError> {
        let mut out = Vec::with_capacity(HEADER + 8);
        self.encode_into(&mut out)?;
        Ok(out)
    }

    /// The wire version it is written in: the lowest that expresses it (3 for a digest or a handoff
    /// that asks for one, 2 otherwise).
    pub fn wire_version(&self) -> u8 {
        match &self.body {
            NotificationBody::Digest(_) | NotificationBody::Handoff { digest: true, .. } => 3,
            _ => OLDEST_VERSION,
        }
    }

    /// Encodes, appending to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), CodecError> {
        let tag = match &self.body {
            NotificationBody::KvChunk { .. } => 1,
            NotificationBody::Aux(_) => 2,
            NotificationBody::State(_) => 3,
            NotificationBody::Failure(_) => 4,
            NotificationBody::Handoff { .. } => 5,
            NotificationBody::Abort(_) => 6,
            NotificationBody::Fenced => 7,
            NotificationBody::Digest(_) => 8,
        };
        out.extend_from_slice(&[MAGIC, self.wire_version(), tag]);
        out.extend_from_slice(&self.request.0.to_le_bytes());
        out.extend_from_slice(&self.generation.to_le_bytes());
        out.extend_from_slice(&self.sender.to_u64().to_le_bytes());
        match &self.body {
            NotificationBody::KvChunk { chunk, last } => {
                out.extend_from_slice(&chunk.to_le_bytes());
                out.push(u8::from(*last));
            }
            NotificationBody::Aux(p) | NotificationBody::State(p) => {
                if p.len() > MAX_PAYLOAD {
                    return Err(CodecError::TooLong { len: p.len(), max: MAX_PAYLOAD });
                }
                out.extend_from_slice(&(p.len() as u32).to_le_bytes());
                out.extend_from_slice(p);
            }
            NotificationBody::Failure(r) | NotificationBody::Abort(r) => {
                let mut end = r.len().min(MAX_REASON);
                while !r.is_char_boundary(end) {
                    end -= 1;
                }
                out.extend_from_slice(&(end as u16).to_le_bytes());
                out.extend_from_slice(&r.as_bytes()[..end]);
            }
            NotificationBody::Handoff { pages, aux_slot, digest } => {
                if pages.len() > MAX_HANDOFF_PAGES {
                    return Err(CodecError::TooLong { len: pages.len() * 4, max: MAX_PAYLOAD });
                }
                out.push(u8::from(aux_slot.is_some()) | (u8::from(*digest) << 1));
                out.extend_from_slice(&aux_slot.unwrap_or(0).to_le_bytes());
                out.extend_from_slice(&(pages.len() as u32).to_le_bytes());
                for p in pages {
                    out.extend_from_slice(&p.to_le_bytes());
                }
            }
            NotificationBody::Fenced => {}
            NotificationBody::Digest(d) => {
                if d.len() > MAX_DIGEST_ENTRIES {
                    return Err(CodecError::TooLong { len: d.len() * 8, max: MAX_PAYLOAD });
                }
                out.extend_from_slice(&(d.len() as u32).to_le_bytes());
                for v in d {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
        Ok(())
    }

    /// Decodes exactly one notification from `buf`.
    pub fn decode(buf: &[u8]) -> Result<Self, CodecError> {
        let mut r = Reader { buf, pos: 0 };
        let magic = r.u8()?;
        if magic != MAGIC {
            return Err(CodecError::Magic { found: magic, expected: MAGIC });
        }
        let version = r.u8()?;
        if !(OLDEST_VERSION..=VERSION).contains(&version) {
            return Err(CodecError::Version {
                what: "notification",
                found: version,
                oldest: OLDEST_VERSION,
                newest: VERSION,
            });
        }
        let tag = r.u8()?;
        let request = RequestId(r.u64()?);
        let generation = r.u64()?;
        let sender = SenderKey::from_u64(r.u64()?);
        let body = match tag {
            1 => {
                let chunk = r.u32()?;
                let last = match r.u8()? {
                    0 => false,
                    1 => true,
                    f => return Err(CodecError::Flag(f)),
                };
                NotificationBody::KvChunk { chunk, last }
            }
            2 | 3 => {
                let len = r.u32()? as usize;
                if len > MAX_PAYLOAD {
                    return Err(CodecError::TooLong { len, max: MAX_PAYLOAD });
                }
                let p = r.bytes(len)?.to_vec();
                if tag == 2 {
                    NotificationBody::Aux(p)
                } else {
                    NotificationBody::State(p)
                }
            }
            4 | 6 => {
                let len = usize::from(r.u16()?);
                if len > MAX_REASON {
                    return Err(CodecError::TooLong { len, max: MAX_REASON });
                }
                let s = std::str::from_utf8(r.bytes(len)?).map_err(|_| CodecError::Utf8)?.to_owned();
                if tag == 4 {
                    NotificationBody::Failure(s)
                } else {
                    NotificationBody::Abort(s)
                }
            }
            5 => {
                let (has_aux, digest) = match r.u8()? {
                    f if f <= 1 || (f <= 3 && version >= 3) => (f & 1 == 1, f & 2 == 2),
                    f => return Err(CodecError::Flag(f)),
                };
                let aux = r.u32()?;
                let n = r.u32()? as usize;
                if n > MAX_HANDOFF_PAGES {
                    return Err(CodecError::TooLong { len: n.saturating_mul(4), max: MAX_PAYLOAD });
                }
                let raw = r.bytes(n * 4)?;
                let pages = raw.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
                NotificationBody::Handoff { pages, aux_slot: has_aux.then_some(aux), digest }
            }
            7 => NotificationBody::Fenced,
            8 if version >= 3 => {
                let n = r.u32()? as usize;
                if n > MAX_DIGEST_ENTRIES {
                    return Err(CodecError::TooLong { len: n.saturating_mul(8), max: MAX_PAYLOAD });
                }
                let raw = r.bytes(n * 8)?;
                NotificationBody::Digest(
                    raw.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect(),
                )
            }
            t => return Err(CodecError::Tag(t)),
        };
        if r.pos != buf.len() {
            return Err(CodecError::Trailing(buf.len() - r.pos));
        }
        Ok(Self { request, generation, sender, body })
    }
}

/// Most destination pages one handoff carries (its payload stays within [`MAX_PAYLOAD`]).
pub const MAX_HANDOFF_PAGES: usize = MAX_PAYLOAD / 4;

/// Most entries one digest carries (its payload stays within [`MAX_PAYLOAD`]).
pub const MAX_DIGEST_ENTRIES: usize = MAX_PAYLOAD / 8;

impl fmt::Display for Notification {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} gen {} from {}: ", self.request, self.generation, self.sender)?;
        match &self.body {
            NotificationBody::KvChunk { chunk, last } => {
                write!(f, "chunk {chunk}{}", if *last { " (last)" } else { "" })
            }
            NotificationBody::Aux(p) => write!(f, "aux ({} bytes)", p.len()),
            NotificationBody::State(p) => write!(f, "state ({} bytes)", p.len()),
            NotificationBody::Failure(r) => write!(f, "failure: {r}"),
            NotificationBody::Handoff { pages, aux_slot, digest } => {
                write!(f, "handoff of {} pages", pages.len())?;
                if let Some(a) = aux_slot {
                    write!(f, ", aux slot {a}")?;
                }
                if *digest {
                    write!(f, ", digest wanted")?;
                }
                Ok(())
            }
            NotificationBody::Abort(r) => write!(f, "abort: {r}"),
            NotificationBody::Fenced => write!(f, "fenced"),
            NotificationBody::Digest(d) => write!(f, "digest ({} entries)", d.len()),
        }
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> Result<&'a [u8], CodecError> {
        let end = self.pos.checked_add(n).filter(|e| *e <= self.buf.len()).ok_or(CodecError::Truncated {
            needed: n,
            offset: self.pos,
            len: self.buf.len(),
        })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, CodecError> {
        Ok(self.bytes(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, CodecError> {
        Ok(u16::from_le_bytes(self.bytes(2)?.try_into().expect("2 bytes")))
    }
    fn u32(&mut self) -> Result<u32, CodecError> {
        Ok(u32::from_le_bytes(self.bytes(4)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> Result<u64, CodecError> {
        Ok(u64::from_le_bytes(self.bytes(8)?.try_into().expect("8 bytes")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn body() -> impl Strategy<Value = NotificationBody> {
        prop_oneof![
            (any::<u32>(), any::<bool>()).prop_map(|(chunk, last)| NotificationBody::KvChunk { chunk, last }),
            proptest::collection::vec(any::<u8>(), 0..64).prop_map(NotificationBody::Aux),
            proptest::collection::vec(any::<u8>(), 0..64).prop_map(NotificationBody::State),
            ".{0,40}".prop_map(NotificationBody::Failure),
            (proptest::collection::vec(any::<u32>(), 0..64), proptest::option::of(any::<u32>()), any::<bool>())
                .prop_map(|(pages, aux_slot, digest)| NotificationBody::Handoff { pages, aux_slot, digest }),
            ".{0,40}".prop_map(NotificationBody::Abort),
            Just(NotificationBody::Fenced),
            proptest::collection::vec(any::<u64>(), 0..32).prop_map(NotificationBody::Digest),
        ]
    }

    proptest! {
        #[test]
        fn roundtrip(req in any::<u64>(), gen in any::<u64>(), key in any::<u64>(), body in body()) {
            let n = Notification { request: RequestId(req), generation: gen, sender: SenderKey::from_u64(key), body };
            let bytes = n.encode().unwrap();
            prop_assert_eq!(Notification::decode(&bytes).unwrap(), n);
        }

        #[test]
        fn decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            let _ = Notification::decode(&bytes);
        }

        #[test]
        fn every_truncation_is_an_error(req in any::<u64>(), body in body()) {
            let n = Notification::new(RequestId(req), SenderKey::from_u64(7), body).with_generation(3);
            let bytes = n.encode().unwrap();
            for cut in 0..bytes.len() {
                prop_assert!(Notification::decode(&bytes[..cut]).is_err());
            }
        }
    }

    #[test]
    fn malformed_inputs_name_the_problem() {
        let good = Notification::chunk(RequestId(1), SenderKey::from_u64(2), 3, true).encode().unwrap();
        let mut b = good.clone();
        b[0] = 0;
        assert!(matches!(Notification::decode(&b), Err(CodecError::Magic { .. })));
        let mut b = good.clone();
        b[1] = 9;
        assert!(matches!(Notification::decode(&b), Err(CodecError::Version { found: 9, .. })));
        let mut b = good.clone();
        b[2] = 77;
        assert!(matches!(Notification::decode(&b), Err(CodecError::Tag(77))));
        let mut b = good.clone();
        *b.last_mut().unwrap() = 2;
        assert!(matches!(Notification::decode(&b), Err(CodecError::Flag(2))));
        let mut b = good.clone();
        b.push(0);
        assert!(matches!(Notification::decode(&b), Err(CodecError::Trailing(1))));
        let mut f = Notification::failure(RequestId(1), SenderKey::from_u64(2), "ab").encode().unwrap();
        let n = f.len();
        f[n - 1] = 0xff;
        assert!(matches!(Notification::decode(&f), Err(CodecError::Utf8)));
        assert_eq!(good.len(), HEADER + 5);
        let h = |digest| {
            Notification::new(
                RequestId(1),
                SenderKey::from_u64(2),
                NotificationBody::Handoff { pages: vec![3], aux_slot: None, digest },
            )
            .encode()
            .unwrap()
        };
        // Without the digest the handoff is the bytes of before (an older prefill rank reads it).
        assert_eq!(h(false)[HEADER], 0);
        assert_eq!(h(true)[HEADER], 2);
        let mut b = h(true);
        b[HEADER] = 4;
        assert!(matches!(Notification::decode(&b), Err(CodecError::Flag(4))));
    }

    #[test]
    fn long_reasons_truncate_on_char_boundary() {
        let reason = "é".repeat(MAX_REASON);
        let n = Notification::failure(RequestId(1), SenderKey::from_u64(0), reason);
        let d = Notification::decode(&n.encode().unwrap()).unwrap();
        match d.body {
            NotificationBody::Failure(r) => assert!(r.len() <= MAX_REASON && r.chars().all(|c| c == 'é')),
            _ => panic!("wrong body"),
        }
    }
}
