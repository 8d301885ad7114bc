//! Progress: the endpoint's state behind its mutex ([`State`]), jobs and their phases, posting them
//! to the provider within the in-flight window, polling the completion queue and dispatching what it
//! reports (messages go to the peers' and regions' handlers), and the progress thread that runs these
//! rounds, the heartbeats and the liveness checks.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use kvxfer_core::toolkit::{self, EventQueue, Fragmenter, PeerTable, Reassembler, RegionRef, RegionTable};
use kvxfer_core::{
    AbortTransfer, BackendError, BackendEvent, Capabilities, Notification, PeerId, RegionId, Secret, TransferState,
    WriteOp,
};

use crate::ffi::{
    Event, FiError, LocalRange, MrHandle, MrInfo, PostError, ProviderInfo, RdmEndpoint, RemoteIov, Waker,
};
use crate::options::{Options, MAX_IN_FLIGHT, MAX_PIECE};
use crate::peers::{Connecting, CutInfo, Live, Peer, PendingAuth};
use crate::regions::{AckDue, RevokeWait};
use crate::wire::{self, Kind, Staged};
use crate::{lock, NAME};

/// One post to the provider.
pub(crate) enum Item {
    Write { local: Vec<LocalRange>, remote: Vec<RemoteIov>, data: Option<u64> },
    Send(Vec<u8>),
}

/// Items posted together; the next phase starts when every completion of this one arrived.
pub(crate) struct Phase {
    pub(crate) items: VecDeque<Item>,
    /// A notification phase: waits until every earlier job to the same peer posted everything, so
    /// notifications to a peer leave in post order.
    pub(crate) ordered: bool,
}

/// A posted transfer (or notification, or hello) in progress.
pub(crate) struct Job {
    pub(crate) peer: PeerId,
    pub(crate) target: Arc<Peer>,
    pub(crate) state: Arc<TransferState>,
    pub(crate) phases: VecDeque<Phase>,
    pub(crate) posted: usize,
    pub(crate) completed: usize,
    pub(crate) error: Option<BackendError>,
    /// No more posting (abort, failure, deadline).
    pub(crate) stopped: bool,
    /// Some piece was never posted.
    pub(crate) dropped: bool,
    pub(crate) deadline: Instant,
    /// The source regions, held until the job is final (a registration close waits for them).
    pub(crate) _refs: Vec<RegionRef>,
    /// Destination regions (a revoke from the peer waits for the jobs writing into it).
    pub(crate) dst: Vec<RegionId>,
    /// Write bytes posted and not completed.
    pub(crate) in_flight: u64,
}

impl Job {
    fn sealed(&self) -> bool {
        self.phases.iter().all(|p| p.items.is_empty())
    }

    pub(crate) fn stop(&mut self, error: Option<BackendError>) {
        self.stopped = true;
        if self.error.is_none() {
            self.error = error;
        }
    }
}

/// `user` value of control messages (no job waits for them).
pub(crate) const USER_CONTROL: u64 = 0;
const USER_SEND: u64 = 1;
/// A control message waiting for a transmit slot.
pub(crate) struct Control {
    pub(crate) to: u64,
    pub(crate) msg: Vec<u8>,
    pub(crate) since: Instant,
}

/// Why a job stopped posting for now.
#[derive(PartialEq, Eq)]
enum Stall {
    /// Nothing (all posted, or waiting at a barrier or for an earlier job).
    No,
    /// The provider refused a piece to this peer (`-FI_EAGAIN`): later jobs to it wait.
    Peer,
    /// The endpoint's in-flight window is full: no more writes this round.
    Window,
}

/// Most control messages queued for a transmit slot before heartbeats are skipped.
pub(crate) const MAX_CONTROL: usize = 4096;

