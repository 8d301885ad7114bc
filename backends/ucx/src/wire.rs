//! What UCX endpoints tell each other: the metadata payload and the active-message header.
//!
//! Metadata payload (JSON inside [`kvxfer_core::EndpointMetadata::payload`]):
//! `{"v":3,"instance":..,"ucx":"1.13.1","worker":"<hex>","regions":[{"id":..,"addr":..,"len":..,"rkey":"<hex>"}],"proc":{..},"mm_seg":32832}`.
//! `worker` is the UCP worker address (it lists every transport the worker can be reached by, so
//! peers on the same host pick shared memory and cma, others tcp or RDMA); `rkey` is the packed
//! remote key of a registered region.
//!
//! Active-message header (18 bytes, little endian): `kind u8, flags u8, instance u64, identity u64`;
//! the data is the kind's body: an encoded [`kvxfer_core::Notification`] (kinds 1 and 2), a JSON
//! [`Hello`] (3), nothing (goodbye, 4), data-path messages (5 to 7, see [`DataMsg`]), the region
//! revocation and its acknowledgement (8, 9), the answer to a hello (10) and, with a cluster secret,
//! the authentication exchange (11 to 13, see [`Exchange`]); see [`Kind`].

use kvxfer_core::secret::{Exchange, NONCE_BYTES, PROOF_BYTES};
use serde::{Deserialize, Serialize};

use crate::liveness::ProcId;

/// Version of the JSON payload.
/// 3: `mm_seg` (the shared-memory segment size, which peers on one host must share).
pub(crate) const PAYLOAD_VERSION: u32 = 3;

/// One registered region as published.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RegionMeta {
    /// Region id.
    pub id: u32,
    /// Virtual address in the owner's process.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Packed remote key, hex (empty for a zero-length region).
    pub rkey: String,
}

/// The backend-specific part of the endpoint metadata.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Payload {
    /// Payload version.
    pub v: u32,
    /// Random id of the endpoint instance (distinguishes restarts with the same identity).
    pub instance: u64,
    /// UCX version of the publisher (informational).
    pub ucx: String,
    /// Worker address, hex.
    pub worker: String,
    /// Registered regions.
    pub regions: Vec<RegionMeta>,
    /// The publishing process (for liveness checks of shared-memory peers).
    pub proc: ProcId,
    /// The publisher's shared-memory segment size ([`crate::mmseg`]); 0 without shared memory.
    pub mm_seg: u64,
}

/// The body of a hello: how to reach (and watch) the connecting endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Hello {
    /// Matches the [`Kind::Welcome`] answer to this hello.
    pub nonce: u64,
    /// Worker address, hex.
    pub worker: String,
    /// The connecting process.
    pub proc: ProcId,
    /// The connecting side's fresh challenge nonce ([`NONCE_BYTES`] bytes, hex); empty from a
    /// build without authentication.
    #[serde(default)]
    pub challenge: String,
    /// The connector's shared-memory segment size ([`crate::mmseg`]); 0 without shared memory.
    #[serde(default)]
    pub mm_seg: u64,
    /// The connector writes with active messages (`data=am`), which the receiver places itself and
    /// can refuse; false (or absent: an older build) means `ucp_put_nbx`, which it cannot refuse
    /// (see the crate README, "Cutting a peer off"). Not serialized when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub am: bool,
}

/// Lower-case hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    const D: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(D[(b >> 4) as usize] as char);
        s.push(D[(b & 15) as usize] as char);
    }
    s
}

/// Parses lower- or upper-case hex.
pub(crate) fn unhex(s: &str) -> Result<Vec<u8>, String> {
    if s.len() % 2 != 0 {
        return Err(format!("hex string of odd length {}", s.len()));
    }
    let digit = |c: u8| -> Result<u8, String> {
        match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            b'A'..=b'F' => Ok(c - b'A' + 10),
            _ => Err(format!("not a hex digit: {:?}", c as char)),
        }
    };
    s.as_bytes().chunks(2).map(|p| Ok(digit(p[0])? << 4 | digit(p[1])?)).collect()
}

