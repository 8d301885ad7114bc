//! `kvxfer plan --format svg`: the P x D head map of a plan as an SVG picture.
//!
//! Prefill ranks are boxes in a column on the left (grouped by pipeline stage when prefill PP > 1),
//! decode ranks on the right; each box names the KV heads (or the MLA latent) its rank holds, dashed
//! when they are replicated on several ranks of that side. Every (prefill rank, decode rank) pair that
//! moves bytes is one `<line class="edge">` (with `data-src`, `data-dst` as `tp/pp` and `data-bytes`),
//! labelled with the heads it carries and its bytes for the chunk; an edge whose heads the decode side
//! replicates (the same bytes also land on other decode ranks) has the classes `edge replicated` and a
//! dashed stroke. A pair that only notifies (a lower-ranked replica writes its heads) is a dotted
//! `<line class="notify">`. The picture is plain string generation; every text is XML-escaped.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::ops::Range;

use kvxfer_core::plan::ChunkPlan;
use kvxfer_core::{heads, Attention, RankId, Side, Topology};

use crate::plan::{describe, human_bytes};

const MARGIN: f64 = 20.0;
const BOX_W: f64 = 300.0;
const BOX_H: f64 = 62.0;
const BOX_GAP: f64 = 14.0;
/// Room for a stage header above each stage's boxes (pipeline sides only).
const STAGE_GAP: f64 = 26.0;
const COL_GAP: f64 = 420.0;
const LINE_H: f64 = 17.0;
const TITLE_LINES: usize = 3;

const INK: &str = "#222";
const EDGE: &str = "#1f5fa8";
const NOTIFY: &str = "#999";
const PREFILL_FILL: &str = "#eef4fb";
const DECODE_FILL: &str = "#f2f8ee";

/// Escapes `s` for XML text and attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
    out
}

/// What one rank holds of every layer of its stage.
struct Holding {
    /// e.g. `KV heads 0-3`, `KV head 1`, `MLA latent (576)` (its elements).
    what: String,
    /// Ranks of the same side that hold the same heads (1: not replicated).
    replicas: u32,
}

fn head_range(r: &Range<u32>) -> String {
    if r.len() == 1 {
        format!("head {}", r.start)
    } else {
        format!("heads {}-{}", r.start, r.end.saturating_sub(1))
    }
}

fn holding(topo: &Topology, side: Side, tp: u32) -> Holding {
    let t = topo.parallel(side).tp;
    match topo.kv().attention {
        Attention::Mla { latent_dim } => Holding { what: format!("MLA latent ({latent_dim})"), replicas: t },
        Attention::Gqa { kv_heads, .. } => Holding {
            what: format!("KV {}", head_range(&heads::heads(kv_heads, t, tp))),
            replicas: (t / kv_heads.max(1)).max(1),
        },
    }
}

/// The heads one moving pair carries (`heads 0-3`, `head 5`, `latent`).
fn carried(topo: &Topology, src: RankId, n: u32, src_slot: u32) -> String {
    match topo.kv().attention {
        Attention::Mla { .. } => "latent".to_owned(),
        Attention::Gqa { kv_heads, .. } => {
            let first = heads::first(kv_heads, topo.parallel(Side::Prefill).tp, src.tp) + src_slot;
            head_range(&(first..first + n))
        }
    }
}

fn plural(n: usize, one: &str) -> String {
    if n == 1 {
        format!("1 {one}")
    } else {
        format!("{n} {one}s")
    }
}

/// A rank's box: top-left corner and its text lines.
struct RankBox {
    rank: RankId,
    x: f64,
    y: f64,
    replicated: bool,
    lines: [String; 3],
}