/// Everything behind the endpoint mutex. `ep` is declared first so it is closed before the rest drops.
pub(crate) struct State {
    pub(crate) ep: RdmEndpoint,
    pub(crate) mrs: HashMap<RegionId, (MrHandle, MrInfo)>,
    pub(crate) addrs: HashMap<Vec<u8>, u64>,
    pub(crate) jobs: BTreeMap<u64, Job>,
    pub(crate) next_job: u64,
    pub(crate) next_seq: u64,
    pub(crate) staged: Staged,
    pub(crate) reasm: Reassembler,
    pub(crate) scratch: Vec<Event>,
    pub(crate) dropped_messages: u64,
    pub(crate) stale_messages: u64,
    pub(crate) nonce: u32,
    pub(crate) identity: u64,
    pub(crate) events: Arc<EventQueue>,
    /// Peers that said hello to this endpoint (the ones that can write into its regions), by nonce.
    pub(crate) live: HashMap<u32, Live>,
    /// Control messages waiting for a transmit slot; sent before any further job piece.
    pub(crate) control: VecDeque<Control>,
    /// How long a control message may wait for a slot before it is dropped.
    pub(crate) control_ttl: Duration,
    pub(crate) revokes: HashMap<u64, RevokeWait>,
    pub(crate) acks_due: Vec<AckDue>,
    /// Write bytes posted and not completed (at most [`MAX_IN_FLIGHT`] beyond one piece).
    pub(crate) in_flight: u64,
    /// The cluster secret: every connection authenticates with it (see the crate docs).
    pub(crate) secret: Option<Secret>,
    /// Hellos waiting for their proof, by (sender nonce, connection id).
    pub(crate) pending: HashMap<(u32, u64), PendingAuth>,
    /// Our connects waiting for their answer, by connection id.
    pub(crate) connecting: HashMap<u64, Connecting>,
    /// Endpoint nonces refused for this endpoint's lifetime (they sent a forged notification).
    pub(crate) banned: HashSet<u32>,
    /// Notifications refused because their key was not the identity their sender proved.
    pub(crate) forged: u64,
    /// Messages dropped because their sender had not authenticated.
    pub(crate) unauthenticated: u64,
    /// Without a completion wait fd (shm), when this endpoint last sent a keep-hot heartbeat to
    /// each peer it has writes in flight to, by fabric address (see [`State::keep_targets_hot`]).
    pub(crate) hot_pings: Option<HashMap<u64, Instant>>,
    /// How long a transfer may take from its post (the `timeout_ms` option).
    pub(crate) transfer_timeout: Duration,
    /// Registrations of our regions for one writer instance each (by its nonce), whose keys were
    /// handed to it alone in its connect answer ([`Kind::Keys`]). Closed when the instance is cut
    /// off, says bye or goes away, and with their region.
    pub(crate) remote_mrs: HashMap<u32, HashMap<RegionId, (MrHandle, MrInfo)>>,
    /// What connectors announced in their hello's flags ([`wire::hello_flags`]): capabilities and
    /// receive buffer size, by nonce.
    pub(crate) writer_caps: HashMap<u32, (u8, usize)>,
    /// Instances cut off ([`KvTransferBackend::cut_off`](kvxfer_core::KvTransferBackend::cut_off)),
    /// by nonce: none of their messages is applied, none of their hellos admitted.
    pub(crate) cut: HashMap<u32, CutInfo>,
    /// Our peer ids of cut-off instances.
    pub(crate) cut_ids: HashMap<PeerId, u32>,
    /// Messages dropped because their sender was cut off.
    pub(crate) cut_dropped: u64,
}

/// How often a writer without a completion wait fd pings the peers its writes are in flight to, so
/// their progress threads stay hot (less than the progress loop's hot window).
const HOT_PING: Duration = Duration::from_millis(1);

