//! Peers: the record of each peer this endpoint connected to ([`Peer`]) and of each one that
//! connected here ([`Live`]), the connect exchange with its authentication (hello, challenge,
//! proof, welcome, refusal), liveness (heartbeats, silent peers reported lost), and cutting a peer
//! instance off.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use kvxfer_core::secret::{Exchange, NONCE_BYTES};
use kvxfer_core::toolkit::{EventQueue, Fragmenter};
use kvxfer_core::{BackendError, BackendEvent, EndpointMetadata, Notification, PeerId, TransferState};
use tokio::sync::oneshot;

use crate::ffi::{cma_permitted, env_flag, AvRemoved};
use crate::progress::{Inner, Item, Phase, State, MAX_CONTROL, USER_CONTROL};
use crate::regions::AckDue;
use crate::wire::{self, Kind, Payload, RegionMeta};
use crate::{lock, FabricBackend, NAME};

pub(crate) struct Peer {
    pub(crate) identity: u64,
    pub(crate) fi_addr: u64,
    pub(crate) addr: Vec<u8>,
    pub(crate) nonce: u32,
    pub(crate) pid: u32,
    pub(crate) provider: String,
    pub(crate) cq_data: bool,
    pub(crate) frag: Arc<Fragmenter>,
    /// The peer's regions; a revoke removes one (under the endpoint lock, like every lookup).
    pub(crate) regions: Mutex<HashMap<u32, RegionMeta>>,
    pub(crate) lost: AtomicBool,
    /// The peer proved the cluster secret in the connect exchange (or there is none).
    pub(crate) authed: AtomicBool,
}

/// Whether process `pid` exists and is not a zombie (Linux `/proc`).
fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            !matches!(stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next()), Some('Z' | 'X'))
        }
        Err(_) => false,
    }
}

/// Why posting to an endpoint must not happen: it is in this process and was closed, or (shm, same
/// host) its process is gone. libfabric 1.17's shm provider spins forever on the lock of a dead
/// peer's queue, so a dead shm peer is never posted to.
pub(crate) fn unreachable(provider: &str, addr: &[u8], nonce: u32, pid: u32) -> Option<String> {
    if closed_set().as_ref().is_some_and(|c| c.contains(&(provider.to_owned(), addr.to_vec(), nonce))) {
        return Some("its endpoint (in this process) was closed".to_owned());
    }
    if provider == "shm" && pid != 0 && !process_alive(pid) {
        return Some(format!("its process {pid} is gone"));
    }
    None
}

impl Peer {
    pub(crate) fn gone(&self) -> Option<String> {
        unreachable(&self.provider, &self.addr, self.nonce, self.pid)
    }

    pub(crate) fn describe(&self, id: PeerId) -> String {
        format!("{id} (identity {:#x}, {})", self.identity, self.provider)
    }

    /// Marks the peer lost and reports it, once.
    pub(crate) fn lose(&self, events: &EventQueue, reason: String) {
        if !self.lost.swap(true, Ordering::AcqRel) {
            events.push(BackendEvent::PeerLost { identity: self.identity, reason });
        }
    }
}

pub(crate) struct Live {
    pub(crate) identity: u64,
    pub(crate) last_seen: Instant,
    /// From its hello: where revokes go.
    pub(crate) fi_addr: Option<u64>,
    pub(crate) addr: Vec<u8>,
    pub(crate) pid: u32,
}

/// What [`State::cut_instance`] did, for the caller to wait on and answer.
pub(crate) struct Cutting {
    pub(crate) closed: usize,
    pub(crate) failed: usize,
    /// The transfers to the instance that were not final: answered once they are.
    pub(crate) states: Vec<Arc<TransferState>>,
    /// Why nothing it sent can be said not to land (`None`: confirmed).
    pub(crate) unconfirmed: Option<String>,
    pub(crate) provider: String,
}

/// Why a cut-off is not confirmed on `tcp;ofi_rxm` when this endpoint takes writes carrying remote
/// CQ data (`attached=cq-data`; `auto` chooses messages there for this reason). Closing a connection
/// on which such a write is half received makes libfabric 1.17's tcp provider report the cancelled
/// receive with no context, and `ofi_rxm` dereferences it (`rxm_handle_comp_error`): the process
/// dies of SIGSEGV inside `fi_av_remove`. Measured here: 3 of 3 cut-offs of a writer stopped in the
/// middle of a CQ-data write (`tests/cut_off.rs`, 2026-12-05); the chaos case
/// `presumed_dead_link_healed` met it in 1 run of 21. So the connection is left open and the cut-off
/// reported unconfirmed (the engine quarantines the pages) instead.
const CQ_DATA_CUT_OFF: &str =
    "tcp;ofi_rxm with attached=cq-data: the connection is not closed (libfabric 1.17 crashes \
     closing a connection on which a write carrying remote CQ data is half received), so a write accepted before the \
     cut-off may still be placed; use attached=auto or attached=message for confirmed cut-offs";

