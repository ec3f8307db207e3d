"""The CUDA decode backend (:class:`engine.decode_backend.DecodeBackend`): the dense KV cache
that SDPA reads in place, decode steps at the static shapes of their batch bucket
(:class:`engine.cuda_graphs.StaticDecode` over :class:`engine.compiled_decode.
StaticDecodeLayers`), compiled where ``compile_decode`` and replayed as CUDA graphs where
``cuda_graphs``, each pipeline stage its own step (the hidden states sent and received
between them outside the graphs); the head by BLAS and the sampler on the device.  Every part
but the capture runs on the CPU as well (``kv_layout="dense"``), eagerly or through
inductor.
"""

from __future__ import annotations

import torch

from engine.compiled_decode import StaticDecodeLayers
from engine.cuda_graphs import StaticDecode, bucket
from engine.decode_backend import Head
from engine.decode_memory import DecodeMemory
from engine.forward_paths import CallPlan, StageLayers, choose_paths
from engine.kv_cache import DenseKVCache
from engine.sampling import SamplingParams, SeedStream


class CudaDecode:
    """Decode on the dense KV cache.

    Args:
        device: where the cache lives.
        cuda_graphs: the static steps are captured and replayed (CUDA only).
        compile_decode: the static steps' layers run compiled.
        experts: the experts this rank holds (generation EP; None: all).
    """

    name = "cuda"

    def __init__(self, device: torch.device, cuda_graphs: bool, compile_decode: bool,
                 experts: tuple[int, ...] | None) -> None:
        self.cuda_graphs, self.compile_decode = cuda_graphs, compile_decode
        self.experts = experts
        self.memory = DecodeMemory(DenseKVCache, device, cuda_graphs)
        self.paths = None
        self.block_rows = None
        self.layers: StaticDecodeLayers | None = None
        self.weights_key: object = None

    def set_weights(self, stage: StageLayers, weights_key: object) -> None:
        self.paths = choose_paths(stage, False)
        self.layers = StaticDecodeLayers(stage, self.compile_decode, self.experts)
        self.weights_key = weights_key

    def release(self, keep_cache: bool) -> None:
        self.paths, self.layers, self.weights_key = None, None, None
        self.memory.release(keep=keep_cache)

    def capacity(self, batch: int) -> int:
        """The static steps run the rows of the batch's bucket."""
        return bucket(batch)

    def call_cache(self, sizes: dict, embed, plan: CallPlan
                   ) -> tuple[DenseKVCache, StaticDecode]:
        cache = self.memory.cache_for(**sizes)
        return cache, self.memory.static_decode(embed, self.layers.forward, self.weights_key)

    def kernel_loop(self, single_stage: bool) -> bool:
        return False

    def sample(self, head: Head, x: torch.Tensor, sampling: SamplingParams,
               stream: SeedStream, plan: CallPlan, rows: torch.Tensor | None, step: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return head.sample(x, sampling, stream, rows, step)

    def stats(self) -> dict:
        return {"kv_layout": "dense", "cuda_graphs": self.cuda_graphs,
                "compile_decode": self.compile_decode}
