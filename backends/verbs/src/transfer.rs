//! Transfers on one connection: jobs of work requests, the posting pump, send completions, abort,
//! and the bookkeeping behind region revokes.
//!
//! `post` validates everything, turns the ops into RDMA WRITE requests (the toolkit's
//! [`segments`], destination-contiguous runs gathered into up to `max_sge` SGEs) and the attached
//! notification into fragments, and queues them as one [`Job`]. The pump posts queued requests in
//! FIFO order whenever there is send-queue room (and, for a notification fragment, a ring credit):
//! from `post` itself, from the poller after completions, and from the side channel after credits.
//! The last request of every posted batch is signalled (plus every `signal_every`-th), so every
//! posted request is covered by a signalled one at or after it: its completion (RC: the peer
//! acknowledged, i.e. placed, everything before it) or its flush settles every job before it.
//!
//! A job is final when the completion covering its last posted request arrived: `Done` when every
//! request was posted and succeeded, `Failed` on an error completion (or a flush after one),
//! `Aborted` when an abort dropped requests that were never posted. RC cannot cancel a posted
//! request, so an abort stops posting and waits for the posted ones.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::net::TcpStream;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

use kvxfer_core::toolkit::{segments, Fragmenter, Reassembler, RegionRef};
use kvxfer_core::{AbortTransfer, BackendError, MemDesc, PeerId, RegionId, TransferState, WriteOp};
use tokio::sync::Notify;

use crate::ring::{RingRx, RingTx};
use crate::verbs::{Completion, LocalSge, PostError, QueuePair, SendKind, SendWr, Verbs};
use crate::wire::{Frame, Hello, RemoteRegion};
use crate::NAME;

/// Out-of-band SEND fragments posted per round (the staging area holds this many).
pub(crate) const OOB_FRAGS: usize = 8;
/// `ibv_wc_status` values with special meaning.
const WC_WR_FLUSH_ERR: u32 = 5;
const WC_RETRY_EXC_ERR: u32 = 12;
const WC_RNR_RETRY_EXC_ERR: u32 = 13;

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock means a thread panicked while holding it; the data is plain bookkeeping and the
    // panic is already reported, so keep going rather than cascade.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Device and QP limits that bound a work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WrLimits {
    /// Scatter/gather entries per request (at least 1).
    pub max_sge: usize,
    /// Bytes per request (the port's max message size).
    pub max_msg: u64,
    /// Requests of at most this many bytes are posted inline (0 disables).
    pub max_inline: u32,
}

/// One RDMA WRITE: `len` bytes to `dst_offset` of op `op`'s destination, gathered from `pieces`
/// (source offset, length) in destination order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WritePlan {
    pub op: usize,
    pub dst_offset: u64,
    pub len: u64,
    pub pieces: Vec<(u64, u32)>,
}

/// The RDMA WRITE requests of `ops` (already bounds-checked): the toolkit's contiguous segments
/// (at most one message and one SGE long), with destination-contiguous segments of one op
/// gathered into one request of up to `max_sge` SGEs (source-contiguous ones merge into one SGE).
pub(crate) fn plan_writes(ops: &[WriteOp], l: &WrLimits) -> Vec<WritePlan> {
    let max_msg = l.max_msg.clamp(1, u64::from(u32::MAX));
    let mut out: Vec<WritePlan> = Vec::new();
    for s in segments(ops, max_msg) {
        if let Some(w) =
            out.last_mut().filter(|w| w.op == s.op && w.dst_offset + w.len == s.dst_offset && w.len + s.len <= max_msg)
        {
            let (src, len) = w.pieces.last_mut().expect("a plan has a piece");
            if *src + u64::from(*len) == s.src_offset {
                *len += s.len as u32;
                w.len += s.len;
                continue;
            }
            if w.pieces.len() < l.max_sge.max(1) {
                w.pieces.push((s.src_offset, s.len as u32));
                w.len += s.len;
                continue;
            }
        }
        out.push(WritePlan {
            op: s.op,
            dst_offset: s.dst_offset,
            len: s.len,
            pieces: vec![(s.src_offset, s.len as u32)],
        });
    }
    out
}

