//! The completion tracker (SEMANTICS §5): sans-IO. Notifications and the current time go in; request
//! status comes out. It never reads a clock, never blocks and never panics on bad input.
//!
//! ```text
//! done   <=> not failed and |expected| == N and for every key: received[key] == {0..expected[key]-1}
//!            and (aux not required or aux received) and (state not required or state from all N keys)
//! failed <=> a failure notification arrived, or a notification from a key outside the expected set,
//!            or the deadline passed (the error names the keys still missing)
//! ```

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::time::Instant;

use crate::error::TrackerError;
use crate::model::SenderKey;
use crate::notify::{Notification, NotificationBody, RequestId};

/// What the receiver expects for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpectSpec {
    /// Every sender key that must report (from [`crate::Topology::expected_senders`]).
    pub senders: Vec<SenderKey>,
    /// Whether an aux notification is required.
    pub aux: bool,
    /// Whether a state notification from every sender is required.
    pub state: bool,
    /// When the request fails if not done.
    pub deadline: Instant,
}

/// Why a request failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// A sender reported failure.
    Notified {
        /// The sender.
        key: SenderKey,
        /// Its reason.
        reason: String,
    },
    /// A notification from a key that is not an expected sender of this request.
    UnexpectedKey {
        /// The key.
        key: SenderKey,
    },
    /// A chunk beyond the sender's announced last chunk, or two different last chunks.
    InconsistentChunks {
        /// The sender.
        key: SenderKey,
        /// What was inconsistent.
        detail: String,
    },
    /// The deadline passed; these keys (and flags) were still missing.
    DeadlineExceeded {
        /// Keys whose chunks are not all in.
        missing: Vec<SenderKey>,
        /// Keys whose state is missing (when state is required).
        missing_state: Vec<SenderKey>,
        /// Whether aux was required and is missing.
        missing_aux: bool,
    },
    /// The transport lost the connection to a sender.
    PeerLost {
        /// The sender.
        key: SenderKey,
        /// What the transport said.
        reason: String,
    },
    /// The receiver aborted the request.
    Aborted {
        /// Why.
        reason: String,
    },
}

fn keys(ks: &[SenderKey]) -> String {
    ks.iter().map(|k| k.to_string()).collect::<Vec<_>>().join(", ")
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Notified { key, reason } => write!(f, "sender {key} reported failure: {reason}"),
            Failure::UnexpectedKey { key } => {
                write!(f, "notification from {key}, which is not an expected sender (topology mismatch?)")
            }
            Failure::InconsistentChunks { key, detail } => write!(f, "sender {key}: {detail}"),
            Failure::DeadlineExceeded { missing, missing_state, missing_aux } => {
                write!(f, "deadline passed; still missing chunks from [{}]", keys(missing))?;
                if !missing_state.is_empty() {
                    write!(f, ", state from [{}]", keys(missing_state))?;
                }
                if *missing_aux {
                    write!(f, ", aux")?;
                }
                Ok(())
            }
            Failure::PeerLost { key, reason } => write!(f, "lost sender {key}: {reason}"),
            Failure::Aborted { reason } => write!(f, "aborted: {reason}"),
        }
    }
}

/// The status of a tracked request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    /// Still waiting.
    Pending,
    /// Every expected byte has landed.
    Done,
    /// Failed, with the reason.
    Failed(Failure),
}

/// What [`CompletionTracker::handle`] did with a notification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handled {
    /// Recorded; the request is still pending.
    Progress,
    /// Recorded, and it completed the request.
    Completed,
    /// Already seen (idempotent).
    Duplicate,
    /// It failed the request.
    Failed,
    /// The request already has an outcome; ignored.
    AfterOutcome,
    /// Unknown request: counted and dropped.
    UnknownRequest,
    /// A request released earlier: counted and dropped.
    Released,
}

/// Counters of the notifications the tracker dropped or ignored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TrackerStats {
    /// Notifications recorded.
    pub accepted: u64,
    /// Duplicates ignored.
    pub duplicates: u64,
    /// For requests never expected.
    pub unknown_request: u64,
    /// For requests already released.
    pub released: u64,
    /// For requests that already had an outcome.
    pub after_outcome: u64,
}

#[derive(Debug, Default)]
struct KeyState {
    received: BTreeSet<u32>,
    expected: Option<u32>,
    state: bool,
}

impl KeyState {
    fn chunks_complete(&self) -> bool {
        self.expected.is_some_and(|n| self.received.len() as u64 == u64::from(n))
    }
}

