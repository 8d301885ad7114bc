#!/usr/bin/env python3
"""The issue-13 performance table: every backend and transport next to its baselines, in one run.

Runs, in interleaved rounds (so a slow moment of the machine hits every column alike):

- `kvxfer bench --block BLOCKS --total TOTAL --shuffle --format json` for tcp, ucx over tcp, ucx over
  shared memory, libfabric over `tcp;ofi_rxm` and libfabric over shm (backend, memcpy of the same
  ops, the polling plain socket, and the C library's own two-process tool, all from the same command);
- NIXL over UCX tcp (`benches/nixl/nixl_bench.py`, the same workload), when `--nixl-python` names a
  Python that has `nixl-cu12` and numpy (see benches/nixl/README.md);
- with `--sessions`, `kvxfer bench --model llama3-70b` P8->D2 and P2->D8 in NHD and HND on every
  backend (`session_vs_raw`: the sessions over the raw post of the same ops);
- with `--demo`, `kvxfer demo --requests 2` on tcp and on libfabric over shm (wall seconds and the
  demo's aggregate GB/s).

Prints Markdown tables of the per-round medians (with the range over the rounds), and with `--json
FILE` writes every raw result. Needs a release build with the C backends:
`cargo build --release -p kvxfer-cli --features ucx,fabric`. On a 2-core machine one round of the
default set takes about 4 minutes; run it on a quiet machine.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BACKENDS = [
    ("tcp", "tcp", []),
    ("ucx tcp", "ucx", ["tls=tcp"]),
    ("ucx shm", "ucx", ["tls=posix,sysv,cma,self"]),
    ("fabric tcp", "fabric", ["provider=tcp"]),
    ("fabric shm", "fabric", ["provider=shm"]),
]


def run_json(cmd, env=None, timeout=900):
    """Runs `cmd` and parses its stdout as JSON (the last JSON document if there is log noise)."""
    # UCX writes its own warnings to stdout unless told otherwise before the library loads.
    env = dict(os.environ if env is None else env)
    env.setdefault("UCX_LOG_FILE", "stderr")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"exit {p.returncode}: {p.stderr.strip()[-300:]} (from: {' '.join(cmd)})")
    lines = p.stdout.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith(("{", "[")):
            return json.loads("".join(lines[i:]))
    raise RuntimeError(f"{' '.join(cmd)} printed no JSON: {p.stdout[-500:]!r}")


def bench(kvxfer, backend, opts, blocks, total, runs):
    cmd = [kvxfer, "bench", "--backend", backend, "--block", blocks, "--total", total, "--shuffle"]
    cmd += ["--runs", str(runs), "--format", "json"]
    for o in opts:
        cmd += ["--backend-opt", o]
    return run_json(cmd)["cases"]


def nixl(python, blocks, total, runs):
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, UCX_TLS="tcp")
    cmd = [python, os.path.join(here, "nixl", "nixl_bench.py"), "--block", blocks, "--total", total]
    cmd += ["--runs", str(runs), "--initiator-progress-thread", "off", "--format", "json"]
    return run_json(cmd, env=env)


def sessions(kvxfer, backend, opts, runs):
    rows = []
    for p, d in ((8, 2), (2, 8)):
        for layout in ("nhd", "hnd"):
            cmd = [kvxfer, "bench", "--backend", backend, "--model", "llama3-70b", "--tokens", "8192"]
            cmd += ["--prefill-tp", str(p), "--decode-tp", str(d), "--layout", layout]
            cmd += ["--runs", str(runs), "--format", "json"]
            for o in opts:
                cmd += ["--backend-opt", o]
            c = run_json(cmd)["cases"][0]
            rows.append((f"P{p}->D{d} {layout}", c))
    return rows


def demo(kvxfer, backend, opts):
    cmd = [kvxfer, "demo", "--requests", "2", "--backend", backend, "--format", "json"]
    for o in opts:
        cmd += ["--backend-opt", o]
    return run_json(cmd)


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, rng=None):
    if x is None:
        return "-"
    if rng and len([r for r in rng if r is not None]) > 1:
        lo, hi = min(r for r in rng if r is not None), max(r for r in rng if r is not None)
        return f"{x:.2f} ({lo:.2f}-{hi:.2f})"
    return f"{x:.2f}"


def ratio(a, b):
    return None if a is None or not b else a / b


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kvxfer", default="target/release/kvxfer")
    p.add_argument("--nixl-python", help="a Python with nixl-cu12 and numpy (NIXL column)")
    p.add_argument("--blocks", default="4K,64K,1M,16M")
    p.add_argument("--total", default="1G")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runs", type=int, default=5, help="timed runs per measurement")
    p.add_argument("--only", help="comma-separated subset of: " + ", ".join(b[0] for b in BACKENDS))
    p.add_argument("--sessions", action="store_true", help="also the model-shaped session cases")
    p.add_argument("--demo", action="store_true", help="also the tcp and fabric-shm demos")
    p.add_argument("--json", help="write every raw result here")
    a = p.parse_args()
    chosen = [b for b in BACKENDS if not a.only or b[0] in a.only.split(",")]
    raw = {"rounds": []}
    for r in range(a.rounds):
        rnd = {"bench": {}, "nixl": None, "sessions": {}, "demo": {}}
        t0 = time.time()
        if a.nixl_python:
            try:
                rnd["nixl"] = nixl(a.nixl_python, ",".join(b for b in a.blocks.split(",") if b != "16M"), a.total,
                                   a.runs)
            except Exception as e:  # a missing NIXL leaves its column empty, named below
                rnd["nixl"] = {"error": str(e)}
        for label, backend, opts in chosen:
            try:
                rnd["bench"][label] = bench(a.kvxfer, backend, opts, a.blocks, a.total, a.runs)
            except Exception as e:
                rnd["bench"][label] = {"error": str(e)}
        if a.sessions:
            for label, backend, opts in chosen:
                try:
                    rnd["sessions"][label] = [(n, c) for n, c in sessions(a.kvxfer, backend, opts, a.runs)]
                except Exception as e:
                    rnd["sessions"][label] = {"error": str(e)}
        if a.demo:
            for label, backend, opts in (("tcp", "tcp", []), ("fabric shm", "fabric", ["provider=shm"])):
                try:
                    rnd["demo"][label] = demo(a.kvxfer, backend, opts)
                except Exception as e:
                    rnd["demo"][label] = {"error": str(e)}
        print(f"round {r + 1}/{a.rounds}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        raw["rounds"].append(rnd)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(raw, f, indent=1)
    report(raw, chosen, a)


def report(raw, chosen, a):
    rounds = raw["rounds"]
    print(f"{len(rounds)} interleaved rounds, --total {a.total} --shuffle, median GB/s of the rounds' medians"
          " (range over the rounds); ratios of the medians\n")
    print("core rtt: the bench's core-to-core round trip of a cache line before and after each case, ns"
          " (per round; two-process rates measured next to a slow one, 300+ ns on the development VM,"
          " are 2-3x lower)\n")
    print("| backend | block | kvxfer | memcpy | polling socket | native | native tool | NIXL UCX tcp |"
          " / memcpy | / socket | / native | / NIXL | core rtt ns |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, _, _ in chosen:
        for bi, block in enumerate(a.blocks.split(",")):
            cases = [rd["bench"].get(label) for rd in rounds]
            errs = [c["error"] for c in cases if isinstance(c, dict) and "error" in c]
            cases = [c[bi] for c in cases if isinstance(c, list) and len(c) > bi]
            if not cases:
                print(f"| {label} | {block} | failed: {errs[0][:200] if errs else '?'} ||||||||||||")
                continue
            be = [c["backend"]["median_gbps"] for c in cases]
            mc = [c["memcpy"]["median_gbps"] for c in cases]
            so = [c["socket"]["median_gbps"] for c in cases]
            nat = [(c.get("native") or {}).get("median_gbps") for c in cases]
            tool = next(((c.get("native") or {}).get("tool") for c in cases if c.get("native")), None)
            nerr = next(((c.get("native") or {}).get("error") for c in cases if (c.get("native") or {}).get("error")),
                        None)
            nx = []
            if label == "tcp":
                for rd in rounds:
                    n = rd.get("nixl")
                    if isinstance(n, list):
                        nx += [x["median_gbps"] for x in n if x.get("block") == parse_size(block) and x.get("verified")]
            vb, vm, vs, vn, vx = med(be), med(mc), med(so), med(nat), med(nx)
            rtt = " ".join("/".join("-" if x is None else f"{x:.0f}" for x in (c.get("core_rtt_ns") or [None, None]))
                           for c in cases)
            if not all(c["verified"] for c in cases):
                vb = None
            print(f"| {label} | {block} | {fmt(vb, be)} | {fmt(vm)} | {fmt(vs)} | {fmt(vn, nat)} |"
                  f" {tool or '-'}{' (failed: ' + nerr[:80] + ')' if nerr else ''} | {fmt(vx, nx)} |"
                  f" {fmt(ratio(vb, vm))} | {fmt(ratio(vb, vs))} | {fmt(ratio(vb, vn))} | {fmt(ratio(vb, vx))} | {rtt} |")
    if any(rd["sessions"] for rd in rounds):
        print("\n| backend | case | sessions GB/s | raw GB/s | sessions / raw |")
        print("|---|---|---|---|---|")
        for label, _, _ in chosen:
            per = [rd["sessions"].get(label) for rd in rounds]
            per = [x for x in per if isinstance(x, list)]
            if not per:
                print(f"| {label} | failed |||")
                continue
            for i, (name, _) in enumerate(per[0]):
                s = [x[i][1]["session"]["median_gbps"] for x in per if x[i][1].get("session")]
                rw = [x[i][1]["backend"]["median_gbps"] for x in per]
                print(f"| {label} | {name} | {fmt(med(s), s)} | {fmt(med(rw), rw)} | {fmt(ratio(med(s), med(rw)))} |")
    if any(rd["demo"] for rd in rounds):
        print("\n| demo (`--requests 2`) | wall s | aggregate GB/s | verified |")
        print("|---|---|---|---|")
        for label in ("tcp", "fabric shm"):
            ds = [rd["demo"].get(label) for rd in rounds if rd["demo"].get(label)]
            ok = [d for d in ds if "error" not in d]
            if not ok:
                print(f"| {label} | failed: {ds[0]['error'][:200] if ds else '?'} |||")
                continue
            w = [d["wall_seconds"] for d in ok]
            g = [d["aggregate_gbps"] for d in ok]
            print(f"| {label} | {fmt(med(w), w)} | {fmt(med(g), g)} | {all(d['ok'] for d in ok)} |")


def parse_size(s):
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(s[:-1] if s[-1:] in "KMG" else s) * mult


if __name__ == "__main__":
    main()
