"""vLLM rollout adapter without a GPU: the modules import without vllm, the bucket planner by
enumeration, and the adapter driving a stand-in ``LLM`` whose ``collective_rpc`` reaches a fake
worker built on the real worker extension (on one process and on 2 gloo ranks, tp_g = 2):
per-row seeds, EOS and padding against the native engine, sleep and wake over RL iterations.
The ``rollout`` config section, its check before the job and the actor's choice of engine (a
stand-in ``vllm`` module), and ``rollout.max_num_seqs`` waves of the native engine against one
call.  vLLM's own signatures are checked where vllm is installed; the real engine needs a
GPU."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import itertools
import os
import random
import shutil
import subprocess
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from engine.generation import GenerationEngine
from engine.hf_interop import config_to_hf, full_to_hf_state_dict
from engine.hybrid_engine import HybridEngine
from engine.llama_spec import LlamaConfig, init_full_state_dict, llama_shard_specs
from engine.model import ParallelLlama, load_adapter_state_dict, load_full_state_dict
from engine.sampling import SamplingParams
from engine.vllm_rollout import VLLMRollout, WeightBucket, plan_weight_buckets
from engine.train import OptimConfig
from engine.vllm_worker_ext import (DESCRIBE, LOAD_BUCKET, WORKER_EXTENSION,
                                    HybridflowWorkerExtension)
from hybridflow_comm.devices import FP32
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from rlhf.builders import check_rollout_engine
from rlhf.config import PolicyLossConfig, RolloutConfig, load_config
from rlhf.controller import Batch
from rlhf.workers import ActorSpec, ActorWorker, ModelSpec, UpdateSpec
from rlhf.workers.rollout_engine import WavedGeneration, wave_rows
from tests.near_ties import assert_clear_picks
from tests.test_generation_multirank import resharded_model

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, rope_theta=500.0, max_position_embeddings=64,
                  tie_word_embeddings=False)
TIED = LlamaConfig(**(CFG.__dict__ | {"tie_word_embeddings": True}))


# Stand-ins for vLLM ------------------------------------------------------------------------


class RecordingModel:
    """What the worker extension reaches (``model_runner.model``): records every
    ``load_weights`` call as ``[(name, clone, (storage pointer, data pointer))]``; optionally
    forwards the weights to a transformers model."""

    def __init__(self, hf=None) -> None:
        self.calls: list[list[tuple[str, torch.Tensor, tuple[int, int]]]] = []
        self.hf = hf

    def load_weights(self, weights) -> set[str]:
        weights = list(weights)
        self.calls.append([(n, t.clone(), (t.untyped_storage().data_ptr(), t.data_ptr()))
                           for n, t in weights])
        if self.hf is not None:
            self.hf.load_state_dict(dict(weights), strict=False)
        return {n for n, _ in weights}

    def received(self) -> dict[str, torch.Tensor]:
        return {n: t for call in self.calls for n, t, _ in call}


class FakeWorker(HybridflowWorkerExtension):
    """vLLM's worker with the extension among its bases, as vLLM builds it."""

    def __init__(self, tp_size: int = 1, hf=None) -> None:
        self.model_runner = SimpleNamespace(model=RecordingModel(hf))
        self.parallel_config = SimpleNamespace(tensor_parallel_size=tp_size)


SLEEP_TAGS = frozenset({"weights", "kv_cache"})


class FakeLLM:
    """``collective_rpc`` with vLLM's signature (the method by name on every worker, results in
    a list), ``generate`` through transformers' greedy decoding, and vLLM's sleep mode as a
    state machine: ``sleep(level)`` takes the weights and the KV cache off the device,
    ``wake_up(tags)`` brings the named ones back; loading weights needs the weights awake,
    generating needs both.  ``events`` logs every call in order."""

    def __init__(self, workers, hf=None) -> None:
        self.workers, self.hf = workers, hf
        self.rpc: list[str] = []
        self.events: list[tuple] = []
        self.asleep: set[str] = set()

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None) -> list:
        if method == LOAD_BUCKET:
            assert "weights" not in self.asleep, "weights loaded into a sleeping engine"
        self.rpc.append(method)
        self.events.append(("rpc", method))
        return [getattr(w, method)(*args, **(kwargs or {})) for w in self.workers]

    def sleep(self, level=1):
        self.events.append(("sleep", level))
        self.asleep = set(SLEEP_TAGS)

    def wake_up(self, tags=None):
        self.events.append(("wake_up", tuple(tags or SLEEP_TAGS)))
        self.asleep -= set(tags or SLEEP_TAGS)

    def reset_prefix_cache(self):
        self.events.append(("reset_prefix_cache",))

    def generate(self, prompts, sampling_params, use_tqdm=False, lora_request=None):
        assert not self.asleep, f"generate while {sorted(self.asleep)} sleep"
        assert isinstance(sampling_params, list) and len(sampling_params) == len(prompts)
        self.events.append(("generate", len(prompts)))
        self.lora_requests = getattr(self, "lora_requests", []) + [lora_request]
        return self._generate(prompts, sampling_params)

    @torch.no_grad()
    def _generate(self, prompts, params):
        outs = []
        for p, sp in zip(prompts, params):
            assert sp.temperature == 0 and sp.logprobs == 0 and sp.top_k == 0
            ids = torch.tensor([p["prompt_token_ids"]])
            r = self.hf.generate(input_ids=ids, max_new_tokens=sp.max_tokens, do_sample=False,
                                 eos_token_id=(sp.stop_token_ids or [None])[0],
                                 pad_token_id=0, output_scores=True,
                                 return_dict_in_generate=True)
            toks = r.sequences[0, ids.shape[1]:].tolist()
            lps = [{t: SimpleNamespace(logprob=float(torch.log_softmax(s[0].float(), -1)[t]))}
                   for t, s in zip(toks, r.scores)]
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=toks, logprobs=lps)]))
        return outs


