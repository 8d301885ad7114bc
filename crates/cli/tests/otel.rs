//! Issue 30, traces: `kvxfer demo` built with the `otel` feature and `OTEL_EXPORTER_OTLP_ENDPOINT`
//! set exports its requests over OTLP/HTTP (here JSON, to a collector stand-in in this test that
//! records what it receives). Every request is one trace whose id is the kvxfer trace id (room <<
//! 64 | the decode rank's generation), made of the spans of the processes it touched: the decode
//! worker's and each prefill worker's, each from its own process, each ended with its final status.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::routing::post;
use axum::Router;
use serde_json::Value;

const EXE: &str = env!("CARGO_BIN_EXE_kvxfer");
const REQUESTS: usize = 8;

/// One exported span: its trace id, process id, role, rank, outcome and events.
#[derive(Debug)]
struct Exported {
    trace: String,
    pid: i64,
    role: String,
    rank: String,
    room: String,
    outcome: Option<String>,
    events: Vec<String>,
    error: bool,
    unfinished: bool,
    after_final: bool,
}

fn attr<'a>(attrs: &'a Value, key: &str) -> Option<&'a Value> {
    attrs.as_array()?.iter().find(|a| a["key"] == key).map(|a| &a["value"])
}

fn string(v: Option<&Value>) -> String {
    v.and_then(|v| v["stringValue"].as_str()).unwrap_or_default().to_owned()
}

/// The spans in OTLP/JSON export requests.
fn spans(bodies: &[Vec<u8>]) -> Vec<Exported> {
    let mut out = Vec::new();
    for b in bodies {
        let v: Value = serde_json::from_slice(b).expect("an OTLP/JSON export request");
        for rs in v["resourceSpans"].as_array().expect("resourceSpans") {
            let res = &rs["resource"]["attributes"];
            assert_eq!(string(attr(res, "service.name")), "kvxfer");
            let pid = attr(res, "process.pid")
                .and_then(|p| p["intValue"].as_str().and_then(|s| s.parse().ok()).or(p["intValue"].as_i64()))
                .expect("process.pid");
            for ss in rs["scopeSpans"].as_array().unwrap() {
                for s in ss["spans"].as_array().unwrap() {
                    let a = &s["attributes"];
                    out.push(Exported {
                        trace: s["traceId"].as_str().unwrap().to_lowercase(),
                        pid,
                        role: string(attr(a, "kvxfer.role")),
                        rank: string(attr(a, "kvxfer.rank")),
                        room: string(attr(a, "kvxfer.room")),
                        outcome: attr(a, "kvxfer.outcome").map(|v| v["stringValue"].as_str().unwrap().to_owned()),
                        events: s["events"]
                            .as_array()
                            .map(|e| e.iter().map(|e| e["name"].as_str().unwrap().to_owned()).collect())
                            .unwrap_or_default(),
                        error: s["status"]["code"] == 2 || s["status"]["code"] == "STATUS_CODE_ERROR",
                        unfinished: attr(a, "kvxfer.unfinished").is_some(),
                        after_final: attr(a, "kvxfer.after_final").is_some(),
                    });
                }
            }
        }
    }
    out
}

#[test]
fn every_request_is_one_trace_across_the_worker_processes() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let got: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    let sink = Arc::clone(&got);
    let app = Router::new().route(
        "/v1/traces",
        post(move |body: Bytes| {
            let sink = Arc::clone(&sink);
            async move {
                sink.lock().unwrap().push(body.to_vec());
                ([("content-type", "application/json")], "{}")
            }
        }),
    );
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(async move { axum::serve(listener, app).await });

    let out = Command::new(EXE)
        .args(["demo", "--format", "json", "--timeout-s", "120", "--requests", &REQUESTS.to_string()])
        .args(["--tokens", "64", "--layers", "2", "--prefill-tp", "2", "--decode-tp", "1", "--abort-rate", "0.3"])
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{addr}"))
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .env_remove("OTEL_SERVICE_NAME")
        .output()
        .expect("run kvxfer demo");
    let summary: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("no summary ({e}): {}", String::from_utf8_lossy(&out.stderr)));
    assert!(out.status.success(), "{summary:#}\n{}", String::from_utf8_lossy(&out.stderr));
    let (completed, aborted) = (summary["completed"].as_u64().unwrap(), summary["aborted"].as_u64().unwrap());
    assert_eq!(completed + aborted, REQUESTS as u64);
    assert!(aborted > 0 && completed > 0, "{summary:#}");

    let exported = spans(&got.lock().unwrap());
    // Events after a rank's final status (a late fence, an abort of a request the prefill had
    // finished) are spans of their own: of the same trace, after the rank's span.
    let (late, all): (Vec<Exported>, Vec<Exported>) = exported.into_iter().partition(|s| s.after_final);
    for l in &late {
        assert!(all.iter().any(|s| s.trace == l.trace && s.role == l.role && s.rank == l.rank), "{l:?}");
    }
    let mut traces: BTreeMap<&str, Vec<&Exported>> = BTreeMap::new();
    for s in &all {
        traces.entry(&s.trace).or_default().push(s);
    }
    // One trace per request (one decode rank: one generation per room).
    let decode: Vec<&Exported> = all.iter().filter(|s| s.role == "decode").collect();
    assert_eq!(decode.len(), REQUESTS, "{all:#?}");
    assert_eq!(traces.len(), REQUESTS, "{all:#?}");
    // Every rank's part of every request ended with its final status (none was ended at exit).
    for s in &all {
        assert!(!s.unfinished && s.outcome.is_some(), "{s:?}");
    }
    let mut ok = 0;
    for d in &decode {
        // The OpenTelemetry trace id is the kvxfer trace id: the room in the high 64 bits.
        let room: u64 = d.room.trim_start_matches('#').parse().expect("a room");
        assert_eq!(&d.trace[..16], format!("{room:016x}"), "{d:?}");
        assert!(d.events.iter().any(|e| e.starts_with("handoff")), "{d:?}");
        assert!(d.events.last().unwrap().starts_with("final:"), "{d:?}");
        let spans = &traces[d.trace.as_str()];
        let prefill: Vec<&&Exported> = spans.iter().filter(|s| s.role == "prefill").collect();
        match d.outcome.as_deref() {
            Some("success") => {
                ok += 1;
                assert!(!d.error);
                // Both prefill ranks fed it, each from its own process, each ended with success.
                let ranks: BTreeSet<&str> = prefill.iter().map(|s| s.rank.as_str()).collect();
                assert_eq!(ranks, BTreeSet::from(["0/0", "1/0"]), "{spans:#?}");
                let pids: BTreeSet<i64> = spans.iter().map(|s| s.pid).collect();
                assert_eq!(pids.len(), 3, "three processes: {spans:#?}");
                for p in &prefill {
                    assert_eq!(p.outcome.as_deref(), Some("success"), "{p:?}");
                    assert!(p.events.iter().any(|e| e == "handoff received"), "{p:?}");
                    assert!(p.events.iter().any(|e| e == "posting"), "{p:?}");
                }
            }
            Some("failure") => {
                assert!(d.error, "{d:?}");
                // The prefill ranks that saw it before the abort ended their spans too (failed,
                // or succeeded where every write was done before the abort came).
                for p in &prefill {
                    assert!(p.outcome.is_some(), "{p:?}");
                }
            }
            other => panic!("decode span without an outcome ({other:?}): {d:?}"),
        }
    }
    assert_eq!(ok, completed as usize);
    rt.shutdown_background();
}
