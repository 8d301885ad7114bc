//! Metadata payload and the TCP side channel: QP handshake, credits, goodbye.
//!
//! An endpoint's [`EndpointMetadata`](kvxfer_core::EndpointMetadata) payload is [`Address`] as JSON:
//! the TCP address of its handshake listener and its port's addressing (LID, GID, MTU). `connect`
//! opens a TCP connection there and authenticates first ([`Open`], [`Challenge`], [`Frame::Auth`]:
//! the toolkit's mutual challenge-response, [`kvxfer_core::secret::Exchange`] with the label
//! [`AUTH_PROTOCOL`], when the endpoints have a cluster secret); only then do both sides exchange a
//! [`Hello`] (QP number, PSN, notification ring, registered regions with remote keys), move their
//! QPs to RTR/RTS, and the connecting side confirms with `Ready` once its QP can receive; the
//! accepting side answers with its own `Ready` once it counts the peer as connected (its revokes now
//! reach it), and only then does `connect` return, so a region the acceptor closes after that is
//! always revoked at the new peer. The connection then stays open as the side channel: ring
//! credits flow on it, region revokes and their acknowledgements (a closing registration tells every
//! peer to forget its remote key, and each peer answers once none of its writes into it can still
//! land), and its loss is how a peer's death is noticed (RC itself only notices on the next send).
//!
//! Frames: `u32` little-endian length of what follows, a tag byte, the body.

use std::io::{Read, Write};

use kvxfer_core::secret::{Exchange, NONCE_BYTES, PROOF_BYTES};
use serde::{Deserialize, Serialize};

/// Version of the payload and the handshake (2: the handshake starts with the authentication
/// exchange, [`Frame::Open`]).
pub const PROTO_VERSION: u32 = 2;

/// The protocol label of this backend's authentication exchange ([`Exchange::protocol`]).
pub const AUTH_PROTOCOL: &str = "kvxfer-verbs";
/// Largest frame we accept (a Hello lists regions; 16 MiB is far above any real count).
pub const MAX_FRAME: usize = 16 << 20;
/// Largest frame read before the peer is authenticated (open, challenge, auth, a reject's reason):
/// an unauthenticated peer cannot make the endpoint allocate more than this for one frame.
pub const MAX_AUTH_FRAME: usize = 64 << 10;

/// What an endpoint publishes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Address {
    /// [`PROTO_VERSION`].
    pub version: u32,
    /// `ip:port` of the handshake listener.
    pub handshake: String,
    /// Device name (informational).
    pub device: String,
    /// Port number.
    pub port: u8,
    /// LID (0 on RoCE).
    pub lid: u16,
    /// GID at the configured index.
    pub gid: [u8; 16],
    /// Link layer (1 InfiniBand, 2 Ethernet).
    pub link_layer: u8,
    /// Active MTU (`ibv_mtu`).
    pub mtu: u32,
}

impl Address {
    /// JSON payload.
    pub fn to_payload(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("plain struct serialises")
    }

    /// Parses and validates a payload.
    pub fn from_payload(bytes: &[u8]) -> Result<Self, String> {
        let a: Address = serde_json::from_slice(bytes).map_err(|e| format!("payload is not a verbs address: {e}"))?;
        if a.version != PROTO_VERSION {
            return Err(format!("verbs address version {} (this build speaks {PROTO_VERSION})", a.version));
        }
        if crate::attrs::mtu_bytes(a.mtu).is_none() {
            return Err(format!("MTU code {} is not an ibv_mtu (1..=5)", a.mtu));
        }
        if a.handshake.parse::<std::net::SocketAddr>().is_err() {
            return Err(format!("handshake address {:?} is not ip:port", a.handshake));
        }
        Ok(a)
    }
}

/// A registered region as a peer may write it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteRegion {
    /// Region id.
    pub id: u32,
    /// Remote virtual address of offset 0.
    pub addr: u64,
    /// Length.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
}