/// What a work request was, for error messages.
#[derive(Debug, Clone)]
pub(crate) enum WrDesc {
    Write { bytes: u64, src: RegionId, src_offset: u64, dst: RegionId, dst_offset: u64 },
    Fragment { index: usize, of: usize, slot: u32 },
    Send { index: usize, of: usize },
    Fence,
}

impl fmt::Display for WrDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WrDesc::Write { bytes, src, src_offset, dst, dst_offset } => {
                write!(f, "RDMA WRITE of {bytes} bytes from local {src}+{src_offset} to remote {dst}+{dst_offset}")
            }
            WrDesc::Fragment { index, of, slot } => {
                write!(f, "RDMA WRITE WITH IMMEDIATE of notification fragment {}/{of} into ring slot {slot}", index + 1)
            }
            WrDesc::Send { index, of } => write!(f, "SEND of out-of-band notification fragment {}/{of}", index + 1),
            WrDesc::Fence => f.write_str("empty fence request after a refused post"),
        }
    }
}

/// A work request not posted yet.
pub(crate) enum Pending<V: Verbs> {
    /// Ready to post (RDMA WRITE or SEND).
    Ready(SendWr<V>, WrDesc),
    /// A notification fragment: the ring slot it gets decides where it goes.
    Fragment { bytes: Vec<u8>, index: usize, of: usize },
}

/// One transfer (or one round of an out-of-band notification) on a connection.
pub(crate) struct Job<V: Verbs> {
    id: u64,
    state: Arc<TransferState>,
    pending: VecDeque<Pending<V>>,
    first_wr: Option<u64>,
    last_wr: Option<u64>,
    /// An abort dropped requests that were never posted.
    cut: bool,
    error: Option<BackendError>,
    /// Keeps the source regions open (their close waits) while the NIC may read them.
    _srcs: Vec<RegionRef>,
    /// The peer's regions it writes into (a revoke of one waits for this job).
    dsts: Vec<u32>,
}

impl<V: Verbs> Job<V> {
    pub(crate) fn new(
        state: Arc<TransferState>,
        pending: VecDeque<Pending<V>>,
        srcs: Vec<RegionRef>,
        dsts: Vec<u32>,
    ) -> Self {
        Self { id: 0, state, pending, first_wr: None, last_wr: None, cut: false, error: None, _srcs: srcs, dsts }
    }

    fn holds(&self, wr_id: u64) -> bool {
        matches!((self.first_wr, self.last_wr), (Some(a), Some(b)) if a <= wr_id && wr_id <= b)
    }
}

/// The send side of a connection.
pub(crate) struct SendState<V: Verbs> {
    jobs: VecDeque<Job<V>>,
    /// Posted requests not yet covered by a completion, in post order.
    outstanding: VecDeque<(u64, WrDesc)>,
    in_flight: u32,
    since_signal: u32,
    next_wr_id: u64,
    next_job: u64,
    /// Highest request id covered by a completion.
    done_through: u64,
    pub ring: RingTx,
    /// First error completion (or refused post); the QP is in the error state after it.
    pub failed: Option<BackendError>,
    /// Why the peer is gone (side channel lost, goodbye, protocol violation, disconnect).
    pub lost: Option<String>,
    /// Jobs not final per remote region id.
    dst_use: HashMap<u32, usize>,
    /// Revokes (seq, region) answered once no job writes into the region.
    revokes: Vec<(u64, u32)>,
    /// Revoke acknowledgements to send once the lock is released.
    acks: Vec<u64>,
}

impl<V: Verbs> SendState<V> {
    pub(crate) fn new(ring: RingTx) -> Self {
        Self {
            jobs: VecDeque::new(),
            outstanding: VecDeque::new(),
            in_flight: 0,
            since_signal: 0,
            next_wr_id: 1,
            next_job: 1,
            done_through: 0,
            ring,
            failed: None,
            lost: None,
            dst_use: HashMap::new(),
            revokes: Vec::new(),
            acks: Vec::new(),
        }
    }
}

