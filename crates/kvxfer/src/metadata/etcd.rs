//! etcd v3 as a [`MetadataStore`] (cargo feature `etcd`), through the `etcd-client` crate.
//!
//! Keys are `<prefix>/<key>`; values are JSON text. `create` is a transaction on the key's create
//! revision; epochs are etcd create revisions; leases are etcd leases (whole seconds, rounded up,
//! and etcd raises a TTL below its minimum, about 2 s with default election settings). Every call is
//! bounded by the store's timeout (unary calls and opening a watch; a watch's `next` by its
//! `max_wait`), so a stopped etcd makes calls fail with an error that names it, never hang.

use std::future::Future;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, KeyValue, PutOptions, Txn, TxnOp, TxnOpResponse,
    WatchOptions, WatchStream,
};
use serde_json::Value;

use super::{Created, Entry, EventKind, LeaseId, MetadataStore, StoreError, StoreEvent, Watch};

/// An etcd cluster, under a cluster prefix.
#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
    prefix: String,
    name: String,
    timeout: Duration,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore").field("name", &self.name).finish()
    }
}

impl EtcdStore {
    /// Connects to the members `endpoints` (`host:port` each), with keys under `prefix` (`/name`).
    /// `timeout` bounds connecting and every call.
    pub async fn connect(endpoints: &[String], prefix: &str, timeout: Duration) -> Result<Self, StoreError> {
        let name = format!("etcd at {} (prefix {prefix})", endpoints.join(","));
        let opts = ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
            .with_keep_alive_while_idle(true);
        let client = match tokio::time::timeout(timeout, Client::connect(endpoints, Some(opts))).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                return Err(StoreError::Unavailable { store: name, op: "connect".into(), detail: e.to_string() })
            }
            Err(_) => return Err(StoreError::Timeout { store: name, op: "connect".into(), after: timeout }),
        };
        let s = Self { client, prefix: prefix.to_owned(), name, timeout };
        // One round trip, so a wrong address fails here, naming the store.
        s.get("").await?;
        Ok(s)
    }

    fn full(&self, key: &str) -> String {
        format!("{}/{key}", self.prefix)
    }

    fn rel(&self, key: &[u8]) -> String {
        let k = String::from_utf8_lossy(key);
        k.strip_prefix(&self.prefix).and_then(|k| k.strip_prefix('/')).unwrap_or(&k).to_owned()
    }

    fn entry(&self, kv: &KeyValue) -> Result<Entry, StoreError> {
        let key = self.rel(kv.key());
        let value = serde_json::from_slice(kv.value()).map_err(|e| StoreError::Malformed {
            store: self.name.clone(),
            key: key.clone(),
            detail: format!("not JSON: {e}"),
        })?;
        Ok(Entry {
            key,
            value,
            create_revision: kv.create_revision() as u64,
            mod_revision: kv.mod_revision() as u64,
            lease: (kv.lease() != 0).then_some(LeaseId(kv.lease() as u64)),
        })
    }

    async fn bounded<T>(
        &self,
        op: &str,
        fut: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                Err(StoreError::Unavailable { store: self.name.clone(), op: op.to_owned(), detail: e.to_string() })
            }
            Err(_) => Err(StoreError::Timeout { store: self.name.clone(), op: op.to_owned(), after: self.timeout }),
        }
    }

    fn text(&self, key: &str, v: &Value) -> Result<Vec<u8>, StoreError> {
        serde_json::to_vec(v).map_err(|e| StoreError::Malformed {
            store: self.name.clone(),
            key: key.to_owned(),
            detail: e.to_string(),
        })
    }
}

fn is_lease_not_found(e: &StoreError) -> bool {
    matches!(e, StoreError::Unavailable { detail, .. } if detail.contains("lease not found"))
}

#[async_trait::async_trait]
impl MetadataStore for EtcdStore {
    fn name(&self) -> &str {
        &self.name
    }