/// One side of the QP handshake.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// [`PROTO_VERSION`].
    pub version: u32,
    /// The sender's endpoint identity.
    pub identity: u64,
    /// QP number.
    pub qp_num: u32,
    /// Initial send PSN (24 bits).
    pub psn: u32,
    /// LID.
    pub lid: u16,
    /// GID.
    pub gid: [u8; 16],
    /// Link layer.
    pub link_layer: u8,
    /// Active MTU (`ibv_mtu`).
    pub mtu: u32,
    /// This side's notification ring (where the peer writes attached notifications).
    pub ring: RemoteRegion,
    /// Ring slots.
    pub ring_slots: u32,
    /// Ring slot size.
    pub slot_size: u32,
    /// Size of each pre-posted receive buffer (largest out-of-band SEND).
    pub recv_buf: u32,
    /// Registered regions.
    pub regions: Vec<RemoteRegion>,
}

impl Hello {
    /// Validates what the peer sent against what we can use.
    pub fn validate(&self, local_link_layer: u8) -> Result<(), String> {
        if self.version != PROTO_VERSION {
            return Err(format!("handshake version {} (this build speaks {PROTO_VERSION})", self.version));
        }
        if self.link_layer != local_link_layer {
            return Err(format!(
                "peer's link layer is {} and ours is {} (1 InfiniBand, 2 Ethernet): they cannot form a queue pair",
                self.link_layer, local_link_layer
            ));
        }
        if crate::attrs::mtu_bytes(self.mtu).is_none() {
            return Err(format!("MTU code {} is not an ibv_mtu (1..=5)", self.mtu));
        }
        crate::ring::check_geometry(self.ring_slots, self.slot_size).map_err(|e| e.0)?;
        if self.ring.len < u64::from(self.ring_slots) * u64::from(self.slot_size) {
            return Err(format!(
                "ring of {} bytes is smaller than {} slots of {}",
                self.ring.len, self.ring_slots, self.slot_size
            ));
        }
        if self.recv_buf < 2 {
            return Err(format!("receive buffers of {} bytes cannot hold a SEND fragment", self.recv_buf));
        }
        Ok(())
    }
}

/// The connecting side's first frame: who it is and its fresh challenge nonce (sent with or without
/// a cluster secret, so the acceptor's answer can say what is missing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Open {
    /// [`PROTO_VERSION`].
    pub version: u32,
    /// The connecting endpoint's identity.
    pub identity: u64,
    /// The connecting endpoint's instance (random per endpoint).
    pub instance: u64,
    /// The connector's fresh nonce `nc`.
    pub nonce: [u8; NONCE_BYTES],
}

/// The accepting side's answer to an [`Open`]: who it is, its fresh nonce, and (when it has a
/// cluster secret) its proof [`Exchange::acceptor_proof`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    /// The accepting endpoint's identity.
    pub identity: u64,
    /// The accepting endpoint's instance.
    pub instance: u64,
    /// The acceptor's fresh nonce `na`.
    pub nonce: [u8; NONCE_BYTES],
    /// The acceptor's proof; `None`: the acceptor has no secret.
    pub proof: Option<[u8; PROOF_BYTES]>,
}

/// The exchange of a connection between the endpoint that sent `open` and the one that answered
/// `challenge` (proofs computed by the toolkit with [`AUTH_PROTOCOL`]).
pub fn exchange(open: &Open, challenge: &Challenge) -> Exchange {
    Exchange {
        protocol: AUTH_PROTOCOL,
        connector_nonce: open.nonce,
        acceptor_nonce: challenge.nonce,
        connector: (open.identity, open.instance),
        acceptor: (challenge.identity, challenge.instance),
    }
}

