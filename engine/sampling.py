"""Sampling parameters and next-token selection from vocab-parallel logits.

Every rank of a generation TP group holds the logits of its own vocabulary slice
``[B, V/t_g]`` (rows ``vocab_range``).  All members must pick the *same* token; they do so by
running identical code on identical, all-gathered inputs with identical seed streams
(:class:`SeedStream`).
What is gathered depends on the mode, so the full ``[B, V]`` logits move only when the
distribution really needs the whole vocabulary:

    mode                          all-gathered per step (per row)          full logits?
    greedy (temperature == 0)     (local max, sum-exp, argmax and its id)  no
    top_k > 0                     k local candidates (value, id) + stats   no (exact: the
                                                                           global top-k is
                                                                           among them)
    temperature / top_p only      the V/t_g local logits                   yes

The log-normaliser is combined from the per-rank ``(max, sum exp(z - max))`` pairs in float64
(``lse = m + log sum_r s_r exp(m_r - m)``), so no rank needs the full softmax.

Returned log-probs are those of the distribution actually sampled *before* any truncation,
``log_softmax(logits / temperature)`` of the chosen token (top-k/top-p only restrict the draw):
exactly what the training model recomputes for the same sequence at the same temperature
(:meth:`engine.model.ParallelLlama.head_outputs`), so the PPO ratio starts at 1 and rollout
and training can be compared token by token.  Greedy (``temperature == 0``) has no sampled
distribution; its log-probs are the model's, ``log_softmax(logits)`` at temperature 1.
Every sampling mode divides the logits by the temperature once, first (which keeps their
order, so what each mode gathers and selects is unchanged).

``min_new_tokens`` (HF ``generate(min_new_tokens=)``, vLLM ``SamplingParams.min_tokens``):
while a row has produced fewer tokens, the EOS logit is set to -inf before any other
processing (before top-k/top-p, as in HF's ``MinNewTokensLengthLogitsProcessor``), so the
token is drawn from the distribution renormalised over the rest (greedy: the argmax of the
rest).  Only the rank whose vocabulary slice holds EOS masks it, in the logits it selects
from; the normaliser is gathered from the unmasked ones.  Like top-k/top-p it is a
truncation of the support, so the returned log-probs stay those of the model's
``softmax(logits / temperature)`` *without* the mask (what training recomputes, so the PPO
ratio still starts at 1; under the masked distribution the sampled token's log-prob is
larger by ``-log(1 - p_eos)``).  HF's ``output_scores`` and vLLM's ``processed_logprobs``
are of the masked distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.inductor import Compiled
from engine.seeds import SPLITMIX, SeedStream, check_seed
from engine.seeds import derive_seed  # noqa: F401  (re-exported)
from hybridflow_comm.comm import all_gather_tensor
from hybridflow_comm.groups import Group

try:  # C++ kernels (setup.py builds them); the same uniforms by tensor ops without them
    from engine import _kernels
except ImportError:  # pragma: no cover - a source tree never built
    _kernels = None


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick each new token."""

    max_new_tokens: int = 16
    """Tokens to generate per sequence at most (the response width)."""
    temperature: float
    """Softmax temperature; 0 means greedy (argmax, lowest id on ties).  Tokens are drawn from
    ``softmax(logits / temperature)`` and their log-probs are of that distribution (greedy: of
    ``softmax(logits)``).  No default: the run config's rollout temperature
    (data.temperature) is the one."""
    top_k: int = 0
    """Keep only the k most likely tokens before sampling; 0 disables."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest top set with probability mass >= top_p; in (0, 1]."""
    eos_token_id: int | None = None
    """A sequence ends after emitting this token (it is kept, with mask 1); None: never."""
    min_new_tokens: int = 0
    """EOS cannot be drawn before a row has this many tokens (its logit is -inf; the module
    docstring says how this acts on the draw and on the log-probs); 0 = off, no effect
    without ``eos_token_id``.  At most ``max_new_tokens``; a row's own, smaller limit
    (``GenerationEngine.generate(max_new_tokens=)``) still ends it."""
    pad_token_id: int = 0
    """Written after a sequence has ended (mask 0)."""
    seed: int = 0
    """Seed of the sampling call's :class:`SeedStream` (all 63 bits count); the same seed
    gives the same tokens."""
    first_row: int = 0
    """Row id of the call's first row in the draw's counters (:func:`clock_uniforms`): row
    ``i`` draws as row ``first_row + i`` of a larger batch, so a batch generated as calls of
    consecutive rows (waves) samples the tokens of one call over all of it."""

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got "
                             f"max_new_tokens={self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an int >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.pad_token_id < 0 or (self.eos_token_id is not None and self.eos_token_id < 0):
            raise ValueError(f"pad_token_id={self.pad_token_id} and eos_token_id="
                             f"{self.eos_token_id} must be >= 0")
        if isinstance(self.min_new_tokens, bool) or not isinstance(self.min_new_tokens, int) \
                or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens={self.min_new_tokens!r} must be an int in "
                             f"[0, max_new_tokens={self.max_new_tokens}] (0 = off)")
        check_seed("seed", self.seed)
        if isinstance(self.first_row, bool) or not isinstance(self.first_row, int) \
                or not 0 <= self.first_row < 1 << 31:
            raise ValueError(f"first_row={self.first_row!r} must be an int in [0, 2**31)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def banned_token(self, step: int) -> int | None:
        """The token that cannot be drawn at decode step ``step`` (= tokens each row has
        produced before it): EOS while ``step < min_new_tokens``, else None."""
        return self.eos_token_id if step < self.min_new_tokens else None

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError unless the special token ids exist in the vocabulary."""
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and value >= vocab_size:
                raise ValueError(f"{name}={value} is outside the vocabulary of {vocab_size}")


def _without(z: torch.Tensor, token: int | None, start: int) -> torch.Tensor:
    """``z [B, V_slice]`` (vocabulary ids ``start, start + 1, ...``) with the column of
    global id ``token`` at -inf: a copy when this slice holds it, else ``z`` itself."""
    if token is None or not start <= token < start + z.shape[-1]:
        return z
    out = z.clone()  # out of place: z may be the caller's logits
    out.select(-1, token - start).fill_(float("-inf"))  # no index tensor to copy over
    return out


def _all_gather(t: torch.Tensor, group: Group | None) -> torch.Tensor:
    """``[t_g, *t.shape]``, in group-rank order (= vocabulary order)."""
    if group is None:
        return t.unsqueeze(0)
    return all_gather_tensor(t, group)


def _log_normaliser(lmax: torch.Tensor, lsum: torch.Tensor) -> torch.Tensor:
    """Combine per-rank ``[t, B]`` maxima and sums of exp into the global log-sum-exp ``[B]``."""
    m = lmax.max(dim=0).values
    return m + torch.log((lsum * torch.exp(lmax - m)).sum(dim=0))


def _draw(scaled: torch.Tensor, stream: SeedStream, rows: torch.Tensor | None = None,
          first_row: int = 0) -> torch.Tensor:
    """One index ``[B, 1]`` per row from ``softmax(scaled)`` (every sampling path's draw).

    The exponential race: with ``E_j = -log(U_j) ~ Exp(1)`` drawn per candidate,
    ``argmax(p_j / E_j)`` (the candidate whose clock of rate ``p_j`` rings first) is a draw
    from ``p``, and removing a candidate that loses the race leaves the winner unchanged.
    The exponentials come from counter-based float32 uniforms (:func:`clock_uniforms`) and a
    vectorised log, not from ``torch.multinomial`` (its ``exponential_`` takes a scalar
    double ``log1p`` per candidate) or ``torch.rand`` with a generator (a sequential Mersenne
    Twister); ``bench/generation.py --profile`` times the sampling stage.  ``rows``
    (``[B_full]`` bool, the True rows are ``scaled``'s rows, in order) gives each row its id
    in the full batch: a row's draw, and the stream's state after the step, do not depend
    on which other rows are still running (early exit compacts finished rows away);
    ``first_row`` (:attr:`SamplingParams.first_row`) is added to every id.
    """
    probs = torch.softmax(scaled, dim=-1)
    row_ids = _row_ids(probs.shape[0], rows, first_row, probs.device)
    return _race(probs, clock_uniforms(stream, row_ids, probs.shape[-1]))


def _race(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """``[R, 1]`` the candidate of ``probs [R, C]`` whose clock (of ``uniforms``, the same
    shape) rings first: ``argmax p / E``."""
    return (probs / _clocks(uniforms).to(probs.dtype)).argmax(dim=-1, keepdim=True)


MIN_CLOCK = 2.0 ** -25
"""Smallest exponential clock: a uniform of 1 gives ``-log(1) = 0``, and a candidate of
probability 0 (banned, filtered, or underflowed) would then race as ``0 / 0 = NaN``, which
argmax picks; at ``MIN_CLOCK`` it scores 0, and any candidate of probability > 0 with that
clock still rings first."""


def _clocks(uniforms: torch.Tensor) -> torch.Tensor:
    """The race's exponential clocks ``max(-log(u), MIN_CLOCK)`` of ``uniforms`` in (0, 1],
    computed in place (``uniforms`` is the caller's fresh tensor)."""
    return uniforms.log_().neg_().clamp_min_(MIN_CLOCK)


def _row_ids(count: int, rows: torch.Tensor | None, first_row: int,
             device: torch.device) -> torch.Tensor:
    """``[count]`` the draw's row ids: the True rows of ``rows`` (None: all), as many as
    there are logits rows (known on the host: no device sync), plus ``first_row``."""
    return (torch.arange(count, device=device) if rows is None
            else torch.nonzero_static(rows, size=count).squeeze(1)) + first_row


_GAMMA, _MIX1, _MIX2 = (c - (1 << 64) for c in SPLITMIX)  # as int64


def clock_uniforms(stream: SeedStream, row_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """The race's uniforms ``[len(row_ids), vocab]`` float32 in ``(0, 1]`` of one step.

    One 63-bit seed is taken from ``stream`` (so it advances by one step whatever the rows),
    and ``u[i, j]`` is SplitMix64 of ``(seed, row_ids[i], j)`` (:func:`counter_uniforms_formula`;
    ``engine._kernels.counter_uniforms`` where built and ``row_ids`` is on the CPU).  A row's
    uniforms depend on its id in the full batch only; they live on ``row_ids``' device.
    """
    seed = stream.next()
    if _kernels is not None and row_ids.device.type == "cpu":
        return _kernels.counter_uniforms(seed, row_ids, vocab)
    return counter_uniforms_formula(seed, row_ids, vocab)


def counter_uniforms_formula(seed: int | torch.Tensor, row_ids: torch.Tensor,
                             vocab: int) -> torch.Tensor:
    """SplitMix64 by int64 tensor ops (products wrap mod 2^64; ``>>`` is arithmetic, so the
    logical shifts mask the sign bits): ``(top 24 bits + 1) / 2^24`` of
    ``mix(seed + (row << 32 | j + 1) * gamma)``; ``seed`` an int or a 0-d int64 tensor on
    ``row_ids``' device (compiled code: no constant per step)."""
    def shr(z: torch.Tensor, bits: int) -> torch.Tensor:
        return (z >> bits) & ((1 << (64 - bits)) - 1)

    counter = (row_ids.long()[:, None] << 32) + torch.arange(vocab, device=row_ids.device) + 1
    z = counter * _GAMMA + seed
    z = (z ^ shr(z, 30)) * _MIX1
    z = (z ^ shr(z, 27)) * _MIX2
    z = z ^ shr(z, 31)
    return (shr(z, 40) + 1).float() * 2.0 ** -24


def _rows_kernel(z: torch.Tensor) -> bool:
    """Whether ``engine._kernels.argmax_logsumexp`` takes ``z``: float32 CPU ``[R, V > 0]``
    outside code ``torch.compile`` traces."""
    return (_kernels is not None and z.dtype == torch.float32 and z.device.type == "cpu"
            and z.dim() == 2 and z.shape[-1] > 0 and not torch.compiler.is_compiling())


def _logsumexp(z: torch.Tensor) -> torch.Tensor:
    """``log sum exp(z)`` over the last dim as float64, summed in float32 after subtracting
    the row maximum (relative error of the sum ~1e-7), cheaper than ``logsumexp`` of a
    float64 copy; the C++ rows kernel where it applies (csrc/engine/vocab_rows.cpp, two
    passes on vectors)."""
    if _rows_kernel(z):
        return _kernels.argmax_logsumexp(z, -1)[2]
    zmax = z.amax(dim=-1, keepdim=True)
    total = torch.exp(z - zmax).sum(dim=-1)
    return zmax.squeeze(-1).double() + torch.log(total.double())


def _filter_and_sample(values: torch.Tensor, ids: torch.Tensor, params: SamplingParams,
                       stream: SeedStream, rows: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k, top-p over candidate logits ``values [B, C]`` (already divided by the
    temperature) with global ``ids``; ``rows`` as in :func:`_draw`.

    Returns the chosen ids ``[B]`` and their (temperature-scaled) logits ``[B]``.
    """
    if params.top_p == 1 and not 0 < params.top_k < values.shape[-1]:
        # nothing is filtered: sample from the candidates as they come (no sort)
        pick = _draw(values, stream, rows, params.first_row)
        return (torch.gather(ids, -1, pick).squeeze(-1),
                torch.gather(values, -1, pick).squeeze(-1))
    sorted_z, order = torch.sort(values, dim=-1, descending=True, stable=True)
    sorted_ids = torch.gather(ids, -1, order)
    kept = sorted_z.clone()  # truncated in place; sorted_z keeps every logit
    if 0 < params.top_k < kept.shape[-1]:
        kept[:, params.top_k:] = float("-inf")
    if params.top_p < 1:
        probs = torch.softmax(kept, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop = mass_before >= params.top_p
        drop[:, 0] = False  # the most likely token always stays
        kept = kept.masked_fill(drop, float("-inf"))
    pick = _draw(kept, stream, rows, params.first_row)
    return torch.gather(sorted_ids, -1, pick).squeeze(-1), torch.gather(sorted_z, -1,
                                                                        pick).squeeze(-1)


def whole_vocab_formula(logits: torch.Tensor, inv_temperature: torch.Tensor | None,
                        banned: int | None, seed: torch.Tensor | None,
                        row_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_next`'s two whole-vocabulary modes without filters, as one function of
    tensors (what :data:`COMPILED_DEVICES` run compiled): ``seed`` None, the argmax (greedy,
    or ``top_k == 1`` at a temperature), else the draw of :func:`_draw` from the 0-d int64
    ``seed`` for ``row_ids``.  The logits are scaled by the float32 ``inv_temperature`` (0-d;
    None: greedy), as CUDA divides by a scalar and as the training head scales them.
    Returns ``(tokens [R], log_probs [R])``."""
    z = logits.float() if inv_temperature is None else logits.float() * inv_temperature
    zs = _without(z, banned, 0)
    if seed is None:
        smax, arg = zs.max(dim=-1)  # first maximum = lowest vocabulary id
        return arg, smax - torch.logsumexp(z, dim=-1)
    pick = _race(torch.softmax(zs, dim=-1),
                 counter_uniforms_formula(seed, row_ids, z.shape[-1]))
    return pick.squeeze(-1), (torch.gather(z, -1, pick).squeeze(-1).double()
                              - _logsumexp(z)).float()


_whole_vocab = Compiled(whole_vocab_formula)
"""Compiled from ``MIN_NUMEL`` logits on (:mod:`engine.inductor`); eager below."""

COMPILED_DEVICES = ("cuda",)
"""Where the whole-vocabulary modes run :data:`_whole_vocab`: eagerly a step is some ten
passes over the ``[R, V]`` logits (the draw's int64 counters alone are five), compiled one
fused loop per reduction.  On the CPU the C++ kernels of the draw and the argmax do the same
in place."""


@torch.no_grad()
def sample_next(logits: torch.Tensor, params: SamplingParams, group: Group | None,
                stream: SeedStream | None, rows: torch.Tensor | None = None,
                step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose the next token of every row from vocab-parallel logits.

    Args:
        logits: ``[B, V/t_g]`` this rank's vocabulary slice (slice ``group.rank``).
        params: sampling settings (greedy when ``temperature == 0``).
        group: generation TP group (None or size 1: no communication).
        stream: the call's seeds (unused when greedy); identical state on every member.
        rows: ``[B_full]`` bool or None (all rows): the logits' rows are the True rows of a
            batch of ``B_full``; the random draw is made for all ``B_full`` rows, so a row's
            token does not depend on which rows are still running (:func:`_draw`).
        step: tokens every row has produced before this one (EOS is masked while it is below
            ``params.min_new_tokens``).

    Returns:
        ``(tokens [B] int64, log_probs [B] float32)``, identical on every member; log-probs of
        ``softmax(logits / temperature)`` before the EOS mask and top-k/top-p truncation
        (temperature 1 when greedy; see the module docstring).
    """
    # z: the logits of the sampled distribution (greedy: the model's own), which give the
    # log-probs; zs: the ones the token is selected from (z, or z with EOS at -inf)
    whole_vocab = group is None or group.pg is None
    banned = params.banned_token(step)
    argmax_only = params.greedy or params.top_k == 1
    device = logits.device
    if whole_vocab and device.type in COMPILED_DEVICES and (
            argmax_only or (params.top_p == 1 and params.top_k == 0)):
        inv_t = None if params.greedy else torch.full(
            (), params.temperature, dtype=torch.float32, device=device).reciprocal()
        if argmax_only:
            return _whole_vocab(logits, inv_t, banned, None, None)
        seed = torch.full((), stream.next(), dtype=torch.long, device=device)
        return _whole_vocab(logits, inv_t, banned, seed,
                            _row_ids(logits.shape[0], rows, params.first_row, device))
    z = logits.float() if params.greedy else logits.float() / params.temperature
    v_local = z.shape[-1]
    start = (0 if group is None else group.rank) * v_local
    if whole_vocab and argmax_only and _rows_kernel(z):
        # the argmax-only modes below: the first maximum over the columns but EOS (while
        # banned) and the normaliser over all of them, in one C++ call
        arg, best, lse = _kernels.argmax_logsumexp(z, -1 if banned is None else banned)
        return arg, (best.double() - lse).float()
    zs = _without(z, banned, start)
    if whole_vocab and not params.greedy and params.top_p == 1 and params.top_k == 0:
        # nothing to gather or filter: the general path's draw and log-prob in fewer ops
        pick = _draw(zs, stream, rows, params.first_row)
        lse = _logsumexp(z)
        return pick.squeeze(-1), (torch.gather(z, -1, pick).squeeze(-1).double() - lse).float()
    smax, arg = zs.max(dim=-1)  # first maximum = lowest vocabulary id
    # top_k == 1 keeps one token, the most likely: greedy's choice, ties to the lowest id
    # (torch.topk's order among equal logits is unspecified), with no random draw
    if argmax_only and whole_vocab:
        return arg, smax - torch.logsumexp(z, dim=-1)
    lmax = smax if zs is z else z.amax(dim=-1)
    lsum = torch.exp(z - lmax.unsqueeze(-1)).sum(dim=-1)
    if argmax_only:
        packed = torch.stack([lmax.double(), lsum.double(), smax.double(),
                              (arg + start).double()], dim=-1)
        table = _all_gather(packed, group)  # [t, B, 4]
        lse = _log_normaliser(table[..., 0], table[..., 1])
        winner = table[..., 2].argmax(dim=0)  # first maximum = lowest vocabulary id
        best = torch.gather(table, 0, winner.view(1, -1, 1).expand(1, -1, 4))[0]  # [B, 4]
        return best[:, 3].long(), (best[:, 2] - lse).float()
    if params.top_k > 0:
        k = min(params.top_k, v_local)
        vals, idx = torch.topk(zs, k, dim=-1)  # [B, k], sorted
        packed = torch.cat([vals.double(), (idx + start).double(), lmax.double().unsqueeze(-1),
                            lsum.double().unsqueeze(-1)], dim=-1)
        table = _all_gather(packed, group)  # [t, B, 2k+2]
        values = table[..., :k].permute(1, 0, 2).flatten(1)  # [B, t*k]
        ids = table[..., k:2 * k].permute(1, 0, 2).flatten(1).long()
        lse = _log_normaliser(table[..., 2 * k], table[..., 2 * k + 1])
        chosen, chosen_z = _filter_and_sample(values, ids, params, stream, rows)
        return chosen, (chosen_z - lse).float()
    full = _all_gather(z, group).permute(1, 0, 2).flatten(1)  # [B, V]: documented full gather
    lse = _logsumexp(full)
    ids = torch.arange(full.shape[-1], device=full.device).expand_as(full)
    chosen, chosen_z = _filter_and_sample(_without(full, params.banned_token(step), 0), ids,
                                          params, stream, rows)
    return chosen, (chosen_z.double() - lse).float()
