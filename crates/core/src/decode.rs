//! The decode side's request book (SEMANTICS §5-§6): a decode rank's requests, sans-IO.
//!
//! [`CompletionTracker`] decides when a handed-off request is done, failed or fenced; this book
//! owns it and holds the rest of a decode request's life around it, so that a decode rank's request
//! lives in one place: the request before its handoff (and an abort then), the generation of each
//! handoff (the rank's epoch in the upper 32 bits, a counter below), the asks that a failed
//! request's senders stop and fence (repeated after 1, 2, 4, then every 8 s while a fence is
//! missing), the end-to-end digest check's progress, and which outcomes were counted.
//!
//! Events go in (`create`, `hand_off`, `handle`, `abort`, the sender losses, `poll`, `check_done`,
//! `release`) with the time passed in; what to do comes out as return values: the generation to put
//! on the handoff, the [`Ask`]s to send, the digest [`Check`]s to run, the [`Outcome`]s to count. The
//! driver (the engine's `Agent`) says whether its connect failed and whether its links are up, which
//! the phase before the handoff depends on.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use crate::model::{RankId, SenderKey};
use crate::notify::{Notification, RequestId};
use crate::phase::Phase;
use crate::prefill::{BookStatus, CallError};
use crate::tracker::{
    CompletionTracker, ExpectSpec, Failure, Fence, Handled, Loss, Status, TrackerConfig, TrackerStats,
};

/// How long a decode rank waits for a sender's fence after asking it to abort before it asks again;
/// each further ask waits twice as long, up to [`FENCE_REASK_MAX`]. A prefill rank answers every
/// ask (a repeated one with another fence), so a lost ask or answer costs one wait.
pub const FENCE_REASK: Duration = Duration::from_secs(1);
/// The longest wait between two asks.
pub const FENCE_REASK_MAX: Duration = Duration::from_secs(8);

/// The wait before ask number `n + 1` (after `n + 1` asks were sent).
pub fn reask_after(n: u32) -> Duration {
    FENCE_REASK.saturating_mul(1 << n.min(3)).min(FENCE_REASK_MAX)
}

/// What the book needs to know of its rank.
#[derive(Debug, Clone)]
pub struct DecodeConfig {
    /// This decode rank.
    pub rank: RankId,
    /// Every sender key a request of this rank must hear from (`Topology::expected_senders`).
    pub senders: Vec<SenderKey>,
    /// This rank's membership epoch (the upper 32 bits of its generations).
    pub epoch: u64,
    /// A handed-off request without an outcome this long after its handoff fails.
    pub request_timeout: Duration,
    /// Whether handoffs ask for the end-to-end digest.
    pub digest: bool,
    /// The tracker's bounds.
    pub tracker: TrackerConfig,
}

/// Where a request's digest check stands.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Verify {
    Off,
    /// Waits until the tracker has every chunk and digest.
    Waiting,
    /// Hashing the landed bytes.
    Running,
    /// Checked: `Err` names the sender and the first bad range.
    Checked(Result<(), String>),
}

#[derive(Debug, Clone)]
struct Recv {
    generation: Option<u64>,
    /// Senders asked to abort: when last asked, and how many times before.
    asks: BTreeMap<SenderKey, (Instant, u32)>,
    /// An abort before the handoff (nothing to fence).
    early_failure: Option<String>,
    counted: bool,
    /// When the request was handed off, and the bytes its pages take on this rank.
    handed_off: Option<(Instant, u64)>,
    verify: Verify,
    /// The pages handed off (kept for the digest check only, which takes them).
    pages: Vec<u32>,
}

/// An abort to send: ask `key` to stop writing `room` (generation `generation`) and fence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ask {
    /// The request.
    pub room: RequestId,
    /// Its generation.
    pub generation: u64,
    /// The sender asked.
    pub key: SenderKey,
    /// How many times it was asked before (0: the first ask).
    pub repeated: u32,
    /// Why the request failed (goes in the abort).
    pub reason: String,
}

/// A digest check to run: hash `pages` of this rank's pool as each sender wrote them and compare
/// with the digest it sent; report with [`DecodeBook::check_done`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// The request.
    pub room: RequestId,
    /// Its generation.
    pub generation: u64,
    /// The destination pages.
    pub pages: Vec<u32>,
    /// Per sender key, the digest it sent.
    pub sent: Vec<(SenderKey, Option<Vec<u64>>)>,
}

/// Why a decode request failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeCause {
    /// Aborted before its handoff.
    AbortedEarly,
    /// The driver's connect failed.
    Connect,
    /// The digest check found a difference.
    Digest,
    /// The tracker's failure.
    Tracker(Failure),
    /// Not tracked (should not happen).
    Untracked,
}

