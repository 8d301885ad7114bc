//! The control channel's frames: a prefill endpoint's one TCP connection to each decode endpoint it
//! writes to (same node, normally loopback). Data never crosses it: it carries the handshake,
//! notifications (after the copies they cover completed), and the revoke exchange that fences a
//! closing registration.
//!
//! A frame is `type: u8, len: u32 LE, payload: len bytes`, at most [`MAX_PAYLOAD`] bytes of payload.
//!
//! | type | direction | payload |
//! |---|---|---|
//! | HELLO | prefill -> decode | magic `KVXI`, version u16, token (16), identity u64, nonce (32) |
//! | WELCOME | decode -> prefill | identity u64, secret flag u8, nonce (32), proof (32, zero without secret) |
//! | PROOF | prefill -> decode | proof (32, zero without secret) |
//! | READY | decode -> prefill | empty |
//! | REJECT | either | reason (UTF-8) |
//! | NOTE | prefill -> decode | an encoded notification |
//! | REVOKE | decode -> prefill | region u32, seq u64 |
//! | REVOKED | prefill -> decode | seq u64 |
//! | BYE | prefill -> decode | empty |

use kvxfer_core::secret::{NONCE_BYTES, PROOF_BYTES};

/// Magic of a HELLO.
pub const MAGIC: [u8; 4] = *b"KVXI";
/// Protocol version this build speaks.
pub const VERSION: u16 = 1;
/// Access token bytes.
pub const TOKEN_LEN: usize = 16;
/// Bytes of a frame header.
pub const HEADER_LEN: usize = 5;
/// Largest payload (an encoded notification with the largest aux/state payload, or a reason).
pub const MAX_PAYLOAD: u32 = (kvxfer_core::notify::MAX_PAYLOAD + 64) as u32;
/// Longest reject reason sent.
pub const MAX_REASON: usize = 1024;

/// Frame types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Type {
    /// The connecting side's hello.
    Hello = 1,
    /// The accepting side's answer.
    Welcome = 2,
    /// The connecting side's proof.
    Proof = 3,
    /// Admitted.
    Ready = 4,
    /// Refused, with a reason.
    Reject = 5,
    /// A notification.
    Note = 6,
    /// Stop writing a region, then say so.
    Revoke = 7,
    /// A region is no longer written.
    Revoked = 8,
    /// Closing.
    Bye = 9,
}

/// A malformed frame, with what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cuda-ipc control frame: {0}")]
pub struct WireError(pub String);

impl Type {
    /// The type of a header byte.
    pub fn of(b: u8) -> Result<Type, WireError> {
        Ok(match b {
            1 => Type::Hello,
            2 => Type::Welcome,
            3 => Type::Proof,
            4 => Type::Ready,
            5 => Type::Reject,
            6 => Type::Note,
            7 => Type::Revoke,
            8 => Type::Revoked,
            9 => Type::Bye,
            _ => return Err(WireError(format!("unknown frame type {b}"))),
        })
    }
}

/// A header: type and payload length (checked against [`MAX_PAYLOAD`]).
pub fn decode_header(h: &[u8; HEADER_LEN]) -> Result<(Type, u32), WireError> {
    let ty = Type::of(h[0])?;
    let len = u32::from_le_bytes([h[1], h[2], h[3], h[4]]);
    if len > MAX_PAYLOAD {
        return Err(WireError(format!("{ty:?} frame of {len} bytes is over the limit of {MAX_PAYLOAD}")));
    }
    Ok((ty, len))
}

/// A whole frame.
pub fn frame(ty: Type, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(HEADER_LEN + payload.len());
    f.push(ty as u8);
    f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    f.extend_from_slice(payload);
    f
}

fn take<const N: usize>(p: &[u8], at: &mut usize, what: &str) -> Result<[u8; N], WireError> {
    let s = p.get(*at..*at + N).ok_or_else(|| WireError(format!("{what}: {} bytes, too short", p.len())))?;
    *at += N;
    Ok(s.try_into().expect("N bytes"))
}

fn done(p: &[u8], at: usize, what: &str) -> Result<(), WireError> {
    if at != p.len() {
        return Err(WireError(format!("{what}: {} bytes, expected {at}", p.len())));
    }
    Ok(())
}

/// HELLO.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The decode endpoint's token (from its metadata).
    pub token: [u8; TOKEN_LEN],
    /// The connecting endpoint's identity.
    pub identity: u64,
    /// The connecting side's fresh nonce.
    pub nonce: [u8; NONCE_BYTES],
}

impl Hello {
    /// The frame.
    pub fn encode(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(4 + 2 + TOKEN_LEN + 8 + NONCE_BYTES);
        p.extend_from_slice(&MAGIC);
        p.extend_from_slice(&VERSION.to_le_bytes());
        p.extend_from_slice(&self.token);
        p.extend_from_slice(&self.identity.to_le_bytes());
        p.extend_from_slice(&self.nonce);
        frame(Type::Hello, &p)
    }

    /// From a HELLO payload.
    pub fn decode(p: &[u8]) -> Result<Self, WireError> {
        let mut at = 0;
        let magic: [u8; 4] = take(p, &mut at, "HELLO")?;
        if magic != MAGIC {
            return Err(WireError(format!("HELLO magic {magic:?}: not a kvxfer cuda-ipc peer")));
        }
        let version = u16::from_le_bytes(take(p, &mut at, "HELLO")?);
        if version != VERSION {
            return Err(WireError(format!("peer speaks cuda-ipc control version {version}, this build {VERSION}")));
        }
        let token = take(p, &mut at, "HELLO")?;
        let identity = u64::from_le_bytes(take(p, &mut at, "HELLO")?);
        let nonce = take(p, &mut at, "HELLO")?;
        done(p, at, "HELLO")?;
        Ok(Hello { token, identity, nonce })
    }
}