impl State {
    /// Keeps the targets of in-flight writes polling. With shm the target's progress moves the
    /// data (it copies incoming commands), yet RMA writes raise no completion there, so a target
    /// with nothing of its own to do went to sleep (backing off to `idle_poll_us`) and the writer
    /// waited for each batch of commands: 1 KiB writes moved 0.05-0.07 GB/s against 0.2-0.3 for a
    /// target that polls all the time. A heartbeat every [`HOT_PING`] to every peer with writes in
    /// flight is a completion there, which keeps its thread hot.
    fn keep_targets_hot(&mut self, now: Instant) {
        let Some(pings) = self.hot_pings.as_mut() else { return };
        if self.control.len() > MAX_CONTROL {
            return;
        }
        let mut due: Vec<(u64, u32)> = Vec::new();
        for job in self.jobs.values() {
            if job.stopped || job.posted == job.completed || job.target.lost.load(Ordering::Acquire) {
                continue;
            }
            let t = &job.target;
            if !pings.get(&t.fi_addr).is_some_and(|last| now.duration_since(*last) < HOT_PING) {
                pings.insert(t.fi_addr, now);
                due.push((t.fi_addr, t.nonce));
            }
        }
        if pings.len() > 4 * MAX_CONTROL {
            pings.retain(|_, last| now.duration_since(*last) < HOT_PING);
        }
        for (to, nonce) in due {
            let msg = wire::message(Kind::Heartbeat, self.nonce, nonce, self.identity, &[]);
            self.queue(to, msg);
        }
    }

    /// Polls the completion queue until it is empty (bounded) and dispatches what it reports.
    ///
    /// Returns the completions read, plus one when a poll that read none took long enough to have done
    /// work: a target of RMA writes sees no completions for them, yet its polls move their data (shm
    /// copies incoming commands, tcp drains sockets), and that traffic must keep the thread hot.
    pub(crate) fn pump(&mut self, inner: &Inner) -> usize {
        const WORKED: Duration = Duration::from_micros(20);
        let mut total = 0;
        // One clock read per pump, not per poll: only a first poll that read nothing is judged by it.
        let t = Instant::now();
        for _ in 0..16 {
            let mut out = std::mem::take(&mut self.scratch);
            let n = self.ep.poll(&mut out, 64).unwrap_or_else(|e| {
                tracing::warn!(target: "kvxfer_fabric", "{e}");
                0
            });
            for ev in out.drain(..) {
                self.dispatch(ev, inner);
            }
            self.scratch = out;
            total += n;
            if n == 0 {
                if total == 0 && t.elapsed() > WORKED {
                    total += 1;
                }
                break;
            }
        }
        total
    }

    /// One round of work: completions, control messages, posts, finished jobs, due acknowledgements.
    /// Returns what [`State::pump`] read and the clock reading the round used.
    pub(crate) fn advance(&mut self, inner: &Inner) -> (usize, Instant) {
        let n = self.pump(inner);
        let now = Instant::now();
        self.keep_targets_hot(now);
        self.post_jobs(now);
        self.finish_jobs(now);
        (n, now)
    }

    fn deliver(&mut self, bytes: &[u8]) {
        match Notification::decode(bytes) {
            Ok(n) => self.events.push(BackendEvent::Notification(n)),
            Err(e) => {
                self.dropped_messages += 1;
                tracing::warn!(target: "kvxfer_fabric", "dropping an undecodable notification: {e}");
            }
        }
    }

    pub(crate) fn malformed(&mut self, e: impl std::fmt::Display) {
        self.dropped_messages += 1;
        tracing::warn!(target: "kvxfer_fabric", "dropping a malformed message: {e}");
    }

    fn dispatch(&mut self, ev: Event, inner: &Inner) {
        match ev {
            Event::Message(bytes) => self.message(&bytes, inner),
            Event::RemoteData(token) => {
                if let Some(n) = self.staged.token(token) {
                    self.deliver(&n);
                }
            }
            Event::RecvError(e) => {
                self.dropped_messages += 1;
                tracing::warn!(target: "kvxfer_fabric", "a receive failed: {}", e.detail);
            }
            Event::Done { user, error, .. } if user >> 1 == USER_CONTROL => {
                if let Some(e) = error {
                    tracing::debug!(target: "kvxfer_fabric", "a control message failed: {}", e.detail);
                }
            }
            Event::Done { user, error, bytes } => {
                let send = user & USER_SEND != 0;
                let call = if send { "fi_send (completion)" } else { "fi_writemsg (completion)" };
                // A completion of an abandoned job (see `finish_jobs`) was taken out of the window then.
                let Some(job) = self.jobs.get_mut(&(user >> 1)) else { return };
                job.completed += 1;
                if !send {
                    job.in_flight -= bytes;
                    self.in_flight = self.in_flight.saturating_sub(bytes);
                }
                if let Some(e) = error {
                    let err = ffi_completion_error(call, &e, job.peer, job.target.identity);
                    if e.is_connection_loss() {
                        job.target.lose(&self.events, format!("{call} to {} failed: {}", job.peer, e.detail));
                    }
                    job.stop(Some(err));
                }
            }
        }
    }

