//! `kvxfer plan --format json` over the configuration matrix of issue 2, checked against an oracle
//! written here from head ownership (SEMANTICS §2-5), never from the planner:
//!
//! - the JSON has exactly the documented keys and types;
//! - the pairs are exactly the (prefill, decode) pairs of SEMANTICS §3, and `expected_senders` is §5's set;
//! - every op byte, decoded through both ranks' buffer geometry, carries the same (global layer, kind,
//!   global head, request token, byte) on both sides, reads only the request's source pages and writes only
//!   its destination pages;
//! - every destination byte of the request is written exactly once (a byte bitmap per decode buffer), and
//!   each decode rank receives `layers * pages * S * (hd*hk + hd*hv)` bytes (MLA: `layers*pages*S*latent`);
//! - invalid configurations exit non-zero with the core's specific error on stderr.

use std::collections::{BTreeSet, HashMap};
use std::process::{Command, Output};

use serde_json::{Map, Value};

const BIN: &str = env!("CARGO_BIN_EXE_kvxfer");

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    Nhd,
    Hnd,
}

#[derive(Debug, Clone)]
struct Cfg {
    p: u32,
    d: u32,
    /// KV heads, or `None` for MLA.
    h: Option<u32>,
    hdk: u32,
    hdv: u32,
    latent: u32,
    dtype: u32,
    layers: u32,
    pp_p: u32,
    pp_d: u32,
    s: u32,
    layout: Layout,
    src: Vec<u32>,
    dst: Vec<u32>,
}

fn list(v: &[u32]) -> String {
    v.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

impl Cfg {
    fn args(&self) -> Vec<String> {
        let mut a: Vec<String> = vec!["plan".into()];
        let mut kv = |k: &str, v: String| {
            a.push(format!("--{k}"));
            a.push(v);
        };
        kv("prefill-tp", self.p.to_string());
        kv("decode-tp", self.d.to_string());
        kv("layers", self.layers.to_string());
        kv("page-size", self.s.to_string());
        kv("dtype-bytes", self.dtype.to_string());
        kv("src-pages", list(&self.src));
        kv("dst-pages", list(&self.dst));
        kv("prefill-pp", self.pp_p.to_string());
        kv("decode-pp", self.pp_d.to_string());
        kv("layout", if self.layout == Layout::Nhd { "nhd" } else { "hnd" }.into());
        kv("format", "json".into());
        match self.h {
            Some(h) => {
                kv("kv-heads", h.to_string());
                kv("head-dim", self.hdk.to_string());
                kv("v-head-dim", self.hdv.to_string());
            }
            None => {
                kv("latent-dim", self.latent.to_string());
                a.push("--mla".into());
            }
        }
        a
    }

    fn run(&self) -> Output {
        Command::new(BIN).args(self.args()).output().expect("run kvxfer")
    }

    fn kinds(&self) -> &'static [&'static str] {
        if self.h.is_some() {
            &["k", "v"]
        } else {
            &["latent"]
        }
    }

    fn head_bytes(&self, kind: &str) -> u64 {
        u64::from(match kind {
            "k" => self.hdk,
            "v" => self.hdv,
            _ => self.latent,
        }) * u64::from(self.dtype)
    }

    /// Heads of the group (1 for MLA: the latent, held whole by every rank).
    fn big_h(&self) -> u32 {
        self.h.unwrap_or(1)
    }

    /// SEMANTICS §2, for MLA every rank holds "head" 0.
    fn heads(&self, t: u32, r: u32) -> std::ops::Range<u32> {
        let h = self.big_h();
        if self.h.is_none() {
            0..1
        } else if t <= h {
            r * (h / t)..(r + 1) * (h / t)
        } else {
            let x = r / (t / h);
            x..x + 1
        }
    }

    fn local(&self, t: u32) -> u32 {
        if self.h.is_none() {
            1
        } else {
            (self.big_h() / t).max(1)
        }
    }

    /// SEMANTICS §3: prefill TP ranks feeding decode TP rank `d` within a stage.
    fn sender_tps(&self, d: u32) -> Vec<u32> {
        let (p, dd) = (self.p, self.d);
        if self.h.is_none() {
            return vec![if p <= dd { d / (dd / p) } else { d * (p / dd) }];
        }
        if p <= dd {
            vec![d / (dd / p)]
        } else {
            (d * (p / dd)..(d + 1) * (p / dd)).collect()
        }
    }

    /// (prefill rank, decode rank) pairs as ((tp, pp), (tp, pp)).
    fn pairs(&self) -> BTreeSet<((u32, u32), (u32, u32))> {
        let mut out = BTreeSet::new();
        for dpp in 0..self.pp_d {
            for d in 0..self.d {
                let stages: Vec<u32> = if self.pp_d == 1 { (0..self.pp_p).collect() } else { vec![dpp] };
                for spp in stages {
                    for p in self.sender_tps(d) {
                        out.insert(((p, spp), (d, dpp)));
                    }
                }
            }
        }
        out
    }

    /// SEMANTICS §5, in stage order then TP order.
    fn expected(&self, d: u32, dpp: u32) -> Vec<String> {
        let stages: Vec<u32> = if self.pp_d == 1 { (0..self.pp_p).collect() } else { vec![dpp] };
        stages
            .into_iter()
            .flat_map(|spp| self.sender_tps(d).into_iter().map(move |p| format!("tp{p}.pp{spp}")))
            .collect()
    }

    fn pool_pages(&self, pages: &[u32]) -> u64 {
        u64::from(pages.iter().copied().max().unwrap_or(0)) + 2
    }
}

