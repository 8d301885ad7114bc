//! Ranks on a metadata store: registering under a kept-alive lease, finding peers, checking their
//! layouts, and watching who joins, leaves and is lost. Written once over [`MetadataStore`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kvxfer_core::{RankId, Side, Topology};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{Created, Entry, EventKind, LeaseId, MetadataStore, StoreError};
use crate::bootstrap::{
    check_compatible, check_pair, check_rank_in_config, describe, BootstrapError, RankRegistration,
};

/// Lease time to live when none is configured.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(5);

/// What a rank's key holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankRecord {
    /// The rank's registration.
    pub registration: RankRegistration,
    /// Set just before the rank revokes its lease on purpose (so peers tell leaving from dying).
    #[serde(default)]
    pub left: bool,
}

/// A rank as the store knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Its registration.
    pub registration: RankRegistration,
    /// The store revision that created its record: a rank that comes back has a higher one.
    pub epoch: u64,
    /// The lease its record lives under.
    pub lease: Option<LeaseId>,
    /// Whether it marked itself as leaving.
    pub left: bool,
}

impl Member {
    /// `prefill rank 0/0 (pid 7, epoch 12)`.
    pub fn describe(&self) -> String {
        let r = &self.registration;
        let mut s = format!("{} rank {} (", r.role, r.rank);
        if !r.label.is_empty() {
            s.push_str(&r.label);
            s.push_str(", ");
        }
        s.push_str(&format!("epoch {})", self.epoch));
        s
    }

    fn from_entry(store: &str, e: &Entry) -> Result<Self, StoreError> {
        // Read from the value in place: a record is kilobytes, and every rank reads every record.
        let rec = e.parse::<RankRecord>().map_err(|err| StoreError::Malformed {
            store: store.to_owned(),
            key: e.key.clone(),
            detail: err.to_string(),
        })?;
        Ok(Self { registration: rec.registration, epoch: e.create_revision, lease: e.lease, left: rec.left })
    }
}

/// What a membership watch reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemberEvent {
    /// A rank registered.
    Joined(Member),
    /// A rank left on purpose.
    Left(Member),
    /// A rank's lease expired (or its record vanished) without it leaving: it is gone.
    Lost(Member),
}

/// A failure to register or to find peers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetadataError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Two sides that cannot exchange KV (every mismatch listed).
    #[error(transparent)]
    Layout(BootstrapError),
    /// The rank is registered already (alive, or dead and its lease not yet expired).
    #[error("{who} is already registered in {store} ({existing}); a rank that comes back registers once the old lease expired (TTL {ttl:?})")]
    Duplicate {
        /// The store.
        store: String,
        /// The rank.
        who: String,
        /// The registered one.
        existing: String,
        /// Our lease TTL, as a hint.
        ttl: Duration,
    },
    /// Ranks this rank exchanges with did not register in time.
    #[error(
        "{store}: {role} rank(s) [{}] that this rank exchanges with did not register within {} ms (registered: [{}]); \
         start them against the same metadata address and prefix, or check their logs for why they stopped",
        missing.join(", "), after.as_millis(), have.join(", ")
    )]
    MissingRanks {
        /// The store.
        store: String,
        /// The role.
        role: Side,
        /// The ranks still missing.
        missing: Vec<String>,
        /// The ranks of `role` that were registered.
        have: Vec<String>,
        /// How long.
        after: Duration,
    },
    /// Fewer peers than needed registered in time.
    #[error("{store}: only {have} of {want} {role} ranks registered within {} ms (have: [{}])", after.as_millis(), names.join(", "))]
    Peers {
        /// The store.
        store: String,
        /// The role.
        role: Side,
        /// Needed.
        want: u32,
        /// Found.
        have: u32,
        /// Their ranks.
        names: Vec<String>,
        /// How long.
        after: Duration,
    },
}

/// The key of a rank's record.
pub fn rank_key(role: Side, rank: RankId) -> String {
    format!("ranks/{role}/{}.{}", rank.tp, rank.pp)
}

fn role_prefix(role: Side) -> String {
    format!("ranks/{role}/")
}

