"""SGLang adapter: kvxfer as a disaggregation transfer backend (``--disaggregation-transfer-backend kvxfer``).

A thin mapping of SGLang's ``disaggregation/base/conn.py`` classes onto the kvxfer API (checked against
SGLang 0.5.23):

=============================  ==========================================================================
SGLang                         kvxfer
=============================  ==========================================================================
``KvxferKVManager(args, ...)``  one ``kvxfer.Agent`` per rank (decode: one per prefill bootstrap address,
                               made on first use); ``KVArgs.kv_data_ptrs`` etc. -> ``register_kv``,
                               ``aux_data_*`` -> ``register_aux``
``KvxferKVSender``             ``agent.sender(room)``: ``init``, ``send`` (aux row after the last chunk)
``KvxferKVReceiver``           ``agent.receiver(room)``: ``send_metadata``, aux row placed before Success
``poll()``                     ``KVPoll``; a failed request whose pages may still be written reports
                               ``Transferring`` until the fence closed, so SGLang frees pages only when
                               nothing can land in them (no deferred-release bookkeeping needed)
``failure_exception()``        raises ``kvxfer.KvxferError`` with the Rust error (rank, peer, request)
``KvxferKVBootstrapServer``    ``kvxfer.BootstrapServer`` on the prefill's bootstrap port
=============================  ==========================================================================

What SGLang's ``KVArgs`` does not say, kvxfer needs: the other side's parallelism. Set it in the
environment of both servers (defaults: the same as this side):

- ``KVXFER_PREFILL_TP``, ``KVXFER_DECODE_TP``, ``KVXFER_PREFILL_PP``, ``KVXFER_DECODE_PP``
- ``KVXFER_KV_HEADS``: total KV heads, when this side's ``KVArgs`` lacks ``total_kv_head_num`` and its
  TP is larger than the head count
- ``KVXFER_LAYERS``: total layers, with pipeline parallelism (default: layers of this stage x PP)
- ``KVXFER_BACKEND`` (``tcp``), ``KVXFER_BACKEND_OPTIONS`` (``key=value,key=value``; tcp listens on
  ``0.0.0.0:0`` and advertises this host's address towards the bootstrap unless given),
  ``KVXFER_NOTIFY`` (``attached``), ``KVXFER_TIMEOUT_S`` (60), ``KVXFER_BOOTSTRAP`` (prefill: the
  ``host:port`` of its bootstrap server, default this host and ``--disaggregation-bootstrap-port``)

Not supported (an error names them): draft-model KV (speculative decoding), state buffers (Mamba, SWA),
decode-side prefix reuse (``decode_prefix_len > 0``), host KV destinations.

The plugin (entry point ``sglang.srt.plugins: kvxfer = kvxfer.sglang:register``) adds ``kvxfer`` to the
transfer-backend choices and to ``TransferBackend``, and makes ``get_kv_class`` return these classes for
it, in every module that imported it, without patching SGLang's files.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import kvxfer
from kvxfer import KVPoll

logger = logging.getLogger("sglang.srt.disaggregation.kvxfer")  # under SGLang's loggers

try:  # SGLang's base classes when SGLang is installed; plain objects otherwise (tier 0 runs without it).
    from sglang.srt.disaggregation.base.conn import (  # type: ignore[import-not-found]
        BaseKVBootstrapServer,
        BaseKVManager,
        BaseKVReceiver,
        BaseKVSender,
        KVTransferMetric,
    )

    HAVE_SGLANG = True
except Exception:  # noqa: BLE001 - any import failure means: no usable SGLang here
    HAVE_SGLANG = False

    class BaseKVManager:  # type: ignore[no-redef]
        """Stand-in for SGLang's class when SGLang is not installed."""

    class BaseKVSender:  # type: ignore[no-redef]
        """Stand-in for SGLang's class when SGLang is not installed."""

    class BaseKVReceiver:  # type: ignore[no-redef]
        """Stand-in for SGLang's class when SGLang is not installed."""

    class BaseKVBootstrapServer:  # type: ignore[no-redef]
        """Stand-in for SGLang's class when SGLang is not installed."""

    class KVTransferMetric(SimpleNamespace):  # type: ignore[no-redef]
        """Stand-in for SGLang's metric record."""

        def __init__(self, transfer_latency_s=None, alloc_latency_s=None, transfer_total_bytes=None):
            super().__init__(transfer_latency_s=transfer_latency_s, alloc_latency_s=alloc_latency_s,
                             transfer_total_bytes=transfer_total_bytes)


BACKEND_NAME = "kvxfer"
def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


def _dtype_bytes(s: str | None) -> int | None:
    s = (s or "").lower()
    for key, n in (("float32", 4), ("fp32", 4), ("bfloat16", 2), ("float16", 2), ("half", 2), ("bf16", 2),
                   ("fp16", 2), ("fp8", 1), ("float8", 1), ("int8", 1), ("uint8", 1)):
        if key in s:
            return n
    return None


def _mode(m: Any) -> str:
    v = getattr(m, "value", m)
    if v not in ("prefill", "decode"):
        raise kvxfer.KvxferError(f"kvxfer: disaggregation mode must be prefill or decode, not {v!r}")
    return v


