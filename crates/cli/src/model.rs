//! Model presets (shapes from MODELS.md) and the workload arguments `demo`, `worker` and `bench` share.

use std::collections::BTreeMap;
use std::time::Duration;

use kvxfer_core::{Attention, KvSpec, LayerPartition, NotifyStyle, Parallel, SideSpec, Topology};

use crate::plan::LayoutArg;

/// Named real model shapes (bf16).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Preset {
    /// Llama 3 8B: 32 layers, 8 KV heads, head_dim 128 (128 KiB of KV per token).
    #[value(name = "llama3-8b")]
    Llama3_8b,
    /// Llama 3 70B: 80 layers, 8 KV heads, head_dim 128 (320 KiB per token).
    #[value(name = "llama3-70b")]
    Llama3_70b,
    /// Qwen3 8B: 36 layers, 8 KV heads, head_dim 128.
    #[value(name = "qwen3-8b")]
    Qwen3_8b,
    /// Qwen3 32B: 64 layers, 8 KV heads, head_dim 128 (256 KiB per token).
    #[value(name = "qwen3-32b")]
    Qwen3_32b,
    /// A Qwen3.5-like hybrid (qwen3-next-80b): 12 full-attention KV layers, 2 KV heads, head_dim 256.
    #[value(name = "qwen3.5")]
    Qwen35,
    /// gpt-oss-120b: 36 layers, 8 KV heads, head_dim 64.
    #[value(name = "gpt-oss-120b")]
    GptOss120b,
    /// DeepSeek-V3: MLA, 61 layers, latent 512 + rope 64 = 576.
    #[value(name = "deepseek-v3")]
    DeepseekV3,
}

impl Preset {
    /// (attention, layers) of the preset.
    pub fn shape(self) -> (Attention, u32) {
        let gqa = |h, d| Attention::Gqa { kv_heads: h, head_dim_k: d, head_dim_v: d };
        match self {
            Preset::Llama3_8b => (gqa(8, 128), 32),
            Preset::Llama3_70b => (gqa(8, 128), 80),
            Preset::Qwen3_8b => (gqa(8, 128), 36),
            Preset::Qwen3_32b => (gqa(8, 128), 64),
            Preset::Qwen35 => (gqa(2, 256), 12),
            Preset::GptOss120b => (gqa(8, 64), 36),
            Preset::DeepseekV3 => (Attention::Mla { latent_dim: 576 }, 61),
        }
    }

    /// The preset's command-line name.
    pub fn name(self) -> String {
        clap::ValueEnum::to_possible_value(&self).map(|v| v.get_name().to_owned()).unwrap_or_default()
    }
}

/// Notification style as a command-line value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NotifyArg {
    /// NIXL-like: the notification rides with the data.
    Attached,
    /// Mooncake-like: a status message after the writes completed.
    OutOfBand,
}

impl From<NotifyArg> for NotifyStyle {
    fn from(n: NotifyArg) -> Self {
        match n {
            NotifyArg::Attached => NotifyStyle::Attached,
            NotifyArg::OutOfBand => NotifyStyle::OutOfBand,
        }
    }
}

/// Longest duration any flag takes, in seconds (one day).
pub const MAX_SECONDS: f64 = 86_400.0;

/// Parses a duration in seconds: a finite number in (0, [`MAX_SECONDS`]]. NaN, infinities, zero,
/// negative and absurdly large values are refused with the range in the message (instead of a panic
/// converting them to a `Duration`, or a run that ends at once).
pub fn parse_seconds(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= MAX_SECONDS => Ok(v),
        _ => Err(format!("`{s}` is not a number of seconds in (0, {MAX_SECONDS}]")),
    }
}

/// Parses a number of seconds in [0, 86400] (0: off).
pub fn parse_seconds_or_zero(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(0.0) => Ok(0.0),
        _ => parse_seconds(s).map_err(|_| format!("`{s}` is not a number of seconds in [0, {MAX_SECONDS}]")),
    }
}

/// Parses `key=value`.
pub fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .ok_or_else(|| format!("`{s}` is not key=value"))
}

