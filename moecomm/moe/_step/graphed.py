"""``MoELayer(cuda_graph=True)``: the capacity step captured per input shape and replayed.

The first call of each shape and set of per-call options warms the step up eagerly on a side
stream (three forward + backward passes, as torch's ``make_graphed_callables`` does), then
captures two CUDA graphs, each in a memory pool of its own: the forward (from a static copy of
the input to the output, the aux loss and the losses it is made of) and the backward (from
static gradients of those outputs to the gradients of the input and of every parameter).
Later calls copy the input in, replay the forward, and return copies of the outputs through
one autograd node, whose backward copies the incoming gradients in and replays the backward.

A graph's saved activations are shared by all replays of that graph, so a call while an
earlier replay of the same graph still awaits its backward runs eagerly (a token held by
that autograd node tells: alive and not yet backpropagated), and the backward of a replay
whose activations a later replay overwrote (a retained graph) raises instead of computing
wrong gradients. Graphs of different shapes use different memory, so they interleave freely.
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import Tensor, nn

__all__ = ["StepGraphs", "StepAccess", "CallResults"]

_WARMUP = 3
_MAX_GRAPHS = 8
_CAPTURE_MODE = "thread_local"
"""The captures protect themselves only from this thread's unsafe CUDA calls: under torch's
default ("global") any thread's call (a data loader pinning memory, a library's watchdog
querying an event) invalidates a capture that happens to be under way on first use."""


class CallResults(NamedTuple):
    """What a call of the layer leaves besides its output: the loss tensors (the same tensor
    may be several of them), the router logits kept for a later z-loss, and the routing."""

    aux_loss: Optional[Tensor]
    balance_loss: Optional[Tensor]
    z_loss: Optional[Tensor]
    z_logits: Optional[Tensor]
    routing: Any


@dataclass(frozen=True)
class StepAccess:
    """The layer as the captured steps see it, handed over by the layer at every call.

    An explicit interface instead of the layer's private members: the eager step, the token
    agreement, and its per-call results to read and to set. Not kept beyond the call, so the
    graphs (and their memory pools) hold no reference to their layer.
    """

    layer: nn.Module
    """The layer: its parameters, ``training``, ``gates``, ``model_dim``, ``comm`` and the
    routing options that key a graph, and its public ``last_parallel_mode``."""
    run: Callable[..., Tensor]
    """The eager step: ``(x, gate, k, cf, degree, own, algorithm, dropless, ineq, mode, wire) -> y``."""
    agreed_tokens: Callable[[int, torch.device], int]
    """``(T, device) -> the largest token count of all ranks`` (a blocking agreement)."""
    results: Callable[[], CallResults]
    """The last call's :class:`CallResults`."""
    set_results: Callable[[CallResults], None]
    """Make these the last call's results."""

    def clear_losses(self) -> None:
        """Drop the loss tensors (the z logits and the routing stay)."""
        self.set_results(self.results()._replace(aux_loss=None, balance_loss=None, z_loss=None))


class _Token:
    """Held only by the autograd node of one replay: alive while that node may still run."""

    __slots__ = ("done", "__weakref__")

    def __init__(self) -> None:
        self.done = False


