"""Planner: enumeration, memory model, simulator sanity, cost composition, caching, plans."""

import itertools
import math

import pytest
import torch

from engine.llama_spec import LlamaConfig
from rlhf.planner import Planner, Workload, build_dataflow, load_profile, model_shape
from rlhf.planner import memory as mem
from rlhf.planner import simulator as sim
from rlhf.planner.dataflow import STAGES, RoleSpec
from rlhf.planner.partitions import allocations, bell, device_counts, set_partitions
from rlhf.planner.profile import shipped_profiles
from rlhf.planner.search import SetPlan, compose
from rlhf.planner.strategy import Strategy, enumerate_strategies

A100 = load_profile("a100-80gb")
SEVEN = model_shape("7b")


def test_set_partitions_count_bell_and_are_partitions():
    assert [bell(n) for n in range(8)] == [1, 1, 2, 5, 15, 52, 203, 877]
    for n in range(7):
        items = list(range(n))
        parts = list(set_partitions(items))
        assert len(parts) == bell(n)
        canon = {frozenset(frozenset(b) for b in p) for p in parts}
        assert len(canon) == len(parts)                       # each partition once
        for p in parts:
            assert sorted(x for b in p for x in b) == items   # every item exactly once
    assert len(list(set_partitions(["actor", "critic", "reference", "reward"]))) == 15


def test_allocations_sum_and_respect_minimums():
    counts = device_counts(32, 8)
    assert counts == [1, 2, 4, 8, 16, 24, 32]
    allocs = list(allocations(32, [2, 8, 1], counts))
    brute = [a for a in itertools.product(counts, repeat=3)
             if sum(a) == 32 and a[0] >= 2 and a[1] >= 8 and a[2] >= 1]
    assert sorted(allocs) == sorted(brute) and allocs
    assert device_counts(4, 4) == [1, 2, 3, 4]


def test_strategies_valid_and_divisible():
    for n in (1, 4, 12, 16):
        for s in enumerate_strategies(SEVEN, n, generates=True):
            assert s.pp * s.tp * s.dp == n and s.pp % s.pp_g == 0 and s.tp % s.tp_g == 0
            assert s.dp_g * s.pp_g * s.tp_g == n
    tiny = model_shape("tiny")                                # 2 KV heads, 2 layers
    assert {(s.pp, s.tp) for s in enumerate_strategies(tiny, 4, False)} == {(1, 1), (1, 2),
                                                                          (2, 1), (2, 2)}
    with pytest.raises(ValueError, match="pp_g=2 must divide pp=1"):
        Strategy(1, 2, 1, 2, 1)


def test_params_of_presets():
    assert abs(SEVEN.params - 6.74e9) / 6.74e9 < 0.01
    assert abs(model_shape("13b").params - 13.0e9) / 13.0e9 < 0.01
    assert abs(model_shape("70b").params - 69.0e9) / 69.0e9 < 0.02


def test_params_equal_transformers_count_and_moe_active_params():
    """Every parameter the planner counts equals transformers' model of the same config (on
    the meta device, nothing allocated): Qwen3-30B-A3B (128 experts, q/k norms) and tiny
    Qwen2 (q/k/v bias) / Qwen3 (o bias); a MoE token uses k of E experts."""
    import dataclasses

    import transformers

    from engine.hf_interop import config_to_hf
    from rlhf.planner.models import ModelShape

    big = model_shape("qwen3-30b-a3b")
    tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                num_kv_heads=2, tie_word_embeddings=False)
    shapes = [big,
              ModelShape("q2", LlamaConfig(**tiny, qkv_bias=True, model_type="qwen2")),
              ModelShape("q3", LlamaConfig(**tiny, qkv_bias=True, o_proj_bias=True,
                                           qk_norm=True, head_dim=16, model_type="qwen3"))]
    for shape in shapes:
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(config_to_hf(shape.config))
        assert shape.params == sum(p.numel() for p in hf.parameters()), shape.name
    assert abs(big.params - 30.5e9) / 30.5e9 < 0.01  # the model card: 30.5B in total,
    assert abs(big.active_params - 3.3e9) / 3.3e9 < 0.02  # 3.3B activated
    dense = ModelShape("d", dataclasses.replace(big.config, num_experts=0, model_type="qwen3",
                                                num_experts_per_tok=2))
    assert dense.active_params == dense.params < big.active_params
    # a token's matmuls read its k experts only
    assert big.matmul_params < big.active_params < big.params


