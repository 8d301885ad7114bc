//! The TCP backend's wire protocol: handshake, frame headers, op descriptors, and their validation.
//!
//! Pure code, no IO: encoders and decoders over byte slices, so the protocol can be tested (and a
//! hostile peer simulated) without sockets. The crate README describes the same format in prose.
//!
//! All integers are little endian.
//!
//! ```text
//! CHALLENGE (server -> client, first bytes of every stream), 48 bytes:
//!   0  [4]  magic "KVXT"
//!   4  u16  protocol version (4)
//!   6  u8   flags: bit 0 SECRET (the server has a cluster secret: it requires a proof, and proves it too)
//!   7  u8   reserved, 0
//!   8  u64  server identity
//!   16 [32] server nonce (fresh per stream)
//! HELLO (client -> server, the answer to the CHALLENGE), 120 bytes:
//!   0  [4]  magic "KVXT"
//!   4  u16  protocol version (4)
//!   6  u8   stream kind: 0 data, 1 control
//!   7  u8   stream index within the link
//!   8  [16] access token (from the server's endpoint metadata)
//!   24 u64  link id (random, groups the streams of one connect call)
//!   32 u64  client identity
//!   40 u32  data streams in the link
//!   44 u8   flags: bit 0 PROOF (bytes 88..120 carry the client's proof; otherwise they are 0)
//!   45 [3]  reserved, 0
//!   48 [32] client nonce (fresh per stream)
//!   80 u64  client instance (drawn once per endpoint: a server that cut this instance off refuses
//!           it; a restarted process is another instance)
//!   88 [32] client proof: HMAC-SHA256(secret, "kvxfer-tcp/3 client\0" || CHALLENGE || HELLO[0..88])
//! HELLO reply (server -> client), 52 bytes + reason:
//!   0  [4]  magic "KVXT"
//!   4  u16  protocol version
//!   6  u8   status: 0 accepted, 1 rejected
//!   7  u8   flags: bit 0 PROOF (accepted only: bytes 20..52 carry the server's proof; otherwise 0)
//!   8  u64  server identity (the CHALLENGE's)
//!   16 u32  reason length (0 when accepted, at most MAX_MESSAGE)
//!   20 [32] server proof: HMAC-SHA256(secret, "kvxfer-tcp/3 server\0" || CHALLENGE || HELLO || REPLY[0..20])
//!   52      the UTF-8 reason
//! //! FRAME header, 32 bytes:
//!   0  u8   type: 1 WRITE, 2 NOTE, 3 BYE, 4 DROP (client -> server); 0x81 ACK, 0x82 ERROR
//!           (server -> client)
//!   1  u8   flags. WRITE: bit 0 LAST (last frame of the batch on this stream), bit 1 NOTE_FOLLOWS
//!           (with LAST: an attached NOTE for this batch follows on stream 0). DROP: bit 0 PART (the
//!           LAST frame of this stream's part of an aborted batch was dropped), bit 1 NOTE (the
//!           batch's NOTE was dropped), exactly one.
//!   2  u16  frame magic 0x584b ("KX")
//!   4  u32  n: WRITE op descriptors (1..=MAX_OPS); NOTE / ERROR body length
//!   8  u64  batch id
//!   16 u64  payload bytes (WRITE: the sum of len * count over its ops; otherwise 0)
//!   24 u32  parts (NOTE, DROP of a NOTE: data stream parts of the batch to wait for; otherwise 0)
//!   28 u32  reserved, 0
//! Every WRITE frame is answered by an ACK (same batch id) once its payload is placed, in order.
//! WRITE body: n op descriptors of 40 bytes, then the payload (the ops' ranges in order):
//!   0  u32 destination region, 4 u32 reserved 0, 8 u64 offset, 16 u64 len, 24 u64 count, 32 u64 stride
//! NOTE body: a kvxfer-core encoded Notification. ERROR body: a UTF-8 message.
//! ```

use std::fmt;

use kvxfer_core::secret::Secret;
use kvxfer_core::{RegionId, WriteOp};

pub use kvxfer_core::secret::{NONCE_BYTES, PROOF_BYTES};

