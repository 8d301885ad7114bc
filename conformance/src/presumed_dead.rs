//! The `presumed_dead` family (SEMANTICS §6, "known dead"; issue 32): a rank that gives up on a
//! peer cuts it off ([`KvTransferBackend::cut_off`]) before it reuses the memory that peer could
//! write, and the peer may well be alive: a stopped process resumes with its queued writes, a
//! partition heals. The cases check the backend's promise: once `cut_off` returned `Ok`, nothing the
//! cut-off instance sent or sends lands, while a new instance of the same identity (a restarted
//! process) is admitted.
//!
//! - `presumed_dead::nothing_lands_after_cut_off`: A and B connected both ways (as two ranks are:
//!   each connects to the other), each with a large transfer in flight to the other; B cuts A off
//!   mid-transfer. After `Ok`, B's destination is snapshotted (a read guard: no write may be under
//!   way); B's own transfers to A are final; A then keeps posting on its old connection, notifies,
//!   and connects again with the same endpoint (refused, or its writes never land); after a pause
//!   B's memory is still the snapshot and no notification of A's reached B after the cut. Then a new
//!   endpoint with A's identity connects to B and its write lands.
//! - `presumed_dead::cut_off_is_idempotent_and_bounded`: cutting off an unknown peer is a typed
//!   error at once, a cut-off of an idle peer returns within the bound, and a second one of the same
//!   id answers at once (`UnknownPeer`, or the first outcome where the backend remembers it).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::oracle::SENTINEL;
use kvxfer_core::{
    BackendError, BackendEvent, HostBuffer, KvTransferBackend, NotifyStyle, PeerId, RegionId, RequestId, SenderKey,
    TransferStatus, WriteOp,
};

use crate::{err, BackendFactory};

/// Bytes of each direction's transfer (large enough that the cut lands mid-way).
const TOTAL: u64 = 32 << 20;
/// Bytes per op.
const BLOCK: u64 = 64 << 10;
/// The longest a cut-off may take here (the engine's default bound is 10 s).
const CUT_BOUND: Duration = Duration::from_secs(10);
/// How long the resumed peer keeps trying before the final check.
const PAUSE: Duration = Duration::from_millis(600);

fn deadline(s: u64) -> Instant {
    Instant::now() + Duration::from_secs(s)
}

fn filled(len: u64, seed: u8) -> HostBuffer {
    let data: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect();
    HostBuffer::from_slice(&data)
}

fn ops(src: RegionId, dst: RegionId, len: u64) -> Vec<WriteOp> {
    (0..len / BLOCK).map(|k| WriteOp::contiguous(src, k * BLOCK, dst, (len / BLOCK - 1 - k) * BLOCK, BLOCK)).collect()
}

/// Posts in chunks of at most the endpoint's ops-per-post limit; an error ends the posting (the
/// peer may refuse at any point once cut off).
fn post_some(be: &dyn KvTransferBackend, peer: PeerId, all: &[WriteOp]) -> Vec<kvxfer_core::Transfer> {
    let per = be.capabilities().limits.max_ops_per_post.clamp(1, 64) as usize;
    let mut out = Vec::new();
    for c in all.chunks(per) {
        match be.post(peer, c, None) {
            Ok(t) => out.push(t),
            Err(_) => break,
        }
    }
    out
}

/// The whole region, read under a guard (an error: a write into it is under way).
fn snapshot(view: &kvxfer_core::MemDesc, when: &str) -> Result<Vec<u8>, String> {
    let g = view.read_guard(0, view.len() as u64).map_err(|e| format!("{when}: a write is still under way: {e}"))?;
    Ok(g.as_slice().to_vec())
}

/// Notifications from `identity` that `be` delivers within `within`.
async fn notes_from(be: &dyn KvTransferBackend, identity: u64, within: Duration) -> Result<usize, String> {
    let until = Instant::now() + within;
    let mut n = 0;
    while Instant::now() < until {
        for e in be.recv(Duration::from_millis(50)).await.map_err(err)? {
            if let BackendEvent::Notification(note) = e {
                if note.sender.to_u64() == identity {
                    n += 1;
                }
            }
        }
    }
    Ok(n)
}

