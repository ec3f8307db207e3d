"""Micro-batches by token budget (dynamic batch size) and padding removal, as pure functions.

Dynamic batching (verl's ``use_dynamic_bsz``): a mini-batch's sequences are split into
micro-batches by their total number of real tokens, each at most ``max_tokens``, instead of
a fixed number of rows.  :func:`partition_by_tokens` does it in two passes::

    1. first-fit decreasing (FFD) finds how many bins the budget needs, k
       (FFD uses at most 11/9 OPT + 6/9 bins, and at most one of its bins is half full or less)
    2. LPT into exactly k' >= k bins (k' = k, or the largest k of all DP ranks): sequences
       longest first, each into the least-loaded bin (an empty one first, so every bin gets
       a sequence); that bin has the most room, so if the
       sequence does not fit there it fits nowhere, and then FFD's own bins are used (split
       until there are k').  Loads of an LPT result differ by at most the longest sequence.

Deterministic: ties break by sequence index, and each micro-batch lists its rows in order.
Unlike verl's Karmarkar-Karp split (balanced, but a part may exceed the budget) every
micro-batch here respects the budget.

Padding removal: a padded micro-batch ``[B, S]`` becomes one row of its ``T`` real tokens::

    input_ids [B, S]     | p p a b c |        packed [1, T]   | a b c | d e | f g h i |
                         | d e p p p |   ->   cu_seqlens      0       3     5         9
                         | p f g h i |        position_ids    0 1 2   0 1   0 1 2 3

:func:`pack_rows` gives the index maps (:class:`PackedRows`): ``pack`` gathers any ``[B, S,
...]`` tensor into that row, ``scatter`` puts per-token results back at their padded
``(row, column)`` with zeros elsewhere.  Each real token sees the same keys and positions as in
the padded row, so the outputs at real positions are the padded path's up to summation order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention import PackedSeqs


# Partitioning -------------------------------------------------------------------------------
def check_token_budget(lengths: Sequence[int], max_tokens: int) -> None:
    """ValueError unless ``max_tokens`` is a positive int and no sequence is longer."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_token_len_per_micro_batch={max_tokens!r} must be an int > 0")
    if any(n < 0 for n in lengths):
        raise ValueError(f"sequence lengths must be >= 0, got {min(lengths)}")
    longest = max(lengths, default=0)
    if longest > max_tokens:
        i = list(lengths).index(longest)
        raise ValueError(f"max_token_len_per_micro_batch={max_tokens} is shorter than sequence "
                         f"{i} of the batch ({longest} tokens): raise it to at least "
                         f"max_prompt_len + max_response_len")


