"""Mixture-of-experts layers (Qwen3-MoE, Mixtral) against transformers and a float64 loop.

The tiny checkpoints are written by transformers from a config (tests/test_hf_families.py
builds them; that module also runs them at tp=2, pp=2 and dp=2, through generation and a
saved train step).  Here, in one process: logits and the gradient of every tensor against
transformers' autograd (its stacked expert tensors split back into the per-expert names of
the checkpoint), the block against a per-token float64 reference (top-k with and without
renormalisation, experts that get no token), and the configs the engine refuses.
"""

from __future__ import annotations

import re

import pytest
import torch

from engine.hf_interop import config_from_hf, config_to_hf
from engine.llama_spec import LlamaConfig, init_full_state_dict
from engine.lora import ATTENTION, LoraConfig
from engine.megatron_backend import transformer_config
from engine.model import ParallelLlama, load_full_state_dict
from engine.moe import MoeRouting, experts_mask, moe_block
from engine.train import OptimConfig, TrainEngine
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from tests.test_hf_families import COMMON, VOCAB, hf_config, randomize, single_model

FAMILIES = ["qwen3_moe", "mixtral"]


def hf_grad(params: dict, name: str) -> torch.Tensor:
    """The gradient of the checkpoint tensor ``name`` from transformers' in-memory parameters
    (a mixture of experts holds each layer's experts stacked: ``gate_up_proj [E, 2F, H]``,
    gate rows then up rows, and ``down_proj [E, H, F]``; Mixtral's ``block_sparse_moe`` is
    its ``mlp`` in memory)."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    m = re.fullmatch(r"(.*\.experts\.)(\d+)\.(\w+)\.weight", name)
    if m is None:
        return params[name].grad
    prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
    if proj in ("down_proj", "w2"):
        return params[prefix + "down_proj"].grad[e]
    gate_up = params[prefix + "gate_up_proj"].grad[e]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if proj in ("gate_proj", "w1") else gate_up[half:]


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_and_every_gradient_match_transformers(tmp_path, name):
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(name)).float().eval()
    randomize(hf, seed=5)
    hf.save_pretrained(tmp_path)
    model = single_model(str(tmp_path))
    assert model.config.num_experts == 4
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, VOCAB, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, 9:] = 0  # right padding
    out = model.head_outputs(model.stage_forward(ids, mask), ids, with_logits=True,
                             temperature=1.0)
    ref = hf(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(out["logits"][real], ref[real], atol=1e-5, rtol=1e-5)
    m = (mask[:, 1:] * mask[:, :-1]).float()
    ref_lp = torch.log_softmax(ref[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    ((out["log_probs"] * m).sum() / m.sum()).backward()
    ((ref_lp * m).sum() / m.sum()).backward()
    params = dict(hf.named_parameters())
    checked = set()
    for spec in model.specs:
        grad = model.params[spec.name].grad
        parts = spec.fusion.split(grad) if spec.fusion is not None else (grad,)
        for hf_name, part in zip(spec.hf_names, parts):
            want = hf_grad(params, hf_name)
            assert want is not None and want.abs().max() > 0, hf_name
            torch.testing.assert_close(part, want, atol=1e-6, rtol=1e-4,
                                       msg=lambda msg: f"{name} {hf_name}: {msg}")
            checked.add(hf_name)
    assert any(".gate.weight" in n for n in checked)  # the router's gradient too
    assert len(checked) == len(model.specs) + sum(
        len(s.hf_names) - 1 for s in model.specs)


def reference_moe(x: torch.Tensor, w: dict, top_k: int, norm_topk: bool,
                  given: torch.Tensor | None = None) -> torch.Tensor:
    """One token at a time in float64: softmax over the router, its top k (or the ``given
    [N, k]`` experts, where not negative), each chosen expert's SwiGLU (gate/up rows
    interleaved as in ``gate_up``) weighted by its probability and summed."""
    x, out = x.double(), torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        probs = torch.softmax(w["router"].double() @ x[t], -1)
        top, experts = torch.topk(probs, top_k)
        if given is not None and bool((given[t] >= 0).all()):
            experts = given[t]
            top = probs[experts]
        if norm_topk:
            top = top / top.sum()
        for p, e in zip(top, experts.tolist()):
            gu = w[f"experts.{e}.gate_up"].double() @ x[t]
            h = torch.nn.functional.silu(gu[0::2]) * gu[1::2]
            out[t] += p * (w[f"experts.{e}.down_proj"].double() @ h)
    return out


def random_block(g: torch.Generator, E: int, H: int, F: int) -> dict:
    """A router ``[E, H]`` and ``E`` SwiGLU experts of width ``F``, drawn from ``g`` (router,
    then each expert's gate_up and down_proj)."""
    w = {"router": torch.randn(E, H, generator=g)}
    for e in range(E):
        w[f"experts.{e}.gate_up"] = torch.randn(2 * F, H, generator=g) / 4
        w[f"experts.{e}.down_proj"] = torch.randn(H, F, generator=g) / 4
    return w


@pytest.mark.parametrize("norm_topk", [False, True])
def test_block_equals_a_per_token_float64_loop(norm_topk):
    g = torch.Generator().manual_seed(7)
    E, H, F, N = 6, 16, 12, 9
    w = random_block(g, E, H, F)
    w["router"][5] = -50.0 * w["router"][5].abs()  # expert 5 (almost surely) gets no token
    x = torch.randn(N, H, generator=g).abs()
    routing = MoeRouting(top_k=2, norm_topk=norm_topk)
    ref = reference_moe(x, w, 2, norm_topk)
    for batch_shape in ((N,), (3, 3)):  # [N, H] and [B, S, H] give the same rows
        got = moe_block(x.reshape(*batch_shape, H), w, routing, None).reshape(N, H)
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    # every expert's weights get a gradient, zero for the one without tokens
    params = {k: v.clone().requires_grad_() for k, v in w.items()}
    moe_block(x, params, routing, None).square().sum().backward()
    assert params["experts.5.gate_up"].grad is not None
    assert torch.count_nonzero(params["experts.5.gate_up"].grad) == 0
    assert all(torch.count_nonzero(params[f"experts.{e}.down_proj"].grad) > 0
               for e in range(5))


def test_router_replay_imposes_the_recorded_experts():
    """A forward records each layer's experts; replaying them gives the same output bit for
    bit; after the router has changed, replay keeps the recorded experts (weights from the
    new probabilities, as a float64 loop with those experts computes), and a negative entry
    leaves that token to the router."""
    from engine.route_trace import RouteTrace

    g = torch.Generator().manual_seed(8)
    E, H, F, N = 5, 16, 12, 10
    w = random_block(g, E, H, F)
    x = torch.randn(N, H, generator=g)
    routing = MoeRouting(top_k=2, norm_topk=True)
    first = RouteTrace()
    out = moe_block(x, w, routing, None, trace=first)
    recorded = first.recorded()  # [N, 1 layer, k]
    assert recorded.shape == (N, 1, 2)
    assert torch.equal(moe_block(x, w, routing, None, trace=RouteTrace(replay=recorded)), out)
    moved = dict(w, router=w["router"] + torch.randn(E, H, generator=g))
    own = RouteTrace()
    moe_block(x, moved, routing, None, trace=own)
    assert not torch.equal(own.recorded(), recorded)  # the new router picks other experts
    replay = recorded.clone()
    replay[0] = -1  # token 0: the router's own choice
    trace = RouteTrace(replay=replay)
    got = moe_block(x, moved, routing, None, trace=trace)
    given = replay[:, 0].clone()
    torch.testing.assert_close(got.double(), reference_moe(x, moved, 2, True, given),
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(trace.recorded()[1:], recorded[1:])
    assert torch.equal(trace.recorded()[0], own.recorded()[0])


def test_model_records_and_replays_every_layer():
    cfg = config_from_hf(hf_config("mixtral").to_dict())
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(cfg, groups)
    load_full_state_dict(model, init_full_state_dict(cfg, seed=4))
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    from engine.route_trace import RouteTrace

    trace = RouteTrace()
    out = model.stage_forward(ids, routes=trace)
    assert trace.recorded().shape == (14, cfg.num_layers, cfg.num_experts_per_tok)
    again = model.stage_forward(ids, routes=RouteTrace(replay=trace.recorded()))
    assert torch.equal(again, out)


def generation_routes(model, prompts, mask, n_new: int, eos: int, limits=None, **engine_kw):
    """Greedy generation of ``model``'s weights with routes recorded (``limits``: the rows'
    own ``max_new_tokens``)."""
    from engine.generation import GenerationEngine
    from engine.sampling import SamplingParams
    from hybridflow_comm.reshard import Resharder

    resharder = Resharder(model.specs, model.groups, buffer=model.buffer)
    resharder.to_generation()
    engine = GenerationEngine(model.config, model.groups, record_routes=True, **engine_kw)
    engine.load_weights(resharder)
    out = engine.generate(prompts, mask, SamplingParams(max_new_tokens=n_new, temperature=0.0,
                                                        eos_token_id=eos), limits)
    engine.release()
    resharder.to_training()
    return out


def test_experts_split_over_ranks_sum_to_the_whole_block():
    """Generation EP: each rank computes only its experts' pairs (holding only their
    weights); the TP all-reduce's sum over a partition of the experts is the whole block (the
    float64 loop), and an expert outside the subset is never read."""
    g = torch.Generator().manual_seed(8)
    E, H, F, N = 8, 16, 12, 11
    w = random_block(g, E, H, F)
    x = torch.randn(2, N, H, generator=g)
    routing = MoeRouting(top_k=2, norm_topk=True)
    ref = reference_moe(x.reshape(-1, H), w, 2, True).reshape(2, N, H)
    for parts in ([(0, 1, 4, 5), (2, 3, 6, 7)], [(7, 0), (1, 6), (5, 2), (4, 3)]):
        total = torch.zeros_like(ref)
        for part in parts:
            mine = {k: v for k, v in w.items()
                    if not k.startswith("experts.") or int(k.split(".")[1]) in part}
            out = moe_block(x, mine, routing, None, experts=part)
            held = experts_mask(part, E, x.device)  # made once by the generation engine
            assert torch.equal(moe_block(x, mine, routing, None, experts=part,
                                         held_mask=held), out)
            total += out.double()
        torch.testing.assert_close(total, ref, atol=1e-5, rtol=1e-5)


def test_generation_engine_checks_its_experts():
    from engine.generation import GenerationEngine

    cfg = config_from_hf(hf_config("qwen3_moe").to_dict())
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    engine = GenerationEngine(cfg, groups, experts=[3, 1])
    assert engine.experts == (1, 3)
    assert [k for k in engine.required_weights() if ".experts." in k][:2] == \
        ["layers.0.experts.1.gate_up", "layers.0.experts.1.down_proj"]
    for bad in ([1, 1], [cfg.num_experts], []):
        with pytest.raises(ValueError, match=rf"GenerationEngine\(experts=.*need distinct "
                                             rf"experts in \[0, {cfg.num_experts}\)"):
            GenerationEngine(cfg, groups, experts=bad)
    dense = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_layers=2,
                        num_heads=4, num_kv_heads=2, tie_word_embeddings=False)
    with pytest.raises(ValueError, match=r"experts=\[0\]\): the model has no experts"):
        GenerationEngine(dense, groups, experts=[0])


@pytest.mark.parametrize("early_exit,copies,static", [
    (True, 1, None), (False, 1, None), (True, 4, None), (True, 4, "eager"), (True, 4, "compiled")])
def test_generation_records_the_routing_a_training_forward_takes(early_exit, copies, static):
    """The experts generation records for every fed token (shared prefill of identical
    prompts, decode steps, rows leaving early) equal those of one training forward over the
    finished sequences; padding and each row's last token are -1, also where a finished row
    is still fed because too few rows finished to compact (``copies`` x 4 rows whose own
    limits end one row a step: 16 rows keep a finished row running; early_exit=False keeps
    every row; ``static``: the static steps of the dense cache, whose batch buckets pad the
    running rows, eager or through the compiled attention regions, the routed MLP eager)."""
    from engine.route_trace import RouteTrace
    from tests.test_hf_families import prompts as family_prompts

    cfg = config_from_hf(hf_config("qwen3_moe").to_dict())
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(cfg, groups)
    load_full_state_dict(model, init_full_state_dict(cfg, seed=11, std=0.2))
    ids, mask = family_prompts()
    ids, mask = torch.cat([ids, ids[:1]]), torch.cat([mask, mask[:1]])  # a shared prompt
    ids, mask = ids.repeat(copies, 1), mask.repeat(copies, 1)
    limits = None if copies == 1 else (torch.arange(4 * copies) + 1).clamp(max=12)
    kw = {} if static is None else dict(kv_layout="dense", compile_decode=static == "compiled")
    out = generation_routes(model, ids, mask, 12, eos=20, limits=limits, early_exit=early_exit,
                            **kw)
    assert out.stats["compile_decode"] == (static == "compiled")
    routes = out.routes
    assert routes.shape == (4 * copies, out.input_ids.shape[1], cfg.num_layers, 2)
    trace = RouteTrace()
    with torch.no_grad():
        model.stage_forward(out.input_ids, out.attention_mask, routes=trace)
    want = trace.recorded().view(routes.shape)
    real = out.attention_mask.bool()
    last = real.long().cumsum(1) == real.long().sum(1, keepdim=True)  # each row's last token
    fed = real & ~(last & (torch.arange(real.shape[1]) >= out.prompt_length))
    assert bool((routes[~fed] == -1).all())  # padding and each row's last token
    assert torch.equal(routes[fed].long(), want[fed])
    decoded = int(fed[:, out.prompt_length:].sum())
    assert decoded >= 20 and bool((out.response_mask == 0).any()), decoded  # some rows ended


@pytest.mark.parametrize("remove_padding", [False, True])
def test_train_engine_replays_a_micro_batchs_routes(remove_padding):
    """A micro-batch's ``routes`` steer every layer of the training engine's forward (padded
    and packed): imposed experts give the model's own forward with that replay, its own
    recorded routes give its plain forward."""
    from engine.route_trace import RouteTrace

    cfg = config_from_hf(hf_config("mixtral").to_dict())
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(cfg, groups)
    load_full_state_dict(model, init_full_state_dict(cfg, seed=4, std=0.2))
    eng = TrainEngine(model, frozen=True)
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    own = RouteTrace()
    with torch.no_grad():
        model.stage_forward(ids, mask, routes=own)
    recorded = own.recorded().view(2, 9, cfg.num_layers, 2)
    forced = torch.zeros_like(recorded)
    forced[..., 1] = 1  # every token to experts 0 and 1
    forced[~mask.bool()] = -1

    def log_probs(routes=None):
        mb = {"input_ids": ids, "attention_mask": mask}
        if routes is not None:
            mb["routes"] = routes.to(torch.int16)
        return eng.forward([mb], temperature=1.0, remove_padding=remove_padding)[0]["log_probs"]

    real = (mask[:, 1:] * mask[:, :-1]).bool()
    plain = log_probs()
    torch.testing.assert_close(log_probs(recorded)[real], plain[real], atol=1e-6, rtol=0)
    want = model.head_outputs(model.stage_forward(ids, mask, routes=RouteTrace(
        replay=forced.flatten(0, 1))), ids, temperature=1.0)["log_probs"]
    got = log_probs(forced)
    torch.testing.assert_close(got[real], want.detach()[real], atol=1e-5, rtol=0)
    assert (got[real] - plain[real]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="routes .* are not"):
        log_probs(recorded[:, :, :1])


def test_expert_specs_and_layer_keys():
    cfg = config_from_hf(config_to_hf(config_from_hf(hf_config("mixtral").to_dict())).to_dict())
    assert cfg.layer_keys[:5] == ("input_norm", "qkv", "o_proj", "post_norm", "router")
    assert "gate_up" not in cfg.layer_keys and "experts.3.down_proj" in cfg.layer_keys
    assert cfg.routing == MoeRouting(top_k=2, norm_topk=True)


def test_refused_configs():
    import transformers

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                num_kv_heads=2, tie_word_embeddings=False)
    with pytest.raises(ValueError, match="num_experts_per_tok=5 must be an int in"):
        LlamaConfig(**base, model_type="mixtral", num_experts=4, num_experts_per_tok=5)
    with pytest.raises(ValueError, match="num_experts=1 must be an int >= 2"):
        LlamaConfig(**base, model_type="mixtral", num_experts=1)
    with pytest.raises(ValueError, match=r"model_type='mixtral' cannot.*num_experts"):
        LlamaConfig(**base, model_type="mixtral")  # a mixture without experts
    with pytest.raises(ValueError, match=r"model_type='llama' cannot.*num_experts"):
        LlamaConfig(**base, num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="norm_topk_prob"):
        LlamaConfig(**base, model_type="mixtral", num_experts=4, num_experts_per_tok=2,
                    norm_topk_prob=False)
    for bad in (dict(mlp_only_layers=[0]), dict(decoder_sparse_step=2)):
        hf = transformers.Qwen3MoeConfig(**COMMON | dict(num_experts=4) | bad).to_dict()
        with pytest.raises(ValueError, match="every layer must be a mixture of experts"):
            config_from_hf(hf)
    hf = transformers.MixtralConfig(**COMMON | dict(router_jitter_noise=0.1)).to_dict()
    with pytest.raises(ValueError, match="router_jitter_noise"):
        config_from_hf(hf)
    moe = config_from_hf(hf_config("mixtral").to_dict())
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    with pytest.raises(ValueError, match=r"includes \['gate_proj', 'up_proj', 'down_proj'\].*"
                                         r"4 experts, which take no adapters"):
        ParallelLlama(moe, groups, lora=LoraConfig(rank=4, alpha=8))  # all-linear
    with pytest.raises(ValueError, match="num_experts"):
        transformer_config(moe, ParallelLayout(1, 1, 1))


