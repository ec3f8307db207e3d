"""Precision from the command line to the engines: ``precision=auto|fp32|bf16`` is resolved once
per rank (:func:`rlhf.config.resolve_devices`, on the rank's device) into one
:class:`hybridflow_comm.devices.Precision`; the builders build every model in its
``param_dtype`` and hand it to every role's :class:`engine.train.TrainEngine` (trained roles
keep master weights when it says so; the frozen reference, reward and cost models take it too); the SFT entry and the main job take the same path.  Nothing
downstream reads ``auto`` again or infers the precision from the tensors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.llama_spec import LlamaConfig
from engine.model import ParallelLlama
from engine.train import TrainEngine
from hybridflow_comm.devices import BF16, FP32, Precision
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from rlhf import builders
from rlhf.config import load_config, resolve_devices
from rlhf.world_plan import validate_for_world

TINY = ["actor.model.hidden_size=32", "actor.model.intermediate_size=64",
        "actor.model.num_heads=4", "actor.model.num_kv_heads=2", "actor.model.num_layers=2",
        "actor.layout.tp=1", "actor.layout.gen_tp=1", "critic.layout.tp=1", "device=cpu"]
CASES = pytest.mark.parametrize("given, precision", [("auto", FP32), ("fp32", FP32),
                                                     ("bf16", BF16)])


def _groups():
    return build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))


def _worker(cls, spec):
    w = cls.__new__(cls)
    w.groups = _groups()
    w.__init__(spec)
    return w


@CASES
def test_config_precision_reaches_the_engines(given, precision):
    """auto on cpu -> fp32; bf16 -> bf16 parameters with fp32 masters, in training and in
    the generation engine's config (the actor's and the rollout pool's); the frozen models'
    engines (reference, reward model) take the same value."""
    from rlhf.workers import ActorWorker, CriticWorker, ReferenceWorker, RewardWorker, ScoreSpec
    from rlhf.workers.rollout import SyncSpec

    cfg, device = resolve_devices(load_config([*TINY, f"precision={given}"]))
    assert device == torch.device("cpu")
    assert cfg.precision == precision.name  # the saved config says what ran
    plan = validate_for_world(cfg, 1)
    assert builders.run_precision(cfg) is precision
    dtype = precision.param_dtype
    actor_spec = builders.actor_spec(cfg, plan)
    critic_spec = builders.critic_spec(cfg, plan, "critic", 1)
    reference_spec = builders.reference_spec(cfg)
    reward_spec = ScoreSpec(model=builders.model_spec(cfg, "reward_model", "value", 3),
                            precision=precision, model_weight=1.0, rule_weights={},
                            cost_rule=None, function=None, tokenizer=None, overlong=None)
    for spec in (actor_spec, critic_spec, reference_spec, reward_spec):
        assert spec.precision is precision and spec.model.config.dtype == dtype
    sync = SyncSpec(train=(1, 1, 1), gen=(1, 1, 1), train_ranks=(0,), gen_ranks=(1,))
    assert builders.rollout_spec(cfg, sync).config.dtype == dtype

    actor = _worker(ActorWorker, actor_spec)
    critic = _worker(CriticWorker, critic_spec)
    for model, engine in ((actor.model, actor.train), (critic.model, critic.engine)):
        assert engine.precision is precision
        assert {p.dtype for p in model.params.values()} == {dtype}
        assert (engine.masters is not None) is precision.master_weights
        assert {p.dtype for p in engine.train_params.values()} == {torch.float32}
    assert actor.engine.rollout.engine.config.dtype == dtype  # generation
    reference = _worker(ReferenceWorker, reference_spec)
    reward = _worker(RewardWorker, reward_spec)
    for model, engine in ((reference.model, reference.engine), (reward.model, reward.engine)):
        assert engine.precision is precision and engine.frozen and engine.masters is None
        assert {p.dtype for p in model.params.values()} == {dtype}


def test_builders_refuse_an_unresolved_precision():
    cfg = load_config(TINY)
    assert cfg.precision == "auto"
    with pytest.raises(ValueError, match="precision='auto' is not resolved"):
        builders.actor_spec(cfg, validate_for_world(cfg, 1))


def test_engine_refuses_parameters_of_another_precision():
    """The engine takes the precision and checks the parameters against it (before any
    collective); it never infers it from their dtypes."""
    config = LlamaConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, max_position_embeddings=16,
                         tie_word_embeddings=False)
    m32 = ParallelLlama(config, _groups())
    m16 = ParallelLlama(dataclasses.replace(config, dtype=torch.bfloat16), _groups())
    with pytest.raises(ValueError, match=r"precision=bf16 trains torch.bfloat16 parameters, but "
                                         r"\d+ of the model's are not \(embed_tokens: "
                                         r"torch.float32"):
        TrainEngine(m32, precision=BF16)
    with pytest.raises(ValueError, match=r"precision=fp32 trains torch.float32 parameters, but "
                                         r".*torch.bfloat16"):
        TrainEngine(m16, precision=FP32, frozen=True)
    # given, or (a model built by hand) the precision of its config's dtype
    assert TrainEngine(m16).precision is BF16 and TrainEngine(m16).masters is not None
    assert TrainEngine(m32, precision=FP32).masters is None


def test_precision_values():
    assert Precision.named("bf16") is BF16 and Precision.of_dtype(torch.float32) is FP32
    assert (BF16.param_dtype, BF16.master_weights) == (torch.bfloat16, True)
    assert (FP32.param_dtype, FP32.master_weights) == (torch.float32, False)
    with pytest.raises(ValueError, match="precision='auto' is not resolved"):
        Precision.named("auto")
    with pytest.raises(ValueError, match="precision='fp16' must be one of"):
        Precision.named("fp16")
    with pytest.raises(ValueError, match="no precision has torch.float16 parameters"):
        Precision.of_dtype(torch.float16)


def test_sft_and_main_job_take_the_run_configs_precision():
    from rlhf import main_job, sft

    assert sft.run_device(["device=cpu"]) == (torch.device("cpu"), FP32)
    assert sft.run_device(["device=cpu", "precision=bf16"]) == (torch.device("cpu"), BF16)
    with pytest.raises(ValueError, match="precision='half' must be one of"):
        sft.run_device(["precision=half"])
    # the main job hands the RL run's device and precision (as its config reads the user's
    # overrides) to the SFT phases, which resolve them as rlhf.train does
    assert main_job.sft_device([]) == ["device=auto", "precision=auto"]
    assert main_job.sft_device(["iterations=3", "precision=bf16", "device=cpu"]) == \
        ["device=cpu", "precision=bf16"]
    with pytest.raises(ValueError, match="precision='half' must be one of"):
        main_job.sft_device(["precision=half"])