def fake_sampling(**kw):
    return SimpleNamespace(**kw)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def check_buckets(calls: list[list[tuple]], cap: int) -> None:
    """Each bucket within the cap unless alone, and greedy: the next tensor would not fit."""
    sizes = [[nbytes(t) for _, t, _ in call] for call in calls]
    for i, s in enumerate(sizes):
        assert s and (sum(s) <= cap or len(s) == 1), (i, s, cap)
        if i + 1 < len(sizes):
            assert sum(s) + sizes[i + 1][0] > cap, (i, s, sizes[i + 1][0], cap)


# Imports -----------------------------------------------------------------------------------


def test_modules_import_without_vllm_and_extension_resolves_by_name():
    """With ``import vllm`` made to fail, both modules load and ``WORKER_EXTENSION`` resolves
    to the class the way vLLM resolves ``worker_extension_cls`` (module path + attribute)."""
    code = (
        "import importlib, sys\n"
        "sys.modules['vllm'] = None\n"
        "import engine.vllm_rollout, engine.vllm_worker_ext as ext\n"
        "mod, _, name = ext.WORKER_EXTENSION.rpartition('.')\n"
        "cls = getattr(importlib.import_module(mod), name)\n"
        "assert cls is ext.HybridflowWorkerExtension, cls\n"
        "loaded = [m for m, v in sys.modules.items() if m.split('.')[0] == 'vllm' and v]\n"
        "assert not loaded, loaded\n"
        "print('ok', ext.WORKER_EXTENSION)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", "engine.vllm_worker_ext.HybridflowWorkerExtension"]
    mod, _, name = WORKER_EXTENSION.rpartition(".")
    assert getattr(importlib.import_module(mod), name) is HybridflowWorkerExtension
    # vLLM refuses extension attributes that clash with its worker's: all ours are prefixed
    ours = [a for a in vars(HybridflowWorkerExtension) if not a.startswith("__")]
    assert ours and all(a.startswith("hybridflow_") for a in ours), ours
    assert {DESCRIBE, LOAD_BUCKET} <= set(ours)


# Bucket planner ----------------------------------------------------------------------------


def check_plan(sizes: list[tuple[str, int]], cap: int, plan: list[WeightBucket]) -> None:
    names = [n for n, _ in sizes]
    size = dict(sizes)
    assert [n for b in plan for n in b.names] == names  # every tensor once, order kept
    start = 0
    for i, b in enumerate(plan):
        assert b.names and b.start == start, (i, b)
        start += len(b.names)
        assert b.nbytes == sum(size[n] for n in b.names)
        assert b.nbytes <= cap or len(b.names) == 1, (cap, b)
        if i + 1 < len(plan):  # greedy: the next bucket's first tensor would not have fit
            assert b.nbytes + size[plan[i + 1].names[0]] > cap, (cap, b, plan[i + 1])


def test_bucket_plan_exhaustive_small():
    """Every sequence of up to 5 tensors over sizes {0, 1, 2, 3, 5}, caps 1..6."""
    count = 0
    for length in range(6):
        for combo in itertools.product((0, 1, 2, 3, 5), repeat=length):
            sizes = [(f"t{i}", s) for i, s in enumerate(combo)]
            for cap in range(1, 7):
                check_plan(sizes, cap, plan_weight_buckets(sizes, cap))
                count += 1
    assert count == 6 * sum(5 ** n for n in range(6))


def test_bucket_plan_random_model_sizes():
    rng = random.Random(0)
    for trial in range(300):
        n = rng.randint(1, 60)
        sizes = [(f"layers.{i}.w", rng.choice([0, 4, 64, 4096, rng.randint(1, 1 << 24)]))
                 for i in range(n)]
        cap = rng.choice([1, 4096, 1 << 20, 1 << 24, 1 << 30])
        plan = plan_weight_buckets(sizes, cap)
        check_plan(sizes, cap, plan)
        if cap >= sum(s for _, s in sizes):
            assert len(plan) == 1, (trial, cap)


