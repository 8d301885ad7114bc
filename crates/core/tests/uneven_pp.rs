//! Uneven pipeline stages (SEMANTICS §1): explicit per-side layer partitions, their validation (each error
//! names the numbers), the stage ranges they give, pool sizes per stage, and their serialized form.

use kvxfer_core::plan::plan_chunk;
use kvxfer_core::{
    Attention, ConfigError, KvKind, KvSpec, LayerPartition, Layout, Parallel, RankId, Side, SideSpec, Topology,
    MAX_PARTITION_STAGES,
};

fn kv(layers: u32) -> KvSpec {
    KvSpec {
        attention: Attention::Gqa { kv_heads: 8, head_dim_k: 128, head_dim_v: 128 },
        layers,
        dtype_bytes: 2,
        page_size: 16,
        layout: Layout::Nhd,
    }
}

fn even(layers: u32, tp: u32, pp: u32) -> SideSpec {
    SideSpec { kv: kv(layers), parallel: Parallel::new(tp, pp) }
}

/// `pp` stages with an explicit partition (which may not fit: that is what the errors test).
fn split(layers: u32, tp: u32, pp: u32, stages: &[u32]) -> SideSpec {
    let parallel = Parallel { layer_partition: Some(LayerPartition::new(stages).unwrap()), ..Parallel::new(tp, pp) };
    SideSpec { kv: kv(layers), parallel }
}

fn deepseek_v3(tp: u32, stages: &[u32]) -> SideSpec {
    SideSpec {
        kv: KvSpec {
            attention: Attention::Mla { latent_dim: 576 },
            layers: 61,
            dtype_bytes: 2,
            page_size: 64,
            layout: Layout::Nhd,
        },
        parallel: Parallel::with_stage_layers(tp, stages).unwrap(),
    }
}

#[test]
fn deepseek_v3_61_layers_on_prefill_pp2() {
    // The even split refuses 61 over 2, and says an explicit partition is possible.
    let e = Topology::new(&SideSpec { parallel: Parallel::new(8, 2), ..deepseek_v3(8, &[61]) }, &deepseek_v3(8, &[61]))
        .unwrap_err();
    assert_eq!(e, ConfigError::LayersNotDivisible { side: Side::Prefill, layers: 61, pp: 2 });
    let text = e.to_string();
    assert!(
        text.contains("61 layers cannot be split evenly over PP 2") && text.contains("explicit layer partition"),
        "{text}"
    );

    // [31, 30] into decode PP 1: stage 1's layer 0 lands at decode layer 31.
    let topo = Topology::new(&deepseek_v3(8, &[31, 30]), &deepseek_v3(4, &[61])).unwrap();
    assert_eq!(topo.layer_partition(Side::Prefill), [31, 30]);
    assert_eq!(topo.layer_partition(Side::Decode), [61]);
    assert_eq!((topo.stage_layers(Side::Prefill, 0), topo.stage_layers(Side::Prefill, 1)), (31, 30));
    assert_eq!(topo.stage_range(Side::Prefill, 1), 31..61);
    assert_eq!(topo.stage_layers(Side::Decode, 0), 61);
    assert_eq!((topo.dst_layer_offset(0), topo.dst_layer_offset(1)), (0, 31));
    let plan = plan_chunk(&topo, &[3, 4, 9], &[0, 1, 2]).unwrap();
    let by_stage = |s: u32| plan.pairs.iter().filter(move |p| p.src.pp == s);
    assert!(by_stage(0).all(|p| p.layers == 31 && p.dst_layer_offset == 0));
    assert!(by_stage(1).all(|p| p.layers == 30 && p.dst_layer_offset == 31));
    let last = by_stage(1).flat_map(|p| p.ops().collect::<Vec<_>>()).map(|o| o.dst_region.layer).max();
    assert_eq!(last, Some(60));
    // Every decode rank hears from one sender per stage, with distinct keys.
    for r in topo.ranks(Side::Decode) {
        assert_eq!(topo.expected_senders(r).len(), 2);
    }

    // The same partition on both sides with equal PP.
    let topo = Topology::new(&deepseek_v3(8, &[31, 30]), &deepseek_v3(4, &[31, 30])).unwrap();
    assert_eq!(topo.layer_partition(Side::Decode), [31, 30]);
    assert_eq!((topo.dst_layer_offset(0), topo.dst_layer_offset(1)), (0, 0));
    assert_eq!(topo.receivers(RankId::new(0, 1))[0].pp, 1);
}

#[test]
fn partition_length_must_equal_pp() {
    for (pp, stages) in [(2u32, &[2u32, 2, 1][..]), (3, &[3, 2]), (2, &[]), (1, &[4, 1])] {
        let e = Topology::new(&split(5, 1, pp, stages), &even(5, 1, 1)).unwrap_err();
        assert_eq!(e, ConfigError::PartitionLength { side: Side::Prefill, partition: stages.to_vec(), pp });
        let text = e.to_string();
        assert!(text.contains(&format!("names {} stage(s) but PP is {pp}", stages.len())), "{text}");
    }
    // Decode side, its own name.
    let e = Topology::new(&even(4, 1, 2), &split(4, 1, 1, &[2, 2])).unwrap_err();
    assert_eq!(e, ConfigError::PartitionLength { side: Side::Decode, partition: vec![2, 2], pp: 1 });
    assert!(e.to_string().starts_with("decode: layer partition [2, 2] names 2 stage(s) but PP is 1"), "{e}");
}

