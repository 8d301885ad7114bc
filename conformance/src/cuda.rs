//! CUDA pools (feature `cuda`): what the backends' CUDA test targets share.
//!
//! [`run_main_cuda`] runs the conformance suite with every pool in CUDA memory: each endpoint is an
//! endpoint of the backend under test behind the device mirror (`kvxfer_cuda::mirror`), so every
//! byte the suite checks was read back from device memory. [`gpu_order_check`] is the GPU-ordered
//! send check on CUDA pools (emulated driver).
// gpu_order_check: a MemDesc view of its own device buffer, CudaHandle::from_raw of its own event and stream.
#![allow(unsafe_code)]

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer_core::{
    BackendConfig, BackendError, CudaHandle, GpuOrder, HostBuffer, KvTransferBackend, MemDesc, RegionId, Secret,
    WriteOp,
};
use kvxfer_cuda::{context, emulation, CopyPlan, DeviceBuffer, Event, PinnedBuffer, Shape, Stream};

use crate::BackendFactory;

/// A backend's `create` (e.g. `kvxfer_tcp::create`).
pub type CreateFn = fn(&BackendConfig) -> Result<Arc<dyn KvTransferBackend>, BackendError>;

/// The backend under the suite on CUDA pools.
#[derive(Clone, Copy)]
pub struct CudaBackend {
    /// The backend's static name (its `NAME`): the `NoDevice` error of a failed mirror names it.
    pub name: &'static str,
    /// The report's name up to the device, e.g. `"tcp(loopback, "`: the suite reports
    /// `{label}CUDA device {device} pools, driver {library})`.
    pub label: &'static str,
    /// The configuration of the endpoint with this identity (the `auth` family adds its secret).
    pub config: fn(u64) -> BackendConfig,
    /// The backend's `create`.
    pub create: CreateFn,
}

/// The backend's endpoints behind the device mirror on CUDA device `device`.
struct Mirrored {
    backend: CudaBackend,
    device: u32,
    skip: Option<String>,
}

impl Mirrored {
    fn wrap(
        &self,
        b: Result<Arc<dyn KvTransferBackend>, BackendError>,
    ) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
        kvxfer_cuda::mirror::Mirror::wrap(b?, self.device)
            .map_err(|e| BackendError::NoDevice { backend: self.backend.name, detail: e.to_string() })
    }
}

impl BackendFactory for Mirrored {
    fn name(&self) -> String {
        let d = kvxfer_cuda::driver().map(|d| d.library().to_owned()).unwrap_or_else(|e| e.to_string());
        format!("{}CUDA device {} pools, driver {d})", self.backend.label, self.device)
    }
    fn create(&self, identity: u64) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
        self.wrap((self.backend.create)(&(self.backend.config)(identity)))
    }
    fn skip_reason(&self) -> Option<String> {
        self.skip.clone()
    }
    fn create_with_secret(
        &self,
        identity: u64,
        secret: Option<Secret>,
    ) -> Option<Result<Arc<dyn KvTransferBackend>, BackendError>> {
        Some(self.wrap((self.backend.create)(&(self.backend.config)(identity).with_secret(secret))))
    }
}

/// The `main` of a backend's conformance target on CUDA pools: [`crate::run_main`] with every
/// endpoint behind the device mirror.
///
/// `KVXFER_TEST_CUDA=real` runs it on the machine's GPU (device `KVXFER_TEST_CUDA_DEVICE`, default
/// 0), and a missing driver or device is then a failure, not a skip; otherwise it runs on the
/// emulated driver, which runs the same code on any machine (every case is skipped, naming why, if
/// the device is still missing). The `lifecycle` family (agents made through the registry) is
/// skipped: the registry cannot build a mirror.
pub fn run_main_cuda(backend: CudaBackend) -> ExitCode {
    let real = std::env::var("KVXFER_TEST_CUDA").is_ok_and(|v| v == "real");
    if !real {
        emulation::install();
    }
    let device = std::env::var("KVXFER_TEST_CUDA_DEVICE").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    let skip = match kvxfer_cuda::driver().and_then(|d| d.device_count()) {
        Ok(n) if n > device => None,
        Ok(n) => Some(format!("no CUDA device {device} (this host has {n})")),
        Err(e) => Some(format!("no CUDA driver: {e}")),
    };
    if let (true, Some(why)) = (real, &skip) {
        // Asked for the GPU: a missing one is a failure, not a skip.
        eprintln!("KVXFER_TEST_CUDA=real but {why}");
        return ExitCode::FAILURE;
    }
    crate::run_main(Arc::new(Mirrored { backend, device, skip }))
}

const LEN: usize = 1 << 20;

/// The engine writing its own pool (not through kvxfer's guards: a view of the same memory),
/// queued on its stream; the returned copy completes on its own.
fn fill(stream: &Stream, dst: &MemDesc, byte: u8) -> kvxfer_cuda::Pending {
    let p = std::ptr::NonNull::new(dst.addr()).unwrap();
    // SAFETY: a second description of the check's own live device buffer, used only for this copy.
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

/// GPU-ordered sends on CUDA pools (emulated driver), between two endpoints made by `create`
/// (identities 1 and 2): the engine's stream is busy (a stalled "kernel", then the copy that
/// produces the KV) when the send is posted, once ordered after an event recorded on that stream
/// and once after the stream itself (`GpuOrder::AfterEvent`, `GpuOrder::AfterStream`); each time the
/// bytes that land are the produced ones, and the host was not blocked (post returns at once).
///
/// Panics on any failure; call it from a multi-threaded tokio test
/// (`#[tokio::test(flavor = "multi_thread", worker_threads = 2)]`).
pub async fn gpu_order_check(create: impl Fn(u64) -> Arc<dyn KvTransferBackend>) {
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
            // SAFETY: the check's own live event on device 0; the send captures it during the call.
            let o = GpuOrder::AfterEvent(unsafe { CudaHandle::from_raw(ev.raw(), 0) });
            drop(ev); // the engine may let its event go right after the call
            o
        } else {
            // SAFETY: the check's own live stream on device 0.
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
