//! `kvxfer demo --metrics-listen`: the demo serves its workers' metrics merged into one OpenMetrics
//! exposition, scraped over HTTP here after the summary; the counters must equal the demo's own
//! summary (requests, aborts, bytes), and the latency histograms must count every request.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

const EXE: &str = env!("CARGO_BIN_EXE_kvxfer");
const REQUESTS: u64 = 8;

fn scrape(addr: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect to the demo's metrics");
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.to_ascii_lowercase().contains("content-type: application/openmetrics-text"), "{head}");
    body.to_owned()
}

/// Sum of the samples of `name` whose labels contain every one of `labels`.
fn sum(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, rest) = series.split_once('{').unwrap_or((series, "}"));
            (n == name && labels.iter().all(|w| rest.contains(w))).then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

fn run(extra: &[&str]) -> (serde_json::Value, String) {
    let mut child = Command::new(EXE)
        .args(["demo", "--format", "json", "--timeout-s", "120", "--requests", &REQUESTS.to_string()])
        .args(["--tokens", "80", "--layers", "4", "--prefill-tp", "2", "--decode-tp", "2"])
        .args(["--metrics-listen", "127.0.0.1:0", "--metrics-linger-s", "60"])
        .args(extra)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kvxfer demo");
    let err = BufReader::new(child.stderr.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in err.lines().map_while(Result::ok) {
            eprintln!("demo: {line}");
            if let Some(rest) = line.strip_prefix("kvxfer demo: metrics of every worker at http://") {
                let _ = tx.send(rest.trim_end_matches("/metrics").to_owned());
            }
        }
    });
    let addr = rx.recv_timeout(Duration::from_secs(30)).expect("the demo printed its metrics address");
    // The pretty-printed summary ends with a line `}`; the demo then lingers, serving the metrics.
    let mut json = String::new();
    for line in BufReader::new(child.stdout.take().unwrap()).lines().map_while(Result::ok) {
        json.push_str(&line);
        json.push('\n');
        if line == "}" {
            break;
        }
    }
    let v: serde_json::Value = serde_json::from_str(&json).unwrap_or_else(|e| panic!("no summary ({e}): {json}"));
    let text = scrape(&addr);
    drop(child.stdin.take()); // ends the linger
    let st = child.wait().unwrap();
    assert!(st.success(), "demo {extra:?}: {st:?}\n{v:#}");
    assert_eq!(v["ok"], true, "{v:#}");
    (v, text)
}

fn check(v: &serde_json::Value, t: &str) {
    let dec = ["role=\"decode\""];
    let pre = ["role=\"prefill\""];
    let n = |x: &serde_json::Value| x.as_u64().unwrap() as f64;
    let (completed, aborted) = (n(&v["completed"]), n(&v["aborted"]));
    // Two decode ranks, two prefill ranks: every rank's samples are there.
    for tp in ["0", "1"] {
        for role in ["prefill", "decode"] {
            let l = [&*format!("role=\"{role}\""), &*format!("tp=\"{tp}\"")];
            // TP 2 to TP 2: each rank exchanges with the one of the same TP rank.
            assert_eq!(sum(t, "kvxfer_peers", &l), 1.0, "{role} {tp}:\n{t}");
            // The final figures: a decode rank ends after its senders left, a prefill rank
            // before its receivers do.
            let connected = if role == "prefill" { 1.0 } else { 0.0 };
            assert_eq!(sum(t, "kvxfer_peers_connected", &l), connected, "{role} {tp}:\n{t}");
        }
    }
    assert_eq!(sum(t, "kvxfer_requests_total", &[dec[0], "outcome=\"success\""]), completed, "{t}");
    assert_eq!(sum(t, "kvxfer_requests_total", &[dec[0], "outcome=\"failed\""]), aborted, "{t}");
    assert_eq!(sum(t, "kvxfer_aborts_total", &dec), aborted, "{t}");
    assert_eq!(sum(t, "kvxfer_request_failures_total", &[dec[0], "cause=\"aborted\""]), aborted, "{t}");
    // The histograms count every request that ended, on both sides.
    assert_eq!(sum(t, "kvxfer_request_duration_seconds_count", &[dec[0], "outcome=\"success\""]), completed);
    assert_eq!(sum(t, "kvxfer_request_duration_seconds_count", &[dec[0], "outcome=\"failed\""]), aborted);
    assert_eq!(sum(t, "kvxfer_request_duration_seconds_bucket", &[dec[0], "le=\"+Inf\""]), completed + aborted);
    let prefill_ok = sum(t, "kvxfer_requests_total", &[pre[0], "outcome=\"success\""]);
    let prefill_failed = sum(t, "kvxfer_requests_total", &[pre[0], "outcome=\"failed\""]);
    assert_eq!(prefill_ok + prefill_failed, 2.0 * REQUESTS as f64, "{t}");
    // Prefill latency starts at the first post: every success has one; a request aborted before
    // it posted anything has none.
    assert_eq!(sum(t, "kvxfer_request_duration_seconds_count", &[pre[0], "outcome=\"success\""]), prefill_ok, "{t}");
    assert!(sum(t, "kvxfer_request_duration_seconds_count", &[pre[0], "outcome=\"failed\""]) <= prefill_failed);
    // Bytes: decode counts the requests that succeeded, which the demo verified byte for byte.
    assert_eq!(sum(t, "kvxfer_transfer_bytes_total", &dec), n(&v["verified_bytes"]), "{t}");
    let ranks = v["ranks"].as_array().unwrap();
    let prefill_summary: f64 = ranks.iter().filter(|r| r["role"] == "prefill").map(|r| n(&r["bytes"])).sum();
    let prefill_ops: f64 = ranks.iter().filter(|r| r["role"] == "prefill").map(|r| n(&r["ops"])).sum();
    // Prefill counts every write that completed: the summary's completed requests, plus what
    // aborted requests had written before their abort.
    if aborted == 0.0 {
        assert_eq!(sum(t, "kvxfer_transfer_bytes_total", &pre), prefill_summary, "{t}");
        assert_eq!(sum(t, "kvxfer_transfer_ops_total", &pre), prefill_ops, "{t}");
    } else {
        assert!(sum(t, "kvxfer_transfer_bytes_total", &pre) >= prefill_summary, "{t}");
    }
    assert!(sum(t, "kvxfer_registered_bytes", &dec) > 0.0);
    // Decode ranks give up on their senders when those leave at the end, and cut them off: every
    // give-up confirmed, nothing quarantined.
    assert_eq!(sum(t, "kvxfer_peers_lost_total", &dec), 2.0, "{t}");
    assert_eq!(sum(t, "kvxfer_cut_offs_total", &dec), 2.0, "{t}");
    assert_eq!(sum(t, "kvxfer_cut_offs_unconfirmed_total", &[]), 0.0, "{t}");
    assert_eq!(sum(t, "kvxfer_peers_lost_total", &pre), 0.0, "{t}");
    assert!(t.ends_with("# EOF\n") && t.matches("# EOF").count() == 1, "{t}");
}

#[test]
fn scraped_counters_equal_the_demo_summary() {
    let (v, t) = run(&[]);
    assert_eq!(v["aborted"], 0, "{v:#}");
    check(&v, &t);
}

#[test]
fn scraped_counters_with_aborts() {
    let (v, t) = run(&["--abort-rate", "0.3", "--chunk-pages", "2"]);
    assert!(v["aborted"].as_u64().unwrap() > 0, "{v:#}");
    check(&v, &t);
}
