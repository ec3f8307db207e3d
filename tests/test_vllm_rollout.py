"""vLLM rollout adapter: CPU tests with a stand-in engine (transformers behind vLLM's call
shapes), and a real-vLLM test that needs a GPU (skipped otherwise)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.generation import GenerationEngine
from engine.hf_interop import config_to_hf, full_to_hf_state_dict
from engine.hybrid_engine import HybridEngine
from engine.llama_spec import LlamaConfig, init_full_state_dict, llama_shard_specs
from engine.model import ParallelLlama, load_full_state_dict
from engine.sampling import SamplingParams
from engine.vllm_rollout import VLLMRollout
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout

CFG = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, rope_theta=500.0, max_position_embeddings=64,
                  tie_word_embeddings=False)


class FakeLLM:
    """transformers' model behind the parts of ``vllm.LLM`` the adapter touches."""

    def __init__(self, cfg: LlamaConfig) -> None:
        import transformers

        self.hf = transformers.LlamaForCausalLM(config_to_hf(cfg)).eval()  # random weights
        self.loaded: dict[str, torch.Tensor] = {}
        self.model = SimpleNamespace(load_weights=self._load)

    def _load(self, weights) -> None:
        self.loaded = {k: v.clone() for k, v in weights}
        self.hf.load_state_dict(self.loaded, strict=False)

    @torch.no_grad()
    def generate(self, prompts, sampling_params, use_tqdm=False):
        sp = sampling_params
        assert sp.temperature == 0 and sp.logprobs == 0
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


def test_adapter_feeds_full_hf_weights_and_matches_native_engine():
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(CFG, groups)
    full = init_full_state_dict(CFG, seed=4, std=0.2)
    load_full_state_dict(model, full)
    fake = FakeLLM(CFG)
    rollout = VLLMRollout(fake, groups.gen_tp, model_getter=lambda llm: llm.model,
                          sampling_cls=lambda **kw: SimpleNamespace(**kw))
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
    want = full_to_hf_state_dict(full, llama_shard_specs(CFG, 1))
    assert fake.loaded.keys() == want.keys()
    assert all(torch.equal(fake.loaded[k], want[k]) for k in want)
    native = GenerationEngine(CFG, groups)
    native.set_weights(model.params)
    ref = native.generate(ids, mask, sp)
    assert torch.equal(via_vllm.input_ids, ref.input_ids)
    assert torch.equal(via_vllm.attention_mask, ref.attention_mask)
    torch.testing.assert_close(via_vllm.log_probs, ref.log_probs, atol=1e-5, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM rollout needs a GPU")
def test_real_vllm_greedy_matches_native(tmp_path):
    vllm = pytest.importorskip("vllm")
    from engine.hf_interop import save_hf_checkpoint

    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(CFG, groups)
    load_full_state_dict(model, init_full_state_dict(CFG, seed=4, std=0.2))
    save_hf_checkpoint(model, str(tmp_path))
    llm = vllm.LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True,
                   gpu_memory_utilization=0.2)
    engine = HybridEngine(model, rollout=VLLMRollout(llm, groups.gen_tp))
    ids = torch.randint(1, CFG.vocab_size, (2, 5))
    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    with engine.generation_mode():
        out = engine.generate_sequences(ids, None, sp)
    native = GenerationEngine(CFG, groups)
    native.set_weights(model.params)
    assert torch.equal(out.responses, native.generate(ids, None, sp).responses)
