"""The MoE layer's fused FP8 dispatch (the gather writes packed FP8 rows,
``moecomm/moe/_step/wire_dispatch.py``) against a reference built from public pieces (the same
layer without ``wire_dtype`` whose experts first apply the FP8 rule to the rows they receive,
straight-through, with the backward's gradient rounded as ``grad_wire_dtype`` sends it: the
rule is row-wise, so it commutes with the exchange), bit for bit, and the fused step's (the
default, ``moecomm/moe/_step/fused_step.py``) against both; the fused dispatch-exchange against
the unfused pieces (``moecomm_ext.dispatch``, then ``functional.all_to_all_v(wire_dtype=)``);
on real ranks (run by
tests/test_moe_wire_fused.py; from 3 ranks on also on sub-communicators of W - 1 ranks and of 1): the layer's output, aux loss, input gradient and every parameter
gradient over capacity/dropless, k = 1..3, float32/bfloat16 in, both FP8 dtypes, prescore and
postscore gates; the fused dispatch-exchange itself (also on one rank, where the layer does not
exchange); and ``Communicator.all_to_all_v_packed`` against ``all_to_all_v(wire_dtype=)``.

Argument: ``mpi`` (default) or ``nccl`` (GPUs, one rank per GPU).
"""

from __future__ import annotations

import itertools
import sys

import torch

import moecomm
import moecomm.functional as F
import moecomm_ext
from moecomm import quant, wire
from moecomm.moe import MoELayer
from moecomm.moe._step import wire_dispatch as _wire_dispatch
from tests.mpi_util import collective_assert, rank_main
from tests.ranks.data import count_matrix

MODE = sys.argv[1] if len(sys.argv) > 1 else "mpi"
EXTRA = {"p2p_bytes": 0} if MODE == "nccl" else {}
COMM = moecomm.init(backend=MODE, timeout=60, set_default=False, hierarchy=False, **EXTRA)
W, R, DEV = COMM.size, COMM.rank, COMM.device
# from 3 ranks on, the layer and dispatch checks also run on a sub-communicator of all ranks
# but the last and on one of the last rank alone (1, 2 and 3 ranks in one launch of 3)
SUB = COMM.split(0 if R < W - 1 else 1) if W >= 3 else None
COMMS = [COMM] if SUB is None else [SUB, COMM]
WIRES = [torch.float8_e4m3fn, torch.float8_e5m2]


