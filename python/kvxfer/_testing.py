"""Multi-process transfers with an independent numpy reference: what tier 0 and ``python -m kvxfer.demo`` run.

The reference is SEMANTICS §2 written again in numpy (which heads a rank holds), nothing of kvxfer's
planner: every source element is a hash of (global layer, kind, global head, source page, token slot,
element), so a decode rank's expected page is that hash over *its* heads at the source page that was
paired with it. Pools use SGLang's layout (NHD: one ``[pages * page_size, local heads, head_dim]`` array
per layer and kind, every layer's K then every layer's V; MLA: one ``[pages * page_size, 1, latent]`` per
layer) or vLLM's HND (``[pages, local heads, page_size, head_dim]``).

Needs numpy. Processes are started with the ``spawn`` method (an agent owns threads; never fork it).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvxfer

SENTINEL = 0xEE
"""Every byte of a decode pool starts as this; bytes of pages no request names must keep it."""

AUX_ROWS = 16
_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32}


# ------------------------------------------------------------------------------------------- reference


def heads_of(tp: int, rank: int, kv_heads: int) -> list[int]:
    """SEMANTICS §2: the global KV heads rank ``rank`` of ``tp`` ranks holds."""
    if tp <= kv_heads:
        assert kv_heads % tp == 0, (kv_heads, tp)
        n = kv_heads // tp
        return list(range(rank * n, (rank + 1) * n))
    assert tp % kv_heads == 0, (kv_heads, tp)
    return [rank // (tp // kv_heads)]


@dataclass(frozen=True)
class Shape:
    """The KV geometry of a test cluster (kwargs of ``kvxfer.Topology``)."""

    kv_heads: int = 4
    head_dim: int = 8
    v_head_dim: int | None = None
    layers: int = 2
    page_size: int = 4
    dtype_bytes: int = 2
    prefill_tp: int = 1
    decode_tp: int = 1
    mla_latent_dim: int | None = None
    layout: str = "nhd"

    def topology(self) -> kvxfer.Topology:
        kw = dict(
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            layers=self.layers,
            page_size=self.page_size,
            dtype_bytes=self.dtype_bytes,
            prefill_tp=self.prefill_tp,
            decode_tp=self.decode_tp,
            layout=self.layout,
        )
        if self.v_head_dim is not None:
            kw["v_head_dim"] = self.v_head_dim
        if self.mla_latent_dim is not None:
            kw["mla_latent_dim"] = self.mla_latent_dim
        return kvxfer.Topology(**kw)

    @property
    def mla(self) -> bool:
        return self.mla_latent_dim is not None

    def kinds(self) -> list[tuple[int, int]]:
        """(kind id, elements per head) per buffer kind, in SGLang's order."""
        if self.mla:
            return [(2, self.mla_latent_dim)]
        return [(0, self.head_dim), (1, self.v_head_dim or self.head_dim)]

    def heads(self, role: str, rank: int) -> list[int]:
        if self.mla:
            return [0]
        tp = self.prefill_tp if role == "prefill" else self.decode_tp
        return heads_of(tp, rank, self.kv_heads)

    def dtype(self):
        return _DTYPES[self.dtype_bytes]


def pattern(shape: Shape, layer: int, kind: int, heads: list[int], pages, elems: int) -> np.ndarray:
    """Source contents: ``[len(pages), page_size, len(heads), elems]`` of the shape's dtype."""
    u = np.uint64
    p = np.asarray(pages, dtype=u).reshape(-1, 1, 1, 1)
    t = np.arange(shape.page_size, dtype=u).reshape(1, -1, 1, 1)
    h = np.asarray(heads, dtype=u).reshape(1, 1, -1, 1)
    e = np.arange(elems, dtype=u).reshape(1, 1, 1, -1)
    x = u((layer * 0x9E3779B1 + kind * 0x85EBCA77 + 0x1234567) & 0xFFFFFFFFFFFFFFFF)
    with np.errstate(over="ignore"):
        x = x ^ (p * u(0xC2B2AE3D)) ^ (t * u(0x27D4EB2F)) ^ (h * u(0x165667B1)) ^ (e * u(0xD3A2646C))
        x = x ^ (x >> u(15))
        x = x * u(0x2C1B3C6D297A5F35)
        x = x ^ (x >> u(29))
    mask = (1 << (8 * shape.dtype_bytes)) - 1
    return (x & u(mask)).astype(shape.dtype())


