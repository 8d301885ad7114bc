//! Progress: posting (`post` validates and queues one job of RDMA WRITEs and ring fragments on the
//! peer; `notify` sends out-of-band SENDs in rounds) and the poller thread that drives completions:
//! it drains the CQ that fired, settles transfers and turns receive completions into events.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::{BackendError, BackendEvent, Notification, PeerId, Transfer, TransferState, TransferStatus, WriteOp};

use crate::endpoint::Inner;
use crate::transfer::{
    lock, plan_writes, Aborter, Job, Peer, Pending, RecvState, WrDesc, OOB_FRAGS, RING_SOURCE, SEND_SOURCE,
};
use crate::verbs::{
    Completion, CompletionQueue, CqEvent, EventChannel, LocalSge, MemoryRegion, QueuePair, SendKind, SendWr, Verbs,
};
use crate::wire::{Frame, RemoteRegion};
use crate::NAME;

/// `ibv_wc_status` WR_FLUSH_ERR.
const WC_WR_FLUSH_ERR: u32 = 5;

impl<V: Verbs> Inner<V> {
    // ---- completions ----

    pub(crate) fn poll_loop(self: Arc<Self>) {
        let mut wcs = Vec::with_capacity(64);
        while !self.shutdown.load(Ordering::SeqCst) {
            let ev = match self.channel.next_event(Duration::from_millis(100)) {
                Ok(Some(ev)) => ev,
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "completion channel");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            let key = ev.key();
            // Look the owner up before acknowledging (see CqEvent).
            let peer = lock(&self.by_key).get(&(key >> 1)).cloned();
            drop(ev);
            let Some(peer) = peer else { continue };
            let is_recv = key & 1 == 1;
            let cq = if is_recv { &peer.recv_cq } else { &peer.send_cq };
            if let Err(e) = cq.arm() {
                tracing::warn!(error = %e, peer = %peer.label, "re-arming a completion queue");
            }
            loop {
                wcs.clear();
                match cq.poll(&mut wcs, 64) {
                    Ok(0) => break,
                    Ok(_) => {
                        for c in &wcs {
                            if is_recv {
                                self.on_recv(&peer, c);
                            } else {
                                peer.on_send(c);
                            }
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, peer = %peer.label, "polling a completion queue");
                        break;
                    }
                }
            }
        }
    }

    fn on_recv(&self, peer: &Arc<Peer<V>>, c: &Completion) {
        if !c.ok() {
            if c.status != WC_WR_FLUSH_ERR {
                self.lose(peer, format!("receive completion error: {} (status {})", V::status_str(c.status), c.status));
            }
            return;
        }
        let idx = c.wr_id;
        let now = Instant::now();
        let outcome: Result<Option<Vec<u8>>, String> = if c.is_recv_imm() {
            let mut rs = lock(&peer.recv);
            let RecvState { ring, reasm } = &mut *rs;
            let r = match ring.accept(c.imm.unwrap_or(0), c.byte_len) {
                Ok(f) => match peer.ring_mem.read_guard(f.offset, f.len as u64) {
                    Ok(g) => reasm.push(RING_SOURCE, g.as_slice(), now).map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                },
                Err(e) => Err(e.0),
            };
            let credit = ring.credit_due();
            drop(rs);
            if let Some(n) = credit {
                if let Err(e) = peer.send_frame(&Frame::Credit(n)) {
                    tracing::debug!(error = %e, peer = %peer.label, "credit report not sent");
                }
            }
            r
        } else if c.is_recv_send() {
            let len = u64::from(c.byte_len.min(peer.recv_size));
            match peer.recv_mem.read_guard(idx * u64::from(peer.recv_size), len) {
                Ok(g) => lock(&peer.recv).reasm.push(SEND_SOURCE, g.as_slice(), now).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            }
        } else {
            Err(format!("unexpected receive completion opcode {}", c.opcode))
        };
        if idx < u64::from(peer.recv_count) {
            let off = idx * u64::from(peer.recv_size);
            if let Err(e) = peer.qp.post_recv(idx, &peer.recv_mr, off, peer.recv_size) {
                self.lose(peer, format!("reposting a receive buffer failed: {e}"));
                return;
            }
        }
        match outcome {
            Ok(None) => {}
            Ok(Some(_)) if peer.refused.load(Ordering::SeqCst) => {}
            Ok(Some(msg)) => match Notification::decode(&msg) {
                Ok(n) if self.secret.is_some() && !n.is_from(peer.identity) => self.refuse_forged(peer, &n),
                Ok(n) => self.events.push(BackendEvent::Notification(n)),
                Err(e) => tracing::warn!(error = %e, peer = %peer.label, "dropping an undecodable notification"),
            },
            Err(e) => self.lose(peer, format!("protocol violation: {e}")),
        }
    }

    // ---- posting ----