/// A side-channel frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Authentication, connector to acceptor: the first frame of every connection.
    Open(Open),
    /// Authentication, acceptor to connector: the answer to [`Frame::Open`].
    Challenge(Challenge),
    /// Authentication, connector to acceptor: its proof [`Exchange::connector_proof`] (`None`: the
    /// connector has no secret). Followed by the connector's [`Frame::Hello`].
    Auth(Option<[u8; PROOF_BYTES]>),
    /// Handshake.
    Hello(Hello),
    /// The connecting side's QP is in RTS: the peer may use the connection.
    Ready,
    /// Total ring fragments consumed so far by the sender of this frame.
    Credit(u64),
    /// Orderly close, with a reason.
    Bye(String),
    /// Handshake refused, with a reason.
    Reject(String),
    /// The sender's region `region` is closing: forget its remote key, and answer
    /// [`Frame::RevokeAck`] with `seq` once no write into it is in flight any more.
    Revoke {
        /// Number of this revoke at its sender.
        seq: u64,
        /// The region id.
        region: u32,
    },
    /// Answer to [`Frame::Revoke`] number `seq`: no write of ours into that region can land any more.
    RevokeAck(u64),
}

const T_HELLO: u8 = 1;
const T_READY: u8 = 2;
const T_CREDIT: u8 = 3;
const T_BYE: u8 = 4;
const T_REJECT: u8 = 5;
const T_REVOKE: u8 = 6;
const T_REVOKE_ACK: u8 = 7;
const T_OPEN: u8 = 8;
const T_CHALLENGE: u8 = 9;
const T_AUTH: u8 = 10;

/// Body length of an open: version, identity, instance, nonce.
const OPEN_LEN: usize = 4 + 8 + 8 + NONCE_BYTES;
/// Body length of a challenge without a proof: identity, instance, nonce.
const CHALLENGE_LEN: usize = 8 + 8 + NONCE_BYTES;

impl Frame {
    /// Encodes with its length prefix.
    pub fn encode(&self) -> Vec<u8> {
        let (tag, body) = match self {
            Frame::Open(o) => {
                let mut b = Vec::with_capacity(OPEN_LEN);
                b.extend_from_slice(&o.version.to_le_bytes());
                b.extend_from_slice(&o.identity.to_le_bytes());
                b.extend_from_slice(&o.instance.to_le_bytes());
                b.extend_from_slice(&o.nonce);
                (T_OPEN, b)
            }
            Frame::Challenge(c) => {
                let mut b = Vec::with_capacity(CHALLENGE_LEN + PROOF_BYTES);
                b.extend_from_slice(&c.identity.to_le_bytes());
                b.extend_from_slice(&c.instance.to_le_bytes());
                b.extend_from_slice(&c.nonce);
                if let Some(p) = &c.proof {
                    b.extend_from_slice(p);
                }
                (T_CHALLENGE, b)
            }
            Frame::Auth(p) => (T_AUTH, p.map_or_else(Vec::new, |p| p.to_vec())),
            Frame::Hello(h) => (T_HELLO, serde_json::to_vec(h).expect("plain struct serialises")),
            Frame::Ready => (T_READY, Vec::new()),
            Frame::Credit(n) => (T_CREDIT, n.to_le_bytes().to_vec()),
            Frame::Bye(r) => (T_BYE, r.as_bytes().to_vec()),
            Frame::Reject(r) => (T_REJECT, r.as_bytes().to_vec()),
            Frame::Revoke { seq, region } => (T_REVOKE, [&seq.to_le_bytes()[..], &region.to_le_bytes()].concat()),
            Frame::RevokeAck(seq) => (T_REVOKE_ACK, seq.to_le_bytes().to_vec()),
        };
        let mut out = Vec::with_capacity(5 + body.len());
        out.extend_from_slice(&((body.len() + 1) as u32).to_le_bytes());
        out.push(tag);
        out.extend_from_slice(&body);
        out
    }

