"""DAPO: its program's dynamic sampling driven by fake roles with scripted scores, the overlong
penalty against the paper's formula, and the varied-group filter against a direct loop.

The fake roles answer at once (future-likes whose ``wait()`` is themselves and ``get()`` their
batch) and record every call, so a test sees exactly which rows each role was given.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from engine.sampling import SamplingParams
from rlhf.algos import (LagrangeMultiplier, make_kl_controller, overlong_penalty,
                        varied_groups)
from rlhf.config import load_config
from rlhf.controller import Batch
from rlhf.metrics import PhaseTimer
from rlhf.programs import Iteration, Roles
from rlhf.programs.dapo import dapo

T = 4   # response width of the fake rollouts


class Done:
    """A future that has already resolved."""

    def __init__(self, batch: Batch) -> None:
        self.batch = batch

    def wait(self) -> "Done":
        return self

    def get(self) -> Batch:
        return self.batch


def batch_of(x: Batch | Done) -> Batch:
    """What a worker group receives: a batch, or the future of an earlier call."""
    return x.get() if isinstance(x, Done) else x


class PromptStream:
    """``data.prompts_per_iter`` prompts at a time, ``samples`` rows each; uids are stream
    positions, as :func:`rlhf.runtime.next_prompts` gives them."""

    def __init__(self, prompts: int, samples: int) -> None:
        self.prompts, self.samples, self.position, self.calls = prompts, samples, 0, 0

    def next(self) -> Batch:
        uids = [self.position + i for i in range(self.prompts) for _ in range(self.samples)]
        self.position += self.prompts
        return Batch({"input_ids": torch.tensor(uids)[:, None]}, {"uid": uids})

    def more(self) -> Batch:  # Iteration.more_prompts
        self.calls += 1
        return self.next()


class FakeActor:
    """Generation with a varied response length, log-probs of zeros, a recorded update."""

    def __init__(self) -> None:
        self.seeds: list[int] = []
        self.log_prob_calls: list[Batch] = []
        self.updates: list[Batch] = []

    def generate_sequences(self, prompts: Batch | Done, sampling: SamplingParams) -> Done:
        prompts = batch_of(prompts)
        self.seeds.append(sampling.seed)
        b = len(prompts)
        lengths = torch.arange(b) % T + 1
        mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
        return Done(Batch({"input_ids": prompts["input_ids"], "response_mask": mask,
                           "rollout_log_probs": torch.zeros(b, T)}, dict(prompts.non_tensors)))

    def compute_log_prob(self, batch: Batch | Done) -> Done:
        batch = batch_of(batch)
        self.log_prob_calls.append(batch)
        return Done(Batch({"old_log_probs": torch.zeros(len(batch), T)}))

    def update_actor(self, batch: Batch | Done) -> Done:
        self.updates.append(batch_of(batch))
        return Done(Batch({"pg_loss": torch.tensor([0.5])}))


class ScriptedReward:
    """Round ``r``'s call returns ``script[r]`` (one score list per group, in prompt order)."""

    def __init__(self, script: list[list[list[float]]]) -> None:
        self.script, self.calls = script, 0

    def compute_reward(self, batch: Batch | Done) -> Done:
        batch = batch_of(batch)
        scores = [s for group in self.script[self.calls] for s in group]
        self.calls += 1
        assert len(scores) == len(batch)
        return Done(Batch({"scores": torch.tensor(scores, dtype=torch.float32)}))


@dataclasses.dataclass
class Result:
    batch: Batch
    metrics: dict
    actor: FakeActor
    stream: PromptStream
    sampling: SamplingParams


def run_dapo(script: list[list[list[float]]], *, prompts: int = 8, samples: int = 4,
             mini_batch: int = 16, max_rounds: int = 4) -> Result:
    """DAPO's program on the recipe's algo section with ``max_gen_rounds = max_rounds``."""
    cfg = load_config(["algo=dapo"])
    algo = dataclasses.replace(cfg.algo, max_gen_rounds=max_rounds)
    stream, actor = PromptStream(prompts, samples), FakeActor()
    sampling = SamplingParams(max_new_tokens=T, temperature=1.0, seed=1234)
    it = Iteration(algo=algo, sampling=sampling,
                   greedy=dataclasses.replace(sampling, temperature=0.0), timer=PhaseTimer(),
                   kl_ctrl=make_kl_controller("fixed", algo.kl_coef, algo.kl_target,
                                              algo.kl_horizon),
                   lagrange=LagrangeMultiplier(algo.lagrange_init, algo.lagrange_lr,
                                               algo.cost_limit, algo.lagrange_max),
                   mini_batch_size=mini_batch, more_prompts=stream.more)
    roles = Roles(actor=actor, reward=ScriptedReward(script), reference=None)
    batch, metrics = dapo(roles, stream.next(), it)
    return Result(batch, metrics, actor, stream, sampling)