def _same_storage(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class _Step:
    """One captured forward + backward of the layer at one shape and set of options."""

    def __init__(self, access: StepAccess, x: Tensor, call: Callable[[Tensor], Tensor]) -> None:
        dev = x.device
        self.params = [p for p in access.layer.parameters() if p.requires_grad]
        self.x = x.detach().clone().requires_grad_(x.requires_grad)
        self.x_grad = x.requires_grad
        inputs = ([self.x] if x.requires_grad else []) + self.params

        def outputs(y: Tensor) -> list:
            """y, then the distinct loss tensors of the call (aux, balance, z), None where absent."""
            aux, bal, z = access.results()[:3]
            return [y, aux, None if bal is aux else bal, None if (z is aux or z is bal) else z]

        def backward(outs: list, grads: Optional[list]) -> Optional[tuple]:
            need = [o for o in outs if o is not None and o.requires_grad]
            if not need:
                return None
            g = grads if grads is not None else [torch.zeros_like(o) for o in need]
            return torch.autograd.grad(need, inputs, g, allow_unused=True)

        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(_WARMUP):
                backward(outputs(call(self.x)), None)
        torch.cuda.current_stream(dev).wait_stream(side)
        # let the warm-up's autograd graph go: it holds the parameters' AccumulateGrad nodes,
        # made on the side stream, which later backward passes would otherwise keep using
        access.clear_losses()

        # two pools: the backward graph's outputs (the gradients, which autograd may keep as
        # .grad) must not lie in memory that the forward graph's temporaries reuse
        self.fwd = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.fwd, pool=torch.cuda.graph_pool_handle(), capture_error_mode=_CAPTURE_MODE):
            outs = outputs(call(self.x))
        self.outs = [o for o in outs if o is not None]
        self.slots = []  # where aux, balance, z are in self.outs (-1: absent)
        idx = 1
        for o in outs[1:]:
            if o is None:
                self.slots.append(-1)
            else:
                self.slots.append(idx)
                idx += 1
        captured = access.results()
        self.balance_is_aux = captured.balance_loss is captured.aux_loss and captured.aux_loss is not None
        self.z_is_aux = captured.z_loss is not None and captured.z_loss is captured.aux_loss
        self.z_logits = captured.z_logits
        self.routing = captured.routing
        self.grad_idx = [i for i, o in enumerate(self.outs) if o.requires_grad]
        self.nograd_idx = [i for i, o in enumerate(self.outs) if not o.requires_grad]
        self.grad_bufs = [torch.zeros_like(self.outs[i]) for i in self.grad_idx]
        self.buf_zero = [True] * len(self.grad_bufs)
        self.bwd = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.bwd, pool=torch.cuda.graph_pool_handle(), capture_error_mode=_CAPTURE_MODE):
            grads = backward(self.outs, self.grad_bufs)
        self.outs = [o.detach() for o in self.outs]  # the captured autograd graph is not needed
        access.clear_losses()
        grads = list(grads) if grads is not None else [None] * len(inputs)
        self.gx = grads.pop(0) if self.x_grad else None
        self.gparams = grads
        self.generation = 0  # forward replays so far
        self.local: tuple = ()  # the cache key less the agreed token count
        self.last: Optional["weakref.ref[_Token]"] = None

    def busy(self) -> bool:
        """An earlier replay's backward may still run (its saved activations are in use)."""
        token = self.last() if self.last is not None else None
        return token is not None and not token.done

    def load_grads(self, grads: tuple) -> None:
        for j, i in enumerate(self.grad_idx):
            g = grads[i]
            buf = self.grad_bufs[j]
            if g is None:
                if not self.buf_zero[j]:
                    buf.zero_()
                    self.buf_zero[j] = True
            else:
                buf.copy_(g)
                self.buf_zero[j] = False

    def unalias(self, x: Optional[Tensor]) -> None:
        """A ``.grad`` that autograd took over from this graph's buffers (it does when the field
        was empty) would be overwritten by the replay: give it its own copy first."""
        for p, g in zip(self.params, self.gparams):
            if g is not None and p.grad is not None and _same_storage(p.grad, g):
                p.grad = p.grad.clone()
        if x is not None and self.gx is not None and x.grad is not None and _same_storage(x.grad, self.gx):
            x.grad = x.grad.clone()


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, step: _Step, token: _Token, x: Tensor, *params: Tensor):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        if step.x.data_ptr() != x.data_ptr():
            step.x.copy_(x)
        step.fwd.replay()
        step.generation += 1
        outs = tuple(o.detach().clone() for o in step.outs)
        ctx.step, ctx.token, ctx.generation = step, token, step.generation
        ctx.leaf = x if x.grad_fn is None and x.requires_grad else None
        nd = [outs[i] for i in step.nograd_idx]
        if nd:
            ctx.mark_non_differentiable(*nd)
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):  # type: ignore[override]
        step: _Step = ctx.step
        if ctx.generation != step.generation:
            raise RuntimeError(
                "MoELayer(cuda_graph=True): backward of a call whose saved activations a later call of the layer "
                "(same shape) has overwritten: a graph kept with retain_graph=True must be backpropagated before "
                "the layer's next call, or use cuda_graph=False")
        ctx.token.done = True
        step.load_grads(grads)
        step.unalias(ctx.leaf)
        ctx.leaf = None
        step.bwd.replay()
        gp = tuple(None if g is None else g.detach() for g in step.gparams)
        return (None, None, None if step.gx is None else step.gx.detach()) + gp


