"""vLLM rollout adapter without a GPU: the modules import without vllm, the bucket planner by
enumeration, and the adapter driving a stand-in ``LLM`` whose ``collective_rpc`` reaches a fake
worker built on the real worker extension (on one process and on 2 gloo ranks, tp_g = 2).
vLLM's own signatures are checked where vllm is installed; the real engine needs a GPU."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import itertools
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from engine.generation import GenerationEngine
from engine.hf_interop import config_to_hf, full_to_hf_state_dict
from engine.hybrid_engine import HybridEngine
from engine.llama_spec import LlamaConfig, init_full_state_dict, llama_shard_specs
from engine.model import ParallelLlama, load_full_state_dict
from engine.sampling import SamplingParams
from engine.vllm_rollout import VLLMRollout, WeightBucket, plan_weight_buckets
from engine.vllm_worker_ext import (DESCRIBE, LOAD_BUCKET, WORKER_EXTENSION,
                                    HybridflowWorkerExtension)
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
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


class FakeLLM:
    """``collective_rpc`` with vLLM's signature (the method by name on every worker, results in
    a list), and ``generate`` through transformers' greedy decoding."""

    def __init__(self, workers, hf=None) -> None:
        self.workers, self.hf = workers, hf
        self.rpc: list[str] = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None) -> list:
        self.rpc.append(method)
        return [getattr(w, method)(*args, **(kwargs or {})) for w in self.workers]

    @torch.no_grad()
    def generate(self, prompts, sampling_params, use_tqdm=False):
        sp = sampling_params
        assert sp.temperature == 0 and sp.logprobs == 0 and sp.top_k == 0
        outs = []
        for p in prompts:
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
    for arg in ("worker_extension_cls", "logprobs_mode", "distributed_executor_backend"):
        assert arg in init or (forwards and arg in engine_fields), arg
    gen = inspect.signature(vllm.LLM.generate).parameters
    assert {"prompts", "sampling_params", "use_tqdm"} <= gen.keys(), list(gen)
    sp = vllm.SamplingParams(max_tokens=4, temperature=0.7, top_k=0, top_p=0.9, seed=1,
                             logprobs=0, stop_token_ids=[2])
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
                   worker_extension_cls=WORKER_EXTENSION, logprobs_mode="processed_logprobs")
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
