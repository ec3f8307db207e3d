"""KL between the policy and the reference: estimators, KL-in-reward, KL as a loss, and the
fixed / adaptive coefficient controllers.

Per-token estimators of ``KL(pi || pi_ref)`` from samples of ``pi`` (Schulman, "Approximating
KL divergence", 2020), with ``x = log pi(a) - log pi_ref(a)``::

    k1 = x                       unbiased, high variance, can be negative
    k2 = x^2 / 2                 biased, low variance, >= 0
    k3 = exp(-x) - 1 + x         unbiased, low variance, >= 0

Bounds: ``k3`` grows like ``exp(-x)``, so one token whose policy probability fell far below
the reference's (``x = -30``: ``k3 ~ 1e13``) would swamp a loss or a reward.  Every estimator
therefore sees ``x`` clamped to ``[-log_ratio_clamp, log_ratio_clamp]`` (``algo.
kl_log_ratio_clamp``, 20: ``exp(20) ~ 5e8`` stays finite in float32), and ``k3`` is clamped to
``[-k3_clamp, k3_clamp]`` (``algo.kl_k3_clamp``, 10, verl's bound).  Where a clamp is active
the token's gradient is 0 (``torch.clamp``), as in verl: such a token is an outlier the
estimate no longer describes.

Shapes: ``[B, T]`` with a response mask ``[B, T]``; masked positions are ignored by
``torch.where`` (NaN and inf there never reach a result or a gradient).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlhf.algos.masked import agg_loss, check_same_shape, kept, masked_mean

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, estimator: str, *,
                log_ratio_clamp: float, k3_clamp: float) -> torch.Tensor:
    """Per-token KL estimate ``[B, T]`` (see the module docstring for the formulas and bounds).

    Args:
        log_prob, ref_log_prob: ``[B, T]`` log-probs under the policy and the reference.
        estimator: ``k1``, ``k2`` or ``k3``.
        log_ratio_clamp: bound on ``|x|`` (> 0).
        k3_clamp: bound on ``|k3|`` (> 0).
    """
    _check_bounds(log_ratio_clamp, k3_clamp)
    x = (log_prob - ref_log_prob).clamp(-log_ratio_clamp, log_ratio_clamp)
    if estimator == "k1":
        return x
    if estimator == "k2":
        return 0.5 * x * x
    if estimator == "k3":
        return (torch.expm1(-x) + x).clamp(-k3_clamp, k3_clamp)
    raise ValueError(f"kl estimator={estimator!r} is not one of {KL_ESTIMATORS}")


def _check_bounds(log_ratio_clamp: float, k3_clamp: float) -> None:
    if not (log_ratio_clamp > 0 and k3_clamp > 0):
        raise ValueError(f"kl log_ratio_clamp={log_ratio_clamp} and k3_clamp={k3_clamp} must "
                         f"be > 0")


@dataclass(frozen=True)
class KLLossTerm:
    """The KL-as-loss term of the actor's loss (:func:`rlhf.algos.actor_loss`):
    ``coef * agg(k(log_prob, ref_log_prob))`` with :func:`kl_estimate`'s estimator and bounds.
    """

    coef: float
    """Coefficient of the term (>= 0)."""
    estimator: str
    """k1, k2 or k3."""
    log_ratio_clamp: float
    """Bound on the estimators' log ratio (> 0)."""
    k3_clamp: float
    """Bound on k3 per token (> 0)."""

    def __post_init__(self) -> None:
        if not self.coef >= 0:
            raise ValueError(f"kl coef={self.coef} must be >= 0")
        if self.estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl estimator={self.estimator!r} is not one of {KL_ESTIMATORS}")
        _check_bounds(self.log_ratio_clamp, self.k3_clamp)

    @classmethod
    def of(cls, algo: Any) -> KLLossTerm | None:
        """The term an algorithm section asks for (``algo``: any object with the attributes of
        :class:`rlhf.config.AlgoConfig`, read by name): None unless its ``kl_loss_coef`` is set
        (``algo.kl_mode=loss``)."""
        if algo.kl_loss_coef is None:
            return None
        return cls(coef=algo.kl_loss_coef, estimator=algo.kl_estimator,
                   log_ratio_clamp=algo.kl_log_ratio_clamp, k3_clamp=algo.kl_k3_clamp)


def kl_penalty_rewards(token_scores: torch.Tensor, log_prob: torch.Tensor,
                       ref_log_prob: torch.Tensor, mask: torch.Tensor, beta: float,
                       estimator: str, *, log_ratio_clamp: float, k3_clamp: float
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL penalty folded into the reward (Ziegler et al. 2019)::

        r_t = s_t - beta * k(log_prob_t, ref_log_prob_t)     on valid tokens, 0 elsewhere

    Args:
        token_scores: ``[B, T]`` task scores (typically the sequence score on the last token).
        log_prob, ref_log_prob: ``[B, T]`` rollout and reference log-probs.
        beta: KL coefficient (from a :class:`FixedKLController` / :class:`AdaptiveKLController`).
        estimator, log_ratio_clamp, k3_clamp: see :func:`kl_estimate`.
    Returns:
        ``(token_rewards, {"kl", "kl_coef"})``; ``kl`` is the batch mean of each sequence's
        token-mean KL, the quantity the adaptive controller tracks.
    """
    check_same_shape(mask, token_scores=token_scores, log_prob=log_prob,
                     ref_log_prob=ref_log_prob)
    with torch.no_grad():
        kl = kl_estimate(kept(log_prob, mask), kept(ref_log_prob, mask), estimator,
                         log_ratio_clamp=log_ratio_clamp, k3_clamp=k3_clamp)
        rewards = kept(token_scores - beta * kl, mask)
        seq_kl = masked_mean(kl, mask, dim=-1)
    return rewards, {"kl": seq_kl.mean(), "kl_coef": torch.tensor(float(beta))}


def kl_loss(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, mask: torch.Tensor,
            estimator: str, loss_agg_mode: str, *, log_ratio_clamp: float, k3_clamp: float,
            denominator: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL as a loss term (GRPO style): ``agg(k(log_prob, ref_log_prob))``; scale it by the
    coefficient when adding it to the policy loss.

    Args:
        estimator, log_ratio_clamp, k3_clamp: see :func:`kl_estimate`.
        loss_agg_mode, denominator: see :func:`rlhf.algos.masked.agg_loss`.
    Returns:
        ``(loss, {"kl_loss"})``.
    """
    check_same_shape(mask, log_prob=log_prob, ref_log_prob=ref_log_prob)
    k = kl_estimate(kept(log_prob, mask), kept(ref_log_prob, mask), estimator,
                    log_ratio_clamp=log_ratio_clamp, k3_clamp=k3_clamp)
    loss = agg_loss(k, mask, loss_agg_mode, denominator)
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