def to_layout(shape: Shape, a: np.ndarray) -> np.ndarray:
    """``[pages, page_size, heads, elems]`` -> the pool's layout (NHD token-major or HND head-major)."""
    if shape.layout == "hnd":
        return np.ascontiguousarray(a.transpose(0, 2, 1, 3))
    n, s, h, e = a.shape
    return a.reshape(n * s, h, e)


def page_view(shape: Shape, buf: np.ndarray, page: int) -> np.ndarray:
    """One page of a pool buffer, as ``[page_size, heads, elems]``."""
    if shape.layout == "hnd":
        return buf[page].transpose(1, 0, 2)
    s = shape.page_size
    return buf[page * s : (page + 1) * s]


def make_pool(shape: Shape, role: str, rank: int, pages: int) -> list[np.ndarray]:
    """A rank's KV pool in SGLang's order: the prefill's filled with the pattern, the decode's with SENTINEL."""
    heads = shape.heads(role, rank)
    out = []
    for kind, elems in shape.kinds():
        for layer in range(shape.layers):
            if role == "prefill":
                out.append(to_layout(shape, pattern(shape, layer, kind, heads, range(pages), elems)))
            else:
                dims = (pages, len(heads), shape.page_size, elems) if shape.layout == "hnd" else (
                    pages * shape.page_size,
                    len(heads),
                    elems,
                )
                a = np.empty(dims, dtype=shape.dtype())
                a.view(np.uint8)[...] = SENTINEL
                out.append(a)
    return out


def make_aux() -> list[np.ndarray]:
    """Two aux buffers like SGLang's metadata buffers: int32 [rows, 8] and float32 [rows, 4]."""
    return [np.zeros((AUX_ROWS, 8), np.int32), np.zeros((AUX_ROWS, 4), np.float32)]


def aux_row(room: int) -> tuple[np.ndarray, np.ndarray]:
    return (room * 100 + np.arange(8, dtype=np.int32), room + 0.25 * np.arange(4, dtype=np.float32))


def verify_decode(shape: Shape, rank: int, pool: list[np.ndarray], written: list[tuple[list[int], list[int]]],
                  pages: int, skip: set[int] = frozenset()) -> tuple[int, list[str]]:
    """Checks every byte of a decode pool: each (src, dst) page pair of a successful request holds the
    reference for this rank's heads, every page no request named still holds SENTINEL (``skip``: pages of
    failed requests, which may hold part of a transfer). Returns (bytes checked, errors)."""
    heads = shape.heads("decode", rank)
    errors: list[str] = []
    checked = 0
    named: set[int] = set(skip)
    buffers = [(kind, elems, layer) for kind, elems in shape.kinds() for layer in range(shape.layers)]
    for src, dst in written:
        named.update(dst)
        for (kind, elems, layer), buf in zip(buffers, pool):
            want = pattern(shape, layer, kind, heads, src, elems)
            for i, (s, d) in enumerate(zip(src, dst)):
                got = page_view(shape, buf, d)
                checked += got.nbytes
                if not np.array_equal(got, want[i]):
                    bad = np.argwhere(got != want[i])[0]
                    errors.append(
                        f"decode rank {rank}: layer {layer} kind {kind} dst page {d} (src page {s}): first wrong "
                        f"element at (token, head slot, elem) {tuple(int(x) for x in bad)}"
                    )
                    if len(errors) > 8:
                        return checked, errors
    for p in range(pages):
        if p in named:
            continue
        for (kind, _, layer), buf in zip(buffers, pool):
            v = page_view(shape, buf, p)
            checked += v.nbytes
            if not (np.ascontiguousarray(v).view(np.uint8) == SENTINEL).all():
                errors.append(f"decode rank {rank}: layer {layer} kind {kind} page {p} was written, but no request names it")
                if len(errors) > 8:
                    return checked, errors
    return checked, errors


