"""vLLM adapter: ``KvxferConnector``, a v1 KV connector in push mode (the prefill writes into the decode's blocks).

Load it with::

    --kv-transfer-config '{"kv_connector": "KvxferConnector", "kv_connector_module_path": "kvxfer.vllm",
                           "kv_role": "kv_producer",        # the decode instance: "kv_consumer"
                           "kv_connector_extra_config": {"bootstrap": "HOST:7878", "prefill_tp": 2, "decode_tp": 1}}'

and run a kvxfer bootstrap service at ``HOST:7878`` (``kvxfer bootstrap --listen 0.0.0.0:7878``, or
``"serve_bootstrap": true`` in the producer's extra config). Both instances get a request's
``kv_transfer_params`` from the proxy: ``{"do_remote_decode": true, "kvxfer_room": N}`` on the prefill,
``{"do_remote_prefill": true, "kvxfer_room": N}`` on the decode (N: the same integer on both; default a
hash of the request id). Checked against vLLM 0.33.0 (its ``ActiveKVConnector`` worker driver, the
per-layer ``maybe_transfer_kv_layer`` wrapper, the v1 ``Scheduler``).

KV caches (vLLM 0.33, ``allocate_kv_cache``): one ``[B, H, N, C]`` view per layer over one backing
buffer, ``C = head_size + head_size_v`` (K and V of a token interleaved). The connector asks for the
``LBHNC`` layout (``get_required_kvcache_layout``): every layer's blocks are then contiguous
``[H, N, C]`` pages, kvxfer's head-major (``hnd``) pages with a "head" of ``C`` elements (K and V of one
head move together). ``LBNHC`` (token-major, kvxfer ``nhd``) is taken too; block-outermost layouts are
refused, naming the strides. kvxfer's topology has a K and a V buffer per layer; since vLLM's V lives
inside C, each layer gets a companion V buffer of one element per head and token (1/C of the cache's
bytes, moved with it, never read). MLA: ``[B, 1, N, latent]``, one latent buffer per layer.

Call order (0.33's ``ActiveKVConnector``): ``handle_preemptions`` and ``bind_connector_metadata`` before
the forward (senders are made there), ``save_kv_layer`` after each attention layer (pushes that layer of
the blocks this step completed, once the decode's block list is known; on CUDA only once the layer's
kernels finished: an event per layer, waited for in ``wait_for_save``), ``start_load_kv`` after the
forward (hands the decode's blocks to the prefill), ``wait_for_save``, then ``get_transfer_results``.

Requests:

- prefill: the blocks stay held after ``request_finished`` until the send is final; an aborted or
  unfinished request's sender is aborted and its blocks are released only after kvxfer's fence (no write
  of it can still read them). A preempted request's posted writes finish before the forward that may
  reuse its blocks (``handle_preemptions``); chunks still waiting for the decode's block list then fail
  the request (their source blocks are gone).
- decode: ``get_num_new_matched_tokens`` -> the prompt loads asynchronously; a failed load is reported in
  ``failed_recving`` (vLLM's ``kv_load_failure_policy`` decides: recompute or fail), only once no write
  can land in its blocks. An aborted request's receiver is aborted and reported finished after the
  fence, so the scheduler frees its blocks only then. A request with a local prefix-cache hit computes
  its uncached tail itself and releases the prefill at once (kvxfer's handoff cannot yet skip the
  first pages); so does a request aborted before it was allocated.

Stats: the workers' transfer stats reach vLLM's own (``get_kv_connector_stats`` -> ``KVOutputAggregator``
-> ``SchedulerStats`` -> the "KV Transfer metrics: ..." log line and ``vllm:kvxfer_*`` Prometheus metrics):
``KvxferKVConnectorStats`` and ``KvxferPromMetrics``, after vLLM 0.33.0's ``kv_connector/v1/metrics.py``.

Not supported (refused, naming the reason): pipeline parallelism, hybrid allocators (more than one KV
cache group), GPU memory with the tcp and local backends (host memory only; UCX moves CUDA memory).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

import kvxfer
from kvxfer import KVPoll

logger = logging.getLogger("vllm.kvxfer")  # under vLLM's logger: its handlers print it (INFO)

try:  # vLLM's base classes when vLLM is installed; plain stand-ins otherwise (tier 0 runs without it).
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found]
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
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

    @dataclass
    class KVConnectorTransferResults:  # type: ignore[no-redef]
        """Stand-in for vLLM's record when vLLM is not installed."""

        finished_sending: set = field(default_factory=set)
        finished_recving: set = field(default_factory=set)
        failed_recving: set = field(default_factory=set)

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

        def has_connector_metadata(self):
            return self._connector_metadata is not None

        def _get_connector_metadata(self):
            assert self._connector_metadata is not None
            return self._connector_metadata


try:  # vLLM's stats base class (vllm/distributed/kv_transfer/kv_connector/v1/metrics.py at 0.33.0)
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # type: ignore[import-not-found]
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
except Exception:  # noqa: BLE001 - tier 0: no vLLM; the stats class still works on its own

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        """Stand-in for vLLM's base class when vLLM is not installed (its one field)."""

        data: dict[str, Any] = field(default_factory=dict)

        def to_dict(self) -> dict[str, Any]:
            """The serializable payload."""
            return self.data

    KVConnectorPromMetrics = None  # type: ignore[assignment,misc]