    fn message(&mut self, bytes: &[u8], inner: &Inner) {
        let (h, body) = match wire::parse(bytes) {
            Ok(x) => x,
            Err(e) => return self.malformed(e),
        };
        if h.dest != self.nonce {
            // For an earlier owner of this (recycled) endpoint address.
            self.stale_messages += 1;
            return;
        }
        if self.cut.contains_key(&h.nonce) {
            return self.on_cut_message(h, body);
        }
        let now = Instant::now();
        // The connect exchange: matched by connection id, decided by the proofs in it.
        match h.kind {
            Kind::Hello => {
                if let Some(caps) = wire::split_hello_flags(h.flags) {
                    self.on_caps(h.nonce, caps);
                }
                return self.on_hello(h.nonce, h.seq, body, now, inner);
            }
            Kind::Auth => return self.on_auth(h.nonce, h.seq, body, inner),
            Kind::Challenge => return self.on_challenge(h.nonce, h.seq, body),
            Kind::Keys => return self.on_keys(h.nonce, h.seq, body),
            Kind::Welcome => return self.on_welcome(h.nonce, h.seq, body),
            Kind::Refused => return self.on_refused(h.nonce, h.seq, body, inner),
            _ => {}
        }
        // Everything else only from a peer that authenticated, under the identity it proved (with
        // a secret; without one every sender is taken at its word).
        let proved = if self.secret.is_some() {
            let Some(id) = self.proved(h.nonce, inner) else {
                self.unauthenticated += 1;
                return tracing::debug!(target: "kvxfer_fabric", "dropping a {:?} message from an endpoint that has not authenticated", h.kind);
            };
            if matches!(h.kind, Kind::Heartbeat | Kind::Bye | Kind::Gone) && h.seq != id {
                let what = format!("sent a {:?} message under identity {:#x}", h.kind, h.seq);
                return self.refuse_forged(h.nonce, id, what, inner);
            }
            Some(id)
        } else {
            None
        };
        if let Some(l) = self.live.get_mut(&h.nonce) {
            l.last_seen = now;
        }
        match h.kind {
            Kind::Hello | Kind::Auth | Kind::Challenge | Kind::Welcome | Kind::Refused | Kind::Keys => {}
            Kind::Heartbeat => {
                self.live.entry(h.nonce).or_insert(Live {
                    identity: proved.unwrap_or(h.seq),
                    last_seen: now,
                    fi_addr: None,
                    addr: Vec::new(),
                    pid: 0,
                });
            }
            Kind::Bye | Kind::Gone => {
                self.live.remove(&h.nonce);
                // It writes no more: its keys go.
                self.drop_writer_mrs(h.nonce);
                self.reasm.forget(u64::from(h.nonce));
                self.writer_gone(h.nonce);
                if h.kind == Kind::Gone {
                    self.events.push(BackendEvent::PeerLost {
                        identity: h.seq,
                        reason: format!("the peer endpoint (identity {:#x}) closed", h.seq),
                    });
                }
            }
            Kind::Revoke => {
                let Some((region, addr)) = wire::split_u32(body) else { return self.malformed("short revoke") };
                self.revoked(inner, h.nonce, h.seq, RegionId(region), addr);
            }
            Kind::RevokeAck => {
                if let Some(w) = self.revokes.get_mut(&h.seq) {
                    w.waiting.remove(&h.nonce);
                }
                self.resolve_revokes();
            }
            Kind::Notify | Kind::Staged => match self.reasm.push(u64::from(h.nonce), body, now) {
                Ok(Some(n)) if !self.bound(&n, h.nonce, proved, inner) => {}
                Ok(Some(n)) if h.kind == Kind::Notify => self.deliver(&n),
                Ok(Some(n)) => {
                    if let Some(n) = self.staged.notification(h.seq, n) {
                        self.deliver(&n);
                    }
                }
                Ok(None) => {}
                Err(e) => self.malformed(e),
            },
        }
    }

