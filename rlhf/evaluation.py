"""Held-out evaluation: greedy rollouts of ``data.val_files`` scored by the run's reward.

Logged in the first iteration's record for the starting policy (a fresh run), then after every
``eval_every`` iterations' updates and after the last one::

    val/reward     mean score of the greedy responses
    val/accuracy   fraction of responses with score >= 1 (a correct answer under an exact-match
                   or 0/1 reward function)
"""

from __future__ import annotations

import torch

from rlhf.builders import sampling_of
from rlhf.config import Config
from rlhf.programs import Roles
from rlhf.prompts import encode_prompts, fitting_prompts
from rlhf.task import read_dataset


class Evaluator:
    """The validation rows of a run (read and length-filtered once, on the controller)."""

    def __init__(self, cfg: Config, tok) -> None:
        d = cfg.data
        self.cfg, self.tok = cfg, tok
        self.examples = fitting_prompts(read_dataset(d.val_files, d.prompt_key,
                                                     d.ground_truth_key),
                                        tok, d.max_prompt_len, "data.val_files")

    def due(self, step: int) -> bool:
        """Whether to evaluate after iteration ``step`` (0-based)."""
        every, last = self.cfg.eval_every, self.cfg.iterations - 1
        return step == last or bool(every and (step + 1) % every == 0)

    def run(self, roles: Roles, step: int) -> dict[str, float]:
        """Greedy responses to every validation prompt, scored; ``val/*`` metrics."""
        d, greedy = self.cfg.data, sampling_of(self.cfg, step, self.tok, greedy=True)
        chunk = d.rollout_batch_size
        scores = []
        for i in range(0, len(self.examples), chunk):
            prompts = encode_prompts(self.examples[i:i + chunk], self.tok, d.max_prompt_len,
                                     1, first_uid=i)
            gen = roles.actor.generate_sequences(prompts, greedy)
            scores.append(roles.reward.compute_reward(gen).get()["scores"].float())
        s = torch.cat(scores)
        return {"val/reward": float(s.mean()), "val/accuracy": float((s >= 1).float().mean())}