def test_bucket_plan_rejects_bad_input():
    for cap in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="cap_bytes"):
            plan_weight_buckets([("a", 1)], cap)
    with pytest.raises(ValueError, match="'b'.*nbytes=-1"):
        plan_weight_buckets([("a", 1), ("b", -1)], 8)
    with pytest.raises(ValueError, match="'a' appears twice"):
        plan_weight_buckets([("a", 1), ("a", 1)], 8)
    assert plan_weight_buckets([], 8) == []


# The adapter on a stand-in engine -----------------------------------------------------------


def one_rank_model(cfg: LlamaConfig = CFG):
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(cfg, groups)
    full = init_full_state_dict(cfg, seed=4, std=0.2)
    load_full_state_dict(model, full)
    return groups, model, full


def test_adapter_loads_generation_views_in_buckets_and_matches_native_engine():
    import transformers

    groups, model, full = one_rank_model()
    hf = transformers.LlamaForCausalLM(config_to_hf(CFG)).eval()  # random weights
    worker = FakeWorker(hf=hf)
    fake = FakeLLM([worker], hf=hf)
    cap = 24 * 1024  # several buckets; the MLP weights (32 KiB) above the cap
    rollout = VLLMRollout(fake, groups.gen_tp, bucket_bytes=cap, sampling_cls=fake_sampling)
    assert fake.rpc == [DESCRIBE]  # checked once, before any weight moves
    engine = HybridEngine(model, rollout=rollout)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, CFG.vocab_size, (3, 5), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ids = ids.masked_fill(mask == 0, 0)
    sp = SamplingParams(max_new_tokens=7, temperature=0.0)
    with engine.generation_mode():
        via_vllm = engine.generate_sequences(ids, mask, sp)
        assert rollout.weights_version == 1
        base = engine.resharder.buffer.storage(torch.float32).untyped_storage().data_ptr()
        views = {n: (base, t.data_ptr()) for n, t in engine.resharder.named_generation_weights()
                 if t.untyped_storage().data_ptr() == base}
    calls = worker.model_runner.model.calls
    assert fake.rpc == [DESCRIBE] + [LOAD_BUCKET] * len(calls) and len(calls) > 2
    want = full_to_hf_state_dict(full, llama_shard_specs(CFG, 1))  # q/k/v, gate/up split
    got = worker.model_runner.model.received()
    assert sorted(n for call in calls for n, _, _ in call) == sorted(want)  # each once
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    # tp_g = 1: what the resharder streams as views of the flat buffer reaches the worker as
    # those views, no copy (the q/k/v parts of the interleaved fused tensor, and the
    # row-parallel weights, are copies in the stream itself)
    assert len(views) >= 9, sorted(views)  # norms, embedding, lm_head, gate/up at least
    sent = {n: ptrs for call in calls for n, _, ptrs in call}
    assert all(sent[n] == ptrs for n, ptrs in views.items()), (views, sent)
    check_buckets(calls, cap)
    assert any(len(c) == 1 and nbytes(c[0][1]) > cap for c in calls)  # the oversize one alone
    stats = rollout.last_load
    assert (stats.buckets, stats.tensors) == (len(calls), len(want))
    assert stats.nbytes == sum(nbytes(t) for t in want.values())
    native = GenerationEngine(CFG, groups)
    native.set_weights(model.params)
    ref = native.generate(ids, mask, sp)
    assert_clear_picks(model, ref, sp)
    assert torch.equal(via_vllm.input_ids, ref.input_ids)
    assert torch.equal(via_vllm.attention_mask, ref.attention_mask)
    torch.testing.assert_close(via_vllm.log_probs, ref.log_probs, atol=1e-5, rtol=0)


