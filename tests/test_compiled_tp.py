"""The compiled layers under tensor parallelism (engine/compiled_train.py and
engine/compiled_decode.py: the regions between the TP collectives) against the eager
single-process model, on 2 gloo ranks at tp=2 and tp_g=2.

Training: a dense model with every optional weight (q/k/v and o_proj biases, q/k norms),
LoRA adapters on every linear, and a mixture of experts with its router loss (and with its
experts split over the two ranks, expert parallelism inside the TP group; LoRA and the
mixture also with packed micro-batches); forward
log-probs, the loss, the gradient norm and every trained tensor's gradient of one step, each
rank's shard of the reference's.  Generation: the dense model and the mixture, greedy, the
static decode steps of the dense KV cache through the compiled regions at tp_g=2, and on two
pipeline stages (each stage's own static step: eager, compiled, and replayed as faked
graphs): the single process's tokens (no near-tie) and log-probs."""

from __future__ import annotations

from dataclasses import replace

import torch

from engine.generation import GenerationEngine
from engine.llama_spec import LlamaConfig, init_full_state_dict
from engine.lora import LoraConfig, init_lora_state_dict
from engine.model import ParallelLlama, load_adapter_state_dict, load_full_state_dict
from engine.sampling import SamplingParams
from engine.train import OptimConfig, TrainEngine
from hybridflow_comm.expert_layout import ExpertLayout
from hybridflow_comm.groups import build_expert_groups, build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from hybridflow_comm.reshard import Resharder
from tests.near_ties import assert_clear_picks

DENSE = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                    num_heads=4, num_kv_heads=2, tie_word_embeddings=False, qkv_bias=True,
                    o_proj_bias=True, qk_norm=True, model_type="qwen3")
MOE = replace(DENSE, qkv_bias=False, o_proj_bias=False, num_experts=4, num_experts_per_tok=2,
              router_aux_loss_coef=0.05, model_type="qwen3_moe")
LORA = LoraConfig(rank=4, alpha=8.0, target_modules="all-linear")
KINDS = {"dense": (DENSE, None), "lora": (DENSE, LORA), "moe": (MOE, None)}
ATOL = 2e-5
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)


def micro_batches() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(2):
        ids = torch.randint(0, DENSE.vocab_size, (2, 11), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :2 + i] = 0  # left padding
        mask[1, -3:] = 0  # right padding
        out.append({"input_ids": ids, "attention_mask": mask,
                    "advantages": torch.randn(2, 10, generator=g)})
    return out


def loss(outputs: dict, mb: dict) -> torch.Tensor:
    m = (mb["attention_mask"][:, 1:] * mb["attention_mask"][:, :-1]).float()
    return (-outputs["log_probs"] * mb["advantages"] * m).sum() / m.sum()


def weights(kind: str) -> tuple[dict, dict]:
    """The full state dict and adapters (B away from zero, so every adapter matters)."""
    config, lora = KINDS[kind]
    full = init_full_state_dict(config, seed=4, std=0.2)
    adapters = {}
    if lora is not None:
        g = torch.Generator().manual_seed(6)
        adapters = {k: torch.randn(v.shape, generator=g) * 0.1
                    for k, v in init_lora_state_dict(config, lora).items()}
    return full, adapters


def build(kind: str, tp: int, compiled: bool, pp: int = 1, ep: int = 1
          ) -> ParallelLlama | None:
    config, lora = KINDS[kind]
    layout = HybridLayout(ParallelLayout(pp, tp, 1), pp, tp)
    pool = list(range(pp * tp))
    groups = build_hybrid_groups(layout, pool=pool)
    if groups is None:
        return None
    experts = None
    if ep > 1:
        experts = build_expert_groups(ExpertLayout(layout, config.num_experts, ep=ep),
                                      pool=pool)
    model = ParallelLlama(config, groups, lora=lora, compile_layers=compiled,
                          experts=experts)
    full, adapters = weights(kind)
    load_full_state_dict(model, full)
    if lora is not None:
        load_adapter_state_dict(model, adapters)
    return model


