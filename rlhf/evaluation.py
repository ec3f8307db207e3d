"""Held-out evaluation: ``data.val_files``, or the built-in task's held-out problems (a fixed
tenth of all problems that never appears in training or SFT data, ``data.val_size`` of them),
scored by the run's reward.

Logged in the first iteration's record for the starting policy (a fresh run), then after every
``eval_every`` iterations' updates and after the last one::

    val/reward     mean score of the greedy responses
    val/accuracy   fraction of greedy responses with score >= 1 (a correct answer under an
                   exact-match or 0/1 reward function)
    val/pass@k     fraction of prompts where at least one of k = ``eval_pass_k`` responses sampled
                   at the rollout temperature scores >= 1 (k samples per prompt: the plain
                   estimate, which is the unbiased one when n = k)
    timing_s/eval  the evaluation's wall time (not part of the iteration's timing_s/step)

The responses come from where the run's rollouts come from (``Roles.rollout``, its
``generate``): the actor on its own ranks, or on a disaggregated run the rollout pool, queued
behind the generations in flight and after the push of the weights just trained (the
runtime pushes before it evaluates), so it scores the same version as a colocated run would.
The numbers then equal the colocated evaluation's when both generate on the same number of
replicas ``dp_g`` with the same generation layout (each replica's rows and seed are a function
of ``dp_g`` and its index): the rollout pool's ``placement.pool_sizes.rollout / (gen_pp x
gen_tp)`` against the actor's ``dp_g``.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from engine.sampling import derive_seed
from rlhf.builders import sampling_of, task_of
from rlhf.config import Config
from rlhf.programs import Roles
from rlhf.prompts import encode_prompts, fitting_prompts
from rlhf.task import Example, read_dataset


def evaluation_examples(cfg: Config, tok, encode=None) -> list[Example]:
    """The run's held-out prompts: ``data.val_files`` (those that fit ``data.max_prompt_len``
    encoded by ``encode``, :func:`rlhf.prompts.fitting_prompts`); else, for the built-in task,
    its ``data.val_size`` held-out problems; else none."""
    d = cfg.data
    if d.val_files:
        return fitting_prompts(read_dataset(d.val_files, d.prompt_key, d.ground_truth_key),
                               tok, d.max_prompt_len, "data.val_files", encode)
    if d.train_files is None and d.val_size:
        return task_of(cfg).heldout_examples(d.val_size)
    return []


class Evaluator:
    """The validation rows of a run (read and length-filtered once, on the controller)."""

    def __init__(self, cfg: Config, tok, examples: list[Example]) -> None:
        self.cfg, self.tok, self.examples = cfg, tok, examples

    def due(self, step: int) -> bool:
        """Whether to evaluate after iteration ``step`` (0-based)."""
        every, last = self.cfg.eval_every, self.cfg.iterations - 1
        return step == last or bool(every and (step + 1) % every == 0)

    def _correct(self, roles: Roles, sampling, samples: int) -> torch.Tensor:
        """``[n_prompts, samples]`` scores of the responses to every validation prompt."""
        d = self.cfg.data
        chunk = max(1, d.rollout_batch_size // samples)
        scores = []
        for i in range(0, len(self.examples), chunk):
            prompts = encode_prompts(self.examples[i:i + chunk], self.tok, d.max_prompt_len,
                                     samples, first_uid=i)
            gen = roles.rollout.generate(prompts, sampling)  # the newest weights
            scores.append(roles.reward.compute_reward(gen).get()["scores"].float())
        return torch.cat(scores).view(-1, samples)  # repeat() keeps a prompt's samples adjacent

    def run(self, roles: Roles, step: int) -> dict[str, float]:
        """Greedy responses (and ``eval_pass_k`` samples) to every validation prompt, scored;
        ``val/*`` metrics."""
        t0 = time.perf_counter()
        greedy = sampling_of(self.cfg, step, self.tok, greedy=True, evaluation=True)
        s = self._correct(roles, greedy, 1)[:, 0]
        out = {"val/reward": float(s.mean()), "val/accuracy": float((s >= 1).float().mean())}
        k = self.cfg.eval_pass_k
        if k:
            sampled = sampling_of(self.cfg, step, self.tok, evaluation=True)
            sampled = dataclasses.replace(sampled, seed=derive_seed(sampled.seed, "eval"))
            hits = (self._correct(roles, sampled, k) >= 1).any(dim=1)
            out["val/pass@k"] = float(hits.float().mean())
        return out | {"timing_s/eval": time.perf_counter() - t0}
