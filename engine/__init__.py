"""HybridEngine: the TP/PP training model, the KV-cache generation engine and the actor's
training <-> generation cycle, built on :mod:`hybridflow_comm`."""

import os as _os

# The decode kernels read this when engine._kernels loads; a bad value must not pass for a
# missing extension (the modules that import it fall back to the Python paths on ImportError).
_PREFETCH = _os.environ.get("HYBRIDFLOW_WEIGHT_PREFETCH")
if _PREFETCH not in (None, "nta", "t1"):
    raise ValueError(f"HYBRIDFLOW_WEIGHT_PREFETCH={_PREFETCH!r} must be 'nta' or 't1' (unset: "
                     f"nta on AMD CPUs, t1 elsewhere; csrc/engine/small_gemm.cpp)")
