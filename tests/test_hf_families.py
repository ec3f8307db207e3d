"""The transformers families a verl/TRL user brings, against transformers itself.

Tiny random float32 models (built from a config, ``save_pretrained`` into tmp dirs, nothing
downloaded) of each family: Llama with Llama-3 RoPE scaling (head_dim 16, so that some
frequencies are stretched and some interpolated), Qwen2 with tied embeddings (q/k/v bias), Qwen3 (q/k norm,
attention_bias on q/k/v/o, head_dim 16 != 32/4, a sharded checkpoint with an index file) and
Mistral (sliding window = the run's length), and the mixtures of experts Qwen3-MoE (q/k norm,
4 experts, top 2 without renormalisation) and Mixtral (top 2 of 4, renormalised).  For each:
logits equal transformers' at tp=1, tp=2, pp=2 and dp=2; greedy generation equals ``generate`` for 32 tokens on four generation
layouts; load -> one train step -> ``save_hf_checkpoint`` -> ``from_pretrained`` gives our
logits, and every layout saves the single-process weights.  Plus value heads from
``*ForSequenceClassification``, the slice maths of loading against cutting full tensors, the
kernels' refusal of layers they lack, and the configs the engine refuses.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from engine import forward_paths
from engine.forward_paths import kernels_available
from engine.generation import GenerationEngine
from engine.hf_interop import config_from_hf, config_to_hf, load_hf_checkpoint, \
    read_hf_config, read_hf_head
from engine.hf_shards import hf_reads, hf_shapes, shard_parts
from engine.llama_spec import LlamaConfig, llama_shard_specs
from engine.model import ParallelLlama
from engine.rope import RopeScaling
from engine.train import TrainEngine
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from hybridflow_comm.shard_spec import train_shard
from tests import hf_family_jobs as jobs
from tests.near_ties import assert_no_near_tie

VOCAB, SEQ, N_NEW, ATOL = 64, 12, 32, 1e-4
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
FAMILIES = ["llama3", "qwen2_tied", "qwen3", "mistral", "qwen3_moe", "mixtral"]
# weights whose greedy continuations (hf_greedy) have no near-tie
SEEDS = {"qwen3_moe": 9, "mixtral": 8}
MOE = {"qwen3_moe", "mixtral"}
# the families the C++ decode kernels run: no biases or q/k norms, or q/k/v biases only
KERNEL_DECODE = {"llama3", "mistral", "qwen2_tied"}


def hf_config(name: str):
    import transformers as T

    return {
        "llama3": lambda: T.LlamaConfig(**COMMON | dict(hidden_size=64, rope_parameters=LLAMA3)),
        "qwen2_tied": lambda: T.Qwen2Config(**COMMON | dict(tie_word_embeddings=True)),
        "qwen3": lambda: T.Qwen3Config(**COMMON | dict(head_dim=16, attention_bias=True)),
        "mistral": lambda: T.MistralConfig(**COMMON | dict(sliding_window=64)),
        "qwen3_moe": lambda: T.Qwen3MoeConfig(**COMMON | dict(
            head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
            norm_topk_prob=False, router_aux_loss_coef=0.5)),
        "mixtral": lambda: T.MixtralConfig(**COMMON | dict(num_local_experts=4,
                                                           num_experts_per_tok=2)),
    }[name]()


def randomize(model, seed: int) -> None:
    """Norms near one, every matrix and bias normal(0, 0.2) (HF zeroes biases; large enough
    that greedy continuations are not one repeated token)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.1 if name.endswith("norm.weight") else 0.2
            p.copy_(torch.randn(p.shape, generator=g) * scale
                    + float(name.endswith("norm.weight")))


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, VOCAB, (3, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :6] = 0
    return ids.masked_fill(mask == 0, 0), mask