def test_memory_matches_hand_computation():
    """7B actor, pp=2 tp=4: the largest stage is the last, 16 layers + LM head + final norm."""
    actor = RoleSpec("actor", SEVEN, trained=True, generations=1)
    s = Strategy(2, 4, 2, 1, 2)
    h, v, f, L = 4096, 32000, 11008, 32
    layer = 4 * h * h + 3 * h * f + 2 * h
    stage = 16 * layer + v * h + h
    assert mem.resident_bytes(actor, s, A100) == stage / 4 * (2 + 2 + 12)
    ref = RoleSpec("reference", SEVEN)
    assert mem.resident_bytes(ref, s, A100) == stage / 4 * 2
    # generation: 1 stage cut 2 ways, minus the training shard; KV: 2 L G D s bytes / (tp_g pp_g)
    full = L * layer + 2 * v * h + h
    assert mem.gen_weight_extra_bytes(actor, s, A100) == (full / 2 - stage / 4) * 2
    w = Workload(prompts=64, prompt_len=512, response_len=512, micro_batch=4)
    assert mem.kv_bytes_per_sequence(SEVEN, s, w, A100) == 2 * L * 32 * 128 * 1024 * 2 / 2
    # activations: min(pp, micro-batches) x 16 layers x 17 s b h act / tp + fp32 logits
    b, m = mem.micro_batch(w, s.dp)
    assert (b, m) == (4, 8)
    act = 2 * 16 * 17 * 1024 * 4 * h * 2 / 4 + 2 * 4 * 1024 * v * 4 / 4
    assert mem.train_activation_bytes(actor, s, w, A100) == act


def test_memory_decides_min_devices():
    """Colocated 7B PPO: actor + critic states alone (16 B/param each) need > 2 A100s."""
    p = Planner(build_dataflow("ppo", SEVEN), Workload(), 16, A100)
    n = p.min_devices(("actor", "critic", "reference", "reward"))
    need = (2 * SEVEN.params * 16 + 2 * SEVEN.params * 2) / A100.usable_bytes
    assert n is not None and n >= need
    assert p.set_plan(("actor", "critic", "reference", "reward"), 1) is None
    assert p.min_devices(("reference",)) == 1


def test_transition_formula_matches_toolkit_and_paper():
    from bench.transition import formula_bytes
    from hybridflow_comm.layout import HybridLayout, ParallelLayout

    assert sim.transition_bytes(1, 4, 1, 2, 8.0) == 8.0 / 4      # paper: 1-4-2 -> 1-2: M/4
    for pp, tp, dp in itertools.product((1, 2, 4), (1, 2, 4), (1, 2)):
        for pp_g, tp_g in itertools.product((1, 2, 4), (1, 2, 4)):
            if pp % pp_g or tp % tp_g:
                continue
            hl = HybridLayout(ParallelLayout(pp, tp, dp), pp_g, tp_g)
            assert math.isclose(sim.transition_bytes(pp, tp, pp_g, tp_g, 1e9),
                                formula_bytes("hybridflow", hl, int(1e9)))


QWEN3_MOE = model_shape("qwen3-30b-a3b")


