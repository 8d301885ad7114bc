//! The contract families: what the backend interface promises beyond moving the right bytes.
//!
//! - `lifetime`: a registration closed while writes into it land resolves only when nothing can
//!   touch the memory (afterwards the backend holds no descriptor of it and no byte changes); writes
//!   into a closed region and out of a closed source are refused with nothing written; a
//!   registration dropped without closing is closed in the background.
//! - `abort`: a transfer aborted mid-way, whose destination is reused at once by another transfer of
//!   a different pattern, leaves exactly the second pattern; abort of a finished transfer is a no-op;
//!   two endpoints aborting transfers to each other at once both fence.
//! - `capabilities`: every claim is exercised (memory kinds, styles, completion, limits) and every
//!   unclaimed feature is refused with a typed error.
//! - `selfconnect`: an endpoint connected to itself moves bytes and notifications.
//! - `bidirectional`: two endpoints writing to each other at once, round after round.
//! - `indexed`: page lists ([`kvxfer_core::IndexedOp`]) moved byte for byte by every backend.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer::session::{KvPool, SenderSession, SessionError};
use kvxfer_core::oracle::SENTINEL;
use kvxfer_core::{
    BackendError, BackendEvent, Completion, HostBuffer, KvTransferBackend, Layout, MemKind, Notification,
    NotificationBody, NotifyStyle, PeerId, RankId, RegionId, RequestId, SenderKey, Side, Topology, Transfer,
    TransferStatus, WriteOp,
};

use crate::{err, gqa, BackendFactory};

/// Bytes of the big transfers (enough that an abort or a close usually lands mid-way).
const TOTAL: u64 = 16 << 20;
/// Bytes per op of the big transfers.
const BLOCK: u64 = 16 << 10;

fn deadline(s: u64) -> Instant {
    Instant::now() + Duration::from_secs(s)
}

/// The byte at `i` of pattern `seed` (never the sentinel's neighbourhood by accident: seeds differ).
fn pat(i: u64, seed: u8) -> u8 {
    ((i.wrapping_mul(0x9E37_79B1) >> 11) as u8) ^ seed.wrapping_mul(37) ^ 0x5a
}

fn pattern(len: u64, seed: u8) -> HostBuffer {
    let data: Vec<u8> = (0..len).map(|i| pat(i, seed)).collect();
    HostBuffer::from_slice(&data)
}

/// Destination block of source block `k`: a fixed permutation (paged KV never lands in order).
fn dst_block(k: u64, blocks: u64) -> u64 {
    (k * 7 + 3) % blocks
}

/// `TOTAL / BLOCK` ops from local region `src` into peer region `dst`, blocks permuted.
fn big_ops(src: RegionId, dst: RegionId) -> Vec<WriteOp> {
    let blocks = TOTAL / BLOCK;
    (0..blocks).map(|k| WriteOp::contiguous(src, k * BLOCK, dst, dst_block(k, blocks) * BLOCK, BLOCK)).collect()
}

/// The destination content the big ops of pattern `seed` leave.
fn expected_big(seed: u8) -> Vec<u8> {
    let blocks = TOTAL / BLOCK;
    let mut v = vec![0u8; TOTAL as usize];
    for k in 0..blocks {
        let d = dst_block(k, blocks) * BLOCK;
        for i in 0..BLOCK {
            v[(d + i) as usize] = pat(k * BLOCK + i, seed);
        }
    }
    v
}

/// Posts `ops` in as many transfers as the endpoint's ops-per-post limit needs.
fn post_all(be: &dyn KvTransferBackend, peer: PeerId, ops: &[WriteOp]) -> Result<Vec<Transfer>, BackendError> {
    let per = be.capabilities().limits.max_ops_per_post.clamp(1, 256) as usize;
    ops.chunks(per).map(|c| be.post(peer, c, None)).collect()
}

async fn wait_all(ts: &[Transfer], until: Instant) -> Result<(), String> {
    for t in ts {
        t.wait(until).await.map_err(err)?;
    }
    Ok(())
}

/// Waits until every transfer is final (whatever the outcome); a transfer that never ends is a hang.
async fn settle_all(ts: &[Transfer], until: Instant) -> Result<(), String> {
    for t in ts {
        if let Err(BackendError::Timeout { .. }) = t.wait(until).await {
            return Err(format!("a transfer was still in flight past its deadline: {t:?}"));
        }
    }
    Ok(())
}

