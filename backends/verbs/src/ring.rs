//! How a full kvxfer [`Notification`](kvxfer_core::Notification) reaches the receiver through 32-bit
//! immediates and SENDs.
//!
//! **Attached notifications** (ordered after the data of the same `write`): each connection has a
//! notification ring at the receiver, `slots` slots of `slot_size` bytes, registered for remote write.
//! The sender encodes the notification with kvxfer's codec, cuts it into fragments of at most
//! `slot_size` bytes, and posts one RDMA WRITE WITH IMMEDIATE per fragment, chained after the data
//! writes: the write puts the fragment into the next ring slot, and the immediate says
//! `more:1 | slot:15 | len:16`. RC ordering guarantees the receive completion of the immediate comes
//! after every earlier write of the QP is placed, so the notification is delivered only after its data.
//! The receiver checks the slot and length, copies the fragment out, reposts the receive, and
//! reassembles until `more == 0`. Slots are flow-controlled by credits: the receiver reports its
//! consumed-fragment count (on the TCP side channel) every `max(1, slots/4)` fragments, and the
//! sender never has more than `slots` fragments unconsumed.
//!
//! **Out-of-band notifications** are SENDs into pre-posted receive buffers: one header byte
//! (`1` more fragments follow, `0` last) then up to `recv_buf - 1` bytes of the encoding.

use std::fmt;

/// Largest slot count (15 bits of the immediate).
pub const MAX_SLOTS: u32 = 1 << 15;
/// Largest slot size (the 16-bit length field holds up to 65535; powers of two up to 32 KiB).
pub const MAX_SLOT_SIZE: u32 = 1 << 15;
/// Largest notification we reassemble: the codec's largest encoding (1 MiB payload + header).
pub const MAX_MESSAGE: usize = kvxfer_core::notify::MAX_PAYLOAD + 64;

/// A decoded immediate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Imm {
    /// More fragments of the same notification follow.
    pub more: bool,
    /// Ring slot the fragment was written to.
    pub slot: u16,
    /// Fragment length in bytes.
    pub len: u16,
}

impl Imm {
    /// Packs into 32 bits (host order; the FFI layer converts to network order).
    pub fn encode(self) -> u32 {
        (u32::from(self.more) << 31) | (u32::from(self.slot & 0x7fff) << 16) | u32::from(self.len)
    }

    /// Unpacks 32 bits; every value decodes (validation is the ring's job).
    pub fn decode(v: u32) -> Self {
        Self { more: v >> 31 == 1, slot: ((v >> 16) & 0x7fff) as u16, len: (v & 0xffff) as u16 }
    }
}

/// A ring protocol violation by the peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingError(pub String);

impl fmt::Display for RingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Checks a ring geometry.
pub fn check_geometry(slots: u32, slot_size: u32) -> Result<(), RingError> {
    if !(1..=MAX_SLOTS).contains(&slots) || !(64..=MAX_SLOT_SIZE).contains(&slot_size) {
        return Err(RingError(format!(
            "notification ring of {slots} slots of {slot_size} bytes: slots must be 1..={MAX_SLOTS} and slot size 64..={MAX_SLOT_SIZE}"
        )));
    }
    Ok(())
}

/// Sender side of a peer's ring.
#[derive(Debug, Clone)]
pub struct RingTx {
    slots: u32,
    slot_size: u32,
    sent: u64,
    credited: u64,
}

/// Where the next fragment goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotGrant {
    /// Slot index.
    pub slot: u32,
    /// Byte offset of the slot in the ring.
    pub offset: u64,
    /// The immediate to send with it.
    pub imm: u32,
}

impl RingTx {
    /// A ring of `slots` × `slot_size` (geometry already checked).
    pub fn new(slots: u32, slot_size: u32) -> Self {
        Self { slots, slot_size, sent: 0, credited: 0 }
    }

    /// Slot size (largest fragment).
    pub fn slot_size(&self) -> u32 {
        self.slot_size
    }