def test_expert_transition_formula_matches_the_expert_layout():
    """The planner's expert bytes are :class:`ExpertLayout`'s volume (which the multi-rank
    tests hold the ExpertResharder to); the dense rest keeps the paper's formula."""
    from hybridflow_comm.expert_layout import ExpertLayout
    from hybridflow_comm.layout import HybridLayout, ParallelLayout

    moe = QWEN3_MOE.config
    seen, gen_eps = 0, set()
    for n in (2, 4, 8):
        for s in enumerate_strategies(QWEN3_MOE, n, generates=True):
            hl = HybridLayout(ParallelLayout(s.pp, s.tp, s.dp), s.pp_g, s.tp_g)
            if s.ep == 1:
                continue
            seen += 1
            m_e = QWEN3_MOE.num_layers * QWEN3_MOE.expert_layer_params * 2
            want = ExpertLayout(hl, moe.num_experts, ep=s.ep, gen_ep=s.gen_ep
                                ).received_fraction() * m_e
            assert sim.expert_transition_bytes(s.pp, s.ep, s.pp_g, s.tp_g, m_e, s.gen_ep) == \
                pytest.approx(float(want), rel=1e-12)
            gen_eps.add(s.gen_ep)
            dense = sim.transition_bytes(s.pp, s.tp, s.pp_g, s.tp_g,
                                         QWEN3_MOE.params * 2 - m_e)
            assert sim.model_transition_bytes(QWEN3_MOE, s, 2) == \
                pytest.approx(dense + float(want), rel=1e-12)
    assert seen > 20 and gen_eps == {1, 2, 4}  # gen_ep divides tp_g <= 4 (4 KV heads)


def test_expert_parallel_strategies_memory_and_all_to_all():
    """ep enumerates the divisors of tp*dp that divide E; a rank holds E/ep whole experts per
    layer; the all-to-all term grows with ep's remote share and vanishes at ep=1."""
    moe = QWEN3_MOE.config
    strategies = list(enumerate_strategies(QWEN3_MOE, 8, generates=False))
    assert {s.ep for s in strategies if (s.pp, s.tp) == (1, 1)} == {1, 2, 4, 8}
    assert {s.ep for s in strategies if (s.pp, s.tp) == (1, 2)} == {1, 2, 4, 8}
    assert {s.ep for s in enumerate_strategies(SEVEN, 8, False)} == {1}
    h, f, e, k = moe.hidden_size, moe.intermediate_size, moe.num_experts, moe.num_experts_per_tok
    base, ep8 = Strategy(1, 2, 4, 1, 2), Strategy(1, 2, 4, 1, 2, ep=8)
    experts = moe.num_layers * e * 3 * h * f
    dense = QWEN3_MOE.params - experts
    assert mem.train_shard_params(QWEN3_MOE, base) == pytest.approx(QWEN3_MOE.params / 2)
    assert mem.train_shard_params(QWEN3_MOE, ep8) == pytest.approx(dense / 2 + experts / 8)
    assert (ep8.expert_split, ep8.expert_dp, base.expert_split, base.expert_dp) == (8, 1, 2, 4)
    # 1,000 tokens of a TP group of 2: 500 per rank, k rows each, 7/8 of them remote
    assert sim.all_to_all_bytes(QWEN3_MOE, 1000, ep8, 2) == pytest.approx(500 * k * h * 2 * 7 / 8)
    assert sim.all_to_all_bytes(QWEN3_MOE, 1000, base, 2) == 0
    assert sim.all_to_all_bytes(SEVEN, 1000, Strategy(1, 1, 2, 1, 1, ep=2), 2) == 0
    work = Workload(prompts=64, prompt_len=256, response_len=256, mini_batch=32)
    actor = RoleSpec("actor", QWEN3_MOE, trained=True, generations=1)
    volume = sim.all_to_all_volume(actor, ep8, work, A100)
    b, m = mem.micro_batch(work, ep8.dp)
    per_step = 4 * moe.num_layers * m * sim.all_to_all_bytes(QWEN3_MOE, b * work.seq_len, ep8,
                                                             A100.act_bytes)
    m_all = math.ceil(math.ceil(work.sequences / ep8.dp) / b)
    prep = 2 * moe.num_layers * m_all * sim.all_to_all_bytes(QWEN3_MOE, b * work.seq_len, ep8,
                                                             A100.act_bytes)
    assert volume == pytest.approx(work.optimizer_steps * per_step + prep)
    assert sim.all_to_all_volume(actor, base, work, A100) == 0
    # a training pass differs from ep=1's by its all-to-alls alone
    extra = sim.forward_pass_time(actor, ep8, work, A100, True, 32) - \
        sim.forward_pass_time(actor, base, work, A100, True, 32)
    one = sim.all_to_all_bytes(QWEN3_MOE, b * work.seq_len, ep8, A100.act_bytes)
    assert extra == pytest.approx(4 * moe.num_layers * m * sim.all_to_all_time(one, 8, 8, A100)
                                  * A100.slowdown(8))


