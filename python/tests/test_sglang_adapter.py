"""The SGLang adapter driven through SGLang's call sequence (decode.py / prefill.py of SGLang 0.5.23).

Tier 0 runs it without SGLang (the adapter's classes then derive from stand-ins); tier 1
(``python/tier1.sh``) runs the same file with SGLang installed, where they derive from SGLang's own
``Base*`` classes, and adds the plugin test. KV pools are numpy arrays described to the adapter the way
SGLang's ``KVArgs`` describes its pool (raw addresses, lengths, page item lengths; every layer's K, then
every layer's V), and every destination byte is checked against the numpy reference.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

import kvxfer
from kvxfer import KVPoll
from kvxfer import sglang as adapter
from kvxfer._testing import Shape, aux_row, make_aux, make_pool, moved_bytes, verify_decode

PAGES = 48


def kv_args(shape: Shape, role: str, rank: int, pool, aux):
    """``KVArgs`` as SGLang's ``_init_kv_manager`` fills it."""
    tp = shape.prefill_tp if role == "prefill" else shape.decode_tp
    item = lambda a: a.nbytes // PAGES  # noqa: E731 - bytes of one page
    return SimpleNamespace(
        engine_rank=rank,
        pp_rank=0,
        system_dp_rank=0,
        kv_cache_dtype_str="torch.bfloat16",
        kv_layout=None,
        kv_data_ptrs=[a.ctypes.data for a in pool],
        kv_data_lens=[a.nbytes for a in pool],
        kv_item_lens=[item(a) for a in pool],
        num_draft_entries=0,
        page_size=shape.page_size,
        kv_head_num=len(shape.heads(role, rank)),
        total_kv_head_num=shape.kv_heads if role == "prefill" else None,
        aux_data_ptrs=[a.ctypes.data for a in aux],
        aux_data_lens=[a.nbytes for a in aux],
        aux_item_lens=[a[0].nbytes for a in aux],
        state_data_ptrs=[],
        ib_device=None,
        gpu_id=0,
        _tp=tp,
    )


def server_args(tp: int, port: int):
    return SimpleNamespace(tp_size=tp, dp_size=1, pp_size=1, enable_dp_attention=False, device="cpu",
                           host="127.0.0.1", disaggregation_bootstrap_port=port, dist_init_addr=None)


