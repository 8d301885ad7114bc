//! `kvxfer plan`: prints what every prefill rank writes into every decode rank for one request chunk.
//!
//! The table (default) is for people; `--format svg` draws the P x D head map ([`crate::svg`]);
//! `--format json` is a public interface documented in docs/cli.md:
//!
//! ```text
//! {"transfers":[{"src":{"tp":0,"pp":0},"dst":{"tp":0,"pp":0},"ops":[{"src_region":{"layer":0,"kind":"k"},
//!   "dst_region":{"layer":0,"kind":"k"},"src_offset":0,"dst_offset":0,"len":256,"count":16,
//!   "src_stride":512,"dst_stride":256}]}],"expected_senders":{"0/0":["tp0.pp0"]}}
//! ```
//!
//! One entry per communicating (prefill rank, decode rank) pair, in prefill rank order (stage-major,
//! then TP rank), including pairs that move no bytes (deduplicated replicas: they only notify).
//! Ops are expanded from the planner's lazy product and streamed, never collected in memory.

use std::fmt::Write as _;
use std::io::{self, Write};
use std::process::ExitCode;

use kvxfer_core::plan::{plan_chunk, ChunkPlan, PairPlan};
use kvxfer_core::{Attention, KvSpec, Layout, Side, SideSpec, Topology};
use serde::ser::{SerializeMap, SerializeStruct};
use serde::{Serialize, Serializer};

use crate::model::{Preset, StageLayersArgs};

/// Page layout as a command-line value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LayoutArg {
    /// Token-major `[pages * page_size, local heads, head_dim]` (SGLang's pool).
    Nhd,
    /// Head-major `[pages, local heads, page_size, head_dim]` (vLLM's layout).
    Hnd,
}

impl From<LayoutArg> for Layout {
    fn from(l: LayoutArg) -> Self {
        match l {
            LayoutArg::Nhd => Layout::Nhd,
            LayoutArg::Hnd => Layout::Hnd,
        }
    }
}

/// Output format of `kvxfer demo` and `kvxfer bench` (`kvxfer plan` has [`PlanFormat`], which adds SVG).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// A readable table.
    Table,
    /// One JSON document (see docs/cli.md).
    Json,
}

/// Output format of `kvxfer plan`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PlanFormat {
    /// A readable table per (prefill rank, decode rank) pair, with totals.
    Table,
    /// The documented JSON object (every op expanded).
    Json,
    /// The P x D head map as an SVG picture: ranks as boxes with their heads, one edge per pair
    /// that moves bytes, labelled with its heads and bytes.
    Svg,
}

/// A comma-separated page list; `a-b` stands for the pages `a..=b`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PageList(pub Vec<u32>);

/// Most pages one list may expand to (a range typo like `0-4000000000` should not eat the memory).
const MAX_PAGES: u64 = 1 << 26;

fn parse_page_list(s: &str) -> Result<PageList, String> {
    let mut out = Vec::new();
    let s = s.trim();
    if s.is_empty() {
        return Ok(PageList(out));
    }
    for item in s.split(',') {
        let item = item.trim();
        let num = |t: &str| {
            t.trim().parse::<u32>().map_err(|e| format!("page `{t}` in `{item}` is not a page index (0..2^32): {e}"))
        };
        match item.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if a > b {
                    return Err(format!("page range `{item}` is empty: write the lower page first"));
                }
                if out.len() as u64 + u64::from(b - a) + 1 > MAX_PAGES {
                    return Err(format!("page list expands to more than {MAX_PAGES} pages"));
                }
                out.extend(a..=b);
            }
            None => {
                if out.len() as u64 >= MAX_PAGES {
                    return Err(format!("page list expands to more than {MAX_PAGES} pages"));
                }
                out.push(num(item)?)
            }
        }
    }
    Ok(PageList(out))
}

/// `--page-size` with `--model` when not given (as `kvxfer demo`).
pub const MODEL_PAGE_SIZE: u32 = 16;
/// `--dtype-bytes` with `--model` when not given: the presets are bf16.
pub const MODEL_DTYPE_BYTES: u32 = 2;