def test_expert_parallel_span_and_generation_memory():
    """An EP group's span is the widest of ExpertLayout's EP groups in device order; the
    generation memory beyond the training shard is never negative and, for the experts, what a
    device receives."""
    from hybridflow_comm.expert_layout import ExpertLayout
    from hybridflow_comm.layout import HybridLayout, ParallelLayout

    spans = 0
    for pp, tp, dp in itertools.product((1, 2, 4), (1, 2, 3, 4), (1, 2, 3, 4)):
        for ep in (e for e in range(2, tp * dp + 1) if (tp * dp) % e == 0 and 24 % e == 0):
            el = ExpertLayout(HybridLayout(ParallelLayout(pp, tp, dp), pp, tp), 24, ep=ep)
            want = max(max(g) - min(g) + 1 for g in el.ep_groups())
            assert Strategy(pp, tp, dp, pp, tp, ep).ep_span == want, (pp, tp, dp, ep)
            spans += 1
    assert spans > 50
    actor = RoleSpec("actor", QWEN3_MOE, trained=True, generations=1)
    experts = QWEN3_MOE.num_layers * QWEN3_MOE.expert_layer_params
    for s in enumerate_strategies(QWEN3_MOE, 8, generates=True):
        extra = mem.gen_weight_extra_bytes(actor, s, A100)
        assert extra >= 0, s
        if s.ep > 1:
            base = mem.gen_weight_extra_bytes(actor, Strategy(s.pp, s.tp, s.dp, s.pp_g, s.tp_g),
                                              A100)
            dense = base - (experts / (s.pp_g * s.tp_g) - experts / (s.pp * s.tp)) * 2
            assert extra == pytest.approx(dense + mem.expert_transition_bytes(
                s.pp, s.ep, s.pp_g, s.tp_g, experts * 2, s.gen_ep), rel=1e-9), s


def _role_stage_times(role, n, work, prof):
    return [min(sim.train_time(role, s, work, prof) + sim.infer_time(role, s, work, prof)
                for s in enumerate_strategies(role.shape, n, False, prof.per_node))
            for _ in [0]][0]


def test_simulator_monotone_in_devices_and_work():
    work = Workload(prompts=256, prompt_len=512, response_len=512, mini_batch=64)
    critic = RoleSpec("critic", SEVEN.as_value_model(), trained=True)
    best = [_role_stage_times(critic, n, work, A100) for n in (8, 16, 32, 64)]
    assert all(a >= b for a, b in zip(best, best[1:]))        # more devices never slower
    s = Strategy(1, 4, 2, 1, 4)
    longer = Workload(prompts=256, prompt_len=512, response_len=1024, mini_batch=64)
    assert sim.train_time(critic, s, longer, A100) > sim.train_time(critic, s, work, A100)
    actor = RoleSpec("actor", SEVEN, trained=True, generations=1)
    g1 = sim.generation_time(actor, s, work, A100, 20e9)
    assert sim.generation_time(actor, s, longer, A100, 20e9) > g1
    assert sim.generation_time(actor, s, work, A100, 1e9) >= g1   # less KV room: more waves
    assert sim.generation_time(actor, s, work, A100, 1.0) == math.inf
    # a reshard costs time; equal layouts cost none
    assert sim.transition_time(actor, Strategy(1, 4, 2, 1, 4), A100) == 0
    assert sim.transition_time(actor, Strategy(1, 4, 2, 1, 2), A100) > 0


