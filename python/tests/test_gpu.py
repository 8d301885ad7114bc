"""GPU memory from Python: torch CUDA pools registered as they are, moved by tcp (pinned staging),
local (CUDA copies) and cuda-ipc (device to device), every byte compared; refusals that name what
to do. The GPU tests skip cleanly without torch or without a CUDA device; the no-driver tests run
only where no CUDA driver can be loaded (and check the error names the library).

The two-process measurement is scripts/gpu_xfer.py (scripts/gpu-check.sh runs both on a GPU machine).
"""

from __future__ import annotations

import ctypes
import time

import pytest

import kvxfer

KVPoll = kvxfer.KVPoll


def _driver_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch")
    return torch


no_driver = pytest.mark.skipif(_driver_loads(), reason="a CUDA driver is present (the GPU tests cover it)")

H, D, L, S, POOL = 4, 16, 2, 4, 16
SENTINEL = -4370


def _topo(prefill_tp: int = 2):
    return kvxfer.Topology(kv_heads=H, head_dim=D, layers=L, page_size=S, dtype_bytes=2, prefill_tp=prefill_tp,
                           decode_tp=1)


# ------------------------------------------------------------------------------------- no driver


class _FakeCudaArray:
    """An object that says it is CUDA memory (what CuPy, Numba or PyTorch arrays say)."""

    def __init__(self, ptr: int, n: int):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (n,), "typestr": "<u2", "version": 3}


@no_driver
def test_cuda_memory_without_a_driver_is_refused_naming_the_library():
    t = _topo(prefill_tp=1)
    with kvxfer.BootstrapServer() as server:
        a = kvxfer.Agent(role="decode", topology=t, bootstrap=server.address, backend="tcp")
        n = POOL * S * H * D
        with pytest.raises(kvxfer.KvxferError, match="libcuda.so.1"):
            a.register_kv_buffers([_FakeCudaArray(1 << 30, n) for _ in range(2 * L)])
        # Declared CUDA memory: registration with the backend at start refuses it, naming the library
        # and the backends that could take CUDA memory.
        a.register_kv(ptrs=[1 << 30] * (2 * L), lens=[n * 2] * (2 * L), item_lens=t.item_lens("decode"), kind="cuda",
                      device=0)
        with pytest.raises(kvxfer.KvxferError, match="libcuda.so.1") as e:
            a.start()
        assert "backends compiled in that take CUDA memory of device 0" in str(e.value) and "tcp" in str(e.value)
        a.close()


def test_memory_kind_names():
    t = _topo(prefill_tp=1)
    with kvxfer.BootstrapServer() as server:
        a = kvxfer.Agent(role="decode", topology=t, bootstrap=server.address)
        with pytest.raises(ValueError, match="memory kind"):
            a.register_kv(ptrs=[4096] * 4, lens=[1 << 20] * 4, item_lens=t.item_lens("decode"), kind="hbm")
        a.close()


# ------------------------------------------------------------------------------------------ GPU


def _pattern(torch, layer, kind, heads, pages, device):
    p = torch.as_tensor(list(pages), device=device, dtype=torch.int64).view(-1, 1, 1, 1)
    t = torch.arange(S, device=device, dtype=torch.int64).view(1, S, 1, 1)
    h = torch.as_tensor(list(heads), device=device, dtype=torch.int64).view(1, 1, -1, 1)
    e = torch.arange(D, device=device, dtype=torch.int64).view(1, 1, 1, D)
    v = ((layer * 2 + kind) * 1000003 + h * 7919 + p * 104729 + t * 131 + e * 17) % 32749
    return v.to(torch.int16).reshape(-1, len(list(heads)), D)


