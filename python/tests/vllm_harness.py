"""Tier 1 harness: vLLM 0.33.0's own scheduler, KV cache allocation and worker-side connector driver.

An instance (prefill or decode) is vLLM's real ``Scheduler`` (built from a ``VllmConfig`` whose
``kv_transfer_config`` names ``KvxferConnector`` by module path) in the test process, and one spawned
process per TP rank running vLLM's worker-side pieces: ``init_distributed_environment`` /
``initialize_model_parallel`` over gloo, ``ensure_kv_transfer_initialized``, the KV caches from
``allocate_kv_cache`` (CPU tensors, the layout vLLM resolved with the connector's preference), and
``ActiveKVConnector`` (``pre_forward``, the attention wrapper ``maybe_transfer_kv_layer`` around each
layer's KV write, ``finish_forward``, ``post_forward`` / ``no_forward``). Worker outputs are combined with
vLLM's ``KVOutputAggregator`` and fed to ``Scheduler.update_from_output``.

Stand-ins (each mirrors an engine function whose source hash ``PINNED`` checks, so an upgrade that
changes one fails naming it):

- the KV cache specs (``Attention.get_kv_cache_spec`` / ``MLAAttention.get_kv_cache_spec``) and the
  engine core's KV cache set-up (``EngineCore._initialize_kv_caches``), without profiling a model;
- the "model": per layer, one call of a function wrapped by vLLM's real ``maybe_transfer_kv_layer``
  that writes the scheduled tokens' KV into vLLM's cache view (``Attention.unified_kv_cache_update``'s
  place), with content derived from (layer, global head, position, token, element) so the decode can
  check every byte; sampled tokens are fixed values (``GPUModelRunner.execute_model``'s place).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np

BLOCK = 16
HEAD = 64
SENTINEL = -7  # int8: every byte of a decode cache starts as this (0xF9)


def _pinned():
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu import kv_connector
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.utils import allocate_kv_cache

    return {
        "vllm.v1.engine.core.EngineCore._initialize_kv_caches": EngineCore._initialize_kv_caches,
        "vllm...attention.Attention.get_kv_cache_spec": Attention.get_kv_cache_spec,
        "vllm...mla_attention.MLAAttention.get_kv_cache_spec": MLAAttention.get_kv_cache_spec,
        "vllm.v1.worker.gpu.model_runner.GPUModelRunner.execute_model": GPUModelRunner.execute_model,
        # Used as is; pinned because the harness relies on their call order.
        "vllm.v1.worker.gpu.kv_connector.ActiveKVConnector": kv_connector.ActiveKVConnector,
        "vllm...kv_transfer_utils.maybe_transfer_kv_layer": maybe_transfer_kv_layer,
        "vllm.v1.worker.utils.allocate_kv_cache": allocate_kv_cache,
    }


# sha256 of inspect.getsource at vLLM 0.33.0 (the first 16 hex digits).
PINNED = {
    "vllm.v1.engine.core.EngineCore._initialize_kv_caches": "748a4dcbddb8752b",
    "vllm...attention.Attention.get_kv_cache_spec": "2b66919f6a191bc6",
    "vllm...mla_attention.MLAAttention.get_kv_cache_spec": "f184daa0cee6aac8",
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner.execute_model": "7a1168866a759c6a",
    "vllm.v1.worker.gpu.kv_connector.ActiveKVConnector": "9852c79cee4bf2b3",
    "vllm...kv_transfer_utils.maybe_transfer_kv_layer": "f88493be75a1f24a",
    "vllm.v1.worker.utils.allocate_kv_cache": "b1f3e24311485a09",
}


def source_hashes() -> dict[str, str]:
    return {k: hashlib.sha256(inspect.getsource(f).encode()).hexdigest()[:16] for k, f in _pinned().items()}


# --------------------------------------------------------------------------------------------- config


def write_model(path: str, mla: bool = False, kv_heads: int = 2, layers: int = 3) -> str:
    """A tiny local ``config.json`` (no weights, no tokenizer): Llama-shaped, or DeepSeek-V2-shaped (MLA)."""
    os.makedirs(path, exist_ok=True)
    if mla:
        cfg = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 256,
               "intermediate_size": 512, "moe_intermediate_size": 128, "num_attention_heads": 4,
               "num_key_value_heads": 4, "num_hidden_layers": layers, "vocab_size": 1000,
               "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "torch_dtype": "float16",
               "kv_lora_rank": 64, "q_lora_rank": None, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
               "v_head_dim": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": layers, "rope_theta": 10000.0}
    else:
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
               "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": kv_heads,
               "head_dim": HEAD, "num_hidden_layers": layers, "vocab_size": 1000, "max_position_embeddings": 2048,
               "rms_norm_eps": 1e-5, "torch_dtype": "float16", "rope_theta": 10000.0}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


@dataclass
class InstanceSpec:
    model: str
    role: str  # kv_producer | kv_consumer
    tp: int
    bootstrap: str
    prefill_tp: int
    decode_tp: int
    num_blocks: int = 64
    max_batched: int = 64
    failure_policy: str = "fail"
    prefix_caching: bool = False
    timeout_s: float = 60.0
    log_stats: bool = False  # the Scheduler's log_stats: SchedulerStats (with kv_connector_stats) every step
    extra: dict = field(default_factory=dict)


def vllm_config(spec: InstanceSpec, rank: int = 0):
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, VllmConfig)

    mc = ModelConfig(model=spec.model, skip_tokenizer_init=True, dtype="float16", max_model_len=512,
                     enforce_eager=True)
    extra = {"bootstrap": spec.bootstrap, "prefill_tp": spec.prefill_tp, "decode_tp": spec.decode_tp,
             "backend_options": {"listen": "127.0.0.1:0"}, "timeout_s": spec.timeout_s, **spec.extra}
    ktc = KVTransferConfig(kv_connector="KvxferConnector", kv_connector_module_path="kvxfer.vllm",
                           kv_role=spec.role, kv_connector_extra_config=extra,
                           kv_load_failure_policy=spec.failure_policy)
    pc = ParallelConfig(tensor_parallel_size=spec.tp)
    pc.rank = rank
    sc = SchedulerConfig(max_num_batched_tokens=spec.max_batched, max_num_seqs=8, max_model_len=512,
                         is_encoder_decoder=False, enable_chunked_prefill=True)
    cc = CacheConfig(block_size=BLOCK, num_gpu_blocks_override=spec.num_blocks,
                     enable_prefix_caching=spec.prefix_caching)
    return VllmConfig(model_config=mc, cache_config=cc, parallel_config=pc, kv_transfer_config=ktc,
                      scheduler_config=sc, device_config=DeviceConfig(device="cpu"))


def kv_cache_specs(vc) -> dict[str, Any]:
    """What ``Attention.get_kv_cache_spec`` / ``MLAAttention.get_kv_cache_spec`` return for this model on one
    rank (stand-in: no model is built)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    mc = vc.model_config
    layers = mc.get_num_layers(vc.parallel_config)
    if mc.use_mla:
        spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=mc.get_head_size(),
                                dtype=torch.float16, cache_dtype_str="auto")
    else:
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=mc.get_num_kv_heads(vc.parallel_config),
                                 head_size=mc.get_head_size(), dtype=torch.float16)
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(layers)}