    /// Decodes a frame's content (tag and body, without the length prefix).
    pub fn decode(buf: &[u8]) -> Result<Frame, String> {
        let (&tag, body) = buf.split_first().ok_or("empty frame")?;
        let text = |b: &[u8]| String::from_utf8(b.to_vec()).map_err(|_| "frame text is not UTF-8".to_string());
        let u64_at = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        match tag {
            T_OPEN if body.len() == OPEN_LEN => Ok(Frame::Open(Open {
                version: u32::from_le_bytes(body[..4].try_into().expect("4 bytes")),
                identity: u64_at(body, 4),
                instance: u64_at(body, 12),
                nonce: body[20..].try_into().expect("nonce bytes"),
            })),
            T_CHALLENGE if body.len() == CHALLENGE_LEN || body.len() == CHALLENGE_LEN + PROOF_BYTES => {
                Ok(Frame::Challenge(Challenge {
                    identity: u64_at(body, 0),
                    instance: u64_at(body, 8),
                    nonce: body[16..CHALLENGE_LEN].try_into().expect("nonce bytes"),
                    proof: body[CHALLENGE_LEN..].try_into().ok(),
                }))
            }
            T_AUTH if body.is_empty() => Ok(Frame::Auth(None)),
            T_AUTH if body.len() == PROOF_BYTES => Ok(Frame::Auth(Some(body.try_into().expect("proof bytes")))),
            T_HELLO => serde_json::from_slice(body).map(Frame::Hello).map_err(|e| format!("malformed hello: {e}")),
            T_READY if body.is_empty() => Ok(Frame::Ready),
            T_CREDIT if body.len() == 8 => Ok(Frame::Credit(u64::from_le_bytes(body.try_into().expect("8 bytes")))),
            T_BYE => text(body).map(Frame::Bye),
            T_REJECT => text(body).map(Frame::Reject),
            T_REVOKE if body.len() == 12 => Ok(Frame::Revoke {
                seq: u64::from_le_bytes(body[..8].try_into().expect("8 bytes")),
                region: u32::from_le_bytes(body[8..].try_into().expect("4 bytes")),
            }),
            T_REVOKE_ACK if body.len() == 8 => {
                Ok(Frame::RevokeAck(u64::from_le_bytes(body.try_into().expect("8 bytes"))))
            }
            T_READY | T_CREDIT | T_REVOKE | T_REVOKE_ACK | T_OPEN | T_CHALLENGE | T_AUTH => {
                Err(format!("frame tag {tag} with a body of {} bytes", body.len()))
            }
            t => Err(format!("unknown frame tag {t}")),
        }
    }

    /// Writes one frame.
    pub fn write_to(&self, w: &mut impl Write) -> std::io::Result<()> {
        w.write_all(&self.encode())?;
        w.flush()
    }

    /// Reads one frame (blocking, honouring the stream's read timeout).
    pub fn read_from(r: &mut impl Read) -> std::io::Result<Frame> {
        Self::read_bounded(r, MAX_FRAME)
    }

    /// Reads one frame of at most `max` bytes ([`MAX_AUTH_FRAME`] before the peer is
    /// authenticated): a longer declared length is an error before anything is allocated.
    pub fn read_bounded(r: &mut impl Read, max: usize) -> std::io::Result<Frame> {
        let mut len = [0u8; 4];
        r.read_exact(&mut len)?;
        let len = u32::from_le_bytes(len) as usize;
        if len == 0 || len > max.min(MAX_FRAME) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("frame length {len} (at most {} here)", max.min(MAX_FRAME)),
            ));
        }
        let mut buf = vec![0u8; len];
        r.read_exact(&mut buf)?;
        Frame::decode(&buf).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
    }
}

