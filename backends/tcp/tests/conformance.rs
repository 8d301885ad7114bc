//! The conformance suite over real loopback TCP sockets (both notification styles are cases of the
//! suite). Each endpoint listens on 127.0.0.1 with an ephemeral port and two data streams per peer;
//! the `auth` family creates them with the cluster secret (`create_with_secret`).

use std::collections::BTreeMap;
use std::sync::Arc;

use kvxfer_conformance::BackendFactory;
use kvxfer_core::{BackendConfig, BackendError, KvTransferBackend};

struct Tcp;

impl BackendFactory for Tcp {
    fn name(&self) -> String {
        "tcp(loopback)".into()
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
    BackendConfig::new(identity).with("listen", "127.0.0.1:0").with("connections", "2")
}

fn main() -> std::process::ExitCode {
    kvxfer_conformance::run_main(Arc::new(Tcp))
}
