"""``python -m kvxfer.bench``: the Python-side cost of the engine API, against the Rust API.

One process holds a bootstrap server, a decode and a prefill agent (tcp over loopback). For 2N requests
the decode rank hands off and the prefill sender becomes ready; then N senders are driven from Python
(``s.send(int32 array)`` then ``s.poll()``) and N from Rust (``Sender::send`` then ``Sender::status``,
timed inside Rust through ``kvxfer._native._rust_send_poll_seconds``), alternating cycle by cycle so both
see the same machine state; the medians are compared. The difference per cycle is what the binding adds (argument conversion,
GIL release, panic guard, aux bookkeeping).

Then whole one-page requests, alternating request by request: from Python (decode ``send_metadata``, prefill
``init``, ``wait_ready``, ``send``, decode ``wait``, as an engine with a thread per request drives them) and
the same calls from Rust (``kvxfer._native._rust_request_seconds``), each timed from the handoff to decode's
``Success``; ``request_ratio`` is Rust's median over Python's (issue 31's goal: at least 0.95). Needs numpy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

try:
    import numpy as np
except ImportError:  # pragma: no cover - depends on the environment
    sys.exit('python -m kvxfer.bench needs numpy: pip install "./python[demo]" (or pip install numpy)')

import kvxfer
from kvxfer import _native
from kvxfer._testing import Shape, make_pool


def _ready(pre, dec, rooms, pages: int):
    out = []
    for room in rooms:
        r = dec.receiver(room)
        r.send_metadata(np.arange(pages, dtype=np.int32) + pages)
        s = pre.sender(room)
        s.init(pages)
        out.append((r, s))
    deadline = time.monotonic() + 30
    for _, s in out:
        while s.poll() != kvxfer.KVPoll.WaitingForInput:
            if time.monotonic() > deadline:
                raise TimeoutError("senders did not become ready")
            time.sleep(0.0002)
    return out


def _finish(pairs):
    for r, s in pairs:
        if r.wait(timeout_s=30) != kvxfer.KVPoll.Success or s.wait(timeout_s=30) != kvxfer.KVPoll.Success:
            raise RuntimeError(f"room {r.room}: {r.failure_exception() or s.failure_exception()}")
        r.clear()
        s.clear()


SHAPE = Shape(kv_heads=8, head_dim=128, layers=2, page_size=16, prefill_tp=1, decode_tp=1)


def _agents(server, pool_pages: int):
    """A started decode and prefill agent of SHAPE, each with a pool of `pool_pages` pages."""
    agents = []
    for role in ("decode", "prefill"):
        a = kvxfer.Agent(role=role, topology=SHAPE.topology(), bootstrap=server.address)
        a.register_kv_buffers(make_pool(SHAPE, role, 0, pool_pages))
        a.start()
        agents.append(a)
    return agents


def measure(n: int = 400, batch: int = 50, pages: int = 4) -> dict:
    py_s, rs_s = [], []
    with kvxfer.BootstrapServer() as server:
        agents = _agents(server, 4 * pages)
        dec, pre = agents
        for a in agents:
            a.wait_connected(timeout_s=30)
        src = np.arange(pages, dtype=np.int32)
        src_list = list(range(pages))
        room = 1
        try:
            for _ in range(max(1, (2 * n) // batch)):
                pairs = _ready(pre, dec, range(room, room + batch), pages)
                room += batch
                # Alternate cycle by cycle, so both sides see the same machine state.
                for j in range(0, batch - 1, 2):
                    s = pairs[j][1]
                    t0 = time.perf_counter()
                    s.send(src)
                    s.poll()
                    py_s.append(time.perf_counter() - t0)
                    rs_s.append(_native._rust_send_poll_seconds([pairs[j + 1][1]], src_list))
                _finish(pairs)
        finally:
            pre.close()
            dec.close()
    py_us = statistics.median(py_s) * 1e6
    rs_us = statistics.median(rs_s) * 1e6
    p90 = lambda v: statistics.quantiles(v, n=10)[-1] * 1e6  # noqa: E731
    return {"cycles": len(py_s), "python_us": py_us, "rust_us": rs_us, "overhead_us": py_us - rs_us,
            "ratio": py_us / rs_us if rs_us else float("inf"), "python_p90_us": p90(py_s), "rust_p90_us": p90(rs_s)}


def _py_request(pre, dec, room: int, src, dst) -> float:
    t0 = time.perf_counter()
    r = dec.receiver(room)
    r.send_metadata(dst)
    s = pre.sender(room)
    s.init(len(src))
    if s.wait_ready(timeout_s=30) != kvxfer.KVPoll.WaitingForInput:
        raise RuntimeError(f"room {room}: prefill not ready: {s.failure_exception()}")
    s.send(src)
    if r.wait(timeout_s=30) != kvxfer.KVPoll.Success:
        raise RuntimeError(f"room {room}: {r.failure_exception()}")
    elapsed = time.perf_counter() - t0
    if s.wait(timeout_s=30) != kvxfer.KVPoll.Success:
        raise RuntimeError(f"room {room}: {s.failure_exception()}")
    s.clear()
    r.clear()
    return elapsed


def measure_requests(n: int = 200) -> dict:
    """One-page requests from Python and from Rust, alternating, on one prefill and one decode agent."""
    py_s, rs_s = [], []
    with kvxfer.BootstrapServer() as server:
        agents = _agents(server, 8)
        dec, pre = agents
        try:
            for a in agents:
                a.wait_connected(timeout_s=30)
            src, dst = np.array([1], dtype=np.int32), np.array([2], dtype=np.int32)
            room = 1
            # One of each first (not timed), then alternate.
            for i in range(2 * n + 2):
                if i % 2 == 0:
                    t = _py_request(pre, dec, room, src, dst)
                    if i >= 2:
                        py_s.append(t)
                else:
                    t = _native._rust_request_seconds(pre, dec, room, [1], [2])
                    if i >= 2:
                        rs_s.append(t)
                room += 1
        finally:
            pre.close()
            dec.close()
    py_us = statistics.median(py_s) * 1e6
    rs_us = statistics.median(rs_s) * 1e6
    return {"requests": len(py_s), "python_us": py_us, "rust_us": rs_us,
            "request_ratio": rs_us / py_us if py_us else 0.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvxfer.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=400)
    ap.add_argument("--requests", type=int, default=200, help="one-page requests from each side")
    ap.add_argument("--format", default="table", choices=("table", "json"))
    a = ap.parse_args(argv)
    m = measure(a.cycles)
    m["request"] = measure_requests(a.requests)
    if a.format == "json":
        print(json.dumps(m))
    else:
        print(f"kvxfer bench (python): one send + poll cycle, median over {m['cycles']} cycles each, alternating")
        print(f"  from Python {m['python_us']:.1f} us (p90 {m['python_p90_us']:.1f}), from Rust {m['rust_us']:.1f} us "
              f"(p90 {m['rust_p90_us']:.1f}): the binding adds {m['overhead_us']:.1f} us per cycle ({m['ratio']:.2f}x)")
        q = m["request"]
        print(f"  one-page request, handoff to decode Success, median over {q['requests']} each, alternating: "
              f"from Python {q['python_us']:.0f} us, from Rust {q['rust_us']:.0f} us: "
              f"the Python path at {q['request_ratio']:.2f}x the Rust path's speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
