"""Training forward + backward of one model: our layers (engine.layers, the C++ RMSNorm where
built) against transformers' LlamaForCausalLM, side by side in one process.

    python bench/train_layers.py [--preset grpo|medium] [--threads 1] [--repeat 30] [--json PATH]

Same weights and the same left-padded batch for both; the loss is the mean log-prob of the
next tokens from real positions (what a policy loss differentiates; the two models' outputs at
padding positions differ and are masked).  Presets: ``grpo`` = the GRPO recipe's actor
(2 layers x 64, batch 32 x 14 tokens: one rank's share of the e2e benchmark), ``medium`` =
4 layers x 256, batch 8 x 128.  Each round runs every contender once (interleaved medians).
Prints ``{"ours_tokens_per_s", "hf_tokens_per_s", "ours_vs_hf", "forward_only": {...},
"max_grad_rel_diff"}`` (the gradient difference against transformers').
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.report import emit_json  # noqa: E402
from bench.timing import interleaved_median_times  # noqa: E402

PRESETS = {  # (layers, hidden, intermediate, heads, kv heads, vocab, batch, seq)
    "grpo": (2, 64, 128, 4, 2, 24, 32, 14),
    "medium": (4, 256, 688, 8, 4, 512, 8, 128),
}


def run(preset: str, repeat: int) -> dict:
    import transformers

    from engine.hf_interop import config_to_hf, full_to_hf_state_dict
    from engine.llama_spec import LlamaConfig, init_full_state_dict, llama_shard_specs
    from engine.model import ParallelLlama, load_full_state_dict
    from hybridflow_comm.groups import build_hybrid_groups
    from hybridflow_comm.layout import HybridLayout, ParallelLayout

    layers, hidden, inner, heads, kv, vocab, batch, seq = PRESETS[preset]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inner,
                      num_layers=layers, num_heads=heads, num_kv_heads=kv,
                      max_position_embeddings=max(seq, 32), tie_word_embeddings=False)
    full = init_full_state_dict(cfg, seed=0, std=0.1)
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(cfg, groups)
    load_full_state_dict(model, full)
    hf = transformers.LlamaForCausalLM(config_to_hf(cfg))
    hf.load_state_dict(full_to_hf_state_dict(full, llama_shard_specs(cfg, 1)), strict=False)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    pad = torch.randint(0, seq // 2, (batch,), generator=gen)
    mask = (torch.arange(seq) >= pad[:, None]).long()  # left padding
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    weight = (mask[:, :-1] * mask[:, 1:]).float()  # real position predicting a real token

    def ours():
        out = model.head_outputs(model.stage_forward(ids, mask), ids, temperature=1.0)
        return -(out["log_probs"] * weight).sum() / weight.sum()

    def theirs():
        logits = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        return -(lp * weight).sum() / weight.sum()

    def step(loss_fn, params: dict):
        def fn():
            for p in params.values():
                p.grad = None
            loss_fn().backward()
            return {n: p.grad for n, p in params.items()}
        return fn

    train = {"ours": step(ours, model.params),  # by spec name, as full_to_hf_state_dict reads
             "hf": step(theirs, dict(hf.named_parameters()))}
    t, r = interleaved_median_times(train, repeat, warmup=3)
    with torch.no_grad():
        f, _ = interleaved_median_times({"ours": ours, "hf": theirs}, repeat, warmup=3)
    tokens = int(mask.sum())
    return {"preset": preset, "threads": torch.get_num_threads(),
            "ours_tokens_per_s": tokens / t["ours"], "hf_tokens_per_s": tokens / t["hf"],
            "ours_vs_hf": t["hf"] / t["ours"],
            "forward_only": {"ours_vs_hf": f["hf"] / f["ours"]},
            "max_grad_rel_diff": max(
                ((g - r["hf"][n]).abs().max() / r["hf"][n].abs().max().clamp(min=1e-12)).item()
                for n, g in full_to_hf_state_dict(r["ours"], model.specs).items())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="grpo")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    result = run(a.preset, a.repeat)
    emit_json(result, a.json)


if __name__ == "__main__":
    main()
