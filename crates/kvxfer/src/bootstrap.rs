//! Bootstrap: how ranks of different processes and hosts find each other, and check, before any byte
//! moves, that they describe the same KV cache.
//!
//! An embedded service ([`BootstrapServer`]) and its client ([`BootstrapClient`]) speak JSON lines
//! over TCP: the client opens a connection, sends one request line, reads one response line, and
//! closes. Requests:
//!
//! ```text
//! {"op":"store","call":<StoreCall>}                   -> {"ok":true,"result":{"Ok":<JSON>}|{"Err":<MemStoreError>}}
//! {"op":"stats"}                                      -> {"ok":true,"stats":<ServerStats>}
//! any failure                                         -> {"ok":false,"error":"<what and what to do>"[,"kind":"auth"|"busy"|"limit"|"version"]}
//! ```
//!
//! Every request also carries `"v"`, the kvxfer protocol of the client ([`kvxfer_core::protocol`]; a
//! request without it is of protocol 2, the previous release, whose client wrote none), and every
//! answer `"v"`, the newest protocol of the service. A request of a version the service does not
//! speak is refused by name (`kind` `version`).
//!
//! `store` carries the [`crate::metadata::MetadataStore`] interface (leases, put, create, get, list,
//! delete, watch with a revision) to an in-memory store ([`crate::metadata::memory`]);
//! [`crate::metadata::bootstrap::BootstrapStore`] is its client. Ranks publish their
//! [`RankRegistration`] there ([`crate::metadata::Membership`]), which checks it against every
//! rank already registered ([`check_rank_in_config`], `check_pair`: every mismatch of SEMANTICS
//! §6 with both values), so a misconfigured worker fails at start-up, not with corrupted KV.
//! (The service once kept a `register`/`peers`/`put`/`get`/`delete` table beside the store; no
//! release's ranks used it, and it is gone: such a request is refused naming the store.)
//!
//! Every wait (a store `watch`) has a deadline (at most
//! [`MAX_WATCH_WAIT`](crate::metadata::memory::MAX_WATCH_WAIT)), and every client call is
//! bounded by one too. A client keeps its connection open until it has read the answer: closing it
//! (or only its sending half) cancels a waiting request.
//!
//! **Limits** ([`Limits`], all configurable through [`ServerConfig`]): connections open at once
//! (beyond: one error line, closed; the accept loop goes on, and backs off briefly when accepting
//! fails, for example at the open-file limit), the length of a request line (applied while
//! reading), the size of a stored value, waits held at once (store watches), and the time a
//! connection may take to send its request line (however slowly it trickles in). `stats` reports
//! the store's keys and leases and every counter, so a long-running service can be checked for
//! leaks.
//!
//! **Shared secret** (optional, [`ServerConfig::secret`]): the service then greets each connection
//! with a random challenge, and each request line must carry an HMAC-SHA256 proof over that
//! challenge and the request's bytes; see [`crate::metadata::auth`]. A captured request cannot be
//! replayed on another connection. Without a secret, anyone who can reach the port can read and
//! write every key and rank record.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvxfer_core::model::kv_mismatches;
use kvxfer_core::{EndpointMetadata, ProtocolRange, RankId, Side, SideSpec, Topology};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

use crate::metadata::auth;
pub use crate::metadata::auth::{Secret, SecretError, SECRET_ENV};
use crate::metadata::memory::{json_len, MemShared, StoreCall};
use crate::session::KvPool;

/// Longest response line a client reads.
const MAX_LINE: usize = 64 << 20;

/// Longest request line the service reads by default ([`Limits::max_request_line`]), newline
/// excluded. The limit applies while reading: a client that sends more without a newline is answered
/// an error and disconnected once it passes the limit, so one connection never holds more than this
/// much of the service's memory.
pub const MAX_REQUEST_LINE: usize = 16 << 20;

/// Default of [`Limits::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;

/// Default of [`Limits::max_connections_per_source`]: a quarter of the connections, so one host
/// (or one misbehaving client) cannot take them all; a host of 8 ranks uses a few dozen.
pub const DEFAULT_MAX_CONNECTIONS_PER_SOURCE: usize = 1024;

/// Default of [`Limits::max_waits`]: half the connections, so waits never starve short calls.
pub const DEFAULT_MAX_WAITS: usize = 2048;

/// Default of [`Limits::max_value_bytes`] (1 MiB).
pub const DEFAULT_MAX_VALUE_BYTES: usize = 1 << 20;

/// Default of [`Limits::idle_timeout`].
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the service keeps reading (and discarding) from a client it refused, so that the client can
/// read the error before the connection closes.
const REFUSED_LINGER: Duration = Duration::from_secs(2);

/// The same, for a connection closed for idling (it sends nothing, or a trickle).
const IDLE_LINGER: Duration = Duration::from_millis(500);

/// Refused connections lingering at once; beyond, a refusal is written without waiting and closed.
const MAX_LINGERING: usize = 64;

/// Longest pause of the accept loop after accepting failed (it doubles from 5 ms while failures go on).
const MAX_ACCEPT_BACKOFF: Duration = Duration::from_millis(200);

/// What a rank publishes about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankRegistration {
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
    /// The model whose KV cache this rank holds, as the engine names it
    /// ([`crate::engine::AgentConfig::model`]); `None` when the engine gave none. Two ranks that
    /// both name one and name different ones never pair (a record without it, from an engine that
    /// gave none or from a kvxfer older than this field, pairs with anything of the same layout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelIdentity>,
    /// The kvxfer protocol versions the rank speaks ([`kvxfer_core::protocol`]); two ranks that
    /// share none never pair, and the pair uses the highest both speak. A record without it comes
    /// from a protocol-2 build and reads as speaking 2 only. (Metadata stores keep records as the
    /// rank wrote them, so a bootstrap service or etcd of any version passes the field on.)
    #[serde(default)]
    pub protocol: ProtocolRange,
    /// A decode rank's warm-up region: each prefill rank writes what a one-page request would
    /// into it right after connecting ([`crate::session::SenderSession::warm_up`]), so that the
    /// first request does not pay the transport's first-use costs. `None` for prefill ranks, for
    /// a backend that takes no host memory, and in records of a kvxfer older than this field
    /// (those connections are not warmed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup: Option<WarmupRegion>,
}

/// A region a decode rank registered only for warm-up writes; its bytes are never read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WarmupRegion {
    /// Its region id ([`crate::session::WARMUP_REGION`]).
    pub region: kvxfer_core::RegionId,
    /// Its length: at least [`crate::session::warmup_bytes`] of the rank.
    pub len: u64,
}

/// What model a rank's KV cache belongs to, beyond what the layout says: two models of one shape
/// (a fine-tune and its base, two revisions, bf16 and fp16 weights of 2 bytes each) have KV caches
/// of the same geometry that must never be exchanged. Every field is compared as given; an empty
/// field matches only an empty field.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelIdentity {
    /// The model's name or path as the engine was started with it (`meta-llama/Llama-3.1-8B`).
    pub name: String,
    /// Its revision (a commit hash or tag; empty when the engine does not know one).
    #[serde(default)]
    pub revision: String,
    /// The KV cache's element type as the engine names it (`bfloat16`, `float8_e4m3fn`).
    #[serde(default)]
    pub dtype: String,
}

impl std::fmt::Display for ModelIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.name)?;
        if !self.revision.is_empty() {
            write!(f, "@{}", self.revision)?;
        }
        if !self.dtype.is_empty() {
            write!(f, " ({})", self.dtype)?;
        }
        Ok(())
    }
}