/// A request that became final and was not counted yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The request.
    pub room: RequestId,
    /// Its generation, if it was handed off.
    pub generation: Option<u64>,
    /// `Success` or `Failed`.
    pub phase: Phase,
    /// Why it failed.
    pub reason: Option<String>,
    /// When it was handed off, and its bytes on this rank.
    pub handed_off: Option<(Instant, u64)>,
    /// Why it failed, as a cause (`None` on success).
    pub cause: Option<DecodeCause>,
}

/// The decode side's requests of one rank (see the module docs).
#[derive(Debug, Clone)]
pub struct DecodeBook {
    cfg: DecodeConfig,
    tracker: CompletionTracker,
    reqs: HashMap<RequestId, Recv>,
    next_gen: u64,
}

impl DecodeBook {
    /// An empty book.
    pub fn new(cfg: DecodeConfig) -> Self {
        let tracker = CompletionTracker::with_config(cfg.tracker);
        Self { cfg, tracker, reqs: HashMap::new(), next_gen: 1 }
    }

    /// Creates the request of `room` (the engine's receiver), not handed off yet.
    pub fn create(&mut self, room: RequestId) -> Result<(), CallError> {
        if self.reqs.contains_key(&room) {
            return Err(CallError::RoomInUse);
        }
        let r = Recv {
            generation: None,
            asks: BTreeMap::new(),
            early_failure: None,
            counted: false,
            handed_off: None,
            verify: Verify::Off,
            pages: Vec::new(),
        };
        self.reqs.insert(room, r);
        Ok(())
    }

    /// Hands the request off at `now`: its destination `pages` (already checked against the pool),
    /// whether it wants aux, and the bytes its pages take. Returns the generation to put on the
    /// handoff. A refusal changes nothing.
    pub fn hand_off(
        &mut self,
        room: RequestId,
        pages: &[u32],
        aux: bool,
        bytes: u64,
        now: Instant,
    ) -> Result<u64, CallError> {
        let r = self.reqs.get(&room).ok_or(CallError::Unknown)?;
        if r.generation.is_some() || r.early_failure.is_some() {
            return Err(CallError::Refused("send_metadata was already called (or the request was aborted)".into()));
        }
        let generation = (self.cfg.epoch << 32) | (self.next_gen & 0xffff_ffff);
        let spec = ExpectSpec {
            generation,
            senders: self.cfg.senders.clone(),
            aux,
            state: false,
            digest: self.cfg.digest,
            deadline: now + self.cfg.request_timeout,
        };
        self.tracker.expect(room, spec, now).map_err(|e| CallError::Refused(e.to_string()))?;
        self.next_gen += 1;
        let digest = self.cfg.digest;
        let r = self.reqs.get_mut(&room).expect("looked up above");
        r.generation = Some(generation);
        r.handed_off = Some((now, bytes));
        if digest {
            r.verify = Verify::Waiting;
            r.pages = pages.to_vec();
        }
        Ok(generation)
    }

    /// A notification from a sender.
    pub fn handle(&mut self, n: &Notification, now: Instant) -> Handled {
        self.tracker.handle(n, now)
    }

    /// Aborts the request. Returns whether this call failed a request that had no outcome.
    pub fn abort(&mut self, room: RequestId, reason: &str, now: Instant) -> bool {
        let Some(r) = self.reqs.get_mut(&room) else { return false };
        if r.generation.is_none() {
            if r.early_failure.is_none() {
                r.early_failure = Some(format!("aborted before the handoff: {reason}"));
                return true;
            }
            return false;
        }
        let pending = matches!(self.tracker.status(room, now), Some(Status::Pending));
        self.tracker.abort(room, reason);
        pending
    }

    /// The driver gave up on a sender ([`CompletionTracker::sender_lost`]).
    pub fn sender_lost(&mut self, key: SenderKey, reason: &str) -> Loss {
        self.tracker.sender_lost(key, reason)
    }

    /// The cut-off of a loss was confirmed ([`CompletionTracker::sender_cut_off`]).
    pub fn sender_cut_off(&mut self, key: SenderKey, loss: u64) -> Vec<RequestId> {
        self.tracker.sender_cut_off(key, loss)
    }

    /// The cut-off of a loss could not be confirmed ([`CompletionTracker::sender_quarantined`]).
    pub fn sender_quarantined(&mut self, key: SenderKey, loss: u64, why: &str) -> Vec<RequestId> {
        self.tracker.sender_quarantined(key, loss, why)
    }