/// A buffer's bytes once every descriptor is gone (the registration was closed and the backend let
/// go of the memory); waiting up to `within` for a background close.
async fn released(b: &HostBuffer, within: Duration, what: &str) -> Result<Vec<u8>, String> {
    let until = Instant::now() + within;
    loop {
        match b.to_vec() {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() >= until => {
                return Err(format!("{what}: the backend still holds the memory after its registration closed: {e}"))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

fn first_diff(got: &[u8], want: &[u8]) -> Option<usize> {
    got.iter().zip(want).position(|(a, b)| a != b)
}

/// Two endpoints, A connected to B.
async fn pair(f: &dyn BackendFactory) -> Result<(Arc<dyn KvTransferBackend>, Arc<dyn KvTransferBackend>), String> {
    Ok((f.create(0x1_0001).map_err(err)?, f.create(0x1_0002).map_err(err)?))
}

pub(crate) async fn lifetime_close_waits(f: Arc<dyn BackendFactory>, _: NotifyStyle) -> Result<(), String> {
    let (a, b) = pair(f.as_ref()).await?;
    let mut src = pattern(TOTAL, 1);
    let mut dst = HostBuffer::filled(TOTAL as usize, SENTINEL);
    let _src_reg = a.register(RegionId(1), src.desc()).await.map_err(err)?;
    let dst_reg = b.register(RegionId(2), dst.desc()).await.map_err(err)?;
    let peer = a.connect(&b.metadata().map_err(err)?).await.map_err(err)?;
    let ts = post_all(a.as_ref(), peer, &big_ops(RegionId(1), RegionId(2))).map_err(err)?;
    dst_reg.close(deadline(30)).await.map_err(|e| format!("closing while writes land: {e}"))?;
    let first = released(&dst, Duration::from_secs(1), "close").await?;
    settle_all(&ts, deadline(30)).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let later = dst.to_vec().map_err(err)?;
    if let Some(i) = first_diff(&later, &first) {
        return Err(format!("destination byte {i} changed after the registration's close resolved"));
    }
    let want = expected_big(1);
    if let Some(i) = later.iter().zip(&want).position(|(g, w)| *g != SENTINEL && g != w) {
        return Err(format!("destination byte {i} holds neither the sentinel nor the source's byte"));
    }
    Ok(())
}

pub(crate) async fn lifetime_closed_refused(f: Arc<dyn BackendFactory>, _: NotifyStyle) -> Result<(), String> {
    let (a, b) = pair(f.as_ref()).await?;
    let mut src = pattern(1 << 16, 2);
    let mut dst = HostBuffer::filled(1 << 16, SENTINEL);
    let src_reg = a.register(RegionId(1), src.desc()).await.map_err(err)?;
    let dst_reg = b.register(RegionId(2), dst.desc()).await.map_err(err)?;
    // The peer's metadata still lists region 2: only the receiver can refuse.
    let peer = a.connect(&b.metadata().map_err(err)?).await.map_err(err)?;
    dst_reg.close(deadline(30)).await.map_err(err)?;
    let op = WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 4096);
    let r = match a.post(peer, &[op], None) {
        Ok(t) => t.wait(deadline(20)).await,
        Err(e) => Err(e),
    };
    match r {
        Ok(()) => return Err("a write into a closed region succeeded".into()),
        Err(BackendError::Timeout { .. }) => return Err("a write into a closed region hung".into()),
        Err(_) => {}
    }
    let v = released(&dst, Duration::from_secs(5), "closed destination").await?;
    if let Some(i) = v.iter().position(|x| *x != SENTINEL) {
        return Err(format!("byte {i} of a closed region was written"));
    }
    // A closed source is refused at post, before anything moves.
    let mut dst2 = HostBuffer::filled(1 << 16, SENTINEL);
    let _dst2_reg = b.register(RegionId(3), dst2.desc()).await.map_err(err)?;
    let p2 = a.connect(&b.metadata().map_err(err)?).await.map_err(err)?;
    src_reg.close(deadline(30)).await.map_err(err)?;
    match a.post(p2, &[WriteOp { dst: RegionId(3), ..op }], None) {
        Err(BackendError::UnknownRegion { region: RegionId(1), .. }) => {}
        other => return Err(format!("posting from a closed source: expected UnknownRegion, got {other:?}")),
    }
    src.as_mut_slice().map_err(|e| format!("source after close: {e}"))?;
    Ok(())
}

pub(crate) async fn lifetime_drop_without_close(f: Arc<dyn BackendFactory>, _: NotifyStyle) -> Result<(), String> {
    let (a, b) = pair(f.as_ref()).await?;
    let mut src = pattern(1 << 16, 3);
    let mut dst = HostBuffer::filled(1 << 16, SENTINEL);
    let _src_reg = a.register(RegionId(1), src.desc()).await.map_err(err)?;
    let dst_reg = b.register(RegionId(2), dst.desc()).await.map_err(err)?;
    let peer = a.connect(&b.metadata().map_err(err)?).await.map_err(err)?;
    let op = WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 1 << 15);
    a.post(peer, &[op], None).map_err(err)?.wait(deadline(20)).await.map_err(err)?;
    drop(dst_reg);
    let v = released(&dst, Duration::from_secs(10), "dropped registration").await?;
    let want: Vec<u8> = (0..1u64 << 16).map(|i| if i < 1 << 15 { pat(i, 3) } else { SENTINEL }).collect();
    if let Some(i) = first_diff(&v, &want) {
        return Err(format!("byte {i} wrong after the registration was dropped"));
    }
    let r = match a.post(peer, &[op], None) {
        Ok(t) => t.wait(deadline(20)).await,
        Err(e) => Err(e),
    };
    if r.is_ok() {
        return Err("a write into a dropped registration succeeded".into());
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    if let Some(i) = first_diff(&dst.to_vec().map_err(err)?, &want) {
        return Err(format!("byte {i} changed after the registration was dropped"));
    }
    Ok(())
}

/// Checks that no byte of `view` changes over a pause (nothing may land after a fence). A local
/// write still under way is caught by the guard itself.
async fn still(view: &kvxfer_core::MemDesc, when: &str) -> Result<(), String> {
    let snap = || -> Result<Vec<u8>, String> {
        let g =
            view.read_guard(0, view.len() as u64).map_err(|e| format!("{when}: a write is still under way: {e}"))?;
        Ok(g.as_slice().to_vec())
    };
    let first = snap()?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    if let Some(i) = first_diff(&snap()?, &first) {
        return Err(format!("destination byte {i} changed {when}"));
    }
    Ok(())
}

/// Aborts `ts`, checking that each abort resolves (with any final status).
async fn abort_all(ts: &[Transfer]) -> Result<(), String> {
    let aborts = ts.iter().map(|t| t.abort(deadline(30)));
    for r in futures::future::join_all(aborts).await {
        match r {
            Ok(TransferStatus::InFlight) => return Err("abort resolved with the transfer still in flight".into()),
            Ok(_) => {}
            Err(e) => return Err(format!("abort did not fence: {e}")),
        }
    }
    Ok(())
}

pub(crate) async fn abort_then_reuse(f: Arc<dyn BackendFactory>, _: NotifyStyle) -> Result<(), String> {
    let (a, b) = pair(f.as_ref()).await?;
    let mut first = pattern(TOTAL, 4);
    let mut second = pattern(TOTAL, 5);
    let mut dst = HostBuffer::filled(TOTAL as usize, SENTINEL);
    let _r1 = a.register(RegionId(1), first.desc()).await.map_err(err)?;
    let _r2 = a.register(RegionId(2), second.desc()).await.map_err(err)?;
    let view = dst.desc();
    let dst_reg = b.register(RegionId(3), view.clone()).await.map_err(err)?;
    let peer = a.connect(&b.metadata().map_err(err)?).await.map_err(err)?;
    let ts = post_all(a.as_ref(), peer, &big_ops(RegionId(1), RegionId(3))).map_err(err)?;
    abort_all(&ts).await?;
    still(&view, "after the abort resolved").await?;
    drop(view);
    // The pages are reused at once by another request.
    let ts2 = post_all(a.as_ref(), peer, &big_ops(RegionId(2), RegionId(3))).map_err(err)?;
    wait_all(&ts2, deadline(60)).await.map_err(|e| format!("the write reusing aborted pages: {e}"))?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    dst_reg.close(deadline(30)).await.map_err(err)?;
    let got = released(&dst, Duration::from_secs(5), "close").await?;
    if let Some(i) = first_diff(&got, &expected_big(5)) {
        let stray = got[i] == expected_big(4)[i];
        return Err(format!(
            "destination byte {i} is not the second request's{}",
            if stray { ": a byte of the aborted transfer landed after its abort resolved" } else { "" }
        ));
    }
    Ok(())
}

pub(crate) async fn abort_finished_noop(f: Arc<dyn BackendFactory>, _: NotifyStyle) -> Result<(), String> {
    let (a, b) = pair(f.as_ref()).await?;
    let mut src = pattern(1 << 16, 6);
    let mut dst = HostBuffer::filled(1 << 16, SENTINEL);
    let _s = a.register(RegionId(1), src.desc()).await.map_err(err)?;
    let d = b.register(RegionId(2), dst.desc()).await.map_err(err)?;
    let peer = a.connect(&b.metadata().map_err(err)?).await.map_err(err)?;
    let t = a.post(peer, &[WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 1 << 16)], None).map_err(err)?;
    t.wait(deadline(20)).await.map_err(err)?;
    match t.abort(deadline(10)).await {
        Ok(TransferStatus::Done) => {}
        other => return Err(format!("abort of a finished transfer: expected Ok(Done), got {other:?}")),
    }
    if t.status() != TransferStatus::Done {
        return Err(format!("status after a no-op abort: {:?}", t.status()));
    }
    d.close(deadline(30)).await.map_err(err)?;
    let got = released(&dst, Duration::from_secs(5), "close").await?;
    if let Some(i) = got.iter().enumerate().position(|(i, x)| *x != pat(i as u64, 6)) {
        return Err(format!("byte {i} wrong"));
    }
    Ok(())
}

pub(crate) async fn abort_both_sides(f: Arc<dyn BackendFactory>, _: NotifyStyle) -> Result<(), String> {
    let (a, b) = pair(f.as_ref()).await?;
    let ends = [(&a, 7u8, 8u8), (&b, 9u8, 10u8)];
    let mut keep = Vec::new();
    let mut dsts = Vec::new();
    for (e, s1, s2) in ends {
        let mut one = pattern(TOTAL, s1);
        let mut two = pattern(TOTAL, s2);
        let mut dst = HostBuffer::filled(TOTAL as usize, SENTINEL);
        keep.push(e.register(RegionId(1), one.desc()).await.map_err(err)?);
        keep.push(e.register(RegionId(2), two.desc()).await.map_err(err)?);
        let dreg = e.register(RegionId(3), dst.desc()).await.map_err(err)?;
        dsts.push((dst, dreg, one, two));
    }
    let ab = a.connect(&b.metadata().map_err(err)?).await.map_err(err)?;
    let ba = b.connect(&a.metadata().map_err(err)?).await.map_err(err)?;
    let ta = post_all(a.as_ref(), ab, &big_ops(RegionId(1), RegionId(3))).map_err(err)?;
    let tb = post_all(b.as_ref(), ba, &big_ops(RegionId(1), RegionId(3))).map_err(err)?;
    let (ra, rb) = futures::join!(abort_all(&ta), abort_all(&tb));
    ra.map_err(|e| format!("A's abort: {e}"))?;
    rb.map_err(|e| format!("B's abort: {e}"))?;
    for (dst, _, _, _) in dsts.iter_mut() {
        let view = dst.desc();
        still(&view, "after both aborts resolved").await?;
    }
    let ta = post_all(a.as_ref(), ab, &big_ops(RegionId(2), RegionId(3))).map_err(err)?;
    let tb = post_all(b.as_ref(), ba, &big_ops(RegionId(2), RegionId(3))).map_err(err)?;
    let (ra, rb) = futures::join!(wait_all(&ta, deadline(60)), wait_all(&tb, deadline(60)));
    ra?;
    rb?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // B's destination holds A's second pattern (8), A's destination B's (10).
    for ((dst, dreg, _, _), (who, want)) in dsts.into_iter().zip([("A", 10u8), ("B", 8u8)]) {
        dreg.close(deadline(30)).await.map_err(err)?;
        let got = released(&dst, Duration::from_secs(5), "close").await?;
        if let Some(i) = first_diff(&got, &expected_big(want)) {
            return Err(format!("{who}'s destination byte {i} is not the reusing transfer's"));
        }
    }
    Ok(())
}

pub(crate) async fn self_connect(f: Arc<dyn BackendFactory>, _: NotifyStyle) -> Result<(), String> {
    let a = f.create(0x1_0003).map_err(err)?;
    let mut src = pattern(1 << 20, 11);
    let mut dst = HostBuffer::filled(1 << 20, SENTINEL);
    let _s = a.register(RegionId(1), src.desc()).await.map_err(err)?;
    let d = a.register(RegionId(2), dst.desc()).await.map_err(err)?;
    let me = a.connect(&a.metadata().map_err(err)?).await.map_err(err)?;
    let ops: Vec<WriteOp> =
        (0..64).map(|k| WriteOp::contiguous(RegionId(1), k * 16384, RegionId(2), (63 - k) * 16384, 16384)).collect();
    let note = Notification::chunk(RequestId(77), SenderKey::of(RankId::new(0, 0)), 0, true);
    let caps = a.capabilities();
    let attach = caps.attached.then_some(&note);
    a.post(me, &ops, attach).map_err(err)?.wait(deadline(20)).await.map_err(err)?;
    if !caps.attached {
        a.notify(me, &note).await.map_err(err)?;
    }
    expect_notification(a.as_ref(), &note, deadline(10)).await?;
    d.close(deadline(30)).await.map_err(err)?;
    let got = released(&dst, Duration::from_secs(5), "close").await?;
    for k in 0..64u64 {
        let at = ((63 - k) * 16384) as usize;
        if let Some(i) = (0..16384).position(|i| got[at + i] != pat(k * 16384 + i as u64, 11)) {
            return Err(format!("block {k} byte {i} wrong"));
        }
    }
    Ok(())
}

async fn expect_notification(be: &dyn KvTransferBackend, want: &Notification, until: Instant) -> Result<(), String> {
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("notification {want} not delivered"));
        }
        // The first event decides: the wanted notification, or what came instead.
        if let Some(e) = be.recv(left.min(Duration::from_millis(200))).await.map_err(err)?.into_iter().next() {
            return match e {
                BackendEvent::Notification(n) if &n == want => Ok(()),
                BackendEvent::Notification(n) => Err(format!("unexpected notification {n}")),
                BackendEvent::PeerLost { identity, reason } => {
                    Err(format!("peer {identity:#x} lost while waiting: {reason}"))
                }
            };
        }
    }
}

