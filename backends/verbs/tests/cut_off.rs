//! Cutting a peer off (`KvTransferBackend::cut_off`, SEMANTICS §6 "known dead") over the in-process
//! verbs model (`--features emulator`): A and B connected both ways, A writing a large multi-piece
//! transfer into B, B cuts A off mid-transfer; from the call's return on nothing A sends lands in
//! B's memory (new posts, a reconnect of the same instance is refused), B's transfers to A are
//! final, and a new endpoint with A's identity (a restarted process) is admitted and its writes
//! land. The model drops a write that reaches a queue pair in the error state (the sender gets a
//! retry-exceeded completion, as from a real RC responder that stopped answering). A partition of
//! the model's network holds what A transmitted around the cut-off (a stopped process's NIC, or a
//! link that heals later): those writes arrive after the cut-off returned, and must not land.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::{BackendConfig, HostBuffer, KvTransferBackend, MemDesc, RegionId, TransferStatus, WriteOp};

const LEN: u64 = 16 << 20;
/// 4 KiB pieces every 8 KiB: 2048 separate writes, one per work request.
const PIECE: u64 = 4096;

fn endpoint(identity: u64) -> Arc<dyn KvTransferBackend> {
    let cfg = BackendConfig::new(identity).with("timeout_ms", "10000").with("sq_depth", "64");
    kvxfer_verbs::create_emulated(&cfg).expect("the emulated device opens")
}

/// The region's bytes; a write in progress (the guard is busy) is a failure once nothing may land.
fn bytes(view: &MemDesc) -> Vec<u8> {
    view.read_guard(0, view.len() as u64).expect("no write in progress").as_slice().to_vec()
}

fn landed(view: &MemDesc, byte: u8) -> bool {
    view.read_guard(0, view.len() as u64).is_ok_and(|g| g.as_slice().contains(&byte))
}

fn strided() -> WriteOp {
    WriteOp {
        src: RegionId(1),
        src_offset: 0,
        dst: RegionId(2),
        dst_offset: 0,
        len: PIECE,
        count: LEN / (2 * PIECE),
        src_stride: 2 * PIECE,
        dst_stride: 2 * PIECE,
    }
}

async fn wait_until(what: &str, within: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_peer_lands_nothing_and_a_restarted_one_is_admitted() {
    let a = endpoint(1);
    let b = endpoint(2);
    let mut a_src = HostBuffer::filled(LEN as usize, 0xa1);
    let mut a_dst = HostBuffer::zeroed(LEN as usize);
    let mut b_dst = HostBuffer::zeroed(LEN as usize);
    let mut b_src = HostBuffer::filled(LEN as usize, 0xb2);
    let _as = a.register(RegionId(1), a_src.desc()).await.unwrap();
    let _ad = a.register(RegionId(2), a_dst.desc()).await.unwrap();
    let view = b_dst.desc();
    let _bd = b.register(RegionId(2), view.clone()).await.unwrap();
    let _bs = b.register(RegionId(1), b_src.desc()).await.unwrap();
    // Both directions, as the engine connects.
    let ab = a.connect(&b.metadata().unwrap()).await.unwrap();
    let ba = b.connect(&a.metadata().unwrap()).await.unwrap();

    let big = a.post(ab, &[strided()], None).unwrap();
    // Mid-transfer: some pieces landed.
    wait_until("the first pieces", Duration::from_secs(10), || landed(&view, 0xa1)).await;
    // From here the network holds what is transmitted (A's remaining pieces, a late transfer of A
    // into the gaps, and B's transfer to A) until it heals, after the cut-off.
    kvxfer_verbs::emulated_partition();
    let gaps = WriteOp { dst_offset: PIECE, ..strided() };
    let late = a.post(ab, &[gaps], None).unwrap();
    let back = b.post(ba, &[strided()], None).unwrap();

    let t = Instant::now();
    let cut = b.cut_off(ba, "test: lease expired").await.expect("the cut-off is confirmed");
    let took = t.elapsed();
    eprintln!("verbs (emulated): cut_off took {took:?}: {cut:?}");
    assert!(cut.closed >= 2, "both queue pairs of the instance: {cut:?}");
    let snapshot = bytes(&view);
    assert!(back.status().is_final(), "B's transfer to A is final once the cut-off returned: {:?}", back.status());
    let held = kvxfer_verbs::emulated_heal();
    assert!(held > 0, "A had writes in the network");
    assert!(bytes(&view) == snapshot, "writes held in the network landed after the cut-off");
    let _ = late.wait(Instant::now() + Duration::from_secs(10)).await;

    // A goes on as if nothing happened: its transfer, new posts, a reconnect of the same instance.
    let _ = big.wait(Instant::now() + Duration::from_secs(10)).await;
    let mut later = Vec::new();
    for i in 0..8u64 {
        let op = WriteOp::contiguous(RegionId(1), i * PIECE, RegionId(2), i * 2 * PIECE + PIECE, PIECE);
        if let Ok(t) = a.post(ab, &[op], None) {
            later.push(t);
        }
    }
    for t in &later {
        let r = t.wait(Instant::now() + Duration::from_secs(10)).await;
        assert!(r.is_err(), "a write after the cut-off completed: {r:?}");
    }
    let again = a.connect(&b.metadata().unwrap()).await;
    assert!(again.is_err(), "the cut-off instance reconnected");
    assert!(again.unwrap_err().to_string().contains("cut off"));
    assert!(b.connect(&a.metadata().unwrap()).await.is_err(), "B connected to the cut-off instance");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(bytes(&view) == snapshot, "bytes landed in B's region after the cut-off returned");
    // Idempotent: confirmed again at once.
    assert!(b.cut_off(ba, "again").await.is_ok());

    // A restarted process: same identity, a new instance.
    let a2 = endpoint(1);
    let mut a2_src = HostBuffer::filled(LEN as usize, 0x5a);
    let _a2s = a2.register(RegionId(1), a2_src.desc()).await.unwrap();
    let a2b = a2.connect(&b.metadata().unwrap()).await.expect("a new instance is admitted");
    let _ba2 = b.connect(&a2.metadata().unwrap()).await.expect("and can be connected to");
    a2.post(a2b, &[WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, 2 * PIECE)], None)
        .unwrap()
        .wait(Instant::now() + Duration::from_secs(10))
        .await
        .unwrap();
    assert!(bytes(&view)[..2 * PIECE as usize].iter().all(|&x| x == 0x5a), "the new instance's write landed");
    assert!(matches!(back.status(), TransferStatus::Failed(_) | TransferStatus::Done));
}
