"""The CPU decode backend (:class:`engine.decode_backend.DecodeBackend`): the tiled KV cache,
the decode steps on the C++ kernels of ``engine._kernels`` where they read the weights (else
the Python layers), the kernels' LM heads, and a greedy call's remaining steps in one
``greedy_decode`` call.  What each choice buys is in docs/architecture.md ("CPU paths and
their switches"); :func:`engine.forward_paths.plan_call` fixes a call's choices once.
"""

from __future__ import annotations

import torch

from engine.decode_backend import Head, Responses, StepTables
from engine.decode_memory import DecodeMemory
from engine.early_exit import RunningRows
from engine.forward_paths import CallPlan, KernelLayers, KernelStage, StageLayers, choose_paths
from engine.kv_cache import TiledKVCache
from engine.norm import rms_norm
from engine.sampling import SamplingParams, SeedStream, sample_next


class CpuDecode:
    """Decode on the CPU.

    Args:
        device: where the cache lives (the weights' device).
        fused_decode: decode steps on the kernels where they read the weights
            (:func:`engine.forward_paths.resolve_kernels`, resolved by the engine).
        greedy_loop: a greedy call whose rows all run to the end finishes in one
            ``greedy_decode`` call where a step is the kernel stage's.
    """

    name = "cpu"

    def __init__(self, device: torch.device, fused_decode: bool, greedy_loop: bool) -> None:
        self.fused_decode, self.greedy_loop = fused_decode, greedy_loop
        self.memory = DecodeMemory(TiledKVCache, device, capture=False)
        self.paths = None
        self.block_rows: int | None = None

    def set_weights(self, stage: StageLayers, weights_key: object) -> None:
        # LoRA adapters run on the Python layers (the kernels lack them)
        self.paths = choose_paths(stage, self.fused_decode and not stage.loras)
        self.block_rows = None
        if isinstance(self.paths.decode, (KernelStage, KernelLayers)):
            from engine import _kernels  # built: the kernel paths exist only then
            self.block_rows = _kernels.small_gemm_max_rows

    def release(self, keep_cache: bool) -> None:
        self.paths, self.block_rows = None, None
        self.memory.release(keep=keep_cache)

    def capacity(self, batch: int) -> int:
        return batch

    def call_cache(self, sizes: dict, embed, plan: CallPlan) -> tuple[TiledKVCache, None]:
        return self.memory.cache_for(**sizes), None

    def kernel_loop(self, single_stage: bool) -> bool:
        """Whether a greedy call may finish in one ``greedy_decode`` call: allowed, one stage,
        and a decode step is exactly the kernel stage's."""
        return self.greedy_loop and single_stage and isinstance(self.paths.decode, KernelStage)

    def sample(self, head: Head, x: torch.Tensor, sampling: SamplingParams,
               stream: SeedStream, plan: CallPlan, rows: torch.Tensor | None, step: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if plan.head == "greedy_head":
            # the whole vocabulary here and argmax only: norm, head and choice in one call
            # (the same bits as the three below, without the Python between them)
            from engine import _kernels
            banned = sampling.banned_token(step)
            return _kernels.greedy_head(x[:, -1], head.norm, head.eps, head.weight,
                                        -1 if banned is None else banned,
                                        row_lanes=plan.row_lanes)
        if plan.head == "small_linear":
            # a few rows: the kernels' product reads the head in place on every intra-op
            # thread (BLAS packs the whole [V/t_g, H] weight first)
            from engine import _kernels
            h = rms_norm(x[:, -1], head.norm, head.eps)  # [R, H]
            logits = _kernels.small_linear(h.contiguous(), head.weight, row_lanes=plan.row_lanes)
            return sample_next(logits, sampling, head.tp_group, stream, rows, step)
        return head.sample(x, sampling, stream, rows, step)

    def greedy_rest(self, decode: KernelStage, out: Responses, step: int, cache: TiledKVCache,
                    tables: StepTables, sampling: SamplingParams, rows: RunningRows,
                    embed: torch.Tensor, head: Head) -> None:
        """The greedy decode steps after ``step`` of every row in one kernel call of the call's
        kernel stage ``decode`` (in its product form), written to ``out``; the cache advances
        by their number."""
        from engine import _kernels
        s, n_new = decode.stage, sampling.max_new_tokens
        steps = n_new - 1 - step
        banned = [sampling.banned_token(j) for j in range(step + 1, n_new)]
        out.ids[:, step + 1:], out.log_probs[:, step + 1:] = _kernels.greedy_decode(
            out.ids[:, step], steps, embed, decode.flat_weights, s.eps, tables.cos, tables.sin,
            cache.k, cache.v, cache.length, tables.keys_ok[:, 0, 0], s.q_per_group,
            decode.qkv_biases, head.norm, head.eps, head.weight,
            [-1 if b is None else b for b in banned], row_lanes=decode.row_lanes)
        out.mask[:, step + 1:] = 1
        cache.advance(steps)
        rows.count_steps(steps)

    def stats(self) -> dict:
        return {"kv_layout": "tiled", "cuda_graphs": False, "compile_decode": False}