/// Takes one complete frame off the front of `buf` (bytes read so far from a stream), if there is one.
pub fn take_frame(buf: &mut Vec<u8>) -> Result<Option<Frame>, String> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes")) as usize;
    if len == 0 || len > MAX_FRAME {
        return Err(format!("frame length {len}"));
    }
    if buf.len() < 4 + len {
        return Ok(None);
    }
    let f = Frame::decode(&buf[4..4 + len]);
    buf.drain(..4 + len);
    f.map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hello(identity: u64) -> Hello {
        Hello {
            version: PROTO_VERSION,
            identity,
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

    fn addr() -> Address {
        Address {
            version: PROTO_VERSION,
            handshake: "10.0.0.2:4791".into(),
            device: "mlx5_0".into(),
            port: 1,
            lid: 0,
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
            link_layer: 2,
            mtu: 3,
        }
    }

    #[test]
    fn address_round_trips_and_rejects_garbage() {
        let a = addr();
        assert_eq!(Address::from_payload(&a.to_payload()).unwrap(), a);
        assert!(Address::from_payload(b"{}").is_err());
        assert!(Address::from_payload(b"\x00\x01").is_err());
        let mut v = a.clone();
        v.version = 1;
        assert!(Address::from_payload(&v.to_payload()).unwrap_err().contains("version 1"));
        let mut m = a.clone();
        m.mtu = 9;
        assert!(Address::from_payload(&m.to_payload()).is_err());
        let mut h = a;
        h.handshake = "nowhere".into();
        assert!(Address::from_payload(&h.to_payload()).is_err());
    }

    #[test]
    fn hello_validation_names_the_problem() {
        assert!(hello(1).validate(1).is_ok());
        assert!(hello(1).validate(2).unwrap_err().contains("link layer"));
        let mut h = hello(1);
        h.ring.len = 10;
        assert!(h.validate(1).unwrap_err().contains("smaller"));
        let mut h = hello(1);
        h.ring_slots = 0;
        assert!(h.validate(1).is_err());
        let mut h = hello(1);
        h.version = 7;
        assert!(h.validate(1).unwrap_err().contains("version 7"));
    }

    #[test]
    fn frames_round_trip_through_a_stream() {
        let frames = vec![
            Frame::Open(Open { version: PROTO_VERSION, identity: 7, instance: 8, nonce: [1; NONCE_BYTES] }),
            Frame::Challenge(Challenge { identity: 9, instance: 10, nonce: [2; NONCE_BYTES], proof: None }),
            Frame::Challenge(Challenge {
                identity: 9,
                instance: 10,
                nonce: [2; NONCE_BYTES],
                proof: Some([3; PROOF_BYTES]),
            }),
            Frame::Auth(None),
            Frame::Auth(Some([4; PROOF_BYTES])),
            Frame::Hello(hello(42)),
            Frame::Ready,
            Frame::Credit(123_456_789),
            Frame::Bye("going away".into()),
            Frame::Reject("wrong link layer".into()),
            Frame::Revoke { seq: 9, region: 0xdead_beef },
            Frame::RevokeAck(u64::MAX),
        ];
        let mut wire = Vec::new();
        for f in &frames {
            f.write_to(&mut wire).unwrap();
        }
        let mut r = std::io::Cursor::new(wire);
        for f in &frames {
            assert_eq!(&Frame::read_from(&mut r).unwrap(), f);
        }
        assert!(Frame::read_from(&mut r).is_err(), "end of stream is an error");
    }

    #[test]
    fn frames_are_taken_from_partial_reads() {
        let mut wire = Frame::Credit(5).encode();
        wire.extend(Frame::Bye("x".into()).encode());
        let mut buf = Vec::new();
        let mut got = Vec::new();
        for b in wire {
            buf.push(b);
            while let Some(f) = take_frame(&mut buf).unwrap() {
                got.push(f);
            }
        }
        assert_eq!(got, vec![Frame::Credit(5), Frame::Bye("x".into())]);
        assert!(buf.is_empty());
        let mut bad = vec![0, 0, 0, 0];
        assert!(take_frame(&mut bad).is_err());
    }

    #[test]
    fn malformed_frames_are_errors() {
        assert!(Frame::decode(&[]).is_err());
        assert!(Frame::decode(&[T_READY, 1]).is_err());
        assert!(Frame::decode(&[T_CREDIT, 1, 2]).is_err());
        assert!(Frame::decode(&[T_REVOKE, 1, 2, 3]).is_err());
        assert!(Frame::decode(&[T_REVOKE_ACK]).is_err());
        assert!(Frame::decode(&[T_OPEN; OPEN_LEN]).is_err(), "one byte short");
        assert!(Frame::decode(&[T_CHALLENGE; CHALLENGE_LEN + 2]).is_err(), "a partial proof");
        assert!(Frame::decode(&[T_AUTH; PROOF_BYTES]).is_err(), "a partial proof");
        assert!(Frame::decode(&[T_AUTH; PROOF_BYTES + 2]).is_err(), "an over-long proof");
        assert!(Frame::decode(&[99]).unwrap_err().contains("99"));
        assert!(Frame::decode(&[T_BYE, 0xff]).is_err());
        let mut r = std::io::Cursor::new(vec![0u8, 0, 0, 0]);
        assert!(Frame::read_from(&mut r).is_err(), "zero length");
        let mut r = std::io::Cursor::new(((MAX_FRAME + 1) as u32).to_le_bytes().to_vec());
        assert!(Frame::read_from(&mut r).is_err(), "over-long");
        // Before authentication a frame may not declare more than MAX_AUTH_FRAME.
        let mut r = std::io::Cursor::new(((MAX_AUTH_FRAME + 1) as u32).to_le_bytes().to_vec());
        let e = Frame::read_bounded(&mut r, MAX_AUTH_FRAME).unwrap_err();
        assert!(e.to_string().contains("at most 65536"), "{e}");
        let mut buf = Vec::new();
        Frame::Reject("no".into()).write_to(&mut buf).unwrap();
        assert_eq!(
            Frame::read_bounded(&mut std::io::Cursor::new(buf), MAX_AUTH_FRAME).unwrap(),
            Frame::Reject("no".into())
        );
    }

    #[test]
    fn the_exchange_binds_both_frames_and_this_backends_label() {
        let s = kvxfer_core::Secret::new(b"cluster".to_vec()).unwrap();
        let open = Open { version: PROTO_VERSION, identity: 7, instance: 8, nonce: [1; NONCE_BYTES] };
        let ch = Challenge { identity: 9, instance: 10, nonce: [2; NONCE_BYTES], proof: None };
        let x = exchange(&open, &ch);
        assert_eq!((x.protocol, x.connector, x.acceptor), (AUTH_PROTOCOL, (7, 8), (9, 10)));
        let (a, c) = (x.acceptor_proof(&s), x.connector_proof(&s));
        assert!(x.verify_acceptor(&s, &a) && x.verify_connector(&s, &c) && !x.verify_connector(&s, &a));
        let other = Exchange { protocol: "kvxfer-ucx", ..x };
        assert!(!other.verify_acceptor(&s, &a), "another backend's label");
        let replayed = exchange(&Open { nonce: [5; NONCE_BYTES], ..open }, &ch);
        assert!(!replayed.verify_acceptor(&s, &a) && !replayed.verify_connector(&s, &c), "another connection");
    }

    proptest! {
        #[test]
        fn hello_round_trips(identity in any::<u64>(), qp in any::<u32>(), psn in 0u32..1 << 24, gid in any::<[u8; 16]>(),
                             regions in proptest::collection::vec((any::<u32>(), any::<u64>(), any::<u64>(), any::<u32>()), 0..5)) {
            let mut h = hello(identity);
            h.qp_num = qp;
            h.psn = psn;
            h.gid = gid;
            h.regions = regions.into_iter().map(|(id, addr, len, rkey)| RemoteRegion { id, addr, len, rkey }).collect();
            let bytes = Frame::Hello(h.clone()).encode();
            prop_assert_eq!(Frame::decode(&bytes[4..]).unwrap(), Frame::Hello(h));
        }

        #[test]
        fn decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Frame::decode(&bytes);
        }
    }
}
