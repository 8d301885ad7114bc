//! Model, layout and parallel-configuration types, and the topology that validates them.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{ConfigError, Mismatch};
use crate::heads;

/// Which side of the disaggregated pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    /// The prefill workers (senders).
    Prefill,
    /// The decode workers (receivers).
    Decode,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Prefill => "prefill",
            Side::Decode => "decode",
        })
    }
}

/// How attention stores its cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "type")]
pub enum Attention {
    /// Multi-head / grouped-query attention: `kv_heads` K and V heads, sharded over TP.
    Gqa {
        /// Total KV heads H of the group (`num_key_value_heads`).
        kv_heads: u32,
        /// Elements per K head.
        head_dim_k: u32,
        /// Elements per V head (may differ from K).
        head_dim_v: u32,
    },
    /// Multi-head latent attention: one latent per token per layer, identical on every TP rank.
    Mla {
        /// Elements of the latent (kv_lora_rank + qk_rope_head_dim).
        latent_dim: u32,
    },
}

/// Page layout of the KV pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    /// Token-major `[pages * page_size, local heads, head_dim]` per layer and K/V (SGLang's pool).
    #[default]
    Nhd,
    /// Head-major `[pages, local heads, page_size, head_dim]` per layer and K/V (vLLM's layout).
    Hnd,
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Layout::Nhd => "nhd",
            Layout::Hnd => "hnd",
        })
    }
}

/// Which buffer of a layer: K, V, or the MLA latent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvKind {
    /// Keys.
    K,
    /// Values.
    V,
    /// MLA latent.
    Latent,
}

impl KvKind {
    /// Small stable index (K 0, V 1, latent 2).
    pub fn index(self) -> u32 {
        match self {
            KvKind::K => 0,
            KvKind::V => 1,
            KvKind::Latent => 2,
        }
    }
}

impl fmt::Display for KvKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KvKind::K => "k",
            KvKind::V => "v",
            KvKind::Latent => "latent",
        })
    }
}

/// Everything about the KV cache that both sides must agree on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvSpec {
    /// Attention kind and head geometry.
    pub attention: Attention,
    /// Layers of the model that carry KV.
    pub layers: u32,
    /// Bytes per element (2 for bf16).
    pub dtype_bytes: u32,
    /// Tokens per page.
    pub page_size: u32,
    /// Page layout.
    pub layout: Layout,
}

impl KvSpec {
    /// The kinds of buffer each layer holds: K and V, or the latent.
    pub fn kinds(&self) -> &'static [KvKind] {
        match self.attention {
            Attention::Gqa { .. } => &[KvKind::K, KvKind::V],
            Attention::Mla { .. } => &[KvKind::Latent],
        }
    }

    /// Bytes of one head of one token for `kind` (the latent counts as one head).
    pub fn head_bytes(&self, kind: KvKind) -> u64 {
        let elems = match (self.attention, kind) {
            (Attention::Gqa { head_dim_k, .. }, KvKind::K) => head_dim_k,
            (Attention::Gqa { head_dim_v, .. }, KvKind::V) => head_dim_v,
            (Attention::Mla { latent_dim }, KvKind::Latent) => latent_dim,
            _ => 0,
        };
        u64::from(elems) * u64::from(self.dtype_bytes)
    }

    /// Whether this is MLA.
    pub fn is_mla(&self) -> bool {
        matches!(self.attention, Attention::Mla { .. })
    }

    /// KV heads H (1 for MLA).
    pub fn kv_heads(&self) -> u32 {
        match self.attention {
            Attention::Gqa { kv_heads, .. } => kv_heads,
            Attention::Mla { .. } => 1,
        }
    }

    /// KV bytes of one token over all layers and all heads (the model's KV footprint per token). Exact
    /// for the spec of a [`Topology`] (validated to fit); saturates at `u64::MAX` for a spec that does not.
    pub fn bytes_per_token(&self) -> u64 {
        let heads = u64::from(self.kv_heads());
        let per_layer =
            self.kinds().iter().fold(0u64, |acc, k| acc.saturating_add(self.head_bytes(*k).saturating_mul(heads)));
        per_layer.saturating_mul(u64::from(self.layers))
    }
}