    async fn grant(&self, ttl: Duration) -> Result<LeaseId, StoreError> {
        let secs = ttl.as_secs_f64().ceil().max(1.0) as i64;
        let mut c = self.client.clone();
        let r = self.bounded("lease grant", c.lease_grant(secs, None)).await?;
        Ok(LeaseId(r.id() as u64))
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError> {
        let mut c = self.client.clone();
        let op = format!("keep-alive of lease {lease}");
        match self.bounded(&op, c.lease_keep_alive(lease.0 as i64)).await {
            Ok(_) => Ok(()),
            Err(e) if is_lease_not_found(&e) => Err(StoreError::LeaseGone { store: self.name.clone(), lease }),
            Err(e) => Err(e),
        }
    }

    async fn revoke(&self, lease: LeaseId) -> Result<(), StoreError> {
        let mut c = self.client.clone();
        match self.bounded(&format!("revoke of lease {lease}"), c.lease_revoke(lease.0 as i64)).await {
            Ok(_) => Ok(()),
            Err(e) if is_lease_not_found(&e) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn put(&self, key: &str, value: &Value, lease: Option<LeaseId>) -> Result<u64, StoreError> {
        let mut c = self.client.clone();
        let opts = lease.map(|l| PutOptions::new().with_lease(l.0 as i64));
        let r = self.bounded(&format!("put {key}"), c.put(self.full(key), self.text(key, value)?, opts)).await?;
        match r.header() {
            Some(h) => Ok(h.revision() as u64),
            None => Err(StoreError::Unavailable {
                store: self.name.clone(),
                op: format!("put {key}"),
                detail: "answer without a header".into(),
            }),
        }
    }

    async fn create(&self, key: &str, value: &Value, lease: Option<LeaseId>) -> Result<Created, StoreError> {
        let full = self.full(key);
        let opts = lease.map(|l| PutOptions::new().with_lease(l.0 as i64));
        let txn = Txn::new()
            .when([Compare::create_revision(full.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(full.clone(), self.text(key, value)?, opts)])
            .or_else([TxnOp::get(full, None)]);
        let mut c = self.client.clone();
        let r = self.bounded(&format!("create {key}"), c.txn(txn)).await?;
        let rev = r.header().map(|h| h.revision() as u64).unwrap_or(0);
        if r.succeeded() {
            return Ok(Created::Yes { revision: rev });
        }
        for op in r.op_responses() {
            if let TxnOpResponse::Get(g) = op {
                if let Some(kv) = g.kvs().first() {
                    return Ok(Created::Exists(self.entry(kv)?));
                }
            }
        }
        Err(StoreError::Unavailable {
            store: self.name.clone(),
            op: format!("create {key}"),
            detail: "the key exists, yet reading it returned nothing".into(),
        })
    }

    async fn get(&self, key: &str) -> Result<(Option<Entry>, u64), StoreError> {
        let mut c = self.client.clone();
        let r = self.bounded(&format!("get {key}"), c.get(self.full(key), None)).await?;
        let rev = r.header().map(|h| h.revision() as u64).unwrap_or(0);
        let e = r.kvs().first().map(|kv| self.entry(kv)).transpose()?;
        Ok((e, rev))
    }

    async fn list(&self, prefix: &str) -> Result<(Vec<Entry>, u64), StoreError> {
        let mut c = self.client.clone();
        let r = self
            .bounded(&format!("list {prefix}"), c.get(self.full(prefix), Some(GetOptions::new().with_prefix())))
            .await?;
        let rev = r.header().map(|h| h.revision() as u64).unwrap_or(0);
        let es = r.kvs().iter().map(|kv| self.entry(kv)).collect::<Result<Vec<_>, _>>()?;
        Ok((es, rev))
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let mut c = self.client.clone();
        let r = self.bounded(&format!("delete {key}"), c.delete(self.full(key), None)).await?;
        Ok(r.deleted() > 0)
    }

    async fn watch(&self, prefix: &str, after: u64) -> Result<Box<dyn Watch>, StoreError> {
        let mut c = self.client.clone();
        let opts = WatchOptions::new().with_prefix().with_prev_key().with_start_revision(after as i64 + 1);
        let stream = self.bounded(&format!("watch {prefix}"), c.watch(self.full(prefix), Some(opts))).await?;
        Ok(Box::new(EtcdWatch { store: self.clone(), prefix: prefix.to_owned(), after, stream }))
    }
}

struct EtcdWatch {
    store: EtcdStore,
    prefix: String,
    after: u64,
    stream: WatchStream,
}

#[async_trait::async_trait]
impl Watch for EtcdWatch {
    async fn next(&mut self, max_wait: Duration) -> Result<Vec<StoreEvent>, StoreError> {
        let deadline = tokio::time::Instant::now() + max_wait;
        let op = format!("watch {}", self.prefix);
        let unavailable =
            |detail: String| StoreError::Unavailable { store: self.store.name.clone(), op: op.clone(), detail };
        // Bounded: each round waits for one message until the deadline; a message without events
        // (created, progress) goes round again.
        for _ in 0..1024 {
            let msg = match tokio::time::timeout_at(deadline, self.stream.message()).await {
                Err(_) => return Ok(Vec::new()),
                Ok(Err(e)) => return Err(unavailable(e.to_string())),
                Ok(Ok(None)) => return Err(unavailable("etcd ended the watch".into())),
                Ok(Ok(Some(m))) => m,
            };
            if msg.canceled() {
                if msg.compact_revision() > 0 {
                    return Err(StoreError::Compacted {
                        store: self.store.name.clone(),
                        after: self.after,
                        compacted: msg.compact_revision() as u64,
                    });
                }
                return Err(unavailable(format!("etcd canceled the watch: {}", msg.cancel_reason())));
            }
            let mut out = Vec::new();
            for ev in msg.events() {
                let Some(kv) = ev.kv() else { continue };
                let revision = kv.mod_revision() as u64;
                let key = self.store.rel(kv.key());
                let (kind, entry) = match ev.event_type() {
                    EventType::Put => (EventKind::Put, Some(self.store.entry(kv)?)),
                    EventType::Delete => (EventKind::Delete, ev.prev_kv().map(|p| self.store.entry(p)).transpose()?),
                };
                self.after = self.after.max(revision);
                out.push(StoreEvent { kind, key, entry, revision });
            }
            if !out.is_empty() {
                return Ok(out);
            }
        }
        Ok(Vec::new())
    }
}
