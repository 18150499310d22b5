"""Which known activation a callable is, read from its traced graph.

A callable activation runs through torch.autograd inside the experts' step (an extra autograd
engine call a step, about 0.3 ms of host time on a slow host), where a named one has one
backward kernel. Tutel's examples and many configs spell a plain activation as a lambda
(``lambda x: F.relu(x)``); :func:`known_form` recognises those by tracing the callable once
with ``torch.fx`` and reading the graph: exactly one input, one call of a known activation on
it with its default arguments (or GELU's ``approximate="tanh"``), and that call's result out.
Anything else (more operations, other arguments, control flow on the input, a module with
parameters, a trace that fails) is not recognised and keeps the autograd path: the answer is
never a function that computes something else.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

__all__ = ["known_form"]


_RELU = (F.relu, {"inplace": (False,)})
# a traced call's target -> (the known function, the keyword arguments allowed, with their allowed values)
_CALLS: dict = {
    F.relu: _RELU, torch.relu: _RELU,
    F.silu: (F.silu, {"inplace": (False,)}),
    F.gelu: (F.gelu, {"approximate": ("none",)}),
    torch.sigmoid: (torch.sigmoid, {}), F.sigmoid: (torch.sigmoid, {}),
    torch.tanh: (torch.tanh, {}), F.tanh: (torch.tanh, {}),
}
_METHODS = {"relu": F.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh}


def known_form(fn: Callable, gelu_tanh: Callable, identity: Callable) -> Optional[Callable]:
    """The known activation ``fn`` computes (``F.relu``, ``F.gelu``, ``gelu_tanh``, ``F.silu``,
    ``torch.sigmoid``, ``torch.tanh`` or ``identity``), or None where its traced graph is not
    exactly one of them applied to its one input."""
    try:
        import torch.fx

        graph = torch.fx.symbolic_trace(fn).graph
    except Exception:  # noqa: BLE001 - any callable fx cannot trace keeps its own path
        return None
    nodes = list(graph.nodes)
    if not nodes or nodes[0].op != "placeholder" or sum(n.op == "placeholder" for n in nodes) != 1:
        return None
    x = nodes[0]
    if len(nodes) == 2 and nodes[1].op == "output" and nodes[1].args == (x,):
        return identity
    if len(nodes) != 3 or nodes[2].op != "output" or nodes[2].args != (nodes[1],):
        return None
    call = nodes[1]
    if call.args != (x,):
        return None
    if call.op == "call_method":
        return _METHODS.get(call.target) if not call.kwargs else None
    if call.op != "call_function":
        return None
    if call.target is F.gelu and call.kwargs == {"approximate": "tanh"}:
        return gelu_tanh
    try:
        form = _CALLS.get(call.target)
    except TypeError:  # an unhashable target
        return None
    if form is None:
        return None
    known, allowed = form
    return known if all(k in allowed and v in allowed[k] for k, v in call.kwargs.items()) else None
