"""``python -m kvxfer.demo``: a decode-and-prefill transfer between processes, every byte verified.

Starts a bootstrap server here and one spawned Python process per rank (2 prefill + 1 decode by default,
a Llama-3-8B-shaped KV cache with fewer layers), registers numpy pools in SGLang's layout, moves the
requests over the tcp backend (scattered pages, several chunks, an aux row each), and checks every
decode byte against a numpy reference of SEMANTICS §2 (and every page no request names untouched).
Prints a summary like ``kvxfer demo``'s; exits 1 if anything is wrong. Needs numpy.
"""

from __future__ import annotations

import argparse
import json
import sys

try:
    import numpy as np
except ImportError:  # pragma: no cover - depends on the environment
    sys.exit('python -m kvxfer.demo needs numpy: pip install "./python[demo]" (or pip install numpy)')

import kvxfer
from kvxfer._testing import Request, Shape, run_cluster, scattered


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _pct(v: list[float], p: float) -> float:
    if not v:
        return 0.0
    s = sorted(v)
    return s[min(len(s) - 1, max(0, int(np.ceil(p / 100 * len(s))) - 1))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvxfer.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--prefill-tp", type=int, default=2)
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--v-head-dim", type=int, default=None)
    ap.add_argument("--mla", type=int, default=None, metavar="LATENT_DIM", help="MLA with this latent dim")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype-bytes", type=int, default=2, choices=(1, 2, 4))
    ap.add_argument("--layout", default="nhd", choices=("nhd", "hnd"))
    ap.add_argument("--tokens", type=int, default=512, help="tokens per request")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--chunk-pages", type=int, default=8, help="pages per chunk the prefill sends")
    ap.add_argument("--inflight", type=int, default=4, help="requests in flight per rank")
    ap.add_argument("--backend", default="tcp")
    ap.add_argument("--notify", default="attached", choices=("attached", "out-of-band"))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--format", default="table", choices=("table", "json"))
    a = ap.parse_args(argv)

    shape = Shape(
        kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        v_head_dim=a.v_head_dim,
        layers=a.layers,
        page_size=a.page_size,
        dtype_bytes=a.dtype_bytes,
        prefill_tp=a.prefill_tp,
        decode_tp=a.decode_tp,
        mla_latent_dim=a.mla,
        layout=a.layout,
    )
    try:
        shape.topology()
    except (kvxfer.KvxferError, ValueError) as e:
        print(f"kvxfer demo: invalid configuration: {e}", file=sys.stderr)
        return 2
    per_request = -(-a.tokens // a.page_size)
    pages = per_request * a.requests + 8
    rng = np.random.default_rng(a.seed)
    used: set[int] = set()
    reqs = []
    for i in range(a.requests):
        dst = scattered(rng, pages, per_request, used)
        used |= set(dst)
        chunks = [min(a.chunk_pages, per_request - j) for j in range(0, per_request, max(1, a.chunk_pages))]
        reqs.append(Request(room=i + 1, src=scattered(rng, pages, per_request), dst=dst, chunks=chunks,
                            aux_prefill=i % 16, aux_decode=(i * 7 + 3) % 16))
    # Fewer aux rows than requests would reuse rows: keep aux for the first 16 only.
    if a.requests > 16:
        for r in reqs[16:]:
            r.aux_prefill = r.aux_decode = None

    out = run_cluster(shape, reqs, pages=pages, backend=a.backend, notify=a.notify, window=a.inflight,
                      limit_s=600.0)

    elems = sum(e for _, e in shape.kinds())
    token_bytes = {
        role: len(shape.heads(role, 0)) * elems * shape.dtype_bytes * shape.layers for role in ("prefill", "decode")
    }
    ok_requests = 0
    latencies = []
    ranks = []
    for r in sorted(out.ranks, key=lambda r: (r["role"] != "prefill", r["tp"])):
        done = [q for q in r["requests"].values() if q.get("poll") == kvxfer.KVPoll.Success]
        if r["role"] == "decode":
            ok_requests += len(done)
            latencies += [q["seconds"] for q in done]
        # A prefill rank holds its heads for every page it sends (replicas write nothing but notify).
        nbytes = len(done) * per_request * shape.page_size * token_bytes[r["role"]]
        span = r.get("span_s") or max((q["seconds"] for q in done), default=0.0)
        ranks.append({"role": r["role"], "rank": r["tp"], "bytes": nbytes, "requests": len(done),
                      "seconds": span, "gbps": nbytes / span / 1e9 if span else 0.0})
    verified = sum(r.get("checked", 0) for r in out.ranks if r["role"] == "decode")
    errors = out.errors
    ok = not errors and ok_requests == a.requests * a.decode_tp
    if not ok and ok_requests != a.requests * a.decode_tp:
        errors = errors + [f"{ok_requests} of {a.requests * a.decode_tp} request x decode-rank transfers succeeded"]
    name = "mla" if shape.mla else ("llama3-8b" if (a.kv_heads, a.head_dim) == (8, 128) else "gqa")
    geometry = (f"latent {a.mla}" if shape.mla else f"H={a.kv_heads}, head_dim {a.head_dim}"
                + (f"/{a.v_head_dim}" if a.v_head_dim else ""))
    summary = {
        "model": name,
        "shape": f"{a.layers} layers, {geometry}, {8 * a.dtype_bytes}-bit, page {a.page_size}, {a.layout}",
        "prefill": f"TP {a.prefill_tp}",
        "decode": f"TP {a.decode_tp}",
        "backend": a.backend,
        "notify": a.notify,
        "requests": a.requests,
        "tokens": a.tokens,
        "bytes_per_request": per_request * shape.page_size * token_bytes["decode"] * a.decode_tp,
        "ranks": ranks,
        "latency_ms": {"p50": _pct(latencies, 50) * 1e3, "p99": _pct(latencies, 99) * 1e3,
                       "max": max(latencies, default=0) * 1e3, "samples": len(latencies)},
        "wall_seconds": out.wall_s,
        "verified_bytes": verified,
        "ok": ok,
        "errors": errors,
    }
    if a.format == "json":
        print(json.dumps(summary, indent=2))
        return 0 if ok else 1
    print(f"kvxfer demo (python): {summary['model']} ({summary['shape']}), prefill {summary['prefill']} -> decode "
          f"{summary['decode']}, backend {a.backend}, {a.notify} notifications, one process per rank")
    print(f"  {a.requests} requests x {a.tokens} tokens, {_human(summary['bytes_per_request'])} per request, "
          f"chunks of {a.chunk_pages} pages, aux row each")
    print(f"  {'role':<8} {'rank':<6} {'bytes':>12} {'requests':>9} {'span s':>9} {'GB/s':>8}")
    for r in ranks:
        print(f"  {r['role']:<8} {r['rank']:<6} {_human(r['bytes']):>12} {r['requests']:>9} {r['seconds']:>9.3f} "
              f"{r['gbps']:>8.2f}")
    lat = summary["latency_ms"]
    print(f"  request latency (send_metadata -> Success): p50 {lat['p50']:.1f} ms, p99 {lat['p99']:.1f} ms, "
          f"max {lat['max']:.1f} ms over {lat['samples']} samples")
    print(f"  wall time {out.wall_s:.1f} s (process start, numpy pools, transfer, verification)")
    if ok:
        print(f"  verification: OK, {_human(verified)} verified against the numpy reference, no stray writes")
    else:
        print("  verification: FAILED")
        for e in errors:
            print(f"    - {e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
