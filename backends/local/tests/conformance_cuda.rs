//! The conformance suite with every pool in CUDA memory: each endpoint is a local endpoint behind
//! the device mirror (`kvxfer_cuda::mirror`), so every transfer is a CUDA copy, and every byte the
//! suite checks was read back from device memory.
//!
//! `KVXFER_TEST_CUDA=real` runs it on the machine's GPU (device `KVXFER_TEST_CUDA_DEVICE`, default
//! 0); otherwise on the emulated driver, which runs the same code on any machine. The `lifecycle`
//! family (agents made through the registry) is skipped: the registry cannot build a mirror.

use std::sync::Arc;

use kvxfer_conformance::BackendFactory;
use kvxfer_core::{BackendConfig, BackendError, KvTransferBackend};

struct CudaLocal {
    device: u32,
    skip: Option<String>,
}

impl CudaLocal {
    fn wrap(
        &self,
        b: Result<Arc<dyn KvTransferBackend>, BackendError>,
    ) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
        kvxfer_cuda::mirror::Mirror::wrap(b?, self.device)
            .map_err(|e| BackendError::NoDevice { backend: "local", detail: e.to_string() })
    }
}

impl BackendFactory for CudaLocal {
    fn name(&self) -> String {
        let d = kvxfer_cuda::driver().map(|d| d.library().to_owned()).unwrap_or_else(|e| e.to_string());
        format!("local(CUDA device {} pools, driver {d})", self.device)
    }
    fn create(&self, identity: u64) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
        self.wrap(kvxfer_local::create(&BackendConfig::new(identity)))
    }
    fn skip_reason(&self) -> Option<String> {
        self.skip.clone()
    }
    fn create_with_secret(
        &self,
        identity: u64,
        secret: Option<kvxfer_core::Secret>,
    ) -> Option<Result<Arc<dyn KvTransferBackend>, BackendError>> {
        Some(self.wrap(kvxfer_local::create(&BackendConfig::new(identity).with_secret(secret))))
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
    kvxfer_conformance::run_main(Arc::new(CudaLocal { device, skip }))
}