/// The live (not leaving) ranks of `role`, and the revision.
async fn live(store: &dyn MetadataStore, role: Option<Side>) -> Result<(Vec<Member>, u64), StoreError> {
    let prefix = role.map(role_prefix).unwrap_or_else(|| "ranks/".into());
    let (es, rev) = store.list(&prefix).await?;
    let mut v = Vec::new();
    for e in &es {
        let m = Member::from_entry(store.name(), e)?;
        if !m.left {
            v.push(m);
        }
    }
    Ok((v, rev))
}

/// Lists the live ranks of `role`, then follows the store's changes under the role's prefix, until
/// `enough` says they are enough (`Ok`) or `timeout` passes (`Err` with the ranks live then; a store
/// error is returned as such). One list, then one watch applied event by event: each change costs
/// its own record, not a list of every rank (with `N` ranks joining at once, re-listing on every
/// change cost each waiting rank `N` lists of up to `N` records). A watch that fell behind the
/// store's history lists again.
async fn wait_live(
    store: &dyn MetadataStore,
    role: Side,
    timeout: Duration,
    enough: impl Fn(&[&Member]) -> bool,
) -> Result<Result<Vec<Member>, Vec<Member>>, MetadataError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let prefix = role_prefix(role);
    let owned = |m: &BTreeMap<String, Member>| m.values().filter(|m| !m.left).cloned().collect::<Vec<_>>();
    'list: loop {
        let (es, mut rev) = store.list(&prefix).await?;
        let mut known = BTreeMap::new();
        for e in &es {
            known.insert(e.key.clone(), Member::from_entry(store.name(), e)?);
        }
        let mut w = store.watch(&prefix, rev).await?;
        loop {
            let found: Vec<&Member> = known.values().filter(|m| !m.left).collect();
            if enough(&found) {
                return Ok(Ok(owned(&known)));
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Ok(Err(owned(&known)));
            }
            let evs = match w.next(deadline - now).await {
                Ok(evs) => evs,
                Err(StoreError::Compacted { .. }) => continue 'list,
                Err(e) => return Err(e.into()),
            };
            for ev in evs {
                if ev.revision <= rev {
                    continue;
                }
                rev = ev.revision;
                match (ev.kind, ev.entry) {
                    (EventKind::Put, Some(e)) => {
                        known.insert(ev.key, Member::from_entry(store.name(), &e)?);
                    }
                    (EventKind::Put, None) => {}
                    (EventKind::Delete, _) => {
                        known.remove(&ev.key);
                    }
                }
            }
        }
    }
}

/// Waits until `want` ranks of `role` are registered (at most `timeout`) and returns them.
pub async fn peers(
    store: &dyn MetadataStore,
    role: Side,
    want: u32,
    timeout: Duration,
) -> Result<Vec<Member>, MetadataError> {
    wait_live(store, role, timeout, |found| found.len() >= want as usize).await?.map_err(|found| MetadataError::Peers {
        store: store.name().to_owned(),
        role,
        want,
        have: found.len() as u32,
        names: found.iter().map(|m| m.registration.rank.to_string()).collect(),
        after: timeout,
    })
}

/// Waits until every rank in `need` of `role` is registered, and at least one rank of `role` when
/// `need` is empty (at most `timeout`); returns every live rank of `role` seen then. Unlike
/// [`peers`], ranks this rank does not exchange with are not waited for: one that already finished
/// and left (an MLA prefill rank that feeds nobody) does not hold the others up.
pub async fn peers_among(
    store: &dyn MetadataStore,
    role: Side,
    need: &[RankId],
    timeout: Duration,
) -> Result<Vec<Member>, MetadataError> {
    let missing = |found: &[&Member]| -> Vec<RankId> {
        need.iter().filter(|r| !found.iter().any(|m| m.registration.rank == **r)).copied().collect()
    };
    wait_live(store, role, timeout, |found| missing(found).is_empty() && !found.is_empty()).await?.map_err(|found| {
        MetadataError::MissingRanks {
            store: store.name().to_owned(),
            role,
            missing: if need.is_empty() {
                vec!["any".into()]
            } else {
                missing(&found.iter().collect::<Vec<_>>()).iter().map(ToString::to_string).collect()
            },
            have: found.iter().map(|m| m.registration.rank.to_string()).collect(),
            after: timeout,
        }
    })
}