def test_lora_actor_loads_the_base_once_and_its_adapters_through_vllms_lora_requests():
    """An actor with LoRA adapters on vLLM: the base is loaded with the first generation phase
    only; every phase writes the adapters (full tensors, PEFT names) as a PEFT folder that
    ``peft`` reads back, with a LoRA request of a new id that each generate call carries;
    the previous version's folder is removed."""
    import peft
    import transformers
    from safetensors.torch import load_file

    from engine.lora import LoraConfig, init_lora_state_dict

    lora = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(CFG, groups, lora=lora)
    load_full_state_dict(model, init_full_state_dict(CFG, seed=4, std=0.2))
    adapters = {k: v + 0.1 for k, v in init_lora_state_dict(CFG, lora, seed=1).items()}
    load_adapter_state_dict(model, adapters)
    hf = transformers.LlamaForCausalLM(config_to_hf(CFG)).eval()
    fake = FakeLLM([FakeWorker(hf=hf)], hf=hf)
    rollout = VLLMRollout(fake, groups.gen_tp, sampling_cls=fake_sampling,
                          lora_request_cls=SimpleNamespace)
    engine = HybridEngine(model, rollout=rollout)
    ids = torch.randint(1, CFG.vocab_size, (2, 4), generator=torch.Generator().manual_seed(0))
    folders = []
    for cycle in range(2):
        loads = fake.rpc.count(LOAD_BUCKET)
        with engine.generation_mode():
            engine.generate_sequences(ids, None, SamplingParams(max_new_tokens=3,
                                                                temperature=0.0))
            request = rollout.lora_request
        assert (fake.rpc.count(LOAD_BUCKET) > loads) == (cycle == 0)  # the base once
        assert fake.lora_requests[-1] is request
        assert request.lora_int_id == engine.version + 1
        folders.append(request.lora_path)
        saved = peft.PeftConfig.from_pretrained(request.lora_path)
        assert (saved.r, saved.lora_alpha) == (4, 8.0)
        assert set(saved.target_modules) == {"q_proj", "v_proj", "down_proj"}
        weights = load_file(os.path.join(request.lora_path, "adapter_model.safetensors"))
        specs = {s.hf_names[0]: s.name for s in model.adapter_specs}
        assert set(weights) == set(specs)
        assert all(torch.equal(weights[k], adapters[n]) for k, n in specs.items())
    assert not os.path.exists(folders[0]) and os.path.exists(folders[1])


def test_build_llm_enables_lora_at_the_actors_rank():
    from engine.vllm_rollout import build_llm

    made = build_llm("DIR", tp_g=1, pp_g=1, world_size=1, dtype="float32", seed=0,
                     gpu_memory_utilization=0.5, max_num_seqs=None, max_lora_rank=32,
                     llm_cls=lambda **kw: kw)
    assert (made["enable_lora"], made["max_lora_rank"], made["max_loras"]) == (True, 32, 1)
    plain = build_llm("DIR", tp_g=1, pp_g=1, world_size=1, dtype="float32", seed=0,
                      gpu_memory_utilization=0.5, max_num_seqs=None, llm_cls=lambda **kw: kw)
    assert "enable_lora" not in plain


def test_adapter_checks_the_engine_before_any_weight_moves():
    groups, _, _ = one_rank_model()

    class Plain:  # vLLM's worker without the extension
        pass

    with pytest.raises(TypeError, match="worker_extension_cls='engine.vllm_worker_ext"):
        VLLMRollout(FakeLLM([Plain()]), groups.gen_tp, sampling_cls=fake_sampling)
    with pytest.raises(ValueError, match="reaches 2 workers.*external_launcher"):
        VLLMRollout(FakeLLM([FakeWorker(), FakeWorker()]), groups.gen_tp,
                    sampling_cls=fake_sampling)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 .* tp_g=1"):
        VLLMRollout(FakeLLM([FakeWorker(tp_size=2)]), groups.gen_tp, sampling_cls=fake_sampling)
    for bad in (0, -5, 2.0, True):
        fake = FakeLLM([FakeWorker()])
        with pytest.raises(ValueError, match="bucket_bytes"):
            VLLMRollout(fake, groups.gen_tp, bucket_bytes=bad, sampling_cls=fake_sampling)
        assert fake.rpc == []


def rank_load(rank: int, world_size: int, cfg: LlamaConfig, train: tuple, gen: tuple,
              full: dict, cap: int) -> dict | None:
    """This rank's model on ``train``, resharded to ``gen``, loaded through the adapter."""
    built = resharded_model(cfg, train, gen, full)
    if built is None:
        return None
    groups, _model, resharder = built
    worker = FakeWorker(tp_size=groups.gen_tp.size)
    rollout = VLLMRollout(FakeLLM([worker]), groups.gen_tp, bucket_bytes=cap,
                          sampling_cls=fake_sampling)
    rollout.load_weights(resharder)
    return {"calls": [[(n, t) for n, t, _ in c] for c in worker.model_runner.model.calls],
            "gen_tp": groups.gen_tp.ranks, "version": rollout.weights_version}


@pytest.mark.parametrize("cfg, train, gen", [(CFG, (1, 2, 1), (1, 2)),
                                             (TIED, (2, 1, 1), (2, 1))])
