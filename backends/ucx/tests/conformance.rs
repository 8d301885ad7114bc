//! The conformance suite on the UCX backend, once per transport set: `tcp` (tcp on `lo`, writes on
//! the active-message data path) and `shm` (posix, sysv, cma, self: writes as `ucp_put_nbx` over
//! cma). `KVXFER_UCX_TRANSPORTS` (`;`-separated names from that list) narrows the list; the usual
//! libtest arguments (filters, `--list`) apply to every transport's run.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::Arc;

use kvxfer_conformance::BackendFactory;
use kvxfer_core::{BackendConfig, BackendError, KvTransferBackend};

struct Ucx {
    name: &'static str,
    tls: &'static str,
}

const TRANSPORTS: [Ucx; 2] = [Ucx { name: "tcp", tls: "tcp" }, Ucx { name: "shm", tls: "posix,sysv,cma,self" }];

impl BackendFactory for Ucx {
    fn name(&self) -> String {
        format!("ucx({})", self.name)
    }

    fn create(&self, identity: u64) -> Result<Arc<dyn KvTransferBackend>, BackendError> {
        kvxfer_ucx::create(&self.config(identity))
    }

    fn agent_backend(&self) -> Option<(String, BTreeMap<String, String>)> {
        Some((kvxfer_ucx::NAME.into(), self.config(0).options))
    }

    fn create_with_secret(
        &self,
        identity: u64,
        secret: Option<kvxfer_core::Secret>,
    ) -> Option<Result<Arc<dyn KvTransferBackend>, BackendError>> {
        Some(kvxfer_ucx::create(&self.config(identity).with_secret(secret)))
    }
}

impl Ucx {
    fn config(&self, identity: u64) -> BackendConfig {
        let mut c = BackendConfig::new(identity).with("tls", self.tls).with("timeout_ms", "20000");
        if self.tls.contains("tcp") {
            c = c.with("net_devices", "lo");
        }
        c
    }
}

fn main() -> ExitCode {
    let wanted = std::env::var("KVXFER_UCX_TRANSPORTS").unwrap_or_else(|_| "tcp;shm".into());
    let mut ok = true;
    for name in wanted.split(';').map(str::trim).filter(|n| !n.is_empty()) {
        let Some(t) = TRANSPORTS.iter().find(|t| t.name == name) else {
            eprintln!("KVXFER_UCX_TRANSPORTS: unknown transport set {name:?} (known: tcp, shm)");
            return ExitCode::FAILURE;
        };
        let code = kvxfer_conformance::run_main(Arc::new(Ucx { name: t.name, tls: t.tls }));
        ok &= code == ExitCode::SUCCESS;
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
