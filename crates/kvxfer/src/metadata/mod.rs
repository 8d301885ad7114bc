//! Metadata stores: where ranks publish themselves (endpoint metadata, KV pool, layout) and the small
//! records a run hands over (page lists, readiness), and how peers learn that a rank is gone.
//!
//! [`MetadataStore`] is the interface: put (optionally under a lease), create-if-absent, get, list,
//! delete, watch a prefix from a revision, and leases (grant, keep-alive, revoke). Two
//! implementations, chosen by a [`MetadataAddr`]:
//!
//! - the embedded bootstrap service ([`crate::bootstrap::BootstrapServer`], address `host:port` or
//!   `bootstrap://host:port[/prefix]`): one process, in memory, nothing to install; the default;
//! - etcd v3 (cargo feature `etcd`, address `etcd://host:port[,host:port...][/prefix]`).
//!
//! Both namespace every key under a cluster prefix (default [`DEFAULT_PREFIX`]), so two deployments
//! can share one store. Membership ([`Membership`], [`MemberWatch`]) is written once on top of the
//! interface: each rank's record lives under a lease it keeps alive; a rank that dies stops the
//! keep-alive, its lease expires, its record is deleted, and every watcher is told which rank is
//! gone ([`MemberEvent::Lost`]). A rank that leaves on purpose marks its record `left` first
//! ([`MemberEvent::Left`]). A rank that comes back registers under a new lease, and its epoch (the
//! store revision that created its record) is higher than any before.
//!
//! Key layout under the prefix (see docs/operations.md, "Metadata stores"):
//!
//! ```text
//! <prefix>/ranks/<role>/<tp>.<pp>   the rank's record (registration, left flag), under its lease
//! <prefix>/req/<r>                  request r's destination page list (decode rank 0/0)
//! <prefix>/ready/<r>/<tp>.<pp>      decode rank posted its expectation of request r
//! <prefix>/done/<r>/<tp>.<pp>       decode rank verified request r; its pages may be reused
//! <prefix>/finished/<tp>.<pp>       decode rank checked its whole pool at the end
//! ```
//!
//! Every call is bounded by a deadline, and every error names the store it came from.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::Value;

pub mod auth;
pub mod bootstrap;
#[cfg(feature = "etcd")]
pub mod etcd;
pub mod members;
pub mod memory;
pub mod testing;

pub use members::{
    handshake, handshake_among, peers, peers_among, Member, MemberEvent, MemberWatch, Membership, MetadataError,
    RankRecord, DEFAULT_LEASE_TTL,
};

/// The cluster prefix used when an address names none.
pub const DEFAULT_PREFIX: &str = "/kvxfer";

/// Default bound on one store call that does not wait for others.
pub const DEFAULT_OP_TIMEOUT: Duration = Duration::from_secs(5);

/// A lease: keys put under it are deleted when it expires or is revoked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LeaseId(pub u64);

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:x}", self.0)
    }
}

/// One key with its value, as stored.
///
/// The value is kept as the JSON text the store gave (a rank's record is kilobytes, and every rank
/// reads every record: building a JSON tree of each, then the record from the tree, was most of a
/// starting rank's CPU in a large cluster, docs/performance/2026-12-06-control-plane.md). Read it
/// as a type with [`Entry::parse`], or as a JSON value with [`Entry::json`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Entry {
    /// The key, relative to the store's prefix.
    pub key: String,
    /// The value, as JSON text.
    pub value: Box<RawValue>,
    /// The store revision that created the key (stays until the key is deleted).
    pub create_revision: u64,
    /// The store revision of the last change.
    pub mod_revision: u64,
    /// The lease the key lives under, if any.
    #[serde(default)]
    pub lease: Option<LeaseId>,
}

impl Entry {
    /// An entry holding `value`.
    pub fn new(key: String, value: &Value, create_revision: u64, mod_revision: u64, lease: Option<LeaseId>) -> Self {
        let value = serde_json::value::to_raw_value(value).expect("a JSON value always serializes");
        Self { key, value, create_revision, mod_revision, lease }
    }

    /// The value read as `T`, straight from its JSON text.
    pub fn parse<T: serde::de::DeserializeOwned>(&self) -> serde_json::Result<T> {
        serde_json::from_str(self.value.get())
    }

    /// The value as a JSON value (built from the text on every call).
    pub fn json(&self) -> Value {
        self.parse().unwrap_or(Value::Null)
    }
}

