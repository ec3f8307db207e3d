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
an unsupported torch) warns once and leaves that function eager for the process, except
during a CUDA graph capture, where it is raised (eager work would land in a capture the failure
may have invalidated).  A call past dynamo's recompile limit (``recompile_limit``, 8 variants
of one function's code; ``fullgraph=True`` makes dynamo raise it) runs eagerly, with one
warning (a function may set its own limit: :class:`Compiled` ``recompile_limit``).
:func:`fallbacks` and :func:`compile_counts` report both, for the benches' records.
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


def compile_applies(wanted: bool | None, device: torch.device) -> bool:
    """The one compile rule of the engines' layers: ``wanted`` (None: on for CUDA, where
    launches dominate small layers; off on the CPU, where a process compiles for a few
    seconds per kind of call) while compiling is enabled."""
    on = device.type == "cuda" if wanted is None else bool(wanted)
    return on and _enabled


try:
    from torch._dynamo.exc import FailOnRecompileLimitHit as _RecompileLimit
except ImportError:  # pragma: no cover - a torch without it raises nothing of the kind
    _RecompileLimit = ()

_instances: list[Compiled] = []


def fallbacks() -> list[str]:
    """The functions that ran eagerly where they were to run compiled, in this process: a
    failed compile (eager from then on) or calls past dynamo's recompile limit; what a bench
    records beside its compiled figures."""
    return sorted({c.fn.__qualname__ for c in _instances if c._broken or c.eager_calls})


def _graphs_of(fn: Callable) -> int:
    """Graphs dynamo holds for ``fn``'s code (its first compile and every recompile, shared by
    every ``torch.compile`` of that code: what its recompile limit counts); 0 where this
    torch cannot say."""
    code = getattr(fn, "__code__", None)
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        return len(_debug_get_cache_entry_list(code)) if code is not None else 0
    except (ImportError, RuntimeError, TypeError):  # pragma: no cover - another torch
        return 0


def compile_counts() -> dict[str, dict[str, int]]:
    """Per compiled function that ran compiled or fell back, by name: ``graphs`` (dynamo's
    compiled variants of its code), ``recompiles`` (``graphs - 1``), ``eager_calls`` (calls
    run eagerly past the recompile limit) and ``failed`` (1 when its compile failed)."""
    out: dict[str, dict[str, int]] = {}
    for c in _instances:
        if c._compiled is None and not c._broken:
            continue
        row = out.setdefault(c.fn.__qualname__, {"graphs": _graphs_of(c.fn), "eager_calls": 0,
                                                 "failed": 0})
        row["eager_calls"] += c.eager_calls
        row["failed"] = max(row["failed"], int(c._broken))
    for row in out.values():
        row["recompiles"] = max(0, row["graphs"] - 1)
    return out


def _capturing() -> bool:
    """Whether this thread's current CUDA stream is recording a graph (never before CUDA is
    initialised: asking then could initialise it, or fail without a GPU)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


class Compiled:
    """``fn`` eager, or compiled once its first argument has at least ``min_numel``
    elements (and compiling is enabled); the results are those of ``fn`` up to float32
    summation order.  ``dynamic``: ``torch.compile``'s (True: every size symbolic from the
    first compile; None: sizes that change between calls become symbolic at the second).
    ``backward_with_forward``: a function trained through compiles its backward with its
    forward (:meth:`_lowering`).  ``scalar_outputs``: a function that reads sizes from a
    tensor (``tolist``) traces them as unbacked sizes (dynamo's ``capture_scalar_outputs``),
    so it compiles whole rather than breaking its graph there.  ``recompile_limit``: the
    variants this function may compile (dynamo's ``recompile_limit`` during its calls; None:
    dynamo's, 8), for a function that serves every model of a process and each kind of call
    to it.  A call past dynamo's recompile limit runs eagerly (with
    one warning; counted in :attr:`eager_calls`); a compile that fails leaves the function
    eager for the process, or is raised during a CUDA graph capture."""

    def __init__(self, fn: Callable, min_numel: int = MIN_NUMEL,
                 dynamic: bool | None = True, backward_with_forward: bool = False,
                 scalar_outputs: bool = False, recompile_limit: int | None = None) -> None:
        self.fn, self.min_numel, self.dynamic = fn, min_numel, dynamic
        self.backward_with_forward, self.scalar_outputs = backward_with_forward, scalar_outputs
        self.recompile_limit = recompile_limit
        self._compiled: Callable | None = None
        self._broken = False
        self.eager_calls = 0
        """Calls run eagerly past dynamo's recompile limit."""
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
            with self._lowering(), self._tracing():
                return self._compiled(first, *args)
        except torch.OutOfMemoryError:
            raise  # not a compile failure: the eager formula would need more memory still
        except _RecompileLimit:  # a variant past dynamo's recompile limit: this call eagerly
            # (raised before anything runs, so eager work is also right inside a capture)
            self.eager_calls += 1
            if self.eager_calls == 1:
                warnings.warn(f"torch.compile of {self.fn.__qualname__} reached dynamo's "
                              f"recompile limit; new variants run eagerly", RuntimeWarning,
                              stacklevel=2)
            return self.fn(first, *args)
        except Exception as exc:  # the backend could not compile: stay eager, say so once
            if _capturing():  # the capture may be invalid now: eager work would be lost in it
                raise
            self._broken = True
            warnings.warn(f"torch.compile of {self.fn.__qualname__} failed ({type(exc).__name__}:"
                          f" {exc}); running it eagerly", RuntimeWarning, stacklevel=2)
            return self.fn(first, *args)

    def _tracing(self):
        """Dynamo's settings of this function inside: ``capture_scalar_outputs`` with
        ``scalar_outputs``, its ``recompile_limit`` (both read when a call compiles)."""
        if not self.scalar_outputs and self.recompile_limit is None:
            return contextlib.nullcontext()  # the common case, every call of a decode step
        import torch._dynamo.config as dynamo_config  # not at import: it sets inductor's cache

        stack = contextlib.ExitStack()
        if self.scalar_outputs:
            stack.enter_context(_attribute(dynamo_config, "capture_scalar_outputs", True))
        if self.recompile_limit is not None:
            stack.enter_context(_attribute(dynamo_config, "recompile_limit",
                                           self.recompile_limit))
        return stack

    def _lowering(self):
        """With ``backward_with_forward``, AOTAutograd lowers the backward when it compiles
        the forward (where the torch has the switch), so that a backward the backend cannot
        compile fails inside this call's fallback, not later in ``loss.backward()``."""
        if self.backward_with_forward and hasattr(functorch_config,
                                                  "force_non_lazy_backward_lowering"):
            return _eager_backward_lowering()
        return contextlib.nullcontext()


@contextlib.contextmanager
def _attribute(config, name: str, value):
    """``config.name = value`` inside, restored after (a tenth of ``config.patch``'s cost,
    paid on every layer's call)."""
    previous = getattr(config, name)
    setattr(config, name, value)
    try:
        yield
    finally:
        setattr(config, name, previous)


def _eager_backward_lowering():
    """AOTAutograd's ``force_non_lazy_backward_lowering`` on inside."""
    return _attribute(functorch_config, "force_non_lazy_backward_lowering", True)
