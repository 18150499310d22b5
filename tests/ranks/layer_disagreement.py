"""Ranks that disagree (issue 34, items 2 and 3), run by tests/test_moe_layer.py.

``python -m tests.ranks.layer_disagreement``:

* settings: an MoE layer whose last rank was built or called with another ``k``, capacity
  factor, dropless mode, overlap degree, dtype, model size, algorithm, or (with
  ``inequivalent_tokens=False``) another token count raises ``CountMismatchError`` on every
  rank, naming the setting and both values; the same layer with agreeing ranks then
  equals the dense reference (tests/ranks/moe_reference.py); on one rank nothing is checked;
* collectives: one rank in an expert count exchange while the others are in a host
  agreement (what a dropless rank and a capacity rank did before the settings check): every
  rank raises a named ``TimeoutError`` within its timeout, and no memory is corrupted (the
  heap corruption of item 2 aborted the process at exit).
"""

from __future__ import annotations

import time

import torch

import moecomm
from moecomm.errors import CountMismatchError
from moecomm.moe import MoELayer
from tests.mpi_util import collective_assert, rank_main
from tests.ranks.moe_reference import random_params, reference

D, H = 8, 12


def _comm():
    if not hasattr(_comm, "c"):
        _comm.c = moecomm.init("mpi", set_default=False)
    return _comm.c


def check_settings_named() -> None:
    comm = _comm()
    W, R = comm.size, comm.rank
    odd = R == W - 1 and W > 1  # the rank that differs
    # (what differs, the layer's arguments, the call's arguments, tokens, the words every rank's error holds)
    cases = [
        ("k", dict(k=1 if odd else 2), {}, 6, ["k (", ": 1", ": 2"]),
        ("capacity_factor", dict(capacity_factor=2.0 if odd else 1.0), {}, 6, ["capacity_factor", "1.0", "2.0"]),
        ("dropless", dict(dropless=not odd, capacity_factor=100.0), {}, 6, ["dropless", "True", "False"]),
        ("overlap_degree", dict(overlap_degree=2 if odd else 1), {}, 6, ["overlap_degree"]),
        ("dtype", dict(dtype=torch.float64 if odd else torch.float32), {}, 6, ["dtype", "float64", "float32"]),
        ("model_dim", dict(model_dim=12 if odd else D), {}, 6, ["model_dim", ": 12", f": {D}"]),
        ("per call k", {}, dict(k=1 if odd else 2), 6, ["k ("]),
        ("per call dropless", {}, dict(dropless=odd), 6, ["dropless"]),
        ("algorithm", {}, dict(algorithm="2dh" if odd else "flat"), 6, ["algorithm", "'2dh'", "'flat'"]),
        ("tokens", dict(inequivalent_tokens=False), {}, 6 + odd, ["inequivalent_tokens=False", ": 6", ": 7"]),
    ]
    errs = []
    for name, kw, call_kw, T, words in cases:
        kw = dict(kw)
        md = kw.pop("model_dim", D)
        layer = MoELayer(md, H, 2 * W, k=kw.pop("k", 2), comm=comm, seed=3, **kw)
        x = torch.randn(T, md, dtype=layer.experts.fc1_weight.dtype)
        try:
            layer(x, **call_kw)
            raised = None
        except CountMismatchError as exc:
            raised = str(exc)
        if W == 1:
            if raised is not None:
                errs.append(f"{name}: one rank raised {raised}")
        elif raised is None:
            errs.append(f"{name}: no error")
        elif not all(w in raised for w in words):
            errs.append(f"{name}: the error does not name {words}: {raised}")
    # the communicator and a layer of agreeing ranks work afterwards: the dense reference
    E = 2 * W
    layer = MoELayer(D, H, E, k=2, capacity_factor=1.0, comm=comm, dtype=torch.float64, inequivalent_tokens=False)
    p = random_params(4, "linear", D, H, E)
    with torch.no_grad():
        layer.gates[0].wg.weight.copy_(p.gate["wg"])
        es = slice(layer.first_expert, layer.first_expert + layer.num_local_experts)
        ex = layer.experts
        for mine, full in ((ex.fc1_weight, p.w1), (ex.fc2_weight, p.w2), (ex.fc1_bias, p.b1), (ex.fc2_bias, p.b2)):
            mine.copy_(full[es])
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(6, D, generator=g, dtype=torch.float64) for _ in range(W)]
    want = reference(p, xs, k=2, capacity_factor=1.0)[R].y
    got = layer(xs[R]).detach()
    want = want.detach()
    if not torch.allclose(got, want, atol=1e-6, rtol=1e-6):  # the gate's softmax in float32
        errs.append(f"the agreeing layer differs from the dense reference by {float((got - want).abs().max()):.3g}")
    collective_assert(not errs, "; ".join(errs))


def check_collectives_that_differ() -> None:
    W = _comm().size
    if W == 1:
        return
    comm = moecomm.init("mpi", timeout=2.0, set_default=False)
    t0 = time.monotonic()
    try:
        if comm.rank == 0:
            comm.all_to_all_v(torch.arange(2 * W, dtype=torch.int64), [2] * W, [2] * W)
        else:
            comm.allreduce_ints([6], "max")
        outcome = "no error"
    except TimeoutError as exc:
        outcome = "" if "did not complete within" in str(exc) else f"unnamed timeout: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported
        outcome = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - t0
    big = [torch.randn(1000) for _ in range(200)]  # the heap in use after the exchange (was: abort)
    del big
    collective_assert(outcome == "" and took < 10, f"{outcome} after {took:.1f} s")


if __name__ == "__main__":
    rank_main([check_settings_named, check_collectives_that_differ])
