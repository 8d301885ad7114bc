//! Prometheus metrics of one [`crate::engine::Agent`] (issue 30).
//!
//! [`crate::engine::Agent::metrics`] encodes them in the OpenMetrics text format (what Prometheus
//! scrapes); `kvxfer worker --metrics-listen ADDR` serves that text over HTTP at `/metrics`. Every
//! metric carries the constant labels `role` (`prefill` / `decode`), `tp` and `pp` of its rank, and
//! its name starts with `kvxfer_`. Counters are read at scrape time from the agent's own counters
//! ([`crate::engine::AgentStats`]), so a scrape and [`crate::engine::Agent::stats`] never disagree;
//! the latency histograms, the byte and op counters and the failure causes are recorded as requests
//! end. The table of names is [`METRICS`] (docs/operations.md prints it).
//!
//! Throughput is `rate(kvxfer_transfer_bytes_total[1m])` on the Prometheus side: a gauge of it here
//! would have to pick a window for every operator.

use std::sync::{Arc, Weak};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use kvxfer_core::{RankId, Side};

/// One metric's name (without the `_total` Prometheus adds to counters), type and meaning.
#[derive(Debug, Clone, Copy)]
pub struct MetricDoc {
    /// Full name as scraped (counters end in `_total`).
    pub name: &'static str,
    /// `counter`, `gauge` or `histogram`.
    pub kind: &'static str,
    /// Labels besides `role`, `tp`, `pp`.
    pub labels: &'static str,
    /// What it counts, and on which side.
    pub help: &'static str,
}

macro_rules! docs {
    ($( $name:literal, $kind:literal, $labels:literal, $help:literal; )*) => {
        /// Every metric an agent exports, in scrape order.
        pub const METRICS: &[MetricDoc] = &[ $( MetricDoc { name: $name, kind: $kind, labels: $labels, help: $help }, )* ];
    };
}

docs! {
    "kvxfer_request_duration_seconds", "histogram", "outcome", "Request latency until its final status: decode from the handoff (send_metadata) to Success or Failed (fence closed); prefill from its first post to its last write completed (success) or its failure settled (a request that failed before posting anything is not observed).";
    "kvxfer_transfer_bytes_total", "counter", "", "KV bytes moved: prefill, bytes of writes that completed (also of requests that failed later); decode, bytes of requests that succeeded.";
    "kvxfer_transfer_ops_total", "counter", "", "Strided write ops completed (prefill only).";
    "kvxfer_request_failures_total", "counter", "cause", "Requests failed here, by cause: aborted (by this engine), aborted_by_peer, peer_lost, deadline, sender_failed (decode: a prefill rank reported failure), transfer (prefill: a write failed), protocol, connect, shutdown, digest (decode: the end-to-end digest check failed).";
    "kvxfer_requests_total", "counter", "outcome", "Requests that reached success or failed here (aborted ones included).";
    "kvxfer_aborts_total", "counter", "", "Requests aborted by this rank's engine.";
    "kvxfer_aborts_received_total", "counter", "", "Abort requests received from the other side (prefill).";
    "kvxfer_fences_total", "counter", "", "Fences sent (prefill) or received (decode).";
    "kvxfer_fence_reasks_total", "counter", "", "Asks to abort sent again because a prefill rank's fence had not come within 1 s (doubling to 8 s) (decode); above zero: an ask or a fence was lost, or a prefill rank did not answer.";
    "kvxfer_early_handoffs_kept_total", "counter", "", "Handoffs kept before their sender existed (prefill).";
    "kvxfer_early_handoffs_expired_total", "counter", "", "Kept early handoffs and aborts dropped: too old or too many (prefill).";
    "kvxfer_early_notifications_kept_total", "counter", "", "Notifications kept before their request was handed off (decode).";
    "kvxfer_early_notifications_expired_total", "counter", "", "Kept notifications dropped: too old or too many (decode).";
    "kvxfer_notifications_total", "counter", "", "Notifications the decode tracker recorded (duplicates not included).";
    "kvxfer_notifications_duplicate_total", "counter", "", "Duplicate notifications ignored (decode).";
    "kvxfer_peers_lost_total", "counter", "", "Peers given up on (left the cluster, lease expired, transport lost them, replaced, own membership lost); each is then cut off.";
    "kvxfer_cut_offs_total", "counter", "", "Peers given up on whose cut-off the backend confirmed.";
    "kvxfer_cut_offs_unconfirmed_total", "counter", "", "Peers given up on whose cut-off could not be confirmed (their pages are quarantined).";
    "kvxfer_stale_refused_total", "counter", "", "Handoffs and aborts refused for carrying an older epoch of their rank.";
    "kvxfer_protocol_errors_total", "counter", "", "Notifications of a kind this side does not take, dropped.";
    "kvxfer_digest_bytes_total", "counter", "", "Bytes hashed for end-to-end digests (AgentConfig::digest): written for decode ranks that asked (prefill), landed (decode); 0 when off.";
    "kvxfer_digest_mismatches_total", "counter", "", "Requests whose end-to-end digest check failed (decode; also counted as failures with cause digest).";
    "kvxfer_cut_off_max_seconds", "gauge", "", "Longest time from giving up on a peer to its confirmed cut-off.";
    "kvxfer_peers", "gauge", "", "Peer ranks this rank exchanges with (from the topology).";
    "kvxfer_peers_connected", "gauge", "", "Of those, connected now and not given up on.";
    "kvxfer_quarantined_peers", "gauge", "", "Peers whose pages are quarantined now (Agent::quarantined).";
    "kvxfer_active_requests", "gauge", "", "Requests created and not released.";
    "kvxfer_requests_in_flight", "gauge", "", "Requests with writes posted and not finished (prefill) or handed off and not final (decode): the queue depth.";
    "kvxfer_early_handoffs_queued", "gauge", "", "Handoffs and aborts kept now for senders not created yet (prefill).";
    "kvxfer_registered_bytes", "gauge", "", "Bytes of KV pool registered with the backend.";
}

