//! The conformance suite on the in-process backend (both notification styles are cases of the suite).

use std::collections::BTreeMap;
use std::sync::Arc;

use kvxfer_conformance::BackendFactory;
use kvxfer_core::{BackendConfig, BackendError, KvTransferBackend};

struct Local;

impl BackendFactory for Local {
    fn name(&self) -> String {
        "local".into()
    }
    fn create(&self, identity: u64) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
        kvxfer_local::create(&BackendConfig::new(identity))
    }
    fn agent_backend(&self) -> Option<(String, BTreeMap<String, String>)> {
        Some((kvxfer_local::NAME.into(), BTreeMap::new()))
    }
    fn create_with_secret(
        &self,
        identity: u64,
        secret: Option<kvxfer_core::Secret>,
    ) -> Option<Result<Arc<dyn KvTransferBackend>, BackendError>> {
        Some(kvxfer_local::create(&BackendConfig::new(identity).with_secret(secret)))
    }
}

fn main() -> std::process::ExitCode {
    kvxfer_conformance::run_main(Arc::new(Local))
}
