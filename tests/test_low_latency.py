"""moecomm.LowLatencyBuffer (issue 30): the rank checks of tests/ranks/low_latency_checks.py on
1-8 CPU ranks (the shared launches of tests/conftest.py), single-process unit tests, and the GPU
test of graph capture and replay with changing routing under torch's sync debug mode."""

from __future__ import annotations

import pytest
import torch

import moecomm
from moecomm.low_latency import LowLatencyBuffer


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 3, 8])
@pytest.mark.ranks_job("tests.ranks.low_latency_checks", timeout=240)
def test_low_latency_on_ranks(nprocs, ranks_job):
    assert f"checks passed on {nprocs} ranks" in ranks_job()


def test_memory_and_wire_bytes_one_process():
    comm = moecomm.init(backend="self", set_default=False)
    M, H, E, k = 8, 256, 4, 2
    buf = LowLatencyBuffer(comm, M, H, E, k, torch.bfloat16)
    mem = buf.memory()
    assert mem["total"] == sum(v for n, v in mem.items() if n != "total")
    assert buf.row_bytes == 512 + 16  # the token, then k int16 ids padded to 16 bytes
    assert buf.wire_bytes() == {"dispatch": M * buf.row_bytes, "combine": M * min(k, E) * H * 2}
    assert mem["expert_rows"] == (E * M + 1) * H * 2
    fp8 = LowLatencyBuffer(comm, M, H, E, k, torch.bfloat16, fp8_dispatch=True)
    assert fp8.row_bytes == 256 + 16 + 16 and fp8.fp8_dtype == torch.float8_e4m3fn


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_capture_and_replay_with_changing_routing():
    """One rank on a GPU: dispatch + experts + combine captured once, replayed with new tokens,
    routing and num_tokens, without host synchronisation (sync debug mode "error") and without
    allocating (the caching allocator's counters); each replay equals an eager run."""
    comm = moecomm.init(set_default=False)  # one process: its device is the GPU
    M, H, E, k = 16, 256, 8, 4
    dev = comm.device
    buf = LowLatencyBuffer(comm, M, H, E, k, torch.bfloat16, fp8_dispatch=True)
    ref = LowLatencyBuffer(comm, M, H, E, k, torch.bfloat16, fp8_dispatch=True)
    x = torch.zeros(M, H, dtype=torch.bfloat16, device=dev)
    idx = torch.zeros(M, k, dtype=torch.int64, device=dev)
    w = torch.zeros(M, k, device=dev)
    n = torch.zeros((), dtype=torch.int64, device=dev)
    scale = (1 + torch.arange(E // comm.size, device=dev) / 8).view(-1, 1, 1)

    def step():
        d = buf.dispatch(x, idx, num_tokens=n)
        ey = (d.x.float() * d.scales.repeat_interleave(128, dim=2)[..., :H] * scale).to(torch.bfloat16)
        return buf.combine(ey, w, d.handle)

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = step()
    gen = torch.Generator(device=dev).manual_seed(0)
    for trial, count in enumerate([M, 0, 3, M - 1]):
        x.copy_(torch.randn(M, H, device=dev, generator=gen))
        idx.copy_(torch.randint(0, E, (M, k), device=dev, generator=gen))
        if trial == 2:
            idx.fill_(1)  # every slot of every token to one expert
        w.copy_(torch.rand(M, k, device=dev, generator=gen))
        n.fill_(count)
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        torch.cuda.set_sync_debug_mode("error")
        try:
            g.replay()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
        d = ref.dispatch(x[:count], idx[:count])
        ey = (d.x.float() * d.scales.repeat_interleave(128, dim=2)[..., :H] * scale).to(torch.bfloat16)
        want = ref.combine(ey, w[:count], d.handle)
        assert torch.equal(y[:count], want) and not y[count:].any()


def test_bench_smoke_one_process(tmp_path):
    """bench.low_latency on one CPU process with small shapes: both phases, floors and JSON."""
    import json

    from bench import low_latency

    path = tmp_path / "ll.json"
    results = low_latency.main(["-t", "4", "-H", "128", "-k", "2", "-n", "3", "-w", "1", "--fp8",
                                "--copy-bytes", str(1 << 20), "--json", str(path)])
    assert [(r["mode"], r["phase"]) for r in results] == [("eager", "dispatch"), ("eager", "combine")]
    for r in results:
        assert r["median_us"] > 0 and r["p99_us"] >= r["median_us"] and r["floor_us"] > 0
    assert results[1]["floor_bytes"] == 2 * 4 * 2 * 128 * 2
    assert json.loads(path.read_text())["results"] == json.loads(json.dumps(results))


GPU_SHAPES = [(128, 7168, 256, 8, False), (128, 7168, 256, 8, True), (1500, 64, 6000, 4, False),
              (3, 100, 5, 7, False), (1, 16, 1, 1, True)]
CPU_SHAPES = [(2, 16, 40000, 3, False), (40, 24, 7, 8, True), (3, 100, 5, 7, False)]


@pytest.mark.parametrize("device,M,H,E,k,fp8", [pytest.param("cuda", *s, marks=pytest.mark.gpu) for s in GPU_SHAPES]
                         + [("cpu", *s) for s in CPU_SHAPES])
def test_native_kernels_match_torch_ops_one_process(device, M, H, E, k, fp8):
    """One rank: the kernels against the buffer's torch ops (use_native=False): counts, expert
    rows and FP8 scales bit for bit, the combine to float32 rounding; shapes that take several
    chunks of the GPU's one-block layouts (1500 tokens, 6000 local experts), int32 ids on the
    wire (40000 experts), 256 local experts, repeated experts in a token, a padded batch with
    num_tokens."""
    import moecomm_ext

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if moecomm_ext.implementation(device) != "native":
        pytest.skip(f"the {device} kernels are not built")
    comm = moecomm.init(backend="self" if device == "cpu" else None, set_default=False)
    dev = comm.device
    nat = LowLatencyBuffer(comm, M, H, E, k, torch.bfloat16, fp8_dispatch=fp8)
    ops = LowLatencyBuffer(comm, M, H, E, k, torch.bfloat16, fp8_dispatch=fp8, use_native=False)
    assert nat._ll is not None and ops._ll is None
    gen = torch.Generator(device=dev).manual_seed(M + E)
    for T, n in ((M, None), (M // 2, None), (0, None), (M, M // 3)):
        x = torch.randn(T, H, device=dev, generator=gen).to(torch.bfloat16)
        idx = torch.randint(-1, E, (T, k), device=dev, generator=gen)
        if T > 2:
            idx[1] = idx[1, :1]  # one expert in every slot
            idx[2, :] = E - 1
        nt = None if n is None else torch.tensor(n, device=dev)
        a, b = nat.dispatch(x, idx, num_tokens=nt), ops.dispatch(x, idx, num_tokens=nt)
        assert torch.equal(a.counts, b.counts)
        for e in range(E):
            c = int(a.counts[e])
            assert torch.equal(a.x[e, :c].view(torch.uint8), b.x[e, :c].view(torch.uint8)), e
            if fp8:
                assert torch.equal(a.scales[e, :c], b.scales[e, :c]), e
        ey = torch.randn(E, nat.max_rows, H, device=dev, generator=gen).to(torch.bfloat16)
        w = torch.rand(T, k, device=dev, generator=gen)
        torch.testing.assert_close(nat.combine(ey, w, a.handle), ops.combine(ey, w, b.handle), atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_on_the_gpu_times_every_mode(tmp_path):
    """bench.low_latency on one GPU process: eager, captured and queued (CUDA events around the
    captured phases replayed back to back), each phase's time positive and finite."""
    from bench import low_latency

    results = low_latency.main(["-t", "8", "-H", "256", "-E", "8", "-k", "2", "-n", "5", "-w", "2",
                                "--copy-bytes", str(1 << 20)])
    assert [(r["mode"], r["phase"]) for r in results] == [
        (m, p) for m in ("eager", "captured", "queued") for p in ("dispatch", "combine")]
    assert all(0 < r["median_us"] < 1e6 for r in results)