/// Most stages an explicit [`LayerPartition`] may name.
pub const MAX_PARTITION_STAGES: usize = 64;

/// An explicit layer partition of one side: the layer count of each pipeline stage, in stage order
/// (SEMANTICS §1), e.g. `[31, 30]` for DeepSeek-V3's 61 layers on PP 2. Stage `s` owns the global
/// layers `[ls, ls + L)` with `ls` the sum of the earlier counts and `L` its own count.
///
/// Holds at most [`MAX_PARTITION_STAGES`] counts, inline, so that [`Parallel`], [`SideSpec`] and
/// [`Topology`] stay `Copy`. Serialized as an array of layer counts (`[31, 30]`). Whether it fits a
/// side (one count per stage, summing to the layer count, no empty stage) is checked by
/// [`Topology::new`], which names the numbers.
#[derive(Clone, Copy)]
pub struct LayerPartition {
    len: u8,
    layers: [u32; MAX_PARTITION_STAGES],
}

impl LayerPartition {
    /// A partition with the given per-stage layer counts, or a [`ConfigError::TooLarge`] when it names
    /// more than [`MAX_PARTITION_STAGES`] stages.
    pub fn new(stage_layers: &[u32]) -> Result<Self, ConfigError> {
        if stage_layers.len() > MAX_PARTITION_STAGES {
            return Err(ConfigError::TooLarge {
                what: "stages of an explicit layer partition",
                value: stage_layers.len() as u64,
                max: MAX_PARTITION_STAGES as u64,
            });
        }
        let mut layers = [0; MAX_PARTITION_STAGES];
        layers[..stage_layers.len()].copy_from_slice(stage_layers);
        Ok(Self { len: stage_layers.len() as u8, layers })
    }

    /// The per-stage layer counts, stage 0 first.
    pub fn as_slice(&self) -> &[u32] {
        &self.layers[..usize::from(self.len)]
    }

    /// Number of stages named.
    pub fn len(&self) -> usize {
        usize::from(self.len)
    }

    /// Whether no stage is named.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The sum of the counts (the layers the partition covers).
    pub fn total(&self) -> u64 {
        self.as_slice().iter().map(|l| u64::from(*l)).sum()
    }
}

impl TryFrom<&[u32]> for LayerPartition {
    type Error = ConfigError;

    fn try_from(v: &[u32]) -> Result<Self, ConfigError> {
        Self::new(v)
    }
}

impl PartialEq for LayerPartition {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for LayerPartition {}

impl std::hash::Hash for LayerPartition {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_slice().hash(state);
    }
}

impl fmt::Debug for LayerPartition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

impl fmt::Display for LayerPartition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&crate::error::render_layers(self.as_slice()))
    }
}

impl Serialize for LayerPartition {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.as_slice())
    }
}

impl<'de> Deserialize<'de> for LayerPartition {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Counts;
        impl<'de> serde::de::Visitor<'de> for Counts {
            type Value = LayerPartition;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "an array of at most {MAX_PARTITION_STAGES} per-stage layer counts")
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<LayerPartition, A::Error> {
                let mut layers = [0; MAX_PARTITION_STAGES];
                let mut len = 0;
                while let Some(l) = seq.next_element::<u32>()? {
                    // Stop at the first count over the limit: a hostile peer cannot make this allocate.
                    if len == MAX_PARTITION_STAGES {
                        return Err(serde::de::Error::invalid_length(len + 1, &self));
                    }
                    layers[len] = l;
                    len += 1;
                }
                Ok(LayerPartition { len: len as u8, layers })
            }
        }
        d.deserialize_seq(Counts)
    }
}

/// One side's parallel configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Parallel {
    /// Attention tensor-parallel size.
    pub tp: u32,
    /// Pipeline-parallel size.
    pub pp: u32,
    /// Explicit per-stage layer counts (`pp` entries summing to the layer count, none 0). `None`: the
    /// layers split evenly over the stages, and a remainder is refused. Absent from the serialized form
    /// when `None`, so configurations and handshakes written without it still parse.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_partition: Option<LayerPartition>,
}

