"""bf16 mixed precision: bf16 parameters and compute, fp32 master weights, gradients and Adam
state (engine.train), fp32 log-prob maths, checkpoints of the masters, bf16 HF checkpoints.

Tolerances.  bf16 keeps 8 significant bits (unit roundoff u = 2**-9 ~ 2e-3).  A mean loss
averages many per-token roundings, so a bf16 run's loss stays within :data:`LOSS_RTOL` = u of
the fp32 run from the same start (seen: <= 3e-4), and a bf16 layout within it of one bf16
process (the summation order changes the roundings).  Logits are single bf16 numbers after two
layers: within :data:`LOGIT_RTOL` = 10 u of the float64 reference, relative to their largest
(seen: 5e-3, transformers' own bf16 forward alike).  Gradient accumulation: fp32 sums of bf16
micro-batch gradients stay within 1e-6 of their float64 sum (seen: 3e-9), while a bf16 running
sum of the same 48 gradients is off by about u (seen: 7e-3).
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode

from engine.hf_interop import (SINGLE_FILE, gather_full_state_dict,
                               load_hf_checkpoint, read_hf_config, save_hf_checkpoint)
from engine.llama_spec import LlamaConfig, init_full_state_dict
from engine.model import ParallelLlama, load_full_state_dict
from engine.train import OptimConfig, TrainEngine
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from rlhf.checkpoint import MOMENTS, read_sharded
from rlhf.workers.common import ShardCheckpoint
from tests.test_engine_model import _hf_model

CFG32 = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2,
                    num_heads=4, num_kv_heads=2, rope_theta=500.0, tie_word_embeddings=False)
CFG16 = dataclasses.replace(CFG32, dtype=torch.bfloat16)
LOSS_RTOL = 2e-3
LOGIT_RTOL = 2e-2
OPTIM = OptimConfig(lr=1e-3)


def _groups(layout=(1, 1, 1)):
    train = ParallelLayout(*layout)
    return build_hybrid_groups(HybridLayout(train, 1, 1), pool=list(range(train.world_size)))


def _start() -> dict[str, torch.Tensor]:
    """One start for every precision: the init rounded to bf16, held in float32."""
    return {k: v.to(torch.bfloat16).float() for k, v in init_full_state_dict(CFG32, 1).items()}


def _model(cfg: LlamaConfig, full: dict[str, torch.Tensor], layout=(1, 1, 1)):
    model = ParallelLlama(cfg, _groups(layout))
    load_full_state_dict(model, full)
    return model


def _micro_batches(n: int, rows: int = 2, seq: int = 10, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, CFG32.vocab_size, (rows, seq), generator=g)
        mask = torch.ones_like(ids)
        mask[0, : int(torch.randint(0, 4, (), generator=g))] = 0  # left padding
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def _nll(outputs: dict, mb: dict) -> torch.Tensor:
    # the losses of rlhf.algos see float32 log-probs from any parameter dtype
    assert outputs["log_probs"].dtype == torch.float32, outputs["log_probs"].dtype
    keep = mb["attention_mask"][:, 1:].float()
    return -(outputs["log_probs"] * keep).sum() / keep.sum()


def _check_mixed_state(model: ParallelLlama, eng: TrainEngine) -> None:
    """Masters, their gradients and Adam moments fp32; params bf16, equal to the masters
    rounded, still the flat buffer's views, with no gradient of their own."""
    for name, p in model.params.items():
        master = eng.train_params[name]
        assert p.dtype == torch.bfloat16 and p.grad is None
        assert master.dtype == master.grad.dtype == torch.float32
        assert p.data_ptr() == model.buffer.train_view(name).data_ptr()
        assert torch.equal(p.detach(), master.detach().to(torch.bfloat16)), name
        state = eng.optimizer.state[master]
        assert all(state[m].dtype == torch.float32 for m in MOMENTS), name
    assert [t.dtype for t in eng.grads.flat.values()] == [torch.float32]