/// Whether `FI_AV_REMOVE_CLEANUP` was in the environment when this crate first opened an endpoint
/// in this process (libfabric reads it once, when it starts: with it, `fi_av_remove` makes
/// `tcp;ofi_rxm` close its connection to the removed peer).
pub(crate) fn av_remove_cleanup() -> bool {
    static CLEANUP: OnceLock<bool> = OnceLock::new();
    *CLEANUP.get_or_init(|| env_flag("FI_AV_REMOVE_CLEANUP"))
}

fn cut_refusal(nonce: u32) -> String {
    format!(
        "this endpoint cut off the peer endpoint with nonce {nonce:#x} (it gave up on that peer); a restarted process \
         is a new endpoint and may connect"
    )
}

/// Most connections waiting for their authentication at once (more hellos are refused).
const MAX_PENDING_AUTH: usize = 256;

/// What every authentication refusal tells the operator to do.
const AUTH_FIX: &str = "configure the same cluster secret (KVXFER_SECRET) on every rank";

/// A hello whose sender has not proved the secret yet: the challenge went out, the proof is due.
pub(crate) struct PendingAuth {
    exchange: Exchange,
    deadline: Instant,
    fi_addr: u64,
    addr: Vec<u8>,
    pid: u32,
}

/// A `connect` of ours waiting for its answer (welcome, challenge or refusal).
pub(crate) struct Connecting {
    peer: Arc<Peer>,
    challenge: [u8; NONCE_BYTES],
    done: oneshot::Sender<Result<(), String>>,
    /// The remote keys the acceptor registered for us ([`Kind::Keys`]).
    keys: HashMap<u32, RegionMeta>,
    /// How many keys its welcome announced (`None`: no welcome yet).
    expected: Option<u32>,
}

/// A peer instance this endpoint cut off.
pub(crate) struct CutInfo {
    /// Why the cut-off is not confirmed (`None`: confirmed: nothing it sends can land).
    pub(crate) unconfirmed: Option<String>,
    /// Its address (to tell it once, on its first message since, that it is refused).
    addr: Vec<u8>,
    told: bool,
}

/// Most writers' capabilities kept (each hello sends them; old entries of unknown senders go).
const MAX_WRITER_CAPS: usize = 65_536;

/// Addresses of endpoints of this process that were closed, per provider.
///
/// libfabric's shm provider (1.17) crashes (SIGSEGV in `fi_writemsg`) when an endpoint writes to a peer
/// endpoint of the same process that was closed, so posts to such a peer fail with `PeerLost` instead.
/// Peers in other processes are unaffected: their writes fail or run into the deadline.
static CLOSED_IN_PROCESS: Mutex<Option<HashSet<ClosedKey>>> = Mutex::new(None);

/// Provider, address and nonce of an endpoint instance.
type ClosedKey = (String, Vec<u8>, u32);

pub(crate) fn closed_set() -> MutexGuard<'static, Option<HashSet<ClosedKey>>> {
    lock(&CLOSED_IN_PROCESS)
}

impl State {
    /// With a secret: the identity the endpoint with `nonce` proved (it connected to us and
    /// authenticated, or we connected to it and it proved the secret), `None` if it did not.
    pub(crate) fn proved(&self, nonce: u32, inner: &Inner) -> Option<u64> {
        if self.banned.contains(&nonce) {
            return None;
        }
        if let Some(l) = self.live.get(&nonce) {
            return Some(l.identity);
        }
        inner
            .peers
            .all()
            .into_iter()
            .find(|(_, p)| p.nonce == nonce && p.authed.load(Ordering::Acquire))
            .map(|(_, p)| p.identity)
    }

    /// Whether notification `n` from `nonce` may be delivered: with a secret, its key must be the
    /// identity the sender proved; one that is not fails the sender's connection.
    pub(crate) fn bound(&mut self, n: &[u8], nonce: u32, proved: Option<u64>, inner: &Inner) -> bool {
        let Some(identity) = proved else { return true };
        match Notification::decode(n) {
            Ok(note) if !note.is_from(identity) => {
                let what =
                    format!("keyed a notification of {} with sender key {:#x}", note.request, note.sender.to_u64());
                self.refuse_forged(nonce, identity, what, inner);
                false
            }
            // Undecodable ones are counted where they are delivered.
            _ => true,
        }
    }

