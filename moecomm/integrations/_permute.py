"""Megatron-core's torch ``permute`` / ``unpermute`` with the row moves on moecomm's gather kernels.

Megatron's unfused path (``moe_utils.permute`` / ``unpermute``, taken when Transformer Engine
is absent or ``moe_permute_fusion`` is off) moves the rows with ``index_select`` (whose
backward is an ``index_add``, atomic on GPUs) and ``scatter_add_`` (atomic on GPUs). The
replacements here compute the same ``sorted_indices`` and permuted probabilities with
Megatron's own index arithmetic, then move the rows with :func:`moecomm_ext.dispatch` /
:func:`moecomm_ext.combine`: gathers forward and backward, no atomics. The token -> slot map
they need (``token_slots``, ``[tokens, experts]``, ``-1`` where a token does not go) is made
in ``permute`` and looked up in ``unpermute`` by the ``sorted_indices`` tensor it returned (a
weak mapping: it dies with the tensor); an ``unpermute`` of indices this module did not make,
and every fused call, goes to Megatron's own function.

**Bits.** In float32 and float64 the results are Megatron's bit for bit, forward and backward:
a token's rows are summed in the order of their positions, as ``index_add`` / ``scatter_add_``
do on CPU. In bfloat16 / float16 moecomm accumulates in float32 and rounds once, Megatron
rounds after every add: equal up to two rows per token (top-1 and top-2 routing), within one
rounding per extra row beyond that. (On GPUs Megatron's atomics have no fixed order.)
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
from torch import Tensor

import moecomm_ext

__all__ = ["make_permute", "make_unpermute"]

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_slots: dict[int, tuple["weakref.ref[Tensor]", Tensor]] = {}
"""id of a sorted_indices our permute returned -> (a weak reference to it, its [tokens, experts]
token -> slot map); an entry leaves when its tensor dies. (Not a WeakKeyDictionary: tensors
compare elementwise.)"""


def _remember(sorted_indices: Tensor, token_slots: Tensor) -> None:
    key = id(sorted_indices)
    _slots[key] = (weakref.ref(sorted_indices), token_slots)
    weakref.finalize(sorted_indices, _slots.pop, key, None)


def _recall(sorted_indices: Tensor) -> Optional[Tensor]:
    entry = _slots.get(id(sorted_indices))
    return entry[1] if entry is not None and entry[0]() is sorted_indices else None


def _token_slots(keys: Tensor, num_tokens: int, num_experts: int) -> Tensor:
    """``[T, E]`` map: the position of key ``e * T + t`` in ``keys``, or -1."""
    inv = torch.full((num_experts * num_tokens,), -1, dtype=torch.long, device=keys.device)
    inv[keys] = torch.arange(keys.numel(), device=keys.device)
    return inv.view(num_experts, num_tokens).t().contiguous()


def make_permute(original: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron's ``permute`` with the token rows gathered by moecomm (``original`` for fused calls)."""

    def permute(tokens: Tensor, routing_map: Tensor, probs: Optional[Tensor] = None,
                num_out_tokens: Optional[int] = None, fused: bool = False, drop_and_pad: bool = False,
                tokens_per_expert: Optional[Tensor] = None, align_size: int = 0) -> tuple:
        if fused or tokens.dim() != 2 or tokens.dtype not in _FLOAT:
            return original(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=fused,
                            drop_and_pad=drop_and_pad, tokens_per_expert=tokens_per_expert, align_size=align_size)
        num_tokens = tokens.shape[0]
        num_experts = routing_map.shape[1]
        permuted_probs = None
        if drop_and_pad and num_out_tokens is not None:  # Megatron's index arithmetic, unchanged
            capacity = num_out_tokens // num_experts
            assert not routing_map.requires_grad
            rmap = routing_map.to(dtype=torch.int8).T.contiguous()
            sorted_indices = rmap.argsort(dim=-1, descending=True, stable=True)[:, :capacity].contiguous()
            sorted_indices = sorted_indices.view(-1)
            indices_dim0 = torch.arange(num_experts, device=routing_map.device).unsqueeze(-1)
            keys = (indices_dim0 * num_tokens + sorted_indices.view(num_experts, capacity)).view(-1)
            if probs is not None:
                permuted_probs = probs.T.contiguous().view(-1).index_select(0, keys)
        else:
            assert num_out_tokens is not None, "num_out_tokens is required for the argsort-based permute"
            rmap = routing_map.bool().T.contiguous()
            keys = rmap.reshape(-1).argsort(descending=True, stable=True)[:num_out_tokens]
            sorted_indices = keys % num_tokens
            if probs is not None:
                permuted_probs = probs.T.contiguous().reshape(-1)[keys]
        token_slots = _token_slots(keys, num_tokens, num_experts)
        permuted_input = moecomm_ext.dispatch(tokens, sorted_indices, token_slots, check=False)
        _remember(sorted_indices, token_slots)
        return permuted_input, permuted_probs, sorted_indices, None, tokens_per_expert

    permute.__doc__ = original.__doc__
    return permute


def make_unpermute(original: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron's ``unpermute`` with the rows summed by moecomm (``original`` where it cannot be)."""

    def unpermute(permuted_tokens: Tensor, sorted_indices: Tensor, restore_shape: torch.Size,
                  probs: Optional[Tensor] = None, routing_map: Optional[Tensor] = None, fused: bool = False,
                  drop_and_pad: bool = False, pad_offsets: Optional[Tensor] = None) -> Tensor:
        token_slots = None if fused else _recall(sorted_indices)
        if (token_slots is None or permuted_tokens.dim() != 2 or len(restore_shape) != 2
                or restore_shape[0] != token_slots.shape[0] or permuted_tokens.dtype not in _FLOAT):
            return original(permuted_tokens, sorted_indices, restore_shape, probs=probs, routing_map=routing_map,
                            fused=fused, drop_and_pad=drop_and_pad, pad_offsets=pad_offsets)
        input_dtype = permuted_tokens.dtype
        if probs is not None:  # Megatron's own arithmetic
            assert routing_map is not None, "Mask must be provided to permute the probs."
            if drop_and_pad:
                num_experts = routing_map.size(1)
                capacity = sorted_indices.size(0) // num_experts
                probs_T_1D = probs.T.contiguous().view(-1)
                indices_dim0 = torch.arange(num_experts, device=routing_map.device).unsqueeze(-1)
                indices_1D = (indices_dim0 * probs.size(0) + sorted_indices.view(num_experts, capacity)).view(-1)
                permuted_probs = probs_T_1D.index_select(0, indices_1D)
            else:
                permuted_probs = probs.T.contiguous().masked_select(routing_map.T.contiguous())
            permuted_tokens = permuted_tokens * permuted_probs.unsqueeze(-1)
        out = moecomm_ext.combine(permuted_tokens, token_slots, None, sorted_indices, check=False)
        return out.to(dtype=input_dtype)

    unpermute.__doc__ = original.__doc__
    return unpermute