pub(crate) async fn bidirectional(f: Arc<dyn BackendFactory>, _: NotifyStyle) -> Result<(), String> {
    let (a, b) = pair(f.as_ref()).await?;
    const LEN: u64 = 1 << 20;
    let mut bufs = Vec::new();
    let mut regs = Vec::new();
    for (e, seed) in [(&a, 12u8), (&b, 13u8)] {
        let mut src = pattern(LEN, seed);
        let mut dst = HostBuffer::filled(LEN as usize, SENTINEL);
        regs.push(e.register(RegionId(1), src.desc()).await.map_err(err)?);
        let d = e.register(RegionId(2), dst.desc()).await.map_err(err)?;
        bufs.push((src, dst, d));
    }
    let ab = a.connect(&b.metadata().map_err(err)?).await.map_err(err)?;
    let ba = b.connect(&a.metadata().map_err(err)?).await.map_err(err)?;
    let ops: Vec<WriteOp> =
        (0..64).map(|k| WriteOp::contiguous(RegionId(1), k * 16384, RegionId(2), k * 16384, 16384)).collect();
    for round in 0..10 {
        let ta = a.post(ab, &ops, None).map_err(err)?;
        let tb = b.post(ba, &ops, None).map_err(err)?;
        let (ra, rb) = futures::join!(ta.wait(deadline(20)), tb.wait(deadline(20)));
        ra.map_err(|e| format!("round {round}, A -> B: {e}"))?;
        rb.map_err(|e| format!("round {round}, B -> A: {e}"))?;
    }
    for ((_, dst, d), (who, seed)) in bufs.into_iter().zip([("A", 13u8), ("B", 12u8)]) {
        d.close(deadline(30)).await.map_err(err)?;
        let got = released(&dst, Duration::from_secs(5), "close").await?;
        if let Some(i) = got.iter().enumerate().position(|(i, x)| *x != pat(i as u64, seed)) {
            return Err(format!("{who}'s destination byte {i} wrong"));
        }
    }
    Ok(())
}