/// The receive side of a connection.
pub(crate) struct RecvState {
    pub ring: RingRx,
    pub reasm: Reassembler,
}

/// Reassembler sources of one connection.
pub(crate) const RING_SOURCE: u64 = 0;
pub(crate) const SEND_SOURCE: u64 = 1;

/// One connected peer: its RC queue pair and everything the connection owns.
pub(crate) struct Peer<V: Verbs> {
    // Field order is drop order: the QP goes first, then the CQs and registrations it used.
    pub qp: V::Qp,
    pub id: PeerId,
    /// Key of its CQs (the poller finds the peer by it).
    pub key: u64,
    /// The identity it proved (with a secret) or claimed; notifications must be keyed with it.
    pub identity: u64,
    /// Its instance (from the authentication exchange).
    pub instance: u64,
    /// It sent a forged notification: nothing more of it is delivered.
    pub refused: AtomicBool,
    pub label: String,
    pub send_cq: Arc<V::Cq>,
    pub recv_cq: Arc<V::Cq>,
    /// Keeps the ring registered (the peer writes into it) for the connection's life.
    pub _ring_mr: Arc<V::Mr>,
    pub ring_mem: MemDesc,
    pub recv_mr: Arc<V::Mr>,
    pub recv_mem: MemDesc,
    pub recv_count: u32,
    pub recv_size: u32,
    pub stage_mr: Arc<V::Mr>,
    pub stage_mem: MemDesc,
    pub remote: Hello,
    pub remote_regions: Mutex<HashMap<u32, RemoteRegion>>,
    pub limits: WrLimits,
    pub sq_depth: u32,
    pub signal_every: u32,
    pub ring_frag: Fragmenter,
    pub oob_frag: Fragmenter,
    pub send: Mutex<SendState<V>>,
    pub recv: Mutex<RecvState>,
    /// Woken when the last job is final.
    pub idle: Notify,
    pub oob_lock: tokio::sync::Mutex<()>,
    pub tcp: Mutex<TcpStream>,
    /// The handshake finished (the side channel carries only our frames from now on).
    pub ready: AtomicBool,
    pub closing: AtomicBool,
}

impl<V: Verbs> Peer<V> {
    pub(crate) fn oob_offset(&self) -> u64 {
        u64::from(self.remote.ring_slots) * u64::from(self.remote.slot_size)
    }

    pub(crate) fn send_frame(&self, f: &Frame) -> std::io::Result<()> {
        f.write_to(&mut *lock(&self.tcp))
    }

    /// The error a new request gets when the peer cannot take it.
    pub(crate) fn unusable(&self, st: &SendState<V>) -> Option<BackendError> {
        if let Some(reason) = &st.lost {
            return Some(BackendError::PeerLost { backend: NAME, peer: self.label.clone(), detail: reason.clone() });
        }
        st.failed.clone()
    }

    /// Runs `f` on the send state, then (unlocked) sends the revoke acknowledgements it made ready
    /// and wakes disconnect when no job is left.
    pub(crate) fn with_send<R>(&self, f: impl FnOnce(&mut SendState<V>) -> R) -> R {
        let mut st = lock(&self.send);
        let r = f(&mut st);
        let acks = std::mem::take(&mut st.acks);
        let idle = st.jobs.is_empty();
        drop(st);
        for seq in acks {
            if let Err(e) = self.send_frame(&Frame::RevokeAck(seq)) {
                tracing::debug!(error = %e, peer = %self.label, "revoke acknowledgement not sent");
            }
        }
        if idle {
            self.idle.notify_waiters();
        }
        r
    }

    /// Queues a job and posts what fits; returns its id. Nothing is queued when the peer is unusable.
    pub(crate) fn enqueue(&self, mut job: Job<V>) -> Result<u64, BackendError> {
        self.with_send(|st| {
            if let Some(e) = self.unusable(st) {
                return Err(e);
            }
            job.id = st.next_job;
            st.next_job += 1;
            for d in &job.dsts {
                *st.dst_use.entry(*d).or_default() += 1;
            }
            let id = job.id;
            st.jobs.push_back(job);
            self.pump(st);
            Ok(id)
        })
    }

