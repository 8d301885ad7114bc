//! The notification ring: where attached notifications land at the receiver, and the 32-bit
//! immediates that announce them.
//!
//! **Attached notifications** (ordered after the data of the same transfer): each connection has a
//! notification ring at the receiver, `slots` slots of `slot_size` bytes, registered for remote write.
//! The sender encodes the notification with kvxfer's codec and cuts it with the toolkit's
//! [`Fragmenter`](kvxfer_core::toolkit::Fragmenter) into fragments of at most `slot_size` bytes
//! (header included), and posts one RDMA WRITE WITH IMMEDIATE per fragment, chained after the data
//! writes: the write puts the fragment into the next ring slot, and the immediate says
//! `0:1 | slot:15 | len:16`. RC ordering guarantees the receive completion of the immediate comes
//! after every earlier write of the QP is placed, so the notification is delivered only after its data.
//! The receiver checks the slot and length, copies the fragment out, reposts the receive, and feeds
//! the toolkit's [`Reassembler`](kvxfer_core::toolkit::Reassembler). Slots are flow-controlled by
//! credits: the receiver reports its consumed-fragment count (on the TCP side channel) every
//! `max(1, slots/4)` fragments, and the sender never has more than `slots` fragments unconsumed.
//!
//! **Out-of-band notifications** are SENDs of the same fragments into pre-posted receive buffers.

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
    /// Ring slot the fragment was written to.
    pub slot: u16,
    /// Fragment length in bytes.
    pub len: u16,
}

impl Imm {
    /// Packs into 32 bits (host order; the FFI layer converts to network order).
    pub fn encode(self) -> u32 {
        (u32::from(self.slot & 0x7fff) << 16) | u32::from(self.len)
    }