def run(model: ParallelLlama, packed: bool = False) -> dict:
    """Log-probs (0 where a token or its predecessor is padding), one step's metrics and the
    trained tensors' gradients by spec name; ``packed``: each micro-batch's real tokens
    packed on one row (``remove_padding``)."""
    eng = TrainEngine(model, OptimConfig(lr=1e-3, max_grad_norm=None))
    mbs = micro_batches()
    outputs = eng.forward(mbs, temperature=1.0, remove_padding=packed)
    real = [mb["attention_mask"][:, 1:] * mb["attention_mask"][:, :-1] for mb in mbs]
    out = {"log_probs": [o["log_probs"] * r for o, r in zip(outputs, real)]
           if model.is_last else []}
    out["metrics"] = eng.train_step(mbs, loss, temperature=1.0, remove_padding=packed)
    out["grads"] = {n: p.grad.clone() for n, p in model.trainable_params().items()}
    return out


def references() -> dict:
    return {kind: run(build(kind, 1, compiled=False)) for kind in KINDS}


def check_kinds(rank: int, world_size: int, refs: dict) -> int:
    """On every rank, compiled, against the single-process reference (padded micro-batches):
    each kind at tp=2, the dense model on two pipeline stages, the mixture with its experts
    over two EP ranks, and LoRA and the mixture at tp=2 with packed micro-batches."""
    from engine import compiled_train, inductor

    inductor.set_enabled(True)
    checks = 0
    runs = [(kind, (1, 2, 1), False) for kind in KINDS] + [
        ("dense", (2, 1, 1), False), ("moe", (1, 2, 2), False), ("lora", (1, 2, 1), True),
        ("moe", (1, 2, 1), True)]
    for kind, (pp, tp, ep), packed in runs:
        model = build(kind, tp, compiled=True, pp=pp, ep=ep)
        if model is None:
            continue
        assert model.compile_layers
        before = _graphs(compiled_train.attention_part)
        got, ref = run(model, packed), refs[kind]
        if packed:  # the packed rows went through the compiled regions, a variant of their own
            assert _graphs(compiled_train.attention_part) > before, kind
        for lp, want in zip(got["log_probs"], ref["log_probs"]):
            torch.testing.assert_close(lp, want, atol=ATOL, rtol=0,
                                       msg=lambda m: f"{kind} log-probs: {m}")
        for key in ("loss", "grad_norm"):
            assert abs(got["metrics"][key] - ref["metrics"][key]) < ATOL, \
                (kind, key, got["metrics"], ref["metrics"])
        specs = {s.name: s for s in model.specs + model.adapter_specs}
        local = {s.name for s in model.local_specs + model.local_adapter_specs}
        assert got["grads"].keys() == local & ref["grads"].keys(), kind
        for name, grad in got["grads"].items():
            want = model.train_shard(ref["grads"][name], specs[name])
            torch.testing.assert_close(grad, want, atol=ATOL, rtol=0,
                                       msg=lambda m: f"{kind} grad {name}: {m}")
            checks += 1
    for fn in (compiled_train.train_layer, compiled_train.attention_part,
               compiled_train.mlp_part, compiled_train.route_part, compiled_train.expert_rows):
        assert _graphs(fn) >= 1, (fn, inductor.compile_counts())
    assert not any(c._broken or c.eager_calls for c in compiled_train.COMPILED), \
        inductor.compile_counts()
    return checks