    /// Queues a control message (sent before any further job piece to that peer).
    pub(crate) fn queue(&mut self, to: u64, msg: Vec<u8>) {
        self.control.push_back(Control { to, msg, since: Instant::now() });
    }

    /// Sends queued control messages, in order per destination; returns the destinations whose
    /// messages still wait for a slot (jobs to them wait too). A message that waited longer than
    /// `control_ttl` is dropped.
    pub(crate) fn flush_control(&mut self, now: Instant) -> HashSet<u64> {
        let mut blocked = HashSet::new();
        if self.control.is_empty() {
            return blocked;
        }
        let mut keep = VecDeque::new();
        while let Some(c) = self.control.pop_front() {
            if blocked.contains(&c.to) {
                keep.push_back(c);
                continue;
            }
            match self.ep.send(c.to, c.msg.clone(), USER_CONTROL) {
                Err(PostError::Again) if now.duration_since(c.since) > self.control_ttl => {
                    tracing::debug!(target: "kvxfer_fabric", "dropping a control message that found no slot for {:?}", self.control_ttl);
                }
                Err(PostError::Again) => {
                    blocked.insert(c.to);
                    keep.push_back(c);
                }
                Err(PostError::Failed(e)) => tracing::debug!(target: "kvxfer_fabric", "a control message failed: {e}"),
                Ok(()) => {}
            }
        }
        self.control = keep;
        blocked
    }

    /// Posts what the jobs have ready, in job order, until the transmit queue is full.
    fn post_jobs(&mut self, now: Instant) {
        let mut blocked = self.flush_control(now);
        let mut full = false;
        let mut unsealed: HashSet<PeerId> = HashSet::new();
        let State { ep, jobs, in_flight, transfer_timeout, .. } = self;
        for (&id, job) in jobs.iter_mut() {
            if !job.stopped {
                if job.state.abort_requested() {
                    job.stop(None);
                } else if now >= job.deadline {
                    let left: usize = job.phases.iter().map(|p| p.items.len()).sum();
                    job.stop(Some(BackendError::Timeout {
                        backend: NAME,
                        what: format!(
                            "a transfer to {}: {left} pieces not posted, {} of {} posted not completed",
                            job.peer,
                            job.posted - job.completed,
                            job.posted
                        ),
                        after: *transfer_timeout,
                    }));
                }
            }
            if job.stopped {
                if !job.sealed() {
                    job.dropped = true;
                    job.phases.clear();
                }
            } else if !full && !blocked.contains(&job.target.fi_addr) {
                match post_job(ep, in_flight, id, job, unsealed.contains(&job.peer)) {
                    Stall::No => {}
                    Stall::Peer => {
                        blocked.insert(job.target.fi_addr);
                    }
                    Stall::Window => full = true,
                }
            }
            if !job.sealed() {
                unsealed.insert(job.peer);
            }
        }
    }