    /// Unpacks 32 bits; the top bit is reserved (0).
    pub fn decode(v: u32) -> Option<Self> {
        (v >> 31 == 0).then_some(Self { slot: ((v >> 16) & 0x7fff) as u16, len: (v & 0xffff) as u16 })
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

    /// Slots the receiver has not consumed yet, by the sender's count.
    pub fn free(&self) -> u64 {
        u64::from(self.slots) - (self.sent - self.credited)
    }

    /// Takes the next slot for a fragment of `len` bytes (1..=slot_size), or None when the ring is full
    /// or the fragment does not fit a slot.
    pub fn grant(&mut self, len: usize) -> Option<SlotGrant> {
        if self.free() == 0 || len == 0 || len > self.slot_size as usize {
            return None;
        }
        let slot = (self.sent % u64::from(self.slots)) as u32;
        self.sent += 1;
        Some(SlotGrant {
            slot,
            offset: u64::from(slot) * u64::from(self.slot_size),
            imm: Imm { slot: slot as u16, len: len as u16 }.encode(),
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
        let i = Imm::decode(imm).ok_or_else(|| RingError(format!("immediate 0x{imm:08x} sets the reserved bit")))?;
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
        Ok(Fragment { offset: u64::from(i.slot) * u64::from(self.slot_size), len: usize::from(i.len) })
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

#[cfg(test)]
mod tests {
    use super::*;
    use kvxfer_core::toolkit::{Fragmenter, Reassembler};
    use kvxfer_core::{Notification, NotificationBody, RequestId, SenderKey};
    use proptest::prelude::*;
    use std::collections::VecDeque;
    use std::time::Instant;

    proptest! {
        #[test]
        fn immediates_round_trip(slot in 0u16..0x8000, len in any::<u16>()) {
            let i = Imm { slot, len };
            prop_assert_eq!(Imm::decode(i.encode()), Some(i));
        }

        #[test]
        fn every_u32_without_the_reserved_bit_decodes_and_reencodes(v in any::<u32>()) {
            match Imm::decode(v) {
                Some(i) => prop_assert_eq!(i.encode(), v),
                None => prop_assert!(v >> 31 == 1),
            }
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
            let frag = Fragmenter::new(slot_size as usize);
            let mut re = Reassembler::new(MAX_MESSAGE, 4);
            let mut ring = vec![0u8; (slots * slot_size) as usize];
            let mut unread: VecDeque<(u32, u32)> = VecDeque::new(); // (imm, len) in flight
            let mut owner: Vec<Option<u64>> = vec![None; slots as usize]; // fragment seq occupying a slot
            let (mut seq, mut consumed_seq) = (0u64, 0u64);
            let sent: Vec<Notification> = payloads.iter().enumerate().map(|(i, p)| Notification {
                generation: 0,
                request: RequestId(i as u64), sender: SenderKey::from_u64(3), body: NotificationBody::Aux(p.clone()),
            }).collect();
            let mut got = Vec::new();
            let mut drain_one = |unread: &mut VecDeque<(u32, u32)>, tx: &mut RingTx, rx: &mut RingRx, ring: &[u8],
                                 owner: &mut Vec<Option<u64>>, got: &mut Vec<Notification>| -> Result<(), TestCaseError> {
                let (imm, len) = unread.pop_front().unwrap();
                let f = rx.accept(imm, len).map_err(|e| TestCaseError::fail(e.0))?;
                let slot = (f.offset / u64::from(slot_size)) as usize;
                prop_assert_eq!(owner[slot], Some(consumed_seq), "slot overwritten before it was read");
                owner[slot] = None;
                consumed_seq += 1;
                let bytes = &ring[f.offset as usize..f.offset as usize + f.len];
                if let Some(msg) = re.push(7, bytes, Instant::now()).map_err(|e| TestCaseError::fail(e.to_string()))? {
                    got.push(Notification::decode(&msg).map_err(|e| TestCaseError::fail(e.to_string()))?);
                }
                if let Some(c) = rx.credit_due() { tx.credit(c).map_err(|e| TestCaseError::fail(e.0))?; }
                Ok(())
            };
            for n in &sent {
                for part in frag.split(&n.encode().unwrap()).unwrap() {
                    loop {
                        if let Some(g) = tx.grant(part.len()) {
                            let slot = g.slot as usize;
                            prop_assert!(owner[slot].is_none(), "sender reused an unread slot");
                            owner[slot] = Some(seq);
                            seq += 1;
                            ring[g.offset as usize..g.offset as usize + part.len()].copy_from_slice(&part);
                            unread.push_back((g.imm, part.len() as u32));
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
        let bad_slot = Imm { slot: 1, len: 10 }.encode();
        assert!(rx.accept(bad_slot, 10).unwrap_err().0.contains("expected slot 0"));
        let ok = Imm { slot: 0, len: 10 }.encode();
        assert!(rx.accept(ok, 11).is_err(), "length mismatch with the completion");
        let too_long = Imm { slot: 0, len: 65 }.encode();
        assert!(rx.accept(too_long, 65).is_err());
        assert!(rx.accept(Imm { slot: 0, len: 0 }.encode(), 0).is_err());
        assert!(rx.accept(ok | 1 << 31, 10).unwrap_err().0.contains("reserved"));
        assert_eq!(rx.accept(ok, 10).unwrap(), Fragment { offset: 0, len: 10 });
        assert_eq!(rx.credit_due(), Some(1));
        assert_eq!(rx.credit_due(), None);
        assert_eq!(rx.accept(Imm { slot: 1, len: 64 }.encode(), 64).unwrap().offset, 64);
    }

    #[test]
    fn sender_stops_when_full_and_rejects_bogus_credits() {
        let mut tx = RingTx::new(2, 64);
        assert!(tx.grant(65).is_none(), "a fragment larger than a slot is refused");
        assert_eq!(tx.grant(64).unwrap().slot, 0);
        assert_eq!(tx.grant(1).unwrap().offset, 64);
        assert!(tx.grant(1).is_none());
        assert!(tx.credit(3).is_err(), "cannot consume more than was sent");
        tx.credit(1).unwrap();
        assert!(tx.credit(0).is_err(), "credits never go backwards");
        let g = tx.grant(5).unwrap();
        assert_eq!(g.slot, 0);
        assert_eq!(Imm::decode(g.imm), Some(Imm { slot: 0, len: 5 }));
        assert!(check_geometry(0, 4096).is_err());
        assert!(check_geometry(64, 1 << 16).is_err());
        assert!(check_geometry(64, 4096).is_ok());
    }
}
