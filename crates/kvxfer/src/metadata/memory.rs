//! The in-memory store behind the embedded bootstrap service: keys with revisions, leases that
//! expire, and a bounded history that watches read from. [`MemState`] is the state machine (no IO,
//! time passed in); [`MemShared`] serves [`StoreCall`]s on it, waking watchers on every change.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{json, Value};

use super::{Entry, EventKind, LeaseId, StoreEvent};

/// Changes kept for watches; a watch further behind must re-read.
pub const HISTORY: usize = 1 << 16;

/// Bytes of history kept for watches (keys and values, as JSON), whatever the count: a long run with
/// large values does not hold [`HISTORY`] copies of them. A watch further behind must re-read.
pub const HISTORY_BYTES: usize = 64 << 20;

/// The serialized size of a JSON value, without building it.
pub(crate) fn json_len(v: &Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0 += b.len();
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Count(0);
    let _ = serde_json::to_writer(&mut c, v);
    c.0
}

/// Longest a single watch call may wait.
pub const MAX_WATCH_WAIT: Duration = Duration::from_secs(30);

/// How often waiting watches look for expired leases.
const EXPIRY_TICK: Duration = Duration::from_millis(50);

/// A watch that finds changes waits this long once more before answering, so that a burst of
/// changes (hundreds of ranks joining at once) is answered in a few answers, not one per change for
/// every watcher: with `N` watchers and `N` joins that is `N` squared round trips otherwise.
pub const WATCH_COALESCE: Duration = Duration::from_millis(10);

/// Most bytes of events in one watch answer (one event at least, whatever its size); see
/// `MemState::watch_text`.
pub const WATCH_ANSWER_BYTES: usize = 1 << 20;

/// A store call, as the bootstrap service receives it (keys are full, prefix included).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum StoreCall {
    /// Grant a lease.
    Grant {
        /// Time to live, milliseconds.
        ttl_ms: u64,
    },
    /// Refresh a lease.
    KeepAlive {
        /// The lease.
        lease: LeaseId,
    },
    /// Revoke a lease and delete its keys.
    Revoke {
        /// The lease.
        lease: LeaseId,
    },
    /// Set a key.
    Put {
        /// Key.
        key: String,
        /// Value.
        value: Value,
        /// Lease.
        #[serde(default)]
        lease: Option<LeaseId>,
    },
    /// Set a key only if absent.
    Create {
        /// Key.
        key: String,
        /// Value.
        value: Value,
        /// Lease.
        #[serde(default)]
        lease: Option<LeaseId>,
    },
    /// Read a key.
    Get {
        /// Key.
        key: String,
    },
    /// Read every key under a prefix.
    List {
        /// Prefix.
        prefix: String,
    },
    /// Delete a key.
    Delete {
        /// Key.
        key: String,
    },
    /// Changes under a prefix after a revision; waits up to `timeout_ms` for the first.
    Watch {
        /// Prefix.
        prefix: String,
        /// Revision after which to report.
        after: u64,
        /// Longest wait, milliseconds.
        timeout_ms: u64,
    },
}

impl StoreCall {
    /// What error messages call this call: `put /kvxfer/req/3`.
    pub fn describe(&self) -> String {
        match self {
            StoreCall::Grant { .. } => "lease grant".to_owned(),
            StoreCall::KeepAlive { lease } => format!("keep-alive of lease {lease}"),
            StoreCall::Revoke { lease } => format!("revoke of lease {lease}"),
            StoreCall::Put { key, .. } => format!("put {key}"),
            StoreCall::Create { key, .. } => format!("create {key}"),
            StoreCall::Get { key } => format!("get {key}"),
            StoreCall::List { prefix } => format!("list {prefix}"),
            StoreCall::Delete { key } => format!("delete {key}"),
            StoreCall::Watch { prefix, .. } => format!("watch {prefix}"),
        }
    }
}

