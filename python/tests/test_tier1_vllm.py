"""Tier 1: KvxferConnector inside vLLM 0.33.0's own scheduler and worker-side connector driver.

See ``vllm_harness.py`` for what runs (vLLM's ``Scheduler``, ``allocate_kv_cache``, ``ActiveKVConnector``,
``maybe_transfer_kv_layer``, ``KVOutputAggregator``; one spawned process per TP rank) and for the pinned
stand-ins. Every decode byte of a loaded request is compared with the prefill's own tensors (snapshots
of the prefill's blocks, mapped head by head); every other decode block keeps its sentinel.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (tier 1: python/tier1.sh)")

import kvxfer  # noqa: E402
import vllm_harness as H  # noqa: E402

LIMIT_S = 60.0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return {
        "llama2": H.write_model(str(d / "llama2"), kv_heads=2),
        "llama1": H.write_model(str(d / "llama1"), kv_heads=1),
        "mla": H.write_model(str(d / "mla"), mla=True),
    }


def test_pinned_engine_functions_are_the_ones_the_harness_mirrors():
    got = H.source_hashes()
    changed = {k: v for k, v in got.items() if H.PINNED.get(k) not in (None, v)}
    assert not changed, f"vLLM changed these functions the tier 1 harness mirrors or relies on: {changed}"
    assert all(H.PINNED[k] is not None for k in got), got


def _requests(n_tokens: int, seed: int):
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(1, 999, n_tokens)]


class Pair:
    """A prefill and a decode instance around one bootstrap server."""

    def __init__(self, model: str, ptp: int, dtp: int, **kw):
        self.server = kvxfer.BootstrapServer(host="127.0.0.1", port=0)
        self.p = self.d = None
        self.touched: set[int] = set()  # decode blocks earlier requests of this pair used
        try:
            base = dict(model=model, bootstrap=self.server.address, prefill_tp=ptp, decode_tp=dtp)
            self.p = H.Instance(H.InstanceSpec(role="kv_producer", tp=ptp, **base, **kw.get("p", {})))
            self.d = H.Instance(H.InstanceSpec(role="kv_consumer", tp=dtp, **base, **kw.get("d", {})), sentinel=True)
        except BaseException:
            self.close()
            raise

    def close(self):
        for inst in (self.d, self.p):
            if inst is not None:
                inst.close()
        self.server.close()


def prefill_snapshot(pair: Pair, rid: str):
    blocks = list(pair.p.scheduler.kv_cache_manager.get_block_ids(rid)[0])
    return blocks, pair.p.ask("snapshot", blocks)


def expected_decode(pair: Pair, psnaps: list, dtp: int, ptp: int, kv_heads: int, mla: bool):
    """Per decode rank: the bytes it must hold, from the prefill ranks' snapshots, head by head."""
    out = []
    for d in range(dtp):
        if mla:
            out.append(psnaps[0])
            continue
        dh = H.heads_of(dtp, d, kv_heads)
        parts = []
        for h in dh:
            for p in range(ptp):
                ph = H.heads_of(ptp, p, kv_heads)
                if h in ph:
                    parts.append(psnaps[p][:, :, ph.index(h) : ph.index(h) + 1])
                    break
        out.append(np.concatenate(parts, axis=2))
    return out


def run_until(pair: Pair, done, what: str, limit: float = LIMIT_S, only=None):
    deadline = time.monotonic() + limit
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        for inst in only or (pair.p, pair.d):
            inst.step()


def finished(inst, kind: str, rid: str) -> bool:
    for _, out, _ in inst.outputs:
        kv = getattr(out, "kv_connector_output", None) if out is not None else None
        if kv is not None and rid in (getattr(kv, kind) or ()):
            return True
    return False


def check_untouched(pair: Pair, named: set[int]):
    """Every decode block no loaded request names still holds the sentinel, on every rank."""
    others = [b for b in range(1, pair.d.vc.cache_config.num_gpu_blocks) if b not in named]
    for r, snap in enumerate(pair.d.ask("snapshot", others)):
        bad = [others[i] for i in range(len(others)) if not (snap[:, i].view(np.int8) == H.SENTINEL).all()]
        assert not bad, f"decode rank {r}: blocks {bad} were written, but no loaded request names them"


