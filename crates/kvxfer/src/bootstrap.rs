//! Bootstrap: how ranks of different processes and hosts find each other, and check, before any byte
//! moves, that they describe the same KV cache.
//!
//! An embedded service ([`BootstrapServer`]) and its client ([`BootstrapClient`]) speak JSON lines
//! over TCP: the client opens a connection, sends one request line, reads one response line, and
//! closes. Requests:
//!
//! ```text
//! {"op":"register","entry":<Registration>}            -> {"ok":true}
//! {"op":"peers","role":"decode","want":4,"timeout_ms":30000}
//!                                                     -> {"ok":true,"entries":[<Registration>...]}
//! {"op":"put","key":"req/7","value":<any JSON>}       -> {"ok":true}
//! {"op":"get","key":"req/7","timeout_ms":30000}       -> {"ok":true,"value":<JSON>}
//! {"op":"store","call":<StoreCall>}                   -> {"ok":true,"result":{"Ok":<JSON>}|{"Err":<MemError>}}
//! any failure                                         -> {"ok":false,"error":"<what and what to do>"}
//! ```
//!
//! `store` carries the [`crate::metadata::MetadataStore`] interface (leases, put, create, get, list,
//! delete, watch with a revision) to an in-memory store ([`crate::metadata::memory`]) kept apart from
//! the `register`/`put`/`get` table; [`crate::metadata::bootstrap::BootstrapStore`] is its client.
//!
//! A [`Registration`] carries the rank's role, TP rank and PP stage, backend name, endpoint
//! metadata, KV pool description, and its [`SideSpec`] (KV layout plus parallel config). `register`
//! rejects a rank registered twice and a rank whose layout is incompatible with any rank already
//! registered; the error lists every mismatch of SEMANTICS §6 ([`check_compatible`]), so a
//! misconfigured worker fails at start-up, not with corrupted KV. `peers` waits until `want` ranks of
//! a role are registered; `get` waits until a key is put. Every wait has a deadline (`timeout_ms`,
//! at most [`MAX_WAIT`]), and every client call is bounded by one too.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvxfer_core::model::kv_mismatches;
use kvxfer_core::{EndpointMetadata, RankId, Side, SideSpec, Topology};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

use crate::metadata::memory::{MemShared, StoreCall};
use crate::session::KvPool;

/// Longest a single bootstrap wait may be asked to last.
pub const MAX_WAIT: Duration = Duration::from_secs(600);

/// Longest response line a client reads.
const MAX_LINE: usize = 64 << 20;

/// Longest request line the service reads, newline excluded. The limit applies while reading: a client
/// that sends more without a newline is answered an error and disconnected once it passes the limit, so
/// one connection never holds more than this much of the service's memory.
pub const MAX_REQUEST_LINE: usize = 16 << 20;

/// How long the service keeps reading (and discarding) from a client it refused, so that the client can
/// read the error before the connection closes.
const REFUSED_LINGER: Duration = Duration::from_secs(2);

/// What a rank publishes about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// Prefill or decode.
    pub role: Side,
    /// TP rank and PP stage.
    pub rank: RankId,
    /// Backend name (both sides must use the same).
    pub backend: String,
    /// The endpoint's metadata.
    pub endpoint: EndpointMetadata,
    /// The rank's KV pool.
    pub pool: KvPool,
    /// The rank's KV layout and parallel config.
    pub spec: SideSpec,
    /// Free-form label (host name, process id) for error messages.
    #[serde(default)]
    pub label: String,
}

/// A bootstrap failure, saying what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BootstrapError {
    /// Could not reach or talk to the service.
    #[error("bootstrap at {addr}: {detail}; is `kvxfer demo` or the bootstrap service running there?")]
    Io {
        /// Service address.
        addr: String,
        /// Cause.
        detail: String,
    },
    /// The service answered with an error.
    #[error("bootstrap at {addr} refused {op}: {detail}")]
    Refused {
        /// Service address.
        addr: String,
        /// The request.
        op: String,
        /// The service's reason.
        detail: String,
    },
    /// Two sides that cannot exchange KV.
    #[error("{prefill} and {decode} cannot exchange KV: {}", problems.join("; "))]
    Incompatible {
        /// The prefill rank (label).
        prefill: String,
        /// The decode rank (label).
        decode: String,
        /// Every problem found.
        problems: Vec<String>,
    },
    /// A wait ran past its deadline.
    #[error("bootstrap at {addr}: {what} did not happen within {after:?}")]
    Timeout {
        /// Service address.
        addr: String,
        /// What was waited for.
        what: String,
        /// How long.
        after: Duration,
    },
}