    /// Posts queued requests, in order, while the send queue has room and the ring has credits.
    pub(crate) fn pump(&self, st: &mut SendState<V>) {
        if self.unusable(st).is_some() {
            self.fail_unposted(st);
            return;
        }
        let batch_max = (self.sq_depth / 4).max(1) as usize;
        loop {
            let limit = batch_max.min(self.sq_depth.saturating_sub(st.in_flight) as usize);
            let mut batch: Vec<SendWr<V>> = Vec::new();
            let mut blocked = false;
            let SendState { jobs, outstanding, ring, next_wr_id, .. } = &mut *st;
            'jobs: for job in jobs.iter_mut() {
                while batch.len() < limit {
                    let (mut wr, desc) = match job.pending.pop_front() {
                        None => continue 'jobs,
                        Some(Pending::Ready(wr, desc)) => (wr, desc),
                        Some(Pending::Fragment { bytes, index, of }) => {
                            let Some(g) = ring.grant(bytes.len()) else {
                                job.pending.push_front(Pending::Fragment { bytes, index, of });
                                blocked = true;
                                break 'jobs;
                            };
                            // The staging slot of ring slot s is free: its previous fragment was
                            // consumed by the peer (that is what the credit says).
                            if let Err(e) = self.stage_mem.write_guard(g.offset, bytes.len() as u64).map(|mut s| {
                                s.as_mut_slice().copy_from_slice(&bytes);
                            }) {
                                tracing::error!(error = %e, "staging a notification fragment");
                            }
                            let wr = SendWr {
                                wr_id: 0,
                                kind: SendKind::WriteImm {
                                    remote_addr: self.remote.ring.addr + g.offset,
                                    rkey: self.remote.ring.rkey,
                                    imm: g.imm,
                                },
                                sges: vec![LocalSge {
                                    mr: self.stage_mr.clone(),
                                    offset: g.offset,
                                    len: bytes.len() as u32,
                                }],
                                signaled: false,
                                inline: bytes.len() as u64 <= u64::from(self.limits.max_inline),
                            };
                            (wr, WrDesc::Fragment { index, of, slot: g.slot })
                        }
                    };
                    wr.wr_id = *next_wr_id;
                    *next_wr_id += 1;
                    job.first_wr.get_or_insert(wr.wr_id);
                    job.last_wr = Some(wr.wr_id);
                    outstanding.push_back((wr.wr_id, desc));
                    batch.push(wr);
                }
                break;
            }
            if batch.is_empty() {
                return;
            }
            let n = batch.len();
            for (i, wr) in batch.iter_mut().enumerate() {
                st.since_signal += 1;
                wr.signaled = i + 1 == n || st.since_signal >= self.signal_every;
                if wr.signaled {
                    st.since_signal = 0;
                }
            }
            st.in_flight += n as u32;
            if let Err(PostError { posted, error }) = self.qp.post_send(&batch) {
                let first = batch.get(posted).map_or(st.next_wr_id, |w| w.wr_id);
                self.refused(st, first, n.saturating_sub(posted), error);
                return;
            }
            if blocked || n < limit {
                return;
            }
        }
    }

    /// A post refused requests from `first` on (`count` of them): they were never posted. The
    /// connection is unusable from now on; the accepted ones are flushed by the error state and a
    /// signalled fence request, so every job still ends.
    fn refused(&self, st: &mut SendState<V>, first: u64, count: usize, error: BackendError) {
        tracing::warn!(error = %error, peer = %self.label, "ibv_post_send refused work requests");
        st.outstanding.retain(|(id, _)| *id < first);
        st.in_flight = st.in_flight.saturating_sub(count as u32);
        for j in st.jobs.iter_mut() {
            match (j.first_wr, j.last_wr) {
                (Some(a), _) if a >= first => (j.first_wr, j.last_wr) = (None, None),
                (_, Some(b)) if b >= first => j.last_wr = Some(first - 1),
                _ => continue,
            }
            j.error.get_or_insert_with(|| error.clone());
        }
        st.failed.get_or_insert(error);
        let (a, m) = crate::attrs::error();
        if let Err(e) = self.qp.modify(&a, m, "to ERR after a refused post") {
            tracing::warn!(error = %e, peer = %self.label, "could not flush the queue pair");
        }
        if !st.outstanding.is_empty() {
            // A zero-byte RDMA WRITE, flushed by the error state: its completion covers every
            // accepted request, including unsignalled ones that already completed silently.
            let kind = SendKind::Write { remote_addr: 0, rkey: 0 };
            let fence = SendWr { wr_id: first, kind, sges: Vec::new(), signaled: true, inline: false };
            st.next_wr_id = first + 1;
            st.outstanding.push_back((first, WrDesc::Fence));
            st.in_flight += 1;
            if self.qp.post_send(std::slice::from_ref(&fence)).is_err() {
                // Nothing will report the accepted requests: give up on them.
                self.abandon_locked(st, "the queue pair refused a fence request after a failed post");
                return;
            }
        }
        self.fail_unposted(st);
    }

    /// Fails every job with nothing posted, and drops the unposted requests of the others (they end
    /// when the flush of their posted requests arrives).
    pub(crate) fn fail_unposted(&self, st: &mut SendState<V>) {
        let Some(e) = self.unusable(st) else { return };
        let mut i = 0;
        while i < st.jobs.len() {
            let j = &mut st.jobs[i];
            if !j.pending.is_empty() {
                j.pending.clear();
                j.error.get_or_insert_with(|| e.clone());
            }
            if j.last_wr.is_none() {
                let job = st.jobs.remove(i).expect("index in range");
                Self::finish(st, job);
            } else {
                i += 1;
            }
        }
        Self::settle(st);
    }

    /// Finishes the jobs at the front whose posted requests are all covered by completions.
    fn settle(st: &mut SendState<V>) {
        while let Some(j) = st.jobs.front() {
            if !j.pending.is_empty() || j.last_wr.is_some_and(|l| l > st.done_through) {
                break;
            }
            let job = st.jobs.pop_front().expect("front exists");
            Self::finish(st, job);
        }
    }

    fn finish(st: &mut SendState<V>, job: Job<V>) {
        match job.error {
            Some(e) => job.state.fail(e),
            None if job.cut => job.state.aborted(),
            None => job.state.complete(),
        };
        for d in &job.dsts {
            if let Some(n) = st.dst_use.get_mut(d) {
                *n -= 1;
                if *n == 0 {
                    st.dst_use.remove(d);
                }
            }
        }
        let SendState { revokes, dst_use, acks, .. } = st;
        revokes.retain(|(seq, region)| {
            let busy = dst_use.contains_key(region);
            if !busy {
                acks.push(*seq);
            }
            busy
        });
    }

    /// The peer is cut off (its queue pair is in the error state): no new job is taken, queued
    /// requests are dropped and jobs with nothing posted fail now; the others fail when the flush
    /// completions of their posted requests arrive. Returns how many jobs were not final.
    pub(crate) fn cut(&self, why: &str) -> usize {
        self.with_send(|st| {
            let n = st.jobs.len();
            st.lost.get_or_insert_with(|| why.to_owned());
            self.fail_unposted(st);
            n
        })
    }

    /// Fails every job now (the endpoint or connection is torn down and no completion will come).
    pub(crate) fn abandon(&self, why: &str) -> usize {
        self.with_send(|st| self.abandon_locked(st, why))
    }

    fn abandon_locked(&self, st: &mut SendState<V>, why: &str) -> usize {
        let n = st.jobs.len();
        while let Some(mut job) = st.jobs.pop_front() {
            let detail = format!("transfer abandoned: {why}");
            job.error.get_or_insert(BackendError::PeerLost { backend: NAME, peer: self.label.clone(), detail });
            Self::finish(st, job);
        }
        st.outstanding.clear();
        st.in_flight = 0;
        n
    }

    /// A send completion (or flush) for `c.wr_id`: everything posted up to it is covered.
    pub(crate) fn on_send(&self, c: &Completion) {
        self.with_send(|st| {
            let Some(pos) = st.outstanding.iter().position(|(id, _)| *id == c.wr_id) else {
                self.qp.retire_through(c.wr_id);
                return;
            };
            let desc = st.outstanding[pos].1.clone();
            st.outstanding.drain(..=pos);
            st.in_flight = st.in_flight.saturating_sub(pos as u32 + 1);
            st.done_through = st.done_through.max(c.wr_id);
            // Registrations are released before any job (and its RegionRefs) ends.
            self.qp.retire_through(c.wr_id);
            if !c.ok() {
                let e = self.error_for(c, &desc, st.failed.as_ref(), st.lost.as_deref());
                if st.failed.is_none() {
                    tracing::warn!(error = %e, "work request failed");
                    st.failed = Some(e.clone());
                }
                if let Some(j) = st.jobs.iter_mut().find(|j| j.holds(c.wr_id)) {
                    j.error.get_or_insert(e);
                }
            }
            Self::settle(st);
            self.pump(st);
        })
    }

    fn error_for(
        &self,
        c: &Completion,
        desc: &WrDesc,
        first: Option<&BackendError>,
        lost: Option<&str>,
    ) -> BackendError {
        if c.status == WC_WR_FLUSH_ERR {
            let why = match (first, lost) {
                (Some(e), _) => format!("an earlier request failed: {e}"),
                (None, Some(l)) => format!("the peer was lost: {l}"),
                (None, None) => "the queue pair entered the error state".to_string(),
            };
            return BackendError::PeerLost {
                backend: NAME,
                peer: self.label.clone(),
                detail: format!("work request {} ({desc}) was flushed because {why}", c.wr_id),
            };
        }
        let detail = format!(
            "work request {} ({desc}) to {} completed with {} (status {}, vendor error 0x{:x}); the queue pair \
             is now in the error state: disconnect and reconnect",
            c.wr_id,
            self.label,
            V::status_str(c.status),
            c.status,
            c.vendor_err
        );
        if c.status == WC_RETRY_EXC_ERR || c.status == WC_RNR_RETRY_EXC_ERR {
            BackendError::PeerLost { backend: NAME, peer: self.label.clone(), detail }
        } else {
            BackendError::Ffi { backend: NAME, call: "ibv_poll_cq", code: i64::from(c.status), detail }
        }
    }

    /// Aborts job `id`: drops its unposted requests; it ends (aborted) at once when nothing of it
    /// was posted, else when the completions of its posted requests arrived.
    pub(crate) fn abort(&self, id: u64) {
        self.with_send(|st| {
            let Some(i) = st.jobs.iter().position(|j| j.id == id) else { return };
            let j = &mut st.jobs[i];
            if !j.pending.is_empty() {
                j.pending.clear();
                j.cut = true;
            }
            if j.last_wr.is_none() {
                let job = st.jobs.remove(i).expect("index in range");
                Self::finish(st, job);
            }
            Self::settle(st);
            self.pump(st);
        })
    }

    /// The peer closes its region `region`: forget its key (new posts naming it fail) and answer
    /// once no job of ours writes into it.
    pub(crate) fn revoke(&self, seq: u64, region: u32) {
        lock(&self.remote_regions).remove(&region);
        self.with_send(|st| {
            if st.dst_use.contains_key(&region) {
                st.revokes.push((seq, region));
            } else {
                st.acks.push(seq);
            }
        });
    }

    /// Waits until no job is left, or `deadline`; returns whether none is left.
    pub(crate) async fn wait_idle(&self, deadline: Instant) -> bool {
        loop {
            let mut idle = std::pin::pin!(self.idle.notified());
            idle.as_mut().enable();
            if lock(&self.send).jobs.is_empty() {
                return true;
            }
            if tokio::time::timeout_at(deadline.into(), idle).await.is_err() {
                return lock(&self.send).jobs.is_empty();
            }
        }
    }
}

