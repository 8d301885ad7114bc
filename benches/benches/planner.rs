//! Planner bench: `plan_chunk` and the iteration of every op for a 128k-token Llama-3-70B request.
//!
//! `cargo bench -p kvxfer-benches --bench planner -- --warm-up-time 1 --measurement-time 3`
//! Before timing, prints per case: pairs, the plan's op count, and the one-op-per-token count.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, SamplingMode};
use kvxfer_benches::{llama70b_topology, one_op_per_token, page_lists, PAGES, TOKENS};
use kvxfer_core::plan::{page_runs, plan_chunk};
use kvxfer_core::{Layout, Topology};

struct Case {
    name: String,
    topo: Topology,
    src: Vec<u32>,
    dst: Vec<u32>,
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for (p, d) in [(8, 2), (2, 8), (8, 8)] {
        for layout in [Layout::Nhd, Layout::Hnd] {
            for shuffled in [false, true] {
                let topo = llama70b_topology(p, d, layout).expect("Llama-3-70B shapes are valid");
                let (src, dst) = page_lists(PAGES, shuffled);
                let pages = if shuffled { "shuffled" } else { "contiguous" };
                out.push(Case { name: format!("P{p}-D{d}/{layout}/{pages}"), topo, src, dst });
            }
        }
    }
    out
}

fn print_counts(cases: &[Case]) {
    eprintln!();
    eprintln!("Llama-3-70B request: 80 layers, H=8, head_dim 128, bf16, page size 16, {TOKENS} tokens ({PAGES} pages)");
    eprintln!(
        "{:<28} {:>6} {:>6} {:>12} {:>16} {:>10} {:>10}",
        "case", "pairs", "runs", "ops", "one-op-per-token", "ratio", "GiB"
    );
    for c in cases {
        let plan = plan_chunk(&c.topo, &c.src, &c.dst).expect("valid chunk");
        let ops = plan.op_count();
        let iterated: u64 = plan.pairs.iter().map(|p| p.ops().count() as u64).sum();
        assert_eq!(ops, iterated, "op_count disagrees with ops()");
        let per_token = one_op_per_token(&c.topo, &plan);
        let bytes: u64 = plan.pairs.iter().map(|p| p.bytes()).sum();
        eprintln!(
            "{:<28} {:>6} {:>6} {:>12} {:>16} {:>9.0}x {:>10.2}",
            c.name,
            plan.pairs.len(),
            plan.runs.len(),
            ops,
            per_token,
            per_token as f64 / ops as f64,
            bytes as f64 / (1u64 << 30) as f64
        );
    }
    eprintln!();
}

fn planner(c: &mut Criterion) {
    let cases = cases();
    print_counts(&cases);

    let mut g = c.benchmark_group("plan_chunk");
    for case in &cases {
        g.bench_with_input(BenchmarkId::from_parameter(&case.name), case, |b, case| {
            b.iter(|| plan_chunk(black_box(&case.topo), black_box(&case.src), black_box(&case.dst)).unwrap())
        });
    }
    g.finish();

    // The page-list half of plan_chunk alone (coalescing into runs plus the duplicate-destination check).
    let mut g = c.benchmark_group("page_runs");
    for shuffled in [false, true] {
        let (src, dst) = page_lists(PAGES, shuffled);
        let name = if shuffled { "shuffled" } else { "contiguous" };
        g.bench_function(name, |b| b.iter(|| page_runs(black_box(&src), black_box(&dst)).unwrap()));
    }
    g.finish();

    // Every op of every pair, as a backend walks them (the plan built once, outside the timing).
    let mut g = c.benchmark_group("iterate_ops");
    g.sample_size(10).sampling_mode(SamplingMode::Flat);
    for case in &cases {
        let plan = plan_chunk(&case.topo, &case.src, &case.dst).unwrap();
        g.bench_with_input(BenchmarkId::from_parameter(&case.name), &plan, |b, plan| {
            b.iter(|| {
                let mut acc = 0u64;
                for pair in &plan.pairs {
                    for op in pair.ops() {
                        acc = acc.wrapping_add(op.src_offset ^ op.dst_offset).wrapping_add(op.len * op.count);
                    }
                }
                black_box(acc)
            })
        });
    }
    g.finish();
}

// What `criterion_group!`/`criterion_main!` expand to, without their undocumented `pub fn`.
fn main() {
    let mut c = Criterion::default().configure_from_args();
    planner(&mut c);
    c.final_summary();
}