/// Why a request failed, as the `cause` label says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Cause {
    Aborted,
    AbortedByPeer,
    PeerLost,
    Deadline,
    SenderFailed,
    Transfer,
    Protocol,
    Connect,
    Shutdown,
    Digest,
}

impl Cause {
    fn label(self) -> &'static str {
        match self {
            Cause::Aborted => "aborted",
            Cause::AbortedByPeer => "aborted_by_peer",
            Cause::PeerLost => "peer_lost",
            Cause::Deadline => "deadline",
            Cause::SenderFailed => "sender_failed",
            Cause::Transfer => "transfer",
            Cause::Protocol => "protocol",
            Cause::Connect => "connect",
            Cause::Shutdown => "shutdown",
            Cause::Digest => "digest",
        }
    }

    /// The cause of a decode-side tracker failure.
    pub(crate) fn of_failure(f: &kvxfer_core::tracker::Failure) -> Cause {
        use kvxfer_core::tracker::Failure;
        match f {
            Failure::Notified { .. } => Cause::SenderFailed,
            Failure::UnexpectedKey { .. } | Failure::InconsistentChunks { .. } => Cause::Protocol,
            Failure::DeadlineExceeded { .. } => Cause::Deadline,
            Failure::PeerLost { .. } | Failure::SenderDown { .. } => Cause::PeerLost,
            Failure::Aborted { .. } => Cause::Aborted,
        }
    }
}

type Labels = [(&'static str, &'static str); 1];

fn latency_histogram() -> Histogram {
    // 100 us to about 52 s, doubling.
    Histogram::new(exponential_buckets(1e-4, 2.0, 20))
}

/// What the agent records as requests end (cheap clones of shared atomics).
#[derive(Debug, Clone)]
pub(crate) struct Recorder {
    latency: Family<Labels, Histogram, fn() -> Histogram>,
    bytes: Counter,
    ops: Counter,
    failures: Family<Labels, Counter>,
}

impl Recorder {
    pub(crate) fn new() -> Self {
        Self {
            latency: Family::new_with_constructor(latency_histogram),
            bytes: Counter::default(),
            ops: Counter::default(),
            failures: Family::default(),
        }
    }

    /// A request reached success after `seconds`.
    pub(crate) fn succeeded(&self, seconds: f64) {
        self.latency.get_or_create(&[("outcome", "success")]).observe(seconds);
    }

