"""The MoE layer's expert-parallel path: dispatch the routed rows to the ranks that hold their
experts, run the experts, and combine what comes back (a part of
:class:`~moecomm.moe.MoELayer`, which inherits it)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

import moecomm_ext

from .._ops import comm as _comm
from . import wire_dispatch as _wire_dispatch
from .._ops.step_cache import StepConstants
from ..experts import Segments, WeightGradSum
from ..routing import Routing, dropless_slots, pipelined_capacity_slots

__all__ = ["ExpertParallelPath"]


class ExpertParallelPath:
    """The expert-parallel step of :class:`~moecomm.moe.MoELayer` (a mixin: it uses the
    layer's ``comm``, expert layout, ``experts``, ``is_postscore`` and ``grad_wire_dtype``).
    ``_run_experts`` is looked up on the layer at every call, so one layer's can be wrapped."""

    comm: Any
    num_experts: int
    num_local_experts: int
    shards: int
    is_postscore: bool
    grad_wire_dtype: Optional[torch.dtype]
    experts: Any
    _use_native: bool
    _consts: StepConstants

    def _slot_weights(self, r: Routing, S: int):
        g = r.gates
        return g if S == 1 else g.repeat_interleave(S, dim=1)

    def _dispatch_scale(self, r: Routing, sm, S: int) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """The dispatch's per-slot scale (prescore gates: each slot's gate weight) and the
        combine weights (postscore gates)."""
        w = self._slot_weights(r, S)
        if self.is_postscore:
            return None, w
        flat = w.reshape(-1)
        safe = sm.slot_route.clamp(min=0)
        scale = torch.where(sm.slot_route >= 0, flat.index_select(0, safe) if flat.numel() else
                            flat.new_zeros(safe.shape), flat.new_zeros(()))
        return scale, None

    def _dispatch(self, x_c: Tensor, r: Routing, sm, S: int) -> tuple[Tensor, Optional[Tensor]]:
        """Send buffer and the combine weights."""
        scale, weights = self._dispatch_scale(r, sm, S)
        return self._gather(x_c, sm, scale), weights

    def _send_rows(self, x_c: Tensor, sm, scale: Optional[Tensor], wire: Optional[torch.dtype], fuse: bool,
                   W: int) -> tuple[Tensor, Optional[Tensor]]:
        """(send buffer, its rows packed for a pipelined FP8 dispatch or None). The default path
        with ``wire`` (``fuse``) gathers packed rows only; the pipelined paths get them packed by
        the same fused gather, beside a stand-in for the rows that autograd sees
        (:func:`._wire_dispatch.stand_in`): either way the rows are never written in the
        activation dtype."""
        if wire is not None and W > 1 and not fuse:  # the pipelined paths (fuse is the default path's)
            packed = self._gather(x_c, sm, scale, wire)
            return _wire_dispatch.stand_in(x_c, sm.slot_token, sm.token_slots, scale, self._use_native), packed
        return self._gather(x_c, sm, scale, wire if fuse else None), None

    def _gather(self, x_c: Tensor, sm, scale: Optional[Tensor], wire: Optional[torch.dtype] = None) -> Tensor:
        """The send buffer: the slots' rows, or with ``wire`` those rows packed in that FP8
        dtype by the same pass (the fused dispatch, :mod:`._wire_dispatch`)."""
        if wire is not None:
            return _wire_dispatch.pack(x_c, sm.slot_token, scale, wire, self._use_native)
        return moecomm_ext.dispatch(x_c, sm.slot_token, sm.token_slots, scale, check=False,
                                    use_native=self._use_native)

    def _combine(self, back: Tensor, sm, weights: Optional[Tensor]) -> Tensor:
        return moecomm_ext.combine(back, sm.token_slots, weights, sm.slot_token, check=False,
                                   use_native=self._use_native, slot_route=sm.slot_route)

    def _run_experts(self, rows: Tensor, seg: Segments) -> Tensor:
        return self.experts(rows, seg)

    def _expert_parallel(self, x_c: Tensor, r: Routing, degree, own_first: bool, algo: Optional[str],
                         cdtype, wire: Optional[torch.dtype] = None) -> Tensor:
        comm, consts = self.comm, self._consts
        W, El, S, E = comm.size, self.num_local_experts, self.shards, self.num_experts
        El_dest = El if S == 1 else 1  # experts per destination rank, as the rows arrive
        own_first = own_first and W > 1
        # the default path with wire_dtype: the gather writes packed FP8 rows (one rank: nothing
        # travels, so nothing is quantized)
        fuse = wire is not None and W > 1 and not own_first
        if r.capacity is not None:
            C = r.capacity
            if degree == "auto":  # equal pair blocks: every pair gets the same number of pieces
                from moecomm.overlap import auto_pieces

                row_bytes = x_c.shape[1] * x_c.element_size()
                degree = max(auto_pieces(comm, [El_dest * C], row_bytes) + [1])
            # each destination block = `degree` equal chunks along the capacity, expert by expert
            Cc = -(-C // degree) if C else 0
            piece = El_dest * Cc  # rows of one chunk of one source: [El_dest][Cc]
            sm = pipelined_capacity_slots(r, C, E, S, degree, El, consts)
            fuse = fuse and degree == 1
            scale, weights = self._dispatch_scale(r, sm, S)
            send, packed = self._send_rows(x_c, sm, scale, wire, fuse, W)
            send_splits = recv_splits = [degree * El_dest * Cc] * W
            blocks = [[degree * Cc] * El_dest for _ in range(W)]
            seg = Segments.uniform_blocks(W, El_dest, degree * Cc, consts=consts)
        else:
            sm = dropless_slots(r, S, 1, consts)
            piece = 0  # no fixed layout: each chunk is regrouped from its counts
            fuse = fuse and degree == 1
            scale, weights = self._dispatch_scale(r, sm, S)
            send, packed = self._send_rows(x_c, sm, scale, wire, fuse, W)
            n = r.counts  # [E] routes per expert (all kept)
            send_cnt = n if S == 1 else n.repeat_interleave(S)  # rank e*S+s gets expert e's rows
            recv_cnt = _comm.exchange_counts(send_cnt, comm, El_dest)
            host = torch.cat([send_cnt, recv_cnt]).tolist()  # the one host sync of a dropless step
            mine, got = host[:W * El_dest], host[W * El_dest:]
            _comm.check_received_counts(got, comm, El_dest)
            send_splits = [sum(mine[w * El_dest:(w + 1) * El_dest]) for w in range(W)]
            blocks = [got[w * El_dest:(w + 1) * El_dest] for w in range(W)]
            recv_splits = [sum(b) for b in blocks]
            seg = Segments(blocks, El_dest, counts_dev=recv_cnt.view(W, El_dest))

        if fuse:
            got_rows = _wire_dispatch.exchange(send, x_c, sm.slot_token, sm.token_slots, scale, comm, send_splits,
                                               recv_splits, algo or "flat", wire, self.grad_wire_dtype,
                                               self._use_native)
            y = self._run_experts(got_rows, seg)
            back = _comm.exchange(y, comm, recv_splits, send_splits, algo)
        elif degree == 1 and not own_first:
            got_rows = _comm.exchange(send, comm, send_splits, recv_splits, algo, wire,
                                      None if wire is None else self.grad_wire_dtype)
            y = self._run_experts(got_rows, seg)
            back = _comm.exchange(y, comm, recv_splits, send_splits, algo)
        else:
            wgrad_sum = WeightGradSum()  # the stages' weight gradients summed inside the GEMMs

            def fn(rows: Tensor, chunk) -> Tensor:
                if piece and all(n % piece == 0 for n in chunk.source_splits):
                    # the capacity layout: every source's rows here are whole [El_dest][Cc] pieces
                    nb = sum(chunk.source_splits) // piece
                    return self._run_experts(rows, Segments.uniform_blocks(nb, El_dest, Cc, wgrad_sum, consts))
                return self._run_experts(rows, Segments(chunk.group_splits(blocks), El_dest, wgrad_sum=wgrad_sum))

            if wire is not None and W > 1 and self.grad_wire_dtype not in (None, cdtype):
                raise ValueError(f"wire_dtype with overlap_degree={degree} or own_first sends the dispatch gradient "
                                 f"in the activation dtype {cdtype}: pass grad_wire_dtype=None (or {cdtype}), got "
                                 f"{self.grad_wire_dtype}")
            back = _comm.scatter_compute_gather(comm, send, send_splits, recv_splits, fn, degree, algo, own_first,
                                                wire if W > 1 else None, packed)  # one rank: nothing travels
        return self._combine(back, sm, weights)
