//! The bounce-buffer pipeline: the order in which a stream of chunks goes through a fixed set of
//! staging slots in two stages, written once, without IO, so that it can be proven with host copies.
//!
//! A chunk is *filled* into a slot (stage one), then *drained* out of it (stage two); the slot is
//! free again once the drain completed. On the sending side of a transport with CUDA memory the
//! fill is the device-to-host copy into pinned memory and the drain the socket write; on the
//! receiving side the fill is the socket read into pinned memory and the drain the host-to-device
//! copy, after which the chunk has *landed* and may be acknowledged. The machine decides, and
//! nothing else does:
//!
//! - fills start in push order, each into a free slot, at most `max_fills` at once;
//! - drains start in push order, a chunk's only after its fill completed, at most `max_drains` at
//!   once; so the fill of chunk n+1 overlaps the drain of chunk n whenever a slot is free;
//! - a slot is never filled again before the drain that empties it completed;
//! - chunks land (are reported by [`Pipeline::landed`]) in push order, each only after its drain
//!   completed, whatever order the drains complete in.
//!
//! The caller executes the [`Action`]s that [`Pipeline::poll`] returns and reports completions with
//! [`Pipeline::filled`] and [`Pipeline::drained`]. [`Pipeline::packing`] lays the pieces of one chunk
//! out in its slot.

use std::collections::{BTreeMap, VecDeque};

/// What the caller is to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Start filling `chunk` into `slot`.
    Fill {
        /// The chunk (as numbered by [`Pipeline::push`]).
        chunk: u64,
        /// The staging slot, in `0..slots`.
        slot: usize,
    },
    /// Start draining `chunk` out of `slot` (its fill completed).
    Drain {
        /// The chunk.
        chunk: u64,
        /// Its slot.
        slot: usize,
    },
}

/// A completion the pipeline did not expect: a caller bug, reported instead of corrupting the books.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PipelineError {
    /// `filled` or `drained` named a chunk that is not in that stage.
    #[error("staging pipeline: chunk {chunk} reported {what} but it is not {stage}")]
    Unexpected {
        /// The chunk.
        chunk: u64,
        /// The completion reported ("filled" or "drained").
        what: &'static str,
        /// The stage it would have to be in.
        stage: &'static str,
    },
    /// Pieces that do not fit in one slot.
    #[error("staging pipeline: {bytes} bytes of pieces do not fit in a slot of {slot} bytes")]
    TooLarge {
        /// Bytes asked for.
        bytes: u64,
        /// Slot size.
        slot: u64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Pushed, waiting for a slot.
    Queued,
    Filling,
    Filled,
    Draining,
    Drained,
}

#[derive(Debug)]
struct Entry {
    stage: Stage,
    slot: Option<usize>,
}

/// The two-stage pipeline over `slots` staging slots (see the module docs).
#[derive(Debug)]
pub struct Pipeline {
    slots: usize,
    max_fills: usize,
    max_drains: usize,
    free: VecDeque<usize>,
    chunks: BTreeMap<u64, Entry>,
    next_id: u64,
    /// The oldest chunk whose fill has not started.
    next_fill: u64,
    /// The oldest chunk whose drain has not started.
    next_drain: u64,
    fills: usize,
    drains: usize,
}

impl Pipeline {
    /// A pipeline over `slots` slots (at least 1) with at most `max_fills` fills and `max_drains`
    /// drains running at once (each at least 1). A socket stage is sequential (1); a copy stage on
    /// one CUDA stream may run as many as there are slots.
    pub fn new(slots: usize, max_fills: usize, max_drains: usize) -> Self {
        let slots = slots.max(1);
        Self {
            slots,
            max_fills: max_fills.max(1),
            max_drains: max_drains.max(1),
            free: (0..slots).collect(),
            chunks: BTreeMap::new(),
            next_id: 0,
            next_fill: 0,
            next_drain: 0,
            fills: 0,
            drains: 0,
        }
    }

    /// Slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Appends a chunk; returns its number (0, 1, 2, ...).
    pub fn push(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.chunks.insert(id, Entry { stage: Stage::Queued, slot: None });
        id
    }