/// What a byte holds: (global layer, global head, request token index, byte within the head).
type Ident = (u32, u32, u64, u64);

/// One rank's buffer geometry for one kind.
struct Geom {
    heads: u64,
    first_head: u32,
    hb: u64,
    s: u64,
    layout: Layout,
    /// Pool page -> position in the chunk's page list.
    index: HashMap<u32, u64>,
    pool_bytes: u64,
}

impl Geom {
    fn new(cfg: &Cfg, t: u32, r: u32, kind: &str, pages: &[u32]) -> Self {
        let heads = u64::from(cfg.local(t));
        let hb = cfg.head_bytes(kind);
        let s = u64::from(cfg.s);
        Geom {
            heads,
            first_head: cfg.heads(t, r).start,
            hb,
            s,
            layout: cfg.layout,
            index: pages.iter().enumerate().map(|(i, p)| (*p, i as u64)).collect(),
            pool_bytes: cfg.pool_pages(pages) * s * heads * hb,
        }
    }

    /// (page, token slot, head slot, byte) of a buffer offset.
    fn coord(&self, off: u64) -> (u64, u64, u64, u64) {
        let page_bytes = self.s * self.heads * self.hb;
        let (page, r) = (off / page_bytes, off % page_bytes);
        match self.layout {
            Layout::Nhd => (page, r / (self.heads * self.hb), (r % (self.heads * self.hb)) / self.hb, r % self.hb),
            Layout::Hnd => (page, (r % (self.s * self.hb)) / self.hb, r / (self.s * self.hb), r % self.hb),
        }
    }

    /// The identity of the byte at `off` if its page is part of the chunk.
    fn ident(&self, global_layer: u32, off: u64) -> Result<Ident, String> {
        if off >= self.pool_bytes {
            return Err(format!("offset {off} beyond the pool ({} bytes)", self.pool_bytes));
        }
        let (page, t, slot, b) = self.coord(off);
        let Some(i) = self.index.get(&(page as u32)) else {
            return Err(format!("offset {off} is in page {page}, which is not part of the request"));
        };
        Ok((global_layer, self.first_head + slot as u32, i * self.s + t, b))
    }
}