/// [`handshake`] for the ranks in `need` only (see [`peers_among`]): waits for them, checks every
/// live rank of `role` against `me`, and returns the live ranks and the topology.
pub async fn handshake_among(
    store: &dyn MetadataStore,
    me: &RankRegistration,
    role: Side,
    need: &[RankId],
    timeout: Duration,
) -> Result<(Vec<Member>, Topology), MetadataError> {
    let peers = peers_among(store, role, need, timeout).await?;
    check_peers(store, me, role, peers, 1, timeout)
}

/// Waits for the ranks of `role`, then checks each against `me`: every layout mismatch is reported
/// before any byte moves. Returns the peers and the topology.
pub async fn handshake(
    store: &dyn MetadataStore,
    me: &RankRegistration,
    role: Side,
    want: u32,
    timeout: Duration,
) -> Result<(Vec<Member>, Topology), MetadataError> {
    let peers = peers(store, role, want, timeout).await?;
    check_peers(store, me, role, peers, want, timeout)
}

/// Checks every peer against `me` (layouts) and the first against `me` (compatibility).
fn check_peers(
    store: &dyn MetadataStore,
    me: &RankRegistration,
    role: Side,
    peers: Vec<Member>,
    want: u32,
    timeout: Duration,
) -> Result<(Vec<Member>, Topology), MetadataError> {
    for p in &peers {
        check_pair(me, &p.registration).map_err(MetadataError::Layout)?;
    }
    let other = &peers
        .first()
        .ok_or_else(|| MetadataError::Peers {
            store: store.name().to_owned(),
            role,
            want,
            have: 0,
            names: vec![],
            after: timeout,
        })?
        .registration;
    let (p, d) = if me.role == Side::Prefill { (me, other) } else { (other, me) };
    let topo = check_compatible(&p.spec, &d.spec).map_err(|problems| {
        MetadataError::Layout(BootstrapError::Incompatible { prefill: describe(p), decode: describe(d), problems })
    })?;
    Ok((peers, topo))
}

/// This rank's registration, under a lease kept alive in the background until [`Self::leave`]
/// (or drop: then the lease expires and peers see the rank lost).
pub struct Membership {
    store: Arc<dyn MetadataStore>,
    me: RankRegistration,
    key: String,
    lease: LeaseId,
    epoch: u64,
    ttl: Duration,
    keeper: tokio::task::JoinHandle<()>,
    health: tokio::sync::watch::Receiver<Option<String>>,
}

impl std::fmt::Debug for Membership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Membership")
            .field("key", &self.key)
            .field("lease", &self.lease)
            .field("epoch", &self.epoch)
            .finish()
    }
}

impl Membership {
    /// Registers `me` under a new lease of `ttl`: checks that it lies inside its own parallel config
    /// and against every rank registered (every layout mismatch listed, a rank of its role with
    /// another side spec named with both values), refuses a rank already registered, and keeps the
    /// lease alive (every `ttl / 3`).
    pub async fn join(
        store: Arc<dyn MetadataStore>,
        me: RankRegistration,
        ttl: Duration,
    ) -> Result<Self, MetadataError> {
        check_rank_in_config(&me).map_err(MetadataError::Layout)?;
        let (others, _) = live(&*store, None).await?;
        for o in &others {
            if o.registration.role == me.role && o.registration.rank == me.rank {
                continue; // reported as a duplicate below
            }
            check_pair(&me, &o.registration).map_err(MetadataError::Layout)?;
        }
        let lease = store.grant(ttl).await?;
        let key = rank_key(me.role, me.rank);
        let rec = serde_json::to_value(RankRecord { registration: me.clone(), left: false }).map_err(|e| {
            StoreError::Malformed { store: store.name().into(), key: key.clone(), detail: e.to_string() }
        })?;
        let epoch = match store.create(&key, &rec, Some(lease)).await {
            Ok(Created::Yes { revision }) => revision,
            Ok(Created::Exists(e)) => {
                let _ = store.revoke(lease).await;
                let existing =
                    Member::from_entry(store.name(), &e).map(|m| m.describe()).unwrap_or_else(|_| e.key.clone());
                return Err(MetadataError::Duplicate {
                    store: store.name().to_owned(),
                    who: describe(&me),
                    existing,
                    ttl,
                });
            }
            Err(e) => {
                let _ = store.revoke(lease).await;
                return Err(e.into());
            }
        };
        let (tx, health) = tokio::sync::watch::channel(None);
        let keeper = tokio::spawn(keep_alive(Arc::clone(&store), lease, ttl, tx));
        Ok(Self { store, me, key, lease, epoch, ttl, keeper, health })
    }