class StepGraphs:
    """The layer's captured steps (an explicit cache, at most ``_MAX_GRAPHS``, oldest dropped)."""

    def __init__(self) -> None:
        self._steps: "OrderedDict[tuple, _Step]" = OrderedDict()
        self.failed: dict = {}
        """Keys whose capture failed -> the reason (those calls run eagerly)."""

    def __len__(self) -> int:
        return len(self._steps)

    def clear(self) -> None:
        self._steps.clear()
        self.failed.clear()

    def run(self, access: StepAccess, x: Tensor, gate_index: int, k: int, cf: float, degree: Any, own: Any,
            algo: Optional[str], ineq: bool, mode: str, wire: Optional[torch.dtype] = None) -> Optional[Tensor]:
        """The replayed step's output, or None where this call must run eagerly (its graph's
        previous replay still awaits its backward, or its capture failed)."""
        layer = access.layer
        gate = layer.gates[gate_index]
        T = x.numel() // layer.model_dim
        params = [p for p in layer.parameters() if p.requires_grad]
        local = (tuple(x.shape), x.dtype, x.device, x.requires_grad, k, cf, degree, own, algo, wire, gate_index,
                 layer.training, tuple(p.data_ptr() for p in params), layer.is_postscore,
                 layer.normalize_gate, layer.batch_prioritized_routing)
        # decided before the agreement below, so that an eager fallback agrees only once
        if any(s.local == local and s.busy() for s in self._steps.values()):
            return None
        agreed = access.agreed_tokens(T, x.device) if ineq else T  # eager: the one host step left
        key = local + (agreed,)
        step = self._steps.get(key)
        if step is None:
            if key in self.failed:
                return None

            def call(xs: Tensor) -> Tensor:
                return access.run(xs, gate, k, cf, degree, own, algo, False, ineq, mode, wire)

            try:
                step = _Step(access, x, call)
            except RuntimeError as exc:
                # the capture failed (cudaErrorStreamCaptureInvalidated, say): what it made was never
                # computed, so nothing of it may be used; this key runs eagerly from now on
                access.set_results(CallResults(None, None, None, None, None))
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                if len(self.failed) >= 64:
                    self.failed.pop(next(iter(self.failed)))
                self.failed[key] = reason
                warnings.warn(f"MoELayer(cuda_graph=True): capturing the step for input shape {tuple(x.shape)} "
                              f"failed ({reason}); calls of that shape and options run eagerly",
                              RuntimeWarning, stacklevel=4)
                return None
            step.local = local
            while len(self._steps) >= _MAX_GRAPHS:
                self._steps.popitem(last=False)
            self._steps[key] = step
        else:
            self._steps.move_to_end(key)
        token = _Token()
        outs = _Replay.apply(step, token, x, *step.params)
        step.last = weakref.ref(token)
        if layer.comm.size > 1 and hasattr(layer.comm, "watch_stream"):
            layer.comm.watch_stream("MoELayer cuda_graph replay")
        y = outs[0]
        aux_i, bal_i, z_i = step.slots
        access.set_results(CallResults(
            aux_loss=outs[aux_i] if aux_i >= 0 else None,
            balance_loss=outs[aux_i] if step.balance_is_aux else (outs[bal_i] if bal_i >= 0 else None),
            z_loss=outs[aux_i] if step.z_is_aux else (outs[z_i] if z_i >= 0 else None),
            z_logits=step.z_logits, routing=step.routing))
        layer.last_parallel_mode = "expert"
        return y