/// Aborts one job of a connection (the handle's side of [`Peer::abort`]).
pub(crate) struct Aborter<V: Verbs> {
    pub peer: Weak<Peer<V>>,
    pub job: u64,
}

impl<V: Verbs> AbortTransfer for Aborter<V> {
    fn abort(&self, _state: &Arc<TransferState>) {
        // A peer that is gone finished (failed) every job when it was torn down.
        if let Some(p) = self.peer.upgrade() {
            p.abort(self.job);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn op(src_offset: u64, src_stride: u64, dst_offset: u64, dst_stride: u64, len: u64, count: u64) -> WriteOp {
        WriteOp { src: RegionId(1), src_offset, dst: RegionId(2), dst_offset, len, count, src_stride, dst_stride }
    }

    /// Every (source byte, destination byte) pair, sorted.
    fn op_pairs(op: &WriteOp) -> Vec<(u64, u64)> {
        let mut v: Vec<_> = op.ranges().flat_map(|(s, d, l)| (0..l).map(move |i| (s + i, d + i))).collect();
        v.sort_unstable();
        v
    }

    fn plan_pairs(plans: &[WritePlan]) -> Vec<(u64, u64)> {
        let mut v = Vec::new();
        for w in plans {
            let mut d = w.dst_offset;
            for &(s, l) in &w.pieces {
                v.extend((0..u64::from(l)).map(|i| (s + i, d + i)));
                d += u64::from(l);
            }
        }
        v.sort_unstable();
        v
    }

    proptest! {
        #[test]
        fn requests_cover_exactly_the_ops_bytes_within_limits(
            src_offset in 0u64..64, dst_offset in 0u64..64, len in 0u64..48, count in 1u64..12,
            src_gap in 0u64..3, dst_gap in 0u64..3, max_sge in 1usize..5, max_msg in 1u64..100,
        ) {
            let o = op(src_offset, len + src_gap, dst_offset, len + dst_gap, len, count);
            let l = WrLimits { max_sge, max_msg, max_inline: 0 };
            let plans = plan_writes(&[o], &l);
            for w in &plans {
                prop_assert!(!w.pieces.is_empty() && w.pieces.len() <= max_sge);
                prop_assert!(w.len >= 1 && w.len <= max_msg);
                prop_assert_eq!(w.len, w.pieces.iter().map(|p| u64::from(p.1)).sum::<u64>());
            }
            prop_assert_eq!(plan_pairs(&plans), op_pairs(&o));
        }
    }

    #[test]
    fn gathering_and_splitting() {
        let l = WrLimits { max_sge: 4, max_msg: 1 << 30, max_inline: 0 };
        // A contiguous op expressed as a strided one is one request of one SGE.
        let p = plan_writes(&[op(0, 64, 0, 64, 64, 16)], &l);
        assert_eq!(p, vec![WritePlan { op: 0, dst_offset: 0, len: 1024, pieces: vec![(0, 1024)] }]);
        // Strided source, contiguous destination: 4 SGEs per request.
        let p = plan_writes(&[op(0, 128, 0, 64, 64, 16)], &l);
        assert!(p.len() == 4 && p.iter().all(|w| w.pieces.len() == 4 && w.len == 256));
        // Strided destination: one request per range; two ops never share a request.
        assert_eq!(plan_writes(&[op(0, 64, 0, 128, 64, 16)], &l).len(), 16);
        assert_eq!(plan_writes(&[op(0, 8, 0, 8, 8, 1), op(8, 8, 8, 8, 8, 1)], &l).len(), 2);
        // Long ranges respect the message size (and an SGE's u32 length).
        let big = 5u64 << 30;
        let p = plan_writes(&[op(0, big, 0, big, big, 1)], &WrLimits { max_msg: 1 << 31, ..l });
        assert!(p.len() == 3 && p.iter().all(|w| w.len <= 1 << 31));
        let p = plan_writes(&[op(0, big, 0, big, big, 1)], &WrLimits { max_msg: u64::MAX, ..l });
        assert!(p.iter().all(|w| w.len <= u64::from(u32::MAX)));
        assert_eq!(p.iter().map(|w| w.len).sum::<u64>(), big);
        assert!(plan_writes(&[op(0, 0, 0, 0, 0, 5)], &l).is_empty(), "zero-length ranges yield nothing");
    }
}