# The lists of a KvxferKVConnectorStats payload. Per transfer that finished on a worker rank (one request
# on one TP rank: a TP-2 instance records two per request), as vLLM 0.33's NixlKVConnectorStats
# (kv_connector/v1/nixl/stats.py) records one per NIXL transfer handle: successes carry a duration, the
# bytes kvxfer moved and the blocks; the counters are lists of 1 (NIXL's convention: ``aggregate`` only
# concatenates).
_STAT_LISTS = ("transfer_duration", "bytes_transferred", "num_blocks", "num_failed_transfers",
               "num_aborted_transfers", "num_digest_mismatches")


def _percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default method), without numpy."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class KvxferKVConnectorStats(KVConnectorStats):
    """kvxfer's transfer stats in vLLM's own stats path (vLLM 0.33.0: ``KVConnectorStats`` in
    ``kv_connector/v1/metrics.py``): the worker connector returns them from ``get_kv_connector_stats``,
    ``KVOutputAggregator`` aggregates the TP ranks', the scheduler puts ``to_dict()`` into
    ``SchedulerStats.kv_connector_stats``, vLLM's ``KVConnectorLogging`` logs ``reduce()`` as "KV Transfer
    metrics: ..." and ``KVConnectorProm`` exports them through ``KvxferPromMetrics``.

    Recorded where a transfer is final on a worker rank: the prefill when a request's send is final (bytes:
    the pages sent times ``Topology.sent_page_bytes`` of the rank, what kvxfer's
    ``kvxfer_transfer_bytes_total`` counts for them), the decode when a load is final (bytes: the blocks
    times the rank's page bytes, the decode's ``kvxfer_transfer_bytes_total``). Durations: prefill, from
    the first write posted to the send seen final; decode, from the handoff to the load seen final (at
    the resolution of vLLM's steps). Failures: transfers that failed (``num_failed_transfers``), ones the
    engine aborted (``num_aborted_transfers``), digest checks that failed (``num_digest_mismatches``,
    decode with ``digest``; those loads count as failed too)."""

    def __post_init__(self):
        if not self.data:
            self.reset()
            return
        missing = [k for k in _STAT_LISTS if k not in self.data]
        if missing:
            raise ValueError(f"kvxfer: a KvxferKVConnectorStats payload lacks {missing} (keys {sorted(self.data)})")

    def reset(self):
        """Empties every list (a new dict: a clone taken before keeps its data)."""
        self.data = {k: [] for k in _STAT_LISTS}

    def record_success(self, seconds: float, nbytes: int, blocks: int) -> None:
        """One transfer that succeeded on this rank."""
        self.data["transfer_duration"].append(float(seconds))
        self.data["bytes_transferred"].append(int(nbytes))
        self.data["num_blocks"].append(int(blocks))

    def record_failed(self) -> None:
        """One transfer that failed on this rank (not aborted by the engine)."""
        self.data["num_failed_transfers"].append(1)

    def record_aborted(self) -> None:
        """One transfer the engine aborted (a request aborted or finished before its transfer did)."""
        self.data["num_aborted_transfers"].append(1)

    def record_digest_mismatches(self, n: int) -> None:
        """``n`` requests whose end-to-end digest check failed on this rank."""
        self.data["num_digest_mismatches"].extend([1] * int(n))

    @property
    def num_successful_transfers(self) -> int:
        """Transfers that succeeded."""
        return len(self.data["transfer_duration"])

    def is_empty(self) -> bool:
        """Nothing recorded (failures alone are not empty: they are reported too)."""
        return not any(self.data[k] for k in _STAT_LISTS)

    def clone_and_reset(self) -> KvxferKVConnectorStats:
        """This interval's stats, handed out; this object starts a new interval."""
        old = copy.copy(self)
        self.reset()
        return old

    def aggregate(self, other: KVConnectorStats) -> KvxferKVConnectorStats:
        """Adds another rank's or interval's observations to these (in place; returns self)."""
        if not isinstance(other, KvxferKVConnectorStats):
            raise TypeError(f"kvxfer: cannot aggregate {type(other).__name__} into KvxferKVConnectorStats")
        if not other.is_empty():
            for k in _STAT_LISTS:
                self.data[k].extend(other.data[k])
        return self

    def reduce(self) -> dict[str, int | float]:
        """One summary of the interval, for vLLM's "KV Transfer metrics:" log line."""
        n = self.num_successful_transfers
        out: dict[str, int | float] = {"Num successful transfers": n}
        if n:
            secs = self.data["transfer_duration"]
            nbytes = sum(self.data["bytes_transferred"])
            total_s = sum(secs)
            out.update({
                "Avg xfer time (ms)": round(total_s / n * 1e3, 3),
                "P90 xfer time (ms)": round(_percentile(secs, 90) * 1e3, 3),
                "Bytes transferred": nbytes,
                "Avg MB per transfer": round(nbytes / 2**20 / n, 3),
                "Throughput (MB/s)": round(nbytes / 2**20 / total_s, 3) if total_s > 0 else 0.0,
                "Avg blocks per transfer": round(sum(self.data["num_blocks"]) / n, 1),
            })
        out["Num failed transfers"] = len(self.data["num_failed_transfers"])
        out["Num aborted transfers"] = len(self.data["num_aborted_transfers"])
        out["Num digest mismatches"] = len(self.data["num_digest_mismatches"])
        return out


