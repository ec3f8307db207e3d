"""A mixture-of-experts block at static shapes: no host sync, so a decode step that holds it
can be compiled whole and captured as a CUDA graph.

:func:`engine.moe.moe_block` runs each expert over the tokens routed to it, sized by a
count read on the host (:func:`engine.moe.expert_rows`): the fewest products, but a sync per
layer and shapes that change every step.  Here every held expert runs over every token of
the step, and the routing weights, scattered to a dense ``[N, E]`` gate that is zero where an
expert was not chosen, select what each token keeps::

    route      weights, chosen  [N, k]   (top k of the router, or replayed)   on the device
    gate       [N, E]           gate[n, chosen[n, j]] = weights[n, j], 0 elsewhere
    out        sum over held e of  gate[:, e] * expert_e(x)    [N, H]   (a TP partial sum)

Per step this reads each held expert's weights once, as the routed block does once every
expert has a token (at a decode batch of ``E / k`` rows or more); it multiplies ``E / k``
times the routed block's products, which at a decode step's few rows cost less than reading
the weights.  A prefill or training batch keeps the routed block.  The results equal
:func:`engine.moe.moe_block`'s up to float summation order (each token's experts are
summed in expert order; the unchosen ones add exact zeros); routes are recorded in, or
replayed from, a :class:`engine.route_trace.RouteTrace` alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from engine.moe import MoeRouting, RouteRecord, expert_weights, route, swiglu_expert
from engine.tp_ops import reduce_from_tp
from hybridflow_comm.groups import Group


def routing_gate(weights: torch.Tensor, chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[N, num_experts]``: each token's routing weight of every expert, 0 where not chosen
    (``weights``, ``chosen``: ``[N, k]``)."""
    gate = weights.new_zeros(weights.shape[0], num_experts)
    return gate.scatter_add_(1, chosen, weights)


def static_moe_block(x: torch.Tensor, w: Mapping[str, torch.Tensor], routing: MoeRouting,
                     tp_group: Group | None, router_loss: None = None,
                     trace: RouteRecord | None = None, experts: Sequence[int] | None = None
                     ) -> torch.Tensor:
    """:func:`engine.moe.moe_block`'s output for ``x [..., H]`` at static shapes (the module
    docstring; the same signature): every held expert (``experts``, default all) over every
    token, no host sync.  ``tp_group``: the experts' TP group, whose all-reduce completes the
    partial sums (None: this rank's partial sum is returned, for a caller that reduces it).
    Inference only: ValueError for a ``router_loss``."""
    if router_loss is not None:
        raise ValueError("static_moe_block is for inference steps: no router loss")
    shape, num_experts = x.shape, w["router"].shape[0]
    tokens = x.reshape(-1, shape[-1])
    weights, chosen = route(tokens, w["router"], routing, None, trace)
    gate = routing_gate(weights, chosen, num_experts)
    held = range(num_experts) if experts is None else sorted(experts)
    out = torch.zeros_like(tokens)
    for e, weights_e in zip(held, expert_weights(w, held)):
        out = out + gate[:, e:e + 1] * swiglu_expert(tokens, *weights_e)
    return reduce_from_tp(out, tp_group).reshape(shape)
