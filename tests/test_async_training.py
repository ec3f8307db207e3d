"""Asynchronous off-policy training on a disaggregated rollout pool (issue 19).

Pure: the decoupled PPO objective (behaviour log-probs from the rollout, proximal ones
recomputed, ratio current/proximal, truncated weight proximal/behaviour) against a per-token
loop; the pipeline of :class:`rlhf.programs.async_rl.RolloutPool` against fake pools that run
each call when it is issued (as a rank runs its queue): versions, prompt order, seeds, the
drop of stale batches, the held-out evaluation on the pool with the weights just pushed; the
config checks; the disaggregated actor's flat buffer against the training-shard formula.

Multi-rank, one torchrun job of 4 ranks (2 training + 2 rollout) for the module: a staleness-1
GRPO run learns and its samples are never older than allowed, and its actor's weights are
its training shard alone; a staleness-0 disaggregated run equals the synchronous run (actor
and reference on their own 2 ranks each) bit for bit, for GRPO (held-out evaluation on the
rollout pool included) and for PPO (critic on its own 2 ranks); staleness-1 PPO, Safe-RLHF,
ReMax and DAPO run their own programs within the bound, critics trained on the training pool,
PPO's held-out evaluation on the rollout pool.  A rollout rank killed mid-run stops the job
naming it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from engine.llama_spec import llama_shard_specs
from engine.sampling import SamplingParams
from hybridflow_comm.flat_buffer import FlatParamBuffer
from hybridflow_comm.shard_spec import slot_specs
from rlhf.algos import actor_loss, get_policy_loss, make_kl_controller
from rlhf.builders import sampling_of, tokenizer_of
from rlhf.config import AlgoConfig, PolicyLossConfig, load_config
from rlhf.controller import Batch
from rlhf.evaluation import Evaluator, evaluation_examples
from rlhf.metrics import PhaseTimer, read_metrics
from rlhf.model_arch import llama_config
from rlhf.programs import Iteration, Roles, algorithm
from rlhf.programs import algorithm_names
from rlhf.programs.async_rl import RolloutPool
from rlhf.programs.steps import advantages
from rlhf.workers.actor import ActorWorker, PolicyWorker
from rlhf.workers.rollout import PushingActorWorker
from rlhf.world_plan import validate_for_world
from tests.rlhf_jobs import base_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOISY = ("timing_s/", "perf/", "memory/")
TRANSFER = ("reshard/", "weight_sync/")
"""Bytes moved to the generation side: by resharding colocated, by pushes disaggregated."""
DISAGG = ["algo=grpo", "placement.mode=disaggregated",
          "placement.pool_sizes={actor: 2, rollout: 2}"]
# the format reward of the built-in task from a random start: about 0.3 at first, learnt
# within ~15 iterations at this learning rate
TASK = ["reward.rule_weights={format: 1.0}", "actor.optim.lr=3e-3", "data.max_response_len=4"]


# The decoupled PPO objective ------------------------------------------------------------------
def _iteration(algo: AlgoConfig) -> Iteration:
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0, seed=0)
    return Iteration(algo=algo, sampling=sampling, greedy=sampling, timer=PhaseTimer(),
                     kl_ctrl=make_kl_controller("fixed", 0.0, 0.1, 1.0), lagrange=None,
                     mini_batch_size=8, more_prompts=None)


@pytest.mark.parametrize("cap", [1.3, 3.0])
def test_decoupled_ppo_against_a_token_loop(cap):
    """What the async program trains with (``advantages`` weights the advantages by
    ``min(pi_prox / mu, cap)``, the policy loss takes ``pi_prox`` as old) equals a loop over
    ``-w min(r A, clip(r) A)`` (dual clip for A < 0), ``r = pi / pi_prox``: value and gradient."""
    g = torch.Generator().manual_seed(int(cap * 10))
    b, n = 8, 5
    mask = (torch.rand(b, n, generator=g) < 0.8).long()
    mask[:, 0] = 1
    behaviour = -torch.rand(b, n, generator=g, dtype=torch.float64) * 2      # mu (rollout)
    proximal = behaviour + 0.5 * torch.randn(b, n, generator=g, dtype=torch.float64)
    current = proximal + 0.3 * torch.randn(b, n, generator=g, dtype=torch.float64)
    scores = torch.rand(b, generator=g, dtype=torch.float64)
    token_rewards = torch.zeros(b, n, dtype=torch.float64)
    last = mask.sum(1) - 1
    token_rewards[torch.arange(b), last] = scores
    batch = Batch({"token_level_rewards": token_rewards, "response_mask": mask,
                   "old_log_probs": proximal, "rollout_log_probs": behaviour},
                  {"uid": [i // 4 for i in range(b)]})
    it = _iteration(AlgoConfig(name="grpo", tis_cap=cap))
    out = advantages(batch, it)
    cfg = PolicyLossConfig()
    leaf = current.clone().requires_grad_(True)
    loss, _ = actor_loss(leaf, out["old_log_probs"], out["advantages"], mask,
                         pg_loss=get_policy_loss("ppo"), cfg=cfg)
    loss.backward()

    adv = algorithm("grpo").advantage(batch, it)["advantages"]  # the estimator, unweighted
    ref_leaf = current.clone().requires_grad_(True)
    total, count = 0.0, 0
    for i in range(b):
        for t in range(n):
            if not mask[i, t]:
                continue
            r = torch.exp(ref_leaf[i, t] - proximal[i, t])
            w = min(math.exp(float(proximal[i, t] - behaviour[i, t])), cap)
            a = float(adv[i, t])
            term = torch.maximum(-a * r, -a * r.clamp(1 - cfg.clip_ratio, 1 + cfg.clip_ratio))
            if a < 0:
                term = torch.minimum(term, torch.tensor(-a * cfg.clip_ratio_c,
                                                        dtype=torch.float64))
            total = total + w * term
            count += 1
    ref = total / count
    ref.backward()
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-9, atol=1e-12)
    capped = (proximal - behaviour > math.log(cap)) & mask.bool()
    assert capped.any() and (~capped & mask.bool()).any()  # both branches of the cap ran


# The pipeline, on fake pools -------------------------------------------------------------------
class _Done:
    def __init__(self, value) -> None:
        self.value = value

    def get(self):
        return self.value

    def wait(self):
        return self


class _Rollout:
    """A rollout pool that runs each call when issued: a generation samples with the version
    of the last pull issued before it, as on a rank that runs its calls in issue order."""

    def __init__(self, log: list) -> None:
        self.version, self.log = None, log

    def pull_weights(self, version: int) -> _Done:
        self.version = version
        self.log.append(("pull", version))
        return _Done([{"time_s": 0.5, "received_bytes": 3.0},   # one reply per pool rank
                      {"time_s": 0.25, "received_bytes": 5.0}])

    def generate_sequences(self, prompts: Batch, sampling: SamplingParams) -> _Done:
        self.log.append(("gen" if sampling.temperature > 0 else "greedy", sampling.seed))
        rows = len(prompts)
        return _Done(Batch({"weights_version": torch.full((rows,), self.version),
                            "seed": torch.full((rows,), sampling.seed)},
                           {"draw": list(prompts.non_tensors.get("draw", [None] * rows))}))


class _Actor:
    def __init__(self, log: list) -> None:
        self.log = log

    def push_weights(self) -> _Done:
        self.log.append(("push",))
        return _Done([0.5, 0.5])


class _Stream:
    """Prompt batches numbered in the order they are drawn: 2 groups of 3 samples."""

    def __init__(self) -> None:
        self.draws = 0

    def __call__(self) -> Batch:
        self.draws += 1
        return Batch({"x": torch.zeros(6)}, {"draw": [self.draws - 1] * 6,
                                             "uid": [2 * self.draws + i // 3 for i in range(6)]})


def _it(stream: _Stream) -> SimpleNamespace:
    """What :meth:`RolloutPool.take` reads of an Iteration."""
    return SimpleNamespace(more_prompts=stream)


def _pipeline(k: int, iterations: int, first: int = 0):
    log: list = []
    pool = RolloutPool(_Rollout(log), _Actor(log), k,
                       lambda step: SamplingParams(max_new_tokens=1, temperature=1.0, seed=step),
                       iterations)
    return pool, log, _Stream()


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_pipeline_versions_prompts_and_seeds(k):
    """Iteration ``t`` trains on generation ``t``: the stream's ``t``-th prompts, step ``t``'s
    seed, sampled by version ``max(0, t - k)`` (staleness ``min(t, k)``); ``k + 1``
    generations in flight, none beyond the last iteration."""
    iterations = 7
    pool, log, stream = _pipeline(k, iterations)
    pool.start(0)
    for t in range(iterations):
        ro = pool.take(stream(), _it(stream), greedy=False)  # the runtime draws the prompts
        batch, m = ro.batch, ro.metrics
        assert ro.greedy is None
        assert set(batch.non_tensors["draw"]) == {t}
        assert set(batch["seed"].tolist()) == {t}
        assert set(batch["weights_version"].tolist()) == {max(0, t - k)}
        assert m["rollout/staleness_max"] == m["rollout/staleness_mean"] == min(t, k)
        assert m["rollout/dropped"] == 0
        assert m["rollout/weights_version"] == max(0, t - k)
        out = pool.push()
        assert out == {"timing_s/weight_sync": 0.5, "weight_sync/bytes": 8.0}  # slowest; sum
        assert pool.version == t + 1
    gens = [e for e in log if e[0] == "gen"]
    assert [e[1] for e in gens] == list(range(iterations))
    # the first k + 1 generations go out together, then one after each push
    assert log[:k + 3] == [("push",), ("pull", 0)] + [("gen", j) for j in range(k + 1)]
    assert sum(e == ("push",) for e in log) == iterations + 1


def test_pipeline_drops_a_stale_batch():
    """A batch more than k versions behind the actor is dropped and generated again with
    the current weights (two pushes without a take make the one in flight 2 versions old)."""
    pool, log, stream = _pipeline(1, 5)
    pool.start(0)
    m = pool.take(stream(), _it(stream), greedy=False).metrics
    assert m["rollout/dropped"] == 0
    pool.push()
    pool.push()
    ro = pool.take(stream(), _it(stream), greedy=False)
    batch, m = ro.batch, ro.metrics
    assert m["rollout/dropped"] == 6
    assert set(batch["weights_version"].tolist()) == {2} and m["rollout/staleness_max"] == 0
    assert set(batch.non_tensors["draw"]) == {1} and set(batch["seed"].tolist()) == {1}


def test_pipeline_resumes_at_a_step():
    pool, log, stream = _pipeline(1, 6)
    pool.start(4)
    assert log == [("push",), ("pull", 4)]
    ro = pool.take(stream(), _it(stream), greedy=False)
    assert set(ro.batch["seed"].tolist()) == {4} and ro.metrics["rollout/staleness_max"] == 0
    pool.push()
    ro = pool.take(stream(), _it(stream), greedy=False)
    assert set(ro.batch["seed"].tolist()) == {5} and ro.metrics["rollout/staleness_max"] == 1
    assert [e[1] for e in log if e[0] == "gen"] == [4, 5]  # nothing beyond the last step


@pytest.mark.parametrize("k", [1, 2])
def test_pipeline_greedy_baseline_from_the_same_weights(k):
    """ReMax on the pool: every sampled generation is followed at once by the greedy one of
    its groups' first rows (step's seed, temperature 0), so both carry the same version, also
    when a stale batch is generated again; refills sample with the newest version."""
    pool, log, stream = _pipeline(k, 6)
    pool.start(0)
    for t in range(4):
        ro = pool.take(stream(), _it(stream), greedy=True)
        assert set(ro.batch["weights_version"].tolist()) == {max(0, t - k)}
        assert ro.greedy["weights_version"].tolist() == [max(0, t - k)] * 2  # one per group
        assert ro.greedy.non_tensors["draw"] == [t, t]
        assert set(ro.greedy["seed"].tolist()) == {t}
        more = pool.generate(_Stream()(), SamplingParams(max_new_tokens=1, temperature=1.0,
                                                         seed=99))
        assert set(more["weights_version"].tolist()) == {pool.version}
        pool.push()
    calls = [e for e in log if e[0] in ("gen", "greedy")]
    sampled = [i for i, e in enumerate(calls) if e[0] == "gen" and e[1] != 99]
    assert all(calls[i + 1] == ("greedy", calls[i][1]) for i in sampled)
    # a stale batch: both calls again, back to back
    pool.push()
    pool.push()
    n = len(log)
    ro = pool.take(stream(), _it(stream), greedy=True)
    assert ro.metrics["rollout/dropped"] == 6 and log[n:][-2:] == [("gen", 4), ("greedy", 4)]
    assert set(ro.greedy["weights_version"].tolist()) == {pool.version}


def test_pool_greedy_sampling_is_the_runs_greedy_sampling():
    """The pool derives a step's greedy sampling as its rollout sampling at temperature 0:
    what a colocated run's ``Iteration.greedy`` is (builders.sampling_of)."""
    cfg = load_config(["algo=remax", "data.temperature=0.7"])
    tok = tokenizer_of(cfg)
    for step in (0, 5):
        assert dataclasses.replace(sampling_of(cfg, step, tok), temperature=0.0) == \
            sampling_of(cfg, step, tok, greedy=True)


