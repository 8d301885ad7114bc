//! GPU-ordered sends on CUDA pools (emulated driver): the engine's stream is busy (a stalled "kernel",
//! then the copy that produces the KV) when the send is posted with its event; the bytes that land
//! are the produced ones, and the host was not blocked (post returns at once). The same send from a
//! host pool waits for the event on the host.
#![allow(unsafe_code)] // CudaHandle::from_raw of the test's own event and stream

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::{BackendConfig, CudaHandle, GpuOrder, HostBuffer, KvTransferBackend, MemDesc, RegionId, WriteOp};
use kvxfer_cuda::{context, emulation, CopyPlan, DeviceBuffer, Event, PinnedBuffer, Shape, Stream};

const LEN: usize = 1 << 20;

fn create(identity: u64) -> Arc<dyn KvTransferBackend> {
    kvxfer_cuda_ipc::create(&BackendConfig::new(identity)).unwrap()
}

/// The engine writing its own pool (not through kvxfer's guards: a view of the same memory),
/// queued on its stream; the returned copy completes on its own.
fn fill(stream: &Stream, dst: &MemDesc, byte: u8) -> kvxfer_cuda::Pending {
    let p = std::ptr::NonNull::new(dst.addr()).unwrap();
    // SAFETY: a second description of the test's own live device buffer, used only for this copy.
    let view = unsafe { MemDesc::from_raw_parts(p, dst.len(), dst.kind()) };
    let mut h = HostBuffer::filled(LEN, byte);
    let hd = h.desc();
    let l = LEN as u64;
    let mut plan = CopyPlan::new();
    plan.copy(
        hd.reserve(0, l, 1, l, false).unwrap(),
        Shape::contiguous(0, l),
        view.reserve(0, l, 1, l, true).unwrap(),
        Shape::contiguous(0, l),
    )
    .unwrap();
    plan.keep((view, hd));
    stream.submit(plan).unwrap()
}

fn read(stream: &Stream, src: &MemDesc) -> Vec<u8> {
    let l = LEN as u64;
    let mut plan = CopyPlan::with_pinned(PinnedBuffer::new(stream.context(), LEN).unwrap());
    plan.to_pinned(src.reserve(0, l, 1, l, false).unwrap(), Shape::contiguous(0, l), 0).unwrap();
    let p = stream.submit(plan).unwrap();
    p.wait_blocking(stream, Instant::now() + Duration::from_secs(10)).unwrap();
    p.finish().unwrap().pinned.unwrap().as_slice().to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_reads_its_source_only_after_the_engines_event() {
    emulation::install();
    let ctx = context(0).unwrap();
    let engine = Stream::new(&ctx).unwrap();
    let (a, b) = (create(1), create(2));
    let src = DeviceBuffer::new(&ctx, LEN).unwrap().into_desc();
    let dst = DeviceBuffer::new(&ctx, LEN).unwrap().into_desc();
    let mut produced = vec![fill(&engine, &src, 0), fill(&engine, &dst, 0xEE)];
    engine.synchronize().unwrap();
    let _rs = a.register(RegionId(1), src.clone()).await.unwrap();
    let _rd = b.register(RegionId(2), dst.clone()).await.unwrap();
    let peer = a.connect(&b.metadata().unwrap()).await.unwrap();
    let op = [WriteOp::contiguous(RegionId(1), 0, RegionId(2), 0, LEN as u64)];
    for (round, by_event) in [(1u8, true), (2, false)] {
        // The engine's "kernel": a long stall, then the copy that writes the source.
        emulation::stall(&engine, Duration::from_millis(300));
        produced.push(fill(&engine, &src, round));
        let order = if by_event {
            let ev = Event::new(&ctx).unwrap();
            ev.record(&engine).unwrap();
            // SAFETY: the test's own live event on device 0; the send captures it during the call.
            let o = GpuOrder::AfterEvent(unsafe { CudaHandle::from_raw(ev.raw(), 0) });
            drop(ev); // the engine may let its event go right after the call
            o
        } else {
            // SAFETY: the test's own live stream on device 0.
            GpuOrder::AfterStream(unsafe { CudaHandle::from_raw(engine.raw(), 0) })
        };
        let t0 = Instant::now();
        let t = a.post_ordered(peer, &op, None, order).unwrap();
        assert!(t0.elapsed() < Duration::from_millis(200), "post blocked the host for {:?}", t0.elapsed());
        t.wait(Instant::now() + Duration::from_secs(20)).await.unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(250), "done before the engine's work could complete");
        let got = read(&engine, &dst);
        assert!(got.iter().all(|x| *x == round), "round {round}: the bytes that landed are not the produced ones");
    }
    engine.synchronize().unwrap();
    drop(produced);
}