/// Handshake magic.
pub const HELLO_MAGIC: [u8; 4] = *b"KVXT";
/// Protocol version this build speaks (3: the challenge-response handshake; 4: the client's instance
/// in the HELLO, so that a peer cut off stays cut off).
pub const PROTOCOL_VERSION: u16 = 4;
/// Bytes of a CHALLENGE.
pub const CHALLENGE_LEN: usize = 48;
/// Bytes of a HELLO.
pub const HELLO_LEN: usize = 120;
/// Bytes of a HELLO the client proof covers (everything before the proof).
pub const HELLO_SIGNED_LEN: usize = 88;
/// Bytes of a HELLO reply before its reason.
pub const HELLO_REPLY_LEN: usize = 52;
/// Bytes of a HELLO reply the server proof covers (everything before the proof).
pub const REPLY_SIGNED_LEN: usize = 20;
/// CHALLENGE flag: the server has a cluster secret.
pub const CHALLENGE_SECRET: u8 = 1;
/// HELLO and reply flag: the message carries a proof.
pub const FLAG_PROOF: u8 = 1;
/// Domain separation of the client's proof.
const CLIENT_CONTEXT: &[u8] = b"kvxfer-tcp/3 client\0";
/// Domain separation of the server's proof.
const SERVER_CONTEXT: &[u8] = b"kvxfer-tcp/3 server\0";
/// Bytes of a frame header.
pub const HEADER_LEN: usize = 32;
/// Bytes of one WRITE op descriptor.
pub const OP_LEN: usize = 40;
/// Frame magic.
pub const FRAME_MAGIC: u16 = 0x584b;
/// Most op descriptors in one WRITE frame.
pub const MAX_OPS: u32 = 1024;
/// Longest memory guard the receiver (and sender) takes: contiguous spans are guarded in pieces of
/// at most this many bytes, so the guard table's overlap scan stays short.
pub const MAX_GUARD: u64 = 64 << 10;
/// Most guard pieces (see [`guard_pieces`]) one WRITE frame may need; a frame over it is a protocol
/// error (it bounds what a peer can make the receiver allocate before reading a payload).
pub const MAX_FRAME_RANGES: u64 = 1 << 12;
/// Longest ERROR message or handshake reason.
pub const MAX_MESSAGE: u32 = 4096;
/// Longest NOTE body (an encoded notification with the largest aux/state payload).
pub const MAX_NOTE: u32 = (kvxfer_core::notify::MAX_PAYLOAD + 64) as u32;
/// Access token length.
pub const TOKEN_LEN: usize = 16;

/// WRITE flag: last frame of its batch on this stream; the receiver acks after placing it.
pub const FLAG_LAST: u8 = 1;
/// WRITE flag: an attached NOTE for this batch follows on stream 0.
pub const FLAG_NOTE_FOLLOWS: u8 = 2;
/// DROP flag: a LAST | NOTE_FOLLOWS frame of an aborted batch was not sent on this stream.
pub const DROP_PART: u8 = 1;
/// DROP flag: the NOTE of an aborted batch was not sent (`parts` as the NOTE would have had).
pub const DROP_NOTE: u8 = 2;

/// Frame types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameType {
    /// Data: op descriptors and payload.
    Write = 1,
    /// A notification.
    Note = 2,
    /// Graceful end of the stream.
    Bye = 3,
    /// Part of an aborted batch that was not sent (keeps the receiver's notification books).
    Drop = 4,
    /// The receiver placed a batch's part on this stream.
    Ack = 0x81,
    /// The receiver rejected a frame; it closes the stream after this.
    Error = 0x82,
}

impl FrameType {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::Write,
            2 => Self::Note,
            3 => Self::Bye,
            4 => Self::Drop,
            0x81 => Self::Ack,
            0x82 => Self::Error,
            _ => return None,
        })
    }
}

/// A protocol violation, described for the error message (and the ERROR frame sent back).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireError(pub String);

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

macro_rules! bail {
    ($($t:tt)*) => { return Err(WireError(format!($($t)*))) };
}

fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}
fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}

/// Stream kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    /// Data stream (WRITE frames and attached NOTEs).
    Data,
    /// Control stream (out-of-band NOTEs).
    Control,
}

/// The first message of every stream, from the server: who it is, whether it has a cluster secret,
/// and a fresh nonce the client's proof must cover (so no proof is valid on another stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Challenge {
    /// Server identity.
    pub identity: u64,
    /// Whether the server has a cluster secret (requires a proof, and proves it).
    pub secret: bool,
    /// Server nonce.
    pub nonce: [u8; NONCE_BYTES],
}

impl Challenge {
    /// Encodes.
    pub fn encode(&self) -> [u8; CHALLENGE_LEN] {
        let mut b = [0u8; CHALLENGE_LEN];
        b[0..4].copy_from_slice(&HELLO_MAGIC);
        b[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        b[6] = if self.secret { CHALLENGE_SECRET } else { 0 };
        b[8..16].copy_from_slice(&self.identity.to_le_bytes());
        b[16..48].copy_from_slice(&self.nonce);
        b
    }

    /// Decodes and checks magic, version, flags and the reserved byte.
    pub fn decode(b: &[u8; CHALLENGE_LEN]) -> Result<Self, WireError> {
        if b[0..4] != HELLO_MAGIC {
            bail!("peer did not open the kvxfer-tcp handshake (magic {:02x?})", &b[0..4]);
        }
        let v = u16_at(b, 4);
        if v != PROTOCOL_VERSION {
            bail!("peer speaks protocol version {v}, this endpoint speaks {PROTOCOL_VERSION}");
        }
        if b[6] & !CHALLENGE_SECRET != 0 || b[7] != 0 {
            bail!("unknown handshake challenge flags 0x{:02x} or reserved byte 0x{:02x}", b[6], b[7]);
        }
        let mut nonce = [0u8; NONCE_BYTES];
        nonce.copy_from_slice(&b[16..48]);
        Ok(Self { identity: u64_at(b, 8), secret: b[6] & CHALLENGE_SECRET != 0, nonce })
    }
}

/// The client's answer to a [`Challenge`], the first message it sends on a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// Data or control.
    pub kind: StreamKind,
    /// Index of the stream in its link.
    pub index: u8,
    /// Access token.
    pub token: [u8; TOKEN_LEN],
    /// Link id.
    pub link: u64,
    /// Client identity.
    pub identity: u64,
    /// Data streams in the link.
    pub streams: u32,
    /// Client nonce (the server's proof covers it).
    pub nonce: [u8; NONCE_BYTES],
    /// The client endpoint's instance (see [`crate::TcpBackend::instance`]).
    pub instance: u64,
    /// The client's proof of the cluster secret ([`Hello::sign`]), if it has one.
    pub proof: Option<[u8; PROOF_BYTES]>,
}

