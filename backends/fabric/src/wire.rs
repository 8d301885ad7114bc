//! What travels besides the data: the endpoint-metadata payload and the messages between endpoints.
//!
//! Every message is a 20-byte header (kind, sender nonce, receiver nonce, sequence) and a body.
//! Header bytes: magic 0xfb, kind, 2 flag bytes (0 but in a hello, see [`hello_flags`]; ignored by
//! every other kind), then the sender nonce (u32), the receiver nonce (u32) and the sequence (u64),
//! little endian.
//! Notification bodies are fragments of the toolkit's [`kvxfer_core::toolkit::Fragmenter`] (sized to
//! the receiver's posted buffers) and are put back together by its `Reassembler`; [`Staged`] pairs
//! an attached notification with the remote-CQ-data token of its last write. A connect is an
//! exchange ([`Exchange`]): hello, then challenge and auth (with a cluster secret), then welcome or
//! refusal.

use std::collections::HashMap;

use kvxfer_core::secret::{Exchange, NONCE_BYTES, PROOF_BYTES};
use serde::{Deserialize, Serialize};

/// Version of [`Payload`] and of the messages; `connect` rejects others. Version 3: the hello
/// carries a connection id and a challenge nonce, and is answered (challenge, auth, welcome,
/// refused).
pub const WIRE_VERSION: u32 = 3;

/// One registered region as a peer sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionMeta {
    /// The region id.
    pub id: u32,
    /// Its length in bytes.
    pub len: u64,
    /// Remote key.
    pub key: u64,
    /// Base address for remote writes (the virtual address under `FI_MR_VIRT_ADDR`, else 0).
    pub base: u64,
}

/// The backend-specific part of [`kvxfer_core::EndpointMetadata`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Payload {
    /// [`WIRE_VERSION`].
    pub wire: u32,
    /// The provider that made the address (`tcp;ofi_rxm`, `shm`); peers must use the same.
    pub provider: String,
    /// The endpoint's `fi_getname` address.
    pub addr: Vec<u8>,
    /// Size of the receive buffers the endpoint posts: the largest message a peer may send it.
    pub recv_buf: u32,
    /// Whether the endpoint accepts attached notifications as remote CQ data on the last write.
    pub cq_data: bool,
    /// The endpoint's nonce (random per backend instance); messages to it carry it.
    pub nonce: u32,
    /// The endpoint's process id (shm peers, on the same host, check it is alive before posting).
    pub pid: u32,
    /// Registered regions.
    pub regions: Vec<RegionMeta>,
}

/// Bytes of a message header.
pub const HEADER: usize = 20;
const MAGIC: u8 = 0xfb;

/// What a message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A notification fragment, delivered as soon as the notification is complete.
    Notify = 1,
    /// A fragment of a notification to deliver once the remote CQ data `seq` has arrived (attached
    /// style over remote CQ data).
    Staged = 2,
    /// "I am alive": sent periodically to the peers an endpoint connected to; `seq` is its identity.
    Heartbeat = 3,
    /// The sending endpoint is closing (dropped): the receiver reports the peer lost at once.
    Gone = 4,
    /// The sender disconnected on purpose and writes no more: forget it without reporting a loss.
    Bye = 5,
    /// The first message after `connect`: `seq` is the identity, the body [`greeting`] (pid,
    /// connection id, challenge nonce, address), so the receiver can answer and send revokes back.
    Hello = 6,
    /// "Stop writing into my region (body: u32 id, then my address); acknowledge with `seq` once your
    /// writes into it completed."
    Revoke = 7,
    /// The acknowledgement of the revoke `seq`.
    RevokeAck = 8,
    /// With a cluster secret, the answer to a hello: `seq` is the connection id, the body the
    /// acceptor's nonce and proof ([`Exchange`]).
    Challenge = 9,
    /// The connector's proof (`seq`: the connection id; body: the proof).
    Auth = 10,
    /// The connection is admitted (`seq`: the connection id; body: [`welcome`], the remote keys
    /// registered for the connecting instance alone, as many as fit, and their total; the rest
    /// follow in [`Kind::Keys`] messages).
    Welcome = 11,
    /// The connection is refused (`seq`: the connection id, or 0 for an established connection the
    /// receiver closes after a forged notification; body: the reason, UTF-8).
    Refused = 12,
    /// Remote keys for the connecting endpoint alone that did not fit in the welcome (`seq`: the
    /// connection id; body: [`keys`]). A registration of each region per peer instance, so that
    /// cutting one instance off revokes its keys only; the connector completes when it has them all.
    Keys = 13,
}