def test_adapter_on_two_ranks_feeds_full_hf_tensors(pool2, cfg, train, gen):
    """tp_g = 2: both ranks of the generation TP group plan the same buckets and hand their
    worker the full tensors (gathered); pp_g = 2: each stage its own layers, the tied lm_head
    sent once per stage under the embedding's name; together the HF state dict, each tensor
    equal to the single-process one."""
    full = init_full_state_dict(cfg, seed=7, std=0.2)
    want = full_to_hf_state_dict(full, llama_shard_specs(cfg, 1))
    cap = 20 * 1024
    results = pool2.run(rank_load, cfg, train, gen, full, cap)
    covered = []
    for r in results:
        assert r["version"] == 1
        calls = [[(n, t, 0) for n, t in c] for c in r["calls"]]
        check_buckets(calls, cap)
        for call in calls:
            for name, t, _ in call:
                assert torch.equal(t, want[name]), name
        names = [n for c in r["calls"] for n, _ in c]
        assert len(names) == len(set(names))
        covered.append(names)
    if gen[1] == 2:  # one TP group: the same buckets, in the same order, on both ranks
        assert [[n for n, _ in c] for c in results[0]["calls"]] == \
            [[n for n, _ in c] for c in results[1]["calls"]]
        assert sorted(covered[0]) == sorted(want)
    else:  # two stages: their own layers; both hold the tied embedding (the last as lm_head)
        assert set(covered[0]) & set(covered[1]) == {"model.embed_tokens.weight"}
        assert set(covered[0]) | set(covered[1]) == want.keys()


# vLLM itself -------------------------------------------------------------------------------


def test_vllm_signatures_used_by_the_adapter():
    vllm = pytest.importorskip("vllm", reason="vllm is the optional extra (requirements-vllm.txt)")
    rpc = inspect.signature(vllm.LLM.collective_rpc).parameters
    assert {"method", "args", "kwargs", "timeout"} <= rpc.keys(), list(rpc)
    init = inspect.signature(vllm.LLM.__init__).parameters
    engine_fields = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    forwards = any(p.kind is p.VAR_KEYWORD for p in init.values())
    for arg in ("worker_extension_cls", "logprobs_mode", "distributed_executor_backend",
                "enable_sleep_mode", "load_format", "skip_tokenizer_init", "max_num_seqs",
                "gpu_memory_utilization", "pipeline_parallel_size", "data_parallel_size"):
        assert arg in init or (forwards and arg in engine_fields), arg
    assert "level" in inspect.signature(vllm.LLM.sleep).parameters
    assert "tags" in inspect.signature(vllm.LLM.wake_up).parameters
    assert callable(vllm.LLM.reset_prefix_cache)
    gen = inspect.signature(vllm.LLM.generate).parameters
    assert {"prompts", "sampling_params", "use_tqdm"} <= gen.keys(), list(gen)
    sp = vllm.SamplingParams(max_tokens=4, temperature=0.7, top_k=0, top_p=0.9, seed=1,
                             logprobs=0, stop_token_ids=[2], min_tokens=1, detokenize=False)
    assert (sp.max_tokens, sp.top_k, sp.logprobs, sp.stop_token_ids) == (4, 0, 0, [2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM rollout needs a GPU")
def test_real_vllm_greedy_matches_native(tmp_path, monkeypatch):
    vllm = pytest.importorskip("vllm")
    from engine.hf_interop import save_hf_checkpoint

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # worker in this process
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(CFG, groups)
    load_full_state_dict(model, init_full_state_dict(CFG, seed=4, std=0.2))
    save_hf_checkpoint(model, str(tmp_path))
    # dummy (random) weights: only the adapter's load gives vLLM the model's
    llm = vllm.LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True,
                   gpu_memory_utilization=0.2, enforce_eager=True, load_format="dummy",
                   worker_extension_cls=WORKER_EXTENSION, logprobs_mode="processed_logprobs",
                   enable_sleep_mode=True)
    rollout = VLLMRollout(llm, groups.gen_tp, bucket_bytes=16 * 1024)
    engine = HybridEngine(model, rollout=rollout)
    ids = torch.randint(1, CFG.vocab_size, (2, 5))
    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    with engine.generation_mode():
        out = engine.generate_sequences(ids, None, sp)
    assert rollout.last_load.buckets > 1
    native = GenerationEngine(CFG, groups)
    native.set_weights(model.params)
    ref = native.generate(ids, None, sp)
    assert_clear_picks(model, ref, sp)
    assert torch.equal(out.responses, ref.responses)


# Seeds, EOS and sleep mode on a scripted engine --------------------------------------------


class ScriptedLLM(FakeLLM):
    """Generates as a sampler seeded per request would: each request's tokens are a
    pseudo-random stream of its own ``seed`` (or ``script[i]`` for prompt ``i`` when given),
    stopped after a stop token as vLLM stops (the token kept); log-probs ``-(k + 1) / 8``."""

    def __init__(self, vocab: int = CFG.vocab_size, script=None, tp_size: int = 1,
                 stops: bool = True) -> None:
        super().__init__([FakeWorker(tp_size=tp_size)])
        self.vocab, self.script, self.stops = vocab, script, stops
        self.params: list = []

    def _generate(self, prompts, params):
        self.params.append(params)
        outs = []
        for i, sp in enumerate(params):
            if self.script is not None:
                toks, lps = self.script[i]
            else:
                rng = random.Random(sp.seed)
                toks = [rng.randrange(1, self.vocab) for _ in range(sp.max_tokens)]
                lps = [-(k + 1) / 8 for k in range(len(toks))]
            stop = [k for k, t in enumerate(toks)
                    if self.stops and t in sp.stop_token_ids and k >= sp.min_tokens]
            end = stop[0] + 1 if stop else sp.max_tokens
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(
                token_ids=list(toks[:end]),
                logprobs=[{t: SimpleNamespace(logprob=lp)} for t, lp in zip(toks[:end], lps)])]))
        return outs