fn obj<'a>(v: &'a Value, keys: &[&str], what: &str) -> &'a Map<String, Value> {
    let m = v.as_object().unwrap_or_else(|| panic!("{what} is not an object: {v}"));
    let got: BTreeSet<&str> = m.keys().map(String::as_str).collect();
    let want: BTreeSet<&str> = keys.iter().copied().collect();
    assert_eq!(got, want, "{what}: keys");
    m
}

fn uint(m: &Map<String, Value>, k: &str) -> u64 {
    let v = &m[k];
    assert!(v.is_u64(), "{k} is not an unsigned integer: {v}");
    v.as_u64().unwrap()
}

fn rank(v: &Value, what: &str) -> (u32, u32) {
    let m = obj(v, &["tp", "pp"], what);
    (uint(m, "tp") as u32, uint(m, "pp") as u32)
}

fn region(v: &Value, kinds: &[&str]) -> (u32, String) {
    let m = obj(v, &["layer", "kind"], "region");
    let kind = m["kind"].as_str().unwrap_or_else(|| panic!("kind is not a string: {v}")).to_string();
    assert!(kinds.contains(&kind.as_str()), "kind {kind} not one of {kinds:?}");
    (uint(m, "layer") as u32, kind)
}

/// Runs `cfg` and checks everything; returns the number of ops.
fn check(cfg: &Cfg) -> u64 {
    let out = cfg.run();
    let ctx = cfg.args().join(" ");
    assert!(out.status.success(), "{ctx}: exit {:?}, stderr {}", out.status, String::from_utf8_lossy(&out.stderr));
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{ctx}: bad JSON: {e}"));
    let top = obj(&doc, &["transfers", "expected_senders"], "top level");

    // expected_senders: every decode rank, SEMANTICS §5 order and content.
    let es = top["expected_senders"].as_object().expect("expected_senders is an object");
    let mut want_keys = BTreeSet::new();
    for dpp in 0..cfg.pp_d {
        for d in 0..cfg.d {
            let key = format!("{d}/{dpp}");
            let got: Vec<String> = es
                .get(&key)
                .unwrap_or_else(|| panic!("{ctx}: expected_senders lacks {key}"))
                .as_array()
                .unwrap_or_else(|| panic!("{ctx}: expected_senders[{key}] is not an array"))
                .iter()
                .map(|s| s.as_str().expect("sender key is a string").to_string())
                .collect();
            assert_eq!(got, cfg.expected(d, dpp), "{ctx}: expected_senders[{key}]");
            want_keys.insert(key);
        }
    }
    assert_eq!(es.keys().cloned().collect::<BTreeSet<_>>(), want_keys, "{ctx}: expected_senders keys");

    // Destination bitmaps per (decode tp, decode pp, local layer, kind).
    let dst_stage_layers = cfg.layers / cfg.pp_d;
    let src_stage_layers = cfg.layers / cfg.pp_p;
    let mut bitmaps: HashMap<(u32, u32, u32, &str), Vec<bool>> = HashMap::new();
    let mut received: HashMap<(u32, u32), u64> = HashMap::new();
    let mut seen_pairs = BTreeSet::new();
    let mut ops_total = 0;
    let transfers = top["transfers"].as_array().expect("transfers is an array");
    for t in transfers {
        let tm = obj(t, &["src", "dst", "ops"], "transfer");
        let (sp, spp) = rank(&tm["src"], "src");
        let (dt, dpp) = rank(&tm["dst"], "dst");
        assert!(seen_pairs.insert(((sp, spp), (dt, dpp))), "{ctx}: pair {sp}/{spp} -> {dt}/{dpp} twice");
        for op in tm["ops"].as_array().expect("ops is an array") {
            ops_total += 1;
            let m = obj(
                op,
                &["src_region", "dst_region", "src_offset", "dst_offset", "len", "count", "src_stride", "dst_stride"],
                "op",
            );
            let (sl, skind) = region(&m["src_region"], cfg.kinds());
            let (dl, dkind) = region(&m["dst_region"], cfg.kinds());
            assert_eq!(skind, dkind, "{ctx}: op copies {skind} into {dkind}");
            assert!(sl < src_stage_layers, "{ctx}: source layer {sl} beyond the stage's {src_stage_layers}");
            assert!(dl < dst_stage_layers, "{ctx}: destination layer {dl} beyond the stage's {dst_stage_layers}");
            let (so, do_, len, count) =
                (uint(m, "src_offset"), uint(m, "dst_offset"), uint(m, "len"), uint(m, "count"));
            let (ss, ds) = (uint(m, "src_stride"), uint(m, "dst_stride"));
            assert!(len > 0 && count > 0, "{ctx}: empty op {op}");
            if count == 1 {
                assert!(ss == len && ds == len, "{ctx}: count 1 op must carry strides equal to len: {op}");
            }
            let kind: &'static str = cfg.kinds().iter().find(|k| **k == skind).unwrap();
            let sg = Geom::new(cfg, cfg.p, sp, kind, &cfg.src);
            let dg = Geom::new(cfg, cfg.d, dt, kind, &cfg.dst);
            let src_global = spp * src_stage_layers + sl;
            let dst_global = dpp * dst_stage_layers + dl;
            let bm = bitmaps.entry((dt, dpp, dl, kind)).or_insert_with(|| vec![false; dg.pool_bytes as usize]);
            for i in 0..count {
                for j in 0..len {
                    let (s, d) = (so + i * ss + j, do_ + i * ds + j);
                    let si = sg.ident(src_global, s).unwrap_or_else(|e| panic!("{ctx}: source {e} (op {op})"));
                    let di = dg.ident(dst_global, d).unwrap_or_else(|e| panic!("{ctx}: destination {e} (op {op})"));
                    assert_eq!(si, di, "{ctx}: byte {s} of the source lands on byte {d} (op {op})");
                    assert!(!bm[d as usize], "{ctx}: destination byte {d} of {dt}/{dpp} L{dl} {kind} written twice");
                    bm[d as usize] = true;
                }
            }
            *received.entry((dt, dpp)).or_default() += len * count;
        }
    }
    assert_eq!(seen_pairs, cfg.pairs(), "{ctx}: the set of (prefill, decode) pairs");

    // Every destination byte of the request, exactly once (bytes outside it were rejected above).
    let pages = cfg.dst.len() as u64;
    for dpp in 0..cfg.pp_d {
        for dt in 0..cfg.d {
            for dl in 0..dst_stage_layers {
                for &kind in cfg.kinds() {
                    let dg = Geom::new(cfg, cfg.d, dt, kind, &cfg.dst);
                    let Some(bm) = bitmaps.get(&(dt, dpp, dl, kind)) else {
                        assert!(pages == 0, "{ctx}: decode {dt}/{dpp} L{dl} {kind} receives nothing");
                        continue;
                    };
                    for (off, w) in bm.iter().enumerate() {
                        let inside = dg.ident(0, off as u64).is_ok();
                        assert_eq!(*w, inside, "{ctx}: decode {dt}/{dpp} L{dl} {kind} byte {off}");
                    }
                }
            }
            // SEMANTICS §4: layers * pages * S * (hd*hk + hd*hv), or layers * pages * S * latent.
            let formula = u64::from(dst_stage_layers)
                * pages
                * u64::from(cfg.s)
                * cfg.kinds().iter().map(|k| u64::from(cfg.local(cfg.d)) * cfg.head_bytes(k)).sum::<u64>();
            assert_eq!(received.get(&(dt, dpp)).copied().unwrap_or(0), formula, "{ctx}: bytes into {dt}/{dpp}");
        }
    }
    ops_total
}