impl Hello {
    /// Encodes.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&HELLO_MAGIC);
        b[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        b[6] = match self.kind {
            StreamKind::Data => 0,
            StreamKind::Control => 1,
        };
        b[7] = self.index;
        b[8..24].copy_from_slice(&self.token);
        b[24..32].copy_from_slice(&self.link.to_le_bytes());
        b[32..40].copy_from_slice(&self.identity.to_le_bytes());
        b[40..44].copy_from_slice(&self.streams.to_le_bytes());
        b[48..80].copy_from_slice(&self.nonce);
        b[80..88].copy_from_slice(&self.instance.to_le_bytes());
        if let Some(p) = &self.proof {
            b[44] = FLAG_PROOF;
            b[88..120].copy_from_slice(p);
        }
        b
    }

    /// Decodes and checks magic, version, kind, flags and reserved bytes (not the token or the proof).
    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Self, WireError> {
        if b[0..4] != HELLO_MAGIC {
            bail!("not a kvxfer-tcp handshake (magic {:02x?})", &b[0..4]);
        }
        let v = u16_at(b, 4);
        if v != PROTOCOL_VERSION {
            bail!("protocol version {v}, this endpoint speaks {PROTOCOL_VERSION}");
        }
        let kind = match b[6] {
            0 => StreamKind::Data,
            1 => StreamKind::Control,
            k => bail!("unknown stream kind {k}"),
        };
        if b[44] & !FLAG_PROOF != 0 || b[45..48] != [0; 3] {
            bail!("unknown handshake flags 0x{:02x} or reserved bytes not zero", b[44]);
        }
        let proof = if b[44] & FLAG_PROOF != 0 {
            let mut p = [0u8; PROOF_BYTES];
            p.copy_from_slice(&b[88..120]);
            Some(p)
        } else if b[88..120] != [0; PROOF_BYTES] {
            bail!("a handshake without the PROOF flag carries proof bytes");
        } else {
            None
        };
        let streams = u32_at(b, 40);
        if streams == 0 || streams > 64 {
            bail!("link announces {streams} data streams (1..=64 allowed)");
        }
        let mut token = [0u8; TOKEN_LEN];
        token.copy_from_slice(&b[8..24]);
        let mut nonce = [0u8; NONCE_BYTES];
        nonce.copy_from_slice(&b[48..80]);
        Ok(Self {
            kind,
            index: b[7],
            token,
            link: u64_at(b, 24),
            identity: u64_at(b, 32),
            streams,
            nonce,
            instance: u64_at(b, 80),
            proof,
        })
    }

    /// The same HELLO with the client's proof of `secret` over `challenge` (the server's CHALLENGE as
    /// it arrived) and every field of this HELLO before the proof.
    pub fn sign(mut self, secret: &Secret, challenge: &[u8; CHALLENGE_LEN]) -> Self {
        self.proof = Some([0; PROOF_BYTES]);
        let b = self.encode();
        self.proof = Some(secret.proof(&[CLIENT_CONTEXT, challenge, &b[..HELLO_SIGNED_LEN]]));
        self
    }

    /// Whether this HELLO carries a proof of `secret` over `challenge` (the one this server sent on
    /// this stream) and its own fields; compared in constant time.
    pub fn verify(&self, secret: &Secret, challenge: &[u8; CHALLENGE_LEN]) -> bool {
        let Some(p) = &self.proof else { return false };
        secret.verify(&[CLIENT_CONTEXT, challenge, &self.encode()[..HELLO_SIGNED_LEN]], p)
    }
}

/// Why a handshake was refused for authentication: the reason the server answers on the wire, and
/// what the connecting side reports. Every message says what to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthFailure {
    /// Server side: this endpoint has a secret and the HELLO carries no proof.
    ProofMissing,
    /// Server side: the HELLO's proof does not verify (another secret, or a replayed HELLO).
    ProofInvalid,
    /// Server side: the HELLO carries a proof but this endpoint has no secret.
    NoSecretHere,
    /// Client side: the server says it has no secret, so it cannot prove one.
    PeerHasNoSecret,
    /// Client side: the server's reply does not prove the secret.
    PeerProofInvalid,
}