/// Counters of a bootstrap service ([`BootstrapServer::stats`], [`BootstrapClient::stats`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ServerStats {
    /// Keys of the metadata store (`store` requests).
    pub store_keys: u64,
    /// Live leases of the metadata store.
    pub store_leases: u64,
    /// Connections open now (over the wire: the one asking included).
    pub connections: u64,
    /// Waits held now (store watches).
    pub waits: u64,
    /// Connections accepted since start.
    pub accepted: u64,
    /// Connections refused at [`Limits::max_connections`].
    pub refused_connections: u64,
    /// Connections refused at [`Limits::max_connections_per_source`].
    pub refused_per_source: u64,
    /// Waits refused at [`Limits::max_waits`].
    pub refused_waits: u64,
    /// Values refused at [`Limits::max_value_bytes`].
    pub refused_values: u64,
    /// Requests refused for a missing or wrong proof of the shared secret.
    pub auth_failures: u64,
    /// Connections whose TLS handshake failed or did not finish in time (TLS services only).
    pub tls_failures: u64,
    /// Connections closed because no complete request line came within [`Limits::idle_timeout`].
    pub idle_closed: u64,
    /// Request lines refused as too long, not UTF-8, or not a request.
    pub malformed: u64,
    /// Failures of accepting a connection (for example at the open-file limit).
    pub accept_errors: u64,
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
    /// A rank whose TP rank or PP stage lies outside its own side's parallel config.
    #[error(
        "{who} is outside its own parallel config: TP rank {} with TP {tp}, PP stage {} with PP {pp} (ranks count \
         from 0 and must be below the size); check the rank's --tp-rank/--pp-stage against its side's TP and PP",
        rank.tp, rank.pp
    )]
    RankOutsideConfig {
        /// The rank (label).
        who: String,
        /// Its TP rank and PP stage.
        rank: RankId,
        /// Its side's TP size.
        tp: u32,
        /// Its side's PP size.
        pp: u32,
    },
    /// The shared secret was refused, or is missing on one side.
    #[error("bootstrap at {addr}: {detail}")]
    Auth {
        /// Service address.
        addr: String,
        /// What went wrong and what to do.
        detail: String,
    },
    /// A service configuration or secret that cannot be used.
    #[error("bootstrap configuration: {detail}")]
    Config {
        /// What is wrong.
        detail: String,
    },
}

impl From<SecretError> for BootstrapError {
    fn from(e: SecretError) -> Self {
        BootstrapError::Config { detail: e.to_string() }
    }
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
    let (p, d) = (&prefill.parallel, &decode.parallel);
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

pub(crate) fn describe(r: &RankRegistration) -> String {
    let mut s = format!("{} rank {}", r.role, r.rank);
    if !r.label.is_empty() {
        s.push_str(&format!(" ({})", r.label));
    }
    s
}

/// Every difference between two side specs of one role, each with both values (`a` first).
fn side_differences(a: &SideSpec, b: &SideSpec) -> Vec<String> {
    let mut out: Vec<String> =
        kv_mismatches(&a.kv, &b.kv).into_iter().map(|m| format!("{} {} vs {}", m.field, m.prefill, m.decode)).collect();
    let (pa, pb) = (&a.parallel, &b.parallel);
    if pa.tp != pb.tp {
        out.push(format!("TP {} vs {}", pa.tp, pb.tp));
    }
    if pa.pp != pb.pp {
        out.push(format!("PP {} vs {}", pa.pp, pb.pp));
    }
    if pa != pb && pa.tp == pb.tp && pa.pp == pb.pp {
        out.push(format!("parallel config {pa:?} vs {pb:?}"));
    }
    if out.is_empty() && a != b {
        out.push(format!("{a:?} vs {b:?}"));
    }
    out
}

/// Checks a new registration against one already there.
pub(crate) fn check_pair(a: &RankRegistration, b: &RankRegistration) -> Result<(), BootstrapError> {
    let (p, d) = if a.role == Side::Prefill { (a, b) } else { (b, a) };
    let mut problems = Vec::new();
    if a.backend != b.backend {
        problems.push(format!("backend differs (prefill {}, decode {})", p.backend, d.backend));
    }
    if b.protocol.negotiate(a.protocol, "the peer").is_err() {
        // Whichever rank is behind is the one to upgrade.
        let (behind, ahead) = if a.protocol.newest < b.protocol.oldest { (a, b) } else { (b, a) };
        problems.push(format!(
            "no common kvxfer protocol ({} speaks {}, {} speaks {}): upgrade {} to a kvxfer that speaks protocol {} or \
             later (a rolling upgrade goes one protocol version at a time)",
            describe(behind),
            behind.protocol,
            describe(ahead),
            ahead.protocol,
            describe(behind),
            ahead.protocol.oldest,
        ));
    }
    if let (Some(ma), Some(mb)) = (&a.model, &b.model) {
        if ma != mb {
            problems.push(if a.role == b.role {
                format!(
                    "model differs between two {} ranks ({} has {ma}, {} has {mb}): start every rank with the same model",
                    a.role,
                    describe(a),
                    describe(b)
                )
            } else {
                format!(
                    "model differs (prefill {}, decode {}): their KV caches must never be exchanged",
                    p.model.as_ref().map_or_else(String::new, ToString::to_string),
                    d.model.as_ref().map_or_else(String::new, ToString::to_string)
                )
            });
        }
    }
    if a.role == b.role {
        // Same side: the whole side spec must agree (one parallel config per side).
        let diff = side_differences(&a.spec, &b.spec);
        if !diff.is_empty() {
            problems.push(format!(
                "two {} ranks describe different configurations ({} has {}; every rank of a side must be started \
                 with the same workload)",
                a.role,
                describe(a),
                diff.iter()
                    .map(|d| d.replacen(" vs ", &format!(", {} has ", describe(b)), 1))
                    .collect::<Vec<_>>()
                    .join("; ")
            ));
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

/// Checks that a rank lies inside its own side's parallel config: TP rank below TP, PP stage below PP.
pub fn check_rank_in_config(r: &RankRegistration) -> Result<(), BootstrapError> {
    let par = &r.spec.parallel;
    if r.rank.tp >= par.tp || r.rank.pp >= par.pp {
        return Err(BootstrapError::RankOutsideConfig { who: describe(r), rank: r.rank, tp: par.tp, pp: par.pp });
    }
    Ok(())
}

/// Raises this process's soft limit of open files (`RLIMIT_NOFILE`) towards `want`, at most to the
/// hard limit, and returns the soft limit now in force. A service that should hold `N` connections
/// needs about `N` + 64 descriptors; the soft limit is often 1024 while the hard limit is far higher.
/// Does nothing where the platform has no such limit.
pub fn raise_open_file_limit(want: u64) -> std::io::Result<u64> {
    #[cfg(unix)]
    {
        rlimit::increase_nofile_limit(want)
    }
    #[cfg(not(unix))]
    {
        Ok(want)
    }
}

/// Limits of one bootstrap service. Every limit answers a client that reaches it with an error that
/// names the limit; none stops the service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Connections open at once; a connection beyond is answered one error line and closed.
    pub max_connections: usize,
    /// Connections open at once from one source address (IP); one beyond is answered one error line
    /// and closed, while other sources are still served.
    pub max_connections_per_source: usize,
    /// Waits held at once (store watches); a wait beyond is answered with an error at once.
    pub max_waits: usize,
    /// Largest value of a store put or create, in bytes of JSON.
    pub max_value_bytes: usize,
    /// Longest request line, newline excluded (applied while reading).
    pub max_request_line: usize,
    /// Time from accepting a connection to its complete request line; then it is answered an error
    /// and closed, however slowly its bytes were trickling in. Also bounds writing an answer.
    pub idle_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_connections_per_source: DEFAULT_MAX_CONNECTIONS_PER_SOURCE,
            max_waits: DEFAULT_MAX_WAITS,
            max_value_bytes: DEFAULT_MAX_VALUE_BYTES,
            max_request_line: MAX_REQUEST_LINE,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
        }
    }
}

impl Limits {
    fn check(&self) -> Result<(), BootstrapError> {
        let bad = |detail: String| Err(BootstrapError::Config { detail });
        if self.max_connections == 0 {
            return bad("max_connections must be at least 1".into());
        }
        if self.max_connections_per_source == 0 {
            return bad("max_connections_per_source must be at least 1".into());
        }
        if self.max_value_bytes == 0 {
            return bad("max_value_bytes must be at least 1".into());
        }
        if self.max_request_line < 1024 {
            return bad(format!(
                "max_request_line {} is below 1024 bytes; a rank record needs more",
                self.max_request_line
            ));
        }
        if self.idle_timeout.is_zero() {
            return bad("idle_timeout must be above 0".into());
        }
        Ok(())
    }
}

/// How a bootstrap service runs ([`BootstrapServer::start_with`]).
#[derive(Debug, Clone, Default)]
pub struct ServerConfig {
    /// A shared secret every request must prove (challenge-response, see [`crate::metadata::auth`]);
    /// `None`: no authentication, anyone who reaches the port reads and writes everything.
    pub secret: Option<Secret>,
    /// The limits.
    pub limits: Limits,
    /// TLS for every connection ([`kvxfer_tls`]: mutual, cluster CA): the handshake must finish
    /// within [`Limits::idle_timeout`], a client without a certificate of the cluster is refused
    /// (counted in [`ServerStats::tls_failures`]). `None`: plaintext.
    pub tls: Option<kvxfer_tls::Tls>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub(crate) enum Request {
    Stats,
    Store { call: StoreCall },
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct Response {
    ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    /// The class of an error: `auth`, `busy` (connections or waits at their limit), `limit` (a value
    /// or line too large), `idle`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    result: Option<StoreAnswer>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    stats: Option<ServerStats>,
}

/// A `store` request's answer: read by a client as JSON text; written by the service from the
/// store's JSON text as it is (a list or watch answer holds every rank's record, written once when it
/// was stored), or from a value.
#[derive(Debug)]
pub(crate) enum StoreAnswer {
    /// A value (an error the service writes).
    Value(Value),
    /// JSON text, sent as it is.
    Text(Box<serde_json::value::RawValue>),
}

impl StoreAnswer {
    /// The answer as JSON text.
    pub(crate) fn into_text(self) -> Box<serde_json::value::RawValue> {
        match self {
            Self::Value(v) => serde_json::value::to_raw_value(&v).unwrap_or_else(|_| null_text()),
            Self::Text(t) => t,
        }
    }
}

fn null_text() -> Box<serde_json::value::RawValue> {
    serde_json::value::RawValue::from_string("null".into()).expect("null is JSON")
}

impl Serialize for StoreAnswer {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Value(v) => v.serialize(s),
            Self::Text(t) => t.serialize(s),
        }
    }
}

/// A client reads the answer as its text (the answer line is read with `serde_json::from_str`):
/// each record in it is read once, into its type, by the caller.
impl<'de> Deserialize<'de> for StoreAnswer {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Box::<serde_json::value::RawValue>::deserialize(d).map(Self::Text)
    }
}