/// Arguments of `kvxfer plan`.
#[derive(Debug, Clone, clap::Args)]
pub struct PlanArgs {
    /// Prefill attention TP size P.
    #[arg(long)]
    pub prefill_tp: u32,
    /// Decode attention TP size D.
    #[arg(long)]
    pub decode_tp: u32,
    /// A model preset for the KV shape (heads and head dims or the MLA latent, layers; bf16), as in
    /// `kvxfer demo`. Instead of --kv-heads/--head-dim/--v-head-dim/--mla/--latent-dim; --layers,
    /// --page-size [default 16] and --dtype-bytes [default 2] override the preset.
    #[arg(long, value_enum)]
    pub model: Option<Preset>,
    /// Total KV heads H of the model (num_key_value_heads). Not with --mla or --model.
    #[arg(long, required_unless_present_any = ["mla", "model"], conflicts_with_all = ["mla", "model"])]
    pub kv_heads: Option<u32>,
    /// Elements per K head. Not with --mla or --model.
    #[arg(long, required_unless_present_any = ["mla", "model"], conflicts_with_all = ["mla", "model"])]
    pub head_dim: Option<u32>,
    /// Elements per V head [default: --head-dim]. Not with --mla or --model.
    #[arg(long, conflicts_with_all = ["mla", "model"])]
    pub v_head_dim: Option<u32>,
    /// Layers of the model that carry KV (all stages together) [with --model: the preset's].
    #[arg(long, required_unless_present = "model")]
    pub layers: Option<u32>,
    /// Tokens per page [with --model: 16].
    #[arg(long, required_unless_present = "model")]
    pub page_size: Option<u32>,
    /// Bytes per element (2 for bf16/fp16, 1 for fp8) [with --model: 2].
    #[arg(long, required_unless_present = "model")]
    pub dtype_bytes: Option<u32>,
    /// Source (prefill) pages of the chunk, comma-separated; `a-b` means a..=b.
    #[arg(long, value_parser = parse_page_list, allow_hyphen_values = true)]
    pub src_pages: PageList,
    /// Destination (decode) pages, one per source page, same syntax.
    #[arg(long, value_parser = parse_page_list, allow_hyphen_values = true)]
    pub dst_pages: PageList,
    /// Prefill pipeline-parallel size.
    #[arg(long, default_value_t = 1)]
    pub prefill_pp: u32,
    /// Decode pipeline-parallel size (1 or the prefill PP size).
    #[arg(long, default_value_t = 1)]
    pub decode_pp: u32,
    /// Explicit per-stage layer counts (uneven pipeline stages).
    #[command(flatten)]
    pub stage_layers: StageLayersArgs,
    /// Page layout of both KV pools.
    #[arg(long, value_enum, default_value_t = LayoutArg::Nhd)]
    pub layout: LayoutArg,
    /// Multi-head latent attention: one latent per token per layer, identical on every TP rank. Not
    /// with --model (the preset says whether the model uses MLA).
    #[arg(long, requires = "latent_dim", conflicts_with = "model")]
    pub mla: bool,
    /// Elements of the MLA latent (kv_lora_rank + qk_rope_head_dim, 576 for DeepSeek-V3).
    #[arg(long, requires = "mla")]
    pub latent_dim: Option<u32>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = PlanFormat::Table)]
    pub format: PlanFormat,
    /// Table only: most ops printed per pair (0 prints all); totals always count every op.
    #[arg(long, default_value_t = 32)]
    pub max_rows: u64,
}

impl PlanArgs {
    /// The KV spec both sides share: the preset's shape with `--model`, else the explicit flags.
    pub fn kv_spec(&self) -> KvSpec {
        if let Some(preset) = self.model {
            let (attention, layers) = preset.shape();
            return KvSpec {
                attention,
                layers: self.layers.unwrap_or(layers),
                dtype_bytes: self.dtype_bytes.unwrap_or(MODEL_DTYPE_BYTES),
                page_size: self.page_size.unwrap_or(MODEL_PAGE_SIZE),
                layout: self.layout.into(),
            };
        }
        let attention = match (self.mla, self.latent_dim) {
            (true, Some(latent_dim)) => Attention::Mla { latent_dim },
            // clap enforces kv_heads/head_dim without --mla and latent_dim with it; 0 is rejected by the
            // topology with a message naming the field, should this be built some other way.
            (true, None) => Attention::Mla { latent_dim: 0 },
            (false, _) => {
                let head_dim_k = self.head_dim.unwrap_or(0);
                Attention::Gqa {
                    kv_heads: self.kv_heads.unwrap_or(0),
                    head_dim_k,
                    head_dim_v: self.v_head_dim.unwrap_or(head_dim_k),
                }
            }
        };
        // clap requires these without --model; 0 is rejected by the topology, naming the field.
        KvSpec {
            attention,
            layers: self.layers.unwrap_or(0),
            dtype_bytes: self.dtype_bytes.unwrap_or(0),
            page_size: self.page_size.unwrap_or(0),
            layout: self.layout.into(),
        }
    }

