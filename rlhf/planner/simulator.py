"""Analytic simulator: seconds one model spends in each stage under a strategy.

Per device, with ``n = pp * tp * dp`` devices and the profile's constants:

* training (compute-bound): ``3 x forward FLOPs / (n_busy * peak * mfu_train)``, stretched by
  the 1F1B bubble ``(pp - 1) / m`` (m micro-batches per step), plus per layer and micro-batch
  four TP all-reduces and a fixed overhead, the pipeline sends, one gradient all-reduce
  ``2 (dp-1)/dp`` of the shard per optimizer step, and the optimizer's memory sweep.
* preparation (compute-bound): one forward of the rollout batch, same terms without backward.
* generation (memory-bound): prefill is compute-bound; each of ``response_len`` decode steps
  reads the generation shard and the wave's KV cache, ``max(bytes / (mem_bw * eff), FLOPs /
  (peak * mfu_infer))``.  Stages of a generation pipeline run one after the other (no
  overlap), so pp_g saves memory but not time.  Sequences run in waves that fit ``kv_budget``.
* transition (before generation): the micro-DP all-gather of the 3D-HybridEngine, receiving
  ``(tp p - t_g p_g) / (t_g p_g t p) M`` bytes per device (paper Table 2,
  :mod:`hybridflow_comm.reshard`), over the link its micro-DP group spans.  Under expert
  parallelism the experts' ``M_e`` bytes move by their own formula (generation EP 1,
  :mod:`hybridflow_comm.expert_layout`): ``(p ep - p_g) / (p ep p_g t_g) M_e``.
* expert parallelism (``ep > 1``, a mixture of ``E`` experts, ``k`` per token): each MoE layer
  of a pass sends every device's share of its TP group's tokens to the experts' owners by one
  all-to-all and gets the outputs back by another; with balanced routing a device sends
  ``tokens / tp * k * H * act_bytes * (ep - 1) / ep`` bytes in each
  (:func:`all_to_all_bytes`), and a backward pass does both again.  The experts' gradients
  all-reduce over the ``tp dp / ep`` ranks holding the same experts.

``n_busy`` counts only DP replicas that get sequences, so devices beyond the batch add nothing.
CPU ranks that share fewer cores than ranks run slower by :meth:`DeviceProfile.slowdown`.
"""

from __future__ import annotations

import math

from rlhf.planner.dataflow import RoleSpec, Workload
from rlhf.planner.memory import (expert_transition_bytes, kv_bytes_per_sequence, micro_batch,
                                 stage_expert_params, train_shard_params)
from rlhf.planner.models import ModelShape
from rlhf.planner.profile import DeviceProfile
from rlhf.planner.strategy import Strategy


def transition_bytes(pp: int, tp: int, pp_g: int, tp_g: int, model_bytes: float) -> float:
    """Bytes each device receives in the train -> generation reshard (paper, Table 2):
    ``(t p - t_g p_g) / (t_g p_g t p) M``."""
    mp, mp_g = tp * pp, tp_g * pp_g
    if mp % mp_g:
        raise ValueError(f"tp_g*pp_g={mp_g} must divide tp*pp={mp}")
    return (mp - mp_g) / (mp_g * mp) * model_bytes


def model_transition_bytes(shape: ModelShape, s: Strategy, param_bytes: float) -> float:
    """Bytes each device receives in the train -> generation reshard of ``shape`` under
    ``s``: the dense weights by the paper's formula, the experts (``ep > 1``) by theirs."""
    total = shape.params * param_bytes
    if s.ep == 1:
        return transition_bytes(s.pp, s.tp, s.pp_g, s.tp_g, total)
    experts = stage_expert_params(shape, 1) * param_bytes
    return transition_bytes(s.pp, s.tp, s.pp_g, s.tp_g, total - experts) + \
        expert_transition_bytes(s.pp, s.ep, s.pp_g, s.tp_g, experts, s.gen_ep)