pub(crate) async fn capabilities(f: Arc<dyn BackendFactory>, _: NotifyStyle) -> Result<(), String> {
    let (a, b) = pair(f.as_ref()).await?;
    let caps = a.capabilities();
    if caps != b.capabilities() {
        return Err("two endpoints of one configuration report different capabilities".into());
    }
    // Memory kinds: host memory is claimed and taken; unclaimed kinds are refused, nothing registered.
    if !caps.memory.contains(&MemKind::Host) {
        return Err("every backend takes host memory, this one does not claim it".into());
    }
    let mut probe = HostBuffer::zeroed(4096);
    for kind in [MemKind::Cuda { device: 0 }, MemKind::DmaBuf { fd: -1, offset: 0 }] {
        if caps.memory.contains(&kind) {
            continue; // claimed: exercised on machines with such memory
        }
        match a.register(RegionId(40), probe.desc_labelled(kind)).await {
            Err(BackendError::Unsupported { .. }) => {}
            other => return Err(format!("registering unclaimed {kind}: expected Unsupported, got {other:?}")),
        }
    }
    let host_reg = a.register(RegionId(40), probe.desc()).await.map_err(|e| format!("after a refusal: {e}"))?;
    // Styles: a session refuses an unclaimed style with a typed error, accepts a claimed one.
    let side = gqa(1, 4, 4, 1, 1, Layout::Nhd, 1, 1);
    let topo = Topology::new(&side, &side).map_err(err)?;
    let fill = |_: kvxfer_core::BufferRef, _: &mut [u8]| {};
    let (pool, _mem) =
        KvPool::allocate(&topo, Side::Prefill, RankId::new(0, 0), 2, b.as_ref(), &fill).await.map_err(err)?;
    for style in [NotifyStyle::Attached, NotifyStyle::OutOfBand] {
        let r = SenderSession::new(Arc::clone(&b), topo, RankId::new(0, 0), pool.clone(), style);
        match (caps.supports(style), r) {
            (true, Ok(_)) => {}
            (false, Err(SessionError::Backend { source: BackendError::Unsupported { .. }, .. })) => {}
            (claimed, r) => return Err(format!("{style} (claimed: {claimed}): session answered {:?}", r.map(|_| ()))),
        }
    }
    if caps.completion == Completion::Local && caps.supports(NotifyStyle::OutOfBand) {
        return Err("local completion cannot offer the out-of-band style".into());
    }
    // Completion: with remote completion, bytes are in the peer's memory when the status is Done.
    let mut src = pattern(1 << 20, 14);
    let mut dst = HostBuffer::filled(1 << 20, SENTINEL);
    let _s = a.register(RegionId(1), src.desc()).await.map_err(err)?;
    let view = dst.desc();
    let dreg = b.register(RegionId(2), view.clone()).await.map_err(err)?;
    let peer = a.connect(&b.metadata().map_err(err)?).await.map_err(err)?;
    let t = a.post(peer, &[WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 1 << 20)], None).map_err(err)?;
    t.wait(deadline(20)).await.map_err(err)?;
    if caps.completion == Completion::Remote {
        let g = view.read_guard(0, 1 << 20).map_err(err)?;
        if let Some(i) = g.as_slice().iter().enumerate().position(|(i, x)| *x != pat(i as u64, 14)) {
            return Err(format!("remote completion claimed, but byte {i} was not in place when the transfer was Done"));
        }
    }
    // Ops per post: the limit is taken, one more is refused before anything moves.
    let limit = caps.limits.max_ops_per_post;
    if limit <= 1 << 16 {
        let ops = |n: u64| -> Vec<WriteOp> {
            (0..n).map(|k| WriteOp::contiguous(RegionId(1), k % (1 << 20), RegionId(2), k % (1 << 20), 1)).collect()
        };
        match a.post(peer, &ops(limit + 1), None) {
            Err(BackendError::Limit { .. }) => {}
            other => return Err(format!("{} ops over a limit of {limit}: expected Limit, got {other:?}", limit + 1)),
        }
        a.post(peer, &ops(limit), None).map_err(err)?.wait(deadline(30)).await.map_err(err)?;
    }
    // Notification size: the limit is delivered, one byte more is refused.
    let key = SenderKey::of(RankId::new(0, 0));
    let aux = |n: usize| Notification {
        generation: 0,
        request: RequestId(5),
        sender: key,
        body: NotificationBody::Aux(vec![1; n]),
    };
    let overhead = aux(0).encode().map_err(err)?.len() as u64;
    let max_payload = kvxfer_core::notify::MAX_PAYLOAD as u64;
    let fits = caps.limits.max_notification_bytes.saturating_sub(overhead).min(max_payload);
    let n = aux(fits as usize);
    a.notify(peer, &n).await.map_err(|e| format!("a notification at the size limit: {e}"))?;
    expect_notification(b.as_ref(), &n, deadline(10)).await?;
    if caps.limits.max_notification_bytes < overhead + max_payload {
        match a.notify(peer, &aux(fits as usize + 1)).await {
            Err(BackendError::Limit { .. } | BackendError::Codec { .. }) => {}
            other => return Err(format!("a notification over the size limit: expected Limit, got {other:?}")),
        }
    }
    // Regions: the limit is reachable and one more is refused.
    if caps.limits.max_regions <= 256 {
        let c = f.create(0x1_0004).map_err(err)?;
        let mut small: Vec<HostBuffer> = (0..=caps.limits.max_regions).map(|_| HostBuffer::zeroed(64)).collect();
        let mut held = Vec::new();
        for (i, s) in small.iter_mut().enumerate() {
            let r = c.register(RegionId(100 + i as u32), s.desc()).await;
            match (i as u64 == caps.limits.max_regions, r) {
                (false, Ok(r)) => held.push(r),
                (true, Err(BackendError::Limit { .. })) => {}
                (_, r) => return Err(format!("region {} of a limit of {}: {r:?}", i + 1, caps.limits.max_regions)),
            }
        }
    }
    drop(view);
    dreg.close(deadline(30)).await.map_err(err)?;
    host_reg.close(deadline(30)).await.map_err(err)?;
    Ok(())
}

