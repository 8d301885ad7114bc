//! The conformance factory both tcp suites share: loopback endpoints (127.0.0.1, an ephemeral port)
//! with the suite's options on top; the `auth` family creates them with the cluster secret
//! (`create_with_secret`).

use std::collections::BTreeMap;
use std::sync::Arc;

use kvxfer_conformance::BackendFactory;
use kvxfer_core::{BackendConfig, BackendError, KvTransferBackend};

/// A tcp endpoint factory: `name` is the suite's label, `options` the backend options after
/// `listen=127.0.0.1:0`.
pub struct Tcp {
    pub name: &'static str,
    pub options: &'static [(&'static str, &'static str)],
}

impl Tcp {
    fn config(&self, identity: u64) -> BackendConfig {
        self.options.iter().fold(BackendConfig::new(identity).with("listen", "127.0.0.1:0"), |c, (k, v)| c.with(k, *v))
    }
}

impl BackendFactory for Tcp {
    fn name(&self) -> String {
        self.name.into()
    }
    fn create(&self, identity: u64) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
        kvxfer_tcp::create(&self.config(identity))
    }
    fn agent_backend(&self) -> Option<(String, BTreeMap<String, String>)> {
        Some((kvxfer_tcp::NAME.into(), self.config(0).options))
    }
    fn create_with_secret(
        &self,
        identity: u64,
        secret: Option<kvxfer_core::Secret>,
    ) -> Option<Result<Arc<dyn KvTransferBackend>, BackendError>> {
        Some(kvxfer_tcp::create(&self.config(identity).with_secret(secret)))
    }
}

/// Runs the whole suite over `factory` (the test binary's `main`).
pub fn run(factory: Tcp) -> std::process::ExitCode {
    kvxfer_conformance::run_main(Arc::new(factory))
}