    /// The validated topology (the core's errors on an invalid configuration).
    pub fn topology(&self) -> Result<Topology, kvxfer_core::ConfigError> {
        let kv = self.kv_spec();
        let prefill = SideSpec { kv, parallel: self.stage_layers.prefill(self.prefill_tp, self.prefill_pp) };
        let decode =
            SideSpec { kv, parallel: self.stage_layers.decode(self.decode_tp, self.decode_pp, self.prefill_pp) };
        Topology::new(&prefill, &decode)
    }
}

/// Runs `kvxfer plan`: prints the plan on stdout, or the configuration error on stderr with exit code 1.
pub fn run(args: &PlanArgs) -> ExitCode {
    let topo = match args.topology() {
        Ok(t) => t,
        Err(e) => return fail(&e),
    };
    let plan = match plan_chunk(&topo, &args.src_pages.0, &args.dst_pages.0) {
        Ok(p) => p,
        Err(e) => return fail(&e),
    };
    let stdout = io::stdout();
    let mut out = io::BufWriter::with_capacity(1 << 16, stdout.lock());
    let res = match args.format {
        PlanFormat::Json => write_json(&mut out, &topo, &plan),
        PlanFormat::Table => write_table(&mut out, &topo, &plan, args),
        PlanFormat::Svg => {
            out.write_all(crate::svg::plan_svg(&topo, &plan, args.model.map(Preset::name).as_deref()).as_bytes())
        }
    }
    .and_then(|()| out.flush());
    match res {
        Ok(()) => ExitCode::SUCCESS,
        // `kvxfer plan ... | head`: the reader has what it wanted.
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: cannot write the plan to stdout: {e}");
            ExitCode::FAILURE
        }
    }
}

fn fail(e: &dyn std::error::Error) -> ExitCode {
    eprintln!("error: {e}");
    ExitCode::FAILURE
}

/// Writes the plan as the documented JSON object, streaming every op.
pub fn write_json(out: &mut impl Write, topo: &Topology, plan: &ChunkPlan) -> io::Result<()> {
    let doc = JsonPlan { topo, plan };
    serde_json::to_writer(&mut *out, &doc).map_err(io::Error::from)?;
    out.write_all(b"\n")
}

struct JsonPlan<'a> {
    topo: &'a Topology,
    plan: &'a ChunkPlan,
}

impl Serialize for JsonPlan<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("Plan", 2)?;
        st.serialize_field("transfers", &Transfers(&self.plan.pairs))?;
        st.serialize_field("expected_senders", &ExpectedSenders(self.topo))?;
        st.end()
    }
}

struct Transfers<'a>(&'a [PairPlan]);

impl Serialize for Transfers<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(Transfer))
    }
}

struct Transfer<'a>(&'a PairPlan);

impl Serialize for Transfer<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("Transfer", 3)?;
        st.serialize_field("src", &self.0.src)?;
        st.serialize_field("dst", &self.0.dst)?;
        st.serialize_field("ops", &Ops(self.0))?;
        st.end()
    }
}

struct Ops<'a>(&'a PairPlan);

impl Serialize for Ops<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.ops())
    }
}

/// `"<decode tp>/<decode pp>"` to sender keys, decode ranks in topology order (stage-major, then TP).
struct ExpectedSenders<'a>(&'a Topology);

impl Serialize for ExpectedSenders<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let ranks = self.0.ranks(Side::Decode);
        let mut m = s.serialize_map(Some(ranks.len()))?;
        for d in ranks {
            let keys: Vec<String> = self.0.expected_senders(d).iter().map(ToString::to_string).collect();
            m.serialize_entry(&d.to_string(), &keys)?;
        }
        m.end()
    }
}