def test_lora_on_the_attention_of_a_mixture_of_experts():
    """Adapters on q/k/v/o of a MoE model: B = 0 gives the base logits, and training moves
    the adapters only."""
    cfg = config_from_hf(hf_config("qwen3_moe").to_dict())
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    base = ParallelLlama(cfg, groups)
    load_full_state_dict(base, init_full_state_dict(cfg, seed=3))
    lora = ParallelLlama(cfg, groups, buffer=base.buffer,
                         lora=LoraConfig(rank=4, alpha=8, target_modules=list(ATTENTION)))
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(lora.stage_forward(ids), base.stage_forward(ids))
    frozen = {n: p.detach().clone() for n, p in lora.params.items()}
    eng = TrainEngine(lora, OptimConfig(lr=1e-2))
    for _ in range(2):
        eng.train_step([{"input_ids": ids}], lambda o, mb: -o["log_probs"].mean(),
                       temperature=1.0)
    assert all(torch.equal(p, frozen[n]) for n, p in lora.params.items())
    assert (lora.stage_forward(ids) - base.stage_forward(ids)).abs().max() > 1e-4


# The load-balancing loss -----------------------------------------------------------------------
def hf_layer_losses(hf, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, list]:
    """transformers' logits and its ``load_balancing_loss_func`` of each layer on its own."""
    import importlib

    family = importlib.import_module(type(hf).__module__)
    out = hf(input_ids=ids, attention_mask=mask, output_router_logits=True)
    c = hf.config
    return out.logits, [family.load_balancing_loss_func(
        (logits,), c.num_experts if hasattr(c, "num_experts") else c.num_local_experts,
        c.num_experts_per_tok, mask) for logits in out.router_logits]