/// WELCOME.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Welcome {
    /// The accepting endpoint's identity.
    pub identity: u64,
    /// Whether it has a cluster secret.
    pub secret: bool,
    /// Its fresh nonce.
    pub nonce: [u8; NONCE_BYTES],
    /// Its proof (zero without a secret).
    pub proof: [u8; PROOF_BYTES],
}

impl Welcome {
    /// The frame.
    pub fn encode(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(8 + 1 + NONCE_BYTES + PROOF_BYTES);
        p.extend_from_slice(&self.identity.to_le_bytes());
        p.push(u8::from(self.secret));
        p.extend_from_slice(&self.nonce);
        p.extend_from_slice(&self.proof);
        frame(Type::Welcome, &p)
    }

    /// From a WELCOME payload.
    pub fn decode(p: &[u8]) -> Result<Self, WireError> {
        let mut at = 0;
        let identity = u64::from_le_bytes(take(p, &mut at, "WELCOME")?);
        let [flag] = take(p, &mut at, "WELCOME")?;
        let nonce = take(p, &mut at, "WELCOME")?;
        let proof = take(p, &mut at, "WELCOME")?;
        done(p, at, "WELCOME")?;
        Ok(Welcome { identity, secret: flag != 0, nonce, proof })
    }
}

/// A fixed-size payload: a PROOF (32 bytes), a REVOKE (region u32, seq u64) or a REVOKED (seq u64).
pub fn revoke(region: u32, seq: u64) -> Vec<u8> {
    let mut p = region.to_le_bytes().to_vec();
    p.extend_from_slice(&seq.to_le_bytes());
    frame(Type::Revoke, &p)
}

/// From a REVOKE payload: (region, seq).
pub fn decode_revoke(p: &[u8]) -> Result<(u32, u64), WireError> {
    let mut at = 0;
    let r = u32::from_le_bytes(take(p, &mut at, "REVOKE")?);
    let s = u64::from_le_bytes(take(p, &mut at, "REVOKE")?);
    done(p, at, "REVOKE")?;
    Ok((r, s))
}

/// A REVOKED frame.
pub fn revoked(seq: u64) -> Vec<u8> {
    frame(Type::Revoked, &seq.to_le_bytes())
}

/// From a REVOKED payload.
pub fn decode_revoked(p: &[u8]) -> Result<u64, WireError> {
    let mut at = 0;
    let s = u64::from_le_bytes(take(p, &mut at, "REVOKED")?);
    done(p, at, "REVOKED")?;
    Ok(s)
}

/// From a PROOF payload.
pub fn decode_proof(p: &[u8]) -> Result<[u8; PROOF_BYTES], WireError> {
    let mut at = 0;
    let proof = take(p, &mut at, "PROOF")?;
    done(p, at, "PROOF")?;
    Ok(proof)
}

/// A REJECT frame with `reason` (cut to [`MAX_REASON`] bytes at a character boundary).
pub fn reject(reason: &str) -> Vec<u8> {
    let mut end = reason.len().min(MAX_REASON);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    frame(Type::Reject, &reason.as_bytes()[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let h = Hello { token: [7; TOKEN_LEN], identity: 42, nonce: [9; NONCE_BYTES] };
        let f = h.encode();
        let (ty, len) = decode_header(f[..HEADER_LEN].try_into().unwrap()).unwrap();
        assert_eq!((ty, len as usize), (Type::Hello, f.len() - HEADER_LEN));
        assert_eq!(Hello::decode(&f[HEADER_LEN..]).unwrap(), h);
        let w = Welcome { identity: 5, secret: true, nonce: [1; NONCE_BYTES], proof: [2; PROOF_BYTES] };
        assert_eq!(Welcome::decode(&w.encode()[HEADER_LEN..]).unwrap(), w);
        assert_eq!(decode_revoke(&revoke(3, 99)[HEADER_LEN..]).unwrap(), (3, 99));
        assert_eq!(decode_revoked(&revoked(99)[HEADER_LEN..]).unwrap(), 99);
        let long = "é".repeat(MAX_REASON);
        let r = reject(&long);
        assert!(r.len() - HEADER_LEN <= MAX_REASON && std::str::from_utf8(&r[HEADER_LEN..]).is_ok());
    }

    #[test]
    fn malformed_frames_are_errors_naming_the_frame() {
        assert!(decode_header(&[77, 0, 0, 0, 0]).unwrap_err().0.contains("unknown frame type 77"));
        assert!(decode_header(&[6, 0xff, 0xff, 0xff, 0xff]).unwrap_err().0.contains("over the limit"));
        let mut h = Hello { token: [0; TOKEN_LEN], identity: 1, nonce: [0; NONCE_BYTES] }.encode();
        h[HEADER_LEN] = b'X';
        assert!(Hello::decode(&h[HEADER_LEN..]).unwrap_err().0.contains("not a kvxfer cuda-ipc peer"));
        assert!(decode_revoke(&[1, 2, 3]).unwrap_err().0.contains("REVOKE"));
        assert!(decode_revoked(&[0; 9]).is_err());
    }

    proptest::proptest! {
        /// No input makes a decoder panic.
        #[test]
        fn decoders_never_panic(b in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..128)) {
            let _ = Hello::decode(&b);
            let _ = Welcome::decode(&b);
            let _ = decode_revoke(&b);
            let _ = decode_revoked(&b);
            let _ = decode_proof(&b);
            if b.len() >= HEADER_LEN {
                let _ = decode_header(b[..HEADER_LEN].try_into().unwrap());
            }
        }
    }
}