/// Equal when key, revisions, lease and the value's JSON text are.
impl PartialEq for Entry {
    fn eq(&self, o: &Self) -> bool {
        self.key == o.key
            && self.value.get() == o.value.get()
            && self.create_revision == o.create_revision
            && self.mod_revision == o.mod_revision
            && self.lease == o.lease
    }
}

/// What happened to a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EventKind {
    /// Created or changed.
    Put,
    /// Deleted (explicitly, or because its lease expired or was revoked).
    Delete,
}

/// One change seen by a watch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoreEvent {
    /// Put or delete.
    pub kind: EventKind,
    /// The key, relative to the store's prefix.
    pub key: String,
    /// Put: the new entry. Delete: the entry as it was before (when the store still knows it).
    pub entry: Option<Entry>,
    /// The store revision of the change.
    pub revision: u64,
}

/// The result of [`MetadataStore::create`].
#[derive(Debug, Clone, PartialEq)]
pub enum Created {
    /// The key was absent and is now created at this revision.
    Yes {
        /// The creating revision.
        revision: u64,
    },
    /// The key already exists; nothing was written.
    Exists(Entry),
}

/// A failure of a metadata store. Every message names the store (kind, address, prefix).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The store could not be reached or failed the call.
    #[error("{store}: {op}: {detail}")]
    Unavailable {
        /// The store.
        store: String,
        /// The call.
        op: String,
        /// Cause.
        detail: String,
    },
    /// The store did not answer in time.
    #[error("{store}: {op}: no answer within {after:?}; is the store running and reachable?")]
    Timeout {
        /// The store.
        store: String,
        /// The call.
        op: String,
        /// How long.
        after: Duration,
    },
    /// A lease expired or was revoked.
    #[error("{store}: lease {lease} is gone (expired or revoked)")]
    LeaseGone {
        /// The store.
        store: String,
        /// The lease.
        lease: LeaseId,
    },
    /// A watch asked for history the store no longer keeps.
    #[error("{store}: cannot watch from revision {after}: history up to revision {compacted} is compacted")]
    Compacted {
        /// The store.
        store: String,
        /// The revision asked for.
        after: u64,
        /// The newest revision no longer available.
        compacted: u64,
    },
    /// A wait ran past its deadline.
    #[error("{store}: {what} did not happen within {after:?}")]
    WaitTimeout {
        /// The store.
        store: String,
        /// What was waited for.
        what: String,
        /// How long.
        after: Duration,
    },
    /// A stored value is not what kvxfer wrote.
    #[error("{store}: malformed value under {key}: {detail}")]
    Malformed {
        /// The store.
        store: String,
        /// The key.
        key: String,
        /// Cause.
        detail: String,
    },
    /// An address that names no store this build can use.
    #[error("metadata address {addr:?}: {detail}")]
    Address {
        /// The address.
        addr: String,
        /// What is wrong.
        detail: String,
    },
}

/// A stream of changes under a prefix, in revision order.
#[async_trait::async_trait]
pub trait Watch: Send {
    /// Waits at most `max_wait` for changes; an empty vector when none came. An error (the store
    /// went away, history compacted) ends the watch.
    async fn next(&mut self, max_wait: Duration) -> Result<Vec<StoreEvent>, StoreError>;
}

/// A metadata store. Keys are relative to the store's cluster prefix; values are JSON.
#[async_trait::async_trait]
pub trait MetadataStore: Send + Sync + fmt::Debug {
    /// What error messages call this store: kind, address and prefix.
    fn name(&self) -> &str;
    /// Grants a lease of about `ttl` (a store may round it up to its granularity or minimum).
    async fn grant(&self, ttl: Duration) -> Result<LeaseId, StoreError>;
    /// Refreshes a lease to its full TTL; [`StoreError::LeaseGone`] if it already expired.
    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError>;
    /// Revokes a lease, deleting its keys. Revoking a lease that is gone is not an error.
    async fn revoke(&self, lease: LeaseId) -> Result<(), StoreError>;
    /// Sets `key` (overwrites), under `lease` if given. Returns the revision of the change.
    async fn put(&self, key: &str, value: &Value, lease: Option<LeaseId>) -> Result<u64, StoreError>;
    /// Sets `key` only if it does not exist, atomically.
    async fn create(&self, key: &str, value: &Value, lease: Option<LeaseId>) -> Result<Created, StoreError>;
    /// The entry under `key`, if any, and the store revision the answer reflects.
    async fn get(&self, key: &str) -> Result<(Option<Entry>, u64), StoreError>;
    /// Every entry whose key starts with `prefix`, in key order, and the store revision.
    async fn list(&self, prefix: &str) -> Result<(Vec<Entry>, u64), StoreError>;
    /// Deletes `key`; whether it existed.
    async fn delete(&self, key: &str) -> Result<bool, StoreError>;
    /// Watches every key that starts with `prefix`, from the first change after revision `after`.
    async fn watch(&self, prefix: &str, after: u64) -> Result<Box<dyn Watch>, StoreError>;
}