    pub(crate) fn post(
        &self,
        peer_id: PeerId,
        ops: &[WriteOp],
        notify: Option<&Notification>,
    ) -> Result<Transfer, BackendError> {
        self.closed()?;
        let peer = self.peers.get(peer_id)?;
        let encoded =
            notify.map(|n| n.encode()).transpose().map_err(|source| BackendError::Codec { backend: NAME, source })?;
        let note_len = encoded.as_ref().map_or(0, Vec::len);
        self.capabilities.check_post(NAME, ops.len(), note_len)?;
        if note_len > peer.ring_frag.max_message() {
            let limit = peer.ring_frag.max_message() as u64;
            return Err(BackendError::Limit {
                backend: NAME,
                what: "notification bytes",
                asked: note_len as u64,
                limit,
            });
        }
        // Validate everything before anything is queued.
        let mut refs = Vec::new();
        let mut srcs = Vec::with_capacity(ops.len());
        let mut dsts: Vec<RemoteRegion> = Vec::with_capacity(ops.len());
        {
            let mrs = lock(&self.mrs);
            let remote = lock(&peer.remote_regions);
            for op in ops {
                if !refs.iter().any(|r: &kvxfer_core::toolkit::RegionRef| r.id() == op.src) {
                    refs.push(self.regions.get(op.src, None)?);
                }
                let mr = mrs.get(&op.src).ok_or(BackendError::UnknownRegion {
                    backend: NAME,
                    region: op.src,
                    peer: None,
                })?;
                op.check_src(NAME, Some(peer_id), mr.as_ref().map_or(0, |m| m.len() as u64))?;
                let dst = remote.get(&op.dst.0).ok_or(BackendError::UnknownRegion {
                    backend: NAME,
                    region: op.dst,
                    peer: Some(peer_id),
                })?;
                op.check_dst(NAME, Some(peer_id), dst.len)?;
                srcs.push(mr.clone());
                dsts.push(*dst);
            }
        }
        let mut pending = VecDeque::new();
        for p in plan_writes(ops, &peer.limits) {
            let op = &ops[p.op];
            // Plans exist only for non-empty ranges, which the bounds check refuses in an empty region.
            let mr =
                srcs[p.op].as_ref().ok_or(BackendError::UnknownRegion { backend: NAME, region: op.src, peer: None })?;
            let dst = &dsts[p.op];
            let desc = WrDesc::Write {
                bytes: p.len,
                src: op.src,
                src_offset: p.pieces[0].0,
                dst: op.dst,
                dst_offset: p.dst_offset,
            };
            let sges = p.pieces.iter().map(|&(offset, len)| LocalSge { mr: mr.clone(), offset, len }).collect();
            let kind = SendKind::Write { remote_addr: dst.addr + p.dst_offset, rkey: dst.rkey };
            let inline = p.len <= u64::from(peer.limits.max_inline);
            pending.push_back(Pending::Ready(SendWr { wr_id: 0, kind, sges, signaled: false, inline }, desc));
        }
        if let Some(bytes) = &encoded {
            let frags = peer.ring_frag.split(bytes).map_err(|source| BackendError::Codec { backend: NAME, source })?;
            let of = frags.len();
            pending.extend(frags.into_iter().enumerate().map(|(index, bytes)| Pending::Fragment { bytes, index, of }));
        }
        let bytes: u64 = ops.iter().map(WriteOp::bytes).sum();
        if pending.is_empty() {
            return Ok(Transfer::finished(NAME, peer_id, TransferStatus::Done, bytes));
        }
        let mut targets: Vec<u32> = dsts.iter().map(|d| d.id).collect();
        targets.sort_unstable();
        targets.dedup();
        let state = TransferState::new(NAME, peer_id);
        let job = peer.enqueue(Job::new(state.clone(), pending, refs, targets))?;
        Ok(Transfer::new(state, Arc::new(Aborter { peer: Arc::downgrade(&peer), job }), bytes))
    }

    pub(crate) async fn notify(&self, peer_id: PeerId, n: &Notification) -> Result<(), BackendError> {
        self.closed()?;
        let peer = self.peers.get(peer_id)?;
        let bytes = n.encode().map_err(|source| BackendError::Codec { backend: NAME, source })?;
        self.capabilities.check_post(NAME, 0, bytes.len())?;
        let frags = peer.oob_frag.split(&bytes).map_err(|source| BackendError::Codec { backend: NAME, source })?;
        let deadline = Instant::now() + self.opts.timeout;
        let _oob = tokio::time::timeout_at(deadline.into(), peer.oob_lock.lock())
            .await
            .map_err(|_| self.timeout_error(format!("waiting to send to {}", peer.label)))?;
        let of = frags.len();
        for (round_no, round) in frags.chunks(OOB_FRAGS).enumerate() {
            let mut pending = VecDeque::with_capacity(round.len());
            for (j, frag) in round.iter().enumerate() {
                let off = peer.oob_offset() + (j as u64) * u64::from(peer.remote.recv_buf);
                // The previous round's SENDs completed, so the staging area is ours.
                let mut g = peer.stage_mem.write_guard(off, frag.len() as u64).map_err(|e| BackendError::Protocol {
                    backend: NAME,
                    peer: peer.label.clone(),
                    detail: format!("staging a SEND fragment: {e}"),
                })?;
                g.as_mut_slice().copy_from_slice(frag);
                drop(g);
                let wr = SendWr {
                    wr_id: 0,
                    kind: SendKind::Send,
                    sges: vec![LocalSge { mr: peer.stage_mr.clone(), offset: off, len: frag.len() as u32 }],
                    signaled: false,
                    inline: frag.len() as u64 <= u64::from(peer.limits.max_inline),
                };
                pending.push_back(Pending::Ready(wr, WrDesc::Send { index: round_no * OOB_FRAGS + j, of }));
            }
            let state = TransferState::new(NAME, peer_id);
            peer.enqueue(Job::new(state.clone(), pending, Vec::new(), Vec::new()))?;
            match state.settled(deadline).await {
                TransferStatus::Done => {}
                TransferStatus::Failed(e) => return Err(e),
                TransferStatus::Aborted => return Err(BackendError::Aborted { backend: NAME, peer: peer_id }),
                TransferStatus::InFlight => {
                    // The staging area is still in use: nothing may reuse it, so the connection is done.
                    let e = self.timeout_error(format!("an out-of-band notification to {}", peer.label));
                    peer.with_send(|st| {
                        st.failed.get_or_insert(e.clone());
                    });
                    return Err(e);
                }
            }
        }
        Ok(())
    }
}
