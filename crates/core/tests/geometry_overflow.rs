//! Issue 10, defect 8: geometry sizes whose byte counts overflow 64 bits are refused by `Topology::new`
//! with a `ConfigError` that names the values, never accepted to panic (debug) or wrap (release) later.

use kvxfer_core::{Attention, ConfigError, KvKind, KvSpec, Layout, Parallel, Side, SideSpec, Topology};

const M: u32 = u32::MAX;

fn gqa(h: u32, hk: u32, hv: u32, layers: u32, page: u32, dtype: u32, tp: u32, pp: u32) -> SideSpec {
    SideSpec {
        kv: KvSpec {
            attention: Attention::Gqa { kv_heads: h, head_dim_k: hk, head_dim_v: hv },
            layers,
            dtype_bytes: dtype,
            page_size: page,
            layout: Layout::Nhd,
        },
        parallel: Parallel::new(tp, pp),
    }
}

fn mla(latent: u32, layers: u32, page: u32, dtype: u32) -> SideSpec {
    SideSpec {
        kv: KvSpec {
            attention: Attention::Mla { latent_dim: latent },
            layers,
            dtype_bytes: dtype,
            page_size: page,
            layout: Layout::Nhd,
        },
        parallel: Parallel::new(1, 1),
    }
}

/// Every case overflows some byte size of the cache; `names` are values the error must show.
fn overflowing() -> Vec<(&'static str, SideSpec, Vec<String>)> {
    vec![
        ("head_dim_k u32::MAX", gqa(8, M, 128, 8, 16, 2, 1, 1), vec![M.to_string()]),
        ("head_dim_v u32::MAX", gqa(8, 128, M, 8, 16, 2, 1, 1), vec![M.to_string()]),
        ("dtype_bytes u32::MAX", gqa(8, 128, 128, 8, 16, M, 1, 1), vec![M.to_string()]),
        ("page_size u32::MAX", gqa(8, 128, 128, 8, M, 2, 1, 1), vec![M.to_string()]),
        ("kv_heads u32::MAX", gqa(M, 128, 128, 8, 16, 2, 1, 1), vec![M.to_string()]),
        ("everything u32::MAX", gqa(M, M, M, M, M, M, 1, 1), vec![M.to_string()]),
        ("latent_dim u32::MAX", mla(M, 8, 16, 2), vec![M.to_string()]),
        ("latent and dtype u32::MAX", mla(M, 61, 1, M), vec![M.to_string()]),
        // Each rank's page of one layer fits, but the model's KV per token does not (2^15 heads x 2^32
        // bytes per head for K and V x 2^31 layers).
        ("layers x heads", gqa(1 << 15, 1 << 30, 1 << 30, 1 << 31, 1, 2, 1 << 15, 1), vec![(1u32 << 31).to_string()]),
        // KV per token fits (2^50 bytes), a page of 2^16 tokens of it does not.
        (
            "page x layers",
            gqa(1 << 15, 1 << 14, 1 << 14, 1 << 20, 1 << 16, 1, 1 << 15, 1),
            vec![(1u32 << 16).to_string()],
        ),
    ]
}

#[test]
fn overflowing_geometries_are_refused_with_the_values() {
    for (name, s, names) in overflowing() {
        // Both sides share the KV spec; the prefill side is checked first.
        let r = std::panic::catch_unwind(|| Topology::new(&s, &s));
        let Ok(r) = r else { panic!("{name}: Topology::new panicked") };
        let e = match r {
            Ok(t) => {
                let sizes = std::panic::catch_unwind(|| {
                    t.kv().kinds().iter().map(|k| t.buffer_bytes(Side::Prefill, *k, M)).collect::<Vec<_>>()
                });
                panic!("{name}: accepted; buffer sizes for u32::MAX pages: {sizes:?}")
            }
            Err(e) => e,
        };
        let ConfigError::SizeOverflow { side, .. } = &e else { panic!("{name}: {e:?}") };
        assert_eq!(*side, Side::Prefill, "{name}: {e}");
        let text = e.to_string();
        for v in &names {
            assert!(text.contains(v.as_str()), "{name}: error does not name {v}: {text}");
        }
        assert!(text.contains("check these sizes"), "{name}: {text}");
    }
}

