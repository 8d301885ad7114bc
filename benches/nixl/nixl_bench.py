#!/usr/bin/env python3
"""NIXL (UCX backend) between two processes: the workload of `kvxfer bench --total T --block B --shuffle`.

The initiator (this process) registers TOTAL bytes of patterned host memory and starts a target
process that registers TOTAL zeroed bytes; both are NIXL agents with the UCX backend only. For each
block size, TOTAL/BLOCK WRITE descriptors move source block i to destination block perm[i] (perm:
the same seeded Fisher-Yates shuffle as `kvxfer bench --shuffle`, seed 11), as one transfer request
prepared once (`initialize_xfer`) and posted `--runs` times after a warm-up; a run ends when the
request reports DONE. The target's memory is then hashed and compared with the expected placement.

Run it with the transport chosen through UCX's environment, e.g. UCX over TCP only:

    UCX_TLS=tcp python3 benches/nixl/nixl_bench.py --block 4K,64K,1M --total 1G --runs 5

Needs `pip install --no-deps nixl-cu12` and numpy (the `nixl` import name, or `nixl_cu12`).
Prints one line per block size (median, best and worst GB/s, 1e9 bytes/s), or JSON with --format json.
"""

import argparse
import base64
import hashlib
import json
import os
import subprocess
import sys
import time

import numpy as np

try:
    from nixl._api import nixl_agent, nixl_agent_config
except ImportError:
    from nixl_cu12 import nixl_agent, nixl_agent_config

MASK = (1 << 64) - 1


def parse_size(s):
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(s[:-1] if s[-1:] in "KMG" else s) * mult


def shuffled(n, seed):
    """kvxfer's SplitMix Fisher-Yates shuffle of 0..n (crates/cli/src/model.rs)."""
    v = list(range(n))
    state = seed
    for i in range(n - 1, 0, -1):
        state = (state + 0x9E3779B97F4A7C15) & MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        z ^= z >> 31
        j = z % (i + 1)
        v[i], v[j] = v[j], v[i]
    return np.array(v, dtype=np.uint64)


def digest(buf):
    return hashlib.blake2b(memoryview(buf), digest_size=16).hexdigest()


def agent(name, progress_thread=True):
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))


def target(total):
    a = agent("target")
    buf = np.zeros(total, dtype=np.uint8)
    buf.fill(0)  # fault the pages in now, not during the first transfer
    a.register_memory([(buf.ctypes.data, total, 0, "")], "DRAM")
    say({"meta": base64.b64encode(a.get_agent_metadata()).decode(), "addr": buf.ctypes.data})
    for line in sys.stdin:
        cmd = json.loads(line)["cmd"]
        if cmd == "clear":
            buf.fill(0)
            say({"ok": True})
        elif cmd == "hash":
            say({"hash": digest(buf)})
        else:
            return


PREFIX = "@@nixl_bench "

# NIXL and UCX log to stdout: this script's own output (results, and the target's protocol lines)
# goes to the original stdout, everything else is sent to stderr.
OUT = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr


def say(v):
    print(PREFIX + json.dumps(v), file=OUT, flush=True)


def hear(f):
    while True:
        line = f.readline()
        if not line:
            sys.exit("the target process ended (see its output above)")
        if line.startswith(PREFIX):
            return json.loads(line[len(PREFIX):])
        sys.stderr.write(line)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block", default="1M", help="block sizes, comma-separated (4K,64K,1M)")
    p.add_argument("--total", default="1G", help="bytes per request")
    p.add_argument("--runs", type=int, default=5, help="timed runs per block size (after one warm-up)")
    p.add_argument("--seed", type=int, default=11, help="seed of the destination permutation")
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.add_argument("--initiator-progress-thread", choices=["on", "off"], default="on",
                   help="NIXL's progress thread in the initiator (off: the status polls progress UCX); "
                   "the target always has one")
    p.add_argument("--role", choices=["initiator", "target"], default="initiator", help=argparse.SUPPRESS)
    args = p.parse_args()
    total = parse_size(args.total)
    if args.role == "target":
        return target(total)

    peer = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--role", "target", "--total", str(total)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def ask(cmd):
        peer.stdin.write(json.dumps({"cmd": cmd}) + "\n")
        peer.stdin.flush()
        return hear(peer.stdout)

    hello = hear(peer.stdout)
    a = agent("initiator", args.initiator_progress_thread == "on")
    src = (np.arange(total // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(1)).view(np.uint8)
    a.register_memory([(src.ctypes.data, total, 0, "")], "DRAM")
    remote = a.add_remote_agent(base64.b64decode(hello["meta"]))
    dst_addr = hello["addr"]
    results = []
    for block in [parse_size(b) for b in args.block.split(",")]:
        if total % block:
            sys.exit(f"--total {total} is not a multiple of --block {block}")
        n = total // block
        perm = shuffled(n, args.seed)
        idx = np.arange(n, dtype=np.uint64)
        local = np.stack([np.uint64(src.ctypes.data) + idx * np.uint64(block), np.full(n, block, np.uint64),
                          np.zeros(n, np.uint64)], axis=1)
        far = np.stack([np.uint64(dst_addr) + perm * np.uint64(block), np.full(n, block, np.uint64),
                        np.zeros(n, np.uint64)], axis=1)
        ask("clear")
        t = time.perf_counter()
        h = a.initialize_xfer("WRITE", a.get_xfer_descs(local, "DRAM"), a.get_xfer_descs(far, "DRAM"), remote)
        prep = time.perf_counter() - t
        secs = []
        for i in range(args.runs + 1):
            t = time.perf_counter()
            state = a.transfer(h)
            while state == "PROC":
                state = a.check_xfer_state(h)
            if state != "DONE":
                sys.exit(f"NIXL transfer failed ({state}) at block {block}")
            if i > 0:
                secs.append(time.perf_counter() - t)
        a.release_xfer_handle(h)
        expect = np.zeros(total, dtype=np.uint8)
        expect.reshape(n, block)[perm.astype(np.int64)] = src.reshape(n, block)
        verified = ask("hash")["hash"] == digest(expect)
        del expect
        secs.sort()
        gbps = [total / s / 1e9 for s in secs]
        results.append({
            "block": block, "bytes": total, "descs": n, "runs": args.runs, "prep_s": prep,
            "median_gbps": total / secs[len(secs) // 2] / 1e9, "best_gbps": max(gbps), "worst_gbps": min(gbps),
            "verified": verified, "ucx_tls": os.environ.get("UCX_TLS", "(UCX default)"),
        })
    peer.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
    peer.stdin.close()
    peer.wait()
    if args.format == "json":
        print(json.dumps(results, indent=2), file=OUT)
    else:
        for r in results:
            print(f"nixl UCX_TLS={r['ucx_tls']} block {r['block']:>8} descs {r['descs']:>7} "
                  f"median {r['median_gbps']:.2f} GB/s (best {r['best_gbps']:.2f}, worst {r['worst_gbps']:.2f}) "
                  f"prep {r['prep_s']:.2f} s verified {'yes' if r['verified'] else 'NO'}", file=OUT)
    return 0 if all(r["verified"] for r in results) else 1


if __name__ == "__main__":
    code = main() or 0
    OUT.flush()
    sys.stderr.flush()
    # nixl-cu12 1.5.1's bundled libnl-route crashes in an exit-time destructor: skip them.
    os._exit(code)
