"""LoRA on the frozen engine model against PEFT on the transformers model.

Tiny random float32 Llama (Llama-3 RoPE scaling), Qwen2 (tied, q/k/v bias) and Qwen3 (q/k
norm) checkpoints made with transformers, wrapped by ``peft.get_peft_model`` with random A
and B (``init_lora_weights=False``, so that the deltas are not zero): our logits and every
adapter gradient equal PEFT's to float32 rounding at tp=1, tp=2 and pp=2, for all-linear and
for q/v only; the base gets no gradient and the adapters off give the base logits.  Training
steps move the adapters only, with optimizer state for them only, the same on every layout.
"""

from __future__ import annotations

import pytest
import torch

from engine.lora import LoraConfig, init_lora_state_dict, lora_shard_specs, resolve_targets
from engine.model import ParallelLlama
from tests import lora_jobs as jobs
from tests.test_hf_families import hf_config, randomize

FAMILIES = ["llama3", "qwen2_tied", "qwen3"]
TARGETS = {"all": "all-linear", "qv": ["q_proj", "v_proj"]}
RANK, ALPHA, ATOL = 4, 8.0, 2e-5
LAYOUTS = {"tp2": (1, 2, 1), "pp2": (2, 1, 1)}


def peft_param(hf_name: str) -> str:
    return hf_name.replace(".weight", ".default.weight")


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Per (family, targets): the base checkpoint folder, the PEFT model's adapter tensors by
    our spec names, ids, PEFT's logits, base logits and adapter gradients."""
    import peft
    import transformers

    made: dict = {}

    def get(name: str, targets: str) -> dict:
        key = (name, targets)
        if key not in made:
            torch.manual_seed(0)
            hf = transformers.AutoModelForCausalLM.from_config(hf_config(name)).float().eval()
            randomize(hf, seed=FAMILIES.index(name))
            folder = str(tmp_path_factory.mktemp(f"{name}_{targets}"))
            hf.save_pretrained(folder)
            lora = LoraConfig(rank=RANK, alpha=ALPHA, target_modules=TARGETS[targets])
            pm = peft.get_peft_model(hf, peft.LoraConfig(
                r=RANK, lora_alpha=ALPHA, target_modules=TARGETS[targets], lora_dropout=0.0,
                init_lora_weights=False))
            state = peft.get_peft_model_state_dict(pm)
            from engine.hf_interop import read_hf_config
            specs = lora_shard_specs(read_hf_config(folder), 1, lora)
            assert {s.hf_names[0] for s in specs} == set(state)  # PEFT's keys, no more
            adapters = {s.name: state[s.hf_names[0]].clone() for s in specs}
            ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
            logits = pm(input_ids=ids).logits
            logits.pow(2).mean().backward()
            params = dict(pm.named_parameters())
            grads = {s.name: params[peft_param(s.hf_names[0])].grad.clone() for s in specs}
            with torch.no_grad(), pm.disable_adapter():
                base = pm(input_ids=ids).logits
            made[key] = dict(folder=folder, lora=lora, adapters=adapters, ids=ids,
                             logits=logits.detach(), base=base, grads=grads, specs=specs)
        return made[key]

    return get


def _global(specs, ranks: dict[int, dict], key: str) -> dict[str, torch.Tensor]:
    """Global tensors from the ranks' shards (TP slices concatenated on each spec's partition
    dim; replicated ones checked equal on every TP rank); every stage's layers."""
    out = {}
    for spec in specs:
        holders = sorted((r for r in ranks.values() if spec.name in r.get(key, {})),
                         key=lambda r: r["tp_rank"])
        parts = [r[key][spec.name] for r in holders]
        assert parts, spec.name
        if spec.partition_dim is None:
            for p in parts[1:]:
                torch.testing.assert_close(p, parts[0], atol=1e-6, rtol=0)
            out[spec.name] = parts[0]
        else:
            out[spec.name] = torch.cat(parts, dim=spec.partition_dim)
    return out


def _check(case, ranks: dict[int, dict], what: str) -> None:
    last = sorted((r for r in ranks.values() if "logits" in r), key=lambda r: r["tp_rank"])
    logits = torch.cat([r["logits"] for r in last], dim=-1)
    torch.testing.assert_close(logits, case["logits"], atol=ATOL, rtol=0,
                               msg=lambda m: f"{what} logits: {m}")
    base = torch.cat([r["base_logits"] for r in last], dim=-1)
    torch.testing.assert_close(base, case["base"], atol=ATOL, rtol=0,
                               msg=lambda m: f"{what} adapters off: {m}")
    assert (case["logits"] - case["base"]).abs().max() > 1e-2  # the adapters matter
    grads = _global(case["specs"], ranks, "grads")
    for name, g in grads.items():
        ref = case["grads"][name]
        assert ref.abs().max() > 0, name
        torch.testing.assert_close(g, ref, atol=1e-5 * float(ref.abs().max()), rtol=1e-4,
                                   msg=lambda m: f"{what} grad {name}: {m}")