def varied(group: list[float]) -> bool:
    return len(set(group)) > 1


def check(script: list[list[list[float]]], *, prompts: int = 8, samples: int = 4,
          mini_batch: int = 16, max_rounds: int = 4) -> Result:
    """Run DAPO on ``script`` and check every promise of its docstring against a direct count
    over the script."""
    res = run_dapo(script, prompts=prompts, samples=samples, mini_batch=mini_batch,
                   max_rounds=max_rounds)
    # what the program should do: rounds until `prompts` varied groups, at most max_rounds
    rounds, kept, dropped = 0, [], 0
    while len(kept) < prompts and rounds < max_rounds:
        for g, group in enumerate(script[rounds]):
            if varied(group):
                kept.append((rounds * prompts + g, group))   # uid = stream position
            else:
                dropped += 1
        rounds += 1
    granule = math.lcm(samples, mini_batch) // samples
    n_trained = min(len(kept), prompts) // granule * granule

    m = res.metrics
    assert m["dapo/gen_rounds"] == rounds
    assert m["dapo/dropped_groups"] == dropped
    assert m["dapo/kept_groups"] == len(kept)
    assert m["dapo/trained_groups"] == n_trained
    assert res.stream.calls == rounds - 1 <= max_rounds - 1

    # round 0 samples with the iteration's seed, every extra round with a seed of its own
    assert len(res.actor.seeds) == rounds and res.actor.seeds[0] == res.sampling.seed
    assert len(set(res.actor.seeds)) == rounds

    if n_trained == 0:
        assert res.actor.updates == [] and res.actor.log_prob_calls == []
        return res
    (update,) = res.actor.updates
    want = [u for u, _ in kept[:n_trained]]
    assert list(dict.fromkeys(update["uid"])) == want
    assert update["uid"] == [u for u in want for _ in range(samples)]
    assert len(update) % mini_batch == 0 and len(update) // samples <= prompts
    # no row of an all-equal group, and every row carries its own group's scores
    scores = dict(kept)
    for i, u in enumerate(update["uid"]):
        assert varied(scores[u])
        assert float(update["scores"][i]) == scores[u][i % samples]
    assert bool((update["advantages"].abs().sum(-1) > 0).all())
    # log-probs of the kept rows only
    (lp,) = res.actor.log_prob_calls
    assert lp["uid"] == update["uid"]
    return res


def script_of(pattern: list[str], samples: int = 4) -> list[list[list[float]]]:
    """One round per string: ``v`` a varied group, ``0``/``1`` a group all scoring that."""
    def group(c: str, k: int) -> list[float]:
        if c == "v":
            return [1.0 if (i + k) % samples == 0 else 0.0 for i in range(samples)]
        return [float(c)] * samples
    return [[group(c, k) for k, c in enumerate(r)] for r in pattern]


def test_first_round_enough():
    res = check(script_of(["vvvvvvvv", "vvvvvvvv"]))
    assert res.metrics["dapo/gen_rounds"] == 1 and res.stream.calls == 0


def test_rounds_until_enough():
    # 3 + 4 + 2 varied groups: three rounds, 9 kept, 8 trained (two mini-batches of 4 groups)
    res = check(script_of(["v0v1v000", "1v0v1v0v", "00vv0000", "vvvvvvvv"]))
    assert res.metrics["dapo/gen_rounds"] == 3
    assert res.metrics["dapo/dropped_groups"] == 5 + 4 + 6
    assert res.metrics["dapo/trained_groups"] == 8


def test_rounds_run_out():
    # one varied group per round: max_gen_rounds rounds, then the 4 it has (one mini-batch)
    res = check(script_of(["v0000000", "0v000000", "11v11111", "000v0000"]))
    assert res.metrics["dapo/kept_groups"] == 4 and res.metrics["dapo/trained_groups"] == 4
    assert res.stream.calls == 3


def test_not_a_whole_mini_batch_means_no_update():
    res = check(script_of(["v0000000", "0v000000", "11v11111", "00000000"]))
    assert res.metrics["dapo/kept_groups"] == 3 and res.metrics["dapo/trained_groups"] == 0


