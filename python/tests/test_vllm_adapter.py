"""The vLLM connector driven in vLLM 0.33's call order, without vLLM (tier 0; tier 1 runs the real engine).

KV caches are numpy arrays in vLLM 0.33's layout: per layer a ``[blocks, heads, block_size, C]`` view with
``C = 2 * head_dim`` (K then V of each token), LBHNC (head-major pages). The worker sees what
``ActiveKVConnector`` does per step: ``handle_preemptions`` and ``bind_connector_metadata`` before the
forward, ``save_kv_layer`` after each layer during it, ``start_load_kv`` after it, ``wait_for_save``, then
``get_transfer_results``. Every decode byte is checked against the numpy reference.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

import kvxfer
from kvxfer import vllm as adapter
from kvxfer._testing import Shape, make_pool, moved_bytes, verify_decode

BLOCKS = 32
ROLE = adapter.KVConnectorRole


def caches(shape: Shape, role: str, rank: int):
    """vLLM 0.33 per-layer views over one backing buffer, built from the reference pool (HND K and V
    buffers interleaved in C); returns the views and the reference K/V views of them (every K, then every V)."""
    pool = make_pool(shape, role, rank, BLOCKS)  # [pages, heads, page_size, head_dim] per K and per V buffer
    h, d = pool[0].shape[1], shape.head_dim
    backing = np.empty((shape.layers, BLOCKS, h, shape.page_size, 2 * d), dtype=pool[0].dtype)
    for layer in range(shape.layers):
        backing[layer, ..., :d] = pool[layer]
        backing[layer, ..., d:] = pool[shape.layers + layer]
    views = [backing[layer] for layer in range(shape.layers)]
    ref = [v[..., :d] for v in views] + [v[..., d:] for v in views]
    return {f"model.layers.{i}.self_attn.attn": v for i, v in enumerate(views)}, ref, backing


def config(role: str, boot: str, shape: Shape, tp_rank: int = 0, tp: int = 1):
    extra = {"bootstrap": boot, "prefill_tp": shape.prefill_tp, "decode_tp": shape.decode_tp,
             "kv_heads": shape.kv_heads, "tp_rank": tp_rank, "backend_options": {"listen": "127.0.0.1:0"}}
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role=role, kv_connector_extra_config=extra),
        cache_config=SimpleNamespace(block_size=shape.page_size),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        model_config=None,
    )


def step(worker, meta, layers: int, finished=frozenset()):
    """What vLLM 0.33's ActiveKVConnector and the attention wrapper do around one forward pass."""
    worker.handle_preemptions(meta)
    worker.bind_connector_metadata(meta)
    for i in range(layers):
        worker.wait_for_layer_load(f"model.layers.{i}.self_attn.attn")
        worker.save_kv_layer(f"model.layers.{i}.self_attn.attn", None, None)
    worker.start_load_kv(None)
    worker.wait_for_save()
    out = worker.get_transfer_results(set(finished))
    worker.clear_connector_metadata()
    return out


def test_transfer_stats_follow_vllm_033_kvconnectorstats_semantics():
    """KvxferKVConnectorStats as vLLM 0.33's aggregation path uses it: clone_and_reset hands the interval
    out, aggregate concatenates ranks, is_empty keeps failure-only intervals, reduce summarises."""
    s = adapter.KvxferKVConnectorStats()
    assert s.is_empty() and s.reduce()["Num successful transfers"] == 0
    s.record_success(0.5, 3 * 2**20, 3)
    s.record_success(1.5, 1 * 2**20, 1)
    out = s.clone_and_reset()
    assert s.is_empty() and out.num_successful_transfers == 2
    other = adapter.KvxferKVConnectorStats()
    other.record_failed()
    other.record_aborted()
    other.record_digest_mismatches(1)
    assert not other.is_empty()  # failures alone are reported
    agg = adapter.KvxferConnector.build_kv_connector_stats(out.to_dict()).aggregate(other)
    r = agg.reduce()
    assert r["Num successful transfers"] == 2 and r["Bytes transferred"] == 4 * 2**20
    assert r["Avg xfer time (ms)"] == 1000.0 and r["Throughput (MB/s)"] == 2.0 and r["Avg blocks per transfer"] == 2.0
    assert (r["Num failed transfers"], r["Num aborted transfers"], r["Num digest mismatches"]) == (1, 1, 1)
    assert adapter.KvxferConnector.build_kv_connector_stats(None).is_empty()
    with pytest.raises(ValueError, match="lacks"):
        adapter.KvxferKVConnectorStats(data={"transfer_duration": [1.0]})


