"""Generation throughput: our KV-cache engine against transformers' ``generate``, in one run.

    python bench/generation.py [--shape tiny|small|qwen2.5-0.5b|smollm2-135m]
                               [--batch|--prompts B] [--new-tokens N] [--repeat 3]
                               [--nproc 4] [--no-multirank] [--no-early-exit] [--profile]
                               [--device cpu|cuda] [--precision fp32|bf16]
                               [--sampled|--no-sampled] [--hf-cache dynamic|static]
                               [--json PATH]

Single process, a model built from a config and seeded weights (nothing downloaded; at
``smollm2-135m`` a real checkpoint where it is installed); both engines generate greedily for
the same left-padded prompts on the same weights (HF gets a copy loaded from our state dict,
:func:`engine.hf_interop.full_to_hf_state_dict`); time is the median over ``repeat`` rounds
after one warm-up, at the same thread count; each round runs every contender once, in turn
(:func:`bench.timing.interleaved_median_times`).  Shapes (``--shape``, :mod:`bench.shapes`):

    tiny   (default) the figures of record before the shape table: a Llama of 4 layers x 256,
           a 128-symbol character vocabulary, printable-character prompts of 8..23 tokens;
           batch 16 x 64 new tokens
    small  the table's Qwen2-style decoder (q/k/v biases, tied embeddings, 6/2 heads, hidden
           384, 6 layers, vocabulary 8192) with the byte-level BPE built here
           (:func:`bench.shapes.build_bpe_tokenizer`, in a temporary folder); prompts are
           :func:`bench.shapes.bench_corpus` text, tokenized, cut to 1/2..1 of
           ``shape.prompt_len`` tokens and left-padded to it; batch 32 x ``shape.response_len``
    qwen2.5-0.5b  Qwen2.5-0.5B's sizes (the GPU bench): as ``small``, with the shape's 8,192-token
           BPE; batch 128 x 512 new tokens
    smollm2-135m  the real checkpoint SmolLM2-135M-Instruct where its package is installed
           (:mod:`bench.real_checkpoint`; the JSON's ``real_weights``): its weights, and chat
           prompts (sums and short instructions) rendered by its tokenizer's template,
           left-padded to the longest; both engines stop a row at its EOS (transformers:
           ``eos_token_id``, no ``min_new_tokens``), and tokens/s counts each side's own
           generated tokens up to and with each EOS.  Without the package: seeded weights of
           its sizes, as ``small``.  Batch 32 x up to 64 new tokens

Device (``--device``, ``--precision``; :func:`bench.timing.bench_device`): both engines, the
prompts and the arbiter live there; on CUDA the clock is read after ``torch.cuda.synchronize``
on both sides of every timed call, transformers' ``generate`` uses its static KV cache
(``--hf-cache``, default ``static`` on CUDA: transformers then compiles its decode step, and
the untimed warm-up call pays for that), the multi-rank part is skipped (one device) and
``--sampled`` is on: ours and transformers also sample at temperature 1 (no top-k/top-p),
``sampled_*`` figures.  The JSON's ``device`` names the card.

Where the C++ decode kernels run (float32 Llama or Qwen2 layers: both shapes), a third
contender is our engine with them switched off (every step through the Python layers), to show
what they bring.
``greedy_match``: both produced identical tokens.  Float32 sums in a different order (our
kernels, BLAS, another CPU's instruction set) can flip a near-tie between the top two logits,
after which the continuations legitimately diverge, so the agreement is also judged against a
float64 forward of the same weights on our sequences (the arbiter, :func:`greedy_agreement`):
``greedy_match_tie_aware`` holds when every row is equal up to its first difference and that
difference is a tie (both picks within ``TIE_TOL`` logits of the arbiter's best);
``max_logprob_diff`` is ours against transformers' log-probs on the common prefixes;
``first_mismatch`` names the earliest differing (row, position), both tokens and the gaps.  On
CUDA in bf16 the arbiter is a float64 copy of the same bf16 weights and the tie tolerance
:data:`BF16_TIE_TOL`; transformers' logits are a teacher-forced forward of its own tokens, and
both are computed a few rows at a time (:func:`agreement`): ``[B, N, V]`` logits of 128 x 512 x
151,936 do not fit a GPU at once.

Early exit (``early_exit``): our engine with and without dropping finished rows
(:mod:`engine.generation`) on the same prompts where half the rows end after N/8 tokens (their
per-row ``max_new_tokens``; an EOS there would end them the same way) and half run to N:
``speedup`` is the ratio of the two medians, ``identical`` that both gave the same tokens and
log-probs.  ``--profile`` (automatic when the ratio to transformers is below 2 at a shape other
than ``tiny``) times where one greedy call's decode steps go (:func:`decode_profile`).

Multi-rank (``--nproc`` gloo ranks, :func:`multirank_layouts`): training at the widest TP the
model's heads allow on them (the rest DP: 1,4,1 for ``tiny`` on 4 ranks, 1,2,2 for ``small``);
for each generation layout (1,1), (1,2), ..., (1,TP) the actor reshards and generates the same
batch through :class:`engine.hybrid_engine.HybridEngine` (prompts split over the micro-DP
group, results gathered back); tokens/s = generated tokens / slowest rank's time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.ranks import launch, max_over_ranks  # noqa: E402
from bench.report import write_json  # noqa: E402
from bench.real_checkpoint import chat_batch, checkpoint_folder  # noqa: E402
from bench.shapes import add_shape_argument, bench_corpus, build_bpe_tokenizer, \
    get_shape, widest_tp  # noqa: E402
from bench.timing import BenchDevice, add_device_arguments, bench_device, \
    interleaved_median_times  # noqa: E402
from engine import forward_paths  # noqa: E402
from engine import generation as generation_mod  # noqa: E402
from engine import layers as layers_mod  # noqa: E402
from engine import moe as moe_mod  # noqa: E402
from engine.generation import GenerationEngine  # noqa: E402
from engine.hf_interop import config_to_hf, full_to_hf_state_dict, gather_full_state_dict, \
    load_hf_checkpoint, read_hf_config  # noqa: E402
from engine.hybrid_engine import HybridEngine  # noqa: E402
from engine.llama_spec import LlamaConfig, init_full_state_dict, llama_shard_specs  # noqa: E402
from engine.model import ParallelLlama, load_full_state_dict  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from hybridflow_comm.groups import build_hybrid_groups  # noqa: E402
from hybridflow_comm.layout import HybridLayout, ParallelLayout  # noqa: E402

CFG = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=768, num_layers=4,
                  num_heads=8, num_kv_heads=4, max_position_embeddings=512,
                  tie_word_embeddings=False)
"""The ``tiny`` model of this bench (docs/benchmarks.md's tiny generation rows; not the
table's ``tiny`` row, which the other benches use)."""
SEED, STD = 0, 0.05
TIE_TOL = 1e-4
"""Logit gap below which two tokens count as tied: 25x the largest float32 logit error of
transformers against the float64 arbiter (``hf_logit_error``, about 4e-6 with
``--batch 32 --new-tokens 256``)."""
BF16_TIE_TOL = 0.25
"""The least tie tolerance of bf16 runs: two bf16 implementations' logits (a few units) differ
by a few bf16 ulps (tests/test_engine_cuda.py's ``BF16_GAP``).  Along a long generation a bf16
forward drifts further from the arbiter (transformers' own logits by most of a logit at
Qwen2.5-0.5B's shape, 128 x 512: docs/benchmarks.md, GPU), so each row's tolerance is at
least twice transformers' measured error on that row (``scale_by_hf``); ``hf_logit_error``
and ``max_tie_tolerance`` record them."""
ARBITER_BYTES = 4 << 30
"""Float64 logits the arbiter computes at once on a GPU (rows per chunk follow from it)."""
DEFAULTS = {"tiny": (16, 64), "qwen2.5-0.5b": (128, 512)}
"""``--batch`` and ``--new-tokens`` per shape where they are not the table's (other shapes:
batch 32, ``shape.response_len``)."""
NPROC = 4
"""``--nproc``: ranks of the multi-rank part."""


@dataclass(frozen=True)
class Workload:
    """What every contender generates from: the model and the left-padded prompts."""

    shape: dict
    """The shape's description (:meth:`bench.shapes.BenchShape.describe`, or the tiny model's)."""
    config: LlamaConfig
    ids: torch.Tensor
    """``[B, P]`` left-padded prompts."""
    mask: torch.Tensor
    """``[B, P]`` 1 for real tokens."""
    new_tokens: int
    pad_token_id: int
    full: dict
    """The global weights every contender loads: seeded
    (:func:`engine.llama_spec.init_full_state_dict`) or the real checkpoint's."""
    eos_token_id: int | None = None
    """A row ends after this token on both sides; None: every row runs ``new_tokens``."""
    checkpoint: str | None = None
    """The real checkpoint's HF folder that ``full`` was read from (the multi-rank part loads
    it there); None: seeded weights."""


def make_prompts(batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded printable-character prompts of 8..23 characters (``tiny``)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 24, (batch,), generator=g)
    plen = int(lengths.max())
    ids = torch.randint(32, 127, (batch, plen), generator=g)
    mask = (torch.arange(plen) >= plen - lengths[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask


def corpus_prompts(tokenizer, batch: int, prompt_len: int, seed: int = 1
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, prompt_len]`` left-padded prompts of :func:`bench.shapes.bench_corpus` text: row
    b joins corpus lines (with spaces) from a seeded start until the text has ``prompt_len``
    tokens, then keeps its first ``prompt_len/2 .. prompt_len`` tokens."""
    g = torch.Generator().manual_seed(seed)
    lines = bench_corpus()
    ids = torch.full((batch, prompt_len), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(batch, prompt_len, dtype=torch.long)
    for b in range(batch):
        line = int(torch.randint(len(lines), (), generator=g))
        text = lines[line]
        while len(tokens := tokenizer(text)["input_ids"]) < prompt_len:
            line += 1
            text += " " + lines[line % len(lines)]
        n = int(torch.randint(prompt_len // 2, prompt_len + 1, (), generator=g))
        ids[b, prompt_len - n:] = torch.tensor(tokens[:n])
        mask[b, prompt_len - n:] = 1
    return ids, mask


def default_sizes(shape_name: str) -> tuple[int, int]:
    """``(batch, new_tokens)`` of ``--shape`` when the flags are not given."""
    if shape_name in DEFAULTS:
        return DEFAULTS[shape_name]
    return 32, get_shape(shape_name, rl=True).response_len


def model_config(shape_name: str, new_tokens: int, dtype: torch.dtype | None = None
                 ) -> LlamaConfig:
    """The model of ``--shape``: :data:`CFG` at ``tiny``, else the table's row with positions
    for a prompt and ``new_tokens``; in ``dtype`` when given (else the shape's)."""
    if shape_name == "tiny":
        return CFG if dtype is None else dataclasses.replace(CFG, dtype=dtype)
    row = get_shape(shape_name, rl=True)
    return row.llama_config(max_positions=row.prompt_len + new_tokens, dtype=dtype)


def workload(shape_name: str, batch: int | None, new_tokens: int | None,
             bd: BenchDevice = BenchDevice(torch.device("cpu"), "fp32")) -> Workload:
    """The model and prompts of ``--shape`` (defaults: :func:`default_sizes`), the model in
    ``bd``'s precision and the prompts on its device."""
    default_batch, default_new = default_sizes(shape_name)
    batch, new_tokens = batch or default_batch, new_tokens or default_new
    folder = None if shape_name == "tiny" else checkpoint_folder(get_shape(shape_name))
    if folder is not None:
        return checkpoint_workload(shape_name, folder, batch, new_tokens, bd)
    config = model_config(shape_name, new_tokens, bd.dtype)
    full = init_full_state_dict(config, seed=SEED, std=STD)
    if shape_name == "tiny":
        ids, mask = make_prompts(batch)
        shape = {"name": "tiny", **config.to_dict(), "prompt_len": int(ids.shape[1])}
        pad = 0
    else:
        row = get_shape(shape_name, rl=True)
        with tempfile.TemporaryDirectory() as folder:
            tokenizer = build_bpe_tokenizer(folder, row.bpe_vocab)
        ids, mask = corpus_prompts(tokenizer, batch, row.prompt_len)
        shape, pad = row.describe(), tokenizer.pad_token_id
    return Workload(shape, config, ids.to(bd.device), mask.to(bd.device), new_tokens, pad,
                    full)


def checkpoint_workload(shape_name: str, folder: str, batch: int, new_tokens: int,
                        bd: BenchDevice) -> Workload:
    """The real checkpoint in ``folder`` (its config, weights and EOS) and its chat prompts
    (:func:`bench.real_checkpoint.chat_batch`), in ``bd``'s precision and on its device."""
    row = get_shape(shape_name, rl=True)
    ids, mask, pad, eos = chat_batch(folder, batch)
    if ids.shape[1] > row.prompt_len:
        raise ValueError(f"a chat prompt has {ids.shape[1]} tokens, more than the shape's "
                         f"prompt_len={row.prompt_len}")
    config = read_hf_config(folder, ids.shape[1] + new_tokens, bd.dtype)
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(config, groups)  # read back through our loader: the spec names
    load_hf_checkpoint(model, folder)
    full = gather_full_state_dict(model)
    return Workload(row.describe(), config, ids.to(bd.device), mask.to(bd.device), new_tokens,
                    pad, full, eos, folder)


def generated_tokens(tokens: torch.Tensor, eos: int | None) -> int:
    """Tokens of ``tokens [B, N]`` up to and with each row's first ``eos`` (all of a row
    without one, and all when ``eos`` is None)."""
    if eos is None:
        return tokens.numel()
    ended = (tokens == eos).long().cumsum(1)  # [B, N] EOS seen so far
    return int(((ended == 0) | ((ended == 1) & (tokens == eos))).sum())


def hf_model(config: LlamaConfig, full: dict, device: torch.device | str = "cpu",
             dtype: torch.dtype | None = None):
    """transformers' model of ``config``'s family holding ``full``'s weights, on ``device`` in
    ``dtype`` (default ``config.dtype``)."""
    import transformers

    with torch.device(device):  # transformers' random init runs there, then is overwritten
        hf = transformers.AutoModelForCausalLM.from_config(config_to_hf(config)).eval()
    missing, unexpected = hf.load_state_dict(
        full_to_hf_state_dict(full, llama_shard_specs(config, 1)), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"HF state dict: missing {missing}, unexpected {unexpected}")
    return hf.to(device, dtype or config.dtype)


@torch.no_grad()
def teacher_forced_logits(hf, ids: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor
                          ) -> torch.Tensor:
    """Logits ``[B, N, V]`` (in ``hf``'s dtype) predicting each of ``tokens [B, N]`` after the
    left-padded prompts ``ids``/``mask [B, P]``, teacher-forced through ``hf`` (positions skip
    the padding, as in generation).  Through a float64 model: the arbiter."""
    seq = torch.cat([ids, tokens], dim=1)
    full = torch.cat([mask, torch.ones_like(tokens)], dim=1)
    positions = (full.cumsum(-1) - 1).clamp(min=0)
    logits = hf(input_ids=seq, attention_mask=full, position_ids=positions).logits
    return logits[:, ids.shape[1] - 1:-1]


def greedy_agreement(ours: torch.Tensor, ours_lp: torch.Tensor, hf: torch.Tensor,
                     hf_logits: torch.Tensor, ref_logits: torch.Tensor,
                     tol: float = TIE_TOL, scale_by_hf: bool = False,
                     live: torch.Tensor | None = None) -> dict:
    """Tie-aware agreement of two greedy generations.

    Args:
        ours, hf: ``[B, N]`` tokens; ``ours_lp [B, N]`` our log-probs of ``ours``.
        hf_logits: ``[B, N, V]`` transformers' logits behind ``hf``.
        ref_logits: ``[B, N, V]`` float64 arbiter logits along ``ours``
            (:func:`float64_logits`); on the common prefix they are the logits of both.
        tol: the tie tolerance in logits.
        scale_by_hf: a row's tolerance is at least twice transformers' own logit error
            against the arbiter on that row up to and at its first difference (bf16: two
            tokens closer than the error of a bf16 forward are ordered by its rounding, and
            along 512 tokens that error grows well past a few ulps).
        live: ``[B, N]`` 1 where ``ours`` holds a generated token (up to and with its EOS;
            default all): the figures over the common prefix skip the padding after it.

    Returns:
        ``greedy_match`` (exact), ``greedy_match_tie_aware`` (every row's first difference,
        if any, is a tie: both picks within the row's tolerance of the arbiter's best
        logit), over the common prefixes ``max_logprob_diff`` (ours against transformers),
        ``ours_logprob_error`` and ``hf_logprob_error`` (each against the arbiter: which of
        the two is the more exact) and ``hf_logit_error`` (max |hf - arbiter| logits),
        ``min_top2_gap`` (the arbiter's closest call there), ``mismatched_rows``,
        ``tie_flips``, ``max_tie_tolerance`` and ``first_mismatch`` (None, or the earliest
        difference by position: row, position, both tokens, the gaps and the tolerance).
    """
    batch, n = ours.shape
    differs = ours != hf
    pos = torch.arange(n, device=ours.device)
    first = torch.where(differs, pos, n).min(dim=1).values  # [B], n where equal
    prefix = pos < first[:, None]  # [B, N] positions before each row's first difference
    if live is not None:
        prefix &= live.bool()
    hf_lp = torch.log_softmax(hf_logits.double(), -1).gather(-1, hf[..., None])[..., 0]
    top2 = ref_logits.topk(2, dim=-1).values  # [B, N, 2]
    gap = top2[..., 0] - top2[..., 1]

    def prefix_max(t: torch.Tensor) -> float:
        return float(t[prefix].max()) if bool(prefix.any()) else 0.0

    hf_error = (hf_logits.double() - ref_logits).abs().amax(-1)  # [B, N]
    ref_lp = torch.log_softmax(ref_logits, -1).gather(-1, ours[..., None])[..., 0]
    rows = [b for b in range(batch) if first[b] < n]
    ties, details, tols = 0, [], []
    for b in rows:
        m = int(first[b])
        a, h = int(ours[b, m]), int(hf[b, m])
        ref, hl = ref_logits[b, m], hf_logits[b, m]
        row_tol = max(tol, 2 * float(hf_error[b, :m + 1].max())) if scale_by_hf else tol
        tie = float(ref.max() - torch.minimum(ref[a], ref[h])) < row_tol
        ties += tie
        tols.append(row_tol)
        details.append({"row": b, "position": m, "ours_token": a, "hf_token": h,
                        "arbiter_top2_gap": float(gap[b, m]),
                        "arbiter_ours_minus_hf": float(ref[a] - ref[h]),
                        "hf_logit_gap": float(hl[h] - hl[a]),
                        "tolerance": row_tol, "tie": tie})
    first_mismatch = min(details, key=lambda d: (d["position"], d["row"]), default=None)
    return {"greedy_match": not rows, "greedy_match_tie_aware": ties == len(rows),
            "max_logprob_diff": prefix_max((ours_lp.double() - hf_lp).abs()),
            "ours_logprob_error": prefix_max((ours_lp.double() - ref_lp).abs()),
            "hf_logprob_error": prefix_max((hf_lp - ref_lp).abs()),
            "hf_logit_error": prefix_max(hf_error),
            "min_top2_gap": float(gap[prefix].min()) if bool(prefix.any()) else None,
            "mismatched_rows": len(rows), "tie_flips": ties,
            "max_tie_tolerance": max(tols, default=tol), "first_mismatch": first_mismatch}


def merge_agreements(parts: list[dict], rows: list[int]) -> dict:
    """One :func:`greedy_agreement` of a batch from those of its row chunks (``rows``: each
    chunk's first row, added to its ``first_mismatch`` row)."""
    gaps = [p["min_top2_gap"] for p in parts if p["min_top2_gap"] is not None]
    mismatches = [p["first_mismatch"] | {"row": p["first_mismatch"]["row"] + start}
                  for p, start in zip(parts, rows) if p["first_mismatch"] is not None]
    return {"greedy_match": all(p["greedy_match"] for p in parts),
            "greedy_match_tie_aware": all(p["greedy_match_tie_aware"] for p in parts),
            "max_logprob_diff": max(p["max_logprob_diff"] for p in parts),
            "ours_logprob_error": max(p["ours_logprob_error"] for p in parts),
            "hf_logprob_error": max(p["hf_logprob_error"] for p in parts),
            "hf_logit_error": max(p["hf_logit_error"] for p in parts),
            "min_top2_gap": min(gaps) if gaps else None,
            "mismatched_rows": sum(p["mismatched_rows"] for p in parts),
            "tie_flips": sum(p["tie_flips"] for p in parts),
            "max_tie_tolerance": max(p["max_tie_tolerance"] for p in parts),
            "first_mismatch": min(mismatches, key=lambda d: (d["position"], d["row"]),
                                  default=None)}


def agreement(w: Workload, ours, hf_tokens: torch.Tensor, hf_logits, tol: float,
              rows: int, scale_by_hf: bool = False) -> dict:
    """:func:`greedy_agreement` of our greedy output ``ours`` and transformers' ``hf_tokens``,
    ``rows`` rows at a time (:func:`merge_agreements`).

    Args:
        hf_logits: ``slice -> [b, N, V]`` transformers' logits behind those rows' tokens.
        tol: the tie tolerance; ``scale_by_hf``: see :func:`greedy_agreement`.
    """
    arbiter = hf_model(w.config, w.full, w.ids.device, torch.float64)
    starts = list(range(0, w.ids.shape[0], rows))
    parts = []
    for start in starts:
        rs = slice(start, start + rows)
        ref = teacher_forced_logits(arbiter, w.ids[rs], w.mask[rs], ours.responses[rs])
        parts.append(greedy_agreement(ours.responses[rs], ours.log_probs[rs], hf_tokens[rs],
                                      hf_logits(rs), ref, tol, scale_by_hf,
                                      ours.response_mask[rs]))
        del ref
    return merge_agreements(parts, starts)


def build(w: Workload, device: torch.device):
    """Our engine (kernels where the model allows), the same without early exit, the one
    with every step in the Python layers, and transformers' model, on one state dict, all on
    ``device``."""
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    model = ParallelLlama(w.config, groups, device=device)
    load_full_state_dict(model, w.full)
    engines = {"ours": GenerationEngine(w.config, groups, device=device),
               "no_early_exit": GenerationEngine(w.config, groups, early_exit=False,
                                                 device=device),
               "python": GenerationEngine(w.config, groups, fused_decode=False, device=device)}
    for e in engines.values():
        e.set_weights(model.params)
    return engines, hf_model(w.config, w.full, device)


def contenders(w: Workload, engines: dict, hf, sampled: bool, hf_cache: str) -> dict:
    """The timed calls: ours and transformers greedy (and ours in the Python layers where the
    kernels run; both sampled at temperature 1 when ``sampled``), each returning tokens."""
    ids, mask, n = w.ids, w.mask, w.new_tokens
    stop = dict(pad_token_id=w.pad_token_id, eos_token_id=w.eos_token_id)
    greedy = SamplingParams(max_new_tokens=n, temperature=0.0, **stop)
    sample = SamplingParams(max_new_tokens=n, temperature=1.0, **stop)
    cache = {} if hf_cache == "dynamic" else {"cache_implementation": hf_cache}

    @torch.no_grad()
    def theirs(**kwargs):
        return hf_responses(hf.generate(input_ids=ids, attention_mask=mask, **hf_stop(w),
                                        **cache, **kwargs), w)

    fns = {"ours": lambda: engines["ours"].generate(ids, mask, greedy),
           "hf": lambda: theirs(do_sample=False)}
    if engines["ours"].fused_decode:  # otherwise "ours" already runs the Python layers
        fns["python"] = lambda: engines["python"].generate(ids, mask, greedy).responses
    if sampled:
        fns["ours_sampled"] = lambda: engines["ours"].generate(ids, mask, sample).responses
        fns["hf_sampled"] = lambda: theirs(do_sample=True, temperature=1.0, top_k=0,
                                           top_p=1.0)
    return fns


def hf_stop(w: Workload) -> dict:
    """transformers' ``generate`` options that end rows as ours do: at EOS, or (no EOS)
    after exactly ``new_tokens``."""
    if w.eos_token_id is None:
        return dict(max_new_tokens=w.new_tokens, min_new_tokens=w.new_tokens,
                    pad_token_id=w.pad_token_id, eos_token_id=None)
    return dict(max_new_tokens=w.new_tokens, pad_token_id=w.pad_token_id,
                eos_token_id=w.eos_token_id)


def hf_responses(sequences: torch.Tensor, w: Workload) -> torch.Tensor:
    """``[B, N]`` the responses of transformers' ``[B, P + n]`` output, padded to ``N`` as
    ours are (it stops early once every row has ended)."""
    out = sequences[:, w.ids.shape[1]:]
    return torch.nn.functional.pad(out, (0, w.new_tokens - out.shape[1]), value=w.pad_token_id)


def single_process(w: Workload, repeat: int, bd: BenchDevice, sampled: bool = False,
                   hf_cache: str = "dynamic") -> tuple[dict, dict]:
    """Ours against transformers, greedy (and sampled); returns the figures and the engines."""
    engines, hf = build(w, bd.device)
    ids, mask, n = w.ids, w.mask, w.new_tokens
    kernels = engines["ours"].fused_decode
    t, r = interleaved_median_times(contenders(w, engines, hf, sampled, hf_cache), repeat,
                                    device=bd.device)
    out = r["ours"]
    if bd.is_cuda:  # transformers' logits along its tokens, a few rows at a time
        rows = max(1, ARBITER_BYTES // (ids.shape[1] + n) // w.config.vocab_size // 8)
        agree = agreement(w, out, r["hf"], lambda rs: teacher_forced_logits(
            hf, ids[rs], mask[rs], r["hf"][rs]).float(), BF16_TIE_TOL
            if bd.precision == "bf16" else TIE_TOL, rows, scale_by_hf=bd.precision == "bf16")
    else:  # untimed: transformers' logits behind the same greedy tokens
        with torch.no_grad():
            hf_out = hf.generate(input_ids=ids, attention_mask=mask, **hf_stop(w),
                                 do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        assert torch.equal(hf_responses(hf_out.sequences, w), r["hf"])
        logits = torch.stack(hf_out.logits, dim=1)  # steps after every row ended: never read
        logits = torch.nn.functional.pad(logits, (0, 0, 0, n - logits.shape[1]))
        agree = agreement(w, out, r["hf"], lambda rs: logits[rs], TIE_TOL, ids.shape[0])
    eos = w.eos_token_id
    tokens = {name: generated_tokens(res if torch.is_tensor(res) else res.responses, eos)
              for name, res in r.items()}
    rate = {name: tokens[name] / t[name] for name in t}
    result = {"ours_tokens_per_s": rate["ours"], "hf_tokens_per_s": rate["hf"],
              "ratio": rate["ours"] / rate["hf"], "generated_tokens": tokens["ours"],
              "hf_generated_tokens": tokens["hf"], **agree, "decode_kernels": kernels,
              "threads": torch.get_num_threads(), "reference": out.responses.cpu()}
    if kernels:
        result |= {"python_layers_tokens_per_s": rate["python"],
                   "python_layers_greedy_match": bool(torch.equal(r["python"], r["hf"]))}
    if sampled:
        result |= {"sampled_ours_tokens_per_s": rate["ours_sampled"],
                   "sampled_hf_tokens_per_s": rate["hf_sampled"],
                   "sampled_ratio": rate["ours_sampled"] / rate["hf_sampled"]}
    return result, engines


def early_exit(w: Workload, engines: dict, repeat: int) -> dict:
    """Our engine with and without early exit where half the rows end after N/8 tokens."""
    n = w.new_tokens
    limits = torch.tensor([max(1, n // 8) if b % 2 == 0 else n for b in range(w.ids.shape[0])],
                          device=w.ids.device)
    sp = SamplingParams(max_new_tokens=n, temperature=0.0, pad_token_id=w.pad_token_id)
    t, r = interleaved_median_times(
        {name: functools.partial(engines[name].generate, w.ids, w.mask, sp, limits)
         for name in ("ours", "no_early_exit")}, repeat, device=w.ids.device)
    on, off = r["ours"], r["no_early_exit"]
    return {"speedup": t["no_early_exit"] / t["ours"],
            "identical": all(torch.equal(a, b) for a, b in (
                (on.input_ids, off.input_ids), (on.attention_mask, off.attention_mask),
                (on.log_probs, off.log_probs))),
            "short_rows": int((limits < n).sum()), "short_tokens": int(limits.min()),
            "row_steps": on.stats["row_steps"], "row_steps_without": off.stats["row_steps"],
            "compactions": on.stats["compactions"]}


@contextlib.contextmanager
def _timed(module, name: str, totals: dict, key: str, phase: list):
    """Accumulate the wall time of ``module.name`` calls into ``totals[phase[0]][key]``."""
    fn = getattr(module, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            part = totals[phase[0]]
            part[key] = part.get(key, 0.0) + time.perf_counter() - t0

    setattr(module, name, wrapper)
    try:
        yield
    finally:
        setattr(module, name, fn)


def decode_profile(w: Workload, eng: GenerationEngine) -> dict:
    """Where one greedy call's time goes, per decode step (ms), by timers around the pieces:
    ``decode_kernels`` (the C++ decode calls, whole layers: norms, products, RoPE, attention
    over the cached positions, SwiGLU) or, on the Python layers, ``attention`` (KV-cache
    write + scaled_dot_product_attention) and ``layer_matmuls`` (q/k/v, o, gate/up, down);
    ``lm_head`` (the [B, H] x [H, V] product), ``sampling``
    (:func:`engine.sampling.sample_next`), ``other`` (the rest: embedding, residuals, the
    loop's own Python); the prefill step apart.  The steps run the Python loop (the timers
    sit around its calls), not the one-call greedy loop (``greedy_loop``)."""
    sp = SamplingParams(max_new_tokens=w.new_tokens, temperature=0.0,
                        pad_token_id=w.pad_token_id)
    totals: dict[str, dict[str, float]] = {"prefill": {}, "decode": {}}
    phase = ["prefill"]
    step = eng._step

    def timed_step(*args):
        t0 = time.perf_counter()
        try:
            return step(*args)
        finally:
            part = totals[phase[0]]
            part["step"] = part.get("step", 0.0) + time.perf_counter() - t0
            phase[0] = "decode"  # every step after the first

    patches = [(layers_mod, "attention", "attention"),
               (layers_mod, "column_linear", "layer_matmuls"),
               (layers_mod, "row_linear", "layer_matmuls"),
               (moe_mod, "column_linear", "layer_matmuls"),
               (moe_mod, "row_linear", "layer_matmuls"),
               (generation_mod, "column_linear", "lm_head"),
               (generation_mod, "sample_next", "sampling")]
    if forward_paths._kernels is not None:
        patches += [(forward_paths._kernels, name, "decode_kernels")
                    for name in ("decode_layers", "decode_attention", "decode_mlp")]
    with contextlib.ExitStack() as stack:
        for module, name, key in patches:
            stack.enter_context(_timed(module, name, totals, key, phase))
        eng._step, greedy_loop, eng.greedy_loop = timed_step, eng.greedy_loop, False
        try:
            out = eng.generate(w.ids, w.mask, sp)
        finally:
            del eng._step
            eng.greedy_loop = greedy_loop
    steps = out.stats["forward_steps"] - 1
    decode = totals["decode"]
    parts = {k: decode.get(k, 0.0) / steps * 1e3
             for k in ("decode_kernels", "attention", "layer_matmuls", "lm_head", "sampling")
             if k in decode}
    decode_ms = decode["step"] / steps * 1e3
    parts["other"] = decode_ms - sum(parts.values())
    return {"decode_step_ms": decode_ms, "prefill_ms": totals["prefill"]["step"] * 1e3,
            "decode_steps": steps, "batch": int(w.ids.shape[0]),
            "positions": int(w.ids.shape[1] + w.new_tokens),
            "per_step_ms": parts,
            "fractions": {k: v / decode_ms for k, v in parts.items()},
            "call_s": out.stats["time_s"], "path": eng.paths.decode.name}


def _rank_main(rank: int, world: int, cfg: dict):
    config, ids, mask, folder = cfg["config"], cfg["ids"], cfg["mask"], cfg["checkpoint"]
    full = None if folder else init_full_state_dict(config, seed=SEED, std=STD)
    sp = SamplingParams(max_new_tokens=cfg["new_tokens"], temperature=0.0,
                        pad_token_id=cfg["pad_token_id"], eos_token_id=cfg["eos_token_id"])
    results = {}
    for layout in cfg["layouts"]:
        groups = build_hybrid_groups(layout)
        model = ParallelLlama(config, groups)
        if folder:
            load_hf_checkpoint(model, folder)
        else:
            load_full_state_dict(model, full)
        engine = HybridEngine(model)
        times, reshard = [], []
        for _ in range(cfg["repeat"] + 1):
            dist.barrier()
            with engine.generation_mode() as stats:
                t0 = time.perf_counter()
                out = engine.generate_sequences(ids, mask, sp)
                times.append(max_over_ranks(time.perf_counter() - t0))
            reshard.append(max_over_ranks(stats.time_s))
        t = statistics.median(times[1:])
        results[f"1,{layout.tp_g}"] = {
            "tokens_per_s": generated_tokens(out.responses, cfg["eos_token_id"]) / t,
            "time_s": t,
            "reshard_time_s": statistics.median(reshard[1:]),
            "micro_dp_size": groups.layout.micro_dp_size,
            "matches_single_process": bool(torch.equal(out.responses, cfg["reference"])),
        }
    return results


def multirank_layouts(config: LlamaConfig, nproc: int) -> list[HybridLayout]:
    """The multi-rank part's layouts: training on ``nproc`` ranks at the widest TP the model
    allows (:func:`bench.shapes.widest_tp`, the rest DP), generation at every TP degree that
    divides it."""
    tp = widest_tp(llama_shard_specs(config, 1), nproc)
    train = ParallelLayout(1, tp, nproc // tp)
    return [HybridLayout(train, 1, tp_g) for tp_g in range(1, tp + 1) if tp % tp_g == 0]


def multi_rank(nproc: int, w: Workload, repeat: int, reference: torch.Tensor) -> dict:
    """Reshard and generate at every layout of :func:`multirank_layouts` on ``nproc`` ranks."""
    layouts = multirank_layouts(w.config, nproc)
    t = layouts[0].train
    cfg = {"config": w.config, "ids": w.ids, "mask": w.mask, "new_tokens": w.new_tokens,
           "pad_token_id": w.pad_token_id, "eos_token_id": w.eos_token_id,
           "checkpoint": w.checkpoint, "repeat": repeat, "layouts": layouts,
           "reference": reference}
    return {"train": [t.pp, t.tp, t.dp], "gen": launch(_rank_main, nproc, cfg)}


def summary(name: str, single: dict, batch: int, n: int, tol: float, real: bool = False) -> str:
    """The printed line of the single-process comparison (``real``: the real checkpoint,
    rows ending at EOS)."""
    weights = (f"real weights, {single['generated_tokens']} tokens up to EOS" if real
               else "seeded weights")
    line = (f"[{name}] single process ({single['threads']} threads), batch {batch} x {n} "
            f"new tokens ({weights}), greedy: ours {single['ours_tokens_per_s']:.0f} tok/s, "
            f"transformers {single['hf_tokens_per_s']:.0f} tok/s, ratio {single['ratio']:.2f}, "
            f"greedy_match={single['greedy_match']} (tie-aware "
            f"{single['greedy_match_tie_aware']}, tolerance {tol:g} logits, max log-prob diff "
            f"{single['max_logprob_diff']:.1e})")
    if single["decode_kernels"]:
        line += (f"; ours with every step in the Python layers "
                 f"{single['python_layers_tokens_per_s']:.0f} tok/s "
                 f"(greedy_match={single['python_layers_greedy_match']})")
    else:
        line += "; decode in the Python layers (no kernels)"
    if "sampled_ratio" in single:
        line += (f"; sampled: ours {single['sampled_ours_tokens_per_s']:.0f} tok/s, "
                 f"transformers {single['sampled_hf_tokens_per_s']:.0f} tok/s, ratio "
                 f"{single['sampled_ratio']:.2f}")
    return line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_argument(p, default="tiny", rl=True)
    add_device_arguments(p)
    p.add_argument("--batch", "--prompts", dest="batch", type=int, default=None,
                   help="prompts (default 16 at tiny, 128 at qwen2.5-0.5b, 32 otherwise)")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="tokens per response (default 64 at tiny, the shape's response_len)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--nproc", type=int, default=NPROC)
    p.add_argument("--no-multirank", action="store_true")
    p.add_argument("--no-early-exit", action="store_true",
                   help="skip the early-exit comparison")
    p.add_argument("--profile", action="store_true",
                   help="time the decode step's pieces (CPU; automatic below ratio 2 off tiny)")
    p.add_argument("--sampled", action=argparse.BooleanOptionalAction, default=None,
                   help="also time sampling at temperature 1 (default: on CUDA)")
    p.add_argument("--hf-cache", choices=("dynamic", "static"), default=None,
                   help="transformers' KV cache (default static on CUDA, dynamic on CPU)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    bad = {k: v for k, v in (("batch", a.batch), ("new_tokens", a.new_tokens),
                             ("repeat", a.repeat), ("nproc", a.nproc))
           if v is not None and v < 1}
    if bad:
        print(f"error: {bad} must be >= 1", file=sys.stderr)
        return 2
    try:
        bd = bench_device(a)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if bd.is_cuda and a.profile:
        print("error: --profile times host calls around the decode step: CPU only",
              file=sys.stderr)
        return 2
    sampled = bd.is_cuda if a.sampled is None else a.sampled
    hf_cache = a.hf_cache or ("static" if bd.is_cuda else "dynamic")
    w = workload(a.shape, a.batch, a.new_tokens, bd)
    batch, n = int(w.ids.shape[0]), w.new_tokens
    single, engines = single_process(w, a.repeat, bd, sampled, hf_cache)
    reference = single.pop("reference")
    result = {**single, "shape": w.shape, "real_weights": w.checkpoint is not None,
              "argv": sys.argv if argv is None else argv,
              "config": {"batch": batch, "new_tokens": n, "prompt_len": int(w.ids.shape[1]),
                         "repeat": a.repeat, "model": w.config.to_dict()},
              "device": bd.describe()}
    if bd.is_cuda:
        from engine import inductor

        result |= {"precision": bd.precision, "hf_cache": hf_cache,
                   "compile_fallbacks": inductor.fallbacks()}
    tol = BF16_TIE_TOL if bd.is_cuda and bd.precision == "bf16" else TIE_TOL
    print(summary(a.shape, single, batch, n, tol, w.checkpoint is not None))
    if single["first_mismatch"]:
        print(f"first mismatch: {single['first_mismatch']}")
    if not a.no_early_exit:
        result["early_exit"] = e = early_exit(w, engines, a.repeat)
        print(f"early exit ({e['short_rows']} of {batch} rows end after {e['short_tokens']} "
              f"tokens): {e['speedup']:.2f}x faster than computing every row to the end, "
              f"identical={e['identical']} ({e['row_steps']} vs {e['row_steps_without']} "
              f"row-steps, {e['compactions']} compactions)")
    if a.profile or (not bd.is_cuda and a.shape != "tiny" and single["ratio"] < 2):
        result["profile"] = prof = decode_profile(w, engines["ours"])
        print(f"decode step {prof['decode_step_ms']:.2f} ms at batch {prof['batch']} over "
              f"<= {prof['positions']} positions ({prof['path']}): " + ", ".join(
                  f"{k} {v:.2f} ms ({prof['fractions'][k]:.0%})"
                  for k, v in prof["per_step_ms"].items())
              + f"; prefill {prof['prefill_ms']:.1f} ms")
    if not a.no_multirank and not bd.is_cuda:  # gloo ranks on CPU; one GPU runs one rank
        result["multirank"] = multi_rank(a.nproc, w, a.repeat, reference)
        train = ",".join(map(str, result["multirank"]["train"]))
        for name, r in result["multirank"]["gen"].items():
            print(f"train {train} -> gen {name}: {r['tokens_per_s']:.0f} tok/s "
                  f"(reshard {r['reshard_time_s'] * 1e3:.1f} ms, micro-DP "
                  f"{r['micro_dp_size']}, matches single process: "
                  f"{r['matches_single_process']})")
    write_json(result, a.json, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