def test_no_varied_group_means_no_update():
    res = check(script_of(["00000000", "11111111", "01010101"]), max_rounds=3)
    assert res.metrics["dapo/trained_groups"] == 0
    assert res.metrics["dapo/dropped_groups"] == 24 and res.metrics["dapo/kept_groups"] == 0
    assert res.actor.updates == []
    assert res.batch["uid"][0] == 0   # the first round's scored batch comes back


def test_mini_batch_not_a_multiple_of_the_group():
    # samples 4, mini-batch 8 rows = 2 groups: 5 kept groups -> 4 trained
    res = check(script_of(["v0v0v000", "v0000000", "0v000000"]), mini_batch=8, max_rounds=3)
    assert res.metrics["dapo/trained_groups"] == 4
    # mini-batch 6 rows: lcm(4, 6) = 12 rows = 3 groups per granule
    res = check(script_of(["vv0v0v00", "vvv00000", "00000000"]), mini_batch=6, max_rounds=3)
    assert res.metrics["dapo/trained_groups"] == 6


@pytest.mark.parametrize("seed", range(20))
def test_random_scripts(seed):
    rng = random.Random(seed)
    prompts, samples = rng.choice([(4, 2), (8, 4), (6, 3)])
    mini_batch = samples * rng.choice([1, 2]) * (1 if prompts % 2 else rng.choice([1, 2]))
    max_rounds = rng.randint(1, 5)
    p_varied = rng.random()
    script = [[[float(rng.random() < 0.5) for _ in range(samples)] if rng.random() < p_varied
               else [float(rng.randint(0, 1))] * samples for _ in range(prompts)]
              for _ in range(max_rounds)]
    check(script, prompts=prompts, samples=samples, mini_batch=mini_batch,
          max_rounds=max_rounds)


# The overlong penalty and the varied-group filter --------------------------------------------
def dapo_overlong(length: int, max_len: int, buffer: int, factor: float) -> float:
    """Yu et al. 2025, eq. 13, times the penalty factor."""
    if length <= max_len - buffer:
        return 0.0
    if length <= max_len:
        return (max_len - buffer - length) / buffer * factor
    return -factor


@pytest.mark.parametrize("max_len,buffer,factor", [(6, 2, 1.0), (16, 16, 0.5), (10, 1, 2.0),
                                                   (20, 7, 0.0), (1, 1, 1.0)])
def test_overlong_penalty_matches_the_paper(max_len, buffer, factor):
    lengths = torch.arange(0, max_len + 1)
    got = overlong_penalty(lengths, max_len, buffer, factor)
    want = [dapo_overlong(int(n), max_len, buffer, factor) for n in lengths]
    assert got.shape == lengths.shape and got.dtype == torch.float32
    for g, w in zip(got.tolist(), want):
        assert g == pytest.approx(w, abs=1e-6)
    assert float(got[-1]) == pytest.approx(-factor)   # a response at the limit: full penalty


@pytest.mark.parametrize("max_len,buffer,factor", [(6, 0, 1.0), (6, 7, 1.0), (6, 2, -0.1)])
def test_overlong_penalty_rejects(max_len, buffer, factor):
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([1, 2]), max_len, buffer, factor)


@pytest.mark.parametrize("seed", range(10))
def test_varied_groups_matches_a_loop(seed):
    g = torch.Generator().manual_seed(seed)
    rows = int(torch.randint(1, 40, (1,), generator=g))
    # few distinct ids (some groups of one) and few distinct values (many all-equal groups)
    uid = [f"p{int(x)}" for x in torch.randint(0, 8, (rows,), generator=g)]
    scores = torch.randint(0, 3, (rows,), generator=g).float() * 0.5
    if seed % 2:
        scores = scores + torch.randn(rows, generator=g) * (torch.rand(rows, generator=g) < 0.2)
    got = varied_groups(scores, uid)
    want = [len({float(scores[j]) for j in range(rows) if uid[j] == uid[i]}) > 1
            for i in range(rows)]
    assert got.dtype == torch.bool and got.tolist() == want


def test_varied_groups_edges():
    assert varied_groups(torch.zeros(0), []).tolist() == []
    assert varied_groups(torch.tensor([1.0]), ["a"]).tolist() == [False]
    assert varied_groups(torch.tensor([1.0, 1.0 + 1e-7, 2.0]), [0, 0, 1]).tolist() == \
        [True, True, False]
    with pytest.raises(ValueError):
        varied_groups(torch.tensor([1.0, 2.0]), ["a"])