    /// A peer that proved `identity` broke the binding: nothing more of it is applied, it is told
    /// why, it is refused from now on, and `PeerLost` is reported with the identity it proved.
    pub(crate) fn refuse_forged(&mut self, nonce: u32, identity: u64, what: String, inner: &Inner) {
        self.forged += 1;
        let reason = format!(
            "forged notification refused: the peer proved identity {identity:#x} but {what}; its connection was closed"
        );
        tracing::warn!(target: "kvxfer_fabric", "{reason}");
        self.banned.insert(nonce);
        let forward: Vec<Arc<Peer>> =
            inner.peers.all().into_iter().filter(|(_, p)| p.nonce == nonce).map(|(_, p)| p).collect();
        let to = self.live.get(&nonce).and_then(|l| l.fi_addr).or_else(|| forward.first().map(|p| p.fi_addr));
        if let Some(a) = to {
            self.queue(a, wire::message(Kind::Refused, self.nonce, nonce, 0, &wire::refusal(&reason)));
        }
        self.live.remove(&nonce);
        self.drop_writer_mrs(nonce);
        self.reasm.forget(u64::from(nonce));
        self.pending.retain(|(n, _), _| *n != nonce);
        for p in forward {
            p.lost.store(true, Ordering::Release);
        }
        self.writer_gone(nonce);
        self.events.push(BackendEvent::PeerLost { identity, reason });
    }

    /// A peer that said hello (and, with a secret, proved it) may write into our regions from now
    /// on: it is told of revokes, including those under way.
    fn admit(&mut self, nonce: u32, identity: u64, fi_addr: Option<u64>, addr: &[u8], pid: u32, now: Instant) {
        self.live.insert(nonce, Live { identity, last_seen: now, fi_addr, addr: addr.to_vec(), pid });
        // A peer that connected with metadata taken before a close still under way: ask it too.
        if let Some(a) = fi_addr {
            let name = self.ep.name().to_vec();
            let mut asks = Vec::new();
            for (seq, w) in self.revokes.iter_mut() {
                w.waiting.insert(nonce);
                asks.push(wire::message(Kind::Revoke, self.nonce, nonce, *seq, &wire::hello(w.region.0, &name)));
            }
            for m in asks {
                self.queue(a, m);
            }
        }
    }

    fn refuse(&mut self, to: u64, dest: u32, conn: u64, reason: &str) {
        tracing::warn!(target: "kvxfer_fabric", "refusing a connection: {reason}");
        self.queue(to, wire::message(Kind::Refused, self.nonce, dest, conn, &wire::refusal(reason)));
    }

    /// A hello: admitted at once without a secret; with one, answered with a challenge.
    pub(crate) fn on_hello(&mut self, nonce: u32, identity: u64, body: &[u8], now: Instant, inner: &Inner) {
        let Some((pid, conn, challenge, addr)) = wire::split_greeting(body) else {
            return self.malformed("short hello");
        };
        let fi_addr = self.insert_addr(addr);
        let Some(secret) = self.secret.clone() else {
            self.admit(nonce, identity, fi_addr, addr, pid, now);
            if let Some(a) = fi_addr {
                self.answer_welcome(inner, a, nonce, conn);
            }
            return;
        };
        let Some(a) = fi_addr else { return };
        if self.banned.contains(&nonce) {
            let why = format!("this endpoint refuses identity {identity:#x} after a forged notification");
            return self.refuse(a, nonce, conn, &why);
        }
        if self.pending.len() >= MAX_PENDING_AUTH {
            let why = format!("{MAX_PENDING_AUTH} connections are already authenticating; try again");
            return self.refuse(a, nonce, conn, &why);
        }
        if self.live.get(&nonce).is_some_and(|l| l.identity != identity) {
            let why = format!("endpoint nonce {nonce:#x} is already connected under another identity");
            return self.refuse(a, nonce, conn, &why);
        }
        let acceptor_nonce = match kvxfer_core::secret::nonce() {
            Ok(n) => n,
            Err(e) => return tracing::warn!(target: "kvxfer_fabric", "no nonce for a connecting peer: {e}"),
        };
        let exchange = wire::exchange(challenge, acceptor_nonce, (identity, nonce), (self.identity, self.nonce));
        let body = wire::challenge(&acceptor_nonce, &exchange.acceptor_proof(&secret));
        self.queue(a, wire::message(Kind::Challenge, self.nonce, nonce, conn, &body));
        let deadline = now + self.control_ttl;
        self.pending.insert((nonce, conn), PendingAuth { exchange, deadline, fi_addr: a, addr: addr.to_vec(), pid });
    }