/// Checks that a prefill side and a decode side can exchange KV: every field of SEMANTICS §6 is
/// compared and **every** mismatch is reported (page size, dtype, head dims, layer count, H,
/// attention kind, layout), then the parallel configs are validated ([`Topology::new`]: TP ratio,
/// PP, divisibility). Returns the topology when compatible, else all problems found.
pub fn check_compatible(prefill: &SideSpec, decode: &SideSpec) -> Result<Topology, Vec<String>> {
    let mism = kv_mismatches(&prefill.kv, &decode.kv);
    if mism.is_empty() {
        return Topology::new(prefill, decode).map_err(|e| vec![e.to_string()]);
    }
    let mut problems: Vec<String> = mism.iter().map(ToString::to_string).collect();
    // The layouts differ; still name the parallel-config problems, each against its own side.
    let (p, d) = (prefill.parallel, decode.parallel);
    if p.tp > 0 && d.tp > 0 && p.tp.max(d.tp) % p.tp.min(d.tp) != 0 {
        problems
            .push(format!("prefill TP {} and decode TP {}: the larger must be a multiple of the smaller", p.tp, d.tp));
    }
    if d.pp != 1 && d.pp != p.pp {
        problems.push(format!("decode PP {} must be 1 or equal to prefill PP {}", d.pp, p.pp));
    }
    for (side, s) in [("prefill", prefill), ("decode", decode)] {
        if let Err(e) = Topology::new(s, s) {
            problems.push(format!("{side} alone: {e}"));
        }
    }
    Err(problems)
}

pub(crate) fn describe(r: &Registration) -> String {
    let mut s = format!("{} rank {}", r.role, r.rank);
    if !r.label.is_empty() {
        s.push_str(&format!(" ({})", r.label));
    }
    s
}