/// Pages of the indexed case's pools, tokens per page, bytes per head.
const IX_PAGES: u64 = 64;
const IX_TOKENS: u64 = 16;
const IX_HEAD: u64 = 64;

/// `indexed`: [`KvTransferBackend::post_indexed`] moves page lists byte for byte, whatever the
/// backend's [`kvxfer_core::Capabilities::indexed`] says: two layouts' templates (NHD, heads 1..3
/// of 4 into a 2-head page, one range per token; HND, heads 2..4 as one range per page) at
/// shuffled pages, runs of one and of several pages, checked against the expected bytes computed
/// here, token by token. A run out of the destination's range is refused before anything moves
/// (the destination keeps every sentinel byte); more runs than the ops-per-post limit are refused
/// as a limit.
pub(crate) async fn indexed_page_lists(f: Arc<dyn BackendFactory>, _: NotifyStyle) -> Result<(), String> {
    use kvxfer_core::{IndexedOp, PageRun};
    let (a, b) = pair(f.as_ref()).await?;
    // Source pages hold 4 heads per token, destination pages 2.
    let (src_page, dst_page) = (IX_TOKENS * 4 * IX_HEAD, IX_TOKENS * 2 * IX_HEAD);
    let mut src = pattern(IX_PAGES * src_page, 21);
    let mut nhd = HostBuffer::filled((IX_PAGES * dst_page) as usize, SENTINEL);
    let mut hnd = HostBuffer::filled((IX_PAGES * dst_page) as usize, SENTINEL);
    let _s = a.register(RegionId(1), src.desc()).await.map_err(err)?;
    let nhd_view = nhd.desc();
    let hnd_view = hnd.desc();
    let _n = b.register(RegionId(2), nhd_view.clone()).await.map_err(err)?;
    let _h = b.register(RegionId(3), hnd_view.clone()).await.map_err(err)?;
    let peer = a.connect(&b.metadata().map_err(err)?).await.map_err(err)?;
    // Runs: source pages 0..28 to shuffled destination pages (20 slots of 3 pages, permuted), every
    // fifth run 3 pages long.
    let mut runs = Vec::new();
    let mut s = 0u32;
    for k in 0..20u32 {
        let len = if k % 5 == 0 { 3 } else { 1 };
        runs.push(PageRun { src: s, dst: (k * 7 + 3) % 20 * 3, len });
        s += len;
    }
    let runs: Arc<[PageRun]> = runs.into();
    // NHD: token t of a page holds its heads at t * heads * IX_HEAD; heads 1..3 of the source
    // land as heads 0..2 of the destination.
    let nhd_t = WriteOp {
        src: RegionId(1),
        src_offset: IX_HEAD,
        dst: RegionId(2),
        dst_offset: 0,
        len: 2 * IX_HEAD,
        count: IX_TOKENS,
        src_stride: 4 * IX_HEAD,
        dst_stride: 2 * IX_HEAD,
    };
    // HND: head h of a page holds its tokens at h * IX_TOKENS * IX_HEAD; heads 2..4 as one range.
    let hnd_t = WriteOp {
        src: RegionId(1),
        src_offset: 2 * IX_TOKENS * IX_HEAD,
        dst: RegionId(3),
        dst_offset: 0,
        len: 2 * IX_TOKENS * IX_HEAD,
        count: 1,
        src_stride: src_page,
        dst_stride: dst_page,
    };
    let ops = [IndexedOp::new(nhd_t, Arc::clone(&runs)), IndexedOp::new(hnd_t, Arc::clone(&runs))];
    let total: u64 = ops.iter().map(IndexedOp::bytes).sum();
    let t = a.post_indexed(peer, &ops, None).map_err(err)?;
    if t.bytes() != total {
        return Err(format!("the transfer says {} bytes, the ops {total}", t.bytes()));
    }
    t.wait(deadline(20)).await.map_err(err)?;
    let mut want_nhd = vec![SENTINEL; (IX_PAGES * dst_page) as usize];
    let mut want_hnd = want_nhd.clone();
    for r in runs.iter() {
        for p in 0..u64::from(r.len) {
            let (sp, dp) = (u64::from(r.src) + p, u64::from(r.dst) + p);
            for tok in 0..IX_TOKENS {
                for h in 0..2 {
                    for i in 0..IX_HEAD {
                        let from = sp * src_page + (tok * 4 + 1 + h) * IX_HEAD + i;
                        want_nhd[(dp * dst_page + (tok * 2 + h) * IX_HEAD + i) as usize] = pat(from, 21);
                        let from = sp * src_page + ((2 + h) * IX_TOKENS + tok) * IX_HEAD + i;
                        want_hnd[(dp * dst_page + (h * IX_TOKENS + tok) * IX_HEAD + i) as usize] = pat(from, 21);
                    }
                }
            }
        }
    }
    for (name, view, want) in [("NHD", &nhd_view, &want_nhd), ("HND", &hnd_view, &want_hnd)] {
        let g = view.read_guard(0, want.len() as u64).map_err(err)?;
        if let Some(i) = first_diff(g.as_slice(), want) {
            return Err(format!("{name} page list: destination byte {i} (page {}) is wrong", i as u64 / dst_page));
        }
    }
    // Out of range: the second run's destination page is past the pool; nothing of the first lands.
    let mut fresh = HostBuffer::filled((IX_PAGES * dst_page) as usize, SENTINEL);
    let fresh_view = fresh.desc();
    let _f = b.register(RegionId(4), fresh_view.clone()).await.map_err(err)?;
    let peer2 = a.connect(&b.metadata().map_err(err)?).await.map_err(err)?;
    let bad: Arc<[PageRun]> =
        vec![PageRun { src: 0, dst: 0, len: 1 }, PageRun { src: 1, dst: IX_PAGES as u32, len: 1 }].into();
    match a.post_indexed(peer2, &[IndexedOp::new(WriteOp { dst: RegionId(4), ..nhd_t }, bad)], None) {
        Err(BackendError::OutOfBounds { side: "destination", .. }) => {}
        other => return Err(format!("a run past the destination pool: expected OutOfBounds, got {other:?}")),
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let g = fresh_view.read_guard(0, fresh_view.len() as u64).map_err(err)?;
    if let Some(i) = g.as_slice().iter().position(|x| *x != SENTINEL) {
        return Err(format!("a refused indexed post wrote destination byte {i}"));
    }
    // The ops-per-post limit counts an indexed op as its runs.
    let limit = a.capabilities().limits.max_ops_per_post;
    if limit < IX_PAGES {
        let many: Arc<[PageRun]> = (0..=limit as u32).map(|k| PageRun { src: k, dst: k, len: 1 }).collect();
        match a.post_indexed(peer2, &[IndexedOp::new(WriteOp { dst: RegionId(4), ..nhd_t }, many)], None) {
            Err(BackendError::Limit { .. }) => {}
            other => return Err(format!("{} runs over a limit of {limit}: expected Limit, got {other:?}", limit + 1)),
        }
    }
    Ok(())
}
