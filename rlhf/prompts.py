"""Prompt rows -> the controller's prompt batch: encoding (chat prompts through the tokenizer's
template), left padding, and the rows' ground truth and metadata for the reward."""

from __future__ import annotations

from collections.abc import Callable

from rlhf.controller import Batch
from rlhf.task import Example


def fitting_prompts(examples: list[Example], tok, width: int, what: str,
                    encode: Callable[[Example], list[int]] | None = None) -> list[Example]:
    """The rows whose encoded prompt fits ``width`` tokens; one counted warning for the rest,
    ValueError if none fits.  ``encode``: a row's prompt ids (default ``tok.encode_prompt``;
    multi-turn runs render the row's tools into it)."""
    encode = encode or (lambda e: tok.encode_prompt(e.prompt))
    keep = [e for e in examples if len(encode(e)) <= width]
    dropped = len(examples) - len(keep)
    if not keep:
        raise ValueError(f"{what}: all {len(examples)} prompts are longer than "
                         f"data.max_prompt_len={width} tokens; raise it")
    if dropped:
        print(f"[rlhf] warning: {what}: dropped {dropped} of {len(examples)} prompts longer "
              f"than data.max_prompt_len={width} tokens", flush=True)
    return keep


def encode_prompts(examples: list[Example], tok, width: int, samples: int,
                   first_uid: int) -> Batch:
    """Left-padded prompt ids (chat prompts through the tokenizer's template), each prompt
    repeated ``samples`` times (same uid)."""
    ids = [tok.encode_prompt(e.prompt) for e in examples]
    too_long = [e.prompt for e, i in zip(examples, ids) if len(i) > width]
    if too_long:
        raise ValueError(f"prompts {too_long[:3]} are longer than data.max_prompt_len={width}")
    input_ids, mask = tok.pad_batch(ids, "left", width)
    b = Batch({"input_ids": input_ids, "attention_mask": mask.long()},
              {"answer": [e.answer for e in examples],
               "data_source": [e.data_source for e in examples],
               "extra_info": [e.extra_info for e in examples],
               "prompt": [e.prompt for e in examples],
               "tools": [e.tools for e in examples],
               "uid": list(range(first_uid, first_uid + len(examples)))})
    return b.repeat(samples) if samples > 1 else b
