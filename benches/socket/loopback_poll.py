#!/usr/bin/env python3
"""Loopback TCP between two processes, one stream, 1 GiB of cold memory per run: how the write
size and busy-polling change the rate (the issue-13 question of why NIXL's busy-polling UCX tcp
lanes beat a sleeping socket at 1 MiB).

    python3 benches/socket/loopback_poll.py --mode poll --send 1M --recv 1M

--mode poll: both sides use non-blocking sockets and spin on EAGAIN; --mode block: blocking
sockets. Prints the median and range of --runs timed runs (after one warm-up), in GB/s
(1e9 bytes/s). The receiver acknowledges each run with one byte. Bounded: every socket has a
30 s timeout in blocking mode, and a spinning side gives up after 30 s without progress.
"""
import argparse
import os
import random
import socket
import statistics
import sys
import time

TOTAL = 1 << 30
STALL = 30.0


def size(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1].upper()] if s[-1].upper() in units else int(s)


def spin(fn, view):
    """Calls fn(view) until it moves at least one byte (poll mode) or raises after STALL s."""
    start = time.monotonic()
    while True:
        try:
            return fn(view)
        except BlockingIOError:
            if time.monotonic() - start > STALL:
                raise TimeoutError("no progress for 30 s")


def receiver(args, port, ready):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen(1)
    os.write(ready, b"x")
    ls.settimeout(STALL)
    c, _ = ls.accept()
    buf = bytearray(TOTAL)
    mv = memoryview(buf)
    for _ in range(args.runs + 1):
        off = 0
        c.setblocking(args.mode == "block")
        if args.mode == "block":
            c.settimeout(STALL)
        while off < TOTAL:
            view = mv[off:min(TOTAL, off + args.recv)]
            n = spin(c.recv_into, view) if args.mode == "poll" else c.recv_into(view)
            if n == 0:
                raise ConnectionError("sender closed early")
            off += n
        c.setblocking(True)
        c.settimeout(STALL)
        c.sendall(b"k")


def sender(args, port):
    c = socket.create_connection(("127.0.0.1", port), timeout=STALL)
    buf = bytearray(os.urandom(1 << 20)) * (TOTAL >> 20)
    mv = memoryview(buf)
    rates = []
    for _ in range(args.runs + 1):
        t = time.perf_counter()
        off = 0
        c.setblocking(args.mode == "block")
        if args.mode == "block":
            c.settimeout(STALL)
        while off < TOTAL:
            view = mv[off:min(TOTAL, off + args.send)]
            off += spin(c.send, view) if args.mode == "poll" else c.send(view)
        c.setblocking(True)
        c.settimeout(STALL)
        if c.recv(1) != b"k":
            raise ConnectionError("no acknowledgement")
        rates.append(TOTAL / (time.perf_counter() - t) / 1e9)
    rates = rates[1:]
    print(
        f"{args.mode} send {args.send} recv {args.recv}: median {statistics.median(rates):.2f} GB/s "
        f"(range {min(rates):.2f}-{max(rates):.2f}, {len(rates)} runs)"
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["poll", "block"], default="poll")
    p.add_argument("--send", type=size, default=1 << 20, help="bytes per send call (e.g. 1M)")
    p.add_argument("--recv", type=size, default=1 << 20, help="bytes per recv call")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    port = 20000 + random.randint(0, 20000)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            receiver(args, port, w)
        finally:
            os._exit(0)
    os.read(r, 1)
    try:
        sender(args, port)
    finally:
        _, status = os.waitpid(pid, 0)
    return 0 if status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