pub(crate) async fn nothing_lands_after_cut_off(f: Arc<dyn BackendFactory>, _: NotifyStyle) -> Result<(), String> {
    const A_ID: u64 = 0x2_0001;
    const B_ID: u64 = 0x2_0002;
    let a = f.create(A_ID).map_err(err)?;
    let b = f.create(B_ID).map_err(err)?;
    if !b.capabilities().cut_off_live {
        return refused_for_a_live_peer(a, b).await;
    }
    let mut a_src = filled(TOTAL, 1);
    // What A sends once it resumed: other bytes than before, so that any of them landing shows.
    let mut a_later = filled(TOTAL, 9);
    let mut a_dst = HostBuffer::filled(TOTAL as usize, SENTINEL);
    let mut b_src = filled(TOTAL, 2);
    let mut b_dst = HostBuffer::filled(TOTAL as usize, SENTINEL);
    let _r1 = a.register(RegionId(1), a_src.desc()).await.map_err(err)?;
    let _r1b = a.register(RegionId(3), a_later.desc()).await.map_err(err)?;
    let _r2 = a.register(RegionId(2), a_dst.desc()).await.map_err(err)?;
    let _r3 = b.register(RegionId(1), b_src.desc()).await.map_err(err)?;
    let b_view = b_dst.desc();
    let _r4 = b.register(RegionId(2), b_view.clone()).await.map_err(err)?;
    let a_to_b = a.connect(&b.metadata().map_err(err)?).await.map_err(err)?;
    let b_to_a = b.connect(&a.metadata().map_err(err)?).await.map_err(err)?;
    let a_meta_before = a.metadata().map_err(err)?;

    // Both directions in flight, then B gives up on A.
    let a_ts = post_some(a.as_ref(), a_to_b, &ops(RegionId(1), RegionId(2), TOTAL));
    let b_ts = post_some(b.as_ref(), b_to_a, &ops(RegionId(1), RegionId(2), TOTAL));
    tokio::time::sleep(Duration::from_millis(2)).await;
    let t0 = Instant::now();
    let cut = tokio::time::timeout(CUT_BOUND, b.cut_off(b_to_a, "conformance: presumed dead"))
        .await
        .map_err(|_| format!("cut_off did not return within {CUT_BOUND:?}"))?
        .map_err(|e| format!("cut_off was not confirmed: {e}"))?;
    let took = t0.elapsed();
    let snap = snapshot(&b_view, "right after cut_off returned")?;
    for t in &b_ts {
        if !t.status().is_final() {
            return Err(format!("B's transfer to A is still in flight after cut_off returned ({cut:?})"));
        }
    }
    if b.post(b_to_a, &[WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 4096)], None).is_ok() {
        return Err("B could still post to the peer it cut off".into());
    }

    // A resumes: more writes and a notification on its old connection, then a new connection of the
    // same endpoint (the same instance).
    let more = post_some(a.as_ref(), a_to_b, &ops(RegionId(3), RegionId(2), TOTAL));
    let note = kvxfer_core::Notification::chunk(RequestId(1), SenderKey::from_u64(A_ID), 0, true);
    let _ = tokio::time::timeout(Duration::from_secs(2), a.notify(a_to_b, &note)).await;
    let again = tokio::time::timeout(Duration::from_secs(10), a.connect(&b.metadata().map_err(err)?)).await;
    let mut late = Vec::new();
    if let Ok(Ok(p)) = again {
        late = post_some(a.as_ref(), p, &ops(RegionId(3), RegionId(2), 1 << 20));
        let _ = tokio::time::timeout(Duration::from_secs(2), a.notify(p, &note)).await;
    }
    let delivered = notes_from(b.as_ref(), A_ID, PAUSE).await?;
    // Every transfer of A's ends one way or another (none may hang: at the latest by A's own
    // transport deadline), and still nothing landed.
    for t in a_ts.iter().chain(&more).chain(&late) {
        let _ = t.wait(deadline(60)).await;
        if !t.status().is_final() {
            return Err(format!("A's transfer to the endpoint that cut it off never ended: {t:?}"));
        }
    }
    let after = snapshot(&b_view, "after the cut-off peer resumed")?;
    if let Some(i) = after.iter().zip(&snap).position(|(x, y)| x != y) {
        return Err(format!(
            "byte {i} of B's memory changed after cut_off returned (the cut-off peer's write landed; cut-off took {took:?})"
        ));
    }
    if delivered > 0 {
        return Err(format!("{delivered} notification(s) of the cut-off peer were delivered after the cut-off"));
    }
    let unfinished = b_ts.iter().filter(|t| !matches!(t.status(), TransferStatus::Done)).count();
    if cut.failed_transfers > unfinished {
        return Err(format!(
            "CutOff reports {} failed transfers, but only {unfinished} of B's {} did not finish",
            cut.failed_transfers,
            b_ts.len()
        ));
    }

    // A restarted process (a new endpoint with A's identity) is admitted, and its write lands.
    let a2 = f.create(A_ID).map_err(err)?;
    let mut a2_src = filled(1 << 20, 3);
    let want = a2_src.to_vec().map_err(err)?;
    let _r5 = a2.register(RegionId(1), a2_src.desc()).await.map_err(err)?;
    if a2.metadata().map_err(err)? == a_meta_before {
        return Err("a new endpoint published the same metadata as the one cut off".into());
    }
    let p2 = a2.connect(&b.metadata().map_err(err)?).await.map_err(|e| format!("a new instance was refused: {e}"))?;
    a2.post(p2, &[WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 1 << 20)], None)
        .map_err(err)?
        .wait(deadline(30))
        .await
        .map_err(|e| format!("a new instance's write: {e}"))?;
    let got = snapshot(&b_view, "after the new instance's write")?;
    if got[..1 << 20] != want[..] {
        return Err("the new instance's write did not land".into());
    }
    drop(b_view);
    Ok(())
}