impl AuthFailure {
    /// The message.
    pub fn message(self) -> &'static str {
        match self {
            Self::ProofMissing => {
                "authentication required: this endpoint has a cluster secret and the connecting rank sent no proof \
                 of it; configure the same cluster secret (KVXFER_SECRET) on every rank"
            }
            Self::ProofInvalid => {
                "authentication failed: the connecting rank's proof does not match this endpoint's cluster secret \
                 (a different secret, or a replayed handshake); configure the same cluster secret (KVXFER_SECRET) \
                 on every rank"
            }
            Self::NoSecretHere => {
                "authentication failed: the connecting rank proves a cluster secret but this endpoint has none; \
                 configure the same cluster secret (KVXFER_SECRET) on every rank"
            }
            Self::PeerHasNoSecret => {
                "authentication failed: the peer has no cluster secret and cannot prove one; configure the same \
                 cluster secret (KVXFER_SECRET) on every rank"
            }
            Self::PeerProofInvalid => {
                "authentication failed: the peer's handshake reply does not prove this endpoint's cluster secret \
                 (a different secret, or not the endpoint of the metadata); configure the same cluster secret \
                 (KVXFER_SECRET) on every rank"
            }
        }
    }
}

impl fmt::Display for AuthFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.message())
    }
}

impl std::error::Error for AuthFailure {}

/// A decoded HELLO reply before its reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplyHead {
    /// Server identity.
    pub identity: u64,
    /// Whether the handshake was rejected (a reason of `reason_len` bytes follows).
    pub rejected: bool,
    /// Bytes of the reason.
    pub reason_len: u32,
    /// The server's proof, if it carries one (accepted replies only).
    pub proof: Option<[u8; PROOF_BYTES]>,
}

/// Encodes a HELLO reply without a proof: a rejection with its reason, or an acceptance by an
/// endpoint without a secret.
pub fn encode_hello_reply(identity: u64, rejection: Option<&str>) -> Vec<u8> {
    let reason = rejection.map(|r| truncate(r, MAX_MESSAGE as usize)).unwrap_or("");
    let mut b = Vec::with_capacity(HELLO_REPLY_LEN + reason.len());
    b.extend_from_slice(&HELLO_MAGIC);
    b.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    b.push(u8::from(rejection.is_some()));
    b.push(0);
    b.extend_from_slice(&identity.to_le_bytes());
    b.extend_from_slice(&(reason.len() as u32).to_le_bytes());
    b.extend_from_slice(&[0; PROOF_BYTES]);
    b.extend_from_slice(reason.as_bytes());
    b
}

/// Encodes an accepting HELLO reply with the server's proof of `secret` over the whole exchange:
/// `challenge` (as sent), `hello` (as received, with the client's nonce) and the reply's own head.
pub fn encode_proved_reply(
    identity: u64,
    secret: &Secret,
    challenge: &[u8; CHALLENGE_LEN],
    hello: &[u8; HELLO_LEN],
) -> [u8; HELLO_REPLY_LEN] {
    let mut b = [0u8; HELLO_REPLY_LEN];
    b[..REPLY_SIGNED_LEN].copy_from_slice(&encode_hello_reply(identity, None)[..REPLY_SIGNED_LEN]);
    b[7] = FLAG_PROOF;
    let p = secret.proof(&[SERVER_CONTEXT, challenge, hello, &b[..REPLY_SIGNED_LEN]]);
    b[REPLY_SIGNED_LEN..].copy_from_slice(&p);
    b
}

/// Whether `reply` (its head) carries the server's proof of `secret` over `challenge` (as received)
/// and `hello` (as sent); compared in constant time.
pub fn verify_reply(
    secret: &Secret,
    challenge: &[u8; CHALLENGE_LEN],
    hello: &[u8; HELLO_LEN],
    reply: &[u8; HELLO_REPLY_LEN],
) -> bool {
    reply[7] & FLAG_PROOF != 0
        && secret.verify(&[SERVER_CONTEXT, challenge, hello, &reply[..REPLY_SIGNED_LEN]], &reply[REPLY_SIGNED_LEN..])
}

/// Decodes a HELLO reply's head. Checks magic, version, status and flags; only a rejection carries
/// a reason, only an acceptance a proof, and proof bytes without the PROOF flag are refused.
pub fn decode_hello_reply(b: &[u8; HELLO_REPLY_LEN]) -> Result<ReplyHead, WireError> {
    if b[0..4] != HELLO_MAGIC {
        bail!("peer did not answer the kvxfer-tcp handshake (magic {:02x?})", &b[0..4]);
    }
    let v = u16_at(b, 4);
    if v != PROTOCOL_VERSION {
        bail!("peer speaks protocol version {v}, this endpoint speaks {PROTOCOL_VERSION}");
    }
    let rejected = match b[6] {
        0 => false,
        1 => true,
        s => bail!("unknown handshake status {s}"),
    };
    if b[7] & !FLAG_PROOF != 0 {
        bail!("unknown handshake reply flags 0x{:02x}", b[7]);
    }
    let len = u32_at(b, 16);
    if len > MAX_MESSAGE {
        bail!("handshake reason of {len} bytes exceeds {MAX_MESSAGE}");
    }
    if !rejected && len != 0 {
        bail!("an accepted handshake with a reason of {len} bytes");
    }
    let proof = if b[7] & FLAG_PROOF != 0 {
        if rejected {
            bail!("a rejected handshake with a proof");
        }
        let mut p = [0u8; PROOF_BYTES];
        p.copy_from_slice(&b[REPLY_SIGNED_LEN..]);
        Some(p)
    } else if b[REPLY_SIGNED_LEN..] != [0; PROOF_BYTES] {
        bail!("a handshake reply without the PROOF flag carries proof bytes");
    } else {
        None
    };
    Ok(ReplyHead { identity: u64_at(b, 8), rejected, reason_len: len, proof })
}

