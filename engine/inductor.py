"""``torch.compile`` (inductor) of small pure tensor functions, where a call is big enough.

Elementwise chains over large tensors (the vocabulary log-softmax of the LM head: ``rows x V``
logits) run as one fused loop when compiled instead of one pass per eager op.  Compiling costs
a few seconds once per process (and per new number of dimensions or dtype; sizes are
symbolic, ``dynamic=True``), so a :class:`Compiled` function runs eagerly below
:data:`MIN_NUMEL` elements, where the eager passes are cheap anyway and short test jobs would
pay the compile for nothing.

Compiled code is cached on disk (inductor's ``TORCHINDUCTOR_CACHE_DIR``).  Unless the user
sets that directory, the first compile points it at a subdirectory of inductor's default keyed
by ATen's CPU capability and the CPU model (:func:`keyed_cache_dir`): an entry written under
one capability (``ATEN_CPU_CAPABILITY``) or on another CPU, e.g. in a copied container, was
seen to give wrong log-probs when loaded under another.

Switches: ``HYBRIDFLOW_COMPILE=0`` in the environment, or :func:`set_enabled`, runs every
function eagerly (the A/B of ``bench/roofline.py``).  A compile that fails (no C++ compiler,
an unsupported torch) warns once and leaves that function eager for the process.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import warnings
from collections.abc import Callable

import torch
import torch._functorch.config as functorch_config

MIN_NUMEL = 1 << 20
"""Smallest first-argument ``numel`` run compiled (4 MiB of float32)."""

_enabled = os.environ.get("HYBRIDFLOW_COMPILE", "1") != "0"
_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
_user_cache = _CACHE_ENV in os.environ


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), "")
    except OSError:
        return ""


def keyed_cache_dir(base: str, capability: str, cpu_model: str) -> str:
    """``base``'s subdirectory for code compiled under ATen's ``capability`` on ``cpu_model``
    (pure)."""
    digest = hashlib.blake2b(cpu_model.encode(), digest_size=4).hexdigest()
    return os.path.join(base, f"hybridflow-{capability.lower()}-{digest}")


def _key_the_cache() -> None:
    """Point inductor's cache at :func:`keyed_cache_dir` unless the user chose a directory."""
    if _user_cache:
        return
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    os.environ[_CACHE_ENV] = keyed_cache_dir(
        default_cache_dir(), torch.backends.cpu.get_cpu_capability(), _cpu_model())


def set_enabled(enabled: bool) -> bool:
    """Compile from now on (or not); returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


def enabled() -> bool:
    return _enabled


try:
    from torch._dynamo.exc import FailOnRecompileLimitHit as _RecompileLimit
except ImportError:  # pragma: no cover - a torch without it raises nothing of the kind
    _RecompileLimit = ()

_instances: list[Compiled] = []


def fallbacks() -> list[str]:
    """The functions whose compile failed in this process (they run eagerly): what a bench
    records beside its compiled figures."""
    return sorted(c.fn.__qualname__ for c in _instances if c._broken)


class Compiled:
    """``fn`` eager, or compiled once its first argument has at least ``min_numel``
    elements (and compiling is enabled); the results are those of ``fn`` up to float32
    summation order.  ``dynamic``: ``torch.compile``'s (True: every size symbolic from the
    first compile; None: sizes that change between calls become symbolic at the second).
    ``backward_with_forward``: a function trained through compiles its backward with its
    forward (:meth:`_lowering`).  A call past dynamo's recompile limit runs eagerly (with
    one warning); a compile that fails leaves the function eager for the process."""

    def __init__(self, fn: Callable, min_numel: int = MIN_NUMEL,
                 dynamic: bool | None = True, backward_with_forward: bool = False) -> None:
        self.fn, self.min_numel, self.dynamic = fn, min_numel, dynamic
        self.backward_with_forward = backward_with_forward
        self._compiled: Callable | None = None
        self._broken = False
        self._limited = False
        _instances.append(self)

    def uses_compiled(self, first: torch.Tensor) -> bool:
        return _enabled and not self._broken and first.numel() >= self.min_numel

    def __call__(self, first: torch.Tensor, *args):
        if not self.uses_compiled(first):
            return self.fn(first, *args)
        if self._compiled is None:
            _key_the_cache()
            self._compiled = torch.compile(self.fn, dynamic=self.dynamic, fullgraph=True)
        try:
            with self._lowering():
                return self._compiled(first, *args)
        except torch.OutOfMemoryError:
            raise  # not a compile failure: the eager formula would need more memory still
        except _RecompileLimit:  # a variant past dynamo's recompile limit: this call eagerly
            if not self._limited:
                self._limited = True
                warnings.warn(f"torch.compile of {self.fn.__qualname__} reached dynamo's "
                              f"recompile limit; new variants run eagerly", RuntimeWarning,
                              stacklevel=2)
            return self.fn(first, *args)
        except Exception as exc:  # the backend could not compile: stay eager, say so once
            self._broken = True
            warnings.warn(f"torch.compile of {self.fn.__qualname__} failed ({type(exc).__name__}:"
                          f" {exc}); running it eagerly", RuntimeWarning, stacklevel=2)
            return self.fn(first, *args)

    def _lowering(self):
        """With ``backward_with_forward``, AOTAutograd lowers the backward when it compiles
        the forward (where the torch has the switch), so that a backward the backend cannot
        compile fails inside this call's fallback, not later in ``loss.backward()``."""
        if self.backward_with_forward and hasattr(functorch_config,
                                                  "force_non_lazy_backward_lowering"):
            return _eager_backward_lowering()
        return contextlib.nullcontext()


@contextlib.contextmanager
def _eager_backward_lowering():
    """AOTAutograd's ``force_non_lazy_backward_lowering`` on inside (set and restored as an
    attribute: a tenth of ``config.patch``'s cost, paid on every layer's call)."""
    previous = functorch_config.force_non_lazy_backward_lowering
    functorch_config.force_non_lazy_backward_lowering = True
    try:
        yield
    finally:
        functorch_config.force_non_lazy_backward_lowering = previous
