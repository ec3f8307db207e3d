"""Asynchronous off-policy training on a disaggregated rollout pool (``placement.mode=
disaggregated``, ``algo.max_staleness=k``): the rollout pool generates up to ``k`` iterations
ahead while the training pool trains.

The pipeline is the order in which the controller issues calls, nothing more: each rank runs
its calls one after the other in issue order, and the two pools run their queues side by side
(:mod:`rlhf.controller`).  For ``k = 1``, with ``v`` the weight version (= iterations trained)::

    rollout pool  | gen 0 (v0) | gen 1 (v0)  |pull v1| gen 2 (v1)  |pull v2| gen 3 (v2) ...
    training pool |            | train on 0 |push v1| train on 1 |push v2| train on 2 ...
                                 staleness 0           staleness 1          staleness 1

* :meth:`RolloutPool.take` issues generation ``t + k`` (queued behind the last push, so it
  samples with the newest weights) and waits for generation ``t``, issued ``k`` iterations
  earlier; its rows travel through the controller (a future passed on would make the rollout
  ranks send them only after the generations queued since).
* The algorithm's own program trains on it: every program takes its rollouts through
  :func:`~rlhf.programs.steps.rollouts` (ReMax :func:`~rlhf.programs.steps.greedy_rollouts`:
  the greedy baseline is issued right behind the sampled generation, so the same weights
  produce both; DAPO's refills :func:`~rlhf.programs.steps.more_rollouts`: generated with the
  newest weights, behind the generations in flight).  Everything else runs on the training
  pool at train time, on the possibly stale rows: log-probs, reference, rewards and costs, the
  critics' values (PPO's GAE uses the current critic), the updates.
* :meth:`RolloutPool.push`, called by the runtime after every iteration, issues the weight
  push on both pools: on the training pool it runs after the update, on the rollout pool
  after the generations in flight (queued behind them); the generations issued after it use
  the new version.

Every sample records the version that generated it (``weights_version``); its staleness is
the actor's version (iterations trained) minus that, at most ``k`` by construction.  A batch
older than ``k`` versions is dropped and its prompts generated again with the current weights
(a safety net: ``rollout/dropped`` counts such rows and stays 0 in this pipeline).

Off-policy correction, decoupled PPO (Hilton et al. 2022; AReaL, verl's async recipes): the
behaviour policy's log-probs ``mu`` are the rollout's own; the proximal policy's ``pi_prox`` are
recomputed by the actor at train time (``algo.recompute_log_prob``, the batch's
``old_log_probs``); the clipped PPO ratio is ``pi / pi_prox`` and each token's term is weighted
by ``min(pi_prox / mu, algo.tis_cap)`` (:func:`rlhf.algos.truncated_is_weights`, applied to the
advantages by :func:`~rlhf.programs.steps.advantages`)::

    L = - sum_t m_t min(pi_prox / mu, C) min(r_t A_t, clip(r_t, 1 - e, 1 + e) A_t) / sum_t m_t,
    r_t = pi(y_t) / pi_prox(y_t)

Checkpoints hold no in-flight generation: a run that resumes pushes its weights again and
skips the ``k`` prompt batches that were in flight.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from rlhf.programs.iteration import Iteration
from rlhf.programs.rollout_sources import IterationRollout, group_heads

if TYPE_CHECKING:  # names of annotations only
    from engine.sampling import SamplingParams
    from rlhf.controller import Batch, Future, WorkerGroup


@dataclass(frozen=True)
class _Generation:
    """One generation in flight: the calls (sampled, greedy or None), its prompts and the step
    whose sampling it uses."""

    sampled: Future
    greedy: Future | None
    prompts: Batch
    step: int


class RolloutPool:
    """The controller's handle on the rollout pool of a disaggregated run (a
    :class:`~rlhf.programs.rollout_sources.Rollouts`: every program takes its rollouts from it).

    Args:
        rollout: the rollout pool's group (:class:`rlhf.workers.rollout.RolloutWorker`).
        actor: the actor's group (:class:`rlhf.workers.rollout.PushingActorWorker`), connected
            to ``rollout`` for the weight push.
        max_staleness: ``k``: at most ``k + 1`` generations in flight.
        sampling: step -> that step's rollout sampling (its own seed; greedy: the same with
            temperature 0).
        iterations: the run's last step + 1 (nothing is generated beyond it).
    """

    def __init__(self, rollout: WorkerGroup, actor: WorkerGroup, max_staleness: int,
                 sampling: Callable[[int], SamplingParams], iterations: int) -> None:
        self.rollout, self.actor = rollout, actor
        self.max_staleness, self.sampling, self.iterations = max_staleness, sampling, iterations
        self.version = 0
        """The actor's weight version: iterations trained since step 0 (one push each)."""
        self._next_step = 0
        self._inflight: deque[_Generation] = deque()
        self._pull: Future | None = None

    def start(self, step: int) -> dict[str, float]:
        """Push the actor's weights as version ``step`` (a run's start, or its resume at
        ``step``); forgets the generations in flight."""
        self.version, self._next_step = step - 1, step
        self._inflight.clear()
        return self.push()

    def push(self) -> dict[str, float]:
        """After an actor update: its weights become the next version on the rollout pool.
        Returns ``timing_s/weight_sync``, the rollout ranks' time in the previous push (done
        by now: the training pool ran it before this update), and ``weight_sync/bytes``, what
        they received in it together."""
        done = {}
        if self._pull is not None:
            pulled = self._pull.get()
            done = {"timing_s/weight_sync": max(p["time_s"] for p in pulled),
                    "weight_sync/bytes": sum(p["received_bytes"] for p in pulled)}
        self.version += 1
        self.actor.push_weights()  # both ends issued back to back: one collective
        self._pull = self.rollout.pull_weights(self.version)
        return done

    def take(self, prompts: Batch, it: Iteration, greedy: bool) -> IterationRollout:
        """This iteration's rollouts, and the ``rollout/`` metrics of their staleness.

        Issues generations until ``k + 1`` are in flight: ``prompts`` (this iteration's draw
        from the stream) for the first, ``it.more_prompts()`` for the others (a run's start);
        then waits for the oldest.  With ``greedy`` each generation is followed at once by
        the greedy one of its prompt groups (nothing can come between two calls issued back
        to back: the same weights sample both).
        """
        todo = [prompts]
        while len(self._inflight) <= self.max_staleness and self._next_step < self.iterations:
            if not todo and it.more_prompts is None:
                raise ValueError("filling the rollout pipeline needs Iteration.more_prompts")
            prompts_t = todo.pop() if todo else it.more_prompts()
            self._inflight.append(self._generation(prompts_t, self._next_step, greedy))
            self._next_step += 1
        if not self._inflight:
            raise RuntimeError(f"no generation in flight after step {self._next_step - 1} "
                               f"(iterations={self.iterations})")
        gen = self._inflight.popleft()
        assert (gen.greedy is not None) == greedy, "a program asks for greedy rollouts or not"
        batch = gen.sampled.get()
        dropped = int(stale_rows(batch["weights_version"], self.version,
                                 self.max_staleness).sum())
        if dropped:  # one call samples with one version: the whole batch, again
            gen = self._generation(gen.prompts, gen.step, greedy)
            batch = gen.sampled.get()
        base = gen.greedy.get() if gen.greedy is not None else None
        assert base is None or bool((base["weights_version"] == batch["weights_version"][0])
                                    .all()), "the greedy baseline came from other weights"
        age = (self.version - batch["weights_version"]).float()
        return IterationRollout(batch, base, {"rollout/staleness_mean": float(age.mean()),
                                     "rollout/staleness_max": float(age.max()),
                                     "rollout/dropped": float(dropped),
                                     "rollout/weights_version":
                                         float(batch["weights_version"].min())})

    def session(self) -> AbstractContextManager:
        return nullcontext({"reshard_s": 0.0})  # the pool generates in its own layout always

    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """Rollouts of ``prompts`` with the newest weights (pushed last), queued behind the
        generations in flight; the rows come through the controller.  DAPO's refills, and the
        held-out evaluation (called after :meth:`push`: it scores the version just trained,
        and waits for the generations in flight before it)."""
        return self.submit(prompts, sampling).get()

    def submit(self, prompts: Batch, sampling: SamplingParams) -> Future:
        return self.rollout.generate_sequences(prompts, sampling)

    def _generation(self, prompts: Batch, step: int, greedy: bool) -> _Generation:
        sampling = self.sampling(step)
        sampled = self.rollout.generate_sequences(prompts, sampling)
        base = self.rollout.generate_sequences(
            group_heads(prompts), replace(sampling, temperature=0.0)) if greedy else None
        return _Generation(sampled, base, prompts, step)


def stale_rows(weights_version: torch.Tensor, version: int, max_staleness: int) -> torch.Tensor:
    """``[B]`` True where a row was sampled more than ``max_staleness`` versions before
    ``version``."""
    return version - weights_version > max_staleness
