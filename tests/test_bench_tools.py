"""The trace summariser's interval arithmetic and report (bench/trace_summary.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.trace_summary import intersection_length, summarize, summarize_host, summarize_shared, union_length

intervals = st.lists(st.tuples(st.integers(0, 50), st.integers(0, 20)).map(lambda t: (t[0], t[0] + t[1])), max_size=12)


def _covered(ivs) -> set:
    return {x for a, b in ivs for x in range(a, b)}


@settings(max_examples=200, deadline=None)
@given(intervals, intervals)
def test_union_and_intersection_match_unit_cells(xs, ys):
    assert union_length(xs) == len(_covered(xs))
    assert intersection_length(xs, ys) == len(_covered(xs) & _covered(ys))


def test_summary_reports_streams_overlap_and_idle():
    def k(stream, ts, dur, name="k"):
        return {"ph": "X", "cat": "kernel", "ts": ts, "dur": dur, "name": name, "args": {"stream": stream}}

    trace = {"traceEvents": [k(7, 0, 100, "gemm"), k(7, 100, 100, "gemm"), k(13, 150, 100, "nccl"),
                             k(13, 400, 100, "nccl"), {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 999}]}
    text = summarize(trace)
    assert "span 0.500 ms, some stream busy 0.350 ms, idle 0.150 ms (30.0%)" in text
    lines = text.splitlines()
    assert any(line.split()[:4] == ["7", "2", "0.200", "25.0%"] for line in lines)
    assert any(line.split()[:4] == ["13", "2", "0.200", "25.0%"] for line in lines)
    assert summarize({"traceEvents": []}) == "no GPU events in the trace"


def test_shared_summary_puts_processes_on_one_time_line():
    def k(ts, dur, name="gemm"):
        return {"ph": "X", "cat": "kernel", "ts": ts, "dur": dur, "name": name, "args": {"stream": 7}}

    # process 0 (base 1000 us): work 1000-1100, waits 1100-1300, work 1300-1400;
    # process 1 (base 1050 us): work 1050-1250, wait 1250-1300, work 1300-1350.
    # Common span 1050-1350: work 1050-1100 (p0) + 1050-1250 (p1) + 1300-1350 -> 250 us; waits only: none
    # left (p0's wait 1100-1300 lies under p1's work until 1250, then 1250-1300 both wait) -> 50 us; idle 0.
    p0 = {"baseTimeNanoseconds": 1_000_000, "traceEvents": [k(0, 100), k(100, 200, "signal_wait_kernel"), k(300, 100)]}
    p1 = {"baseTimeNanoseconds": 1_050_000, "traceEvents": [k(0, 200), k(200, 50, "signal_wait_kernel"), k(250, 50)]}
    text = summarize_shared([p0, p1])
    assert "2 processes, common span 0.300 ms: some process's work running 0.250 ms (83.3%), only waits 0.050 ms, " \
           "idle 0.000 ms" in text
    rows = [line.split() for line in text.splitlines()[2:]]
    assert rows[0][:5] == ["0", "0.100", "0.200", "1", "50-250"]
    assert rows[1][:5] == ["1", "0.250", "0.050", "1", "200-250"]
    assert summarize_shared([p0, {"traceEvents": []}]) == "a trace without GPU events"


def test_host_summary_charges_each_call_its_self_time():
    def c(tid, ts, dur, name, cat="cpu_op"):
        return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": name, "pid": 1, "tid": tid}

    # thread 1: step (0-1000) holding mm (100-400, itself holding a launch 150-250) and a copy (500-600);
    # thread 2 (the autograd engine): backward (0-300); a GPU kernel is not a host call
    trace = {"traceEvents": [c(1, 0, 1000, "step", "python_function"), c(1, 100, 300, "aten::mm"),
                             c(1, 150, 100, "cudaLaunchKernel", "cuda_runtime"), c(1, 500, 100, "aten::copy_"),
                             c(2, 0, 300, "backward", "python_function"),
                             {"ph": "X", "cat": "kernel", "ts": 0, "dur": 5000, "name": "gemm", "tid": 9}]}
    text = summarize_host(trace)
    rows = {name: [ms, n] for ms, n, name in (line.split(None, 2) for line in text.splitlines() if "] " in line)}
    assert rows == {"[python_function] step": ["0.600", "1"], "[cpu_op] aten::mm": ["0.200", "1"],
                    "[cuda_runtime] cudaLaunchKernel": ["0.100", "1"], "[cpu_op] aten::copy_": ["0.100", "1"],
                    "[python_function] backward": ["0.300", "1"]}
    threads = [line.split() for line in text.splitlines() if line.startswith(" ") and "(1," in line]
    assert sorted((t[-2], t[-1]) for t in threads) == [("1", "0.300"), ("4", "1.000")]
    assert summarize_host({"traceEvents": []}) == "no host events in the trace"


def test_kernels_bench_wire_rows(tmp_path, capsys):
    """bench.kernels --wire-dtype: the FP8 passes, native and reference, with their byte counts."""
    import json

    from bench import kernels
    from moecomm.quant import packed_row_bytes

    path = tmp_path / "k.json"
    assert kernels.main(["--device", "cpu", "--tokens", "64", "--dim", "256", "--experts", "4", "--capacity", "16",
                         "--iters", "1", "--warmup", "0", "--wire-dtype", "float8_e5m2", "--json", str(path)]) == 0
    assert "wire float8_e5m2" in capsys.readouterr().out
    data = json.loads(path.read_text())
    rows = {(r["op"], r["impl"]): r for r in data["results"] if r["op"].startswith("wire:")}
    impl = data["meta"]["implementation"]
    assert set(rows) == {(op, i) for op in ("wire: pack_rows", "wire: unpack_rows", "wire: gather_pack_rows")
                         for i in (impl, "torch reference")}
    tokens_bytes = 64 * 256 * 2 + 64 * packed_row_bytes(256)  # bf16 rows in, packed rows out
    assert rows[("wire: pack_rows", impl)]["bytes"] == tokens_bytes == rows[("wire: unpack_rows", impl)]["bytes"]
    assert all(r["median_ms"] > 0 for r in rows.values())


def test_moe_layer_bench_swiglu_beside_the_torch_reference(tmp_path, capsys):
    """bench.moe_layer --activation swiglu --dropless --reference on the CPU, small shapes: the
    layer's rows and the plain-torch reference's, and their ratio."""
    import json

    from bench import moe_layer

    path = tmp_path / "m.json"
    moe_layer.main(["--device", "cpu", "--tokens", "48", "--model-dim", "16", "--hidden", "16", "--experts", "4",
                    "--top-k", "2", "--dropless", "--activation", "swiglu", "--reference", "-n", "1", "--steps", "1",
                    "-w", "1", "--json", str(path)])
    assert "moecomm / reference" in capsys.readouterr().out
    rows = json.loads(path.read_text())["results"]
    assert sorted(r["impl"] for r in rows) == ["gemm_floor", "moecomm", "torch_reference"]
    assert all(r["activation"] == "swiglu" and r["median_ms"] > 0 for r in rows)


def test_gemm_floor_step_runs_every_expert_gemm_forward_and_backward():
    """TorchMoE.gemm_floor_step: each step gives every expert weight (gated: W1, W3 and W2) a
    finite, non-zero gradient of its shape, the same at every step (reset, not accumulated)."""
    import torch

    from bench.torch_moe import TorchMoE

    torch.manual_seed(0)
    ref = TorchMoE(8, 12, 4, k=2, activation="swiglu")
    step = ref.gemm_floor_step(tokens=7)  # 14 routes over 4 experts: 4, 4, 3, 3
    step()
    grads = [ref.w1.grad, ref.w3.grad, ref.w2.grad]
    assert all(g is not None and g.shape == w.shape and torch.isfinite(g).all() and g.abs().sum() > 0
               for g, w in zip(grads, (ref.w1, ref.w3, ref.w2)))
    first = [g.clone() for g in grads]
    step()  # the gradients are reset, not accumulated, between steps
    assert all(torch.equal(a, g) for a, g in zip(first, (ref.w1.grad, ref.w3.grad, ref.w2.grad)))


def test_torch_reference_layer_equals_moe_layer():
    """bench.torch_moe.TorchMoE (argsort permutation, grouped GEMM or a loop) loaded with a
    one-rank SwiGLU MoELayer's weights computes the layer's dropless output and input gradient."""
    import torch

    import moecomm
    from bench.torch_moe import TorchMoE
    from moecomm.moe import MoELayer

    comm = moecomm.init(backend="mpi", set_default=False)
    layer = MoELayer(16, 24, 4, k=2, dropless=True, activation="swiglu", seed=2, comm=comm)
    ref = TorchMoE(16, 24, 4, k=2, activation="swiglu").load_from(layer)
    x = torch.randn(40, 16)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    y, want = layer(xs[0]), ref(xs[1])
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-4, atol=1e-5)


def test_exchange_stamps_wrap_the_exchange_and_report_who_came_last():
    import numpy as np
    import torch

    from bench.exchange_stamps import ExchangeStamps, summarize

    class Comm:
        device = torch.device("cpu")

        def __init__(self):
            self.calls = []

        def all_to_all_single(self, out, x):
            self.calls.append((out, x))

    clock = iter(range(100, 10_000, 100))
    comm = Comm()
    stamps = ExchangeStamps(comm, capacity=4, stamp=lambda buf, i: buf.__setitem__(i, next(clock)))
    with stamps:
        comm.all_to_all_single("o", "x")
        comm.all_to_all_single("o2", "x2")
    assert comm.calls == [("o", "x"), ("o2", "x2")] and "all_to_all_single" not in vars(comm)
    assert stamps.collect().tolist() == [[100, 200], [300, 400]]
    # two ranks, two exchanges a step, one step: rank 1 arrives 5 us after rank 0 at the first exchange,
    # rank 0 3 us before rank 1 at the second; the exchanges done 3 and 2 us after their last arrival
    r0 = np.array([[0, 8_000], [10_000, 15_000]])
    r1 = np.array([[5_000, 8_000], [13_000, 15_000]])
    text = summarize([r0, r1], per_step=2)
    rows = [line.split() for line in text.splitlines()[2:4]]
    assert rows[0][:4] == ["0", "5.0", "1", "3.0"] and rows[1][:6] == ["1", "3.0", "1", "2.0", "2", "5"]
    assert "15.0 us from the first arrival" in text and "after their last arrival 5.0 us" in text
    assert "arrivals apart 8.0 us" in text and "ranks last (count): [0, 2]" in text
    assert summarize([np.zeros((0, 2))], 1) == "no exchange was stamped"
