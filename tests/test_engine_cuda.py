"""The engines on a CUDA device (skipped without one): bf16 generation (dense KV cache, with
and without CUDA graphs) against transformers' greedy generate of the same bf16 model, graph
replay against the same static steps run eagerly (bitwise), a second call replaying the
first call's graphs over the engine's KV cache, the training model's bf16 forward
and backward (eager and compiled layers) against the float32 CPU model, the sampler's
uniforms and its compiled whole-vocabulary modes on the GPU against the CPU's, and a printed
(never asserted) decode throughput of eager steps against graphs.

bf16 paths round differently from each other (our layers vs transformers', SDPA kernels vs
the CPU), so greedy tokens are compared up to each row's first near-tie: a row may part from
the reference only at a step whose two largest reference logits are within
:data:`BF16_GAP`; before it every token must be equal.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.generation import GenerationEngine
from engine.hf_interop import config_to_hf, full_to_hf_state_dict
from engine.llama_spec import LlamaConfig, init_full_state_dict, llama_shard_specs
from engine.model import ParallelLlama, load_full_state_dict
from engine.sampling import SamplingParams, SeedStream, clock_uniforms, \
    counter_uniforms_formula
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CFG = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_layers=2,
                  num_heads=4, num_kv_heads=2, rope_theta=500.0, max_position_embeddings=64,
                  tie_word_embeddings=False, dtype=torch.bfloat16)
STD = 0.1
BF16_GAP = 0.25
"""Two bf16 implementations' logits (magnitudes of a few units here) differ by a few bf16
ulps; a step whose two largest logits are further apart picks the same token on both."""
CUDA = torch.device("cuda")


def groups():
    return build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))


def model_on(cfg: LlamaConfig, full: dict, device: torch.device,
             compile_layers: bool | None = None) -> ParallelLlama:
    model = ParallelLlama(cfg, groups(), device=device, compile_layers=compile_layers)
    load_full_state_dict(model, full)
    return model


def prompts(batch: int, plen: int, padded: bool):
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, CFG.vocab_size, (batch, plen), generator=g)
    mask = torch.ones(batch, plen, dtype=torch.long)
    if padded:
        for b in range(batch):
            mask[b, :b % 4] = 0
    return ids.masked_fill(mask == 0, 0), mask


def hf_bf16(full: dict):
    import transformers

    hf = transformers.LlamaForCausalLM(config_to_hf(CFG)).eval()
    sd = full_to_hf_state_dict(full, llama_shard_specs(CFG, 1))
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.generation_config.eos_token_id = None  # every row runs all steps, as ours do
    return hf.to(device=CUDA, dtype=torch.bfloat16)


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_bf16_generation_matches_transformers_greedy(padded, graphs):
    full = init_full_state_dict(CFG, seed=2, std=STD)
    model = model_on(CFG, full, CUDA)
    eng = GenerationEngine(CFG, model.groups, device=CUDA, cuda_graphs=graphs)
    assert not eng.fused_decode  # the C++ kernels are CPU only
    eng.set_weights(model.params)
    ids, mask = prompts(8, 9, padded)
    n = 16
    out = eng.generate(ids, mask, SamplingParams(max_new_tokens=n, temperature=0.0))
    assert out.input_ids.device.type == "cuda" and out.log_probs.dtype == torch.float32
    assert out.stats["kv_layout"] == "dense" and out.stats["cuda_graphs"] == graphs
    hf = hf_bf16(full)
    with torch.no_grad():
        ref = hf.generate(input_ids=ids.to(CUDA), attention_mask=mask.to(CUDA),
                          max_new_tokens=n, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    ref_tokens = ref.sequences[:, ids.shape[1]:]
    logits = torch.stack(ref.logits, dim=1).float()  # [B, n, V]
    top = logits.topk(2, dim=-1).values
    gaps = top[..., 0] - top[..., 1]
    ours = out.responses
    compared = 0
    for row in range(ids.shape[0]):
        differ = (ours[row] != ref_tokens[row]).nonzero()
        first = int(differ[0]) if differ.numel() else n
        compared += first
        if first < n:
            assert float(gaps[row, first]) <= BF16_GAP, (
                f"row {row} parts from transformers at step {first} where its logits are "
                f"{float(gaps[row, first]):.3f} apart: not a near-tie")
    assert compared >= ids.shape[0] * n // 2  # most tokens were compared, not skipped
    # our log-probs of the shared tokens are transformers' log-softmax within bf16 rounding
    ref_lp = torch.log_softmax(logits, -1).gather(-1, ref_tokens[..., None])[..., 0]
    same = (ours == ref_tokens).cumprod(dim=1).bool()
    assert float((out.log_probs - ref_lp).abs()[same].max()) < 0.1


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_bf16_training_forward_and_backward_match_float32_cpu(padded, compiled):
    """The eager and the compiled layers (engine/compiled_train.py, on by default on CUDA)."""
    full = init_full_state_dict(CFG, seed=3, std=STD)
    # the float32 reference reads the bf16-rounded weights: only the compute differs
    full32 = {k: v.float() for k, v in full.items()}
    ref = model_on(replace(CFG, dtype=torch.float32), full32, torch.device("cpu"))
    import torch._dynamo

    from engine import compiled_train

    gpu = model_on(CFG, full, CUDA, compile_layers=compiled)
    assert gpu.compile_layers == compiled
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    ids, mask = prompts(4, 24, padded)
    outs = {}
    for name, model in (("cpu", ref), ("cuda", gpu)):
        x, m = ids.to(model.device), mask.to(model.device)
        hidden = model.stage_forward(x, m if padded else None)
        head = model.head_outputs(hidden, x, temperature=1.0)
        keep = m[:, 1:].float()
        loss = -(head["log_probs"] * keep).sum() / keep.sum()
        loss.backward()
        outs[name] = (head["log_probs"].detach().cpu(), head["entropy"].detach().cpu(),
                      {n: p.grad.float().cpu() for n, p in model.params.items()})
    if compiled:  # the compiled layers ran: a graph was made and none fell back
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs
        assert not compiled_train.compiled_layer._broken
    (lp32, ent32, g32), (lp16, ent16, g16) = outs["cpu"], outs["cuda"]
    keep = mask[:, 1:].bool()
    assert float((lp16 - lp32).abs()[keep].max()) < 0.1
    assert float((ent16 - ent32).abs()[keep].max()) < 0.1
    for n in g32:  # gradients point the same way
        cos = torch.nn.functional.cosine_similarity(g16[n].flatten(), g32[n].flatten(), dim=0)
        assert float(cos) > 0.98, (n, float(cos))


def test_sampler_uniforms_on_the_gpu_equal_the_cpu_ones():
    rows = torch.tensor([0, 3, 5, 40])
    cpu = clock_uniforms(SeedStream(9), rows, 1000)
    gpu = clock_uniforms(SeedStream(9), rows.to(CUDA), 1000)
    assert gpu.device.type == "cuda"
    assert torch.equal(gpu.cpu(), cpu)
    assert torch.equal(counter_uniforms_formula(5, rows.to(CUDA), 77).cpu(),
                       counter_uniforms_formula(5, rows, 77))


def test_compiled_sampler_on_the_gpu_matches_the_cpu_sampler(monkeypatch):
    """The whole-vocabulary modes compiled by Triton (greedy, top_k=1, unfiltered draws, EOS
    banned or not, a subset of rows): tokens as the CPU sampler's but at near-ties, the int64
    SplitMix64 counters bit for bit, log-probs within float32 rounding."""
    from engine import sampling
    from engine.sampling import SeedStream, sample_next
    from tests.test_compiled_sampling import _assert_equal_but_ties, _race
    from tests.test_generation_early_exit import splitmix64_uniform

    rows_ids = torch.tensor([0, 3, (1 << 31) + 7])
    fn = torch.compile(sampling.counter_uniforms_formula, fullgraph=True)
    got = fn(torch.tensor((1 << 63) - 1, device=CUDA), rows_ids.to(CUDA), 50).cpu()
    want = torch.tensor([[splitmix64_uniform((1 << 63) - 1, int(r), j) for j in range(50)]
                         for r in rows_ids], dtype=torch.float64)
    assert torch.equal(got.double(), want)
    monkeypatch.setattr(sampling._whole_vocab, "min_numel", 0)
    g = torch.Generator().manual_seed(1)
    rows = torch.rand(40, generator=g) < 0.6
    logits = torch.randn(int(rows.sum()), 3000, generator=g) * 3
    cases = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, top_k=1),
             SamplingParams(temperature=0.7, seed=11),
             SamplingParams(temperature=1.0, seed=12, eos_token_id=5, min_new_tokens=4)]
    for params in cases:
        for step in (0, 5):
            want, want_lp = sample_next(logits, params, None, SeedStream(params.seed), rows,
                                        step)
            got, got_lp = sample_next(logits.to(CUDA), params, None, SeedStream(params.seed),
                                      rows.to(CUDA), step)
            z = logits / (params.temperature or 1.0)
            if params.banned_token(step) is not None:
                z[:, params.banned_token(step)] = float("-inf")
            scores = z.double() if params.greedy or params.top_k else _race(
                z, SeedStream(params.seed).next(), torch.nonzero(rows).squeeze(1))
            _assert_equal_but_ties(got.cpu(), want, scores)
            same = got.cpu() == want
            torch.testing.assert_close(got_lp.cpu()[same], want_lp[same], atol=1e-5, rtol=0)
    assert sampling._whole_vocab._compiled is not None and not sampling._whole_vocab._broken


def test_sampled_generation_runs_on_the_gpu_like_the_cpu_in_float32():
    """The same float32 model on both devices draws the same tokens (one sampler, the same
    uniforms) wherever no near-tie could flip them."""
    cfg = replace(CFG, dtype=torch.float32)
    full = init_full_state_dict(cfg, seed=4, std=STD)
    ids, mask = prompts(6, 7, padded=True)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5)
    outs = {}
    for device in (torch.device("cpu"), CUDA):
        model = model_on(cfg, full, device)
        eng = GenerationEngine(cfg, model.groups, fused_decode=False, device=device)
        eng.set_weights(model.params)
        outs[device.type] = eng.generate(ids, mask, params)
    cpu, gpu = outs["cpu"], outs["cuda"]
    equal_steps = (cpu.responses == gpu.responses.cpu()).cumprod(dim=1)
    assert float(equal_steps.float().mean()) > 0.8
    same = equal_steps.bool()
    assert float((cpu.log_probs - gpu.log_probs.cpu()).abs()[same].max()) < 1e-3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_graph_replay_equals_the_eager_static_steps_bitwise(temperature, monkeypatch):
    """The same static steps, captured or not, give the same bits: shared prompts, padding,
    rows that end at EOS and at their own limits (in-place compaction, smaller buckets), key
    buckets of 8 positions (a graph per bucket and key bucket)."""
    from engine import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "KEY_STEP", 8)
    full = init_full_state_dict(CFG, seed=6, std=STD)
    model = model_on(CFG, full, CUDA)
    ids, mask = prompts(20, 9, padded=True)
    ids, mask = ids[::2].repeat_interleave(2, 0), mask[::2].repeat_interleave(2, 0)
    first = SamplingParams(max_new_tokens=24, temperature=temperature, seed=4)
    limits = torch.tensor([24, 5, 24, 9, 24] * 4)
    engines = {}
    for graphs in (False, True):
        engines[graphs] = GenerationEngine(CFG, model.groups, device=CUDA, cuda_graphs=graphs)
        engines[graphs].set_weights(model.params)
    # EOS = a token row 0 produces mid-way: rows finish at different steps
    params = replace(first, eos_token_id=int(engines[False].generate(ids, mask, first)
                                             .responses[0, 6]))
    eager, graph = (engines[g].generate(ids, mask, params, max_new_tokens=limits)
                    for g in (False, True))
    assert graph.stats["cuda_graphs"] and not eager.stats["cuda_graphs"]
    assert graph.stats["graphs_captured"] >= 3 and eager.stats["graphs_captured"] == 0
    # the captures' own time, which bench/roofline.py leaves out of a decode step's
    assert 0 < graph.stats["capture_s"] < graph.stats["time_s"] and eager.stats["capture_s"] == 0
    assert graph.stats["compactions"] >= 1
    assert torch.equal(graph.input_ids, eager.input_ids)
    assert torch.equal(graph.attention_mask, eager.attention_mask)
    assert torch.equal(graph.log_probs, eager.log_probs)



def test_graphs_record_the_tp_all_reduces_of_an_nccl_group(monkeypatch):
    """The generation TP group as a one-rank NCCL group (one GPU, so each all-reduce is a real
    NCCL kernel over one rank): the static steps (eager, not compiled: no compile in this
    check) run with their all-reduces, and the graphs record those with the step; replayed,
    the eager static steps' bits.  The process
    group, destroyed after the engines released their graphs, does not hang."""
    import torch.distributed as dist

    from engine import cuda_graphs
    from hybridflow_comm.groups import Group

    if not dist.is_nccl_available() or dist.is_initialized():
        pytest.skip("needs NCCL and no process group of its own")
    monkeypatch.setattr(cuda_graphs, "KEY_STEP", 8)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        nccl = replace(groups(), gen_tp=Group((0,), 0, dist.group.WORLD))
        full = init_full_state_dict(CFG, seed=6, std=STD)
        model = model_on(CFG, full, CUDA)
        ids, mask = prompts(6, 9, padded=True)
        params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=4)
        outs, engines = {}, {}
        for graphs in (False, True):
            engines[graphs] = GenerationEngine(CFG, nccl, device=CUDA, cuda_graphs=graphs,
                                               compile_decode=False)
            engines[graphs].set_weights(model.params)
            outs[graphs] = engines[graphs].generate(ids, mask, params)
        assert engines[True].cuda_graphs and outs[True].stats["graphs_captured"] >= 2
        assert torch.equal(outs[True].input_ids, outs[False].input_ids)
        assert torch.equal(outs[True].log_probs, outs[False].log_probs)
        for engine in engines.values():
            engine.release()
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()

def test_a_second_call_replays_the_first_calls_graphs(monkeypatch):
    """The KV cache and the graphs are the engine's: a second call of the same sizes captures
    nothing and writes the same buffers, with the bits of the first call and of a fresh
    engine; no capture empties torch's allocator cache (the training blocks stay cached);
    release() drops the cache and the graphs."""
    emptied = []
    empty_cache = torch.cuda.empty_cache
    monkeypatch.setattr(torch.cuda, "empty_cache",
                        lambda: emptied.append(True) or empty_cache())
    full = init_full_state_dict(CFG, seed=6, std=STD)
    model = model_on(CFG, full, CUDA)
    ids, mask = prompts(12, 9, padded=True)
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=4)
    engines = []
    for _ in range(2):
        engines.append(GenerationEngine(CFG, model.groups, device=CUDA, cuda_graphs=True,
                                        compile_decode=False))
        engines[-1].set_weights(model.params)
    eng, fresh = engines
    first = eng.generate(ids, mask, params)
    ptr, static = eng.memory.cache.k_buf.data_ptr(), eng.memory.static
    second = eng.generate(ids, mask, params)
    assert first.stats["graphs_captured"] >= 1 and first.stats["capture_s"] > 0
    assert second.stats["graphs_captured"] == 0 and second.stats["capture_s"] == 0
    assert eng.memory.cache.k_buf.data_ptr() == ptr and eng.memory.static is static
    assert static.graph_count == first.stats["graphs_captured"]
    want = fresh.generate(ids, mask, params)
    for out in (first, second):
        assert torch.equal(out.input_ids, want.input_ids)
        assert torch.equal(out.log_probs, want.log_probs)
    assert not emptied
    eng.release()
    assert eng.memory.cache is None and eng.memory.static is None


MOE_CFG = replace(CFG, num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01,
                  qk_norm=True, model_type="qwen3_moe")


@pytest.mark.parametrize("kind", ["lora", "moe"])
def test_compiled_training_layers_of_lora_and_moe_match_eager(kind):
    """The compiled training layers on CUDA for LoRA adapters (inside the compiled layer) and
    a mixture of experts (the attention region, the routing and the experts' products compiled,
    the row counts unbacked sizes): bf16 log-probs and gradients as the eager layers', nothing
    fallen back to eager."""
    from engine import compiled_train
    from engine.lora import LoraConfig, init_lora_state_dict
    from engine.model import load_adapter_state_dict

    cfg = MOE_CFG if kind == "moe" else CFG
    lora = LoraConfig(rank=4, alpha=8.0, target_modules="all-linear") if kind == "lora" else None
    full = init_full_state_dict(cfg, seed=3, std=STD)
    ids, mask = prompts(4, 24, padded=True)
    x, m = ids.to(CUDA), mask.to(CUDA)
    outs = {}
    for compiled in (False, True):
        model = ParallelLlama(cfg, groups(), device=CUDA, lora=lora, compile_layers=compiled)
        load_full_state_dict(model, full)
        if lora is not None:
            g = torch.Generator().manual_seed(5)
            load_adapter_state_dict(model, {k: torch.randn(v.shape, generator=g) * 0.1
                                            for k, v in init_lora_state_dict(cfg, lora).items()})
        assert model.compile_layers == compiled
        head = model.head_outputs(model.stage_forward(x, m), x, temperature=1.0)
        keep = m[:, 1:].float()
        (-(head["log_probs"] * keep).sum() / keep.sum()).backward()
        outs[compiled] = (head["log_probs"].detach().float().cpu(),
                          {n: p.grad.float().cpu() for n, p in model.trainable_params().items()})
    assert not any(c._broken or c.eager_calls for c in compiled_train.COMPILED)
    (lp_e, g_e), (lp_c, g_c) = outs[False], outs[True]
    assert float((lp_c - lp_e).abs()[mask[:, 1:].bool()].max()) < 0.1
    for n in g_e:
        cos = torch.nn.functional.cosine_similarity(g_c[n].flatten(), g_e[n].flatten(), dim=0)
        assert float(cos) > 0.98, (n, float(cos))



def test_compiled_training_layers_take_packed_sequences_through_varlen():
    """A packed micro-batch (three sequences on one row) through the compiled layers, the
    varlen flash kernel traced inside them: bf16 log-probs and gradients as the eager layers'
    (the same varlen kernel, eagerly), nothing fallen back to eager."""
    from engine import compiled_train, inductor
    from engine.attention import PackedSeqs

    full = init_full_state_dict(CFG, seed=3, std=STD)
    packed = PackedSeqs((0, 7, 19, 30))
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, CFG.vocab_size, (1, packed.total), generator=g).to(CUDA)
    outs = {}
    for compiled in (False, True):
        model = model_on(CFG, full, CUDA, compile_layers=compiled)
        head = model.head_outputs(model.stage_forward(ids, None, packed=packed), ids,
                                  temperature=1.0)
        head["log_probs"].float().mean().neg().backward()
        outs[compiled] = (head["log_probs"].detach().float().cpu(),
                          {n: p.grad.float().cpu() for n, p in model.trainable_params().items()})
    assert not any(c._broken or c.eager_calls for c in compiled_train.COMPILED)
    counts = inductor.compile_counts()
    assert counts.get(compiled_train.train_layer.__qualname__, {}).get("graphs", 0) >= 1
    (lp_e, g_e), (lp_c, g_c) = outs[False], outs[True]
    assert float((lp_c - lp_e).abs().max()) < 0.1
    for n in g_e:
        cos = torch.nn.functional.cosine_similarity(g_c[n].flatten(), g_e[n].flatten(), dim=0)
        assert float(cos) > 0.98, (n, float(cos))


def test_captured_and_compiled_decode_of_a_mixture_match_eager():
    """A mixture's static decode steps on CUDA (the sync-free block): replayed as CUDA graphs
    they give the eager steps' tokens and routes bit for bit (routes read from the replayed
    step); compiled and replayed, the same tokens up to near-ties."""
    from engine import compiled_decode

    full = init_full_state_dict(MOE_CFG, seed=3, std=STD)
    model = model_on(MOE_CFG, full, CUDA)
    ids, mask = prompts(6, 12, padded=True)
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    outs = {}
    for name, graphs, compiled in (("eager", False, False), ("graphs", True, False),
                                   ("graphs+compiled", True, True)):
        eng = GenerationEngine(MOE_CFG, model.groups, device=CUDA, cuda_graphs=graphs,
                               compile_decode=compiled, record_routes=True)
        eng.set_weights(model.params)
        outs[name] = eng.generate(ids, mask, params)
        assert outs[name].stats["compile_decode"] == compiled
        assert (outs[name].stats["graphs_captured"] > 0) == graphs
    assert not any(c._broken or c.eager_calls for c in compiled_decode.COMPILED)
    assert torch.equal(outs["graphs"].input_ids, outs["eager"].input_ids)
    assert torch.equal(outs["graphs"].routes, outs["eager"].routes)
    same = (outs["graphs+compiled"].responses == outs["eager"].responses).cumprod(dim=1).bool()
    assert float(same[:, :4].float().mean()) > 0.8  # bf16 near-ties may part a few rows


def test_lora_decode_graphs_match_eager_steps():
    """LoRA adapters in the decode steps replayed as CUDA graphs, with and without the
    compiled layers: the eager steps' greedy tokens up to near-ties, graphs captured, the
    adapters changing the tokens against the base model."""
    from engine.lora import LoraConfig, init_lora_state_dict
    from engine.model import load_adapter_state_dict

    lora = LoraConfig(rank=4, alpha=8.0, target_modules="all-linear")
    full = init_full_state_dict(CFG, seed=3, std=STD)
    model = ParallelLlama(CFG, groups(), device=CUDA, lora=lora)
    load_full_state_dict(model, full)
    g = torch.Generator().manual_seed(5)
    load_adapter_state_dict(model, {k: torch.randn(v.shape, generator=g) * 0.2
                                    for k, v in init_lora_state_dict(CFG, lora).items()})
    ids, mask = prompts(6, 12, padded=True)
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    outs = {}
    for name, graphs, compiled, adapters in (("eager", False, False, True),
                                             ("graphs", True, False, True),
                                             ("graphs+compiled", True, True, True),
                                             ("base", False, False, False)):
        eng = GenerationEngine(CFG, model.groups, device=CUDA, cuda_graphs=graphs,
                               compile_decode=compiled)
        if adapters:
            eng.set_adapters(model.adapter_params, lora)
        eng.set_weights(model.params)
        outs[name] = eng.generate(ids, mask, params)
        assert outs[name].stats["cuda_graphs"] == graphs
        assert (outs[name].stats["graphs_captured"] > 0) == graphs
    eager = outs["eager"].responses
    assert torch.equal(outs["graphs"].responses, eager)  # the same static steps, replayed
    same = (outs["graphs+compiled"].responses == eager).cumprod(dim=1).bool()
    assert float(same[:, :4].float().mean()) > 0.8
    assert not torch.equal(outs["base"].responses, eager)
