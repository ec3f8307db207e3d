"""GRPO's program and group advantages with another policy loss: one registry entry per loss
(``algo=gspo`` ...; the loss alone is ``actor.loss.mode=gspo`` under any algorithm).  Each
loss's paper and formula are in :mod:`rlhf.algos.policy_losses`; its recipe
(``rlhf/recipes/NAME.yaml``) sets the clip ranges and aggregation the paper uses.

====== ======================================================= ==========================
algo   policy loss                                             paper
====== ======================================================= ==========================
gspo   sequence-level, length-normalised importance ratio      Zheng et al. 2025
cispo  clipped stop-gradient IS weight times log-prob          MiniMax-M1, 2025
clip_cov  PPO clip; cut the gradient of high-covariance tokens Cui et al. 2025
kl_cov    PG with a KL penalty on high-covariance tokens       Cui et al. 2025
gmpo   geometric mean of the token ratios, log-space clip      Zhao et al. 2025
sapo   soft sigmoid gate instead of the hard clip              Gao et al. 2025
gpg    plain policy gradient, no ratio, no clip                Chu et al. 2025
====== ======================================================= ==========================
"""

from __future__ import annotations

from rlhf.programs.registry import register_algorithm
from rlhf.programs.steps import critic_free
from rlhf.programs.grpo import grpo_advantage

for _loss in ("gspo", "cispo", "clip_cov", "kl_cov", "gmpo", "sapo", "gpg"):
    register_algorithm(_loss, advantage=grpo_advantage, grouped=True,
                       policy_loss=_loss)(critic_free)