impl Parallel {
    /// TP `tp` and PP `pp`, the layers split evenly over the stages.
    pub fn new(tp: u32, pp: u32) -> Self {
        Self { tp, pp, layer_partition: None }
    }

    /// TP `tp` and one pipeline stage per entry of `stage_layers`, each holding that many layers (the
    /// PP size is the number of entries). A [`ConfigError::TooLarge`] beyond [`MAX_PARTITION_STAGES`]
    /// stages; the counts are checked against the model by [`Topology::new`].
    pub fn with_stage_layers(tp: u32, stage_layers: &[u32]) -> Result<Self, ConfigError> {
        let partition = LayerPartition::new(stage_layers)?;
        Ok(Self { tp, pp: stage_layers.len() as u32, layer_partition: Some(partition) })
    }

    /// Layers of stage `stage` for a model of `layers` layers: the explicit count, or `layers / pp`;
    /// 0 for a stage outside `0..pp`.
    fn stage_layers(&self, layers: u32, stage: u32) -> u32 {
        if stage >= self.pp {
            return 0;
        }
        match &self.layer_partition {
            Some(p) => p.as_slice().get(stage as usize).copied().unwrap_or(0),
            None => layers / self.pp,
        }
    }

    /// The first global layer of stage `stage` (the layers of the stages before it); the layer count
    /// covered by the stages for `stage >= pp`.
    fn first_layer(&self, layers: u32, stage: u32) -> u32 {
        let stage = stage.min(self.pp);
        match &self.layer_partition {
            Some(p) => p.as_slice().iter().take(stage as usize).fold(0u32, |acc, l| acc.saturating_add(*l)),
            None => stage * (layers / self.pp.max(1)),
        }
    }

    /// Every stage's layer count.
    fn partition(&self, layers: u32) -> Vec<u32> {
        (0..self.pp).map(|s| self.stage_layers(layers, s)).collect()
    }

    /// This config without an explicit partition when the partition is the even split.
    fn normalized(&self, layers: u32) -> Self {
        match &self.layer_partition {
            Some(p) if layers % self.pp.max(1) == 0 && p.as_slice().iter().all(|l| *l == layers / self.pp.max(1)) => {
                Self { layer_partition: None, ..*self }
            }
            _ => *self,
        }
    }
}

/// A rank of one side: its TP rank and PP stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RankId {
    /// TP rank.
    pub tp: u32,
    /// PP stage.
    pub pp: u32,
}

impl RankId {
    /// A rank.
    pub fn new(tp: u32, pp: u32) -> Self {
        Self { tp, pp }
    }
}

impl fmt::Display for RankId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.tp, self.pp)
    }
}

/// The identity a prefill rank puts on its notifications: unique over TP, PP, CP and DP (instance)
/// of one prefill deployment. Packs into 64 bits (16 per dimension) on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SenderKey {
    /// Data-parallel group / prefill instance.
    pub dp: u16,
    /// Context-parallel rank.
    pub cp: u16,
    /// PP stage.
    pub pp: u16,
    /// TP rank.
    pub tp: u16,
}

/// The identity a rank's endpoint carries (in [`BackendConfig::identity`](crate::BackendConfig::identity) and in lost-peer events):
/// prefill ranks use their sender key, decode ranks a value with the top bit set. The one encoding
/// every part of kvxfer uses.
pub fn identity(side: Side, rank: RankId) -> u64 {
    match side {
        Side::Prefill => SenderKey::of(rank).to_u64(),
        Side::Decode => (1 << 63) | (u64::from(rank.pp) << 16) | u64::from(rank.tp),
    }
}

/// The (side, rank) an [`identity`] names.
pub fn from_identity(id: u64) -> (Side, RankId) {
    if id >> 63 == 1 {
        (Side::Decode, RankId::new((id & 0xffff) as u32, ((id >> 16) & 0xffff) as u32))
    } else {
        let k = SenderKey::from_u64(id);
        (Side::Prefill, RankId::new(u32::from(k.tp), u32::from(k.pp)))
    }
}