    /// The connector's proof: admitted (welcome) or refused.
    pub(crate) fn on_auth(&mut self, nonce: u32, conn: u64, body: &[u8], inner: &Inner) {
        let (Some(secret), Some(p)) = (self.secret.clone(), self.pending.remove(&(nonce, conn))) else {
            return tracing::debug!(target: "kvxfer_fabric", "dropping an auth message no challenge asked for");
        };
        if wire::split_auth(body).is_some_and(|proof| p.exchange.verify_connector(&secret, &proof)) {
            let identity = p.exchange.connector.0;
            self.admit(nonce, identity, Some(p.fi_addr), &p.addr, p.pid, Instant::now());
            self.answer_welcome(inner, p.fi_addr, nonce, conn);
            return;
        }
        let why = format!(
            "authentication failed: the connecting endpoint (identity {:#x}) did not prove this endpoint's cluster \
             secret; {AUTH_FIX}",
            p.exchange.connector.0
        );
        self.refuse(p.fi_addr, nonce, conn, &why);
    }

    /// Answers our connect `conn` (once).
    fn answer(&mut self, conn: u64, r: Result<(), String>) {
        if let Some(c) = self.connecting.remove(&conn) {
            let _ = c.done.send(r);
        }
    }

    /// The acceptor's challenge: verify its proof (it has our secret), then prove ours.
    pub(crate) fn on_challenge(&mut self, nonce: u32, conn: u64, body: &[u8]) {
        let Some(c) = self.connecting.get(&conn).filter(|c| c.peer.nonce == nonce) else {
            return tracing::debug!(target: "kvxfer_fabric", "dropping a challenge for no connect of ours");
        };
        let Some(secret) = self.secret.clone() else {
            let why =
                format!("authentication required: the peer has a cluster secret and this endpoint none; {AUTH_FIX}");
            return self.answer(conn, Err(why));
        };
        let Some((acceptor_nonce, proof)) = wire::split_challenge(body) else {
            self.malformed("short challenge");
            return self.answer(conn, Err("authentication failed: the peer's challenge is malformed".into()));
        };
        let exchange =
            wire::exchange(c.challenge, acceptor_nonce, (self.identity, self.nonce), (c.peer.identity, c.peer.nonce));
        if !exchange.verify_acceptor(&secret, &proof) {
            let why = format!(
                "authentication failed: the peer did not prove this endpoint's cluster secret (the secrets differ); \
                 {AUTH_FIX}"
            );
            return self.answer(conn, Err(why));
        }
        c.peer.authed.store(true, Ordering::Release);
        let to = c.peer.fi_addr;
        let msg = wire::message(Kind::Auth, self.nonce, nonce, conn, &exchange.connector_proof(&secret));
        self.queue(to, msg);
    }

    pub(crate) fn on_welcome(&mut self, nonce: u32, conn: u64, body: &[u8]) {
        let Some(c) = self.connecting.get_mut(&conn).filter(|c| c.peer.nonce == nonce) else { return };
        if self.secret.is_some() && !c.peer.authed.load(Ordering::Acquire) {
            let why = format!("authentication failed: the peer has no cluster secret and cannot prove one; {AUTH_FIX}");
            return self.answer(conn, Err(why));
        }
        let Some((total, first)) = wire::split_welcome(body) else {
            self.malformed("welcome");
            return self.answer(conn, Err("the peer's welcome is malformed".into()));
        };
        c.peer.authed.store(true, Ordering::Release);
        c.keys.extend(first.into_iter().map(|k| (k.id, k)));
        c.expected = Some(total);
        self.keys_complete(conn);
    }

    /// Remote keys for one of our connects.
    pub(crate) fn on_keys(&mut self, nonce: u32, conn: u64, body: &[u8]) {
        let Some(c) = self.connecting.get_mut(&conn).filter(|c| c.peer.nonce == nonce) else { return };
        let Some(keys) = wire::split_keys(body) else { return self.malformed("keys") };
        c.keys.extend(keys.into_iter().map(|k| (k.id, k)));
        self.keys_complete(conn);
    }