/// A refusal of the in-memory store (typed, so clients map it back).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(rename_all = "snake_case")]
pub enum MemStoreError {
    /// The lease expired, was revoked, or never existed.
    #[error("lease {lease} not found (expired or revoked)")]
    LeaseNotFound {
        /// The lease.
        lease: LeaseId,
    },
    /// History before the asked revision is gone.
    #[error("history up to revision {compacted} is compacted")]
    Compacted {
        /// The newest revision no longer kept.
        compacted: u64,
    },
}

#[derive(Debug)]
struct LeaseState {
    ttl: Duration,
    expires: Instant,
    keys: BTreeSet<String>,
}

/// Keys, revisions, leases and history. Every method takes the time; nothing here reads a clock.
#[derive(Debug)]
pub struct MemState {
    rev: u64,
    kv: BTreeMap<String, Entry>,
    /// Each entry of `kv` as JSON, written once when it is set: list answers are made of these.
    kv_json: HashMap<String, Box<RawValue>>,
    log: VecDeque<StoreEvent>,
    /// Each event of `log` as JSON, written once: watch answers are made of these.
    log_json: VecDeque<Box<RawValue>>,
    /// The size of each event of `log` (key and value bytes), and their sum.
    log_sizes: VecDeque<usize>,
    log_bytes: usize,
    compacted: u64,
    leases: HashMap<LeaseId, LeaseState>,
    /// No lease expires before this (a lower bound: keep-alives only move expiries later), so
    /// [`MemState::expire`] looks at the leases only once it has passed, not on every call.
    next_expiry: Option<Instant>,
    next_lease: u64,
}

impl Default for MemState {
    fn default() -> Self {
        Self::new()
    }
}

impl MemState {
    /// An empty store at revision 1.
    pub fn new() -> Self {
        Self {
            rev: 1,
            kv: BTreeMap::new(),
            kv_json: HashMap::new(),
            log: VecDeque::new(),
            log_json: VecDeque::new(),
            log_sizes: VecDeque::new(),
            log_bytes: 0,
            compacted: 0,
            leases: HashMap::new(),
            next_expiry: None,
            next_lease: 0x6b76_0000,
        }
    }

    /// The current revision.
    pub fn revision(&self) -> u64 {
        self.rev
    }

    /// Keys stored now.
    pub fn key_count(&self) -> usize {
        self.kv.len()
    }

    /// Events kept for watches, and their approximate bytes.
    pub fn history(&self) -> (usize, usize) {
        (self.log.len(), self.log_bytes)
    }

    /// Leases alive (not yet expired as of the last call that checked).
    pub fn lease_count(&self) -> usize {
        self.leases.len()
    }

    fn record(&mut self, kind: EventKind, key: String, entry: Option<Entry>) {
        let event = StoreEvent { kind, key, entry, revision: self.rev };
        let json = raw(&event);
        // The event as a value and as its JSON text: both count against HISTORY_BYTES.
        let size =
            2 * event.key.len() + event.entry.as_ref().map_or(0, |e| e.value.get().len()) + 64 + json.get().len();
        self.log_json.push_back(json);
        self.log.push_back(event);
        self.log_sizes.push_back(size);
        self.log_bytes += size;
        while self.log.len() > HISTORY || (self.log_bytes > HISTORY_BYTES && self.log.len() > 1) {
            self.log_bytes -= self.log_sizes.pop_front().unwrap_or(0);
            self.log_json.pop_front();
            if let Some(e) = self.log.pop_front() {
                self.compacted = e.revision;
            }
        }
    }

    fn remove(&mut self, key: &str) -> bool {
        let Some(old) = self.kv.remove(key) else { return false };
        self.kv_json.remove(key);
        if let Some(l) = old.lease {
            if let Some(ls) = self.leases.get_mut(&l) {
                ls.keys.remove(key);
            }
        }
        self.rev += 1;
        self.record(EventKind::Delete, key.to_owned(), Some(old));
        true
    }

