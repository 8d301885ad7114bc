//! Memory registration: the per-peer registrations of our regions and the keys handed to each
//! connecting writer, revokes (ours, waiting for every writer's acknowledgement, and the peers',
//! acknowledged once our jobs into the region are final), and closing a registration: out of the
//! region table, wait for local jobs that hold it, revoke it at every peer, then `fi_close` the MR.

use std::collections::HashSet;
use std::sync::Weak;
use std::time::Instant;

use kvxfer_core::toolkit;
use kvxfer_core::{BackendError, BoxFuture, CloseRegistration, RegionId};
use tokio::sync::oneshot;

use crate::ffi::MrHandle;
use crate::peers::unreachable;
use crate::progress::{Control, Inner, State};
use crate::wire::{self, Kind, RegionMeta};
use crate::{lock, NAME};

/// A revoke of ours waiting for acknowledgements.
pub(crate) struct RevokeWait {
    pub(crate) region: RegionId,
    pub(crate) waiting: HashSet<u32>,
    pub(crate) done: Option<oneshot::Sender<()>>,
}

/// A revoke from a peer, acknowledged once `jobs` are final.
pub(crate) struct AckDue {
    pub(crate) fi_addr: u64,
    pub(crate) dest: u32,
    pub(crate) seq: u64,
    pub(crate) jobs: Vec<u64>,
}

impl State {
    /// Answers an admitted connection: a registration of each region for the connecting instance
    /// alone (made at its first connection, reused by later ones), and their keys in the welcome,
    /// sized to the connector's receive buffers (those that do not fit go first, in [`Kind::Keys`]
    /// messages: one message in the usual case, as before per-peer keys).
    pub(crate) fn answer_welcome(&mut self, inner: &Inner, to: u64, nonce: u32, conn: u64) {
        let mut entries = Vec::new();
        let State { ep, mrs, remote_mrs, .. } = self;
        let mine = remote_mrs.entry(nonce).or_default();
        for (id, len) in inner.regions.snapshot() {
            // A region being closed left the table already; one whose registration is gone is skipped.
            let Some((base, _)) = mrs.get(&id) else { continue };
            let info = match mine.get(&id) {
                Some((_, i)) => *i,
                None => match ep.reg_remote(*base) {
                    Ok((h, i)) => {
                        mine.insert(id, (h, i));
                        i
                    }
                    Err(e) => {
                        tracing::warn!(target: "kvxfer_fabric", "registering {id} for a connecting peer: {e}");
                        continue;
                    }
                },
            };
            entries.push(RegionMeta { id: id.0, len, key: info.key, base: info.base });
        }
        let min_buf = 4 * (wire::HEADER + toolkit::FRAGMENT_HEADER);
        let buf = self.writer_caps.get(&nonce).map_or(min_buf, |c| c.1.max(min_buf));
        let per = ((buf - wire::HEADER - 4) / wire::KEY_ENTRY).max(1);
        let total = entries.len() as u32;
        let (first, rest) = entries.split_at(entries.len().min(per));
        for chunk in rest.chunks(per) {
            self.queue(to, wire::message(Kind::Keys, self.nonce, nonce, conn, &wire::keys(chunk)));
        }
        self.queue(to, wire::message(Kind::Welcome, self.nonce, nonce, conn, &wire::welcome(total, first)));
    }

    /// Closes the registrations a writer instance was given (its keys are invalid from now on).
    pub(crate) fn drop_writer_mrs(&mut self, nonce: u32) {
        if let Some(m) = self.remote_mrs.remove(&nonce) {
            for (_, (h, _)) in m {
                self.ep.dereg(h);
            }
        }
    }

    /// A peer (`owner`) revoked its region: forget it, and acknowledge once every job that may write
    /// into it is final.
    pub(crate) fn revoked(&mut self, inner: &Inner, owner: u32, seq: u64, region: RegionId, owner_addr: &[u8]) {
        let mut ids = HashSet::new();
        let mut fi_addr = None;
        for (id, p) in inner.peers.all() {
            if p.nonce == owner {
                lock(&p.regions).remove(&region.0);
                ids.insert(id);
                fi_addr = Some(p.fi_addr);
            }
        }
        let Some(fi_addr) = fi_addr.or_else(|| self.insert_addr(owner_addr)) else { return };
        // Transfers into the region cannot complete any more: they stop posting and fail once what
        // they posted completed; the acknowledgement waits for that.
        let mut jobs = Vec::new();
        for (k, j) in self.jobs.iter_mut().filter(|(_, j)| ids.contains(&j.peer) && j.dst.contains(&region)) {
            j.stop(Some(BackendError::UnknownRegion { backend: NAME, region, peer: Some(j.peer) }));
            jobs.push(*k);
        }
        self.acks_due.push(AckDue { fi_addr, dest: owner, seq, jobs });
    }