#[derive(Debug)]
struct Req {
    keys: BTreeMap<SenderKey, KeyState>,
    aux_required: bool,
    state_required: bool,
    aux: Option<Vec<u8>>,
    states: BTreeMap<SenderKey, Vec<u8>>,
    deadline: Instant,
    outcome: Option<Status>,
}

impl Req {
    fn is_done(&self) -> bool {
        self.keys.values().all(|k| k.chunks_complete() && (!self.state_required || k.state))
            && (!self.aux_required || self.aux.is_some())
    }

    fn deadline_failure(&self) -> Failure {
        Failure::DeadlineExceeded {
            missing: self.keys.iter().filter(|(_, s)| !s.chunks_complete()).map(|(k, _)| *k).collect(),
            missing_state: if self.state_required {
                self.keys.iter().filter(|(_, s)| !s.state).map(|(k, _)| *k).collect()
            } else {
                Vec::new()
            },
            missing_aux: self.aux_required && self.aux.is_none(),
        }
    }

    fn check_deadline(&mut self, now: Instant) {
        if self.outcome.is_none() && now >= self.deadline {
            // Every state change settles a request that is done, so one still pending here misses
            // something and the failure names it; settle a done one as done all the same.
            self.outcome = Some(if self.is_done() { Status::Done } else { Status::Failed(self.deadline_failure()) });
        }
    }
}

/// How many releases the tracker remembers to tell late notifications from unknown ones: an id counts
/// as released while its latest release is among the last `RELEASED_MEMORY`.
const RELEASED_MEMORY: usize = 4096;

/// Tracks completion of every request of one decode rank.
#[derive(Debug, Default)]
pub struct CompletionTracker {
    reqs: HashMap<RequestId, Req>,
    /// Released ids, each with the sequence number of its latest release.
    released: HashMap<RequestId, u64>,
    /// The last `RELEASED_MEMORY` releases, oldest first. An entry whose sequence number is no longer
    /// its id's (the id was expected or released again since) is stale and evicts nothing.
    released_order: VecDeque<(RequestId, u64)>,
    /// Releases so far (the next release's sequence number).
    release_seq: u64,
    stats: TrackerStats,
}

impl CompletionTracker {
    /// An empty tracker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts tracking a request. Must be called before its senders can write (the decode side
    /// allocates the destination pages and tells the senders where to write).
    pub fn expect(&mut self, request: RequestId, spec: ExpectSpec) -> Result<(), TrackerError> {
        if self.reqs.contains_key(&request) {
            return Err(TrackerError::AlreadyTracked(request));
        }
        if spec.senders.is_empty() {
            return Err(TrackerError::NoSenders(request));
        }
        self.released.remove(&request);
        let keys = spec.senders.iter().map(|k| (*k, KeyState::default())).collect();
        self.reqs.insert(
            request,
            Req {
                keys,
                aux_required: spec.aux,
                state_required: spec.state,
                aux: None,
                states: BTreeMap::new(),
                deadline: spec.deadline,
                outcome: None,
            },
        );
        Ok(())
    }

    /// Feeds one notification received at `now`.
    pub fn handle(&mut self, n: &Notification, now: Instant) -> Handled {
        let Some(req) = self.reqs.get_mut(&n.request) else {
            if self.released.contains_key(&n.request) {
                self.stats.released += 1;
                return Handled::Released;
            }
            self.stats.unknown_request += 1;
            return Handled::UnknownRequest;
        };
        req.check_deadline(now);
        if req.outcome.is_some() {
            self.stats.after_outcome += 1;
            return Handled::AfterOutcome;
        }
        let Some(ks) = req.keys.get_mut(&n.sender) else {
            req.outcome = Some(Status::Failed(Failure::UnexpectedKey { key: n.sender }));
            return Handled::Failed;
        };
        let fresh = match &n.body {
            NotificationBody::KvChunk { chunk, last } => {
                let (chunk, last) = (*chunk, *last);
                let inconsistent = match ks.expected {
                    Some(e) if chunk >= e => Some(format!("chunk {chunk} after last chunk {}", e - 1)),
                    Some(e) if last && chunk.saturating_add(1) != e => {
                        Some(format!("last chunk {chunk} after last chunk {} was announced", e - 1))
                    }
                    None if last && ks.received.iter().next_back().is_some_and(|m| *m > chunk) => Some(format!(
                        "last chunk {chunk} but chunk {} already arrived",
                        ks.received.iter().next_back().copied().unwrap_or(0)
                    )),
                    _ => None,
                };
                if let Some(detail) = inconsistent {
                    req.outcome = Some(Status::Failed(Failure::InconsistentChunks { key: n.sender, detail }));
                    return Handled::Failed;
                }
                // A `last` flag on any copy sets expected[key] (SEMANTICS §5): a copy that brings the
                // flag is news even when the chunk itself already arrived.
                let announces = last && ks.expected.is_none();
                if last {
                    ks.expected = Some(chunk.saturating_add(1));
                }
                ks.received.insert(chunk) | announces
            }
            NotificationBody::Aux(p) => {
                let fresh = req.aux.is_none();
                if fresh {
                    req.aux = Some(p.clone());
                }
                fresh
            }
            NotificationBody::State(p) => {
                let fresh = !ks.state;
                ks.state = true;
                req.states.entry(n.sender).or_insert_with(|| p.clone());
                fresh
            }
            NotificationBody::Failure(reason) => {
                req.outcome = Some(Status::Failed(Failure::Notified { key: n.sender, reason: reason.clone() }));
                self.stats.accepted += 1;
                return Handled::Failed;
            }
        };
        if !fresh {
            self.stats.duplicates += 1;
            return Handled::Duplicate;
        }
        self.stats.accepted += 1;
        if req.is_done() {
            req.outcome = Some(Status::Done);
            Handled::Completed
        } else {
            Handled::Progress
        }
    }

