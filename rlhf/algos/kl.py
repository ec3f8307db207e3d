"""KL between the policy and the reference: estimators, KL-in-reward, KL as a loss, and the
fixed / adaptive coefficient controllers.

Per-token estimators of ``KL(pi || pi_ref)`` from samples of ``pi`` (Schulman, "Approximating
KL divergence", 2020), with ``x = log pi(a) - log pi_ref(a)``::

    k1 = x                       unbiased, high variance, can be negative
    k2 = x^2 / 2                 biased, low variance, >= 0
    k3 = exp(-x) - 1 + x         unbiased, low variance, >= 0

Shapes: ``[B, T]`` with a response mask ``[B, T]``.
"""

from __future__ import annotations

import torch

from rlhf.algos.masked import agg_loss, check_same_shape, masked_mean

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor,
                estimator: str = "k1") -> torch.Tensor:
    """Per-token KL estimate ``[B, T]`` (see the module docstring)."""
    x = log_prob - ref_log_prob
    if estimator == "k1":
        return x
    if estimator == "k2":
        return 0.5 * x * x
    if estimator == "k3":
        return torch.expm1(-x) + x
    raise ValueError(f"kl estimator={estimator!r} is not one of {KL_ESTIMATORS}")


def kl_penalty_rewards(token_scores: torch.Tensor, log_prob: torch.Tensor,
                       ref_log_prob: torch.Tensor, mask: torch.Tensor, beta: float,
                       estimator: str = "k1") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL penalty folded into the reward (Ziegler et al. 2019)::

        r_t = s_t - beta * k(log_prob_t, ref_log_prob_t)     on valid tokens, 0 elsewhere

    Args:
        token_scores: ``[B, T]`` task scores (typically the sequence score on the last token).
        log_prob, ref_log_prob: ``[B, T]`` rollout and reference log-probs.
        beta: KL coefficient (from a :class:`FixedKLController` / :class:`AdaptiveKLController`).
    Returns:
        ``(token_rewards, {"kl", "kl_coef"})``; ``kl`` is the batch mean of each sequence's
        token-mean KL, the quantity the adaptive controller tracks.
    """
    check_same_shape(mask, token_scores=token_scores, log_prob=log_prob,
                     ref_log_prob=ref_log_prob)
    m = mask.to(token_scores.dtype)
    with torch.no_grad():
        kl = kl_estimate(log_prob, ref_log_prob, estimator) * m
        rewards = (token_scores - beta * kl) * m
        seq_kl = masked_mean(kl, m, dim=-1)
    return rewards, {"kl": seq_kl.mean(), "kl_coef": torch.tensor(float(beta))}


def kl_loss(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, mask: torch.Tensor,
            estimator: str, loss_agg_mode: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL as a loss term (GRPO style): ``agg(k(log_prob, ref_log_prob))``; scale it by the
    coefficient when adding it to the policy loss.

    Returns:
        ``(loss, {"kl_loss"})``.
    """
    check_same_shape(mask, log_prob=log_prob, ref_log_prob=ref_log_prob)
    loss = agg_loss(kl_estimate(log_prob, ref_log_prob, estimator), mask, loss_agg_mode)
    return loss, {"kl_loss": loss.detach()}


class FixedKLController:
    """Constant KL coefficient; ``update`` is a no-op (same interface as the adaptive one)."""

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef={kl_coef} must be >= 0")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, section 2.2)::

        e      = clip(KL_current / KL_target - 1, -0.2, 0.2)
        beta  <- beta * (1 + e * n_steps / horizon)

    ``n_steps`` is the number of samples (sequences) of the iteration that measured the KL.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if init_kl_coef < 0 or not target_kl > 0 or not horizon > 0:
            raise ValueError(f"init_kl_coef={init_kl_coef} must be >= 0, target_kl={target_kl} "
                             f"and horizon={horizon} must be > 0")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = float(state["horizon"])


def make_kl_controller(kind: str, kl_coef: float, target_kl: float,
                       horizon: float) -> FixedKLController | AdaptiveKLController:
    """``kind`` = ``"fixed"`` or ``"adaptive"``."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"kl controller kind={kind!r} must be 'fixed' or 'adaptive'")
