"""Tensor-parallel building blocks as pure functions of (input, weight, group).

Every function takes the TP group explicitly (a :class:`hybridflow_comm.groups.Group`, or
None); a group of one rank has ``pg is None`` and every collective is skipped, so the same code
runs in one process without torch.distributed.  Nothing here owns a parameter: the training
model passes its flat-buffer views, the generation engine passes its generation shards.

Weight forms accepted::

    column-parallel  w  [out/t, in]                       y_local = x @ w.T   (no comm forward)
    row-parallel     w  [out, in/t]                        y = all_reduce(x_local @ w.T)
                     w  [m, out, in/t/m]  (stacked slots)  y = all_reduce(einsum)   (torch may
                                                           copy w into the GEMM's layout)
                     w  [m, out, in/m]  pieces of one whole tensor (row_linear_pieces: a sum
                                        of the pieces' products, each read in place)
    vocab-parallel   w  [V/t, H]  rows [t_rank*V/t, (t_rank+1)*V/t) of the vocabulary
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine import onednn
from engine.inductor import Compiled
from hybridflow_comm.groups import Group


def _pg(group: Group | None):
    return None if group is None else group.pg


def _rank(group: Group | None) -> int:
    return 0 if group is None else group.rank


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient (input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.pg)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward; identity backward (output of a row-parallel layer)."""

    @staticmethod
    def forward(ctx, x, pg):
        x = x.contiguous()
        dist.all_reduce(x, group=pg)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Mark ``x`` (replicated over the TP group) as input of column-parallel work."""
    pg = _pg(group)
    return x if pg is None else _CopyToTP.apply(x, pg)


def reduce_from_tp(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Sum partial results over the TP group (differentiable)."""
    pg = _pg(group)
    return x if pg is None else _ReduceFromTP.apply(x, pg)