/// `b` bytes in binary units with two decimals (`2.50 MiB`; bytes below 1 KiB exactly: `512 B`).
pub(crate) fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// The per-stage layer counts of an uneven side joined with `sep`; `None` when every stage holds the same.
fn stage_layers(topo: &Topology, side: Side, sep: &str) -> Option<String> {
    let counts = topo.layer_partition(side);
    if counts.windows(2).all(|w| w[0] == w[1]) {
        return None;
    }
    Some(counts.iter().map(u32::to_string).collect::<Vec<_>>().join(sep))
}

/// One line naming the configuration: both sides' TP x PP (and uneven stage layers), the attention
/// shape, layers, dtype, page size, layout.
pub(crate) fn describe(topo: &Topology) -> String {
    let kv = topo.kv();
    let p = topo.parallel(Side::Prefill);
    let d = topo.parallel(Side::Decode);
    let attn = match kv.attention {
        Attention::Gqa { kv_heads, head_dim_k, head_dim_v } if head_dim_k == head_dim_v => {
            format!("H={kv_heads} head_dim={head_dim_k}")
        }
        Attention::Gqa { kv_heads, head_dim_k, head_dim_v } => {
            format!("H={kv_heads} head_dim k={head_dim_k} v={head_dim_v}")
        }
        Attention::Mla { latent_dim } => format!("MLA latent_dim={latent_dim}"),
    };
    // Uneven stages: each stage's layer count after the PP size.
    let stages = |side: Side| match stage_layers(topo, side, "+") {
        Some(counts) => format!(" (layers {counts})"),
        None => String::new(),
    };
    format!(
        "prefill TP {} x PP {}{} -> decode TP {} x PP {}{}; {attn}; {} layers; dtype {} B; page size {}; layout {}",
        p.tp,
        p.pp,
        stages(Side::Prefill),
        d.tp,
        d.pp,
        stages(Side::Decode),
        kv.layers,
        kv.dtype_bytes,
        kv.page_size,
        kv.layout
    )
}

