"""``compute_advantage``: the one advantage call of a controller program, for every algorithm.

The batch is anything indexable by field name (a :class:`rlhf.controller.Batch` or a dict).
Fields read, by algorithm (``[B, T]`` over response tokens unless noted):

=============  ==========================================================================
all            ``token_level_rewards``, ``response_mask``
ppo            ``values``
remax          ``reward_baselines`` ``[B]`` (score of the greedy response)
grpo, rloo     ``uid`` (one group id per row: list or ``[B]`` tensor)
reinforce_pp   (nothing more)
safe_rlhf      ``values``, ``token_level_costs``, ``cost_values`` and ``lagrange=`` argument
=============  ==========================================================================
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf.algos import advantages as adv
from rlhf.algos.safe_rlhf import safe_rlhf_advantages

ALGOS = ("ppo", "remax", "safe_rlhf", "grpo", "rloo", "reinforce_pp")


def _field(batch: Any, key: str, algo: str):
    try:
        return batch[key]
    except KeyError:
        keys = list(batch.keys()) if hasattr(batch, "keys") else "?"
        raise ValueError(f"algo={algo!r} needs batch field {key!r}; the batch has {keys}") from None


def compute_advantage(batch: Any, algo: str, *, gamma: float = 1.0, lam: float = 0.95,
                      whiten: bool = True, norm_adv_by_std: bool = True,
                      lagrange: float | None = None) -> dict[str, torch.Tensor]:
    """Advantages and returns of ``algo`` from the fields of ``batch``.

    Args:
        batch: mapping-like with the fields listed in the module docstring.
        algo: one of ``ALGOS``.
        gamma, lam: discount and GAE lambda (ppo, safe_rlhf; gamma also reinforce_pp).
        whiten: whiten GAE advantages (ppo, safe_rlhf).
        norm_adv_by_std: divide by the group std (grpo).
        lagrange: Safe-RLHF multiplier (required for safe_rlhf).
    Returns:
        ``{"advantages": [B, T], "returns": [B, T], ...}`` (safe_rlhf adds the reward and cost
        parts, see :func:`safe_rlhf_advantages`).
    """
    if algo not in ALGOS:
        raise ValueError(f"algo={algo!r} is not one of {ALGOS}")
    rewards = _field(batch, "token_level_rewards", algo)
    mask = _field(batch, "response_mask", algo)
    if algo == "ppo":
        a, r = adv.gae(rewards, _field(batch, "values", algo), mask, gamma, lam, whiten)
    elif algo == "remax":
        a, r = adv.remax(rewards, _field(batch, "reward_baselines", algo), mask)
    elif algo == "grpo":
        a, r = adv.grpo(rewards, mask, _field(batch, "uid", algo), norm_adv_by_std)
    elif algo == "rloo":
        a, r = adv.rloo(rewards, mask, _field(batch, "uid", algo))
    elif algo == "reinforce_pp":
        a, r = adv.reinforce_pp(rewards, mask, gamma)
    else:
        if lagrange is None:
            raise ValueError("algo='safe_rlhf' needs lagrange= (the current multiplier)")
        return safe_rlhf_advantages(rewards, _field(batch, "values", algo),
                                    _field(batch, "token_level_costs", algo),
                                    _field(batch, "cost_values", algo), mask, lagrange,
                                    gamma, lam, whiten)
    return {"advantages": a, "returns": r}