    /// Makes jobs final whose pieces are all posted (or dropped) and completed, and sends the
    /// revoke acknowledgements that were waiting for them.
    ///
    /// A stopped job whose posted pieces did not complete within a second deadline is abandoned
    /// with a `Timeout`: the provider lost them (libfabric 1.17's shm drops a write to a closed key
    /// without an error completion). The endpoint keeps their memory descriptors until the
    /// completions come or the endpoint is closed.
    fn finish_jobs(&mut self, now: Instant) {
        let grace = self.control_ttl;
        let done: Vec<u64> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.sealed() && (j.completed >= j.posted || now > j.deadline + grace))
            .map(|(k, _)| *k)
            .collect();
        for id in done {
            let mut j = self.jobs.remove(&id).expect("listed above");
            if j.completed < j.posted {
                tracing::warn!(target: "kvxfer_fabric", "abandoning {} writes to {} that never completed", j.posted - j.completed, j.peer);
                self.in_flight = self.in_flight.saturating_sub(j.in_flight);
                j.error = Some(BackendError::Timeout {
                    backend: NAME,
                    what: format!(
                        "{} of {} posted pieces of a transfer to {} completing",
                        j.posted - j.completed,
                        j.posted,
                        j.peer
                    ),
                    after: grace * 2,
                });
            }
            match j.error {
                Some(e) => j.state.fail(e),
                None if j.dropped => j.state.aborted(),
                None => j.state.complete(),
            };
        }
        if !self.acks_due.is_empty() {
            let jobs = &self.jobs;
            let (ready, wait): (Vec<AckDue>, Vec<AckDue>) = std::mem::take(&mut self.acks_due)
                .into_iter()
                .partition(|a| a.jobs.iter().all(|j| !jobs.contains_key(j)));
            self.acks_due = wait;
            for a in ready {
                self.queue(a.fi_addr, wire::message(Kind::RevokeAck, self.nonce, a.dest, a.seq, &[]));
            }
        }
    }

    /// Whether anything waits for progress.
    fn busy(&self) -> bool {
        !self.jobs.is_empty() || !self.control.is_empty() || !self.revokes.is_empty() || !self.acks_due.is_empty()
    }
}

/// Posts `job`'s ready pieces, until it waits or stalls.
fn post_job(ep: &mut RdmEndpoint, in_flight: &mut u64, id: u64, job: &mut Job, earlier_unsealed: bool) -> Stall {
    loop {
        let Some(phase) = job.phases.front_mut() else { return Stall::No };
        if phase.items.is_empty() {
            if job.completed < job.posted {
                return Stall::No; // barrier
            }
            job.phases.pop_front();
            if job.phases.front().is_some_and(|p| !p.items.is_empty()) {
                if let Some(why) = job.target.gone() {
                    let e = BackendError::PeerLost { backend: NAME, peer: job.target.describe(job.peer), detail: why };
                    job.stop(Some(e));
                    job.dropped = true;
                    job.phases.clear();
                    return Stall::No;
                }
            }
            continue;
        }
        if phase.ordered && earlier_unsealed {
            return Stall::No;
        }
        let dest = job.target.fi_addr;
        while let Some(item) = phase.items.pop_front() {
            let mut bytes = 0;
            let r = match &item {
                Item::Write { local, remote, data } => {
                    bytes = local.iter().map(|l| l.len).sum();
                    if *in_flight > 0 && *in_flight + bytes > MAX_IN_FLIGHT {
                        phase.items.push_front(item);
                        return Stall::Window;
                    }
                    ep.write(dest, local, remote, *data, id << 1)
                }
                Item::Send(msg) => ep.send(dest, msg.clone(), (id << 1) | USER_SEND),
            };
            match r {
                Ok(()) => {
                    job.posted += 1;
                    job.in_flight += bytes;
                    *in_flight += bytes;
                }
                Err(PostError::Again) => {
                    phase.items.push_front(item);
                    return Stall::Peer;
                }
                Err(PostError::Failed(e)) => {
                    job.stop(Some(e));
                    job.dropped = true;
                    job.phases.clear();
                    return Stall::No;
                }
            }
        }
    }
}

fn ffi_completion_error(call: &'static str, e: &FiError, peer: PeerId, identity: u64) -> BackendError {
    BackendError::Ffi {
        backend: NAME,
        call,
        code: -i64::from(e.code),
        detail: format!("{}; to {peer} (identity {identity:#x})", e.detail),
    }
}

/// What the backend, its progress thread, registrations and transfer handles share.
pub(crate) struct Inner {
    pub(crate) state: Mutex<State>,
    pub(crate) events: Arc<EventQueue>,
    pub(crate) regions: RegionTable,
    pub(crate) peers: PeerTable<Peer>,
    /// One fragmenter per receive-buffer size, so message ids to one receiver never repeat.
    pub(crate) frags: Mutex<HashMap<usize, Arc<Fragmenter>>>,
    pub(crate) stop: AtomicBool,
    /// Wakes the progress thread when it blocks on the completion queue's wait fd.
    pub(crate) waker: Waker,
    /// Set while the progress thread is (about to be) blocked.
    pub(crate) sleeping: AtomicBool,
    pub(crate) thread: OnceLock<std::thread::Thread>,
    pub(crate) opts: Options,
    pub(crate) info: ProviderInfo,
    pub(crate) caps: Capabilities,
    pub(crate) cq_data_local: bool,
    pub(crate) nonce: u32,
    pub(crate) identity: u64,
}

