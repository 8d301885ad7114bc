//! The `lifecycle` family: a request's whole life through the engine API (SEMANTICS §5-§6) on the
//! backend under test. Every case starts prefill and decode [`Agent`]s in this process (each creates
//! its endpoint through the backend registry, by the name and options
//! [`BackendFactory::agent_backend`] gives), meeting through an in-process bootstrap service on
//! 127.0.0.1, and checks the bytes that landed against the oracle.
//!
//! Prefill page `p` holds the oracle's tokens `p * S ..` (`S` the page size), decode memory the
//! sentinel; a destination page that received source page `p` must hold exactly those tokens, and
//! every other decode byte the sentinel. Distinct uses of the same destination pages send distinct
//! source pages, so a byte of an earlier use shows as a mismatch.
//!
//! - `early_handoff`: a decode handoff that reaches the prefill ranks before their sender exists is
//!   kept (counted) and applied when the engine creates the sender.
//! - `generation_reuse`: a request aborted by decode after its first chunk, released, and the same
//!   room with the same pages handed off again completes under a new generation; after the fence
//!   the pages stay as reset, and at the end they hold only the second use's bytes.
//! - `decode_abort_reuse`: decode aborts mid-request (`Aborting` -> `Failed` with reusable pages);
//!   every prefill rank's status names the decode rank; the pages are reset and reused at once by
//!   another room, which verifies.
//! - `prefill_abort`: a prefill rank aborts; every decode rank it feeds is `Failed` within seconds
//!   (not at the deadline), naming the prefill rank, and nothing lands after.
//! - `release_forgets`: after release no request remains on any agent, and late duplicates of the
//!   released use's notifications (before and after the room is handed off again) never complete
//!   the new use.
//! - `abort_before_connected`: decode aborts a handed-off request while no prefill rank is connected
//!   yet; once they are, the abort reaches them and the request is `Failed` with reusable pages
//!   within seconds; the room is then used again (other pages) and completes.
//! - `hetero_tp_*`: P2 -> D1, P1 -> D2 and P4 -> D2, two chunks, each decode rank with its own pages.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer::bootstrap::BootstrapServer;
use kvxfer::engine::{Agent, AgentConfig, KvMemory, Phase, Receiver, RequestStatus, Sender};
use kvxfer::metadata::MetadataAddr;
use kvxfer_core::oracle::{BufferGeom, SENTINEL};
use kvxfer_core::{KvTransferBackend, Layout, Notification, NotifyStyle, RankId, RequestId, SenderKey, Side, Topology};

use crate::{err, gqa, BackendFactory};

/// Pages of every agent's pool.
const PAGES: u32 = 48;
/// Pages per request (two chunks of half).
const REQ: usize = 8;
/// Each request's deadline on both sides: far above the "within seconds" bounds below.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How soon an abort must reach the other side.
const TOLD_WITHIN: Duration = Duration::from_secs(10);

/// The family's cases, each run once per notification style.
pub(crate) fn cases() -> Vec<(&'static str, crate::CaseFn)> {
    vec![
        ("lifecycle::early_handoff", |f, s| Box::pin(early_handoff(f, s))),
        ("lifecycle::generation_reuse", |f, s| Box::pin(generation_reuse(f, s))),
        ("lifecycle::decode_abort_reuse", |f, s| Box::pin(decode_abort_reuse(f, s))),
        ("lifecycle::prefill_abort", |f, s| Box::pin(prefill_abort(f, s))),
        ("lifecycle::release_forgets", |f, s| Box::pin(release_forgets(f, s))),
        ("lifecycle::abort_before_connected", |f, s| Box::pin(abort_before_connected(f, s))),
        ("lifecycle::hetero_tp_p2_d1", |f, s| Box::pin(hetero_tp(f, s, 2, 1))),
        ("lifecycle::hetero_tp_p1_d2", |f, s| Box::pin(hetero_tp(f, s, 1, 2))),
        ("lifecycle::hetero_tp_p4_d2", |f, s| Box::pin(hetero_tp(f, s, 4, 2))),
    ]
}

/// Why the family cannot run on this factory's backend, if it cannot.
pub(crate) fn skip_reason(f: &dyn BackendFactory) -> Option<String> {
    match f.agent_backend() {
        Some(_) => None,
        None => Some("the factory does not name its registry backend (BackendFactory::agent_backend)".into()),
    }
}

