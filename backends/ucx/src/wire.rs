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
//! [`Hello`] (3), nothing (goodbye, 4), data-path messages (5 to 7, see [`DataBuilder`]) or a
//! revoked region id (8).

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
    /// Write data carried in the message (the active-message data path, see the crate docs).
    Data = 5,
    /// End of one write on the active-message data path; carries the attached notification.
    Commit = 6,
    /// The receiver placed (or refused) one write of the active-message data path.
    Ack = 7,
    /// The sender deregistered a region (data: region id, u32): peers forget its remote key.
    Revoke = 8,
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
            5 => Kind::Data,
            6 => Kind::Commit,
            7 => Kind::Ack,
            8 => Kind::Revoke,
            k => return Err(format!("unknown active-message kind {k}")),
        };
        let u = |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().expect("8 bytes"));
        Ok(Self { kind, flags: b[1], instance: u(2..10), identity: u(10..18) })
    }
}

/// Largest data message body on the active-message path.
pub(crate) const DATA_MSG_MAX: usize = 1 << 20;

/// Builds the data messages of one write: `seq u64, region u32, count u32`, then per segment
/// `offset u64, len u64, bytes`. Segments are cut so that no message exceeds [`DATA_MSG_MAX`].
pub(crate) struct DataBuilder {
    seq: u64,
    region: u32,
    msgs: Vec<Vec<u8>>,
    cur: Vec<u8>,
    count: u32,
}

const DATA_HEAD: usize = 16;
const SEG_HEAD: usize = 16;

impl DataBuilder {
    /// Starts the messages of write `seq`.
    pub fn new(seq: u64) -> Self {
        Self { seq, region: 0, msgs: Vec::new(), cur: Vec::new(), count: 0 }
    }

    fn close(&mut self) {
        if self.count > 0 {
            self.cur[12..16].copy_from_slice(&self.count.to_le_bytes());
            self.msgs.push(std::mem::take(&mut self.cur));
            self.count = 0;
        }
        self.cur.clear();
    }

    fn open(&mut self, region: u32) {
        self.region = region;
        self.cur.extend_from_slice(&self.seq.to_le_bytes());
        self.cur.extend_from_slice(&region.to_le_bytes());
        self.cur.extend_from_slice(&0u32.to_le_bytes());
    }

    /// Appends `len` bytes for `region` at `offset`, filled by `fill` (piece by piece).
    pub fn add(&mut self, region: u32, mut offset: u64, mut len: u64, mut fill: impl FnMut(u64, &mut [u8])) {
        let mut done = 0u64;
        while len > 0 {
            if self.count > 0 && (self.region != region || self.cur.len() + SEG_HEAD >= DATA_MSG_MAX) {
                self.close();
            }
            if self.count == 0 && self.cur.is_empty() {
                self.open(region);
            }
            let room = (DATA_MSG_MAX - self.cur.len() - SEG_HEAD) as u64;
            let n = len.min(room.max(1));
            self.cur.extend_from_slice(&offset.to_le_bytes());
            self.cur.extend_from_slice(&n.to_le_bytes());
            let at = self.cur.len();
            self.cur.resize(at + n as usize, 0);
            fill(done, &mut self.cur[at..]);
            self.count += 1;
            offset += n;
            len -= n;
            done += n;
        }
    }

    /// The finished messages.
    pub fn finish(mut self) -> Vec<Vec<u8>> {
        self.close();
        self.msgs
    }
}

/// A decoded data message: `(seq, region, segments of (offset, bytes))`.
pub(crate) type DataMsg<'a> = (u64, u32, Vec<(u64, &'a [u8])>);

/// Decodes one data message.
pub(crate) fn decode_data(b: &[u8]) -> Result<DataMsg<'_>, String> {
    if b.len() < DATA_HEAD {
        return Err(format!("data message of {} bytes", b.len()));
    }
    let seq = u64::from_le_bytes(b[0..8].try_into().expect("8"));
    let region = u32::from_le_bytes(b[8..12].try_into().expect("4"));
    let count = u32::from_le_bytes(b[12..16].try_into().expect("4"));
    let mut segs = Vec::with_capacity(count as usize);
    let mut at = DATA_HEAD;
    for _ in 0..count {
        if b.len() < at + SEG_HEAD {
            return Err("truncated data segment header".into());
        }
        let off = u64::from_le_bytes(b[at..at + 8].try_into().expect("8"));
        let len = u64::from_le_bytes(b[at + 8..at + 16].try_into().expect("8"));
        at += SEG_HEAD;
        let end = usize::try_from(len).ok().and_then(|l| at.checked_add(l)).filter(|&e| e <= b.len());
        let Some(end) = end else { return Err("truncated data segment".into()) };
        segs.push((off, &b[at..end]));
        at = end;
    }
    if at != b.len() {
        return Err("trailing bytes after the data segments".into());
    }
    Ok((seq, region, segs))
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
    fn data_messages_round_trip_and_split_at_the_limit() {
        let src: Vec<u8> = (0..3 * DATA_MSG_MAX as u64).map(|i| i as u8).collect();
        let mut b = DataBuilder::new(42);
        b.add(3, 10, 100, |at, out| out.copy_from_slice(&src[at as usize..at as usize + out.len()]));
        b.add(3, 5000, 2 * DATA_MSG_MAX as u64, |at, out| {
            out.copy_from_slice(&src[1000 + at as usize..1000 + at as usize + out.len()])
        });
        b.add(4, 0, 7, |_, out| out.fill(9));
        let msgs = b.finish();
        assert!(msgs.len() >= 3 && msgs.iter().all(|m| m.len() <= DATA_MSG_MAX));
        let mut placed: Vec<(u32, u64, Vec<u8>)> = Vec::new();
        for m in &msgs {
            let (seq, region, segs) = decode_data(m).unwrap();
            assert_eq!(seq, 42);
            for (off, bytes) in segs {
                placed.push((region, off, bytes.to_vec()));
            }
        }
        assert_eq!(placed[0], (3, 10, src[..100].to_vec()));
        let big: Vec<u8> = placed.iter().filter(|p| p.0 == 3 && p.1 >= 5000).flat_map(|p| p.2.clone()).collect();
        assert_eq!(big, src[1000..1000 + 2 * DATA_MSG_MAX].to_vec());
        assert_eq!(placed.last().unwrap(), &(4, 0, vec![9; 7]));
        let mut bad = msgs[0].clone();
        bad.truncate(bad.len() - 1);
        assert!(decode_data(&bad).is_err());
        assert!(decode_data(&[0; 3]).is_err());
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
