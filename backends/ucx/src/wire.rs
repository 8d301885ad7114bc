//! What UCX endpoints tell each other: the metadata payload and the active-message header.
//!
//! Metadata payload (JSON inside [`kvxfer_core::EndpointMetadata::payload`]):
//! `{"v":1,"instance":..,"ucx":"1.13.1","worker":"<hex>","regions":[{"id":..,"addr":..,"len":..,"rkey":"<hex>"}]}`.
//! `worker` is the UCP worker address (it lists every transport the worker can be reached by, so
//! peers on the same host pick shared memory and cma, others tcp or RDMA); `rkey` is the packed
//! remote key of a registered region.
//!
//! Active-message header (18 bytes, little endian): `kind u8, flags u8, instance u64, identity u64`;
//! the data is the kind's body: an encoded [`kvxfer_core::Notification`] (kinds 1 and 2), a JSON
//! [`Hello`] (3) or nothing (goodbye, 4).

use serde::{Deserialize, Serialize};

use crate::liveness::ProcId;

/// Version of the JSON payload.
pub(crate) const PAYLOAD_VERSION: u32 = 1;

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
}

/// The body of a hello: how to reach (and watch) the connecting endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Hello {
    /// Worker address, hex.
    pub worker: String,
    /// The connecting process.
    pub proc: ProcId,
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
    /// A notification sent with `write` (after the data, attached style).
    Attached = 1,
    /// A notification sent with `notify` (out of band).
    OutOfBand = 2,
    /// A connecting peer introduces itself with its worker address, so we can watch it.
    Hello = 3,
    /// A peer disconnects (flag 0) or shuts down (flag [`GOODBYE_SHUTDOWN`]).
    Goodbye = 4,
}

/// Goodbye flag: the whole endpoint is going away (not just one connection).
pub(crate) const GOODBYE_SHUTDOWN: u8 = 1;

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
            k => return Err(format!("unknown active-message kind {k}")),
        };
        let u = |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().expect("8 bytes"));
        Ok(Self { kind, flags: b[1], instance: u(2..10), identity: u(10..18) })
    }
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
    fn header_round_trips_and_rejects_garbage() {
        let h = Header { kind: Kind::Goodbye, flags: GOODBYE_SHUTDOWN, instance: 7, identity: u64::MAX };
        assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        assert!(Header::decode(&h.encode()[..17]).is_err());
        let mut bad = h.encode();
        bad[0] = 9;
        assert!(Header::decode(&bad).is_err());
    }
}
