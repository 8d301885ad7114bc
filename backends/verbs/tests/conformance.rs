//! The conformance suite on the verbs backend.
//!
//! Device selection comes from the environment (`KVXFER_VERBS_DEVICE`, `KVXFER_VERBS_PORT`,
//! `KVXFER_VERBS_GID_INDEX`, `KVXFER_VERBS_LISTEN`; see the crate README). On a host without a usable
//! RDMA device every case is reported skipped with the reason `ibv_get_device_list` (or the port
//! query) gave; skipped cases are counted and printed, never counted as passed.
//!
//! Built with `--features emulator` (and no `KVXFER_VERBS_DEVICE` naming a real device), the same
//! suite runs the backend over the in-process model of the verbs layer (`device=emulated`,
//! src/emu.rs) and reports itself as `verbs(emulated)`. The `auth` family runs with endpoints
//! configured with the cluster secret (`create_with_secret`).

use std::collections::BTreeMap;
use std::sync::Arc;

use kvxfer_conformance::BackendFactory;
use kvxfer_core::{BackendConfig, BackendError, KvTransferBackend, Secret};

struct Verbs {
    config: BackendConfig,
    label: String,
    skip: Option<String>,
}

impl BackendFactory for Verbs {
    fn name(&self) -> String {
        self.label.clone()
    }
    fn create(&self, identity: u64) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
        kvxfer_verbs::create(&BackendConfig { identity, ..self.config.clone() })
    }
    fn skip_reason(&self) -> Option<String> {
        self.skip.clone()
    }
    fn agent_backend(&self) -> Option<(String, BTreeMap<String, String>)> {
        Some((kvxfer_verbs::NAME.into(), self.config.options.clone()))
    }
    fn create_with_secret(
        &self,
        identity: u64,
        secret: Option<Secret>,
    ) -> Option<Result<Arc<dyn KvTransferBackend>, BackendError>> {
        Some(kvxfer_verbs::create(&BackendConfig { identity, ..self.config.clone() }.with_secret(secret)))
    }
}

fn main() -> std::process::ExitCode {
    let device = std::env::var("KVXFER_VERBS_DEVICE").ok().filter(|d| !d.is_empty());
    let mut config = BackendConfig::new(0);
    let label = match device {
        Some(d) => format!("verbs({d})"),
        None if kvxfer_verbs::EMULATED => {
            config = config.with("device", kvxfer_verbs::EMULATED_DEVICE);
            "verbs(emulated)".into()
        }
        None => "verbs".into(),
    };
    let skip = kvxfer_verbs::no_device_reason(&config);
    kvxfer_conformance::run_main(Arc::new(Verbs { config, label, skip }))
}
