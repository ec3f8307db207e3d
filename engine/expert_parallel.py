"""A mixture-of-experts layer under expert parallelism: tokens travel to their experts' ranks
and back by all-to-all, differentiably.

With ``ep > 1`` each rank of an EP group holds whole experts, ``[ep_rank * E/ep, ...)`` of the
layer (:class:`hybridflow_comm.expert_layout.ExpertLayout`); the group holds every expert once.
One layer on one rank::

    1. route every token of the TP group (replicated, so the load-balancing term and the
       route trace are those of the unsplit layer)
    2. keep the pairs of the tokens this TP rank handles: token t with t % tp == tp_rank
    3. sort them by expert, which sorts them by owner; all-to-all the rows to the owners
       (split sizes first exchanged as a [ep, E/ep] count table)
    4. the owner groups what it received by expert, runs each of its experts once and puts
       the rows back in arrival order
    5. all-to-all back, scale by the routing weights, sum per token; the TP all-reduce joins
       the TP ranks' shares of the tokens

An expert's gradient on its owner sums the contributions of the EP group's tokens; the
expert-DP group (the ranks holding the same experts) reduces it further, as the DP group does
for the dense weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.moe import ExpertRows, MoeRouting, RouteRecord, RouterLossTerms, expert_counts, \
    expert_rows, expert_weights, route
from engine.tp_ops import copy_to_tp, reduce_from_tp
from hybridflow_comm.groups import Group


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with given split sizes; backward sends the gradient the
    opposite way."""

    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, pg):
        ctx.counts, ctx.pg = (send_counts, recv_counts), pg
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=pg)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.counts
        out = grad.new_empty((sum(send_counts), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send_counts, recv_counts, group=ctx.pg)
        return out, None, None, None


def all_to_all_rows(x: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                    group: Group) -> torch.Tensor:
    """Rows ``x [sum(send_counts), ...]`` to the group's members (``send_counts[k]`` to member
    ``k``) -> ``[sum(recv_counts), ...]`` in member order (differentiable)."""
    if group.pg is None:
        return x
    return _AllToAll.apply(x, send_counts, recv_counts, group.pg)


def exchange_counts(counts: torch.Tensor, group: Group) -> torch.Tensor:
    """``counts [ep, per]`` (rows for member k's experts) -> the table of what every member
    sends to this one, ``[ep, per]`` by source."""
    if group.pg is None:
        return counts
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group.pg)
    return out


def moe_block_ep(x: torch.Tensor, w: Mapping[str, torch.Tensor], routing: MoeRouting,
                 num_experts: int, ep_group: Group, tp_group: Group | None,
                 router_loss: RouterLossTerms | None = None, trace: RouteRecord | None = None
                 ) -> torch.Tensor:
    """Dropless top-k mixture of SwiGLU experts under expert parallelism (module docstring):
    ``x [..., H]`` (replicated over TP) -> ``[..., H]``.

    Args:
        w: ``router`` and this rank's experts under their global names
            (``experts.{e}.gate_up`` / ``experts.{e}.down_proj``, whole).
        num_experts: experts of the layer (``ep_group.size`` divides it).
        ep_group: this rank's EP group (member ``k`` holds the ``k``-th block of experts).
        tp_group: this rank's TP group (None: no TP).
    """
    shape = x.shape
    tokens = x.reshape(-1, shape[-1])
    weights, experts = route(tokens, w["router"], routing, router_loss, trace)
    return dispatch_ep(tokens, weights, experts, w, num_experts, ep_group,
                       tp_group).reshape(shape)


def dispatch_ep(tokens: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                w: Mapping[str, torch.Tensor], num_experts: int, ep_group: Group,
                tp_group: Group | None, rows_fn: ExpertRows = expert_rows) -> torch.Tensor:
    """:func:`moe_block_ep` after its routing: the routed ``tokens [N, H]`` (``weights``,
    ``experts``: ``[N, k]``) to their experts' owners and back, weighted, summed per token and
    all-reduced over TP; ``rows_fn`` runs this rank's experts."""
    ep, per = ep_group.size, num_experts // ep_group.size
    first = ep_group.rank * per
    top_k = experts.shape[-1]
    tp_size, tp_rank = (tp_group.size, tp_group.rank) if tp_group is not None else (1, 0)
    mine = torch.arange(tp_rank, tokens.shape[0], tp_size, device=tokens.device)
    # 3. this rank's pairs by expert (so by owner), their rows to the owners.
    chosen = experts[mine].flatten()
    order = torch.argsort(chosen, stable=True)
    token_of = order // top_k  # [pairs], index into ``mine``
    send = expert_counts(chosen, num_experts).view(ep, per)
    recv = exchange_counts(send, ep_group)  # [source, my expert]
    table = torch.cat([send, recv]).tolist()  # the layer's one wait for the host
    send_counts, recv_counts = [sum(r) for r in table[:ep]], [sum(r) for r in table[ep:]]
    rows = copy_to_tp(tokens, tp_group)[mine][token_of]
    arrived = all_to_all_rows(rows, send_counts, recv_counts, ep_group)
    # 4. group by expert, each expert once, back to arrival order.
    expert_of = torch.arange(per, device=tokens.device).repeat(ep).repeat_interleave(
        recv.flatten(), output_size=sum(recv_counts))
    by_expert = torch.argsort(expert_of, stable=True)
    per_expert = torch.tensor([sum(col) for col in zip(*table[ep:])])  # on the host: no wait
    held = expert_weights(w, range(first, first + per))
    outs = rows_fn(arrived[by_expert], per_expert, held)
    done = torch.empty_like(by_expert)
    done[by_expert] = torch.arange(by_expert.numel(), device=tokens.device)
    # 5. back to this rank, weighted, summed per token, joined over TP.
    back = all_to_all_rows(outs[done], recv_counts, send_counts, ep_group)
    scale = copy_to_tp(weights, tp_group)[mine].flatten()[order]
    out = torch.zeros_like(tokens).index_add(0, mine[token_of], back * scale[:, None])
    return reduce_from_tp(out, tp_group)


@dataclass(frozen=True)
class ExpertParallel:
    """:func:`moe_block_ep` over one EP group, as the MoE block of a decoder layer
    (:class:`engine.moe.MoeFn`)."""

    group: Group
    num_experts: int

    def __call__(self, x: torch.Tensor, w: Mapping[str, torch.Tensor], routing: MoeRouting,
                 tp_group: Group | None, router_loss: RouterLossTerms | None = None,
                 trace: RouteRecord | None = None) -> torch.Tensor:
        return moe_block_ep(x, w, routing, self.num_experts, self.group, tp_group,
                            router_loss, trace)

    def dispatch(self, tokens: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                 w: Mapping[str, torch.Tensor], tp_group: Group | None,
                 rows_fn: ExpertRows = expert_rows) -> torch.Tensor:
        """:func:`dispatch_ep` over this EP group (the block after its routing)."""
        return dispatch_ep(tokens, weights, experts, w, self.num_experts, self.group,
                           tp_group, rows_fn)