const TPS: [u32; 6] = [1, 2, 3, 4, 6, 8];
const HS: [u32; 6] = [1, 2, 4, 6, 8, 12];

fn divides(h: u32, t: u32) -> bool {
    if t <= h {
        h % t == 0
    } else {
        t % h == 0
    }
}

fn tp_pairs() -> Vec<(u32, u32)> {
    TPS.iter().flat_map(|&p| TPS.iter().map(move |&d| (p, d))).filter(|(p, d)| p.max(d) % p.min(d) == 0).collect()
}

/// Page lists: contiguous (one run), or shuffled with a run of three consecutive pairs inside.
fn pages(shuffled: bool) -> (Vec<u32>, Vec<u32>) {
    if shuffled {
        (vec![7, 3, 4, 5, 0, 9], vec![2, 10, 11, 12, 6, 0])
    } else {
        (vec![2, 3, 4, 5], vec![5, 6, 7, 8])
    }
}

fn base(p: u32, d: u32, h: Option<u32>) -> Cfg {
    let (src, dst) = pages(false);
    Cfg {
        p,
        d,
        h,
        hdk: 4,
        hdv: 4,
        latent: 9,
        dtype: 2,
        layers: 2,
        pp_p: 1,
        pp_d: 1,
        s: 16,
        layout: Layout::Nhd,
        src,
        dst,
    }
}

