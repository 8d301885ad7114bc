"""Tier 1 harness: the kvxfer backend inside SGLang 0.5.23's disaggregation code, one process per rank.

Each rank process publishes an SGLang config (``RuntimeContext.override_server_args``: ``--device cpu``,
``--disaggregation-transfer-backend kvxfer``, the case's TP / DP / PP), joins a gloo process group of its
side's attention-TP ranks, loads SGLang's plugins (kvxfer's entry point makes ``kvxfer`` a transfer
backend), builds SGLang's own KV pool on CPU (``MHATokenToKVPool`` / ``MLATokenToKVPool``, plus a draft
pool) and metadata buffers, and gets its ``KvxferKVManager`` from the real
``PrefillBootstrapQueue._init_kv_manager`` / ``DecodePreallocQueue._init_kv_manager`` (which fill
SGLang's ``KVArgs``; ``get_kv_class`` picks kvxfer's classes). Requests then follow the queues' call
sequence, polled with SGLang's ``poll_and_all_reduce_attn_cp_tp_group`` / ``poll_and_all_reduce`` over
the real gloo group (MIN across attention-TP ranks), and a decode failure takes SGLang's deferred
release path (``ensure_abort_notified``, hold flags MAX-all-reduced, ``is_abort_release_safe``).

Stand-ins (pinned by source hash in ``PINNED``): the queue objects are made without their constructors
(which need a whole scheduler: a model runner, allocators, a radix cache) with the attributes their
``_init_kv_manager`` reads, and the scheduler object is a namespace with the fields those read; the loop
that drives senders and receivers mirrors ``pop_bootstrapped`` / ``send_kv_chunk`` /
``process_disagg_prefill_inflight_queue`` on the prefill and ``pop_preallocated`` / ``_send_kv_metadata``
/ ``pop_transferred`` / ``resolve_deferred_releases`` on the decode.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import time
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

PAGE = 16
SENTINEL = -7  # int8 fill of every decode pool byte


def _pinned():
    from sglang.srt.disaggregation import decode, prefill, utils

    return {
        "PrefillBootstrapQueue.__init__": prefill.PrefillBootstrapQueue.__init__,
        "PrefillBootstrapQueue.pop_bootstrapped": prefill.PrefillBootstrapQueue.pop_bootstrapped,
        "PrefillBootstrapQueue.finalize_bootstrap": prefill.PrefillBootstrapQueue.finalize_bootstrap,
        "SchedulerDisaggregationPrefillMixin.send_kv_chunk": prefill.SchedulerDisaggregationPrefillMixin.send_kv_chunk,
        "SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue":
            prefill.SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue,
        "DecodePreallocQueue.__init__": decode.DecodePreallocQueue.__init__,
        "DecodePreallocQueue._ensure_prefill_info": decode.DecodePreallocQueue._ensure_prefill_info,
        "DecodePreallocQueue._send_kv_metadata": decode.DecodePreallocQueue._send_kv_metadata,
        "DecodeTransferQueue.pop_transferred": decode.DecodeTransferQueue.pop_transferred,
        "DecodeTransferQueue.resolve_deferred_releases": decode.DecodeTransferQueue.resolve_deferred_releases,
        "utils.poll_and_all_reduce": utils.poll_and_all_reduce,
    }


PINNED: dict[str, str | None] = {
    "PrefillBootstrapQueue.__init__": "722da74f9fee8bf4",
    "PrefillBootstrapQueue.pop_bootstrapped": "88a0d9b58692bb20",
    "PrefillBootstrapQueue.finalize_bootstrap": "2186380f1eafd2c5",
    "SchedulerDisaggregationPrefillMixin.send_kv_chunk": "f9458879c49b3eeb",
    "SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue": "41c14e7c6d8ff1e2",
    "DecodePreallocQueue.__init__": "804b21759e56a885",
    "DecodePreallocQueue._ensure_prefill_info": "d2d72102ec923234",
    "DecodePreallocQueue._send_kv_metadata": "06dc2331e684e5c3",
    "DecodeTransferQueue.pop_transferred": "016f67c7064c1da6",
    "DecodeTransferQueue.resolve_deferred_releases": "11abf1156672ec02",
    "utils.poll_and_all_reduce": "0eae52d79982c879",
}


def source_hashes() -> dict[str, str]:
    return {k: hashlib.sha256(inspect.getsource(f).encode()).hexdigest()[:16] for k, f in _pinned().items()}


def write_model(path: str, kv_heads: int = 2, layers: int = 4, mla: bool = False) -> str:
    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
           "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": kv_heads, "head_dim": 64,
           "num_hidden_layers": layers, "vocab_size": 1000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
           "torch_dtype": "float16"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


@dataclass
class RankSpec:
    role: str  # prefill | decode
    model: str
    kv_heads: int
    layers: int
    tp: int  # attention TP of this side (x dp = the server's tp_size with DP attention)
    rank: int  # attention-TP rank
    dist_port: int
    bootstrap_port: int
    pages: int = 48
    pp: int = 1
    pp_rank: int = 0
    dp: int = 1
    dp_rank: int = 0
    mla: bool = False
    draft_layers: int = 0
    state_slots: int = 0
    env: dict = field(default_factory=dict)
    script: list = field(default_factory=list)  # requests: dicts (see rank_main)
    timeout_s: float = 60.0


def heads_of(tp: int, rank: int, kv_heads: int) -> list[int]:
    if tp <= kv_heads:
        n = kv_heads // tp
        return list(range(rank * n, (rank + 1) * n))
    return [rank // (tp // kv_heads)]


def pattern(kind: int, layer: int, heads: list[int], pages: list[int], elems: int) -> np.ndarray:
    """Prefill pool content: [pages, PAGE, heads, elems] int16, a hash of (kind, global layer, head, page,
    slot, element) -- the decode expects it at its own page for the source page it was paired with."""
    u = np.uint64
    p = np.asarray(pages, dtype=u).reshape(-1, 1, 1, 1)
    t = np.arange(PAGE, dtype=u).reshape(1, -1, 1, 1)
    h = np.asarray(heads, dtype=u).reshape(1, 1, -1, 1)
    e = np.arange(elems, dtype=u).reshape(1, 1, 1, -1)
    with np.errstate(over="ignore"):
        x = u(layer * 0x9E3779B1 + kind * 0x85EBCA77 + 0x1234567) ^ (p * u(0xC2B2AE3D)) ^ (t * u(0x27D4EB2F)) ^ (
            h * u(0x165667B1)) ^ (e * u(0xD3A2646C))
        x = x ^ (x >> u(15))
        x = x * u(0x2C1B3C6D297A5F35)
        x = x ^ (x >> u(29))
    return (x & u(0x3BFF)).astype(np.int16)


def _server_args_fields(spec: RankSpec) -> dict:
    return dict(device="cpu", disaggregation_mode=spec.role, disaggregation_transfer_backend="kvxfer",
                tp_size=spec.tp * spec.dp, dp_size=spec.dp, enable_dp_attention=spec.dp > 1, pp_size=spec.pp,
                disaggregation_bootstrap_port=spec.bootstrap_port, model_path=spec.model, host="127.0.0.1")


def rank_main(spec: RankSpec, q_out, ev) -> None:
    out: dict[str, Any] = {"role": spec.role, "rank": spec.rank, "pp_rank": spec.pp_rank, "dp_rank": spec.dp_rank,
                           "requests": {}, "errors": []}
    mgr = None
    try:
        os.environ.update(spec.env)
        import torch
        import torch.distributed as dist
        from sglang.srt.runtime_context import get_context

        from sglang.srt.runtime_context import get_parallel

        ov = get_context().override_server_args(**_server_args_fields(spec))
        server_args = ov.install()
        # The ranks a launcher's spawn would state for this process.
        get_parallel().override_permanently(tp_rank=spec.rank + spec.tp * spec.dp_rank, pp_rank=spec.pp_rank,
                                            dp_rank=spec.dp_rank if spec.dp > 1 else None,
                                            attn_tp_rank=spec.rank, attn_tp_size=spec.tp,
                                            attn_dp_size=spec.dp)
        out["mgr"] = _run(spec, server_args, torch, dist, out, ev)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out["errors"].append(f"{spec.role} rank {spec.rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    q_out.put(out)
    ev["done"].wait(120)
    if mgr is not None:
        mgr.close()


def _run(spec: RankSpec, server_args, torch, dist, out, ev):
    from sglang.srt.plugins import load_plugins

    load_plugins()  # kvxfer's sglang.srt.plugins entry point: --disaggregation-transfer-backend kvxfer
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import (KVClassType, MetadataBuffers, TransferBackend, get_kv_class,
                                                 poll_and_all_reduce, poll_and_all_reduce_attn_cp_tp_group)
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    # The attention-TP group of this side (gloo, as SGLang's attn_tp_cpu_group).
    group_rank = spec.rank + spec.tp * (spec.pp_rank + spec.pp * spec.dp_rank)
    world = spec.tp * spec.pp * spec.dp
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec.dist_port}", world_size=world,
                            rank=group_rank)
    tp_groups = [dist.new_group(list(range(b, b + spec.tp)), backend="gloo") for b in range(0, world, spec.tp)]
    attn_tp_group = tp_groups[group_rank // spec.tp]
    solo_groups = [dist.new_group([r], backend="gloo") for r in range(world)]
    attn_cp_group = solo_groups[group_rank]
    backend = TransferBackend("kvxfer")

    layers_here = spec.layers // spec.pp if spec.pp > 1 and not os.environ.get("KVXFER_PREFILL_LAYERS") else spec.layers
    start_layer = 0
    if spec.pp > 1:
        from sglang.srt.distributed.utils import get_pp_indices

        start_layer, end_layer = get_pp_indices(spec.layers, spec.pp_rank, spec.pp)
        layers_here = end_layer - start_layer
    size = spec.pages * PAGE
    local = 1 if spec.mla else len(heads_of(spec.tp, spec.rank, spec.kv_heads))
    if spec.mla:
        pool = MLATokenToKVPool(size=size, page_size=PAGE, dtype=torch.float16, kv_lora_rank=64, qk_rope_head_dim=16,
                                layer_num=layers_here, device="cpu", enable_memory_saver=False,
                                start_layer=start_layer, end_layer=start_layer + layers_here)
        bufs = [("latent", 2, i, b) for i, b in enumerate(pool.kv_buffer)]
    else:
        pool = MHATokenToKVPool(size=size, page_size=PAGE, dtype=torch.float16, head_num=local, head_dim=64,
                                layer_num=layers_here, device="cpu", enable_memory_saver=False,
                                start_layer=start_layer, end_layer=start_layer + layers_here)
        bufs = [("k", 0, i, b) for i, b in enumerate(pool.k_buffer)] + [("v", 1, i, b) for i, b in enumerate(pool.v_buffer)]
    draft = None
    if spec.draft_layers:
        draft = MHATokenToKVPool(size=size, page_size=PAGE, dtype=torch.float16, head_num=local, head_dim=32,
                                 layer_num=spec.draft_layers, device="cpu", enable_memory_saver=False)
        bufs += [("dk", 3, i, b) for i, b in enumerate(draft.k_buffer)] + [("dv", 4, i, b) for i, b in
                                                                          enumerate(draft.v_buffer)]
    heads = [0] if spec.mla else heads_of(spec.tp, spec.rank, spec.kv_heads)
    pages = spec.pages + 1  # SGLang pools hold one padding page
    for _, kind, i, b in bufs:
        v = b.view(torch.int16).numpy().reshape(pages, PAGE, b.shape[1], b.shape[2])
        if spec.role == "prefill":
            v[...] = pattern(kind, start_layer + i, heads, list(range(pages)), b.shape[2])
        else:
            v.view(np.int8)[...] = SENTINEL
    metadata = MetadataBuffers(size=16, hidden_size=32, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=4)
    state = None
    if spec.state_slots:
        state = [torch.zeros((spec.state_slots, 24), dtype=torch.float32), torch.zeros((spec.state_slots, 8, 4),
                                                                                         dtype=torch.float16)]
        for t_i, t in enumerate(state):
            flat = t.view(torch.int8).numpy().reshape(spec.state_slots, -1)
            if spec.role == "prefill":
                flat[...] = ((np.arange(flat.size).reshape(flat.shape) * 7 + t_i) % 101).astype(np.int8)
            else:
                flat[...] = SENTINEL

    model_config = SimpleNamespace(hf_text_config=SimpleNamespace(), num_hidden_layers=spec.layers,
                                   get_total_num_kv_heads=lambda: spec.kv_heads)
    scheduler = SimpleNamespace(
        rust_server=None, server_args=server_args, model_config=model_config, enable_hisparse=False,
        tp_worker=SimpleNamespace(model_runner=SimpleNamespace(kv_cache_dtype_str="torch.float16")),
        attn_tp_cpu_group=attn_tp_group, attn_cp_cpu_group=attn_cp_group)
    qcls = PrefillBootstrapQueue if spec.role == "prefill" else DecodePreallocQueue
    q = object.__new__(qcls)  # stand-in for the constructor: what _init_kv_manager reads
    q.token_to_kv_pool, q.draft_token_to_kv_pool = pool, draft
    q.metadata_buffers, q.scheduler, q.transfer_backend = metadata, scheduler, backend
    q.tp_rank = spec.rank + spec.tp * spec.dp_rank
    q.pp_rank, q.pp_size, q.gpu_id, q.is_mla_backend = spec.pp_rank, spec.pp, 0, spec.mla
    q.enable_staging = False
    if state is not None:
        import sglang.srt.disaggregation.utils as du

        real_setup = du.setup_state_kv_args

        def with_state(kv_args, *a, **kw):  # what setup_state_kv_args fills for a pool with state (Mamba-like)
            real_setup(kv_args, *a, **kw)
            from sglang.srt.disaggregation.base.conn import StateType

            kv_args.state_types = [StateType.MAMBA]
            kv_args.state_data_ptrs = [[t.data_ptr() for t in state]]
            kv_args.state_data_lens = [[t.nbytes for t in state]]
            kv_args.state_item_lens = [[t[0].nbytes for t in state]]

        import sglang.srt.disaggregation.decode as dmod
        import sglang.srt.disaggregation.prefill as pmod

        pmod.setup_state_kv_args = dmod.setup_state_kv_args = with_state
    t0 = time.monotonic()
    mgr = qcls._init_kv_manager(q)
    out["manager_s"] = time.monotonic() - t0
    out["manager"] = type(mgr).__name__
    out["topology"] = repr(mgr.topology)
    out["groups"] = [g.name for g in mgr.groups]
    bootstrap = f"127.0.0.1:{spec.bootstrap_port}"
    deadline = time.monotonic() + spec.timeout_s

    def all_reduce(pollers, decode: bool):
        if decode:
            return poll_and_all_reduce(pollers, attn_tp_group)
        if spec.pp > 1:
            # poll_and_all_reduce_prefill_pp's first half (each stage here; SGLang then broadcasts stage 0's)
            from sglang.srt.disaggregation import utils as du

            return du._all_reduce_polls(du._poll_with_failure_injection_pp(pollers), attn_tp_group)
        return poll_and_all_reduce_attn_cp_tp_group(pollers, attn_cp_group, attn_tp_group)

    for r in spec.script:
        rec = out["requests"].setdefault(r["room"], {})
        if spec.role == "prefill":
            if r.get("dp", 0) != spec.dp_rank or r.get("decode_only"):
                continue
            sender = get_kv_class(backend, KVClassType.SENDER)(mgr=mgr, bootstrap_addr=bootstrap,
                                                               bootstrap_room=r["room"])
            # pop_bootstrapped: MIN over attention TP until WaitingForInput (or Failed)
            while True:
                (v,) = all_reduce([sender], False)
                if v in (KVPoll.WaitingForInput, KVPoll.Failed) or time.monotonic() > deadline:
                    break
                time.sleep(0.002)
            rec["bootstrap_poll"] = int(v)
            if v == KVPoll.WaitingForInput:
                sender.init(len(r["src"]), r.get("aux_p"))  # finalize_bootstrap
                at = 0
                for n in r["chunks"]:  # send_kv_chunk per chunk (the last one even when empty)
                    chunk = r["src"][at:at + n]
                    at += n
                    last = at >= len(r["src"])
                    if r.get("prefill_event_before_chunk") == at - n and spec.rank == 0:
                        ev[r["prefill_event_before_chunk_name"]].wait(30)
                    if sender.should_send_kv_chunk(len(chunk), last):
                        sender.send(np.asarray(chunk, dtype=np.int32),
                                    state_indices=[r["state_src"]] if (last and "state_src" in r) else None)
                    if r.get("signal_after_chunk") == at and spec.rank == 0:
                        ev[r["signal_name"]].set()
            # process_disagg_prefill_inflight_queue: MIN over attention TP until final
            while True:
                (v,) = all_reduce([sender], False)
                if v in (KVPoll.Success, KVPoll.Failed) or time.monotonic() > deadline:
                    break
                time.sleep(0.002)
            rec["poll"] = int(v)
            if v == KVPoll.Failed:
                try:
                    sender.failure_exception()
                except Exception as e:  # noqa: BLE001
                    rec["reason"] = str(e)
            sender.clear()
            # process_disagg_prefill_inflight_queue then hands a successful request's transfer metric (read
            # after clear()) to ReqTimeStats.compute_and_observe_kv_transfer_metrics.
            from sglang.srt.disaggregation.base.conn import KVTransferMetric

            tm = sender.get_transfer_metric()
            assert isinstance(tm, KVTransferMetric), type(tm)
            rec["transfer_metric"] = (tm.transfer_latency_s, tm.transfer_total_bytes)
        else:
            receiver = get_kv_class(backend, KVClassType.RECEIVER)(mgr=mgr, bootstrap_addr=r.get("addr", bootstrap),
                                                                   bootstrap_room=r["room"])
            # _ensure_prefill_info: retried, then SGLang aborts the receivers (here: 3 tries)
            ok = False
            for _ in range(r.get("ensure_tries", 200)):
                if mgr.try_ensure_parallel_info(r.get("addr", bootstrap)):
                    ok = True
                    break
                time.sleep(0.05)
            rec["parallel_info"] = ok
            if ok:
                receiver.init(r.get("dp", 0))
            else:
                receiver.abort()
            while True:  # pop_preallocated: MIN over attention TP
                (v,) = all_reduce([receiver], True)
                if v in (KVPoll.WaitingForInput, KVPoll.Failed) or time.monotonic() > deadline:
                    break
                time.sleep(0.002)
            rec["prealloc_poll"] = int(v)
            if v == KVPoll.WaitingForInput:  # _send_kv_metadata
                receiver.send_metadata(np.asarray(r["dst"], dtype=np.int32), r.get("aux_d"),
                                       state_indices=[r["state_dst"]] if "state_dst" in r else None)
            aborted = False
            while True:  # pop_transferred
                if (r.get("decode_abort_rank") == spec.rank and not aborted
                        and ev[r["abort_when"]].is_set()):
                    receiver.abort()  # this rank fails first
                    aborted = True
                (v,) = all_reduce([receiver], True)
                if v in (KVPoll.Success, KVPoll.Failed) or time.monotonic() > deadline:
                    break
                time.sleep(0.002)
            rec["poll"] = int(v)
            if v == KVPoll.Failed:
                try:
                    receiver.failure_exception()
                except Exception as e:  # noqa: BLE001
                    rec["reason"] = str(e)
                # SGLang's deferred release: arm, agree on holding (MAX), release once safe (MIN)
                if mgr.enable_deferred_decode_kv_release and not receiver.abort_notified:
                    receiver.ensure_abort_notified(force_arm=True)
                held = torch.tensor([1 if receiver.abort_notified else 0], dtype=torch.int32)
                dist.all_reduce(held, op=dist.ReduceOp.MAX, group=attn_tp_group)
                t_hold = time.monotonic()
                while held.item():
                    ready = torch.tensor([1 if mgr.is_abort_release_safe(r["room"], 0) else 0], dtype=torch.int32)
                    dist.all_reduce(ready, op=dist.ReduceOp.MIN, group=attn_tp_group)
                    if ready.item() or time.monotonic() - t_hold > 30:
                        break
                    time.sleep(0.002)
                rec["released_safe"] = receiver.is_abort_release_safe()
                rec["held_s"] = time.monotonic() - t_hold
                if r.get("rewrite_after_release"):
                    # The pages are free: SGLang gives them to another request, which writes them.
                    for _, _, _, b in bufs:
                        v_ = b.view(torch.int16).numpy().reshape(pages, PAGE, b.shape[1], b.shape[2])
                        v_[r["dst"]] = 0x5A5A
                    ev[r["released_name"]].set()
                    time.sleep(r.get("watch_s", 1.5))  # the prefill keeps sending meanwhile
                    bad = []
                    for name, _, i, b in bufs:
                        v_ = b.view(torch.int16).numpy().reshape(pages, PAGE, b.shape[1], b.shape[2])
                        if not (v_[r["dst"]] == 0x5A5A).all():
                            bad.append(f"{name}{i}")
                    rec["landed_after_release"] = bad
            receiver.clear()
    # Verify every decode byte: named pages of successful requests hold the prefill's bytes for this
    # rank's heads; every other page keeps the sentinel.
    if spec.role == "decode":
        named = set()
        checked = 0
        for r in spec.script:
            rec = out["requests"][r["room"]]
            if rec.get("poll") != KVPoll.Success:
                continue
            named |= set(r["dst"])
            for name, kind, i, b in bufs:
                v = b.view(torch.int16).numpy().reshape(pages, PAGE, b.shape[1], b.shape[2])
                want = pattern(kind, i, heads, r["src"], b.shape[2])
                got = v[r["dst"]]
                checked += got.nbytes
                if not np.array_equal(got, want):
                    bad = np.argwhere(got != want)[0]
                    out["errors"].append(f"decode rank {spec.rank} {name}{i}: first wrong (page, slot, head, elem) "
                                         f"{tuple(int(x) for x in bad)} of room {r['room']}")
            if "aux_d" in r:
                out["aux_room"] = int(metadata.bootstrap_room[r["aux_d"], 0].item()) if hasattr(metadata,
                                                                                                "bootstrap_room") else None
            if state is not None and "state_dst" in r:
                for t_i, t in enumerate(state):
                    flat = t.view(torch.int8).numpy().reshape(spec.state_slots, -1)
                    want = ((np.arange(flat.size).reshape(flat.shape) * 7 + t_i) % 101).astype(np.int8)
                    for s_src, s_dst in zip(r["state_src"], r["state_dst"]):
                        if not np.array_equal(flat[s_dst], want[s_src]):
                            out["errors"].append(f"decode rank {spec.rank}: state tensor {t_i} slot {s_dst} differs")
        for r in spec.script:
            if out["requests"][r["room"]].get("poll") != KVPoll.Success:
                named |= set(r["dst"]) if not r.get("rewrite_after_release") else set()
        for name, kind, i, b in bufs:
            v = b.view(torch.int16).numpy().reshape(pages, PAGE, b.shape[1], b.shape[2])
            for pg in range(pages):
                if pg in named:
                    continue
                if any(pg in r["dst"] for r in spec.script if r.get("rewrite_after_release")):
                    continue
                checked += v[pg].nbytes
                if not (v[pg].view(np.int8) == SENTINEL).all():
                    out["errors"].append(f"decode rank {spec.rank} {name}{i}: page {pg} written, no request names it")
                    break
        out["checked"] = checked
    out["stats"] = [a.stats() for agents in mgr._agents.values() for a in agents]
    out["moved_bytes"] = sum(int(float(line.rsplit(" ", 1)[1])) for agents in mgr._agents.values() for a in agents
                             for line in a.metrics().splitlines() if line.startswith("kvxfer_transfer_bytes_total"))
    return None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(specs: list[RankSpec], limit_s: float = 420.0, events=("done",)) -> list[dict]:
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ev = {name: ctx.Event() for name in set(events) | {"done"}}
    procs = [ctx.Process(target=rank_main, args=(s, q, ev), daemon=True) for s in specs]
    for p in procs:
        p.start()
    outs: list[dict] = []
    deadline = time.monotonic() + limit_s
    try:
        while len(outs) < len(procs):
            try:
                outs.append(q.get(timeout=0.2))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(procs) - len(outs)} rank(s) did not report within {limit_s} s") from None
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank processes {dead} died") from None
    finally:
        ev["done"].set()
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()
                p.join(5)
    return outs