def all_to_all_bytes(shape: ModelShape, tokens: float, s: Strategy, act_bytes: float) -> float:
    """Bytes one device sends to the other members of its EP group in one MoE layer's token
    dispatch (and again in the outputs' return) for ``tokens`` tokens of its TP group: its
    ``tokens / tp`` share's ``k`` rows each of ``H`` activations, the ``(ep - 1) / ep`` of
    them whose expert another member holds when routing is balanced (0 without ``ep``)."""
    if s.ep == 1 or not shape.config.num_experts:
        return 0.0
    k = shape.config.num_experts_per_tok
    return tokens / s.tp * k * shape.hidden_size * act_bytes * (s.ep - 1) / s.ep


def all_to_all_time(nbytes: float, size: int, span: int, prof: DeviceProfile) -> float:
    """An all-to-all in which each of ``size`` devices (spread over ``span``) sends
    ``nbytes`` to the others."""
    if size <= 1:
        return 0.0
    bw, lat = prof.link(span)
    return lat * (size - 1) + nbytes / bw


def _pass_all_to_all_bytes(role: RoleSpec, s: Strategy, work: Workload, prof: DeviceProfile,
                           backward: bool, sequences: int) -> tuple[float, float]:
    """``(bytes of one all-to-all, all-to-alls)`` of one device in one pass over
    ``sequences`` sequences: two per MoE layer and micro-batch, four with backward."""
    b, _ = micro_batch(work, s.dp)
    m = math.ceil(math.ceil(sequences / s.dp) / b)
    layers = role.shape.num_layers // s.pp
    one = all_to_all_bytes(role.shape, b * work.seq_len, s, prof.act_bytes)
    return one, (4 if backward else 2) * layers * m * (one > 0)


def all_to_all_volume(role: RoleSpec, s: Strategy, work: Workload, prof: DeviceProfile
                      ) -> float:
    """Bytes one device sends by the EP all-to-alls in one iteration: the preparation
    stage's forwards and, for a trained model, every optimizer step's forward and backward."""
    one, count = _pass_all_to_all_bytes(role, s, work, prof, False, work.sequences)
    total = role.forwards * one * count
    if role.trained:
        one, count = _pass_all_to_all_bytes(role, s, work, prof, True,
                                            work.mini_batch or work.sequences)
        total += work.optimizer_steps * one * count
    return total


def allreduce_time(nbytes: float, size: int, span: int, prof: DeviceProfile) -> float:
    """Ring all-reduce of ``nbytes`` over ``size`` devices spread over ``span`` devices."""
    if size <= 1:
        return 0.0
    bw, lat = prof.link(span)
    return lat * math.log2(size) + 2 * (size - 1) / size * nbytes / bw


def _p2p_time(nbytes: float, span: int, prof: DeviceProfile) -> float:
    bw, lat = prof.link(span)
    return lat + nbytes / bw


def _busy_replicas(sequences: int, dp: int) -> int:
    return min(dp, sequences)


def forward_pass_time(role: RoleSpec, s: Strategy, work: Workload, prof: DeviceProfile,
                      backward: bool, sequences: int) -> float:
    """One pass (forward, or forward + backward) of ``sequences`` sequences on every replica."""
    shape, seq = role.shape, work.seq_len
    b, m = micro_batch(work, s.dp)
    m = math.ceil(math.ceil(sequences / s.dp) / b)   # micro-batches over all ``sequences``
    mult, mfu = (3.0, prof.mfu_train) if backward else (1.0, prof.mfu_infer)
    busy = s.pp * s.tp * _busy_replicas(sequences, s.dp)
    compute = mult * shape.forward_flops(sequences * seq, seq / 2) / (busy * prof.peak_flops * mfu)
    compute *= 1 + (s.pp - 1) / m
    layers = shape.num_layers // s.pp
    slots = m + s.pp - 1                              # pipeline time slots per device
    act = b * seq * shape.hidden_size * prof.act_bytes
    tp_comm = (4 if backward else 2) * layers * slots * allreduce_time(act, s.tp, s.tp, prof)
    overhead = mult * layers * slots * prof.layer_overhead_s
    pp_comm = (2 if backward else 1) * slots * _p2p_time(act / s.tp, s.pp * s.tp, prof) \
        if s.pp > 1 else 0.0
    one, count = _pass_all_to_all_bytes(role, s, work, prof, backward, sequences)
    ep_comm = count * all_to_all_time(one, s.ep, s.ep_span, prof)
    return (compute + tp_comm + overhead + pp_comm + ep_comm) * prof.slowdown(s.devices)