/// Truncates at a char boundary.
pub fn truncate(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// A frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Type.
    pub ty: FrameType,
    /// Flags.
    pub flags: u8,
    /// Descriptor count or body length.
    pub n: u32,
    /// Batch id.
    pub batch: u64,
    /// Payload bytes.
    pub payload: u64,
    /// Parts (NOTE).
    pub parts: u32,
}

impl Header {
    /// A header with no flags, body, payload or parts.
    pub fn new(ty: FrameType, batch: u64) -> Self {
        Self { ty, flags: 0, n: 0, batch, payload: 0, parts: 0 }
    }

    /// Encodes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = self.ty as u8;
        b[1] = self.flags;
        b[2..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.n.to_le_bytes());
        b[8..16].copy_from_slice(&self.batch.to_le_bytes());
        b[16..24].copy_from_slice(&self.payload.to_le_bytes());
        b[24..28].copy_from_slice(&self.parts.to_le_bytes());
        b
    }

    /// Decodes and checks the magic, type, reserved bytes and per-type limits.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Self, WireError> {
        let magic = u16_at(b, 2);
        if magic != FRAME_MAGIC {
            bail!("bad frame magic 0x{magic:04x} (expected 0x{FRAME_MAGIC:04x}); stream out of sync");
        }
        let Some(ty) = FrameType::from_u8(b[0]) else { bail!("unknown frame type 0x{:02x}", b[0]) };
        if u32_at(b, 28) != 0 {
            bail!("reserved frame header bytes are not zero");
        }
        let h = Self {
            ty,
            flags: b[1],
            n: u32_at(b, 4),
            batch: u64_at(b, 8),
            payload: u64_at(b, 16),
            parts: u32_at(b, 24),
        };
        match ty {
            FrameType::Write => {
                if h.flags & !(FLAG_LAST | FLAG_NOTE_FOLLOWS) != 0 {
                    bail!("unknown WRITE flags 0x{:02x}", h.flags);
                }
                if h.n == 0 || h.n > MAX_OPS {
                    bail!("WRITE with {} op descriptors (1..={MAX_OPS} allowed)", h.n);
                }
                if h.parts != 0 {
                    bail!("WRITE with non-zero parts field");
                }
            }
            FrameType::Note => {
                if h.n == 0 || h.n > MAX_NOTE {
                    bail!("NOTE body of {} bytes (1..={MAX_NOTE} allowed)", h.n);
                }
                if h.flags != 0 || h.payload != 0 {
                    bail!("NOTE with flags or payload");
                }
                if h.parts > 64 {
                    bail!("NOTE waits for {} parts (at most 64 streams)", h.parts);
                }
            }
            FrameType::Drop => {
                let ok = match h.flags {
                    DROP_PART => h.parts == 0,
                    DROP_NOTE => h.parts <= 64,
                    _ => false,
                };
                if !ok || h.n != 0 || h.payload != 0 {
                    bail!("malformed DROP frame (flags 0x{:02x}, parts {})", h.flags, h.parts);
                }
            }
            FrameType::Error => {
                if h.n > MAX_MESSAGE || h.flags != 0 || h.payload != 0 || h.parts != 0 {
                    bail!("malformed ERROR frame");
                }
            }
            FrameType::Bye | FrameType::Ack => {
                if h.n != 0 || h.flags != 0 || h.payload != 0 || h.parts != 0 {
                    bail!("{ty:?} frame with a body, flags or payload");
                }
            }
        }
        Ok(h)
    }
}

/// One op descriptor of a WRITE frame: where `count` ranges of `len` bytes land.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpDesc {
    /// Destination region.
    pub region: RegionId,
    /// Offset of the first range.
    pub offset: u64,
    /// Bytes per range.
    pub len: u64,
    /// Ranges.
    pub count: u64,
    /// Destination stride.
    pub stride: u64,
}

impl OpDesc {
    /// The destination side of a write op.
    pub fn of(op: &WriteOp) -> Self {
        Self { region: op.dst, offset: op.dst_offset, len: op.len, count: op.count, stride: op.dst_stride }
    }

