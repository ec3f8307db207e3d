"""A generation call's inputs and output: the prompts' checks, the rows' limits, the shared
prefill of identical prompts, and :class:`GenerationOutput` (the layout of one call's
result, drawn in :mod:`engine.generation`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.llama_spec import LlamaConfig
from engine.sampling import SamplingParams


@dataclass
class GenerationOutput:
    """Prompts and responses of one batch (the layout is drawn in :mod:`engine.generation`)."""

    input_ids: torch.Tensor
    """``[B, P + N]`` int64: left-padded prompt, then the right-padded response."""
    attention_mask: torch.Tensor
    """``[B, P + N]`` int64, 1 for real tokens."""
    log_probs: torch.Tensor
    """``[B, N]`` float32 log-probs of the response tokens under ``softmax(logits / T)``
    before top-k/top-p truncation and the EOS mask of ``min_new_tokens`` (greedy: ``T = 1``);
    0 where masked (:mod:`engine.sampling`)."""
    prompt_length: int
    """P."""
    routes: torch.Tensor | None = None
    """A mixture of experts generating with ``record_routes``: ``[B, P + N, L, k]`` int16,
    the experts every layer sent each token to (the routing router replay imposes on the
    training passes); -1 at padding and at the last token, which is never fed."""
    stats: dict = field(default_factory=dict)
    """This rank's timing and memory: ``time_s``, ``new_tokens``, ``kv_cache_bytes``..."""

    @property
    def responses(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_length:]

    @property
    def response_mask(self) -> torch.Tensor:
        return self.attention_mask[:, self.prompt_length:]


def check_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                  config: LlamaConfig, sampling: SamplingParams) -> torch.Tensor:
    """Validate a prompt batch (ValueError naming the value); returns the mask (int64).

    The checks read the values on the host: a few device-to-host syncs per call.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 \
            or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"input_ids must be an int tensor [B, P], got "
                         f"{getattr(input_ids, 'shape', type(input_ids))}")
    batch, plen = input_ids.shape
    if batch == 0 or plen == 0:
        raise ValueError(f"input_ids must be non-empty, got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids, dtype=torch.long)
    if tuple(attention_mask.shape) != (batch, plen):
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                         f"{(batch, plen)}")
    mask = attention_mask.long()
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask must hold only 0 and 1")
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError("prompts must be left-padded (attention_mask rows 0..0 1..1)")
    if bool((mask[:, -1] == 0).any()):
        raise ValueError(f"prompt rows {torch.nonzero(mask[:, -1] == 0).flatten().tolist()} "
                         f"have no real token")
    real = input_ids[mask.bool()]
    if bool(((real < 0) | (real >= config.vocab_size)).any()):
        raise ValueError(f"prompt token ids must be in [0, {config.vocab_size}), got "
                         f"min={int(real.min())} max={int(real.max())}")
    total = plen + sampling.max_new_tokens
    if total > config.max_position_embeddings:
        raise ValueError(f"prompt length {plen} + max_new_tokens={sampling.max_new_tokens} = "
                         f"{total} exceeds max_position_embeddings="
                         f"{config.max_position_embeddings}")
    sampling.check_vocab(config.vocab_size)
    return mask


def check_limits(limits: torch.Tensor | None, batch: int, n_new: int,
                 device: torch.device) -> torch.Tensor:
    """The rows' own ``max_new_tokens`` ``[B]`` on ``device`` (default all ``n_new``);
    ValueError naming them unless each is in ``[1, n_new]``."""
    if limits is None:
        return torch.full((batch,), n_new, dtype=torch.long, device=device)
    limits = torch.as_tensor(limits, dtype=torch.long, device=device)
    if tuple(limits.shape) != (batch,) or bool(((limits < 1) | (limits > n_new)).any()):
        raise ValueError(f"max_new_tokens per sequence must be [B={batch}] ints in "
                         f"[1, {n_new}], got {limits.tolist()}")
    return limits


def distinct_prompts(prompt: torch.Tensor, mask: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows to prefill and how to copy them back to one row per sequence.

    Identical prompts (the samples of one prompt in GRPO, RLOO, ...: equal ids and mask) share
    their prefill, as vLLM's ``n > 1`` does.  Returns ``(distinct [U], copies)``: the first
    row of each distinct prompt, in batch order, and ``copies [B]`` with the index into
    ``distinct`` of every row's prompt, or None when all ``B`` prompts differ (then
    ``distinct`` is every row and nothing is copied).
    """
    batch, device = prompt.shape[0], prompt.device
    # the number of distinct prompts sizes the prefill: one device-to-host sync a call
    _, group = torch.unique(torch.cat([prompt, mask], dim=1), dim=0, return_inverse=True)
    first = torch.full((int(group.max()) + 1,), batch, dtype=torch.long, device=device)
    first.scatter_reduce_(0, group, torch.arange(batch, device=device), reduce="amin")
    if first.numel() == batch:
        return torch.arange(batch, device=device), None
    distinct, order = first.sort()  # batch order
    slot = torch.empty_like(order)
    slot[order] = torch.arange(order.numel(), device=device)
    return distinct, slot[group]


def padded_prompt(input_ids: torch.Tensor, mask: torch.Tensor,
                   sampling: SamplingParams) -> torch.Tensor:
    """The prompt as returned: padding positions hold ``pad_token_id``."""
    return input_ids.long().masked_fill(mask == 0, sampling.pad_token_id)