/// Hello flag: the flag bytes carry the connector's capabilities (absent from older builds).
pub const CAP_PRESENT: u8 = 0x80;
/// Hello flag: the connector's writes carry `FI_DELIVERY_COMPLETE`.
pub const CAP_DELIVERY_COMPLETE: u8 = 1;
/// Hello flag: shm, and cross-memory attach is usable from the connector to the acceptor
/// (`FI_SHM_DISABLE_CMA` and `FI_SHM_USE_DSA_SAR` unset, `process_vm_writev` permitted).
pub const CAP_CMA: u8 = 2;

/// The flag bytes of a hello: capabilities ([`CAP_PRESENT`] and the others) and the base-2
/// logarithm of the connector's receive buffer size, rounded down (the acceptor's answer fits it).
pub fn hello_flags(caps: u8, recv_buf: usize) -> [u8; 2] {
    [caps | CAP_PRESENT, recv_buf.max(1).ilog2() as u8]
}

/// The capabilities and the receive buffer size (a lower bound) a hello's flag bytes announce;
/// `None` from an older build.
pub fn split_hello_flags(flags: [u8; 2]) -> Option<(u8, usize)> {
    (flags[0] & CAP_PRESENT != 0 && flags[1] < 32).then(|| (flags[0] & !CAP_PRESENT, 1usize << flags[1]))
}

/// Bytes of one entry of a [`keys`] body.
pub const KEY_ENTRY: usize = 28;

impl Kind {
    fn from_u8(k: u8) -> Option<Self> {
        Some(match k {
            1 => Kind::Notify,
            2 => Kind::Staged,
            3 => Kind::Heartbeat,
            4 => Kind::Gone,
            5 => Kind::Bye,
            6 => Kind::Hello,
            7 => Kind::Revoke,
            8 => Kind::RevokeAck,
            9 => Kind::Challenge,
            10 => Kind::Auth,
            11 => Kind::Welcome,
            12 => Kind::Refused,
            13 => Kind::Keys,
            _ => return None,
        })
    }
}

/// A parsed message header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Kind.
    pub kind: Kind,
    /// The sender endpoint's nonce.
    pub nonce: u32,
    /// The receiving endpoint's nonce (from its metadata): a message for an earlier owner of a recycled
    /// endpoint address is dropped.
    pub dest: u32,
    /// Sequence (identity, CQ-data token or revoke number, by kind).
    pub seq: u64,
    /// The flag bytes (meaningful in a hello only, [`hello_flags`]).
    pub flags: [u8; 2],
}

/// A message: header and body.
pub fn message(kind: Kind, nonce: u32, dest: u32, seq: u64, body: &[u8]) -> Vec<u8> {
    message_flagged(kind, [0, 0], nonce, dest, seq, body)
}

/// A message with flag bytes (a hello's, [`hello_flags`]).
pub fn message_flagged(kind: Kind, flags: [u8; 2], nonce: u32, dest: u32, seq: u64, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(HEADER + body.len());
    f.extend_from_slice(&[MAGIC, kind as u8, flags[0], flags[1]]);
    f.extend_from_slice(&nonce.to_le_bytes());
    f.extend_from_slice(&dest.to_le_bytes());
    f.extend_from_slice(&seq.to_le_bytes());
    f.extend_from_slice(body);
    f
}

/// The body of a [`Kind::Hello`]: the sender's pid, the connection id (answers carry it), the
/// connector's fresh challenge nonce, and the sender's address.
pub fn greeting(pid: u32, conn: u64, challenge: &[u8; NONCE_BYTES], addr: &[u8]) -> Vec<u8> {
    let mut b = pid.to_le_bytes().to_vec();
    b.extend_from_slice(&conn.to_le_bytes());
    b.extend_from_slice(challenge);
    b.extend_from_slice(addr);
    b
}