@pytest.mark.parametrize("name", FAMILIES)
def test_router_loss_and_its_gradient_match_transformers(tmp_path, name):
    """Each layer's term equals transformers' load-balancing loss of that layer; the
    gradient of ``log-prob loss + coef * mean over layers`` equals transformers' autograd of
    the same sum (routers included)."""
    import transformers

    from engine.router_loss import RouterLoss

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(name)).float().eval()
    randomize(hf, seed=6)
    hf.save_pretrained(tmp_path)
    model = single_model(str(tmp_path))
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    coef, layers = 0.5, model.config.num_layers
    loss = RouterLoss(coef / layers, mask.flatten().bool())
    out = model.head_outputs(model.stage_forward(ids, mask, router_loss=loss), ids,
                             temperature=1.0)
    logits, want = hf_layer_losses(hf, ids, mask)
    assert len(loss.terms) == len(want) == layers
    for got, ref in zip(loss.terms, want):
        torch.testing.assert_close(got, ref.float(), atol=1e-6, rtol=1e-5)
    m = (mask[:, 1:] * mask[:, :-1]).float()
    ((out["log_probs"] * m).sum() / m.sum()).backward()
    ref_lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    ((ref_lp * m).sum() / m.sum() + coef * torch.stack(want).mean()).backward()
    params = dict(hf.named_parameters())
    for spec in model.specs:
        grad = model.params[spec.name].grad
        parts = spec.fusion.split(grad) if spec.fusion is not None else (grad,)
        for hf_name, part in zip(spec.hf_names, parts):
            torch.testing.assert_close(part, hf_grad(params, hf_name), atol=1e-6, rtol=1e-4,
                                       msg=lambda msg: f"{name} {hf_name}: {msg}")