    /// [`Membership::join`], but a rank whose record is still held by a lease (a previous process of
    /// this rank that crashed moments ago, its lease not yet expired) waits, for up to `wait`, until
    /// the record is gone (one `get` of its key every 100 ms; no lease is granted meanwhile), then
    /// joins: a dead process's lease expires within its TTL, so a supervisor may restart a crashed
    /// rank at once. A record still held after `wait` belongs to a live process of the same rank (or
    /// to one whose TTL is longer than `wait`): [`MetadataError::Duplicate`] then. Every other error
    /// returns at once.
    pub async fn join_waiting(
        store: Arc<dyn MetadataStore>,
        me: RankRegistration,
        ttl: Duration,
        wait: Duration,
    ) -> Result<Self, MetadataError> {
        let end = tokio::time::Instant::now() + wait;
        let key = rank_key(me.role, me.rank);
        loop {
            match Self::join(Arc::clone(&store), me.clone(), ttl).await {
                Err(MetadataError::Duplicate { .. }) if tokio::time::Instant::now() < end => {
                    while tokio::time::Instant::now() < end {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        if store.get(&key).await?.0.is_none() {
                            break;
                        }
                    }
                }
                r => return r,
            }
        }
    }

    /// The epoch: the store revision that created this rank's record.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The lease.
    pub fn lease(&self) -> LeaseId {
        self.lease
    }

    /// The lease TTL asked for.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn MetadataStore> {
        &self.store
    }

    /// `None` while the lease is kept alive; the reason once it could not be (the store is gone or
    /// the lease expired: peers then consider this rank lost).
    pub fn health(&self) -> tokio::sync::watch::Receiver<Option<String>> {
        self.health.clone()
    }

    /// Leaves on purpose: marks the record `left` (peers see [`MemberEvent::Left`]), then revokes
    /// the lease, deleting this rank's keys.
    pub async fn leave(self) -> Result<(), StoreError> {
        self.keeper.abort();
        let rec = serde_json::to_value(RankRecord { registration: self.me.clone(), left: true }).map_err(|e| {
            StoreError::Malformed { store: self.store.name().into(), key: self.key.clone(), detail: e.to_string() }
        })?;
        let marked = self.store.put(&self.key, &rec, Some(self.lease)).await;
        let revoked = self.store.revoke(self.lease).await;
        marked.and(revoked)
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

async fn keep_alive(
    store: Arc<dyn MetadataStore>,
    lease: LeaseId,
    ttl: Duration,
    health: tokio::sync::watch::Sender<Option<String>>,
) {
    let every = (ttl / 3).max(Duration::from_millis(50));
    let mut last_ok = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(every).await;
        match tokio::time::timeout(every, store.keep_alive(lease)).await {
            Ok(Ok(())) => {
                last_ok = tokio::time::Instant::now();
                if health.borrow().is_some() {
                    let _ = health.send(None);
                }
            }
            Ok(Err(e @ StoreError::LeaseGone { .. })) => {
                let _ = health.send(Some(format!("{e}: peers consider this rank lost")));
                return;
            }
            r => {
                let why = match r {
                    Ok(Err(e)) => e.to_string(),
                    _ => format!("{}: keep-alive of lease {lease} got no answer within {every:?}", store.name()),
                };
                if last_ok.elapsed() >= ttl {
                    let _ = health.send(Some(format!(
                        "{why}; no keep-alive succeeded for {:?} (lease TTL {ttl:?}): peers may consider this rank lost",
                        last_ok.elapsed()
                    )));
                }
                tracing::warn!(%lease, "keep-alive failed: {why}");
            }
        }
    }
}