def awake_rollout(llm, **kw) -> VLLMRollout:
    """An adapter on ``llm`` with one load done (weights of a one-rank model)."""
    groups, model, _ = one_rank_model()
    engine = HybridEngine(model, rollout=VLLMRollout(llm, groups.gen_tp,
                                                     sampling_cls=fake_sampling, **kw))
    engine.resharder.to_generation()
    engine.rollout.load_weights(engine.resharder)
    return engine.rollout


def test_one_seed_per_row_distinct_deterministic_and_wave_free():
    """A GRPO group of identical prompts gets distinct seeds, hence distinct samples; the same
    call gives the same seeds; a call's rows split in two calls (first_row) get the seeds of
    the one call; another call seed gives other seeds."""
    llm = ScriptedLLM()
    rollout = awake_rollout(llm)
    prompt = torch.randint(1, CFG.vocab_size, (1, 4), generator=torch.Generator().manual_seed(0))
    ids = prompt.repeat(8, 1)
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, seed=123)
    out = rollout.generate(ids, None, sp)
    seeds = [p.seed for p in llm.params[-1]]
    assert len(set(seeds)) == 8
    assert len({tuple(r) for r in out.responses.tolist()}) == 8  # no collapsed group
    again = rollout.generate(ids, None, sp)
    assert [p.seed for p in llm.params[-1]] == seeds
    assert torch.equal(again.input_ids, out.input_ids)
    halves = [rollout.generate(ids[a:a + 4], None, dataclasses.replace(sp, first_row=a))
              for a in (0, 4)]
    assert [p.seed for p in llm.params[-2] + llm.params[-1]] == seeds
    assert torch.equal(torch.cat([h.input_ids for h in halves]), out.input_ids)
    rollout.generate(ids, None, dataclasses.replace(sp, seed=124))
    assert not set(p.seed for p in llm.params[-1]) & set(seeds)
    first = llm.params[0][0]
    assert (first.max_tokens, first.temperature, first.logprobs, first.detokenize) == \
        (6, 1.0, 0, False)


def native_eos_run(seed: int = 3):
    """The native engine's greedy output on padded prompts, without EOS and with an EOS id
    that ends some rows early (a token of row 0's response)."""
    groups, model, _ = one_rank_model()
    native = GenerationEngine(CFG, groups)
    native.set_weights(model.params)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, CFG.vocab_size, (4, 5), generator=g)
    mask = torch.ones_like(ids)
    mask[2, :3] = 0
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, pad_token_id=0)
    free = native.generate(ids, mask, sp)
    eos = int(free.responses[0, 2])
    sp_eos = dataclasses.replace(sp, eos_token_id=eos)
    return ids, mask, free, sp_eos, native.generate(ids, mask, sp_eos)


def test_eos_and_padding_match_the_native_engine():
    """The same token streams through the adapter give the native engine's output: cut after
    the first EOS (kept), pad ids, mask 0 and log-prob 0 after it, float32 log-probs; vLLM's
    outputs either stopped at the EOS or running past it."""
    ids, mask, free, sp, ref = native_eos_run()
    assert (ref.response_mask == 0).any() and (free.response_mask == 1).all()
    streams = [(r, lp) for r, lp in zip(free.responses.tolist(), free.log_probs.tolist())]
    for stops in (True, False):  # vLLM stopped at EOS, or a stream running past it
        llm = ScriptedLLM(script=streams, stops=stops)
        out = awake_rollout(llm).generate(ids, mask, sp)
        assert out.log_probs.dtype == ref.log_probs.dtype == torch.float32
        assert torch.equal(out.input_ids, ref.input_ids)
        assert torch.equal(out.attention_mask, ref.attention_mask)
        torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-5, rtol=0)
        assert out.prompt_length == ref.prompt_length
        assert llm.params[-1][0].stop_token_ids == [sp.eos_token_id]


def fake_vllm_module(built: list) -> types.ModuleType:
    """A stand-in ``vllm`` package: ``LLM(**kwargs)`` records its arguments in ``built`` and
    is a :class:`ScriptedLLM`."""
    mod = types.ModuleType("vllm")

    def llm(**kwargs):
        engine = ScriptedLLM(tp_size=kwargs["tensor_parallel_size"])
        built.append((kwargs, engine))
        return engine

    mod.LLM, mod.SamplingParams = llm, fake_sampling
    return mod


