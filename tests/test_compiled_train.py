"""The training model's compiled decoder layers (engine/compiled_train.py) against the eager
layers and float64: forward, log-probs and every parameter's gradient, causal and padded, two
sequence lengths, with and without gradients, with LoRA adapters and a mixture of experts;
compiled here by inductor's CPU backend (Triton on a GPU).  Tensor parallelism:
tests/test_engine_parallel.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine import compiled_train, inductor
from engine.attention import PackedSeqs
from engine.llama_spec import LlamaConfig, init_full_state_dict
from engine.lora import LoraConfig
from engine.model import ParallelLlama, load_full_state_dict
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout

CFG = LlamaConfig(vocab_size=80, hidden_size=64, intermediate_size=96, num_layers=3,
                  num_heads=4, num_kv_heads=2, rope_theta=500.0, max_position_embeddings=64,
                  tie_word_embeddings=False, qkv_bias=True, model_type="qwen2")
MOE = replace(CFG, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01,
              qkv_bias=False, qk_norm=True, model_type="qwen3_moe")
GROUPS = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))


@pytest.fixture(autouse=True)
def compile_on():
    """Compiling on whatever HYBRIDFLOW_COMPILE says, dynamo's variants counted from zero;
    every test ends with no fallback: no failed compile, no call past the recompile limit."""
    import torch._dynamo

    torch._dynamo.reset()
    for c in compiled_train.COMPILED:
        c.eager_calls = 0
    previous = inductor.set_enabled(True)
    yield
    inductor.set_enabled(previous)
    assert not any(c._broken or c.eager_calls for c in compiled_train.COMPILED)


def _graphs(fn) -> int:
    """Dynamo's compiled variants of one of compiled_train's functions."""
    return inductor.compile_counts().get(fn.__qualname__, {}).get("graphs", 0)


def _model(cfg: LlamaConfig, compiled: bool, lora: LoraConfig | None = None) -> ParallelLlama:
    model = ParallelLlama(cfg, GROUPS, compile_layers=compiled, lora=lora)
    load_full_state_dict(model, init_full_state_dict(cfg, seed=3, std=0.2))
    if lora is not None:  # B away from its zero start, so every adapter has a gradient
        g = torch.Generator().manual_seed(5)
        for p in model.adapter_params.values():
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _batch(batch: int, seq: int, padded: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, CFG.vocab_size, (batch, seq), generator=g)
    if not padded:
        return ids, None
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, :3] = 0  # a left-padded prompt
    mask[1, -4:] = 0  # a right-padded response
    return ids, mask


def _pass(model: ParallelLlama, ids: torch.Tensor, mask: torch.Tensor | None, grad: bool,
          packed: PackedSeqs | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Log-probs of ``ids`` and, with ``grad``, every parameter's gradient of their sum."""
    for p in (model.params | model.adapter_params).values():
        p.grad = None
    with torch.set_grad_enabled(grad):
        hidden = model.stage_forward(ids, mask, packed=packed)
        lp = model.head_outputs(hidden, ids, temperature=1.0)["log_probs"]
        if grad:
            (lp.double().sum() + 1e-3 * hidden.double().pow(2).sum()).backward()
    params = model.params | model.adapter_params
    grads = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
    return lp.detach(), grads


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def test_compile_applies():
    """One rule for every kind of model: asked for (None: CUDA only) and compiling enabled;
    TP, experts and LoRA no longer keep a model eager."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert inductor.compile_applies(None, cuda) and not inductor.compile_applies(None, cpu)
    assert inductor.compile_applies(True, cpu) and not inductor.compile_applies(False, cuda)
    inductor.set_enabled(False)
    assert not inductor.compile_applies(True, cuda)
    assert not ParallelLlama(CFG, GROUPS, compile_layers=True).compile_layers
    inductor.set_enabled(True)
    lora = LoraConfig(rank=2, alpha=4.0, target_modules=("q_proj",))
    assert ParallelLlama(CFG, GROUPS, lora=lora, compile_layers=True).compile_layers
    assert ParallelLlama(MOE, GROUPS, compile_layers=True).compile_layers
    assert not ParallelLlama(CFG, GROUPS).compile_layers  # off on the CPU by default


def test_compiled_layers_match_eager_float32():
    """One compile serves every layer (three here) and, after one recompile, a second length;
    log-probs and gradients equal the eager model's within float32 summation order."""
    import torch._dynamo

    torch._dynamo.reset()
    stats = torch._dynamo.utils.counters["stats"]
    eager, compiled = _model(CFG, False), _model(CFG, True)
    assert compiled.compile_layers and not eager.compile_layers
    counted = stats["unique_graphs"]
    for seq in (12, 17):
        ids, _ = _batch(3, seq, padded=False)
        lp_e, g_e = _pass(eager, ids, None, grad=True)
        lp_c, g_c = _pass(compiled, ids, None, grad=True)
        assert torch.allclose(lp_c, lp_e, atol=2e-5, rtol=0)
        assert g_c.keys() == g_e.keys() == compiled.params.keys()
        for n in g_e:
            assert _rel(g_c[n], g_e[n].double()) < 1e-5, n
    # not one compile per layer or per length: a static one, then sizes symbolic
    assert 1 <= stats["unique_graphs"] - counted <= 2
    for seq, grad in ((12, True), (17, True), (17, False)):  # padding masks, a no-grad pass
        ids, mask = _batch(3, seq, padded=True)
        lp_e, g_e = _pass(eager, ids, mask, grad)
        lp_c, g_c = _pass(compiled, ids, mask, grad)
        real = mask[:, 1:].bool()
        assert torch.allclose(lp_c[real], lp_e[real], atol=2e-5, rtol=0)
        assert g_c.keys() == g_e.keys()
        for n in g_e:
            assert _rel(g_c[n], g_e[n].double()) < 1e-5, n