/// Where the metadata lives, parsed from an address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetadataAddr {
    /// The embedded bootstrap service: `host:port` or `bootstrap://host:port[/prefix]`.
    Bootstrap {
        /// `host:port`.
        addr: String,
        /// Cluster prefix (`/name`, no trailing slash).
        prefix: String,
    },
    /// etcd v3: `etcd://host:port[,host:port...][/prefix]`.
    Etcd {
        /// `host:port` of each member.
        endpoints: Vec<String>,
        /// Cluster prefix (`/name`, no trailing slash).
        prefix: String,
    },
}

fn norm_prefix(p: &str) -> String {
    let p = p.trim_matches('/');
    if p.is_empty() {
        DEFAULT_PREFIX.to_owned()
    } else {
        format!("/{p}")
    }
}

impl MetadataAddr {
    /// Parses `etcd://h:p[,h:p...][/prefix]`, `bootstrap://h:p[/prefix]` or a bare `h:p`
    /// (the bootstrap service).
    pub fn parse(s: &str) -> Result<Self, StoreError> {
        let bad = |detail: &str| StoreError::Address { addr: s.to_owned(), detail: detail.to_owned() };
        let (scheme, rest) = match s.split_once("://") {
            Some((sch, rest)) => (sch, rest),
            None => ("bootstrap", s),
        };
        let (hosts, prefix) = match rest.split_once('/') {
            Some((h, p)) => (h, norm_prefix(p)),
            None => (rest, DEFAULT_PREFIX.to_owned()),
        };
        let endpoints: Vec<String> =
            hosts.split(',').map(str::trim).filter(|h| !h.is_empty()).map(String::from).collect();
        if endpoints.is_empty() {
            return Err(bad("no host:port given"));
        }
        for e in &endpoints {
            let port = e.rsplit_once(':').map(|(_, p)| p).unwrap_or("");
            if port.parse::<u16>().is_err() {
                return Err(bad(&format!("{e:?} is not host:port")));
            }
        }
        match scheme {
            "etcd" => Ok(Self::Etcd { endpoints, prefix }),
            "bootstrap" if endpoints.len() == 1 => {
                Ok(Self::Bootstrap { addr: endpoints.into_iter().next().unwrap_or_default(), prefix })
            }
            "bootstrap" => Err(bad("the bootstrap service is one process: give one host:port")),
            other => {
                Err(bad(&format!("unknown store {other:?}; use etcd://host:port[/prefix] or bootstrap://host:port")))
            }
        }
    }

    /// The cluster prefix.
    pub fn prefix(&self) -> &str {
        match self {
            Self::Bootstrap { prefix, .. } | Self::Etcd { prefix, .. } => prefix,
        }
    }
}

impl fmt::Display for MetadataAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Bootstrap { addr, prefix } => write!(f, "bootstrap://{addr}{prefix}"),
            Self::Etcd { endpoints, prefix } => write!(f, "etcd://{}{prefix}", endpoints.join(",")),
        }
    }
}

/// Connects to the store an address names. `op_timeout` bounds every call that does not wait for
/// others (connecting included). A bootstrap service with a shared secret needs [`connect_with`].
pub async fn connect(addr: &MetadataAddr, op_timeout: Duration) -> Result<Arc<dyn MetadataStore>, StoreError> {
    connect_with(addr, op_timeout, None).await
}

/// As [`connect`], proving `secret` to a bootstrap service on every call (see [`auth`]); typically
/// [`auth::Secret::from_env`] (`KVXFER_SECRET`) or [`auth::Secret::from_file`]. etcd authenticates by
/// its own means: there the secret is not used.
pub async fn connect_with(
    addr: &MetadataAddr,
    op_timeout: Duration,
    secret: Option<auth::Secret>,
) -> Result<Arc<dyn MetadataStore>, StoreError> {
    connect_secured(addr, op_timeout, secret, None).await
}