/// A side is checked with its own local heads: prefill TP 8 holds one of 8 heads per rank (a page of 2^31
/// bytes per layer), decode TP 1 holds all 8 (2^34 bytes), which is refused on the decode side.
#[test]
fn each_side_is_checked_with_its_own_heads() {
    let p = gqa(8, 1 << 30, 1 << 30, 2, 1, 2, 8, 1);
    let d = gqa(8, 1 << 30, 1 << 30, 2, 1, 2, 1, 1);
    let e = Topology::new(&p, &d).unwrap_err();
    assert!(matches!(e, ConfigError::SizeOverflow { side: Side::Decode, .. }), "{e:?}");
    assert!(e.to_string().contains("local heads 8") && e.to_string().contains("head_dim_k 1073741824"), "{e}");
    assert!(Topology::new(&p, &p).is_ok());
}

/// Page counts: the buffer of one layer and the pool of one rank, checked, for page counts up to u32::MAX.
#[test]
fn buffer_and_pool_sizes_are_checked_for_every_page_count() {
    // One rank's page of one layer is exactly 2^32 bytes: the largest accepted.
    let big = gqa(1, 1 << 15, 1 << 15, 4, 1 << 16, 2, 1, 1);
    let t = Topology::new(&big, &big).unwrap();
    assert_eq!(t.checked_buffer_bytes(Side::Decode, KvKind::K, M), Ok(u64::from(M) << 32));
    assert_eq!(t.buffer_bytes(Side::Decode, KvKind::V, M), u64::from(M) << 32);
    assert_eq!(t.checked_pool_bytes(Side::Decode, 0, 1), Ok(8 << 32));
    let cases: [(u32, bool); 5] = [(0, true), (1, true), ((1 << 29) - 1, true), (1 << 29, false), (M, false)];
    for (pages, fits) in cases {
        let r = t.checked_pool_bytes(Side::Prefill, 0, pages);
        assert_eq!(r.is_ok(), fits, "{pages} pages: {r:?}");
        if let Err(e) = r {
            assert!(matches!(e, ConfigError::SizeOverflow { side: Side::Prefill, .. }), "{e:?}");
            assert!(e.to_string().contains(&format!("pages {pages}")), "{e}");
        }
    }
    // One page more per layer than that is refused.
    let over = gqa(1, (1 << 15) + 1, 1 << 15, 4, 1 << 16, 2, 1, 1);
    let e = Topology::new(&over, &over).unwrap_err();
    assert!(e.to_string().contains("head_dim_k 32769"), "{e}");
}

/// The edge that is still accepted: any page count then has a buffer size, without overflow.
#[test]
fn accepted_geometries_have_a_buffer_size_for_any_page_count() {
    let cases = [
        gqa(8, 128, 128, 8, 16, 2, 1, 1),
        gqa(1, 1 << 15, 1 << 15, 1, 1 << 16, 2, 1, 1),
        gqa(8, 128, 128, 61, 1, 2, 8, 1),
        mla(576, 61, 64, 2),
        gqa(8, 128, 128, M - M % 3, 1, 1, 1, 3),
    ];
    for s in cases {
        let t = Topology::new(&s, &s).unwrap_or_else(|e| panic!("{s:?}: {e}"));
        for side in [Side::Prefill, Side::Decode] {
            for k in t.kv().kinds() {
                let b = std::panic::catch_unwind(|| t.buffer_bytes(side, *k, M));
                assert!(b.is_ok(), "{s:?}: buffer_bytes({side}, {k}, u32::MAX) panicked");
            }
        }
        let _ = t.kv().bytes_per_token();
    }
}
