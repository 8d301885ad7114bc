//! The embedded bootstrap service as a [`MetadataStore`]: each call is one `store` request to the
//! service ([`crate::bootstrap`]), or, for a store inside this process ([`BootstrapStore::in_process`],
//! tests and single-process engines), a direct call on the same in-memory store.

use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde_json::Value;

use super::memory::{MemShared, MemStoreError, StoreCall};
use super::{Created, Entry, LeaseId, MetadataStore, StoreError, StoreEvent, Watch, DEFAULT_OP_TIMEOUT};
use crate::bootstrap::{BootstrapClient, BootstrapError};

#[derive(Debug, Clone)]
enum Transport {
    Tcp(BootstrapClient),
    InProcess(Arc<MemShared>),
}

/// A client of the bootstrap service's store, under a cluster prefix.
#[derive(Debug, Clone)]
pub struct BootstrapStore {
    transport: Transport,
    prefix: String,
    name: String,
    timeout: Duration,
}

impl BootstrapStore {
    /// A client of the service at `addr` (`host:port`), with keys under `prefix` (`/name`).
    pub fn new(addr: &str, prefix: &str) -> Self {
        Self {
            transport: Transport::Tcp(BootstrapClient::new(addr).with_timeout(DEFAULT_OP_TIMEOUT)),
            prefix: prefix.to_owned(),
            name: format!("bootstrap at {addr} (prefix {prefix})"),
            timeout: DEFAULT_OP_TIMEOUT,
        }
    }

    /// The same store proving `secret` to the service on every call (the service must have the same
    /// one; see [`super::auth`]). No effect on a store inside this process.
    pub fn with_secret(mut self, secret: super::auth::Secret) -> Self {
        if let Transport::Tcp(c) = &self.transport {
            self.transport = Transport::Tcp(c.clone().with_secret(secret));
        }
        self
    }

    /// The same store speaking TLS to the service (see [`kvxfer_tls`]). No effect on a store inside
    /// this process.
    pub fn with_tls(mut self, tls: Option<kvxfer_tls::Tls>) -> Self {
        if let Transport::Tcp(c) = &self.transport {
            self.transport = Transport::Tcp(c.clone().with_tls(tls));
        }
        self
    }

    /// A store inside this process (no service, no sockets), with keys under `prefix`.
    pub fn in_process(store: Arc<MemShared>, prefix: &str) -> Self {
        Self {
            transport: Transport::InProcess(store),
            prefix: prefix.to_owned(),
            name: format!("in-process store (prefix {prefix})"),
            timeout: DEFAULT_OP_TIMEOUT,
        }
    }

    /// The same store with another bound on each call.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        if let Transport::Tcp(c) = &self.transport {
            self.transport = Transport::Tcp(c.clone().with_timeout(timeout));
        }
        self
    }

    fn full(&self, key: &str) -> String {
        format!("{}/{key}", self.prefix)
    }

    fn rel(&self, key: &str) -> String {
        key.strip_prefix(&self.prefix).and_then(|k| k.strip_prefix('/')).unwrap_or(key).to_owned()
    }

    fn fix(&self, mut e: Entry) -> Entry {
        e.key = self.rel(&e.key);
        e
    }

    async fn call(&self, call: StoreCall, wait: Duration) -> Result<Value, StoreError> {
        let op = call.describe();
        let r: Result<Value, MemStoreError> = match &self.transport {
            Transport::InProcess(m) => {
                let fut = m.call(call);
                tokio::time::timeout(self.timeout + wait, fut).await.map_err(|_| StoreError::Timeout {
                    store: self.name.clone(),
                    op: op.clone(),
                    after: self.timeout + wait,
                })?
            }
            Transport::Tcp(c) => {
                let v = c.store_call(call, wait).await.map_err(|e| match e {
                    BootstrapError::Timeout { what, after, .. } => {
                        StoreError::Timeout { store: self.name.clone(), op: what, after }
                    }
                    BootstrapError::Io { detail, .. } => {
                        StoreError::Unavailable { store: self.name.clone(), op: op.clone(), detail }
                    }
                    BootstrapError::Refused { op, detail, .. } => {
                        StoreError::Unavailable { store: self.name.clone(), op, detail }
                    }
                    BootstrapError::Auth { detail, .. } => {
                        StoreError::Unavailable { store: self.name.clone(), op: op.clone(), detail }
                    }
                    other => {
                        StoreError::Unavailable { store: self.name.clone(), op: op.clone(), detail: other.to_string() }
                    }
                })?;
                serde_json::from_value(v).map_err(|e| StoreError::Unavailable {
                    store: self.name.clone(),
                    op: "call".into(),
                    detail: format!("malformed answer (is this a kvxfer bootstrap service of this version?): {e}"),
                })?
            }
        };
        r.map_err(|e| match e {
            MemStoreError::LeaseNotFound { lease } => StoreError::LeaseGone { store: self.name.clone(), lease },
            MemStoreError::Compacted { compacted } => {
                StoreError::Compacted { store: self.name.clone(), after: 0, compacted }
            }
        })
    }

    fn field<T: DeserializeOwned>(&self, v: &Value, f: &str) -> Result<T, StoreError> {
        // In place: a list answer holds every rank's record.
        T::deserialize(v.get(f).unwrap_or(&Value::Null)).map_err(|e| StoreError::Unavailable {
            store: self.name.clone(),
            op: "call".into(),
            detail: format!("malformed answer: field {f}: {e}"),
        })
    }
}