def column_linear(x: torch.Tensor, weight: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Column-parallel linear.

    Args:
        x: ``[..., in]`` replicated over the TP group.
        weight: ``[out_local, in]`` (a training shard or several concatenated on dim 0).
        group: TP group (its gradient all-reduce runs in backward).

    Returns:
        ``[..., out_local]``, this rank's slice of the output features.
    """
    return onednn.linear(copy_to_tp(x, group), weight)


def row_linear(x: torch.Tensor, weight: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Row-parallel linear: input features split over the TP group, output summed.

    Args:
        x: ``[..., in_local]``, this rank's slice of the input features.
        weight: ``[out, in_local]``, or the stacked generation form ``[m, out, in_local/m]``
            (m neighbouring training shards; read in place by an einsum, never concatenated).
        group: TP group of the layout the weight belongs to.

    Returns:
        ``[..., out]`` replicated over the group.
    """
    if weight.dim() == 2:
        y = onednn.linear(x, weight)
    elif weight.dim() == 3:
        m, _, k = weight.shape
        if x.shape[-1] != m * k:
            raise ValueError(f"row_linear: input has {x.shape[-1]} features but the stacked "
                             f"weight {tuple(weight.shape)} expects {m * k}")
        y = torch.einsum("...mk,mok->...o", x.unflatten(-1, (m, k)), weight)
    else:
        raise ValueError(f"row_linear: weight must be [out, in] or [m, out, in/m], got "
                         f"{tuple(weight.shape)}")
    return reduce_from_tp(y, group)


def row_linear_pieces(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [..., m * k]`` times a weight stored as its ``m`` column pieces ``[m, out, k]``
    (e.g. an expert's ``down_proj`` kept as its generation pieces): the sum over the pieces of
    ``x_i @ weight[i].T``, each product on a view of its piece, so neither the forward nor
    autograd's saved tensors copy the weight.  No communication."""
    m, _, k = weight.shape
    if x.shape[-1] != m * k:
        raise ValueError(f"row_linear_pieces: input has {x.shape[-1]} features but the pieces "
                         f"{tuple(weight.shape)} expect {m * k}")
    y = onednn.linear(x[..., :k], weight[0])
    for i in range(1, m):
        y = y + onednn.linear(x[..., i * k:(i + 1) * k], weight[i])
    return y


def vocab_range(vocab_local: int, group: Group | None) -> tuple[int, int]:
    """``[start, end)`` of the vocabulary rows held by this rank."""
    start = _rank(group) * vocab_local
    return start, start + vocab_local


def vocab_embedding(ids: torch.Tensor, weight: torch.Tensor,
                    group: Group | None) -> torch.Tensor:
    """Vocab-parallel embedding lookup.

    Args:
        ids: ``[...]`` token ids (global vocabulary).
        weight: ``[V/t, H]`` this rank's rows.
        group: TP group.

    Returns:
        ``[..., H]`` replicated over the group.
    """
    if _pg(group) is None:
        return torch.nn.functional.embedding(ids, weight)
    start, end = vocab_range(weight.shape[0], group)
    outside = (ids < start) | (ids >= end)
    local = (ids - start).masked_fill(outside, 0)
    out = torch.nn.functional.embedding(local, weight).masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from_tp(out, group)


def _vocab_row_sums(z: torch.Tensor, zmax: torch.Tensor, local_t: torch.Tensor) -> torch.Tensor:
    """One pass over this rank's logits ``z [..., V/t]`` (float32): ``[3, ...]`` stacked sum of
    ``exp(z - zmax)``, sum of ``exp(z - zmax) * z``, and the target's logit (0 where the target
    is another rank's)."""
    e = torch.exp(z - zmax.unsqueeze(-1))
    inside = (local_t >= 0) & (local_t < z.shape[-1])
    z_t = torch.gather(z, -1, local_t.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return torch.stack([e.sum(dim=-1), (e * z).sum(dim=-1), z_t.masked_fill(~inside, 0.0)])


def _vocab_grad(z: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                local_t: torch.Tensor, g_logp: torch.Tensor, g_ent: torch.Tensor) -> torch.Tensor:
    """``d(g_logp . logp + g_ent . H) / dz`` in one pass (no communication)."""
    log_p = z - lse.unsqueeze(-1)
    p = torch.exp(log_p)
    target = torch.arange(z.shape[-1], device=z.device) == local_t.unsqueeze(-1)  # none outside
    g = g_logp.unsqueeze(-1)
    return torch.where(target, g, 0.0) - p * (g + (log_p + entropy.unsqueeze(-1)) * g_ent.unsqueeze(-1))


_row_sums = Compiled(_vocab_row_sums)
_grad = Compiled(_vocab_grad)


class _VocabLogProbEntropy(torch.autograd.Function):
    """Log-prob of the targets and entropy of softmax(logits), logits split over the vocab.

    Forward: two all-reduces of ``[...]``-shaped tensors (the max, then one stacked sum of
    ``sum exp(z - max)``, ``sum exp(z - max) z`` and the target logit); the ``[..., V/t]``
    logits never leave the rank, and each rank reads them twice (the max, then one fused pass,
    :mod:`engine.inductor` above its size threshold).  Backward needs no communication and is
    one pass::

        d logp / dz_j = onehot_j - p_j
        d H    / dz_j = -p_j * (log p_j + H)        H = lse - sum_j p_j z_j
    """

    @staticmethod
    def forward(ctx, logits, targets, pg, start):
        # logits [..., V/t] any float dtype, targets [...] global ids
        z = logits.float().contiguous()  # every sum, exp and log below in float32
        zmax = z.amax(dim=-1)  # values only: max() also finds the indices
        if pg is not None:
            dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=pg)
        local_t = targets - start
        sums = _row_sums(z, zmax, local_t)
        if pg is not None:
            dist.all_reduce(sums, group=pg)
        lse = zmax + torch.log(sums[0])
        logp = sums[2] - lse
        entropy = lse - sums[1] / sums[0]
        # p is recomputed in backward from z and lse: only the logits stay alive
        ctx.save_for_backward(z, lse, entropy, local_t)
        ctx.in_dtype = logits.dtype
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        z, lse, entropy, local_t = ctx.saved_tensors
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp
        g_ent = torch.zeros_like(lse) if g_ent is None else g_ent
        grad = _grad(z, lse, entropy, local_t, g_logp.float(), g_ent.float())
        return grad.to(ctx.in_dtype), None, None, None


def vocab_log_prob_entropy(logits: torch.Tensor, targets: torch.Tensor,
                           group: Group | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-prob of ``targets`` and entropy, from vocab-parallel logits.

    The maths runs in float32 whatever the logits' dtype (bf16 logits are upcast once, here;
    their gradient goes back in their own dtype).

    Args:
        logits: ``[..., V/t]`` this rank's vocabulary slice (rows ``vocab_range``), any float
            dtype.
        targets: ``[...]`` global token ids.
        group: TP group over which the vocabulary is split.

    Returns:
        ``(log_probs, entropy)``, both ``[...]`` float32, replicated over the group.
    """
    start, _ = vocab_range(logits.shape[-1], group)
    return _VocabLogProbEntropy.apply(logits, targets, _pg(group), start)


LOGITS_PER_CHUNK = 2 ** 24
"""Logit elements one chunk of :func:`linear_log_prob_entropy` holds (64 MiB in float32)."""


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[rows, V/t]`` float32 logits of ``h`` (scaled in float32 as the padded head does)."""
    z = onednn.linear(h, weight).float()
    return z / temperature if temperature != 1.0 else z


class _LinearLogProbEntropy(torch.autograd.Function):
    """:func:`vocab_log_prob_entropy` of ``h @ weight.T / temperature`` computed ``rows``
    tokens at a time: a chunk's ``[rows, V/t]`` logits exist only while it is processed, in
    forward and again (recomputed) in backward.

    Forward keeps per token this rank's max ``m``, ``s = sum exp(z - m)``, ``a = sum exp(z -
    m) z`` and the target's logit; the ranks then agree on ``M = max m`` (one all-reduce) and
    sum ``s exp(m - M)``, ``a exp(m - M)`` and the target logits (one all-reduce): the same two
    collectives as the whole-logits path.  Backward: per chunk the logits again, their
    gradient (:func:`_vocab_grad`), ``dh = dz W`` and ``dW += dz^T h``, accumulated by the
    product itself in the weight's dtype (one rounding per chunk; one chunk: the whole path's
    product), so nothing of the head's size is allocated beyond the gradient.
    """

    @staticmethod
    def forward(ctx, h, weight, targets, pg, start, temperature, rows):
        # h [T, H] (replicated over TP), weight [V/t, H], targets [T] global ids
        local_t = targets - start
        stats = []
        for a in range(0, h.shape[0], rows):
            z = _chunk_logits(h[a:a + rows], weight, temperature)
            m = z.amax(dim=-1)
            stats.append(torch.cat([m[None], _row_sums(z, m, local_t[a:a + rows])]))
        m, s, ez, zt = torch.cat(stats, dim=1) if stats else torch.zeros(4, 0, device=h.device)
        big = m.clone()
        if pg is not None:
            dist.all_reduce(big, op=dist.ReduceOp.MAX, group=pg)
        scale = torch.exp(m - big)
        sums = torch.stack([s * scale, ez * scale, zt])
        if pg is not None:
            dist.all_reduce(sums, group=pg)
        lse = big + torch.log(sums[0])
        logp = sums[2] - lse
        entropy = lse - sums[1] / sums[0]
        ctx.save_for_backward(h, weight, lse, entropy, local_t)
        ctx.temperature, ctx.rows = temperature, rows
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h, weight, lse, entropy, local_t = ctx.saved_tensors
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.float()
        g_ent = torch.zeros_like(lse) if g_ent is None else g_ent.float()
        rows, temperature = ctx.rows, ctx.temperature
        want_h, want_w = ctx.needs_input_grad[:2]  # a frozen head (LoRA) needs no dW
        dh = torch.empty_like(h) if want_h else None
        dw = None
        for a in range(0, h.shape[0], rows):
            b = a + rows
            z = _chunk_logits(h[a:b], weight, temperature)
            dz = _grad(z, lse[a:b], entropy[a:b], local_t[a:b], g_logp[a:b], g_ent[a:b])
            if temperature != 1.0:
                dz = dz / temperature
            dz = dz.to(h.dtype)
            if want_h:
                dh[a:b] = dz @ weight
            if want_w:
                dw = dz.t() @ h[a:b] if dw is None else dw.addmm_(dz.t(), h[a:b])
        return dh, dw, None, None, None, None, None


def linear_log_prob_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                            group: Group | None, temperature: float = 1.0,
                            chunk_elems: int | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`vocab_log_prob_entropy` of the vocab-parallel head's logits ``hidden @ weight.T /
    temperature``, never holding more than ``chunk_elems`` logits: where the whole logits
    would exceed them, the LM head and the log-softmax fused a chunk of tokens at a time
    (:class:`_LinearLogProbEntropy`; at 151,936 columns the whole logits of a micro-batch take
    about 10 bytes per element between forward and backward, the chunks recompute theirs in
    backward instead); otherwise the whole logits, computed once.

    Args:
        hidden: ``[..., H]`` replicated over the TP group.
        weight: ``[V/t, H]`` this rank's vocabulary rows.
        targets: ``[...]`` global token ids.
        group: TP group over which the vocabulary is split.
        temperature: the logits are divided by it (in float32).
        chunk_elems: logits per chunk (at least one token's row; default
            :data:`LOGITS_PER_CHUNK`).

    Returns:
        ``(log_probs, entropy)``, both ``[...]`` float32, replicated over the group.
    """
    chunk_elems = LOGITS_PER_CHUNK if chunk_elems is None else chunk_elems
    rows = max(1, chunk_elems // max(1, weight.shape[0]))
    if hidden[..., 0].numel() <= rows:  # the whole logits fit one chunk: no recompute
        logits = column_linear(hidden, weight, group)
        if temperature != 1.0:
            logits = logits.float() / temperature  # scaled in float32, as the log-softmax
        return vocab_log_prob_entropy(logits, targets, group)
    start, _ = vocab_range(weight.shape[0], group)
    lead = hidden.shape[:-1]
    h = copy_to_tp(hidden, group).reshape(-1, hidden.shape[-1])
    logp, entropy = _LinearLogProbEntropy.apply(h, weight, targets.reshape(-1), _pg(group),
                                                start, float(temperature), rows)
    return logp.reshape(lead), entropy.reshape(lead)