    /// Answers connect `conn` once its welcome and every key it announced arrived: the peer's regions
    /// are the ones it registered for us.
    fn keys_complete(&mut self, conn: u64) {
        let Some(c) = self.connecting.get_mut(&conn) else { return };
        if c.expected != Some(c.keys.len() as u32) {
            return;
        }
        *lock(&c.peer.regions) = std::mem::take(&mut c.keys);
        self.answer(conn, Ok(()));
    }

    /// What a connector announced in its hello's flags: capabilities and receive buffer size.
    pub(crate) fn on_caps(&mut self, nonce: u32, caps: (u8, usize)) {
        if self.writer_caps.len() < MAX_WRITER_CAPS || self.writer_caps.contains_key(&nonce) {
            self.writer_caps.insert(nonce, caps);
        }
    }

    /// A message of a cut-off instance: nothing of it is applied. A hello is refused (its connect
    /// fails at once), and the first other message since the cut-off gets one refusal, so that the
    /// instance fails its transfers instead of waiting for them.
    pub(crate) fn on_cut_message(&mut self, h: wire::Header, body: &[u8]) {
        self.cut_dropped += 1;
        let why = cut_refusal(h.nonce);
        match h.kind {
            Kind::Hello => {
                if let Some((_, conn, _, addr)) = wire::split_greeting(body) {
                    if let Some(a) = self.insert_addr(addr) {
                        self.refuse(a, h.nonce, conn, &why);
                    }
                }
            }
            Kind::Revoke => {
                // It closes a region of its own: we write nothing into it any more (every transfer
                // to it was stopped), which the acknowledgement says once those are final.
                let Some((region, owner_addr)) = wire::split_u32(body) else { return };
                let Some(fi_addr) = self.insert_addr(owner_addr) else { return };
                let cut_ids: HashSet<PeerId> =
                    self.cut_ids.iter().filter(|(_, n)| **n == h.nonce).map(|(id, _)| *id).collect();
                let jobs = self.jobs.iter().filter(|(_, j)| cut_ids.contains(&j.peer)).map(|(k, _)| *k).collect();
                tracing::debug!(target: "kvxfer_fabric", "acknowledging region {region} of a cut-off peer");
                self.acks_due.push(AckDue { fi_addr, dest: h.nonce, seq: h.seq, jobs });
            }
            Kind::Refused | Kind::RevokeAck => {}
            _ => {
                let Some(c) = self.cut.get_mut(&h.nonce) else { return };
                if std::mem::replace(&mut c.told, true) || c.addr.is_empty() {
                    return;
                }
                let addr = c.addr.clone();
                if let Some(a) = self.insert_addr(&addr) {
                    self.queue(a, wire::message(Kind::Refused, self.nonce, h.nonce, 0, &wire::refusal(&why)));
                }
            }
        }
    }