/// The sender key a rank puts on the notifications it sends: its [`identity`] as a key, so that a
/// backend can bind every notification to the identity its connection proved (`to_u64` of the key
/// equals the identity; for prefill ranks that is `SenderKey::of(rank)`, for decode ranks the key
/// carries the decode bit in its `dp` field). Only `tp` and `pp` are read back ([`rank_of_key`]).
pub fn own_key(side: Side, rank: RankId) -> SenderKey {
    SenderKey::from_u64(identity(side, rank))
}

/// The rank a sender key (or an [`own_key`]) names: its `tp` and `pp`.
pub fn rank_of_key(k: SenderKey) -> RankId {
    RankId::new(u32::from(k.tp), u32::from(k.pp))
}

impl SenderKey {
    /// The key of prefill rank `rank` in instance 0, CP rank 0.
    pub fn of(rank: RankId) -> Self {
        Self { dp: 0, cp: 0, pp: rank.pp as u16, tp: rank.tp as u16 }
    }

    /// The 64-bit wire form.
    pub fn to_u64(self) -> u64 {
        (u64::from(self.dp) << 48) | (u64::from(self.cp) << 32) | (u64::from(self.pp) << 16) | u64::from(self.tp)
    }

    /// From the 64-bit wire form.
    pub fn from_u64(v: u64) -> Self {
        Self { dp: (v >> 48) as u16, cp: (v >> 32) as u16, pp: (v >> 16) as u16, tp: v as u16 }
    }
}

impl fmt::Display for SenderKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tp{}.pp{}", self.tp, self.pp)?;
        if self.cp != 0 {
            write!(f, ".cp{}", self.cp)?;
        }
        if self.dp != 0 {
            write!(f, ".dp{}", self.dp)?;
        }
        Ok(())
    }
}

/// One side: KV spec plus parallel config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SideSpec {
    /// The KV cache description.
    pub kv: KvSpec,
    /// Parallel sizes.
    pub parallel: Parallel,
}

/// A validated pair of prefill and decode configurations. All planning starts here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Topology {
    kv: KvSpec,
    prefill: Parallel,
    decode: Parallel,
}

fn check_side(side: Side, s: &SideSpec) -> Result<(), ConfigError> {
    let zero = |what| Err(ConfigError::Zero { side, what });
    let kv = &s.kv;
    if s.parallel.tp == 0 {
        return zero("TP size");
    }
    if s.parallel.pp == 0 {
        return zero("PP size");
    }
    if kv.layers == 0 {
        return zero("layer count");
    }
    if kv.page_size == 0 {
        return zero("page size");
    }
    if kv.dtype_bytes == 0 {
        return zero("dtype bytes");
    }
    match kv.attention {
        Attention::Gqa { kv_heads, head_dim_k, head_dim_v } => {
            if kv_heads == 0 {
                return zero("KV heads");
            }
            if head_dim_k == 0 {
                return zero("K head dim");
            }
            if head_dim_v == 0 {
                return zero("V head dim");
            }
            if !heads::divides(kv_heads, s.parallel.tp) {
                return Err(ConfigError::HeadsNotDivisible { side, kv_heads, tp: s.parallel.tp });
            }
        }
        Attention::Mla { latent_dim } => {
            if latent_dim == 0 {
                return zero("latent dim");
            }
        }
    }
    for (what, v) in [("TP size", s.parallel.tp), ("PP size", s.parallel.pp)] {
        if v > u32::from(u16::MAX) {
            return Err(ConfigError::TooLarge { what, value: v.into(), max: u16::MAX.into() });
        }
    }
    check_partition(side, kv.layers, &s.parallel)?;
    check_sizes(side, s)
}