/// What an active message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A notification attached to a transfer (posted after the transfer's flush).
    Attached = 1,
    /// A notification sent with `notify` (out of band).
    OutOfBand = 2,
    /// A connecting peer introduces itself (JSON [`Hello`]), so we can watch and answer it.
    Hello = 3,
    /// A peer disconnects (flag 0) or shuts down (flag [`GOODBYE_SHUTDOWN`]).
    Goodbye = 4,
    /// Transfer data carried in the message (the active-message data path, see the crate docs).
    Data = 5,
    /// End of one transfer on the active-message data path (`seq u64`, then the attached
    /// notification); flag [`COMMIT_ABORTED`]: the transfer was aborted, deliver nothing.
    Commit = 6,
    /// The receiver placed (or refused) one transfer of the active-message data path.
    Ack = 7,
    /// The sender closed a region (`seq u64, region u32`): peers forget its remote key, finish
    /// their puts into it, and answer with [`Kind::RevokeAck`].
    Revoke = 8,
    /// Every put into a revoked region is complete and none will follow (`seq u64`).
    RevokeAck = 9,
    /// The answer to a hello (`nonce u64`, then the `u32` ids of the regions registered now): the
    /// connecting side keeps only those remote keys. With a secret, sent only after the connecting
    /// side proved it ([`Kind::Auth`]).
    Welcome = 10,
    /// With a secret, the accepting side's answer to a hello: `nonce u64, acceptor nonce [32],
    /// acceptor proof [32]` (see [`Exchange`]).
    Challenge = 11,
    /// The connecting side's proof: `nonce u64, connector proof [32]`.
    Auth = 12,
    /// The accepting side refuses a connection (`nonce u64`, then the reason, UTF-8): the hello's
    /// nonce while connecting; 0 for an established connection it closes (a forged notification).
    Refused = 13,
}

/// Goodbye flag: the whole endpoint is going away (not just one connection).
pub(crate) const GOODBYE_SHUTDOWN: u8 = 1;
/// Commit flag: the transfer was aborted.
pub(crate) const COMMIT_ABORTED: u8 = 1;

/// The decoded header of an active message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    /// Kind.
    pub kind: Kind,
    /// Kind-specific flags.
    pub flags: u8,
    /// Sender's instance.
    pub instance: u64,
    /// Sender's identity.
    pub identity: u64,
}

const HEADER_LEN: usize = 18;

impl Header {
    /// Encodes.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(HEADER_LEN);
        v.push(self.kind as u8);
        v.push(self.flags);
        v.extend_from_slice(&self.instance.to_le_bytes());
        v.extend_from_slice(&self.identity.to_le_bytes());
        v
    }

    /// Decodes, rejecting a wrong length or an unknown kind.
    pub fn decode(b: &[u8]) -> Result<Self, String> {
        if b.len() != HEADER_LEN {
            return Err(format!("active-message header of {} bytes, expected {HEADER_LEN}", b.len()));
        }
        let kind = match b[0] {
            1 => Kind::Attached,
            2 => Kind::OutOfBand,
            3 => Kind::Hello,
            4 => Kind::Goodbye,
            5 => Kind::Data,
            6 => Kind::Commit,
            7 => Kind::Ack,
            8 => Kind::Revoke,
            9 => Kind::RevokeAck,
            10 => Kind::Welcome,
            11 => Kind::Challenge,
            12 => Kind::Auth,
            13 => Kind::Refused,
            k => return Err(format!("unknown active-message kind {k}")),
        };
        let u = |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().expect("8 bytes"));
        Ok(Self { kind, flags: b[1], instance: u(2..10), identity: u(10..18) })
    }
}

/// The connect-time authentication exchange (with a cluster secret on both sides), computed by the
/// toolkit's [`Exchange`] with the protocol label [`AUTH_PROTOCOL`]:
///
/// 1. hello (connector to acceptor): carries the connector's fresh nonce `nc`;
/// 2. [`Kind::Challenge`] (acceptor to connector): the acceptor's fresh nonce `na` and
///    [`Exchange::acceptor_proof`]; the connector verifies it (mutual: a peer without the secret
///    cannot answer);
/// 3. [`Kind::Auth`] (connector to acceptor): [`Exchange::connector_proof`]; the acceptor verifies it,
///    then (4.) answers with the welcome, or with [`Kind::Refused`].
///
/// Both endpoints enter as (identity, instance id).
pub(crate) const AUTH_PROTOCOL: &str = "kvxfer-ucx";