def test_page_geometry_reads_vllm_033_views_and_refuses_block_outer_layouts():
    lbhnc = np.zeros((3, 8, 2, 16, 128), np.uint16)[1]  # [B, H, N, C] of layer 1
    assert adapter.page_geometry(lbhnc) == ("hnd", 8, 2, 16, 128)
    lbnhc = np.zeros((3, 8, 16, 2, 128), np.uint16)[1].transpose(0, 2, 1, 3)
    assert adapter.page_geometry(lbnhc) == ("nhd", 8, 2, 16, 128)
    blhnc = np.zeros((8, 3, 2, 16, 128), np.uint16)[:, 1]  # block-outermost: pages not a stride apart
    with pytest.raises(kvxfer.KvxferError, match="LBHNC"):
        adapter.page_geometry(blhnc)
    with pytest.raises(kvxfer.KvxferError, match="4-D"):
        adapter.page_geometry(np.zeros((2, 8, 16, 2, 64), np.uint16))


@pytest.mark.parametrize("shape", [
    pytest.param(Shape(kv_heads=4, head_dim=8, layers=3, prefill_tp=1, decode_tp=1, layout="hnd"), id="tp1"),
    pytest.param(Shape(kv_heads=4, head_dim=8, layers=3, prefill_tp=1, decode_tp=2, layout="hnd"), id="tp1to2"),
])
def test_call_order_of_vllm_033(shape: Shape):
    with kvxfer.BootstrapServer() as server:
        boot = server.address
        d_conns = []
        for r in range(shape.decode_tp):
            cfg = config("kv_consumer", boot, shape, r, shape.decode_tp)
            sched, worker = adapter.KvxferConnector(cfg, ROLE.SCHEDULER), adapter.KvxferConnector(cfg, ROLE.WORKER)
            kv, ref, keep = caches(shape, "decode", r)
            worker.register_kv_caches(kv)
            d_conns.append((sched, worker, ref, keep))
        cfg = config("kv_producer", boot, shape)
        p_sched, p_worker = adapter.KvxferConnector(cfg, ROLE.SCHEDULER), adapter.KvxferConnector(cfg, ROLE.WORKER)
        p_kv, _, p_keep = caches(shape, "prefill", 0)
        p_worker.register_kv_caches(p_kv)
        for w in [p_worker] + [c[1] for c in d_conns]:
            w.agent.wait_connected(timeout_s=20)
        try:
            rng = np.random.default_rng(9)
            prompt = 9 * shape.page_size + 3  # 10 blocks, the last one partly filled
            src = [int(x) for x in rng.permutation(BLOCKS)[:10]]
            dst = [int(x) for x in rng.permutation(BLOCKS)[:10]]
            params = {"kvxfer_room": 5150}
            p_req = SimpleNamespace(request_id="p-1", prompt_token_ids=list(range(prompt)),
                                    kv_transfer_params={**params, "do_remote_decode": True},
                                    status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))
            # Prefill, step 1 (6 full blocks), before the decode handed off: save_kv_layer finds the
            # sender made in bind_connector_metadata (vLLM 0.33 calls start_load_kv after the forward).
            assert p_sched.get_num_new_matched_tokens(p_req, 0) == (0, False)
            p_sched.update_state_after_alloc(p_req, SimpleNamespace(get_block_ids=lambda: (src[:7],)), 0)
            out1 = SimpleNamespace(
                scheduled_new_reqs=[SimpleNamespace(req_id="p-1", block_ids=(src[:7],), num_computed_tokens=0)],
                scheduled_cached_reqs=None, num_scheduled_tokens={"p-1": 6 * shape.page_size + 2})
            meta = p_sched.build_connector_meta(out1)
            assert meta.save["p-1"].pages == src[:6] and meta.save["p-1"].total_pages == 10
            step(p_worker, meta, shape.layers)
            assert p_worker._deferred["p-1"] == [src[:6]]
            # Decode: the scheduler learns the prompt loads remotely, allocates, the worker hands off.
            for sched, worker, _, _ in d_conns:
                d_req = SimpleNamespace(request_id="d-1", prompt_token_ids=list(range(prompt)),
                                        kv_transfer_params={**params, "do_remote_prefill": True})
                n, is_async = sched.get_num_new_matched_tokens(d_req, 0)
                assert (n, is_async) == (prompt, True)
                sched.update_state_after_alloc(d_req, SimpleNamespace(get_block_ids=lambda: (dst + [31],)), n)
                step(worker, sched.build_connector_meta(SimpleNamespace()), shape.layers)
            deadline = time.monotonic() + 20
            while "p-1" in p_worker._deferred:
                assert time.monotonic() < deadline
                p_worker.get_transfer_results(set())
                time.sleep(0.002)
            out2 = SimpleNamespace(
                scheduled_new_reqs=[],
                scheduled_cached_reqs=SimpleNamespace(req_ids=["p-1"], new_block_ids=[(src[7:],)], resumed_req_ids=set(),
                                                      num_computed_tokens=[6 * shape.page_size + 2]),
                num_scheduled_tokens={"p-1": prompt - (6 * shape.page_size + 2)})
            meta = p_sched.build_connector_meta(out2)
            assert meta.save["p-1"].pages == src[6:10]
            step(p_worker, meta, shape.layers)
            assert p_worker.stats["layer_pushes"] == shape.layers and p_worker.stats["whole_chunks"] == 1
            held, out_params = p_sched.request_finished(p_req, src)
            assert held and out_params["kvxfer_room"] == 5150
            sent, loaded = set(), {i: set() for i in range(len(d_conns))}
            while "p-1" not in sent or any("d-1" not in v for v in loaded.values()):
                assert time.monotonic() < deadline, (sent, loaded)
                sent |= p_worker.get_transfer_results({"p-1"} if not sent else set()).finished_sending
                for i, (_, worker, _, _) in enumerate(d_conns):
                    res = worker.get_transfer_results(set())
                    assert not res.failed_recving
                    loaded[i] |= res.finished_recving
                time.sleep(0.002)
            for r, (_, worker, ref, _) in enumerate(d_conns):
                _, errors = verify_decode(shape, r, ref, [(src, dst)], BLOCKS)
                assert errors == [], errors
            # vLLM's transfer stats: one transfer per rank, the bytes each agent counted.
            p_stats = p_worker.get_kv_connector_stats()
            assert p_stats.num_successful_transfers == 1 and p_stats.data["num_blocks"] == [10]
            assert p_stats.data["bytes_transferred"] == [moved_bytes(p_worker.agent)]
            assert p_worker.get_kv_connector_stats() is None  # handed out and reset
            d_stats = adapter.KvxferConnector.build_kv_connector_stats()
            for _, worker, _, _ in d_conns:
                d_stats = d_stats.aggregate(worker.get_kv_connector_stats())
            assert d_stats.num_successful_transfers == shape.decode_tp
            assert d_stats.data["bytes_transferred"] == [moved_bytes(c[1].agent) for c in d_conns]
            assert sum(d_stats.data["bytes_transferred"]) == p_stats.data["bytes_transferred"][0]
            summary = d_stats.reduce()
            assert summary["Bytes transferred"] == p_stats.data["bytes_transferred"][0]
            assert summary["Num failed transfers"] == 0 and summary["Num aborted transfers"] == 0
        finally:
            for w in [p_worker] + [c[1] for c in d_conns]:
                w.shutdown()