def _model_kv_heads(server_args: Any) -> int | None:
    """The model's total KV heads from its config (``--model-path``; no download: a local path or the
    Hugging Face cache), as SGLang's ``ModelConfig.get_total_num_kv_heads`` reads them."""
    path = _resolved(server_args, "model_path", None)
    if not path:
        return None
    try:
        from transformers import AutoConfig  # SGLang's own dependency

        cfg = AutoConfig.from_pretrained(path, trust_remote_code=bool(_resolved(server_args, "trust_remote_code", False)),
                                         local_files_only=True)
    except Exception as e:  # noqa: BLE001 - reported by the caller's error
        logger.debug("kvxfer: no model config at %s: %s", path, e)
        return None
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    for name in ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "num_attention_heads"):
        v = getattr(text, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def pinned_protocol(value: str | None) -> int | None:
    """``KVXFER_PROTOCOL``: the newest kvxfer protocol this rank speaks (unset: this build's newest).
    During a rolling upgrade, ``KVXFER_PROTOCOL=2`` keeps an upgraded rank on the previous release's
    protocol; a version this build does not speak is refused when the agent is made."""
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"KVXFER_PROTOCOL={value!r} is not a protocol version (an integer, e.g. 2)") from None


def model_identity(server_args: Any, group: str) -> dict[str, str] | None:
    """The model identity kvxfer publishes with this rank's layout (issue 30): ranks that both name one
    and name different ones never pair. The model path as SGLang was started with it (the draft model's
    for the draft group; other groups carry their name), its revision and the KV cache dtype
    (``kv_cache_dtype``, else ``dtype``). ``KVXFER_MODEL_IDENTITY=0`` sends none (e.g. when the two
    sides name one model by different paths)."""
    if os.environ.get("KVXFER_MODEL_IDENTITY", "1") == "0":
        return None
    try:
        path = _resolved(server_args, "model_path", None)
        revision = getattr(server_args, "revision", None)
        if group == "draft":
            path = getattr(server_args, "speculative_draft_model_path", None) or path
            revision = getattr(server_args, "speculative_draft_model_revision", None) or revision
        if not path:
            return None
        kv = str(getattr(server_args, "kv_cache_dtype", None) or "auto")
        dtype = str(getattr(server_args, "dtype", None) or "auto") if kv == "auto" else kv
        name = str(path) if group in ("kv", "draft") else f"{path}#{group}"
        return {"name": name, "revision": str(revision or ""), "dtype": dtype}
    except Exception:  # noqa: BLE001 - an identity is a safeguard, never a reason not to start
        logger.warning("kvxfer: no model identity from the server args", exc_info=True)
        return None


def _resolved(server_args: Any, name: str, default: Any = None) -> Any:
    """A setting as SGLang resolved it: SGLang 0.5.23 publishes resolved values in its runtime context
    (``get_parallel()``, ``get_device()``, ...) while ``ServerArgs`` keeps the raw input (``device`` is
    None there unless given); older SGLang and tests: the ``server_args`` attribute."""
    try:
        from sglang.srt import runtime_context as rc  # type: ignore[import-not-found]

        getters = {
            "tp_size": lambda: rc.get_parallel().tp_size,
            "dp_size": lambda: rc.get_parallel().dp_size,
            "pp_size": lambda: rc.get_parallel().pp_size,
            "attn_tp_size": lambda: rc.get_parallel().attn_tp_size,
            "device": lambda: rc.get_device().device,
            "disaggregation_bootstrap_port": lambda: rc.get_disagg().disaggregation_bootstrap_port,
            "host": lambda: rc.get_serving().host,
            "model_path": lambda: rc.get_model().model_path,
            "trust_remote_code": lambda: rc.get_model().trust_remote_code,
        }
        v = getters[name]()
        if v is not None:
            return v
    except Exception:  # noqa: BLE001 - not published here (tier 0, another SGLang)
        pass
    v = getattr(server_args, name, None)
    return default if v is None else v


def _attn_tp(server_args: Any) -> int:
    dp = _resolved(server_args, "dp_size", 1) or 1
    tp = _resolved(server_args, "tp_size", 1) or 1
    attn = _resolved(server_args, "attn_tp_size", None) if not isinstance(server_args, SimpleNamespace) else None
    if attn:
        return int(attn)
    return tp // dp if getattr(server_args, "enable_dp_attention", False) else tp


def _dp_attention(server_args: Any) -> bool:
    return _attn_tp(server_args) < (_resolved(server_args, "tp_size", 1) or 1) or bool(
        getattr(server_args, "enable_dp_attention", False))


def _stage_layers(total: int, pp: int, env: str) -> list[int] | None:
    """Every PP stage's layer count: ``env`` (``20,21,20``), else SGLang's own partition
    (``SGLANG_PP_LAYER_PARTITION`` / ``get_pp_indices``: the last stages take the remainder)."""
    if pp <= 1:
        return None
    given = os.environ.get(env)
    if given:
        return [int(x) for x in given.split(",")]
    try:
        from sglang.srt.distributed.utils import get_pp_indices  # type: ignore[import-not-found]

        return [b - a for a, b in (get_pp_indices(total, r, pp) for r in range(pp))]
    except Exception:  # noqa: BLE001 - no SGLang: an even split
        return None


