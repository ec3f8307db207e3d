"""Training state offloaded during generation (engine.train_state.OffloadedState): the masters,
Adam state and gradient buffer leave the device (their storages at 0 bytes, every view kept)
and come back bit for bit; a HybridEngine that offloads generates and trains exactly as one that
does not; actor.offload_during_generation reaches the actor's engine."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.hybrid_engine import HybridEngine
from engine.llama_spec import LlamaConfig, init_full_state_dict
from engine.model import ParallelLlama, load_full_state_dict
from engine.sampling import SamplingParams
from engine.train import OptimConfig, TrainEngine
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout

CFG32 = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2,
                    num_heads=4, num_kv_heads=2, rope_theta=500.0, max_position_embeddings=64,
                    tie_word_embeddings=False)
CFG16 = dataclasses.replace(CFG32, dtype=torch.bfloat16)
OPTIM = OptimConfig(lr=1e-2)
PRECISIONS = pytest.mark.parametrize("cfg", [CFG32, CFG16], ids=["fp32", "bf16"])


def _model(cfg: LlamaConfig, device: str = "cpu") -> ParallelLlama:
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(cfg, groups, device=torch.device(device))
    load_full_state_dict(model, init_full_state_dict(CFG32, seed=5, std=0.2))
    return model


def _micro_batches(seed: int, device: torch.device, n: int = 2, rows: int = 3,
                   seq: int = 9) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, CFG32.vocab_size, (rows, seq), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :2] = 0  # left padding
        out.append({"input_ids": ids.masked_fill(mask == 0, 0).to(device),
                    "attention_mask": mask.to(device)})
    return out


def _nll(outputs: dict, mb: dict) -> torch.Tensor:
    keep = mb["attention_mask"][:, 1:].float()
    return -(outputs["log_probs"] * keep).sum() / keep.sum()


def _step(eng: TrainEngine, seed: int) -> dict:
    return eng.train_step(_micro_batches(seed, eng.device), _nll, temperature=1.0)


def _state(eng: TrainEngine) -> dict[str, torch.Tensor]:
    """Copies of everything the training state holds, by a readable key."""
    out = {f"param/{n}": p.detach().clone() for n, p in eng.model.params.items()}
    for n, p in eng.train_params.items():
        out[f"train/{n}"] = p.detach().clone()
        for k, v in eng.optimizer.state[p].items():
            out[f"{k}/{n}"] = v.clone()
    return out


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _offloaded_tensors(eng: TrainEngine) -> list[torch.Tensor]:
    """Every tensor whose storage an offload gives back, reached through its users' views."""
    out = [p.grad for p in eng.train_params.values()]
    out += [v for p in eng.train_params.values() for v in eng.optimizer.state[p].values()]
    if eng.masters is not None:
        out += list(eng.masters.params.values())
    return out


def _expected_nbytes(eng: TrainEngine) -> int:
    """fp32 gradients and moments per element (+ fp32 masters of 16-bit params), plus one
    fp32 step counter per parameter (fused AdamW)."""
    numel = sum(p.numel() for p in eng.model.params.values())
    per_elem = 4 + 8 + (4 if eng.masters is not None else 0)
    return per_elem * numel + 4 * len(eng.model.params)


@PRECISIONS
def test_offload_and_reload_are_bitwise_and_free_the_storage(cfg):
    plain, moved = TrainEngine(_model(cfg), OPTIM), TrainEngine(_model(cfg), OPTIM)
    assert _step(plain, 0) == _step(moved, 0)
    params = {n: p.data_ptr() for n, p in moved.model.params.items()}
    with torch.device("meta"):  # no tensor is created without its device
        freed = moved.offload_train_state()
    assert freed == _expected_nbytes(moved)
    for t in _offloaded_tensors(moved):
        assert t.untyped_storage().nbytes() == 0
    # the parameters stay: same addresses, same values, forward passes run
    assert {n: p.data_ptr() for n, p in moved.model.params.items()} == params
    mb = _micro_batches(7, moved.device)
    _assert_bitwise({str(i): o["log_probs"] for i, o in enumerate(moved.forward(
        mb, temperature=1.0))}, {str(i): o["log_probs"] for i, o in enumerate(plain.forward(
            mb, temperature=1.0))})
    with pytest.raises(RuntimeError, match="offloaded"):
        _step(moved, 1)
    with pytest.raises(RuntimeError, match="already offloaded"):
        moved.offload_train_state()
    with torch.device("meta"):
        moved.reload_train_state()
    with pytest.raises(RuntimeError, match="not offloaded"):
        moved.reload_train_state()
    assert all(t.untyped_storage().nbytes() > 0 for t in _offloaded_tensors(moved))
    _assert_bitwise(_state(moved), _state(plain))
    for seed in (1, 2):
        assert _step(moved, seed) == _step(plain, seed)
    _assert_bitwise(_state(moved), _state(plain))


