"""Safe-RLHF (Dai et al. 2023): a cost critic beside the reward critic and a Lagrange
multiplier that trades reward against the cost constraint ``J_C = E[cost] <= cost_limit``.

Per iteration::

    A_r, R_r = GAE(rewards, values)             A_c, R_c = GAE(costs, cost_values)
    A        = (A_r - lambda * A_c) / (1 + lambda)
    lambda  <- max(0, lambda + lr * (J_C - cost_limit))     (projected gradient ascent)

Costs are "bad" quantities (higher = less safe), so the cost advantage enters with a minus.
"""

from __future__ import annotations

import torch

from rlhf.algos.advantages import gae
from rlhf.algos.masked import check_same_shape


def combine_advantages(reward_adv: torch.Tensor, cost_adv: torch.Tensor,
                       lagrange: float) -> torch.Tensor:
    """``(A_r - lambda A_c) / (1 + lambda)`` elementwise; ``lambda >= 0``."""
    if lagrange < 0:
        raise ValueError(f"lagrange multiplier={lagrange} must be >= 0")
    return (reward_adv - lagrange * cost_adv) / (1.0 + lagrange)


def safe_rlhf_advantages(token_rewards: torch.Tensor, values: torch.Tensor,
                         token_costs: torch.Tensor, cost_values: torch.Tensor,
                         mask: torch.Tensor, lagrange: float, gamma: float,
                         lam: float, whiten: bool) -> dict[str, torch.Tensor]:
    """Reward and cost GAE, combined with the Lagrange multiplier.

    Args:
        token_rewards, values: ``[B, T]`` reward per token (with any KL penalty) and reward
            critic values.
        token_costs, cost_values: ``[B, T]`` cost per token and cost critic values.
        mask: ``[B, T]``; lagrange: current multiplier.
    Returns:
        ``{"advantages", "returns", "reward_advantages", "cost_advantages", "cost_returns"}``.
    """
    check_same_shape(mask, token_costs=token_costs, cost_values=cost_values)
    a_r, r_r = gae(token_rewards, values, mask, gamma, lam, whiten)
    a_c, r_c = gae(token_costs, cost_values, mask, gamma, lam, whiten)
    return {"advantages": combine_advantages(a_r, a_c, lagrange), "returns": r_r,
            "reward_advantages": a_r, "cost_advantages": a_c, "cost_returns": r_c}


class LagrangeMultiplier:
    """Lagrange multiplier of the cost constraint, updated by projected gradient ascent.

    ``update(J_C)``: ``lambda <- clip(lambda + lr * (J_C - cost_limit), 0, max_value)``, where
    ``J_C`` is the mean episode cost of the iteration.  Constraint violated -> lambda grows.
    """

    def __init__(self, init: float, lr: float, cost_limit: float,
                 max_value: float | None = None) -> None:
        if init < 0 or not lr > 0:
            raise ValueError(f"lagrange init={init} must be >= 0 and lr={lr} > 0")
        if max_value is not None and max_value < init:
            raise ValueError(f"lagrange max_value={max_value} must be >= init={init}")
        self.value = float(init)
        self.lr = float(lr)
        self.cost_limit = float(cost_limit)
        self.max_value = max_value

    def update(self, mean_cost: float) -> float:
        v = max(0.0, self.value + self.lr * (float(mean_cost) - self.cost_limit))
        self.value = v if self.max_value is None else min(v, float(self.max_value))
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value, "lr": self.lr, "cost_limit": self.cost_limit,
                "max_value": self.max_value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.lr = float(state["lr"])
        self.cost_limit = float(state["cost_limit"])
        self.max_value = state["max_value"]
