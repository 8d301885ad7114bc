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

use kvxfer_conformance::cuda::{run_main_cuda, CudaBackend};
use kvxfer_core::BackendConfig;

fn main() -> std::process::ExitCode {
    run_main_cuda(CudaBackend {
        name: kvxfer_cuda_ipc::NAME,
        label: "cuda-ipc(",
        config: BackendConfig::new,
        create: kvxfer_cuda_ipc::create,
    })
}