@pytest.mark.parametrize("padded", [False, True])
def test_compiled_layers_bf16_against_float64(padded):
    """In bf16 the compiled layers keep their fused intermediates in float32: log-probs and
    gradients are no further from the float64 model than the eager bf16 layers'."""
    ids, mask = _batch(3, 12, padded)
    ref_lp, ref_g = _pass(_model(replace(CFG, dtype=torch.float64), False), ids, mask, True)
    bf16 = replace(CFG, dtype=torch.bfloat16)
    errors = {}
    for compiled in (False, True):
        model = _model(bf16, compiled)
        assert model.compile_layers == compiled
        lp, grads = _pass(model, ids, mask, True)
        real = mask[:, 1:].bool() if padded else torch.ones_like(lp, dtype=torch.bool)
        errors[compiled] = (_rel(lp[real], ref_lp[real]),
                            max(_rel(grads[n], ref_g[n]) for n in ref_g))
    (lp_e, g_e), (lp_c, g_c) = errors[False], errors[True]
    assert lp_e < 2e-2 and g_e < 0.15, errors  # bf16's own rounding
    assert lp_c <= 1.5 * lp_e and g_c <= 1.5 * g_e, errors


def test_bf16_train_step_with_compiled_layers():
    """A bf16 TrainEngine step (fp32 gradients added by the parameters' post-accumulate hooks,
    masters, AdamW) over two padded micro-batches: the compiled layers' loss and gradient
    norm are the eager layers' within bf16 rounding, and the masters move alike."""
    from engine.train import OptimConfig, TrainEngine

    bf16 = replace(CFG, dtype=torch.bfloat16)
    mbs = [dict(zip(("input_ids", "attention_mask"), _batch(3, seq, padded=True)))
           for seq in (12, 15)]
    results, moves = {}, {}
    for compiled in (False, True):
        engine = TrainEngine(_model(bf16, compiled), OptimConfig(lr=1e-3, max_grad_norm=None))
        before = torch.cat([m.flatten() for m in engine.masters.flat.values()])
        results[compiled] = engine.train_step(
            mbs, lambda out, mb: -(out["log_probs"] * mb["attention_mask"][:, 1:]).mean(),
            temperature=1.0)
        moves[compiled] = torch.cat([m.flatten() for m in engine.masters.flat.values()]) - before
    eager, comp = results[False], results[True]
    assert abs(comp["loss"] - eager["loss"]) < 1e-2 * abs(eager["loss"])
    assert abs(comp["grad_norm"] - eager["grad_norm"]) < 3e-2 * eager["grad_norm"]
    # Adam's first step moves each master by about lr the gradient's way: the same ways
    assert float((moves[True].abs() > 5e-4).double().mean()) > 0.9
    assert float((moves[True].sign() == moves[False].sign()).double().mean()) > 0.95


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_compiled_layers_take_packed_sequences(kind):
    """Sequences packed on one row through the compiled layers (a dense layer, and a
    mixture's regions; the attention of each sequence on its own as the block-diagonal mask
    on the CPU) against the eager layers' one attention per sequence: log-probs and every
    gradient, for three packings (an empty sequence among them); once sizes are symbolic a
    new packing compiles nothing: the boundaries are a tensor, not guarded on."""
    cfg = MOE if kind == "moe" else CFG
    eager, compiled = _model(cfg, False), _model(cfg, True)
    fn = compiled_train.attention_part if kind == "moe" else compiled_train.train_layer
    graphs = []
    for bounds in ((0, 5, 14), (0, 3, 3, 9, 17), (0, 2, 8, 20)):
        ids, _ = _batch(1, bounds[-1], padded=False)
        packed = PackedSeqs(bounds)
        lp_e, g_e = _pass(eager, ids, None, grad=True, packed=packed)
        lp_c, g_c = _pass(compiled, ids, None, grad=True, packed=packed)
        assert torch.allclose(lp_c, lp_e, atol=2e-5, rtol=0), bounds
        assert g_c.keys() == g_e.keys()
        for n in g_e:
            assert _rel(g_c[n], g_e[n].double()) < 1e-5, (bounds, n)
        graphs.append(_graphs(fn))
    assert graphs[0] >= 1 and graphs[2] == graphs[1]