/// Parses per-stage layer counts, comma-separated (`31,30`), into a [`LayerPartition`]. Whether they fit
/// the model and the PP size is checked with the topology (the core's errors name the numbers).
pub fn parse_stage_layers(s: &str) -> Result<LayerPartition, String> {
    let counts = s
        .split(',')
        .map(|t| {
            let t = t.trim();
            t.parse::<u32>().map_err(|e| format!("layer count `{t}` in `{s}` is not a number of layers: {e}"))
        })
        .collect::<Result<Vec<u32>, String>>()?;
    LayerPartition::new(&counts).map_err(|e| e.to_string())
}

/// Explicit per-stage layer counts of the two pipelines (uneven stages, SEMANTICS §1). Shared by the
/// workload flags and `kvxfer plan`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::Args)]
pub struct StageLayersArgs {
    /// Layers of each prefill pipeline stage, comma-separated, one count per stage (as many as
    /// --prefill-pp), each at least 1, summing to the layer count: e.g. `31,30` for 61 layers on
    /// --prefill-pp 2. Default: the layers split evenly over the stages (a remainder is refused).
    #[arg(long, value_name = "L0,L1,..", value_parser = parse_stage_layers)]
    pub prefill_layers: Option<LayerPartition>,
    /// Layers of each decode pipeline stage, same form. With --decode-pp equal to --prefill-pp the two
    /// partitions must be identical, and this defaults to --prefill-layers; with --decode-pp 1 the decode
    /// ranks hold every layer.
    #[arg(long, value_name = "L0,L1,..", value_parser = parse_stage_layers)]
    pub decode_layers: Option<LayerPartition>,
}

impl StageLayersArgs {
    /// The prefill side's parallel config.
    pub fn prefill(&self, tp: u32, pp: u32) -> Parallel {
        Parallel { layer_partition: self.prefill_layers, ..Parallel::new(tp, pp) }
    }

    /// The decode side's parallel config: `--decode-layers`, or with decode PP equal to prefill PP (> 1)
    /// the prefill partition (the only one that fits).
    pub fn decode(&self, tp: u32, pp: u32, prefill_pp: u32) -> Parallel {
        let inherited = if pp == prefill_pp && pp > 1 { self.prefill_layers } else { None };
        Parallel { layer_partition: self.decode_layers.or(inherited), ..Parallel::new(tp, pp) }
    }

    /// The flags that reproduce these partitions.
    pub fn to_args(self) -> Vec<String> {
        let list = |p: &LayerPartition| p.as_slice().iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        let mut a = Vec::new();
        if let Some(p) = &self.prefill_layers {
            a.extend(["--prefill-layers".to_owned(), list(p)]);
        }
        if let Some(p) = &self.decode_layers {
            a.extend(["--decode-layers".to_owned(), list(p)]);
        }
        a
    }
}

/// The model shape, the two sides' parallel configs and the request stream. Every worker of one
/// run must get the same values (`kvxfer demo` passes them on; by hand, pass the same flags).
#[derive(Debug, Clone, clap::Args)]
pub struct Workload {
    /// Model shape.
    #[arg(long, value_enum, default_value = "llama3-8b")]
    pub model: Preset,
    /// Override the preset's layer count (quick runs of big models).
    #[arg(long)]
    pub layers: Option<u32>,
    /// Prefill attention TP size.
    #[arg(long, default_value_t = 2)]
    pub prefill_tp: u32,
    /// Decode attention TP size.
    #[arg(long, default_value_t = 1)]
    pub decode_tp: u32,
    /// Prefill pipeline stages.
    #[arg(long, default_value_t = 1)]
    pub prefill_pp: u32,
    /// Decode pipeline stages (1 or equal to --prefill-pp).
    #[arg(long, default_value_t = 1)]
    pub decode_pp: u32,
    /// Explicit per-stage layer counts (uneven pipeline stages).
    #[command(flatten)]
    pub stage_layers: StageLayersArgs,
    /// Page layout of both pools.
    #[arg(long, value_enum, default_value = "nhd")]
    pub layout: LayoutArg,
    /// Tokens per page.
    #[arg(long, default_value_t = 16)]
    pub page_size: u32,
    /// Bytes per element (2 = bf16).
    #[arg(long, default_value_t = 2)]
    pub dtype_bytes: u32,
    /// Tokens per request (rounded up to whole pages).
    #[arg(long, default_value_t = 512)]
    pub tokens: u32,
    /// Requests in the stream.
    #[arg(long, default_value_t = 16)]
    pub requests: u32,
    /// Pages per chunk (0: each request is one chunk).
    #[arg(long, default_value_t = 0)]
    pub chunk_pages: u32,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 4)]
    pub inflight: u32,
    /// Transport, by registry name (an unknown name prints the compiled-in ones).
    #[arg(long, default_value = "tcp")]
    pub backend: String,
    /// Backend option `key=value` (repeatable), e.g. `connections=4` or `listen=10.0.0.1:0`.
    #[arg(long = "backend-opt", value_parser = parse_kv)]
    pub backend_opts: Vec<(String, String)>,
    /// Notification style.
    #[arg(long, value_enum, default_value = "attached")]
    pub notify: NotifyArg,
    /// Seed of the page permutations.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Deadline of each request, in seconds.
    #[arg(long, default_value_t = 60.0, value_parser = parse_seconds)]
    pub request_timeout_s: f64,
}