def actor_worker(rollout: RolloutConfig) -> ActorWorker:
    """An ActorWorker of a one-rank layout, built as the runtime builds it."""
    groups, _, _ = one_rank_model()
    spec = ActorSpec(
        model=ModelSpec(config=CFG, head="lm", init_from=None, seed=0, fresh_head=False,
                        lora=None, lora_init_from=None),
        precision=FP32, optim=OptimConfig(max_grad_norm=None), loss=PolicyLossConfig(),
        update=UpdateSpec(1, 4, 4, None), algo="grpo", kl_loss=None, temperature=1.0,
        offload_during_generation=False, rollout=rollout, router_replay=False)
    w = ActorWorker.__new__(ActorWorker)
    w.groups = groups
    w.__init__(spec)
    return w


def test_actor_selects_vllm_and_sleeps_while_training(monkeypatch):
    """rollout.engine=vllm: the actor builds vllm.LLM (sleep mode, the worker extension, the
    run's limits) behind its HybridEngine; over two RL iterations vLLM sleeps outside
    generation, wakes its weights before each load, its KV cache after, resets the prefix
    cache after each load, and generates only awake."""
    built: list = []
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm_module(built))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    w = actor_worker(RolloutConfig(engine="vllm", max_num_seqs=3, gpu_memory_utilization=0.4))
    (kwargs, llm), = built
    try:
        assert isinstance(w.engine.rollout, VLLMRollout) and w.engine.rollout.llm is llm
        assert os.path.isfile(os.path.join(kwargs["model"], "config.json"))
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        assert {k: kwargs[k] for k in ("enable_sleep_mode", "worker_extension_cls",
                                       "logprobs_mode", "max_num_seqs",
                                       "gpu_memory_utilization", "tensor_parallel_size",
                                       "load_format", "dtype")} == {
            "enable_sleep_mode": True, "worker_extension_cls": WORKER_EXTENSION,
            "logprobs_mode": "processed_logprobs", "max_num_seqs": 3,
            "gpu_memory_utilization": 0.4, "tensor_parallel_size": 1, "load_format": "dummy",
            "dtype": "float32"}
        assert "distributed_executor_backend" not in kwargs  # one rank
    finally:
        shutil.rmtree(kwargs["model"])
    assert llm.events == [("rpc", DESCRIBE), ("sleep", 1)] and llm.asleep == SLEEP_TAGS
    ids = torch.randint(1, CFG.vocab_size, (4, 5), generator=torch.Generator().manual_seed(1))
    prompts = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    for step in range(2):
        llm.events.clear()
        out = w.generate_sequences(prompts, SamplingParams(max_new_tokens=4, temperature=1.0,
                                                           seed=step))
        assert llm.asleep == SLEEP_TAGS  # the update runs with vLLM off the device
        loads = sum(e == ("rpc", LOAD_BUCKET) for e in llm.events)
        assert loads >= 1
        assert llm.events == [("wake_up", ("weights",))] + [("rpc", LOAD_BUCKET)] * loads + [
            ("wake_up", ("kv_cache",)), ("reset_prefix_cache",), ("generate", 4),
            ("sleep", 1)], llm.events
        assert out["input_ids"].shape == (4, 9) and bool(out["response_mask"].all())


def test_actor_native_engine_by_default_and_in_waves():
    w = actor_worker(RolloutConfig(max_num_seqs=2))
    assert isinstance(w.engine.rollout, WavedGeneration)
    assert isinstance(w.engine.rollout.engine, GenerationEngine)
    assert w.engine.rollout.max_num_seqs == 2
    ids = torch.randint(1, CFG.vocab_size, (5, 4), generator=torch.Generator().manual_seed(2))
    prompts = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    with w.engine.generation_mode():
        one = w.engine.rollout.engine.generate(ids, None, SamplingParams(max_new_tokens=3,
                                                                         temperature=0.0))
    out = w.generate_sequences(prompts, SamplingParams(max_new_tokens=3, temperature=0.0))
    assert torch.equal(out["input_ids"], one.input_ids)


# max_num_seqs: waves of the native engine ---------------------------------------------------


def waves_case():
    groups, model, _ = one_rank_model()
    native = GenerationEngine(CFG, groups)
    native.set_weights(model.params)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, CFG.vocab_size, (7, 5), generator=g)
    ids[1] = ids[0]  # a GRPO pair (prefilled once)
    mask = torch.ones_like(ids)
    mask[3, :2] = 0
    mask[5, :4] = 0
    return model, native, ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("sp", [SamplingParams(max_new_tokens=6, temperature=0.0),
                                SamplingParams(max_new_tokens=6, temperature=1.0, seed=5),
                                SamplingParams(max_new_tokens=6, temperature=0.8, top_k=5,
                                               seed=9)],
                         ids=["greedy", "sampled", "top_k"])