    /// Slots the receiver has not consumed yet, by the sender's count.
    pub fn free(&self) -> u64 {
        u64::from(self.slots) - (self.sent - self.credited)
    }

    /// Takes the next slot for a fragment of `len` bytes (1..=slot_size), or None when the ring is full.
    pub fn grant(&mut self, len: usize, more: bool) -> Option<SlotGrant> {
        assert!(len >= 1 && len <= self.slot_size as usize, "fragment of {len} bytes for slots of {}", self.slot_size);
        if self.free() == 0 {
            return None;
        }
        let slot = (self.sent % u64::from(self.slots)) as u32;
        self.sent += 1;
        Some(SlotGrant {
            slot,
            offset: u64::from(slot) * u64::from(self.slot_size),
            imm: Imm { more, slot: slot as u16, len: len as u16 }.encode(),
        })
    }

    /// Applies a credit report (the receiver's total consumed count).
    pub fn credit(&mut self, consumed: u64) -> Result<(), RingError> {
        if consumed < self.credited || consumed > self.sent {
            return Err(RingError(format!(
                "credit report of {consumed} fragments is outside [{}, {}] (already credited, sent)",
                self.credited, self.sent
            )));
        }
        self.credited = consumed;
        Ok(())
    }
}

/// A fragment the receiver may copy out of its ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fragment {
    /// Byte offset in the ring.
    pub offset: u64,
    /// Bytes.
    pub len: usize,
    /// More fragments follow.
    pub more: bool,
}

/// Receiver side of a ring.
#[derive(Debug, Clone)]
pub struct RingRx {
    slots: u32,
    slot_size: u32,
    consumed: u64,
    reported: u64,
}

impl RingRx {
    /// A ring of `slots` × `slot_size` (geometry already checked).
    pub fn new(slots: u32, slot_size: u32) -> Self {
        Self { slots, slot_size, consumed: 0, reported: 0 }
    }

    /// Validates a write-with-immediate completion (`imm`, `byte_len`) against the expected slot and
    /// counts it consumed (the caller copies the fragment out before the next credit report).
    pub fn accept(&mut self, imm: u32, byte_len: u32) -> Result<Fragment, RingError> {
        let i = Imm::decode(imm);
        let expected = (self.consumed % u64::from(self.slots)) as u16;
        if i.slot != expected {
            return Err(RingError(format!(
                "immediate 0x{imm:08x} names ring slot {}, expected slot {expected} (fragment {})",
                i.slot, self.consumed
            )));
        }
        if i.len == 0 || u32::from(i.len) > self.slot_size || u32::from(i.len) != byte_len {
            return Err(RingError(format!(
                "immediate 0x{imm:08x} says {} bytes, the completion says {byte_len}, slots hold {}",
                i.len, self.slot_size
            )));
        }
        self.consumed += 1;
        Ok(Fragment { offset: u64::from(i.slot) * u64::from(self.slot_size), len: usize::from(i.len), more: i.more })
    }

    /// The consumed count to report to the sender, when enough fragments were consumed since the last report.
    pub fn credit_due(&mut self) -> Option<u64> {
        let threshold = u64::from((self.slots / 4).max(1));
        if self.consumed - self.reported >= threshold {
            self.reported = self.consumed;
            Some(self.consumed)
        } else {
            None
        }
    }
}

/// Splits an encoding into fragments of at most `max` bytes: `(start, end, more)`.
pub fn fragments(len: usize, max: usize) -> Vec<(usize, usize, bool)> {
    let max = max.max(1);
    let mut v = Vec::with_capacity(len.div_ceil(max).max(1));
    let mut start = 0;
    while start < len {
        let end = (start + max).min(len);
        v.push((start, end, end < len));
        start = end;
    }
    v
}

/// Rebuilds messages from fragments arriving in order.
#[derive(Debug, Default)]
pub struct Reassembler {
    buf: Vec<u8>,
}

