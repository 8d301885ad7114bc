//! The conformance suite on cuda-ipc: every endpoint behind the device mirror
//! (`kvxfer_cuda::mirror`), which registers a device copy of each host pool the suite hands it and
//! reads every byte the suite checks back from device memory.
//!
//! `KVXFER_TEST_CUDA=real` runs it on the machine's GPU (device `KVXFER_TEST_CUDA_DEVICE`, default
//! 0): all endpoints are in this process, so imports resolve through the process's own exports (a
//! CUDA IPC handle cannot be opened by its exporter; the cross-process path is what
//! `scripts/gpu-check.sh` runs). Otherwise it runs on the emulated driver, whose handles open in the
//! exporting process, so the import path runs too. The `lifecycle` family (agents made through the
//! registry) is skipped: the registry cannot build a mirror.

use std::sync::Arc;

use kvxfer_conformance::BackendFactory;
use kvxfer_core::{BackendConfig, BackendError, KvTransferBackend};

struct CudaIpc {
    device: u32,
    skip: Option<String>,
}

impl CudaIpc {
    fn wrap(
        &self,
        b: Result<Arc<dyn KvTransferBackend>, BackendError>,
    ) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
        kvxfer_cuda::mirror::Mirror::wrap(b?, self.device)
            .map_err(|e| BackendError::NoDevice { backend: kvxfer_cuda_ipc::NAME, detail: e.to_string() })
    }
}

impl BackendFactory for CudaIpc {
    fn name(&self) -> String {
        let d = kvxfer_cuda::driver().map(|d| d.library().to_owned()).unwrap_or_else(|e| e.to_string());
        format!("cuda-ipc(device {}, driver {d})", self.device)
    }
    fn create(&self, identity: u64) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
        self.wrap(kvxfer_cuda_ipc::create(&BackendConfig::new(identity)))
    }
    fn skip_reason(&self) -> Option<String> {
        self.skip.clone()
    }
    fn create_with_secret(
        &self,
        identity: u64,
        secret: Option<kvxfer_core::Secret>,
    ) -> Option<Result<Arc<dyn KvTransferBackend>, BackendError>> {
        Some(self.wrap(kvxfer_cuda_ipc::create(&BackendConfig::new(identity).with_secret(secret))))
    }
}

fn main() -> std::process::ExitCode {
    let real = std::env::var("KVXFER_TEST_CUDA").is_ok_and(|v| v == "real");
    if !real {
        kvxfer_cuda::emulation::install();
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
        return std::process::ExitCode::FAILURE;
    }
    kvxfer_conformance::run_main(Arc::new(CudaIpc { device, skip }))
}
