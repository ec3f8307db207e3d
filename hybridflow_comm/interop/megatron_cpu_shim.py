"""The one place that makes megatron-core 0.16.1 run on a CPU-only torch (gloo).

megatron-core's tensor-parallel *layers* run on CPU as they are when built with
``TransformerConfig(use_cpu_initialization=True)``.  A whole ``GPTModel`` forward does not, for
three reasons, each patched here and nowhere else in the project:

1. **RNG tracker.** Attention dropout always runs inside ``get_cuda_rng_tracker().fork()``
   (even with dropout 0), and megatron's tracker stores and swaps *CUDA* generator states.
   :func:`seed_model_parallel_rng` installs :class:`CpuRNGStatesTracker`, the same named states
   (data-parallel, tensor-parallel, expert-parallel seeds, as in
   ``model_parallel_cuda_manual_seed``) kept as CPU generator states.  This replaces megatron's
   module-level tracker object; torch itself is not touched.
2. **Device of the rotary table.** ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to
   ``torch.cuda.current_device()`` on every call.  Inside :func:`cpu_device` that function
   returns ``torch.device("cpu")``; the original is restored on exit.  This is the only patch
   of torch, and it is scoped.
3. **Default causal mask.** ``get_default_causal_mask`` builds its mask with
   ``device="cuda"``; inside :func:`cpu_device` megatron's softmax module sees a CPU version.

Usage::

    with megatron_cpu_shim.cpu_device():
        megatron_cpu_shim.seed_model_parallel_rng(1234)
        model = GPTModel(...)
        logits = model(tokens, positions, attention_mask=None)
    logits.sum().backward()   # the backward pass needs no shim

Nothing here imports megatron at module import time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_MP_RNG = "model-parallel-rng"
_DP_RNG = "data-parallel-rng"
_EP_RNG = "expert-parallel-rng"


class CpuRNGStatesTracker:
    """Megatron's ``CudaRNGStatesTracker`` interface over the CPU generator.

    ``fork(name)`` swaps the CPU generator to the named state, runs the block, stores the
    advanced state under ``name`` and restores the original, exactly like the CUDA tracker.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = _MP_RNG) -> Iterator[None]:
        if name not in self.states_:
            raise ValueError(f"RNG state {name!r} was never added (call seed_model_parallel_rng)")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def seed_model_parallel_rng(seed: int, tp_rank: int | None = None) -> CpuRNGStatesTracker:
    """CPU stand-in for megatron's ``model_parallel_cuda_manual_seed``.

    Installs a :class:`CpuRNGStatesTracker` as megatron's global tracker with the same seeds
    megatron would use (``seed`` for data parallel, ``seed + 2718 + tp_rank`` for tensor
    parallel, ``seed + 1024`` for experts) and seeds the default CPU generator with ``seed``.

    Args:
        seed: base seed, the same on every rank.
        tp_rank: tensor-parallel rank (default: megatron's parallel_state).

    Returns:
        The installed tracker.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tracker = CpuRNGStatesTracker()
    tracker.add(_DP_RNG, seed)
    tracker.add(_MP_RNG, seed + 2718 + tp_rank)
    tracker.add(_EP_RNG, seed + 1024)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch.manual_seed(seed)
    return tracker


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


@contextlib.contextmanager
def cpu_device() -> Iterator[None]:
    """Within the block, megatron's device queries answer "cpu" (patches 2 and 3 above)."""
    from megatron.core.fusions import fused_softmax

    saved_device = torch.cuda.current_device
    saved_mask = fused_softmax.get_default_causal_mask
    torch.cuda.current_device = lambda: torch.device("cpu")
    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    try:
        yield
    finally:
        torch.cuda.current_device = saved_device
        fused_softmax.get_default_causal_mask = saved_mask