/// The exchange between `connector` and `acceptor` (each `(identity, instance)`) on this wire.
pub(crate) fn exchange(
    connector_nonce: [u8; NONCE_BYTES],
    acceptor_nonce: [u8; NONCE_BYTES],
    connector: (u64, u64),
    acceptor: (u64, u64),
) -> Exchange {
    Exchange { protocol: AUTH_PROTOCOL, connector_nonce, acceptor_nonce, connector, acceptor }
}

/// Length of a challenge body: `nonce u64, acceptor nonce, acceptor proof`.
pub(crate) const CHALLENGE_LEN: usize = 8 + NONCE_BYTES + PROOF_BYTES;
/// Length of an auth body: `nonce u64, connector proof`.
pub(crate) const AUTH_LEN: usize = 8 + PROOF_BYTES;

/// Encodes a challenge body.
pub(crate) fn encode_challenge(nonce: u64, acceptor_nonce: &[u8; NONCE_BYTES], proof: &[u8; PROOF_BYTES]) -> Vec<u8> {
    let mut v = Vec::with_capacity(CHALLENGE_LEN);
    v.extend_from_slice(&nonce.to_le_bytes());
    v.extend_from_slice(acceptor_nonce);
    v.extend_from_slice(proof);
    v
}

/// Decodes a challenge body: `(nonce, acceptor nonce, acceptor proof)`.
pub(crate) fn decode_challenge(b: &[u8]) -> Result<(u64, [u8; NONCE_BYTES], [u8; PROOF_BYTES]), String> {
    if b.len() != CHALLENGE_LEN {
        return Err(format!("challenge of {} bytes, expected {CHALLENGE_LEN}", b.len()));
    }
    let nonce = u64_at(b, 0).expect("length checked");
    let n = b[8..8 + NONCE_BYTES].try_into().expect("length checked");
    let p = b[8 + NONCE_BYTES..].try_into().expect("length checked");
    Ok((nonce, n, p))
}

/// Encodes an auth body.
pub(crate) fn encode_auth(nonce: u64, proof: &[u8; PROOF_BYTES]) -> Vec<u8> {
    let mut v = Vec::with_capacity(AUTH_LEN);
    v.extend_from_slice(&nonce.to_le_bytes());
    v.extend_from_slice(proof);
    v
}

/// Decodes an auth body: `(nonce, connector proof)`.
pub(crate) fn decode_auth(b: &[u8]) -> Result<(u64, [u8; PROOF_BYTES]), String> {
    if b.len() != AUTH_LEN {
        return Err(format!("auth message of {} bytes, expected {AUTH_LEN}", b.len()));
    }
    Ok((u64_at(b, 0).expect("length checked"), b[8..].try_into().expect("length checked")))
}

/// Most bytes of a refusal's reason.
pub(crate) const MAX_REFUSAL: usize = 1024;

/// Encodes a refusal body (the reason truncated to [`MAX_REFUSAL`] bytes at a character boundary).
pub(crate) fn encode_refused(nonce: u64, reason: &str) -> Vec<u8> {
    let mut end = reason.len().min(MAX_REFUSAL);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let mut v = nonce.to_le_bytes().to_vec();
    v.extend_from_slice(&reason.as_bytes()[..end]);
    v
}

/// Decodes a refusal body: `(nonce, reason)`; the reason must be UTF-8 of at most [`MAX_REFUSAL`] bytes.
pub(crate) fn decode_refused(b: &[u8]) -> Result<(u64, &str), String> {
    let Some(nonce) = u64_at(b, 0) else { return Err(format!("refusal of {} bytes", b.len())) };
    if b.len() - 8 > MAX_REFUSAL {
        return Err(format!("refusal reason of {} bytes, at most {MAX_REFUSAL}", b.len() - 8));
    }
    let reason = std::str::from_utf8(&b[8..]).map_err(|_| "refusal reason is not UTF-8".to_owned())?;
    Ok((nonce, reason))
}