# ---------------------------------------------------------------------------------------------- workers


@dataclass
class Request:
    """One request of a scenario, as both sides see it."""

    room: int
    src: list[int]
    dst: list[int]
    chunks: list[int]  # pages per chunk
    aux_prefill: int | None = None
    aux_decode: int | None = None
    # "ok"; "prefill_dies" (after its first chunk the prefill waits to be killed);
    # "decode_aborts"/"prefill_aborts" (after the first chunk); "prefill_absent" (no sender: decode times out)
    action: str = "ok"


@dataclass
class RankSpec:
    role: str
    tp: int
    shape: Shape
    bootstrap: str
    pages: int
    requests: list[Request]
    backend: str = "tcp"
    notify: str = "attached"
    timeout_s: float = 30.0
    aux: bool = True
    # Requests that run at once (each request waits for its peers).
    window: int = 4


def moved_bytes(agent, nonzero: bool = True, timeout_s: float = 10.0) -> int:
    """The agent's ``kvxfer_transfer_bytes_total`` once it stopped changing (and, with ``nonzero``, is not 0:
    the progress task records a decode's bytes as it sees the request final, maybe just after a poll did)."""
    def read() -> int:
        line = next(x for x in agent.metrics().splitlines() if x.startswith("kvxfer_transfer_bytes_total"))
        return int(float(line.rsplit(" ", 1)[1]))

    deadline, last = time.monotonic() + timeout_s, -1
    while True:
        now = read()
        if now == last and (now > 0 or not nonzero) or time.monotonic() > deadline:
            return now
        last = now
        time.sleep(0.05)


def _poll_until(obj, want: set[int], deadline: float, sleep: float = 0.0005) -> int:
    while True:
        v = obj.poll()
        if v in want or time.monotonic() > deadline:
            return v
        time.sleep(sleep)