impl Reassembler {
    /// Adds a fragment; returns the complete message after the last fragment.
    pub fn push(&mut self, bytes: &[u8], more: bool) -> Result<Option<Vec<u8>>, RingError> {
        if self.buf.len() + bytes.len() > MAX_MESSAGE {
            self.buf.clear();
            return Err(RingError(format!("a notification grew past {MAX_MESSAGE} bytes without a last fragment")));
        }
        self.buf.extend_from_slice(bytes);
        if more {
            Ok(None)
        } else {
            Ok(Some(std::mem::take(&mut self.buf)))
        }
    }
}

/// Header byte of an out-of-band SEND fragment.
pub fn send_header(more: bool) -> u8 {
    u8::from(more)
}

/// Parses an out-of-band SEND: `(more, payload)`.
pub fn parse_send(buf: &[u8]) -> Result<(bool, &[u8]), RingError> {
    match buf.split_first() {
        Some((0, rest)) => Ok((false, rest)),
        Some((1, rest)) => Ok((true, rest)),
        Some((h, _)) => Err(RingError(format!("out-of-band SEND with header byte {h} (expected 0 or 1)"))),
        None => Err(RingError("empty out-of-band SEND".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvxfer_core::{Notification, NotificationBody, RequestId, SenderKey};
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn immediates_round_trip(more in any::<bool>(), slot in 0u16..0x8000, len in any::<u16>()) {
            let i = Imm { more, slot, len };
            prop_assert_eq!(Imm::decode(i.encode()), i);
        }

        #[test]
        fn every_u32_decodes_and_reencodes(v in any::<u32>()) {
            prop_assert_eq!(Imm::decode(v).encode(), v);
        }

        /// The whole attached path without a NIC: the sender writes fragments into a simulated remote
        /// ring in post order, the receiver validates the immediates, reassembles and credits; the
        /// notifications come out intact and in order, and no slot is overwritten before it is read.
        #[test]
        fn notifications_survive_the_ring(
            slots in 1u32..8, slot_size in prop_oneof![Just(64u32), Just(128), Just(4096)],
            payloads in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..700), 1..12),
            lag in 0usize..6,
        ) {
            let mut tx = RingTx::new(slots, slot_size);
            let mut rx = RingRx::new(slots, slot_size);
            let mut ring = vec![0u8; (slots * slot_size) as usize];
            let mut unread: std::collections::VecDeque<(u32, u32)> = Default::default(); // (imm, len) in flight
            let mut owner: Vec<Option<u64>> = vec![None; slots as usize]; // fragment seq occupying a slot
            let mut seq = 0u64;
            let mut re = Reassembler::default();
            let sent: Vec<Notification> = payloads.iter().enumerate().map(|(i, p)| Notification {
                request: RequestId(i as u64), sender: SenderKey::from_u64(3), body: NotificationBody::Aux(p.clone()),
            }).collect();
            let mut got = Vec::new();
            let mut consumed_seq = 0u64;
            let mut drain_one = |unread: &mut std::collections::VecDeque<(u32, u32)>, tx: &mut RingTx, rx: &mut RingRx,
                                 ring: &Vec<u8>, owner: &mut Vec<Option<u64>>, got: &mut Vec<Notification>| -> Result<(), TestCaseError> {
                let (imm, len) = unread.pop_front().unwrap();
                let f = rx.accept(imm, len).map_err(|e| TestCaseError::fail(e.0))?;
                let slot = (f.offset / u64::from(slot_size)) as usize;
                prop_assert_eq!(owner[slot], Some(consumed_seq), "slot overwritten before it was read");
                owner[slot] = None;
                consumed_seq += 1;
                if let Some(msg) = re.push(&ring[f.offset as usize..f.offset as usize + f.len], f.more).map_err(|e| TestCaseError::fail(e.0))? {
                    got.push(Notification::decode(&msg).map_err(|e| TestCaseError::fail(e.to_string()))?);
                }
                if let Some(c) = rx.credit_due() { tx.credit(c).map_err(|e| TestCaseError::fail(e.0))?; }
                Ok(())
            };
            for n in &sent {
                let bytes = n.encode().unwrap();
                for (s, e, more) in fragments(bytes.len(), slot_size as usize) {
                    loop {
                        if let Some(g) = tx.grant(e - s, more) {
                            let slot = g.slot as usize;
                            prop_assert!(owner[slot].is_none(), "sender reused an unread slot");
                            owner[slot] = Some(seq);
                            seq += 1;
                            ring[g.offset as usize..g.offset as usize + (e - s)].copy_from_slice(&bytes[s..e]);
                            unread.push_back((g.imm, (e - s) as u32));
                            break;
                        }
                        prop_assert!(!unread.is_empty(), "ring full with nothing in flight: credits deadlocked");
                        drain_one(&mut unread, &mut tx, &mut rx, &ring, &mut owner, &mut got)?;
                    }
                    // The receiver lags `lag` fragments behind.
                    while unread.len() > lag {
                        drain_one(&mut unread, &mut tx, &mut rx, &ring, &mut owner, &mut got)?;
                    }
                }
            }
            while !unread.is_empty() {
                drain_one(&mut unread, &mut tx, &mut rx, &ring, &mut owner, &mut got)?;
            }
            prop_assert_eq!(got, sent);
        }
    }

    #[test]
    fn receiver_rejects_wrong_slots_and_lengths() {
        let mut rx = RingRx::new(4, 64);
        let bad_slot = Imm { more: false, slot: 1, len: 10 }.encode();
        assert!(rx.accept(bad_slot, 10).unwrap_err().0.contains("expected slot 0"));
        let ok = Imm { more: true, slot: 0, len: 10 }.encode();
        assert!(rx.accept(ok, 11).is_err(), "length mismatch with the completion");
        let too_long = Imm { more: false, slot: 0, len: 65 }.encode();
        assert!(rx.accept(too_long, 65).is_err());
        assert!(rx.accept(Imm { more: false, slot: 0, len: 0 }.encode(), 0).is_err());
        assert_eq!(rx.accept(ok, 10).unwrap(), Fragment { offset: 0, len: 10, more: true });
        assert_eq!(rx.credit_due(), Some(1));
        assert_eq!(rx.credit_due(), None);
        assert_eq!(rx.accept(Imm { more: false, slot: 1, len: 64 }.encode(), 64).unwrap().offset, 64);
    }

    #[test]
    fn sender_stops_when_full_and_rejects_bogus_credits() {
        let mut tx = RingTx::new(2, 64);
        assert_eq!(tx.grant(64, false).unwrap().slot, 0);
        assert_eq!(tx.grant(1, false).unwrap().offset, 64);
        assert!(tx.grant(1, false).is_none());
        assert!(tx.credit(3).is_err(), "cannot consume more than was sent");
        tx.credit(1).unwrap();
        assert!(tx.credit(0).is_err(), "credits never go backwards");
        let g = tx.grant(5, true).unwrap();
        assert_eq!(g.slot, 0);
        assert_eq!(Imm::decode(g.imm), Imm { more: true, slot: 0, len: 5 });
    }

    #[test]
    fn fragments_and_send_headers() {
        assert_eq!(fragments(10, 4), vec![(0, 4, true), (4, 8, true), (8, 10, false)]);
        assert_eq!(fragments(4, 4), vec![(0, 4, false)]);
        assert!(fragments(0, 4).is_empty());
        assert_eq!(parse_send(&[send_header(true), 9, 8]).unwrap(), (true, &[9u8, 8][..]));
        assert_eq!(parse_send(&[send_header(false)]).unwrap(), (false, &[][..]));
        assert!(parse_send(&[2, 1]).is_err());
        assert!(parse_send(&[]).is_err());
        assert!(check_geometry(0, 4096).is_err());
        assert!(check_geometry(64, 1 << 16).is_err());
        assert!(check_geometry(64, 4096).is_ok());
        let mut r = Reassembler::default();
        assert!(r.push(&vec![0; MAX_MESSAGE], true).unwrap().is_none());
        assert!(r.push(&[1], false).is_err(), "over-long message is refused");
        assert_eq!(r.push(&[1, 2], false).unwrap(), Some(vec![1, 2]), "and the reassembler recovers");
    }
}
