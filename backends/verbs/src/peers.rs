//! Peers: connection setup (a [`Half`]'s queue pair, ring and receive buffers, the hellos, RTR and
//! RTS, the peer table), connecting (`dial`) and the handshake listener with the authentication
//! exchange (open, challenge, auth), the per-peer side channel (credits, revokes, goodbye), losing,
//! refusing and cutting a peer off, and the socket deadline helpers the handshakes use.

use std::io::{ErrorKind, Read};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvxfer_core::toolkit::{Fragmenter, Reassembler};
use kvxfer_core::{BackendError, BackendEvent, HostBuffer, MemDesc, Notification, PeerId};
use tokio::sync::Notify;

use crate::attrs::{self, RemoteQp};
use crate::endpoint::{io_err, Inner};
use crate::limits::{LimitRefusal, Slot};
use crate::ring::{self, RingRx, RingTx};
use crate::transfer::{lock, Peer, RecvState, SendState, WrLimits, OOB_FRAGS};
use crate::verbs::{Access, CompletionQueue, MemoryRegion, QpCaps, QueuePair, Verbs};
use crate::wire::{self, Address, Challenge, Frame, Hello, Open, RemoteRegion, PROTO_VERSION};
use crate::NAME;

/// Region id the notification ring is announced under (informative only).
const RING_REGION: u32 = u32::MAX;
/// Incomplete notifications a connection keeps while reassembling.
const MAX_PENDING_NOTIFICATIONS: usize = 64;

/// What every authentication refusal tells the operator to do.
const AUTH_FIX: &str = "configure the same cluster secret (KVXFER_SECRET or a secret file) on every rank";

/// Half of a connection: local resources before the peer's Hello is known.
struct Half<V: Verbs> {
    qp: V::Qp,
    key: u64,
    /// Send queue depth the send CQ was sized for (the device may grant a deeper queue; we use no more).
    sq: u32,
    psn: u32,
    send_cq: Arc<V::Cq>,
    recv_cq: Arc<V::Cq>,
    ring_mr: Arc<V::Mr>,
    ring_mem: MemDesc,
    recv_mr: Arc<V::Mr>,
    recv_mem: MemDesc,
    recv_count: u32,
}

impl<V: Verbs> Inner<V> {
    // ---- connection setup ----

    /// Creates the CQs, the QP (moved to INIT), the ring and the receive buffers (all posted).
    fn new_half(&self) -> Result<Half<V>, BackendError> {
        let o = &self.opts;
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        let max_wr = self.caps.max_qp_wr.max(4);
        let sq = o.sq_depth.min(max_wr);
        let recv_count = (o.ring_slots + OOB_FRAGS as u32 + 8).min(max_wr);
        let cq_max = self.caps.max_cqe.max(8);
        let send_cq = V::Cq::create(&self.ctx, &self.channel, (sq + 8).min(cq_max), key << 1)?;
        let recv_cq = V::Cq::create(&self.ctx, &self.channel, (recv_count + 8).min(cq_max), (key << 1) | 1)?;
        let want = QpCaps {
            max_send_wr: sq,
            max_recv_wr: recv_count,
            max_send_sge: o.max_sge.min(self.caps.max_sge.max(1)),
            max_inline: o.max_inline,
        };
        let qp = V::Qp::create(&self.pd, &send_cq, &recv_cq, want)?;
        let (a, m) = attrs::init(&self.local_port);
        qp.modify(&a, m, "RESET to INIT")?;
        let ring_mem = HostBuffer::zeroed((o.ring_slots * o.slot_size) as usize).desc();
        let ring_mr = Arc::new(V::Mr::register(&self.pd, ring_mem.clone(), Access::RemoteWrite)?);
        let recv_mem = HostBuffer::zeroed(recv_count as usize * o.recv_buf as usize).desc();
        let recv_mr = Arc::new(V::Mr::register(&self.pd, recv_mem.clone(), Access::Local)?);
        for i in 0..recv_count {
            qp.post_recv(u64::from(i), &recv_mr, u64::from(i) * u64::from(o.recv_buf), o.recv_buf)?;
        }
        let psn = rand::random::<u32>() & 0x00ff_ffff;
        Ok(Half { qp, key, sq, psn, send_cq, recv_cq, ring_mr, ring_mem, recv_mr, recv_mem, recv_count })
    }