/// Reads a little-endian u64 at `at`.
pub(crate) fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    b.get(at..at + 8).map(|x| u64::from_le_bytes(x.try_into().expect("8 bytes")))
}

/// Reads a little-endian u32 at `at`.
pub(crate) fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    b.get(at..at + 4).map(|x| u32::from_le_bytes(x.try_into().expect("4 bytes")))
}

/// Largest data message body on the active-message path.
pub(crate) const DATA_MSG_MAX: usize = 1 << 20;
const DATA_HEAD: usize = 12;
/// Bytes of a segment header in a data message (region u32, offset u64, len u64).
pub(crate) const SEG_HEAD: usize = 20;

/// One data message of one transfer: `seq u64, count u32`, then per segment
/// `region u32, offset u64, len u64, bytes`; at most [`DATA_MSG_MAX`] bytes.
pub(crate) struct DataMsg {
    buf: Vec<u8>,
    count: u32,
}

impl DataMsg {
    /// An empty message of transfer `seq`.
    pub fn new(seq: u64) -> Self {
        let mut buf = Vec::with_capacity(DATA_MSG_MAX);
        buf.extend_from_slice(&seq.to_le_bytes());
        buf.extend_from_slice(&0u32.to_le_bytes());
        Self { buf, count: 0 }
    }

    /// Payload bytes the next segment may carry (0: the message is full).
    pub fn room(&self) -> usize {
        DATA_MSG_MAX.saturating_sub(self.buf.len() + SEG_HEAD)
    }

    /// Segments so far.
    #[cfg(test)]
    pub fn count(&self) -> u32 {
        self.count
    }

    /// Appends a segment of `len` bytes for `region` at `offset`, filled by `fill` (tests and fuzz seeds).
    #[cfg(any(test, fuzzing, feature = "fuzzing"))]
    pub fn push<E>(
        &mut self,
        region: u32,
        offset: u64,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> Result<(), E>,
    ) -> Result<(), E> {
        self.head(region, offset, len);
        let at = self.buf.len();
        self.buf.resize(at + len, 0);
        fill(&mut self.buf[at..])?;
        self.count += 1;
        Ok(())
    }

    /// Appends a segment carrying `bytes` for `region` at `offset` (no more than [`Self::room`]).
    pub fn push_bytes(&mut self, region: u32, offset: u64, bytes: &[u8]) {
        self.head(region, offset, bytes.len());
        self.buf.extend_from_slice(bytes);
        self.count += 1;
    }

    fn head(&mut self, region: u32, offset: u64, len: usize) {
        self.buf.extend_from_slice(&region.to_le_bytes());
        self.buf.extend_from_slice(&offset.to_le_bytes());
        self.buf.extend_from_slice(&(len as u64).to_le_bytes());
    }

    /// The encoded message.
    pub fn finish(mut self) -> Vec<u8> {
        self.buf[8..12].copy_from_slice(&self.count.to_le_bytes());
        self.buf
    }
}

/// A decoded data message: `(seq, segments of (region, offset, bytes))`.
pub(crate) type Decoded<'a> = (u64, Vec<(u32, u64, &'a [u8])>);

