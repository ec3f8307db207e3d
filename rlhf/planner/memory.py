"""Memory model: bytes one device holds for one model under a strategy.

Two kinds of memory per model and device::

    resident   lives for the whole run: weights (param_bytes), and for trained models
               gradients (grad_bytes) and optimizer states (optim_bytes) -- one pipeline
               stage's parameters cut tp ways (its experts ep ways under expert parallelism)
    transient  lives during one stage only, and only one model of a colocated set runs at a
               time: training activations (1F1B keeps min(pp, micro-batches) in flight),
               forward activations + fp32 logits, or during generation the extra generation
               weights ``M/(pp_g tp_g) - M/(pp tp)`` plus the KV cache

A colocated set fits on its devices when ``sum(resident) + max(transient) <= usable``.  The KV
cache is not fixed: generation runs in waves of as many sequences as the memory left over holds
(:func:`kv_bytes_per_sequence`), so it needs room for at least one sequence.

Activations per layer and micro-batch follow Megatron's count with flash attention and selective
recompute, ``34 s b h`` bytes at 2-byte activations, i.e. ``17 s b h act_bytes``, split tp ways.
"""

from __future__ import annotations

import math

from rlhf.planner.dataflow import RoleSpec, Workload
from rlhf.planner.models import ModelShape
from rlhf.planner.profile import DeviceProfile
from rlhf.planner.strategy import Strategy

ACT_ELEMS_PER_TOKEN_HIDDEN = 17


def stage_params(shape: ModelShape, pp: int) -> int:
    """Parameters of the largest pipeline stage (embedding on the first, head on the last)."""
    h = shape.hidden_size
    head = h if shape.value_head else shape.vocab_size * h
    ends = shape.vocab_size * h + head + h if pp == 1 else max(shape.vocab_size * h, head + h)
    return (shape.num_layers // pp) * shape.layer_params + ends


def stage_expert_params(shape: ModelShape, pp: int) -> int:
    """Parameters of one pipeline stage's experts (0 for a dense model)."""
    return (shape.num_layers // pp) * shape.expert_layer_params


def train_shard_params(shape: ModelShape, s: Strategy) -> float:
    """Parameters one training device holds: its stage's dense weights cut ``tp`` ways and
    its stage's experts cut :attr:`Strategy.expert_split` ways (whole experts under ``ep``)."""
    experts = stage_expert_params(shape, s.pp)
    return (stage_params(shape, s.pp) - experts) / s.tp + experts / s.expert_split


def bytes_per_param(role: RoleSpec, prof: DeviceProfile) -> int:
    if role.trained:
        return prof.param_bytes + prof.grad_bytes + prof.optim_bytes
    return prof.param_bytes


def resident_bytes(role: RoleSpec, s: Strategy, prof: DeviceProfile) -> float:
    """Weights (+ gradients + optimizer states if trained) of one device's shard."""
    return train_shard_params(role.shape, s) * bytes_per_param(role, prof)


def micro_batch(work: Workload, dp: int) -> tuple[int, int]:
    """(sequences per micro-batch, micro-batches per optimizer step) on one DP replica."""
    per_step = work.mini_batch or work.sequences
    per_replica = math.ceil(per_step / dp)
    b = min(work.micro_batch, per_replica)
    return b, math.ceil(per_replica / b)


def train_activation_bytes(role: RoleSpec, s: Strategy, work: Workload,
                           prof: DeviceProfile) -> float:
    """Peak activations of one device during a training step (first or last stage)."""
    shape = role.shape
    b, m = micro_batch(work, s.dp)
    per_layer = ACT_ELEMS_PER_TOKEN_HIDDEN * work.seq_len * b * shape.hidden_size \
        * prof.act_bytes / s.tp
    layers = shape.num_layers // s.pp
    return min(s.pp, m) * layers * per_layer + logits_bytes(shape, b, work.seq_len, s.tp)


def logits_bytes(shape: ModelShape, b: int, seq_len: int, tp: int) -> float:
    """fp32 logits (and their gradient / softmax) of one micro-batch: ``2 b s V / tp`` x 4."""
    out = 1 if shape.value_head else shape.vocab_size
    return 2 * b * seq_len * out * 4 / tp


def infer_activation_bytes(role: RoleSpec, s: Strategy, work: Workload,
                           prof: DeviceProfile) -> float:
    """Peak of one forward-only micro-batch: one layer's activations and the logits."""
    b, _ = micro_batch(work, s.dp)
    layer = ACT_ELEMS_PER_TOKEN_HIDDEN * work.seq_len * b * role.shape.hidden_size \
        * prof.act_bytes / s.tp
    return layer + logits_bytes(role.shape, b, work.seq_len, s.tp)


def expert_transition_bytes(pp: int, ep: int, pp_g: int, tp_g: int, expert_bytes: float,
                            gen_ep: int = 1) -> float:
    """Bytes each device receives of the experts' ``expert_bytes`` in the train -> generation
    reshard from ``ep > 1`` to generation EP ``gen_ep`` (``E / gen_ep`` experts cut
    ``tp_g / gen_ep`` ways): ``(p ep - p_g gen_ep) / (p ep p_g t_g) M_e``."""
    return (pp * ep - pp_g * gen_ep) / (pp * ep * pp_g * tp_g) * expert_bytes


def gen_weight_extra_bytes(role: RoleSpec, s: Strategy, prof: DeviceProfile) -> float:
    """Generation weights beyond the training shard (the 3D-HybridEngine's gathered slots).
    Under expert parallelism the experts' part is what a device receives of them
    (:func:`expert_transition_bytes`): generation holds ``E / gen_ep`` experts cut
    ``tp_g / gen_ep`` ways, a piece of each whole expert the device trains is a view of it."""
    shape = role.shape
    if s.ep == 1:
        gen = stage_params(shape, s.pp_g) / s.tp_g
        return (gen - train_shard_params(shape, s)) * prof.param_bytes
    dense_gen = (stage_params(shape, s.pp_g) - stage_expert_params(shape, s.pp_g)) / s.tp_g
    dense_train = (stage_params(shape, s.pp) - stage_expert_params(shape, s.pp)) / s.tp
    experts = expert_transition_bytes(s.pp, s.ep, s.pp_g, s.tp_g, stage_expert_params(shape, 1),
                                      s.gen_ep)
    return (dense_gen - dense_train + experts) * prof.param_bytes


def kv_bytes_per_sequence(shape: ModelShape, s: Strategy, work: Workload,
                          prof: DeviceProfile) -> float:
    """KV cache of one full-length sequence on one device of a generation replica (the keys'
    padding to whole tiles of :data:`engine.kv_cache.KEY_TILE` positions, at most 63 more
    positions of K per sequence, is left out)."""
    return shape.kv_elems_per_token() * work.seq_len * prof.act_bytes / (s.tp_g * s.pp_g)


def transient_bytes(role: RoleSpec, s: Strategy, work: Workload, prof: DeviceProfile) -> float:
    """Peak transient memory of a model outside generation (the KV cache is sized per set)."""
    peak = infer_activation_bytes(role, s, work, prof)
    if role.trained:
        peak = max(peak, train_activation_bytes(role, s, work, prof))
    return peak


def min_generation_bytes(role: RoleSpec, s: Strategy, work: Workload,
                         prof: DeviceProfile) -> float:
    """Transient memory of generation with a one-sequence wave."""
    return gen_weight_extra_bytes(role, s, prof) + kv_bytes_per_sequence(role.shape, s, work, prof)