def _cluster(torch, backend: str, mem: str, server):
    """Decode TP 1 and prefill TP 2 agents in this process with torch pools on `mem`."""
    dev = torch.device("cuda", 0) if mem == "cuda" else torch.device("cpu")
    t = _topo()
    agents, pools = {}, {}
    for role, tp in (("decode", 0), ("prefill", 0), ("prefill", 1)):
        heads = range(H) if role == "decode" else range(tp * H // 2, (tp + 1) * H // 2)
        pool = []
        for kind in (0, 1):
            for layer in range(L):
                if role == "decode":
                    pool.append(torch.full((POOL * S, H, D), SENTINEL, dtype=torch.int16, device=dev))
                else:
                    pool.append(_pattern(torch, layer, kind, heads, range(POOL), torch.device("cuda", 0)).to(dev))
        a = kvxfer.Agent(role=role, topology=t, tp_rank=tp, bootstrap=server.address, backend=backend, timeout_s=30.0)
        a.register_kv_buffers(pool)
        a.start()
        agents[(role, tp)], pools[(role, tp)] = a, pool
    for a in agents.values():
        a.wait_connected(timeout_s=30)
    return agents, pools


def _transfer_and_check(torch, agents, pools, room: int, src, dst):
    rx = agents[("decode", 0)].receiver(room)
    rx.send_metadata(dst)
    txs = []
    for tp in (0, 1):
        tx = agents[("prefill", tp)].sender(room)
        tx.init(len(src))
        limit = time.monotonic() + 30
        while tx.poll() == KVPoll.Bootstrapping and time.monotonic() < limit:
            time.sleep(0.001)
        tx.send(src)
        txs.append(tx)
    assert rx.wait(timeout_s=30) == KVPoll.Success, rx.failure_exception()
    for tx in txs:
        assert tx.wait(timeout_s=30) == KVPoll.Success, tx.failure_exception()
    torch.cuda.synchronize()
    cuda = torch.device("cuda", 0)
    di = torch.as_tensor(dst, device=cuda)
    others = torch.ones(POOL, dtype=torch.bool, device=cuda)
    others[di] = False
    for kind in (0, 1):
        for layer in range(L):
            got = pools[("decode", 0)][kind * L + layer].to(cuda).view(POOL, S, H, D)
            want = _pattern(torch, layer, kind, range(H), src, cuda).view(len(src), S, H, D)
            assert torch.equal(got[di], want), f"layer {layer} kind {kind}: request pages differ"
            assert bool((got[others] == SENTINEL).all()), f"layer {layer} kind {kind}: a byte outside the request changed"


@pytest.mark.parametrize("backend,mem", [("tcp", "cuda"), ("local", "cuda"), ("cuda-ipc", "cuda"), ("tcp", "host")])
def test_torch_pools_prefill_tp2_to_decode_tp1_every_byte(backend, mem):
    torch = _torch_cuda()
    if backend not in kvxfer.backends():
        pytest.skip(f"{backend} is not compiled into this wheel ({kvxfer.backends()})")
    with kvxfer.BootstrapServer() as server:
        agents, pools = _cluster(torch, backend, mem, server)
        try:
            _transfer_and_check(torch, agents, pools, 1, [3, 9, 4, 12, 0, 7], [15, 1, 2, 8, 10, 5])
            for p in pools[("decode", 0)]:
                p.fill_(SENTINEL)
            _transfer_and_check(torch, agents, pools, 2, list(range(5, 11)), list(range(0, 6)))
        finally:
            for a in agents.values():
                a.close(timeout_s=10)


def test_host_pool_on_cuda_ipc_is_refused_naming_the_backends_that_take_it():
    torch = _torch_cuda()
    if "cuda-ipc" not in kvxfer.backends():
        pytest.skip("cuda-ipc is not compiled into this wheel")
    t = _topo(prefill_tp=1)
    with kvxfer.BootstrapServer() as server:
        a = kvxfer.Agent(role="decode", topology=t, bootstrap=server.address, backend="cuda-ipc")
        a.register_kv_buffers([torch.zeros((POOL * S, H, D), dtype=torch.int16) for _ in range(2 * L)])
        with pytest.raises(kvxfer.KvxferError) as e:
            a.start()
        msg = str(e.value)
        assert "host memory" in msg and "backends compiled in that take host memory" in msg and "tcp" in msg, msg
        a.close()


def test_device_comes_from_the_pointer_and_kinds_are_checked():
    torch = _torch_cuda()
    t = _topo(prefill_tp=1)
    pool = [torch.zeros((POOL * S, H, D), dtype=torch.int16, device="cuda") for _ in range(2 * L)]
    with kvxfer.BootstrapServer() as server:
        a = kvxfer.Agent(role="decode", topology=t, bootstrap=server.address, backend="tcp")
        mixed = pool[:-1] + [torch.zeros((POOL * S, H, D), dtype=torch.int16)]
        with pytest.raises(ValueError, match="one memory kind"):
            a.register_kv_buffers(mixed)
        with pytest.raises(ValueError, match="not contiguous"):
            a.register_kv_buffers([p.transpose(0, 1) for p in pool])
        # Raw pointers with kind "auto": the driver says CUDA memory of device 0.
        a.register_kv(ptrs=[p.data_ptr() for p in pool], lens=[p.numel() * 2 for p in pool],
                      item_lens=t.item_lens("decode"), kind="auto")
        a.start()
        a.close()