    /// Cuts off the instance with endpoint nonce `nonce` (see the crate README, "Cutting a peer
    /// off"): its keys are closed, connections of the provider to it closed where that is how
    /// writes already past the key check are stopped, every connection state dropped, every
    /// transfer to it stopped.
    pub(crate) fn cut_instance(&mut self, inner: &Inner, nonce: u32, reason: &str) -> Cutting {
        let why = format!("cut off: {reason}");
        let provider = self.ep.info().provider.clone();
        let forward: Vec<(PeerId, Arc<Peer>)> =
            inner.peers.all().into_iter().filter(|(_, p)| p.nonce == nonce).collect();
        let live = self.live.remove(&nonce);
        let keys_given = self.remote_mrs.contains_key(&nonce);
        let pid = live.as_ref().map(|l| l.pid).filter(|p| *p != 0).or_else(|| forward.first().map(|(_, p)| p.pid));
        let addr = live
            .as_ref()
            .map(|l| l.addr.clone())
            .filter(|a| !a.is_empty())
            .or_else(|| forward.first().map(|(_, p)| p.addr.clone()))
            .unwrap_or_default();
        let mut fi_addrs: HashSet<u64> = forward.iter().map(|(_, p)| p.fi_addr).collect();
        fi_addrs.extend(live.as_ref().and_then(|l| l.fi_addr));
        fi_addrs.extend(self.pending.iter().filter(|((n, _), _)| *n == nonce).map(|(_, p)| p.fi_addr));
        // Its keys: every write with them that reaches the key check from now on fails it.
        self.drop_writer_mrs(nonce);
        // Nothing more goes to it, but for acknowledgements of its revokes (it waits for them to
        // close its regions; they promise what is true from now on: we write nothing into them).
        let mut acks = Vec::new();
        self.control.retain(|c| {
            if !fi_addrs.contains(&c.to) {
                return true;
            }
            if c.msg.get(1) == Some(&(Kind::RevokeAck as u8)) {
                acks.push(c.msg.clone());
            }
            false
        });
        if let Some(h) = self.hot_pings.as_mut() {
            h.retain(|a, _| !fi_addrs.contains(a));
        }
        // Writes already past the key check.
        let unconfirmed = if keys_given {
            self.stop_accepted_writes(&provider, inner.cq_data_local, nonce, pid, &fi_addrs)
        } else {
            None
        };
        for (id, p) in &forward {
            let _ = inner.peers.remove(*id);
            self.cut_ids.insert(*id, nonce);
            p.lost.store(true, Ordering::Release);
        }
        let answers: Vec<u64> =
            self.connecting.iter().filter(|(_, c)| c.peer.nonce == nonce).map(|(k, _)| *k).collect();
        for conn in answers {
            self.answer(conn, Err(why.clone()));
        }
        self.pending.retain(|(n, _), _| *n != nonce);
        self.reasm.forget(u64::from(nonce));
        // Its revokes waiting for our transfers to it: still acknowledged once those are final
        // (to its address inserted anew where the cut-off removed it).
        if !acks.is_empty() || self.acks_due.iter().any(|a| a.dest == nonce) {
            let to = if addr.is_empty() { None } else { self.insert_addr(&addr) };
            match to {
                Some(to) => {
                    for a in self.acks_due.iter_mut().filter(|a| a.dest == nonce) {
                        a.fi_addr = to;
                    }
                    for msg in acks {
                        self.queue(to, msg);
                    }
                }
                None => self.acks_due.retain(|a| a.dest != nonce),
            }
        }
        if unconfirmed.is_none() {
            // It writes nothing any more: closing regions stop waiting for it. (Unconfirmed, they
            // keep waiting, time out, and the memory is not freed.)
            self.writer_gone(nonce);
        }
        let ids: HashSet<PeerId> = forward.iter().map(|(id, _)| *id).collect();
        let mut states = Vec::new();
        for j in self.jobs.values_mut().filter(|j| ids.contains(&j.peer)) {
            let e = BackendError::PeerLost { backend: NAME, peer: j.target.describe(j.peer), detail: why.clone() };
            j.stop(Some(e));
            states.push(j.state.clone());
        }
        let closed = forward.len() + usize::from(live.is_some());
        self.cut.insert(nonce, CutInfo { unconfirmed: unconfirmed.clone(), addr, told: false });
        Cutting { closed, failed: states.len(), states, unconfirmed, provider }
    }

    /// Stops the instance's writes that passed the key check before its keys were closed; returns
    /// why that cannot be confirmed, if it cannot.
    fn stop_accepted_writes(
        &mut self,
        provider: &str,
        cq_data: bool,
        nonce: u32,
        pid: Option<u32>,
        fi_addrs: &HashSet<u64>,
    ) -> Option<String> {
        match provider {
            "tcp;ofi_rxm" if cq_data => Some(CQ_DATA_CUT_OFF.to_owned()),
            "tcp;ofi_rxm" => {
                if !av_remove_cleanup() {
                    return Some(
                        "tcp;ofi_rxm: a write whose header passed the key check before the cut-off keeps being \
                         placed as its payload arrives, and only closing the connection stops it, which \
                         fi_av_remove does only with FI_AV_REMOVE_CLEANUP=1 in the environment when libfabric \
                         starts (it was not)"
                            .to_owned(),
                    );
                }
                let mut failed = Vec::new();
                for a in fi_addrs {
                    // The probe, if the provider may hold no connection to it (see `av_remove`): a
                    // heartbeat, harmless wherever it lands.
                    let probe = wire::message(Kind::Heartbeat, self.nonce, nonce, self.identity, &[]);
                    match self.ep.av_remove(*a, probe, USER_CONTROL) {
                        Ok(AvRemoved::Removed) => {}
                        Ok(AvRemoved::NoConnection) => tracing::info!(
                            target: "kvxfer_fabric",
                            "cut-off of instance {nonce:#x}: no connection to close at address {a} (a post to it fails at once)"
                        ),
                        Err(e) => failed.push(e.to_string()),
                    }
                    self.addrs.retain(|_, v| v != a);
                }
                (!failed.is_empty()).then(|| format!("tcp;ofi_rxm: fi_av_remove failed: {}", failed.join("; ")))
            }
            "shm" => {
                let caps = self.writer_caps.get(&nonce).map_or(0, |c| c.0);
                let mut why = Vec::new();
                if caps & wire::CAP_DELIVERY_COMPLETE == 0 {
                    why.push("its writes may take shm's fast path (CMA by the writer, no key check here)");
                }
                if caps & wire::CAP_CMA == 0 {
                    why.push("it may not use cross-memory attach towards this endpoint");
                }
                if env_flag("FI_SHM_DISABLE_CMA") || env_flag("FI_SHM_USE_DSA_SAR") {
                    why.push("FI_SHM_DISABLE_CMA or FI_SHM_USE_DSA_SAR is set here");
                }
                if !pid.is_some_and(cma_permitted) {
                    why.push("this process may not use cross-memory attach on it");
                }
                (!why.is_empty()).then(|| {
                    format!(
                        "shm: {} (a write larger than one segment could then be copied in several rounds, the \
                         later ones after its key was closed)",
                        why.join("; ")
                    )
                })
            }
            other => Some(format!(
                "provider {other}: whether a write accepted before its key was closed can still be placed is not \
                 verified for it"
            )),
        }
    }

