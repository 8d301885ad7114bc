"""vLLM adapter: ``KvxferConnector``, a v1 KV connector in push mode (the prefill writes into the decode's blocks).

Load it with::

    --kv-transfer-config '{"kv_connector": "KvxferConnector", "kv_connector_module_path": "kvxfer.vllm",
                           "kv_role": "kv_producer",        # the decode instance: "kv_consumer"
                           "kv_connector_extra_config": {"bootstrap": "HOST:7878", "prefill_tp": 2, "decode_tp": 1}}'

and run a kvxfer bootstrap service at ``HOST:7878`` (``kvxfer bootstrap --listen 0.0.0.0:7878``, or
``"serve_bootstrap": true`` in the producer's extra config). Both instances get a request's
``kv_transfer_params`` from the proxy: ``{"do_remote_decode": true, "kvxfer_room": N}`` on the prefill,
``{"do_remote_prefill": true, "kvxfer_room": N}`` on the decode (N: the same integer on both; default a
hash of the request id).

The mapping onto the kvxfer API (a thin one):

- worker ``register_kv_caches``: one ``kvxfer.Agent`` per worker; each layer's ``[2, blocks, block_size,
  heads, head_dim]`` cache is its K and V buffer (MLA: ``[blocks, block_size, latent]``), a block is a
  kvxfer page.
- decode scheduler: ``get_num_new_matched_tokens`` -> the prompt loads asynchronously;
  ``update_state_after_alloc`` records the blocks; the worker's ``start_load_kv`` hands them off
  (``receiver.send_metadata``); ``get_finished`` reports the request loaded once ``Success`` or
  ``Failed`` (a failed request's blocks are listed by ``get_block_ids_with_load_errors``; a failure is
  reported only once no write can land in them).
- prefill scheduler: ``build_connector_meta`` tells the workers which blocks each step completed;
  ``save_kv_layer`` sends them layer by layer (``sender.send_layers``) when the decode's block list is
  already there, else ``get_finished`` sends them whole once it arrives; ``request_finished`` keeps the
  blocks until ``get_finished`` reports the send final.

Not supported: decode-side prefix-cache hits (a request with local hits is computed by the decode
itself), hybrid allocators (one KV cache group), pipeline parallelism.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import kvxfer
from kvxfer import KVPoll

logger = logging.getLogger(__name__)

try:  # vLLM's base classes when vLLM is installed; plain stand-ins otherwise (tier 0 runs without it).
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found]
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )

    HAVE_VLLM = True
except Exception:  # noqa: BLE001 - any import failure means: no usable vLLM here
    import enum

    HAVE_VLLM = False

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Stand-in for vLLM's class when vLLM is not installed."""

    class KVConnectorBase_V1:  # type: ignore[no-redef]
        """Stand-in for vLLM's base class when vLLM is not installed (its constructor's state only)."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role
            self._connector_metadata = None

        @property
        def role(self):
            return self._role

        def bind_connector_metadata(self, connector_metadata):
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self):
            self._connector_metadata = None

        def _get_connector_metadata(self):
            assert self._connector_metadata is not None
            return self._connector_metadata


def room_of(request_id: str, params: dict | None) -> int:
    """The kvxfer room of a request: ``kv_transfer_params["kvxfer_room"]``, else a hash of its id."""
    if params and params.get("kvxfer_room") is not None:
        return int(params["kvxfer_room"])
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little") >> 1


@dataclass
class _Save:
    room: int
    total_pages: int
    pages: list[int]  # the blocks this step completed, in token order


@dataclass
class KvxferMetadata(KVConnectorMetadata):
    """Scheduler -> workers, per step."""

    load: dict[str, tuple[int, list[int]]] = field(default_factory=dict)  # req_id -> (room, blocks)
    save: dict[str, _Save] = field(default_factory=dict)


def _ptr(t) -> int:
    return int(t.data_ptr()) if hasattr(t, "data_ptr") else int(t.ctypes.data)


def _nbytes(t) -> int:
    if hasattr(t, "untyped_storage"):
        return int(t.numel() * t.element_size())
    return int(t.nbytes)


def _itemsize(t) -> int:
    return int(t.element_size()) if hasattr(t, "element_size") else int(t.itemsize)


def _kind(t) -> tuple[str, int]:
    dev = getattr(t, "device", None)
    if dev is not None and getattr(dev, "type", "cpu") == "cuda":
        return "cuda", int(dev.index or 0)
    return "host", 0


class KvxferConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector over kvxfer (push: prefill writes into decode blocks)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.extra: dict[str, Any] = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
        kv_role = getattr(ktc, "kv_role", "kv_producer")
        self.side = "decode" if kv_role == "kv_consumer" else "prefill"
        self.block_size = int(getattr(vllm_config.cache_config, "block_size", 16))
        self._server = None
        # scheduler side
        self._to_load: dict[str, tuple[int, list[int]]] = {}
        self._producing: dict[str, dict[str, Any]] = {}  # req_id -> room, prompt_len, blocks, sent_pages
        # worker side
        self.agent: kvxfer.Agent | None = None
        self._layer_index: dict[str, int] = {}
        self._recv: dict[str, tuple[Any, list[int]]] = {}
        self._send: dict[str, Any] = {}
        self._deferred: dict[str, list[list[int]]] = {}
        self._step_layerwise: dict[str, bool] = {}
        self._finished_seen: set[str] = set()
        self._load_errors: set[int] = set()
        if role == KVConnectorRole.SCHEDULER and self.side == "prefill" and self.extra.get("serve_bootstrap"):
            host, _, port = str(self.extra["bootstrap"]).rpartition(":")
            self._server = kvxfer.BootstrapServer(host="0.0.0.0" if self.extra.get("bind_all", True) else host,
                                                  port=int(port))

    # ------------------------------------------------------------------------------ configuration

    def _topology(self, caches: list, mla: bool) -> kvxfer.Topology:
        mc = getattr(self._vllm_config, "model_config", None)
        pc = getattr(self._vllm_config, "parallel_config", None)
        my_tp = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        prefill_tp = int(self.extra.get("prefill_tp", my_tp))
        decode_tp = int(self.extra.get("decode_tp", my_tp))
        first = caches[0]
        dtype = _itemsize(first)
        kw: dict[str, Any] = dict(layers=len(caches), page_size=self.block_size, dtype_bytes=dtype,
                                  prefill_tp=prefill_tp, decode_tp=decode_tp,
                                  layout=str(self.extra.get("layout", "nhd")))
        if mla:
            kw["mla_latent_dim"] = int(first.shape[-1])
        else:
            heads = self.extra.get("kv_heads")
            if heads is None and mc is not None and hasattr(mc, "get_total_num_kv_heads"):
                heads = mc.get_total_num_kv_heads()
            if heads is None:
                heads = int(first.shape[-2]) * (prefill_tp if self.side == "prefill" else decode_tp)
            kw.update(kv_heads=int(heads), head_dim=int(first.shape[-1]))
        return kvxfer.Topology(**kw)

    def _tp_rank(self) -> int:
        if "tp_rank" in self.extra:
            return int(self.extra["tp_rank"])
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank  # type: ignore

            return int(get_tensor_model_parallel_rank())
        except Exception:  # noqa: BLE001 - no vLLM process group (tests)
            return 0

    # ---------------------------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]):
        """Registers every layer's cache (K then V buffers, as kvxfer orders them) and starts the agent."""
        names = list(kv_caches)
        caches = [kv_caches[n] for n in names]
        mla = bool(self.extra.get("mla", len(caches[0].shape) == 3))
        self._layer_index = {n: i for i, n in enumerate(names)}
        ptrs, lens, items = [], [], []
        if mla:
            for c in caches:
                ptrs.append(_ptr(c))
                lens.append(_nbytes(c))
                items.append(_nbytes(c) // int(c.shape[0]))
        else:
            for part in (0, 1):  # every layer's K, then every layer's V
                for c in caches:
                    half = _nbytes(c) // 2
                    ptrs.append(_ptr(c) + part * half)
                    lens.append(half)
                    items.append(half // int(c.shape[1]))
        kind, device = _kind(caches[0])
        topo = self._topology(caches, mla)
        opts = dict(self.extra.get("backend_options", {}))
        if self.extra.get("backend", "tcp") == "tcp" and "listen" not in opts:
            # Reachable from the other instance's hosts: listen everywhere, advertise the route to the bootstrap.
            opts["listen"] = "0.0.0.0:0"
            opts.setdefault("advertise", kvxfer.local_address(str(self.extra["bootstrap"])))
        agent = kvxfer.Agent(role=self.side, topology=topo, tp_rank=self._tp_rank(), bootstrap=self.extra["bootstrap"],
                             backend=self.extra.get("backend", "tcp"), notify=self.extra.get("notify", "attached"),
                             backend_options=opts or None, timeout_s=float(self.extra.get("timeout_s", 60)),
                             label=f"vllm {self.side} pid {os.getpid()}")
        agent.register_kv(ptrs=ptrs, lens=lens, item_lens=items, kind=kind, device=device)
        agent.start()
        self.agent = agent

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        assert self.agent is not None, "register_kv_caches first"
        for req_id, (room, blocks) in meta.load.items():
            r = self.agent.receiver(room)
            r.send_metadata(blocks)
            self._recv[req_id] = (r, blocks)
        for req_id, save in meta.save.items():
            if req_id not in self._send:
                s = self.agent.sender(save.room)
                s.init(save.total_pages)
                self._send[req_id] = s
            self._step_layerwise.pop(req_id, None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole requests, reported by ``get_finished``; nothing to wait for per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        meta = self._connector_metadata
        if meta is None or not meta.save:
            return
        layer = self._layer_index[layer_name]
        for req_id, save in meta.save.items():
            if not save.pages:
                continue
            s = self._send[req_id]
            if layer == 0:
                # Layer by layer only when the decode's blocks are known and nothing waits before this chunk.
                ready = s.poll() == KVPoll.WaitingForInput and not self._deferred.get(req_id)
                self._step_layerwise[req_id] = ready
                if not ready:
                    self._deferred.setdefault(req_id, []).append(list(save.pages))
            if self._step_layerwise.get(req_id):
                s.send_layers(save.pages, layer, layer + 1)

    def wait_for_save(self):
        """Writes run on kvxfer's threads; source blocks stay held until ``get_finished`` reports them."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._finished_seen |= set(finished_req_ids)
        sending, recving = set(), set()
        for req_id, chunks in list(self._deferred.items()):
            s = self._send.get(req_id)
            while chunks and s is not None and s.poll() == KVPoll.WaitingForInput:
                s.send(chunks.pop(0))
            if not chunks:
                del self._deferred[req_id]
        for req_id, s in list(self._send.items()):
            v = s.poll()
            if v in (KVPoll.Success, KVPoll.Failed) and req_id in self._finished_seen:
                if v == KVPoll.Failed:
                    logger.warning("kvxfer: sending %s failed: %s", req_id, s.failure_exception())
                s.clear()
                del self._send[req_id]
                self._finished_seen.discard(req_id)
                sending.add(req_id)
        for req_id, (r, blocks) in list(self._recv.items()):
            v = r.poll()
            if v in (KVPoll.Success, KVPoll.Failed):
                if v == KVPoll.Failed:
                    logger.warning("kvxfer: loading %s failed: %s", req_id, r.failure_exception())
                    self._load_errors.update(blocks)
                r.clear()
                del self._recv[req_id]
                recving.add(req_id)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self):
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        if self._server is not None:
            self._server.close()
            self._server = None

    # ------------------------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = getattr(request, "kv_transfer_params", None) or {}
        if self.side == "decode" and params.get("do_remote_prefill") and num_computed_tokens == 0:
            return len(request.prompt_token_ids), True
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        params = getattr(request, "kv_transfer_params", None) or {}
        rid = request.request_id
        if self.side == "decode":
            if num_external_tokens > 0:
                pages = -(-len(request.prompt_token_ids) // self.block_size)
                ids = list(blocks.get_block_ids()[0])[:pages]
                self._to_load[rid] = (room_of(rid, params), ids)
                params["do_remote_prefill"] = False  # loaded once
        elif params.get("do_remote_decode") and rid not in self._producing:
            self._producing[rid] = {"room": room_of(rid, params), "prompt": len(request.prompt_token_ids),
                                    "blocks": [], "sent": 0}

    def build_connector_meta(self, scheduler_output) -> KvxferMetadata:
        meta = KvxferMetadata(load=self._to_load)
        self._to_load = {}
        if self._producing:
            computed: dict[str, int] = {}
            for new in getattr(scheduler_output, "scheduled_new_reqs", []) or []:
                if new.req_id in self._producing:
                    self._producing[new.req_id]["blocks"] = list(new.block_ids[0])
                    computed[new.req_id] = int(new.num_computed_tokens)
            cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
            if cached is not None:
                for i, rid in enumerate(getattr(cached, "req_ids", []) or []):
                    if rid in self._producing:
                        new_ids = cached.new_block_ids[i]
                        if new_ids:
                            self._producing[rid]["blocks"] += list(new_ids[0])
                        computed[rid] = int(cached.num_computed_tokens[i])
            scheduled = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
            for rid, n in scheduled.items():
                st = self._producing.get(rid)
                if st is None or rid not in computed:
                    continue
                done = min(st["prompt"], computed[rid] + int(n))
                total = -(-st["prompt"] // self.block_size)
                complete = total if done >= st["prompt"] else done // self.block_size
                pages = st["blocks"][st["sent"] : complete]
                if pages or complete == total:
                    meta.save[rid] = _Save(st["room"], total, pages)
                st["sent"] = complete
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        st = self._producing.pop(request.request_id, None)
        if st is None:
            return False, None
        # The blocks are freed when the workers report the send final (get_finished).
        return True, {"kvxfer_room": st["room"], "do_remote_prefill": True}

    def has_pending_push_work(self) -> bool:
        return bool(self._producing)