/// A parsed [`greeting`]: `(pid, connection id, challenge nonce, address)`.
pub type Greeting<'a> = (u32, u64, [u8; NONCE_BYTES], &'a [u8]);

/// Parses a [`greeting`].
pub fn split_greeting(body: &[u8]) -> Option<Greeting<'_>> {
    let (pid, rest) = body.split_first_chunk::<4>()?;
    let (conn, rest) = rest.split_first_chunk::<8>()?;
    let (challenge, addr) = rest.split_first_chunk::<NONCE_BYTES>()?;
    Some((u32::from_le_bytes(*pid), u64::from_le_bytes(*conn), *challenge, addr))
}

/// The connect-time authentication exchange (with a cluster secret on both sides), computed by the
/// toolkit's [`Exchange`] with the protocol label [`AUTH_PROTOCOL`]:
///
/// 1. hello (connector to acceptor): carries the connector's fresh nonce `nc`;
/// 2. [`Kind::Challenge`] (acceptor to connector): the acceptor's fresh nonce `na` and
///    [`Exchange::acceptor_proof`], which the connector verifies (mutual);
/// 3. [`Kind::Auth`]: [`Exchange::connector_proof`], which the acceptor verifies;
/// 4. [`Kind::Welcome`] or [`Kind::Refused`].
///
/// Both endpoints enter as (identity, endpoint nonce widened to u64).
pub const AUTH_PROTOCOL: &str = "kvxfer-fabric";

/// The exchange between `connector` and `acceptor` (each `(identity, endpoint nonce)`) on this wire.
pub fn exchange(
    connector_nonce: [u8; NONCE_BYTES],
    acceptor_nonce: [u8; NONCE_BYTES],
    connector: (u64, u32),
    acceptor: (u64, u32),
) -> Exchange {
    Exchange {
        protocol: AUTH_PROTOCOL,
        connector_nonce,
        acceptor_nonce,
        connector: (connector.0, u64::from(connector.1)),
        acceptor: (acceptor.0, u64::from(acceptor.1)),
    }
}

/// The body of a [`Kind::Challenge`]: the acceptor's nonce and proof.
pub fn challenge(nonce: &[u8; NONCE_BYTES], proof: &[u8; PROOF_BYTES]) -> Vec<u8> {
    [&nonce[..], &proof[..]].concat()
}

/// Parses a [`challenge`] body.
pub fn split_challenge(body: &[u8]) -> Option<([u8; NONCE_BYTES], [u8; PROOF_BYTES])> {
    let (n, p) = body.split_first_chunk::<NONCE_BYTES>()?;
    Some((*n, p.try_into().ok()?))
}

/// Parses an [`Kind::Auth`] body (the proof, exactly).
pub fn split_auth(body: &[u8]) -> Option<[u8; PROOF_BYTES]> {
    body.try_into().ok()
}

/// Most bytes of a refusal's reason.
pub const MAX_REFUSAL: usize = 1024;

/// The body of a [`Kind::Refused`]: the reason, truncated to [`MAX_REFUSAL`] bytes at a character
/// boundary.
pub fn refusal(reason: &str) -> Vec<u8> {
    let mut end = reason.len().min(MAX_REFUSAL);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    reason.as_bytes()[..end].to_vec()
}

/// Parses a [`refusal`] body: UTF-8 of at most [`MAX_REFUSAL`] bytes.
pub fn split_refusal(body: &[u8]) -> Option<&str> {
    if body.len() > MAX_REFUSAL {
        return None;
    }
    std::str::from_utf8(body).ok()
}

/// The body of a [`Kind::Keys`]: the entries (region id u32, length u64, key u64, base u64 each).
pub fn keys(entries: &[RegionMeta]) -> Vec<u8> {
    let mut b = Vec::with_capacity(entries.len() * KEY_ENTRY);
    for e in entries {
        b.extend_from_slice(&e.id.to_le_bytes());
        b.extend_from_slice(&e.len.to_le_bytes());
        b.extend_from_slice(&e.key.to_le_bytes());
        b.extend_from_slice(&e.base.to_le_bytes());
    }
    b
}

