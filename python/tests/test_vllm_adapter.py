"""The vLLM connector driven through vLLM's scheduler- and worker-side call sequence (push mode).

Tier 0 runs it without vLLM: the connector derives from a stand-in base class and the scheduler's
objects (requests, allocated blocks, scheduler output) are plain records with vLLM's field names.
KV caches are numpy arrays in vLLM's flash-attention layout (``[2, blocks, block_size, heads,
head_dim]`` per layer); every decode byte is checked against the numpy reference.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

import kvxfer
from kvxfer import vllm as adapter
from kvxfer._testing import Shape, make_pool, verify_decode

BLOCKS = 32
ROLE = adapter.KVConnectorRole


def caches(shape: Shape, role: str, rank: int):
    """vLLM's per-layer caches, built from the reference pool (K of layer l and V of layer l stacked)."""
    pool = make_pool(shape, role, rank, BLOCKS)
    per = []
    for layer in range(shape.layers):
        k, v = pool[layer], pool[shape.layers + layer]
        per.append(np.ascontiguousarray(np.stack([k, v]).reshape(2, BLOCKS, shape.page_size, *k.shape[1:])))
    # The reference pool again, as views of the registered caches (every K, then every V).
    views = [c[0].reshape(BLOCKS * shape.page_size, *c.shape[3:]) for c in per] + [
        c[1].reshape(BLOCKS * shape.page_size, *c.shape[3:]) for c in per
    ]
    return {f"model.layers.{i}.self_attn.attn": c for i, c in enumerate(per)}, views


def config(role: str, boot: str, shape: Shape, tp_rank: int = 0):
    extra = {"bootstrap": boot, "prefill_tp": shape.prefill_tp, "decode_tp": shape.decode_tp,
             "kv_heads": shape.kv_heads, "tp_rank": tp_rank, "backend_options": {"listen": "127.0.0.1:0"}}
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role=role, kv_connector_extra_config=extra),
        cache_config=SimpleNamespace(block_size=shape.page_size),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        model_config=None,
    )


def step(worker, meta, layers: int):
    """What vLLM's model runner does around one forward pass."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    for i in range(layers):
        worker.wait_for_layer_load(f"model.layers.{i}.self_attn.attn")
        worker.save_kv_layer(f"model.layers.{i}.self_attn.attn", None, None)
    worker.wait_for_save()
    worker.clear_connector_metadata()


@pytest.mark.parametrize("shape", [
    pytest.param(Shape(kv_heads=4, head_dim=8, layers=3, prefill_tp=1, decode_tp=1), id="tp1"),
    pytest.param(Shape(kv_heads=4, head_dim=8, layers=3, prefill_tp=1, decode_tp=2), id="tp1to2"),
])
def test_push_mode_call_sequence(shape: Shape):
    with kvxfer.BootstrapServer() as server:
        boot = server.address
        d_conns = []
        for r in range(shape.decode_tp):
            cfg = config("kv_consumer", boot, shape, r)
            sched, worker = adapter.KvxferConnector(cfg, ROLE.SCHEDULER), adapter.KvxferConnector(cfg, ROLE.WORKER)
            kv, views = caches(shape, "decode", r)
            worker.register_kv_caches(kv)
            d_conns.append((sched, worker, kv, views))
        cfg = config("kv_producer", boot, shape)
        p_sched, p_worker = adapter.KvxferConnector(cfg, ROLE.SCHEDULER), adapter.KvxferConnector(cfg, ROLE.WORKER)
        p_kv, _ = caches(shape, "prefill", 0)
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
                                    kv_transfer_params={**params, "do_remote_decode": True})
            # Prefill, step 1 (6 full blocks), before the decode handed off: deferred.
            assert p_sched.get_num_new_matched_tokens(p_req, 0) == (0, False)
            p_sched.update_state_after_alloc(p_req, SimpleNamespace(get_block_ids=lambda: (src[:7],)), 0)
            out1 = SimpleNamespace(
                scheduled_new_reqs=[SimpleNamespace(req_id="p-1", block_ids=(src[:7],), num_computed_tokens=0)],
                scheduled_cached_reqs=None, num_scheduled_tokens={"p-1": 6 * shape.page_size + 2})
            meta = p_sched.build_connector_meta(out1)
            assert meta.save["p-1"].pages == src[:6] and meta.save["p-1"].total_pages == 10
            step(p_worker, meta, shape.layers)
            assert p_worker.get_finished(set()) == (None, None)
            # Decode: the scheduler learns the prompt loads remotely, allocates, the worker hands off.
            for sched, worker, _, _ in d_conns:
                d_req = SimpleNamespace(request_id="d-1", prompt_token_ids=list(range(prompt)),
                                        kv_transfer_params={**params, "do_remote_prefill": True})
                n, is_async = sched.get_num_new_matched_tokens(d_req, 0)
                assert (n, is_async) == (prompt, True)
                sched.update_state_after_alloc(d_req, SimpleNamespace(get_block_ids=lambda: (dst + [31],)), n)
                step(worker, sched.build_connector_meta(SimpleNamespace()), shape.layers)
            # Prefill: the deferred chunk goes once the block lists arrived; step 2 then goes layer by layer.
            deadline = time.monotonic() + 20
            while "p-1" in p_worker._deferred:
                assert time.monotonic() < deadline
                p_worker.get_finished(set())
                time.sleep(0.002)
            out2 = SimpleNamespace(
                scheduled_new_reqs=[],
                scheduled_cached_reqs=SimpleNamespace(req_ids=["p-1"], new_block_ids=[(src[7:],)],
                                                      num_computed_tokens=[6 * shape.page_size + 2]),
                num_scheduled_tokens={"p-1": prompt - (6 * shape.page_size + 2)})
            meta = p_sched.build_connector_meta(out2)
            assert meta.save["p-1"].pages == src[6:10]
            step(p_worker, meta, shape.layers)
            assert p_worker._step_layerwise["p-1"]
            held, out_params = p_sched.request_finished(p_req, src)
            assert held and out_params["kvxfer_room"] == 5150
            # Both sides report the request through get_finished.
            sent, loaded = set(), {i: set() for i in range(len(d_conns))}
            while "p-1" not in sent or any("d-1" not in v for v in loaded.values()):
                assert time.monotonic() < deadline, (sent, loaded)
                s, _ = p_worker.get_finished({"p-1"} if not sent else set())
                sent |= s or set()
                for i, (_, worker, _, _) in enumerate(d_conns):
                    _, r = worker.get_finished(set())
                    loaded[i] |= r or set()
                time.sleep(0.002)
            for r, (_, worker, _, views) in enumerate(d_conns):
                assert worker.get_block_ids_with_load_errors() == set()
                _, errors = verify_decode(shape, r, views, [(src, dst)], BLOCKS)
                assert errors == [], errors
        finally:
            for w in [p_worker] + [c[1] for c in d_conns]:
                w.shutdown()


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
    cfg = SimpleNamespace(kv_transfer_config=ktc, cache_config=SimpleNamespace(block_size=16),
                          scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=True),
                          parallel_config=SimpleNamespace(tensor_parallel_size=1), model_config=None)
    conn = KVConnectorFactory.create_connector(cfg, ROLE.SCHEDULER, None)
    assert isinstance(conn, adapter.KvxferConnector) and conn.side == "decode" and conn.role == ROLE.SCHEDULER
    req = SimpleNamespace(request_id="r", prompt_token_ids=[1] * 40, kv_transfer_params={"do_remote_prefill": True})
    assert conn.get_num_new_matched_tokens(req, 0) == (40, True)
