//! Regions: revoking a closing region's remote key at every usable peer and waiting for their
//! acknowledgements ([`RevokeWait`]), and closing a registration ([`Closer`]): out of the region
//! table, wait for local operations and the peers' answers, then deregister (`ibv_dereg_mr`).
//! Registering (`register`) is in the trait impl in lib.rs.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvxfer_core::toolkit::Drained;
use kvxfer_core::{BackendError, BoxFuture, CloseRegistration, RegionId};
use tokio::sync::Notify;

use crate::endpoint::{io_err, Inner};
use crate::transfer::lock;
use crate::verbs::Verbs;
use crate::wire::Frame;

/// A closing registration waiting for the peers' acknowledgements of its revoke.
#[derive(Default)]
pub(crate) struct RevokeWait {
    /// Keys of the peers that have not answered yet.
    pub(crate) pending: Mutex<HashSet<u64>>,
    pub(crate) done: Notify,
}

impl RevokeWait {
    pub(crate) fn answered(&self, key: u64) {
        let mut p = lock(&self.pending);
        p.remove(&key);
        if p.is_empty() {
            self.done.notify_waiters();
        }
    }

    async fn wait(&self, deadline: Instant) -> bool {
        loop {
            let mut done = std::pin::pin!(self.done.notified());
            done.as_mut().enable();
            if lock(&self.pending).is_empty() {
                return true;
            }
            if tokio::time::timeout_at(deadline.into(), done).await.is_err() {
                return lock(&self.pending).is_empty();
            }
        }
    }
}

impl<V: Verbs> Inner<V> {
    // ---- registrations ----

    /// Makes region `id` unknown to new operations; returns the drain of the operations holding it.
    fn unregister(&self, id: RegionId) -> Option<Drained> {
        let mut mrs = lock(&self.mrs);
        mrs.remove(&id);
        self.regions.remove(id).ok()
    }

    /// Tells every usable peer to forget region `id`; returns what to wait on for their answers.
    fn revoke(&self, id: RegionId) -> (u64, Arc<RevokeWait>) {
        let seq = self.next_revoke.fetch_add(1, Ordering::Relaxed);
        let wait = Arc::new(RevokeWait::default());
        // Only connections past their handshake: a frame must not land between Hello and Ready. (A
        // peer still in its handshake may hold the key from our Hello; its writes with it fail at the
        // NIC once the region is deregistered.)
        let peers: Vec<_> = self
            .peers
            .all()
            .into_iter()
            .filter(|(_, p)| {
                p.ready.load(Ordering::SeqCst) && !p.closing.load(Ordering::SeqCst) && lock(&p.send).lost.is_none()
            })
            .collect();
        lock(&wait.pending).extend(peers.iter().map(|(_, p)| p.key));
        lock(&self.revokes).insert(seq, wait.clone());
        for (_, p) in peers {
            if let Err(e) = p.send_frame(&Frame::Revoke { seq, region: id.0 }) {
                tracing::debug!(error = %e, peer = %p.label, "revoke not sent; the peer is going away");
                wait.answered(p.key);
            }
        }
        (seq, wait)
    }

    /// A peer is gone: closing registrations stop waiting for its answer.
    pub(crate) fn forget_in_revokes(&self, key: u64) {
        for w in lock(&self.revokes).values() {
            w.answered(key);
        }
    }
}

/// Closes one registration (see [`Registration`](kvxfer_core::Registration)).
pub(crate) struct Closer<V: Verbs> {
    pub(crate) inner: Arc<Inner<V>>,
    pub(crate) id: RegionId,
    pub(crate) mr: Option<Arc<V::Mr>>,
    pub(crate) rt: tokio::runtime::Handle,
}

impl<V: Verbs> Closer<V> {
    /// Remove from the table (new ops fail), tell peers to drop the rkey, wait for local ops and the
    /// peers' answers, then deregister: after `ibv_dereg_mr` the rkey is invalid, so even a peer that
    /// did not answer cannot write into the memory any more (its RDMA WRITE fails at the NIC).
    async fn run(self) -> Result<(), BackendError> {
        let Closer { inner, id, mr, .. } = self;
        let drained = inner.unregister(id);
        let (seq, answers) = inner.revoke(id);
        if let Some(d) = drained {
            d.wait().await;
        }
        let answered = answers.wait(Instant::now() + inner.opts.timeout).await;
        lock(&inner.revokes).remove(&seq);
        if !answered {
            tracing::warn!(region = %id, "not every peer acknowledged the revoke in time; deregistering anyway");
        }
        drop(inner);
        match (mr, tokio::runtime::Handle::try_current()) {
            (Some(mr), Ok(rt)) => {
                rt.spawn_blocking(move || deregister::<V>(mr)).await.map_err(|e| io_err("deregistering", e))?
            }
            (Some(mr), Err(_)) => deregister::<V>(mr),
            (None, _) => {}
        }
        Ok(())
    }
}

/// Drops the last reference of a registration (`ibv_dereg_mr`). Completions release the queue
/// pairs' references just before the transfers end, so this waits a moment at most.
fn deregister<V: Verbs>(mut mr: Arc<V::Mr>) {
    let start = Instant::now();
    loop {
        match Arc::try_unwrap(mr) {
            Ok(m) => return drop(m),
            Err(shared) if start.elapsed() < Duration::from_secs(5) => {
                mr = shared;
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(_) => {
                tracing::warn!("a registration is still referenced after 5 s; it is deregistered when released");
                return;
            }
        }
    }
}

impl<V: Verbs> CloseRegistration for Closer<V> {
    fn close(self: Box<Self>) -> BoxFuture<'static, Result<(), BackendError>> {
        Box::pin(self.run())
    }

    fn close_detached(self: Box<Self>) {
        let rt = self.rt.clone();
        rt.spawn(async move {
            if let Err(e) = self.run().await {
                tracing::warn!(error = %e, "closing a dropped registration");
            }
        });
    }
}
