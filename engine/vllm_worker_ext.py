"""The worker side of the vLLM rollout: methods that vLLM mixes into its GPU worker.

vLLM adds the class named by ``LLM(..., worker_extension_cls=WORKER_EXTENSION)`` to the bases
of its worker class and reaches its methods with ``LLM.collective_rpc(name, args=...)``.  The
worker imports this module by its dotted path, so it imports nothing from vllm (nor anything
heavy) at import time.  vLLM refuses an extension whose attribute names clash with its
worker's, hence the ``hybridflow_`` prefix on every method.

What the methods rely on is the worker's public surface used by vLLM's own RLHF examples:
``self.model_runner.model.load_weights(weights=...)`` (Hugging Face names, *full* tensors:
each weight loader keeps its own TP rank's slice) and ``self.parallel_config``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class HybridflowWorkerExtension:
    """Mixed into vLLM's worker (``self`` is the worker): receives the generation weights."""

    def hybridflow_describe(self) -> dict[str, int]:
        """What the adapter checks once against its generation TP group: ``{"tp_size": n}``."""
        return {"tp_size": int(self.parallel_config.tensor_parallel_size)}

    def hybridflow_load_bucket(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Load one bucket of ``(HF name, full tensor)`` pairs into the model.

        Args:
            bucket: pairs in stream order; any device and floating dtype (the loaders copy
                into vLLM's own parameters, casting and moving as needed).

        Returns:
            the number of tensors handed to ``load_weights`` (the adapter checks the total).
        """
        self.model_runner.model.load_weights(weights=list(bucket))
        return len(bucket)


WORKER_EXTENSION = f"{__name__}.{HybridflowWorkerExtension.__qualname__}"
"""The qualified name to pass as ``worker_extension_cls``."""
DESCRIBE = HybridflowWorkerExtension.hybridflow_describe.__name__
LOAD_BUCKET = HybridflowWorkerExtension.hybridflow_load_bucket.__name__