@pytest.mark.parametrize("targets", list(TARGETS))
@pytest.mark.parametrize("name", FAMILIES)
def test_logits_and_gradients_match_peft(pool2, cases, name, targets):
    case = cases(name, targets)
    args = (case["folder"], case["lora"], case["adapters"], case["ids"])
    _check(case, {0: jobs.logits_and_grads(0, 1, (1, 1, 1), *args)}, f"{name} tp1")
    for layout, train in LAYOUTS.items():
        ranks = dict(enumerate(pool2.run(jobs.logits_and_grads, train, *args)))
        _check(case, ranks, f"{name} {layout}")


def _batches() -> list[dict]:
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": torch.randint(0, 64, (2, 10), generator=g)} for _ in range(2)]


def test_training_moves_the_adapters_only_the_same_on_every_layout(pool2, cases):
    case = cases("qwen2_tied", "all")
    args = (case["folder"], case["lora"], case["adapters"], _batches(), 3)
    single = jobs.train_steps(0, 1, (1, 1, 1), *args)
    assert single["base_unchanged"] and not single["masters"]
    assert single["losses"][-1] < single["losses"][0]
    n = single["adapter_numel"]
    assert single["trained_numel"] == single["grad_numel"] == n  # no base gradient buffer
    assert single["optim_numel"] == 2 * n  # Adam moments of the adapters only
    moved = {k: v for k, v in single["adapters"].items()
             if not torch.equal(v, case["adapters"][k])}
    assert set(moved) == set(single["adapters"])
    for layout, train in LAYOUTS.items():
        ranks = dict(enumerate(pool2.run(jobs.train_steps, train, *args)))
        assert all(r["base_unchanged"] for r in ranks.values()), layout
        adapters = _global(case["specs"], ranks, "adapters")
        for k, v in adapters.items():
            torch.testing.assert_close(v, single["adapters"][k], atol=2e-6, rtol=0,
                                       msg=lambda m: f"{layout} {k}: {m}")


def test_bf16_trains_float32_masters_of_the_adapters_only(cases):
    case = cases("llama3", "qv")
    r = jobs.train_steps(0, 1, (1, 1, 1), case["folder"], case["lora"], case["adapters"],
                         _batches(), 2, dtype=torch.bfloat16)
    assert r["masters"] and r["base_unchanged"]
    assert r["trained_numel"] == r["grad_numel"] == r["adapter_numel"]
    assert all(v.dtype == torch.bfloat16 for v in r["adapters"].values())


def test_fresh_adapters_start_exactly_at_the_base(cases):
    """B = 0: step 0 is the base model bit for bit; A is PEFT's Kaiming-uniform."""
    case = cases("qwen3", "all")
    from engine.hf_interop import read_hf_config
    config = read_hf_config(case["folder"])
    fresh = init_lora_state_dict(config, case["lora"], seed=3)
    model = jobs.build((1, 1, 1), case["folder"], case["lora"], fresh)
    with torch.no_grad():
        on = model.local_logits(model.stage_forward(case["ids"]))
        with model.adapters_disabled():
            off = model.local_logits(model.stage_forward(case["ids"]))
    assert torch.equal(on, off)
    a = fresh["layers.0.q_proj.lora_A"]
    bound = 1 / config.hidden_size ** 0.5
    assert float(a.abs().max()) <= bound and float(a.abs().max()) > 0.8 * bound
    assert all(not v.any() for k, v in fresh.items() if k.endswith("lora_B"))


def test_dropout_acts_on_the_training_forward_only(cases):
    case = cases("llama3", "all")
    lora = LoraConfig(rank=RANK, alpha=ALPHA, dropout=0.5)
    model = jobs.build((1, 1, 1), case["folder"], lora, case["adapters"])
    plain = jobs.build((1, 1, 1), case["folder"], case["lora"], case["adapters"])
    ids = case["ids"]
    with torch.no_grad():
        torch.testing.assert_close(model.local_logits(model.stage_forward(ids)),
                                   plain.local_logits(plain.stage_forward(ids)), atol=0, rtol=0)
    torch.manual_seed(1)
    first = model.local_logits(model.stage_forward(ids))
    second = model.local_logits(model.stage_forward(ids))
    assert (first - second).abs().max() > 1e-3


def test_bad_lora_settings_name_the_value():
    with pytest.raises(ValueError, match="lora.rank=0"):
        LoraConfig(rank=0, alpha=8)
    with pytest.raises(ValueError, match="lora.alpha"):
        LoraConfig(rank=4, alpha=0)
    with pytest.raises(ValueError, match="lora.dropout=1.0"):
        LoraConfig(rank=4, alpha=8, dropout=1.0)
    with pytest.raises(ValueError, match="'qproj'"):
        resolve_targets(["qproj", "v_proj"])
    with pytest.raises(ValueError, match="'all_linear'"):
        resolve_targets("all_linear")
    assert resolve_targets(["v_proj", "q_proj"]) == ("q_proj", "v_proj")
    assert isinstance(ParallelLlama, type)