    /// A refusal: of our connect `conn`, or (conn 0) of an established connection by a peer that
    /// authenticated (or any peer without a secret).
    pub(crate) fn on_refused(&mut self, nonce: u32, conn: u64, body: &[u8], inner: &Inner) {
        let Some(reason) = wire::split_refusal(body).map(str::to_owned) else {
            return self.malformed("refusal reason");
        };
        if conn != 0 {
            if self.connecting.get(&conn).is_some_and(|c| c.peer.nonce == nonce) {
                self.answer(conn, Err(format!("the peer refused the connection: {reason}")));
            }
            return;
        }
        if self.secret.is_some() && self.proved(nonce, inner).is_none() {
            return;
        }
        for (_, p) in inner.peers.all().into_iter().filter(|(_, p)| p.nonce == nonce) {
            p.lose(&self.events, format!("the peer (identity {:#x}) closed the connection: {reason}", p.identity));
        }
    }

    pub(crate) fn insert_addr(&mut self, addr: &[u8]) -> Option<u64> {
        if let Some(a) = self.addrs.get(addr) {
            return Some(*a);
        }
        match self.ep.av_insert(addr) {
            Ok(a) => {
                self.addrs.insert(addr.to_vec(), a);
                Some(a)
            }
            Err(e) => {
                tracing::warn!(target: "kvxfer_fabric", "cannot address a peer that said hello: {e}");
                None
            }
        }
    }

    /// Queues a heartbeat to every peer this endpoint connected to.
    pub(crate) fn heartbeats(&mut self, inner: &Inner) {
        if self.control.len() > MAX_CONTROL {
            return;
        }
        for (_, p) in inner.peers.all() {
            if !p.lost.load(Ordering::Acquire) && p.gone().is_none() {
                self.queue(p.fi_addr, wire::message(Kind::Heartbeat, self.nonce, p.nonce, self.identity, &[]));
            }
        }
    }

    /// Reports peers not heard from within `timeout` as lost (once).
    pub(crate) fn check_liveness(&mut self, timeout: Duration) {
        let now = Instant::now();
        self.pending.retain(|_, p| now < p.deadline);
        let dead: Vec<u32> =
            self.live.iter().filter(|(_, l)| now.duration_since(l.last_seen) > timeout).map(|(n, _)| *n).collect();
        for n in dead {
            if let Some(l) = self.live.remove(&n) {
                self.events.push(BackendEvent::PeerLost {
                    identity: l.identity,
                    reason: format!("no heartbeat from identity {:#x} for {timeout:?}", l.identity),
                });
            }
            self.writer_gone(n);
        }
    }
}