class _VersionReward:
    """Scores every row with the weight version that generated it."""

    def compute_reward(self, gen: Batch) -> _Done:
        return _Done(Batch({"scores": gen["weights_version"].float()}))


def test_evaluation_on_the_pool_scores_the_weights_just_pushed():
    """The held-out evaluation of a disaggregated run generates on the rollout pool (the actor
    is never asked), queued behind the generation in flight and the pull of the version the
    runtime has just pushed: every evaluated row comes from that version."""
    cfg = load_config(["algo=grpo", "data.val_size=6", "eval_pass_k=2"])
    tok = tokenizer_of(cfg)
    val = Evaluator(cfg, tok, evaluation_examples(cfg, tok))
    for k in (1, 2):
        log: list = []
        pool = RolloutPool(_Rollout(log), _Actor(log), k,
                           lambda step: SamplingParams(max_new_tokens=1, temperature=1.0,
                                                       seed=step), 6)
        roles = Roles(actor=_Actor(log), reward=_VersionReward(), rollout=pool)
        stream = _Stream()
        pool.start(0)
        assert val.run(roles, 0)["val/reward"] == 0  # the starting weights
        for t in range(3):
            pool.take(stream(), _it(stream), greedy=False)
            pool.push()  # as the runtime does, before it evaluates
            n = len(log)
            m = val.run(roles, t)
            assert m["val/reward"] == m["val/accuracy"] * pool.version == t + 1
            assert m["val/pass@k"] == 1.0
            # greedy rows (temperature 0), then the pass@k samples, issued after the pull
            assert {e[0] for e in log[n:]} == {"greedy", "gen"} and ("pull", t + 1) in log[:n]


