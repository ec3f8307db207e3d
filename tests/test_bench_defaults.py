"""Every bench's defaults fit every shape of bench/shapes.py it accepts: the layouts, rank
counts and batch sizes a bench runs with when given only ``--shape`` pass the checks that
would otherwise raise inside its ranks (the engine's, the resharder's, the RL runtime's).

``kernels_vs_compile.py`` and ``train_step.py --dynamic`` run one process at layout 1,1,1 at
any shape: they have no parallel sizes to check.
"""

import inspect
import os
import time

import pytest

from bench import e2e, e2e_async, e2e_multi_turn, generation, roofline, transition, weight_sync
from bench.shapes import SHAPES
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from hybridflow_comm.shard_spec import check_specs

RL_SHAPES = [name for name, shape in SHAPES.items() if shape.rl]
POSITIONS = 2048
"""Positions of a model built for the layout checks (the resharding-only rows have no
prompt or response length)."""


def _wider_tps(tp: int, nproc: int) -> list[int]:
    return [t for t in range(tp + 1, nproc + 1) if nproc % t == 0]


def _plan(overrides: list[str], world: int):
    """What ``rlhf.train`` checks before any rank works: the config, its world plan."""
    from rlhf.config import load_config
    from rlhf.planner.config_bridge import resolve_config
    from rlhf.world_plan import validate_for_world

    return validate_for_world(resolve_config(load_config(overrides), world), world)


@pytest.mark.parametrize("name", RL_SHAPES)
def test_generation_multirank_layouts_fit(name):
    batch, new_tokens = generation.default_sizes(name)
    config = generation.model_config(name, new_tokens)
    nproc = generation.NPROC
    layouts = generation.multirank_layouts(config, nproc)
    train = layouts[0].train
    train.check_world_size(nproc)
    config.check_parallel(train.pp, train.tp)  # ParallelLlama's check
    for t in _wider_tps(train.tp, nproc):  # the widest TP the model allows
        with pytest.raises(ValueError):
            config.check_parallel(1, t)
    assert [hl.tp_g for hl in layouts] == [d for d in range(1, train.tp + 1) if train.tp % d == 0]
    for hl in layouts:
        assert hl.train == train
        config.check_parallel(hl.pp_g, hl.tp_g)  # GenerationEngine's check
        # HybridEngine.generate_sequences splits the prompts over the micro-DP group
        assert batch % hl.micro_dp_size == 0, (name, batch, hl)