/// Lays out one side's column from `top`: boxes in topology order (stage-major, then TP rank), with a
/// header line above each stage when the side has several. Returns the boxes, the stage headers
/// (x, y, text) and the column's bottom.
fn column(
    topo: &Topology,
    plan: &ChunkPlan,
    side: Side,
    x: f64,
    top: f64,
) -> (Vec<RankBox>, Vec<(f64, f64, String)>, f64) {
    let pp = topo.parallel(side).pp;
    let name = match side {
        Side::Prefill => "prefill",
        Side::Decode => "decode",
    };
    let mut boxes = Vec::new();
    let mut headers = Vec::new();
    let mut y = top;
    let mut stage = None;
    for rank in topo.ranks(side) {
        if pp > 1 && stage != Some(rank.pp) {
            let layers = topo.stage_range(side, rank.pp);
            headers.push((
                x,
                y + STAGE_GAP - 9.0,
                format!("{name} stage {}: layers {}-{}", rank.pp, layers.start, layers.end.saturating_sub(1)),
            ));
            y += STAGE_GAP;
            stage = Some(rank.pp);
        }
        let h = holding(topo, side, rank.tp);
        let title =
            if pp > 1 { format!("{name} tp {}, pp {}", rank.tp, rank.pp) } else { format!("{name} tp {}", rank.tp) };
        let held =
            if h.replicas > 1 { format!("{}, replicated on {} ranks", h.what, h.replicas) } else { h.what.clone() };
        let traffic = match side {
            Side::Prefill => {
                let pairs: Vec<_> = plan.pairs.iter().filter(|p| p.src == rank).collect();
                let moving: Vec<_> = pairs.iter().filter(|p| p.writes()).collect();
                let bytes: u64 = moving.iter().map(|p| p.bytes()).sum();
                if pairs.is_empty() {
                    "no receiver: a replica sends the same data".to_owned()
                } else if moving.is_empty() {
                    format!("notifies {}; a replica writes", plural(pairs.len(), "decode rank"))
                } else {
                    format!("sends {} to {}", human_bytes(bytes), plural(moving.len(), "decode rank"))
                }
            }
            Side::Decode => {
                let bytes: u64 = plan.pairs.iter().filter(|p| p.dst == rank).map(|p| p.bytes()).sum();
                let senders = topo.expected_senders(rank).len();
                format!("receives {}; hears from {}", human_bytes(bytes), plural(senders, "sender"))
            }
        };
        boxes.push(RankBox { rank, x, y, replicated: h.replicas > 1, lines: [title, held, traffic] });
        y += BOX_H + BOX_GAP;
    }
    (boxes, headers, y - BOX_GAP)
}

/// A line between two boxes, before it is drawn.
struct Edge {
    src: RankId,
    dst: RankId,
    /// `None`: the pair only notifies.
    label: Option<(String, u64)>,
    replicated: bool,
    y_src: f64,
    y_dst: f64,
}

/// Spreads the edge ends of each box along its side, in the order of the far ends, so that the
/// lines of one box stay apart.
fn attach(edges: &mut [Edge], boxes: &[RankBox], far: &BTreeMap<RankId, f64>, prefill_end: bool) {
    let mut by_box: BTreeMap<RankId, Vec<usize>> = BTreeMap::new();
    for (i, e) in edges.iter().enumerate() {
        by_box.entry(if prefill_end { e.src } else { e.dst }).or_default().push(i);
    }
    for b in boxes {
        let Some(ix) = by_box.get_mut(&b.rank) else { continue };
        let other = |e: &Edge| far.get(&if prefill_end { e.dst } else { e.src }).copied().unwrap_or(0.0);
        ix.sort_by(|&a, &c| other(&edges[a]).total_cmp(&other(&edges[c])));
        let k = ix.len() as f64;
        for (j, &i) in ix.iter().enumerate() {
            // Inside the middle 70% of the box's height.
            let y = b.y + BOX_H * (0.15 + 0.7 * (j as f64 + 1.0) / (k + 1.0));
            if prefill_end {
                edges[i].y_src = y;
            } else {
                edges[i].y_dst = y;
            }
        }
    }
}

