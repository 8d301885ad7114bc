//! The embedded bootstrap service as a [`MetadataStore`]: each call is one `store` request to the
//! service ([`crate::bootstrap`]), or, for a store inside this process ([`BootstrapStore::in_process`],
//! tests and single-process engines), a direct call on the same in-memory store.

use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::value::RawValue;
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

    /// One call; its answer as JSON text (read into the call's answer type by [`Self::answer`]).
    async fn call(&self, call: StoreCall, wait: Duration) -> Result<Box<RawValue>, StoreError> {
        let op = call.describe();
        let r: Result<Box<RawValue>, MemStoreError> = match &self.transport {
            Transport::InProcess(m) => {
                let fut = m.call_text(call);
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
                // `{"Ok": answer}` or `{"Err": error}`, as serde writes a `Result`; the answer read
                // in place, not as a JSON tree.
                serde_json::from_str::<Result<&RawValue, MemStoreError>>(v.get())
                    .map(|r| r.map(RawValue::to_owned))
                    .map_err(|e| StoreError::Unavailable {
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

    /// A call's answer read as `T` from its text (a list answer holds every rank's record: each
    /// entry's value stays text, see [`Entry`]).
    fn answer<T: DeserializeOwned>(&self, text: &RawValue) -> Result<T, StoreError> {
        serde_json::from_str(text.get()).map_err(|e| StoreError::Unavailable {
            store: self.name.clone(),
            op: "call".into(),
            detail: format!("malformed answer: {e}"),
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
        Ok(self.answer::<GrantAnswer>(&v)?.lease)
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.call(StoreCall::KeepAlive { lease }, Duration::ZERO).await.map(|_| ())
    }

    async fn revoke(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.call(StoreCall::Revoke { lease }, Duration::ZERO).await.map(|_| ())
    }

    async fn put(&self, key: &str, value: &Value, lease: Option<LeaseId>) -> Result<u64, StoreError> {
        let v = self.call(StoreCall::Put { key: self.full(key), value: value.clone(), lease }, Duration::ZERO).await?;
        Ok(self.answer::<PutAnswer>(&v)?.revision)
    }

    async fn create(&self, key: &str, value: &Value, lease: Option<LeaseId>) -> Result<Created, StoreError> {
        let v =
            self.call(StoreCall::Create { key: self.full(key), value: value.clone(), lease }, Duration::ZERO).await?;
        let a: CreateAnswer = self.answer(&v)?;
        match (a.created, a.existing) {
            (true, _) => Ok(Created::Yes { revision: a.revision }),
            (false, Some(e)) => Ok(Created::Exists(self.fix(e))),
            (false, None) => Err(StoreError::Unavailable {
                store: self.name.clone(),
                op: "create".into(),
                detail: "malformed answer: not created and no existing entry".into(),
            }),
        }
    }

    async fn get(&self, key: &str) -> Result<(Option<Entry>, u64), StoreError> {
        let v = self.call(StoreCall::Get { key: self.full(key) }, Duration::ZERO).await?;
        let a: GetAnswer = self.answer(&v)?;
        Ok((a.entry.map(|e| self.fix(e)), a.revision))
    }

    async fn list(&self, prefix: &str) -> Result<(Vec<Entry>, u64), StoreError> {
        let v = self.call(StoreCall::List { prefix: self.full(prefix) }, Duration::ZERO).await?;
        let a: ListAnswer = self.answer(&v)?;
        Ok((a.entries.into_iter().map(|e| self.fix(e)).collect(), a.revision))
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let v = self.call(StoreCall::Delete { key: self.full(key) }, Duration::ZERO).await?;
        Ok(self.answer::<DeleteAnswer>(&v)?.deleted)
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
        let evs = self.store.answer::<WatchAnswer>(&v)?.events;
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

// The answers of the store's calls (`MemState::apply`), as the service writes them.

#[derive(Deserialize)]
struct GrantAnswer {
    lease: LeaseId,
}

#[derive(Deserialize)]
struct PutAnswer {
    revision: u64,
}

#[derive(Deserialize)]
struct CreateAnswer {
    created: bool,
    revision: u64,
    #[serde(default)]
    existing: Option<Entry>,
}

#[derive(Deserialize)]
struct GetAnswer {
    entry: Option<Entry>,
    revision: u64,
}

#[derive(Deserialize)]
struct ListAnswer {
    entries: Vec<Entry>,
    revision: u64,
}

#[derive(Deserialize)]
struct DeleteAnswer {
    deleted: bool,
}

#[derive(Deserialize)]
struct WatchAnswer {
    events: Vec<StoreEvent>,
}
