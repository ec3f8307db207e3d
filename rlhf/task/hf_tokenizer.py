"""A user's tokenizer: any HF tokenizer folder (``tokenizer.json`` / ``tokenizer_config.json``,
loaded with ``transformers.AutoTokenizer``, nothing downloaded), behind the same small interface
as the built-in :class:`rlhf.task.CharTokenizer`::

    vocab_size, pad_id, eos_id          special ids (pad falls back to eos)
    encode_prompt(prompt) -> ids        a chat list [{role, content}] through the tokenizer's
                                        own chat template (add_generation_prompt=True); a string
                                        as plain text (with the tokenizer's BOS, if it adds one)
    decode_response(ids) -> str         the generated tokens up to EOS, special tokens skipped
    pad_batch(seqs, side, length)       [B, L] ids and bool mask
"""

from __future__ import annotations

import os

import torch

from rlhf.task.tokenizer import CharTokenizer, pad_sequences, response_ids

TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")


def is_tokenizer_dir(path: str | os.PathLike) -> bool:
    """An HF tokenizer folder (``save_pretrained`` writes tokenizer_config.json)."""
    return os.path.isfile(os.path.join(path, "tokenizer_config.json"))


def load_tokenizer(path: str | os.PathLike | None):
    """The tokenizer in folder ``path``: an HF tokenizer (tokenizer_config.json), the built-in
    character tokenizer saved by ``rlhf.sft`` (a lone tokenizer.json), or the built-in one
    when ``path`` is None."""
    if path is None:
        return CharTokenizer.build()
    if is_tokenizer_dir(path):
        return HFTokenizer(path)
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return CharTokenizer.load(os.path.join(path, "tokenizer.json"))
    raise ValueError(f"tokenizer={str(path)!r} is not a folder with tokenizer files "
                     f"({', '.join(TOKENIZER_FILES)})")


class HFTokenizer:
    """Adapter over ``transformers.AutoTokenizer.from_pretrained(path)`` (local files only)."""

    def __init__(self, path: str | os.PathLike) -> None:
        from transformers import AutoTokenizer

        if not is_tokenizer_dir(path):
            raise ValueError(f"tokenizer={str(path)!r} is not a folder with tokenizer files "
                             f"({', '.join(TOKENIZER_FILES)})")
        self.path = str(path)
        self.tok = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        eos = self.tok.eos_token_id
        if eos is None:
            raise ValueError(f"tokenizer {self.path!r} has no eos token: generation could never "
                             f"end a response")
        self.eos_id = int(eos)
        pad = self.tok.pad_token_id
        self.pad_id = int(eos if pad is None else pad)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return len(self.tok)

    def encode_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tok(prompt)["input_ids"])
        if not (isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m
                                                 and "content" in m for m in prompt)):
            raise ValueError(f"a prompt must be a string or a chat list of {{role, content}} "
                             f"dicts, got {prompt!r:.120}")
        if not self.tok.chat_template:
            raise ValueError(f"tokenizer {self.path!r} has no chat_template, so chat prompts "
                             f"cannot be rendered; use string prompts or a tokenizer with one")
        ids = self.tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return list(ids)

    def decode_response(self, ids) -> str:
        n = self.vocab_size  # a model's padded embedding rows have no token
        return self.tok.decode([i for i in response_ids(ids, self.eos_id) if i < n],
                               skip_special_tokens=True)

    def pad_batch(self, seqs: list[list[int]], side: str = "left", length: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        return pad_sequences(seqs, self.pad_id, side, length)

    def save_files(self, folder: str | os.PathLike) -> None:
        """Write the tokenizer files into ``folder`` (beside an exported model)."""
        self.tok.save_pretrained(str(folder))