/// Parses a [`keys`] body (whole entries only).
pub fn split_keys(body: &[u8]) -> Option<Vec<RegionMeta>> {
    if body.len() % KEY_ENTRY != 0 {
        return None;
    }
    let u64_at = |c: &[u8], i: usize| u64::from_le_bytes(c[i..i + 8].try_into().expect("8 bytes"));
    Some(
        body.chunks_exact(KEY_ENTRY)
            .map(|c| RegionMeta {
                id: u32::from_le_bytes(c[..4].try_into().expect("4 bytes")),
                len: u64_at(c, 4),
                key: u64_at(c, 12),
                base: u64_at(c, 20),
            })
            .collect(),
    )
}

/// The body of a [`Kind::Welcome`]: the total number of keys handed out (u32) and the first of
/// them ([`keys`] entries); empty when there are none (as older builds send it).
pub fn welcome(total: u32, first: &[RegionMeta]) -> Vec<u8> {
    if total == 0 {
        return Vec::new();
    }
    let mut b = total.to_le_bytes().to_vec();
    b.extend_from_slice(&keys(first));
    b
}

/// Parses a [`welcome`] body: `(total, first keys)`.
pub fn split_welcome(body: &[u8]) -> Option<(u32, Vec<RegionMeta>)> {
    if body.is_empty() {
        return Some((0, Vec::new()));
    }
    let (total, rest) = body.split_first_chunk::<4>()?;
    let total = u32::from_le_bytes(*total);
    let first = split_keys(rest)?;
    (total > 0 && first.len() <= total as usize).then_some((total, first))
}

/// The body of a [`Kind::Revoke`]: a u32 (the region id) and the sender's address.
pub fn hello(pid: u32, addr: &[u8]) -> Vec<u8> {
    let mut b = pid.to_le_bytes().to_vec();
    b.extend_from_slice(addr);
    b
}

/// Splits a revoke body ([`hello`]: region id and address) into its u32 and the address.
pub fn split_u32(body: &[u8]) -> Option<(u32, &[u8])> {
    let (n, rest) = body.split_first_chunk::<4>()?;
    Some((u32::from_le_bytes(*n), rest))
}

/// Parses a message into its header and body.
pub fn parse(frame: &[u8]) -> Result<(Header, &[u8]), String> {
    if frame.len() < HEADER {
        return Err(format!("message of {} bytes is shorter than the {HEADER}-byte header", frame.len()));
    }
    if frame[0] != MAGIC {
        return Err(format!("bad magic {:#x}", frame[0]));
    }
    let kind = Kind::from_u8(frame[1]).ok_or_else(|| format!("unknown message kind {}", frame[1]))?;
    let u32_at = |i: usize| u32::from_le_bytes(frame[i..i + 4].try_into().expect("4 bytes"));
    let seq = u64::from_le_bytes(frame[12..20].try_into().expect("8 bytes"));
    let flags = [frame[2], frame[3]];
    Ok((Header { kind, nonce: u32_at(4), dest: u32_at(8), seq, flags }, &frame[HEADER..]))
}

/// Most staged notifications or unmatched tokens kept at once; beyond it the oldest are dropped.
const MAX_PENDING: usize = 4096;

/// Pairs staged notifications with their CQ-data tokens, whichever arrives first.
#[derive(Default)]
pub struct Staged {
    staged: HashMap<u64, (Vec<u8>, u64)>,
    tokens: HashMap<u64, u64>,
    clock: u64,
}

fn evict<V>(map: &mut HashMap<u64, V>, order: impl Fn(&V) -> u64) {
    if map.len() > MAX_PENDING {
        if let Some(k) = map.iter().min_by_key(|(_, v)| order(v)).map(|(k, _)| *k) {
            tracing::warn!(target: "kvxfer_fabric", "dropping unmatched attached-notification state for token {k:#x}");
            map.remove(&k);
        }
    }
}

