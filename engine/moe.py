"""Mixtures of experts: top-k routing and the dropless block of SwiGLU experts.

The block is pure maths over its arguments.  What a training forward keeps besides (the
router's load-balancing term, :class:`engine.router_loss.RouterLoss`) and the experts each
token went to (recorded or replayed, :class:`engine.route_trace.RouteTrace`) reach it as
small protocols (:class:`RouterLossTerms`, :class:`RouteRecord`); the block owns no training
state.  The block is its routing (:func:`route`: :func:`router_probs`, then :func:`choose`)
and its dispatch (:func:`dispatch`: the pairs sorted by expert, :func:`expert_rows` over
them, the weighted sum back per token), so compiled code can run each part
(:mod:`engine.compiled_train`).
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

    def replayed(self, device: torch.device) -> torch.Tensor | None:
        """This layer's ``[N, k]`` experts to impose (a negative entry: the router's own), on
        ``device``; None: the router's own."""

    def record(self, experts: torch.Tensor) -> None:
        """This layer's ``[N, k]`` experts, as routed."""


def router_probs(tokens: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    """The router's softmax ``[N, E]`` (float32) of ``tokens [N, H]``."""
    return torch.softmax(F.linear(tokens, router).float(), dim=-1)


def choose(probs: torch.Tensor, top_k: int, norm_topk: bool,
           given: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(weights [N, k] float32, own [N, k], chosen [N, k])`` from the router's ``probs``:
    ``own`` the router's top ``top_k`` experts, ``chosen`` those of ``given`` (router replay;
    a negative entry: the router's own) or ``own``, ``weights`` their probabilities
    (renormalised to sum to one where ``norm_topk``)."""
    weights, own = torch.topk(probs, top_k, dim=-1)
    chosen = own
    if given is not None:
        chosen = torch.where(given >= 0, given, own)
        weights = probs.gather(-1, chosen)
    if norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, own, chosen


def route(x: torch.Tensor, router: torch.Tensor, routing: MoeRouting,
          router_loss: RouterLossTerms | None = None, trace: RouteRecord | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [N, k] in x's dtype, experts [N, k] int64)`` of the tokens ``x [N, H]``
    (and the layer's term of ``router_loss``, of the router's own choice; the experts
    recorded in, or replayed from, ``trace``)."""
    probs = router_probs(x, router)
    given = trace.replayed(x.device) if trace is not None else None
    weights, own, chosen = choose(probs, routing.top_k, routing.norm_topk, given)
    if router_loss is not None:
        router_loss.add(probs, own)
    if trace is not None:
        trace.record(chosen)
    return weights.to(x.dtype), chosen


ExpertWeights = tuple[torch.Tensor, torch.Tensor]
"""One expert's ``(gate_up, down_proj)``."""


def expert_weights(w: Mapping[str, torch.Tensor], experts: Sequence[int]
                   ) -> list[ExpertWeights]:
    """The ``(gate_up, down_proj)`` of each of ``experts`` in ``w``, in that order."""
    return [(w[f"experts.{e}.gate_up"], w[f"experts.{e}.down_proj"]) for e in experts]


def swiglu_expert(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
                  ) -> torch.Tensor:
    """One expert's SwiGLU of ``rows [n, H]`` (of its TP shard: a partial sum, unreduced)."""
    h = swiglu(column_linear(rows, gate_up, None).unflatten(-1, (-1, 2)))
    if down.dim() == 3:  # a trained expert stored as its generation pieces
        return row_linear_pieces(h, down)
    return row_linear(h, down, None)


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[num_experts]`` int64: how many entries of ``experts`` (any shape) name each expert
    (a fixed size, so traced code knows it without reading the values)."""
    flat = experts.flatten()
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))


def expert_rows(rows: torch.Tensor, counts: torch.Tensor,
                experts: Sequence[ExpertWeights]) -> torch.Tensor:
    """``rows [n, H]`` grouped by expert (the first ``counts[0]`` rows for ``experts[0]``,
    and so on) -> each group's :func:`swiglu_expert`, ``[n, H]`` in the same order.
    ``counts`` is read on the host (a device tensor: the block's one wait for the host; a
    host tensor, as expert parallelism passes, none); under ``torch.compile`` (with
    ``capture_scalar_outputs``) they are unbacked sizes, so the function compiles whole."""
    sizes = counts.tolist()
    if torch.compiler.is_compiling():  # the unbacked sizes' bounds, for the tracer
        for size in sizes:
            torch._check(size >= 0)
            torch._check(size <= rows.shape[0])
    parts = rows.split(sizes)
    return torch.cat([swiglu_expert(r, *ew) for ew, r in zip(experts, parts)])


class ExpertRows(Protocol):
    """:func:`expert_rows` or a compiled form of it."""

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor,
                 experts: Sequence[ExpertWeights]) -> torch.Tensor: ...


def dispatch(tokens: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
             w: Mapping[str, torch.Tensor], tp_group: Group | None,
             experts: Sequence[int] | None = None, held_mask: torch.Tensor | None = None,
             rows_fn: ExpertRows = expert_rows) -> torch.Tensor:
    """The routed tokens ``tokens [N, H]`` (``weights``, ``chosen``: ``[N, k]``) through their
    experts, weighted and summed per token, all-reduced over ``tp_group`` (:func:`moe_block`
    after its routing; ``rows_fn`` runs the experts)."""
    num_experts, top_k = w["router"].shape[0], chosen.shape[-1]
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    held = range(num_experts) if experts is None else sorted(experts)
    counts = expert_counts(flat, num_experts)
    if experts is not None:  # this rank's experts' pairs only
        mine = held_mask if held_mask is not None else experts_mask(experts, num_experts,
                                                                    flat.device)
        order = order[mine[flat[order]]]
        counts = counts.cpu()[held]  # on the host, where expert_rows reads them
    token_of = order // top_k
    inputs = copy_to_tp(tokens, tp_group)[token_of]  # [pairs, H], expert after expert
    outs = rows_fn(inputs, counts, expert_weights(w, held))  # no tokens: 0 rows
    scale = copy_to_tp(weights, tp_group).flatten()[order]
    out = torch.zeros_like(tokens).index_add(0, token_of, outs * scale[:, None])
    return reduce_from_tp(out, tp_group)


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
    shape = x.shape
    tokens = x.reshape(-1, shape[-1])
    weights, chosen = route(tokens, w["router"], routing, router_loss, trace)
    return dispatch(tokens, weights, chosen, w, tp_group, experts, held_mask).reshape(shape)


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