if KVConnectorPromMetrics is not None:
    _TIME_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]

    class KvxferPromMetrics(KVConnectorPromMetrics):
        """kvxfer's transfer stats as vLLM Prometheus metrics (``KVConnectorPromMetrics``, vLLM 0.33.0), beside
        vLLM's own on its ``/metrics``: ``vllm:kvxfer_xfer_time_seconds``, ``vllm:kvxfer_bytes_transferred``,
        ``vllm:kvxfer_num_blocks`` (histograms, one observation per successful transfer) and the counters
        ``vllm:kvxfer_num_failed_transfers``, ``vllm:kvxfer_num_aborted_transfers``,
        ``vllm:kvxfer_num_digest_mismatches``. Labelled like vLLM's metrics (model name, engine)."""

        def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            from vllm.v1.metrics.utils import create_metric_per_engine  # type: ignore[import-not-found]

            def per_engine(metric):
                return create_metric_per_engine(metric, self.per_engine_labelvalues)

            self.histograms = {
                "transfer_duration": per_engine(self._histogram_cls(
                    name="vllm:kvxfer_xfer_time_seconds", buckets=_TIME_BUCKETS, labelnames=labelnames,
                    documentation="Duration of kvxfer KV cache transfers (prefill: first write to the send "
                                  "final; decode: handoff to the load final), per request and TP rank.")),
                "bytes_transferred": per_engine(self._histogram_cls(
                    name="vllm:kvxfer_bytes_transferred", buckets=[2 ** (10 + i) for i in range(1, 25, 2)],
                    labelnames=labelnames,
                    documentation="Bytes kvxfer moved per successful KV cache transfer (per request and TP rank).")),
                "num_blocks": per_engine(self._histogram_cls(
                    name="vllm:kvxfer_num_blocks", labelnames=labelnames,
                    buckets=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384],
                    documentation="vLLM blocks per successful kvxfer KV cache transfer.")),
            }
            self.counters = {
                k: per_engine(self._counter_cls(name=f"vllm:kvxfer_{k}", documentation=doc, labelnames=labelnames))
                for k, doc in (
                    ("num_failed_transfers", "kvxfer KV cache transfers that failed (per request and TP rank)."),
                    ("num_aborted_transfers", "kvxfer KV cache transfers the engine aborted."),
                    ("num_digest_mismatches", "kvxfer loads whose end-to-end digest check failed (decode)."),
                )
            }

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
            """Records one aggregated ``KvxferKVConnectorStats`` payload."""
            for k, h in self.histograms.items():
                for v in transfer_stats_data[k]:
                    h[engine_idx].observe(v)
            for k, c in self.counters.items():
                n = len(transfer_stats_data[k])
                if n:
                    c[engine_idx].inc(n)


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
    abort_send: dict[str, int] = field(default_factory=dict)  # prefill: req_id -> room
    abort_recv: dict[str, int] = field(default_factory=dict)  # decode: handed off, then aborted
    release: dict[str, int] = field(default_factory=dict)  # decode: never loads; free the prefill now
    preempted: set[str] = field(default_factory=set)


def _ptr(t) -> int:
    return int(t.data_ptr()) if hasattr(t, "data_ptr") else int(t.ctypes.data)


def _itemsize(t) -> int:
    return int(t.element_size()) if hasattr(t, "element_size") else int(t.itemsize)