    /// Chunks pushed and not yet landed.
    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    /// Whether every chunk pushed has landed.
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// Whether a chunk pushed now could start its fill at once (a slot is free and no earlier
    /// chunk waits for one).
    pub fn has_room(&self) -> bool {
        !self.free.is_empty() && self.next_fill == self.next_id && self.fills < self.max_fills
    }

    /// The next action allowed now, if any. Call until `None` after every push and completion.
    pub fn poll(&mut self) -> Option<Action> {
        // Drains first: they free slots.
        if self.drains < self.max_drains {
            if let Some(e) = self.chunks.get_mut(&self.next_drain) {
                if e.stage == Stage::Filled {
                    e.stage = Stage::Draining;
                    self.drains += 1;
                    let chunk = self.next_drain;
                    self.next_drain += 1;
                    return Some(Action::Drain { chunk, slot: e.slot.expect("a filled chunk has a slot") });
                }
            }
        }
        if self.fills < self.max_fills && self.next_fill < self.next_id {
            if let Some(slot) = self.free.pop_front() {
                let chunk = self.next_fill;
                let e = self.chunks.get_mut(&chunk).expect("chunks from next_fill on are present");
                e.stage = Stage::Filling;
                e.slot = Some(slot);
                self.fills += 1;
                self.next_fill += 1;
                return Some(Action::Fill { chunk, slot });
            }
        }
        None
    }

    fn expect(
        &mut self,
        chunk: u64,
        stage: Stage,
        what: &'static str,
        name: &'static str,
    ) -> Result<&mut Entry, PipelineError> {
        match self.chunks.get_mut(&chunk) {
            Some(e) if e.stage == stage => Ok(e),
            _ => Err(PipelineError::Unexpected { chunk, what, stage: name }),
        }
    }

    /// The fill of `chunk` completed.
    pub fn filled(&mut self, chunk: u64) -> Result<(), PipelineError> {
        self.expect(chunk, Stage::Filling, "filled", "filling")?.stage = Stage::Filled;
        self.fills -= 1;
        Ok(())
    }

    /// The drain of `chunk` completed: its slot is free again.
    pub fn drained(&mut self, chunk: u64) -> Result<(), PipelineError> {
        let e = self.expect(chunk, Stage::Draining, "drained", "draining")?;
        e.stage = Stage::Drained;
        let slot = e.slot.take().expect("a draining chunk has a slot");
        self.drains -= 1;
        self.free.push_back(slot);
        Ok(())
    }

    /// The oldest chunk, once it has landed (its drain and every earlier chunk's completed); it
    /// leaves the books.
    pub fn landed(&mut self) -> Option<u64> {
        let (&chunk, e) = self.chunks.iter().next()?;
        if e.stage != Stage::Drained {
            return None;
        }
        self.chunks.remove(&chunk);
        Some(chunk)
    }

    /// The oldest chunk not yet landed and its stage name, for diagnostics.
    pub fn oldest(&self) -> Option<(u64, &'static str)> {
        self.chunks.iter().next().map(|(c, e)| {
            (
                *c,
                match e.stage {
                    Stage::Queued => "queued",
                    Stage::Filling => "filling",
                    Stage::Filled => "filled",
                    Stage::Draining => "draining",
                    Stage::Drained => "drained",
                },
            )
        })
    }

