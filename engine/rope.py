"""Rotary position embeddings: the positions of the tokens, RoPE's ``(cos, sin)`` tables
(with Llama-3 frequency scaling) and their application to queries and keys."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3 frequency scaling of RoPE (transformers' ``rope_type="llama3"``): wavelengths
    longer than ``original_max_position_embeddings / low_freq_factor`` are stretched by
    ``factor``, shorter than ``.../ high_freq_factor`` kept, those between interpolated."""

    rope_type: str
    """Only ``"llama3"``."""
    factor: float
    """Stretch of the low frequencies (8 in Llama 3.1)."""
    low_freq_factor: float
    """Wavelength bound of the stretched band, as a divisor of the original context."""
    high_freq_factor: float
    """Wavelength bound of the kept band, as a divisor of the original context."""
    original_max_position_embeddings: int
    """Context length of pre-training (8192 in Llama 3.1)."""

    def __post_init__(self) -> None:
        if self.rope_type != "llama3":
            raise ValueError(f"rope_type={self.rope_type!r}: only 'llama3' scaling is supported")
        if not (self.factor > 0 and 0 < self.low_freq_factor < self.high_freq_factor
                and self.original_max_position_embeddings > 0):
            raise ValueError(f"llama3 rope scaling needs factor > 0, 0 < low_freq_factor < "
                             f"high_freq_factor and original_max_position_embeddings > 0, got "
                             f"{self}")

    def scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """The scaled inverse frequencies (the operations of transformers, in its order)."""
        old = self.original_max_position_embeddings
        low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        out = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor
                                                            - self.low_freq_factor)
        smoothed = (1 - smooth) * out / self.factor + smooth * out
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, out)


def rope_tables(position_ids: torch.Tensor, head_dim: int, theta: float,
                dtype: torch.dtype = torch.float32, scaling: RopeScaling | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary ``(cos, sin)``, each ``[B, S, D]``, for integer ``position_ids [B, S]``
    (optionally with Llama-3 frequency ``scaling``)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                             device=position_ids.device).float() / head_dim))
    if scaling is not None:
        inv_freq = scaling.scale(inv_freq)
    freqs = position_ids.float().unsqueeze(-1) * inv_freq  # [B, S, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, S, heads, D]`` (half-split convention of transformers' Llama)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos.unsqueeze(2) + rotated * sin.unsqueeze(2)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: ``cumsum(mask) - 1`` clamped at 0, ``[B, S]``."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)