def test_static_block_equals_the_routed_block():
    """The sync-free block (every held expert over every token, engine/moe_static.py) gives
    the routed block's output within float32 summation order, against the float64 loop too:
    the whole block, a partition of the experts summed (generation EP), a replay of recorded
    routes (the same experts recorded), and compiled through inductor with no graph break."""
    from engine import inductor
    from engine.route_trace import RouteTrace
    from engine.moe_static import static_moe_block

    g = torch.Generator().manual_seed(9)
    E, H, F, N = 6, 16, 12, 7
    w = random_block(g, E, H, F)
    x = torch.randn(N, 1, H, generator=g)
    routing = MoeRouting(top_k=2, norm_topk=True)
    routed, recorded = RouteTrace(), RouteTrace()
    want = moe_block(x, w, routing, None, trace=routed)
    got = static_moe_block(x, w, routing, None, trace=recorded)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.double().reshape(N, H),
                               reference_moe(x.reshape(N, H), w, 2, True), atol=1e-5, rtol=1e-5)
    assert torch.equal(recorded.recorded(), routed.recorded())
    parts = sum(static_moe_block(x, w, routing, None, experts=p) for p in ([0, 4, 5], [3, 1, 2]))
    torch.testing.assert_close(parts, want, atol=1e-5, rtol=1e-5)
    moved = dict(w, router=w["router"] + torch.randn(E, H, generator=g))
    replay = RouteTrace(replay=routed.recorded())
    torch.testing.assert_close(
        static_moe_block(x, moved, routing, None, trace=replay),
        moe_block(x, moved, routing, None, trace=RouteTrace(replay=routed.recorded())),
        atol=1e-5, rtol=1e-5)
    assert torch.equal(replay.recorded(), routed.recorded())
    previous = inductor.set_enabled(True)
    try:
        compiled = torch.compile(lambda t: static_moe_block(t, w, routing, None), fullgraph=True)
        torch.testing.assert_close(compiled(x), got, atol=1e-5, rtol=1e-5)
    finally:
        inductor.set_enabled(previous)