def same_bits(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a, b = a.detach().cpu(), b.detach().cpu()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


def near(a, b, dtype) -> bool:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    return bool((a - b).abs().max() <= tol * max(1.0, float(b.abs().max())))


class _Counter:
    """Counts the calls of the fused exchange (so that a check cannot pass on the unfused path)."""

    def __init__(self) -> None:
        self.calls, self.inner = 0, _wire_dispatch.exchange

    def __call__(self, *args, **kw):
        self.calls += 1
        return self.inner(*args, **kw)


class _WireRule(torch.autograd.Function):
    """Rows as a ``wire_dtype`` exchange delivers them (quantized and dequantized); the
    gradient as ``grad_wire_dtype`` sends it back (FP8 block-scaled, cast there and back, or
    as it is): the rules of ``all_to_all_v`` and its backward, applied on the receiving side."""

    @staticmethod
    def forward(ctx, x, wd, gw):  # type: ignore[override]
        ctx.gw = gw
        return quant.dequantize_rows(*quant.quantize_rows(x, wd), x.dtype)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        gw = ctx.gw
        if gw in WIRES:
            g = quant.dequantize_rows(*quant.quantize_rows(g.contiguous(), gw), g.dtype)
        elif gw is not None:
            g = g.to(gw).to(g.dtype)
        return g, None, None


class _WireRuleFirst(torch.nn.Module):
    """A layer's experts, fed the rows as the FP8 dispatch would deliver them."""

    def __init__(self, inner, wd, gw) -> None:
        super().__init__()
        self.inner, self.wd, self.gw = inner, wd, gw

    def forward(self, x, seg):
        return self.inner(_WireRule.apply(x, self.wd, self.gw), seg)


def check_layer_fused_vs_unfused() -> None:
    problems = []
    for comm in COMMS:
        problems += _layer_fused_vs_unfused(comm)
    collective_assert(not problems, "fused vs unfused layer: " + "; ".join(problems[:6]))


def _layer_fused_vs_unfused(comm) -> list:
    W, R = comm.size, comm.rank
    D, H, E = 136, 24, max(4, 2 * W)  # a row of one full and one short scale block
    counter = _Counter()
    _wire_dispatch.exchange = counter
    problems = []
    try:
        cases = itertools.product([False, True], [1, 2, 3], [torch.float32, torch.bfloat16], WIRES, [False, True])
        for i, (dropless, k, dtype, wd, post) in enumerate(cases):
            gw = [torch.bfloat16, None, torch.float8_e5m2, torch.float32][i % 4]
            kw = dict(k=k, comm=comm, seed=3, wire_dtype=wd, grad_wire_dtype=gw, is_postscore=post, dtype=dtype,
                      device=DEV, dropless=dropless, capacity_factor=1.5, overlap_degree=1, own_first=False)
            step = MoELayer(D, H, E, **kw)  # the default: the fused step (its own packed dispatch)
            fused = MoELayer(D, H, E, fused_step=False, **kw)  # op by op, the fused FP8 dispatch
            fused.load_state_dict(step.state_dict())
            # the reference: no wire_dtype; its experts apply the wire's rules (one rank: none)
            plain = MoELayer(D, H, E, fused_step=False, **dict(kw, wire_dtype=None, grad_wire_dtype=None))
            plain.load_state_dict(step.state_dict())
            if W > 1:
                plain.experts = _WireRuleFirst(plain.experts, wd, gw)
            gen = torch.Generator().manual_seed(100 * i + R)
            x = (torch.randn(29 + 3 * R, D, generator=gen) * 3).to(dtype).to(DEV)
            g = torch.randn(29 + 3 * R, D, generator=gen).to(dtype).to(DEV)
            res = []
            before = counter.calls
            for lay in (step, fused, plain):
                xx = x.clone().requires_grad_()
                y = lay(xx)
                (y * g).sum().add(lay.aux_loss * 0.5).backward()
                res.append([y, lay.aux_loss, xx.grad] + [p.grad for _, p in lay.named_parameters()])
            want = 1 if post else 2  # the fused step has a packed dispatch of its own (postscore only)
            if W > 1 and counter.calls != before + want:
                problems.append(f"case {i}: the op-by-op fused exchange ran {counter.calls - before} times, not {want}")
            names = ["output", "aux loss", "input grad"] + [n for n, _ in fused.named_parameters()]
            tag = f"{W} ranks, case {i} (dropless={dropless}, k={k}, {dtype}->{wd}, post={post}, gw={gw})"
            bad = [n for n, a, b in zip(names, res[1], res[2]) if not same_bits(a, b)]
            if bad:
                problems.append(f"{tag}, fused dispatch vs the public-pieces reference: {bad}")
            if post:  # the fused step covers postscore gates only; prescore ones run op by op
                # the input's and the gate's gradients pass the router's float32 softmax backward,
                # whose sum over experts runs in another order in the fused step: to rounding
                rounding = {"input grad"} | {n for n in names if n.startswith("gates.")}
                if DEV.type == "cuda" and k >= 3:  # torch's CUDA sum of 3+ gates runs in another order
                    rounding = set(names)
                bad = [n for n, a, b in zip(names, res[0], res[1])
                       if not (same_bits(a, b) or (n in rounding and near(a, b, dtype)))]
                if bad:
                    problems.append(f"{tag}, fused step vs op by op: {bad}")
    finally:
        _wire_dispatch.exchange = counter.inner
    return problems


def check_layer_pipelined() -> None:
    """The pipelined paths (overlap_degree > 1, own_first) with wire_dtype: the fused gather packs
    the rows and a stand-in carries their gradient (``scatter_compute_gather(..., packed=)``);
    against the same reference from public pieces with the same degree, bit for bit."""
    problems = []
    for comm in COMMS:
        if comm.size > 1:
            problems += _layer_pipelined(comm)
    collective_assert(not problems, "pipelined FP8 dispatch: " + "; ".join(problems[:6]))


def _layer_pipelined(comm) -> list:
    W, R = comm.size, comm.rank
    D, H, E = 136, 24, max(4, 2 * W)
    problems = []
    cases = itertools.product([False, True], [(2, False), (3, True), (1, True)], [torch.float32, torch.bfloat16],
                              [False, True])
    for i, (dropless, (degree, own), dtype, post) in enumerate(cases):
        wd = WIRES[i % 2]
        kw = dict(k=2, comm=comm, seed=5, is_postscore=post, dtype=dtype, device=DEV, dropless=dropless,
                  capacity_factor=1.5, overlap_degree=degree, own_first=own, fused_step=False)
        lay = MoELayer(D, H, E, wire_dtype=wd, grad_wire_dtype=None, **kw)
        ref = MoELayer(D, H, E, **kw)
        ref.load_state_dict(lay.state_dict())
        ref.experts = _WireRuleFirst(ref.experts, wd, None)
        gen = torch.Generator().manual_seed(300 + 10 * i + R)
        x = (torch.randn(23 + 2 * R, D, generator=gen) * 3).to(dtype).to(DEV)
        g = torch.randn(23 + 2 * R, D, generator=gen).to(dtype).to(DEV)
        res = []
        for layer in (lay, ref):
            xx = x.clone().requires_grad_()
            y = layer(xx)
            (y * g).sum().add(layer.aux_loss * 0.5).backward()
            res.append([y, layer.aux_loss, xx.grad] + [p.grad for _, p in layer.named_parameters()])
        names = ["output", "aux loss", "input grad"] + [n for n, _ in lay.named_parameters()]
        bad = [n for n, a, b in zip(names, *res) if not same_bits(a, b)]
        if bad:
            problems.append(f"{W} ranks, case {i} (dropless={dropless}, degree={degree}, own_first={own}, "
                            f"{dtype}->{wd}, post={post}): {bad}")
    return problems


def check_dispatch_exchange() -> None:
    """The fused gather + packed exchange (autograd in x and the slot scale) against
    moecomm_ext.dispatch then functional.all_to_all_v(wire_dtype=), on every rank count
    (one rank included: the exchange still quantizes)."""
    problems = []
    for comm in COMMS:
        problems += _dispatch_exchange(comm)
    collective_assert(not problems, "fused dispatch exchange: " + "; ".join(problems))


def _dispatch_exchange(comm) -> list:
    W, R = comm.size, comm.rank
    problems = []
    for i, (dtype, wd, gw, scaled) in enumerate([(torch.float32, WIRES[0], torch.bfloat16, True),
                                                  (torch.bfloat16, WIRES[1], None, False),
                                                  (torch.float16, WIRES[0], WIRES[1], True),
                                                  (torch.bfloat16, WIRES[0], torch.float16, True)]):
        T, K, D = 30 + R, 2, 200
        gen = torch.Generator().manual_seed(7 * i + R)
        m = count_matrix(40 + i, W, 6, 0.3)
        send, recv = [int(v) for v in m[R]], [int(v) for v in m[:, R]]
        M = sum(send)
        # a random slot map: M slots, each holding one (token, j) or empty
        routes = torch.randperm(T * K, generator=gen)[:M]
        slot_token = torch.full((M,), -1, dtype=torch.long)
        token_slots = torch.full((T, K), -1, dtype=torch.long)
        for s, rt in enumerate(routes.tolist()):
            if s % 5 != 4:
                slot_token[s] = rt // K
                token_slots[rt // K, rt % K] = s
        slot_token, token_slots = slot_token.to(DEV), token_slots.to(DEV)
        x0 = (torch.randn(T, D, generator=gen) * 5).to(dtype).to(DEV)
        s0 = torch.rand(M, generator=gen).to(DEV) if scaled else None
        gout = torch.randn(sum(recv), D, generator=gen).to(dtype).to(DEV)
        res = []
        for fused in (True, False):
            x = x0.clone().requires_grad_()
            s = None if s0 is None else s0.clone().requires_grad_()
            if fused:
                packed = _wire_dispatch.pack(x, slot_token, s, wd, None)
                out = _wire_dispatch.exchange(packed, x, slot_token, token_slots, s, comm, send, recv, "flat", wd, gw,
                                              None)
            else:
                rows = moecomm_ext.dispatch(x, slot_token, token_slots, s, check=False)
                out, _ = F.all_to_all_v(rows, send, recv, comm=comm, wire_dtype=wd, grad_wire_dtype=gw)
            out.backward(gout)
            res.append((out, x.grad, None if s is None else s.grad))
        bad = [n for n, a, b in zip(("output", "x grad", "scale grad"), *res) if not same_bits(a, b)]
        if bad:
            problems.append(f"{W} ranks, case {i} ({dtype}->{wd}, gw={gw}): {bad}")
    return problems


def check_packed_api() -> None:
    """Communicator.all_to_all_v_packed: the bits of all_to_all_v(wire_dtype=), async too,
    and named errors for bad arguments."""
    problems = []
    for i, (dtype, wd, row_shape) in enumerate([(torch.bfloat16, WIRES[0], (300,)), (torch.float32, WIRES[1], (2, 70)),
                                                (torch.float16, WIRES[0], (5,)), (torch.float32, WIRES[0], (0,))]):
        m = count_matrix(60 + i, W, 5, 0.3)
        send, recv = [int(v) for v in m[R]], [int(v) for v in m[:, R]]
        gen = torch.Generator().manual_seed(i + 10 * R)
        x = (torch.randn((sum(send),) + row_shape, generator=gen) * 10).to(dtype).to(DEV)
        want, _ = COMM.all_to_all_v(x, send, recv, wire_dtype=wd)
        packed = quant.pack_rows(x, wd, wire.WIRE_BLOCK)
        got, got_recv = COMM.all_to_all_v_packed(packed, send, row_shape=row_shape, dtype=dtype, wire_dtype=wd)
        work = COMM.all_to_all_v_packed(packed, send, recv, row_shape=row_shape, dtype=dtype, wire_dtype=wd,
                                        async_op=True)
        got2, _ = work.wait()
        if not (same_bits(got, want) and same_bits(got2, want) and got_recv == recv):
            problems.append(f"case {i}")
    p = quant.pack_rows(torch.randn(W, 130, device=DEV), WIRES[0])
    bad_calls = [(dict(packed=p.float()), TypeError, "packed"), (dict(packed=p[:, :-16].contiguous()), ValueError, "packed"),
                 (dict(row_shape=(100,)), ValueError, "packed"), (dict(row_shape=130), TypeError, "row_shape"),
                 (dict(dtype=torch.float64), TypeError, "dtype"), (dict(wire_dtype=torch.bfloat16), TypeError, "wire_dtype")]
    for kw, exc, word in bad_calls:
        args = dict(packed=p, row_shape=(130,), dtype=torch.float32, wire_dtype=WIRES[0])
        args.update(kw)
        try:
            COMM.all_to_all_v_packed(args.pop("packed"), [1] * W, [1] * W, **args)
            problems.append(f"{kw}: no error")
        except exc as e:
            if word not in str(e):
                problems.append(f"{kw}: {e}")
    collective_assert(not problems, "all_to_all_v_packed: " + "; ".join(problems))


def check_packed_validate() -> None:
    """validate=True: packed rows from non-finite values raise ValueError on every rank."""
    comm = moecomm.init(backend=MODE, timeout=60, set_default=False, hierarchy=False, validate=True, **EXTRA)
    x = torch.randn(2 * W, 40, device=DEV)
    if R == W - 1:
        x[1, 3] = float("inf")
    try:
        comm.all_to_all_v_packed(quant.pack_rows(x, WIRES[1]), [2] * W, row_shape=(40,), dtype=torch.float32,
                                 wire_dtype=WIRES[1])
        ok = False
    except ValueError as e:
        ok = "non-finite" in str(e)
    x[torch.isinf(x)] = 0.0
    out, _ = comm.all_to_all_v_packed(quant.pack_rows(x, WIRES[0]), [2] * W, row_shape=(40,), dtype=torch.float32,
                                      wire_dtype=WIRES[0])
    comm.close()
    collective_assert(ok and out.shape == x.shape, "all_to_all_v_packed validate=True")


if __name__ == "__main__":
    rank_main([check_packed_api, check_packed_validate, check_dispatch_exchange, check_layer_fused_vs_unfused,
               check_layer_pipelined])