def _graphs(fn) -> int:
    """Dynamo's compiled variants of one of compiled_train's functions."""
    from engine import inductor

    return inductor.compile_counts().get(fn.__qualname__, {}).get("graphs", 0)


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, DENSE.vocab_size, (5, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[4, :4] = 0
    return ids.masked_fill(mask == 0, 0), mask


def generate(model: ParallelLlama, calls: int = 1, replay: bool = False, **engine_kw):
    """Greedy responses of :func:`prompts` from ``model``'s weights resharded to generation
    (its layout's pp_g, tp_g), by ``calls`` calls of one engine; ``replay``: the calls after
    the first replay their static steps as "graphs" (captures faked on the CPU,
    tests/test_kv_cache_reuse.py).  Returns the last call's output."""
    resharder = Resharder(model.specs, model.groups, buffer=model.buffer)
    resharder.to_generation()
    engine = GenerationEngine(model.config, model.groups, **engine_kw)
    engine.load_weights(resharder)
    for call in range(calls):
        out = engine.generate(*prompts(), GREEDY)
        if replay:
            engine.memory.static.capture = True
    engine.release()
    resharder.to_training()
    return out


def check_generation(rank: int, world_size: int, refs: dict) -> int:
    """On every rank: greedy generation at tp_g=2 through the compiled static decode steps,
    eager and replayed with their all-reduces (faked captures), and on two pipeline stages
    through static steps eager, compiled and replayed (each stage's own step), gives the
    single process's tokens and log-probs."""
    from engine import compiled_decode, inductor
    from engine.cuda_graphs import StaticDecode
    from tests.test_kv_cache_reuse import _fake_capture

    StaticDecode._capture = _fake_capture  # a rank process of this module only
    inductor.set_enabled(True)
    checks = 0
    runs = [(kind, tp, pp, kw) for kind in ("dense", "moe") for tp, pp, kw in (
        (2, 1, dict(compile_decode=True)), (1, 2, dict(compile_decode=True)),
        (1, 2, dict(compile_decode=False, calls=2, replay=True)),
        (2, 1, dict(compile_decode=True, calls=2, replay=True)))]
    for kind, tp, pp, kw in runs:
        model = build(kind, tp, compiled=False, pp=pp)
        if model is None:
            continue
        out = generate(model, kv_layout="dense", **kw)
        assert out.stats["compile_decode"] == kw["compile_decode"], out.stats
        assert (out.stats["graphs_captured"] >= 1) == bool(kw.get("replay")), out.stats
        assert torch.equal(out.input_ids, refs[kind].input_ids), (kind, tp, pp, kw)
        torch.testing.assert_close(out.log_probs, refs[kind].log_probs, atol=ATOL, rtol=0)
        checks += 1
    counts = inductor.compile_counts()
    for name in ("decode_attention_part", "decode_mlp_part", "decode_moe_part", "decode_layer"):
        assert counts.get(name, {}).get("graphs", 0) >= 1, (name, counts)
    assert not any(c._broken or c.eager_calls for c in compiled_decode.COMPILED), counts
    return checks


def test_graphs_apply_on_cuda_with_an_nccl_tp_group_only():
    """Graphs where the step's collectives can be captured: none, or NCCL from 2.9.6 (also
    where the run's groups name a backend per device)."""
    from engine.cuda_graphs import cuda_backend, graphs_apply, tp_backend

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert graphs_apply(cuda, None) and not graphs_apply(cpu, None)
    assert graphs_apply(cuda, "nccl", (2, 21, 5)) and graphs_apply(cuda, "nccl", (2, 9, 6))
    assert not graphs_apply(cuda, "nccl", (2, 9, 5)) and not graphs_apply(cuda, "nccl", None)
    assert not graphs_apply(cuda, "gloo", (2, 21, 5)) and not graphs_apply(cpu, "nccl", (2, 21))
    one = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    assert tp_backend(one.gen_tp) is None and tp_backend(None) is None
    # a run's groups: one backend per device (hybridflow_comm.devices.backend_for)
    from hybridflow_comm.devices import backend_for

    assert cuda_backend(backend_for(cuda)) == "nccl" and cuda_backend("nccl") == "nccl"
    assert cuda_backend("gloo") == "gloo" and cuda_backend("cpu:gloo") is None


def test_compiled_layers_under_tp_match_single_process(pool2):
    refs = references()
    checks = pool2.run(check_kinds, refs)
    assert min(checks) >= 40, checks
    gen_refs = {}
    for kind in ("dense", "moe"):
        model = build(kind, 1, compiled=False)
        gen_refs[kind] = generate(model)
        assert_clear_picks(model, gen_refs[kind], GREEDY)
    assert pool2.run(check_generation, gen_refs) == [8, 8]