impl Workload {
    /// One side's spec.
    pub fn side(&self, parallel: Parallel) -> SideSpec {
        let (attention, layers) = self.model.shape();
        SideSpec {
            kv: KvSpec {
                attention,
                layers: self.layers.unwrap_or(layers),
                dtype_bytes: self.dtype_bytes,
                page_size: self.page_size,
                layout: self.layout.into(),
            },
            parallel,
        }
    }

    /// Prefill side.
    pub fn prefill(&self) -> SideSpec {
        self.side(self.stage_layers.prefill(self.prefill_tp, self.prefill_pp))
    }

    /// Decode side.
    pub fn decode(&self) -> SideSpec {
        self.side(self.stage_layers.decode(self.decode_tp, self.decode_pp, self.prefill_pp))
    }

    /// Validated topology.
    pub fn topology(&self) -> Result<Topology, String> {
        if self.tokens == 0 || self.requests == 0 || self.inflight == 0 {
            return Err("--tokens, --requests and --inflight must be at least 1".into());
        }
        if !(self.request_timeout_s > 0.0 && self.request_timeout_s.is_finite()) {
            return Err("--request-timeout-s must be a positive number".into());
        }
        Topology::new(&self.prefill(), &self.decode()).map_err(|e| e.to_string())
    }

    /// Pages per request.
    pub fn pages_per_request(&self) -> u32 {
        self.tokens.div_ceil(self.page_size.max(1))
    }

    /// Pages each rank's pool holds: a slot of pages per in-flight request, plus a few pages no
    /// request uses (their content must never change).
    pub fn pool_pages(&self) -> u32 {
        self.inflight * self.pages_per_request() + 4
    }

    /// The request deadline.
    pub fn request_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.request_timeout_s)
    }

    /// Backend options as a map.
    pub fn options(&self) -> BTreeMap<String, String> {
        self.backend_opts.iter().cloned().collect()
    }

    /// The command-line flags that reproduce this workload (for spawning workers).
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec![
            "--model".into(),
            self.model.name(),
            "--prefill-tp".into(),
            self.prefill_tp.to_string(),
            "--decode-tp".into(),
            self.decode_tp.to_string(),
            "--prefill-pp".into(),
            self.prefill_pp.to_string(),
            "--decode-pp".into(),
            self.decode_pp.to_string(),
            "--layout".into(),
            match self.layout {
                LayoutArg::Nhd => "nhd".into(),
                LayoutArg::Hnd => "hnd".into(),
            },
            "--page-size".into(),
            self.page_size.to_string(),
            "--dtype-bytes".into(),
            self.dtype_bytes.to_string(),
            "--tokens".into(),
            self.tokens.to_string(),
            "--requests".into(),
            self.requests.to_string(),
            "--chunk-pages".into(),
            self.chunk_pages.to_string(),
            "--inflight".into(),
            self.inflight.to_string(),
            "--backend".into(),
            self.backend.clone(),
            "--notify".into(),
            match self.notify {
                NotifyArg::Attached => "attached".into(),
                NotifyArg::OutOfBand => "out-of-band".into(),
            },
            "--seed".into(),
            self.seed.to_string(),
            "--request-timeout-s".into(),
            self.request_timeout_s.to_string(),
        ];
        if let Some(l) = self.layers {
            a.extend(["--layers".into(), l.to_string()]);
        }
        a.extend(self.stage_layers.to_args());
        for (k, v) in &self.backend_opts {
            a.extend(["--backend-opt".into(), format!("{k}={v}")]);
        }
        a
    }
}