    /// Appends the encoding.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.region.0.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&self.count.to_le_bytes());
        out.extend_from_slice(&self.stride.to_le_bytes());
    }

    /// Decodes one descriptor (`b` is exactly [`OP_LEN`] bytes).
    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        if b.len() != OP_LEN {
            bail!("op descriptor of {} bytes", b.len());
        }
        if u32_at(b, 4) != 0 {
            bail!("reserved op descriptor bytes are not zero");
        }
        Ok(Self {
            region: RegionId(u32_at(b, 0)),
            offset: u64_at(b, 8),
            len: u64_at(b, 16),
            count: u64_at(b, 24),
            stride: u64_at(b, 32),
        })
    }

    /// Bytes carried, or `None` on overflow.
    pub fn bytes(&self) -> Option<u64> {
        self.len.checked_mul(self.count)
    }

    /// First and one-past-last byte touched (valid after bounds were checked).
    fn span(&self) -> (u64, u64) {
        (self.offset, self.offset + (self.count - 1) * self.stride + self.len)
    }

    /// The ranges `(offset, len)`.
    pub fn ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        (0..self.count).map(move |i| (self.offset + i * self.stride, self.len))
    }

    /// The guard pieces of the destination side, in payload order (see [`guard_pieces`]).
    pub fn pieces(&self) -> impl Iterator<Item = (u64, u64)> {
        guard_pieces(self.offset, self.stride, self.len, self.count)
    }
}

/// Whether `count` ranges of `len` bytes `stride` apart form one contiguous span.
pub fn contiguous(stride: u64, len: u64, count: u64) -> bool {
    count == 1 || stride == len
}

/// How many pieces [`guard_pieces`] yields, or `None` on overflow.
pub fn guard_count(stride: u64, len: u64, count: u64) -> Option<u64> {
    if contiguous(stride, len, count) {
        Some(len.checked_mul(count)?.div_ceil(MAX_GUARD))
    } else {
        count.checked_mul(len.div_ceil(MAX_GUARD))
    }
}

/// The `(offset, len)` pieces that cover `count` ranges of `len` bytes at `offset + i * stride`, in
/// order: contiguous ranges merged, every piece at most [`MAX_GUARD`] bytes. Each piece is guarded
/// and becomes one I/O slice. Call only after the bounds were checked.
pub fn guard_pieces(offset: u64, stride: u64, len: u64, count: u64) -> impl Iterator<Item = (u64, u64)> {
    let (stride, len, count) = if contiguous(stride, len, count) { (0, len * count, 1) } else { (stride, len, count) };
    (0..count).flat_map(move |i| {
        let start = offset + i * stride;
        (0..len.div_ceil(MAX_GUARD)).map(move |k| (start + k * MAX_GUARD, (len - k * MAX_GUARD).min(MAX_GUARD)))
    })
}

/// Checks a frame's ops before any byte is placed, given the length of each op's destination region
/// (`region_lens[i]` for `ops[i]`; the caller resolved every region, so an unknown one never gets
/// here): every range of every op lies inside its region, strides do not make an op overlap
/// itself, the payload length equals the ops' bytes, and the frame needs at most
/// [`MAX_FRAME_RANGES`] guard pieces. Overlaps between ops, and with other frames in flight, are
/// caught by the memory guards the receiver takes next.
pub fn validate_write(ops: &[OpDesc], payload: u64, region_lens: &[u64]) -> Result<(), WireError> {
    let mut total: u64 = 0;
    let mut pieces: u64 = 0;
    for (i, (op, region_len)) in ops.iter().zip(region_lens).enumerate() {
        if op.len == 0 || op.count == 0 {
            bail!("op {i} is empty (len {}, count {})", op.len, op.count);
        }
        if op.count > 1 && op.stride < op.len {
            bail!("op {i}: stride {} is smaller than the range length {} (ranges overlap)", op.stride, op.len);
        }
        if let Err(e) = WriteOp::check_bounds(op.offset, op.stride, op.len, op.count, *region_len) {
            bail!("op {i} into {} is out of bounds: {e}", op.region);
        }
        let Some(b) = op.bytes() else { bail!("op {i}: length overflows") };
        let Some(t) = total.checked_add(b) else { bail!("frame length overflows") };
        total = t;
        pieces = pieces.saturating_add(guard_count(op.stride, op.len, op.count).unwrap_or(u64::MAX));
    }
    if total != payload {
        bail!("frame announces {payload} payload bytes but its ops cover {total}");
    }
    if pieces > MAX_FRAME_RANGES {
        bail!("frame needs {pieces} destination pieces (limit {MAX_FRAME_RANGES}); split it");
    }
    Ok(())
}

/// Most ranges [`check_disjoint`] expands when op spans interleave.
pub const MAX_EXPANDED_RANGES: u64 = 1 << 20;

