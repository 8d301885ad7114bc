"""Tier 1: the kvxfer transfer backend inside SGLang 0.5.23's disaggregation code (see ``sglang_harness.py``).

One spawned process per rank, SGLang's KV pools on CPU, the managers from the queues' real
``_init_kv_manager``, polls MIN-all-reduced over real gloo groups with SGLang's ``poll_and_all_reduce``;
every decode byte is checked against the pattern the prefill pool held (per head, per page pair), and
every page no successful request names keeps its sentinel. No case sets ``KVXFER_KV_HEADS``: the decode
reads the head count from the model config at ``--model-path``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (tier 1: python/tier1.sh)")

import sglang_harness as H  # noqa: E402

SUCCESS, FAILED = 4, 0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("sgl")
    return {"h2": H.write_model(str(d / "h2"), kv_heads=2), "h4": H.write_model(str(d / "h4"), kv_heads=4),
            "h2l5": H.write_model(str(d / "h2l5"), kv_heads=2, layers=5)}


@pytest.fixture()
def boot():
    from sglang.srt.plugins import load_plugins

    load_plugins()  # before anything binds get_kv_class by name
    from sglang.srt.disaggregation import utils as du

    port = H.free_port()
    server = du.get_kv_class(du.TransferBackend("kvxfer"), du.KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=port)
    yield port
    server.close()


def test_pinned_engine_functions_are_the_ones_the_harness_mirrors():
    got = H.source_hashes()
    changed = {k: v for k, v in got.items() if H.PINNED.get(k) not in (None, v)}
    assert not changed, f"SGLang changed these functions the tier 1 harness mirrors: {changed}"
    assert all(H.PINNED[k] is not None for k in got), got


def script(rooms=(7001,), pages=9, seed=1, total=48, **extra):
    rng = np.random.default_rng(seed)
    out, used = [], set()
    for room in rooms:
        dst = [int(x) for x in rng.permutation([p for p in range(1, total) if p not in used])[:pages]]
        used |= set(dst)
        src = [int(x) for x in rng.permutation(range(1, total))[:pages]]
        out.append(dict(room=room, src=src, dst=dst, chunks=[4, 3, pages - 7], **extra))
    return out


def cluster(model, *, ptp, dtp, heads, layers=4, pp=1, pdp=1, mla=False, draft=0, state=0, scr=None, port=0,
            env=None, penv=None, denv=None):
    env = dict(env or {})
    env.setdefault("KVXFER_BACKEND_OPTIONS", "listen=127.0.0.1:0")
    common = dict(model=model, kv_heads=heads, layers=layers, bootstrap_port=port, mla=mla, draft_layers=draft,
                  state_slots=state, script=scr or script())
    pport, dport = H.free_port(), H.free_port()
    specs = []
    for dp in range(pdp):
        for ppr in range(pp):
            for r in range(ptp):
                specs.append(H.RankSpec(role="prefill", tp=ptp, rank=r, dist_port=pport, pp=pp, pp_rank=ppr, dp=pdp,
                                        dp_rank=dp, env={**env, "KVXFER_DECODE_TP": str(dtp), **(penv or {})},
                                        **common))
    for r in range(dtp):
        specs.append(H.RankSpec(role="decode", tp=dtp, rank=r, dist_port=dport,
                                env={**env, "KVXFER_PREFILL_TP": str(ptp), "KVXFER_PREFILL_PP": str(pp),
                                     "KVXFER_PREFILL_DP": str(pdp), **(denv or {})}, **common))
    return specs


def check(outs, rooms_ok=None):
    errors = [e for o in outs for e in o["errors"]]
    assert not errors, "\n".join(errors)
    for o in outs:
        assert o["manager"] == "KvxferKVManager"
        for room, rec in o["requests"].items():
            if rooms_ok is None or room in rooms_ok:
                if rec:
                    assert rec.get("poll") == SUCCESS, (o["role"], o["rank"], room, rec)
    for o in outs:
        if o["role"] == "decode":
            assert o["checked"] > 0


def test_sglang_p2_d1_with_draft_kv(models, boot):
    """Prefill TP 2 -> decode TP 1 (each decode rank fed by two senders), with a draft model's KV
    (speculative decoding: SGLang appends the draft pool's buffers, num_draft_entries) and aux rows."""
    # Hetero TP: the draft model's heads split like the target's; its head count is the draft model's
    # (KVXFER_DRAFT_KV_HEADS, here 2). At equal TP its pages move whole and nothing needs saying.
    outs = H.run(cluster(models["h2"], ptp=2, dtp=1, heads=2, draft=2, port=boot, env={"KVXFER_DRAFT_KV_HEADS": "2"},
                         scr=script(rooms=(7001, 7002), aux_p=3, aux_d=5)))
    check(outs)
    assert all(o["groups"] == ["kv", "draft"] for o in outs), [o["groups"] for o in outs]
    # SGLang's KVTransferMetric per request (its sglang:kv_transfer_* histograms): each prefill rank's
    # requests add up to the bytes its agents (kv and draft) counted; the decode received them all.
    sent = 0
    for o in outs:
        if o["role"] == "prefill":
            got = [rec["transfer_metric"] for rec in o["requests"].values() if rec]
            assert len(got) == 2 and all(lat is not None and lat > 0 for lat, _ in got), got
            assert sum(b for _, b in got) == o["moved_bytes"] > 0, (got, o["moved_bytes"])
            sent += o["moved_bytes"]
    assert sent == sum(o["moved_bytes"] for o in outs if o["role"] == "decode"), outs


def test_sglang_p4_d2_two_kv_heads(models, boot):
    """Prefill TP 4 over 2 KV heads (each head on two prefill ranks) -> decode TP 2."""
    check(H.run(cluster(models["h2"], ptp=4, dtp=2, heads=2, port=boot, scr=script(rooms=(7101,)))))


def test_sglang_p1_d2_abort_unreachable_and_send_after_abort(models, boot):
    """Decode TP 2 fed by one prefill rank, three requests in turn:
    1. decode rank 1 aborts after the first chunk (rank 0 still receiving): polls are MIN-all-reduced, both
       ranks take SGLang's deferred release and hold the pages until kvxfer's fence closed on both; the
       pages are then rewritten, the prefill sends its next chunks (``send`` must not raise out of SGLang's
       loop: the failure shows in ``poll``), and no byte lands in them;
    2. a request whose prefill bootstrap cannot be reached: the request fails, the loop goes on;
    3. a normal request: every byte arrives."""
    dead = H.free_port()
    scr = script(rooms=(7201, 7202, 7203), pages=12)
    scr[0]["chunks"] = [4, 4, 4]
    scr[0].update(signal_after_chunk=4, signal_name="chunk1", abort_when="chunk1", decode_abort_rank=1,
                  rewrite_after_release=True, released_name="released", prefill_event_before_chunk=4,
                  prefill_event_before_chunk_name="released")
    scr[1].update(addr=f"127.0.0.1:{dead}", ensure_tries=3, decode_only=True)
    outs = H.run(cluster(models["h2"], ptp=1, dtp=2, heads=2, port=boot, scr=scr),
                 events=("chunk1", "released"))
    errors = [e for o in outs for e in o["errors"]]
    assert not errors, "\n".join(errors)
    pre = [o for o in outs if o["role"] == "prefill"][0]
    dec = [o for o in outs if o["role"] == "decode"]
    assert pre["requests"][7201]["poll"] == FAILED and "aborted" in pre["requests"][7201]["reason"]
    for d in dec:
        a = d["requests"][7201]
        assert a["poll"] == FAILED and a["released_safe"], a
        assert a["landed_after_release"] == [], a
        u = d["requests"][7202]
        assert u["poll"] == FAILED and not u["parallel_info"], u
        assert d["requests"][7203]["poll"] == SUCCESS
    assert pre["requests"][7203]["poll"] == SUCCESS


def test_sglang_prefill_pp2_uneven_layers(models, boot):
    """Prefill PP 2 over 5 layers (SGLang's partition: 2 + 3; each stage registers its own range,
    prefill_start_layer / prefill_end_layer) -> decode PP 1."""
    scr = script(rooms=(7301,))
    outs = H.run(cluster(models["h2l5"], ptp=1, dtp=1, heads=2, layers=5, pp=2, port=boot, scr=scr))
    check(outs)
    assert all("layers=5" in o["topology"] and "prefill_pp=2" in o["topology"] for o in outs), outs[0]["topology"]
    assert sorted(o["pp_rank"] for o in outs if o["role"] == "prefill") == [0, 1]


def test_sglang_mla_with_prefill_dp_attention_and_state(models, boot):
    """MLA (SGLang's MLATokenToKVPool) from a prefill with DP attention 2 (two attention groups of TP 1:
    engine_rank is the global TP rank, kvxfer ranks are attention-TP ranks, one kvxfer rank set per DP
    rank) to decode TP 1; the decode resolves the prefill DP rank from the room (follow_bootstrap_room).
    With a state buffer (Mamba-like: two tensors of different sizes per slot) at equal attention TP."""
    scr = script(rooms=(7400, 7401))
    scr[0]["dp"], scr[1]["dp"] = 0, 1  # room % dp_size
    scr[0].update(state_src=[2], state_dst=[5])
    scr[1].update(state_src=[3], state_dst=[6])
    outs = H.run(cluster(models["h2"], ptp=1, dtp=1, heads=1, mla=True, pdp=2, state=8, port=boot, scr=scr))
    check(outs)
    assert all(len(o["groups"]) == 3 for o in outs), [o["groups"] for o in outs]


def test_sglang_startup_error_is_the_real_cause(models):
    """A start-up error reaches SGLang with its cause at once (GPU memory at fake addresses given to the tcp
    backend: without a CUDA driver the cause names the driver, with one the memory), not after the retries
    meant for a bootstrap service that is not up yet; and an agent whose start failed for want of its store
    reports the same cause again when retried (not "already started"), as `StoreUnreachable`."""
    import kvxfer
    from kvxfer import sglang as adapter

    args = type("KVArgs", (), {})()
    args.engine_rank, args.page_size, args.kv_cache_dtype_str = 0, 16, "torch.float16"
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = [1 << 20] * 8, [1 << 16] * 8, [2048] * 8
    args.total_kv_head_num, args.kv_head_num = 2, 2
    sa = type("SA", (), {"device": "cuda", "tp_size": 1, "dp_size": 1, "pp_size": 1, "host": "127.0.0.1",
                         "disaggregation_bootstrap_port": H.free_port()})()
    t0 = time.monotonic()
    with pytest.raises(kvxfer.KvxferError, match="tcp: registering CUDA memory") as e:
        adapter.KvxferKVManager(args, "prefill", sa, False)
    assert not isinstance(e.value, kvxfer.StoreUnreachable), e.value
    assert time.monotonic() - t0 < 5
    topo = kvxfer.Topology(kv_heads=2, head_dim=8, layers=1, page_size=4, dtype_bytes=2)
    a = kvxfer.Agent(role="prefill", topology=topo, bootstrap=f"127.0.0.1:{H.free_port()}", timeout_s=2.0,
                     connect_timeout_s=2.0)
    bufs = [np.zeros((64, 2, 8), np.uint16) for _ in range(2)]
    a.register_kv_buffers(bufs)
    causes = []
    for _ in range(2):
        with pytest.raises(kvxfer.StoreUnreachable) as e:
            a.start()
        causes.append(str(e.value))
    assert "already started" not in causes[1] and causes[0].split(":")[0] == causes[1].split(":")[0], causes
    a.close()