impl Inner {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Makes sure the progress thread looks at the endpoint soon.
    pub(crate) fn wake(&self) {
        if self.sleeping.load(Ordering::SeqCst) {
            self.waker.poke();
        }
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }

    pub(crate) fn fragmenter(&self, recv_buf: usize) -> Arc<Fragmenter> {
        lock(&self.frags).entry(recv_buf).or_insert_with(|| Arc::new(Fragmenter::new(recv_buf - wire::HEADER))).clone()
    }

    /// Adds a job, posts what the queue takes now, and wakes the progress thread for the rest.
    pub(crate) fn submit(
        &self,
        st: &mut State,
        peer: PeerId,
        target: Arc<Peer>,
        phases: Vec<Phase>,
        refs: Vec<RegionRef>,
        dst: Vec<RegionId>,
    ) -> Arc<TransferState> {
        let state = TransferState::new(NAME, peer);
        let id = st.next_job;
        st.next_job += 1;
        st.jobs.insert(
            id,
            Job {
                peer,
                target,
                state: state.clone(),
                phases: phases.into(),
                posted: 0,
                completed: 0,
                error: None,
                stopped: false,
                dropped: false,
                deadline: Instant::now() + self.opts.timeout,
                _refs: refs,
                dst,
                in_flight: 0,
            },
        );
        st.post_jobs(Instant::now());
        self.wake();
        state
    }

    /// Validates `ops` (every region known and every range in bounds, on both sides) and lowers them
    /// into posts: contiguous pieces that follow each other on both sides are coalesced into one
    /// range, and up to `iov_limit` ranges (within `max_msg_size`) share one `fi_writemsg`.
    #[allow(clippy::type_complexity)]
    pub(crate) fn plan(
        &self,
        st: &State,
        peer: PeerId,
        target: &Peer,
        ops: &[WriteOp],
    ) -> Result<(Vec<RegionRef>, Vec<RegionId>, Vec<Item>), BackendError> {
        let theirs = lock(&target.regions);
        let mut refs: Vec<RegionRef> = Vec::new();
        let mut dst = Vec::new();
        for op in ops {
            let src_len = match refs.iter().find(|r| r.id() == op.src) {
                Some(r) => r.len(),
                None => {
                    let r = self.regions.get(op.src, None)?;
                    let len = r.len();
                    refs.push(r);
                    len
                }
            };
            let d = theirs.get(&op.dst.0).ok_or(BackendError::UnknownRegion {
                backend: NAME,
                region: op.dst,
                peer: Some(peer),
            })?;
            op.check_src(NAME, None, src_len)?;
            op.check_dst(NAME, Some(peer), d.len)?;
            if !dst.contains(&op.dst) {
                dst.push(op.dst);
            }
        }
        let iov_limit = self.info.iov_limit;
        let max_msg = self.info.max_msg_size.clamp(1, MAX_PIECE);
        let mut items = Vec::new();
        let (mut local, mut remote): (Vec<LocalRange>, Vec<RemoteIov>) = (Vec::new(), Vec::new());
        let mut bytes = 0u64;
        for s in toolkit::segments(ops, max_msg) {
            let mr = st.mrs.get(&s.src).map(|m| m.0).ok_or(BackendError::UnknownRegion {
                backend: NAME,
                region: s.src,
                peer: None,
            })?;
            let meta = &theirs[&s.dst.0];
            let (addr, key) = (meta.base + s.dst_offset, meta.key);
            if let (Some(l), Some(r)) = (local.last_mut(), remote.last_mut()) {
                if l.mr == mr
                    && l.offset + l.len == s.src_offset
                    && r.key == key
                    && r.addr + r.len == addr
                    && bytes + s.len <= max_msg
                {
                    l.len += s.len;
                    r.len += s.len;
                    bytes += s.len;
                    continue;
                }
            }
            if local.len() == iov_limit || bytes + s.len > max_msg {
                items.push(Item::Write {
                    local: std::mem::take(&mut local),
                    remote: std::mem::take(&mut remote),
                    data: None,
                });
                bytes = 0;
            }
            local.push(LocalRange { mr, offset: s.src_offset, len: s.len });
            remote.push(RemoteIov { addr, len: s.len, key });
            bytes += s.len;
        }
        if !local.is_empty() {
            items.push(Item::Write { local, remote, data: None });
        }
        Ok((refs, dst, items))
    }

