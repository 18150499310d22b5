"""moecomm.LowLatencyBuffer on real MPI ranks (run by tests/test_low_latency.py): dispatch and
combine against a dense reference written independently (hypothesis: token counts 0..max,
skewed routing, k 1..8, 1..32 experts per rank; native kernels and torch ops), the native
kernels bit for bit against the torch ops, a transport of used rows only against the padded
exchange, a padded batch with a device ``num_tokens``,
the combine independent of how blocks arrive, FP8 dispatch bit-identical to quantizing with
moecomm.quant and dispatching in BF16, no allocation after construction, views into the
preallocated buffers, argument errors, and the MoE layer's decode path against its normal path.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moecomm
import moecomm_ext
from moecomm import quant
from moecomm.low_latency import AllToAllTransport, LowLatencyBuffer
from tests.mpi_util import collective_assert, rank_main

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=8,
                    suppress_health_check=list(HealthCheck))
MODE = sys.argv[1] if len(sys.argv) > 1 else "mpi"  # or "peer": GPU ranks (sharing one GPU under MPS)
ONLY = sys.argv[2] if len(sys.argv) > 2 else None

COMM = moecomm.init(backend=MODE, timeout=60, set_default=False, **({"hierarchy": False} if MODE == "mpi" else {}))
W, R = COMM.size, COMM.rank
DEV = COMM.device
ROUTINGS = ["uniform", "one_expert", "one_rank", "holes", "duplicates"]


def routing(seed: int, rank: int, T: int, k: int, E: int, how: str) -> torch.Tensor:
    """``[T, k]`` expert ids that rank ``rank`` routes: distinct per token unless ``how`` says."""
    rng = np.random.default_rng([seed, rank, 11])
    idx = np.stack([rng.permutation(max(E, k))[:k] % E for _ in range(T)]) if T else np.zeros((0, k), np.int64)
    if how == "one_expert":  # every token to expert 0 (its other choices as drawn)
        idx[:, 0] = 0
        idx[:, 1:][idx[:, 1:] == 0] = -1
    elif how == "one_rank":  # everything to the last rank's experts
        L = E // W
        idx = (W - 1) * L + idx % L
    elif how == "holes":
        idx[rng.random(idx.shape) < 0.4] = -1
    elif how == "duplicates":  # all slots of a token name one expert
        idx[:] = idx[:, :1]
    return torch.from_numpy(idx.astype(np.int64))


def tokens(seed: int, rank: int, T: int, H: int, dtype: torch.dtype) -> torch.Tensor:
    rng = np.random.default_rng([seed, rank, 13])
    x = rng.standard_normal((T, H)).astype(np.float32) * (10.0 ** rng.uniform(-2, 2, (T, 1))).astype(np.float32)
    return torch.from_numpy(x).to(dtype)


def weights(seed: int, rank: int, T: int, k: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng([seed, rank, 17]).random((T, k)).astype(np.float32))


def expert_fn(e: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The test's experts: global expert ``e`` scales a row by ``1 + e / 8`` (in its dtype)."""
    return rows * (1.0 + e.to(rows.dtype) / 8)


def run_experts(d, L: int) -> torch.Tensor:
    e = (torch.arange(L, device=d.x.device) + R * L).view(L, 1, 1)
    return expert_fn(e, d.x).contiguous()


def dense_dispatch(seed, Ts, k, E, H, dtype, how):
    """Per local expert, the rows it must get: every rank's tokens naming it, rank then token order."""
    L = E // W
    per_expert = [[] for _ in range(L)]
    for p in range(W):
        x, idx = tokens(seed, p, Ts[p], H, dtype), routing(seed, p, Ts[p], k, E, how)
        for t in range(Ts[p]):
            for e in range(L):
                if R * L + e in idx[t].tolist():
                    per_expert[e].append(x[t])
    return per_expert


def dense_combine(seed, T, k, E, H, dtype, how) -> torch.Tensor:
    """This rank's tokens: ``sum_j w[t, j] * f_{idx[t, j]}(x[t])`` in float32, slot order."""
    x, idx, w = tokens(seed, R, T, H, dtype), routing(seed, R, T, k, E, how), weights(seed, R, T, k)
    out = torch.zeros(T, H, dtype=torch.float32)
    for t in range(T):
        for j in range(k):
            e = int(idx[t, j])
            if e >= 0:
                out[t] += w[t, j] * expert_fn(torch.tensor(e), x[t]).float()
    return out.to(dtype)


