//! Request traces over OpenTelemetry (cargo feature `otel`).
//!
//! When `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, every
//! `kvxfer` command exports its requests as OTLP/HTTP spans (protobuf, or JSON with
//! `OTEL_EXPORTER_OTLP_PROTOCOL=http/json`) to that collector. The agent logs each step of a
//! request as a `debug` event of target `kvxfer::request` carrying its trace id
//! (`kvxfer::engine::TraceId`: the room and the decode rank's generation, the same in every process
//! the request touches). This layer turns them into one span per (request, rank): it opens with the
//! rank's first event of the request, every event is a span event, and it ends with the rank's
//! final status (an error status when it failed). An event after that (a late notification, an
//! abort of a request this rank had finished) is a span of its own, marked `kvxfer.after_final`. The span's OpenTelemetry trace id IS the kvxfer
//! trace id, so a tracing backend (Jaeger, Tempo, ...) shows the decode rank and every prefill rank
//! that fed it as one trace, with no context propagated on the wire.
//!
//! Bounded: at most [`MAX_OPEN`] spans are open at once (the oldest is ended, marked
//! `kvxfer.evicted`); the SDK's batch processor bounds its queue and drops on overflow. Export runs
//! on the SDK's own thread; at exit the command flushes for at most [`FLUSH_BOUND`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry::trace::{Span as _, SpanBuilder, SpanKind, Status, TraceId, Tracer as _, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig as _};
use opentelemetry_sdk::trace::{SdkTracerProvider, Span, Tracer};
use opentelemetry_sdk::Resource;
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::Context as LayerContext;
use tracing_subscriber::Layer;

/// The most request spans open at once in one process.
pub const MAX_OPEN: usize = 4096;
/// The longest the exit waits for the last spans to be exported.
pub const FLUSH_BOUND: Duration = Duration::from_secs(5);
/// The target of the agent's request events.
const TARGET: &str = "kvxfer::request";

/// Whether the environment asks for OTLP export.
pub fn requested() -> bool {
    ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
        .iter()
        .any(|v| std::env::var(v).is_ok_and(|s| !s.trim().is_empty()))
}

/// Ends export at drop: ends the spans of requests still open (marked `kvxfer.unfinished`), then
/// flushes what is queued (bounded by [`FLUSH_BOUND`]).
pub struct Guard {
    provider: SdkTracerProvider,
    open: Arc<Mutex<Open>>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        open.order.clear();
        for (_, mut s) in open.spans.drain() {
            s.set_attribute(KeyValue::new("kvxfer.unfinished", true));
            s.end();
        }
        drop(open);
        if let Err(e) = self.provider.shutdown_with_timeout(FLUSH_BOUND) {
            eprintln!("kvxfer: exporting the last request traces over OTLP failed: {e}");
        }
    }
}

/// The layer and its guard, from the standard `OTEL_*` environment variables; `Ok(None)` when no
/// endpoint is set. `command` names the command in the resource (`kvxfer.command`).
pub fn from_env(command: &str) -> Result<Option<(RequestSpans, Guard)>, String> {
    if !requested() {
        return Ok(None);
    }
    let protocol = match std::env::var("OTEL_EXPORTER_OTLP_PROTOCOL").unwrap_or_default().trim() {
        "" | "http/protobuf" => Protocol::HttpBinary,
        "http/json" => Protocol::HttpJson,
        other => {
            return Err(format!(
                "OTEL_EXPORTER_OTLP_PROTOCOL={other}: this kvxfer exports over OTLP/HTTP only (http/protobuf, \
                 http/json); point it at the collector's HTTP port (4318)"
            ))
        }
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(protocol)
        .build()
        .map_err(|e| format!("OTLP exporter: {e}"))?;
    let mut resource = Resource::builder().with_attributes([
        KeyValue::new("kvxfer.command", command.to_owned()),
        KeyValue::new("process.pid", i64::from(std::process::id())),
    ]);
    if std::env::var("OTEL_SERVICE_NAME").is_err() {
        resource = resource.with_service_name("kvxfer");
    }
    let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource.build()).build();
    let tracer = provider.tracer("kvxfer");
    let open = Arc::new(Mutex::new(Open::default()));
    Ok(Some((RequestSpans { tracer, open: Arc::clone(&open) }, Guard { provider, open })))
}

/// The layer: the agent's request events as one span per (request, rank).
pub struct RequestSpans {
    tracer: Tracer,
    open: Arc<Mutex<Open>>,
}