impl Response {
    fn error(kind: Option<&str>, error: String) -> Self {
        Response { ok: false, error: Some(error), kind: kind.map(str::to_owned), ..Default::default() }
    }

    /// The answer's line: with `v`, the newest kvxfer protocol this service speaks.
    fn line(&self) -> Vec<u8> {
        /// The answer and `v`, written in one pass (a store answer holds every rank's record: no
        /// intermediate JSON value of it).
        #[derive(Serialize)]
        struct Line<'a> {
            #[serde(flatten)]
            answer: &'a Response,
            v: u16,
        }
        let mut out = serde_json::to_vec(&Line { answer: self, v: kvxfer_core::protocol::PROTOCOL })
            .unwrap_or_else(|_| b"{\"ok\":false}".to_vec());
        out.push(b'\n');
        out
    }
}

#[derive(Default)]
struct Counters {
    connections: AtomicUsize,
    waits: AtomicUsize,
    lingering: AtomicUsize,
    accepted: AtomicU64,
    refused_connections: AtomicU64,
    refused_per_source: AtomicU64,
    refused_waits: AtomicU64,
    refused_values: AtomicU64,
    auth_failures: AtomicU64,
    tls_failures: AtomicU64,
    idle_closed: AtomicU64,
    malformed: AtomicU64,
    accept_errors: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Takes one of `max` slots of `gauge`, or `None` when all are taken.
fn take_slot(gauge: &AtomicUsize, max: usize) -> bool {
    gauge.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < max).then_some(n + 1)).is_ok()
}

/// A slot of a gauge, given back on drop.
struct Slot<'a>(&'a AtomicUsize);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A connection slot, given back when the connection's task ends.
struct ConnSlot(Arc<Service>, std::net::IpAddr);

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.0.counters.connections.fetch_sub(1, Ordering::AcqRel);
        let mut by = self.0.by_source.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = by.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                by.remove(&self.1);
            }
        }
    }
}

struct Service {
    store: MemShared,
    limits: Limits,
    secret: Option<Secret>,
    tls: Option<kvxfer_tls::Tls>,
    counters: Counters,
    /// Open connections per source address.
    by_source: Mutex<HashMap<std::net::IpAddr, usize>>,
}

impl Service {
    fn stats(&self) -> ServerStats {
        let (store_keys, store_leases) = self.store.counts();
        let c = &self.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ServerStats {
            store_keys: store_keys as u64,
            store_leases: store_leases as u64,
            connections: c.connections.load(Ordering::Acquire) as u64,
            waits: c.waits.load(Ordering::Acquire) as u64,
            accepted: g(&c.accepted),
            refused_connections: g(&c.refused_connections),
            refused_per_source: g(&c.refused_per_source),
            refused_waits: g(&c.refused_waits),
            refused_values: g(&c.refused_values),
            auth_failures: g(&c.auth_failures),
            tls_failures: g(&c.tls_failures),
            idle_closed: g(&c.idle_closed),
            malformed: g(&c.malformed),
            accept_errors: g(&c.accept_errors),
        }
    }