fn deadline(s: u64) -> Instant {
    Instant::now() + Duration::from_secs(s)
}

/// Polls `ok` every 5 ms until it holds, at most `within`.
async fn until(what: &str, within: Duration, ok: impl Fn() -> bool) -> Result<(), String> {
    let end = Instant::now() + within;
    while !ok() {
        if Instant::now() >= end {
            return Err(format!("timed out after {within:?} waiting for {what}"));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

/// Prefill and decode agents of one topology (PP 1), connected through an in-process bootstrap.
struct Cluster {
    topo: Topology,
    /// Every agent's configuration but its role and rank.
    base: AgentConfig,
    /// By TP rank.
    prefill: Vec<Agent>,
    /// By TP rank.
    decode: Vec<Agent>,
    /// Dropped after the agents (fields drop in order).
    _server: BootstrapServer,
}

impl Cluster {
    /// Both sides started, connected, prefill memory filled.
    async fn start(
        f: &dyn BackendFactory,
        p: u32,
        d: u32,
        layout: Layout,
        style: NotifyStyle,
    ) -> Result<Cluster, String> {
        let mut c = Cluster::decode_only(f, p, d, layout, style).await?;
        c.start_prefill().await?;
        Ok(c)
    }

    /// The bootstrap service and the decode ranks only (they stay `Bootstrapping`).
    async fn decode_only(
        f: &dyn BackendFactory,
        p: u32,
        d: u32,
        layout: Layout,
        style: NotifyStyle,
    ) -> Result<Cluster, String> {
        let (backend, options) = f.agent_backend().ok_or("the factory does not name its registry backend")?;
        let topo =
            Topology::new(&gqa(4, 128, 64, 4, 16, layout, p, 1), &gqa(4, 128, 64, 4, 16, layout, d, 1)).map_err(err)?;
        let server = BootstrapServer::start("127.0.0.1:0").await.map_err(err)?;
        let addr = MetadataAddr::parse(&server.addr().to_string()).map_err(err)?;
        let mut base = AgentConfig::new(Side::Decode, RankId::new(0, 0), topo, addr);
        base.backend = backend;
        base.backend_options = options;
        base.notify = style;
        base.connect_timeout = Duration::from_secs(20);
        base.request_timeout = REQUEST_TIMEOUT;
        let mut c = Cluster { topo, base, prefill: Vec::new(), decode: Vec::new(), _server: server };
        for r in topo.ranks(Side::Decode) {
            let a = Agent::start(c.config(Side::Decode, r), KvMemory::Host { pages: PAGES, fill: SENTINEL })
                .await
                .map_err(|e| format!("starting decode rank {r}: {e}"))?;
            c.decode.push(a);
        }
        Ok(c)
    }

    fn config(&self, role: Side, rank: RankId) -> AgentConfig {
        let mut c = self.base.clone();
        c.role = role;
        c.rank = rank;
        c.label = format!("conformance {role} rank {rank}");
        c
    }

    /// Starts the prefill ranks, waits until every rank is connected, fills prefill memory.
    async fn start_prefill(&mut self) -> Result<(), String> {
        for r in self.topo.ranks(Side::Prefill) {
            let a = Agent::start(self.config(Side::Prefill, r), KvMemory::Host { pages: PAGES, fill: 0 })
                .await
                .map_err(|e| format!("starting prefill rank {r}: {e}"))?;
            self.prefill.push(a);
        }
        let by = deadline(30);
        for a in self.prefill.iter().chain(&self.decode) {
            a.wait_connected(by).await.map_err(err)?;
        }
        // Source page p holds the tokens p*S.. of the oracle.
        let s = u64::from(self.topo.kv().page_size);
        for a in &self.prefill {
            for m in a.host_memory() {
                let g = BufferGeom::new(&self.topo, Side::Prefill, a.rank(), m.buffer.layer, m.buffer.kind, PAGES);
                let mut bytes = vec![0u8; m.len() as usize];
                g.fill(&mut bytes, &|p| Some(u64::from(p) * s));
                m.write(0, &bytes).map_err(err)?;
            }
        }
        Ok(())
    }

    fn geom(&self, a: &Agent, m: &kvxfer::session::PoolMemory) -> BufferGeom {
        BufferGeom::new(&self.topo, Side::Decode, a.rank(), m.buffer.layer, m.buffer.kind, PAGES)
    }

    /// Every byte of every decode rank against the oracle: `want[k]` maps decode rank k's destination
    /// pages to the source page they must hold; every other byte holds the sentinel.
    fn verify(&self, want: &[HashMap<u32, u32>], when: &str) -> Result<(), String> {
        let s = u64::from(self.topo.kv().page_size);
        for (k, a) in self.decode.iter().enumerate() {
            for m in a.host_memory() {
                let g = self.geom(a, m);
                let bytes =
                    m.desc().read_guard(0, m.len()).map_err(|e| format!("{when}: reading decode memory: {e}"))?;
                g.verify(0, bytes.as_slice(), &|p| want[k].get(&p).map(|src| u64::from(*src) * s)).map_err(|e| {
                    format!("{when}: decode rank {} layer {} {}: {e}", a.rank(), m.buffer.layer, m.buffer.kind)
                })?;
            }
        }
        Ok(())
    }

    /// Writes the sentinel over `pages[k]` of decode rank k (the engine freeing and reusing pages).
    fn reset(&self, pages: &[Vec<u32>]) -> Result<(), String> {
        for (k, a) in self.decode.iter().enumerate() {
            for m in a.host_memory() {
                let pb = self.geom(a, m).page_bytes();
                let fill = vec![SENTINEL; pb as usize];
                for p in &pages[k] {
                    m.write(u64::from(*p) * pb, &fill).map_err(|e| format!("resetting decode page {p}: {e}"))?;
                }
            }
        }
        Ok(())
    }

    fn receivers(&self, room: RequestId) -> Result<Vec<Receiver>, String> {
        self.decode.iter().map(|a| a.receiver(room).map_err(err)).collect()
    }

    /// Hands `room` off on every decode rank k with pages `dst[k]`.
    fn hand_off(&self, room: RequestId, dst: &[Vec<u32>]) -> Result<Vec<Receiver>, String> {
        let rxs = self.receivers(room)?;
        for (rx, pages) in rxs.iter().zip(dst) {
            rx.send_metadata(pages, None).map_err(err)?;
        }
        Ok(rxs)
    }

    /// A sender for `room` on every prefill rank, `init(total)`, ready (every handoff arrived).
    async fn senders(&self, room: RequestId, total: usize) -> Result<Vec<Sender>, String> {
        let txs: Vec<Sender> = self.prefill.iter().map(|a| a.sender(room).map_err(err)).collect::<Result<_, _>>()?;
        for tx in &txs {
            tx.init(total as u32).map_err(err)?;
        }
        for tx in &txs {
            until("the decode ranks' handoffs", Duration::from_secs(20), || {
                tx.status().phase == Phase::WaitingForInput
            })
            .await
            .map_err(|e| format!("{tx:?}: {e} (status {:?})", tx.status()))?;
        }
        Ok(txs)
    }

    fn active(&self) -> usize {
        self.prefill.iter().chain(&self.decode).map(Agent::active_requests).sum()
    }

    async fn shutdown(self) -> Result<(), String> {
        let mut first = None;
        for a in self.prefill.into_iter().chain(self.decode) {
            let what = format!("{a:?}");
            if let Err(e) = a.shutdown(deadline(20)).await {
                first.get_or_insert(format!("shutting down {what}: {e}"));
            }
        }
        first.map_or(Ok(()), Err)
    }
}

/// Destination pages of decode rank k for a use: `REQ` pages from `start`, spread and shifted per
/// rank, so ranks and uses land on different page orders.
fn dst_pages(ranks: usize, start: u32) -> Vec<Vec<u32>> {
    (0..ranks as u32).map(|k| (0..REQ as u32).map(|i| start + (i * 3 + k * 5) % REQ as u32).collect()).collect()
}

/// Source pages of a use: `REQ` pages from `start`, in reverse (token order differs from page order).
fn src_pages(start: u32) -> Vec<u32> {
    (0..REQ as u32).rev().map(|i| start + i).collect()
}

/// What decode rank k must hold after `src` was sent to `dst[k]`.
fn landed(dst: &[Vec<u32>], src: &[u32]) -> Vec<HashMap<u32, u32>> {
    dst.iter().map(|d| d.iter().copied().zip(src.iter().copied()).collect()).collect()
}

/// Sends `src` from every sender in two chunks.
fn send_two_chunks(txs: &[Sender], src: &[u32]) -> Result<(), String> {
    for tx in txs {
        tx.send(&src[..REQ / 2]).map_err(err)?;
    }
    for tx in txs {
        tx.send(&src[REQ / 2..]).map_err(err)?;
    }
    Ok(())
}

fn expect_phase(
    what: &str,
    s: Result<RequestStatus, kvxfer::engine::EngineError>,
    phase: Phase,
) -> Result<RequestStatus, String> {
    let s = s.map_err(|e| format!("{what}: {e}"))?;
    if s.phase != phase {
        return Err(format!("{what}: expected {phase}, got {s:?}"));
    }
    if s.phase.is_final() && !s.pages_reusable {
        return Err(format!("{what}: final but the pages are not reusable: {s:?}"));
    }
    Ok(s)
}

async fn all_succeed(rxs: &[Receiver], txs: &[Sender]) -> Result<(), String> {
    for rx in rxs {
        expect_phase(&format!("{rx:?}"), rx.wait(deadline(30)).await, Phase::Success)?;
    }
    for tx in txs {
        expect_phase(&format!("{tx:?}"), tx.wait(deadline(30)).await, Phase::Success)?;
    }
    Ok(())
}

fn release_all(rxs: Vec<Receiver>, txs: Vec<Sender>) -> Result<(), String> {
    for tx in txs {
        tx.release().map_err(err)?;
    }
    for rx in rxs {
        rx.release().map_err(err)?;
    }
    Ok(())
}

/// Whether `reason` names prefill rank `r` (as a sender key or a rank).
fn names_prefill(reason: &str, r: RankId) -> bool {
    reason.contains(&SenderKey::of(r).to_string()) || reason.contains(&format!("prefill rank {r}"))
}

async fn early_handoff(f: Arc<dyn BackendFactory>, style: NotifyStyle) -> Result<(), String> {
    let c = Cluster::start(f.as_ref(), 2, 1, Layout::Nhd, style).await?;
    let room = RequestId(0x1001);
    let dst = dst_pages(c.decode.len(), 0);
    let src = src_pages(16);
    let rxs = c.hand_off(room, &dst)?;
    until("every prefill rank to keep the early handoff", Duration::from_secs(20), || {
        c.prefill.iter().all(|p| p.stats().early_handoffs_kept >= 1)
    })
    .await?;
    let txs: Vec<Sender> = c.prefill.iter().map(|a| a.sender(room).map_err(err)).collect::<Result<_, _>>()?;
    for tx in &txs {
        let s = tx.status();
        if s.phase != Phase::WaitingForInput {
            return Err(format!("{tx:?}: the kept handoff was not applied at creation: {s:?}"));
        }
        tx.init(REQ as u32).map_err(err)?;
    }
    send_two_chunks(&txs, &src)?;
    all_succeed(&rxs, &txs).await?;
    c.verify(&landed(&dst, &src), "after the request")?;
    for p in &c.prefill {
        let s = p.stats();
        if s.early_handoffs_kept != 1 || s.early_handoffs_expired != 0 {
            return Err(format!("prefill rank {}: expected 1 early handoff kept, 0 expired: {s:?}", p.rank()));
        }
    }
    release_all(rxs, txs)?;
    if c.active() != 0 {
        return Err(format!("{} requests still active after release", c.active()));
    }
    c.shutdown().await
}

async fn generation_reuse(f: Arc<dyn BackendFactory>, style: NotifyStyle) -> Result<(), String> {
    let c = Cluster::start(f.as_ref(), 1, 1, Layout::Hnd, style).await?;
    let room = RequestId(0x2002);
    let dst = dst_pages(c.decode.len(), 8);
    let (first, second) = (src_pages(16), src_pages(32));
    // First use: one chunk of two, then decode aborts.
    let rxs = c.hand_off(room, &dst)?;
    let g1 = rxs[0].generation().ok_or("no generation after the handoff")?;
    let txs = c.senders(room, REQ).await?;
    for tx in &txs {
        tx.send(&first[..REQ / 2]).map_err(err)?;
    }
    for rx in &rxs {
        rx.abort("preempted by the scheduler");
    }
    for rx in &rxs {
        expect_phase("first use, decode", rx.wait(deadline(30)).await, Phase::Failed)?;
    }
    for tx in &txs {
        expect_phase("first use, prefill", tx.wait(deadline(30)).await, Phase::Failed)?;
    }
    release_all(rxs, txs)?;
    // After the fence nothing of the first use lands: reset pages stay reset.
    c.reset(&dst)?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let none: Vec<HashMap<u32, u32>> = vec![HashMap::new(); c.decode.len()];
    c.verify(&none, "after the fence and the reset")?;
    // Second use: the same room, the same pages.
    let rxs = c.hand_off(room, &dst)?;
    let g2 = rxs[0].generation().ok_or("no generation after the second handoff")?;
    if g2 == g1 {
        return Err(format!("the second use of the room got the same generation {g1:#x}"));
    }
    let txs = c.senders(room, REQ).await?;
    send_two_chunks(&txs, &second)?;
    all_succeed(&rxs, &txs).await?;
    let want = landed(&dst, &second);
    c.verify(&want, "after the second use")?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    c.verify(&want, "200 ms after the second use")?;
    release_all(rxs, txs)?;
    c.shutdown().await
}

async fn decode_abort_reuse(f: Arc<dyn BackendFactory>, style: NotifyStyle) -> Result<(), String> {
    let c = Cluster::start(f.as_ref(), 2, 1, Layout::Nhd, style).await?;
    let (room1, room2) = (RequestId(0x3003), RequestId(0x3004));
    let dst = dst_pages(c.decode.len(), 0);
    let (first, second) = (src_pages(16), src_pages(24));
    let rxs = c.hand_off(room1, &dst)?;
    let txs = c.senders(room1, REQ).await?;
    for tx in &txs {
        tx.send(&first[..REQ / 2]).map_err(err)?;
    }
    for rx in &rxs {
        rx.abort("preempted by the scheduler");
        let s = rx.status();
        // The prefill ranks are alive and may still write: nothing is fenced yet.
        if s.phase != Phase::Aborting || s.pages_reusable {
            return Err(format!("{rx:?} right after abort: expected Aborting with the pages held: {s:?}"));
        }
    }
    for rx in &rxs {
        let s = expect_phase(&format!("{rx:?}"), rx.wait(deadline(30)).await, Phase::Failed)?;
        let why = s.reason.unwrap_or_default();
        if !why.contains("preempted by the scheduler") {
            return Err(format!("{rx:?}: the reason does not carry the engine's: {why}"));
        }
    }
    // The pages are free: the engine resets and reuses them at once, for another room.
    c.reset(&dst)?;
    let rxs2 = c.hand_off(room2, &dst)?;
    // Meanwhile every prefill rank learned of the abort (naming the decode rank), not at its deadline.
    for tx in &txs {
        let s = expect_phase(&format!("{tx:?}"), tx.wait(Instant::now() + TOLD_WITHIN).await, Phase::Failed)?;
        let why = s.reason.unwrap_or_default();
        let named = c.decode.iter().all(|d| why.contains(&format!("decode rank {}", d.rank())));
        if !named {
            return Err(format!("{tx:?}: the reason does not name the decode rank: {why}"));
        }
        if tx.send(&first[REQ / 2..]).is_ok() {
            return Err(format!("{tx:?}: a chunk was accepted after the abort"));
        }
    }
    // The fence is counted once its notification went out (the decode rank may see it first).
    for p in &c.prefill {
        let counted = || {
            let s = p.stats();
            s.aborts_received >= 1 && s.fences >= 1
        };
        until("the prefill rank to count the abort and its fence", Duration::from_secs(5), counted)
            .await
            .map_err(|e| format!("prefill rank {}: {e}: {:?}", p.rank(), p.stats()))?;
    }
    let txs2 = c.senders(room2, REQ).await?;
    send_two_chunks(&txs2, &second)?;
    all_succeed(&rxs2, &txs2).await?;
    let want = landed(&dst, &second);
    c.verify(&want, "after the reuse")?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    c.verify(&want, "200 ms after the reuse")?;
    release_all(rxs, txs)?;
    release_all(rxs2, txs2)?;
    if c.active() != 0 {
        return Err(format!("{} requests still active after release", c.active()));
    }
    c.shutdown().await
}

async fn prefill_abort(f: Arc<dyn BackendFactory>, style: NotifyStyle) -> Result<(), String> {
    let c = Cluster::start(f.as_ref(), 1, 2, Layout::Nhd, style).await?;
    let room = RequestId(0x4004);
    let dst = dst_pages(c.decode.len(), 0);
    let src = src_pages(16);
    let rxs = c.hand_off(room, &dst)?;
    let txs = c.senders(room, REQ).await?;
    for tx in &txs {
        tx.send(&src[..REQ / 2]).map_err(err)?;
    }
    let t0 = Instant::now();
    for tx in &txs {
        tx.abort("prefill ran out of memory");
    }
    let prefill_rank = c.prefill[0].rank();
    for rx in &rxs {
        let s = expect_phase(&format!("{rx:?}"), rx.wait(t0 + TOLD_WITHIN).await, Phase::Failed)?;
        let why = s.reason.unwrap_or_default();
        if !why.contains("prefill ran out of memory") || !names_prefill(&why, prefill_rank) {
            return Err(format!("{rx:?}: the reason does not name prefill rank {prefill_rank} and its cause: {why}"));
        }
    }
    let took = t0.elapsed();
    if took >= TOLD_WITHIN {
        return Err(format!("the decode ranks learned of the abort after {took:?} (deadline {REQUEST_TIMEOUT:?})"));
    }
    for tx in &txs {
        expect_phase(&format!("{tx:?}"), tx.wait(deadline(30)).await, Phase::Failed)?;
    }
    // Nothing of the aborted request lands after its failure.
    c.reset(&dst)?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let none: Vec<HashMap<u32, u32>> = vec![HashMap::new(); c.decode.len()];
    c.verify(&none, "after the abort and the reset")?;
    release_all(rxs, txs)?;
    c.shutdown().await
}

/// Delivers `n` to `peer` the way a sender of `style` does: after (no) data, or out of band.
async fn deliver(
    be: &dyn KvTransferBackend,
    peer: kvxfer_core::PeerId,
    n: &Notification,
    style: NotifyStyle,
) -> Result<(), String> {
    match style {
        NotifyStyle::Attached => be.post(peer, &[], Some(n)).map_err(err)?.wait(deadline(20)).await.map_err(err),
        NotifyStyle::OutOfBand => be.notify(peer, n).await.map_err(err),
    }
}

async fn release_forgets(f: Arc<dyn BackendFactory>, style: NotifyStyle) -> Result<(), String> {
    let c = Cluster::start(f.as_ref(), 1, 1, Layout::Nhd, style).await?;
    let room = RequestId(0x5005);
    let dst = dst_pages(c.decode.len(), 0);
    let (first, second) = (src_pages(16), src_pages(32));
    let rxs = c.hand_off(room, &dst)?;
    let g1 = rxs[0].generation().ok_or("no generation after the handoff")?;
    let txs = c.senders(room, REQ).await?;
    send_two_chunks(&txs, &first)?;
    all_succeed(&rxs, &txs).await?;
    c.verify(&landed(&dst, &first), "after the first use")?;
    release_all(rxs, txs)?;
    if c.active() != 0 {
        return Err(format!("{} requests still active after release", c.active()));
    }
    // Late duplicates of the released use's chunk notifications, from an extra endpoint whose
    // identity is no rank of the cluster (its connection and loss concern no request).
    let injector = f.create(kvxfer_core::identity(Side::Decode, RankId::new(0xffff, 0))).map_err(err)?;
    let decode = &c.decode[0];
    let peer = injector.connect(&decode.backend().metadata().map_err(err)?).await.map_err(err)?;
    let key = SenderKey::of(c.prefill[0].rank());
    let late = [Notification::chunk(room, key, 0, false), Notification::chunk(room, key, 1, true)];
    let released = || decode.stats().tracker.released;
    let before = released();
    for n in &late {
        deliver(injector.as_ref(), peer, &n.clone().with_generation(g1), style).await?;
    }
    until("the late duplicates to be dropped as released", Duration::from_secs(10), || released() >= before + 2)
        .await?;
    // The room again, the same pages: the duplicates (again, now that the room is tracked) must not
    // complete it.
    c.reset(&dst)?;
    let rxs = c.hand_off(room, &dst)?;
    if rxs[0].generation() == Some(g1) {
        return Err("the second use of the room got the released generation".into());
    }
    for n in &late {
        deliver(injector.as_ref(), peer, &n.clone().with_generation(g1), style).await?;
    }
    until("the second duplicates to be dropped as released", Duration::from_secs(10), || released() >= before + 4)
        .await?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let s = rxs[0].status();
    if s.phase != Phase::Transferring {
        return Err(format!("late notifications of a released use changed the new use: {s:?}"));
    }
    let txs = c.senders(room, REQ).await?;
    send_two_chunks(&txs, &second)?;
    all_succeed(&rxs, &txs).await?;
    c.verify(&landed(&dst, &second), "after the second use")?;
    release_all(rxs, txs)?;
    if c.active() != 0 {
        return Err(format!("{} requests still active after the second release", c.active()));
    }
    let r = c.shutdown().await;
    injector.disconnect(peer).await.map_err(err)?;
    r
}

async fn abort_before_connected(f: Arc<dyn BackendFactory>, style: NotifyStyle) -> Result<(), String> {
    let mut c = Cluster::decode_only(f.as_ref(), 1, 1, Layout::Nhd, style).await?;
    let room = RequestId(0x7007);
    let dst = dst_pages(c.decode.len(), 0);
    let rxs = c.hand_off(room, &dst)?;
    for rx in &rxs {
        let s = rx.status();
        if s.phase.is_final() {
            return Err(format!("{rx:?}: final before any prefill rank exists: {s:?}"));
        }
        rx.abort("the client went away");
    }
    // Several progress ticks while no prefill rank is connected: the abort must wait for them.
    tokio::time::sleep(Duration::from_millis(200)).await;
    c.start_prefill().await?;
    for rx in &rxs {
        let s = rx.wait(Instant::now() + TOLD_WITHIN).await;
        expect_phase(&format!("{rx:?} aborted while bootstrapping"), s, Phase::Failed)?;
    }
    for rx in rxs {
        rx.release().map_err(err)?;
    }
    // The room again, other pages: the first use's handoff must not reach the new sender.
    let dst2 = dst_pages(c.decode.len(), 16);
    let src = src_pages(32);
    let rxs = c.hand_off(room, &dst2)?;
    // The sender is created once the new handoff is there: one created before it takes the first
    // use's handoff and abort (kept since the abort) and fails at once.
    until("the prefill ranks to keep the second handoff", Duration::from_secs(20), || {
        c.prefill.iter().all(|p| p.stats().early_handoffs_kept >= 2)
    })
    .await?;
    let txs = c.senders(room, REQ).await?;
    send_two_chunks(&txs, &src)?;
    all_succeed(&rxs, &txs).await?;
    c.verify(&landed(&dst2, &src), "after the second use")?;
    release_all(rxs, txs)?;
    if c.active() != 0 {
        return Err(format!("{} requests still active after release", c.active()));
    }
    c.shutdown().await
}

async fn hetero_tp(f: Arc<dyn BackendFactory>, style: NotifyStyle, p: u32, d: u32) -> Result<(), String> {
    let layout = if p > d { Layout::Nhd } else { Layout::Hnd };
    let c = Cluster::start(f.as_ref(), p, d, layout, style).await?;
    let room = RequestId(0x6000 + u64::from(p * 10 + d));
    let dst = dst_pages(c.decode.len(), 4);
    let src = src_pages(20);
    let rxs = c.hand_off(room, &dst)?;
    let txs = c.senders(room, REQ).await?;
    send_two_chunks(&txs, &src)?;
    all_succeed(&rxs, &txs).await?;
    c.verify(&landed(&dst, &src), "after the request")?;
    release_all(rxs, txs)?;
    if c.active() != 0 {
        return Err(format!("{} requests still active after release", c.active()));
    }
    c.shutdown().await
}