def test_frozen_engine_has_nothing_to_offload():
    eng = TrainEngine(_model(CFG16), frozen=True)
    assert eng.offload_train_state() == 0
    eng.reload_train_state()


def _hybrid(cfg: LlamaConfig, offload: bool) -> HybridEngine:
    return HybridEngine(_model(cfg), OPTIM, offload_during_generation=offload)


def _generate(engine: HybridEngine, sampling: SamplingParams, check=None):
    ids = torch.randint(1, CFG32.vocab_size, (4, 5), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with engine.generation_mode():
        if check is not None:
            check(engine)
        return engine.generate_sequences(ids.masked_fill(mask == 0, 0), mask, sampling)


@PRECISIONS
def test_hybrid_engine_generates_and_trains_as_without_offload(cfg):
    plain, moved = _hybrid(cfg, False), _hybrid(cfg, True)
    assert _step(plain.train, 0) == _step(moved.train, 0)  # the Adam state exists

    def while_generating(engine: HybridEngine) -> None:
        assert engine.train.offloaded is not None
        assert all(t.untyped_storage().nbytes() == 0 for t in _offloaded_tensors(engine.train))

    for sampling in (SamplingParams(max_new_tokens=6, temperature=0.0),
                     SamplingParams(max_new_tokens=6, temperature=1.3, seed=11)):
        want = _generate(plain, sampling)
        got = _generate(moved, sampling, while_generating)
        assert torch.equal(got.input_ids, want.input_ids)
        assert torch.equal(got.log_probs, want.log_probs)
    assert moved.last_offloaded_nbytes == _expected_nbytes(moved.train)
    assert plain.last_offloaded_nbytes == 0 and moved.train.offloaded is None
    assert _step(moved.train, 1) == _step(plain.train, 1)
    _assert_bitwise(_state(moved.train), _state(plain.train))


def test_state_comes_back_when_generation_raises():
    engine = _hybrid(CFG16, True)
    _step(engine.train, 0)
    before = _state(engine.train)
    with pytest.raises(ValueError, match="top_p"):
        _generate(engine, SamplingParams(top_p=2.0, temperature=0.0))
    assert engine.train.offloaded is None and engine.resharder.mode == "training"
    _assert_bitwise(_state(engine.train), before)


def test_config_key_reaches_the_actor_engine():
    from rlhf import builders
    from rlhf.config import load_config, resolve_devices
    from rlhf.controller import Batch
    from rlhf.workers import ActorWorker
    from rlhf.world_plan import validate_for_world

    tiny = ["actor.model.hidden_size=32", "actor.model.intermediate_size=64",
            "actor.model.num_heads=4", "actor.model.num_kv_heads=2",
            "actor.model.num_layers=2", "actor.layout.tp=1", "actor.layout.gen_tp=1",
            "device=cpu"]
    for value in (False, True):
        cfg, _ = resolve_devices(load_config(
            [*tiny, f"actor.offload_during_generation={str(value).lower()}"]))
        assert cfg.actor.offload_during_generation is value
        spec = builders.actor_spec(cfg, validate_for_world(cfg, 1))
        assert spec.offload_during_generation is value
    worker = ActorWorker.__new__(ActorWorker)
    worker.groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    worker.__init__(spec)
    assert worker.engine.offload_during_generation is True
    ids = torch.randint(1, 10, (2, 4), generator=torch.Generator().manual_seed(0))
    out = worker.generate_sequences(Batch({"input_ids": ids, "attention_mask": torch.ones_like(
        ids)}), SamplingParams(max_new_tokens=3, temperature=0.0))
    assert out["input_ids"].shape == (2, 7)
    # before any update only the gradient buffer exists (fp32 run: no masters, no moments)
    grads = sum(t.numel() * t.element_size() for t in worker.train.grads.flat.values())
    assert worker.engine.last_offloaded_nbytes == grads > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_gives_the_device_memory_back():
    eng = TrainEngine(_model(CFG16, "cuda"), OPTIM)
    _step(eng, 0)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    freed = eng.offload_train_state()
    torch.cuda.synchronize()
    assert freed == _expected_nbytes(eng)
    assert before - torch.cuda.memory_allocated() >= freed
    assert all(t.untyped_storage().nbytes() == 0 for t in _offloaded_tensors(eng))
    eng.reload_train_state()
    torch.cuda.synchronize()
    assert abs(torch.cuda.memory_allocated() - before) <= 1 << 20  # the same blocks again
    plain = TrainEngine(_model(CFG16, "cuda"), OPTIM)
    _step(plain, 0)
    _assert_bitwise(_state(eng), _state(plain))
    assert _step(eng, 1) == _step(plain, 1)
    _assert_bitwise(_state(eng), _state(plain))