    /// A wait slot, or the refusal to answer.
    fn wait_slot(&self) -> Result<Slot<'_>, Box<Response>> {
        let max = self.limits.max_waits;
        if take_slot(&self.counters.waits, max) {
            Ok(Slot(&self.counters.waits))
        } else {
            bump(&self.counters.refused_waits);
            Err(Box::new(Response::error(
                Some("busy"),
                format!(
                    "the service holds {max} waits already, its limit (max_waits, `kvxfer bootstrap --max-waits`); \
                     retry later, or raise the limit"
                ),
            )))
        }
    }

    /// Refuses a value over the size limit.
    fn check_value(&self, what: &str, v: &Value) -> Result<(), Box<Response>> {
        let max = self.limits.max_value_bytes;
        let n = json_len(v);
        if n > max {
            bump(&self.counters.refused_values);
            return Err(Box::new(Response::error(
                Some("limit"),
                format!(
                    "the value of {what} is {n} bytes of JSON, over this service's limit of {max} bytes \
                     (max_value_bytes, `kvxfer bootstrap --max-value-bytes`); store large data elsewhere and put a \
                     reference to it"
                ),
            )));
        }
        Ok(())
    }

    async fn handle(&self, req: Request) -> Response {
        match self.serve(req).await {
            Ok(r) => r,
            Err(r) => *r,
        }
    }

    async fn serve(&self, req: Request) -> Result<Response, Box<Response>> {
        let ok = || Response { ok: true, ..Default::default() };
        let err = |e: String| Box::new(Response::error(None, e));
        match req {
            Request::Stats => Ok(Response { stats: Some(self.stats()), ..ok() }),
            Request::Store { call } => {
                match &call {
                    StoreCall::Put { key, value, .. } => self.check_value(&format!("store put {key}"), value)?,
                    StoreCall::Create { key, value, .. } => self.check_value(&format!("store create {key}"), value)?,
                    _ => {}
                }
                let _slot = match &call {
                    StoreCall::Watch { timeout_ms, .. } if *timeout_ms > 0 => Some(self.wait_slot()?),
                    _ => None,
                };
                // `{"Ok": answer}` (as serde writes a Result) around the answer itself, not a copy
                // of it: a list or watch answer holds every rank's record.
                let answer = match self.store.call_text(call).await {
                    Ok(text) => serde_json::value::RawValue::from_string(format!("{{\"Ok\":{}}}", text.get()))
                        .map(StoreAnswer::Text),
                    Err(e) => serde_json::to_value(Err::<Value, _>(e)).map(StoreAnswer::Value),
                };
                match answer {
                    Ok(a) => Ok(Response { result: Some(a), ..ok() }),
                    Err(e) => Err(err(format!("cannot encode the store's answer: {e}"))),
                }
            }
        }
    }
}

/// The embedded bootstrap service. Runs on the current tokio runtime until dropped; dropping it stops
/// accepting and ends every connection it still serves.
pub struct BootstrapServer {
    addr: SocketAddr,
    svc: Arc<Service>,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for BootstrapServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BootstrapServer")
            .field("addr", &self.addr)
            .field("limits", &self.svc.limits)
            .field("secret", &self.svc.secret.is_some())
            .finish()
    }
}

impl BootstrapServer {
    /// Binds `addr` (e.g. `127.0.0.1:0`, or `0.0.0.0:7878` for workers on other hosts) and serves
    /// with the default [`Limits`] and no secret.
    pub async fn start(addr: &str) -> Result<Self, BootstrapError> {
        Self::start_with(addr, ServerConfig::default()).await
    }

    /// Binds `addr` and serves with `config`: its limits, and its secret if any.
    pub async fn start_with(addr: &str, config: ServerConfig) -> Result<Self, BootstrapError> {
        config.limits.check()?;
        let io = |detail: String| BootstrapError::Io { addr: addr.to_owned(), detail };
        let listener = listen(addr).await.map_err(|e| io(format!("cannot listen: {e}")))?;
        let local = listener.local_addr().map_err(|e| io(e.to_string()))?;
        let svc = Arc::new(Service {
            store: MemShared::new(),
            limits: config.limits,
            secret: config.secret,
            tls: config.tls,
            counters: Counters::default(),
            by_source: Mutex::new(HashMap::new()),
        });
        let task = tokio::spawn(accept_loop(listener, Arc::clone(&svc)));
        Ok(Self { addr: local, svc, task })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The service's counters now.
    pub fn stats(&self) -> ServerStats {
        self.svc.stats()
    }

    /// The limits the service runs with.
    pub fn limits(&self) -> &Limits {
        &self.svc.limits
    }

    /// Whether the service requires a shared secret.
    pub fn has_secret(&self) -> bool {
        self.svc.secret.is_some()
    }
}

impl Drop for BootstrapServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Pending connections the kernel queues for the accept loop (capped by `net.core.somaxconn`). The
/// standard library's 128 drops connections of a burst (hundreds of ranks starting at once), and a
/// dropped SYN costs its client a one-second retransmission.
const LISTEN_BACKLOG: u32 = 1024;

/// Binds and listens on the first address `addr` resolves to that works.
async fn listen(addr: &str) -> std::io::Result<TcpListener> {
    let mut last = None;
    for a in tokio::net::lookup_host(addr).await? {
        let s = if a.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
        #[cfg(unix)]
        s.set_reuseaddr(true)?;
        match s.bind(a).and_then(|()| s.listen(LISTEN_BACKLOG)) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "no address to listen on")))
}

async fn accept_loop(listener: TcpListener, svc: Arc<Service>) {
    // Connection tasks live in this set: when the server is dropped and this task aborted, they end too.
    let mut tasks = tokio::task::JoinSet::new();
    let mut backoff = Duration::ZERO;
    let mut warned: Option<Instant> = None;
    loop {
        while tasks.try_join_next().is_some() {}
        let (stream, source) = match listener.accept().await {
            Ok((s, a)) => {
                backoff = Duration::ZERO;
                (s, a.ip())
            }
            Err(e) => {
                // Out of descriptors (EMFILE/ENFILE), memory or buffers: the pending connection stays
                // queued and accepting again at once would fail again. Pause, doubling while it lasts.
                bump(&svc.counters.accept_errors);
                backoff = (backoff * 2).clamp(Duration::from_millis(5), MAX_ACCEPT_BACKOFF);
                if warned.map_or(true, |t| t.elapsed() >= Duration::from_secs(10)) {
                    warned = Some(Instant::now());
                    tracing::warn!(
                        "bootstrap: accepting a connection failed: {e}; pausing {backoff:?} (at the open-file \
                         limit? raise `ulimit -n` or lower max_connections)"
                    );
                }
                tokio::time::sleep(backoff).await;
                continue;
            }
        };
        bump(&svc.counters.accepted);
        let max = svc.limits.max_connections;
        if !take_slot(&svc.counters.connections, max) {
            bump(&svc.counters.refused_connections);
            let resp = Response::error(
                Some("busy"),
                format!(
                    "the service has {max} connections open, its limit (max_connections, `kvxfer bootstrap \
                     --max-connections`); retry later, or raise the limit"
                ),
            );
            refuse_busy(&svc, stream, resp, &mut tasks);
            continue;
        }
        let per = svc.limits.max_connections_per_source;
        let admitted = {
            let mut by = svc.by_source.lock().unwrap_or_else(|p| p.into_inner());
            let n = by.entry(source).or_insert(0);
            if *n < per {
                *n += 1;
                true
            } else {
                false
            }
        };
        if !admitted {
            svc.counters.connections.fetch_sub(1, Ordering::AcqRel);
            bump(&svc.counters.refused_per_source);
            let resp = Response::error(
                Some("busy"),
                format!(
                    "{source} has {per} connections open to this service, the limit per source \
                     (max_connections_per_source, `kvxfer bootstrap --max-connections-per-source`); close idle \
                     ones, retry later, or raise the limit"
                ),
            );
            refuse_busy(&svc, stream, resp, &mut tasks);
            continue;
        }
        let slot = ConnSlot(Arc::clone(&svc), source);
        tasks.spawn(async move {
            match &slot.0.tls {
                None => {
                    let _ = serve_conn(&slot.0, stream).await;
                }
                Some(tls) => match tls.accept(stream, slot.0.limits.idle_timeout).await {
                    Ok(s) => {
                        let _ = serve_conn(&slot.0, s).await;
                    }
                    Err(e) => {
                        bump(&slot.0.counters.tls_failures);
                        tracing::warn!("bootstrap: {e}");
                    }
                },
            }
            drop(slot);
        });
    }
}