def topology_from_kv_args(args: Any, server_args: Any, role: str, is_mla: bool,
                          items: list[int] | None = None, heads_env: str = "KVXFER_KV_HEADS") -> kvxfer.Topology:
    """The kvxfer topology an SGLang rank's ``KVArgs`` (plus ``KVXFER_*`` for the other side) describe (the
    target model's KV; ``items``: another group's item lengths, e.g. the draft model's)."""
    layout = getattr(args, "kv_layout", None) or "nhd"
    if layout not in ("nhd", "hnd"):
        raise kvxfer.KvxferError(f"kvxfer: KV layout {layout!r} is not supported (nhd, hnd)")
    page = int(args.page_size)
    draft = int(getattr(args, "num_draft_entries", 0) or 0)
    if items is None:
        items = list(args.kv_item_lens)[: len(args.kv_item_lens) - draft]
    kinds = 1 if is_mla else 2
    if not items or len(items) % kinds:
        raise kvxfer.KvxferError(f"kvxfer: {len(items)} KV buffers for {'MLA' if is_mla else 'K and V'}")
    stage_layers = len(items) // kinds
    dtype = _dtype_bytes(getattr(args, "kv_cache_dtype_str", None)) or _env_int("KVXFER_DTYPE_BYTES") or 2

    attn_tp = _attn_tp(server_args)
    pp = _resolved(server_args, "pp_size", 1) or 1
    mine = {"tp": attn_tp, "pp": pp}
    prefill = {"tp": _env_int("KVXFER_PREFILL_TP"), "pp": _env_int("KVXFER_PREFILL_PP")}
    decode = {"tp": _env_int("KVXFER_DECODE_TP"), "pp": _env_int("KVXFER_DECODE_PP")}
    # The other side: KVXFER_* when given, else this side's TP and PP 1 (a decode rarely runs PP).
    other = {"tp": attn_tp, "pp": 1}
    p = {k: (mine[k] if role == "prefill" else (prefill[k] or other[k])) for k in mine}
    d = {k: (mine[k] if role == "decode" else (decode[k] or other[k])) for k in mine}
    # Layers. Prefill PP: every stage's layer count (SGLang's partition, or KVXFER_PREFILL_LAYERS), checked
    # against the range this stage's KVArgs say it holds (prefill_start_layer / prefill_end_layer).
    kw: dict[str, Any] = dict(page_size=page, dtype_bytes=dtype, prefill_tp=p["tp"], decode_tp=d["tp"],
                              prefill_pp=p["pp"], decode_pp=d["pp"], layout=layout)
    layers = _env_int("KVXFER_LAYERS")
    if p["pp"] > 1:
        total = layers or (stage_layers if role == "decode" and d["pp"] == 1 else None) or _model_layers(server_args)
        if total is None:
            raise kvxfer.KvxferError("kvxfer: prefill PP needs the model's layer count: set KVXFER_LAYERS")
        stages = _stage_layers(total, p["pp"], "KVXFER_PREFILL_LAYERS")
        if stages is None or sum(stages) != total:
            raise kvxfer.KvxferError(f"kvxfer: no partition of {total} layers over prefill PP {p['pp']}: set "
                                     "KVXFER_PREFILL_LAYERS (e.g. 20,21,20) on both sides")
        layers = total
        kw["prefill_layers"] = stages
        if role == "prefill":
            rank = int(getattr(args, "pp_rank", 0) or 0)
            start = getattr(args, "prefill_start_layer", None)
            end = getattr(args, "prefill_end_layer", None)
            want = (sum(stages[:rank]), sum(stages[: rank + 1]))
            if start is not None and end is not None and (int(start), int(end)) != want:
                raise kvxfer.KvxferError(
                    f"kvxfer: prefill PP stage {rank} holds layers [{start}, {end}) but the partition {stages} "
                    f"puts [{want[0]}, {want[1]}) there; set KVXFER_PREFILL_LAYERS alike on both sides")
            if stages[rank] != stage_layers:
                raise kvxfer.KvxferError(f"kvxfer: prefill PP stage {rank} registers {stage_layers} layers; the "
                                         f"partition {stages} gives it {stages[rank]}")
    elif not layers:
        layers = stage_layers * mine["pp"]
    kw["layers"] = layers
    if is_mla:
        kw["mla_latent_dim"] = items[0] // (page * dtype)
    else:
        heads = (getattr(args, "total_kv_head_num", None) if heads_env == "KVXFER_KV_HEADS" else None) or _env_int(
            heads_env)
        local = getattr(args, "kv_head_num", None) if heads_env == "KVXFER_KV_HEADS" else None
        if not heads and heads_env == "KVXFER_KV_HEADS":
            heads = _model_kv_heads(server_args)
        if not heads:
            if not local or local == 1:
                raise kvxfer.KvxferError(
                    f"kvxfer: this {role} rank holds {local or 'an unknown number of'} KV head(s); KVArgs has no "
                    f"total_kv_head_num and the model config at --model-path "
                    f"{_resolved(server_args, 'model_path', None)!r} gave none: set {heads_env} to the model's "
                    "num_key_value_heads")
            heads = local * attn_tp
        local = max(1, heads // attn_tp)
        for what, item in (("K", items[0]), ("V", items[stage_layers])):
            if item % (page * local * dtype):
                raise kvxfer.KvxferError(
                    f"kvxfer: a {what} page of {item} bytes is not {page} tokens x {local} heads x whole "
                    f"{dtype}-byte elements ({heads} KV heads over attention TP {attn_tp})")
        kw.update(kv_heads=heads, head_dim=items[0] // (page * local * dtype),
                  v_head_dim=items[stage_layers] // (page * local * dtype))
    return kvxfer.Topology(**kw)


def _model_layers(server_args: Any) -> int | None:
    path = _resolved(server_args, "model_path", None)
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(path, local_files_only=True,
                                         trust_remote_code=bool(_resolved(server_args, "trust_remote_code", False)))
        return int(getattr(cfg.get_text_config(), "num_hidden_layers"))
    except Exception:  # noqa: BLE001
        return None


@dataclass
class _Group:
    """One set of buffers kvxfer moves with its own agent: the target KV, the draft model's KV, or one
    size class of a state type (SWA, Mamba: items copied whole, at equal attention TP)."""

    name: str
    prefix: str
    topology: kvxfer.Topology
    ptrs: list[int]
    lens: list[int]
    items: list[int]
    state: int | None = None  # index into KVArgs.state_types
    tensors: list[int] = field(default_factory=list)  # which tensors of that state type


def _whole_items(name: str, items: list[int], prefill_tp: int, decode_tp: int, page_size: int) -> kvxfer.Topology:
    """Buffers whose pages move whole (no head split): an MLA-like topology of one "latent" per page."""
    if items[0] % page_size:
        raise kvxfer.KvxferError(f"kvxfer: {name}: an item of {items[0]} bytes is not {page_size} equal tokens")
    return kvxfer.Topology(layers=len(items), page_size=page_size, dtype_bytes=1, prefill_tp=prefill_tp,
                           decode_tp=decode_tp, mla_latent_dim=items[0] // page_size)


class KvxferKVManager(BaseKVManager):
    """One rank's kvxfer agents, from SGLang's ``KVArgs``: the target KV, the draft model's KV (speculative
    decoding) and state buffers (SWA, Mamba), each its own agent under its own bootstrap prefix."""

    # SGLang's deferred release (decode.py: a failed transfer's pages are held on every attention-TP rank
    # until ``is_abort_release_safe``): kvxfer's fence answers it per room.
    supports_deferred_decode_kv_release = True
    supports_host_destination = False
    supports_role_switch = False

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend: bool | None = False, **_ignored):
        self.kv_args = args
        self.server_args = server_args
        self.role = _mode(disaggregation_mode)
        self.is_mla_backend = bool(is_mla_backend)
        try:
            from sglang.srt.environ import envs  # type: ignore[import-not-found]

            self.enable_deferred_decode_kv_release = bool(envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get())
        except Exception:  # noqa: BLE001 - no SGLang
            self.enable_deferred_decode_kv_release = True
        self.topology = topology_from_kv_args(args, server_args, self.role, self.is_mla_backend)
        self.attn_tp = _attn_tp(server_args)
        # SGLang's prefill gives the global TP rank; kvxfer ranks are attention-TP ranks.
        self.tp_rank = int(args.engine_rank) % self.attn_tp
        self.dp_rank = int(getattr(args, "system_dp_rank", 0) or 0) if _dp_attention(server_args) else 0
        self.pp_rank = int(getattr(args, "pp_rank", 0) or 0)
        self.backend = os.environ.get("KVXFER_BACKEND", "tcp")
        self.notify = os.environ.get("KVXFER_NOTIFY", "attached")
        self.timeout_s = float(os.environ.get("KVXFER_TIMEOUT_S", "60"))
        device = str(_resolved(server_args, "device", "cuda") or "cuda")
        self.mem_kind = "host" if device == "cpu" else "cuda"
        # Whether the backend takes GPU memory is the agent's to say: its start() refuses, naming the
        # backends compiled in that can (tcp and local need the CUDA driver on this host).
        self.groups = self._groups(args)
        self._sent_page_bytes: list[int] | None = None
        self.prefill_dp = (_resolved(server_args, "dp_size", 1) or 1) if self.role == "prefill" and _dp_attention(
            server_args) else (_env_int("KVXFER_PREFILL_DP") or 1)
        if self.role == "decode" and _dp_attention(server_args) and (_resolved(server_args, "dp_size", 1) or 1) > 1:
            raise kvxfer.KvxferError(
                "kvxfer: DP attention on the decode side is not supported yet (each decode DP rank would need its "
                "own kvxfer rank set); the prefill side may use it")
        # Decode: what SGLang's scheduler reads before it creates receivers (prefill_info_table,
        # try_ensure_parallel_info); agents per (prefill instance, prefill DP rank), made on first use.
        self.prefill_info_table: dict[str, Any] = {}
        self._agents: dict[tuple[str, int], list[kvxfer.Agent]] = {}
        self._errors: dict[tuple[str, int], str] = {}
        self._receivers: dict[int, Any] = {}
        self._lock = threading.Lock()
        logger.info("kvxfer: SGLang %s rank tp %d/%d pp %d dp %d: %s; groups %s; %s backend", self.role, self.tp_rank,
                    self.attn_tp, self.pp_rank, self.dp_rank, self.topology, [g.name for g in self.groups],
                    self.backend)
        if self.role == "prefill":
            port = _resolved(server_args, "disaggregation_bootstrap_port", None)
            addr = os.environ.get("KVXFER_BOOTSTRAP") or f"{self._bootstrap_host()}:{port}"
            self._bootstrap = addr
            self._agents_for(addr, self.dp_rank, wait_s=30.0)

    def _groups(self, args) -> list[_Group]:
        draft = int(getattr(args, "num_draft_entries", 0) or 0)
        n = len(args.kv_data_ptrs) - draft
        groups = [_Group("kv", "", self.topology, list(args.kv_data_ptrs[:n]), list(args.kv_data_lens[:n]),
                         list(args.kv_item_lens[:n]))]
        page = int(args.page_size)
        p_tp, d_tp = self.topology.prefill_tp, self.topology.decode_tp
        extra = draft or any(getattr(args, "state_data_ptrs", None) or [])
        if extra and (self.topology.prefill_pp > 1 or self.topology.decode_pp > 1):
            raise kvxfer.KvxferError(
                f"kvxfer: {'draft-model KV' if draft else 'state buffers'} with pipeline parallelism (prefill PP "
                f"{self.topology.prefill_pp}, decode PP {self.topology.decode_pp}) are not supported yet")
        if draft:
            items = list(args.kv_item_lens[n:])
            if p_tp == d_tp and not _env_int("KVXFER_DRAFT_KV_HEADS"):
                topo = _whole_items("draft KV", items, p_tp, d_tp, page)
            else:
                topo = topology_from_kv_args(args, self.server_args, self.role, self.is_mla_backend, items=items,
                                             heads_env="KVXFER_DRAFT_KV_HEADS")
            groups.append(_Group("draft", "-draft", topo, list(args.kv_data_ptrs[n:]), list(args.kv_data_lens[n:]),
                                 items))
        types = list(getattr(args, "state_types", None) or [])
        for t, ptrs in enumerate(getattr(args, "state_data_ptrs", None) or []):
            if not ptrs:
                continue
            name = str(getattr(types[t], "value", types[t])) if t < len(types) else f"state{t}"
            if p_tp != d_tp:
                raise kvxfer.KvxferError(
                    f"kvxfer: state buffers ({name}) move whole at equal attention TP only; this model "
                    f"({_resolved(self.server_args, 'model_path', '?')}) runs prefill TP {p_tp} and decode TP {d_tp} "
                    f"with {len(ptrs)} {name} tensors of {sorted(set(args.state_item_lens[t]))} bytes per slot")
            lens, items = list(args.state_data_lens[t]), list(args.state_item_lens[t])
            by_size: dict[int, list[int]] = {}
            for i, item in enumerate(items):
                by_size.setdefault(item, []).append(i)
            for k, (item, idx) in enumerate(sorted(by_size.items())):
                topo = _whole_items(f"state {name}", [item] * len(idx), p_tp, d_tp, 1)
                groups.append(_Group(f"state:{name}:{item}", f"-state{t}-{k}", topo, [ptrs[i] for i in idx],
                                     [lens[i] for i in idx], [item] * len(idx), state=t, tensors=idx))
        return groups

    # ----------------------------------------------------------------------------------- agents

    def _bootstrap_host(self) -> str:
        host = _resolved(self.server_args, "host", None) or "127.0.0.1"
        if host in ("0.0.0.0", "::"):
            dist = getattr(self.server_args, "dist_init_addr", None)
            host = dist.rsplit(":", 1)[0] if dist else "127.0.0.1"
        return host

    def _options(self, bootstrap: str) -> dict[str, str]:
        opts: dict[str, str] = {}
        for kv in filter(None, os.environ.get("KVXFER_BACKEND_OPTIONS", "").split(",")):
            k, _, v = kv.partition("=")
            opts[k.strip()] = v.strip()
        if self.backend == "tcp":
            opts.setdefault("listen", "0.0.0.0:0")
            opts.setdefault("advertise", kvxfer.local_address(bootstrap))
        return opts

    def _agents_for(self, bootstrap: str, dp: int, wait_s: float = 0.0) -> list[kvxfer.Agent]:
        """This rank's agents towards one prefill instance and DP rank (one per group), started."""
        key = (bootstrap, dp)
        with self._lock:
            agents = self._agents.get(key)
            if agents is not None:
                return agents
            started: list[kvxfer.Agent] = []
            try:
                for g in self._groups_list():
                    prefix = f"/kvxfer{g.prefix}" + (f"-dp{dp}" if self.prefill_dp > 1 else "")
                    agent = kvxfer.Agent(role=self.role, topology=g.topology, tp_rank=self.tp_rank,
                                         pp_rank=self.pp_rank, bootstrap=f"{bootstrap}{prefix}", backend=self.backend,
                                         notify=self.notify, backend_options=self._options(bootstrap),
                                         timeout_s=self.timeout_s,
                                         label=f"sglang {self.role} {g.name} pid {os.getpid()}",
                                         digest=self.role == "decode" and os.environ.get("KVXFER_DIGEST") == "1",
                                         model=model_identity(self.server_args, g.name),
                                         protocol=pinned_protocol(os.environ.get("KVXFER_PROTOCOL")))
                    agent.register_kv(ptrs=g.ptrs, lens=g.lens, item_lens=g.items, kind=self.mem_kind,
                                      device=int(getattr(self.kv_args, "gpu_id", 0) or 0))
                    args = self.kv_args
                    if g.name == "kv" and getattr(args, "aux_data_ptrs", None):
                        agent.register_aux(ptrs=list(args.aux_data_ptrs), lens=list(args.aux_data_lens),
                                           item_lens=list(args.aux_item_lens))
                    # The prefill may start before its bootstrap service listens: retry while the store
                    # is unreachable, for a while, then raise the last cause (a failed start keeps its
                    # setup, so the cause repeats). Any other start failure (memory the backend does not
                    # take, a bad configuration) reaches SGLang at once.
                    deadline = time.monotonic() + wait_s
                    while True:
                        try:
                            agent.start()
                            break
                        except kvxfer.StoreUnreachable as e:
                            if time.monotonic() > deadline:
                                raise
                            logger.info("kvxfer: %s agent not started yet (%s); retrying", g.name, e)
                            time.sleep(0.5)
                    started.append(agent)
            except BaseException:
                for a in started:
                    try:
                        a.close()
                    except Exception:  # noqa: BLE001
                        pass
                raise
            self._agents[key] = started
            return started

    def _groups_list(self) -> list[_Group]:
        return self.groups

    def agents(self, bootstrap_addr: str | None = None, dp: int = 0) -> list[kvxfer.Agent]:
        """This rank's agents (decode: those for that prefill instance and DP rank, made on first use)."""
        if self.role == "prefill":
            return next(iter(self._agents.values()))
        if not bootstrap_addr:
            raise kvxfer.KvxferError("kvxfer: a decode request needs its prefill's bootstrap address")
        return self._agents_for(bootstrap_addr, dp)

    def agent(self, bootstrap_addr: str | None = None) -> kvxfer.Agent:
        return self.agents(bootstrap_addr)[0]

    def sent_page_bytes(self) -> list[int]:
        """Prefill: per group, the bytes this rank writes per page of a request (kvxfer's plan,
        ``Topology.sent_page_bytes``): what its ``kvxfer_transfer_bytes_total`` counts per page sent."""
        if self._sent_page_bytes is None:
            self._sent_page_bytes = [g.topology.sent_page_bytes(self.tp_rank, self.pp_rank) for g in self.groups]
        return self._sent_page_bytes

    # ---------------------------------------------------------------------- SGLang's manager API

    def register_to_bootstrap(self):
        """Agents register themselves when they start."""

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode: joins that prefill instance (once); True once its ranks are connected. Never raises: an
        unreachable prefill is retried by SGLang, which then aborts its requests."""
        try:
            agents = self._agents_for(bootstrap_addr, 0)
        except kvxfer.KvxferError as e:
            self._errors[(bootstrap_addr, 0)] = str(e)
            logger.warning("kvxfer: cannot join the prefill at %s: %s", bootstrap_addr, e)
            return False
        if all(a.is_connected() for a in agents):
            self.prefill_info_table.setdefault(
                bootstrap_addr, SimpleNamespace(dp_size=self.prefill_dp, follow_bootstrap_room=True,
                                                tp_size=self.topology.prefill_tp, pp_size=self.topology.prefill_pp))
            return True
        return False

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        # A decode rank of another TP width holds a slice of what a prefill rank digested.
        return self.topology.prefill_tp == self.topology.decode_tp

    def is_abort_release_safe(self, bootstrap_room: int = 0, required_acks: int = 0) -> bool:
        """SGLang's deferred release: true once no write of that room can land in this rank's pages."""
        r = self._receivers.get(int(bootstrap_room))
        return r is None or r.is_abort_release_safe()

    def clear_deferred_abort_state(self, bootstrap_room: int = 0) -> None:
        """The receiver's ``clear`` drops it."""

    def close(self) -> None:
        """Closes every agent (tests; SGLang ends the process)."""
        with self._lock:
            agents, self._agents = [a for v in self._agents.values() for a in v], {}
        for a in agents:
            a.close()


def _raise_failure(req) -> None:
    exc = req.failure_exception() if req is not None else None
    if exc is not None:
        raise exc


def _combined(parts: list, local_failure: str | None) -> int:
    """One SGLang poll over a request's parts (target KV, draft KV, state groups): Failed only once every
    part is final with its pages reusable (a failed part aborts the others), Success when all are."""
    polls = [p.poll() for p in parts]
    if local_failure is not None or KVPoll.Failed in polls:
        for p, v in zip(parts, polls):
            if v not in (KVPoll.Success, KVPoll.Failed):
                p.abort("another part of the request failed")
        if all(p.pages_reusable() and p.poll() in (KVPoll.Success, KVPoll.Failed) for p in parts):
            return KVPoll.Failed
        return KVPoll.Transferring
    return min(polls) if polls else KVPoll.Failed


class KvxferKVSender(BaseKVSender):
    """Prefill side of one request. ``send`` never raises (SGLang calls it without a ``try``): a failure
    shows in ``poll`` as ``Failed``, as SGLang's own senders report it."""

    def __init__(self, mgr: KvxferKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False, **_ignored):
        self.kv_mgr = mgr
        self.bootstrap_room = int(bootstrap_room)
        self.parts = [a.sender(self.bootstrap_room) for a in mgr.agents()]
        self.init_time: float | None = None
        # SGLang's transfer metric (get_transfer_metric): pages sent per part, first send, latency.
        self._pages_sent = [0] * len(self.parts)
        self._transfer_start: float | None = None
        self._transfer_latency_s: float | None = None
        self.conclude_state: int | None = None
        self._failure: str | None = None
        self._state_inited: set[int] = set()

    def _fail(self, why: str) -> None:
        if self._failure is None:
            self._failure = why
            logger.warning("kvxfer: prefill request %d failed: %s", self.bootstrap_room, why)
        for p in self.parts:
            p.abort(why)

    def init(self, num_kv_indices: int, aux_index: int | None = None):
        self.init_time = time.monotonic()
        try:
            for g, p in zip(self.kv_mgr.groups, self.parts):
                if g.state is None:
                    p.init(int(num_kv_indices), None if aux_index is None or g.name != "kv" else int(aux_index))
        except kvxfer.KvxferError as e:
            self._fail(str(e))

    def send(self, kv_indices, state_indices=None, num_kv_tokens=None, **_ignored):
        if self._failure is not None:
            return
        try:
            if self._transfer_start is None:
                self._transfer_start = time.perf_counter()
            for i, (g, p) in enumerate(zip(self.kv_mgr.groups, self.parts)):
                if g.state is None:
                    p.send(kv_indices)
                    self._pages_sent[i] += len(kv_indices)
                elif state_indices is not None and g.state < len(state_indices) and state_indices[g.state] is not None:
                    idx = list(state_indices[g.state])
                    if id(p) not in self._state_inited:
                        p.init(len(idx))
                        self._state_inited.add(id(p))
                    p.send(idx)
                    self._pages_sent[i] += len(idx)
        except kvxfer.KvxferError as e:  # e.g. the decode aborted: poll reports Failed
            self._fail(str(e))

    def poll(self) -> int:
        v = _combined(self.parts, self._failure)
        if v in (KVPoll.Success, KVPoll.Failed):
            self.conclude_state = v
            if v == KVPoll.Success and self._transfer_latency_s is None and self._transfer_start is not None:
                self._transfer_latency_s = time.perf_counter() - self._transfer_start
        return v

    def poll_pp_consensus(self) -> int:
        """Prefill PP: SGLang polls stage 0 and broadcasts. Each stage's sender reports its own layers; a
        stage that fails tells the decode, which fails the request for every stage."""
        return self.poll()

    def failure_exception(self):
        if self._failure is not None:
            raise kvxfer.KvxferError(f"kvxfer: prefill request {self.bootstrap_room}: {self._failure}")
        for p in self.parts:
            _raise_failure(p)
        raise kvxfer.KvxferError(f"kvxfer: prefill request {self.bootstrap_room} failed")

    def abort(self):
        self._fail("aborted by the prefill engine")

    def clear(self):
        for p in self.parts:
            p.clear()

    def get_transfer_metric(self):
        """SGLang 0.5.23's per-request transfer metric (``BaseKVSender.get_transfer_metric``; its prefill
        loop observes it for every finished request into ``sglang:kv_transfer_latency_ms``,
        ``sglang:kv_transfer_total_mb`` and ``sglang:kv_transfer_speed_gb_s``): the bytes this rank wrote
        (pages sent times ``Topology.sent_page_bytes`` per agent: what kvxfer's
        ``kvxfer_transfer_bytes_total`` counts) and the time from the first send to the poll that saw
        ``Success``. Both None until the request succeeded (a failed request's writes did not all land;
        SGLang observes only requests that succeeded)."""
        if self._transfer_latency_s is None:
            return KVTransferMetric()
        nbytes = sum(n * b for n, b in zip(self._pages_sent, self.kv_mgr.sent_page_bytes()))
        return KVTransferMetric(transfer_latency_s=self._transfer_latency_s, transfer_total_bytes=nbytes)

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        # The last chunk is sent even when empty: it is what completes the request.
        return num_pages > 0 or last_chunk

    def get_max_transfer_tokens(self):
        return None

    def pop_decode_prefix_len(self) -> int:
        return 0


class KvxferKVReceiver(BaseKVReceiver):
    """Decode side of one request. Nothing here blocks or raises: the agents for the request's prefill are
    made in ``init`` (after SGLang's ``try_ensure_parallel_info``), and a prefill that cannot be reached
    fails the request (``poll`` -> ``Failed``)."""

    def __init__(self, mgr: KvxferKVManager, bootstrap_addr: str, bootstrap_room: int | None = None, **_ignored):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room or 0)
        self.parts: list = []
        self.conclude_state: int | None = None
        self.abort_notified = False
        self.require_staging = False
        self.bootstrap_infos: list = []
        self._local_failure: str | None = None
        self._handed_off = False
        mgr._receivers[self.bootstrap_room] = self

    @property
    def supports_host_destination(self) -> bool:
        return False

    def init(self, prefill_dp_rank: int = 0, **_ignored):
        """Joins the request's prefill instance and DP rank (once per manager)."""
        if self.parts or self._local_failure is not None:
            return
        try:
            agents = self.kv_mgr.agents(self.bootstrap_addr, int(prefill_dp_rank or 0))
            self.parts = [a.receiver(self.bootstrap_room) for a in agents]
        except kvxfer.KvxferError as e:
            self._local_failure = f"kvxfer: decode request {self.bootstrap_room}: prefill {self.bootstrap_addr}: {e}"

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None,
                      destination=None, **_ignored):
        if self._local_failure is None and not self.parts:
            self.init(0)
        if self._local_failure is not None:
            return
        if decode_prefix_len:
            self._local_failure = (f"kvxfer: decode request {self.bootstrap_room}: decode-side prefix reuse "
                                   f"(decode_prefix_len {decode_prefix_len}) is not supported yet")
            return
        if destination is not None and getattr(destination, "value", destination) != "device":
            self._local_failure = f"kvxfer: decode request {self.bootstrap_room}: host destinations are not supported"
            return
        try:
            for g, r in zip(self.kv_mgr.groups, self.parts):
                if g.state is None:
                    r.send_metadata(kv_indices, None if aux_index is None or g.name != "kv" else int(aux_index))
                elif state_indices is not None and g.state < len(state_indices) and state_indices[g.state] is not None:
                    r.send_metadata(list(state_indices[g.state]))
                else:
                    self._local_failure = (f"kvxfer: decode request {self.bootstrap_room}: the model has {g.name} "
                                           "state but SGLang gave no state indices")
            self._handed_off = True
        except kvxfer.KvxferError as e:
            self._local_failure = str(e)

    def poll(self) -> int:
        if not self.parts:
            v = KVPoll.Failed if self._local_failure is not None else KVPoll.Bootstrapping
        else:
            v = _combined(self.parts, self._local_failure)
        if v in (KVPoll.Success, KVPoll.Failed):
            self.conclude_state = v
        return v

    def failure_exception(self):
        if self._local_failure is not None:
            raise kvxfer.KvxferError(self._local_failure)
        for p in self.parts:
            _raise_failure(p)
        raise kvxfer.KvxferError(f"kvxfer: decode request {self.bootstrap_room} failed")

    def is_abort_release_safe(self) -> bool:
        return all(p.pages_reusable() for p in self.parts)

    def ensure_abort_notified(self, force_arm: bool = False) -> None:
        """SGLang's deferred release: stop every write of this request into this rank's pages (the prefill
        ranks are told at once; ``is_abort_release_safe`` turns true after kvxfer's fence)."""
        for p in self.parts:
            if p.poll() not in (KVPoll.Success, KVPoll.Failed) or not p.pages_reusable():
                p.abort("the decode released the request (SGLang deferred release)")
        self.abort_notified = True

    def abort(self):
        if not self.parts:
            self._local_failure = self._local_failure or f"kvxfer: decode request {self.bootstrap_room} aborted"
        for p in self.parts:
            p.abort("aborted by the decode engine")

    def clear(self):
        for p in self.parts:
            p.clear()
        if self.kv_mgr._receivers.get(self.bootstrap_room) is self:
            del self.kv_mgr._receivers[self.bootstrap_room]