def test_peft_export_loads_in_peft_with_our_logits_and_reads_back(cases, tmp_path):
    """``save_peft_adapter`` writes what ``PeftModel.from_pretrained(base, dir)`` loads with
    our logits; ``read_peft_adapter`` reads it back bit for bit and refuses another rank,
    alpha or module list, naming both."""
    import peft
    import transformers

    from engine.hf_interop import read_hf_config
    from engine.peft_interop import read_peft_adapter, save_peft_adapter

    case = cases("qwen2_tied", "qv")
    config = read_hf_config(case["folder"])
    model = jobs.build((1, 1, 1), case["folder"], case["lora"], case["adapters"])
    save_peft_adapter(model, str(tmp_path), case["folder"])
    base = transformers.AutoModelForCausalLM.from_pretrained(case["folder"]).eval()
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path))
    with torch.no_grad():
        theirs = loaded(input_ids=case["ids"]).logits
        ours = model.local_logits(model.stage_forward(case["ids"]))
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    back = read_peft_adapter(str(tmp_path), config, case["lora"])
    assert set(back) == set(case["adapters"])
    assert all(torch.equal(back[k], v) for k, v in case["adapters"].items())
    with pytest.raises(ValueError, match="lora_alpha=8.*alpha=16"):
        read_peft_adapter(str(tmp_path), config, LoraConfig(rank=RANK, alpha=16.0,
                                                            target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ValueError, match="target_modules"):
        read_peft_adapter(str(tmp_path), config, LoraConfig(rank=RANK, alpha=ALPHA))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        read_peft_adapter(case["folder"], config, case["lora"])


def test_merged_export_equals_peft_merge_and_unload(cases, tmp_path):
    """``save_merged`` writes ``W + s B A`` into the fused tensors' HF parts: transformers
    loads it with PEFT's ``merge_and_unload`` logits; our model's weights are untouched."""
    import peft
    import transformers

    from engine.peft_interop import save_merged, save_peft_adapter

    case = cases("qwen3", "qv")
    model = jobs.build((1, 1, 1), case["folder"], case["lora"], case["adapters"])
    before = {n: p.detach().clone() for n, p in model.params.items()}
    save_merged(model, str(tmp_path / "merged"))
    assert all(torch.equal(p, before[n]) for n, p in model.params.items())
    save_peft_adapter(model, str(tmp_path / "adapter"), case["folder"])
    base = transformers.AutoModelForCausalLM.from_pretrained(case["folder"]).eval()
    reference = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).merge_and_unload()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        want, got = reference(input_ids=case["ids"]).logits, merged(input_ids=case["ids"]).logits
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(got, case["logits"], atol=ATOL, rtol=0)


def test_generation_applies_the_adapters_eagerly_and_compiled(cases):
    """The generation engine with the adapters (unmerged): greedy tokens and log-probs of the
    Python layers equal the training forward's; the compiled static decode steps (inductor's
    CPU backend here) give the same tokens; without the adapters the tokens differ."""
    import torch._dynamo

    from engine.generation import GenerationEngine
    from engine.sampling import SamplingParams

    torch._dynamo.reset()
    counted = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # the process's so far
    case = cases("qwen2_tied", "all")
    model = jobs.build((1, 1, 1), case["folder"], case["lora"], case["adapters"])
    ids = case["ids"][:, :6]
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    outs = {}
    for name, kw, adapters in (("eager", dict(fused_decode=False), True),
                               ("compiled", dict(kv_layout="dense", compile_decode=True), True),
                               ("base", dict(fused_decode=False), False)):
        eng = GenerationEngine(model.config, model.groups, **kw)
        if adapters:
            eng.set_adapters(model.adapter_params, case["lora"])
        eng.set_weights(model.params)
        outs[name] = eng.generate(ids, None, params)
    eager, compiled = outs["eager"], outs["compiled"]
    assert torch.equal(compiled.input_ids, eager.input_ids)
    assert torch.allclose(compiled.log_probs, eager.log_probs, atol=2e-5, rtol=0)
    assert not torch.equal(outs["base"].input_ids, eager.input_ids)
    with torch.no_grad():  # the training forward of the sampled ids: the same log-probs
        logits = model.local_logits(model.stage_forward(eager.input_ids))
    lp = torch.log_softmax(logits[:, 5:-1].float(), -1).gather(
        -1, eager.input_ids[:, 6:, None])[..., 0]
    torch.testing.assert_close(lp, eager.log_probs, atol=1e-4, rtol=0)
    assert 1 <= torch._dynamo.utils.counters["stats"]["unique_graphs"] - counted <= 3