/// SEMANTICS §1: an explicit partition has one count per stage, none 0, summing to the layer count;
/// without one, the layers split evenly over the stages.
fn check_partition(side: Side, layers: u32, par: &Parallel) -> Result<(), ConfigError> {
    let Some(partition) = &par.layer_partition else {
        if layers % par.pp != 0 {
            return Err(ConfigError::LayersNotDivisible { side, layers, pp: par.pp });
        }
        return Ok(());
    };
    let counts = partition.as_slice();
    if counts.len() as u64 != u64::from(par.pp) {
        return Err(ConfigError::PartitionLength { side, partition: counts.to_vec(), pp: par.pp });
    }
    if let Some(stage) = counts.iter().position(|l| *l == 0) {
        return Err(ConfigError::EmptyStage { side, partition: counts.to_vec(), stage: stage as u32 });
    }
    let sum = partition.total();
    if sum != u64::from(layers) {
        return Err(ConfigError::PartitionSum { side, partition: counts.to_vec(), sum, layers });
    }
    Ok(())
}

/// The largest byte size of one page of one (layer, kind) buffer of one rank: `u64::MAX / u32::MAX`
/// (4 GiB + 1), so that a buffer of any page count a `u32` can name has a byte size that fits in a `u64`.
pub const MAX_PAGE_BUFFER_BYTES: u64 = u64::MAX / u32::MAX as u64;

/// `factors` (name, value) multiplied, checked against `max`: the product, or a
/// [`ConfigError::SizeOverflow`] that names every factor.
fn product(side: Side, what: &'static str, factors: &[(&str, u64)], max: u64) -> Result<u64, ConfigError> {
    let exact = factors.iter().try_fold(1u128, |acc, (_, v)| acc.checked_mul(u128::from(*v)));
    match exact {
        Some(p) if p <= u128::from(max) => Ok(p as u64),
        _ => {
            let mut text = factors.iter().map(|(n, v)| format!("{n} {v}")).collect::<Vec<_>>().join(" x ");
            match exact {
                Some(p) => text.push_str(&format!(" = {p}")),
                None => text.push_str(" = more than 2^128"),
            }
            Err(ConfigError::SizeOverflow { side, what, factors: text, max })
        }
    }
}

/// Byte sizes of a side (SEMANTICS §1): one rank's page of one (layer, kind) buffer is at most
/// [`MAX_PAGE_BUFFER_BYTES`], and the model's KV bytes per token and per page (every layer, head and
/// kind) fit in a `u64`. Every size the planner and the sessions compute from a validated topology then
/// fits: buffer sizes for any `u32` page count, offsets inside them, bytes per token and per page.
fn check_sizes(side: Side, s: &SideSpec) -> Result<(), ConfigError> {
    let kv = &s.kv;
    let local = if kv.is_mla() { 1 } else { heads::local(kv.kv_heads(), s.parallel.tp) };
    let dim = |kind: KvKind| -> (&'static str, u64) {
        match (kv.attention, kind) {
            (Attention::Gqa { head_dim_k, .. }, KvKind::K) => ("head_dim_k", head_dim_k.into()),
            (Attention::Gqa { head_dim_v, .. }, KvKind::V) => ("head_dim_v", head_dim_v.into()),
            (Attention::Mla { latent_dim }, _) => ("latent_dim", latent_dim.into()),
            (Attention::Gqa { .. }, KvKind::Latent) => ("latent_dim", 0),
        }
    };
    for kind in kv.kinds() {
        product(
            side,
            "bytes of one page of one layer's buffer on one rank",
            &[
                ("page_size", kv.page_size.into()),
                ("local heads", local.into()),
                (dim(*kind).0, dim(*kind).1),
                ("dtype_bytes", kv.dtype_bytes.into()),
            ],
            MAX_PAGE_BUFFER_BYTES,
        )?;
    }
    // Every layer, head and kind of one token, then of one page.
    let dims: u64 = kv.kinds().iter().map(|k| dim(*k).1).sum();
    let dims_name = if kv.is_mla() { "latent_dim" } else { "(head_dim_k + head_dim_v)" };
    let per_token = [
        ("kv_heads", u64::from(kv.kv_heads())),
        (dims_name, dims),
        ("dtype_bytes", kv.dtype_bytes.into()),
        ("layers", kv.layers.into()),
    ];
    product(side, "KV bytes per token", &per_token, u64::MAX)?;
    let mut per_page = vec![("page_size", u64::from(kv.page_size))];
    per_page.extend(per_token);
    product(side, "KV bytes per page", &per_page, u64::MAX)?;
    Ok(())
}

