//! The conformance suite with every pool in CUDA memory: each endpoint is a tcp endpoint behind
//! the device mirror (`kvxfer_cuda::mirror`), so every frame goes through the CUDA staging slots
//! on both sides, and every byte the suite checks was read back from device memory.
//!
//! `KVXFER_TEST_CUDA=real` runs it on the machine's GPU (device `KVXFER_TEST_CUDA_DEVICE`, default
//! 0); otherwise on the emulated driver, which runs the same code on any machine. The `lifecycle`
//! family (agents made through the registry) is skipped: the registry cannot build a mirror.

use kvxfer_conformance::cuda::{run_main_cuda, CudaBackend};
use kvxfer_core::BackendConfig;

fn main() -> std::process::ExitCode {
    run_main_cuda(CudaBackend {
        name: kvxfer_tcp::NAME,
        label: "tcp(loopback, ",
        config: |identity| BackendConfig::new(identity).with("listen", "127.0.0.1:0").with("connections", "2"),
        create: kvxfer_tcp::create,
    })
}