# (a) bf16 steps against the fp32 run -------------------------------------------------------------
def test_bf16_steps_follow_the_fp32_run():
    full = _start()
    m32, m16 = _model(CFG32, full), _model(CFG16, full)
    e32, e16 = TrainEngine(m32, OPTIM), TrainEngine(m16, OPTIM)
    assert e32.masters is None and e32.train_params is m32.params
    mbs = _micro_batches(4)
    for step in range(5):
        l32 = e32.train_step(mbs, _nll, temperature=1.0)["loss"]
        l16 = e16.train_step(mbs, _nll, temperature=1.0)["loss"]
        assert abs(l16 - l32) <= LOSS_RTOL * abs(l32), (step, l16, l32)
        _check_mixed_state(m16, e16)
    # the masters hold what bf16 cannot: Adam's small updates (lr 1e-3 on weights ~0.02)
    finer = sum(int((e16.train_params[n] != p.float()).sum()) for n, p in m16.params.items())
    assert finer > 0
    # and they follow the fp32 run's weights: apart by a small part of how far those moved
    for name, w32 in m32.params.items():
        moved = (w32.detach() - full[name]).norm()
        apart = (e16.train_params[name].detach() - w32.detach()).norm()
        assert apart < 0.2 * moved, (name, apart, moved)


def test_frozen_engine_holds_no_training_state():
    """A reference or reward model's engine: the same forward, and no gradient buffer, master
    weights or optimizer (in bf16 these would be 3x the model's own bytes)."""
    full = _start()
    frozen, trained = (TrainEngine(_model(CFG16, full), OPTIM, frozen=f) for f in (True, False))
    assert frozen.grads is None and frozen.masters is None and frozen.optimizer is None
    assert trained.grads is not None and trained.masters is not None
    mbs = _micro_batches(2)
    outs = [e.forward(mbs, temperature=1.0) for e in (frozen, trained)]
    for a, b in zip(*outs):
        assert torch.equal(a["log_probs"], b["log_probs"])
    with pytest.raises(ValueError, match="train_step on a frozen TrainEngine"):
        frozen.train_step(mbs, _nll, temperature=1.0)


# (b) gradient accumulation in fp32 ---------------------------------------------------------------
def test_micro_batch_gradients_accumulate_in_fp32():
    """Many micro-batches: the engine's fp32 sum of the bf16 micro-batch gradients (caught as
    autograd hands them to the parameters) equals their float64 sum to fp32 precision; a bf16
    running sum of the very same gradients is far off."""
    model = _model(CFG16, _start())
    eng = TrainEngine(model, OptimConfig(lr=1e-6, max_grad_norm=None))
    caught: dict[str, list[torch.Tensor]] = {n: [] for n in model.params}
    for name, p in model.params.items():  # tensor hooks run before the engine's accumulation
        p.register_hook(lambda g, name=name: caught[name].append(g.detach().clone()))
    n = 48
    eng.train_step(_micro_batches(n, rows=1), _nll, temperature=1.0)
    err32 = err16 = norm = 0.0
    for name, grads in caught.items():
        assert len(grads) == n and grads[0].dtype == torch.bfloat16
        ref = torch.stack(grads).double().sum(0)
        running = torch.zeros_like(grads[0])
        for g in grads:
            running += g
        err32 += (eng.train_params[name].grad.double() - ref).pow(2).sum().item()
        err16 += (running.double() - ref).pow(2).sum().item()
        norm += ref.pow(2).sum().item()
    rel32, rel16 = (err32 / norm) ** 0.5, (err16 / norm) ** 0.5
    assert rel32 < 1e-6, rel32
    assert rel16 > 100 * rel32, (rel16, rel32)


# (c) tp=2, dp=2 and pp=2 give what one process gives ---------------------------------------------
LAYOUTS = [(1, 2, 1), (1, 1, 2), (2, 1, 1)]
STEPS = 3


def _run_layout(layout, full: dict, mbs: list[dict]) -> tuple[list[float], dict | None]:
    model = _model(CFG16, full, layout)
    eng = TrainEngine(model, OPTIM)
    dp = model.coords.dp
    share = len(mbs) // layout[2]
    mine = mbs[dp * share:(dp + 1) * share]
    losses = [eng.train_step(mine, _nll, temperature=1.0)["loss"] for _ in range(STEPS)]
    _check_mixed_state(model, eng)
    masters = gather_full_state_dict(model, eng.train_params)
    return losses, masters


def layout_in_bf16(rank: int, world_size: int, layout, full: dict, mbs: list[dict]):
    return _run_layout(layout, full, mbs)


