//! Typed errors of the core: configuration, planning, codec and backend errors.

use crate::model::{RankId, Side};
use crate::notify::RequestId;

/// A configuration that kvxfer refuses, with the numbers that make it invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A size that must be at least 1 is 0.
    #[error("{side} {what} is 0; it must be at least 1")]
    Zero {
        /// Which side.
        side: Side,
        /// Which field.
        what: &'static str,
    },
    /// KV heads H and a TP size T do not divide (SEMANTICS §2).
    #[error(
        "{side} TP size {tp} does not fit {kv_heads} KV heads: need H % T == 0 (T <= H) or T % H == 0 (T > H); \
         choose a TP size that divides {kv_heads} or is a multiple of it"
    )]
    HeadsNotDivisible {
        /// Which side.
        side: Side,
        /// Total KV heads.
        kv_heads: u32,
        /// The TP size.
        tp: u32,
    },
    /// max(P, D) is not a multiple of min(P, D).
    #[error("prefill TP {prefill_tp} and decode TP {decode_tp}: the larger must be a multiple of the smaller")]
    TpRatio {
        /// Prefill TP size.
        prefill_tp: u32,
        /// Decode TP size.
        decode_tp: u32,
    },
    /// Decode PP must be 1 or equal to prefill PP.
    #[error("decode PP {decode_pp} must be 1 or equal to prefill PP {prefill_pp}")]
    PpMismatch {
        /// Prefill PP size.
        prefill_pp: u32,
        /// Decode PP size.
        decode_pp: u32,
    },
    /// The layer count is not divisible by a side's PP size, and the side gives no explicit partition.
    #[error(
        "{side}: {layers} layers cannot be split evenly over PP {pp}; \
         give an explicit layer partition ({pp} per-stage layer counts that sum to {layers})"
    )]
    LayersNotDivisible {
        /// Which side.
        side: Side,
        /// Layers of the model.
        layers: u32,
        /// PP size.
        pp: u32,
    },
    /// An explicit layer partition does not name one layer count per pipeline stage.
    #[error(
        "{side}: layer partition {} names {} stage(s) but PP is {pp}; give one layer count per stage",
        render_layers(.partition), .partition.len()
    )]
    PartitionLength {
        /// Which side.
        side: Side,
        /// The partition as given.
        partition: Vec<u32>,
        /// PP size.
        pp: u32,
    },
    /// An explicit layer partition gives a stage no layer.
    #[error(
        "{side}: stage {stage} of layer partition {} has 0 layers; every stage owns at least one layer",
        render_layers(.partition)
    )]
    EmptyStage {
        /// Which side.
        side: Side,
        /// The partition as given.
        partition: Vec<u32>,
        /// The first empty stage.
        stage: u32,
    },
    /// An explicit layer partition does not cover the model's layers.
    #[error(
        "{side}: layer partition {} sums to {sum} layers but the model has {layers}",
        render_layers(.partition)
    )]
    PartitionSum {
        /// Which side.
        side: Side,
        /// The partition as given.
        partition: Vec<u32>,
        /// Its sum.
        sum: u64,
        /// Layers of the model.
        layers: u32,
    },
    /// Decode PP equals prefill PP, but the stages own different layers: a prefill stage's layers must
    /// land on the decode stage that owns them.
    #[error(
        "prefill layer partition {} and decode layer partition {} differ; with decode PP equal to prefill \
         PP {pp}, each decode stage receives the layers of the same prefill stage, so the partitions must be identical",
        render_layers(.prefill), render_layers(.decode)
    )]
    PartitionMismatch {
        /// PP size of both sides.
        pp: u32,
        /// Per-stage layer counts of prefill (explicit or the even split).
        prefill: Vec<u32>,
        /// Per-stage layer counts of decode (explicit or the even split).
        decode: Vec<u32>,
    },
    /// The two sides disagree on fields that must match.
    #[error("prefill and decode are incompatible: {}", .0.iter().map(|m| m.to_string()).collect::<Vec<_>>().join("; "))]
    Mismatch(Vec<Mismatch>),
    /// A rank outside the side's parallel config.
    #[error("{side} rank {rank} is outside TP {tp} x PP {pp}")]
    RankOutOfRange {
        /// Which side.
        side: Side,
        /// The rank asked for.
        rank: RankId,
        /// TP size.
        tp: u32,
        /// PP size.
        pp: u32,
    },
    /// A value that does not fit the wire encoding (sender keys use 16 bits per dimension).
    #[error("{what} = {value} exceeds the supported maximum {max}")]
    TooLarge {
        /// What.
        what: &'static str,
        /// The value.
        value: u64,
        /// The maximum.
        max: u64,
    },
    /// A geometry whose byte sizes do not fit the 64-bit sizes and offsets every buffer is addressed with:
    /// the product of `factors` exceeds `max` bytes.
    #[error(
        "{side}: {what} = {factors} exceeds the {max} bytes kvxfer can address; \
         check these sizes (no real KV cache is this large): a smaller page size, head dim, dtype, layer count or page count"
    )]
    SizeOverflow {
        /// Which side.
        side: Side,
        /// Which size.
        what: &'static str,
        /// The factors, named with their values, and their product when it is representable.
        factors: String,
        /// The largest accepted value of the product.
        max: u64,
    },
}