def train_time(role: RoleSpec, s: Strategy, work: Workload, prof: DeviceProfile) -> float:
    """Training stage: every optimizer step of every epoch."""
    steps = work.optimizer_steps
    per_step = work.mini_batch or work.sequences
    t = steps * forward_pass_time(role, s, work, prof, True, per_step)
    shard = train_shard_params(role.shape, s)
    if s.ep > 1:  # the experts' gradients reduce over the ranks holding the same experts
        experts = stage_expert_params(role.shape, s.pp) / s.ep
        grads = allreduce_time((shard - experts) * prof.grad_bytes, s.dp, s.devices, prof) + \
            allreduce_time(experts * prof.grad_bytes, s.expert_dp, s.devices, prof)
    else:
        grads = allreduce_time(shard * prof.grad_bytes, s.dp, s.devices, prof)
    sweep = shard * 2 * (prof.param_bytes + prof.grad_bytes + prof.optim_bytes) \
        / (prof.mem_bw * prof.mem_bw_eff)
    return t + steps * (grads + sweep) + prof.call_overhead_s


def infer_time(role: RoleSpec, s: Strategy, work: Workload, prof: DeviceProfile) -> float:
    """Preparation stage: ``role.forwards`` forward passes over the rollout batch."""
    one = forward_pass_time(role, s, work, prof, False, work.sequences)
    return role.forwards * (one + prof.call_overhead_s)


def transition_time(role: RoleSpec, s: Strategy, prof: DeviceProfile) -> float:
    """Train -> generation reshard of the 3D-HybridEngine (0 when the layouts are equal)."""
    nbytes = model_transition_bytes(role.shape, s, prof.param_bytes)
    if nbytes == 0:
        return 0.0
    bw, lat = prof.link(max(s.pp * s.tp, s.ep_span))  # experts come from other replicas too
    return lat * math.log2(s.micro_dp) + nbytes / bw


def generation_time(role: RoleSpec, s: Strategy, work: Workload, prof: DeviceProfile,
                    kv_budget: float) -> float:
    """Generation stage (all of ``role.generations`` passes, the reshard included).

    Args:
        kv_budget: bytes per device left for the KV cache; ``inf`` seconds if not even one
            sequence fits.
    """
    shape = role.shape
    kv_seq = kv_bytes_per_sequence(shape, s, work, prof)
    replica = math.ceil(work.sequences / s.dp_g)
    wave = min(replica, int(kv_budget // kv_seq)) if kv_budget > 0 else 0
    if wave < 1:
        return math.inf
    waves = math.ceil(replica / wave)
    gen_devices = s.tp_g                               # stages run one after the other
    prefill = shape.forward_flops(wave * work.prompt_len, work.prompt_len / 2) \
        / (gen_devices * prof.peak_flops * prof.mfu_infer)
    ctx = work.prompt_len + work.response_len / 2
    weight_bytes = shape.params * prof.param_bytes / s.tp_g
    kv_read = wave * shape.kv_elems_per_token() * ctx * prof.act_bytes / s.tp_g
    step_flops = shape.forward_flops(wave, ctx) / (gen_devices * prof.peak_flops
                                                   * prof.mfu_infer)
    step = max((weight_bytes + kv_read) / (prof.mem_bw * prof.mem_bw_eff), step_flops)
    act = wave * shape.hidden_size * prof.act_bytes
    step += shape.num_layers * (prof.layer_overhead_s + 2 * allreduce_time(act, s.tp_g, s.tp_g,
                                                                            prof))
    if s.pp_g > 1:
        step += (s.pp_g - 1) * _p2p_time(act / s.tp_g, s.pp_g * s.tp_g, prof)
    one = waves * (prefill + work.response_len * step) * prof.slowdown(s.devices) \
        + prof.call_overhead_s
    return role.generations * one + transition_time(role, s, prof)