/// As [`connect_with`], and over TLS to a bootstrap service started with TLS
/// ([`crate::bootstrap::ServerConfig::tls`]; same cluster CA). etcd: neither is used.
pub async fn connect_secured(
    addr: &MetadataAddr,
    op_timeout: Duration,
    secret: Option<auth::Secret>,
    tls: Option<kvxfer_tls::Tls>,
) -> Result<Arc<dyn MetadataStore>, StoreError> {
    match addr {
        MetadataAddr::Bootstrap { addr, prefix } => {
            let mut s = bootstrap::BootstrapStore::new(addr, prefix).with_timeout(op_timeout).with_tls(tls);
            if let Some(secret) = secret {
                s = s.with_secret(secret);
            }
            Ok(Arc::new(s))
        }
        #[cfg(feature = "etcd")]
        MetadataAddr::Etcd { endpoints, prefix } => {
            let _ = (secret, tls);
            Ok(Arc::new(etcd::EtcdStore::connect(endpoints, prefix, op_timeout).await?))
        }
        #[cfg(not(feature = "etcd"))]
        MetadataAddr::Etcd { .. } => {
            let _ = (op_timeout, secret, tls);
            Err(StoreError::Address {
                addr: addr.to_string(),
                detail: "this build has no etcd support; rebuild with the cargo feature `etcd` \
                         (`cargo build -p kvxfer-cli --features etcd`, needs protoc)"
                    .into(),
            })
        }
    }
}

/// Waits until the entry under `key` satisfies `pred` (which sees `None` while the key is absent),
/// at most `timeout`, and returns it. Reads once, then follows a watch from that revision, so no
/// change in between is missed.
pub async fn wait_until(
    store: &dyn MetadataStore,
    key: &str,
    timeout: Duration,
    what: &str,
    pred: impl Fn(Option<&Entry>) -> bool + Send,
) -> Result<Option<Entry>, StoreError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let (mut cur, rev) = store.get(key).await?;
    if pred(cur.as_ref()) {
        return Ok(cur);
    }
    let mut watch = store.watch(key, rev).await?;
    loop {
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return Err(StoreError::WaitTimeout {
                store: store.name().to_owned(),
                what: what.to_owned(),
                after: timeout,
            });
        }
        for ev in watch.next(deadline - now).await? {
            if ev.key != key {
                continue;
            }
            cur = match ev.kind {
                EventKind::Put => ev.entry,
                EventKind::Delete => None,
            };
            if pred(cur.as_ref()) {
                return Ok(cur);
            }
        }
    }
}

/// Waits until `key` exists (at most `timeout`) and returns its value.
pub async fn wait_value(store: &dyn MetadataStore, key: &str, timeout: Duration) -> Result<Value, StoreError> {
    let what = format!("key {key:?} being put");
    let e = wait_until(store, key, timeout, &what, |e| e.is_some()).await?;
    Ok(e.map(|e| e.json()).unwrap_or(Value::Null))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_with_prefixes_and_say_what_is_wrong() {
        assert_eq!(
            MetadataAddr::parse("etcd://127.0.0.1:2379,10.0.0.2:2379/x").unwrap(),
            MetadataAddr::Etcd {
                endpoints: vec!["127.0.0.1:2379".into(), "10.0.0.2:2379".into()],
                prefix: "/x".into()
            }
        );
        assert_eq!(
            MetadataAddr::parse("etcd://127.0.0.1:2379").unwrap().prefix(),
            DEFAULT_PREFIX,
            "no prefix: the default"
        );
        assert_eq!(MetadataAddr::parse("etcd://h:1/a/b/").unwrap().prefix(), "/a/b");
        assert_eq!(
            MetadataAddr::parse("127.0.0.1:7878").unwrap(),
            MetadataAddr::Bootstrap { addr: "127.0.0.1:7878".into(), prefix: DEFAULT_PREFIX.into() }
        );
        assert_eq!(MetadataAddr::parse("bootstrap://h:7/c").unwrap().to_string(), "bootstrap://h:7/c");
        for (bad, says) in [
            ("redis://h:1", "unknown store"),
            ("etcd:///x", "no host"),
            ("etcd://h/x", "not host:port"),
            ("bootstrap://a:1,b:2", "one host"),
        ] {
            let e = MetadataAddr::parse(bad).unwrap_err().to_string();
            assert!(e.contains(says) && e.contains(bad), "{bad}: {e}");
        }
    }
}