impl Staged {
    /// A whole staged notification arrived; returns it if its token arrived already.
    pub fn notification(&mut self, token: u64, n: Vec<u8>) -> Option<Vec<u8>> {
        self.clock += 1;
        if self.tokens.remove(&token).is_some() {
            return Some(n);
        }
        self.staged.insert(token, (n, self.clock));
        evict(&mut self.staged, |v| v.1);
        None
    }

    /// A remote-CQ-data token arrived; returns the staged notification it releases, if any.
    pub fn token(&mut self, token: u64) -> Option<Vec<u8>> {
        self.clock += 1;
        if let Some((n, _)) = self.staged.remove(&token) {
            return Some(n);
        }
        self.tokens.insert(token, self.clock);
        evict(&mut self.tokens, |v| *v);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip_and_malformed_ones_are_errors() {
        let m = message(Kind::Revoke, 7, 9, 0x1234, &[1, 2, 3]);
        let (h, body) = parse(&m).unwrap();
        assert_eq!(h, Header { kind: Kind::Revoke, nonce: 7, dest: 9, seq: 0x1234, flags: [0, 0] });
        assert_eq!(body, &[1, 2, 3]);
        assert!(parse(&[0; 10]).is_err());
        let mut bad = m.clone();
        bad[0] = 0;
        assert!(parse(&bad).is_err());
        bad = m;
        bad[1] = 99;
        assert!(parse(&bad).is_err());
        assert_eq!(split_u32(&hello(5, b"addr")), Some((5, &b"addr"[..])));
        assert_eq!(split_u32(&[1, 2]), None);
    }

    #[test]
    fn greetings_and_auth_messages_round_trip_and_reject_garbage() {
        let g = greeting(5, 0xabc, &[9; NONCE_BYTES], b"addr");
        assert_eq!(split_greeting(&g), Some((5, 0xabc, [9; NONCE_BYTES], &b"addr"[..])));
        assert_eq!(split_greeting(&g[..4 + 8 + NONCE_BYTES - 1]), None);
        let c = challenge(&[1; NONCE_BYTES], &[2; PROOF_BYTES]);
        assert_eq!(split_challenge(&c), Some(([1; NONCE_BYTES], [2; PROOF_BYTES])));
        assert_eq!(split_challenge(&c[1..]), None);
        assert_eq!(split_auth(&[3; PROOF_BYTES]), Some([3; PROOF_BYTES]));
        assert_eq!(split_auth(&[3; PROOF_BYTES + 1]), None);
        assert_eq!(split_refusal(&refusal("authentication failed")), Some("authentication failed"));
        let long = "é".repeat(MAX_REFUSAL);
        assert!(split_refusal(&refusal(&long)).is_some());
        assert_eq!(split_refusal(&[0xff]), None);
        assert_eq!(split_refusal(&[b'a'; MAX_REFUSAL + 1]), None);
    }

    #[test]
    fn the_exchange_is_the_toolkits_with_this_wires_label() {
        let s = kvxfer_core::Secret::new(b"cluster".to_vec()).unwrap();
        let x = exchange([1; NONCE_BYTES], [2; NONCE_BYTES], (0x10, 0x11), (0x20, 0x21));
        assert_eq!((x.connector, x.acceptor), ((0x10, 0x11), (0x20, 0x21)), "endpoint nonces widened");
        let (a, c) = (x.acceptor_proof(&s), x.connector_proof(&s));
        assert!(x.verify_acceptor(&s, &a) && x.verify_connector(&s, &c));
        assert!(!x.verify_connector(&s, &a), "a proof cannot be reflected");
        let other = Exchange { protocol: "kvxfer-ucx", ..x };
        assert!(!other.verify_acceptor(&s, &a) && !other.verify_connector(&s, &c), "another backend's label");
    }

    #[test]
    fn staged_waits_for_its_token_either_way_round() {
        let mut s = Staged::default();
        assert_eq!(s.notification(77, b"hello".to_vec()), None);
        assert_eq!(s.token(78), None);
        assert_eq!(s.token(77), Some(b"hello".to_vec()));
        assert_eq!(s.notification(78, b"x".to_vec()), Some(b"x".to_vec()));
    }
}