@pytest.mark.parametrize("name", [None, *SHAPES])
def test_transition_default_layout_fits(name):
    nproc, size_mb = transition.NPROC, transition.SIZE_MB
    train, gen = transition.default_layout(name, size_mb, nproc)
    hl = HybridLayout(ParallelLayout(*train), *gen)
    hl.check_world_size(nproc)
    check_specs(transition.model_specs(name, size_mb, hl.train.pp), hl.train)  # run()'s check
    for t in _wider_tps(hl.train.tp, nproc):
        with pytest.raises(ValueError):
            check_specs(transition.model_specs(name, size_mb, 1), ParallelLayout(1, t, 1))
    # --source fsdp: the generation layout over all the ranks
    fsdp_gen = ParallelLayout(hl.pp_g, hl.tp_g, nproc // (hl.pp_g * hl.tp_g))
    fsdp_gen.check_world_size(nproc)
    check_specs(transition.model_specs(name, size_mb, hl.pp_g), fsdp_gen)
    if name is not None:
        config = SHAPES[name].llama_config(max_positions=POSITIONS)
        config.check_parallel(hl.train.pp, hl.train.tp)
        config.check_parallel(hl.pp_g, hl.tp_g)


@pytest.mark.parametrize("name", SHAPES)
def test_weight_sync_default_pools_fit(name):
    if name not in weight_sync.POOLS:  # refused before any rank starts, naming the shape
        with pytest.raises(ValueError, match=name):
            weight_sync.sync_layout(name)
        return
    layout = weight_sync.sync_layout(name)  # checks the shard specs against both pools
    config = SHAPES[name].llama_config(max_positions=POSITIONS)
    config.check_parallel(layout.train.pp, layout.train.tp)
    config.check_parallel(layout.gen.pp, layout.gen.tp)


@pytest.mark.parametrize("name", RL_SHAPES)
def test_roofline_default_micro_batch_fits(name):
    shape = SHAPES[name]
    sequences = roofline.update_sequences(shape, roofline.MICRO_BATCH)
    assert sequences == shape.prompts * shape.samples


@pytest.mark.parametrize("name", RL_SHAPES)
def test_e2e_default_run_fits(name, tmp_path):
    from engine.hf_interop import config_to_hf

    defaults = {k: p.default for k, p in inspect.signature(e2e.run).parameters.items()}
    row = SHAPES[name]
    contest = e2e.contest(name, str(tmp_path))
    config_to_hf(e2e.model_config(name)).save_pretrained(contest.folder)  # what rlhf.train reads
    nproc = defaults["nproc"]
    overrides = e2e.our_overrides(contest, nproc, defaults["steps"], str(tmp_path),
                                  defaults["tp"], row.prompts, row.samples)
    plan = _plan(overrides, nproc)
    assert plan.roles["actor"].dp * plan.roles["actor"].tp == nproc


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_e2e_async_default_runs_fit(placement):
    """``bench/e2e.py --placement disaggregated`` (``--shape tiny`` only) on its default ranks;
    the main job's model, without its SFT checkpoint: the same architecture, built fresh."""
    from rlhf.main_job import MODEL

    nproc = e2e_async.NPROC
    overrides = e2e_async.overrides(placement, nproc, 1, 8, "runs", "bench")
    plan = _plan([*overrides, "actor.model.init_from=null", *MODEL], nproc)
    assert sum(len(pool) for pool in plan.pools.values()) == nproc


def test_e2e_multi_turn_defaults_pass_the_runs_checks(tmp_path):
    """``bench/e2e.py --multi-turn``: both contenders' configs on the example's files (its
    untrained model in place of the cached SFT one) pass every check ``rlhf.train`` makes
    before a rank starts; the single-turn one generates exactly the tokens it is given."""
    import subprocess
    import sys

    from rlhf.builders import check_run, tokenizer_of
    from rlhf.config import load_config

    folder = tmp_path / "example"
    subprocess.run([sys.executable, os.path.join(e2e_multi_turn.EXAMPLE, "make_example.py"),
                    str(folder), "--train", "8", "--val", "4", "--sft", "4"], check=True,
                   stdout=subprocess.DEVNULL)
    (folder / "sft").symlink_to(folder / "base")
    defaults = inspect.signature(e2e_multi_turn.run).parameters
    nproc, prompts, samples, steps = (defaults[k].default for k in
                                      ("nproc", "prompts", "samples", "steps"))
    slow = e2e_multi_turn.slow_tools(str(tmp_path), 0.2)
    for tokens, tools, overlap in ((None, None, False), (37, None, False), (None, slow, True)):
        kw = {"tools": tools} if tools else {}
        overrides = e2e_multi_turn.overrides(str(folder), steps, prompts, samples,
                                             str(tmp_path), "bench", tokens, overlap=overlap,
                                             **kw)
        plan = _plan(overrides, nproc)
        cfg = load_config(overrides)
        check_run(cfg, tokenizer_of(cfg))
        assert plan.roles["actor"].dp * plan.roles["actor"].tp == nproc
        assert cfg.rollout.overlap_tools == overlap
        if tokens is not None:
            assert (cfg.data.min_new_tokens, cfg.data.max_response_len,
                    cfg.rollout.max_turns) == (tokens, tokens, 1)
    # the slow tool is the example's to the model (same schema), 0.2 s slower
    from rlhf.tools.catalog import load_catalog

    fast = load_catalog(os.path.join(e2e_multi_turn.EXAMPLE, "tools.py"), {}).tools["lookup"]
    late = load_catalog(slow, {}).tools["lookup"]
    assert late.schema == fast.schema
    t0 = time.perf_counter()
    assert late.fn("kalom", extra_info={"name": "kalom", "code": "417"}) == "417"
    assert time.perf_counter() - t0 >= 0.2


def test_e2e_multi_turn_summary():
    recs = [{"response/length_mean": 99.0, "timing_s/step": 9.0, "timing_s/gen": 5.0}] + [
        {"response/length_mean": n, "timing_s/step": s, "timing_s/gen": g,
         "rollout/turns_mean": 2.0, "rollout/tool_calls_mean": 1.0, "timing_s/tools": 0.1}
        for n, s, g in ((10.0, 2.0, 1.0), (20.0, 2.0, 1.5), (12.0, 3.0, 2.0))]
    out = e2e_multi_turn.summarize(recs, rows=8)
    assert out["generated_tokens_per_s"] == sorted([10 * 8 / 2, 20 * 8 / 2, 12 * 8 / 3])[1]
    assert out["tokens_per_sample"] == 12.0 and out["phases_s"] == {"gen": 1.5, "step": 2.0,
                                                                    "tools": 0.1}


def test_device_profile_counts_the_operators_of_each_step():
    """On the CPU the profile counts top-level operators: a call of ``steps`` steps of three
    operators each gives three per step, and their time is a share of the wall time."""
    import torch

    from bench.timing import device_profile

    a, b = torch.randn(64, 64), torch.randn(64, 64)

    def steps(n=5):
        x = a
        for _ in range(n):
            x = torch.tanh(torch.mm(x, b).add_(1.0))
        return x

    steps()
    prof = device_profile(steps, 5, "cpu")
    assert prof["ops_per_step"] == 3
    assert 0 < prof["busy_fraction"] <= 1
    assert {t["name"] for t in prof["top"]} == {"aten::mm", "aten::add_", "aten::tanh"}
    assert abs(sum(t["share"] for t in prof["top"]) - 1) < 1e-6
