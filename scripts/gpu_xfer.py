"""Two-process GPU transfers with torch pools: prefill TP 2 -> decode TP 1 (GQA), every byte compared,
and GB/s next to torch's own copies of the same bytes. What scripts/gpu-check.sh runs on a GPU machine.

Three processes on one GPU (spawned; each imports torch and the kvxfer wheel): a decode rank holding
all H KV heads and two prefill ranks holding H/2 each, SGLang's NHD pools (one
``[pages * page_size, local heads, head_dim]`` int16 tensor per layer and K/V). The prefill pools hold a
pattern of (layer, K/V, global head, page, token slot, element); the decode pool starts as a sentinel.
For each configuration (backend, memory) and page pattern (``runs``: one run of consecutive pages on
each side; ``scattered``: random pages), a request of ``--request-pages`` pages is sent ``--rounds``
times after a warm-up round, the decode pool reset before each; after each round the decode rank
compares its whole pool on the GPU: the request's pages against the pattern of the source pages they
were paired with, over all H heads, and every other byte against the sentinel.

Configurations: ``tcp/host`` (torch CPU tensors: tcp's host rate), ``tcp/cuda`` (CUDA pools through
tcp's pinned staging), ``cuda-ipc/cuda`` (device to device). Torch baselines, in the decode process, on
the same bytes: contiguous device-to-device, device-to-host and host-to-device (pinned) copies, and
torch's indexed copy of the same head slices of the same pages (what a gather kernel reaches).

    python scripts/gpu_xfer.py [--configs tcp/host,tcp/cuda,cuda-ipc/cuda] [--json out.json]

Prints a table and, with ``--json``, writes every number. Exit status 1 if any byte was wrong or any
configuration failed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
import traceback

SENTINEL = -4370  # 0xEEEE as int16


def log(role: str, msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} {role}] {msg}", flush=True)


def pattern(torch, layer: int, kind: int, heads: list[int], pages, s: int, d: int, device):
    """int16 [len(pages) * s, len(heads), d]: the value of every element of those pages and heads."""
    p = torch.as_tensor(pages, device=device, dtype=torch.int64).view(-1, 1, 1, 1)
    t = torch.arange(s, device=device, dtype=torch.int64).view(1, s, 1, 1)
    h = torch.as_tensor(heads, device=device, dtype=torch.int64).view(1, 1, -1, 1)
    e = torch.arange(d, device=device, dtype=torch.int64).view(1, 1, 1, d)
    v = ((layer * 2 + kind) * 1000003 + h * 7919 + p * 104729 + t * 131 + e * 17) % 32749
    return v.to(torch.int16).reshape(-1, len(heads), d)


def page_plan(mode: str, pool: int, n: int, seed: int):
    import random

    rng = random.Random(seed)
    if mode == "runs":
        a = rng.randrange(0, pool - n + 1)
        b = rng.randrange(0, pool - n + 1)
        return list(range(a, a + n)), list(range(b, b + n))
    return rng.sample(range(pool), n), rng.sample(range(pool), n)


def rank_main(role: str, tp: int, a: dict, server: str, barrier, results) -> None:
    name = f"{role}{tp}"
    try:
        import torch

        import kvxfer

        torch.cuda.set_device(0)
        H, D, L, S, POOL, N = a["heads"], a["head_dim"], a["layers"], a["page_size"], a["pool_pages"], a["request_pages"]
        topo = kvxfer.Topology(kv_heads=H, head_dim=D, layers=L, page_size=S, dtype_bytes=2, prefill_tp=2, decode_tp=1)
        heads = list(range(H)) if role == "decode" else list(range(tp * H // 2, (tp + 1) * H // 2))
        cuda = torch.device("cuda", 0)
        log(name, f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, kvxfer {kvxfer.__version__} {kvxfer.backends()}")
        for ci, cfg in enumerate(a["configs"]):
            backend, mem = cfg.split("/")
            dev = cuda if mem == "cuda" else torch.device("cpu")
            # Pools: every layer's K, then every layer's V (SGLang's order).
            pool = []
            for kind in (0, 1):
                for layer in range(L):
                    if role == "decode":
                        t = torch.full((POOL * S, H, D), SENTINEL, dtype=torch.int16, device=dev)
                    else:
                        t = pattern(torch, layer, kind, heads, range(POOL), S, D, cuda).to(dev)
                    pool.append(t)
            torch.cuda.synchronize()
            agent = kvxfer.Agent(
                role=role, topology=topo, tp_rank=tp, bootstrap=server, backend=backend, timeout_s=60.0,
                label=f"gpu_xfer {name} {cfg}",
            )
            agent.register_kv_buffers(pool)
            agent.start()
            agent.wait_connected(timeout_s=60)
            log(name, f"{cfg}: connected")
            barrier.wait(120)
            for mode in a["patterns"]:
                src, dst = page_plan(mode, POOL, N, seed=1000 + ci)
                times = []
                for r in range(1 + a["rounds"]):
                    room = 100000 * (ci + 1) + 1000 * a["patterns"].index(mode) + r
                    if role == "decode":
                        for t in pool:
                            t.fill_(SENTINEL)
                        torch.cuda.synchronize()
                    barrier.wait(120)
                    t0 = time.perf_counter()
                    if role == "decode":
                        rx = agent.receiver(room)
                        rx.send_metadata(dst)
                        got = rx.wait(timeout_s=60)
                        dt = time.perf_counter() - t0
                        if got != kvxfer.KVPoll.Success:
                            raise RuntimeError(f"{cfg} {mode} round {r}: poll {got}: {rx.failure_exception()}")
                        bad = verify(torch, pool, src, dst, a, cuda)
                        if bad:
                            raise RuntimeError(f"{cfg} {mode} round {r}: WRONG BYTES: {bad}")
                        if r > 0:
                            times.append(dt)
                    else:
                        tx = agent.sender(room)
                        tx.init(len(src))
                        limit = time.monotonic() + 60
                        while tx.poll() == kvxfer.KVPoll.Bootstrapping:
                            if time.monotonic() > limit:
                                raise RuntimeError(f"{cfg} {mode} round {r}: no handoff within 60 s")
                            time.sleep(0.0005)
                        tx.send(src)
                        got = tx.wait(timeout_s=60)
                        if got != kvxfer.KVPoll.Success:
                            raise RuntimeError(f"{cfg} {mode} round {r}: poll {got}: {tx.failure_exception()}")
                    barrier.wait(120)
                if role == "decode":
                    nbytes = N * S * H * D * 2 * 2 * L
                    results.put(("xfer", cfg, mode, nbytes, times))
                    log(name, f"{cfg} {mode}: {nbytes / 2**20:.0f} MiB, rounds {[f'{t*1e3:.1f} ms' for t in times]}, "
                        f"median {nbytes / statistics.median(times) / 1e9:.2f} GB/s, every byte checked")
            agent.close(timeout_s=30)
            del pool
            torch.cuda.empty_cache()
            barrier.wait(120)
        if role == "decode":
            results.put(("torch",) + torch_baselines(torch, a, cuda))
        results.put(("done", name))
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        results.put(("error", name, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        try:
            barrier.abort()
        except Exception:
            pass


def verify(torch, pool, src, dst, a, cuda) -> str | None:
    """None when every byte of the decode pool is right; else where the first wrong byte is."""
    H, D, L, S, POOL = a["heads"], a["head_dim"], a["layers"], a["page_size"], a["pool_pages"]
    di = torch.as_tensor(dst, device=cuda)
    others = torch.ones(POOL, dtype=torch.bool, device=cuda)
    others[di] = False
    for kind in (0, 1):
        for layer in range(L):
            got = pool[kind * L + layer].to(cuda).view(POOL, S, H, D)
            want = pattern(torch, layer, kind, list(range(H)), src, S, D, cuda).view(len(src), S, H, D)
            req = got[di]
            if not torch.equal(req, want):
                idx = (req != want).nonzero()[0].tolist()
                return (f"layer {layer} {'KV'[kind]}: request page #{idx[0]} (dst {dst[idx[0]]} <- src {src[idx[0]]}) "
                        f"slot {idx[1]} head {idx[2]} elem {idx[3]}: got {int(req[tuple(idx)])} want {int(want[tuple(idx)])}")
            rest = got[others]
            if not bool((rest == SENTINEL).all()):
                return f"layer {layer} {'KV'[kind]}: a byte outside the request's pages changed"
    return None


def timed(torch, f, reps: int = 5) -> float:
    f()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def torch_baselines(torch, a, cuda):
    """GB/s of torch's own copies of one request's bytes."""
    H, D, L, S, POOL, N = a["heads"], a["head_dim"], a["layers"], a["page_size"], a["pool_pages"], a["request_pages"]
    nbytes = N * S * H * D * 2 * 2 * L
    x = torch.empty(nbytes, dtype=torch.uint8, device=cuda)
    y = torch.empty_like(x)
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {
        "d2d_contiguous": nbytes / timed(torch, lambda: y.copy_(x)) / 1e9,
        "d2h_pinned": nbytes / timed(torch, lambda: h.copy_(x, non_blocking=True)) / 1e9,
        "h2d_pinned": nbytes / timed(torch, lambda: x.copy_(h, non_blocking=True)) / 1e9,
    }
    del x, y, h
    # The same head slices of the same pages, with torch's indexed copy (both prefill halves).
    hp = H // 2
    for mode in a["patterns"]:
        src, dst = page_plan(mode, POOL, N, seed=1000)
        si, di = torch.as_tensor(src, device=cuda), torch.as_tensor(dst, device=cuda)
        dpool = [torch.empty((POOL, S, H, D), dtype=torch.int16, device=cuda) for _ in range(2 * L)]
        spool = [[torch.empty((POOL, S, hp, D), dtype=torch.int16, device=cuda) for _ in range(2 * L)] for _ in range(2)]

        def indexed():
            for p in range(2):
                for k in range(2 * L):
                    dpool[k][di, :, p * hp:(p + 1) * hp, :] = spool[p][k][si]

        out[f"d2d_indexed_{mode}"] = nbytes / timed(torch, indexed, reps=3) / 1e9
        del dpool, spool
        torch.cuda.empty_cache()
    return (nbytes, out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="tcp/host,tcp/cuda,cuda-ipc/cuda")
    ap.add_argument("--patterns", default="runs,scattered")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pool-pages", type=int, default=512)
    ap.add_argument("--request-pages", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=240.0, help="whole run, seconds")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    a = dict(
        configs=[c for c in args.configs.split(",") if c], patterns=[p for p in args.patterns.split(",") if p],
        heads=args.heads, head_dim=args.head_dim, layers=args.layers, page_size=args.page_size,
        pool_pages=args.pool_pages, request_pages=args.request_pages, rounds=args.rounds,
    )
    import kvxfer

    ctx = mp.get_context("spawn")
    server = kvxfer.BootstrapServer(host="127.0.0.1", port=0)
    barrier = ctx.Barrier(3)
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, t, a, server.address, barrier, results), name=f"{r}{t}")
             for r, t in (("decode", 0), ("prefill", 0), ("prefill", 1))]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    done, errors, xfers, base = set(), [], [], None
    while len(done) + len(errors) < 3 and time.monotonic() < deadline:
        try:
            m = results.get(timeout=1.0)
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
            continue
        if m[0] == "done":
            done.add(m[1])
        elif m[0] == "error":
            errors.append(f"{m[1]}: {m[2]}")
        elif m[0] == "xfer":
            xfers.append(m[1:])
        elif m[0] == "torch":
            base = m[1:]
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            errors.append(f"{p.name}: still running at the deadline; killed")
            p.kill()
    server.close()
    rows = {}
    for cfg, mode, nbytes, times in xfers:
        rows[(cfg, mode)] = nbytes / statistics.median(times) / 1e9 if times else None
    print("\n==== gpu_xfer: prefill TP 2 -> decode TP 1, GQA H=%d, %d layers, %d-token pages, %d pages per request"
          % (a["heads"], a["layers"], a["page_size"], a["request_pages"]))
    report = {"args": a, "gbps": {f"{c} {m}": v for (c, m), v in rows.items()}, "errors": errors}
    if base:
        nbytes, t = base
        report["torch_gbps"] = t
        print(f"bytes per request: {nbytes / 2**20:.0f} MiB (decode side)")
        for k, v in t.items():
            print(f"  torch {k:24s} {v:8.2f} GB/s")
    for (cfg, mode), v in sorted(rows.items()):
        line = f"  {cfg:14s} {mode:10s} {v:8.2f} GB/s" if v else f"  {cfg:14s} {mode:10s}   (no rounds)"
        if base and v:
            t = base[1]
            if cfg == "cuda-ipc/cuda":
                line += f"   {v / t['d2d_contiguous']:.3f}x torch d2d, {v / t[f'd2d_indexed_{mode}']:.3f}x torch indexed"
                report.setdefault("ratios", {})[f"{cfg} {mode}"] = {"vs_torch_d2d": v / t["d2d_contiguous"]}
            if cfg == "tcp/cuda":
                host = rows.get(("tcp/host", mode))
                ref = min(t["d2h_pinned"], host) if host else t["d2h_pinned"]
                line += f"   {v / ref:.3f}x min(torch d2h {t['d2h_pinned']:.1f}, tcp host {host or float('nan'):.2f})"
                report.setdefault("ratios", {})[f"{cfg} {mode}"] = {"vs_min_d2h_tcp_host": v / ref}
        print(line)
    for e in errors:
        print(f"ERROR {e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    ok = not errors and len(done) == 3 and len(xfers) == len(a["configs"]) * len(a["patterns"])
    print("gpu_xfer:", "OK, every byte checked" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
