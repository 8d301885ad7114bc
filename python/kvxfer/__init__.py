"""kvxfer: KV-cache transfer between the prefill and decode ranks of disaggregated LLM serving.

The engine API of the Rust crate ``kvxfer`` (``kvxfer::engine``), for Python engines::

    import kvxfer
    server = kvxfer.BootstrapServer(host="127.0.0.1", port=0)
    topo = kvxfer.Topology(kv_heads=8, head_dim=128, layers=4, page_size=16, dtype_bytes=2,
                           prefill_tp=2, decode_tp=1, layout="nhd")
    agent = kvxfer.Agent(role="decode", topology=topo, tp_rank=0, bootstrap=server.address)
    agent.register_kv(ptrs=[...], lens=[...], item_lens=[...])   # or register_kv_buffers([arrays])
    agent.start()
    r = agent.receiver(room)
    r.send_metadata(kv_indices, aux_index=None)
    while r.poll() not in (kvxfer.KVPoll.Success, kvxfer.KVPoll.Failed): ...
    # prefill: s = agent.sender(room); s.init(n); s.wait_ready(timeout_s) (or poll); s.send(kv_indices)

Requests report SGLang's ``KVPoll`` values. A request that failed while a peer may still write into its
pages reports ``Transferring`` until every such write is fenced, then ``Failed``: an engine that frees a
request's pages when it sees ``Failed`` never frees pages a late write could still land in.
``failure_exception()`` names the cause as soon as it is known; ``pages_reusable()`` says when the
pages are free.

Adapters: ``kvxfer.sglang`` (SGLang's disaggregation classes and plugin) and ``kvxfer.vllm``
(``KvxferConnector``, a vLLM v1 KV connector). ``python -m kvxfer.demo`` runs a verified transfer
between processes.
"""

from __future__ import annotations

import enum
import socket

from kvxfer._native import (
    Agent,
    BootstrapServer,
    KvxferError,
    Receiver,
    Sender,
    StoreUnreachable,
    Topology,
    __version__,
    backends,
)

__all__ = [
    "Agent",
    "BootstrapServer",
    "KVPoll",
    "KvxferError",
    "Receiver",
    "Sender",
    "StoreUnreachable",
    "Topology",
    "__version__",
    "backends",
    "local_address",
]


class KVPoll(enum.IntEnum):
    """Request states, with SGLang's values (``disaggregation/base/conn.py``)."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


FINAL = frozenset((KVPoll.Success, KVPoll.Failed))
"""The two outcomes: after one of them a request's pages are free (``pages_reusable()``)."""


def local_address(towards: str) -> str:
    """This host's address on the route to ``towards`` (``host:port`` or a host); no packet is sent. What a
    rank advertises to its peers when it listens on ``0.0.0.0``."""
    host = towards.rsplit(":", 1)[0].strip("[]") if towards.count(":") == 1 or towards.startswith("[") else towards
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