    /// A request failed after `seconds` (None: it never started, no latency).
    pub(crate) fn failed(&self, seconds: Option<f64>, cause: Cause) {
        if let Some(s) = seconds {
            self.latency.get_or_create(&[("outcome", "failed")]).observe(s);
        }
        self.failures.get_or_create(&[("cause", cause.label())]).inc();
    }

    /// Bytes (and ops) moved.
    pub(crate) fn moved(&self, bytes: u64, ops: u64) {
        self.bytes.inc_by(bytes);
        self.ops.inc_by(ops);
    }
}

/// What a scrape reads from the agent at that moment.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Snapshot {
    pub stats: crate::engine::AgentStats,
    pub peers: u64,
    pub peers_connected: u64,
    pub quarantined_peers: u64,
    pub active_requests: u64,
    pub in_flight: u64,
    pub early_queued: u64,
    pub registered_bytes: u64,
}

/// Takes a [`Snapshot`] of a live agent.
pub(crate) trait Source: Send + Sync + std::fmt::Debug + 'static {
    fn snapshot(&self) -> Snapshot;
}

#[derive(Debug)]
struct StatsCollector<S: Source> {
    source: Weak<S>,
}

fn counter(e: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: u64) -> Result<(), std::fmt::Error> {
    ConstCounter::new(v).encode(e.encode_descriptor(name, help, None, MetricType::Counter)?)
}

fn gauge(e: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: f64) -> Result<(), std::fmt::Error> {
    ConstGauge::new(v).encode(e.encode_descriptor(name, help, None, MetricType::Gauge)?)
}

/// The help of a metric registered (not collected): the encoder adds the final full stop itself.
fn registered_help(full: &str) -> &'static str {
    help(full).trim_end_matches('.')
}

fn help(full: &str) -> &'static str {
    METRICS.iter().find(|m| m.name == full).map_or("", |m| m.help)
}

impl<S: Source> Collector for StatsCollector<S> {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        // The agent is gone (its last scrape raced its shutdown): nothing to report.
        let Some(src) = self.source.upgrade() else { return Ok(()) };
        let s = src.snapshot();
        let st = s.stats;
        let c = |e: &mut DescriptorEncoder<'_>, short: &str, v: u64| {
            let full = format!("kvxfer_{short}_total");
            counter(e, short, help(&full), v)
        };
        {
            let mut m = e.encode_descriptor("requests", help("kvxfer_requests_total"), None, MetricType::Counter)?;
            ConstCounter::new(st.succeeded).encode(m.encode_family(&[("outcome", "success")])?)?;
            ConstCounter::new(st.failed).encode(m.encode_family(&[("outcome", "failed")])?)?;
        }
        c(&mut e, "aborts", st.aborted)?;
        c(&mut e, "aborts_received", st.aborts_received)?;
        c(&mut e, "fences", st.fences)?;
        c(&mut e, "fence_reasks", st.fence_reasks)?;
        c(&mut e, "early_handoffs_kept", st.early_handoffs_kept)?;
        c(&mut e, "early_handoffs_expired", st.early_handoffs_expired)?;
        c(&mut e, "early_notifications_kept", st.tracker.early_kept)?;
        c(&mut e, "early_notifications_expired", st.tracker.early_expired)?;
        c(&mut e, "notifications", st.tracker.accepted)?;
        c(&mut e, "notifications_duplicate", st.tracker.duplicates)?;
        c(&mut e, "peers_lost", st.peers_lost)?;
        c(&mut e, "cut_offs", st.cut_offs)?;
        c(&mut e, "cut_offs_unconfirmed", st.quarantined)?;
        c(&mut e, "stale_refused", st.stale_refused)?;
        c(&mut e, "protocol_errors", st.protocol_errors)?;
        c(&mut e, "digest_bytes", st.digest_bytes)?;
        c(&mut e, "digest_mismatches", st.digest_mismatches)?;
        let g =
            |e: &mut DescriptorEncoder<'_>, short: &str, v: f64| gauge(e, short, help(&format!("kvxfer_{short}")), v);
        g(&mut e, "cut_off_max_seconds", st.cut_off_max_us as f64 / 1e6)?;
        g(&mut e, "peers", s.peers as f64)?;
        g(&mut e, "peers_connected", s.peers_connected as f64)?;
        g(&mut e, "quarantined_peers", s.quarantined_peers as f64)?;
        g(&mut e, "active_requests", s.active_requests as f64)?;
        g(&mut e, "requests_in_flight", s.in_flight as f64)?;
        g(&mut e, "early_handoffs_queued", s.early_queued as f64)?;
        g(&mut e, "registered_bytes", s.registered_bytes as f64)?;
        Ok(())
    }
}