/// Every field on which two KV specs disagree (empty when compatible).
pub fn kv_mismatches(p: &KvSpec, d: &KvSpec) -> Vec<Mismatch> {
    let mut out = Vec::new();
    let mut cmp = |field: &'static str, a: String, b: String| {
        if a != b {
            out.push(Mismatch { field, prefill: a, decode: b });
        }
    };
    cmp("page_size", p.page_size.to_string(), d.page_size.to_string());
    cmp("dtype_bytes", p.dtype_bytes.to_string(), d.dtype_bytes.to_string());
    cmp("layers", p.layers.to_string(), d.layers.to_string());
    cmp("layout", p.layout.to_string(), d.layout.to_string());
    match (p.attention, d.attention) {
        (
            Attention::Gqa { kv_heads: h1, head_dim_k: k1, head_dim_v: v1 },
            Attention::Gqa { kv_heads: h2, head_dim_k: k2, head_dim_v: v2 },
        ) => {
            cmp("kv_heads", h1.to_string(), h2.to_string());
            cmp("head_dim_k", k1.to_string(), k2.to_string());
            cmp("head_dim_v", v1.to_string(), v2.to_string());
        }
        (Attention::Mla { latent_dim: a }, Attention::Mla { latent_dim: b }) => {
            cmp("latent_dim", a.to_string(), b.to_string());
        }
        (a, b) => cmp("attention", attention_name(&a), attention_name(&b)),
    }
    out
}

fn attention_name(a: &Attention) -> String {
    match a {
        Attention::Gqa { .. } => "gqa".into(),
        Attention::Mla { .. } => "mla".into(),
    }
}

impl Topology {
    /// Validates both sides and their compatibility (SEMANTICS §1, §2, §6). Every error names the values.
    ///
    /// Layers: a side with an explicit [`Parallel::layer_partition`] needs one count per stage, none 0,
    /// summing to the layer count; a side without one splits the layers evenly and refuses a remainder.
    /// An explicit partition equal to the even split is kept as the even split (`layer_partition: None`
    /// in [`Topology::parallel`]), so that equal topologies mean equal layer layouts.
    /// With decode PP equal to prefill PP (> 1), both sides' per-stage counts must be identical; with
    /// decode PP 1, the decode rank holds every layer and prefill stage `s` lands at its first layer.
    pub fn new(prefill: &SideSpec, decode: &SideSpec) -> Result<Self, ConfigError> {
        let mism = kv_mismatches(&prefill.kv, &decode.kv);
        if !mism.is_empty() {
            return Err(ConfigError::Mismatch(mism));
        }
        check_side(Side::Prefill, prefill)?;
        check_side(Side::Decode, decode)?;
        let (p, d) = (prefill.parallel.tp, decode.parallel.tp);
        if p.max(d) % p.min(d) != 0 {
            return Err(ConfigError::TpRatio { prefill_tp: p, decode_tp: d });
        }
        let (pp, dp) = (prefill.parallel.pp, decode.parallel.pp);
        if dp != 1 && dp != pp {
            return Err(ConfigError::PpMismatch { prefill_pp: pp, decode_pp: dp });
        }
        // Equal PP: prefill stage s writes into decode stage s, layer for layer, so both must own the
        // same layers (SEMANTICS §4).
        let layers = prefill.kv.layers;
        let (ps, ds) = (&prefill.parallel, &decode.parallel);
        if dp == pp && dp > 1 && (0..pp).any(|s| ps.stage_layers(layers, s) != ds.stage_layers(layers, s)) {
            return Err(ConfigError::PartitionMismatch {
                pp,
                prefill: ps.partition(layers),
                decode: ds.partition(layers),
            });
        }
        // An explicit partition equal to the even split is the even split: equal topologies describe
        // equal layouts, however each side spelled its stages.
        Ok(Self { kv: prefill.kv, prefill: ps.normalized(layers), decode: ds.normalized(layers) })
    }