/// Checks a new registration against one already there.
pub(crate) fn check_pair(a: &Registration, b: &Registration) -> Result<(), BootstrapError> {
    let (p, d) = if a.role == Side::Prefill { (a, b) } else { (b, a) };
    let mut problems = Vec::new();
    if a.backend != b.backend {
        problems.push(format!("backend differs (prefill {}, decode {})", p.backend, d.backend));
    }
    if a.role == b.role {
        // Same side: the whole side spec must agree (one parallel config per side).
        if a.spec != b.spec {
            problems
                .push(format!("two {} ranks describe different configurations ({:?} vs {:?})", a.role, a.spec, b.spec));
        }
    } else if let Err(mut ps) = check_compatible(&p.spec, &d.spec) {
        problems.append(&mut ps);
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(BootstrapError::Incompatible { prefill: describe(p), decode: describe(d), problems })
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
enum Request {
    Register { entry: Box<Registration> },
    Peers { role: Side, want: u32, timeout_ms: u64 },
    Put { key: String, value: Value },
    Get { key: String, timeout_ms: u64 },
    Store { call: StoreCall },
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Response {
    ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    entries: Option<Vec<Registration>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    value: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    result: Option<Value>,
}

#[derive(Default)]
struct State {
    entries: BTreeMap<(u8, RankId), Registration>,
    kv: HashMap<String, Value>,
}

fn side_key(s: Side) -> u8 {
    match s {
        Side::Prefill => 0,
        Side::Decode => 1,
    }
}

struct Service {
    state: Mutex<State>,
    changed: tokio::sync::Notify,
    store: MemShared,
}

impl Service {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn handle(&self, req: Request) -> Response {
        let err = |e: String| Response { ok: false, error: Some(e), ..Default::default() };
        match req {
            Request::Register { entry } => {
                let mut st = self.lock();
                let key = (side_key(entry.role), entry.rank);
                if let Some(old) = st.entries.get(&key) {
                    return err(format!(
                        "{} is already registered ({}); each rank registers once per bootstrap service",
                        describe(&entry),
                        describe(old)
                    ));
                }
                for other in st.entries.values() {
                    if let Err(e) = check_pair(&entry, other) {
                        return err(e.to_string());
                    }
                }
                st.entries.insert(key, *entry);
                drop(st);
                self.changed.notify_waiters();
                Response { ok: true, ..Default::default() }
            }
            Request::Peers { role, want, timeout_ms } => {
                let deadline = Instant::now() + Duration::from_millis(timeout_ms).min(MAX_WAIT);
                loop {
                    let notified = self.changed.notified();
                    {
                        let st = self.lock();
                        let found: Vec<Registration> =
                            st.entries.values().filter(|e| e.role == role).cloned().collect();
                        if found.len() >= want as usize {
                            return Response { ok: true, entries: Some(found), ..Default::default() };
                        }
                        if Instant::now() >= deadline {
                            let have: Vec<String> = found.iter().map(|e| e.rank.to_string()).collect();
                            return err(format!(
                                "only {} of {want} {role} ranks registered within {timeout_ms} ms (have: [{}])",
                                found.len(),
                                have.join(", ")
                            ));
                        }
                    }
                    let _ = tokio::time::timeout_at(deadline.into(), notified).await;
                }
            }
            Request::Put { key, value } => {
                self.lock().kv.insert(key, value);
                self.changed.notify_waiters();
                Response { ok: true, ..Default::default() }
            }
            Request::Store { call } => {
                let r = self.store.call(call).await;
                match serde_json::to_value(r) {
                    Ok(v) => Response { ok: true, result: Some(v), ..Default::default() },
                    Err(e) => err(format!("cannot encode the store's answer: {e}")),
                }
            }
            Request::Get { key, timeout_ms } => {
                let deadline = Instant::now() + Duration::from_millis(timeout_ms).min(MAX_WAIT);
                loop {
                    let notified = self.changed.notified();
                    if let Some(v) = self.lock().kv.get(&key) {
                        return Response { ok: true, value: Some(v.clone()), ..Default::default() };
                    }
                    if Instant::now() >= deadline {
                        return err(format!("key {key:?} was not put within {timeout_ms} ms"));
                    }
                    let _ = tokio::time::timeout_at(deadline.into(), notified).await;
                }
            }
        }
    }
}

/// The embedded bootstrap service. Runs on the current tokio runtime until dropped.
pub struct BootstrapServer {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl BootstrapServer {
    /// Binds `addr` (e.g. `127.0.0.1:0`, or `0.0.0.0:7878` for workers on other hosts) and serves.
    pub async fn start(addr: &str) -> Result<Self, BootstrapError> {
        let io = |detail: String| BootstrapError::Io { addr: addr.to_owned(), detail };
        let listener = TcpListener::bind(addr).await.map_err(|e| io(format!("cannot listen: {e}")))?;
        let local = listener.local_addr().map_err(|e| io(e.to_string()))?;
        let svc = Arc::new(Service {
            state: Mutex::new(State::default()),
            changed: tokio::sync::Notify::new(),
            store: MemShared::new(),
        });
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                };
                let svc = Arc::clone(&svc);
                tokio::spawn(async move {
                    let _ = serve_conn(&svc, stream).await;
                });
            }
        });
        Ok(Self { addr: local, task })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for BootstrapServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve_conn(svc: &Service, stream: TcpStream) -> std::io::Result<()> {
    let (r, mut w) = stream.into_split();
    let mut r = BufReader::new(r);
    let mut line = String::new();
    // A request line must arrive promptly; the answer may wait (peers / get carry their own deadline).
    let n = match tokio::time::timeout(Duration::from_secs(30), read_line(&mut r, &mut line, MAX_REQUEST_LINE)).await {
        Ok(Ok(n)) => n,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::InvalidData => {
            // Too long or not UTF-8: say so, then close.
            let resp = Response { ok: false, error: Some(format!("malformed request: {e}")), ..Default::default() };
            let mut out = serde_json::to_vec(&resp).map_err(std::io::Error::other)?;
            out.push(b'\n');
            w.write_all(&out).await?;
            w.shutdown().await?;
            // Closing with unread input would reset the connection and could destroy the answer before
            // the client reads it: discard what it still sends for a moment (constant memory).
            let mut sink = [0u8; 8192];
            let _ = tokio::time::timeout(REFUSED_LINGER, async {
                while matches!(r.read(&mut sink).await, Ok(n) if n > 0) {}
            })
            .await;
            return Ok(());
        }
        Ok(Err(e)) => return Err(e),
        Err(_) => return Ok(()),
    };
    if n == 0 {
        return Ok(());
    }
    let resp = match serde_json::from_str::<Request>(&line) {
        Ok(req) => svc.handle(req).await,
        Err(e) => Response { ok: false, error: Some(format!("malformed request: {e}")), ..Default::default() },
    };
    let mut out = serde_json::to_vec(&resp).map_err(std::io::Error::other)?;
    out.push(b'\n');
    w.write_all(&out).await?;
    w.shutdown().await
}

/// Reads one line (up to and including `\n`, or up to the end of the stream) into `line` and returns
/// the bytes read. The limit applies while reading: at most `limit + 1` bytes (the line and its newline)
/// are ever buffered; a longer line is an `InvalidData` error, as is a line that is not UTF-8.
async fn read_line<R: tokio::io::AsyncBufRead + Unpin>(
    r: &mut R,
    line: &mut String,
    limit: usize,
) -> std::io::Result<usize> {
    let mut buf = Vec::new();
    let n = (&mut *r).take(limit as u64 + 1).read_until(b'\n', &mut buf).await?;
    if buf.len() > limit && buf.last() != Some(&b'\n') {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("line longer than {limit} bytes without a newline; a bootstrap message is one JSON line of at most {limit} bytes"),
        ));
    }
    let text = String::from_utf8(buf)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("line is not UTF-8: {e}")))?;
    line.push_str(&text);
    Ok(n)
}