/// Watches every rank of the store's cluster: who joins, leaves, and is lost.
pub struct MemberWatch {
    store: Arc<dyn MetadataStore>,
    watch: Option<Box<dyn super::Watch>>,
    rev: u64,
    known: BTreeMap<String, Member>,
}

impl MemberWatch {
    /// Starts watching; returns the watch and the ranks registered now.
    pub async fn start(store: Arc<dyn MetadataStore>) -> Result<(Self, Vec<Member>), StoreError> {
        let (es, rev) = store.list("ranks/").await?;
        let mut known = BTreeMap::new();
        for e in &es {
            known.insert(e.key.clone(), Member::from_entry(store.name(), e)?);
        }
        let now = known.values().cloned().collect();
        Ok((Self { store, watch: None, rev, known }, now))
    }

    /// Waits at most `max_wait` for membership changes. An error means the store is unreachable.
    pub async fn next(&mut self, max_wait: Duration) -> Result<Vec<MemberEvent>, StoreError> {
        if self.watch.is_none() {
            self.watch = Some(self.store.watch("ranks/", self.rev).await?);
        }
        let w = self.watch.as_mut().expect("set above");
        let evs = match w.next(max_wait).await {
            Ok(evs) => evs,
            Err(StoreError::Compacted { .. }) => {
                self.watch = None;
                return self.resync().await;
            }
            Err(e) => {
                self.watch = None;
                return Err(e);
            }
        };
        let mut out = Vec::new();
        for ev in evs {
            self.rev = self.rev.max(ev.revision);
            match ev.kind {
                EventKind::Put => {
                    let Some(e) = ev.entry else { continue };
                    let m = Member::from_entry(self.store.name(), &e)?;
                    let was = self.known.insert(ev.key.clone(), m.clone());
                    match (was, m.left) {
                        (Some(old), true) if !old.left => out.push(MemberEvent::Left(m)),
                        (None, false) => out.push(MemberEvent::Joined(m)),
                        (Some(old), false) if old.epoch != m.epoch => out.push(MemberEvent::Joined(m)),
                        _ => {}
                    }
                }
                EventKind::Delete => {
                    let old = self.known.remove(&ev.key);
                    let m = match (old, ev.entry) {
                        (Some(m), _) => Some(m),
                        (None, Some(e)) => Member::from_entry(self.store.name(), &e).ok(),
                        (None, None) => None,
                    };
                    match m {
                        Some(m) if !m.left => out.push(MemberEvent::Lost(m)),
                        Some(_) => {}
                        None => tracing::warn!(key = %ev.key, "a rank record vanished, its content unknown"),
                    }
                }
            }
        }
        Ok(out)
    }

    /// After a gap in history: list again and report the difference.
    async fn resync(&mut self) -> Result<Vec<MemberEvent>, StoreError> {
        let (es, rev) = self.store.list("ranks/").await?;
        let mut now = BTreeMap::new();
        for e in &es {
            now.insert(e.key.clone(), Member::from_entry(self.store.name(), e)?);
        }
        let mut out = Vec::new();
        for (k, m) in &self.known {
            match now.get(k) {
                None if !m.left => out.push(MemberEvent::Lost(m.clone())),
                Some(n) if n.epoch != m.epoch && !m.left => {
                    out.push(MemberEvent::Lost(m.clone()));
                    out.push(MemberEvent::Joined(n.clone()));
                }
                Some(n) if n.left && !m.left => out.push(MemberEvent::Left(n.clone())),
                _ => {}
            }
        }
        for (k, n) in &now {
            if !self.known.contains_key(k) && !n.left {
                out.push(MemberEvent::Joined(n.clone()));
            }
        }
        self.known = now;
        self.rev = rev;
        Ok(out)
    }
}

/// The value of a rank record, for callers that read keys themselves.
pub fn record_of(v: &Value) -> Option<RankRecord> {
    serde_json::from_value(v.clone()).ok()
}