/// Errors if two ops (after bounds checks) write the same byte (the sender checks a whole post). Ops whose spans do not overlap are
/// checked in O(n log n); interleaved strided ops are expanded to their ranges (bounded).
pub fn check_disjoint(ops: &[OpDesc]) -> Result<(), WireError> {
    let mut spans: Vec<(u32, u64, u64, usize)> =
        ops.iter().enumerate().map(|(i, o)| (o.region.0, o.span().0, o.span().1, i)).collect();
    let sorted = spans.windows(2).all(|w| (w[0].0, w[0].2) <= (w[1].0, w[1].1));
    if sorted {
        return Ok(());
    }
    spans.sort_unstable();
    let mut interleaved: Vec<usize> = Vec::new();
    for w in spans.windows(2) {
        if w[0].0 == w[1].0 && w[1].1 < w[0].2 {
            interleaved.push(w[0].3);
            interleaved.push(w[1].3);
        }
    }
    if interleaved.is_empty() {
        return Ok(());
    }
    interleaved.sort_unstable();
    interleaved.dedup();
    let n: u64 = interleaved.iter().map(|i| ops[*i].count).sum();
    if n > MAX_EXPANDED_RANGES {
        bail!("{n} interleaved destination ranges in one frame (limit {MAX_EXPANDED_RANGES})");
    }
    let mut ranges: Vec<(u32, u64, u64)> = Vec::with_capacity(n as usize);
    for i in interleaved {
        let o = &ops[i];
        ranges.extend(o.ranges().map(|(off, len)| (o.region.0, off, off + len)));
    }
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        if w[0].0 == w[1].0 && w[1].1 < w[0].2 {
            bail!(
                "two ops write bytes {}..{} of region {} (destination ranges overlap)",
                w[1].1,
                w[0].2.min(w[1].2),
                w[0].0
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(offset: u64, len: u64, count: u64, stride: u64) -> OpDesc {
        OpDesc { region: RegionId(1), offset, len, count, stride }
    }

    #[test]
    fn header_roundtrip_and_rejections() {
        let h = Header { ty: FrameType::Write, flags: FLAG_LAST, n: 3, batch: 9, payload: 77, parts: 0 };
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        let mut b = h.encode();
        b[2] = 0;
        assert!(Header::decode(&b).unwrap_err().0.contains("magic"));
        let mut b = h.encode();
        b[0] = 9;
        assert!(Header::decode(&b).unwrap_err().0.contains("type"));
        let mut b = h.encode();
        b[1] = 0x80;
        assert!(Header::decode(&b).is_err());
        let bad = Header { n: MAX_OPS + 1, ..h };
        assert!(Header::decode(&bad.encode()).is_err());
        let bad = Header { n: 0, ..h };
        assert!(Header::decode(&bad.encode()).is_err());
        let note = Header { ty: FrameType::Note, flags: 0, n: MAX_NOTE + 1, batch: 0, payload: 0, parts: 0 };
        assert!(Header::decode(&note.encode()).is_err());
        let mut b = Header::new(FrameType::Ack, 1).encode();
        b[30] = 1;
        assert!(Header::decode(&b).is_err());
    }

    fn hello() -> Hello {
        Hello {
            kind: StreamKind::Control,
            index: 2,
            token: [7; 16],
            link: 5,
            identity: 6,
            streams: 2,
            nonce: [9; NONCE_BYTES],
            instance: 11,
            proof: None,
        }
    }

    #[test]
    fn hello_roundtrip_and_rejections() {
        let h = hello();
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        let mut b = h.encode();
        b[0] = b'X';
        assert!(Hello::decode(&b).is_err());
        let mut b = h.encode();
        b[4] = 9;
        assert!(Hello::decode(&b).unwrap_err().0.contains("version"));
        let mut b = h.encode();
        b[44] = 2;
        assert!(Hello::decode(&b).is_err(), "unknown flag");
        let mut b = h.encode();
        b[100] = 1;
        assert!(Hello::decode(&b).unwrap_err().0.contains("proof"), "proof bytes without the flag");
        let mut b = h.encode();
        b[80] = 12;
        assert_eq!(Hello::decode(&b).unwrap().instance, 12, "the instance travels");
        let r = encode_hello_reply(3, Some("bad token"));
        assert_eq!(r.len(), HELLO_REPLY_LEN + "bad token".len());
        let head = decode_hello_reply(r[..HELLO_REPLY_LEN].try_into().unwrap()).unwrap();
        assert_eq!(head, ReplyHead { identity: 3, rejected: true, reason_len: 9, proof: None });
        let c = Challenge { identity: 4, secret: true, nonce: [1; NONCE_BYTES] };
        assert_eq!(Challenge::decode(&c.encode()).unwrap(), c);
        let mut b = c.encode();
        b[6] = 3;
        assert!(Challenge::decode(&b).is_err());
        let mut b = c.encode();
        b[4] = 2;
        assert!(Challenge::decode(&b).unwrap_err().0.contains("version 2"));
    }

    #[test]
    fn proofs_bind_the_secret_the_challenge_and_every_field() {
        let s = Secret::new(b"cluster".to_vec()).unwrap();
        let other = Secret::new(b"other".to_vec()).unwrap();
        let c1 = Challenge { identity: 4, secret: true, nonce: [1; NONCE_BYTES] }.encode();
        let c2 = Challenge { identity: 4, secret: true, nonce: [2; NONCE_BYTES] }.encode();
        let h = hello().sign(&s, &c1);
        let wire = Hello::decode(&h.encode()).unwrap();
        assert!(wire.verify(&s, &c1));
        assert!(!wire.verify(&other, &c1), "another secret");
        assert!(!wire.verify(&s, &c2), "replayed on a stream with another challenge");
        assert!(!hello().verify(&s, &c1), "no proof");
        for (i, tweak) in [
            Hello { identity: 7, ..wire },
            Hello { link: 6, ..wire },
            Hello { index: 3, ..wire },
            Hello { kind: StreamKind::Data, ..wire },
            Hello { nonce: [8; NONCE_BYTES], ..wire },
            Hello { instance: 12, ..wire },
            Hello { token: [0; 16], ..wire },
        ]
        .iter()
        .enumerate()
        {
            assert!(!tweak.verify(&s, &c1), "field {i} changed, proof still valid");
        }
        let hb = h.encode();
        let r = encode_proved_reply(4, &s, &c1, &hb);
        let head = decode_hello_reply(&r).unwrap();
        assert!(!head.rejected && head.proof.is_some() && head.identity == 4);
        assert!(verify_reply(&s, &c1, &hb, &r));
        assert!(!verify_reply(&other, &c1, &hb, &r));
        assert!(!verify_reply(&s, &c2, &hb, &r), "reply replayed on another stream");
        let hb2 = hello().sign(&s, &c1).encode();
        let mut hb3 = hb2;
        hb3[48] ^= 1;
        assert!(!verify_reply(&s, &c1, &hb3, &r), "reply for another client nonce");
        let plain: [u8; HELLO_REPLY_LEN] = encode_hello_reply(4, None).try_into().unwrap();
        assert!(!verify_reply(&s, &c1, &hb, &plain), "a reply without a proof");
        let mut forged = r;
        forged[6] = 1;
        assert!(decode_hello_reply(&forged).unwrap_err().0.contains("rejected handshake with a proof"));
    }

    #[test]
    fn validation_catches_every_violation() {
        let v = |ops: &[OpDesc], payload| validate_write(ops, payload, &vec![1024; ops.len()]);
        assert!(v(&[op(0, 8, 4, 16)], 32).is_ok());
        // payload mismatch
        assert!(v(&[op(0, 8, 4, 16)], 33).unwrap_err().0.contains("payload"));
        // out of bounds on the last stride step only
        assert!(v(&[op(0, 8, 65, 16)], 520).unwrap_err().0.contains("out of bounds"));
        assert!(v(&[op(1020, 8, 1, 8)], 8).is_err());
        assert!(v(&[op(u64::MAX - 2, 8, 1, 8)], 8).is_err());
        // self-overlapping stride, empty op
        assert!(v(&[op(0, 8, 2, 4)], 16).is_err());
        assert!(v(&[op(0, 0, 1, 0)], 0).is_err());
        // overflowing length
        assert!(v(&[op(0, u64::MAX, 2, u64::MAX)], 0).is_err());
        // too many guard pieces
        let big = op(0, 1, MAX_FRAME_RANGES + 1, 2);
        let e = validate_write(&[big], MAX_FRAME_RANGES + 1, &[u64::MAX]).unwrap_err();
        assert!(e.0.contains("pieces"), "{e}");
    }

    #[test]
    fn disjointness_of_a_post() {
        assert!(check_disjoint(&[op(0, 16, 1, 16), op(8, 16, 1, 16)]).unwrap_err().0.contains("overlap"));
        assert!(check_disjoint(&[op(0, 8, 4, 16), op(8, 8, 4, 16)]).is_ok());
        assert!(check_disjoint(&[op(0, 8, 4, 16), op(4, 8, 4, 16)]).is_err());
        assert!(check_disjoint(&[op(64, 8, 1, 8), op(0, 8, 1, 8)]).is_ok());
    }

    #[test]
    fn guard_pieces_merge_and_split() {
        let p: Vec<_> = guard_pieces(10, 100, 100, 3).collect();
        assert_eq!(p, vec![(10, 300)]);
        let p: Vec<_> = guard_pieces(0, 2 * MAX_GUARD, MAX_GUARD + 1, 2).collect();
        assert_eq!(p, vec![(0, MAX_GUARD), (MAX_GUARD, 1), (2 * MAX_GUARD, MAX_GUARD), (3 * MAX_GUARD, 1)]);
        assert_eq!(guard_count(2 * MAX_GUARD, MAX_GUARD + 1, 2), Some(4));
        assert_eq!(guard_count(8, 8, 3 * MAX_GUARD), Some(24));
        let p: Vec<_> = guard_pieces(0, 8, 8, 3 * MAX_GUARD).collect();
        assert_eq!(p.len(), 24);
        assert_eq!(p.iter().map(|x| x.1).sum::<u64>(), 24 * MAX_GUARD);
    }

    #[test]
    fn drop_frames_are_checked() {
        let mut h = Header::new(FrameType::Drop, 4);
        h.flags = DROP_NOTE;
        h.parts = 3;
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        h.flags = DROP_PART;
        assert!(Header::decode(&h.encode()).is_err(), "a dropped part has no parts count");
        h.parts = 0;
        assert!(Header::decode(&h.encode()).is_ok());
        h.flags = DROP_PART | DROP_NOTE;
        assert!(Header::decode(&h.encode()).is_err());
    }

    #[test]
    fn descriptors_roundtrip() {
        let o = op(3, 4, 5, 6);
        let mut v = Vec::new();
        o.encode_into(&mut v);
        assert_eq!(v.len(), OP_LEN);
        assert_eq!(OpDesc::decode(&v).unwrap(), o);
        v[5] = 1;
        assert!(OpDesc::decode(&v).is_err());
    }
}