    /// A sender is connected again ([`CompletionTracker::sender_back`]).
    pub fn sender_back(&mut self, key: SenderKey) {
        self.tracker.sender_back(key)
    }

    /// The driver's timer at `now`: deadlines pass, and every sender of a failed request that may
    /// still write is asked to stop and fence: once, then again after 1, 2, 4 and every 8 s while
    /// its fence is missing. A sender the driver is not connected to (`connected(key)` false) is
    /// asked on a later tick, once it is (an ask sent now would be dropped).
    pub fn poll(&mut self, now: Instant, connected: impl Fn(SenderKey) -> bool) -> Vec<Ask> {
        self.tracker.poll_deadlines(now);
        let mut asks = Vec::new();
        let mut rooms: Vec<RequestId> = self.reqs.keys().copied().collect();
        rooms.sort_unstable();
        for room in rooms {
            let r = self.reqs.get_mut(&room).expect("listed");
            let Some(generation) = r.generation else { continue };
            let Some(Fence::Closing(keys)) = self.tracker.fence(room, now) else { continue };
            let reason = match self.tracker.status(room, now) {
                Some(Status::Failed(f)) => f.to_string(),
                _ => "aborted".into(),
            };
            for k in keys {
                if !connected(k) {
                    continue;
                }
                let due = match r.asks.get(&k) {
                    None => true,
                    Some((at, n)) => now.saturating_duration_since(*at) >= reask_after(*n),
                };
                if due {
                    let repeated = r.asks.get(&k).map_or(0, |(_, n)| n + 1);
                    r.asks.insert(k, (now, repeated));
                    asks.push(Ask { room, generation, key: k, repeated, reason: reason.clone() });
                }
            }
        }
        asks
    }

    /// The digest checks that can start now (the tracker has every chunk and digest); each is marked
    /// running and takes the request's pages.
    pub fn take_checks(&mut self, now: Instant) -> Vec<Check> {
        let mut checks = Vec::new();
        for (room, r) in self.reqs.iter_mut() {
            if r.verify != Verify::Waiting || !matches!(self.tracker.status(*room, now), Some(Status::Done)) {
                continue;
            }
            let Some(generation) = r.generation else { continue };
            let sent =
                self.cfg.senders.iter().map(|k| (*k, self.tracker.digest(*room, *k).map(<[u64]>::to_vec))).collect();
            r.verify = Verify::Running;
            checks.push(Check { room: *room, generation, pages: std::mem::take(&mut r.pages), sent });
        }
        checks.sort_unstable_by_key(|c| c.room);
        checks
    }

    /// A digest check finished (`Err` names the sender and the first bad range). A check of a
    /// released or reused request changes nothing.
    pub fn check_done(&mut self, room: RequestId, generation: u64, result: Result<(), String>) {
        if let Some(r) = self.reqs.get_mut(&room).filter(|r| r.generation == Some(generation)) {
            r.verify = Verify::Checked(result);
        }
    }

    fn phase_of(
        &mut self,
        room: RequestId,
        connect_error: Option<&str>,
        connected: bool,
        now: Instant,
    ) -> Option<(Phase, Option<String>, bool)> {
        let rank = self.cfg.rank;
        let r = self.reqs.get(&room)?;
        if let Some(why) = &r.early_failure {
            return Some((Phase::Failed, Some(why.clone()), true));
        }
        // The initial connect failed: no handoff went out, so nothing can land.
        if let Some(e) = connect_error {
            let why = format!("decode rank {rank}: connecting to its prefill ranks failed: {e}");
            return Some((Phase::Failed, Some(why), true));
        }
        if r.generation.is_none() {
            let phase = if connected { Phase::WaitingForInput } else { Phase::Bootstrapping };
            return Some((phase, None, true));
        }
        let verify = r.verify.clone();
        Some(match self.tracker.status(room, now) {
            None => (Phase::Failed, Some("the request is not tracked".into()), true),
            Some(Status::Pending) => (Phase::Transferring, None, false),
            Some(Status::Done) => match verify {
                Verify::Off | Verify::Checked(Ok(())) => (Phase::Success, None, true),
                // Every sender finished: nothing more can land.
                Verify::Checked(Err(why)) => (Phase::Failed, Some(why), true),
                Verify::Waiting | Verify::Running => (Phase::Transferring, None, false),
            },
            Some(Status::Failed(f)) => {
                let reason = format!("{f} (decode rank {rank})");
                match self.tracker.fence(room, now) {
                    Some(Fence::Closed) => (Phase::Failed, Some(reason), true),
                    Some(Fence::Quarantined(q)) => {
                        let who: Vec<String> = q.into_iter().map(|(_, why)| why).collect();
                        (Phase::Aborting, Some(format!("{reason}; QUARANTINED: {}", who.join("; "))), false)
                    }
                    _ => (Phase::Aborting, Some(reason), false),
                }
            }
        })
    }

