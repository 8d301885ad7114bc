//! GPU-ordered sends on CUDA pools (emulated driver) between tcp endpoints: a send posted after the
//! engine's event reads its source only once the engine's work is done, and posting does not block
//! the host ([`kvxfer_conformance::cuda::gpu_order_check`]).

use std::sync::Arc;

use kvxfer_core::{BackendConfig, KvTransferBackend};

fn create(identity: u64) -> Arc<dyn KvTransferBackend> {
    kvxfer_tcp::create(&BackendConfig::new(identity).with("listen", "127.0.0.1:0")).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_reads_its_source_only_after_the_engines_event() {
    kvxfer_conformance::cuda::gpu_order_check(create).await;
}
