//! The conformance suite on the libfabric backend, once per provider: `tcp` (tcp;ofi_rxm on
//! 127.0.0.1) and `shm`. `KVXFER_FABRIC_PROVIDERS` (comma-separated) narrows or extends the list; the
//! usual libtest arguments (filters, `--list`) apply to every provider's run. `FI_AV_REMOVE_CLEANUP=1`
//! is set unless the environment has it (see the crate README, "Cutting a peer off").

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::Arc;

use kvxfer_conformance::BackendFactory;
use kvxfer_core::{BackendConfig, BackendError, KvTransferBackend};

struct Fabric {
    provider: String,
}

impl Fabric {
    fn config(&self, identity: u64) -> BackendConfig {
        let mut c = BackendConfig::new(identity).with("provider", self.provider.as_str()).with("timeout_ms", "20000");
        // Small receive slabs: the suite opens many endpoints at once.
        c = c.with("recv_buffers", "16").with("recv_buf_size", "16384");
        if self.provider == "tcp" {
            c = c.with("addr", "127.0.0.1");
        }
        c
    }
}

impl BackendFactory for Fabric {
    fn name(&self) -> String {
        format!("fabric({})", self.provider)
    }
    fn create(&self, identity: u64) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
        kvxfer_fabric::create(&self.config(identity))
    }
    fn agent_backend(&self) -> Option<(String, BTreeMap<String, String>)> {
        Some((kvxfer_fabric::NAME.into(), self.config(0).options))
    }
    fn create_with_secret(
        &self,
        identity: u64,
        secret: Option<kvxfer_core::Secret>,
    ) -> Option<Result<Arc<dyn KvTransferBackend>, BackendError>> {
        Some(kvxfer_fabric::create(&self.config(identity).with_secret(secret)))
    }
}

fn main() -> ExitCode {
    // Before libfabric starts (it reads the variable once): cut-offs over tcp;ofi_rxm close the
    // connection (fi_av_remove) and are confirmed; without it they are refused as unconfirmed.
    if std::env::var_os("FI_AV_REMOVE_CLEANUP").is_none() {
        std::env::set_var("FI_AV_REMOVE_CLEANUP", "1");
    }
    let providers = std::env::var("KVXFER_FABRIC_PROVIDERS").unwrap_or_else(|_| "tcp,shm".into());
    let mut ok = true;
    for p in providers.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let code = kvxfer_conformance::run_main(Arc::new(Fabric { provider: p.to_owned() }));
        ok &= code == ExitCode::SUCCESS;
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