def _strides(t) -> tuple[int, ...]:
    """Element strides (torch) of a tensor; numpy's byte strides converted."""
    if hasattr(t, "stride") and callable(t.stride):
        return tuple(int(s) for s in t.stride())
    return tuple(int(s) // int(t.itemsize) for s in t.strides)


def _kind(t) -> tuple[str, int]:
    dev = getattr(t, "device", None)
    if dev is not None and getattr(dev, "type", "cpu") == "cuda":
        return "cuda", int(dev.index or 0)
    return "host", 0


def _layer_number(name: str, fallback: int) -> int:
    m = re.findall(r"\.(\d+)\.", f".{name}.")
    return int(m[-1]) if m else fallback


def page_geometry(view) -> tuple[str, int, int, int, int]:
    """(layout, blocks, local heads, block size, C) of one vLLM 0.33 per-layer ``[B, H, N, C]`` view, or
    ``KvxferError`` naming the strides when its pages are not contiguous ``[H, N, C]`` (kvxfer ``hnd``) or
    ``[N, H, C]`` (kvxfer ``nhd``) runs at a stride of one page."""
    if len(view.shape) != 4:
        raise kvxfer.KvxferError(
            f"kvxfer: a vLLM 0.33 KV cache view is [blocks, heads, block_size, C] (4-D); got shape {tuple(view.shape)}")
    b, h, n, c = (int(x) for x in view.shape)
    sb, sh, sn, sc = _strides(view)
    page = h * n * c
    if sc == 1 and sb == page and (h == 1 or (sh == n * c and sn == c)):
        return "hnd", b, h, n, c
    if sc == 1 and sb == page and sh == c and sn == h * c:
        return "nhd", b, h, n, c
    raise kvxfer.KvxferError(
        f"kvxfer: vLLM's KV cache view has shape {(b, h, n, c)} and element strides {(sb, sh, sn, sc)}: kvxfer needs "
        f"each layer's blocks as contiguous pages of {page} elements at a stride of one page (vLLM layouts LBHNC or "
        "LBNHC; set VLLM_KV_CACHE_LAYOUT=LBHNC)")


class KvxferConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector over kvxfer (push: prefill writes into decode blocks)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.extra: dict[str, Any] = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
        kv_role = getattr(ktc, "kv_role", "kv_producer")
        if kv_role == "kv_both":
            raise kvxfer.KvxferError("kvxfer: kv_role kv_both is not supported: give kv_producer (prefill) or "
                                     "kv_consumer (decode)")
        self.side = "decode" if kv_role == "kv_consumer" else "prefill"
        self.block_size = int(getattr(vllm_config.cache_config, "block_size", 16))
        pc = getattr(vllm_config, "parallel_config", None)
        if int(getattr(pc, "pipeline_parallel_size", 1) or 1) > 1:
            raise kvxfer.KvxferError("kvxfer: pipeline parallelism is not supported by the vLLM connector yet")
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if groups is not None and len(groups) > 1:
            raise kvxfer.KvxferError(
                f"kvxfer: {len(groups)} KV cache groups (a hybrid model): the vLLM connector moves one group; "
                "start vLLM with --disable-hybrid-kv-cache-manager or a model with one attention kind")
        self._server = None
        # scheduler side
        self._to_load: dict[str, tuple[int, list[int]]] = {}
        self._producing: dict[str, dict[str, Any]] = {}  # req_id -> room, prompt, blocks, sent
        self._held: set[str] = set()  # prefill: finished requests whose blocks we hold
        self._loading: dict[str, int] = {}  # decode: handed off, not reported finished yet
        self._abort_send: dict[str, int] = {}
        self._abort_recv: dict[str, int] = {}
        self._release: dict[str, int] = {}
        # worker side
        self.agent: kvxfer.Agent | None = None
        self._layer_index: dict[str, int] = {}
        self._companions: list = []
        self._recv: dict[str, tuple[Any, list[int]]] = {}
        self._releasing: list[Any] = []
        self._send: dict[str, Any] = {}
        self._send_failed: dict[str, str] = {}
        self._aborting: set[str] = set()
        self._deferred: dict[str, list[list[int]]] = {}
        self._step_layerwise: dict[str, bool] = {}
        self._step_layers: dict[str, set[int]] = {}
        self._pending: list[tuple[Any, str, list[int], int]] = []  # (event, req_id, pages, layer)
        self._finished_seen: set[str] = set()
        # vLLM's transfer stats (get_kv_connector_stats): per request, pages and first post (prefill),
        # handoff time (decode); the bytes per page this rank moves, set in register_kv_caches.
        self._xfer_stats = KvxferKVConnectorStats()
        self._send_info: dict[str, list] = {}  # req_id -> [total pages, first post time or None]
        self._recv_t0: dict[str, float] = {}
        self._recv_aborted: set[str] = set()
        self._page_bytes = 0
        self._digest_mismatches_seen = 0
        self.stats = {"layer_pushes": 0, "whole_chunks": 0, "loads": 0, "releases": 0, "failed_sends": 0}
        if role == KVConnectorRole.SCHEDULER and self.side == "prefill" and self.extra.get("serve_bootstrap"):
            host, _, port = str(self.extra["bootstrap"]).rpartition(":")
            self._server = kvxfer.BootstrapServer(host="0.0.0.0" if self.extra.get("bind_all", True) else host,
                                                  port=int(port))
            logger.info("kvxfer: bootstrap service on %s", self._server.address)

    # ------------------------------------------------------------------------------ configuration

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        """LBHNC: every layer's blocks are contiguous head-major pages (kvxfer ``hnd``). MLA: any."""
        mc = getattr(vllm_config, "model_config", None)
        if mc is not None and getattr(mc, "use_mla", False):
            return None
        return "LBHNC"

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # save_kv_layer runs between the attention layers

    def _my_tp(self) -> int:
        pc = getattr(self._vllm_config, "parallel_config", None)
        return int(getattr(pc, "tensor_parallel_size", 1) or 1)

    def _tp_rank(self) -> int:
        if "tp_rank" in self.extra:
            return int(self.extra["tp_rank"])
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank  # type: ignore

            return int(get_tensor_model_parallel_rank())
        except Exception:  # noqa: BLE001 - no model-parallel group in this process: the worker's global rank
            pc = getattr(self._vllm_config, "parallel_config", None)
            return int(getattr(pc, "rank", 0) or 0) % self._my_tp()

    def _model_identity(self) -> dict[str, str] | None:
        """The model identity kvxfer publishes with this rank's layout (issue 30): ranks that both name
        one and name different ones never pair. vLLM's model name or path, its revision and the KV cache
        dtype (``cache_dtype``, else the model's dtype). ``"model_identity": false`` in the extra config
        sends none (e.g. when the two sides name one model by different paths)."""
        if self.extra.get("model_identity", True) is False:
            return None
        try:
            mc = getattr(self._vllm_config, "model_config", None)
            name = getattr(mc, "model", None)
            if not name:
                return None
            cc = getattr(self._vllm_config, "cache_config", None)
            kv = str(getattr(cc, "cache_dtype", None) or "auto")
            dtype = str(getattr(mc, "dtype", "") or "") if kv == "auto" else kv
            return {"name": str(name), "revision": str(getattr(mc, "revision", None) or ""),
                    "dtype": dtype.removeprefix("torch.")}
        except Exception:  # noqa: BLE001 - an identity is a safeguard, never a reason not to start
            logger.warning("kvxfer: no model identity from the vLLM config", exc_info=True)
            return None

    def _use_mla(self) -> bool:
        if "mla" in self.extra:
            return bool(self.extra["mla"])
        mc = getattr(self._vllm_config, "model_config", None)
        return bool(getattr(mc, "use_mla", False))

    def _total_kv_heads(self, local: int, tp_self: int) -> int:
        if self.extra.get("kv_heads") is not None:
            return int(self.extra["kv_heads"])
        mc = getattr(self._vllm_config, "model_config", None)
        if mc is not None and hasattr(mc, "get_total_num_kv_heads"):
            return int(mc.get_total_num_kv_heads())
        raise kvxfer.KvxferError(
            f"kvxfer: no model config to read the total KV head count from (this rank holds {local} of TP "
            f"{tp_self}); give \"kv_heads\" in kv_connector_extra_config")

    # ---------------------------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]):
        """Registers every layer's cache (vLLM 0.33's ``[B, H, N, C]`` views) and starts the agent."""
        if not kv_caches:
            raise kvxfer.KvxferError("kvxfer: vLLM gave no KV cache to register")
        names = sorted(kv_caches, key=lambda n: _layer_number(n, list(kv_caches).index(n)))
        views = [kv_caches[n] for n in names]
        first = views[0]
        kind, device = _kind(first)
        backend = str(self.extra.get("backend", "tcp"))
        # Whether the backend takes this memory (CUDA: tcp and local with a driver, cuda-ipc, ucx built
        # with CUDA) is the agent's to say: its start() refuses, naming the backends compiled in that can.
        geo = [page_geometry(v) for v in views]
        layout, blocks, heads, n, c = geo[0]
        if any(g != geo[0] for g in geo[1:]):
            raise kvxfer.KvxferError(f"kvxfer: vLLM's layers differ in geometry: {sorted(set(geo))}")
        if n != self.block_size:
            raise kvxfer.KvxferError(f"kvxfer: the cache's block size {n} is not vLLM's block size {self.block_size} "
                                     "(kernel block splitting): give --block-size equal to the kernel block size")
        dtype = _itemsize(first)
        mla = self._use_mla()
        my_tp = self._my_tp()
        prefill_tp = int(self.extra.get("prefill_tp", my_tp))
        decode_tp = int(self.extra.get("decode_tp", my_tp))
        if (prefill_tp if self.side == "prefill" else decode_tp) != my_tp:
            raise kvxfer.KvxferError(
                f"kvxfer: this {self.side} instance runs TP {my_tp}, but kv_connector_extra_config says "
                f"{self.side}_tp {prefill_tp if self.side == 'prefill' else decode_tp}")
        kw: dict[str, Any] = dict(layers=len(views), page_size=n, dtype_bytes=dtype, prefill_tp=prefill_tp,
                                  decode_tp=decode_tp, layout=layout)
        if mla:
            if heads != 1:
                raise kvxfer.KvxferError(f"kvxfer: an MLA cache holds one latent per token, not {heads} heads")
            kw["mla_latent_dim"] = c
        else:
            # K and V interleave in C: one "head" of C elements moves both; the V buffer is a companion.
            kw.update(kv_heads=self._total_kv_heads(heads, my_tp), head_dim=c, v_head_dim=1)
        topo = kvxfer.Topology(**kw)
        want = topo.local_heads(self.side)
        if not mla and want != heads:
            raise kvxfer.KvxferError(
                f"kvxfer: this rank's cache holds {heads} KV heads, but {topo.kv_heads} heads over {self.side} TP "
                f"{my_tp} put {want} on each rank")
        ptrs = [_ptr(v) for v in views]
        lens = [blocks * heads * n * c * dtype] * len(views)
        items = [heads * n * c * dtype] * len(views)
        if not mla:
            if hasattr(first, "new_zeros"):  # torch (vLLM): the companions live where the cache lives
                self._companions = [first.new_zeros((blocks, heads, n, 1)) for _ in views]
            else:  # numpy (tier 0)
                import numpy as np

                self._companions = [np.zeros((blocks, heads, n, 1), dtype=first.dtype) for _ in views]
            ptrs += [_ptr(t) for t in self._companions]
            lens += [blocks * heads * n * dtype] * len(views)
            items += [heads * n * dtype] * len(views)
        opts = dict(self.extra.get("backend_options", {}))
        if backend == "tcp" and "listen" not in opts:
            # Reachable from the other instance's hosts: listen everywhere, advertise the route to the bootstrap.
            opts["listen"] = "0.0.0.0:0"
            opts.setdefault("advertise", kvxfer.local_address(str(self.extra["bootstrap"])))
        rank = self._tp_rank()
        agent = kvxfer.Agent(role=self.side, topology=topo, tp_rank=rank, bootstrap=self.extra["bootstrap"],
                             backend=backend, notify=self.extra.get("notify", "attached"),
                             backend_options=opts or None, timeout_s=float(self.extra.get("timeout_s", 60)),
                             label=f"vllm {self.side} pid {os.getpid()}",
                             digest=self.side == "decode" and bool(self.extra.get("digest", False)),
                             model=self._model_identity(),
                             protocol=int(self.extra["protocol"]) if self.extra.get("protocol") is not None else None)
        agent.register_kv(ptrs=ptrs, lens=lens, item_lens=items, kind=kind, device=device)
        agent.start()
        self.agent = agent
        # Bytes per page of a request this rank moves: what kvxfer_transfer_bytes_total counts for it.
        self._page_bytes = (topo.sent_page_bytes(rank) if self.side == "prefill"
                            else sum(topo.item_lens("decode")))
        self._layer_index = {name: i for i, name in enumerate(names)}
        logger.info("kvxfer: vLLM %s TP rank %d/%d: %d layers of %d blocks (%s pages, %s), %s backend, bootstrap %s",
                    self.side, rank, my_tp, len(views), blocks, layout, topo, backend, self.extra["bootstrap"])

    def handle_preemptions(self, kv_connector_metadata) -> None:
        """Runs before the forward that may reuse a preempted request's freed blocks: its posted writes must
        have read them by then. Chunks still waiting for the decode's block list lost their source: the
        request fails."""
        for req_id in getattr(kv_connector_metadata, "preempted", ()) or ():
            s = self._send.get(req_id)
            if s is None:
                continue
            if self._deferred.pop(req_id, None):
                self._fail_send(req_id, "preempted before the decode's block list arrived: vLLM freed the blocks "
                                        "its chunks were to be read from")
            deadline = time.monotonic() + float(self.extra.get("timeout_s", 60))
            while s.poll() == KVPoll.Transferring and time.monotonic() < deadline:
                time.sleep(0.0005)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.agent is None or self.side != "prefill":
            return
        # Senders exist before the forward: save_kv_layer runs during it.
        for req_id, save in connector_metadata.save.items():
            if req_id not in self._send:
                s = self.agent.sender(save.room)
                s.init(save.total_pages)
                self._send[req_id] = s
                self._send_info[req_id] = [save.total_pages, None]
            self._step_layerwise.pop(req_id, None)
            self._step_layers.pop(req_id, None)
        for req_id, room in connector_metadata.abort_send.items():
            self._aborting.add(req_id)
            self._deferred.pop(req_id, None)
            s = self._send.get(req_id)
            if s is not None:
                s.abort("the prefill request was aborted or did not finish its prefill")

    def _fail_send(self, req_id: str, why: str) -> None:
        self.stats["failed_sends"] += 1
        self._send_failed.setdefault(req_id, why)
        self._deferred.pop(req_id, None)
        s = self._send.get(req_id)
        if s is not None:
            s.abort(why)
        logger.warning("kvxfer: sending %s failed: %s", req_id, why)

    def _send_whole(self, req_id: str, pages: list[int]) -> None:
        try:
            self._send[req_id].send(pages)
            self._posted(req_id)
            self.stats["whole_chunks"] += 1
        except kvxfer.KvxferError as e:  # a failed request: poll reports it; never raise into vLLM's step
            self._fail_send(req_id, str(e))

    @staticmethod
    def _after_kernels(kv_layer):
        """An event that completes once the kernels queued so far on the layer's device finished (CUDA);
        None for host memory (the forward already ran)."""
        dev = getattr(kv_layer, "device", None)
        if dev is None or getattr(dev, "type", "cpu") != "cuda":
            return None
        import torch

        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(dev))
        return ev

    def _post_ready(self, block: bool) -> None:
        """Posts the queued layer pushes whose kernels finished, in order (all of them when ``block``)."""
        while self._pending:
            ev, req_id, pages, layer = self._pending[0]
            if ev is not None and not ev.query():
                if not block:
                    return
                ev.synchronize()
            self._pending.pop(0)
            if req_id in self._send_failed or req_id not in self._send:
                continue
            try:
                self._send[req_id].send_layers(pages, layer, layer + 1)
                self._posted(req_id)
                self.stats["layer_pushes"] += 1
                self._step_layers.setdefault(req_id, set()).add(layer)
            except kvxfer.KvxferError as e:
                self._fail_send(req_id, str(e))

    def _posted(self, req_id: str) -> None:
        info = self._send_info.get(req_id)
        if info is not None and info[1] is None:
            info[1] = time.monotonic()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole requests into blocks no forward reads before ``get_transfer_results`` reports them."""

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        meta = self._connector_metadata
        if meta is None or not getattr(meta, "save", None) or self.side != "prefill":
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        event = None
        for req_id, save in meta.save.items():
            if not save.pages or req_id in self._send_failed or req_id in self._aborting:
                continue
            s = self._send.get(req_id)
            if s is None:
                continue
            if req_id not in self._step_layerwise:
                # Layer by layer only when the decode's blocks are known and no earlier chunk waits.
                self._step_layerwise[req_id] = s.poll() == KVPoll.WaitingForInput and not self._deferred.get(req_id)
            if self._step_layerwise[req_id]:
                if event is None:
                    event = (self._after_kernels(kv_layer),)
                self._pending.append((event[0], req_id, list(save.pages), layer))
        self._post_ready(block=False)

    def wait_for_save(self):
        """Posts what the forward computed: the queued layer pushes (after their kernels), the layers a
        layer-wise chunk still lacks, and whole chunks (deferred until the decode's blocks are known)."""
        self._post_ready(block=True)
        meta = self._connector_metadata
        if meta is None or self.side != "prefill":
            return
        layers = len(self._layer_index)
        for req_id, save in meta.save.items():
            if not save.pages and save.total_pages:
                continue
            if req_id in self._send_failed or req_id in self._aborting or req_id not in self._send:
                continue
            if self._step_layerwise.get(req_id):
                done = self._step_layers.get(req_id, set())
                for layer in range(layers):
                    if layer not in done:
                        try:
                            self._send[req_id].send_layers(list(save.pages), layer, layer + 1)
                            self._posted(req_id)
                        except kvxfer.KvxferError as e:
                            self._fail_send(req_id, str(e))
                            break
            else:
                self._deferred.setdefault(req_id, []).append(list(save.pages))
            self._step_layerwise.pop(req_id, None)
            self._step_layers.pop(req_id, None)
        self._drain_deferred()

    def _drain_deferred(self) -> None:
        for req_id, chunks in list(self._deferred.items()):
            s = self._send.get(req_id)
            while chunks and s is not None and req_id not in self._send_failed and s.poll() == KVPoll.WaitingForInput:
                self._send_whole(req_id, chunks.pop(0))
            if not chunks:
                self._deferred.pop(req_id, None)

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._connector_metadata
        if meta is None or self.agent is None or self.side != "decode":
            return
        for req_id, (room, blocks) in meta.load.items():
            r = self.agent.receiver(room)
            try:
                r.send_metadata(blocks)
            except kvxfer.KvxferError as e:
                logger.warning("kvxfer: handing off %s failed: %s", req_id, e)
                r.abort(str(e))
            self._recv[req_id] = (r, blocks)
            self._recv_t0[req_id] = time.monotonic()
            self.stats["loads"] += 1
        for req_id, room in meta.abort_recv.items():
            entry = self._recv.get(req_id)
            if entry is not None:
                entry[0].abort("the decode request was aborted")
                self._recv_aborted.add(req_id)
        for req_id, room in meta.release.items():
            # The decode will not load this request: tell the prefill at once, so it frees its blocks. An
            # empty page list names no block (no write can land anywhere; the prefill's sends are refused),
            # and the abort that follows it reaches the prefill (an abort before any handoff stays local).
            r = self.agent.receiver(room)
            try:
                r.send_metadata([])
            except kvxfer.KvxferError as e:
                logger.warning("kvxfer: releasing room %d: %s", room, e)
            r.abort("the decode computes this request itself (a local prefix-cache hit, or aborted before it "
                    "was allocated)")
            self._releasing.append(r)
            self.stats["releases"] += 1

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        self._finished_seen |= set(finished_req_ids)
        out = KVConnectorTransferResults()
        self._drain_deferred()
        for req_id, s in list(self._send.items()):
            v = s.poll()
            if req_id not in self._finished_seen:
                continue
            if v == KVPoll.Success or (v == KVPoll.Failed and s.pages_reusable()):
                if v == KVPoll.Failed and req_id not in self._aborting:
                    logger.warning("kvxfer: sending %s failed: %s", req_id, s.failure_exception())
                self._record_send(req_id, v)
                s.clear()
                del self._send[req_id]
                out.finished_sending.add(req_id)
        for req_id in list(self._finished_seen):
            if req_id not in self._send:
                # An aborted request that never had a sender, or one just reported.
                if req_id in self._aborting and req_id not in out.finished_sending:
                    out.finished_sending.add(req_id)
                self._finished_seen.discard(req_id)
                self._aborting.discard(req_id)
                self._send_failed.pop(req_id, None)
                self._deferred.pop(req_id, None)
        for req_id, (r, blocks) in list(self._recv.items()):
            v = r.poll()
            if v in (KVPoll.Success, KVPoll.Failed) and r.pages_reusable():
                if v == KVPoll.Failed:
                    logger.warning("kvxfer: loading %s failed: %s", req_id, r.failure_exception())
                    out.failed_recving.add(req_id)
                self._record_load(req_id, v, len(blocks))
                r.clear()
                del self._recv[req_id]
                out.finished_recving.add(req_id)
        for r in list(self._releasing):
            if r.poll() in (KVPoll.Success, KVPoll.Failed):
                r.clear()
                self._releasing.remove(r)
        return out

    def _record_send(self, req_id: str, v: int) -> None:
        """A prefill send is final: one transfer in vLLM's stats."""
        info = self._send_info.pop(req_id, None)
        if v == KVPoll.Success and info is not None:
            pages, first = info
            now = time.monotonic()
            self._xfer_stats.record_success(now - first if first is not None else 0.0, pages * self._page_bytes,
                                            pages)
        elif req_id in self._aborting:
            self._xfer_stats.record_aborted()
        else:
            self._xfer_stats.record_failed()

    def _record_load(self, req_id: str, v: int, blocks: int) -> None:
        """A decode load is final: one transfer in vLLM's stats."""
        t0 = self._recv_t0.pop(req_id, None)
        aborted = req_id in self._recv_aborted
        self._recv_aborted.discard(req_id)
        if v == KVPoll.Success:
            self._xfer_stats.record_success(time.monotonic() - t0 if t0 is not None else 0.0,
                                            blocks * self._page_bytes, blocks)
            return
        if aborted:
            self._xfer_stats.record_aborted()
        else:
            self._xfer_stats.record_failed()
        if self.agent is not None and self.extra.get("digest"):
            seen = int(self.agent.stats()["digest_mismatches"])
            self._xfer_stats.record_digest_mismatches(seen - self._digest_mismatches_seen)
            self._digest_mismatches_seen = seen

    def get_kv_connector_stats(self) -> KvxferKVConnectorStats | None:
        """This rank's transfer stats since the last call (vLLM 0.33: called by the worker driver after
        every step, aggregated over TP ranks by ``KVOutputAggregator``); None when nothing finished."""
        if self._xfer_stats.is_empty():
            return None
        return self._xfer_stats.clone_and_reset()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvxferKVConnectorStats:
        """The stats object of an aggregated payload (vLLM's ``KVConnectorLogging`` calls it)."""
        return KvxferKVConnectorStats(data=data) if data is not None else KvxferKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        """kvxfer's Prometheus metrics in vLLM's registry (vLLM's ``KVConnectorProm`` calls it)."""
        if KVConnectorPromMetrics is None:
            raise kvxfer.KvxferError("kvxfer: build_prom_metrics needs vLLM (its KVConnectorPromMetrics)")
        return KvxferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Failed loads are reported per request (``failed_recving``), as vLLM 0.33 asks."""
        return set()

    def shutdown(self):
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        self._companions = []
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
            if not params.get("do_remote_prefill"):
                return
            room = room_of(rid, params)
            if num_external_tokens > 0:
                pages = -(-len(request.prompt_token_ids) // self.block_size)
                ids = list(blocks.get_block_ids()[0])[:pages]
                self._to_load[rid] = (room, ids)
                self._loading[rid] = room
            else:
                logger.info("kvxfer: decode request %s has a local prefix-cache hit: it computes its tail and "
                            "releases the prefill (room %d)", rid, room)
                self._release[rid] = room
            params["do_remote_prefill"] = False  # handled once (a preempted request recomputes locally)
        elif params.get("do_remote_decode") and rid not in self._producing:
            self._producing[rid] = {"room": room_of(rid, params), "prompt": len(request.prompt_token_ids),
                                    "blocks": [], "sent": 0, "new": True}

    def build_connector_meta(self, scheduler_output) -> KvxferMetadata:
        meta = KvxferMetadata(load=self._to_load, abort_send=self._abort_send, abort_recv=self._abort_recv,
                              release=self._release,
                              preempted=set(getattr(scheduler_output, "preempted_req_ids", None) or ()))
        self._to_load, self._abort_send, self._abort_recv, self._release = {}, {}, {}, {}
        if self._producing:
            computed: dict[str, int] = {}
            for new in getattr(scheduler_output, "scheduled_new_reqs", []) or []:
                if new.req_id in self._producing:
                    self._producing[new.req_id]["blocks"] = list(new.block_ids[0])
                    computed[new.req_id] = int(new.num_computed_tokens)
            cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
            if cached is not None:
                resumed = getattr(cached, "resumed_req_ids", None) or set()
                for i, rid in enumerate(getattr(cached, "req_ids", []) or []):
                    st = self._producing.get(rid)
                    if st is None:
                        continue
                    new_ids = cached.new_block_ids[i]
                    if rid in resumed:
                        # Recomputed after a preemption, in new blocks (the whole table); pages already
                        # posted stay valid on the decode, the rest follows from the new blocks.
                        st["blocks"] = list(new_ids[0]) if new_ids else []
                    elif new_ids:
                        st["blocks"] += list(new_ids[0])
                    computed[rid] = int(cached.num_computed_tokens[i])
            scheduled = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
            for rid, n in scheduled.items():
                st = self._producing.get(rid)
                if st is None or rid not in computed:
                    continue
                done = min(st["prompt"], computed[rid] + int(n))
                total = -(-st["prompt"] // self.block_size)
                complete = total if done >= st["prompt"] else done // self.block_size
                pages = st["blocks"][st["sent"] : complete] if complete > st["sent"] else []
                if pages or st["new"]:
                    meta.save[rid] = _Save(st["room"], total, pages)
                    st["new"] = False
                st["sent"] = max(st["sent"], complete)
        return meta

    def update_connector_output(self, connector_output) -> None:
        for rid in getattr(connector_output, "finished_sending", None) or ():
            self._held.discard(rid)
        for rid in getattr(connector_output, "finished_recving", None) or ():
            self._loading.pop(rid, None)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        params = getattr(request, "kv_transfer_params", None) or {}
        if self.side == "decode":
            if params.get("do_remote_prefill"):
                # Finished (aborted) before it was allocated: free the prefill's blocks now.
                params["do_remote_prefill"] = False
                self._release[rid] = room_of(rid, params)
            elif rid in self._loading:
                # Aborted while loading: the scheduler keeps its blocks until the receiver reports
                # finished, which it does after kvxfer's fence.
                self._abort_recv[rid] = self._loading[rid]
            return False, None
        st = self._producing.pop(rid, None)
        if st is None:
            return False, None
        status = getattr(getattr(request, "status", None), "name", "")
        self._held.add(rid)
        if status in ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED") and st["sent"] >= -(-st["prompt"] // self.block_size):
            # The blocks are freed when the workers report the send final (get_transfer_results).
            return True, {"kvxfer_room": st["room"], "do_remote_prefill": True}
        # Aborted, or finished before its prefill completed: abort the sender; blocks freed after the fence.
        self._abort_send[rid] = st["room"]
        return True, None

    def has_pending_push_work(self) -> bool:
        return bool(self._producing or self._held or self._abort_send or self._release or self._abort_recv)
