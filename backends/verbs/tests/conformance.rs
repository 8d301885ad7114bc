//! The conformance suite on the verbs backend.
//!
//! Device selection comes from the environment (`KVXFER_VERBS_DEVICE`, `KVXFER_VERBS_PORT`,
//! `KVXFER_VERBS_GID_INDEX`, `KVXFER_VERBS_LISTEN`; see the crate README). On a host without a usable
//! RDMA device every case is reported skipped with the reason `ibv_get_device_list` (or the port
//! query) gave; skipped cases are counted and printed, never counted as passed.
//!
//! Built with `--features emulator`, the same suite runs the backend over the in-process software
//! model of the verbs layer (`src/emu.rs`) and reports itself as `verbs(emulated)`.

use std::sync::Arc;

use kvxfer_conformance::BackendFactory;
use kvxfer_core::{BackendConfig, BackendError, KvTransferBackend};

struct Verbs {
    skip: Option<String>,
}

impl BackendFactory for Verbs {
    fn name(&self) -> String {
        if kvxfer_verbs::EMULATED {
            return "verbs(emulated)".into();
        }
        match std::env::var("KVXFER_VERBS_DEVICE") {
            Ok(d) if !d.is_empty() => format!("verbs({d})"),
            _ => "verbs".into(),
        }
    }
    fn create(&self, identity: u64) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
        kvxfer_verbs::create(&BackendConfig::new(identity))
    }
    fn skip_reason(&self) -> Option<String> {
        self.skip.clone()
    }
}

fn main() -> std::process::ExitCode {
    let skip = kvxfer_verbs::no_device_reason(&BackendConfig::new(0));
    kvxfer_conformance::run_main(Arc::new(Verbs { skip }))
}
