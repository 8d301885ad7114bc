//! The conformance suite over loopback TCP with polling on (`poll_us`, one data stream per peer):
//! the polling reads and writes go through plain system calls on the borrowed socket instead of
//! tokio's, so they get the whole suite of their own, failure and abort cases included.

use std::collections::BTreeMap;
use std::sync::Arc;

use kvxfer_conformance::BackendFactory;
use kvxfer_core::{BackendConfig, BackendError, KvTransferBackend};

struct TcpPolling;

impl BackendFactory for TcpPolling {
    fn name(&self) -> String {
        "tcp(loopback, poll_us=100)".into()
    }
    fn create(&self, identity: u64) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
        kvxfer_tcp::create(&config(identity))
    }
    fn agent_backend(&self) -> Option<(String, BTreeMap<String, String>)> {
        Some((kvxfer_tcp::NAME.into(), config(0).options))
    }
    fn create_with_secret(
        &self,
        identity: u64,
        secret: Option<kvxfer_core::Secret>,
    ) -> Option<Result<Arc<dyn KvTransferBackend>, BackendError>> {
        Some(kvxfer_tcp::create(&config(identity).with_secret(secret)))
    }
}

fn config(identity: u64) -> BackendConfig {
    BackendConfig::new(identity).with("listen", "127.0.0.1:0").with("connections", "1").with("poll_us", "100")
}

fn main() -> std::process::ExitCode {
    kvxfer_conformance::run_main(Arc::new(TcpPolling))
}