def _set(models, times):
    return SetPlan(models, 1, {}, {m: dict(zip(STAGES, t)) for m, t in zip(models, times)}, 0.0)


def test_cost_composition_against_direct_loop():
    sets = (_set(("actor", "reference"), [(5, 1, 7), (0, 2, 0)]),
            _set(("critic",), [(0, 4, 6)]),
            _set(("reward",), [(0, 3.5, 0)]))
    direct = 0.0
    for st in range(3):
        direct += max(sum(t[STAGES[st]] for t in s.times.values()) for s in sets)
    total, stages = compose(sets)
    assert total == direct == 5 + 4 + 7
    assert stages == {"generation": 5, "preparation": 4, "training": 7}
    seq_total, _ = compose(sets, concurrent=False)
    assert seq_total == 5 + (1 + 2 + 4 + 3.5) + (7 + 6)


def test_search_result_consistent_and_cached():
    p = Planner(build_dataflow("ppo", SEVEN), Workload(), 32, A100)
    top = p.search(top=5)
    assert len(top) == 5 and [m.total for m in top] == sorted(m.total for m in top)
    for m in top:
        assert sum(s.devices for s in m.sets) == 32
        assert sorted(r for s in m.sets for r in s.models) == sorted(p.dataflow.names)
        assert math.isclose(m.total, compose(m.sets)[0])
        for s in m.sets:
            assert s.peak_bytes <= A100.usable_bytes * (1 + 1e-9)
            assert all(st.devices == s.devices for st in s.strategies.values())
    misses = p.cache_misses
    assert misses <= len(p.dataflow.names) * len(p.counts)     # once per (model, count)
    p.search(top=5)
    assert p.cache_misses == misses and p.cache_hits > 0
    actor = p.dataflow.role("actor")
    assert p.candidates(actor, 8) is p.candidates(actor, 8)


def test_evaluate_reproduces_search_choice():
    p = Planner(build_dataflow("ppo", SEVEN), Workload(), 16, A100)
    best = p.search(top=1)[0]
    again = p.evaluate([(s.models, s.strategies) for s in best.sets])
    assert math.isclose(again.total, best.total)


@pytest.mark.parametrize("size", ["7b", "13b"])
def test_a100_plans_16_to_128(size):
    for n in (16, 32, 64, 96, 128):
        top = Planner(build_dataflow("ppo", model_shape(size)), Workload(), n, A100).search(3)
        assert top and sum(s.devices for s in top[0].sets) == n


def test_profiles_and_dataflows():
    assert {"a100-80gb", "h100-80gb", "cpu"} <= set(shipped_profiles())
    for name in shipped_profiles():
        assert load_profile(name).usable_bytes > 0
    with pytest.raises(ValueError, match="profile='tpu' is neither"):
        load_profile("tpu")
    assert build_dataflow("ppo", SEVEN).names == ("actor", "critic", "reference", "reward")
    assert build_dataflow("safe_rlhf", SEVEN).names[-1] == "cost"
    assert "critic" not in build_dataflow("remax", SEVEN).names
    assert "critic" not in build_dataflow("grpo", SEVEN).names
    assert build_dataflow("remax", SEVEN).role("actor").generations == 2
    with pytest.raises(ValueError, match="algo='dpo' has no built-in dataflow"):
        build_dataflow("dpo", SEVEN)
    with pytest.raises(ValueError, match="prompts=0 must be a positive int"):
        Workload(prompts=0)
    with pytest.raises(ValueError, match="devices=0"):
        Planner(build_dataflow("ppo", SEVEN), Workload(), 0, A100)