/// The registry of one agent: the recorder's metrics and a collector over its counters.
#[derive(Debug)]
pub(crate) struct AgentMetrics {
    registry: Registry,
}

impl AgentMetrics {
    pub(crate) fn new<S: Source>(role: Side, rank: RankId, recorder: &Recorder, source: &Arc<S>) -> Self {
        let labels = [
            ("role".into(), role.to_string().into()),
            ("tp".into(), rank.tp.to_string().into()),
            ("pp".into(), rank.pp.to_string().into()),
        ];
        let mut registry = Registry::with_prefix_and_labels("kvxfer", labels.into_iter());
        registry.register(
            "request_duration_seconds",
            registered_help("kvxfer_request_duration_seconds"),
            recorder.latency.clone(),
        );
        registry.register("transfer_bytes", registered_help("kvxfer_transfer_bytes_total"), recorder.bytes.clone());
        if role == Side::Prefill {
            registry.register("transfer_ops", registered_help("kvxfer_transfer_ops_total"), recorder.ops.clone());
        }
        registry.register(
            "request_failures",
            registered_help("kvxfer_request_failures_total"),
            recorder.failures.clone(),
        );
        registry.register_collector(Box::new(StatsCollector { source: Arc::downgrade(source) }));
        Self { registry }
    }

    /// The OpenMetrics text of every metric now (ends with `# EOF`).
    pub(crate) fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail; the collector returns no error of its own.
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("encoding into a String");
        out
    }
}