def engine_kv_caches(vc):
    """``EngineCore._initialize_kv_caches`` without profiling: the layout (with the connector's
    preference), the groups and every worker's ``KVCacheConfig``. Returns (worker configs, scheduler
    config, layout name)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups  # type: ignore[attr-defined]

    tp = vc.parallel_config.tensor_parallel_size
    specs = [kv_cache_specs(vc)] * tp
    names = [layout.name for layout in get_supported_kv_cache_layouts([CPUAttentionBackend])]
    layout = resolve_kv_cache_layout(vc, [names] * tp, [s for sp in specs for s in sp.values()])
    groups = get_global_kv_cache_groups(vc, specs)
    per_block = sum(s.page_size_bytes for s in specs[0].values())
    configs = get_kv_cache_configs(vc, specs, [per_block * vc.cache_config.num_gpu_blocks_override] * tp, groups)
    for c in configs:
        c.kv_cache_layout = vc.cache_config.kv_cache_layout
    sched = generate_scheduler_kv_cache_config(configs)
    vc.cache_config.num_gpu_blocks = sched.num_blocks
    return configs, sched, layout.name


# --------------------------------------------------------------------------------------- the "model"


def kv_pattern(layer: int, heads: list[int], positions: np.ndarray, tokens: np.ndarray, c: int) -> np.ndarray:
    """KV content of the given tokens: ``[len(heads), len(positions), c]`` int16 (fp16 bits), a hash of
    (layer, global head, position, token, element)."""
    u = np.uint64
    h = np.asarray(heads, dtype=u).reshape(-1, 1, 1)
    p = np.asarray(positions, dtype=u).reshape(1, -1, 1)
    t = np.asarray(tokens, dtype=u).reshape(1, -1, 1)
    e = np.arange(c, dtype=u).reshape(1, 1, -1)
    with np.errstate(over="ignore"):
        x = u(layer * 0x9E3779B1 + 0x1234567) ^ (h * u(0x165667B1)) ^ (p * u(0xC2B2AE3D)) ^ (t * u(0x27D4EB2F)) ^ (
            e * u(0xD3A2646C))
        x = x ^ (x >> u(15))
        x = x * u(0x2C1B3C6D297A5F35)
        x = x ^ (x >> u(29))
    return (x & u(0x3BFF)).astype(np.int16)  # finite fp16 bit patterns


def heads_of(tp: int, rank: int, kv_heads: int) -> list[int]:
    if tp <= kv_heads:
        n = kv_heads // tp
        return list(range(rank * n, (rank + 1) * n))
    return [rank // (tp // kv_heads)]


# ------------------------------------------------------------------------------------------- workers


@dataclass
class WorkerSpec:
    inst: InstanceSpec
    rank: int
    kv_cache_config: Any
    dist_port: int
    sentinel: bool


def _view_np(t):
    """An int16 numpy view of a torch fp16 tensor view (shares memory)."""
    return t.view(__import__("torch").int16).numpy()


def worker_main(ws: WorkerSpec, inq, outq) -> None:
    """One TP rank: vLLM's worker-side connector set-up and driver, a "model" that writes KV."""
    try:
        import torch
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.distributed.kv_transfer.kv_transfer_state import (ensure_kv_transfer_initialized,
                                                                     ensure_kv_transfer_shutdown)
        from vllm.forward_context import set_forward_context
        from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
        from vllm.v1.worker.utils import allocate_kv_cache

        from vllm.config import set_current_vllm_config

        vc = vllm_config(ws.inst, ws.rank)
        vc.cache_config.kv_cache_layout = ws.kv_cache_config.kv_cache_layout
        with set_current_vllm_config(vc):
            _worker_loop(ws, vc, inq, outq)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        outq.put(("error", ws.rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _worker_loop(ws: WorkerSpec, vc, inq, outq) -> None:
    if True:
        import torch
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.distributed.kv_transfer.kv_transfer_state import (ensure_kv_transfer_initialized,
                                                                     ensure_kv_transfer_shutdown)
        from vllm.forward_context import set_forward_context
        from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
        from vllm.v1.worker.utils import allocate_kv_cache

        init_distributed_environment(world_size=ws.inst.tp, rank=ws.rank,
                                     distributed_init_method=f"tcp://127.0.0.1:{ws.dist_port}", local_rank=ws.rank,
                                     backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=ws.inst.tp, backend="gloo")
        layout = KVCacheLayout[ws.kv_cache_config.kv_cache_layout]
        kv_caches = allocate_kv_cache(ws.kv_cache_config, torch.device("cpu"), layout)
        names = sorted(kv_caches, key=lambda n: int(n.split(".")[2]))
        if ws.sentinel:
            for n in names:
                kv_caches[n].view(torch.int8).fill_(SENTINEL)
        ensure_kv_transfer_initialized(vc, ws.kv_cache_config)
        driver = ActiveKVConnector(vc, kv_caches)
        mc = vc.model_config
        mla = mc.use_mla
        total_heads = 1 if mla else mc.get_total_num_kv_heads()
        my_heads = [0] if mla else heads_of(ws.inst.tp, ws.rank, total_heads)
        # The layers vLLM's forward context finds by name (Attention layers carry .kv_cache).
        layers = {n: type("Layer", (), {"kv_cache": kv_caches[n]})() for n in names}
        vc.compilation_config.static_forward_context.update(layers)

        @maybe_transfer_kv_layer
        def attention(layer_name: str, writes):
            """Writes this step's KV of one layer into vLLM's cache view (what the attention op's KV update does)."""
            view = kv_caches[layer_name]
            arr = _view_np(view)  # [B, H, N, C] with its strides
            layer = names.index(layer_name)
            for block, slot, pos, tok in writes:
                arr[block, :, slot, :] = kv_pattern(layer, my_heads, np.array([pos]), np.array([tok]), arr.shape[3])[:, 0, :]

        tokens: dict[str, list[int]] = {}
        blocks: dict[str, list[int]] = {}
        outq.put(("ready", ws.rank, {"layout": ws.kv_cache_config.kv_cache_layout,
                                     "shape": tuple(kv_caches[names[0]].shape),
                                     "stride": tuple(kv_caches[names[0]].stride())}))
        while True:
            msg = inq.get()
            if msg[0] == "stop":
                break
            if msg[0] == "snapshot":  # bytes of the given blocks, every layer: [L, blocks, H, N, C]
                want = msg[1]
                snap = np.stack([_view_np(kv_caches[n])[want] for n in names]) if want else None
                outq.put(("snapshot", ws.rank, snap))
                continue
            if msg[0] == "stats":
                outq.put(("stats", ws.rank, dict(driver.kv_connector.stats)))
                continue
            if msg[0] == "metrics":  # the rank's kvxfer agent's OpenMetrics text
                outq.put(("metrics", ws.rank, driver.kv_connector.agent.metrics()))
                continue
            if msg[0] == "write":  # rewrite blocks with a marker (what a new request's forward does)
                for n in names:
                    _view_np(kv_caches[n])[msg[1]] = msg[2]
                outq.put(("write", ws.rank, None))
                continue
            if msg[0] == "expected":  # the pattern for (blocks, token ids) of a request on this rank's heads
                blist, toks, upto = msg[1], msg[2], msg[3]
                c = _view_np(kv_caches[names[0]]).shape[3]
                want = np.zeros((len(names), len(blist), len(my_heads), BLOCK, c), np.int16)
                for li in range(len(names)):
                    for bi in range(len(blist)):
                        for s in range(BLOCK):
                            pos = bi * BLOCK + s
                            if pos < upto:
                                want[li, bi, :, s, :] = kv_pattern(li, my_heads, np.array([pos]),
                                                                   np.array([toks[pos]]), c)[:, 0, :]
                outq.put(("expected", ws.rank, want))
                continue
            so = msg[1]
            for new in so.scheduled_new_reqs:
                tokens[new.req_id] = list(new.prompt_token_ids)
                blocks[new.req_id] = list(new.block_ids[0])
            cr = so.scheduled_cached_reqs
            for i, rid in enumerate(cr.req_ids):
                ids = cr.new_block_ids[i]
                if rid in cr.resumed_req_ids:
                    blocks[rid] = list(ids[0]) if ids else []
                elif ids:
                    blocks.setdefault(rid, []).extend(ids[0])
            for rid in so.finished_req_ids:
                tokens.pop(rid, None)
                blocks.pop(rid, None)
            if so.total_num_scheduled_tokens == 0:
                out = driver.no_forward(so)
                outq.put(("out", ws.rank, out))
                continue
            # computed tokens before this step, per request
            computed = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
            for i, rid in enumerate(cr.req_ids):
                computed[rid] = cr.num_computed_tokens[i]
            writes = []
            for rid, n in so.num_scheduled_tokens.items():
                toks = tokens.setdefault(rid, [])
                for pos in range(computed[rid], computed[rid] + n):
                    tok = toks[pos] if pos < len(toks) else 7
                    writes.append((blocks[rid][pos // BLOCK], pos % BLOCK, pos, tok))
            batch = type("InputBatch", (), {"req_ids": list(so.num_scheduled_tokens), "idx_mapping": None,
                                            "num_tokens": so.total_num_scheduled_tokens})()
            attn_md = {n: object() for n in names}
            driver.pre_forward(so, batch, attn_md)
            with set_forward_context(attn_md, vc, slot_mapping={}):
                for n in names:
                    attention(n, writes)
            driver.finish_forward()
            kv_out = driver.post_forward(so.finished_req_ids)
            # Sampled tokens: requests past their prompt sample token 7 (appended to their token list).
            req_ids = list(so.num_scheduled_tokens)
            sampled = []
            for rid in req_ids:
                done = computed[rid] + so.num_scheduled_tokens[rid]
                if done >= len(tokens[rid]):
                    tokens[rid].append(7)
                    sampled.append([7])
                else:
                    sampled.append([])
            out = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                    sampled_token_ids=sampled, kv_connector_output=kv_out)
            outq.put(("out", ws.rank, out))
        ensure_kv_transfer_shutdown()
        outq.put(("stopped", ws.rank, None))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Instance:
    """One vLLM instance: the real Scheduler here, one spawned worker process per TP rank."""

    def __init__(self, spec: InstanceSpec, sentinel: bool = False):
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.spec = spec
        self.vc = vllm_config(spec)
        configs, sched_cfg, self.layout = engine_kv_caches(self.vc)
        self.scheduler = Scheduler(self.vc, sched_cfg, StructuredOutputManager(self.vc), block_size=BLOCK,
                                   log_stats=spec.log_stats)
        self.connector = self.scheduler.connector
        self.aggregator = KVOutputAggregator.from_connector(self.connector, spec.tp)
        ctx = mp.get_context("spawn")
        self.outq = ctx.Queue()
        self.inqs = [ctx.Queue() for _ in range(spec.tp)]
        port = free_port()
        self.procs = [ctx.Process(target=worker_main, args=(WorkerSpec(spec, r, configs[r], port, sentinel),
                                                             self.inqs[r], self.outq), daemon=True)
                      for r in range(spec.tp)]
        for p in self.procs:
            p.start()
        self.info = [m[2] for m in self._collect("ready")]
        self.outputs: list = []

    def _collect(self, kind: str, timeout: float = 120.0) -> list:
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(self.procs):
            try:
                m = self.outq.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers did not answer {kind!r} within {timeout} s") from None
                dead = [i for i, p in enumerate(self.procs) if p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"worker ranks {dead} died (exit codes {[self.procs[i].exitcode for i in dead]})")
                continue
            if m[0] == "error":
                raise RuntimeError(f"worker rank {m[1]}: {m[2]}")
            assert m[0] == kind, m
            got[m[1]] = m
        return [got[r] for r in range(len(self.procs))]

    def add(self, request) -> None:
        self.scheduler.add_request(request)

    def step(self):
        """One engine step: schedule -> every worker -> aggregate -> update_from_output."""
        so = self.scheduler.schedule()
        for q in self.inqs:
            q.put(("step", so))
        outs = [m[2] for m in self._collect("out")]
        out = self.aggregator.aggregate(outs)
        eco = self.scheduler.update_from_output(so, out)
        self.outputs.append((so, out, eco))
        return so, out, eco

    def kv_connector_stats(self) -> list[dict]:
        """Every non-empty ``SchedulerStats.kv_connector_stats`` payload the scheduler returned so far (vLLM
        0.33: ``update_from_output`` -> ``make_stats``, what the engine core sends to the stat loggers)."""
        got = []
        for _, _, eco in self.outputs:
            for outs in (eco or {}).values():
                st = getattr(outs, "scheduler_stats", None)
                if st is not None and st.kv_connector_stats:
                    got.append(st.kv_connector_stats)
        return got

    def moved_bytes(self) -> int:
        """Sum over this instance's TP ranks of their agents' ``kvxfer_transfer_bytes_total``."""
        total = 0
        for text in self.ask("metrics"):
            line = next(x for x in text.splitlines() if x.startswith("kvxfer_transfer_bytes_total"))
            total += int(float(line.rsplit(" ", 1)[1]))
        return total

    def block_hasher(self):
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        fn = get_hash_fn_by_name(self.vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(fn)
        return get_request_block_hasher(BLOCK, fn)

    def ask(self, what: str, *args) -> list:
        for q in self.inqs:
            q.put((what, *args))
        return [m[2] for m in self._collect(what)]

    def close(self) -> None:
        for q in self.inqs:
            q.put(("stop",))
        try:
            self._collect("stopped", timeout=30)
        except Exception:  # noqa: BLE001
            pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        if self.connector is not None:
            self.connector.shutdown()


def make_request(rid: str, prompt: list[int], params: dict, max_tokens: int = 1, hasher=None):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args={"kv_transfer_params": dict(params)})
    return Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None,
                   block_hasher=hasher)
