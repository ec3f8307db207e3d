"""The two ends of a disaggregated run (``placement.mode=disaggregated``): the rollout pool's
worker, which holds generation weights only, and the actor that pushes its weights there.

::

    training pool A (every role: actor,               rollout pool B (generation only)
      critics, reference, reward, cost)
    PushingActorWorker                                 RolloutWorker
      trains on p-t-d (a TrainEngine only: no            rollout.engine's backend (native or
      resharder, no generation engine, a flat            vLLM) on gen_pp x gen_tp, dp_g =
      buffer of the training shard alone)                |B| / (gen_pp gen_tp) replicas
                                                         pull_weights(version): receives its
      push_weights(): every training rank sends   ---->    generation shard in place, stamps
      only the boxes it owns (WeightSync)                  the version on every later sample
                                                         generate_sequences(): the run's
                                                           rollouts and its held-out evaluation

The training pool runs the algorithm's whole program but its generation: it scores, values
(PPO's GAE with the current critic) and trains on the rollout pool's rows, and it holds
training state only (the plan gives the actor ``gen_pp x gen_tp = pp x tp``:
:func:`rlhf.world_plan.validate_for_world`).  The held-out evaluation generates on the rollout
pool too (:class:`rlhf.evaluation.Evaluator`), with the weights pushed last.

Both ends of a push are one call each on their own pool, issued back to back by the
controller (:class:`rlhf.programs.async_rl.RolloutPool`); the weight transfer is the
collective between them (:class:`hybridflow_comm.sync.WeightSync` over the group of both
pools).  Each rank runs its calls in issue order, so a push queued on the rollout pool runs
after the generations issued before it, and a generation issued after it samples with the
new weights.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from engine.llama_spec import LlamaConfig, llama_shard_specs
from engine.lora import LoraConfig, lora_shard_specs
from engine.sampling import SamplingParams, derive_seed
from hybridflow_comm.expert_layout import ExpertLayout
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from hybridflow_comm.sync import WeightSync, build_sync_group
from hybridflow_comm.sync_plan import SyncLayout
from rlhf.config import RolloutConfig
from rlhf.controller import ONE_TO_ALL, THREE_D_PROTO, Batch, Worker, protocol
from rlhf.workers.actor import PolicyWorker
from rlhf.workers.rollout_engine import build_rollout, routes_field


@dataclass(frozen=True)
class SyncSpec:
    """The two pools of a weight push (job ranks, ascending) and their layouts."""

    train: tuple[int, int, int]
    """The actor's training ``(pp, tp, dp)``."""
    gen: tuple[int, int, int]
    """The rollout pool's ``(gen_pp, gen_tp, dp_g)``."""
    train_ranks: tuple[int, ...]
    """Job ranks of the training pool."""
    gen_ranks: tuple[int, ...]
    """Job ranks of the rollout pool."""
    experts: tuple[int, int, int, int] | None = None
    """Under the actor's expert parallelism, ``(num_experts, ep, gen_pp, gen_tp)`` of its
    expert layout (its experts go out whole from the ranks of their EP block, stored as the
    pieces its generation side ``gen_pp, gen_tp`` implies); None: none."""

    def layout(self) -> SyncLayout:
        train = ParallelLayout(*self.train)
        experts = None
        if self.experts is not None:
            num, ep, gen_pp, gen_tp = self.experts
            experts = ExpertLayout(HybridLayout(train, gen_pp, gen_tp), num, ep=ep)
        return SyncLayout(train, ParallelLayout(*self.gen), self.train_ranks, self.gen_ranks,
                          experts)


@dataclass(frozen=True)
class RolloutSpec:
    """The rollout pool's worker: the architecture, where its weights come from and the
    generation engine."""

    config: LlamaConfig
    """The actor's architecture."""
    sync: SyncSpec
    """The pools of the weight push."""
    rollout: RolloutConfig
    """The generation engine and its limits."""
    init_from: str | None
    """The actor's HF folder (vLLM reads its config.json); None = random init."""
    seed: int
    """vLLM's global seed."""
    lora: LoraConfig | None
    """The actor's LoRA adapters (None: none): the frozen base comes with the first push
    only, the adapters with every push, applied unmerged by the native engine."""
    record_routes: bool = False
    """actor.router_replay: the rollouts carry the experts each token was routed to."""


@dataclass(frozen=True)
class PushedWeights:
    """The generation shards a push left in the pool's flat buffer, in the form a
    :class:`engine.hybrid_engine.Rollout`'s ``load_weights`` takes (a resharder's)."""

    sync: WeightSync
    version: int
    """The actor's weight version they are."""

    @property
    def mode(self) -> str:
        """Always ``"generation"``: the shards are in the generation layout (as a resharder's
        after ``to_generation``)."""
        return "generation"

    @property
    def specs(self) -> list:
        return self.sync.specs

    def generation_params(self) -> dict[str, torch.Tensor]:
        return self.sync.generation_params()

    def named_generation_weights(self, hf_names: bool = True
                                 ) -> Iterator[tuple[str, torch.Tensor]]:
        return self.sync.named_generation_weights(hf_names)