def _until(f, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not f():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


@pytest.mark.parametrize("shape", [
    pytest.param(Shape(kv_heads=4, head_dim=8, v_head_dim=4, prefill_tp=2, decode_tp=1), id="gqa-2to1"),
    pytest.param(Shape(kv_heads=2, head_dim=8, prefill_tp=1, decode_tp=4), id="gqa-1to4-replicated"),
    pytest.param(Shape(mla_latent_dim=24, layers=3, prefill_tp=2, decode_tp=1), id="mla-2to1"),
])
def test_sglang_call_sequence(shape: Shape, monkeypatch):
    monkeypatch.setenv("KVXFER_PREFILL_TP", str(shape.prefill_tp))
    monkeypatch.setenv("KVXFER_DECODE_TP", str(shape.decode_tp))
    monkeypatch.setenv("KVXFER_BACKEND_OPTIONS", "listen=127.0.0.1:0")
    if shape.decode_tp > shape.kv_heads:
        monkeypatch.setenv("KVXFER_KV_HEADS", str(shape.kv_heads))  # decode KVArgs lack total_kv_head_num
    mode = SimpleNamespace(value="prefill"), SimpleNamespace(value="decode")
    boot = adapter.KvxferKVBootstrapServer(host="127.0.0.1", port=0)
    port = int(boot.address.rsplit(":", 1)[1])
    addr = f"127.0.0.1:{port}"
    monkeypatch.setenv("KVXFER_BOOTSTRAP", addr)
    mgrs, keep = [], []
    try:
        pre = []
        for r in range(shape.prefill_tp):
            pool, aux = make_pool(shape, "prefill", r, PAGES), make_aux()
            keep.append((pool, aux))
            pre.append(adapter.KvxferKVManager(kv_args(shape, "prefill", r, pool, aux), mode[0],
                                               server_args(shape.prefill_tp, port), shape.mla))
        dec = []
        for r in range(shape.decode_tp):
            pool, aux = make_pool(shape, "decode", r, PAGES), make_aux()
            keep.append((pool, aux))
            dec.append((adapter.KvxferKVManager(kv_args(shape, "decode", r, pool, aux), mode[1],
                                                server_args(shape.decode_tp, port), shape.mla), pool, aux))
        mgrs = pre + [m for m, _, _ in dec]
        assert pre[0].topology == dec[0][0].topology, (pre[0].topology, dec[0][0].topology)
        # Decode: the scheduler resolves the prefill's parallel info before it makes receivers.
        for m, _, _ in dec:
            _until(lambda m=m: m.try_ensure_parallel_info(addr), "parallel info")
            assert m.prefill_info_table[addr].dp_size == 1
        rng = np.random.default_rng(3)
        room = 424242
        dst = [int(x) for x in rng.permutation(PAGES)[:9]]
        src = [int(x) for x in rng.permutation(PAGES)[:9]]
        for r, (_, aux) in enumerate(keep[: shape.prefill_tp]):
            aux[0][5], aux[1][5] = aux_row(room)
        receivers = []
        for m, _, _ in dec:
            rx = adapter.KvxferKVReceiver(mgr=m, bootstrap_addr=addr, bootstrap_room=room)
            rx.init(0)
            assert rx.poll() in (KVPoll.Bootstrapping, KVPoll.WaitingForInput)
            rx.send_metadata(np.asarray(dst, dtype=np.int32), aux_index=2)
            receivers.append(rx)
        senders = [adapter.KvxferKVSender(mgr=m, bootstrap_addr=addr, bootstrap_room=room) for m in pre]
        for tx in senders:
            _until(lambda tx=tx: tx.poll() == KVPoll.WaitingForInput, "the page lists")
            tx.init(len(src), 5)
            assert tx.get_transfer_metric().transfer_total_bytes is None  # only once it succeeded
        for chunk in (src[:4], src[4:8], src[8:]):
            last = chunk is not None and chunk[-1] == src[-1]
            for tx in senders:
                assert tx.should_send_kv_chunk(len(chunk), last)
                tx.send(np.asarray(chunk, dtype=np.int64), None, num_kv_tokens=len(chunk) * shape.page_size)
        for x in receivers + senders:
            _until(lambda x=x: x.poll() in (KVPoll.Success, KVPoll.Failed), "the outcome")
            assert x.poll() == KVPoll.Success, x.failure_exception
            assert x.conclude_state == KVPoll.Success
        for r, (m, pool, aux) in enumerate(dec):
            _, errors = verify_decode(shape, r, pool, [(src, dst)], PAGES)
            assert errors == [], errors
            a, b = aux_row(room)
            assert np.array_equal(aux[0][2], a) and np.array_equal(aux[1][2], b)
        # SGLang's transfer metric (prefill.py observes it per finished request): the bytes each prefill
        # rank's agent counted, the decode's total, and a latency.
        metrics = [tx.get_transfer_metric() for tx in senders]
        for m, got in zip(pre, metrics):  # (MLA: one prefill rank writes the latent, the other nothing)
            assert got.transfer_total_bytes == moved_bytes(m.agent(), nonzero=False), got
            assert got.transfer_latency_s is not None and got.transfer_latency_s > 0, got
        total = sum(g.transfer_total_bytes for g in metrics)
        assert total == sum(moved_bytes(m.agent(addr)) for m, _, _ in dec) > 0, metrics
        for x in receivers + senders:
            x.clear()
        # A failure is raised, SGLang-style, with the Rust message.
        rx = adapter.KvxferKVReceiver(mgr=dec[0][0], bootstrap_addr=addr, bootstrap_room=room + 1)
        rx.init(0)
        rx.send_metadata(np.asarray(dst[:2], dtype=np.int32), decode_prefix_len=16)
        assert rx.poll() == KVPoll.Failed
        with pytest.raises(kvxfer.KvxferError, match="prefix reuse"):
            rx.failure_exception()
        rx.abort()
        rx.clear()
    finally:
        for m in mgrs:
            m.close()
        boot.close()


def test_topology_needs_no_more_than_kvargs_and_the_peer_parallelism(monkeypatch):
    monkeypatch.setenv("KVXFER_PREFILL_TP", "8")
    shape = Shape(kv_heads=8, head_dim=128, layers=2, page_size=16, prefill_tp=8, decode_tp=2)
    pool = make_pool(shape, "decode", 0, 2)
    args = kv_args(shape, "decode", 0, pool, make_aux())
    args.kv_data_lens = [a.nbytes for a in pool]
    args.kv_item_lens = [a.nbytes // 2 for a in pool]
    t = adapter.topology_from_kv_args(args, server_args(2, 0), "decode", False)
    assert (t.kv_heads, t.head_dim, t.prefill_tp, t.decode_tp, t.layers) == (8, 128, 8, 2, 2)
    # Draft-model KV entries (speculative decoding) follow the target's in KVArgs; the target topology
    # leaves them out (they get an agent of their own).
    args.kv_data_ptrs = args.kv_data_ptrs + args.kv_data_ptrs
    args.kv_data_lens = args.kv_data_lens + args.kv_data_lens
    args.kv_item_lens = args.kv_item_lens + [x // 2 for x in args.kv_item_lens]
    args.num_draft_entries = 4
    t = adapter.topology_from_kv_args(args, server_args(2, 0), "decode", False)
    assert (t.kv_heads, t.head_dim, t.layers) == (8, 128, 2)


@pytest.mark.skipif(not adapter.HAVE_SGLANG, reason="SGLang is not installed (tier 1: python/tier1.sh)")
def test_plugin_makes_kvxfer_a_transfer_backend():
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    from sglang.srt.disaggregation import utils as du
    from sglang.srt.disaggregation.base.conn import BaseKVManager, BaseKVReceiver, BaseKVSender
    from sglang.srt.managers import disagg_service  # imported before the plugins, as in a scheduler process
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()  # finds kvxfer's entry point among the installed distributions
    args = prepare_server_args(["--model-path", "/nonexistent", "--disaggregation-mode", "decode",
                                "--disaggregation-transfer-backend", "kvxfer", "--device", "cpu"])
    assert args.disaggregation_transfer_backend == "kvxfer"
    assert disagg_service.get_kv_class(du.TransferBackend("kvxfer"), du.KVClassType.BOOTSTRAP_SERVER) is (
        adapter.KvxferKVBootstrapServer
    )
    assert not disagg_service.rust_server_serves_kv_bootstrap("kvxfer")  # kvxfer brings its own bootstrap
    assert "kvxfer" in DISAGG_TRANSFER_BACKEND_CHOICES
    backend = du.TransferBackend("kvxfer")
    assert du.get_kv_class(backend, du.KVClassType.MANAGER) is adapter.KvxferKVManager
    assert du.get_kv_class(backend, du.KVClassType.SENDER) is adapter.KvxferKVSender
    assert du.get_kv_class(backend, du.KVClassType.RECEIVER) is adapter.KvxferKVReceiver
    assert du.get_kv_class(backend, du.KVClassType.BOOTSTRAP_SERVER) is adapter.KvxferKVBootstrapServer
    assert du.get_kv_class(backend, du.KVClassType.KVARGS) is du.get_kv_class(du.TransferBackend.FAKE,
                                                                              du.KVClassType.KVARGS)
    assert issubclass(adapter.KvxferKVManager, BaseKVManager)
    assert issubclass(adapter.KvxferKVSender, BaseKVSender) and issubclass(adapter.KvxferKVReceiver, BaseKVReceiver)
    # Other backends are untouched.
    assert du.get_kv_class(du.TransferBackend.FAKE, du.KVClassType.MANAGER).__name__ == "FakeKVManager"