/// Answers a connection refused at the connection limit and closes it: lingering (a bounded number at
/// once) so the client can read the answer, else at once.
fn refuse_busy(svc: &Arc<Service>, stream: TcpStream, resp: Response, tasks: &mut tokio::task::JoinSet<()>) {
    let line = resp.line();
    if !take_slot(&svc.counters.lingering, MAX_LINGERING) {
        let _ = stream.try_write(&line);
        return;
    }
    let svc = Arc::clone(svc);
    tasks.spawn(async move {
        let _slot = Slot(&svc.counters.lingering);
        match &svc.tls {
            None => {
                let (r, w) = tokio::io::split(stream);
                close_with(w, r, &line, IDLE_LINGER).await;
            }
            // The refusal must travel inside TLS to be read: a short handshake first.
            Some(tls) => {
                if let Ok(s) = tls.accept(stream, IDLE_LINGER).await {
                    let (r, w) = tokio::io::split(s);
                    close_with(w, r, &line, IDLE_LINGER).await;
                }
            }
        }
    });
}

/// Writes `line`, closes the sending half, and reads (discarding, constant memory) for at most
/// `linger`: closing with unread input would reset the connection and could destroy the answer
/// before the client reads it.
async fn close_with<W: AsyncWrite + Unpin, R: AsyncRead + Unpin>(mut w: W, mut r: R, line: &[u8], linger: Duration) {
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = w.write_all(line).await;
        let _ = w.shutdown().await;
    })
    .await;
    let mut sink = [0u8; 8192];
    let _ = tokio::time::timeout(linger, async { while matches!(r.read(&mut sink).await, Ok(n) if n > 0) {} }).await;
}

/// Returns once the client has closed its connection (or its sending half), discarding whatever it
/// still sends meanwhile.
async fn client_gone<R: AsyncRead + Unpin>(r: &mut R) {
    let mut sink = [0u8; 1024];
    while matches!(r.read(&mut sink).await, Ok(n) if n > 0) {}
}

async fn serve_conn<S: AsyncRead + AsyncWrite + Unpin>(svc: &Service, stream: S) -> std::io::Result<()> {
    let limits = &svc.limits;
    let (r, mut w) = tokio::io::split(stream);
    let mut r = BufReader::new(r);
    let mut line = String::new();
    // The greeting (with a secret) and the whole request line must come within the idle deadline,
    // however slowly the bytes trickle in; the answer may wait (peers / get carry their own deadline).
    let first = tokio::time::timeout(limits.idle_timeout, async {
        let nonce = match &svc.secret {
            Some(_) => {
                let n = auth::nonce()?;
                let mut greet = auth::challenge_line(&n).into_bytes();
                greet.push(b'\n');
                w.write_all(&greet).await?;
                Some(n)
            }
            None => None,
        };
        let n = read_line(&mut r, &mut line, limits.max_request_line).await?;
        Ok::<_, std::io::Error>((n, nonce))
    })
    .await;
    let nonce = match first {
        Ok(Ok((0, _))) => return Ok(()),
        Ok(Ok((_, nonce))) => nonce,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::InvalidData => {
            // Too long or not UTF-8: say so, then close.
            bump(&svc.counters.malformed);
            let resp = Response::error(Some("limit"), format!("malformed request: {e}"));
            close_with(w, r, &resp.line(), REFUSED_LINGER).await;
            return Ok(());
        }
        Ok(Err(e)) => return Err(e),
        Err(_) => {
            bump(&svc.counters.idle_closed);
            let resp = Response::error(
                Some("idle"),
                format!(
                    "no complete request line within {:?} of connecting (idle_timeout, `kvxfer bootstrap \
                     --idle-timeout-s`); closing",
                    limits.idle_timeout
                ),
            );
            close_with(w, r, &resp.line(), IDLE_LINGER).await;
            return Ok(());
        }
    };
    let text = line.trim_end_matches(['\n', '\r']);
    let body = match (&svc.secret, nonce) {
        (Some(secret), Some(nonce)) => match auth::verify(secret, &nonce, text) {
            Ok(body) => body,
            Err(why) => {
                bump(&svc.counters.auth_failures);
                let resp = Response::error(Some("auth"), why.to_string());
                close_with(w, r, &resp.line(), REFUSED_LINGER).await;
                return Ok(());
            }
        },
        _ => text.to_owned(),
    };
    drop(line);
    let resp = match parse_request(&body) {
        Ok(req) => {
            drop(body);
            let handled = svc.handle(req);
            tokio::pin!(handled);
            tokio::select! {
                biased;
                resp = &mut handled => resp,
                // The client went away: end its wait now rather than at its deadline.
                () = client_gone(&mut r) => return Ok(()),
            }
        }
        Err(e) => {
            bump(&svc.counters.malformed);
            let kind = matches!(e, RequestError::Version { .. }).then_some("version");
            Response::error(kind, e.to_string())
        }
    };
    let out = resp.line();
    tokio::time::timeout(limits.idle_timeout, async {
        w.write_all(&out).await?;
        w.shutdown().await
    })
    .await
    .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "the client does not read its answer"))?
}

/// A request line's body as the service reads it: the kvxfer protocol the client speaks (`v`;
/// absent from a protocol-2 client) beside the request.
#[derive(Deserialize)]
struct Incoming {
    #[serde(default = "unversioned")]
    v: u16,
    #[serde(flatten)]
    req: Request,
}

/// A request as a client writes it: `v` (this build's protocol) beside the request.
#[derive(Serialize)]
struct Outgoing<'a> {
    v: u16,
    #[serde(flatten)]
    req: &'a Request,
}

/// The ops of the table the service kept beside the store until it was removed.
const REMOVED_OPS: [&str; 5] = ["register", "peers", "put", "get", "delete"];

fn unversioned() -> u16 {
    kvxfer_core::protocol::UNVERSIONED
}

/// A request line the service cannot serve.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RequestError {
    /// Not a request of any version.
    #[error("malformed request: {0}")]
    Malformed(#[from] serde_json::Error),
    /// A request of the `register`/`peers`/`put`/`get`/`delete` table, which this service no longer
    /// keeps.
    #[error(
        "the bootstrap service no longer serves {op:?}: ranks register and find each other through its metadata \
         store (`store` requests: kvxfer::metadata::Membership over BootstrapStore); keep other data in the store \
         too (its put, get, watch)"
    )]
    Removed {
        /// The op asked for.
        op: String,
    },
    /// A request of a protocol version this service does not speak.
    #[error(
        "a bootstrap request of kvxfer protocol {found}; this service speaks {}: upgrade whichever side is \
         older (a rolling upgrade goes one protocol version at a time)",
        ProtocolRange::THIS_BUILD
    )]
    Version {
        /// The client's version.
        found: u16,
    },
}

/// Decodes a request line's body (after its proof was checked, when the service has a secret) as the
/// service does: a version this build does not speak is refused by name. Pure; the
/// `bootstrap_request` fuzz target (`crate::fuzzing`) drives it.
pub(crate) fn parse_request(body: &str) -> Result<Request, RequestError> {
    let Incoming { v, req } = serde_json::from_str(body).map_err(|e| {
        // A request of the table this service no longer keeps: say so, not "malformed".
        let op = serde_json::from_str::<Value>(body).ok().and_then(|v| v.get("op")?.as_str().map(str::to_owned));
        match op {
            Some(op) if REMOVED_OPS.contains(&op.as_str()) => RequestError::Removed { op },
            _ => RequestError::Malformed(e),
        }
    })?;
    if !ProtocolRange::THIS_BUILD.contains(v) {
        return Err(RequestError::Version { found: v });
    }
    Ok(req)
}