    /// Deletes the keys of every lease that expired by `now`; returns how many leases expired.
    pub fn expire(&mut self, now: Instant) -> usize {
        if self.next_expiry.map_or(true, |t| now < t) {
            return 0;
        }
        let gone: Vec<LeaseId> = self.leases.iter().filter(|(_, l)| l.expires <= now).map(|(id, _)| *id).collect();
        for id in &gone {
            self.drop_lease(*id);
        }
        self.next_expiry = self.leases.values().map(|l| l.expires).min();
        gone.len()
    }

    fn drop_lease(&mut self, id: LeaseId) -> bool {
        let Some(l) = self.leases.remove(&id) else { return false };
        for k in l.keys {
            self.remove(&k);
        }
        true
    }

    fn check_lease(&self, lease: Option<LeaseId>) -> Result<(), MemStoreError> {
        match lease {
            Some(l) if !self.leases.contains_key(&l) => Err(MemStoreError::LeaseNotFound { lease: l }),
            _ => Ok(()),
        }
    }

    fn set(&mut self, key: String, value: Value, lease: Option<LeaseId>) -> u64 {
        self.rev += 1;
        let rev = self.rev;
        let old = self.kv.get(&key).cloned();
        if let Some(ol) = old.as_ref().and_then(|o| o.lease) {
            if Some(ol) != lease {
                if let Some(ls) = self.leases.get_mut(&ol) {
                    ls.keys.remove(&key);
                }
            }
        }
        if let Some(l) = lease {
            if let Some(ls) = self.leases.get_mut(&l) {
                ls.keys.insert(key.clone());
            }
        }
        let entry = Entry::new(key.clone(), &value, old.map(|o| o.create_revision).unwrap_or(rev), rev, lease);
        self.kv_json.insert(key.clone(), raw(&entry));
        self.kv.insert(key.clone(), entry.clone());
        self.record(EventKind::Put, key, Some(entry));
        rev
    }

    /// Events under `prefix` with a revision above `after`.
    pub fn events_after(&self, prefix: &str, after: u64) -> Result<Vec<StoreEvent>, MemStoreError> {
        Ok(self.events_ref(prefix, after)?.into_iter().map(|(e, _)| e.clone()).collect())
    }

    /// [`Self::events_after`] without copying them, each with its JSON.
    fn events_ref(&self, prefix: &str, after: u64) -> Result<Vec<(&StoreEvent, &RawValue)>, MemStoreError> {
        if after < self.compacted {
            return Err(MemStoreError::Compacted { compacted: self.compacted });
        }
        let start = self.log.partition_point(|e| e.revision <= after);
        Ok(self
            .log
            .iter()
            .zip(&self.log_json)
            .skip(start)
            .filter(|(e, _)| e.key.starts_with(prefix))
            .map(|(e, j)| (e, &**j))
            .collect())
    }

