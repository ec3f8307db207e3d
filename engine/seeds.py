"""Seeds of the random streams: :func:`derive_seed` names one 63-bit seed per stream (run seed,
purpose, step, replica, ...), :class:`SeedStream` draws a sampling call's per-step seeds from
it with SplitMix64.  Integer maths on the standard library only, so that code which only
derives seeds does not load the sampler (:mod:`engine.sampling`) and its compiled kernels."""

from __future__ import annotations

import hashlib


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed for the random stream named by ``parts`` (run seed, purpose, step,
    replica, ...): a 64-bit hash, so streams of different names never overlap the way sums
    do (``seed + step + replica`` gives step s, replica r the stream of step s + 1, replica
    r - 1)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


MASK64 = (1 << 64) - 1
SPLITMIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
"""SplitMix64's increment (gamma) and its two mixing multipliers, unsigned."""


SEED_LIMIT = 1 << 63
"""Seeds lie in ``[0, SEED_LIMIT)``: a run's seed (config ``seed``, ``data.seed``), a sampling
call's (:class:`SeedStream` keeps all 63 bits) and each derived one (:func:`derive_seed`)."""


def check_seed(name: str, seed: object) -> None:
    """ValueError naming ``name`` unless ``seed`` is an int in ``[0,`` :data:`SEED_LIMIT` ``)``
    (a bool is not a seed)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"{name}={seed!r} must be an int in [0, 2**63)")


def splitmix64(z: int) -> int:
    """SplitMix64's output function (Steele, Lea, Flood 2014) of the 64-bit state ``z``."""
    z = ((z ^ (z >> 30)) * SPLITMIX[1]) & MASK64
    z = ((z ^ (z >> 27)) * SPLITMIX[2]) & MASK64
    return z ^ (z >> 31)


class SeedStream:
    """The per-step seeds of one sampling call: step ``n`` (from 1) takes the 63-bit
    ``splitmix64(seed + n * gamma)``.  Every bit of the 63-bit ``seed`` counts (a
    ``torch.Generator`` keeps only ``seed mod 2**32``, so two rollout seeds equal in their low
    32 bits would draw the same tokens), and, as in SplitMix64, two seeds give overlapping
    streams only if they differ by a multiple of gamma below the number of steps.

    Args:
        seed: an int in ``[0, 2**63)`` (:func:`derive_seed` gives one per named stream).
    """

    def __init__(self, seed: int) -> None:
        check_seed("seed", seed)
        self.seed, self.steps = seed, 0

    def next(self) -> int:
        """The next step's seed, in ``[0, 2**63)``."""
        self.steps += 1
        return splitmix64((self.seed + self.steps * SPLITMIX[0]) & MASK64) >> 1