/// A request's body as this build's client writes it.
pub(crate) fn request_body(req: &Request) -> Result<Vec<u8>, serde_json::Error> {
    serde_json::to_vec(&Outgoing { v: kvxfer_core::protocol::PROTOCOL, req })
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
    /// The shared secret, if the service requires one.
    secret: Option<Secret>,
    /// TLS, if the service speaks it.
    tls: Option<kvxfer_tls::Tls>,
}

impl BootstrapClient {
    /// A client of the service at `addr` (`host:port`). Nothing is sent until the first call.
    pub fn new(addr: impl Into<String>) -> Self {
        Self { addr: addr.into(), timeout: Duration::from_secs(30), secret: None, tls: None }
    }

    /// The same client speaking TLS ([`kvxfer_tls`]; the service must use a certificate of the same
    /// cluster CA). The handshake counts against the connect bound ([`Self::with_timeout`]).
    pub fn with_tls(mut self, tls: Option<kvxfer_tls::Tls>) -> Self {
        self.tls = tls;
        self
    }

    /// The same client with another bound on connecting and on calls that do not wait for others.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The same client proving `secret` on every call (the service must have the same one). Such a
    /// client talks only to a service that sends a challenge: against one without a secret, each
    /// call fails with [`BootstrapError::Auth`] after the client's timeout.
    pub fn with_secret(mut self, secret: Secret) -> Self {
        self.secret = Some(secret);
        self
    }

    /// The service address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Whether this client proves a secret.
    pub fn has_secret(&self) -> bool {
        self.secret.is_some()
    }

    fn refusal(&self, op: &str, resp: Response) -> BootstrapError {
        let detail = resp.error.unwrap_or_else(|| "no reason given".into());
        match resp.kind.as_deref() {
            Some("auth") => BootstrapError::Auth { addr: self.addr.clone(), detail },
            _ => BootstrapError::Refused { addr: self.addr.clone(), op: op.to_owned(), detail },
        }
    }

    async fn call(&self, op: &str, req: &Request, wait: Duration) -> Result<Response, BootstrapError> {
        let io = |detail: String| BootstrapError::Io { addr: self.addr.clone(), detail };
        // Connecting and the challenge: within `timeout` of now.
        let deadline = tokio::time::Instant::now() + self.timeout;
        let stream = tokio::time::timeout_at(deadline, TcpStream::connect(&self.addr))
            .await
            .map_err(|_| io(format!("no connection within {:?}", self.timeout)))?
            .map_err(|e| io(format!("cannot connect: {e}")))?;
        match &self.tls {
            None => self.exchange(stream, op, req, wait, deadline).await,
            Some(tls) => {
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                let s = tls.connect(stream, left).await.map_err(|e| io(e.to_string()))?;
                self.exchange(s, op, req, wait, deadline).await
            }
        }
    }