def test_captured_steps_of_a_mixture_record_its_routes(monkeypatch):
    """A mixture's static decode steps are captured (the sync-free block; captures faked on
    the CPU by a "graph" whose replay rewrites the captured outputs, tests/test_kv_cache_reuse
    .py): the routes come out of the replayed step itself, and tokens and routes equal the
    eager static steps'."""
    from engine.cuda_graphs import StaticDecode
    from engine.generation import GenerationEngine
    from engine.sampling import SamplingParams
    from tests.test_hf_families import prompts as family_prompts
    from tests.test_kv_cache_reuse import _fake_capture

    monkeypatch.setattr(StaticDecode, "_capture", _fake_capture)
    cfg = config_from_hf(hf_config("qwen3_moe").to_dict())
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(cfg, groups)
    load_full_state_dict(model, init_full_state_dict(cfg, seed=11, std=0.2))
    ids, mask = family_prompts()
    params = SamplingParams(max_new_tokens=10, temperature=0.0, eos_token_id=20)
    eng = GenerationEngine(cfg, groups, kv_layout="dense", record_routes=True)
    eng.set_weights(model.params)
    eager = eng.generate(ids, mask, params)
    static = eng.memory.static
    static.capture = True  # from now on every step is a "graph" replay
    replayed = eng.generate(ids, mask, params)
    assert replayed.stats["graphs_captured"] == static.graph_count >= 1
    assert torch.equal(replayed.input_ids, eager.input_ids)
    assert torch.equal(replayed.routes, eager.routes)
    fed = eager.attention_mask.bool().clone()
    fed[:, eager.prompt_length:] &= eager.response_mask.cumsum(1) < eager.response_mask.sum(
        1, keepdim=True)
    assert bool((replayed.routes[:, eager.prompt_length:][fed[:, eager.prompt_length:]]
                 >= 0).all())  # every fed response token has its experts