def rank_main(spec: RankSpec, results, events: dict[str, Any]) -> None:
    """A rank in its own process: register numpy pools, run the scenario's requests, verify, report."""
    out: dict[str, Any] = {"role": spec.role, "tp": spec.tp, "requests": {}, "errors": [], "checked": 0}
    agent = None
    try:
        topo = spec.shape.topology()
        agent = kvxfer.Agent(
            role=spec.role,
            topology=topo,
            tp_rank=spec.tp,
            bootstrap=spec.bootstrap,
            backend=spec.backend,
            notify=spec.notify,
            timeout_s=spec.timeout_s,
            lease_ttl_s=2.0,
            backend_options={"listen": "127.0.0.1:0"} if spec.backend == "tcp" else None,
        )
        pool = make_pool(spec.shape, spec.role, spec.tp, spec.pages)
        agent.register_kv_buffers(pool)
        aux = make_aux()
        if spec.aux:
            agent.register_aux_buffers(aux)
        t0 = time.monotonic()
        agent.start()
        agent.wait_connected(timeout_s=spec.timeout_s)
        out["connect_s"] = time.monotonic() - t0
        if spec.role == "prefill":
            for r in spec.requests:
                if r.aux_prefill is not None and spec.aux:
                    a, b = aux_row(r.room)
                    aux[0][r.aux_prefill] = a
                    aux[1][r.aux_prefill] = b
            _run_prefill(spec, agent, out, events)
        else:
            _run_decode(spec, agent, out, events)
            written = [(r.src, r.dst) for r in spec.requests if out["requests"][r.room]["poll"] == kvxfer.KVPoll.Success]
            failed_pages = {p for r in spec.requests if out["requests"][r.room]["poll"] != kvxfer.KVPoll.Success for p in r.dst}
            # Pages of failed requests may hold part of a transfer: neither checked nor required untouched.
            checked, errors = verify_decode(spec.shape, spec.tp, pool, written, spec.pages, failed_pages)
            out["checked"] = checked
            out["errors"] += errors
            if spec.aux:
                named = set()
                for r in spec.requests:
                    if r.aux_decode is None:
                        continue
                    named.add(r.aux_decode)
                    if out["requests"][r.room]["poll"] != kvxfer.KVPoll.Success:
                        continue
                    a, b = aux_row(r.room)
                    if not (np.array_equal(aux[0][r.aux_decode], a) and np.array_equal(aux[1][r.aux_decode], b)):
                        out["errors"].append(f"decode rank {spec.tp}: aux row {r.aux_decode} of room {r.room} is wrong")
                for row in range(AUX_ROWS):
                    if row not in named and (aux[0][row].any() or aux[1][row].any()):
                        out["errors"].append(f"decode rank {spec.tp}: aux row {row} was written, but no request names it")
        out["stats"] = agent.stats()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out["errors"].append(f"{spec.role} rank {spec.tp}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    results.put(out)
    # Stay up until every rank reported: a peer that leaves early fails the others' requests.
    events["done"].wait(120)
    if agent is not None:
        try:
            agent.close()
        except Exception:  # noqa: BLE001
            pass


def _run_prefill(spec: RankSpec, agent, out, events) -> None:
    deadline = time.monotonic() + spec.timeout_s * 2
    live: list[tuple[Request, Any, list[list[int]], float]] = []
    todo = [r for r in spec.requests if r.action != "prefill_absent"]
    src_bytes = 0
    while todo or live:
        while todo and len(live) < spec.window:
            r = todo.pop(0)
            s = agent.sender(r.room)
            s.init(len(r.src), r.aux_prefill if spec.aux else None)
            chunks, at = [], 0
            for n in r.chunks:
                chunks.append(r.src[at : at + n])
                at += n
            live.append((r, s, chunks, time.monotonic()))
        for item in list(live):
            r, s, chunks, t_start = item
            action = r.action if spec.tp == 0 else "ok"  # the failure scenarios act on prefill rank 0
            v = s.poll()
            rec = out["requests"].setdefault(r.room, {"sent": 0})
            if v == kvxfer.KVPoll.WaitingForInput and chunks:
                first = rec["sent"] == 0
                if not first and action in ("prefill_dies", "prefill_aborts", "decode_aborts"):
                    pass
                else:
                    c = chunks.pop(0)
                    try:
                        s.send(np.asarray(c, dtype=np.int32))
                    except kvxfer.KvxferError:
                        # The request failed between the poll and the send (another rank aborted it):
                        # what an engine sees too; its final status is recorded below.
                        if s.poll() != kvxfer.KVPoll.Failed:
                            raise
                        chunks.clear()
                        continue
                    rec["sent"] += 1
                    src_bytes += len(c)
                    if first and action == "prefill_dies":
                        events["first_chunk"].set()
                        time.sleep(600)  # killed by the parent
                    if first and action == "prefill_aborts":
                        s.abort()
                        events["first_chunk"].set()
                    if first and action == "decode_aborts":
                        events["first_chunk"].set()
                        events["aborted"].wait(30)
                continue
            if v in kvxfer.FINAL or time.monotonic() > deadline:
                exc = s.failure_exception()
                rec.update(poll=int(v), reason=str(exc) if exc else None, seconds=time.monotonic() - t_start,
                           reusable=s.pages_reusable())
                s.clear()
                live.remove(item)
        time.sleep(0.0005)
    out["pages_sent"] = src_bytes


def _run_decode(spec: RankSpec, agent, out, events) -> None:
    deadline = time.monotonic() + spec.timeout_s * 2
    todo = list(spec.requests)
    live: list[tuple[Request, Any, float, list[int]]] = []
    while todo or live:
        while todo and len(live) < spec.window:
            r = todo.pop(0)
            rx = agent.receiver(r.room)
            v = _poll_until(rx, {kvxfer.KVPoll.WaitingForInput, kvxfer.KVPoll.Failed}, deadline)
            t = time.monotonic()
            rx.send_metadata(np.asarray(r.dst, dtype=np.int32), r.aux_decode if spec.aux else None)
            out.setdefault("first_metadata", t)
            live.append((r, rx, t, [v]))
        for item in list(live):
            r, rx, t, seen = item
            v = rx.poll()
            if seen[-1] != v:
                seen.append(v)
            if r.action == "decode_aborts" and spec.tp == 0 and events["first_chunk"].is_set() and not events["aborted"].is_set():
                rx.abort()
                events["aborted"].set()
                continue
            if v in kvxfer.FINAL or time.monotonic() > deadline:
                exc = rx.failure_exception()
                out["requests"][r.room] = dict(poll=int(v), reason=str(exc) if exc else None,
                                               seconds=time.monotonic() - t, reusable=rx.pages_reusable(),
                                               polls=[int(x) for x in seen])
                rx.clear()
                live.remove(item)
                out["last_final"] = time.monotonic()
        time.sleep(0.0005)
    if "first_metadata" in out:
        out["span_s"] = out.pop("last_final") - out.pop("first_metadata")


# ----------------------------------------------------------------------------------------------- cluster


@dataclass
class Outcome:
    """What every rank reported."""

    ranks: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0

    def rank(self, role: str, tp: int) -> dict[str, Any]:
        for r in self.ranks:
            if r["role"] == role and r["tp"] == tp:
                return r
        raise KeyError((role, tp))

    @property
    def errors(self) -> list[str]:
        return [e for r in self.ranks for e in r["errors"]]


def run_cluster(shape: Shape, requests: list[Request], *, pages: int = 64, backend: str = "tcp",
                notify: str = "attached", timeout_s: float = 30.0, aux: bool = True, kill_prefill: int | None = None,
                window: int = 4, limit_s: float = 120.0, decode_timeout_s: float | None = None) -> Outcome:
    """Starts a bootstrap server here and one spawned process per rank, runs ``requests`` and collects
    what every rank reported. ``kill_prefill``: SIGKILL that prefill rank once it sent its first chunk."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    events = {"done": ctx.Event(), "first_chunk": ctx.Event(), "aborted": ctx.Event()}
    t0 = time.monotonic()
    out = Outcome()
    with kvxfer.BootstrapServer(host="127.0.0.1", port=0) as server:
        procs = {}
        for role, tp_n in (("decode", shape.decode_tp), ("prefill", shape.prefill_tp)):
            for tp in range(tp_n):
                t = decode_timeout_s if (role == "decode" and decode_timeout_s) else timeout_s
                spec = RankSpec(role, tp, shape, server.address, pages, requests, backend, notify, t, aux, window)
                p = ctx.Process(target=rank_main, args=(spec, results, events), name=f"kvxfer-{role}{tp}", daemon=True)
                p.start()
                procs[(role, tp)] = p
        want = len(procs)
        killed = None
        deadline = time.monotonic() + limit_s
        try:
            while len(out.ranks) < want - (1 if killed else 0):
                if kill_prefill is not None and killed is None and events["first_chunk"].is_set():
                    killed = procs[("prefill", kill_prefill)]
                    os.kill(killed.pid, signal.SIGKILL)
                    out.ranks.append({"role": "prefill", "tp": kill_prefill, "killed": True, "requests": {},
                                      "errors": [], "checked": 0})
                    want += 1
                    continue
                try:
                    out.ranks.append(results.get(timeout=0.05))
                except queue.Empty:
                    if time.monotonic() > deadline:
                        missing = [k for k in procs if not any(r["role"] == k[0] and r["tp"] == k[1] for r in out.ranks)]
                        raise TimeoutError(f"ranks {missing} did not report within {limit_s} s") from None
                    dead = [k for k, p in procs.items() if p.exitcode not in (None, 0) and p is not killed]
                    if dead:
                        raise RuntimeError(f"ranks {dead} died (exit codes {[procs[k].exitcode for k in dead]})")
        finally:
            events["done"].set()
            for p in procs.values():
                p.join(timeout=20)
                if p.is_alive():
                    p.kill()
                    p.join(5)
    out.wall_s = time.monotonic() - t0
    return out


def scattered(rng: np.random.Generator, pages: int, n: int, exclude: set[int] = frozenset()) -> list[int]:
    """n distinct page indices out of [0, pages), shuffled (so neither side's runs are contiguous)."""
    free = [p for p in range(pages) if p not in exclude]
    return [int(x) for x in rng.permutation(free)[:n]]
