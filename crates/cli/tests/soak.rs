//! `kvxfer soak` end to end, short: 40 s of requests (abort rate 0.3) with one prefill rank of two
//! SIGKILLed at 15 s and restarted. The summary must name the killed rank, see the restarted one
//! back in service, count no wrong byte, and every worker must exit 0. The 30-minute run and its
//! flatness figures are not for CI: `scripts/soak.sh` (docs/testing.md).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_kvxfer");
/// The run (40 s), the workers' ends (a few seconds), slack for 2 loaded cores.
const BOUND: Duration = Duration::from_secs(150);

#[test]
fn a_killed_prefill_rank_is_named_and_back_in_service_with_no_wrong_byte() {
    let logs = std::env::temp_dir().join(format!("kvxfer-soak-test-{}", std::process::id()));
    let mut child = Command::new(BIN)
        .args(["soak", "--duration", "40s", "--kill-every", "15s", "--sample-every", "2s", "--warmup", "5s"])
        .args(["--lease-ttl-s", "2", "--inflight", "2", "--format", "json"])
        // 40 s say nothing about flatness (that is the 30-minute run's figure): a loose bound here.
        .args(["--max-growth-pct", "100"])
        .arg("--logs")
        .arg(&logs)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kvxfer soak");
    let end = Instant::now() + BOUND;
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() >= end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kvxfer soak did not end within {BOUND:?} (logs in {})", logs.display());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = child.wait_with_output().expect("output");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let r: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("no JSON report ({e}):\n{}\n{stderr}", String::from_utf8_lossy(&out.stdout)));
    assert!(out.status.success(), "kvxfer soak failed: {:#}\n{stderr}", r["failed_checks"]);
    assert_eq!(r["failed_checks"].as_array().map(Vec::len), Some(0), "{r:#}");
    let kills = r["kills"].as_array().expect("kills");
    assert_eq!(kills.len(), 1, "one kill expected: {r:#}");
    let k = &kills[0];
    assert_eq!(k["rank"], "1/0");
    assert!(k["named_after_s"].as_f64().is_some_and(|s| s < 15.0), "not named: {k}");
    assert!(k["restarted_epoch"].as_u64() > k["epoch"].as_u64(), "no new epoch: {k}");
    assert!(k["restarted_sent"].as_u64() > Some(0) && k["decode_done_after"].as_u64() > Some(0), "{k}");
    assert_eq!(k["ok"], true);
    let q = &r["requests"];
    assert!(q["completed"].as_u64() > Some(0), "{q}");
    assert_eq!(q["completed"], q["verified"], "{q}");
    assert_eq!(q["wrong_byte_errors"], 0, "{q}");
    assert_eq!(q["quarantined"], 0, "{q}");
    assert!(q["aborted"].as_u64() > Some(0), "abort rate 0.3, none aborted: {q}");
    // Sampled: the bootstrap, the decode and the prefill rank never killed.
    let names: Vec<&str> = r["processes"].as_array().unwrap().iter().filter_map(|p| p["name"].as_str()).collect();
    assert_eq!(names, ["bootstrap", "decode 0/0", "prefill 0/0"]);
    assert!(r["samples"].as_array().is_some_and(|s| s.len() >= 15), "samples: {}", r["samples"]);
    for (name, code) in r["exits"].as_object().expect("exits") {
        assert_eq!(code, 0, "{name} exited {code}");
    }
    let _ = std::fs::remove_dir_all(&logs);
}