@pytest.fixture(scope="module")
def one_process():
    full, mbs = _start(), _micro_batches(4)
    return full, mbs, _run_layout((1, 1, 1), full, mbs)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_layouts_match_one_process(pool2, one_process, layout):
    full, mbs, (ref_losses, ref_masters) = one_process
    runs = pool2.run(layout_in_bf16, layout, full, mbs)
    losses, masters = runs[0]
    for mine, ref in zip(losses, ref_losses):
        assert abs(mine - ref) <= LOSS_RTOL * abs(ref), (layout, losses, ref_losses)
    for name, ref in ref_masters.items():  # Adam moves each weight by <= ~lr per step
        assert (masters[name] - ref).abs().max() <= STEPS * OPTIM.lr, (layout, name)
    assert runs[1][0] == runs[0][0]  # every rank reports the same loss


# (d) checkpoints of the masters ------------------------------------------------------------------
def _trained(cfg: LlamaConfig, steps: int = 2):
    model = _model(cfg, _start())
    eng = TrainEngine(model, OPTIM)
    for _ in range(steps):
        eng.train_step(_micro_batches(2), _nll, temperature=1.0)
    return model, eng


def _save(model, eng, folder: str) -> None:
    ckpt = ShardCheckpoint(model, eng)
    ckpt.start_save(folder)
    ckpt.finish_save()


def _fresh(cfg: LlamaConfig):
    model = _model(cfg, init_full_state_dict(CFG32, 9))
    return model, TrainEngine(model, OPTIM)


def _state_of(eng: TrainEngine) -> dict:
    return {n: (p.detach().float(), *(eng.optimizer.state[p][m] for m in MOMENTS))
            for n, p in eng.train_params.items()}


