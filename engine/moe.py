"""Mixtures of experts: top-k routing and the dropless block of SwiGLU experts.

The block is pure maths over its arguments.  What a training forward keeps besides (the
router's load-balancing term, :class:`engine.router_loss.RouterLoss`) and the experts each
token went to (recorded or replayed, :class:`engine.route_trace.RouteTrace`) reach it as
objects with one method each (:class:`RouterLossTerms`, :class:`RouteRecord`); the block owns
no training state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.mlp import swiglu
from engine.tp_ops import column_linear, copy_to_tp, reduce_from_tp, row_linear, \
    row_linear_pieces
from hybridflow_comm.groups import Group


@dataclass(frozen=True)
class MoeRouting:
    """How a mixture-of-experts layer routes: the top ``top_k`` experts of the router's
    softmax (computed in float32), their weights renormalised to sum to one where
    ``norm_topk``."""

    top_k: int
    norm_topk: bool



class RouterLossTerms(Protocol):
    """Where each routed layer adds its load-balancing term (:class:`engine.router_loss.
    RouterLoss`)."""

    def add(self, probs: torch.Tensor, experts: torch.Tensor) -> None:
        """The layer's term from its router's ``probs [N, E]`` (float32) and chosen
        ``experts [N, k]``."""


class RouteRecord(Protocol):
    """Where each routed layer records its experts, or takes them from for router replay
    (:class:`engine.route_trace.RouteTrace`)."""

    def experts(self, own: torch.Tensor) -> torch.Tensor:
        """This layer's ``[N, k]`` experts given the router's own ``own``."""


def route(x: torch.Tensor, router: torch.Tensor, routing: MoeRouting,
          router_loss: RouterLossTerms | None = None, trace: RouteRecord | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [N, k] in x's dtype, experts [N, k] int64)`` of the tokens ``x [N, H]``
    (and the layer's term of ``router_loss``, of the router's own choice; the experts
    recorded in, or replayed from, ``trace``)."""
    probs = torch.softmax(F.linear(x, router).float(), dim=-1)
    weights, experts = torch.topk(probs, routing.top_k, dim=-1)
    if router_loss is not None:
        router_loss.add(probs, experts)
    if trace is not None:
        chosen = trace.experts(experts)
        if chosen is not experts:
            weights, experts = probs.gather(-1, chosen), chosen
    if routing.norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(x.dtype), experts


def expert_ffn(rows: torch.Tensor, w: Mapping[str, torch.Tensor], e: int) -> torch.Tensor:
    """Expert ``e``'s SwiGLU of ``rows [n, H]`` (of its TP shard: a partial sum, unreduced)."""
    gu = column_linear(rows, w[f"experts.{e}.gate_up"], None)
    h, down = swiglu(gu.unflatten(-1, (-1, 2))), w[f"experts.{e}.down_proj"]
    if down.dim() == 3:  # a trained expert stored as its generation pieces
        return row_linear_pieces(h, down)
    return row_linear(h, down, None)


def moe_block(x: torch.Tensor, w: Mapping[str, torch.Tensor], routing: MoeRouting,
              tp_group: Group | None, router_loss: RouterLossTerms | None = None,
              trace: RouteRecord | None = None, experts: Sequence[int] | None = None,
              held_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Dropless top-k mixture of SwiGLU experts: ``x [..., H]`` (replicated) -> ``[..., H]``.

    The (token, expert) pairs are sorted by expert so each expert runs one matmul pair over
    its tokens (a loop over experts, none over tokens); the weighted outputs are summed back
    per token.  Under TP each expert is split like the dense MLP and its partial outputs
    are all-reduced once for the layer.  With ``experts`` (generation EP inside the TP group,
    :mod:`hybridflow_comm.expert_layout`) only the pairs of those experts, whose pieces ``w``
    holds, are computed here; the TP all-reduce adds the other members' experts.  The
    router is replicated and its inputs whole on every rank; the routing weights scale
    partial outputs, so their gradient is a partial sum: they enter through
    :func:`engine.tp_ops.copy_to_tp`, like the experts' inputs.  The layer's load-balancing
    term goes to ``router_loss`` where given (training), its experts to (or from) ``trace``
    (:class:`RouteRecord`).  ``held_mask``: ``experts`` as a bool ``[E]`` mask on ``x``'s
    device, made once by a caller that runs the block every step (default: made here).
    """
    shape, num_experts = x.shape, w["router"].shape[0]
    tokens = x.reshape(-1, shape[-1])
    weights, chosen = route(tokens, w["router"], routing, router_loss, trace)
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    held = range(num_experts) if experts is None else sorted(experts)  # the pairs' order
    if experts is not None:  # this rank's experts' pairs only
        mine = held_mask if held_mask is not None else experts_mask(experts, num_experts,
                                                                    flat.device)
        order = order[mine[flat[order]]]
    counts = torch.bincount(flat[order], minlength=num_experts).tolist()
    token_of = order // routing.top_k
    inputs = copy_to_tp(tokens, tp_group)[token_of]  # [pairs, H], expert after expert
    rows = dict(zip(range(num_experts), inputs.split(counts)))
    outs = [expert_ffn(rows[e], w, e) for e in held]  # an expert without tokens: 0 rows
    scale = copy_to_tp(weights, tp_group).flatten()[order]
    out = torch.zeros_like(tokens).index_add(0, token_of, torch.cat(outs) * scale[:, None])
    return reduce_from_tp(out, tp_group).reshape(shape)


def experts_mask(experts: Sequence[int], num_experts: int,
                 device: torch.device) -> torch.Tensor:
    """``[num_experts]`` bool on ``device``, True at ``experts``."""
    mask = torch.zeros(num_experts, dtype=torch.bool, device=device)
    mask[torch.as_tensor(list(experts), device=device)] = True
    return mask


class MoeFn(Protocol):
    """A mixture-of-experts block with :func:`moe_block`'s signature (e.g.
    :class:`engine.expert_parallel.ExpertParallel`'s, over the rank's EP group)."""

    def __call__(self, x: torch.Tensor, w: Mapping[str, torch.Tensor], routing: MoeRouting,
                 tp_group: Group | None, router_loss: RouterLossTerms | None = None,
                 trace: RouteRecord | None = None) -> torch.Tensor: ...
