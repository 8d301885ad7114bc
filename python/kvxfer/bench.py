"""``python -m kvxfer.bench``: the Python-side cost of one ``send`` + ``poll`` cycle, against the Rust API.

One process holds a bootstrap server, a decode and a prefill agent (tcp over loopback). For 2N requests
the decode rank hands off and the prefill sender becomes ready; then N senders are driven from Python
(``s.send(int32 array)`` then ``s.poll()``) and N from Rust (``Sender::send`` then ``Sender::status``,
timed inside Rust through ``kvxfer._native._rust_send_poll_seconds``), alternating cycle by cycle so both
see the same machine state; the medians are compared. The difference per cycle is what the binding adds (argument conversion,
GIL release, panic guard, aux bookkeeping). Needs numpy.
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


def measure(n: int = 400, batch: int = 50, pages: int = 4) -> dict:
    shape = Shape(kv_heads=8, head_dim=128, layers=2, page_size=16, prefill_tp=1, decode_tp=1)
    topo = shape.topology()
    py_s, rs_s = [], []
    with kvxfer.BootstrapServer() as server:
        agents = []
        for role in ("decode", "prefill"):
            a = kvxfer.Agent(role=role, topology=topo, bootstrap=server.address)
            a.register_kv_buffers(make_pool(shape, role, 0, 4 * pages))
            a.start()
            agents.append(a)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvxfer.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=400)
    ap.add_argument("--format", default="table", choices=("table", "json"))
    a = ap.parse_args(argv)
    m = measure(a.cycles)
    if a.format == "json":
        print(json.dumps(m))
    else:
        print(f"kvxfer bench (python): one send + poll cycle, median over {m['cycles']} cycles each, alternating")
        print(f"  from Python {m['python_us']:.1f} us (p90 {m['python_p90_us']:.1f}), from Rust {m['rust_us']:.1f} us "
              f"(p90 {m['rust_p90_us']:.1f}): the binding adds {m['overhead_us']:.1f} us per cycle ({m['ratio']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