    fn hello(&self, half: &Half<V>) -> Hello {
        let regions = lock(&self.mrs)
            .iter()
            .map(|(id, mr)| match mr {
                Some(mr) => RemoteRegion { id: id.0, addr: mr.addr(), len: mr.len() as u64, rkey: mr.rkey() },
                None => RemoteRegion { id: id.0, addr: 0, len: 0, rkey: 0 },
            })
            .collect();
        Hello {
            version: PROTO_VERSION,
            identity: self.identity,
            qp_num: half.qp.qp_num(),
            psn: half.psn,
            lid: self.port.lid,
            gid: self.gid,
            link_layer: self.port.link_layer,
            mtu: self.port.active_mtu,
            ring: RemoteRegion {
                id: RING_REGION,
                addr: half.ring_mr.addr(),
                len: half.ring_mr.len() as u64,
                rkey: half.ring_mr.rkey(),
            },
            ring_slots: self.opts.ring_slots,
            slot_size: self.opts.slot_size,
            recv_buf: self.opts.recv_buf,
            regions,
        }
    }

    /// Moves the QP to RTR and RTS towards `remote` and adds the peer (completions find it from now
    /// on; the caller publishes it or takes it back).
    fn finish(
        &self,
        half: Half<V>,
        remote: Hello,
        instance: u64,
        tcp: TcpStream,
        label: String,
    ) -> Result<Arc<Peer<V>>, BackendError> {
        if let Some(why) = self.cut_refusal(remote.identity, instance) {
            return Err(BackendError::Connect { backend: NAME, peer: label, detail: why });
        }
        let rq = RemoteQp { qp_num: remote.qp_num, psn: remote.psn, lid: remote.lid, gid: remote.gid, mtu: remote.mtu };
        let (a, m) = attrs::rtr(&self.local_port, &rq, &self.timing);
        half.qp.modify(&a, m, &format!("INIT to RTR towards {label}"))?;
        let (a, m) = attrs::rts(half.psn, &self.timing);
        half.qp.modify(&a, m, &format!("RTR to RTS towards {label}"))?;
        let stage_len = remote.ring_slots as usize * remote.slot_size as usize + OOB_FRAGS * remote.recv_buf as usize;
        let stage_mem = HostBuffer::zeroed(stage_len).desc();
        let stage_mr = Arc::new(V::Mr::register(&self.pd, stage_mem.clone(), Access::Local)?);
        let caps = half.qp.caps();
        let limits = WrLimits {
            max_sge: caps.max_send_sge.max(1) as usize,
            max_msg: if self.port.max_msg_sz == 0 { 1 << 30 } else { u64::from(self.port.max_msg_sz) },
            max_inline: caps.max_inline,
        };
        let sq_depth = caps.max_send_wr.min(half.sq).max(1);
        let id = self.peers.reserve();
        let peer = Peer {
            id,
            key: half.key,
            identity: remote.identity,
            instance,
            refused: AtomicBool::new(false),
            label,
            send_cq: half.send_cq,
            recv_cq: half.recv_cq,
            _ring_mr: half.ring_mr,
            ring_mem: half.ring_mem,
            recv_mr: half.recv_mr,
            recv_mem: half.recv_mem,
            recv_count: half.recv_count,
            recv_size: self.opts.recv_buf,
            stage_mr,
            stage_mem,
            remote_regions: Mutex::new(remote.regions.iter().map(|r| (r.id, *r)).collect()),
            limits,
            sq_depth,
            signal_every: self.opts.signal_every.min(sq_depth / 2).max(1),
            ring_frag: Fragmenter::new(remote.slot_size as usize),
            oob_frag: Fragmenter::new(remote.recv_buf as usize),
            send: Mutex::new(SendState::new(RingTx::new(remote.ring_slots, remote.slot_size))),
            recv: Mutex::new(RecvState {
                ring: RingRx::new(self.opts.ring_slots, self.opts.slot_size),
                reasm: Reassembler::new(ring::MAX_MESSAGE, MAX_PENDING_NOTIFICATIONS),
            }),
            remote,
            idle: Notify::new(),
            oob_lock: tokio::sync::Mutex::new(()),
            tcp: Mutex::new(tcp),
            ready: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            qp: half.qp,
        };
        {
            // Under the cut-off lock: a cut-off of this instance either finds the connection in the
            // table or is seen here.
            let cut = lock(&self.cut);
            if cut.contains(&(peer.identity, instance)) {
                drop(cut);
                let (a, m) = attrs::error();
                let _ = <V::Qp as QueuePair<V>>::modify(&peer.qp, &a, m, "to ERR: cut off during its handshake");
                return Err(BackendError::Connect {
                    backend: NAME,
                    peer: peer.label.clone(),
                    detail: cut_refusal(peer.identity, instance),
                });
            }
            self.peers.insert_at(id, peer);
        }
        let peer = self.peers.get(id)?;
        lock(&self.by_key).insert(half.key, peer.clone());
        Ok(peer)
    }