#[async_trait::async_trait]
impl MetadataStore for BootstrapStore {
    fn name(&self) -> &str {
        &self.name
    }

    async fn grant(&self, ttl: Duration) -> Result<LeaseId, StoreError> {
        let v = self.call(StoreCall::Grant { ttl_ms: ttl.as_millis().max(1) as u64 }, Duration::ZERO).await?;
        self.field(&v, "lease")
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.call(StoreCall::KeepAlive { lease }, Duration::ZERO).await.map(|_| ())
    }

    async fn revoke(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.call(StoreCall::Revoke { lease }, Duration::ZERO).await.map(|_| ())
    }

    async fn put(&self, key: &str, value: &Value, lease: Option<LeaseId>) -> Result<u64, StoreError> {
        let v = self.call(StoreCall::Put { key: self.full(key), value: value.clone(), lease }, Duration::ZERO).await?;
        self.field(&v, "revision")
    }

    async fn create(&self, key: &str, value: &Value, lease: Option<LeaseId>) -> Result<Created, StoreError> {
        let v =
            self.call(StoreCall::Create { key: self.full(key), value: value.clone(), lease }, Duration::ZERO).await?;
        if self.field::<bool>(&v, "created")? {
            Ok(Created::Yes { revision: self.field(&v, "revision")? })
        } else {
            Ok(Created::Exists(self.fix(self.field(&v, "existing")?)))
        }
    }

    async fn get(&self, key: &str) -> Result<(Option<Entry>, u64), StoreError> {
        let v = self.call(StoreCall::Get { key: self.full(key) }, Duration::ZERO).await?;
        let e: Option<Entry> = self.field(&v, "entry")?;
        Ok((e.map(|e| self.fix(e)), self.field(&v, "revision")?))
    }

    async fn list(&self, prefix: &str) -> Result<(Vec<Entry>, u64), StoreError> {
        let v = self.call(StoreCall::List { prefix: self.full(prefix) }, Duration::ZERO).await?;
        let es: Vec<Entry> = self.field(&v, "entries")?;
        Ok((es.into_iter().map(|e| self.fix(e)).collect(), self.field(&v, "revision")?))
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let v = self.call(StoreCall::Delete { key: self.full(key) }, Duration::ZERO).await?;
        self.field(&v, "deleted")
    }

    async fn watch(&self, prefix: &str, after: u64) -> Result<Box<dyn Watch>, StoreError> {
        Ok(Box::new(BootstrapWatch { store: self.clone(), prefix: self.full(prefix), after }))
    }
}

/// A watch on the bootstrap store: long polls from the last revision seen.
struct BootstrapWatch {
    store: BootstrapStore,
    prefix: String,
    after: u64,
}

#[async_trait::async_trait]
impl Watch for BootstrapWatch {
    async fn next(&mut self, max_wait: Duration) -> Result<Vec<StoreEvent>, StoreError> {
        let wait = max_wait.min(super::memory::MAX_WATCH_WAIT);
        let call =
            StoreCall::Watch { prefix: self.prefix.clone(), after: self.after, timeout_ms: wait.as_millis() as u64 };
        let v = self.store.call(call, wait).await.map_err(|e| match e {
            StoreError::Compacted { store, compacted, .. } => {
                StoreError::Compacted { store, after: self.after, compacted }
            }
            e => e,
        })?;
        let evs: Vec<StoreEvent> = self.store.field(&v, "events")?;
        if let Some(last) = evs.last() {
            self.after = last.revision;
        }
        Ok(evs
            .into_iter()
            .map(|mut e| {
                e.key = self.store.rel(&e.key);
                e.entry = e.entry.map(|x| self.store.fix(x));
                e
            })
            .collect())
    }
}