def test_layer_pushes_wait_for_the_kernels_that_wrote_the_layer(monkeypatch):
    """On CUDA a layer's push is posted only once an event recorded after its kernels completed
    (save_kv_layer returns before the GPU wrote the KV); wait_for_save waits for the rest."""
    shape = Shape(kv_heads=2, head_dim=8, layers=2, prefill_tp=1, decode_tp=1, layout="hnd")
    w = adapter.KvxferConnector(config("kv_producer", "127.0.0.1:1", shape), ROLE.WORKER)
    w._layer_index = {f"model.layers.{i}.self_attn.attn": i for i in range(2)}

    class Event:
        def __init__(self):
            self.done = False
            self.waited = False

        def query(self):
            return self.done

        def synchronize(self):
            self.waited = True
            self.done = True

    events: list[Event] = []
    monkeypatch.setattr(adapter.KvxferConnector, "_after_kernels", staticmethod(
        lambda kv: events.append(Event()) or events[-1]))
    posted: list[int] = []
    sender = SimpleNamespace(poll=lambda: kvxfer.KVPoll.WaitingForInput,
                             send_layers=lambda pages, a, b: posted.append(a))
    w._send["r"] = sender
    w.bind_connector_metadata(adapter.KvxferMetadata(save={"r": adapter._Save(1, 4, [0, 1])}))
    w.save_kv_layer("model.layers.0.self_attn.attn", object(), None)
    assert posted == []  # the layer's kernels have not finished
    events[0].done = True
    w.save_kv_layer("model.layers.1.self_attn.attn", object(), None)
    assert posted == [0]  # layer 0 now; layer 1 still waits for its event
    w.wait_for_save()
    assert posted == [0, 1] and events[1].waited


def test_room_is_shared_through_params_or_hashed_from_the_id():
    assert adapter.room_of("x", {"kvxfer_room": 12}) == 12
    assert adapter.room_of("abc", None) == adapter.room_of("abc", {}) < 2**63


@pytest.mark.skipif(not adapter.HAVE_VLLM, reason="vLLM is not installed (tier 1: python/tier1.sh)")
def test_vllm_factory_loads_the_connector_by_module_path():
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    ktc = KVTransferConfig(kv_connector="KvxferConnector", kv_connector_module_path="kvxfer.vllm",
                           kv_role="kv_consumer",
                           kv_connector_extra_config={"bootstrap": "127.0.0.1:1", "prefill_tp": 2, "decode_tp": 1})
    cls = KVConnectorFactory.get_connector_class(ktc)
    assert cls is adapter.KvxferConnector and issubclass(cls, KVConnectorBase_V1)