def checkpoint_names(folder: str) -> set[str]:
    """The tensor names transformers saved (per expert for a mixture of experts, whose
    in-memory experts are stacked 3-D tensors)."""
    from safetensors import safe_open

    names = set()
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), "pt") as st:
                names |= set(st.keys())
    return names


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def hf_greedy(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """transformers' greedy tokens, with no near-tie among its logits (so they are every
    layout's tokens: tests/near_ties.py)."""
    model.generation_config.eos_token_id = None  # 32 tokens on every row
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=N_NEW,
                         do_sample=False, pad_token_id=0, output_scores=True,
                         return_dict_in_generate=True)
    assert_no_near_tie(torch.stack(out.scores, 1))
    return out.sequences[:, ids.shape[1]:]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Per family: checkpoint folder, transformers model, ids and its logits and greedy
    tokens (built lazily, once per module)."""
    import transformers

    made: dict = {}

    def get(name: str) -> dict:
        if name not in made:
            torch.manual_seed(0)
            hf = transformers.AutoModelForCausalLM.from_config(hf_config(name)).float().eval()
            randomize(hf, seed=SEEDS.get(name, FAMILIES.index(name)))
            folder = str(tmp_path_factory.mktemp(name))
            # qwen3: a sharded checkpoint (model.safetensors.index.json + several files)
            hf.save_pretrained(folder, max_shard_size="40KB" if name == "qwen3" else "1GB")
            ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
            p_ids, p_mask = prompts()
            made[name] = dict(hf=hf, folder=folder, ids=ids, logits=hf_logits(hf, ids),
                              prompts=(p_ids, p_mask), tokens=hf_greedy(hf, p_ids, p_mask))
        return made[name]

    return get


def single_model(folder: str, head: str = "lm", **kw) -> ParallelLlama:
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(read_hf_config(folder), groups, head, **kw)
    load_hf_checkpoint(model, folder)
    return model


# Configs ------------------------------------------------------------------------------------
def test_each_family_reads_its_switches(cases):
    want = {  # (model_type, qkv_bias, o_proj_bias, qk_norm, head_dim, window, tied, scaling)
        "llama3": ("llama", False, False, False, 16, None, False, True),
        "qwen2_tied": ("qwen2", True, False, False, 8, None, True, False),
        "qwen3": ("qwen3", True, True, True, 16, None, False, False),
        "mistral": ("mistral", False, False, False, 8, 64, False, False),
        "qwen3_moe": ("qwen3_moe", False, False, True, 16, None, False, False),
        "mixtral": ("mixtral", False, False, False, 8, None, False, False),
    }
    experts = {  # (num_experts, top k, renormalised, expert width, aux loss weight)
        "qwen3_moe": (4, 2, False, 24, 0.5), "mixtral": (4, 2, True, 48, 0.001)}
    for name, w in want.items():
        c = read_hf_config(cases(name)["folder"])
        assert (c.model_type, c.qkv_bias, c.o_proj_bias, c.qk_norm, c.head_dim, c.sliding_window,
                c.tie_word_embeddings, c.rope_scaling is not None) == w, name
        assert read_hf_head(cases(name)["folder"]) == "lm"
        assert (c.num_experts, c.num_experts_per_tok, c.norm_topk_prob, c.intermediate_size,
                c.router_aux_loss_coef) == experts.get(name, (0, 0, True, 48, 0.0)), name
        # config.json written by config_to_hf reads back as the same config
        assert config_from_hf(config_to_hf(c).to_dict()) == c
        assert config_from_hf(config_to_hf(c, "value").to_dict()) == c
    sc = read_hf_config(cases("llama3")["folder"]).rope_scaling
    assert sc == RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=32)


def test_legacy_rope_scaling_key_and_top_level_theta():
    """transformers 4.x config.json: ``rope_theta`` at the top, ``rope_scaling`` with ``type``."""
    hf = dict(COMMON, architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=5e5,
              rope_scaling={k: v for k, v in LLAMA3.items() if k not in ("rope_theta",
                                                                         "rope_type")}
              | {"type": "llama3"})
    c = config_from_hf(hf)
    assert c.rope_theta == 5e5 and c.rope_scaling.factor == 8.0


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 64}))
    with pytest.raises(ValueError) as e:
        read_hf_config(str(tmp_path))
    for name in ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "MistralForCausalLM", "Qwen2ForSequenceClassification"):
        assert name in str(e.value)
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        config_from_hf({"model_type": "gpt2"})


def test_refused_configs(tmp_path):
    import transformers

    transformers.MistralConfig(**COMMON | dict(sliding_window=16)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="sliding_window=16 is shorter than "
                                         "max_position_embeddings=64"):
        read_hf_config(str(tmp_path))
    assert read_hf_config(str(tmp_path), max_position_embeddings=16).sliding_window == 16
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                num_kv_heads=2, tie_word_embeddings=False)
    with pytest.raises(ValueError, match="model_type='llama' cannot"):
        LlamaConfig(**base, qk_norm=True)
    with pytest.raises(ValueError, match="model_type='qwen2' cannot"):
        LlamaConfig(**base, model_type="qwen2")  # Qwen2 always has the q/k/v bias
    with pytest.raises(ValueError, match="model_type='bert' is not supported"):
        LlamaConfig(**base, model_type="bert")
    with pytest.raises(ValueError, match="rope_type"):
        config_from_hf(dict(COMMON, model_type="llama", rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}))
    with pytest.raises(ValueError, match="mlp_bias"):
        config_from_hf(dict(COMMON, model_type="llama", mlp_bias=True))
    cfg = LlamaConfig(**base, max_position_embeddings=16, sliding_window=16,
                      model_type="mistral")
    model = ParallelLlama(cfg, build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1)))
    with pytest.raises(ValueError, match="longer than the model's sliding_window=16"):
        model.stage_forward(torch.zeros(1, 17, dtype=torch.long))


# The slice maths of loading -----------------------------------------------------------------
def _layouts(max_world: int = 8):
    return [(pp, tp, dp) for pp in (1, 2) for tp in (1, 2, 4) for dp in (1, 2)
            if pp * tp * dp <= max_world]


@pytest.mark.parametrize("head", ["lm", "value"])
def test_hf_reads_equal_cutting_the_full_tensor(head):
    """For every spec, layout and rank: the shard filled block by block from the HF tensors
    equals ``train_shard`` of the fused full tensor, and each block is its own chunk."""
    base = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=8,
                num_kv_heads=4, max_position_embeddings=16)
    configs = [LlamaConfig(**base, tie_word_embeddings=True, model_type="qwen3", head_dim=6,
                           qkv_bias=True, o_proj_bias=True, qk_norm=True),
               LlamaConfig(**base, tie_word_embeddings=False, model_type="qwen2",
                           qkv_bias=True)]
    g = torch.Generator().manual_seed(0)
    checks = 0
    for cfg in configs:
        for layout in _layouts():
            train = ParallelLayout(*layout)
            if cfg.num_kv_heads % train.tp or cfg.num_layers % train.pp:
                continue
            for spec in llama_shard_specs(cfg, train.pp, head):
                parts = [torch.randn(s, generator=g) for s in hf_shapes(spec)]
                full = spec.fusion.fuse(*parts) if spec.fusion is not None else parts[0]
                assert tuple(full.shape) == spec.shape
                hf = dict(zip(spec.hf_names, parts))
                for rank in range(train.world_size):
                    want = train_shard(full, spec, train, rank)
                    reads = hf_reads(spec, train, rank)
                    if want is None:
                        assert reads is None
                        continue
                    shard = torch.full(spec.shard_shape(train.tp), float("nan"))
                    views = shard_parts(spec, shard)
                    for r in reads:
                        assert r.hf_shape == tuple(hf[r.hf_name].shape)
                        views[r.part].copy_(hf[r.hf_name][r.index].reshape(views[r.part].shape))
                    assert torch.equal(shard, want), (spec.name, layout, rank)
                    for view in views:  # the views write the shard in place
                        assert view.untyped_storage().data_ptr() == \
                            shard.untyped_storage().data_ptr()
                    checks += 1
    assert checks > 500


# Families against transformers --------------------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
def test_family_matches_transformers(pool2, cases, name, tmp_path):
    """Logits, greedy tokens, train step + save + from_pretrained, on 1 and 2 ranks."""
    import transformers
    from safetensors.torch import load_file

    case = cases(name)
    p_ids, p_mask = case["prompts"]
    args = (case["folder"], case["ids"], p_ids, p_mask, N_NEW, str(tmp_path))
    results = jobs.run_layouts(0, 1, jobs.SINGLE, *args)
    for rank, r in enumerate(pool2.run(jobs.run_layouts, jobs.MULTI, *args)):
        for layout, res in r.items():
            results.setdefault(layout, {})[rank] = res
    results["single"] = {0: results["single"]}
    ref_weights = load_file(os.path.join(tmp_path, "single", "model.safetensors"))
    for layout, ranks in results.items():
        last = sorted((r for r in ranks.values() if r["is_last"] and r["dp_rank"] == 0),
                      key=lambda r: r["tp_rank"])  # one vocab slice per TP rank
        logits = torch.cat([r["logits"] for r in last], dim=-1)
        torch.testing.assert_close(logits, case["logits"], atol=ATOL, rtol=0,
                                   msg=lambda m: f"{name} {layout} logits: {m}")
        for rank, r in ranks.items():
            assert torch.equal(r["tokens"], case["tokens"]), (name, layout, rank, r["tokens"],
                                                              case["tokens"])
            # a mixture of experts: every layer's experts of every fed token, gathered over
            # the generation stages, those of the single process
            single = results["single"][0]["routes"]
            assert (single is None) == (name not in MOE), name
            assert single is None or torch.equal(r["routes"], single), (name, layout, rank)
            # the transition (experts included) receives the minimum, nothing twice
            received, minimum = r["reshard_bytes"]
            assert received == minimum and (received > 0) == (layout == "tp2"), \
                (name, layout, rank, received, minimum)
            assert r["paths"][0] == "python", (layout, r["paths"])  # every prefill
            kernels = ("kernel_stage", "kernel_layers")
            assert r["paths"][1] in (kernels if name in KERNEL_DECODE else ("python",)), \
                (layout, r["paths"])
        if "logits_after" not in last[0]:
            continue
        # a mixture of experts' load-balancing loss: every rank of every layout reports the
        # single process's (summed over the stages, averaged over DP)
        want = results["single"][0].get("router_aux_loss")
        assert (want is not None) == (name in MOE), name
        for r in ranks.values():
            assert r.get("router_aux_loss") == (want if want is None else pytest.approx(
                want, rel=1e-5)), (name, layout)
        folder = os.path.join(tmp_path, layout)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        assert type(hf) is type(case["hf"]) and hf.dtype == torch.float32
        after = torch.cat([r["logits_after"] for r in last], dim=-1)
        assert (after - case["logits"]).abs().max() > 1e-3  # the step moved the weights
        torch.testing.assert_close(hf_logits(hf, case["ids"]), after, atol=ATOL, rtol=0,
                                   msg=lambda m: f"{name} {layout} saved model logits: {m}")
        saved = load_file(os.path.join(folder, "model.safetensors"))
        assert set(saved) == set(ref_weights) == checkpoint_names(case["folder"])
        for k, v in saved.items():
            torch.testing.assert_close(v, ref_weights[k], atol=1e-5, rtol=0,
                                       msg=lambda m: f"{name} {layout} {k} after a step: {m}")


def test_llama3_scaling_changes_the_logits(cases):
    """The scaled frequencies matter in the test model (else the check above proves little)."""
    case = cases("llama3")
    model = single_model(case["folder"])
    cfg = model.config
    plain = LlamaConfig(**(cfg.__dict__ | {"rope_scaling": None}))
    other = ParallelLlama(plain, model.groups)
    with torch.no_grad():
        for n, p in other.params.items():
            p.copy_(model.params[n])
    logits = TrainEngine(other).forward([{"input_ids": case["ids"]}], with_logits=True,
                                        temperature=1.0)
    assert (logits[0]["logits"] - case["logits"]).abs().max() > 1e-2


def test_decode_kernels_decline_o_bias_and_qk_norm(cases):
    model = single_model(cases("qwen3")["folder"])
    assert not kernels_available(torch.float32, model.config.layer_keys)
    assert not GenerationEngine(model.config, model.groups).fused_decode
    with pytest.raises(ValueError, match="kernels lack: \\['q_norm', 'k_norm', 'o_proj_bias'\\]"):
        GenerationEngine(model.config, model.groups, fused_decode=True)
    built = forward_paths._kernels is not None
    for name in ("llama3", "qwen2_tied"):  # q/k/v biases: read by the decode kernels
        cfg = single_model(cases(name)["folder"]).config
        assert kernels_available(torch.float32, cfg.layer_keys) == built


# Value heads --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def score_model(tmp_path_factory):
    """A Qwen3ForSequenceClassification with one label (q/k norm and biases included)."""
    import transformers

    torch.manual_seed(0)
    cfg = hf_config("qwen3")
    cfg.num_labels, cfg.pad_token_id = 1, 0
    hf = transformers.AutoModelForSequenceClassification.from_config(cfg).float().eval()
    randomize(hf, seed=9)
    folder = str(tmp_path_factory.mktemp("score"))
    hf.save_pretrained(folder)
    ids = torch.randint(1, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(2))
    return hf, folder, ids, hf_logits(hf, ids)[:, 0]  # pad id 0 never occurs: last token


def test_value_head_from_sequence_classification(pool2, score_model, tmp_path):
    import transformers

    hf, folder, ids, scores = score_model
    assert read_hf_head(folder) == "value"
    with pytest.raises(ValueError, match="cannot initialise a model with head='lm'"):
        single_model(folder, head="lm")
    single = jobs.value_scores(0, 1, (1, 1, 1), folder, ids, None)
    torch.testing.assert_close(single["values"][:, -1], scores, atol=ATOL, rtol=0)
    out = str(tmp_path / "saved")
    for r in pool2.run(jobs.value_scores, (1, 2, 1), folder, ids, out):
        torch.testing.assert_close(r["values"][:, -1], scores, atol=ATOL, rtol=0)
    back = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert type(back) is type(hf) and back.config.num_labels == 1
    back.config.pad_token_id = 0
    torch.testing.assert_close(hf_logits(back, ids)[:, 0], scores, atol=ATOL, rtol=0)


def test_value_head_from_a_causal_lm_starts_fresh(cases):
    case = cases("mistral")
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(read_hf_config(case["folder"]), groups, "value")
    fresh = model.params["value_head"].detach().clone().fill_(0.5)
    with torch.no_grad():
        model.params["value_head"].copy_(fresh)
    load_hf_checkpoint(model, case["folder"])
    assert torch.equal(model.params["value_head"], fresh)
    assert torch.equal(model.params["norm"], case["hf"].model.norm.weight)