def tol(dtype):
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}


def close(a, b, dtype) -> bool:
    try:
        torch.testing.assert_close(a, b, **tol(dtype))
        return True
    except AssertionError:
        return False


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


@SETTINGS
@given(seed=st.integers(0, 2 ** 31), M=st.integers(1, 5), local=st.sampled_from([1, 2, 3, 8, 32]),
       k=st.integers(1, 8), H=st.sampled_from([16, 130]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       how=st.sampled_from(ROUTINGS), full=st.booleans(), native=st.sampled_from([None, False]))
def check_against_dense(seed, M, local, k, H, dtype, how, full, native) -> None:
    E = local * W
    rng = np.random.default_rng([seed, 5])
    Ts = [M if full else int(v) for v in rng.integers(0, M + 1, W)]
    buf = LowLatencyBuffer(COMM, M, H, E, k, dtype, use_native=native)
    x, idx = tokens(seed, R, Ts[R], H, dtype), routing(seed, R, Ts[R], k, E, how)
    d = buf.dispatch(x.to(DEV), idx.to(DEV))
    want = dense_dispatch(seed, Ts, k, E, H, dtype, how)
    problems = []
    if d.counts.tolist() != [len(r) for r in want]:
        problems.append(f"counts {d.counts.tolist()} != {[len(r) for r in want]}")
    else:
        for e, rows in enumerate(want):
            if rows and not same_bits(d.x[e, :len(rows)].cpu(), torch.stack(rows)):
                problems.append(f"expert {e}'s rows")
    y = buf.combine(run_experts(d, local), weights(seed, R, Ts[R], k).to(DEV), d.handle).cpu()
    if not close(y, dense_combine(seed, Ts[R], k, E, H, dtype, how), dtype):
        problems.append("combine")
    collective_assert(not problems, f"seed={seed} M={M} L={local} k={k} H={H} {dtype} {how} T={Ts} "
                      f"use_native={native}: " + "; ".join(problems))


@SETTINGS
@given(seed=st.integers(0, 2 ** 31), M=st.integers(1, 6), local=st.sampled_from([1, 2, 5, 16]),
       k=st.integers(1, 8), dtype=st.sampled_from([torch.float32, torch.bfloat16]), how=st.sampled_from(ROUTINGS),
       fp8=st.booleans(), padded=st.booleans())
def check_native_matches_torch_ops(seed, M, local, k, dtype, how, fp8, padded) -> None:
    """The native kernels (the default where built) against the buffer's own torch ops
    (use_native=False): the same counts and expert rows (FP8 bytes and scales), bit for bit,
    and the same combined rows (bit for bit on the CPU; on a GPU torch's ops fuse the multiply
    and add, the kernel does not: to float32 rounding); with a padded batch and a device
    num_tokens too."""
    if moecomm_ext.implementation(DEV.type) != "native":
        return
    E, H = local * W, 136
    rng = np.random.default_rng([seed, 6])
    T = M if padded else int(rng.integers(0, M + 1))
    x, idx, w = tokens(seed, R, T, H, dtype), routing(seed, R, T, k, E, how), weights(seed, R, T, k)
    x, idx, w = x.to(DEV), idx.to(DEV), w.to(DEV)
    n = torch.tensor(int(rng.integers(0, T + 1)), dtype=torch.int64, device=DEV) if padded else None
    problems = []
    results = []
    for native in (None, False):
        buf = LowLatencyBuffer(COMM, M, H, E, k, dtype, fp8_dispatch=fp8, use_native=native)
        if (buf._ll is None) == (native is None):
            problems.append(f"use_native={native}: native kernels {'not ' if native is None else ''}used")
        d = buf.dispatch(x, idx, num_tokens=n)
        rows = [d.x[e, :int(d.counts[e])].clone() for e in range(local)]
        scales = [d.scales[e, :int(d.counts[e])].clone() for e in range(local)] if fp8 else []
        ey = run_experts(d, local) if not fp8 else torch.zeros(local, buf.max_rows, H, dtype=dtype, device=DEV)
        results.append((d.counts.clone(), rows, scales, buf.combine(ey, w, d.handle).clone()))
    (c0, r0, s0, y0), (c1, r1, s1, y1) = results
    if not torch.equal(c0, c1):
        problems.append(f"counts {c0.tolist()} vs {c1.tolist()}")
    elif not all(same_bits(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(r0 + s0, r1 + s1)):
        problems.append("expert rows")
    if not (same_bits(y0, y1) if DEV.type == "cpu" else close(y0, y1, dtype)):
        problems.append("combine")
    collective_assert(not problems, f"seed={seed} M={M} L={local} k={k} {dtype} {how} fp8={fp8} T={T} n={n}: "
                      + "; ".join(problems))


def check_num_tokens() -> None:
    """A padded batch of M rows with a device num_tokens: as dispatching the first n rows alone;
    combined rows past n are zero; one buffer reused with n changing (0 and M included)."""
    M, H, k, L = 4, 32, 3, 2
    E = L * W
    buf = LowLatencyBuffer(COMM, M, H, E, k, torch.bfloat16)
    plain = LowLatencyBuffer(COMM, M, H, E, k, torch.bfloat16)
    n_t = torch.zeros((), dtype=torch.int64, device=DEV)
    problems = []
    for seed, n in enumerate([2, 0, M, 1, 3]):
        x = tokens(seed, R, M, H, torch.bfloat16).to(DEV)
        idx = routing(seed, R, M, k, E, "holes").to(DEV)
        w = weights(seed, R, M, k).to(DEV)
        n_t.fill_(n)
        d = buf.dispatch(x, idx, num_tokens=n_t)
        y = buf.combine(run_experts(d, L), w, d.handle).clone()
        dp = plain.dispatch(x[:n], idx[:n])
        yp = plain.combine(run_experts(dp, L), w[:n], dp.handle)
        if not torch.equal(d.counts, dp.counts):
            problems.append(f"n={n}: counts {d.counts.tolist()} vs {dp.counts.tolist()}")
        elif not same_bits(y[:n], yp) or bool(y[n:].any()):
            problems.append(f"n={n}: combine")
    collective_assert(not problems, "; ".join(problems))


class ShuffledTransport(AllToAllTransport):
    """Fills the output with garbage, then writes the blocks that arrived in a random order."""

    def __init__(self, comm, seed: int) -> None:
        super().__init__(comm)
        self.gen = torch.Generator().manual_seed(seed)

    def exchange(self, output, input) -> None:
        landed = torch.empty_like(output)
        super().exchange(landed, input)
        raw = output.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=self.gen))
        B = output.shape[0] // W
        for p in torch.randperm(W, generator=self.gen).tolist():
            output[p * B:(p + 1) * B].copy_(landed[p * B:(p + 1) * B])