/// A backend that cannot cut off a live peer (`cut_off_live == false`) says so: its `cut_off` of a
/// connected peer in this (live) process is refused with `Unsupported` within its bound, so the
/// engine quarantines.
async fn refused_for_a_live_peer(a: Arc<dyn KvTransferBackend>, b: Arc<dyn KvTransferBackend>) -> Result<(), String> {
    let _ = a.connect(&b.metadata().map_err(err)?).await.map_err(err)?;
    let p = b.connect(&a.metadata().map_err(err)?).await.map_err(err)?;
    match tokio::time::timeout(Duration::from_secs(30), b.cut_off(p, "conformance: presumed dead")).await {
        Ok(Err(BackendError::Unsupported { .. })) => Ok(()),
        Ok(other) => Err(format!("cut_off_live is false, but cutting off a live peer answered {other:?}")),
        Err(_) => Err("cut_off of a live peer did not answer within 30 s".into()),
    }
}

pub(crate) async fn cut_off_is_idempotent_and_bounded(
    f: Arc<dyn BackendFactory>,
    _: NotifyStyle,
) -> Result<(), String> {
    let a = f.create(0x2_0011).map_err(err)?;
    let b = f.create(0x2_0012).map_err(err)?;
    match b.cut_off(PeerId(9_999), "unknown").await {
        Err(BackendError::UnknownPeer { .. }) => {}
        other => return Err(format!("cutting off an unknown peer: expected UnknownPeer, got {other:?}")),
    }
    let _ = a.connect(&b.metadata().map_err(err)?).await.map_err(err)?;
    let p = b.connect(&a.metadata().map_err(err)?).await.map_err(err)?;
    if !b.capabilities().cut_off_live {
        return Ok(()); // refused for a live peer: `nothing_lands_after_cut_off` checks that
    }
    let t0 = Instant::now();
    tokio::time::timeout(CUT_BOUND, b.cut_off(p, "idle peer"))
        .await
        .map_err(|_| format!("cut_off of an idle peer did not return within {CUT_BOUND:?}"))?
        .map_err(|e| format!("cut_off of an idle peer: {e}"))?;
    if t0.elapsed() > CUT_BOUND {
        return Err("cut_off of an idle peer took longer than its bound".into());
    }
    // Idempotent, at once: the id is unknown now, or the backend remembers the cut instance.
    let t1 = Instant::now();
    match b.cut_off(p, "again").await {
        Err(BackendError::UnknownPeer { .. }) | Ok(_) if t1.elapsed() < Duration::from_secs(1) => Ok(()),
        other => Err(format!("a second cut_off of the same id: expected UnknownPeer or Ok at once, got {other:?}")),
    }
}