    /// Sends the revoke of `region` to every peer that said hello; the receiver resolves when all
    /// acknowledged (or were lost). `None` when no peer can write.
    fn revoke(&mut self, region: RegionId) -> Option<oneshot::Receiver<()>> {
        let seq = self.next_seq;
        self.next_seq += 1;
        let body = wire::hello(region.0, self.ep.name());
        let provider = self.ep.info().provider.clone();
        let mut waiting = HashSet::new();
        for (nonce, l) in &self.live {
            let Some(a) = l.fi_addr else { continue };
            if let Some(why) = unreachable(&provider, &l.addr, *nonce, l.pid) {
                tracing::debug!(target: "kvxfer_fabric", "not revoking {region} at identity {:#x}: {why}", l.identity);
                continue;
            }
            waiting.insert(*nonce);
            let msg = wire::message(Kind::Revoke, self.nonce, *nonce, seq, &body);
            self.control.push_back(Control { to: a, msg, since: Instant::now() });
        }
        if waiting.is_empty() {
            return None;
        }
        let (tx, rx) = oneshot::channel();
        self.revokes.insert(seq, RevokeWait { region, waiting, done: Some(tx) });
        Some(rx)
    }

    /// A writer is gone (bye, gone, silent): it acknowledges nothing any more and writes nothing.
    pub(crate) fn writer_gone(&mut self, nonce: u32) {
        for w in self.revokes.values_mut() {
            w.waiting.remove(&nonce);
        }
        self.resolve_revokes();
    }

    pub(crate) fn resolve_revokes(&mut self) {
        self.revokes.retain(|_, w| {
            if w.waiting.is_empty() {
                if let Some(tx) = w.done.take() {
                    let _ = tx.send(());
                }
                false
            } else {
                true
            }
        });
    }
}

/// Closes one registration (see the module docs for the steps).
pub(crate) struct Closer {
    pub(crate) inner: Weak<Inner>,
    pub(crate) id: RegionId,
}

async fn close_region(inner: Weak<Inner>, id: RegionId) -> Result<(), BackendError> {
    // The endpoint is gone: closing it closed (or, for shm, recycled) every registration.
    let Some(inner) = inner.upgrade() else { return Ok(()) };
    let drained = inner.regions.remove(id)?;
    let deadline = tokio::time::Instant::now() + inner.opts.timeout;
    let timeout = |what: String| BackendError::Timeout { backend: NAME, what, after: inner.opts.timeout };
    if tokio::time::timeout_at(deadline, drained.wait()).await.is_err() {
        return Err(timeout(format!("closing {id}: transfers from it still in flight")));
    }
    let rx = {
        let mut st = inner.lock();
        // Take in what already arrived first: a peer whose connect returned has had its hello
        // delivered here, but the progress thread may not have read it yet, and a peer we do not
        // know of would get no revoke.
        st.advance(&inner);
        st.revoke(id)
    };
    inner.wake();
    if let Some(rx) = rx {
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(BackendError::Closed { backend: NAME }),
            Err(_) => return Err(timeout(format!("closing {id}: peers acknowledging its revoke"))),
        }
    }
    let mut st = inner.lock();
    if let Some((mr, _)) = st.mrs.remove(&id) {
        st.ep.dereg(mr);
    }
    let per_peer: Vec<MrHandle> = st.remote_mrs.values_mut().filter_map(|m| m.remove(&id)).map(|(h, _)| h).collect();
    for h in per_peer {
        st.ep.dereg(h);
    }
    Ok(())
}

impl CloseRegistration for Closer {
    fn close(self: Box<Self>) -> BoxFuture<'static, Result<(), BackendError>> {
        Box::pin(close_region(self.inner, self.id))
    }

    fn close_detached(self: Box<Self>) {
        let (id, fut) = (self.id, close_region(self.inner, self.id));
        let report = move |r: Result<(), BackendError>| {
            if let Err(e) = r {
                tracing::warn!(target: "kvxfer_fabric", "closing dropped registration {id}: {e}");
            }
        };
        if let Ok(h) = tokio::runtime::Handle::try_current() {
            h.spawn(async move { report(fut.await) });
            return;
        }
        let spawned = std::thread::Builder::new().name("kvxfer-fabric-close".into()).spawn(move || {
            match tokio::runtime::Builder::new_current_thread().enable_time().build() {
                Ok(rt) => report(rt.block_on(fut)),
                Err(e) => tracing::warn!(target: "kvxfer_fabric", "closing dropped registration {id}: no runtime: {e}"),
            }
        });
        if let Err(e) = spawned {
            tracing::warn!(target: "kvxfer_fabric", "closing dropped registration {id}: no thread: {e}");
        }
    }
}