class UsedRowsTransport(AllToAllTransport):
    """exchange_rows as the peer-memory transport does it (used rows only; the rest of each
    block left as it was: zeros at first, which name expert 0, then earlier calls' rows), over
    the communicator: the buffer's used-rows path on any ranks."""

    def __init__(self, comm, gathers_rows: bool = False) -> None:
        super().__init__(comm)
        self.outputs = None
        self.gathers_rows = gathers_rows
        self.gathered = 0

    def bind_rows(self, outputs) -> bool:
        self.outputs = list(outputs)
        return True

    def exchange_rows(self, index, input, counts, scale, row_bytes, recv_rows=None, gather=None) -> None:
        out = self.outputs[index]
        if gather is not None:  # (the peer kernel picks these rows on the way)
            assert self.gathers_rows and gather.numel() == out.shape[0], "gather: one index per output row"
            input = input.index_select(0, gather)
            self.gathered += 1
        landed = torch.empty_like(out)
        super().exchange(landed, input)
        got = torch.empty_like(counts)
        self.comm.all_to_all_single(got, counts.contiguous())
        raw = out.view(torch.uint8).view(W, -1)
        for q in range(W):
            n = int(got[q]) * scale * row_bytes
            raw[q, :n].copy_(landed.view(torch.uint8).view(W, -1)[q, :n])
        if recv_rows is not None:
            recv_rows.copy_(got * scale)