def transfer(pair: Pair, *, ptp: int, dtp: int, kv_heads: int, mla: bool, prompt_len: int, room: int,
             decode_first: bool = False, preempt_after: int | None = None):
    prompt = _requests(prompt_len, room)
    P, D = f"p-{room}", f"d-{room}"
    pair.d.add(H.make_request(D, prompt, {"do_remote_prefill": True, "kvxfer_room": room}, max_tokens=3))
    if decode_first:  # the decode hands off before the prefill computes anything: every chunk goes layer-wise
        loads = sum(s["loads"] for s in pair.d.ask("stats"))
        run_until(pair, lambda: sum(s["loads"] for s in pair.d.ask("stats")) > loads, "the decode's handoff",
                  only=[pair.d])
    pair.p.add(H.make_request(P, prompt, {"do_remote_decode": True, "kvxfer_room": room}, max_tokens=1))
    snaps: dict = {}
    if preempt_after is not None:
        for _ in range(preempt_after):
            pair.p.step()
            pair.d.step()
        assert P in [r.request_id for r in pair.p.scheduler.running]
        assert pair.p.scheduler.requests[P].num_computed_tokens < prompt_len
        assert pair.p.scheduler.reset_prefix_cache(reset_running_requests=True)
        assert pair.p.scheduler.requests[P].num_preemptions == 1

    def prefill_done():
        # Snapshot the prefill's blocks once its prompt is computed (they are held until the send is final).
        if "p" not in snaps:
            req = pair.p.scheduler.requests.get(P)
            if req is not None and req.is_finished():
                snaps["p"] = prefill_snapshot(pair, P)
        return "p" in snaps

    def loaded():
        prefill_done()
        if "d" not in snaps and finished(pair.d, "finished_recving", D):
            blocks = list(pair.d.scheduler.kv_cache_manager.get_block_ids(D)[0])[: -(-prompt_len // H.BLOCK)]
            snaps["d"] = (blocks, pair.d.ask("snapshot", blocks))
        return "d" in snaps and "p" in snaps

    run_until(pair, loaded, "the decode to load and the prefill to finish")
    run_until(pair, lambda: finished(pair.p, "finished_sending", P) and P not in pair.p.scheduler.requests,
              "the prefill to free its blocks")
    pblocks, psnaps = snaps["p"]
    dblocks, dsnaps = snaps["d"]
    assert len(pblocks) >= len(dblocks) == -(-prompt_len // H.BLOCK)
    psnaps = [s[:, : len(dblocks)] for s in psnaps]
    want = expected_decode(pair, psnaps, dtp, ptp, kv_heads, mla)
    for r in range(dtp):
        assert dsnaps[r].shape == want[r].shape, (dsnaps[r].shape, want[r].shape)
        if not np.array_equal(dsnaps[r], want[r]):
            bad = np.argwhere(dsnaps[r] != want[r])[0]
            pytest.fail(f"decode rank {r}: (layer, block, head, slot, elem) {tuple(bad)} differs from the prefill")
    # The prefill computed what the pattern says (so the comparison is not of two blank caches).
    ref = pair.p.ask("expected", pblocks[: len(dblocks)], prompt, prompt_len)
    for p in range(ptp):
        assert np.array_equal(psnaps[p][..., :, :], np.where(ref[p] != 0, ref[p], psnaps[p])), f"prefill rank {p}"
        assert np.count_nonzero(ref[p]) > 0
    check_untouched(pair, set(dblocks) | pair.touched)
    pair.touched |= set(dblocks)
    # The decode then runs the request to its end (its own KV writes after the load).
    run_until(pair, lambda: D not in pair.d.scheduler.requests, "the decode to finish the request")
    return dsnaps


@pytest.mark.parametrize("ptp,dtp,model,heads", [
    pytest.param(2, 1, "llama2", 2, id="tp2-1"),
    pytest.param(1, 2, "llama2", 2, id="tp1-2"),
    pytest.param(1, 2, "llama1", 1, id="gqa-decode-tp-above-heads"),
    pytest.param(1, 2, "mla", 1, id="mla-deepseek"),
])
def test_vllm_pd_transfer(models, ptp, dtp, model, heads):
    pair = Pair(models[model], ptp, dtp, p={"log_stats": True}, d={"log_stats": True})
    try:
        # vLLM took the connector's layout preference (MLA: no preference, vLLM's CPU default).
        assert pair.p.layout == "LBHNC" and pair.d.layout == "LBHNC", (pair.p.layout, pair.d.layout)
        info = pair.d.info[0]
        assert len(info["shape"]) == 4  # vLLM 0.33's [B, H, N, C] views
        transfer(pair, ptp=ptp, dtp=dtp, kv_heads=heads, mla=model == "mla", prompt_len=9 * H.BLOCK + 3, room=5150)
        stats = pair.p.ask("stats")
        # Chunks computed before the decode's block list arrived go whole, later; the rest layer by layer
        # from save_kv_layer during the forward (which of the two a chunk takes depends on timing).
        assert all(s["whole_chunks"] + s["layer_pushes"] >= 1 and not s["failed_sends"] for s in stats), stats
        # vLLM's own stats path: per worker get_kv_connector_stats -> KVOutputAggregator -> the scheduler's
        # SchedulerStats.kv_connector_stats -> vLLM's KVConnectorLogging and KVConnectorProm. One transfer per
        # TP rank of each side, carrying the bytes each rank's kvxfer agent counted.
        moved = {"p": pair.p.moved_bytes(), "d": pair.d.moved_bytes()}
        assert moved["p"] == moved["d"] > 0, moved
        for side, inst, ranks in (("p", pair.p, ptp), ("d", pair.d, dtp)):
            check_vllm_stats(inst, transfers=ranks, nbytes=moved[side], blocks=10)
    finally:
        pair.close()


def check_vllm_stats(inst, *, transfers: int, nbytes: int, blocks: int):
    """vLLM 0.33's KVConnectorLogging and KVConnectorProm fed the instance's scheduler stats payloads, as its
    LoggingStatLogger and PrometheusStatLogger do, show these transfers (none failed)."""
    import functools

    import prometheus_client as prom
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm

    payloads = inst.kv_connector_stats()
    assert payloads, "the scheduler returned no kv_connector_stats: the connector's stats did not reach vLLM"
    logging_ = KVConnectorLogging(inst.vc.kv_transfer_config)
    registry = prom.CollectorRegistry()

    class Prom(KVConnectorProm):  # vLLM's class, metrics in a registry of this test
        _gauge_cls = functools.partial(prom.Gauge, registry=registry)
        _counter_cls = functools.partial(prom.Counter, registry=registry)
        _histogram_cls = functools.partial(prom.Histogram, registry=registry)

    exporter = Prom(inst.vc, labelnames=["model_name", "engine"], per_engine_labelvalues={0: ["m", "0"]})
    for data in payloads:
        logging_.observe(data)
        exporter.observe(data, 0)
    lines = []
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1 and lines[0].startswith("KV Transfer metrics: "), lines
    fields = dict(kv.split("=", 1) for kv in lines[0].removeprefix("KV Transfer metrics: ").split(", "))
    assert int(fields["Num successful transfers"]) == transfers, lines
    assert int(fields["Bytes transferred"]) == nbytes, (lines, nbytes)
    assert float(fields["Avg blocks per transfer"]) == blocks, lines
    assert int(fields["Num failed transfers"]) == 0 and int(fields["Num aborted transfers"]) == 0, lines
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("vllm:kvxfer_bytes_transferred_count", labels) == transfers
    assert registry.get_sample_value("vllm:kvxfer_bytes_transferred_sum", labels) == nbytes
    assert registry.get_sample_value("vllm:kvxfer_xfer_time_seconds_count", labels) == transfers
    assert registry.get_sample_value("vllm:kvxfer_num_blocks_sum", labels) == blocks * transfers


@pytest.fixture(scope="module")
def tp1(models):
    """One TP 1 -> 1 pair for the cases below (each with its own prompts, rooms and request ids); the
    decode has prefix caching on."""
    pair = Pair(models["llama2"], 1, 1, d={"prefix_caching": True})
    yield pair
    pair.close()


def test_vllm_tp1_transfer(tp1):
    assert tp1.p.layout == "LBHNC" and tp1.d.layout == "LBHNC", (tp1.p.layout, tp1.d.layout)
    assert len(tp1.d.info[0]["shape"]) == 4  # vLLM 0.33's [B, H, N, C] views
    transfer(tp1, ptp=1, dtp=1, kv_heads=2, mla=False, prompt_len=9 * H.BLOCK + 3, room=5150)
    s = tp1.p.ask("stats")[0]
    assert s["whole_chunks"] + s["layer_pushes"] >= 1 and not s["failed_sends"], s


def test_vllm_layerwise_push_and_prefill_preemption(tp1):
    """The decode hands off first, so every chunk goes layer-wise from save_kv_layer; the prefill is
    preempted after its first chunk (vLLM's reset_prefix_cache(reset_running_requests=True)), resumes in
    new blocks, and the decode still gets every byte."""
    before = tp1.p.ask("stats")[0]
    transfer(tp1, ptp=1, dtp=1, kv_heads=2, mla=False, prompt_len=9 * H.BLOCK + 3, room=777,
             decode_first=True, preempt_after=1)
    s = tp1.p.ask("stats")[0]
    assert s["whole_chunks"] == before["whole_chunks"] and s["layer_pushes"] - before["layer_pushes"] >= 3 * 3, s
    assert s["failed_sends"] == before["failed_sends"], s


def test_vllm_decode_prefix_hit_releases_the_prefill_at_once(tp1):
    """A decode with a local prefix-cache hit computes its tail itself and frees the prefill right away
    (before: the prefill held its blocks until its timeout)."""
    pair = tp1
    prompt = _requests(6 * H.BLOCK, 42)
    hasher = pair.d.block_hasher()
    pair.d.add(H.make_request("local", prompt[: 4 * H.BLOCK], {}, max_tokens=1, hasher=hasher))
    run_until(pair, lambda: "local" not in pair.d.scheduler.requests, "the local request", only=[pair.d])
    releases = pair.d.ask("stats")[0]["releases"]
    pair.p.add(H.make_request("p-hit", prompt, {"do_remote_decode": True, "kvxfer_room": 99}, max_tokens=1))
    pair.d.add(H.make_request("d-hit", prompt, {"do_remote_prefill": True, "kvxfer_room": 99}, max_tokens=2,
                              hasher=hasher))
    t0 = time.monotonic()
    run_until(pair, lambda: "p-hit" not in pair.p.scheduler.requests and "d-hit" not in pair.d.scheduler.requests,
              "both requests to finish")
    took = time.monotonic() - t0
    assert took < 10.0, f"the prefill held its blocks {took:.1f} s (its timeout is 60 s)"
    assert pair.d.ask("stats")[0]["releases"] == releases + 1


def test_vllm_decode_abort_mid_transfer_is_fenced(tp1):
    """The decode aborts while the prefill is still pushing: vLLM frees the request's blocks only after
    kvxfer's fence; the blocks are then rewritten, the prefill keeps computing (its pushes fail, nothing
    raises into its step), and no byte of the aborted request lands in them afterwards."""
    from vllm.v1.request import RequestStatus

    pair = tp1
    prompt = _requests(12 * H.BLOCK, 5)
    loads = pair.d.ask("stats")[0]["loads"]
    pair.d.add(H.make_request("d-ab", prompt, {"do_remote_prefill": True, "kvxfer_room": 31}, max_tokens=2))
    run_until(pair, lambda: pair.d.ask("stats")[0]["loads"] > loads, "the decode's handoff", only=[pair.d])
    dblocks = list(pair.d.scheduler.kv_cache_manager.get_block_ids("d-ab")[0])
    pair.p.add(H.make_request("p-ab", prompt, {"do_remote_decode": True, "kvxfer_room": 31}, max_tokens=1))
    pair.p.step()  # the first of three chunks pushed
    assert pair.p.scheduler.requests["p-ab"].num_computed_tokens < len(prompt)
    pair.d.scheduler.finish_requests("d-ab", RequestStatus.FINISHED_ABORTED)
    assert "d-ab" in pair.d.scheduler.requests  # blocks held: the load has not reported finished yet
    run_until(pair, lambda: "d-ab" not in pair.d.scheduler.requests, "the decode to free the aborted request")
    kv = [o.kv_connector_output for _, o, _ in pair.d.outputs if o is not None and o.kv_connector_output]
    assert any("d-ab" in (k.failed_recving or ()) for k in kv)
    # The freed blocks are rewritten (a new request's forward would), then the prefill runs on.
    pair.d.ask("write", dblocks, 0x5A5A)
    run_until(pair, lambda: "p-ab" not in pair.p.scheduler.requests, "the prefill to finish and free", only=[pair.p])
    time.sleep(0.5)
    snaps = pair.d.ask("snapshot", dblocks)
    assert (snaps[0] == 0x5A5A).all(), "a write of the aborted request landed after the fence"
    kv = [o.kv_connector_output for _, o, _ in pair.p.outputs if o is not None and o.kv_connector_output]
    assert any("p-ab" in (k.finished_sending or ()) for k in kv)  # the prefill freed its blocks too

