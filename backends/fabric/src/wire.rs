//! What travels besides the data: the endpoint-metadata payload and the framing of notification
//! messages (fragmented to the receiver's posted buffer size, reassembled per sender).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// Version of [`Payload`]; `connect` rejects others.
pub const WIRE_VERSION: u32 = 1;

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
    /// Whether remote writes use virtual addresses (`FI_MR_VIRT_ADDR`); informational, `base` carries it.
    pub virt_addr: bool,
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
pub const HEADER: usize = 28;
const MAGIC: u8 = 0xfb;

/// What a message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A notification to deliver as soon as it is complete.
    Notify = 1,
    /// A notification to deliver once the remote CQ data with the same token has arrived (attached
    /// style over `fi_writedata`).
    Staged = 2,
    /// "I am alive": sent on connect and then periodically by every endpoint to the peers it connected
    /// to; `seq` carries the sender's identity. A receiver that stops hearing it reports the peer lost.
    Heartbeat = 3,
    /// The sending endpoint is closing (it was dropped): the receiver reports the peer lost at once.
    Gone = 4,
    /// The sender disconnected on purpose: forget it without reporting a loss.
    Bye = 5,
}

impl Kind {
    /// Whether this kind is a liveness message (no notification body).
    pub fn is_control(self) -> bool {
        matches!(self, Kind::Heartbeat | Kind::Gone | Kind::Bye)
    }
}

/// A liveness message ([`Kind::Heartbeat`], [`Kind::Gone`], [`Kind::Bye`]) carrying `identity`.
pub fn control(kind: Kind, nonce: u32, dest: u32, identity: u64) -> Vec<u8> {
    frames(kind, nonce, dest, identity, &[], HEADER).remove(0)
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
    /// Message sequence number (for [`Kind::Staged`], the CQ-data token).
    pub seq: u64,
    /// Length of the whole notification encoding.
    pub total: u32,
    /// Offset of this fragment in it.
    pub offset: u32,
}

/// Splits an encoded notification into frames of at most `frame_max` bytes (header included).
pub fn frames(kind: Kind, nonce: u32, dest: u32, seq: u64, body: &[u8], frame_max: usize) -> Vec<Vec<u8>> {
    let room = frame_max.saturating_sub(HEADER).max(1);
    let mut out = Vec::new();
    let mut off = 0usize;
    loop {
        let end = (off + room).min(body.len());
        let mut f = Vec::with_capacity(HEADER + end - off);
        f.push(MAGIC);
        f.push(kind as u8);
        f.extend_from_slice(&[0, 0]);
        f.extend_from_slice(&nonce.to_le_bytes());
        f.extend_from_slice(&seq.to_le_bytes());
        f.extend_from_slice(&(body.len() as u32).to_le_bytes());
        f.extend_from_slice(&(off as u32).to_le_bytes());
        f.extend_from_slice(&dest.to_le_bytes());
        f.extend_from_slice(&body[off..end]);
        out.push(f);
        off = end;
        if off >= body.len() {
            return out;
        }
    }
}

/// Parses a frame into its header and fragment bytes.
pub fn parse(frame: &[u8]) -> Result<(Header, &[u8]), String> {
    if frame.len() < HEADER {
        return Err(format!("message of {} bytes is shorter than the {HEADER}-byte header", frame.len()));
    }
    if frame[0] != MAGIC {
        return Err(format!("bad magic {:#x}", frame[0]));
    }
    let kind = match frame[1] {
        1 => Kind::Notify,
        2 => Kind::Staged,
        3 => Kind::Heartbeat,
        4 => Kind::Gone,
        5 => Kind::Bye,
        k => return Err(format!("unknown message kind {k}")),
    };
    let u32_at = |i: usize| u32::from_le_bytes(frame[i..i + 4].try_into().expect("4 bytes"));
    let nonce = u32_at(4);
    let seq = u64::from_le_bytes(frame[8..16].try_into().expect("8 bytes"));
    let total = u32_at(16);
    let offset = u32_at(20);
    let dest = u32_at(24);
    let frag = &frame[HEADER..];
    if u64::from(offset) + frag.len() as u64 > u64::from(total) {
        return Err(format!("fragment at {offset} of {} bytes exceeds the total {total}", frag.len()));
    }
    Ok((Header { kind, nonce, dest, seq, total, offset }, frag))
}

/// Most partial messages or unmatched tokens kept at once; beyond it the oldest are dropped with a warning.
const MAX_PENDING: usize = 4096;

struct Partial {
    buf: Vec<u8>,
    got: usize,
    order: u64,
}

/// Reassembles fragmented notifications and pairs staged ones with their CQ-data tokens.
#[derive(Default)]
pub struct Reassembly {
    partial: HashMap<(u32, u64), Partial>,
    staged: HashMap<u64, (Vec<u8>, u64)>,
    tokens: HashMap<u64, u64>,
    clock: u64,
}