    /// A watch's answer, `{"events":[...],"revision":N}`, as JSON text made of the events' JSON
    /// written when they happened.
    ///
    /// At most [`WATCH_ANSWER_BYTES`] of events (at least one): a watcher continues from the last
    /// event's revision, so the rest comes with its next call. A burst of joins in a large cluster
    /// reaches each watcher in answers it reads in well under the service's idle timeout, not as
    /// one answer of every record.
    fn watch_text(&self, events: &[(&StoreEvent, &RawValue)]) -> Box<RawValue> {
        #[derive(Serialize)]
        struct Answer<'a> {
            events: Vec<&'a RawValue>,
            revision: u64,
        }
        let mut bytes = 0;
        let events = events
            .iter()
            .take_while(|(_, j)| {
                let first = bytes == 0;
                bytes += j.get().len() + 1;
                first || bytes <= WATCH_ANSWER_BYTES
            })
            .map(|(_, j)| *j)
            .collect();
        raw(&Answer { events, revision: self.rev })
    }

    /// [`Self::apply`], answering as JSON text: list and watch answers are made of the JSON each
    /// entry and event got when it was written, so the bootstrap service writes every rank's
    /// record once, not once per reader (see docs/performance/2026-12-06-control-plane.md).
    pub fn apply_text(&mut self, call: StoreCall, now: Instant) -> Result<Box<RawValue>, MemStoreError> {
        match call {
            StoreCall::List { prefix } => {
                self.expire(now);
                #[derive(Serialize)]
                struct Answer<'a> {
                    entries: Vec<&'a RawValue>,
                    revision: u64,
                }
                let entries = self
                    .kv
                    .range(prefix.clone()..)
                    .take_while(|(k, _)| k.starts_with(&prefix))
                    .filter_map(|(k, _)| self.kv_json.get(k).map(|j| &**j))
                    .collect();
                Ok(raw(&Answer { entries, revision: self.rev }))
            }
            StoreCall::Watch { prefix, after, .. } => {
                self.expire(now);
                let evs = self.events_ref(&prefix, after)?;
                Ok(self.watch_text(&evs))
            }
            call => self.apply(call, now).map(|v| raw(&v)),
        }
    }

    /// Applies one call that does not wait (`Watch` answers with what is there now).
    pub fn apply(&mut self, call: StoreCall, now: Instant) -> Result<Value, MemStoreError> {
        self.expire(now);
        Ok(match call {
            StoreCall::Grant { ttl_ms } => {
                self.next_lease += 1;
                let id = LeaseId(self.next_lease);
                let ttl = Duration::from_millis(ttl_ms.max(1));
                self.leases.insert(id, LeaseState { ttl, expires: now + ttl, keys: BTreeSet::new() });
                self.next_expiry = Some(self.next_expiry.map_or(now + ttl, |t| t.min(now + ttl)));
                json!({"lease": id, "ttl_ms": ttl.as_millis() as u64})
            }
            StoreCall::KeepAlive { lease } => {
                let l = self.leases.get_mut(&lease).ok_or(MemStoreError::LeaseNotFound { lease })?;
                l.expires = now + l.ttl;
                json!({"ttl_ms": l.ttl.as_millis() as u64})
            }
            StoreCall::Revoke { lease } => json!({"revoked": self.drop_lease(lease)}),
            StoreCall::Put { key, value, lease } => {
                self.check_lease(lease)?;
                json!({"revision": self.set(key, value, lease)})
            }
            StoreCall::Create { key, value, lease } => {
                self.check_lease(lease)?;
                match self.kv.get(&key) {
                    Some(e) => json!({"created": false, "existing": e, "revision": self.rev}),
                    None => json!({"created": true, "revision": self.set(key, value, lease)}),
                }
            }
            StoreCall::Get { key } => json!({"entry": self.kv.get(&key), "revision": self.rev}),
            StoreCall::List { prefix } => {
                let entries: Vec<&Entry> = self
                    .kv
                    .range(prefix.clone()..)
                    .take_while(|(k, _)| k.starts_with(&prefix))
                    .map(|(_, e)| e)
                    .collect();
                json!({"entries": entries, "revision": self.rev})
            }
            StoreCall::Delete { key } => json!({"deleted": self.remove(&key), "revision": self.rev}),
            StoreCall::Watch { prefix, after, .. } => {
                let evs: Vec<&StoreEvent> = self.events_ref(&prefix, after)?.into_iter().map(|(e, _)| e).collect();
                json!({"events": evs, "revision": self.rev})
            }
        })
    }
}

/// A [`MemState`] shared by the callers of one process, with waiting watches.
#[derive(Debug, Default)]
pub struct MemShared {
    state: Mutex<MemState>,
    changed: tokio::sync::Notify,
}

impl MemShared {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MemState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keys and live leases now (expired leases are collected first).
    pub fn counts(&self) -> (usize, usize) {
        let mut st = self.lock();
        if st.expire(Instant::now()) > 0 {
            drop(st);
            self.changed.notify_waiters();
            st = self.lock();
        }
        (st.key_count(), st.lease_count())
    }

    /// Serves one call. A `Watch` with nothing to report waits (at most its timeout, at most
    /// [`MAX_WATCH_WAIT`]) for the first change, checking lease expiry meanwhile.
    pub async fn call(&self, call: StoreCall) -> Result<Value, MemStoreError> {
        let text = self.call_text(call).await?;
        Ok(serde_json::from_str(text.get()).unwrap_or(Value::Null))
    }