@pytest.mark.parametrize("padded", [False, True])
def test_compiled_layers_with_lora_match_eager(padded):
    """LoRA adapters on every linear inside the compiled layer: log-probs, every adapter's
    gradient (the base frozen), and the base model with the adapters off."""
    lora = LoraConfig(rank=4, alpha=8.0, target_modules="all-linear")
    eager, compiled = _model(CFG, False, lora), _model(CFG, True, lora)
    ids, mask = _batch(3, 13, padded)
    lp_e, g_e = _pass(eager, ids, mask, grad=True)
    lp_c, g_c = _pass(compiled, ids, mask, grad=True)
    real = mask[:, 1:].bool() if padded else torch.ones_like(lp_e, dtype=torch.bool)
    assert torch.allclose(lp_c[real], lp_e[real], atol=2e-5, rtol=0)
    assert g_c.keys() == g_e.keys() == compiled.adapter_params.keys()
    for n in g_e:
        assert _rel(g_c[n], g_e[n].double()) < 1e-5, n
    with eager.adapters_disabled(), compiled.adapters_disabled():
        base_e, _ = _pass(eager, ids, mask, grad=False)
        base_c, _ = _pass(compiled, ids, mask, grad=False)
    assert torch.allclose(base_c[real], base_e[real], atol=2e-5, rtol=0)
    assert float((base_e[real] - lp_e[real]).abs().max()) > 1e-3  # the adapters mattered
    assert _graphs(compiled_train.train_layer) >= 2  # with adapters and without


def test_compiled_layers_of_a_mixture_match_eager():
    """A mixture of experts (q/k norms, router loss) through the compiled attention region,
    the compiled routing and the compiled experts (their row counts unbacked sizes):
    log-probs, every gradient (router and experts included), the router loss and the
    recorded routes; a replay of those routes gives the same pass."""
    from engine.route_trace import RouteTrace
    from engine.router_loss import RouterLoss

    ids, mask = _batch(3, 12, padded=True)
    runs = {}
    for compiled in (False, True):
        model = _model(MOE, compiled)
        for p in model.params.values():
            p.grad = None
        loss, trace = RouterLoss(0.5), RouteTrace()
        hidden = model.stage_forward(ids, mask, router_loss=loss, routes=trace)
        lp = model.head_outputs(hidden, ids, temperature=1.0)["log_probs"]
        (lp.double().sum() + loss.weighted()).backward()
        grads = {n: p.grad.clone() for n, p in model.params.items() if p.grad is not None}
        with torch.no_grad():
            replayed = model.stage_forward(ids, mask, routes=RouteTrace(replay=trace.recorded()))
        runs[compiled] = (lp.detach(), grads, float(loss.total().detach()), trace.recorded(),
                          replayed)
    (lp_e, g_e, l_e, r_e, h_e), (lp_c, g_c, l_c, r_c, h_c) = runs[False], runs[True]
    real = mask[:, 1:].bool()
    assert torch.allclose(lp_c[real], lp_e[real], atol=2e-5, rtol=0)
    assert abs(l_c - l_e) < 1e-5 and torch.equal(r_c, r_e)
    assert any(".experts." in n for n in g_e) and g_c.keys() == g_e.keys()
    for n in g_e:
        assert _rel(g_c[n], g_e[n].double()) < 1e-5, n
    assert torch.allclose(h_c, h_e, atol=2e-5, rtol=0)
    for part in (compiled_train.attention_part, compiled_train.route_part,
                 compiled_train.expert_rows):
        assert _graphs(part) >= 1, part.__qualname__
    assert _graphs(compiled_train.train_layer) == _graphs(compiled_train.mlp_part) == 0
