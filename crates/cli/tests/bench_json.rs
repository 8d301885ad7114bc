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
