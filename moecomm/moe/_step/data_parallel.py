"""The MoE layer's data-parallel path (every rank runs every expert on its own tokens, with
the expert weights gathered) and the ``"auto"`` choice between it and the expert-parallel
path by timed trials (a part of :class:`~moecomm.moe.MoELayer`, which inherits it)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from .gather import gather_expert_params
from ..experts import FFNExperts, Segments
from ..routing import Routing, capacity_slots, dropless_slots

__all__ = ["DataParallelPath"]


class DataParallelPath:
    """The data-parallel step and the ``parallel_mode="auto"`` trials of
    :class:`~moecomm.moe.MoELayer` (a mixin: it uses the layer's ``comm``, ``experts``,
    ``shards``, ``auto_trials`` and the expert-parallel path's ``_dispatch``/``_combine``)."""

    comm: Any
    num_experts: int
    shards: int
    experts: Any
    auto_trials: int
    last_parallel_mode: Any
    _auto: dict

    def _data_parallel(self, x_c: Tensor, r: Routing, cdtype) -> Tensor:
        E = self.num_experts
        ex: FFNExperts = self.experts  # type: ignore[assignment]
        if r.capacity is None:
            sm = dropless_slots(r, 1, 1)
            counts = r.counts.view(1, E)
            seg = Segments.on_device(counts, [r.topk_idx.numel()], E)  # every route kept: no host sync
        else:
            sm = capacity_slots(r, r.capacity, E, 1, 1)
            seg = Segments.uniform_blocks(1, E, r.capacity)
        send, weights = self._dispatch(x_c, r, sm, 1)
        spec = ex.checkpoint_spec()
        names = ["fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]
        params = ex.params(cdtype)
        specs = [spec.get(nm, (0, None, False)) for nm in names]
        w1, b1, w2, b2 = gather_expert_params(self.comm, specs, self.shards, params)
        y = FFNExperts.run(send, seg, w1, b1, w2, b2, ex.act, 1.0)
        return self._combine(y, sm, weights)

    # -- auto mode ------------------------------------------------------------------------------

    def _auto_choice(self, key) -> str:
        st = self._auto.get(key)
        if st is None:
            st = self._auto[key] = {"times": {"expert": [], "data": []}, "choice": None}
        if st["choice"] is not None:
            return st["choice"]
        t = st["times"]
        return "trial:expert" if len(t["expert"]) <= len(t["data"]) else "trial:data"

    def _timed(self, trial: str, key, x_c, r, deg, own, algo, cdtype, wire=None) -> Tensor:
        mode = trial.split(":", 1)[1]
        sync = torch.cuda.synchronize if x_c.is_cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        y = self._expert_parallel(x_c, r, deg, own, algo, cdtype, wire) if mode == "expert" else \
            self._data_parallel(x_c, r, cdtype)
        sync()
        dt = time.perf_counter() - t0
        st = self._auto[key]
        st["times"][mode].append(dt)
        te, td = st["times"]["expert"], st["times"]["data"]
        if len(te) >= self.auto_trials and len(td) >= self.auto_trials:
            # the first trial of each is a warm-up; ranks agree on the slowest rank's medians
            med = [sorted(v[1:])[len(v[1:]) // 2] for v in (te, td)]
            agreed = torch.tensor(med, dtype=torch.float64, device=self.comm.device)
            if self.comm.size > 1:
                self.comm.allreduce(agreed, "max")
            me, md = agreed.tolist()
            st["choice"] = "expert" if me <= md else "data"
            st["measured_s"] = {"expert": me, "data": md}
        self.last_parallel_mode = mode
        return y

    def auto_decisions(self) -> dict:
        """What ``parallel_mode='auto'`` chose per call shape: ``{key: (choice, measured seconds)}``."""
        return {k: (v["choice"], v.get("measured_s")) for k, v in self._auto.items()}