/// Writes the readable table: a header, each pair with its head slice and ops, totals, expected senders.
pub fn write_table(out: &mut impl Write, topo: &Topology, plan: &ChunkPlan, args: &PlanArgs) -> io::Result<()> {
    let kv = topo.kv();
    let pages: u64 = plan.runs.iter().map(|r| u64::from(r.len)).sum();
    writeln!(out, "{}", describe(topo))?;
    writeln!(
        out,
        "chunk: {pages} pages ({} tokens) in {} run(s) of consecutive pages; {} layer(s) per prefill stage",
        pages * u64::from(kv.page_size),
        plan.runs.len(),
        stage_layers(topo, Side::Prefill, "/").unwrap_or_else(|| topo.stage_layers(Side::Prefill, 0).to_string())
    )?;
    writeln!(
        out,
        "local heads: prefill {}, decode {}; offsets are bytes within one rank's buffer for (layer, kind)",
        topo.local_heads(Side::Prefill),
        topo.local_heads(Side::Decode)
    )?;
    let header = format!(
        "    {:<10} {:<10} {:>14} {:>14} {:>10} {:>8} {:>11} {:>11}",
        "src", "dst", "src_offset", "dst_offset", "len", "count", "src_stride", "dst_stride"
    );
    for pair in &plan.pairs {
        writeln!(out)?;
        let mut line = format!("prefill {} (key {}) -> decode {}: ", pair.src, pair.key, pair.dst);
        match pair.slices.first() {
            None => line.push_str("no bytes (its heads are written by a lower-ranked replica); notifies only"),
            Some(s) => {
                let _ = write!(
                    line,
                    "{} head(s), source slot {}, destination slot {}; {} op(s), {}",
                    s.n,
                    s.src_slot,
                    s.dst_slot,
                    pair.op_count(),
                    human_bytes(pair.bytes())
                );
            }
        }
        writeln!(out, "{line}")?;
        if !pair.writes() {
            continue;
        }
        writeln!(out, "{header}")?;
        let limit = if args.max_rows == 0 { u64::MAX } else { args.max_rows };
        for op in pair.ops().take(limit.min(pair.op_count()) as usize) {
            writeln!(
                out,
                "    {:<10} {:<10} {:>14} {:>14} {:>10} {:>8} {:>11} {:>11}",
                format!("L{} {}", op.src_region.layer, op.src_region.kind),
                format!("L{} {}", op.dst_region.layer, op.dst_region.kind),
                op.src_offset,
                op.dst_offset,
                op.len,
                op.count,
                op.src_stride,
                op.dst_stride
            )?;
        }
        if pair.op_count() > limit {
            writeln!(out, "    ... {} more op(s) (--max-rows 0 prints all)", pair.op_count() - limit)?;
        }
    }
    writeln!(out)?;
    let total_bytes: u64 = plan.pairs.iter().map(PairPlan::bytes).sum();
    let writing = plan.pairs.iter().filter(|p| p.writes()).count();
    // SGLang posts one op per token per layer per K/V for every pair (it also has replicas re-send).
    let pair_layers: u64 = plan.pairs.iter().map(|p| u64::from(p.layers)).sum();
    let per_token: u64 = pair_layers * pages * u64::from(kv.page_size) * kv.kinds().len() as u64;
    writeln!(
        out,
        "totals: {} pair(s) ({writing} moving bytes), {} op(s), {}; one op per token per layer per kind would be {per_token}",
        plan.pairs.len(),
        plan.op_count(),
        human_bytes(total_bytes),
    )?;
    writeln!(out, "per decode rank (bytes received; expected senders, each must notify):")?;
    for d in topo.ranks(Side::Decode) {
        let recv: u64 = plan.pairs.iter().filter(|p| p.dst == d).map(PairPlan::bytes).sum();
        let keys: Vec<String> = topo.expected_senders(d).iter().map(ToString::to_string).collect();
        writeln!(out, "  decode {d}: {} from {} sender(s): {}", human_bytes(recv), keys.len(), keys.join(", "))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        a: PlanArgs,
    }

    fn parse(args: &[&str]) -> Result<PlanArgs, String> {
        let pages = ["--src-pages", "0-3", "--dst-pages", "4-7", "--prefill-tp", "8", "--decode-tp", "2"];
        Cli::try_parse_from(std::iter::once("plan").chain(pages).chain(args.iter().copied()))
            .map(|c| c.a)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn model_presets_give_the_shape_and_flags_override_the_rest() {
        let a = parse(&["--model", "llama3-70b"]).unwrap();
        let kv = a.kv_spec();
        assert_eq!(kv.attention, Attention::Gqa { kv_heads: 8, head_dim_k: 128, head_dim_v: 128 });
        assert_eq!((kv.layers, kv.page_size, kv.dtype_bytes), (80, MODEL_PAGE_SIZE, MODEL_DTYPE_BYTES));
        let a = parse(&["--model", "deepseek-v3", "--layers", "4", "--page-size", "64", "--dtype-bytes", "1"]).unwrap();
        let kv = a.kv_spec();
        assert_eq!(kv.attention, Attention::Mla { latent_dim: 576 });
        assert_eq!((kv.layers, kv.page_size, kv.dtype_bytes), (4, 64, 1));
        // The preset and the model shape flags exclude each other, by name.
        for shape in
            [&["--kv-heads", "8"][..], &["--head-dim", "64"], &["--v-head-dim", "64"], &["--mla", "--latent-dim", "8"]]
        {
            let e = parse(&[&["--model", "llama3-8b"][..], shape].concat()).unwrap_err();
            assert!(e.contains("cannot be used with") && e.contains("--model"), "{shape:?}: {e}");
        }
        // Without --model the explicit shape stays required, as before.
        let e = parse(&["--kv-heads", "8", "--head-dim", "128"]).unwrap_err();
        assert!(e.contains("--layers") && e.contains("--page-size") && e.contains("--dtype-bytes"), "{e}");
        let a = parse(&[
            "--kv-heads",
            "8",
            "--head-dim",
            "128",
            "--layers",
            "2",
            "--page-size",
            "16",
            "--dtype-bytes",
            "2",
        ])
        .unwrap();
        assert_eq!(a.topology().unwrap().kv().layers, 2);
        assert_eq!(a.format, PlanFormat::Table);
        assert_eq!(parse(&["--model", "qwen3-8b", "--format", "svg"]).unwrap().format, PlanFormat::Svg);
    }
}
