//! The pictures of issue 30, end to end through the `kvxfer` binary:
//!
//! - `kvxfer plan --format svg` parses as XML and has exactly one `edge` element per pair that moves
//!   bytes, where the moving pairs (and their bytes) are read independently from `kvxfer plan
//!   --format json` with the same arguments; pairs that only notify are `notify` lines, never edges;
//!   rank boxes, and the replicated ones among them, match the configuration;
//! - `kvxfer bench --plot FILE.svg` writes an SVG that parses as XML and has a series (a legend
//!   entry and one point per block size) for every measurement the same run reports in its JSON.

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_kvxfer");
const SVG_NS: &str = "http://www.w3.org/2000/svg";

fn kvxfer(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("running kvxfer")
}

fn ok(args: &[&str]) -> String {
    let out = kvxfer(args);
    assert!(out.status.success(), "kvxfer {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

fn rank(v: &Value) -> String {
    format!("{}/{}", v["tp"].as_u64().expect("tp"), v["pp"].as_u64().expect("pp"))
}

/// A (prefill rank, decode rank) pair as `tp/pp` strings.
type Pair = (String, String);

/// From the JSON plan: moving pairs (src, dst) -> bytes, and the pairs that only notify.
fn pairs_from_json(json: &str) -> (BTreeMap<Pair, u64>, BTreeSet<Pair>) {
    let v: Value = serde_json::from_str(json).expect("plan JSON");
    let mut moving = BTreeMap::new();
    let mut notify = BTreeSet::new();
    for t in v["transfers"].as_array().expect("transfers") {
        let key = (rank(&t["src"]), rank(&t["dst"]));
        let ops = t["ops"].as_array().expect("ops");
        if ops.is_empty() {
            assert!(notify.insert(key.clone()), "pair {key:?} twice in the JSON");
        } else {
            let bytes = ops.iter().map(|o| o["len"].as_u64().unwrap() * o["count"].as_u64().unwrap()).sum();
            assert!(moving.insert(key.clone(), bytes).is_none(), "pair {key:?} twice in the JSON");
        }
    }
    (moving, notify)
}

fn classes<'a>(n: &roxmltree::Node<'a, '_>) -> Vec<&'a str> {
    n.attribute("class").map(|c| c.split_whitespace().collect()).unwrap_or_default()
}

/// One configuration: its flags, and how many rank boxes of each side hold replicated heads.
struct Case {
    args: Vec<&'static str>,
    ranks: usize,
    replicated: usize,
    /// Pairs that only notify (a replica writes their heads).
    notify_only: usize,
}

fn check_plan_picture(case: &Case) {
    let with = |format: &str| {
        let mut a = vec!["plan"];
        a.extend(&case.args);
        a.extend(["--format", format]);
        a.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    let args_json = with("json");
    let args_svg = with("svg");
    let json = ok(&args_json.iter().map(String::as_str).collect::<Vec<_>>());
    let svg = ok(&args_svg.iter().map(String::as_str).collect::<Vec<_>>());
    let (moving, notify) = pairs_from_json(&json);
    assert!(!moving.is_empty(), "{:?}: nothing moves", case.args);
    assert_eq!(notify.len(), case.notify_only, "{:?}: the JSON's notify-only pairs", case.args);

    let doc = roxmltree::Document::parse(&svg).unwrap_or_else(|e| panic!("{:?}: not XML: {e}\n{svg}", case.args));
    let root = doc.root_element();
    assert_eq!((root.tag_name().namespace(), root.tag_name().name()), (Some(SVG_NS), "svg"));

    let mut edges = BTreeMap::new();
    let mut notifies = BTreeSet::new();
    let (mut boxes, mut replicated_boxes, mut labels) = (0, 0, 0);
    for n in doc.descendants().filter(|n| n.is_element()) {
        let c = classes(&n);
        let ends = || (n.attribute("data-src").unwrap().to_owned(), n.attribute("data-dst").unwrap().to_owned());
        if c.contains(&"edge") {
            assert!(matches!(n.tag_name().name(), "line" | "path"), "edge element <{}>", n.tag_name().name());
            let bytes: u64 = n.attribute("data-bytes").expect("data-bytes").parse().expect("bytes");
            assert!(edges.insert(ends(), bytes).is_none(), "{:?}: two edges for {:?}", case.args, ends());
        }
        if c.contains(&"notify") {
            assert!(notifies.insert(ends()));
        }
        if c.contains(&"rank") {
            boxes += 1;
            replicated_boxes += usize::from(c.contains(&"replicated"));
        }
        labels += usize::from(c.contains(&"edge-label"));
    }
    // Exactly one edge per moving pair, with the pair's bytes; the rest only notify.
    assert_eq!(edges, moving, "{:?}: SVG edges vs JSON moving pairs", case.args);
    assert_eq!(notifies, notify, "{:?}", case.args);
    assert_eq!(labels, moving.len(), "{:?}: one label per edge", case.args);
    assert_eq!(boxes, case.ranks, "{:?}: rank boxes", case.args);
    assert_eq!(replicated_boxes, case.replicated, "{:?}: replicated rank boxes", case.args);
    if case.replicated > 0 {
        assert!(svg.contains("replicated on"), "{:?}", case.args);
    }
}

fn gqa(p: &'static str, d: &'static str, h: &'static str, layers: &'static str) -> Vec<&'static str> {
    vec![
        "--prefill-tp",
        p,
        "--decode-tp",
        d,
        "--kv-heads",
        h,
        "--head-dim",
        "128",
        "--layers",
        layers,
        "--page-size",
        "16",
        "--dtype-bytes",
        "2",
        "--src-pages",
        "0-3,9",
        "--dst-pages",
        "20,22-25",
    ]
}

#[test]
fn plan_svg_has_one_edge_per_moving_pair_of_the_json_plan() {
    let pages = ["--src-pages", "0-3", "--dst-pages", "10-11,5,7"];
    let mla = [
        &["--prefill-tp", "4", "--decode-tp", "2", "--mla", "--latent-dim", "576", "--layers", "61"][..],
        &["--page-size", "16", "--dtype-bytes", "2"],
        &pages,
    ]
    .concat();
    let cases = [
        // llama3-70b-like: 8 KV heads, P=8 -> D=2; one head per prefill rank.
        Case { args: gqa("8", "2", "8", "80"), ranks: 10, replicated: 0, notify_only: 0 },
        // P=2 -> D=8 with 8 heads: one head per decode rank (no replication: D = H).
        Case { args: gqa("2", "8", "8", "4"), ranks: 10, replicated: 0, notify_only: 0 },
        Case { args: gqa("4", "4", "8", "4"), ranks: 8, replicated: 0, notify_only: 0 },
        // GQA H=2, P=8 -> D=4: each head on 4 prefill and 2 decode ranks; half the pairs only notify.
        Case { args: gqa("8", "4", "2", "4"), ranks: 12, replicated: 12, notify_only: 4 },
        // H=2, P=2 -> D=8: replication on decode.
        Case { args: gqa("2", "8", "2", "4"), ranks: 10, replicated: 8, notify_only: 0 },
        // MLA P=4 -> D=2: the latent on every rank; prefill ranks 1 and 3 have no receiver.
        Case { args: mla, ranks: 6, replicated: 6, notify_only: 0 },
        // PP 2 -> 2.
        Case {
            args: [&gqa("2", "2", "8", "8")[..], &["--prefill-pp", "2", "--decode-pp", "2"]].concat(),
            ranks: 8,
            replicated: 0,
            notify_only: 0,
        },
        // Uneven PP 2 -> 1, HND and a preset (--model).
        Case {
            args: [&["--model", "deepseek-v3", "--prefill-tp", "2", "--decode-tp", "4"][..], &pages]
                .concat()
                .into_iter()
                .chain(["--prefill-pp", "2", "--prefill-layers", "31,30", "--layout", "hnd"])
                .collect(),
            ranks: 8,
            replicated: 8,
            notify_only: 0,
        },
        // qwen3.5 (H=2), P=8 -> D=2: each head on 4 prefill ranks; 3 of each decode rank's 4 senders
        // only notify.
        Case {
            args: [&["--model", "qwen3.5", "--prefill-tp", "8", "--decode-tp", "2"][..], &pages].concat(),
            ranks: 10,
            replicated: 8,
            notify_only: 6,
        },
    ];
    for case in &cases {
        check_plan_picture(case);
    }
}

#[test]
fn plan_model_equals_the_explicit_shape_and_refuses_conflicts() {
    let pages = ["--src-pages", "0-7", "--dst-pages", "8-15", "--prefill-tp", "8", "--decode-tp", "2"];
    let explicit = [
        &pages[..],
        &["--kv-heads", "8", "--head-dim", "128", "--layers", "80", "--page-size", "16", "--dtype-bytes", "2"],
    ]
    .concat();
    let preset = [&pages[..], &["--model", "llama3-70b"]].concat();
    for format in ["json", "table"] {
        let a = ok(&[&["plan", "--format", format][..], &explicit].concat());
        let b = ok(&[&["plan", "--format", format][..], &preset].concat());
        assert_eq!(a, b, "--model llama3-70b differs from its explicit shape ({format})");
    }
    // An explicit flag overrides the preset's value.
    let a = ok(&[&["plan", "--format", "json"][..], &explicit]
        .concat()
        .iter()
        .map(|s| if *s == "80" { "2" } else { s })
        .collect::<Vec<_>>());
    let b = ok(&[&["plan", "--format", "json", "--layers", "2"][..], &preset].concat());
    assert_eq!(a, b);
    // Shape flags conflict with the preset, by name.
    let out = kvxfer(&[&["plan"][..], &preset, &["--kv-heads", "4"]].concat());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--model") && err.contains("--kv-heads"), "{err}");
    // An invalid configuration still fails, with nothing on stdout.
    let out = kvxfer(
        &["plan", "--model", "llama3-8b", "--prefill-tp", "3", "--decode-tp", "1", "--src-pages", "0"]
            .iter()
            .chain(&["--dst-pages", "0", "--format", "svg"])
            .copied()
            .collect::<Vec<_>>(),
    );
    assert!(!out.status.success() && out.stdout.is_empty(), "{out:?}");
    // bench has no SVG format (--plot draws its chart).
    let out = kvxfer(&["bench", "--format", "svg"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid value 'svg'"));
}

#[test]
fn bench_plot_has_a_series_per_reported_measurement() {
    let path = std::env::temp_dir().join(format!("kvxfer-pictures-{}.svg", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let start = Instant::now();
    let plot = path.to_str().expect("UTF-8 temp path");
    let json = ok(&["bench", "--backend", "tcp", "--block", "4K,64K", "--total", "256K", "--runs", "1"]
        .iter()
        .chain(&["--format", "json", "--plot", plot])
        .copied()
        .collect::<Vec<_>>());
    assert!(start.elapsed() < Duration::from_secs(60), "took {:?}", start.elapsed());
    let svg = std::fs::read_to_string(&path).expect("--plot wrote the file");
    let _ = std::fs::remove_file(&path);

    // What the run reports: the backend, the socket and memcpy for every case; a native tool where
    // it measured (tcp has none, but read it from the JSON, not assumed).
    let v: Value = serde_json::from_str(&json).expect("bench JSON");
    let cases = v["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 2);
    let mut expected: BTreeMap<String, usize> = BTreeMap::new();
    for c in cases {
        assert_eq!(c["verified"], true);
        for (key, name) in [("backend", "kvxfer tcp"), ("socket", "plain socket"), ("memcpy", "memcpy")] {
            if c[key]["median_gbps"].as_f64().is_some() {
                *expected.entry(name.to_owned()).or_default() += 1;
            }
        }
        if let Some(tool) = c["native"]["tool"].as_str().filter(|_| c["native"]["median_gbps"].is_number()) {
            *expected.entry(tool.to_owned()).or_default() += 1;
        }
    }
    assert_eq!(expected.len(), 3, "{expected:?}");

    let doc = roxmltree::Document::parse(&svg).unwrap_or_else(|e| panic!("--plot is not XML: {e}\n{svg}"));
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let texts: Vec<String> = doc
        .descendants()
        .filter(|n| n.has_tag_name((SVG_NS, "text")) || n.has_tag_name("text"))
        .map(|n| n.text().unwrap_or("").trim().to_owned())
        .collect();
    for name in expected.keys() {
        assert_eq!(texts.iter().filter(|t| t.starts_with(name.as_str())).count(), 1, "legend entry {name}: {texts:?}");
    }
    for label in ["4 KiB", "64 KiB"] {
        assert!(texts.iter().any(|t| t == label), "x tick {label}: {texts:?}");
    }
    assert!(texts.iter().any(|t| t.starts_with("block size")), "x axis label: {texts:?}");
    assert!(texts.iter().any(|t| t.starts_with("GB/s")), "y axis label: {texts:?}");
    // One point per measurement, and one line per series.
    let points = doc.descendants().filter(|n| n.tag_name().name() == "circle").count();
    assert_eq!(points, expected.values().sum::<usize>(), "points");
    let lines = doc.descendants().filter(|n| n.tag_name().name() == "polyline").count();
    assert!(lines >= expected.len(), "{lines} polylines for {} series", expected.len());
}
