"""The load-balancing loss of a mixture of experts' training forward, and how a pipeline
stage's backward also trains it (:func:`add_loss_gradient`).

Each routed layer adds its term (:func:`engine.moe.route`); :meth:`engine.model.ParallelLlama.
stage_forward` attaches the weighted sum to the stage's hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RouterLoss:
    """The load-balancing loss of the mixture-of-experts layers of one training forward
    (Switch Transformer's, per layer)::

        loss_l = E * sum_e f_e * P_e     f_e: expert e's share of the (token, slot) pairs
                                              (sum_e f_e = k), P_e: its mean probability,
                                              both over the real tokens

    Each layer appends its ``loss_l``; :meth:`total` is their sum and :meth:`weighted` that
    sum times ``weight``, the term added to the micro-batch's loss (``coef / (layers *
    micro-batches)``: the mean over the model's layers, like the micro-batch loss a share of
    the step)."""

    weight: float
    token_mask: torch.Tensor | None = None
    """``[N]`` bool over the flattened tokens, True = real (None: every token)."""
    terms: list[torch.Tensor] = field(default_factory=list)

    def add(self, probs: torch.Tensor, experts: torch.Tensor) -> None:
        """One layer's term from its router's ``probs [N, E]`` (float32) and chosen
        ``experts [N, k]``."""
        n, num_experts = probs.shape
        real = (torch.ones(n, device=probs.device) if self.token_mask is None
                else self.token_mask.to(probs.device, torch.float32))
        pairs = torch.zeros(num_experts, device=probs.device).index_add(
            0, experts.flatten(), real.repeat_interleave(experts.shape[1]))
        tokens = real.sum().clamp(min=1.0)
        mean_prob = (probs * real[:, None]).sum(0) / tokens
        self.terms.append(num_experts * (pairs / tokens * mean_prob).sum())

    def total(self) -> torch.Tensor:
        return torch.stack(self.terms).sum()

    def weighted(self) -> torch.Tensor:
        return self.total() * self.weight


class _AddLossGradient(torch.autograd.Function):
    """``x`` unchanged forward; backward also sends gradient 1 into ``loss`` (a scalar in
    ``x``'s graph), so a pipeline stage's backward of ``x`` trains the loss too."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


def add_loss_gradient(x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``x``, through which backward also minimises ``loss`` (:class:`_AddLossGradient`)."""
    return _AddLossGradient.apply(x, loss)