/// Per-stage layer counts as `[31, 30]`.
pub(crate) fn render_layers(counts: &[u32]) -> String {
    format!("[{}]", counts.iter().map(u32::to_string).collect::<Vec<_>>().join(", "))
}

/// One field on which prefill and decode disagree.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field} differs (prefill {prefill}, decode {decode})")]
pub struct Mismatch {
    /// The field name (page_size, dtype_bytes, head_dim_k, head_dim_v, kv_heads, layers, attention, layout).
    pub field: &'static str,
    /// The prefill value, rendered.
    pub prefill: String,
    /// The decode value, rendered.
    pub decode: String,
}

/// A request chunk that cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// Source and destination page lists differ in length.
    #[error("source has {src} pages but destination has {dst}; every source page needs one destination page")]
    PageCountMismatch {
        /// Source pages.
        src: usize,
        /// Destination pages.
        dst: usize,
    },
    /// A prefill rank asked to write a decode rank it does not feed (SEMANTICS §3).
    #[error("prefill rank {src} does not feed decode rank {dst} in this topology")]
    NotAReceiver {
        /// The prefill rank.
        src: RankId,
        /// The decode rank.
        dst: RankId,
    },
    /// A destination page appears twice in one chunk.
    #[error("destination page {page} appears twice in the chunk; two source pages cannot land on one page")]
    DuplicateDestinationPage {
        /// The page.
        page: u32,
    },
    /// A page index is beyond a pool's capacity.
    #[error("{side} page {page} is outside the pool of {capacity} pages (rank {rank})")]
    PageOutOfRange {
        /// Which side.
        side: Side,
        /// The rank whose pool.
        rank: RankId,
        /// The page.
        page: u32,
        /// Pages the pool holds.
        capacity: u32,
    },
    /// The rank is not part of the topology.
    #[error(transparent)]
    Config(#[from] ConfigError),
}

/// A notification that failed to decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// Fewer bytes than the header or a field needs.
    #[error("notification truncated: needed {needed} bytes at offset {offset}, have {len}")]
    Truncated {
        /// Bytes needed.
        needed: usize,
        /// Offset at which they were needed.
        offset: usize,
        /// Total length.
        len: usize,
    },
    /// A version this build does not speak.
    #[error(
        "{what} of version {found}, this build speaks {}; upgrade whichever side is older (a rolling \
         upgrade goes one version at a time)",
        if oldest == newest { newest.to_string() } else { format!("{oldest}..={newest}") }
    )]
    Version {
        /// What was read ("notification", "fragment").
        what: &'static str,
        /// Version found.
        found: u8,
        /// The oldest version this build reads.
        oldest: u8,
        /// The newest version this build reads.
        newest: u8,
    },
    /// Bad magic byte.
    #[error("not a kvxfer notification (magic 0x{found:02x}, expected 0x{expected:02x})")]
    Magic {
        /// Found.
        found: u8,
        /// Expected.
        expected: u8,
    },
    /// Unknown body tag.
    #[error("unknown notification kind tag {0}")]
    Tag(u8),
    /// A flag byte that is neither 0 nor 1.
    #[error("invalid flag byte {0}")]
    Flag(u8),
    /// Failure reason is not UTF-8.
    #[error("failure reason is not valid UTF-8")]
    Utf8,
    /// Bytes after the end of the message.
    #[error("{0} trailing bytes after the notification")]
    Trailing(usize),
    /// A payload over the size limit.
    #[error("payload of {len} bytes exceeds the limit of {max}")]
    TooLong {
        /// Length.
        len: usize,
        /// Limit.
        max: usize,
    },
    /// A notification fragment that does not fit the message it claims to belong to.
    #[error("bad notification fragment: {0}")]
    Fragment(String),
}

/// The tracker refused a call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TrackerError {
    /// `expect` for a room that is already tracked.
    #[error(
        "request {request} is already being tracked (generation {generation}); release it before expecting it again"
    )]
    AlreadyTracked {
        /// The room.
        request: RequestId,
        /// The generation tracked now.
        generation: u64,
    },
    /// `expect` for a (room, generation) that was already released: generations are unique per use.
    #[error("request {request} generation {generation} was already used and released; give every use of a room a new generation")]
    GenerationReleased {
        /// The room.
        request: RequestId,
        /// The generation.
        generation: u64,
    },
    /// `expect` with an empty sender set.
    #[error("request {0}: the expected sender set is empty")]
    NoSenders(RequestId),
}