fn evict<V>(map: &mut HashMap<u64, (V, u64)>) {
    if map.len() > MAX_PENDING {
        if let Some(k) = map.iter().min_by_key(|(_, (_, o))| *o).map(|(k, _)| *k) {
            tracing::warn!(target: "kvxfer_fabric", "dropping unmatched attached-notification state for token {k:#x}");
            map.remove(&k);
        }
    }
}

impl Reassembly {
    /// Feeds one frame; returns the encoded notification that became deliverable, if any.
    pub fn frame(&mut self, frame: &[u8]) -> Result<Option<Vec<u8>>, String> {
        let (h, frag) = parse(frame)?;
        self.clock += 1;
        let whole = if h.offset == 0 && frag.len() == h.total as usize {
            frag.to_vec()
        } else {
            let key = (h.nonce, h.seq);
            let p = self.partial.entry(key).or_insert_with(|| Partial {
                buf: vec![0; h.total as usize],
                got: 0,
                order: self.clock,
            });
            if p.buf.len() != h.total as usize {
                return Err(format!("fragment total {} disagrees with {} for message {}", h.total, p.buf.len(), h.seq));
            }
            let off = h.offset as usize;
            p.buf[off..off + frag.len()].copy_from_slice(frag);
            p.got += frag.len();
            if p.got < p.buf.len() {
                if self.partial.len() > MAX_PENDING {
                    if let Some(k) = self.partial.iter().min_by_key(|(_, p)| p.order).map(|(k, _)| *k) {
                        tracing::warn!(target: "kvxfer_fabric", "dropping an incomplete message {k:?}");
                        self.partial.remove(&k);
                    }
                }
                return Ok(None);
            }
            self.partial.remove(&key).map(|p| p.buf).unwrap_or_default()
        };
        match h.kind {
            Kind::Heartbeat | Kind::Gone | Kind::Bye => Err(format!("{:?} is not a notification", h.kind)),
            Kind::Notify => Ok(Some(whole)),
            Kind::Staged => {
                if self.tokens.remove(&h.seq).is_some() {
                    Ok(Some(whole))
                } else {
                    self.staged.insert(h.seq, (whole, self.clock));
                    evict(&mut self.staged);
                    Ok(None)
                }
            }
        }
    }

    /// Feeds one remote-CQ-data token; returns the staged notification it releases, if it arrived already.
    pub fn token(&mut self, token: u64) -> Option<Vec<u8>> {
        self.clock += 1;
        if let Some((n, _)) = self.staged.remove(&token) {
            return Some(n);
        }
        self.tokens.insert(token, self.clock);
        if self.tokens.len() > MAX_PENDING {
            if let Some(k) = self.tokens.iter().min_by_key(|(_, o)| **o).map(|(k, _)| *k) {
                self.tokens.remove(&k);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fragments_reassemble_in_any_order_and_interleaved() {
        let a: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        let b: Vec<u8> = (0..700u32).map(|i| (i * 7) as u8).collect();
        let fa = frames(Kind::Notify, 1, 0, 5, &a, 100);
        let fb = frames(Kind::Notify, 2, 0, 5, &b, 64);
        assert!(fa.len() > 10 && fa.iter().all(|f| f.len() <= 100));
        let mut r = Reassembly::default();
        let mut got = Vec::new();
        let mut ib = fb.iter();
        for f in fa.iter().rev() {
            if let Some(x) = r.frame(f).unwrap() {
                got.push(x);
            }
            if let Some(g) = ib.next() {
                if let Some(x) = r.frame(g).unwrap() {
                    got.push(x);
                }
            }
        }
        for g in ib {
            if let Some(x) = r.frame(g).unwrap() {
                got.push(x);
            }
        }
        assert_eq!(got.len(), 2);
        assert!(got.contains(&a) && got.contains(&b));
    }

    #[test]
    fn staged_waits_for_its_token_either_way_round() {
        let mut r = Reassembly::default();
        let f = frames(Kind::Staged, 3, 0, 77, b"hello", 64);
        assert_eq!(r.frame(&f[0]).unwrap(), None);
        assert_eq!(r.token(78), None);
        assert_eq!(r.token(77), Some(b"hello".to_vec()));
        assert_eq!(r.frame(&frames(Kind::Staged, 3, 0, 78, b"x", 64)[0]).unwrap(), Some(b"x".to_vec()));
    }

    #[test]
    fn malformed_frames_are_errors() {
        assert!(parse(&[0; 10]).is_err());
        let mut f = frames(Kind::Notify, 1, 0, 1, b"abc", 64).remove(0);
        f[0] = 0;
        assert!(parse(&f).is_err());
        let mut f = frames(Kind::Notify, 1, 0, 1, b"abc", 64).remove(0);
        f[1] = 9;
        assert!(parse(&f).is_err());
        let mut f = frames(Kind::Notify, 1, 0, 1, b"abc", 64).remove(0);
        f[16] = 1; // total 1 < fragment 3
        assert!(parse(&f).is_err());
    }
}