fn text(out: &mut String, x: f64, y: f64, attrs: &str, s: &str) {
    let _ = writeln!(out, r#"<text x="{x:.1}" y="{y:.1}"{attrs}>{}</text>"#, escape(s));
}

/// The head map of `plan` (a chunk of `topo`) as a standalone SVG document; `model` (a preset's
/// name) leads the title when given.
pub fn plan_svg(topo: &Topology, plan: &ChunkPlan, model: Option<&str>) -> String {
    let kv = topo.kv();
    let pages: u64 = plan.runs.iter().map(|r| u64::from(r.len)).sum();
    let total: u64 = plan.pairs.iter().map(|p| p.bytes()).sum();
    let moving = plan.pairs.iter().filter(|p| p.writes()).count();
    let desc = describe(topo);
    let (head, rest) = desc.split_once("; ").unwrap_or((desc.as_str(), ""));
    let title = [
        match model {
            Some(m) => format!("kvxfer plan: {m}, {head}"),
            None => format!("kvxfer plan: {head}"),
        },
        rest.to_owned(),
        format!(
            "chunk of {pages} pages ({} tokens): {} moving bytes of {}, {} in all",
            pages * u64::from(kv.page_size),
            plural(moving, "pair"),
            plural(plan.pairs.len(), "communicating pair"),
            human_bytes(total)
        ),
    ];

    let top = MARGIN + LINE_H * TITLE_LINES as f64 + 16.0;
    let (xl, xr) = (MARGIN, MARGIN + BOX_W + COL_GAP);
    let (mut left, mut lh, lb) = column(topo, plan, Side::Prefill, xl, top);
    let (mut right, mut rh, rb) = column(topo, plan, Side::Decode, xr, top);
    // Centre the shorter column on the taller one.
    let bottom = lb.max(rb);
    for (boxes, headers, b) in [(&mut left, &mut lh, lb), (&mut right, &mut rh, rb)] {
        let shift = ((bottom - b) / 2.0).floor();
        boxes.iter_mut().for_each(|x| x.y += shift);
        headers.iter_mut().for_each(|h| h.1 += shift);
    }
    let width = xr + BOX_W + MARGIN;
    let legend_top = bottom + 28.0;

    let centre =
        |boxes: &[RankBox]| -> BTreeMap<RankId, f64> { boxes.iter().map(|b| (b.rank, b.y + BOX_H / 2.0)).collect() };
    let (lc, rc) = (centre(&left), centre(&right));
    let dst_replicated = right.iter().any(|b| b.replicated);
    let mut edges: Vec<Edge> = plan
        .pairs
        .iter()
        .map(|p| Edge {
            src: p.src,
            dst: p.dst,
            label: p.slices.first().filter(|_| p.writes()).map(|s| (carried(topo, p.src, s.n, s.src_slot), p.bytes())),
            replicated: dst_replicated,
            y_src: lc.get(&p.src).copied().unwrap_or(top),
            y_dst: rc.get(&p.dst).copied().unwrap_or(top),
        })
        .collect();
    attach(&mut edges, &left, &rc, true);
    attach(&mut edges, &right, &lc, false);
    // Labels near the end whose column has more boxes: there the lines are furthest apart.
    let t = if left.len() >= right.len() { 0.27 } else { 0.73 };

    // Legend: sample strokes (their own classes, never `edge`) and what they mean, for what is drawn.
    let what = if kv.is_mla() { "the latent" } else { "the heads it carries (K and V)" };
    let any_edge = |replicated: bool| edges.iter().any(|e| e.label.is_some() && e.replicated == replicated);
    let legend = [
        (
            any_edge(false) || !any_edge(true),
            format!(r#"stroke="{EDGE}" stroke-width="1.6""#),
            format!("writes bytes; label: {what} and its bytes for this chunk"),
        ),
        (
            any_edge(true),
            format!(r#"stroke="{EDGE}" stroke-width="1.6" stroke-dasharray="7 4""#),
            "writes bytes that the decode side replicates: the same bytes also land on its other replicas".to_owned(),
        ),
        (
            edges.iter().any(|e| e.label.is_none()),
            format!(r#"stroke="{NOTIFY}" stroke-width="1" stroke-dasharray="1 4""#),
            "notifies only: a lower-ranked prefill replica writes these heads (or the chunk is empty)".to_owned(),
        ),
        (
            left.iter().chain(&right).any(|b| b.replicated),
            format!(r#"stroke="{INK}" stroke-width="1.2" stroke-dasharray="6 3""#),
            "dashed box: the rank holds heads that other ranks of its side hold too".to_owned(),
        ),
    ];
    let legend: Vec<_> = legend.into_iter().filter(|l| l.0).collect();
    let height = legend_top + LINE_H * legend.len() as f64 + MARGIN;

    let mut s = String::with_capacity(4096 + 600 * (plan.pairs.len() + left.len() + right.len()));
    let _ = writeln!(s, r#"<?xml version="1.0" encoding="UTF-8"?>"#);
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="12" fill="{INK}">"#
    );
    let _ = writeln!(s, "<title>{}</title>", escape(&format!("kvxfer plan: {desc}")));
    let _ = writeln!(s, r#"<rect x="0" y="0" width="{width:.0}" height="{height:.0}" fill="white"/>"#);
    for (i, line) in title.iter().enumerate() {
        let attrs = if i == 0 { r#" font-size="14" font-weight="bold""# } else { "" };
        text(&mut s, MARGIN, MARGIN + 12.0 + LINE_H * i as f64, attrs, line);
    }

    // Edges under the boxes, labels above everything.
    let (x1, x2) = (xl + BOX_W, xr);
    for e in &edges {
        let ends = format!(
            r#"data-src="{}" data-dst="{}" x1="{x1:.1}" y1="{:.1}" x2="{x2:.1}" y2="{:.1}""#,
            e.src, e.dst, e.y_src, e.y_dst
        );
        match &e.label {
            Some((_, bytes)) if e.replicated => {
                let _ = writeln!(
                    s,
                    r#"<line class="edge replicated" {ends} data-bytes="{bytes}" stroke="{EDGE}" stroke-width="1.6" stroke-dasharray="7 4"/>"#
                );
            }
            Some((_, bytes)) => {
                let _ = writeln!(
                    s,
                    r#"<line class="edge" {ends} data-bytes="{bytes}" stroke="{EDGE}" stroke-width="1.6"/>"#
                );
            }
            None => {
                let _ = writeln!(
                    s,
                    r#"<line class="notify" {ends} stroke="{NOTIFY}" stroke-width="1" stroke-dasharray="1 4"/>"#
                );
            }
        }
    }
    for (boxes, headers, fill) in [(&left, &lh, PREFILL_FILL), (&right, &rh, DECODE_FILL)] {
        for (x, y, h) in headers.iter() {
            text(&mut s, *x, *y, r#" font-weight="bold""#, h);
        }
        for b in boxes.iter() {
            let (class, dash) =
                if b.replicated { ("rank replicated", r#" stroke-dasharray="6 3""#) } else { ("rank", "") };
            let _ = writeln!(s, r#"<g class="{class}" data-rank="{}">"#, b.rank);
            let _ = writeln!(
                s,
                r#"<rect x="{:.1}" y="{:.1}" width="{BOX_W:.0}" height="{BOX_H:.0}" rx="5" fill="{fill}" stroke="{INK}" stroke-width="1.2"{dash}/>"#,
                b.x, b.y
            );
            for (i, line) in b.lines.iter().enumerate() {
                let attrs = if i == 0 { r#" font-weight="bold""# } else { "" };
                text(&mut s, b.x + 8.0, b.y + 17.0 + LINE_H * i as f64, attrs, line);
            }
            s.push_str("</g>\n");
        }
    }
    for e in &edges {
        if let Some((heads, bytes)) = &e.label {
            let (x, y) = (x1 + (x2 - x1) * t, e.y_src + (e.y_dst - e.y_src) * t);
            let label = format!("{heads}: {}", human_bytes(*bytes));
            // A white plate under the label (about 6.2 px per character at 11 px).
            let w = label.chars().count() as f64 * 6.2 + 8.0;
            let _ = writeln!(
                s,
                r#"<rect class="edge-plate" x="{:.1}" y="{:.1}" width="{w:.1}" height="15" rx="3" fill="white" fill-opacity="0.9"/>"#,
                x - w / 2.0,
                y - 7.5
            );
            text(&mut s, x, y + 4.0, r#" class="edge-label" text-anchor="middle" font-size="11""#, &label);
        }
    }

    for (i, (_, stroke, what)) in legend.iter().enumerate() {
        let y = legend_top + LINE_H * i as f64;
        let _ = writeln!(
            s,
            r#"<line class="legend-key" x1="{MARGIN:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" {stroke}/>"#,
            y - 4.0,
            MARGIN + 40.0,
            y - 4.0
        );
        text(&mut s, MARGIN + 50.0, y, "", what);
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use kvxfer_core::plan::plan_chunk;
    use kvxfer_core::{KvSpec, Layout, Parallel, SideSpec};

    use super::*;

    fn topo(attention: Attention, layers: u32, p: (u32, u32), d: (u32, u32)) -> Topology {
        let kv = KvSpec { attention, layers, dtype_bytes: 2, page_size: 16, layout: Layout::Nhd };
        Topology::new(
            &SideSpec { kv, parallel: Parallel::new(p.0, p.1) },
            &SideSpec { kv, parallel: Parallel::new(d.0, d.1) },
        )
        .unwrap()
    }

    fn gqa(h: u32) -> Attention {
        Attention::Gqa { kv_heads: h, head_dim_k: 128, head_dim_v: 128 }
    }

    fn count(svg: &str, needle: &str) -> usize {
        svg.matches(needle).count()
    }

    #[test]
    fn escapes_markup() {
        assert_eq!(escape(r#"a<b & "c" 'd'>"#), "a&lt;b &amp; &quot;c&quot; &apos;d&apos;&gt;");
        assert_eq!(escape("heads 0-3: 1.00 MiB"), "heads 0-3: 1.00 MiB");
    }

    #[test]
    fn one_edge_per_moving_pair_with_its_bytes() {
        let t = topo(gqa(8), 80, (8, 1), (2, 1));
        let plan = plan_chunk(&t, &[0, 1, 2, 3], &[4, 5, 6, 7]).unwrap();
        let svg = plan_svg(&t, &plan, None);
        assert!(svg.starts_with("<?xml") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(count(&svg, r#"<line class="edge""#), 8);
        assert_eq!(count(&svg, r#"class="notify""#), 0);
        assert_eq!(count(&svg, r#"class="rank""#), 10);
        assert_eq!(count(&svg, "replicated on"), 0);
        // Prefill rank 5 holds head 5 and writes it into decode rank 1 (slot 1 of 4 there):
        // 80 layers x 4 pages x 16 tokens x (K + V) x 256 bytes = 2.5 MiB.
        let bytes = 80 * 4 * 16 * 2 * 256;
        assert!(svg.contains(r#"data-src="5/0" data-dst="1/0" x1"#), "{svg}");
        assert!(svg.contains(&format!(r#"data-bytes="{bytes}""#)));
        assert!(svg.contains(">head 5: 2.50 MiB</text>"), "{svg}");
        assert!(svg.contains(">KV heads 4-7</text>"), "{svg}");
    }

    #[test]
    fn replicas_are_marked_and_notify_only_pairs_are_not_edges() {
        // H=2, P=8 -> D=4: each head on 4 prefill and 2 decode ranks; of each decode rank's two
        // senders, the lower writes and the other only notifies.
        let t = topo(gqa(2), 4, (8, 1), (4, 1));
        let plan = plan_chunk(&t, &[0], &[0]).unwrap();
        let svg = plan_svg(&t, &plan, None);
        assert_eq!(count(&svg, r#"<line class="edge replicated""#), 4);
        assert_eq!(count(&svg, r#"<line class="notify""#), 4);
        assert_eq!(count(&svg, r#"class="rank replicated""#), 12);
        assert!(svg.contains("KV head 1, replicated on 4 ranks"), "{svg}");
        assert!(svg.contains("KV head 0, replicated on 2 ranks"), "{svg}");
        assert!(svg.contains("notifies 1 decode rank; a replica writes"), "{svg}");
    }

    #[test]
    fn mla_and_pipeline_stages() {
        let t = topo(Attention::Mla { latent_dim: 576 }, 61, (4, 1), (2, 1));
        let plan = plan_chunk(&t, &[0, 1], &[2, 3]).unwrap();
        let svg = plan_svg(&t, &plan, None);
        assert_eq!(count(&svg, r#"<line class="edge"#), 2);
        assert!(svg.contains("MLA latent (576), replicated on 4 ranks"));
        assert!(svg.contains("no receiver: a replica sends the same data"));
        assert!(svg.contains(">latent: "));

        let t = topo(gqa(8), 8, (2, 2), (2, 2));
        let plan = plan_chunk(&t, &[0], &[1]).unwrap();
        let svg = plan_svg(&t, &plan, None);
        assert_eq!(count(&svg, r#"<line class="edge""#), 4);
        assert!(svg.contains(">prefill stage 1: layers 4-7</text>"), "{svg}");
        assert!(svg.contains(">decode tp 1, pp 1</text>"), "{svg}");
        assert!(svg.contains(r#"data-src="1/1" data-dst="1/1""#), "{svg}");
    }

    #[test]
    fn an_empty_chunk_moves_nothing_and_still_draws() {
        let t = topo(gqa(8), 2, (2, 1), (2, 1));
        let plan = plan_chunk(&t, &[], &[]).unwrap();
        let svg = plan_svg(&t, &plan, None);
        assert_eq!(count(&svg, r#"class="edge"#), 0);
        assert_eq!(count(&svg, r#"<line class="notify""#), 2);
    }
}
