"""A character-level tokenizer for the built-in arithmetic task, built locally with the
``tokenizers`` library (nothing is downloaded).

Vocabulary (ids are fixed, so a saved model and a rebuilt tokenizer always agree)::

    0 <pad>   1 <bos>   2 <eos>   3 <unk>   4..13 '0'..'9'   14 '+'  15 '-'  16 '*'  17 '='
    18 ' '    19.. <extra_k> unused, up to a multiple of ``pad_to_multiple`` (TP splits the vocab)

Prompts are left-padded and responses right-padded by :meth:`CharTokenizer.pad_batch`.
"""

from __future__ import annotations

import os

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = "0123456789+-*= "


class CharTokenizer:
    """Thin wrapper over a ``tokenizers.Tokenizer`` with one token per character."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        ids = {s: tokenizer.token_to_id(s) for s in SPECIALS}
        if None in ids.values():
            raise ValueError(f"tokenizer lacks special tokens: {ids}")
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = (ids[s] for s in SPECIALS)

    @classmethod
    def build(cls, pad_to_multiple: int = 8) -> "CharTokenizer":
        """Build the vocabulary above; ``vocab_size`` is a multiple of ``pad_to_multiple``."""
        if pad_to_multiple < 1:
            raise ValueError(f"pad_to_multiple={pad_to_multiple} must be >= 1")
        tokens = list(SPECIALS) + list(CHARS)
        while len(tokens) % pad_to_multiple:
            tokens.append(f"<extra_{len(tokens)}>")
        tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens([t for t in tokens if t.startswith("<")])
        return cls(tok)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CharTokenizer":
        """Load a tokenizer saved by :meth:`save` (a ``tokenizers`` json file)."""
        if not os.path.isfile(path):
            raise ValueError(f"tokenizer file {str(path)!r} does not exist")
        return cls(Tokenizer.from_file(str(path)))

    def save(self, path: str | os.PathLike) -> None:
        self.tok.save(str(path))

    def save_files(self, folder: str | os.PathLike) -> None:
        """``folder/tokenizer.json`` (what :func:`rlhf.task.load_tokenizer` reads back)."""
        self.save(os.path.join(folder, "tokenizer.json"))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``; ValueError naming any character outside the vocabulary."""
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if self.unk_id in ids:
            bad = sorted({c for c in text if self.tok.token_to_id(c) is None})
            raise ValueError(f"text {text!r} has characters outside the vocabulary: {bad}")
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids, skip_special: bool = True) -> str:
        """Text of ``ids`` (list or 1-D tensor); specials dropped when ``skip_special``."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def decode_response(self, ids) -> str:
        """Text of a generated response: everything before the first ``<eos>``, pads dropped."""
        return self.decode([i for i in response_ids(ids, self.eos_id) if i != self.pad_id])

    def encode_prompt(self, prompt: str) -> list[int]:
        """``<bos> prompt`` ids (the built-in task's prompts are plain strings)."""
        if not isinstance(prompt, str):
            raise ValueError(f"the character tokenizer takes string prompts, got "
                             f"{type(prompt).__name__}: {prompt!r:.80}; chat prompts need an HF "
                             f"tokenizer with a chat template (tokenizer=DIR)")
        return self.encode(prompt, add_bos=True)

    def pad_batch(self, seqs: list[list[int]], side: str = "left", length: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        return pad_sequences(seqs, self.pad_id, side, length)


def response_ids(ids, eos_id: int) -> list[int]:
    """A generated response's ids (list or 1-D tensor) before its first ``eos_id``."""
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return ids[:ids.index(eos_id)] if eos_id in ids else ids


def pad_sequences(seqs: list[list[int]], pad_id: int, side: str = "left",
                  length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad id lists to ``[B, L]`` int64 ids and a ``[B, L]`` bool attention mask.

    ``side="left"`` for prompts (generation appends on the right), ``"right"`` for responses.
    """
    if side not in ("left", "right"):
        raise ValueError(f"side={side!r} must be 'left' or 'right'")
    longest = max((len(s) for s in seqs), default=0)
    length = longest if length is None else length
    if length < longest:
        raise ValueError(f"length={length} is shorter than the longest sequence ({longest})")
    # rows built as lists, one tensor each (per-row tensor writes cost the controller more)
    pads = [[pad_id] * (length - len(s)) for s in seqs]
    rows = [p + s if side == "left" else s + p for s, p in zip(seqs, pads)]
    marks = [[False] * len(p) + [True] * len(s) if side == "left"
             else [True] * len(s) + [False] * len(p) for s, p in zip(seqs, pads)]
    shape = (len(seqs), length)
    return (torch.tensor(rows, dtype=torch.long, device="cpu").reshape(shape),
            torch.tensor(marks, dtype=torch.bool, device="cpu").reshape(shape))