    /// [`Self::call`], answering as JSON text (see [`MemState::apply_text`]): what the bootstrap
    /// service sends.
    pub async fn call_text(&self, call: StoreCall) -> Result<Box<RawValue>, MemStoreError> {
        if let StoreCall::Watch { prefix, after, timeout_ms } = &call {
            let deadline = Instant::now() + Duration::from_millis(*timeout_ms).min(MAX_WATCH_WAIT);
            let mut coalesced = false;
            loop {
                let notified = self.changed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                // None: nothing yet; Some(None): changes, wait WATCH_COALESCE once for more;
                // Some(Some(answer)): the answer.
                let (expired, answer) = {
                    let mut st = self.lock();
                    let expired = st.expire(Instant::now());
                    let evs = st.events_ref(prefix, *after)?;
                    let now = Instant::now();
                    let answer = if evs.is_empty() && now < deadline {
                        None
                    } else if !evs.is_empty() && !coalesced && now + WATCH_COALESCE < deadline {
                        Some(None)
                    } else {
                        Some(Some(st.watch_text(&evs)))
                    };
                    (expired, answer)
                };
                if expired > 0 {
                    self.changed.notify_waiters();
                }
                match answer {
                    Some(Some(v)) => return Ok(v),
                    Some(None) => {
                        coalesced = true;
                        tokio::time::sleep(WATCH_COALESCE).await;
                        continue;
                    }
                    None => {}
                }
                let tick = (deadline - Instant::now().min(deadline)).min(EXPIRY_TICK);
                let _ = tokio::time::timeout(tick, notified).await;
            }
        }
        // Waiting watches are woken only by a change (a new revision); lease expiry they check
        // themselves every EXPIRY_TICK.
        let (r, changed) = {
            let mut st = self.lock();
            let before = st.revision();
            let r = st.apply_text(call, Instant::now());
            (r, st.revision() != before)
        };
        if changed {
            self.changed.notify_waiters();
        }
        r
    }
}