#[test]
fn partition_must_sum_to_the_layer_count() {
    let e = Topology::new(&split(61, 1, 2, &[31, 31]), &even(61, 1, 1)).unwrap_err();
    assert_eq!(e, ConfigError::PartitionSum { side: Side::Prefill, partition: vec![31, 31], sum: 62, layers: 61 });
    assert_eq!(e.to_string(), "prefill: layer partition [31, 31] sums to 62 layers but the model has 61");
    let e = Topology::new(&split(8, 1, 2, &[3, 4]), &even(8, 1, 1)).unwrap_err();
    assert!(matches!(e, ConfigError::PartitionSum { sum: 7, layers: 8, .. }), "{e:?}");
    // Counts whose sum overflows a u32 are a sum error, not a wrap-around.
    let e = Topology::new(&split(4, 1, 2, &[u32::MAX, 5]), &even(4, 1, 1)).unwrap_err();
    assert_eq!(
        e,
        ConfigError::PartitionSum {
            side: Side::Prefill,
            partition: vec![u32::MAX, 5],
            sum: u64::from(u32::MAX) + 5,
            layers: 4
        }
    );
}

#[test]
fn every_stage_owns_a_layer() {
    let e = Topology::new(&split(5, 1, 3, &[3, 0, 2]), &even(5, 1, 1)).unwrap_err();
    assert_eq!(e, ConfigError::EmptyStage { side: Side::Prefill, partition: vec![3, 0, 2], stage: 1 });
    let text = e.to_string();
    assert!(text.contains("stage 1 of layer partition [3, 0, 2] has 0 layers"), "{text}");
    // Even when the counts still sum to the layers.
    let e = Topology::new(&split(5, 1, 2, &[5, 0]), &even(5, 1, 1)).unwrap_err();
    assert_eq!(e, ConfigError::EmptyStage { side: Side::Prefill, partition: vec![5, 0], stage: 1 });
}

#[test]
fn equal_pp_needs_identical_partitions() {
    // Explicit against explicit.
    let e = Topology::new(&split(5, 2, 2, &[3, 2]), &split(5, 2, 2, &[2, 3])).unwrap_err();
    assert_eq!(e, ConfigError::PartitionMismatch { pp: 2, prefill: vec![3, 2], decode: vec![2, 3] });
    let text = e.to_string();
    assert!(
        text.contains("prefill layer partition [3, 2] and decode layer partition [2, 3] differ")
            && text.contains("PP 2"),
        "{text}"
    );
    // Explicit against the even split: the error shows the even split's counts.
    let e = Topology::new(&split(6, 1, 3, &[1, 2, 3]), &even(6, 1, 3)).unwrap_err();
    assert_eq!(e, ConfigError::PartitionMismatch { pp: 3, prefill: vec![1, 2, 3], decode: vec![2, 2, 2] });
    let e = Topology::new(&even(4, 1, 2), &split(4, 1, 2, &[1, 3])).unwrap_err();
    assert_eq!(e, ConfigError::PartitionMismatch { pp: 2, prefill: vec![2, 2], decode: vec![1, 3] });
    // Explicit counts equal to the even split are the even split: the same topology either way.
    let topo = Topology::new(&split(6, 1, 3, &[2, 2, 2]), &even(6, 1, 3)).unwrap();
    assert_eq!(topo.layer_partition(Side::Decode), [2, 2, 2]);
    assert_eq!(topo, Topology::new(&even(6, 1, 3), &split(6, 1, 3, &[2, 2, 2])).unwrap());
    assert_eq!(topo, Topology::new(&even(6, 1, 3), &even(6, 1, 3)).unwrap());
    assert_eq!(topo.parallel(Side::Prefill).layer_partition, None);
    let one = Topology::new(&split(6, 1, 3, &[1, 2, 3]), &split(6, 1, 1, &[6])).unwrap();
    assert_eq!(one, Topology::new(&split(6, 1, 3, &[1, 2, 3]), &even(6, 1, 1)).unwrap());
    assert_eq!(one.parallel(Side::Prefill).layer_partition, Some(LayerPartition::new(&[1, 2, 3]).unwrap()));
    // Decode PP 1 takes any prefill partition; decode PP that is neither 1 nor prefill PP is still refused.
    assert!(Topology::new(&split(6, 1, 3, &[1, 2, 3]), &even(6, 1, 1)).is_ok());
    let e = Topology::new(&split(6, 1, 3, &[1, 2, 3]), &split(6, 1, 2, &[3, 3])).unwrap_err();
    assert_eq!(e, ConfigError::PpMismatch { prefill_pp: 3, decode_pp: 2 });
}