    /// Fails every pending request that still waits on `key` (the transport lost that sender).
    /// Returns the requests it failed.
    pub fn sender_lost(&mut self, key: SenderKey, reason: &str) -> Vec<RequestId> {
        let mut failed = Vec::new();
        for (id, req) in &mut self.reqs {
            if req.outcome.is_some() {
                continue;
            }
            let waiting = req.keys.get(&key).is_some_and(|s| !s.chunks_complete() || (req.state_required && !s.state));
            if waiting {
                req.outcome = Some(Status::Failed(Failure::PeerLost { key, reason: reason.to_owned() }));
                failed.push(*id);
            }
        }
        failed.sort();
        failed
    }

    /// Fails a pending request (receiver-side abort). No effect on a request with an outcome.
    pub fn abort(&mut self, request: RequestId, reason: &str) {
        if let Some(req) = self.reqs.get_mut(&request) {
            if req.outcome.is_none() {
                req.outcome = Some(Status::Failed(Failure::Aborted { reason: reason.to_owned() }));
            }
        }
    }

    /// The status of a request at `now` (a passed deadline fails it). `None` for an unknown request.
    pub fn status(&mut self, request: RequestId, now: Instant) -> Option<Status> {
        let req = self.reqs.get_mut(&request)?;
        req.check_deadline(now);
        Some(req.outcome.clone().unwrap_or(Status::Pending))
    }

    /// Fails every request whose deadline passed; returns them.
    pub fn poll_deadlines(&mut self, now: Instant) -> Vec<RequestId> {
        let mut out = Vec::new();
        for (id, req) in &mut self.reqs {
            if req.outcome.is_none() {
                req.check_deadline(now);
                if req.outcome.is_some() {
                    out.push(*id);
                }
            }
        }
        out.sort();
        out
    }

    /// The earliest deadline of a pending request.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.reqs.values().filter(|r| r.outcome.is_none()).map(|r| r.deadline).min()
    }

    /// The aux payload of a request, once received.
    pub fn aux(&self, request: RequestId) -> Option<&[u8]> {
        self.reqs.get(&request)?.aux.as_deref()
    }

    /// The state payload a sender sent for a request.
    pub fn state(&self, request: RequestId, key: SenderKey) -> Option<&[u8]> {
        self.reqs.get(&request)?.states.get(&key).map(Vec::as_slice)
    }

    /// Stops tracking a request and returns its final status. Later notifications for it are
    /// counted as released and dropped.
    pub fn release(&mut self, request: RequestId, now: Instant) -> Option<Status> {
        let status = self.status(request, now);
        if self.reqs.remove(&request).is_some() {
            let seq = self.release_seq;
            self.release_seq += 1;
            self.released.insert(request, seq);
            self.released_order.push_back((request, seq));
            while self.released_order.len() > RELEASED_MEMORY {
                if let Some((old, old_seq)) = self.released_order.pop_front() {
                    // Forget the id only if this was its latest release.
                    if self.released.get(&old) == Some(&old_seq) {
                        self.released.remove(&old);
                    }
                }
            }
        }
        status
    }

    /// Requests currently tracked.
    pub fn len(&self) -> usize {
        self.reqs.len()
    }

    /// Whether no request is tracked.
    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    /// Counters.
    pub fn stats(&self) -> TrackerStats {
        self.stats
    }
}