    /// Lays out pieces of `(len, count)` rows back to back in a slot of `slot` bytes: the offset of
    /// each piece's first row. The rows of a piece are packed (`len` apart), pieces follow each
    /// other in order, so a slot holds exactly the bytes of a frame's payload in wire order.
    pub fn packing(pieces: &[(u64, u64)], slot: u64) -> Result<Vec<u64>, PipelineError> {
        let mut at = 0u64;
        let mut out = Vec::with_capacity(pieces.len());
        for &(len, count) in pieces {
            out.push(at);
            at = len
                .checked_mul(count)
                .and_then(|b| b.checked_add(at))
                .ok_or(PipelineError::TooLarge { bytes: u64::MAX, slot })?;
        }
        if at > slot {
            return Err(PipelineError::TooLarge { bytes: at, slot });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn fill_of_the_next_chunk_overlaps_the_drain_of_this_one() {
        let mut p = Pipeline::new(2, 2, 1);
        let (a, b, c) = (p.push(), p.push(), p.push());
        assert_eq!(p.poll(), Some(Action::Fill { chunk: a, slot: 0 }));
        assert_eq!(p.poll(), Some(Action::Fill { chunk: b, slot: 1 }));
        assert_eq!(p.poll(), None, "no free slot for c");
        p.filled(a).unwrap();
        assert_eq!(p.poll(), Some(Action::Drain { chunk: a, slot: 0 }));
        p.filled(b).unwrap();
        assert_eq!(p.poll(), None, "one drain at a time; b waits although filled");
        p.drained(a).unwrap();
        assert_eq!(p.landed(), Some(a));
        assert_eq!(p.poll(), Some(Action::Drain { chunk: b, slot: 1 }));
        assert_eq!(p.poll(), Some(Action::Fill { chunk: c, slot: 0 }), "c fills while b drains");
        assert!(matches!(p.filled(b), Err(PipelineError::Unexpected { .. })));
        assert!(matches!(p.drained(c), Err(PipelineError::Unexpected { .. })));
        p.drained(b).unwrap();
        p.filled(c).unwrap();
        assert_eq!(p.poll(), Some(Action::Drain { chunk: c, slot: 0 }));
        p.drained(c).unwrap();
        assert_eq!((p.landed(), p.landed(), p.landed()), (Some(b), Some(c), None));
        assert!(p.is_empty() && p.has_room());
    }

    #[test]
    fn landing_is_in_order_whatever_order_drains_complete_in() {
        let mut p = Pipeline::new(3, 1, 3);
        let ids: Vec<u64> = (0..3).map(|_| p.push()).collect();
        for &c in &ids {
            assert_eq!(p.poll(), Some(Action::Fill { chunk: c, slot: c as usize }));
            p.filled(c).unwrap();
            assert_eq!(p.poll(), Some(Action::Drain { chunk: c, slot: c as usize }));
        }
        p.drained(2).unwrap();
        p.drained(1).unwrap();
        assert_eq!(p.landed(), None, "chunk 0 has not landed");
        assert_eq!(p.oldest(), Some((0, "draining")));
        p.drained(0).unwrap();
        assert_eq!((p.landed(), p.landed(), p.landed(), p.landed()), (Some(0), Some(1), Some(2), None));
    }

    #[test]
    fn packing_lays_pieces_out_back_to_back() {
        assert_eq!(Pipeline::packing(&[(4, 2), (3, 1), (0, 5), (1, 1)], 12).unwrap(), vec![0, 8, 11, 11]);
        assert!(matches!(Pipeline::packing(&[(4, 4)], 15), Err(PipelineError::TooLarge { bytes: 16, slot: 15 })));
        assert!(Pipeline::packing(&[(u64::MAX, 2)], u64::MAX).is_err());
    }

    /// One chunk of the simulation: `len` bytes from `src` in the source to `dst` in the destination.
    #[derive(Debug, Clone)]
    struct Piece {
        src: usize,
        dst: usize,
        len: usize,
    }

    /// Runs a transfer through the machine with host copies as the two stages. The `order` bytes pick
    /// which running operation completes next (any order, as completions may come). Checks every
    /// invariant of the module docs on the way.
    fn simulate(
        pieces: &[Piece],
        slots: usize,
        max_fills: usize,
        max_drains: usize,
        slot_bytes: usize,
        order: &[u8],
    ) -> Result<Vec<u8>, TestCaseError> {
        let source: Vec<u8> = (0..4096).map(|i| (i * 7 + 3) as u8).collect();
        let mut dest = vec![0u8; 4096];
        let mut staging = vec![vec![0u8; slot_bytes]; slots];
        // Which chunk each slot holds (None: free).
        let mut owner: Vec<Option<u64>> = vec![None; slots];
        let mut p = Pipeline::new(slots, max_fills, max_drains);
        let ids: Vec<u64> = pieces.iter().map(|_| p.push()).collect();
        prop_assert_eq!(ids.clone(), (0..pieces.len() as u64).collect::<Vec<_>>());
        // Running operations: (is_drain, chunk, slot).
        let mut running: Vec<(bool, u64, usize)> = Vec::new();
        let mut landed = Vec::new();
        let mut drains_started = Vec::new();
        let mut filled: Vec<u64> = Vec::new();
        let mut done_drains = 0usize;
        for step in 0..100_000usize {
            while let Some(a) = p.poll() {
                match a {
                    Action::Fill { chunk, slot } => {
                        prop_assert!(
                            owner[slot].is_none(),
                            "slot {} refilled while chunk {:?} holds it",
                            slot,
                            owner[slot]
                        );
                        owner[slot] = Some(chunk);
                        running.push((false, chunk, slot));
                    }
                    Action::Drain { chunk, slot } => {
                        prop_assert_eq!(owner[slot], Some(chunk));
                        drains_started.push(chunk);
                        running.push((true, chunk, slot));
                    }
                }
                prop_assert!(running.iter().filter(|r| !r.0).count() <= max_fills);
                prop_assert!(running.iter().filter(|r| r.0).count() <= max_drains);
            }
            // Work-conserving: nothing allowed is left idle (so the fill of the next chunk runs
            // while this one drains whenever a slot is free).
            let fills = running.iter().filter(|r| !r.0).count();
            let drains = running.iter().filter(|r| r.0).count();
            let started_fills = owner.iter().flatten().count() + done_drains;
            prop_assert!(
                !(started_fills < pieces.len() && owner.iter().any(Option::is_none) && fills < max_fills),
                "a fill could start but did not"
            );
            let next_drain = drains_started.len();
            prop_assert!(
                !(next_drain < pieces.len() && filled.contains(&(next_drain as u64)) && drains < max_drains),
                "a drain could start but did not"
            );
            while let Some(c) = p.landed() {
                landed.push(c);
            }
            if running.is_empty() {
                break;
            }
            let pick = order.get(step).copied().unwrap_or(0) as usize % running.len();
            let (drain, chunk, slot) = running.remove(pick);
            let pc = &pieces[chunk as usize];
            if drain {
                dest[pc.dst..pc.dst + pc.len].copy_from_slice(&staging[slot][..pc.len]);
                owner[slot] = None;
                done_drains += 1;
                p.drained(chunk).map_err(|e| TestCaseError::fail(e.to_string()))?;
            } else {
                staging[slot][..pc.len].copy_from_slice(&source[pc.src..pc.src + pc.len]);
                filled.push(chunk);
                p.filled(chunk).map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
        }
        prop_assert!(p.is_empty(), "stuck: {:?}", p.oldest());
        prop_assert_eq!(&landed, &ids, "landing order");
        prop_assert_eq!(&drains_started, &ids, "drain order");
        for pc in pieces {
            prop_assert_eq!(&dest[pc.dst..pc.dst + pc.len], &source[pc.src..pc.src + pc.len]);
        }
        Ok(dest)
    }

    proptest! {
        /// Host copies through the machine: every byte arrives, in order, without a slot being
        /// overwritten in use, whatever the slot count, the stage limits and the completion order.
        #[test]
        fn host_copies_through_the_pipeline_arrive_exactly(
            lens in proptest::collection::vec(1usize..64, 0..40),
            slots in 1usize..5,
            max_fills in 1usize..4,
            max_drains in 1usize..4,
            order in proptest::collection::vec(any::<u8>(), 0..400),
        ) {
            // Disjoint destinations, shuffled sources.
            let mut pieces = Vec::new();
            let mut at = 0;
            for (i, len) in lens.iter().enumerate() {
                pieces.push(Piece { src: (i * 97) % 2048, dst: at, len: *len });
                at += len;
            }
            simulate(&pieces, slots, max_fills, max_drains, 64, &order)?;
        }
    }
}