def test_disaggregated_actor_has_no_generation_side():
    """The disaggregated actor is the policy's training side plus the push: no generation
    method, no HybridEngine; the colocated actor keeps both."""
    assert issubclass(PushingActorWorker, PolicyWorker)
    assert not issubclass(PushingActorWorker, ActorWorker)
    assert not hasattr(PushingActorWorker, "generate_sequences")
    assert hasattr(ActorWorker, "generate_sequences")


def _train_shard_bytes(specs, pp_rank: int, tp: int) -> int:
    """The formula: a rank's training shard, tensor by tensor (partitioned: 1/tp of it)."""
    return sum(math.prod(s.shape) // (tp if s.partition_dim is not None else 1)
               * s.dtype.itemsize for s in specs if s.stage == pp_rank)


def _gen_shard_bytes(specs, pp_rank: int, pp: int, pp_g: int, tp_g: int) -> int:
    """A rank's generation shard: every tensor of its generation stage, 1/tp_g of each
    partitioned one."""
    per = pp // pp_g
    return sum(math.prod(s.shape) // (tp_g if s.partition_dim is not None else 1)
               * s.dtype.itemsize for s in specs if s.stage // per == pp_rank // per)


@pytest.mark.parametrize("layout", ["{pp: 1, tp: 2, dp: 0, gen_tp: 1}",
                                    "{pp: 2, tp: 2, dp: 0, gen_pp: 1, gen_tp: 1}",
                                    "{pp: 1, tp: 4, dp: 0, gen_tp: 2}"])
def test_disaggregated_actor_buffer_is_the_training_shard(layout):
    """The flat buffer the disaggregated actor's plan gives every training rank
    (``slot_specs`` of its layout, what ``ParallelLlama`` allocates) holds its training shard
    and nothing else; the same actor colocated holds its generation shard (the resharder's
    slots), and the rollout pool keeps the configured generation layout."""
    extra = [f"actor.layout={layout}", "actor.model.num_heads=4", "actor.model.num_kv_heads=4"]
    disagg = load_config([*DISAGG[:2], "placement.pool_sizes={actor: 4, rollout: 2}", *extra])
    a = validate_for_world(disagg, 6).roles["actor"]
    c = validate_for_world(load_config(["algo=grpo", *extra]), 4).roles["actor"]
    assert (a.gen_pp, a.gen_tp, a.dp_g) == (a.pp, a.tp, a.dp)
    r = validate_for_world(disagg, 6).rollout
    assert (r.pp, r.tp) == (c.gen_pp, c.gen_tp) and r.dp_g == 2 // (c.gen_pp * c.gen_tp)
    specs = llama_shard_specs(llama_config(disagg.actor.model), a.pp)
    saved = 0
    for rank in range(4):
        pp_rank = a.layout.train.coords(rank).pp
        mine = FlatParamBuffer(slot_specs(specs, a.layout, rank))
        assert mine.gen_nbytes == mine.train_nbytes == _train_shard_bytes(specs, pp_rank, a.tp)
        colocated = sum(s.num_slots * s.slot_nbytes for s in slot_specs(specs, c.layout, rank))
        assert colocated == _gen_shard_bytes(specs, pp_rank, c.pp, c.gen_pp, c.gen_tp)
        saved += colocated - mine.gen_nbytes
    assert saved > 0


# Config checks --------------------------------------------------------------------------------
@pytest.mark.parametrize("args, world, match", [
    (["algo=grpo", "algo.max_staleness=1", "algo.tis_cap=2.0"], 4,
     "algo.max_staleness=1 needs placement.mode=disaggregated"),
    ([*DISAGG, "algo.max_staleness=2"], 4, "algo.max_staleness=2 .* set algo.tis_cap"),
    ([*DISAGG[1:], "algo=remax", "placement.pool_sizes={actor: 2, rollout: 4}",
      "data.prompts_per_iter=2", "data.samples_per_prompt=8"], 6,
     "rollout pool: remax's greedy baseline batch prompts_per_iter=2 does not split over its "
     "4 generation replicas"),
    (["algo=grpo", "algo.max_staleness=-1"], 4, "algo.max_staleness=-1 must be an int >= 0"),
    ([*DISAGG[:2], "placement.pool_sizes={actor: 2}"], 4,
     r"keys \['actor', 'rollout'\], got \{'actor': 2\}"),
    ([*DISAGG], 5, r"sum to 4 but world_size=5; make them sum to 5"),
    ([*DISAGG[:2], "placement.pool_sizes={actor: 2, rollout: 3}", "actor.layout.gen_tp=2"], 5,
     "pool_sizes.rollout=3 is not a multiple of .*gen_pp=1 x gen_tp=2 = 2"),
    ([*DISAGG[:2], "placement.pool_sizes={actor: 2, rollout: 3}"], 5,
     "rollout batch 32 does not split over its 3 generation replicas"),
])
def test_config_names_values_and_fix(args, world, match):
    with pytest.raises(ValueError, match=match):
        validate_for_world(load_config(args), world)


@pytest.mark.parametrize("name", algorithm_names())
def test_every_algorithm_runs_disaggregated(name):
    """Each registered algorithm's own program takes its rollouts from the pool: every one
    validates with staleness 1, its critics and cost sources on the training pool."""
    cfg = load_config([f"algo={name}", *DISAGG[1:], "algo.max_staleness=1",
                       "algo.tis_cap=2.0"])
    plan = validate_for_world(cfg, 4)
    assert plan.rollout.pool == (2, 3)
    assert {r: p.pool for r, p in plan.roles.items()} == dict.fromkeys(cfg.roles, (0, 1))
    with pytest.raises(ValueError, match="set algo.tis_cap"):
        load_config([f"algo={name}", *DISAGG[1:], "algo.max_staleness=1"])


def test_disaggregated_plan():
    cfg = load_config([*DISAGG, "algo.max_staleness=1", "algo.tis_cap=2.0"])
    plan = validate_for_world(cfg, 4)
    assert plan.pools == {"actor": (0, 1), "rollout": (2, 3)}
    assert plan.roles["actor"].pool == plan.roles["reference"].pool == (0, 1)
    r = plan.rollout  # the actor's generation layout (recipe: tp 2 -> gen_tp 1) on 2 ranks
    assert (r.pool, r.pp, r.tp, r.dp, r.dp_g) == ((2, 3), 1, 1, 2, 2)
    a = plan.roles["actor"]  # generates nothing: its generation side is its training side
    assert (a.pp, a.tp, a.gen_pp, a.gen_tp) == (1, 2, 1, 2) and a.dp_g == a.dp == 1
    assert validate_for_world(load_config(["algo=grpo"]), 4).rollout is None


# Multi-rank: one job for the module ------------------------------------------------------------
def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node=4", *args]


LEARN_ITERATIONS = 20
OWN_ITERATIONS = 4
OWN_PROGRAMS = ("ppo", "safe_rlhf", "remax", "dapo")  # programs of their own, staleness 1
RUNS = {
    # the grpo recipe's actor trains on tp 2 and generates on tp 1: the push re-cuts rows
    "async1": [*DISAGG, "algo.max_staleness=1", "algo.tis_cap=2.0",
               f"iterations={LEARN_ITERATIONS}", "data.val_size=0", *TASK],
    "async0": [*DISAGG, "actor.layout.tp=1", "iterations=3", "data.val_size=16", *TASK],
    "sync": ["algo=grpo", "placement.mode=standalone", "actor.layout.tp=1",
             "placement.pool_sizes={actor: 2, reference: 2}", "iterations=3",
             "data.val_size=16", *TASK],
    # PPO: the critic on the training pool (disaggregated) or on its own 2 ranks (split, the
    # reference beside the actor): the same layouts, so the same numbers at staleness 0
    "ppo_async0": ["algo=ppo", *DISAGG[1:], "actor.layout.tp=1", "iterations=2",
                   "data.val_size=0", *TASK],
    "ppo_sync": ["algo=ppo", "placement.mode=split", "placement.pool_sizes={actor: 2, critic: 2}",
                 "actor.layout.tp=1", "iterations=2", "data.val_size=0", *TASK],
    **{f"{name}_async1": [f"algo={name}", *DISAGG[1:], "algo.max_staleness=1", "algo.tis_cap=2.0",
                          f"iterations={OWN_ITERATIONS}", *TASK,
                          # PPO also evaluates (on the rollout pool), at the start and every 2
                          *(["data.val_size=8", "eval_every=2"] if name == "ppo" else
                            ["data.val_size=0"])]
       for name in OWN_PROGRAMS},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("async")
    spec = {name: [*o, f"log.runs_dir={d}", f"log.run_name={name}", "checkpoint.resume=never"]
            for name, o in RUNS.items()}
    # async1 two iterations more, from its last checkpoint (found when the run starts)
    spec["resumed"] = [*RUNS["async1"], f"iterations={LEARN_ITERATIONS + 2}",
                       f"log.runs_dir={d}", "log.run_name=resumed", "checkpoint.resume=auto",
                       f"checkpoint.dir={d}/async1/checkpoints"]
    (d / "spec.json").write_text(json.dumps(spec))
    res = subprocess.run(_torchrun("-m", "tests.rlhf_jobs", str(d / "spec.json"),
                                   str(d / "out.json")),
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    out = json.loads((d / "out.json").read_text())
    for name in spec:
        assert "error" not in out[name], out[name].get("traceback")
    return d, out


def test_staleness_one_learns_within_the_bound(runs):
    d, out = runs
    recs = out["async1"]["records"]
    assert recs == read_metrics(str(d / "async1" / "metrics.jsonl"))
    assert [r["step"] for r in recs] == list(range(LEARN_ITERATIONS))
    for t, r in enumerate(recs):
        # the versions the rollout ranks stamped on the samples: never older than k = 1, and
        # exactly 1 behind once the pipeline runs (the rollout pool is one iteration ahead)
        assert r["rollout/staleness_max"] == r["rollout/staleness_mean"] == min(t, 1)
        assert r["rollout/weights_version"] == t - min(t, 1)
        assert r["rollout/dropped"] == 0
        assert r["timing_s/weight_sync"] > 0  # the push before this update, rollout side
    # behaviour = proximal policy at step 0 (the pushed weights equal the actor's); after it,
    # the samples come from the previous version
    assert recs[0]["actor/rollout_logprob_diff_max"] < 1e-4
    assert all(r["actor/rollout_logprob_diff"] > 1e-4 for r in recs[1:])
    first = sum(r["reward/mean"] for r in recs[:3]) / 3
    last = sum(r["reward/mean"] for r in recs[-5:]) / 5
    assert first < 0.6 and last > first + 0.3, [r["reward/mean"] for r in recs]


def test_disaggregated_actor_holds_its_training_shard_only(runs):
    """The actor ranks of the staleness-1 run (training tp 2, generation tp 1 on the rollout
    pool) hold their training shard alone: the weights they report (the largest flat buffer)
    equal the formula, not the generation shard a colocated actor would hold."""
    _, out = runs
    overrides = RUNS["async1"]
    cfg = load_config(base_overrides(overrides) + overrides)
    a = validate_for_world(cfg, 4).roles["actor"]
    specs = llama_shard_specs(llama_config(cfg.actor.model), a.pp)
    assert a.tp == 2 and cfg.actor.layout.gen_tp == 1
    want = max(_train_shard_bytes(specs, a.layout.train.coords(r).pp, a.tp) for r in range(2))
    got = out["async1"]["records"][0]["memory/actor_weights_gb"]
    assert got == want / 2**30
    assert got < _gen_shard_bytes(specs, 0, a.pp, 1, 1) / 2**30  # what colocated would hold


def test_resume_pushes_the_restored_weights(runs):
    """A resumed run starts its pipeline again: the checkpoint's weights go to the rollout
    pool as version ``step`` and the first iteration is on-policy."""
    _, out = runs
    recs = out["resumed"]["records"]
    t = LEARN_ITERATIONS
    assert [r["step"] for r in recs] == [t, t + 1]
    assert [r["rollout/staleness_max"] for r in recs] == [0, 1]
    assert [r["rollout/weights_version"] for r in recs] == [t, t]
    assert recs[0]["actor/rollout_logprob_diff_max"] < 1e-4


def assert_staleness_zero_equals(a: list[dict], s: list[dict], n: int) -> list[dict]:
    """``n`` records each; every record of the k = 0 disaggregated run ``a`` is at staleness 0
    with its step's version, and equals the synchronous run's ``s`` bit for bit but for the
    timings, the transfer bytes and the rollout/ metrics.  Returns ``a``'s compared records."""
    assert len(a) == len(s) == n
    compared = []
    for x, y in zip(a, s):
        assert x["rollout/staleness_max"] == 0 and x["rollout/weights_version"] == x["step"]
        exact = {k: v for k, v in x.items()
                 if not k.startswith((*NOISY, *TRANSFER, "rollout/"))}
        assert exact == {k: v for k, v in y.items() if not k.startswith((*NOISY, *TRANSFER))}
        compared.append(exact)
    return compared


def test_staleness_zero_equals_the_synchronous_run(runs):
    """Generation on the rollout pool with pushed weights, k = 0, against the actor's own
    generation on its 2 ranks (same replicas, rows and seeds): every metric but the timings
    and the rollout/ ones is equal bit for bit, held-out evaluation included."""
    _, out = runs
    a = assert_staleness_zero_equals(out["async0"]["records"], out["sync"]["records"], 3)
    assert "val/accuracy" in a[0] and "val/accuracy" in a[-1]


def test_staleness_zero_ppo_equals_the_synchronous_run(runs):
    """PPO's own program on the rollout pool's rows, k = 0: values, GAE, the critic's and the
    actor's updates equal the run whose actor generates (critic on its own ranks) bit for
    bit."""
    _, out = runs
    exact = assert_staleness_zero_equals(out["ppo_async0"]["records"],
                                         out["ppo_sync"]["records"], 2)
    assert all("critic/vf_loss" in x for x in exact)


@pytest.mark.parametrize("name", OWN_PROGRAMS)
def test_own_programs_at_staleness_one(runs, name):
    """PPO, Safe-RLHF, ReMax and DAPO run their own programs on the rollout pool's rows, one
    version behind once the pipeline runs (never more), off-policy corrected, their critics
    (cost critic, greedy baseline, refills) trained and logged."""
    _, out = runs
    recs = out[f"{name}_async1"]["records"]
    assert [r["step"] for r in recs] == list(range(OWN_ITERATIONS))
    for t, r in enumerate(recs):
        assert r["rollout/staleness_max"] == r["rollout/staleness_mean"] == min(t, 1)
        assert r["rollout/weights_version"] == t - min(t, 1)
        assert r["rollout/dropped"] == 0 and r["timing_s/weight_sync"] > 0
        assert all(math.isfinite(v) for v in r.values())
    assert recs[0]["actor/rollout_logprob_diff_max"] < 1e-4
    trained = recs[1:] if name != "dapo" else [r for r in recs[1:] if "actor/pg_loss" in r]
    assert trained and all(r["actor/rollout_logprob_diff"] > 1e-4 for r in trained)
    own = {"ppo": ("critic/vf_loss",), "safe_rlhf": ("critic/vf_loss", "cost_critic/vf_loss",
                                                     "cost/lagrange"),
           "remax": ("reward/greedy_baseline",), "dapo": ("dapo/gen_rounds",)}[name]
    assert all(k in r for r in recs for k in own), sorted(recs[-1])
    if name == "ppo":  # held-out evaluation on the rollout pool: start, every 2, the last
        evaluated = [t for t, r in enumerate(recs) if "val/accuracy" in r]
        assert evaluated == [0, 1, 3], evaluated
        assert all(0 <= recs[t][k] <= 1 for t in evaluated
                   for k in ("val/accuracy", "val/reward", "val/pass@k"))
        assert recs[0]["timing_s/eval"] > 0


# A rollout rank killed ---------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except OSError:
                continue
            if ppid == pid:
                out.append(int(entry))
    return out


def _rank_pid(launcher: int, rank: int) -> int | None:
    for pid in _children(launcher):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"RANK") == str(rank).encode() and env.get(b"LOCAL_RANK") is not None:
            return pid
    return None


def test_rollout_rank_killed_stops_the_job_naming_it(tmp_path):
    """SIGKILL of rollout rank 3 with a generation call in flight: the job exits non-zero
    within a minute, naming the lost rank and the call (no hang of the training ranks in the
    push that waits for it), whether rank 0 reads the closed connection first or torchrun's
    SIGTERM reaches it first.  The rank is stopped (SIGSTOP) first and killed once the
    controller's call trace shows a generation issued to it after the stop: a call it can
    never have answered."""
    args = [*DISAGG, "algo.max_staleness=1", "algo.tis_cap=2.0", "iterations=1000",
            "data.val_size=0", *TASK, f"log.runs_dir={tmp_path}", "log.run_name=kill",
            "checkpoint.resume=never", "log.progress=false", "log.tensorboard=false",
            "log.plot=false"]
    trace = tmp_path / "calls.txt"
    proc = subprocess.Popen(_torchrun("-m", "rlhf.train", *args), cwd=ROOT,
                            env=_env() | {"HYBRIDFLOW_TRACE_CALLS": str(trace)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    metrics = tmp_path / "kill" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, "the run never started"
            time.sleep(0.2)
        pid = _rank_pid(proc.pid, 3)
        assert pid is not None, "rank 3 not found among the launcher's children"
        os.kill(pid, signal.SIGSTOP)
        issued_before = len(trace.read_text().splitlines())
        deadline = time.monotonic() + 60
        while not any("issue rollout.generate_sequences" in line
                      and "3" in line.split("ranks=")[1].split(",")
                      for line in trace.read_text().splitlines()[issued_before:]):
            assert proc.poll() is None and time.monotonic() < deadline, \
                "no generation was issued to the stopped rank"
            time.sleep(0.1)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=90)
        elapsed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    assert elapsed < 60, elapsed
    lost = [line for line in out.splitlines() if "RankLostError: lost rank 3: " in line]
    assert lost and "rollout.generate_sequences" in lost[0], out[-3000:]