#[test]
fn without_a_partition_the_even_split_is_unchanged() {
    let topo = Topology::new(&even(8, 2, 4), &even(8, 1, 1)).unwrap();
    assert_eq!(topo.layer_partition(Side::Prefill), [2, 2, 2, 2]);
    assert_eq!((0..4).map(|s| topo.first_layer(Side::Prefill, s)).collect::<Vec<_>>(), [0, 2, 4, 6]);
    assert_eq!((0..4).map(|s| topo.dst_layer_offset(s)).collect::<Vec<_>>(), [0, 2, 4, 6]);
    // Outside the side: no layers, and the first layer past the last stage is the layer count.
    assert_eq!(topo.stage_layers(Side::Prefill, 4), 0);
    assert_eq!(topo.first_layer(Side::Prefill, 4), 8);
    assert_eq!(topo.stage_range(Side::Prefill, 9), 8..8);
    let e = Topology::new(&even(9, 1, 2), &even(9, 1, 1)).unwrap_err();
    assert_eq!(e, ConfigError::LayersNotDivisible { side: Side::Prefill, layers: 9, pp: 2 });
}

#[test]
fn pool_bytes_follow_the_stage() {
    let topo = Topology::new(&split(61, 8, 2, &[31, 30]), &even(61, 8, 1)).unwrap();
    // One rank holds 1 head of 128 bf16 elements per K and per V: 512 bytes per token per layer.
    let per_layer = 16 * 2 * 128 * 2;
    assert_eq!(topo.checked_pool_bytes(Side::Prefill, 0, 1), Ok(31 * per_layer));
    assert_eq!(topo.checked_pool_bytes(Side::Prefill, 1, 1), Ok(30 * per_layer));
    assert_eq!(topo.checked_pool_bytes(Side::Decode, 0, 1), Ok(61 * per_layer));
    assert_eq!(topo.buffer_bytes(Side::Prefill, KvKind::K, 1) * 2 * 30, 30 * per_layer);
}

#[test]
fn partition_capacity_is_bounded_and_named() {
    let many = vec![1u32; MAX_PARTITION_STAGES + 1];
    let e = LayerPartition::new(&many).unwrap_err();
    assert_eq!(
        e,
        ConfigError::TooLarge {
            what: "stages of an explicit layer partition",
            value: MAX_PARTITION_STAGES as u64 + 1,
            max: MAX_PARTITION_STAGES as u64,
        }
    );
    assert!(Parallel::with_stage_layers(1, &many).is_err());
    // The largest accepted partition works end to end.
    let max = vec![1u32; MAX_PARTITION_STAGES];
    let p = Parallel::with_stage_layers(1, &max).unwrap();
    assert_eq!(p.pp as usize, MAX_PARTITION_STAGES);
    let side = SideSpec { kv: kv(MAX_PARTITION_STAGES as u32), parallel: p };
    let topo = Topology::new(&side, &side).unwrap();
    assert_eq!(topo.first_layer(Side::Decode, 63), 63);
}

#[test]
fn serialized_form_is_compatible() {
    // Written without a partition: no new key, and old JSON (no key) parses to the even split.
    let old = r#"{"kv":{"attention":{"type":"gqa","kv_heads":8,"head_dim_k":128,"head_dim_v":128},"layers":8,"dtype_bytes":2,"page_size":16,"layout":"nhd"},"parallel":{"tp":2,"pp":2}}"#;
    let s: SideSpec = serde_json::from_str(old).unwrap();
    assert_eq!(s, even(8, 2, 2));
    assert_eq!(serde_json::to_string(&s).unwrap(), old);
    // With a partition: an array of counts, round trip.
    let s = split(61, 8, 2, &[31, 30]);
    let json = serde_json::to_string(&s.parallel).unwrap();
    assert_eq!(json, r#"{"tp":8,"pp":2,"layer_partition":[31,30]}"#);
    assert_eq!(serde_json::from_str::<Parallel>(&json).unwrap(), s.parallel);
    // A peer cannot send more stages than a partition holds.
    let long = format!(r#"{{"tp":1,"pp":65,"layer_partition":[{}]}}"#, vec!["1"; 65].join(","));
    let e = serde_json::from_str::<Parallel>(&long).unwrap_err();
    assert!(e.to_string().contains("at most 64"), "{e}");
    assert!(serde_json::from_str::<Parallel>(r#"{"tp":1,"pp":1,"layer_partition":[-1]}"#).is_err());
    // Equality and hashing look at the named counts only.
    let a = LayerPartition::new(&[3, 2]).unwrap();
    assert_eq!(a, LayerPartition::try_from(&[3u32, 2][..]).unwrap());
    assert_ne!(a, LayerPartition::new(&[3, 2, 0]).unwrap());
    assert_eq!((a.len(), a.total(), a.to_string(), format!("{a:?}")), (2, 5, "[3, 2]".into(), "[3, 2]".into()));
}