/// The bootstrap service's counters ([`crate::bootstrap::ServerStats`]) in the OpenMetrics text
/// format (`kvxfer bootstrap --metrics-listen`): gauges `kvxfer_bootstrap_{store_keys, store_leases,
/// connections, waits}` and counters `kvxfer_bootstrap_{accepted, refused_connections,
/// refused_per_source, refused_waits, refused_values, auth_failures, tls_failures, idle_closed,
/// malformed, accept_errors}_total`, as [`crate::bootstrap::ServerStats`] documents them.
pub fn encode_bootstrap(stats: &crate::bootstrap::ServerStats) -> String {
    #[derive(Debug)]
    struct Bootstrap(crate::bootstrap::ServerStats);
    impl Collector for Bootstrap {
        fn encode(&self, mut e: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
            let s = &self.0;
            for (name, help, v) in [
                ("store_keys", "Keys of the metadata store.", s.store_keys),
                ("store_leases", "Live leases of the metadata store.", s.store_leases),
                ("connections", "Connections open now.", s.connections),
                ("waits", "Waits held now (store watches).", s.waits),
            ] {
                gauge(&mut e, name, help, v as f64)?;
            }
            for (name, help, v) in [
                ("accepted", "Connections accepted since start.", s.accepted),
                ("refused_connections", "Connections refused at the connection limit.", s.refused_connections),
                ("refused_per_source", "Connections refused at the per-source limit.", s.refused_per_source),
                ("refused_waits", "Waits refused at the wait limit.", s.refused_waits),
                ("refused_values", "Values refused at the value size limit.", s.refused_values),
                (
                    "auth_failures",
                    "Requests refused for a missing or wrong proof of the shared secret.",
                    s.auth_failures,
                ),
                ("tls_failures", "Connections whose TLS handshake failed or timed out.", s.tls_failures),
                ("idle_closed", "Connections closed for sending no complete request line in time.", s.idle_closed),
                ("malformed", "Request lines refused as too long, not UTF-8, or not a request.", s.malformed),
                ("accept_errors", "Failures of accepting a connection.", s.accept_errors),
            ] {
                counter(&mut e, name, help, v)?;
            }
            Ok(())
        }
    }
    let mut registry = Registry::with_prefix("kvxfer_bootstrap");
    registry.register_collector(Box::new(Bootstrap(stats.clone())));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry).expect("encoding into a String");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Fixed(Snapshot);
    impl Source for Fixed {
        fn snapshot(&self) -> Snapshot {
            self.0
        }
    }

    fn sample(text: &str, prefix: &str) -> f64 {
        let line = text.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no {prefix} in\n{text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    }

    #[test]
    fn encodes_every_documented_metric_with_the_rank_labels() {
        let rec = Recorder::new();
        let mut snap = Snapshot { peers: 4, peers_connected: 3, registered_bytes: 1 << 20, ..Snapshot::default() };
        snap.stats.succeeded = 7;
        snap.stats.failed = 2;
        snap.stats.aborted = 1;
        snap.stats.cut_off_max_us = 1500;
        let src = Arc::new(Fixed(snap));
        let m = AgentMetrics::new(Side::Prefill, RankId { tp: 1, pp: 0 }, &rec, &src);
        rec.succeeded(0.002);
        rec.succeeded(0.004);
        rec.failed(Some(1.0), Cause::Deadline);
        rec.failed(None, Cause::Connect);
        rec.moved(4096, 3);
        let t = m.encode();
        assert!(t.ends_with("# EOF\n"), "{t}");
        for d in METRICS {
            assert!(t.contains(&format!("# TYPE {} ", d.name.trim_end_matches("_total"))), "{} missing:\n{t}", d.name);
        }
        let l = r#"role="prefill",tp="1",pp="0""#;
        assert_eq!(sample(&t, &format!("kvxfer_requests_total{{{l},outcome=\"success\"}}")), 7.0);
        assert_eq!(sample(&t, &format!("kvxfer_requests_total{{{l},outcome=\"failed\"}}")), 2.0);
        assert_eq!(sample(&t, &format!("kvxfer_transfer_bytes_total{{{l}}}")), 4096.0);
        assert_eq!(sample(&t, &format!("kvxfer_transfer_ops_total{{{l}}}")), 3.0);
        assert_eq!(sample(&t, &format!("kvxfer_request_duration_seconds_count{{{l},outcome=\"success\"}}")), 2.0);
        assert_eq!(sample(&t, &format!("kvxfer_request_duration_seconds_count{{{l},outcome=\"failed\"}}")), 1.0);
        assert_eq!(sample(&t, &format!("kvxfer_request_failures_total{{{l},cause=\"deadline\"}}")), 1.0);
        assert_eq!(sample(&t, &format!("kvxfer_request_failures_total{{{l},cause=\"connect\"}}")), 1.0);
        assert_eq!(sample(&t, &format!("kvxfer_cut_off_max_seconds{{{l}}}")), 0.0015);
        assert_eq!(sample(&t, &format!("kvxfer_peers_connected{{{l}}}")), 3.0);
        // The agent gone: the collector reports nothing, the recorded metrics stay.
        drop(src);
        let t = m.encode();
        assert!(!t.contains("kvxfer_peers_connected"), "{t}");
        assert!(t.contains("kvxfer_transfer_bytes_total"), "{t}");
    }

    #[test]
    fn docs_list_every_metric() {
        let ops = include_str!("../../../docs/operations.md");
        let readme = include_str!("../../../README.md");
        for d in METRICS {
            assert!(ops.contains(&format!("| `{}` | {} |", d.name, d.kind)), "docs/operations.md lacks {}", d.name);
            assert!(readme.contains(&format!("`{}", d.name)), "README.md lacks {}", d.name);
        }
    }

    #[test]
    fn bootstrap_counters() {
        let s = crate::bootstrap::ServerStats { store_keys: 3, accepted: 12, auth_failures: 1, ..Default::default() };
        let t = encode_bootstrap(&s);
        assert_eq!(sample(&t, "kvxfer_bootstrap_store_keys "), 3.0);
        assert_eq!(sample(&t, "kvxfer_bootstrap_accepted_total "), 12.0);
        assert_eq!(sample(&t, "kvxfer_bootstrap_auth_failures_total "), 1.0);
        assert!(t.ends_with("# EOF\n"), "{t}");
    }

    #[test]
    fn the_decode_side_has_no_op_counter() {
        let rec = Recorder::new();
        let src = Arc::new(Fixed(Snapshot::default()));
        let t = AgentMetrics::new(Side::Decode, RankId { tp: 0, pp: 0 }, &rec, &src).encode();
        assert!(!t.contains("kvxfer_transfer_ops"), "{t}");
        assert!(t.contains(r#"role="decode""#), "{t}");
    }
}
