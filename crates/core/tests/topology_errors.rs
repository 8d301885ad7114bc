//! Every invalid configuration gets its specific error, naming the numbers.

use kvxfer_core::{Attention, ConfigError, KvSpec, Layout, Parallel, Side, SideSpec, Topology};

fn side(h: u32, hk: u32, hv: u32, layers: u32, page: u32, dtype: u32, layout: Layout, tp: u32, pp: u32) -> SideSpec {
    SideSpec {
        kv: KvSpec {
            attention: Attention::Gqa { kv_heads: h, head_dim_k: hk, head_dim_v: hv },
            layers,
            dtype_bytes: dtype,
            page_size: page,
            layout,
        },
        parallel: Parallel::new(tp, pp),
    }
}

fn ok(tp: u32, pp: u32) -> SideSpec {
    side(8, 128, 128, 8, 16, 2, Layout::Nhd, tp, pp)
}

#[test]
fn heads_and_tp_must_divide() {
    let e = Topology::new(&side(8, 128, 128, 8, 16, 2, Layout::Nhd, 3, 1), &ok(1, 1)).unwrap_err();
    assert_eq!(e, ConfigError::HeadsNotDivisible { side: Side::Prefill, kv_heads: 8, tp: 3 });
    assert!(e.to_string().contains("TP size 3") && e.to_string().contains("8 KV heads"), "{e}");
    let e = Topology::new(&ok(1, 1), &side(8, 128, 128, 8, 16, 2, Layout::Nhd, 12, 1)).unwrap_err();
    assert_eq!(e, ConfigError::HeadsNotDivisible { side: Side::Decode, kv_heads: 8, tp: 12 });
}

#[test]
fn tp_ratio_must_be_an_integer() {
    let a = side(12, 8, 8, 8, 16, 2, Layout::Nhd, 4, 1);
    let b = side(12, 8, 8, 8, 16, 2, Layout::Nhd, 6, 1);
    let e = Topology::new(&a, &b).unwrap_err();
    assert_eq!(e, ConfigError::TpRatio { prefill_tp: 4, decode_tp: 6 });
    assert!(e.to_string().contains("prefill TP 4") && e.to_string().contains("decode TP 6"));
}

#[test]
fn decode_pp_is_one_or_prefill_pp() {
    let e = Topology::new(&ok(2, 2), &ok(2, 4)).unwrap_err();
    assert_eq!(e, ConfigError::PpMismatch { prefill_pp: 2, decode_pp: 4 });
    assert!(Topology::new(&ok(2, 4), &ok(2, 1)).is_ok());
    assert!(Topology::new(&ok(2, 4), &ok(2, 4)).is_ok());
}

#[test]
fn layers_split_evenly_over_pp() {
    let e =
        Topology::new(&side(8, 128, 128, 9, 16, 2, Layout::Nhd, 1, 2), &side(8, 128, 128, 9, 16, 2, Layout::Nhd, 1, 1))
            .unwrap_err();
    assert_eq!(e, ConfigError::LayersNotDivisible { side: Side::Prefill, layers: 9, pp: 2 });
}

#[test]
fn every_mismatch_is_reported_with_both_values() {
    let a = side(8, 128, 128, 8, 16, 2, Layout::Nhd, 1, 1);
    let b = side(4, 64, 96, 16, 32, 1, Layout::Hnd, 1, 1);
    let ConfigError::Mismatch(ms) = Topology::new(&a, &b).unwrap_err() else { panic!("expected mismatch") };
    let fields: Vec<_> = ms.iter().map(|m| m.field).collect();
    assert_eq!(fields, ["page_size", "dtype_bytes", "layers", "layout", "kv_heads", "head_dim_k", "head_dim_v"]);
    let text = ConfigError::Mismatch(ms).to_string();
    assert!(text.contains("page_size differs (prefill 16, decode 32)"), "{text}");
    let mla = SideSpec { kv: KvSpec { attention: Attention::Mla { latent_dim: 576 }, ..a.kv }, parallel: a.parallel };
    let ConfigError::Mismatch(ms) = Topology::new(&a, &mla).unwrap_err() else { panic!() };
    assert_eq!(ms[0].field, "attention");
}

#[test]
fn zero_sizes_are_rejected() {
    for (s, what) in [
        (side(8, 128, 128, 8, 16, 2, Layout::Nhd, 0, 1), "TP size"),
        (side(8, 128, 128, 8, 16, 2, Layout::Nhd, 1, 0), "PP size"),
        (side(0, 128, 128, 8, 16, 2, Layout::Nhd, 1, 1), "KV heads"),
        (side(8, 0, 128, 8, 16, 2, Layout::Nhd, 1, 1), "K head dim"),
        (side(8, 128, 128, 8, 0, 2, Layout::Nhd, 1, 1), "page size"),
    ] {
        let mut d = s;
        d.parallel = Parallel::new(1, 1);
        assert_eq!(Topology::new(&s, &d).unwrap_err(), ConfigError::Zero { side: Side::Prefill, what });
    }
}