    /// The request's status: `connect_error` when the driver's initial connect failed, `connected`
    /// whether its links are up (the phase before the handoff).
    pub fn status(
        &mut self,
        room: RequestId,
        connect_error: Option<&str>,
        connected: bool,
        now: Instant,
    ) -> BookStatus {
        match self.phase_of(room, connect_error, connected, now) {
            None => BookStatus {
                phase: Phase::Failed,
                reason: Some("the request was released or never created".into()),
                pages_reusable: true,
            },
            Some((phase, reason, pages_reusable)) => BookStatus { phase, reason, pages_reusable },
        }
    }

    fn cause_of(&mut self, room: RequestId, connect_failed: bool, now: Instant) -> DecodeCause {
        let Some(r) = self.reqs.get(&room) else { return DecodeCause::Untracked };
        if r.early_failure.is_some() {
            return DecodeCause::AbortedEarly;
        }
        if connect_failed {
            return DecodeCause::Connect;
        }
        if matches!(r.verify, Verify::Checked(Err(_))) {
            return DecodeCause::Digest;
        }
        match self.tracker.status(room, now) {
            Some(Status::Failed(f)) => DecodeCause::Tracker(f),
            _ => DecodeCause::Untracked,
        }
    }

    /// The requests that became final since the last call (each reported once).
    pub fn take_outcomes(&mut self, connect_error: Option<&str>, connected: bool, now: Instant) -> Vec<Outcome> {
        let mut rooms: Vec<RequestId> = self.reqs.iter().filter(|(_, r)| !r.counted).map(|(k, _)| *k).collect();
        rooms.sort_unstable();
        let mut out = Vec::new();
        for room in rooms {
            let Some((phase, reason, _)) = self.phase_of(room, connect_error, connected, now) else { continue };
            if !phase.is_final() {
                continue;
            }
            let cause = (phase == Phase::Failed).then(|| self.cause_of(room, connect_error.is_some(), now));
            let r = self.reqs.get_mut(&room).expect("listed");
            r.counted = true;
            out.push(Outcome { room, generation: r.generation, phase, reason, handed_off: r.handed_off, cause });
        }
        out
    }

    /// Frees the request: refused (changing nothing) unless it is final with its pages reusable.
    /// Late notifications of its generation are dropped afterwards.
    pub fn release(
        &mut self,
        room: RequestId,
        connect_error: Option<&str>,
        connected: bool,
        now: Instant,
    ) -> Result<BookStatus, CallError> {
        if !self.reqs.contains_key(&room) {
            return Err(CallError::Unknown);
        }
        let s = self.status(room, connect_error, connected, now);
        if !(s.phase.is_final() && s.pages_reusable) {
            return Err(CallError::Refused(format!(
                "cannot release while {}: writes may still land; abort and wait first",
                s.phase
            )));
        }
        self.tracker.release(room, now);
        self.reqs.remove(&room);
        Ok(s)
    }

    /// The request's generation, once handed off.
    pub fn generation(&self, room: RequestId) -> Option<u64> {
        self.reqs.get(&room).and_then(|r| r.generation)
    }

    /// The aux payload, once received.
    pub fn aux(&self, room: RequestId) -> Option<Vec<u8>> {
        self.tracker.aux(room).map(<[u8]>::to_vec)
    }

    /// Every room with a request.
    pub fn rooms(&self) -> Vec<RequestId> {
        self.reqs.keys().copied().collect()
    }

    /// Requests created and not released.
    pub fn len(&self) -> usize {
        self.reqs.len()
    }

    /// Whether no request is held.
    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    /// Requests handed off and not counted final yet (the queue depth).
    pub fn in_flight(&self) -> usize {
        self.reqs.values().filter(|r| r.generation.is_some() && !r.counted).count()
    }

    /// The tracker's counters.
    pub fn tracker_stats(&self) -> TrackerStats {
        self.tracker.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fence_asks_are_repeated_after_1_2_4_then_every_8_seconds() {
        let waits: Vec<u64> = (0..7).map(|n| reask_after(n).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 8, 8, 8]);
        assert_eq!(reask_after(u32::MAX), FENCE_REASK_MAX, "no overflow however many asks went out");
    }
}
