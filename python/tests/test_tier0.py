"""Tier 0: the Python package end to end, numpy only.

Each cluster test starts a bootstrap server in this process and one spawned Python process per rank
(``kvxfer._testing.run_cluster``), registers numpy pools in SGLang's layout, runs requests with scattered
page indices in several chunks plus aux rows over the tcp backend, and checks every destination byte
against head slices computed in numpy (SEMANTICS §2 written again, not kvxfer's planner), every other
byte untouched. The failure tests kill, abort and time out requests and check what each side reports.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvxfer
from kvxfer._testing import Request, Shape, heads_of, make_pool, pattern, run_cluster, scattered, verify_decode

KVPoll = kvxfer.KVPoll
PAGES = 64


def requests(seed: int, n: int = 3, pages_per_request: int = 7, chunks=(3, 2, 2), aux: bool = True) -> list[Request]:
    rng = np.random.default_rng(seed)
    used: set[int] = set()
    out = []
    for i in range(n):
        dst = scattered(rng, PAGES, pages_per_request, used)
        used |= set(dst)
        src = scattered(rng, PAGES, pages_per_request)
        out.append(
            Request(
                room=1000 * seed + i,
                src=src,
                dst=dst,
                chunks=list(chunks),
                aux_prefill=(i + 3) if aux else None,
                aux_decode=(2 * i + 1) if aux else None,
            )
        )
    return out


def check_all_succeeded(outcome, reqs, shape: Shape) -> None:
    assert outcome.errors == [], "\n".join(outcome.errors)
    for r in outcome.ranks:
        for room in (q.room for q in reqs):
            got = r["requests"].get(room)
            assert got is not None, f"{r['role']} rank {r['tp']}: no outcome for room {room}"
            assert got["poll"] == KVPoll.Success, f"{r['role']} rank {r['tp']} room {room}: {got}"
            assert got["reusable"], got
    # Every decode rank checked its whole pool: the named pages against the reference, the rest untouched.
    for t in range(shape.decode_tp):
        d = outcome.rank("decode", t)
        heads = len(shape.heads("decode", t))
        per_token = heads * sum(e for _, e in shape.kinds()) * shape.dtype_bytes * shape.layers
        assert d["checked"] == PAGES * shape.page_size * per_token, d["checked"]


# ------------------------------------------------------------------------------------------------ API


def test_kvpoll_values_are_sglangs():
    assert (KVPoll.Failed, KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success) == (
        0,
        1,
        2,
        3,
        4,
    )
    assert kvxfer.KVPoll.Success == 4 and isinstance(KVPoll.Success, int)


def test_topology_rejects_what_does_not_divide_and_names_the_values():
    with pytest.raises(kvxfer.KvxferError, match="3"):
        kvxfer.Topology(kv_heads=8, head_dim=128, layers=4, page_size=16, dtype_bytes=2, prefill_tp=3, decode_tp=1)
    with pytest.raises(kvxfer.KvxferError):
        kvxfer.Topology(kv_heads=8, head_dim=128, layers=4, page_size=16, dtype_bytes=2, prefill_tp=4, decode_tp=3)
    with pytest.raises(ValueError, match="layout"):
        kvxfer.Topology(kv_heads=8, head_dim=128, layers=4, page_size=16, dtype_bytes=2, layout="thd")
    t = kvxfer.Topology(kv_heads=8, head_dim=128, layers=4, page_size=16, dtype_bytes=2, prefill_tp=2, decode_tp=1)
    # SGLang's kv_item_lens: bytes of one page of one buffer, K buffers then V buffers.
    assert t.item_lens("prefill") == [16 * 4 * 128 * 2] * 8
    assert t.item_lens("decode") == [16 * 8 * 128 * 2] * 8
    assert t.senders(0) == [(0, 0), (1, 0)] and t.receivers(1) == [(0, 0)]
    mla = kvxfer.Topology(mla_latent_dim=576, layers=3, page_size=1, dtype_bytes=2, prefill_tp=2, decode_tp=4)
    assert mla.kinds() == ["latent"] and mla.item_lens("decode") == [576 * 2] * 3


def test_bootstrap_server_address_and_close():
    server = kvxfer.BootstrapServer(host="127.0.0.1", port=0)
    host, port = server.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    server.close()
    server.close()  # idempotent


def test_agent_errors_are_exceptions_with_the_rust_message():
    t = Shape(kv_heads=4, head_dim=8, prefill_tp=2, decode_tp=1).topology()
    with kvxfer.BootstrapServer() as server:
        with pytest.raises(kvxfer.KvxferError, match="rank"):
            kvxfer.Agent(role="prefill", topology=t, tp_rank=2, bootstrap=server.address)
        with pytest.raises(ValueError, match="role"):
            kvxfer.Agent(role="middle", topology=t, bootstrap=server.address)
        a = kvxfer.Agent(role="decode", topology=t, bootstrap=server.address)
        with pytest.raises(kvxfer.KvxferError, match="start"):
            a.receiver(1)
        with pytest.raises(kvxfer.KvxferError, match="register the KV pool"):
            a.start()
        # Wrong buffer count, then a wrong item length: each error names what it expected.
        with pytest.raises(kvxfer.KvxferError, match="expected 4 buffers"):
            a.register_kv(ptrs=[4096] * 3, lens=[1 << 20] * 3, item_lens=[128] * 3)
        with pytest.raises(kvxfer.KvxferError, match="item length 100 bytes"):
            a.register_kv(ptrs=[4096] * 4, lens=[1 << 20] * 4, item_lens=[100] * 4)
        ro = [np.zeros((64 * 4, 4, 8), np.uint16) for _ in range(4)]
        ro[0].flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            a.register_kv_buffers(ro)
        a.close()


def _in_process_pair(shape: Shape, server, timeout_s: float = 10.0, digest: bool = False,
                     prefill_protocol: int | None = None):
    """A prefill and a decode agent in this process (tcp over loopback), with pools and aux."""
    t = shape.topology()
    agents, pools = [], []
    for role in ("decode", "prefill"):
        a = kvxfer.Agent(role=role, topology=t, bootstrap=server.address, timeout_s=timeout_s, lease_ttl_s=2.0,
                         digest=digest and role == "decode",
                         protocol=prefill_protocol if role == "prefill" else None)
        pool = make_pool(shape, role, 0, PAGES)
        a.register_kv_buffers(pool)
        aux = [np.zeros((8, 8), np.int32)]
        a.register_aux_buffers(aux)
        a.start()
        agents.append(a)
        pools.append((pool, aux))
    for a in agents:
        a.wait_connected(timeout_s=10)
    return agents, pools


def _until(f, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        v = f()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def test_request_lifecycle_in_one_process():
    shape = Shape(kv_heads=2, head_dim=8, layers=2)
    with kvxfer.BootstrapServer() as server:
        (dec, pre), ((dpool, daux), (_, paux)) = _in_process_pair(shape, server)
        try:
            r = dec.receiver(7)
            assert r.poll() == KVPoll.WaitingForInput and r.failure_exception() is None
            with pytest.raises(kvxfer.KvxferError, match="already active"):
                dec.receiver(7)
            with pytest.raises(kvxfer.KvxferError, match="decode"):
                dec.sender(7)
            with pytest.raises(kvxfer.KvxferError, match="aux_index 99"):
                r.send_metadata([1, 2], aux_index=99)
            s = pre.sender(7)
            assert s.poll() == KVPoll.Bootstrapping  # no page list from the decode rank yet
            s.init(2, aux_index=4)
            with pytest.raises(kvxfer.KvxferError, match="not ready"):
                s.send([5, 6])
            # No handoff yet: waiting for readiness times out and returns the phase.
            assert s.wait_ready(timeout_s=0.05) == KVPoll.Bootstrapping
            paux[0][4] = np.arange(8) + 70
            r.send_metadata(np.array([9, 3], np.int32), aux_index=6)
            assert r.poll() == KVPoll.Transferring
            assert s.wait_ready(timeout_s=10) == KVPoll.WaitingForInput
            # The prefill rank warmed its one connection before it counted as connected.
            assert pre.stats()["warm_ups"] == 1 and pre.stats()["warm_up_failures"] == 0
            assert dec.stats()["warm_ups"] == 0
            s.send(np.array([5], np.int64))  # numpy int64 works too
            assert s.poll() == KVPoll.WaitingForInput
            s.send([6])  # and a list; this chunk reaches the total: the aux row follows it
            assert r.wait(timeout_s=10) == KVPoll.Success
            assert s.wait(timeout_s=10) == KVPoll.Success
            assert list(daux[0][6]) == list(range(70, 78)) and not daux[0][4].any()
            checked, errors = verify_decode(shape, 0, dpool, [([5, 6], [9, 3])], PAGES)
            assert errors == [] and checked > 0
            assert r.pages_reusable() and r.status()["phase"] == "success"
            with pytest.raises(kvxfer.KvxferError, match="last chunk"):
                s.send([1])
            r.clear()
            s.clear()
            r.clear()  # idempotent
            # The room may be used again once released.
            r2 = dec.receiver(7)
            r2.abort()
            assert r2.poll() == KVPoll.Failed and "abort" in str(r2.failure_exception())
            r2.clear()
            assert dec.active_requests() == 0 and pre.active_requests() == 0
            # The agents' metrics (OpenMetrics text) count the same: one success on each side, the
            # decode's abort of r2 as a failure with the cause `aborted`.
            dm, pm = dec.metrics(), pre.metrics()
            assert dm.endswith("# EOF\n") and pm.endswith("# EOF\n")
            assert 'kvxfer_requests_total{role="decode",tp="0",pp="0",outcome="success"} 1' in dm, dm
            assert 'kvxfer_requests_total{role="decode",tp="0",pp="0",outcome="failed"} 1' in dm, dm
            assert 'kvxfer_request_failures_total{role="decode",tp="0",pp="0",cause="aborted"} 1' in dm, dm
            assert 'kvxfer_requests_total{role="prefill",tp="0",pp="0",outcome="success"} 1' in pm, pm
            assert 'kvxfer_request_duration_seconds_count{role="prefill",tp="0",pp="0",outcome="success"} 1' in pm
        finally:
            pre.close()
            dec.close()
        with pytest.raises(kvxfer.KvxferError, match="metrics"):
            dec.metrics()


def test_digest_on_the_decode_checks_what_landed():
    """Issue 30: with digest=True on the decode rank, the prefill hashes what it writes and the decode
    what landed; the request succeeds and both sides count the bytes. A prefill rank cannot ask."""
    shape = Shape(kv_heads=2, head_dim=8, layers=2)
    with pytest.raises(ValueError, match="decode setting"):
        kvxfer.Agent(role="prefill", topology=shape.topology(), bootstrap="127.0.0.1:1", digest=True)
    with kvxfer.BootstrapServer() as server:
        (dec, pre), ((dpool, _), _) = _in_process_pair(shape, server, digest=True)
        try:
            r = dec.receiver(3)
            s = pre.sender(3)
            s.init(3)
            r.send_metadata([8, 1, 30])
            _until(lambda: s.poll() == KVPoll.WaitingForInput, "the handoff")
            s.send([2, 3])
            s.send([40])
            assert r.wait(timeout_s=10) == KVPoll.Success, r.failure_exception()
            assert s.wait(timeout_s=10) == KVPoll.Success
            checked, errors = verify_decode(shape, 0, dpool, [([2, 3, 40], [8, 1, 30])], PAGES)
            assert errors == [] and checked > 0
            ds, ps = dec.stats(), pre.stats()
            assert ds["digest_bytes"] == ps["digest_bytes"] > 0, (ds, ps)
            assert ds["digest_mismatches"] == 0
            # The trace id both sides log the request under (issue 30).
            assert len(r.trace_id) == 32 and s.trace_ids == {"0/0": r.trace_id}, (r.trace_id, s.trace_ids)
            assert int(r.trace_id, 16) == (3 << 64) | r.generation
            r.clear()
            s.clear()
        finally:
            pre.close()
            dec.close()


def test_ranks_of_different_models_never_pair():
    """Issue 30: the model identity published with the layout; a rank naming another model is refused
    at start, naming both."""
    shape = Shape(kv_heads=2, head_dim=8, layers=2)
    t = shape.topology()
    with pytest.raises(ValueError, match="unknown key"):
        kvxfer.Agent(role="decode", topology=t, bootstrap="127.0.0.1:1", model={"name": "m", "rev": "x"})
    with pytest.raises(ValueError, match="name"):
        kvxfer.Agent(role="decode", topology=t, bootstrap="127.0.0.1:1", model={"revision": "x"})
    with kvxfer.BootstrapServer() as server:
        agents = []
        try:
            for role, model in (("decode", {"name": "org/m", "revision": "abc", "dtype": "bfloat16"}),
                                ("prefill", {"name": "org/m", "revision": "def", "dtype": "bfloat16"})):
                a = kvxfer.Agent(role=role, topology=t, bootstrap=server.address, timeout_s=5, lease_ttl_s=2.0,
                                 model=model)
                a.register_kv_buffers(make_pool(shape, role, 0, PAGES))
                agents.append(a)
            agents[0].start()
            with pytest.raises(kvxfer.KvxferError, match=r"model differs \(prefill org/m@def \(bfloat16\), decode org/m@abc"):
                agents[1].start()
        finally:
            for a in agents:
                a.close()


def test_a_prefill_pinned_to_the_previous_protocol_serves_an_upgraded_decode():
    """Issue 30, rolling upgrades: protocol=2 makes a rank speak as the previous release; an upgraded
    decode pairs with it and every byte lands; a version this build does not speak is refused."""
    shape = Shape(kv_heads=2, head_dim=8, layers=2)
    for v in (1, 4):
        with pytest.raises(ValueError, match=r"this build speaks kvxfer protocol 2\.\.=3"):
            kvxfer.Agent(role="prefill", topology=shape.topology(), bootstrap="127.0.0.1:1", protocol=v)
    with kvxfer.BootstrapServer() as server:
        (dec, pre), ((dpool, _), _) = _in_process_pair(shape, server, prefill_protocol=2)
        try:
            r = dec.receiver(5)
            s = pre.sender(5)
            s.init(2)
            r.send_metadata([7, 2])
            _until(lambda: s.poll() == KVPoll.WaitingForInput, "the handoff")
            s.send([3, 9])
            assert r.wait(timeout_s=10) == KVPoll.Success, r.failure_exception()
            assert s.wait(timeout_s=10) == KVPoll.Success
            checked, errors = verify_decode(shape, 0, dpool, [([3, 9], [7, 2])], PAGES)
            assert errors == [] and checked > 0
            r.clear()
            s.clear()
        finally:
            pre.close()
            dec.close()


def test_clear_while_writes_may_land_releases_after_the_fence():
    shape = Shape(kv_heads=2, head_dim=8, layers=2)
    with kvxfer.BootstrapServer() as server:
        (dec, pre), _ = _in_process_pair(shape, server)
        try:
            r = dec.receiver(11)
            r.send_metadata([1, 2, 3])
            s = pre.sender(11)
            s.init(3)
            _until(lambda: s.poll() == KVPoll.WaitingForInput, "the handoff")
            s.send([4])
            r.clear()  # not final: aborted, released once every sender fenced
            _until(lambda: dec.active_requests() == 0, "the deferred release")
            _until(lambda: s.poll() == KVPoll.Failed, "the prefill side to fail")
            assert "abort" in str(s.failure_exception())
            s.clear()
            _until(lambda: pre.active_requests() == 0, "the prefill release")
        finally:
            pre.close()
            dec.close()


def test_reference_catches_a_misplaced_head():
    """The check itself: a decode page holding the wrong head is reported."""
    shape = Shape(kv_heads=4, head_dim=8, prefill_tp=1, decode_tp=2)
    pool = make_pool(shape, "decode", 1, 8)
    heads = heads_of(2, 1, 4)
    assert heads == [2, 3]
    for layer in range(shape.layers):
        for i, (kind, elems) in enumerate(shape.kinds()):
            want = pattern(shape, layer, kind, [3, 2], [5], elems)  # heads swapped
            pool[i * shape.layers + layer][0:4] = want[0]
    _, errors = verify_decode(shape, 1, pool, [([5], [0])], 8)
    assert errors and "dst page 0" in errors[0]


# ----------------------------------------------------------------------------------- transfers by process


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param(Shape(kv_heads=4, head_dim=8, v_head_dim=4, prefill_tp=2, decode_tp=1), id="gqa-2to1-hk!=hv"),
        pytest.param(Shape(kv_heads=4, head_dim=8, prefill_tp=1, decode_tp=2), id="gqa-1to2"),
        pytest.param(Shape(kv_heads=2, head_dim=8, prefill_tp=4, decode_tp=2), id="gqa-replicated-prefill-4to2-H2"),
        pytest.param(Shape(kv_heads=2, head_dim=8, prefill_tp=1, decode_tp=4), id="gqa-replicated-decode-1to4-H2"),
        pytest.param(Shape(mla_latent_dim=24, layers=3, prefill_tp=2, decode_tp=1), id="mla-2to1"),
        pytest.param(Shape(mla_latent_dim=24, layers=3, prefill_tp=1, decode_tp=2), id="mla-1to2"),
    ],
)
def test_transfer_every_byte(shape: Shape):
    reqs = requests(seed=shape.prefill_tp * 10 + shape.decode_tp)
    out = run_cluster(shape, reqs, pages=PAGES)
    check_all_succeeded(out, reqs, shape)


def test_hnd_layout_out_of_band_notifications():
    shape = Shape(kv_heads=4, head_dim=8, prefill_tp=2, decode_tp=1, layout="hnd")
    reqs = requests(seed=5, chunks=(1, 4, 2))
    out = run_cluster(shape, reqs, pages=PAGES, notify="out-of-band")
    check_all_succeeded(out, reqs, shape)


# -------------------------------------------------------------------------------------------- failures


def _decode(out, room):
    return out.rank("decode", 0)["requests"][room]


def test_prefill_killed_mid_transfer_fails_the_decode_before_its_deadline():
    shape = Shape(kv_heads=4, head_dim=8, prefill_tp=1, decode_tp=1)
    (req,) = requests(seed=21, n=1)
    req.action = "prefill_dies"
    out = run_cluster(shape, [req], pages=PAGES, timeout_s=30.0, kill_prefill=0)
    d = _decode(out, req.room)
    assert d["poll"] == KVPoll.Failed, d
    assert d["reason"] and "prefill" in d["reason"], d
    assert d["seconds"] < 15.0, f"the decode learned of the loss after {d['seconds']:.1f} s (deadline 30 s)"
    assert d["reusable"]
    assert out.rank("decode", 0)["errors"] == []  # every page no request named is untouched


def test_abort_from_the_decode_side():
    shape = Shape(kv_heads=4, head_dim=8, prefill_tp=1, decode_tp=1)
    (req,) = requests(seed=22, n=1)
    req.action = "decode_aborts"
    out = run_cluster(shape, [req], pages=PAGES, timeout_s=30.0)
    assert out.errors == [], out.errors
    d = _decode(out, req.room)
    assert d["poll"] == KVPoll.Failed and "abort" in d["reason"], d
    assert d["reusable"]
    # Failed only once the fence closed: never Failed before the pages were free.
    assert KVPoll.Failed not in d["polls"][:-1], d["polls"]
    p = out.rank("prefill", 0)["requests"][req.room]
    assert p["poll"] == KVPoll.Failed and "abort" in p["reason"], p
    assert p["seconds"] < 15.0


def test_abort_from_the_prefill_side():
    shape = Shape(kv_heads=4, head_dim=8, prefill_tp=2, decode_tp=1)
    (req,) = requests(seed=23, n=1)
    req.action = "prefill_aborts"
    out = run_cluster(shape, [req], pages=PAGES, timeout_s=30.0)
    assert out.errors == [], out.errors
    d = _decode(out, req.room)
    assert d["poll"] == KVPoll.Failed and "abort" in d["reason"], d
    assert d["seconds"] < 15.0 and d["reusable"]
    p0 = out.rank("prefill", 0)["requests"][req.room]
    assert p0["poll"] == KVPoll.Failed and "abort" in p0["reason"], p0
    # The other prefill rank sent everything, then learned that the request failed (or finished its part).
    assert out.rank("prefill", 1)["requests"][req.room]["poll"] in (KVPoll.Failed, KVPoll.Success)


def test_a_request_no_prefill_serves_times_out():
    shape = Shape(kv_heads=4, head_dim=8, prefill_tp=1, decode_tp=1)
    reqs = requests(seed=24, n=2)
    reqs[0].action = "prefill_absent"
    out = run_cluster(shape, reqs, pages=PAGES, timeout_s=30.0, decode_timeout_s=2.0, window=2)
    assert out.errors == [], out.errors
    d = _decode(out, reqs[0].room)
    assert d["poll"] == KVPoll.Failed and d["reason"], d
    assert 1.5 < d["seconds"] < 10.0, d
    assert d["reusable"]
    # The other request, served, succeeded with every byte checked.
    assert _decode(out, reqs[1].room)["poll"] == KVPoll.Success