    /// The shared KV spec.
    pub fn kv(&self) -> &KvSpec {
        &self.kv
    }

    /// Parallel config of a side.
    pub fn parallel(&self, side: Side) -> Parallel {
        match side {
            Side::Prefill => self.prefill,
            Side::Decode => self.decode,
        }
    }

    /// The side spec (KV + parallel) of a side.
    pub fn side(&self, side: Side) -> SideSpec {
        SideSpec { kv: self.kv, parallel: self.parallel(side) }
    }

    /// All ranks of a side, TP-major within each stage.
    pub fn ranks(&self, side: Side) -> Vec<RankId> {
        let par = self.parallel(side);
        (0..par.pp).flat_map(|pp| (0..par.tp).map(move |tp| RankId { tp, pp })).collect()
    }

    /// Errors unless `rank` is a rank of `side`.
    pub fn check_rank(&self, side: Side, rank: RankId) -> Result<(), ConfigError> {
        let par = self.parallel(side);
        if rank.tp >= par.tp || rank.pp >= par.pp {
            return Err(ConfigError::RankOutOfRange { side, rank, tp: par.tp, pp: par.pp });
        }
        Ok(())
    }

    /// Layers held by stage `stage` of a side: its entry of the side's explicit layer partition, or
    /// `layers / PP` without one. 0 for a stage outside the side.
    pub fn stage_layers(&self, side: Side, stage: u32) -> u32 {
        self.parallel(side).stage_layers(self.kv.layers, stage)
    }

    /// The global layers stage `stage` of a side owns: `[ls, ls + L)` (SEMANTICS §1). Empty for a stage
    /// outside the side.
    pub fn stage_range(&self, side: Side, stage: u32) -> std::ops::Range<u32> {
        let first = self.first_layer(side, stage);
        first..first + self.stage_layers(side, stage)
    }

    /// Every stage's layer count on a side, stage 0 first: the explicit partition, or the even split.
    pub fn layer_partition(&self, side: Side) -> Vec<u32> {
        self.parallel(side).partition(self.kv.layers)
    }

    /// Heads held by one rank of a side (1 for MLA).
    pub fn local_heads(&self, side: Side) -> u32 {
        if self.kv.is_mla() {
            1
        } else {
            heads::local(self.kv.kv_heads(), self.parallel(side).tp)
        }
    }

    /// Bytes of one rank's buffer for one layer and kind, holding `pages` pages. Never overflows for a
    /// topology built by [`Topology::new`] (one page of a buffer is at most [`MAX_PAGE_BUFFER_BYTES`]);
    /// saturates at `u64::MAX` otherwise. [`Topology::checked_buffer_bytes`] says so with an error.
    pub fn buffer_bytes(&self, side: Side, kind: KvKind, pages: u32) -> u64 {
        self.checked_buffer_bytes(side, kind, pages).unwrap_or(u64::MAX)
    }

    /// [`Topology::buffer_bytes`], or a [`ConfigError::SizeOverflow`] naming the values when the size does
    /// not fit in a `u64`.
    pub fn checked_buffer_bytes(&self, side: Side, kind: KvKind, pages: u32) -> Result<u64, ConfigError> {
        product(
            side,
            "bytes of one layer's buffer on one rank",
            &[
                ("pages", pages.into()),
                ("page_size", self.kv.page_size.into()),
                ("local heads", self.local_heads(side).into()),
                ("bytes per head", self.kv.head_bytes(kind)),
            ],
            u64::MAX,
        )
    }

    /// Bytes of the whole pool of `pages` pages of one rank of stage `stage`: every layer of that stage
    /// and every kind. A [`ConfigError::SizeOverflow`] naming the values when it does not fit in a `u64`.
    pub fn checked_pool_bytes(&self, side: Side, stage: u32, pages: u32) -> Result<u64, ConfigError> {
        let head_bytes = self.kv.kinds().iter().fold(0u64, |acc, k| acc.saturating_add(self.kv.head_bytes(*k)));
        product(
            side,
            "bytes of one rank's pool",
            &[
                ("pages", pages.into()),
                ("page_size", self.kv.page_size.into()),
                ("local heads", self.local_heads(side).into()),
                ("bytes per head of every kind", head_bytes),
                ("stage layers", self.stage_layers(side, stage).into()),
            ],
            u64::MAX,
        )
    }

