//! The conformance suite with every pool in CUDA memory: each endpoint is a local endpoint behind
//! the device mirror (`kvxfer_cuda::mirror`), so every transfer is a CUDA copy, and every byte the
//! suite checks was read back from device memory.
//!
//! `KVXFER_TEST_CUDA=real` runs it on the machine's GPU (device `KVXFER_TEST_CUDA_DEVICE`, default
//! 0); otherwise on the emulated driver, which runs the same code on any machine. The `lifecycle`
//! family (agents made through the registry) is skipped: the registry cannot build a mirror.

use kvxfer_conformance::cuda::{run_main_cuda, CudaBackend};
use kvxfer_core::BackendConfig;

fn main() -> std::process::ExitCode {
    run_main_cuda(CudaBackend {
        name: kvxfer_local::NAME,
        label: "local(",
        config: BackendConfig::new,
        create: kvxfer_local::create,
    })
}
