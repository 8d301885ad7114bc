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
from types import SimpleNamespace
from typing import Any

import kvxfer
from kvxfer import KVPoll

logger = logging.getLogger(__name__)

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


def topology_from_kv_args(args: Any, server_args: Any, role: str, is_mla: bool) -> kvxfer.Topology:
    """The kvxfer topology an SGLang rank's ``KVArgs`` (plus ``KVXFER_*`` for the other side) describe."""
    if getattr(args, "num_draft_entries", 0):
        raise kvxfer.KvxferError("kvxfer: draft-model KV (speculative decoding) is not supported yet")
    if any(getattr(args, "state_data_ptrs", None) or []):
        raise kvxfer.KvxferError("kvxfer: state buffers (Mamba, SWA, DSA) are not supported yet")
    layout = getattr(args, "kv_layout", None) or "nhd"
    if layout not in ("nhd", "hnd"):
        raise kvxfer.KvxferError(f"kvxfer: KV layout {layout!r} is not supported (nhd, hnd)")
    page = int(args.page_size)
    items = list(args.kv_item_lens)
    kinds = 1 if is_mla else 2
    if not items or len(items) % kinds:
        raise kvxfer.KvxferError(f"kvxfer: {len(items)} KV buffers for {'MLA' if is_mla else 'K and V'}")
    stage_layers = len(items) // kinds
    dtype = _dtype_bytes(getattr(args, "kv_cache_dtype_str", None)) or _env_int("KVXFER_DTYPE_BYTES") or 2

    dp = getattr(server_args, "dp_size", 1) or 1
    tp = getattr(server_args, "tp_size", 1) or 1
    attn_tp = tp // dp if getattr(server_args, "enable_dp_attention", False) else tp
    pp = getattr(server_args, "pp_size", 1) or 1
    mine = {"tp": attn_tp, "pp": pp}
    other = {"tp": attn_tp, "pp": pp}
    prefill = {"tp": _env_int("KVXFER_PREFILL_TP"), "pp": _env_int("KVXFER_PREFILL_PP")}
    decode = {"tp": _env_int("KVXFER_DECODE_TP"), "pp": _env_int("KVXFER_DECODE_PP")}
    p = {k: (mine[k] if role == "prefill" else (prefill[k] or other[k])) for k in mine}
    d = {k: (mine[k] if role == "decode" else (decode[k] or other[k])) for k in mine}
    layers = _env_int("KVXFER_LAYERS") or stage_layers * pp
    kw: dict[str, Any] = dict(layers=layers, page_size=page, dtype_bytes=dtype, prefill_tp=p["tp"],
                              decode_tp=d["tp"], prefill_pp=p["pp"], decode_pp=d["pp"], layout=layout)
    if is_mla:
        kw["mla_latent_dim"] = items[0] // (page * dtype)
    else:
        heads = getattr(args, "total_kv_head_num", None) or _env_int("KVXFER_KV_HEADS")
        local = getattr(args, "kv_head_num", None)
        if not heads:
            if not local or local == 1:
                # One head per rank: H may be the TP size or any divisor of it (replicated heads).
                raise kvxfer.KvxferError(
                    f"kvxfer: this {role} rank holds {local or 'an unknown number of'} KV head(s) and KVArgs has no "
                    "total_kv_head_num: set KVXFER_KV_HEADS to the model's num_key_value_heads")
            heads = local * attn_tp
        local = local or max(1, heads // attn_tp)
        kw.update(kv_heads=heads, head_dim=items[0] // (page * local * dtype),
                  v_head_dim=items[stage_layers] // (page * local * dtype))
    return kvxfer.Topology(**kw)


class KvxferKVManager(BaseKVManager):
    """One rank's kvxfer agent(s), from SGLang's ``KVArgs``."""

    enable_deferred_decode_kv_release = False
    supports_deferred_decode_kv_release = False
    supports_host_destination = False
    supports_role_switch = False

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend: bool | None = False, **_ignored):
        self.kv_args = args
        self.server_args = server_args
        self.role = _mode(disaggregation_mode)
        self.is_mla_backend = bool(is_mla_backend)
        self.topology = topology_from_kv_args(args, server_args, self.role, self.is_mla_backend)
        self.tp_rank = int(args.engine_rank)
        self.pp_rank = int(getattr(args, "pp_rank", 0) or 0)
        self.backend = os.environ.get("KVXFER_BACKEND", "tcp")
        self.notify = os.environ.get("KVXFER_NOTIFY", "attached")
        self.timeout_s = float(os.environ.get("KVXFER_TIMEOUT_S", "60"))
        device = str(getattr(server_args, "device", "cuda") or "cuda")
        self.mem_kind = "host" if device == "cpu" else "cuda"
        # Decode: what SGLang's scheduler reads before it creates receivers (prefill_info_table,
        # try_ensure_parallel_info); one agent per prefill instance (bootstrap address).
        self.prefill_info_table: dict[str, Any] = {}
        self._agents: dict[str, kvxfer.Agent] = {}
        self._lock = threading.Lock()
        if self.role == "prefill":
            port = getattr(server_args, "disaggregation_bootstrap_port", None)
            addr = os.environ.get("KVXFER_BOOTSTRAP") or f"{self._bootstrap_host()}:{port}"
            self._agent_for(addr, wait_s=30.0)

    # ----------------------------------------------------------------------------------- agents

    def _bootstrap_host(self) -> str:
        host = getattr(self.server_args, "host", None) or "127.0.0.1"
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

    def _agent_for(self, bootstrap: str, wait_s: float = 0.0) -> kvxfer.Agent:
        with self._lock:
            agent = self._agents.get(bootstrap)
            if agent is not None:
                return agent
            args = self.kv_args
            agent = kvxfer.Agent(role=self.role, topology=self.topology, tp_rank=self.tp_rank, pp_rank=self.pp_rank,
                                 bootstrap=bootstrap, backend=self.backend, notify=self.notify,
                                 backend_options=self._options(bootstrap), timeout_s=self.timeout_s,
                                 label=f"sglang {self.role} pid {os.getpid()}")
            agent.register_kv(ptrs=list(args.kv_data_ptrs), lens=list(args.kv_data_lens),
                              item_lens=list(args.kv_item_lens), kind=self.mem_kind,
                              device=int(getattr(args, "gpu_id", 0) or 0))
            if getattr(args, "aux_data_ptrs", None):
                agent.register_aux(ptrs=list(args.aux_data_ptrs), lens=list(args.aux_data_lens),
                                   item_lens=list(args.aux_item_lens))
            # The prefill may start before its bootstrap server listens: retry for a while.
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    agent.start()
                    break
                except kvxfer.KvxferError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            self._agents[bootstrap] = agent
            return agent

    def agent(self, bootstrap_addr: str | None = None) -> kvxfer.Agent:
        """This rank's agent (decode: the one for that prefill instance, made on first use)."""
        if self.role == "prefill":
            return next(iter(self._agents.values()))
        if not bootstrap_addr:
            raise kvxfer.KvxferError("kvxfer: a decode request needs its prefill's bootstrap address")
        return self._agent_for(bootstrap_addr)

    # ---------------------------------------------------------------------- SGLang's manager API

    def register_to_bootstrap(self):
        """Agents register themselves when they start."""

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode: connects to that prefill instance (once); True once its ranks are connected."""
        try:
            agent = self._agent_for(bootstrap_addr)
        except kvxfer.KvxferError as e:
            logger.warning("kvxfer: cannot join the prefill at %s: %s", bootstrap_addr, e)
            return False
        if agent.is_connected():
            self.prefill_info_table.setdefault(
                bootstrap_addr, SimpleNamespace(dp_size=1, follow_bootstrap_room=True, tp_size=self.topology.prefill_tp,
                                                pp_size=self.topology.prefill_pp))
            return True
        return False

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        # A decode rank of another TP width holds a slice of what a prefill rank digested.
        return self.topology.prefill_tp == self.topology.decode_tp

    def is_abort_release_safe(self, *_args) -> bool:
        return True

    def clear_deferred_abort_state(self, *_args) -> None:
        pass

    def close(self) -> None:
        """Closes every agent (tests; SGLang ends the process)."""
        with self._lock:
            agents, self._agents = list(self._agents.values()), {}
        for a in agents:
            a.close()


def _raise_failure(req) -> None:
    exc = req.failure_exception() if req is not None else None
    if exc is not None:
        raise exc


class KvxferKVSender(BaseKVSender):
    """Prefill side of one request."""

    def __init__(self, mgr: KvxferKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False, **_ignored):
        self.kv_mgr = mgr
        self.bootstrap_room = int(bootstrap_room)
        self.sender = mgr.agent().sender(self.bootstrap_room)
        self.init_time: float | None = None
        self.conclude_state: int | None = None

    def init(self, num_kv_indices: int, aux_index: int | None = None):
        self.init_time = time.monotonic()
        self.sender.init(int(num_kv_indices), None if aux_index is None else int(aux_index))

    def send(self, kv_indices, state_indices=None, num_kv_tokens=None, **_ignored):
        if state_indices and any(x is not None for x in state_indices):
            raise kvxfer.KvxferError("kvxfer: state buffers (Mamba, SWA, DSA) are not supported yet")
        self.sender.send(kv_indices)

    def poll(self) -> int:
        v = self.sender.poll()
        if v in (KVPoll.Success, KVPoll.Failed):
            self.conclude_state = v
        return v

    def failure_exception(self):
        _raise_failure(self.sender)
        raise kvxfer.KvxferError(f"kvxfer: prefill request {self.bootstrap_room} failed")

    def abort(self):
        self.sender.abort()

    def clear(self):
        self.sender.clear()

    def get_transfer_metric(self):
        return KVTransferMetric()

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        # The last chunk is sent even when empty: it is what completes the request.
        return num_pages > 0 or last_chunk

    def get_max_transfer_tokens(self):
        return None

    def pop_decode_prefix_len(self) -> int:
        return 0


class KvxferKVReceiver(BaseKVReceiver):
    """Decode side of one request."""

    def __init__(self, mgr: KvxferKVManager, bootstrap_addr: str, bootstrap_room: int | None = None, **_ignored):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room or 0)
        self.receiver = mgr.agent(bootstrap_addr).receiver(self.bootstrap_room)
        self.conclude_state: int | None = None
        self.abort_notified = False
        self.require_staging = False
        self.bootstrap_infos: list = []
        self._local_failure: str | None = None

    @property
    def supports_host_destination(self) -> bool:
        return False

    def init(self, prefill_dp_rank: int = 0, **_ignored):
        """The prefill instance was resolved when this receiver was made; nothing to do."""

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None,
                      destination=None, **_ignored):
        if decode_prefix_len:
            self._local_failure = (f"kvxfer: decode request {self.bootstrap_room}: decode-side prefix reuse "
                                   f"(decode_prefix_len {decode_prefix_len}) is not supported")
            return
        if state_indices and any(x is not None for x in state_indices):
            self._local_failure = f"kvxfer: decode request {self.bootstrap_room}: state buffers are not supported"
            return
        if destination is not None and getattr(destination, "value", destination) != "device":
            self._local_failure = f"kvxfer: decode request {self.bootstrap_room}: host destinations are not supported"
            return
        self.receiver.send_metadata(kv_indices, None if aux_index is None else int(aux_index))

    def poll(self) -> int:
        if self._local_failure is not None:
            v = KVPoll.Failed
        else:
            v = self.receiver.poll()
        if v in (KVPoll.Success, KVPoll.Failed):
            self.conclude_state = v
        return v

    def failure_exception(self):
        if self._local_failure is not None:
            raise kvxfer.KvxferError(self._local_failure)
        _raise_failure(self.receiver)
        raise kvxfer.KvxferError(f"kvxfer: decode request {self.bootstrap_room} failed")

    def is_abort_release_safe(self) -> bool:
        return self.receiver.pages_reusable()

    def ensure_abort_notified(self, force_arm: bool = False) -> None:
        pass

    def abort(self):
        self.receiver.abort()

    def clear(self):
        self.receiver.clear()


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