def _decreasing(lengths: Sequence[int]) -> list[int]:
    """Indices by length, longest first, ties by index."""
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def first_fit_decreasing(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Bins of sequence indices, each summing to at most ``max_tokens`` (FFD bin packing).

    Args:
        lengths: tokens of each sequence.
        max_tokens: budget per bin (>= every length).

    Returns:
        The bins in the order they were opened, each with its indices ascending.
    """
    check_token_budget(lengths, max_tokens)
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in _decreasing(lengths):
        j = next((j for j, load in enumerate(loads) if load + lengths[i] <= max_tokens), None)
        if j is None:
            bins.append([i])
            loads.append(lengths[i])
        else:
            bins[j].append(i)
            loads[j] += lengths[i]
    return [sorted(b) for b in bins]


def count_micro_batches(lengths: Sequence[int], max_tokens: int) -> int:
    """How many micro-batches :func:`partition_by_tokens` makes on its own (FFD's count)."""
    return len(first_fit_decreasing(lengths, max_tokens))


def _lpt(lengths: Sequence[int], max_tokens: int, parts: int) -> list[list[int]] | None:
    """Longest first into the least-loaded of ``parts`` bins (ties: fewest sequences, then
    lowest bin, so no bin stays empty); None when a sequence does not fit the least-loaded bin
    (then it fits none)."""
    bins: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for i in _decreasing(lengths):
        j = min(range(parts), key=lambda j: (loads[j], len(bins[j]), j))
        if loads[j] + lengths[i] > max_tokens:
            return None
        bins[j].append(i)
        loads[j] += lengths[i]
    return bins


def _split_to(bins: list[list[int]], lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Halve the heaviest bin of >= 2 sequences (alternating members, longest first) until
    there are ``parts`` bins; a part of a bin stays within the budget."""
    bins = [list(b) for b in bins]
    while len(bins) < parts:
        j = max((j for j, b in enumerate(bins) if len(b) > 1),
                key=lambda j: (sum(lengths[i] for i in bins[j]), -j))
        members = sorted(bins[j], key=lambda i: (-lengths[i], i))
        bins[j] = members[0::2]
        bins.append(members[1::2])
    return bins


def partition_by_tokens(lengths: Sequence[int], max_tokens: int,
                        parts: int | None = None) -> list[list[int]]:
    """Micro-batches of sequence indices by token budget (see the module docstring).

    Args:
        lengths: real tokens of each sequence of the mini-batch.
        max_tokens: budget per micro-batch; ValueError if a sequence is longer.
        parts: exact number of micro-batches (e.g. the largest :func:`count_micro_batches` of
            all DP ranks, so every rank runs as many); None = FFD's count.  Must lie in
            ``[count_micro_batches(...), len(lengths)]``.

    Returns:
        ``parts`` lists of indices, each ascending, every index in exactly one, each list's
        tokens ``<= max_tokens``; ordered by their first index.
    """
    ffd = first_fit_decreasing(lengths, max_tokens)
    k = len(ffd) if parts is None else parts
    if isinstance(k, bool) or not isinstance(k, int) or not len(ffd) <= k <= len(lengths):
        raise ValueError(f"parts={parts!r} must be an int in [{len(ffd)}, {len(lengths)}] (the "
                         f"budget needs {len(ffd)} micro-batches of {len(lengths)} sequences)")
    bins = _lpt(lengths, max_tokens, k) if k else []
    if bins is None:
        bins = _split_to(ffd, lengths, k)
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


# Padding removal ----------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class PackedRows:
    """Where the real tokens of a padded ``[B, S]`` micro-batch go in its packed row ``[1, T]``
    (see the module docstring; built by :func:`pack_rows`)."""

    batch: int
    """Rows B of the padded micro-batch."""
    seq: int
    """Columns S of the padded micro-batch."""
    index: torch.Tensor
    """``[T]`` flat padded index ``row * S + col`` of each packed token, row-major."""
    has_next: torch.Tensor
    """``[T]`` bool: the padded position right after the token is real, so it is the next
    packed token (the token's next-token log-prob is the padded path's)."""
    seqs: PackedSeqs
    """Sequence boundaries on the row (one per padded row, empty ones included)."""

    @property
    def total(self) -> int:
        return self.seqs.total

    @property
    def cols(self) -> torch.Tensor:
        """``[T]`` padded column of each packed token."""
        return self.index % self.seq

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, S, ...]`` -> ``[1, T, ...]`` (the real positions, in order)."""
        if tuple(t.shape[:2]) != (self.batch, self.seq):
            raise ValueError(f"cannot pack a tensor of shape {tuple(t.shape)}: the micro-batch "
                             f"is [{self.batch}, {self.seq}]")
        return t.flatten(0, 1)[self.index].unsqueeze(0)

    def scatter(self, values: torch.Tensor, keep: torch.Tensor, start: int, width: int
                ) -> torch.Tensor:
        """Per-token results back to a padded ``[B, width, ...]`` (zeros elsewhere).

        Args:
            values: ``[n, ...]`` results of the packed tokens selected by ``keep``.
            keep: ``[T]`` bool selection of the packed tokens.
            start: padded column that becomes column 0 of the result (the head's start).
            width: columns of the result; every kept token's column lies in
                ``[start, start + width)``.

        Differentiable in ``values``.
        """
        index = self.index[keep]
        rows, cols = index // self.seq, index % self.seq - start
        flat = rows * width + cols
        out = values.new_zeros((self.batch * width, *values.shape[1:]))
        return out.index_put((flat,), values).unflatten(0, (self.batch, width))


def pack_rows(attention_mask: torch.Tensor) -> PackedRows:
    """The packing of a padded micro-batch from its ``attention_mask [B, S]`` (1 = real token,
    padding anywhere: left, right, or holes).

    Raises:
        ValueError: the mask is not 2-D or has no real token at all.
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [B, S], got {tuple(attention_mask.shape)}")
    real = attention_mask.bool()
    batch, seq = real.shape
    index = real.flatten().nonzero().squeeze(1)
    if index.numel() == 0:
        raise ValueError(f"a micro-batch of {batch} rows has no real token to pack")
    after = torch.cat([real[:, 1:], torch.zeros(batch, 1, dtype=torch.bool, device=real.device)],
                      1)  # [B, S]
    cu = [0] + real.sum(1).cumsum(0).tolist()  # host boundaries: one sync per micro-batch
    return PackedRows(batch=batch, seq=seq, index=index, has_next=after.flatten()[index],
                      seqs=PackedSeqs(tuple(cu)))