    /// Takes back a peer whose handshake did not complete.
    fn withdraw(&self, peer: &Arc<Peer<V>>) {
        let _ = self.peers.remove(peer.id);
        self.forget_key(peer);
    }

    fn publish(self: &Arc<Self>, peer: Arc<Peer<V>>, reader: TcpStream) -> PeerId {
        let id = peer.id;
        peer.ready.store(true, Ordering::SeqCst);
        let inner = self.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("kvxfer-verbs-peer{}", id.0))
            .spawn(move || inner.side_channel_loop(peer, reader));
        if let Err(e) = spawned {
            tracing::error!(error = %e, "could not start a side-channel thread; peer loss will only show on send errors");
        }
        id
    }

    pub(crate) fn forget_key(&self, peer: &Arc<Peer<V>>) {
        lock(&self.by_key).remove(&peer.key);
    }

    /// Connecting side of the handshake (blocking; run in `spawn_blocking`): the authentication
    /// exchange, then the hellos, then ready.
    pub(crate) fn dial(self: &Arc<Self>, addr: Address, expected_identity: u64) -> Result<PeerId, BackendError> {
        let deadline = Instant::now() + self.opts.timeout;
        let target: SocketAddr = addr.handshake.parse().map_err(|_| BackendError::BadMetadata {
            backend: NAME,
            detail: format!("handshake address {:?}", addr.handshake),
        })?;
        let label = format!("identity {expected_identity} at {target}");
        let conn_err = |detail: String| BackendError::Connect { backend: NAME, peer: label.clone(), detail };
        let mut s = TcpStream::connect_timeout(&target, self.opts.timeout)
            .map_err(|e| conn_err(format!("TCP connect to the handshake listener: {e}")))?;
        let _ = s.set_nodelay(true);
        set_deadline(&s, deadline).map_err(|e| conn_err(e.to_string()))?;
        let instance = self.authenticate(&mut s, expected_identity).map_err(conn_err)?;
        let half = self.new_half()?;
        Frame::Hello(self.hello(&half)).write_to(&mut s).map_err(|e| conn_err(format!("sending hello: {e}")))?;
        let remote =
            match Frame::read_from(&mut s).map_err(|e| conn_err(format!("waiting for the peer's hello: {e}")))? {
                Frame::Hello(h) => h,
                Frame::Reject(r) => return Err(conn_err(format!("the peer refused: {r}"))),
                f => return Err(conn_err(format!("expected a hello, got {f:?}"))),
            };
        remote.validate(self.port.link_layer).map_err(|e| BackendError::BadMetadata { backend: NAME, detail: e })?;
        if remote.identity != expected_identity {
            return Err(conn_err(format!(
                "the metadata names identity {expected_identity} but the endpoint answered as {}",
                remote.identity
            )));
        }
        let reader = s.try_clone().map_err(|e| conn_err(format!("cloning the side channel: {e}")))?;
        let tcp = s.try_clone().map_err(|e| conn_err(e.to_string()))?;
        let peer = self.finish(half, remote, instance, tcp, label.clone())?;
        if let Err(e) = Frame::Ready.write_to(&mut s) {
            self.withdraw(&peer);
            return Err(conn_err(format!("sending ready: {e}")));
        }
        // The acceptor's Ready: it counts us as a peer now, so a region it closes from here on is
        // revoked at us (returning before it, a close right after `connect` could resolve while
        // our first writes were still landing).
        match Frame::read_from(&mut s) {
            Ok(Frame::Ready) => {}
            Ok(Frame::Reject(r)) => {
                self.withdraw(&peer);
                return Err(conn_err(format!("the peer refused: {r}")));
            }
            Ok(f) => {
                self.withdraw(&peer);
                return Err(conn_err(format!("expected the peer's ready, got {f:?}")));
            }
            Err(e) => {
                self.withdraw(&peer);
                return Err(conn_err(format!("waiting for the peer's ready: {e}")));
            }
        }
        clear_deadline(&s);
        Ok(self.publish(peer, reader))
    }

    /// The connector's part of the exchange (open, challenge, auth); returns the acceptor's instance.
    /// A refusal is told to the acceptor (so it stops waiting) and returned with what to do.
    fn authenticate(&self, s: &mut TcpStream, expected_identity: u64) -> Result<u64, String> {
        let nonce = kvxfer_core::secret::nonce().map_err(|e| format!("drawing a challenge nonce: {e}"))?;
        let open = Open { version: PROTO_VERSION, identity: self.identity, instance: self.instance, nonce };
        Frame::Open(open.clone()).write_to(s).map_err(|e| format!("sending open: {e}"))?;
        let challenge = match Frame::read_bounded(s, wire::MAX_AUTH_FRAME)
            .map_err(|e| format!("waiting for the peer's challenge: {e}"))?
        {
            Frame::Challenge(c) => c,
            Frame::Reject(r) => return Err(format!("the peer refused: {r}")),
            f => return Err(format!("expected a challenge, got {f:?}")),
        };
        let refuse = |s: &mut TcpStream, why: String| {
            let _ = Frame::Reject(why.clone()).write_to(s);
            Err(why)
        };
        if challenge.identity != expected_identity {
            let why = format!(
                "the metadata names identity {expected_identity} but the endpoint answered as {}",
                challenge.identity
            );
            return refuse(s, why);
        }
        if lock(&self.refused).contains(&(challenge.identity, challenge.instance)) {
            return refuse(s, "this endpoint refused the peer after a forged notification".to_owned());
        }
        if let Some(why) = self.cut_refusal(challenge.identity, challenge.instance) {
            return refuse(s, why);
        }
        let x = wire::exchange(&open, &challenge);
        let proof = match (&self.secret, &challenge.proof) {
            (None, None) => None,
            (Some(secret), Some(p)) if x.verify_acceptor(secret, p) => Some(x.connector_proof(secret)),
            (Some(_), Some(_)) => {
                let why = "authentication failed: the peer did not prove this endpoint's cluster secret (the secrets \
                           differ)";
                return refuse(s, format!("{why}; {AUTH_FIX}"));
            }
            (None, Some(_)) => {
                let why = "authentication required: the peer has a cluster secret and this endpoint none";
                return refuse(s, format!("{why}; {AUTH_FIX}"));
            }
            (Some(_), None) => {
                let why = "authentication failed: the peer has no cluster secret and cannot prove one";
                return refuse(s, format!("{why}; {AUTH_FIX}"));
            }
        };
        Frame::Auth(proof).write_to(s).map_err(|e| format!("sending auth: {e}"))?;
        Ok(challenge.instance)
    }

    pub(crate) fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        while !self.shutdown.load(Ordering::SeqCst) {
            match listener.accept() {
                Ok((stream, from)) => match self.limits.admit(from.ip()) {
                    Ok(slot) => {
                        let inner = self.clone();
                        let spawned = std::thread::Builder::new()
                            .name("kvxfer-verbs-hs".into())
                            .spawn(move || inner.serve_handshake(stream, from, slot));
                        if let Err(e) = spawned {
                            tracing::warn!(error = %e, %from, "could not start a handshake thread");
                        }
                    }
                    Err(why) => self.refuse_at_limit(stream, from, why),
                },
                Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "handshake accept failed");
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }

    /// Answers a connection beyond a limit at once with a `Reject` naming it, on the listener's
    /// thread (a fresh socket's send buffer takes the frame whole; the write is bounded anyway), and
    /// closes it. The write side is shut first, so the connector sees the refusal and then an end of
    /// stream (a FIN) even if its own bytes arrive later and the close turns into a reset; what it
    /// already sent is read off before the close (seen in CI: without the shutdown, an open that
    /// landed between the drain and the close made the close a bare reset).
    fn refuse_at_limit(&self, mut stream: TcpStream, from: SocketAddr, why: LimitRefusal) {
        self.counters.refusals.limit(&why);
        tracing::warn!(%from, reason = %why, "handshake connection refused at a limit");
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
        let _ = Frame::Reject(why.to_string()).write_to(&mut stream);
        let _ = stream.shutdown(Shutdown::Write);
        if stream.set_nonblocking(true).is_ok() {
            let mut sink = [0u8; 4096];
            for _ in 0..4 {
                if !matches!(stream.read(&mut sink), Ok(n) if n > 0) {
                    break;
                }
            }
        }
    }

    /// Listening side of the handshake, then the connection's side-channel loop. `slot` is the
    /// connection's place among those not authenticated yet, given back once it authenticated.
    fn serve_handshake(self: Arc<Self>, stream: TcpStream, from: SocketAddr, slot: Slot) {
        let accepted = Instant::now();
        let deadline = accepted + self.opts.timeout;
        let unauthenticated = accepted + self.opts.handshake_timeout.min(self.opts.timeout);
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_nodelay(true);
        if let Err(e) = set_deadline(&stream, unauthenticated) {
            tracing::warn!(error = %e, %from, "handshake socket setup failed");
            return;
        }
        let mut s = stream;
        let open = self.challenge(&mut s, from, unauthenticated);
        drop(slot);
        let Some(open) = open else { return };
        if let Err(e) = set_deadline(&s, deadline) {
            tracing::warn!(error = %e, %from, "handshake socket setup failed");
            return;
        }
        let remote = match Frame::read_from(&mut s) {
            Ok(Frame::Hello(h)) if h.identity == open.identity => h,
            Ok(Frame::Hello(h)) => {
                let why = format!(
                    "the hello names identity {} but the connection authenticated as {}",
                    h.identity, open.identity
                );
                let _ = Frame::Reject(why).write_to(&mut s);
                return;
            }
            Ok(f) => {
                tracing::warn!(%from, frame = ?f, "expected the peer's hello after its authentication");
                return;
            }
            Err(e) => {
                tracing::warn!(%from, error = %e, "handshake read failed");
                return;
            }
        };
        if let Err(e) = remote.validate(self.port.link_layer) {
            let _ = Frame::Reject(e).write_to(&mut s);
            return;
        }
        let label = format!("identity {} at {from}", remote.identity);
        let setup = |s: &mut TcpStream| -> Result<(Arc<Peer<V>>, TcpStream), BackendError> {
            let half = self.new_half()?;
            let hello = self.hello(&half);
            let writer = s.try_clone().map_err(|e| io_err("cloning the side channel", e))?;
            let reader = s.try_clone().map_err(|e| io_err("cloning the side channel", e))?;
            let peer = self.finish(half, remote, open.instance, writer, label.clone())?;
            // Our QP is in RTS before the peer learns its number; the peer sends nothing before it is
            // in RTS itself, and we send nothing before its Ready.
            if let Err(e) = Frame::Hello(hello).write_to(s) {
                self.withdraw(&peer);
                return Err(io_err("sending hello", e));
            }
            Ok((peer, reader))
        };
        let (peer, reader) = match setup(&mut s) {
            Ok(x) => x,
            Err(e) => {
                let _ = Frame::Reject(e.to_string()).write_to(&mut s);
                tracing::warn!(%from, error = %e, "handshake failed");
                return;
            }
        };
        match Frame::read_from(&mut s) {
            Ok(Frame::Ready) => {}
            other => {
                tracing::warn!(%from, result = ?other.map(|f| format!("{f:?}")), "peer did not confirm the connection");
                self.withdraw(&peer);
                return;
            }
        }
        // Our Ready. The peer is marked ready first, under the side channel's writer lock: a revoke
        // that sees it not ready started before the connector could read this Ready (so before its
        // `connect` returned); one that sees it ready queues its frame on the writer lock, after
        // this Ready. (Marked after the write, a close right after `connect` returned could find the
        // peer not ready yet and resolve while its first writes were still landing: seen under load.)
        let confirmed = {
            let mut w = lock(&peer.tcp);
            peer.ready.store(true, Ordering::SeqCst);
            let r = Frame::Ready.write_to(&mut *w);
            if r.is_err() {
                peer.ready.store(false, Ordering::SeqCst);
            }
            r
        };
        if let Err(e) = confirmed {
            tracing::warn!(%from, error = %e, "could not confirm the connection");
            self.withdraw(&peer);
            return;
        }
        clear_deadline(&s);
        self.publish(peer, reader);
    }

    /// The acceptor's part of the exchange: reads the open, answers the challenge, checks the
    /// connector's proof. Returns the open once the connector may go on (with a secret: proved it);
    /// `None` when the connection was refused (told to the connector with the reason) or dropped.
    /// Every read is bounded by `until` as a whole (see [`Until`]); one cut off by it is counted.
    fn challenge(&self, s: &mut TcpStream, from: SocketAddr, until: Instant) -> Option<Open> {
        let refusals = &self.counters.refusals;
        let refuse = |s: &mut TcpStream, why: String| {
            refusals.rejected.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%from, reason = %why, "connection refused");
            let _ = Frame::Reject(why).write_to(s);
            None
        };
        let timed_out = |e: &std::io::Error| {
            if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
                refusals.timed_out.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    %from,
                    "not authenticated within {:?} (handshake_timeout_ms); closing",
                    self.opts.handshake_timeout.min(self.opts.timeout)
                );
                true
            } else {
                false
            }
        };
        let open = match Frame::read_bounded(&mut Until { s, deadline: until }, wire::MAX_AUTH_FRAME) {
            Ok(Frame::Open(o)) => o,
            Ok(Frame::Hello(_)) => {
                let why = format!(
                    "the peer started with a hello: this endpoint speaks verbs handshake version {PROTO_VERSION}, \
                     which starts with the authentication exchange (run the same kvxfer build on every rank)"
                );
                return refuse(s, why);
            }
            Ok(f) => {
                tracing::warn!(%from, frame = ?f, "handshake did not start with an open");
                return None;
            }
            Err(e) => {
                if !timed_out(&e) {
                    tracing::warn!(%from, error = %e, "handshake read failed");
                }
                return None;
            }
        };
        if open.version != PROTO_VERSION {
            return refuse(s, format!("handshake version {} (this build speaks {PROTO_VERSION})", open.version));
        }
        if lock(&self.refused).contains(&(open.identity, open.instance)) {
            let why = format!(
                "this endpoint refused identity {:#x} (this instance of it) after a forged notification",
                open.identity
            );
            return refuse(s, why);
        }
        if let Some(why) = self.cut_refusal(open.identity, open.instance) {
            return refuse(s, why);
        }
        let nonce = match kvxfer_core::secret::nonce() {
            Ok(n) => n,
            Err(e) => return refuse(s, format!("the accepting endpoint could not draw a challenge nonce: {e}")),
        };
        let mut challenge = Challenge { identity: self.identity, instance: self.instance, nonce, proof: None };
        let x = wire::exchange(&open, &challenge);
        challenge.proof = self.secret.as_ref().map(|secret| x.acceptor_proof(secret));
        if let Err(e) = Frame::Challenge(challenge).write_to(s) {
            tracing::warn!(%from, error = %e, "sending the challenge failed");
            return None;
        }
        let proof = match Frame::read_bounded(&mut Until { s, deadline: until }, wire::MAX_AUTH_FRAME) {
            Ok(Frame::Auth(p)) => p,
            Ok(Frame::Reject(r)) => {
                tracing::info!(%from, reason = %r, "the connecting endpoint gave up the connection");
                return None;
            }
            Ok(f) => {
                tracing::warn!(%from, frame = ?f, "expected the peer's auth");
                return None;
            }
            Err(e) => {
                if !timed_out(&e) {
                    tracing::warn!(%from, error = %e, "waiting for the peer's auth failed");
                }
                return None;
            }
        };
        match (&self.secret, proof) {
            // Without a secret nothing is checked (a connector with one refused our challenge).
            (None, _) => Some(open),
            (Some(secret), Some(p)) if x.verify_connector(secret, &p) => Some(open),
            (Some(_), _) => {
                let why = format!(
                    "authentication failed: the connecting endpoint (identity {:#x}) did not prove this endpoint's \
                     cluster secret; {AUTH_FIX}",
                    open.identity
                );
                refuse(s, why)
            }
        }
    }

    // ---- side channel ----

    fn side_channel_loop(self: Arc<Self>, peer: Arc<Peer<V>>, mut reader: TcpStream) {
        let _ = reader.set_read_timeout(Some(Duration::from_millis(200)));
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        let reason = loop {
            if self.shutdown.load(Ordering::SeqCst) || peer.closing.load(Ordering::SeqCst) {
                return;
            }
            match reader.read(&mut chunk) {
                Ok(0) => {
                    break "the side channel was closed (the peer process exited or dropped its endpoint)".to_string()
                }
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {
                    continue
                }
                Err(e) => break format!("the side channel failed: {e}"),
            }
            let stop = loop {
                match crate::wire::take_frame(&mut buf) {
                    Ok(None) => break None,
                    Ok(Some(Frame::Credit(n))) => {
                        let r = peer.with_send(|st| {
                            let r = st.ring.credit(n);
                            peer.pump(st);
                            r
                        });
                        if let Err(e) = r {
                            break Some(format!("protocol violation: {e}"));
                        }
                    }
                    Ok(Some(Frame::Revoke { seq, region })) => peer.revoke(seq, region),
                    Ok(Some(Frame::RevokeAck(seq))) => {
                        if let Some(w) = lock(&self.revokes).get(&seq) {
                            w.answered(peer.key);
                        }
                    }
                    Ok(Some(Frame::Bye(r))) => break Some(format!("the peer disconnected: {r}")),
                    Ok(Some(f)) => break Some(format!("protocol violation: unexpected {f:?} on the side channel")),
                    Err(e) => break Some(format!("protocol violation on the side channel: {e}")),
                }
            };
            if let Some(r) = stop {
                break r;
            }
        };
        self.lose(&peer, reason);
    }

    /// Marks a peer lost (once), flushes its QP and reports it. Posted requests end with the flush;
    /// queued ones fail at once.
    pub(crate) fn lose(&self, peer: &Arc<Peer<V>>, reason: String) {
        if peer.closing.load(Ordering::SeqCst) {
            return;
        }
        let first = peer.with_send(|st| {
            if st.lost.is_some() {
                return false;
            }
            st.lost = Some(reason.clone());
            peer.fail_unposted(st);
            true
        });
        if !first {
            return;
        }
        let (a, m) = attrs::error();
        if let Err(e) = peer.qp.modify(&a, m, "to ERR after losing the peer") {
            tracing::warn!(error = %e, peer = %peer.label, "could not flush the queue pair");
        }
        self.forget_in_revokes(peer.key);
        tracing::info!(peer = %peer.label, %reason, "peer lost");
        self.events.push(BackendEvent::PeerLost { identity: peer.identity, reason });
    }

    /// A peer that proved its identity sent a notification keyed with another one: it is not
    /// delivered, counted, the peer is refused for this endpoint's life (this instance of it), its
    /// connection failed and told why, and `PeerLost` names the forged key.
    pub(crate) fn refuse_forged(&self, peer: &Arc<Peer<V>>, n: &Notification) {
        self.counters.forged.fetch_add(1, Ordering::Relaxed);
        peer.refused.store(true, Ordering::SeqCst);
        lock(&self.refused).insert((peer.identity, peer.instance));
        let reason = format!(
            "forged notification refused: {} proved identity {:#x} but keyed a notification of request {} with \
             sender {} ({:#x}); its connection was closed and it is refused",
            peer.label,
            peer.identity,
            n.request,
            n.sender,
            n.sender.to_u64()
        );
        tracing::warn!(peer = %peer.label, "{reason}");
        self.lose(peer, reason.clone());
        let _ = peer.send_frame(&Frame::Bye(reason));
        let _ = lock(&peer.tcp).shutdown(Shutdown::Both);
    }

    /// Why a handshake with (`identity`, `instance`) is refused: this endpoint cut that instance off.
    fn cut_refusal(&self, identity: u64, instance: u64) -> Option<String> {
        lock(&self.cut).contains(&(identity, instance)).then(|| cut_refusal(identity, instance))
    }

    /// Cuts one connection of a cut-off instance: its QP to ERR (from the `ibv_modify_qp`'s return
    /// on, the NIC places none of the writes that arrive on it), its side channel shut (no more
    /// frames either way, no goodbye), unposted requests dropped; posted ones end with their flush
    /// completions. No loss is reported: the caller gave up on the peer already. Returns how many
    /// jobs were not final.
    pub(crate) fn cut_peer(&self, peer: &Arc<Peer<V>>, why: &str) -> Result<usize, BackendError> {
        // First: the side-channel loop and `lose` then leave the peer alone.
        peer.closing.store(true, Ordering::SeqCst);
        let (a, m) = attrs::error();
        peer.qp.modify(&a, m, &format!("to ERR: cutting off {}", peer.label))?;
        let jobs = peer.cut(&format!("cut off: {why}"));
        let _ = lock(&peer.tcp).shutdown(Shutdown::Both);
        self.forget_in_revokes(peer.key);
        Ok(jobs)
    }

    /// Tears a connection down from our side: goodbye, flush (posted requests end with their flush
    /// completions), fail what was not posted.
    pub(crate) fn close_peer(&self, peer: &Arc<Peer<V>>, why: &str) {
        if peer.closing.swap(true, Ordering::SeqCst) {
            return;
        }
        let _ = peer.send_frame(&Frame::Bye(why.to_owned()));
        let _ = lock(&peer.tcp).shutdown(Shutdown::Both);
        let (a, m) = attrs::error();
        let _ = peer.qp.modify(&a, m, "to ERR on disconnect");
        peer.with_send(|st| {
            st.lost.get_or_insert_with(|| format!("disconnected locally: {why}"));
            peer.fail_unposted(st);
        });
        self.forget_in_revokes(peer.key);
    }
}

fn cut_refusal(identity: u64, instance: u64) -> String {
    format!(
        "this endpoint cut off identity {identity:#x} instance {instance:#x} (it gave up on that peer); a restarted \
         process is a new instance and may connect"
    )
}

/// Reads from a socket until a deadline however the bytes trickle in: each read waits at most what
/// is left (its receive timeout set anew), and none starts once the deadline passed.
struct Until<'a> {
    s: &'a mut TcpStream,
    deadline: Instant,
}

impl Read for Until<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(ErrorKind::TimedOut, "the handshake deadline passed"));
        }
        self.s.set_read_timeout(Some(left))?;
        self.s.read(buf)
    }
}

fn set_deadline(s: &TcpStream, deadline: Instant) -> std::io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    s.set_read_timeout(Some(left))?;
    s.set_write_timeout(Some(left))
}

fn clear_deadline(s: &TcpStream) {
    let _ = s.set_read_timeout(None);
    let _ = s.set_write_timeout(Some(Duration::from_secs(5)));
}