    /// One request and its answer on a connected stream (plain or TLS).
    async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        stream: S,
        op: &str,
        req: &Request,
        wait: Duration,
        deadline: tokio::time::Instant,
    ) -> Result<Response, BootstrapError> {
        let io = |detail: String| BootstrapError::Io { addr: self.addr.clone(), detail };
        let (r, mut w) = tokio::io::split(stream);
        let mut r = BufReader::new(r);
        let body = request_body(req).map_err(|e| io(e.to_string()))?;
        let mut line = match &self.secret {
            None => body,
            Some(secret) => {
                let mut first = String::new();
                let n = tokio::time::timeout_at(deadline, read_line(&mut r, &mut first, MAX_LINE))
                    .await
                    .map_err(|_| BootstrapError::Auth {
                        addr: self.addr.clone(),
                        detail: format!(
                            "no challenge within {:?}: this client has a shared secret but the service sent no \
                             challenge; start the service with the same secret (`kvxfer bootstrap --secret-file`, or \
                             KVXFER_SECRET), or drop the secret from this client",
                            self.timeout
                        ),
                    })?
                    .map_err(|e| io(format!("reading the challenge before {op}: {e}")))?;
                if n == 0 {
                    return Err(io(format!("the service closed the connection before its challenge ({op})")));
                }
                match auth::parse_challenge(&first) {
                    Some(nonce) => auth::sign(secret, &nonce, &body),
                    // Not a challenge: a refusal (the service is at its connection limit) or garbage.
                    None => {
                        let resp = serde_json::from_str::<Response>(&first)
                            .map_err(|e| io(format!("malformed greeting before {op}: {e}")))?;
                        return Err(self.refusal(op, resp));
                    }
                }
            }
        };
        line.push(b'\n');
        // The request and its answer: within `timeout` plus the wait the request asks for.
        let total = self.timeout + wait;
        let fut = async {
            w.write_all(&line).await.map_err(|e| io(format!("sending {op}: {e}")))?;
            let mut resp = String::new();
            let n = read_line(&mut r, &mut resp, MAX_LINE)
                .await
                .map_err(|e| io(format!("reading the answer to {op}: {e}")))?;
            if n == 0 {
                return Err(io(format!("the service closed the connection without answering {op}")));
            }
            if !resp.ends_with('\n') {
                return Err(io(format!(
                    "the service closed the connection after {n} bytes of its answer to {op}, before its end: a \
                     bootstrap service drops a client that has not read its answer within its idle_timeout (`kvxfer \
                     bootstrap --idle-timeout-s`, 30 s by default); this process was too busy to read it, or the \
                     network too slow"
                )));
            }
            if self.secret.is_none() && auth::parse_challenge(&resp).is_some() {
                // The service wants a proof; its refusal follows the challenge.
                resp.clear();
                let _ = read_line(&mut r, &mut resp, MAX_LINE).await;
                let said = serde_json::from_str::<Response>(&resp).ok().and_then(|r| r.error);
                return Err(BootstrapError::Auth {
                    addr: self.addr.clone(),
                    detail: said.unwrap_or_else(|| {
                        "the service requires a shared secret; give this client the same one (KVXFER_SECRET)".into()
                    }),
                });
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
            Err(self.refusal(op, resp))
        }
    }

    /// One call of the metadata-store interface (the `store` request): the in-memory store's answer.
    pub(crate) async fn store_call(
        &self,
        call: StoreCall,
        wait: Duration,
    ) -> Result<Box<serde_json::value::RawValue>, BootstrapError> {
        let op = call.describe();
        Ok(self.call(&op, &Request::Store { call }, wait).await?.result.map_or_else(null_text, StoreAnswer::into_text))
    }

    /// The service's counters (the store's keys and leases, connections, waits, refusals).
    pub async fn stats(&self) -> Result<ServerStats, BootstrapError> {
        Ok(self.call("stats", &Request::Stats, Duration::ZERO).await?.stats.unwrap_or_default())
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
            parallel: Parallel::new(tp, 1),
        }
    }

    fn reg(role: Side, tp: u32, s: SideSpec) -> RankRegistration {
        RankRegistration {
            role,
            rank: RankId::new(tp, 0),
            backend: "tcp".into(),
            endpoint: EndpointMetadata { version: 1, backend: "tcp".into(), identity: 0, payload: vec![] },
            pool: KvPool { pages: 1, buffers: vec![] },
            spec: s,
            label: String::new(),
            model: None,
            protocol: kvxfer_core::ProtocolRange::THIS_BUILD,
            warmup: None,
        }
    }

    async fn server_with(limits: Limits, secret: Option<Secret>) -> BootstrapServer {
        BootstrapServer::start_with("127.0.0.1:0", ServerConfig { secret, limits, tls: None }).await.unwrap()
    }

    /// Reads one line from a raw connection (at most 5 s).
    async fn raw_line(r: &mut BufReader<TcpStream>) -> String {
        let mut l = String::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), r.read_line(&mut l)).await.expect("no line within 5 s");
        l
    }

    /// Waits (at most 5 s) until the server's stats satisfy `pred`.
    async fn until(server: &BootstrapServer, pred: impl Fn(&ServerStats) -> bool) -> ServerStats {
        let end = Instant::now() + Duration::from_secs(5);
        loop {
            let s = server.stats();
            if pred(&s) || Instant::now() >= end {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
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

    #[test]
    fn pair_checks_name_every_mismatch_with_both_values() {
        let p = reg(Side::Prefill, 0, spec(2, 8, 16));
        // An incompatible decode rank: every mismatch named.
        let mut bad = spec(1, 8, 32);
        bad.kv.dtype_bytes = 4;
        let e = check_pair(&reg(Side::Decode, 0, bad), &p).unwrap_err().to_string();
        assert!(e.contains("page_size") && e.contains("dtype_bytes"), "{e}");
        check_pair(&reg(Side::Decode, 0, spec(1, 8, 16)), &p).unwrap();
        // Outside its own parallel config: TP rank 2 of TP 2, PP stage 1 of PP 1.
        let e = check_rank_in_config(&reg(Side::Prefill, 2, spec(2, 8, 16))).unwrap_err().to_string();
        assert!(e.contains("outside its own parallel config") && e.contains("TP rank 2 with TP 2"), "{e}");
        let mut r = reg(Side::Decode, 0, spec(1, 8, 16));
        r.rank.pp = 1;
        let e = check_rank_in_config(&r).unwrap_err().to_string();
        assert!(e.contains("PP stage 1 with PP 1"), "{e}");
        // A second prefill rank with another TP size and page size than the first.
        let e = check_pair(&reg(Side::Prefill, 1, spec(4, 8, 32)), &p).unwrap_err().to_string();
        assert!(
            e.contains("different configurations") && e.contains("TP 4") && e.contains("prefill rank 0/0 has 2"),
            "{e}"
        );
        assert!(e.contains("page_size 32") && e.contains("has 16"), "{e}");
    }

    #[tokio::test]
    async fn a_client_of_a_service_that_is_not_there_fails_naming_the_address() {
        let e = BootstrapClient::new("127.0.0.1:1").stats().await.unwrap_err().to_string();
        assert!(e.contains("127.0.0.1:1"), "{e}");
    }

    /// Issue 30, versions: requests carry the client's kvxfer protocol; a protocol-2 client's line
    /// (none; the fixture is the store put line kvxfer 4022094's client wrote, its fuzz seed) is
    /// served, a version this service does not speak is refused by name, answers carry `v`; a
    /// request of the removed `register`/`peers`/`put`/`get`/`delete` table is refused naming the
    /// store.
    #[tokio::test]
    async fn requests_carry_their_protocol_and_two_versions_back_are_refused() {
        let server = server_with(Limits::default(), None).await;
        let addr = server.addr();
        let ask = |line: String| async move {
            let mut r = BufReader::new(TcpStream::connect(addr).await.unwrap());
            r.get_mut().write_all(line.as_bytes()).await.unwrap();
            serde_json::from_str::<Value>(&raw_line(&mut r).await).unwrap()
        };
        let old = include_str!("../tests/fixtures/protocol2-bootstrap-store-put.jsonl");
        let parsed: Value = serde_json::from_str(old).unwrap();
        assert!(parsed.get("v").is_none(), "a protocol-2 line names no version");
        let a = ask(old.to_owned()).await;
        // Served: the put names lease 1, which this fresh store never granted.
        assert_eq!(a["ok"].as_bool(), Some(true), "{a}");
        assert!(a["result"]["Err"].to_string().contains("lease_not_found"), "{a}");
        assert_eq!(a["v"], kvxfer_core::protocol::PROTOCOL, "{a}");
        for op in REMOVED_OPS {
            let a = ask(format!("{{\"v\":3,\"op\":\"{op}\",\"key\":\"k\"}}\n")).await;
            assert_eq!(a["ok"].as_bool(), Some(false), "{a}");
            let e = a["error"].as_str().unwrap();
            assert!(e.contains(&format!("no longer serves \"{op}\"")) && e.contains("metadata store"), "{e}");
        }
        for v in [1, 4] {
            let a = ask(format!("{{\"v\":{v},\"op\":\"stats\"}}\n")).await;
            assert_eq!((a["ok"].as_bool(), a["kind"].as_str()), (Some(false), Some("version")), "{a}");
            let e = a["error"].as_str().unwrap();
            assert!(e.contains(&format!("kvxfer protocol {v}; this service speaks 2..=3")), "{e}");
        }
        // This build's client writes its version, and is served.
        let body = String::from_utf8(request_body(&Request::Stats).unwrap()).unwrap();
        assert!(body.contains("\"v\":3"), "{body}");
        let c = BootstrapClient::new(server.addr().to_string());
        assert_eq!(c.stats().await.unwrap().store_keys, 0);
    }

    #[tokio::test]
    async fn connections_beyond_the_limit_get_one_error_line_and_the_service_goes_on() {
        let server = server_with(Limits { max_connections: 3, ..Limits::default() }, None).await;
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(TcpStream::connect(server.addr()).await.unwrap());
        }
        until(&server, |s| s.connections == 3).await;
        // The fourth is refused with one line, then closed.
        let mut r = BufReader::new(TcpStream::connect(server.addr()).await.unwrap());
        let l = raw_line(&mut r).await;
        assert!(l.contains("\"ok\":false") && l.contains("3 connections open") && l.contains("busy"), "{l}");
        assert_eq!(raw_line(&mut r).await, "", "not closed");
        let c = BootstrapClient::new(server.addr().to_string()).with_timeout(Duration::from_secs(2));
        let e = c.stats().await.unwrap_err().to_string();
        assert!(e.contains("max-connections"), "{e}");
        // Slots come back as connections close; the accept loop kept working.
        held.clear();
        until(&server, |s| s.connections == 0).await;
        let store = crate::metadata::bootstrap::BootstrapStore::new(&server.addr().to_string(), "/p");
        crate::metadata::MetadataStore::put(&store, "k", &Value::Bool(true), None).await.unwrap();
        let s = c.stats().await.unwrap();
        assert!(s.refused_connections >= 2 && s.connections == 1 && s.store_keys == 1, "{s:?}");
    }

    #[tokio::test]
    async fn one_source_beyond_its_limit_is_refused_while_others_are_served() {
        let limits = Limits { max_connections: 10, max_connections_per_source: 2, ..Limits::default() };
        let server = server_with(limits, None).await;
        let mut held = Vec::new();
        for _ in 0..2 {
            held.push(TcpStream::connect(server.addr()).await.unwrap());
        }
        until(&server, |s| s.connections == 2).await;
        let mut r = BufReader::new(TcpStream::connect(server.addr()).await.unwrap());
        let l = raw_line(&mut r).await;
        assert!(
            l.contains("\"ok\":false") && l.contains("127.0.0.1 has 2 connections") && l.contains("per source"),
            "{l}"
        );
        assert_eq!(raw_line(&mut r).await, "", "not closed");
        // Another source address (127.0.0.2, loopback too) is still served.
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let mut other = BufReader::new(sock.connect(server.addr()).await.unwrap());
        other.get_mut().write_all(b"{\"op\":\"stats\"}\n").await.unwrap();
        let l = raw_line(&mut other).await;
        assert!(l.contains("\"ok\":true") && l.contains("\"refused_per_source\":1"), "{l}");
        // The slots of a source come back as its connections close.
        held.clear();
        drop(other);
        until(&server, |s| s.connections == 0).await;
        let c = BootstrapClient::new(server.addr().to_string()).with_timeout(Duration::from_secs(2));
        c.stats().await.unwrap();
        assert_eq!(server.stats().refused_per_source, 1);
    }

    #[tokio::test]
    async fn values_over_the_limit_are_refused_naming_size_and_limit() {
        let server = server_with(Limits { max_value_bytes: 1000, ..Limits::default() }, None).await;
        let big = Value::String("x".repeat(1200));
        let s = crate::metadata::bootstrap::BootstrapStore::new(&server.addr().to_string(), "/p");
        let e = crate::metadata::MetadataStore::put(&s, "big", &big, None).await.unwrap_err().to_string();
        assert!(e.contains("1202 bytes") && e.contains("limit of 1000 bytes") && e.contains("put /p/big"), "{e}");
        let e = crate::metadata::MetadataStore::create(&s, "big", &big, None).await.unwrap_err().to_string();
        assert!(e.contains("1202 bytes"), "{e}");
        crate::metadata::MetadataStore::put(&s, "small", &Value::String("x".repeat(990)), None).await.unwrap();
        let st = server.stats();
        assert_eq!((st.refused_values, st.store_keys), (2, 1));
    }

    #[tokio::test]
    async fn waits_beyond_the_limit_are_refused_and_a_client_that_leaves_frees_its_wait() {
        let server = server_with(Limits { max_waits: 2, ..Limits::default() }, None).await;
        let addr = server.addr().to_string();
        use crate::metadata::MetadataStore;
        let store = crate::metadata::bootstrap::BootstrapStore::new(&addr, "/p");
        let (_, rev) = store.get("a").await.unwrap();
        let watch = |prefix: &'static str| {
            let store = store.clone();
            tokio::spawn(async move { store.watch(prefix, rev).await?.next(Duration::from_secs(10)).await })
        };
        let (w1, w2) = (watch("a"), watch("b"));
        until(&server, |s| s.waits == 2).await;
        let e = store.watch("x", rev).await.unwrap().next(Duration::from_secs(5)).await.unwrap_err().to_string();
        assert!(e.contains("2 waits") && e.contains("max-waits"), "{e}");
        // A call that needs no wait is still answered, and ends the first wait.
        store.put("a", &Value::Bool(true), None).await.unwrap();
        assert_eq!(w1.await.unwrap().unwrap().len(), 1);
        // A waiting client that goes away gives its wait back at once, not at its deadline.
        until(&server, |s| s.waits == 1).await;
        w2.abort();
        let s = until(&server, |s| s.waits == 0 && s.connections == 0).await;
        assert_eq!((s.waits, s.connections, s.refused_waits), (0, 0, 1), "{s:?}");
    }

    #[tokio::test]
    async fn a_trickling_partial_line_is_cut_at_the_idle_deadline() {
        let idle = Duration::from_millis(600);
        let server = server_with(Limits { idle_timeout: idle, ..Limits::default() }, None).await;
        let s = TcpStream::connect(server.addr()).await.unwrap();
        let (r, mut w) = s.into_split();
        let t = Instant::now();
        // One byte every 50 ms, never a newline: the deadline counts from the connection, not the
        // last byte.
        let trickle = tokio::spawn(async move {
            for _ in 0..200 {
                if w.write_all(b"{").await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        let mut r = BufReader::new(r);
        let mut l = String::new();
        tokio::time::timeout(Duration::from_secs(5), r.read_line(&mut l)).await.unwrap().unwrap();
        let took = t.elapsed();
        assert!(l.contains("no complete request line") && l.contains("idle"), "{l}");
        assert!(took + Duration::from_millis(50) >= idle && took < idle + Duration::from_secs(2), "{took:?}");
        trickle.abort();
        let s = until(&server, |s| s.connections == 0).await;
        assert_eq!((s.idle_closed, s.connections), (1, 0));
        // A silent connection too.
        let mut r = BufReader::new(TcpStream::connect(server.addr()).await.unwrap());
        assert!(raw_line(&mut r).await.contains("no complete request line"));
    }

    #[tokio::test]
    async fn with_a_secret_only_proven_requests_are_served() {
        let secret = Secret::new(b"correct horse".to_vec()).unwrap();
        let server = server_with(Limits::default(), Some(secret.clone())).await;
        let addr = server.addr().to_string();
        let good = BootstrapClient::new(addr.clone()).with_secret(secret.clone());
        let get = |c: &BootstrapClient| {
            let c = c.clone();
            async move { c.store_call(StoreCall::Get { key: "k".into() }, Duration::ZERO).await }
        };
        good.store_call(
            StoreCall::Put { key: "k".into(), value: Value::from("stored-value"), lease: None },
            Duration::ZERO,
        )
        .await
        .unwrap();
        assert!(get(&good).await.unwrap().to_string().contains("stored-value"));
        // No secret, a wrong one: refused, no value.
        let e = get(&BootstrapClient::new(addr.clone())).await.unwrap_err();
        assert!(matches!(&e, BootstrapError::Auth { detail, .. } if detail.contains("authentication required")), "{e}");
        let wrong = BootstrapClient::new(addr.clone()).with_secret(Secret::new(b"wrong".to_vec()).unwrap());
        let e = get(&wrong).await.unwrap_err();
        assert!(matches!(&e, BootstrapError::Auth { detail, .. } if detail.contains("authentication failed")), "{e}");
        assert!(!e.to_string().contains("stored-value"), "{e}");
        // A raw client: a challenge, then a refusal, then the end.
        let mut r = BufReader::new(TcpStream::connect(&addr).await.unwrap());
        let ch = raw_line(&mut r).await;
        let nonce = auth::parse_challenge(&ch).unwrap_or_else(|| panic!("no challenge: {ch}"));
        r.get_mut().write_all(b"{\"op\":\"store\",\"call\":{\"op\":\"get\",\"key\":\"k\"}}\n").await.unwrap();
        let l = raw_line(&mut r).await;
        assert!(
            l.contains("\"ok\":false") && l.contains("authentication required") && !l.contains("stored-value"),
            "{l}"
        );
        // A line proven for one connection, replayed on another: refused.
        let line = auth::sign(&secret, &nonce, br#"{"op":"store","call":{"op":"put","key":"k","value":"evil"}}"#);
        let mut r = BufReader::new(TcpStream::connect(&addr).await.unwrap());
        raw_line(&mut r).await;
        r.get_mut().write_all(&[line.as_slice(), b"\n"].concat()).await.unwrap();
        let l = raw_line(&mut r).await;
        assert!(l.contains("authentication failed"), "{l}");
        assert!(get(&good).await.unwrap().to_string().contains("stored-value"));
        assert_eq!(good.stats().await.unwrap().auth_failures, 4);
        // A client with a secret against a service without one: a clear error after its timeout.
        let open = BootstrapServer::start("127.0.0.1:0").await.unwrap();
        let c =
            BootstrapClient::new(open.addr().to_string()).with_secret(secret).with_timeout(Duration::from_millis(300));
        let e = c.stats().await.unwrap_err().to_string();
        assert!(e.contains("no challenge"), "{e}");
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
        c.stats().await.unwrap();
        assert_eq!(server.stats().malformed, 1);
    }
}