def _connect(sync: SyncSpec, specs: list, **side) -> WeightSync:
    """This rank's end of the push (``train_shards`` on a training rank); collective over
    both pools, which are every rank of the job (``build_sync_group`` then makes no group)."""
    layout = sync.layout()
    return WeightSync(specs, layout, build_sync_group(layout), **side)


class PushingActorWorker(PolicyWorker):
    """The actor of a disaggregated run: trains as :class:`~rlhf.workers.actor.ActorWorker`
    does, generates nothing (no generation weights, no KV cache: the rollout pool generates
    every rollout and the held-out evaluation) and pushes its weights to the rollout pool
    after every update (with LoRA: the frozen base with the first push only, the adapters
    with every push)."""

    sync: WeightSync | None = None
    adapter_sync: WeightSync | None = None

    @protocol(ONE_TO_ALL)
    def connect_rollout(self, sync: SyncSpec) -> None:
        """Plan the weight push (collective with the rollout pool's ``connect_actor``)."""
        self.sync = _connect(sync, self.model.specs, train_shards=self.model.params)
        if self.model.lora is not None:
            self.adapter_sync = _connect(sync, self.model.adapter_specs,
                                         train_shards=self.model.adapter_params)

    @protocol(ONE_TO_ALL)
    def push_weights(self) -> float:
        """Send this rank's boxes of the current weights (collective with ``pull_weights``);
        returns the seconds this rank spent, waiting for the rollout pool included."""
        return sum(s.time_s for s in _push(self.sync, self.adapter_sync))


def _push(base: WeightSync, adapters: WeightSync | None) -> list:
    """One push or pull, the same on both ends (collective between the pools): the weights,
    or with LoRA the frozen base the first time and the adapters every time."""
    stats = [base.sync()] if adapters is None or base.version == 0 else []
    return stats + ([adapters.sync()] if adapters is not None else [])


class RolloutWorker(Worker):
    """One rank of a generation replica of the rollout pool: generation weights only (a flat
    buffer that :class:`WeightSync` fills in place), no optimizer, no training copy."""

    def __init__(self, spec: RolloutSpec) -> None:
        self.spec = spec
        self.engine = build_rollout(spec.rollout, spec.config, self.groups, self.device,
                                    init_from=spec.init_from, seed=spec.seed,
                                    sleep_between_phases=False,  # this pool never trains
                                    lora=spec.lora, record_routes=spec.record_routes)
        self.sync: WeightSync | None = None
        self.adapter_sync: WeightSync | None = None

    @protocol(ONE_TO_ALL)
    def connect_actor(self) -> None:
        """Plan the weight push (collective with the actor's ``connect_rollout``)."""
        s, pp = self.spec, self.spec.sync.train[0]
        self.sync = _connect(s.sync, llama_shard_specs(s.config, pp))
        if s.lora is not None:
            self.adapter_sync = _connect(s.sync, lora_shard_specs(s.config, pp, s.lora))

    @protocol(ONE_TO_ALL)
    def pull_weights(self, version: int) -> dict[str, float]:
        """Receive this rank's generation shard in place (collective with ``push_weights``)
        and generate with it as weight version ``version``; returns the seconds spent and
        the bytes received (with LoRA: the base once, then the adapters alone)."""
        t0 = time.perf_counter()
        stats = _push(self.sync, self.adapter_sync)
        if self.adapter_sync is not None:
            self.engine.set_adapters(PushedWeights(self.adapter_sync, version), self.spec.lora)
        self.engine.load_weights(PushedWeights(self.sync, version))
        return {"time_s": time.perf_counter() - t0,
                "received_bytes": float(sum(st.received_bytes for st in stats))}

    @protocol(THREE_D_PROTO, phase="generation")
    def generate_sequences(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """Rollouts of this replica's prompts, as :meth:`ActorWorker.generate_sequences`
        returns them, plus ``weights_version [B]``: the version that sampled each row."""
        t0 = time.perf_counter()
        dp_g = self.groups.layout.gen_coords(self.groups.rank).dp_g
        out = self.engine.generate(prompts["input_ids"], prompts["attention_mask"],
                                   replace(sampling, seed=derive_seed(sampling.seed, "replica",
                                                                      dp_g)))
        rows = out.input_ids.shape[0]
        version = torch.full((rows,), out.stats["weights_version"], dtype=torch.int64,
                             device=out.input_ids.device)
        return Batch({"input_ids": out.input_ids, "attention_mask": out.attention_mask,
                      "response_mask": out.response_mask, "rollout_log_probs": out.log_probs,
                      "weights_version": version, **routes_field(out)},
                     dict(prompts.non_tensors),
                     {"gen_s": time.perf_counter() - t0, "prompt_len": out.prompt_length})