/// Runs configs on a few threads (each is a process spawn plus a byte-level check).
fn check_all(cfgs: Vec<Cfg>) -> usize {
    let n = cfgs.len();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()).min(4);
    let chunks: Vec<Vec<Cfg>> = (0..threads).map(|i| cfgs.iter().skip(i).step_by(threads).cloned().collect()).collect();
    std::thread::scope(|s| {
        let hs: Vec<_> = chunks.iter().map(|c| s.spawn(move || c.iter().map(check).sum::<u64>())).collect();
        for h in hs {
            h.join().expect("a config failed (see the panic above)");
        }
    });
    n
}

/// Every (P, D, H) of the matrix, in both layouts, page sizes 1 and 16, hk == hv and hk != hv,
/// contiguous and shuffled pages: the full product.
#[test]
fn gqa_matrix() {
    let mut cfgs = Vec::new();
    let mut triples = 0;
    for (p, d) in tp_pairs() {
        for h in HS.into_iter().filter(|h| divides(*h, p) && divides(*h, d)) {
            triples += 1;
            for layout in [Layout::Nhd, Layout::Hnd] {
                for s in [1, 16] {
                    for hdv in [4, 6] {
                        for shuffled in [false, true] {
                            let (src, dst) = pages(shuffled);
                            cfgs.push(Cfg { layout, s, hdv, src, dst, ..base(p, d, Some(h)) });
                        }
                    }
                }
            }
        }
    }
    assert_eq!(triples, 112, "the (P, D, H) matrix");
    let n = check_all(cfgs);
    eprintln!("checked {n} GQA configurations");
}

/// MLA over every (P, D), both layouts, both page sizes, shuffled pages.
#[test]
fn mla_matrix() {
    let mut cfgs = Vec::new();
    for (p, d) in tp_pairs() {
        for layout in [Layout::Nhd, Layout::Hnd] {
            for s in [1, 16] {
                let (src, dst) = pages(true);
                cfgs.push(Cfg { layout, s, src, dst, ..base(p, d, None) });
            }
        }
    }
    check_all(cfgs);
}

/// Prefill PP 2 and 4 into decode PP 1 and into equal PP, for a spread of (P, D, H), GQA and MLA.
#[test]
fn pipeline_parallel() {
    let mut cfgs = Vec::new();
    let shapes = [
        (1, 1, Some(1)),
        (2, 4, Some(4)),
        (4, 2, Some(8)),
        (8, 2, Some(2)),
        (2, 8, Some(4)),
        (3, 6, Some(12)),
        (6, 2, Some(6)),
        (8, 8, Some(8)),
        (4, 1, None),
        (1, 4, None),
    ];
    for (p, d, h) in shapes {
        for pp_p in [2, 4] {
            for pp_d in [1, pp_p] {
                for layout in [Layout::Nhd, Layout::Hnd] {
                    let (src, dst) = pages(true);
                    cfgs.push(Cfg { layers: 8, pp_p, pp_d, layout, hdv: 6, s: 4, src, dst, ..base(p, d, h) });
                }
            }
        }
    }
    check_all(cfgs);
}

