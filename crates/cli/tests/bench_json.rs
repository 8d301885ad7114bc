//! `kvxfer bench --format json` end to end on the embedded tcp backend: a small workload, every
//! baseline present and positive (memcpy, the busy-polling plain socket), the bytes verified, and
//! the core-to-core round trip reported around the case.

use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn bench_reports_every_baseline_and_verifies() {
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_kvxfer"))
        .args(["bench", "--backend", "tcp", "--block", "64K,1M", "--total", "8M", "--shuffle", "--runs", "1"])
        .args(["--format", "json"])
        .output()
        .expect("running kvxfer bench");
    assert!(out.status.success(), "kvxfer bench failed: {}", String::from_utf8_lossy(&out.stderr));
    assert!(start.elapsed() < Duration::from_secs(120), "took {:?}", start.elapsed());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bench prints JSON");
    let cases = v["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 2);
    for c in cases {
        assert_eq!(c["verified"], true, "{c}");
        assert_eq!(c["bytes"], 8 << 20, "{c}");
        for k in ["backend", "memcpy", "socket"] {
            let g = c[k]["median_gbps"].as_f64().unwrap_or(0.0);
            assert!(g > 0.0 && g.is_finite(), "{k}: {c}");
        }
        let r = c["ratio_vs_socket"].as_f64().unwrap_or(0.0);
        assert!(r > 0.0 && r.is_finite(), "{c}");
        // Before and after: a number of ns each, or null where no probe finished.
        let rtt = c["core_rtt_ns"].as_array().expect("core_rtt_ns is a pair");
        assert_eq!(rtt.len(), 2, "{c}");
        for x in rtt {
            assert!(x.is_null() || x.as_f64().is_some_and(|ns| ns > 0.0), "{c}");
        }
        // tcp has no native baseline.
        assert!(c["native"].is_null(), "{c}");
    }
}

/// `--through engine`: requests through the engine API beside the same bytes moved raw and by
/// memcpy, the fields issue 31's goals are read from present and numbers, and every byte verified
/// on every path, contiguous and fragmented.
#[test]
fn bench_through_engine_reports_the_engine_view() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvxfer"))
        .args(["bench", "--through", "engine", "--backend", "tcp", "--model", "llama3-8b"])
        .args(["--prefill-tp", "2", "--decode-tp", "1", "--layers", "2", "--tokens", "256", "--fragmented"])
        .args(["--runs", "2", "--small-requests", "20", "--register-size", "16M", "--format", "json"])
        .output()
        .expect("running kvxfer bench --through engine");
    assert!(out.status.success(), "kvxfer bench failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bench prints JSON");
    assert_eq!(v["through"], "engine");
    assert_eq!(v["small"]["requests"], 20);
    // One page of llama3-8b with 2 layers: 16 tokens x 2 layers x 8 heads x 128 x 2 (K, V) x 2 bytes.
    assert_eq!(v["small"]["bytes"], 16 * 2 * 8 * 128 * 2 * 2);
    assert_eq!(v["register"]["bytes"], 16 << 20);
    let cases = v["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 2, "contiguous and fragmented");
    for c in cases {
        assert_eq!(c["verified"], true, "{c}");
        // 256 tokens x 2 layers x 8 heads x 128 x 2 (K, V) x 2 bytes, from both prefill ranks.
        assert_eq!(c["bytes"], 256 * 2 * 8 * 128 * 2 * 2, "{c}");
        assert_eq!(c["pairs"], 2, "{c}");
        for k in [
            "ops_per_pair",
            "writes_per_pair",
            "bytes_per_write",
            "fragmented_vs_contiguous",
            "engine_vs_raw",
            "raw_vs_memcpy",
            "memcpy_fragmented_vs_contiguous",
            "small_request_overhead_us",
            "register_ms_per_gib",
            "first_vs_steady",
        ] {
            assert!(c[k].as_f64().is_some_and(f64::is_finite), "{k} is not a number: {c}");
        }
        for path in ["engine", "raw", "memcpy"] {
            let g = c[path]["median_gbps"].as_f64().unwrap_or(0.0);
            assert!(g > 0.0 && g.is_finite(), "{path}: {c}");
            let l = &c[path]["latency"];
            assert!(l["p50_us"].as_f64().unwrap() <= l["p99_us"].as_f64().unwrap(), "{c}");
        }
        assert!(c["engine"]["post"]["p50_us"].as_f64().is_some(), "{c}");
    }
    // Contiguous pages are one run per (layer, kind); a shuffled pool is one per page; either way
    // the backend is handed one indexed op per (layer, kind).
    let n = |i: usize, k: &str| cases[i][k].as_u64().unwrap();
    assert_eq!(n(0, "writes_per_pair"), 2 * 2, "contiguous: 2 layers x 2 kinds");
    assert!(n(1, "writes_per_pair") > n(0, "writes_per_pair") * 8, "{}", cases[1]);
    assert_eq!((n(0, "ops_per_pair"), n(1, "ops_per_pair")), (2 * 2, 2 * 2), "indexed ops");
}

/// The engine bench's verification can fail: one landed byte flipped, and the bench says so and
/// exits non-zero.
#[test]
fn bench_through_engine_fails_on_a_wrong_byte() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvxfer"))
        .args(["bench", "--through", "engine", "--prefill-tp", "1", "--decode-tp", "1", "--layers", "1"])
        .args(["--tokens", "32", "--runs", "1", "--small-requests", "2", "--register-size", "1M"])
        .args(["--inject-wrong-byte", "--format", "json"])
        .output()
        .expect("running kvxfer bench --through engine");
    assert!(!out.status.success(), "a flipped byte must fail the bench");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("verification FAILED"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bench prints JSON");
    assert_eq!(v["cases"][0]["verified"], false);
}