def test_bf16_checkpoint_round_trip_is_exact(tmp_path):
    model, eng = _trained(CFG16)
    _save(model, eng, str(tmp_path / "ck"))
    saved = read_sharded(str(tmp_path / "ck"))
    assert saved["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float32  # masters
    other, other_eng = _fresh(CFG16)
    ShardCheckpoint(other, other_eng).load(str(tmp_path / "ck"))
    assert other_eng.step_count == eng.step_count
    before = _state_of(eng)
    for name, want in before.items():
        assert all(torch.equal(a, b) for a, b in zip(_state_of(other_eng)[name], want)), name
    _check_mixed_state(other, other_eng)
    # resume exact: the next step is the same bits in both
    mbs = _micro_batches(2, seed=5)
    assert eng.train_step(mbs, _nll, temperature=1.0) == \
        other_eng.train_step(mbs, _nll, temperature=1.0)
    for name, p in model.params.items():
        assert torch.equal(other_eng.train_params[name], eng.train_params[name]), name
        assert torch.equal(other.params[name], p), name


@pytest.mark.parametrize("saved_cfg, loaded_cfg", [(CFG32, CFG16), (CFG16, CFG32)])
def test_checkpoint_loads_across_precisions(tmp_path, saved_cfg, loaded_cfg):
    """What a checkpoint holds is fp32 either way (fp32 params, or bf16 params' masters): it
    fills the other precision's trained weights and moments exactly, and bf16 params are the
    masters rounded."""
    model, eng = _trained(saved_cfg)
    _save(model, eng, str(tmp_path / "ck"))
    other, other_eng = _fresh(loaded_cfg)
    ShardCheckpoint(other, other_eng).load(str(tmp_path / "ck"))
    mine, want = _state_of(other_eng), _state_of(eng)
    for name in want:
        assert all(torch.equal(a, b) for a, b in zip(mine[name], want[name])), name
    if loaded_cfg.dtype == torch.bfloat16:
        _check_mixed_state(other, other_eng)


# HF checkpoints in bf16 --------------------------------------------------------------------------
class _Float32Watch(TorchDispatchMode):
    """Records every op that reads or makes a float32 tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = [*torch.utils._pytree.tree_leaves((args, kwargs, out))]
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in flat):
            self.seen.append(str(func))
        return out


def _hf_bf16(folder: str):
    """A tiny transformers Llama written by transformers in bf16."""
    hf = _hf_model(CFG32, seed=3).to(torch.bfloat16)
    hf.save_pretrained(folder)
    return hf


def test_bf16_hf_checkpoint_loads_without_float32_and_matches_transformers(tmp_path):
    import transformers

    folder = str(tmp_path / "hf")
    hf = _hf_bf16(folder)
    assert read_hf_config(folder, dtype=torch.bfloat16) == CFG16
    model = ParallelLlama(CFG16, _groups())
    with _Float32Watch() as watch:
        load_hf_checkpoint(model, folder)
    assert watch.seen == []
    with safe_open(os.path.join(folder, SINGLE_FILE), framework="pt") as f:
        for name in ("model.embed_tokens.weight", "model.norm.weight"):
            assert torch.equal(f.get_tensor(name), hf.state_dict()[name])
    ids = torch.randint(0, CFG32.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    ours = TrainEngine(model).forward([{"input_ids": ids}], with_logits=True,
                                      temperature=1.0)[0]["logits"]
    assert ours.dtype == torch.bfloat16
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits  # transformers in bf16
        ref = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float64)(
            input_ids=ids).logits  # the same bf16 weights, float64 maths
    scale = ref.abs().max().item()
    err_ours = (ours.double() - ref).abs().max().item()
    err_theirs = (theirs.double() - ref).abs().max().item()
    assert err_ours <= LOGIT_RTOL * scale, (err_ours, scale)
    assert err_ours <= 2 * err_theirs + 1e-3 * scale, (err_ours, err_theirs)
    torch.testing.assert_close(ours.double(), theirs.double(), rtol=0, atol=LOGIT_RTOL * scale)


def test_hf_export_writes_the_model_dtype(tmp_path):
    src = str(tmp_path / "src")
    _hf_bf16(src)
    model = ParallelLlama(CFG16, _groups())
    load_hf_checkpoint(model, src)
    out = str(tmp_path / "out")
    save_hf_checkpoint(model, out)
    with open(os.path.join(out, "config.json")) as f:
        hf_cfg = json.load(f)
    assert hf_cfg.get("dtype", hf_cfg.get("torch_dtype")) == "bfloat16"
    with safe_open(os.path.join(out, SINGLE_FILE), framework="pt") as f, \
            safe_open(os.path.join(src, SINGLE_FILE), framework="pt") as g:
        assert sorted(f.keys()) == sorted(g.keys())
        for name in f.keys():
            assert torch.equal(f.get_tensor(name), g.get_tensor(name)), name  # bf16, bit-exact
    # an fp32 run reads the bf16 file, cast on load
    m32 = ParallelLlama(CFG32, _groups())
    load_hf_checkpoint(m32, out)
    for name, p in m32.params.items():
        assert p.dtype == torch.float32 and torch.equal(p.to(torch.bfloat16), model.params[name])


# (e) every registered algorithm runs one iteration in bf16 ---------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# one optimizer step per iteration: the step-0 ratio compares the actor with itself
ONE_STEP = ["precision=bf16", "iterations=1", "algo.epochs=1", "data.prompts_per_iter=4",
            "data.samples_per_prompt=2", "data.mini_batch_size=8", "data.micro_batch_size=4",
            "actor.layout.tp=1", "checkpoint.resume=never", "eval_pass_k=0"]


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory):
    import subprocess
    import sys

    from rlhf.programs import algorithm_names

    d = tmp_path_factory.mktemp("bf16")
    spec = {name: [f"algo={name}", *ONE_STEP, f"log.runs_dir={d}", f"log.run_name={name}"]
            for name in algorithm_names()}
    (d / "spec.json").write_text(json.dumps(spec))
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node=1", "-m", "tests.rlhf_jobs", str(d / "spec.json"),
                          str(d / "out.json")], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT),
                         timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return d, json.loads((d / "out.json").read_text())


def test_every_algorithm_runs_in_bf16(bf16_runs):
    from rlhf.programs import algorithm_names

    d, out = bf16_runs
    assert sorted(out) == sorted(algorithm_names())
    for name, run in out.items():
        assert "error" not in run, (name, run.get("traceback"))
        (rec,) = run["records"]
        assert rec["actor/entropy"] > 0, name
        # old log-probs recomputed by the bf16 actor itself: the first step's ratio is 1
        assert rec["actor/ppo_kl"] == 0.0, (name, rec["actor/ppo_kl"])
        assert rec.get("actor/kl", 0.0) == 0.0, (name, rec["actor/kl"])  # reference == actor
        step = d / name / "checkpoints" / "step_00000001"
        dtypes = {role: {t.dtype for k, t in read_sharded(str(step / role)).items()
                         if k.startswith("model.")} for role in ("actor", "reference")
                  if (step / role).is_dir()}
        assert dtypes["actor"] == {torch.float32}, (name, dtypes)  # the masters
        if "reference" in dtypes:
            assert dtypes["reference"] == {torch.bfloat16}, (name, dtypes)