/// `v` as JSON text (the store's own types and values always serialize).
fn raw<T: Serialize>(v: &T) -> Box<RawValue> {
    serde_json::value::to_raw_value(v).unwrap_or_else(|_| RawValue::from_string("null".into()).expect("null is JSON"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(s: &mut MemState, k: &str, lease: Option<LeaseId>, now: Instant) -> Result<Value, MemStoreError> {
        s.apply(StoreCall::Put { key: k.into(), value: json!(k), lease }, now)
    }

    #[test]
    fn a_watch_answer_holds_at_most_its_byte_budget_and_the_next_call_the_rest() {
        let t0 = Instant::now();
        let mut s = MemState::new();
        // Three values of 0.4 MiB: two fit one answer, the third comes with the next call.
        let big = "x".repeat(400 << 10);
        for k in ["/a/1", "/a/2", "/a/3"] {
            s.apply(StoreCall::Put { key: k.into(), value: json!(big), lease: None }, t0).unwrap();
        }
        // One event larger than the budget still comes, alone.
        let huge = "y".repeat(WATCH_ANSWER_BYTES + 1);
        s.apply(StoreCall::Put { key: "/a/4".into(), value: json!(huge), lease: None }, t0).unwrap();
        let mut after = 0;
        let mut keys = Vec::new();
        for want in [2, 1, 1, 0] {
            let call = StoreCall::Watch { prefix: "/a/".into(), after, timeout_ms: 0 };
            let a: Value = serde_json::from_str(s.apply_text(call, t0).unwrap().get()).unwrap();
            let evs = a["events"].as_array().unwrap();
            assert_eq!(evs.len(), want, "after {after}");
            assert!(a.to_string().len() <= WATCH_ANSWER_BYTES + 1024 || want == 1);
            for e in evs {
                keys.push(e["key"].as_str().unwrap().to_owned());
                after = e["revision"].as_u64().unwrap();
            }
        }
        assert_eq!(keys, ["/a/1", "/a/2", "/a/3", "/a/4"]);
    }

    #[test]
    fn leases_expire_their_keys_and_history_says_what_was_there() {
        let t0 = Instant::now();
        let mut s = MemState::new();
        let g = s.apply(StoreCall::Grant { ttl_ms: 1000 }, t0).unwrap();
        let lease: LeaseId = serde_json::from_value(g["lease"].clone()).unwrap();
        put(&mut s, "/a/ranks/x", Some(lease), t0).unwrap();
        put(&mut s, "/a/other", None, t0).unwrap();
        let r0 = s.revision();
        // Kept alive at 0.8 s: still there at 1.5 s.
        s.apply(StoreCall::KeepAlive { lease }, t0 + Duration::from_millis(800)).unwrap();
        assert_eq!(s.expire(t0 + Duration::from_millis(1500)), 0);
        // Not refreshed again: gone at 1.9 s, with a delete event that carries the old entry.
        assert_eq!(s.expire(t0 + Duration::from_millis(1900)), 1);
        let evs = s.events_after("/a/ranks/", r0).unwrap();
        assert_eq!(evs.len(), 1);
        assert_eq!(evs[0].kind, EventKind::Delete);
        assert_eq!(evs[0].entry.as_ref().unwrap().json(), json!("/a/ranks/x"));
        // The lease is gone: keep-alive and puts under it are refused; other keys stay.
        let t2 = t0 + Duration::from_secs(2);
        assert_eq!(s.apply(StoreCall::KeepAlive { lease }, t2), Err(MemStoreError::LeaseNotFound { lease }));
        assert!(put(&mut s, "/a/y", Some(lease), t2).is_err());
        let l = s.apply(StoreCall::List { prefix: "/a/".into() }, t2).unwrap();
        assert_eq!(l["entries"].as_array().unwrap().len(), 1);
    }

    #[test]
    fn create_is_exclusive_and_revisions_only_grow() {
        let t = Instant::now();
        let mut s = MemState::new();
        let c = s.apply(StoreCall::Create { key: "k".into(), value: json!(1), lease: None }, t).unwrap();
        assert_eq!(c["created"], true);
        let first = c["revision"].as_u64().unwrap();
        let c = s.apply(StoreCall::Create { key: "k".into(), value: json!(2), lease: None }, t).unwrap();
        assert_eq!(c["created"], false);
        assert_eq!(c["existing"]["value"], json!(1));
        s.apply(StoreCall::Delete { key: "k".into() }, t).unwrap();
        let c = s.apply(StoreCall::Create { key: "k".into(), value: json!(3), lease: None }, t).unwrap();
        assert!(c["revision"].as_u64().unwrap() > first);
    }

    #[test]
    fn history_is_bounded_in_bytes_too() {
        let t = Instant::now();
        let mut s = MemState::new();
        let big = json!("x".repeat(1 << 20));
        for i in 0..100 {
            s.apply(StoreCall::Put { key: format!("big/{}", i % 3), value: big.clone(), lease: None }, t).unwrap();
        }
        let (events, bytes) = s.history();
        assert!(bytes <= HISTORY_BYTES && events < 70, "{events} events, {bytes} bytes");
        assert!(matches!(s.events_after("big/", 1), Err(MemStoreError::Compacted { .. })));
        assert_eq!(s.events_after("big/", s.revision() - 2).unwrap().len(), 2);
        assert_eq!(s.key_count(), 3);
    }

    #[test]
    fn a_watch_too_far_behind_is_told_so() {
        let t = Instant::now();
        let mut s = MemState::new();
        for i in 0..HISTORY + 10 {
            put(&mut s, &format!("k{}", i % 7), None, t).unwrap();
        }
        assert!(matches!(s.events_after("k", 1), Err(MemStoreError::Compacted { .. })));
        assert_eq!(s.events_after("k", s.revision() - 3).unwrap().len(), 3);
    }
}