    /// Prefill TP ranks that feed decode TP rank `d` (SEMANTICS §3), within one stage.
    pub fn sender_tps(&self, d: u32) -> std::ops::Range<u32> {
        let (p, dd) = (self.prefill.tp, self.decode.tp);
        if self.kv.is_mla() {
            let s = if p <= dd { d / (dd / p) } else { d * (p / dd) };
            return s..s + 1;
        }
        if p == dd {
            d..d + 1
        } else if p < dd {
            let s = d / (dd / p);
            s..s + 1
        } else {
            let r = p / dd;
            d * r..(d + 1) * r
        }
    }

    /// The decode rank that receives prefill rank `src`'s layers for decode TP rank `d`.
    fn dst_stage(&self, src_pp: u32) -> u32 {
        if self.decode.pp == 1 {
            0
        } else {
            src_pp
        }
    }

    /// The decode ranks prefill rank `src` sends to.
    pub fn receivers(&self, src: RankId) -> Vec<RankId> {
        let pp = self.dst_stage(src.pp);
        (0..self.decode.tp).filter(|d| self.sender_tps(*d).contains(&src.tp)).map(|tp| RankId { tp, pp }).collect()
    }

    /// The prefill ranks that send to decode rank `dst`, every stage included.
    pub fn senders(&self, dst: RankId) -> Vec<RankId> {
        let stages: Vec<u32> = if self.decode.pp == 1 { (0..self.prefill.pp).collect() } else { vec![dst.pp] };
        stages.into_iter().flat_map(|pp| self.sender_tps(dst.tp).map(move |tp| RankId { tp, pp })).collect()
    }

    /// The sender keys decode rank `dst` must hear from (SEMANTICS §5):
    /// `N = (P > D and not MLA ? P/D : 1) * (PPd == 1 ? PPp : 1)`.
    pub fn expected_senders(&self, dst: RankId) -> Vec<SenderKey> {
        self.senders(dst).into_iter().map(SenderKey::of).collect()
    }

    /// The first global layer `ls` of a stage on a side: the layers of every earlier stage (explicit
    /// partition or even split). For a stage at or past the side's PP, the layer count.
    pub fn first_layer(&self, side: Side, stage: u32) -> u32 {
        self.parallel(side).first_layer(self.kv.layers, stage)
    }

    /// Destination layer (decode rank-local) of prefill stage `src_pp`'s local layer 0: the stage's
    /// first global layer when decode PP is 1 (the decode rank holds every layer), else 0 (the decode
    /// stage owns the same layers as the prefill stage).
    pub fn dst_layer_offset(&self, src_pp: u32) -> u32 {
        if self.decode.pp == 1 {
            self.first_layer(Side::Prefill, src_pp)
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank of every side round-trips through its identity; the two sides never share one;
    /// a rank's own key is its identity as a key, and names the rank back.
    #[test]
    fn identities_round_trip_and_never_collide_across_sides() {
        let mut seen = std::collections::HashSet::new();
        for side in [Side::Prefill, Side::Decode] {
            for tp in [0u32, 1, 7, 255, 0xffff] {
                for pp in [0u32, 1, 3, 0xffff] {
                    let r = RankId::new(tp, pp);
                    let id = identity(side, r);
                    assert_eq!(from_identity(id), (side, r), "{side} {r}");
                    assert!(seen.insert(id), "{side} {r}: identity {id:#x} used twice");
                    assert_eq!(own_key(side, r).to_u64(), id);
                    assert_eq!(rank_of_key(own_key(side, r)), r);
                    assert_eq!(id >> 63 == 1, side == Side::Decode);
                }
            }
        }
        assert_eq!(identity(Side::Prefill, RankId::new(3, 1)), SenderKey::of(RankId::new(3, 1)).to_u64());
    }
}
