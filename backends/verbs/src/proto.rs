//! Metadata payload and the TCP side channel: QP handshake, credits, goodbye.
//!
//! An endpoint's [`EndpointMetadata`](kvxfer_core::EndpointMetadata) payload is [`Address`] as JSON:
//! the TCP address of its handshake listener and its port's addressing (LID, GID, MTU). `connect`
//! opens a TCP connection there; both sides exchange a [`Hello`] (QP number, PSN, notification ring,
//! registered regions with remote keys), move their QPs to RTR/RTS, and the connecting side confirms
//! with `Ready` once its QP can receive. The connection then stays open as the side channel: ring
//! credits flow on it, region revokes and their acknowledgements (a closing registration tells every
//! peer to forget its remote key, and each peer answers once none of its writes into it can still
//! land), and its loss is how a peer's death is noticed (RC itself only notices on the next send).
//!
//! Frames: `u32` little-endian length of what follows, a tag byte, the body.

use std::io::{Read, Write};

use serde::{Deserialize, Serialize};

/// Version of the payload and the handshake.
pub const PROTO_VERSION: u32 = 1;
/// Largest frame we accept (a Hello lists regions; 16 MiB is far above any real count).
pub const MAX_FRAME: usize = 16 << 20;

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

/// A side-channel frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
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

impl Frame {
    /// Encodes with its length prefix.
    pub fn encode(&self) -> Vec<u8> {
        let (tag, body) = match self {
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
        match tag {
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
            T_READY | T_CREDIT | T_REVOKE | T_REVOKE_ACK => {
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
        let mut len = [0u8; 4];
        r.read_exact(&mut len)?;
        let len = u32::from_le_bytes(len) as usize;
        if len == 0 || len > MAX_FRAME {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("frame length {len}")));
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
        v.version = 2;
        assert!(Address::from_payload(&v.to_payload()).unwrap_err().contains("version 2"));
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
        assert!(Frame::decode(&[99]).unwrap_err().contains("99"));
        assert!(Frame::decode(&[T_BYE, 0xff]).is_err());
        let mut r = std::io::Cursor::new(vec![0u8, 0, 0, 0]);
        assert!(Frame::read_from(&mut r).is_err(), "zero length");
        let mut r = std::io::Cursor::new(((MAX_FRAME + 1) as u32).to_le_bytes().to_vec());
        assert!(Frame::read_from(&mut r).is_err(), "over-long");
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