/// Real model shapes with bigger heads: Llama-3-70B-like (H=8, 128) and a 12-head model, P > D and P < D.
#[test]
fn realistic_head_dims() {
    let mut cfgs = Vec::new();
    for (p, d, h) in [(8, 2, 8), (2, 8, 8), (4, 4, 8), (6, 3, 12)] {
        for layout in [Layout::Nhd, Layout::Hnd] {
            let (src, dst) = pages(true);
            cfgs.push(Cfg { hdk: 128, hdv: 128, layout, src, dst, ..base(p, d, Some(h)) });
        }
    }
    check_all(cfgs);
}

/// An empty chunk is a valid plan: every pair appears with no ops, every sender still expected.
#[test]
fn empty_chunk() {
    let out = Command::new(BIN)
        .args(["plan", "--prefill-tp", "4", "--decode-tp", "2", "--kv-heads", "8", "--head-dim", "4"])
        .args(["--layers", "2", "--page-size", "16", "--dtype-bytes", "2", "--src-pages=", "--dst-pages="])
        .args(["--format", "json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    let transfers = doc["transfers"].as_array().unwrap();
    assert_eq!(transfers.len(), 4);
    assert!(transfers.iter().all(|t| t["ops"].as_array().unwrap().is_empty()));
    assert_eq!(doc["expected_senders"]["1/0"], serde_json::json!(["tp2.pp0", "tp3.pp0"]));
}

/// `a-b` in a page list is the inclusive range; the plan equals the one for the spelled-out list.
#[test]
fn page_ranges() {
    let run = |src: &str, dst: &str| {
        let out = Command::new(BIN)
            .args(["plan", "--prefill-tp", "2", "--decode-tp", "4", "--kv-heads", "8", "--head-dim", "4"])
            .args(["--layers", "2", "--page-size", "4", "--dtype-bytes", "2", "--format", "json"])
            .args(["--src-pages", src, "--dst-pages", dst])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    };
    assert_eq!(run("0-3,9", "4-7,1"), run("0,1,2,3,9", "4,5,6,7,1"));
}

/// The table's totals agree with the JSON's op count, and it lists every decode rank's senders.
#[test]
fn table_matches_json() {
    let cfg = Cfg { layout: Layout::Hnd, hdv: 6, ..base(8, 2, Some(2)) };
    let json_ops = check(&cfg);
    let args: Vec<String> = cfg.args().into_iter().filter(|a| a != "--format" && a != "json").collect();
    let out = Command::new(BIN).args(&args).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let totals = text.lines().find(|l| l.starts_with("totals:")).expect("a totals line");
    assert!(totals.contains(&format!(", {json_ops} op(s),")), "{totals} vs {json_ops} ops in JSON");
    assert!(text.contains("decode 0/0:") && text.contains("tp0.pp0, tp1.pp0, tp2.pp0, tp3.pp0"), "{text}");
    assert!(text.contains("decode 1/0:") && text.contains("tp4.pp0, tp5.pp0, tp6.pp0, tp7.pp0"), "{text}");
    // Deduplicated replicas (P=8 > H=2) are listed as notifying only.
    assert!(text.contains("prefill 1/0 (key tp1.pp0) -> decode 0/0: no bytes"), "{text}");
}

fn expect_error(args: &[&str], needle: &str) {
    let mut all = vec!["plan"];
    all.extend_from_slice(args);
    let out = Command::new(BIN).args(&all).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{all:?} succeeded; stdout {}", String::from_utf8_lossy(&out.stdout));
    assert!(stderr.contains(needle), "{all:?}: stderr {stderr:?} lacks {needle:?}");
    assert!(out.stdout.is_empty(), "{all:?}: an invalid configuration printed a plan");
}

const GOOD: [&str; 10] =
    ["--layers", "4", "--page-size", "16", "--dtype-bytes", "2", "--src-pages", "0,1,2", "--dst-pages", "3,4,5"];

fn with(extra: &[&'static str]) -> Vec<&'static str> {
    let mut v = GOOD.to_vec();
    v.extend_from_slice(extra);
    v
}

#[test]
fn invalid_configurations() {
    let gqa = ["--kv-heads", "8", "--head-dim", "128"];
    // SEMANTICS §2: H=8 with TP 3 on either side.
    expect_error(
        &with(&[&["--prefill-tp", "3", "--decode-tp", "3"][..], &gqa].concat()),
        "prefill TP size 3 does not fit 8 KV heads",
    );
    expect_error(
        &with(&[&["--prefill-tp", "1", "--decode-tp", "3"][..], &gqa].concat()),
        "decode TP size 3 does not fit 8 KV heads",
    );
    // TP ratio not an integer.
    expect_error(
        &with(&[&["--prefill-tp", "4", "--decode-tp", "6", "--kv-heads", "12", "--head-dim", "64"][..]].concat()),
        "prefill TP 4 and decode TP 6: the larger must be a multiple of the smaller",
    );
    // Decode PP not in {1, prefill PP}.
    let six_layers =
        ["--layers", "6", "--page-size", "16", "--dtype-bytes", "2", "--src-pages", "0", "--dst-pages", "3"];
    expect_error(
        &[&["--prefill-tp", "2", "--decode-tp", "2", "--prefill-pp", "2", "--decode-pp", "3"][..], &gqa, &six_layers]
            .concat(),
        "decode PP 3 must be 1 or equal to prefill PP 2",
    );
    // Layers not divisible by PP.
    expect_error(
        &with(&[&["--prefill-tp", "2", "--decode-tp", "2", "--prefill-pp", "3"][..], &gqa].concat()),
        "prefill: 4 layers cannot be split evenly over PP 3",
    );
    // Zero sizes name the field.
    expect_error(
        &with(&[&["--prefill-tp", "0", "--decode-tp", "2"][..], &gqa].concat()),
        "prefill TP size is 0; it must be at least 1",
    );
    expect_error(
        &with(&[&["--prefill-tp", "1", "--decode-tp", "1", "--kv-heads", "8", "--head-dim", "0"][..]].concat()),
        "K head dim is 0",
    );
    // Page lists.
    let base_args = ["--prefill-tp", "2", "--decode-tp", "2", "--kv-heads", "8", "--head-dim", "128"];
    let common = ["--layers", "4", "--page-size", "16", "--dtype-bytes", "2"];
    expect_error(
        &[&base_args[..], &common, &["--src-pages", "0,1,2", "--dst-pages", "3,4"]].concat(),
        "source has 3 pages but destination has 2",
    );
    expect_error(
        &[&base_args[..], &common, &["--src-pages", "0,1,2", "--dst-pages", "3,4,3"]].concat(),
        "destination page 3 appears twice",
    );
    expect_error(&[&base_args[..], &common, &["--src-pages", "0,x", "--dst-pages", "3,4"]].concat(), "page `x`");
    expect_error(&[&base_args[..], &common, &["--src-pages", "5-2", "--dst-pages", "3,4"]].concat(), "is empty");
    // MLA needs its latent dim and takes no head geometry.
    expect_error(&[&["--prefill-tp", "2", "--decode-tp", "2", "--mla"][..], &GOOD].concat(), "--latent-dim");
    expect_error(
        &[&["--prefill-tp", "2", "--decode-tp", "2", "--mla", "--latent-dim", "576"][..], &gqa, &GOOD].concat(),
        "cannot be used with",
    );
    // GQA needs heads.
    expect_error(&[&["--prefill-tp", "2", "--decode-tp", "2", "--head-dim", "64"][..], &GOOD].concat(), "--kv-heads");
}