/// A span's key: the trace id, the role and the rank (one process may hold several agents).
type Key = (u128, String, String);

#[derive(Default)]
struct Open {
    spans: HashMap<Key, Span>,
    order: VecDeque<Key>,
    /// Keys whose span ended with its final status (the latest [`MAX_OPEN`]): a later event of
    /// one (a notification or an abort that arrives after this rank finished) is a span of its
    /// own, ended at once and marked `kvxfer.after_final`.
    closed: HashSet<Key>,
    closed_order: VecDeque<Key>,
}

/// An event's fields: the trace id, role, rank and message apart, the rest as attributes.
#[derive(Default)]
struct Fields {
    trace: Option<u128>,
    role: String,
    rank: String,
    room: String,
    message: String,
    attributes: Vec<KeyValue>,
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.record_str(field, &format!("{value:?}"));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "trace_id" => self.trace = u128::from_str_radix(value, 16).ok().filter(|t| *t != 0),
            "role" => self.role = value.to_owned(),
            "rank" => self.rank = value.to_owned(),
            "room" => self.room = value.to_owned(),
            "message" => self.message = value.to_owned(),
            name => self.attributes.push(KeyValue::new(format!("kvxfer.{name}"), value.to_owned())),
        }
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.attributes.push(KeyValue::new(format!("kvxfer.{}", field.name()), value as i64));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.attributes.push(KeyValue::new(format!("kvxfer.{}", field.name()), value));
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.attributes.push(KeyValue::new(format!("kvxfer.{}", field.name()), value));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.attributes.push(KeyValue::new(format!("kvxfer.{}", field.name()), value));
    }
}

impl RequestSpans {
    fn start(&self, trace: u128, f: &Fields) -> Span {
        let builder = SpanBuilder::from_name(format!("kvxfer {} request", f.role))
            .with_kind(SpanKind::Internal)
            .with_trace_id(TraceId::from(trace))
            .with_attributes([
                KeyValue::new("kvxfer.trace_id", format!("{trace:032x}")),
                KeyValue::new("kvxfer.room", f.room.clone()),
                KeyValue::new("kvxfer.role", f.role.clone()),
                KeyValue::new("kvxfer.rank", f.rank.clone()),
            ]);
        // No parent: the trace id is the request's own, in every process.
        self.tracer.build_with_context(builder, &Context::new())
    }
}

impl<S: Subscriber> Layer<S> for RequestSpans {
    fn on_event(&self, event: &Event<'_>, _: LayerContext<'_, S>) {
        if event.metadata().target() != TARGET {
            return;
        }
        let mut f = Fields::default();
        event.record(&mut f);
        let Some(trace) = f.trace else { return };
        let key = (trace, f.role.clone(), f.rank.clone());
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if !open.spans.contains_key(&key) && open.closed.contains(&key) {
            let mut late = self.start(trace, &f);
            late.set_attribute(KeyValue::new("kvxfer.after_final", true));
            late.add_event(std::mem::take(&mut f.message), std::mem::take(&mut f.attributes));
            late.end();
            return;
        }
        if !open.spans.contains_key(&key) {
            let span = self.start(trace, &f);
            open.spans.insert(key.clone(), span);
            open.order.push_back(key.clone());
        }
        let message = std::mem::take(&mut f.message);
        let finished = message.starts_with("final:");
        let span = open.spans.get_mut(&key).expect("inserted above");
        span.add_event(message.clone(), std::mem::take(&mut f.attributes));
        if finished {
            let outcome = message.trim_start_matches("final:").trim();
            let ok = outcome.starts_with("succeeded") || outcome.starts_with("Success");
            span.set_attribute(KeyValue::new("kvxfer.outcome", if ok { "success" } else { "failure" }));
            span.set_status(if ok { Status::Ok } else { Status::error(outcome.to_owned()) });
            if let Some(mut s) = open.spans.remove(&key) {
                s.end();
            }
            open.order.retain(|k| k != &key);
            if open.closed.insert(key.clone()) {
                open.closed_order.push_back(key);
            }
            while open.closed_order.len() > MAX_OPEN {
                if let Some(k) = open.closed_order.pop_front() {
                    open.closed.remove(&k);
                }
            }
        }
        while open.order.len() > MAX_OPEN {
            let Some(oldest) = open.order.pop_front() else { break };
            if let Some(mut s) = open.spans.remove(&oldest) {
                s.set_attribute(KeyValue::new("kvxfer.evicted", true));
                s.end();
            }
        }
    }
}