def test_waves_equal_one_call(sp):
    """max_num_seqs = 1, 2, 3, 7: the waves' tokens are the one call's (sampled rows draw as
    their rows of the whole batch), log-probs to rounding; without the row offset the sampled
    waves would differ."""
    model, native, ids, mask = waves_case()
    ref = native.generate(ids, mask, sp)
    assert_clear_picks(model, ref, sp)
    for n in (1, 2, 3, 7):
        out = WavedGeneration(native, max_num_seqs=n).generate(ids, mask, sp)
        assert out.stats.get("waves", 1) == -(-7 // n)
        assert torch.equal(out.input_ids, ref.input_ids), n
        assert torch.equal(out.attention_mask, ref.attention_mask), n
        torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-5, rtol=0)
        assert out.stats["new_tokens"] == ref.stats["new_tokens"]
    if not sp.greedy:
        naive = torch.cat([native.generate(ids[a:a + 3], mask[a:a + 3], sp).input_ids
                           for a in range(0, 7, 3)])
        assert not torch.equal(naive, ref.input_ids)


def test_wave_rows():
    assert wave_rows(10, None, 100, None) == 10
    assert wave_rows(10, 4, 100, None) == 4
    assert wave_rows(3, 4, 100, None) == 3
    assert wave_rows(10, None, 100, 350) == 3  # 3 rows' caches fit 350 bytes, 4 do not
    assert wave_rows(10, 2, 100, 350) == 2
    assert wave_rows(10, None, 100, 50) == 1  # one row at least, whatever the budget
    for batch, cap, row, budget in itertools.product((1, 5, 9), (None, 1, 4), (1, 7),
                                                     (None, 0, 6, 30)):
        rows = wave_rows(batch, cap, row, budget)
        assert 1 <= rows <= batch and (cap is None or rows <= cap)
        assert rows == 1 or budget is None or rows * row <= budget
        # the largest such: one more row breaks a limit
        assert rows == batch or rows == cap or (budget is not None and (rows + 1) * row > budget)


def test_wave_budget_counts_the_held_kv_cache_as_free(monkeypatch):
    """On a GPU a wave's KV budget is a fraction of the free memory plus the cache the engine
    holds from its earlier calls (reused or replaced by the next wave), so the later waves of
    a block are sized as the first."""
    class Engine:  # what kv_budget reads of a GenerationEngine
        device = torch.device("cuda")
        memory = types.SimpleNamespace(nbytes=0)

    engine = Engine()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1000, 8000))
    waves = WavedGeneration(engine, max_num_seqs=None, kv_fraction=0.5)
    assert waves.kv_budget() == 500
    engine.memory.nbytes = 600  # the first wave's cache, held: free memory fell by as much
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (400, 8000))
    assert waves.kv_budget() == 500
    engine.device = torch.device("cpu")
    assert waves.kv_budget() is None


# The rollout section of the config ----------------------------------------------------------


def test_rollout_config_keys():
    cfg = load_config(["algo=grpo", "rollout.engine=vllm", "rollout.max_num_seqs=64",
                       "rollout.gpu_memory_utilization=1.0"])
    assert cfg.rollout == RolloutConfig(engine="vllm", max_num_seqs=64,
                                        gpu_memory_utilization=1.0)
    assert load_config(["algo=grpo"]).rollout == RolloutConfig()
    for arg, key in [("rollout.engine=sglang", "rollout.engine"),
                     ("rollout.max_num_seqs=0", "rollout.max_num_seqs"),
                     ("rollout.gpu_memory_utilization=0", "rollout.gpu_memory_utilization"),
                     ("rollout.gpu_memory_utilization=1.5", "rollout.gpu_memory_utilization")]:
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            load_config(["algo=grpo", arg])
    for bad in (True, -1, 2.5):
        with pytest.raises(ValueError, match="max_num_seqs"):
            RolloutConfig(max_num_seqs=bad)


def test_vllm_engine_checked_before_the_job_starts(monkeypatch):
    vllm_cfg = load_config(["algo=grpo", "rollout.engine=vllm", "device=cuda"])
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    with pytest.raises(ValueError, match=r"rollout\.engine='vllm' but vllm cannot be imported"
                                         r".*requirements-vllm\.txt.*rollout\.engine=native"):
        check_rollout_engine(vllm_cfg)
    check_rollout_engine(load_config(["algo=grpo"]))  # native: vllm never imported
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm_module([]))
    check_rollout_engine(vllm_cfg)
    with pytest.raises(ValueError, match=r"GPUs only but device='cpu'"):
        check_rollout_engine(dataclasses.replace(vllm_cfg, device="cpu"))