def check_used_rows() -> None:
    """The buffer over a transport that moves used rows only (stale garbage after them): the
    same counts, expert rows and combined rows, bit for bit, as over the padded exchange; FP8,
    a padded batch with num_tokens, skewed routing, over several calls; with the send rows
    gathered first and picked by the transport on the way (gather=)."""
    if moecomm_ext.implementation(DEV.type) != "native" or W == 1:
        return
    M, k, L = 5, 4, 3
    E = L * W
    problems = []
    for fp8, gathers, H in ((False, False, 40), (True, False, 40), (False, True, 64), (True, True, 64)):
        plain = LowLatencyBuffer(COMM, M, H, E, k, torch.bfloat16, fp8_dispatch=fp8, transport=AllToAllTransport(COMM))
        rows = LowLatencyBuffer(COMM, M, H, E, k, torch.bfloat16, fp8_dispatch=fp8,
                                transport=UsedRowsTransport(COMM, gathers))
        for seed, how in enumerate(["uniform", "one_rank", "holes", "one_expert", "duplicates"]):
            T = M - seed % 3
            x, idx = tokens(seed, R, M, H, torch.bfloat16).to(DEV), routing(seed, R, M, k, E, how).to(DEV)
            w = weights(seed, R, M, k).to(DEV)
            n = torch.tensor(T, device=DEV)
            got = []
            for buf in (plain, rows):
                d = buf.dispatch(x, idx, num_tokens=n)
                rows_e = [d.x[e, :int(d.counts[e])].clone() for e in range(L)]
                ey = torch.randn(L, buf.max_rows, H, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
                got.append((d.counts.clone(), rows_e, buf.combine(ey.to(DEV), w, d.handle).clone()))
            (c0, r0, y0), (c1, r1, y1) = got
            if not torch.equal(c0, c1):
                problems.append(f"fp8={fp8} gathers={gathers} {how}: counts {c0.tolist()} vs {c1.tolist()}")
            elif not all(same_bits(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(r0, r1)):
                problems.append(f"fp8={fp8} {how}: expert rows")
            if not same_bits(y0, y1):
                problems.append(f"fp8={fp8} {how}: combine")
        if rows._by_rows is not True:
            problems.append("the used-rows path was not taken")
        if gathers and rows.transport.gathered < 5:  # (the combine's rows at least: 128 bytes)
            problems.append(f"fp8={fp8}: the rows were picked on the way in {rows.transport.gathered} exchanges")
    collective_assert(not problems, "; ".join(problems))


def check_arrival_order() -> None:
    """The same bits whatever order the blocks arrive in, with garbage in every unused row."""
    M, H, k, L = 5, 24, 4, 3
    E = L * W
    problems = []
    for seed, dtype in enumerate([torch.float32, torch.bfloat16]):
        bufs = [LowLatencyBuffer(COMM, M, H, E, k, dtype)] + \
               [LowLatencyBuffer(COMM, M, H, E, k, dtype, transport=ShuffledTransport(COMM, s)) for s in range(3)]
        T = M - seed
        x, idx, w = tokens(seed, R, T, H, dtype), routing(seed, R, T, k, E, "holes"), weights(seed, R, T, k)
        x, idx, w = x.to(DEV), idx.to(DEV), w.to(DEV)
        ys = []
        for b in bufs:
            d = b.dispatch(x, idx)
            ys.append(b.combine(run_experts(d, L), w, d.handle))
        if not all(same_bits(ys[0], y) for y in ys[1:]):
            problems.append(f"{dtype}: results differ with the arrival order")
    collective_assert(not problems, "; ".join(problems))


def check_fp8_dispatch() -> None:
    """FP8 dispatch: the bits of quant.quantize_rows of each token, and, dequantized, the BF16
    dispatch of the tokens quantized and dequantized by moecomm.quant."""
    M, k, L = 4, 2, 2
    E = L * W
    problems = []
    for seed, (dtype, wire, H) in enumerate([(torch.bfloat16, torch.float8_e4m3fn, 300),
                                            (torch.float32, torch.float8_e5m2, 128),
                                            (torch.bfloat16, torch.float8_e4m3fn, 16)]):
        buf = LowLatencyBuffer(COMM, M, H, E, k, dtype, fp8_dispatch=wire)
        ref = LowLatencyBuffer(COMM, M, H, E, k, dtype)
        T = M - seed % 2
        x, idx = tokens(seed, R, T, H, dtype).to(DEV), routing(seed, R, T, k, E, "uniform").to(DEV)
        x[0, :128] = 0  # a zero block: scale 1
        q, s = quant.quantize_rows(x, wire)
        rt = quant.dequantize_rows(q, s, dtype)
        d = buf.dispatch(x, idx)
        dq = ref.dispatch(rt, idx)
        # what the same routing sends of the quantized rows: through a float32 view of the bits
        qbuf = LowLatencyBuffer(COMM, M, H, E, k, torch.float16)
        dqq = qbuf.dispatch(q.view(torch.uint8).to(torch.float16), idx)
        sbuf = LowLatencyBuffer(COMM, M, quant.num_blocks(H), E, k, torch.float32)
        dss = sbuf.dispatch(s, idx)
        if not torch.equal(d.counts, dq.counts):
            problems.append(f"{wire}: counts")
            continue
        for e in range(L):
            c = int(d.counts[e])
            got = quant.dequantize_rows(d.x[e, :c], d.scales[e, :c], dtype)
            if not same_bits(got, dq.x[e, :c]):
                problems.append(f"{wire} H={H}: expert {e} dequantized != BF16 dispatch of the round trip")
            if not same_bits(d.x[e, :c].view(torch.uint8), dqq.x[e, :c].to(torch.uint8)) or \
                    not same_bits(d.scales[e, :c], dss.x[e, :c]):
                problems.append(f"{wire} H={H}: expert {e} bits != quant.quantize_rows")
    collective_assert(not problems, "; ".join(problems))


def check_no_allocation() -> None:
    """After construction (and one warm-up call) dispatch and combine allocate nothing (the CPU
    allocator's events in torch's profiler; on a GPU the caching allocator's counter), and
    return views into the buffers."""
    from torch.profiler import ProfilerActivity, profile

    M, H, k, L = 4, 256, 4, 3
    E = L * W
    problems = []
    for fp8 in (False, True):
        buf = LowLatencyBuffer(COMM, M, H, E, k, torch.bfloat16, fp8_dispatch=fp8, check_routing=False)
        xs = [tokens(s, R, M - s, H, torch.bfloat16).to(DEV) for s in range(3)]
        idxs = [routing(s, R, M - s, k, E, "holes").to(DEV) for s in range(3)]
        ws = [weights(s, R, M - s, k).to(DEV) for s in range(3)]
        ey = torch.zeros(L, buf.max_rows, H, dtype=torch.bfloat16, device=DEV)
        d = buf.dispatch(xs[0], idxs[0])
        buf.combine(ey, ws[0], d.handle)
        if DEV.type == "cuda":
            before = torch.cuda.memory_stats(DEV)["allocation.all.allocated"]
            for s in range(1, 3):
                d = buf.dispatch(xs[s], idxs[s])
                y = buf.combine(ey, ws[s], d.handle)
            allocs = torch.cuda.memory_stats(DEV)["allocation.all.allocated"] - before
            if allocs:
                problems.append(f"fp8={fp8}: {allocs} allocations on the GPU")
        else:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                for s in range(1, 3):
                    d = buf.dispatch(xs[s], idxs[s])
                    y = buf.combine(ey, ws[s], d.handle)
            allocs = [e for e in prof.events() if e.cpu_memory_usage > 0]
            if allocs:
                problems.append(f"fp8={fp8}: {len(allocs)} allocations, e.g. "
                                + ", ".join(sorted({e.name for e in allocs})[:8]))
        mem = {t.untyped_storage().data_ptr() for t in vars(buf).values() if isinstance(t, torch.Tensor)}
        for name, t in (("x", d.x), ("scales", d.scales), ("counts", d.counts), ("combine", y)):
            if t is not None and t.untyped_storage().data_ptr() not in mem:
                problems.append(f"fp8={fp8}: {name} is not a view of the buffer's memory")
    collective_assert(not problems, "; ".join(problems))


def check_errors() -> None:
    M, H, k, E = 3, 8, 2, 2 * W
    buf = LowLatencyBuffer(COMM, M, H, E, k, torch.float32, check_routing=True)
    x, idx = torch.zeros(2, H, device=DEV), torch.zeros(2, k, dtype=torch.int64, device=DEV)
    cases = {
        "num_experts": lambda: LowLatencyBuffer(COMM, M, H, W + 1 if W > 1 else 0, k, torch.float32),
        "max_tokens_per_rank": lambda: LowLatencyBuffer(COMM, 0, H, E, k, torch.float32),
        "dtype": lambda: LowLatencyBuffer(COMM, M, H, E, k, torch.int32),
        "fp8_dispatch": lambda: LowLatencyBuffer(COMM, M, H, E, k, torch.float32, fp8_dispatch=torch.float16),
        "x must be [T": lambda: buf.dispatch(torch.zeros(M + 1, H, device=DEV),
                                             torch.zeros(M + 1, k, dtype=torch.int64, device=DEV)),
        "x must have": lambda: buf.dispatch(x.double(), idx),
        "topk_idx must be [T": lambda: buf.dispatch(x, idx[:, :1]),
        "topk_idx must hold": lambda: buf.dispatch(x, idx + E),
        "num_tokens": lambda: buf.dispatch(x, idx, num_tokens=2),
    }
    problems = []
    for what, fn in cases.items():
        try:
            fn()
            problems.append(f"{what}: no error")
        except (TypeError, ValueError) as exc:
            if what.split()[0] not in str(exc):
                problems.append(f"{what}: the error does not name it: {exc}")
    d1 = buf.dispatch(x, idx)
    d2 = buf.dispatch(x, idx)
    ey = torch.zeros(E // W, buf.max_rows, H, device=DEV)
    ones = torch.ones(3, k, device=DEV)
    for what, fn in {"handle": lambda: buf.combine(ey, ones[:2], d1.handle),
                     "expert_y": lambda: buf.combine(ey[:, :1], ones[:2], d2.handle),
                     "topk_weights": lambda: buf.combine(ey, ones, d2.handle)}.items():
        try:
            fn()
            problems.append(f"{what}: no error")
        except (TypeError, ValueError) as exc:
            if what not in str(exc):
                problems.append(f"{what}: the error does not name it: {exc}")
    buf.combine(ey, ones[:2], d2.handle)  # every rank completes the same exchanges
    collective_assert(not problems, "; ".join(problems))


def check_moe_layer_decode() -> None:
    """MoELayer(decode_tokens=N): a no_grad forward with at most N tokens takes the buffer's
    path and gives the normal (dropless) path's result; more tokens or autograd: the normal path."""
    from moecomm.moe import MoELayer

    problems = []
    for dtype, k, wire in ((torch.float32, 2, None), (torch.bfloat16, 3, None), (torch.float32, 2, torch.float8_e4m3fn)):
        kw = dict(model_dim=32, hidden_size=16, num_experts=4 * W, k=k, dropless=True, comm=COMM, seed=3,
                  dtype=dtype, wire_dtype=wire)
        normal = MoELayer(**kw)
        fast = MoELayer(**kw, decode_tokens=4)
        fast.load_state_dict(normal.state_dict())
        normal.eval(), fast.eval()
        for T in (0, 1, 4, 6):
            x = tokens(T, R, T, 32, dtype).to(DEV)
            with torch.no_grad():
                want = normal(x)
                got = fast(x)
            used = fast.last_decode
            if used != (T <= 4):
                problems.append(f"{dtype} T={T}: decode path used={used}")
            scale = float(want.float().abs().max()) if want.numel() else 0.0
            # the normal path rounds its products in the activation dtype: bf16 differs by its ulps
            atol = 1e-5 * (1 + scale) if dtype == torch.float32 else 2 ** -7 * scale
            if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=0, atol=atol):
                problems.append(f"{dtype} wire={wire} T={T}: {float((got.float() - want.float()).abs().max())}")
    collective_assert(not problems, "; ".join(problems))


if __name__ == "__main__":
    CHECKS = [check_against_dense, check_native_matches_torch_ops, check_used_rows, check_num_tokens, check_arrival_order, check_fp8_dispatch, check_no_allocation,
              check_errors, check_moe_layer_decode]
    if ONLY:
        CHECKS = [c for c in CHECKS if c.__name__ == ONLY]
    rank_main(CHECKS)