impl FabricBackend {
    /// One try of [`KvTransferBackend::connect`](kvxfer_core::KvTransferBackend::connect) (`p`: the peer's
    /// validated payload).
    pub(crate) async fn connect_once(&self, peer: &EndpointMetadata, p: Payload) -> Result<PeerId, Attempt> {
        let connect_err = |detail: String| BackendError::Connect {
            backend: NAME,
            peer: format!("identity {:#x}", peer.identity),
            detail,
        };
        let challenge = kvxfer_core::secret::nonce()
            .map_err(|e| Attempt::Failed(connect_err(format!("no challenge nonce: {e}"))))?;
        let conn = u64::from_le_bytes(
            kvxfer_core::secret::nonce().map_err(|e| Attempt::Failed(connect_err(format!("no connection id: {e}"))))?
                [..8]
                .try_into()
                .expect("8 bytes"),
        )
        .max(1);
        let (done, answer) = oneshot::channel();
        let (id, target, state) = {
            let mut st = self.inner.lock();
            let fi_addr = match st.addrs.get(&p.addr) {
                Some(a) => *a,
                None => {
                    let a = st.ep.av_insert(&p.addr).map_err(|e| Attempt::Failed(connect_err(e.to_string())))?;
                    st.addrs.insert(p.addr.clone(), a);
                    a
                }
            };
            let target = Peer {
                identity: peer.identity,
                fi_addr,
                addr: p.addr,
                nonce: p.nonce,
                pid: p.pid,
                provider: p.provider,
                cq_data: p.cq_data,
                frag: self.inner.fragmenter(p.recv_buf as usize),
                // The keys come with the answer (registered for us alone); the metadata's are local.
                regions: Mutex::new(HashMap::new()),
                lost: AtomicBool::new(false),
                authed: AtomicBool::new(false),
            };
            // Known from now on (the caller learns the id only when the hello arrived).
            let id = self.inner.peers.reserve();
            self.inner.peers.insert_at(id, target);
            let target = self.inner.peers.get(id).map_err(Attempt::Failed)?;
            // Introduce ourselves (pid and address, so the peer can revoke its regions here, and a
            // fresh challenge) and wait for the hello to be delivered: an unreachable peer fails here.
            let mut caps = 0;
            if st.ep.delivery_complete_requested() {
                caps |= wire::CAP_DELIVERY_COMPLETE;
            }
            let shm = self.inner.info.provider == "shm";
            if shm && !env_flag("FI_SHM_DISABLE_CMA") && !env_flag("FI_SHM_USE_DSA_SAR") && cma_permitted(target.pid) {
                caps |= wire::CAP_CMA;
            }
            let hello = wire::message_flagged(
                Kind::Hello,
                wire::hello_flags(caps, st.ep.recv_buf_size()),
                self.inner.nonce,
                target.nonce,
                self.inner.identity,
                &wire::greeting(std::process::id(), conn, &challenge, st.ep.name()),
            );
            st.connecting.insert(
                conn,
                Connecting { peer: target.clone(), challenge, done, keys: HashMap::new(), expected: None },
            );
            let phases = vec![Phase { items: VecDeque::from([Item::Send(hello)]), ordered: true }];
            let state = self.inner.submit(&mut st, id, target.clone(), phases, Vec::new(), Vec::new());
            (id, target, state)
        };
        let fail = |detail: String| {
            let _ = self.inner.peers.remove(id);
            let mut st = self.inner.lock();
            st.connecting.remove(&conn);
            // A peer without a secret admitted us already: tell it this connection ends.
            if !self.inner.peers.all().iter().any(|(_, q)| q.fi_addr == target.fi_addr) && target.gone().is_none() {
                st.queue(
                    target.fi_addr,
                    wire::message(Kind::Bye, self.inner.nonce, target.nonce, self.inner.identity, &[]),
                );
            }
            drop(st);
            self.inner.wake();
            connect_err(detail)
        };
        if let Err(e) = self.settle(&state, id, "the hello to a new peer").await {
            // `lost` is set only by a completion that reported a connection loss.
            let closed = target.lost.load(Ordering::Acquire);
            let e = fail(format!("the first message did not arrive: {e}"));
            return Err(if closed { Attempt::LinkClosed(e) } else { Attempt::Failed(e) });
        }
        // The answer: a welcome, or (with a secret) the exchange first; bounded by the timeout.
        match tokio::time::timeout(self.inner.opts.timeout, answer).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(why))) => return Err(Attempt::Failed(fail(why))),
            Ok(Err(_)) => return Err(Attempt::Failed(fail("the endpoint closed while connecting".into()))),
            Err(_) => {
                let why = format!("no answer to the hello within {:?}", self.inner.opts.timeout);
                return Err(Attempt::Failed(fail(why)));
            }
        }
        tracing::debug!(target: "kvxfer_fabric", "connected {}", target.describe(id));
        Ok(id)
    }
}

/// How one connect try ended, when it failed.
pub(crate) enum Attempt {
    /// The hello failed on a connection the peer had closed: worth one more try.
    LinkClosed(BackendError),
    /// Anything else: final.
    Failed(BackendError),
}

impl Attempt {
    pub(crate) fn into_error(self) -> BackendError {
        match self {
            Attempt::LinkClosed(e) | Attempt::Failed(e) => e,
        }
    }
}