    pub(crate) fn frames(&self, target: &Peer, kind: Kind, seq: u64, body: &[u8]) -> Result<Vec<Item>, BackendError> {
        let parts = target.frag.split(body).map_err(|source| BackendError::Codec { backend: NAME, source })?;
        Ok(parts.iter().map(|f| Item::Send(wire::message(kind, self.nonce, target.nonce, seq, f))).collect())
    }

    pub(crate) fn encode(&self, n: &Notification, ops: usize) -> Result<Vec<u8>, BackendError> {
        let body = n.encode().map_err(|source| BackendError::Codec { backend: NAME, source })?;
        self.caps.check_post(NAME, ops, body.len())?;
        Ok(body)
    }

    /// The peer, unless it is unknown or unreachable (reported lost once).
    pub(crate) fn target(&self, peer: PeerId) -> Result<Arc<Peer>, BackendError> {
        let p = self.peers.get(peer)?;
        if let Some(detail) = p.gone() {
            p.lose(&self.events, detail.clone());
            return Err(BackendError::PeerLost { backend: NAME, peer: p.describe(peer), detail });
        }
        Ok(p)
    }
}

pub(crate) fn progress_loop(inner: Arc<Inner>) {
    const HOT: Duration = Duration::from_millis(2);
    let min_sleep = Duration::from_micros(10);
    let idle_max = inner.opts.idle_poll;
    let beat = inner.opts.heartbeat_interval();
    let mut sleep = min_sleep;
    let mut last_active = Instant::now();
    let mut last_beat = Instant::now();
    let use_park = !inner.lock().ep.has_wait_fd();
    while !inner.stop.load(Ordering::Acquire) {
        // One clock reading per round (busy rounds are back to back, and each reading costs).
        let (n, busy, now) = {
            let mut st = inner.lock();
            let (n, now) = st.advance(&inner);
            if now.duration_since(last_beat) >= beat {
                last_beat = now;
                st.heartbeats(&inner);
                st.check_liveness(inner.opts.peer_timeout);
            }
            (n, st.busy(), now)
        };
        if n > 0 || busy {
            last_active = now;
            sleep = min_sleep;
            std::thread::yield_now();
        } else if now.duration_since(last_active) < HOT {
            std::thread::yield_now();
        } else {
            // Idle. With a wait fd, block on it (and on the wake pipe) until the provider has work, a
            // post wakes us, or the next heartbeat is due; else sleep with backoff.
            inner.sleeping.store(true, Ordering::SeqCst);
            let fd = {
                let mut st = inner.lock();
                if st.busy() {
                    None
                } else {
                    st.ep.try_wait()
                }
            };
            match fd {
                Some(fd) => inner.waker.wait(fd, beat.saturating_sub(last_beat.elapsed())),
                None if use_park => {
                    std::thread::park_timeout(sleep);
                    sleep = (sleep * 2).min(idle_max);
                }
                None => {}
            }
            inner.sleeping.store(false, Ordering::SeqCst);
        }
    }
}

/// Aborts a job: the progress thread sees `abort_requested` on its state, stops posting, and makes
/// it final once what was posted completed.
pub(crate) struct Aborter(pub(crate) Weak<Inner>);

impl AbortTransfer for Aborter {
    fn abort(&self, _state: &Arc<TransferState>) {
        if let Some(inner) = self.0.upgrade() {
            inner.wake();
        }
    }
}