/// A small deterministic generator (splitmix64) for page permutations; no dependency needed.
pub struct SplitMix(pub u64);

impl SplitMix {
    /// Next value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Fisher-Yates shuffle.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
}

/// The pages request `r` uses on a side: its in-flight slot's pages in a seeded order (so runs are
/// short and pages are not contiguous, as in a real paged pool). `salt` differs per side.
pub fn request_pages(w: &Workload, r: u32, salt: u64) -> Vec<u32> {
    let n = w.pages_per_request();
    let slot = r % w.inflight;
    let mut pages: Vec<u32> = (slot * n..(slot + 1) * n).collect();
    SplitMix(w.seed ^ salt ^ (u64::from(r) << 20)).shuffle(&mut pages);
    pages
}

/// Token number of the first token of request `r` (requests never share token numbers, so a byte
/// from the wrong request is caught).
pub fn token_base(r: u32) -> u64 {
    u64::from(r) << 24
}

#[cfg(test)]
mod stage_layers_tests {
    use clap::Parser;
    use kvxfer_core::Side;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        w: Workload,
    }

    fn parse(args: &[&str]) -> Workload {
        Cli::try_parse_from(std::iter::once("kvxfer").chain(args.iter().copied())).unwrap().w
    }

    #[test]
    fn partitions_reach_the_topology_and_the_worker_flags() {
        let w = parse(&["--model", "deepseek-v3", "--prefill-pp", "2", "--prefill-layers", "31, 30"]);
        let topo = w.topology().unwrap();
        assert_eq!(topo.layer_partition(Side::Prefill), [31, 30]);
        assert_eq!(topo.layer_partition(Side::Decode), [61]);
        // Workers spawned with `to_args` build the same topology.
        let args = w.to_args();
        assert!(args.windows(2).any(|a| a == ["--prefill-layers", "31,30"]), "{args:?}");
        let again = parse(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!(again.topology().unwrap(), topo);
        // Equal PP: decode takes the prefill partition unless told otherwise.
        let equal_pp = ["--layers", "5", "--prefill-pp", "2", "--decode-pp", "2", "--prefill-layers", "3,2"];
        let w = parse(&equal_pp);
        assert_eq!(w.topology().unwrap().layer_partition(Side::Decode), [3, 2]);
        assert!(!w.to_args().contains(&"--decode-layers".to_owned()));
        let w = parse(&[&equal_pp[..], &["--decode-layers", "2,3"]].concat());
        let e = w.topology().unwrap_err();
        assert!(e.contains("[3, 2]") && e.contains("[2, 3]"), "{e}");
        // Without the flags nothing changes.
        let w = parse(&["--prefill-pp", "2"]);
        assert_eq!(w.topology().unwrap().layer_partition(Side::Prefill), [16, 16]);
        assert!(!w.to_args().iter().any(|a| a.ends_with("-layers")));
    }

    #[test]
    fn malformed_lists_name_the_count() {
        assert!(parse_stage_layers("31,x").unwrap_err().contains("layer count `x` in `31,x`"));
        assert!(parse_stage_layers("").unwrap_err().contains("layer count ``"));
        assert_eq!(parse_stage_layers(" 4 ,5").unwrap().as_slice(), [4, 5]);
    }
}

#[cfg(test)]
mod seconds_tests {
    use super::*;

    #[test]
    fn seconds_are_finite_positive_and_bounded() {
        assert_eq!(parse_seconds("2.5").unwrap(), 2.5);
        assert_eq!(parse_seconds("86400").unwrap(), 86_400.0);
        for bad in ["nan", "NaN", "inf", "-1", "0", "1e300", "86401", "", "5s"] {
            let e = parse_seconds(bad).unwrap_err();
            assert!(e.contains("(0, 86400]"), "{bad}: {e}");
        }
    }
}