class KvxferKVBootstrapServer(BaseKVBootstrapServer):
    """The prefill instance's meeting point: kvxfer's bootstrap service on the bootstrap port."""

    def __init__(self, host: str, port: int, **_ignored):
        self.server = kvxfer.BootstrapServer(host=host or "0.0.0.0", port=int(port))
        self.address = self.server.address

    def close(self):
        self.server.close()


CLASSES = {
    "manager": KvxferKVManager,
    "sender": KvxferKVSender,
    "receiver": KvxferKVReceiver,
    "bootstrap_server": KvxferKVBootstrapServer,
}


def _add_enum_member(enum_cls, name: str, value: str):
    """Adds a member to an Enum class (SGLang's ``TransferBackend``), as plugin systems do."""
    if value in enum_cls._value2member_map_:
        return enum_cls._value2member_map_[value]
    member = object.__new__(enum_cls)
    member._name_ = name
    member._value_ = value
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    type.__setattr__(enum_cls, name, member)
    return member


def register() -> None:
    """SGLang plugin entry point: makes ``--disaggregation-transfer-backend kvxfer`` select these classes."""
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation import utils as du
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND_NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND_NAME])
    member = _add_enum_member(du.TransferBackend, "KVXFER", BACKEND_NAME)

    def get_kv_class(original, transfer_backend, class_type, *args, **kwargs):
        if transfer_backend == member or getattr(transfer_backend, "value", transfer_backend) == BACKEND_NAME:
            kind = getattr(class_type, "value", class_type)
            if kind == "kvargs":
                return original(du.TransferBackend.FAKE, class_type)  # the shared KVArgs container
            return CLASSES[kind]
        return original(transfer_backend, class_type, *args, **kwargs)

    # utils.get_kv_class is wrapped; a module that imported it by name before (a scheduler process
    # imports decode.py and prefill.py before it loads plugins) gets the wrapped one too, and a module
    # imported later binds the wrapped one from utils.
    for module in (
        "sglang.srt.disaggregation.utils",
        "sglang.srt.disaggregation.decode",
        "sglang.srt.disaggregation.prefill",
        "sglang.srt.managers.disagg_service",
    ):
        if module.endswith(".utils") or module in sys.modules:
            HookRegistry.register(f"{module}.get_kv_class", get_kv_class, HookType.AROUND)