/// Decodes one data message.
pub(crate) fn decode_data(b: &[u8]) -> Result<Decoded<'_>, String> {
    let (Some(seq), Some(count)) = (u64_at(b, 0), u32_at(b, 8)) else {
        return Err(format!("data message of {} bytes", b.len()));
    };
    let mut segs = Vec::with_capacity(count.min(1024) as usize);
    let mut at = DATA_HEAD;
    for _ in 0..count {
        let (Some(region), Some(off), Some(len)) = (u32_at(b, at), u64_at(b, at + 4), u64_at(b, at + 12)) else {
            return Err("truncated data segment header".into());
        };
        at += SEG_HEAD;
        let end = usize::try_from(len).ok().and_then(|l| at.checked_add(l)).filter(|&e| e <= b.len());
        let Some(end) = end else { return Err("truncated data segment".into()) };
        segs.push((region, off, &b[at..end]));
        at = end;
    }
    if at != b.len() {
        return Err("trailing bytes after the data segments".into());
    }
    Ok((seq, segs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_rejects_garbage() {
        let b = [0u8, 1, 0xab, 0xff];
        assert_eq!(hex(&b), "0001abff");
        assert_eq!(unhex("0001ABff").unwrap(), b);
        assert!(unhex("abc").is_err());
        assert!(unhex("zz").is_err());
    }

    #[test]
    fn data_messages_round_trip_and_stay_under_the_limit() {
        let mut m = DataMsg::new(42);
        m.push(3, 10, 100, |out| -> Result<(), ()> {
            out.fill(7);
            Ok(())
        })
        .unwrap();
        m.push_bytes(4, 5000, &[1, 2, 3]);
        assert_eq!(m.count(), 2);
        assert!(m.room() < DATA_MSG_MAX - 100);
        let b = m.finish();
        let (seq, segs) = decode_data(&b).unwrap();
        assert_eq!(seq, 42);
        assert_eq!(segs, vec![(3, 10, &[7u8; 100][..]), (4, 5000, &[1u8, 2, 3][..])]);
        let mut bad = b.clone();
        bad.truncate(bad.len() - 1);
        assert!(decode_data(&bad).is_err());
        assert!(decode_data(&[0; 3]).is_err());
        let mut full = DataMsg::new(1);
        let room = full.room();
        full.push(1, 0, room, |_| -> Result<(), ()> { Ok(()) }).unwrap();
        assert_eq!(full.room(), 0);
        assert_eq!(full.finish().len(), DATA_MSG_MAX);
    }

    #[test]
    fn the_exchange_is_the_toolkits_with_this_wires_label() {
        let s = kvxfer_core::Secret::new(b"cluster".to_vec()).unwrap();
        let x = exchange([1; NONCE_BYTES], [2; NONCE_BYTES], (0x10, 0x11), (0x20, 0x21));
        let (a, c) = (x.acceptor_proof(&s), x.connector_proof(&s));
        assert!(x.verify_acceptor(&s, &a) && x.verify_connector(&s, &c));
        assert!(!x.verify_connector(&s, &a), "a proof cannot be reflected");
        let other = Exchange { protocol: "kvxfer-fabric", ..x };
        assert!(!other.verify_acceptor(&s, &a) && !other.verify_connector(&s, &c), "another backend's label");
    }

    #[test]
    fn auth_messages_round_trip_and_reject_garbage() {
        let c = encode_challenge(7, &[3; NONCE_BYTES], &[4; PROOF_BYTES]);
        assert_eq!(decode_challenge(&c).unwrap(), (7, [3; NONCE_BYTES], [4; PROOF_BYTES]));
        assert!(decode_challenge(&c[..c.len() - 1]).is_err());
        let a = encode_auth(9, &[5; PROOF_BYTES]);
        assert_eq!(decode_auth(&a).unwrap(), (9, [5; PROOF_BYTES]));
        assert!(decode_auth(&[a.clone(), vec![0]].concat()).is_err());
        let r = encode_refused(0, "authentication failed");
        assert_eq!(decode_refused(&r).unwrap(), (0, "authentication failed"));
        let long = "é".repeat(MAX_REFUSAL);
        let r = encode_refused(1, &long);
        assert!(r.len() - 8 <= MAX_REFUSAL && decode_refused(&r).is_ok());
        assert!(decode_refused(&[0; 7]).is_err());
        assert!(decode_refused(&[0, 0, 0, 0, 0, 0, 0, 0, 0xff]).is_err());
    }

    #[test]
    fn header_round_trips_and_rejects_garbage() {
        let h = Header { kind: Kind::Goodbye, flags: GOODBYE_SHUTDOWN, instance: 7, identity: u64::MAX };
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        assert!(Header::decode(&h.encode()[..17]).is_err());
        let mut bad = h.encode();
        bad[0] = 14;
        assert!(Header::decode(&bad).is_err());
    }
}