/// A client of the bootstrap service.
#[derive(Debug, Clone)]
pub struct BootstrapClient {
    addr: String,
    /// Bound on connecting and on calls that do not wait for others.
    timeout: Duration,
}

impl BootstrapClient {
    /// A client of the service at `addr` (`host:port`). Nothing is sent until the first call.
    pub fn new(addr: impl Into<String>) -> Self {
        Self { addr: addr.into(), timeout: Duration::from_secs(30) }
    }

    /// The same client with another bound on connecting and on calls that do not wait for others.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The service address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    async fn call(&self, op: &str, req: &Request, wait: Duration) -> Result<Response, BootstrapError> {
        let io = |detail: String| BootstrapError::Io { addr: self.addr.clone(), detail };
        let total = self.timeout + wait;
        let fut = async {
            let stream = tokio::time::timeout(self.timeout, TcpStream::connect(&self.addr))
                .await
                .map_err(|_| io(format!("no connection within {:?}", self.timeout)))?
                .map_err(|e| io(format!("cannot connect: {e}")))?;
            let (r, mut w) = stream.into_split();
            let mut line = serde_json::to_vec(req).map_err(|e| io(e.to_string()))?;
            line.push(b'\n');
            w.write_all(&line).await.map_err(|e| io(format!("sending {op}: {e}")))?;
            let mut r = BufReader::new(r);
            let mut resp = String::new();
            let n = read_line(&mut r, &mut resp, MAX_LINE)
                .await
                .map_err(|e| io(format!("reading the answer to {op}: {e}")))?;
            if n == 0 {
                return Err(io(format!("the service closed the connection without answering {op}")));
            }
            serde_json::from_str::<Response>(&resp).map_err(|e| io(format!("malformed answer to {op}: {e}")))
        };
        let resp = tokio::time::timeout(total, fut).await.map_err(|_| BootstrapError::Timeout {
            addr: self.addr.clone(),
            what: format!("the answer to {op}"),
            after: total,
        })??;
        if resp.ok {
            Ok(resp)
        } else {
            Err(BootstrapError::Refused {
                addr: self.addr.clone(),
                op: op.to_owned(),
                detail: resp.error.unwrap_or_else(|| "no reason given".into()),
            })
        }
    }

    /// Publishes a rank. Fails if the rank is already registered or incompatible with a rank that is.
    pub async fn register(&self, entry: &Registration) -> Result<(), BootstrapError> {
        let op = format!("register {}", describe(entry));
        self.call(&op, &Request::Register { entry: Box::new(entry.clone()) }, Duration::ZERO).await.map(|_| ())
    }

    /// Waits until `want` ranks of `role` are registered (at most `timeout`) and returns them.
    pub async fn peers(&self, role: Side, want: u32, timeout: Duration) -> Result<Vec<Registration>, BootstrapError> {
        let timeout = timeout.min(MAX_WAIT);
        let req = Request::Peers { role, want, timeout_ms: timeout.as_millis() as u64 };
        Ok(self.call(&format!("peers {role}"), &req, timeout).await?.entries.unwrap_or_default())
    }

    /// Waits for the ranks of `role`, then checks each against `me`: every layout mismatch is
    /// reported before any byte moves. Returns the peers and the topology.
    pub async fn handshake(
        &self,
        me: &Registration,
        role: Side,
        want: u32,
        timeout: Duration,
    ) -> Result<(Vec<Registration>, Topology), BootstrapError> {
        let peers = self.peers(role, want, timeout).await?;
        for p in &peers {
            check_pair(me, p)?;
        }
        let other = peers.first().ok_or_else(|| BootstrapError::Refused {
            addr: self.addr.clone(),
            op: format!("peers {role}"),
            detail: "no ranks registered".into(),
        })?;
        let (p, d) = if me.role == Side::Prefill { (me, other) } else { (other, me) };
        let topo = check_compatible(&p.spec, &d.spec).map_err(|problems| BootstrapError::Incompatible {
            prefill: describe(p),
            decode: describe(d),
            problems,
        })?;
        Ok((peers, topo))
    }

    /// One call of the metadata-store interface (the `store` request): the in-memory store's answer.
    pub(crate) async fn store_call(&self, call: StoreCall, wait: Duration) -> Result<Value, BootstrapError> {
        let op = call.describe();
        Ok(self.call(&op, &Request::Store { call }, wait).await?.result.unwrap_or(Value::Null))
    }

    /// Stores `value` under `key` (overwrites).
    pub async fn put(&self, key: &str, value: Value) -> Result<(), BootstrapError> {
        self.call(&format!("put {key}"), &Request::Put { key: key.to_owned(), value }, Duration::ZERO).await.map(|_| ())
    }

    /// Waits until `key` is put (at most `timeout`) and returns its value.
    pub async fn get(&self, key: &str, timeout: Duration) -> Result<Value, BootstrapError> {
        let timeout = timeout.min(MAX_WAIT);
        let req = Request::Get { key: key.to_owned(), timeout_ms: timeout.as_millis() as u64 };
        Ok(self.call(&format!("get {key}"), &req, timeout).await?.value.unwrap_or(Value::Null))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvxfer_core::{Attention, KvSpec, Layout, Parallel};

    fn spec(tp: u32, heads: u32, page: u32) -> SideSpec {
        SideSpec {
            kv: KvSpec {
                attention: Attention::Gqa { kv_heads: heads, head_dim_k: 128, head_dim_v: 128 },
                layers: 4,
                dtype_bytes: 2,
                page_size: page,
                layout: Layout::Nhd,
            },
            parallel: Parallel { tp, pp: 1 },
        }
    }

    fn reg(role: Side, tp: u32, s: SideSpec) -> Registration {
        Registration {
            role,
            rank: RankId::new(tp, 0),
            backend: "tcp".into(),
            endpoint: EndpointMetadata { version: 1, backend: "tcp".into(), identity: 0, payload: vec![] },
            pool: KvPool { pages: 1, buffers: vec![] },
            spec: s,
            label: String::new(),
        }
    }

    #[test]
    fn every_mismatch_is_reported() {
        let mut d = spec(1, 8, 16);
        d.kv.page_size = 32;
        d.kv.dtype_bytes = 1;
        d.kv.attention = Attention::Gqa { kv_heads: 4, head_dim_k: 64, head_dim_v: 128 };
        d.kv.layers = 8;
        let e = check_compatible(&spec(2, 8, 16), &d).unwrap_err();
        let all = e.join("; ");
        for f in ["page_size", "dtype_bytes", "layers", "kv_heads", "head_dim_k"] {
            assert!(all.contains(f), "{f} missing from {all}");
        }
        assert!(!all.contains("head_dim_v"));
        // Parallel-config problems are reported together with layout mismatches.
        let mut d3 = spec(3, 8, 32);
        d3.parallel.pp = 2;
        let e = check_compatible(&spec(2, 8, 16), &d3).unwrap_err().join("; ");
        assert!(e.contains("page_size") && e.contains("multiple") && e.contains("decode PP 2"), "{e}");
        let e = check_compatible(&spec(3, 12, 16), &spec(2, 12, 16)).unwrap_err();
        assert!(e[0].contains("multiple"), "{e:?}");
        assert!(check_compatible(&spec(2, 8, 16), &spec(4, 8, 16)).is_ok());
    }

    #[tokio::test]
    async fn register_query_and_reject_over_real_sockets() {
        let server = BootstrapServer::start("127.0.0.1:0").await.unwrap();
        let c = BootstrapClient::new(server.addr().to_string());
        c.register(&reg(Side::Prefill, 0, spec(2, 8, 16))).await.unwrap();
        // Duplicate rank.
        let e = c.register(&reg(Side::Prefill, 0, spec(2, 8, 16))).await.unwrap_err();
        assert!(e.to_string().contains("already registered"), "{e}");
        // Incompatible decode: every mismatch named.
        let mut bad = spec(1, 8, 32);
        bad.kv.dtype_bytes = 4;
        let e = c.register(&reg(Side::Decode, 0, bad)).await.unwrap_err().to_string();
        assert!(e.contains("page_size") && e.contains("dtype_bytes"), "{e}");
        // Waiting for peers that never come ends at the deadline with a reason.
        let e = c.peers(Side::Decode, 1, Duration::from_millis(100)).await.unwrap_err().to_string();
        assert!(e.contains("only 0 of 1"), "{e}");
        // A compatible decode registers; both sides see each other; the handshake builds the topology.
        let d = reg(Side::Decode, 0, spec(1, 8, 16));
        c.register(&d).await.unwrap();
        c.register(&reg(Side::Prefill, 1, spec(2, 8, 16))).await.unwrap();
        let (peers, topo) = c.handshake(&d, Side::Prefill, 2, Duration::from_secs(5)).await.unwrap();
        assert_eq!(peers.len(), 2);
        assert_eq!(topo.expected_senders(RankId::new(0, 0)).len(), 2);
        // Key-value with waiting.
        let c2 = c.clone();
        let getter = tokio::spawn(async move { c2.get("req/1", Duration::from_secs(5)).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        c.put("req/1", serde_json::json!([3, 1, 2])).await.unwrap();
        assert_eq!(getter.await.unwrap().unwrap(), serde_json::json!([3, 1, 2]));
        let e = c.get("never", Duration::from_millis(50)).await.unwrap_err().to_string();
        assert!(e.contains("not put"), "{e}");
        // A client of a service that is not there fails with the address.
        drop(server);
        let e = BootstrapClient::new("127.0.0.1:1").put("x", Value::Null).await.unwrap_err().to_string();
        assert!(e.contains("127.0.0.1:1"), "{e}");
    }

    #[tokio::test]
    async fn read_line_applies_its_limit_while_reading() {
        async fn read(input: &[u8], limit: usize) -> std::io::Result<(usize, String, Vec<u8>)> {
            let mut r = BufReader::with_capacity(3, input);
            let mut line = String::new();
            let n = read_line(&mut r, &mut line, limit).await?;
            let mut rest = Vec::new();
            r.read_to_end(&mut rest).await?;
            Ok((n, line, rest))
        }
        // At the limit, with its newline; the next line stays unread.
        assert_eq!(read(b"abcd\nef", 4).await.unwrap(), (5, "abcd\n".into(), b"ef".to_vec()));
        // The end of the stream ends a line too.
        assert_eq!(read(b"abcd", 4).await.unwrap(), (4, "abcd".into(), vec![]));
        assert_eq!(read(b"", 4).await.unwrap(), (0, String::new(), vec![]));
        // One byte over: refused after reading limit + 1 bytes, not the whole line.
        let mut long = vec![b'x'; 1 << 20];
        long.push(b'\n');
        let mut r = BufReader::with_capacity(8, &long[..]);
        let mut line = String::new();
        let e = read_line(&mut r, &mut line, 4).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("longer than 4 bytes"), "{e}");
        assert!(line.is_empty());
        let mut rest = Vec::new();
        r.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest.len(), long.len() - 5, "read more than the limit");
        // Not UTF-8.
        let e = read(b"\xff\xfe\n", 4).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
    }

    #[tokio::test]
    async fn an_over_long_request_is_answered_and_the_service_keeps_serving() {
        let server = BootstrapServer::start("127.0.0.1:0").await.unwrap();
        let mut s = TcpStream::connect(server.addr()).await.unwrap();
        s.write_all(&vec![b'{'; MAX_REQUEST_LINE + 10]).await.unwrap();
        let mut answer = String::new();
        BufReader::new(&mut s).read_line(&mut answer).await.unwrap();
        assert!(answer.contains("\"ok\":false") && answer.contains("longer than"), "{answer}");
        let c = BootstrapClient::new(server.addr().to_string());
        c.put("k", Value::Bool(true)).await.unwrap();
        assert_eq!(c.get("k", Duration::from_secs(1)).await.unwrap(), Value::Bool(true));
    }
}
