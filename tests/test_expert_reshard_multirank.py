"""Expert transitions on 4 gloo ranks: generation experts bit-exact against slices of the global
tensors, bytes received equal to the layout's formula, own experts as views (storage identity),
nothing staged (down_proj under generation TP stored as its pieces), and bad input refused on
every rank before a message moves; the public entry (``reshard_from_state_dict(...,
experts=)``) on a whole mixture of experts."""

import zlib

import torch

from engine.llama_spec import LlamaConfig, llama_shard_specs
from hybridflow_comm.expert_layout import ExpertLayout
from hybridflow_comm.expert_reshard import ExpertResharder, expert_slot_specs, to_train_layout
from hybridflow_comm.flat_buffer import FlatParamBuffer
from hybridflow_comm.groups import build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from hybridflow_comm.shard_spec import GateUpFusion, ShardSpec, gen_shard, train_shard

NUM_EXPERTS, HIDDEN, FFN = 8, 8, 12

# (train pp, tp, dp), (gen pp_g, tp_g), ep, gen_ep: EP 4 -> gen EP 2 and -> gen TP 2 first.
CASES = [((1, 2, 2), (1, 2), 4, 2), ((1, 2, 2), (1, 2), 4, 1), ((1, 4, 1), (1, 2), 4, 1),
         ((2, 2, 1), (1, 2), 2, 2), ((2, 2, 1), (1, 1), 2, 1), ((1, 1, 4), (1, 1), 2, 1),
         ((1, 4, 1), (1, 4), 4, 4), ((1, 4, 1), (1, 4), 4, 2), ((2, 2, 1), (2, 2), 2, 1)]


def specs_for(pp, layers=4):
    out = []
    for layer in range(layers):
        stage = layer * pp // layers
        for e in range(NUM_EXPERTS):
            p = f"layers.{layer}.experts.{e}."
            out += [ShardSpec(p + "gate_up", (2 * FFN, HIDDEN), dtype=torch.bfloat16,
                              partition_dim=0, stage=stage, fusion=GateUpFusion(), expert=e),
                    ShardSpec(p + "down_proj", (HIDDEN, FFN), dtype=torch.bfloat16,
                              partition_dim=1, stage=stage, expert=e)]
    return out


def full_tensor(spec, version):
    seed = zlib.crc32(f"{spec.name}:{version}".encode())
    return torch.randn(spec.shape, generator=torch.Generator().manual_seed(seed)).to(spec.dtype)


def expected_gen(full, spec, el, rank):
    """Reference: the generation piece of ``full``, or None when ``rank`` does not need it."""
    h = el.hybrid
    g = h.gen_coords(rank)
    if spec.stage // h.micro_pp != g.pp_g or spec.expert not in el.gen_experts(rank):
        return None
    piece = el.gen_piece(rank)
    return full.chunk(piece.count, dim=spec.partition_dim)[piece.index]


def _layout(case):
    train, gen, ep, gen_ep = case
    hl = HybridLayout(ParallelLayout(*train), pp_g=gen[0], tp_g=gen[1])
    return ExpertLayout(hl, NUM_EXPERTS, ep=ep, gen_ep=gen_ep)


def _train_tensors(specs, el, rank, version):
    stage = el.hybrid.train.coords(rank).pp
    return {s.name: full_tensor(s, version) for s in specs
            if s.stage == stage and s.expert in el.train_experts(rank)}


def check_transitions(rank, world, cases):
    out = []
    for case in cases:
        el = _layout(case)
        groups = build_hybrid_groups(el.hybrid)
        specs = specs_for(el.hybrid.train.pp)
        rs = ExpertResharder(specs, el, groups.world, bucket_bytes=4096)
        train = rs.buffer.train_views()
        assert sorted(train) == sorted(_train_tensors(specs, el, rank, 0))
        for version in (0, 1):
            for name, t in _train_tensors(specs, el, rank, version).items():
                spec = next(s for s in specs if s.name == name)  # (new) training weights,
                train[name].copy_(to_train_layout(t, spec, el))  # written in place
            stats = rs.to_generation()
            gen = rs.generation_experts()
            want = {s.name: expected_gen(full_tensor(s, version), s, el, rank) for s in specs}
            want = {n: t for n, t in want.items() if t is not None}
            assert sorted(gen) == sorted(want), case
            for name, t in want.items():
                assert torch.equal(gen[name], t), (case, name)
                if name in train:  # held in training: a view, never a copy
                    assert gen[name].untyped_storage().data_ptr() == \
                        train[name].untyped_storage().data_ptr()
            expert_bytes = sum(s.nbytes for s in specs)
            assert stats.received_bytes == rs.minimum_received_bytes() == \
                el.received_fraction() * expert_bytes, case
            assert stats.redundant_bytes == 0, case  # every piece sent from where it lies
            assert stats.version == version + 1
            rs.to_training()
            assert rs.buffer.released
        out.append((case, stats.received_bytes, stats.redundant_bytes))
    return out


def test_expert_transitions_bit_exact_at_the_formula(pool4):
    results = pool4.run(check_transitions, CASES)
    assert any(case[3] == 1 and case[1][1] > 1 for case, _, _ in results[0])  # gen TP pieces
    for case, received, redundant in results[0]:
        assert redundant == 0, case


def check_bad_input(rank, world):
    el = _layout(CASES[0])
    groups = build_hybrid_groups(el.hybrid)
    specs = specs_for(1)
    errors = []
    other = FlatParamBuffer(expert_slot_specs(specs, ExpertLayout(el.hybrid, NUM_EXPERTS, 4, 1),
                                              rank))
    try:  # a local error: raised before any collective
        ExpertResharder(specs, el, groups.world, buffer=other)
    except ValueError as exc:
        errors.append(str(exc))
    mine = specs if rank else specs[:-1] + [ShardSpec(specs[-1].name, (HIDDEN, FFN),
                                                      dtype=torch.float32, partition_dim=1,
                                                      expert=specs[-1].expert)]
    try:
        ExpertResharder(mine, el, groups.world)
    except ValueError as exc:
        errors.append(str(exc))
    return errors


def test_bad_input_raises_on_every_rank(pool4):
    for rank, errors in enumerate(pool4.run(check_bad_input)):
        assert f"rank {rank}: the expert buffer was not built from" in errors[0]
        assert "shard specs differ across ranks" in errors[1] and "torch.float32" in errors[1]


# The public entry: a whole mixture of experts from plain local tensors ----------------------

MOE = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_layers=2,
                  num_heads=8, num_kv_heads=4, tie_word_embeddings=False, num_experts=8,
                  num_experts_per_tok=2, model_type="mixtral")
ENTRY_CASES = [((1, 2, 2), (1, 1), 4, 1), ((1, 4, 1), (1, 4), 4, 2), ((2, 2, 1), (1, 2), 2, 2)]


def check_public_entry(rank, world, cases):
    import hybridflow_comm as hc

    out = []
    for train, gen, ep, gen_ep in cases:
        hl = HybridLayout(ParallelLayout(*train), pp_g=gen[0], tp_g=gen[1])
        el = ExpertLayout(hl, MOE.num_experts, ep=ep, gen_ep=gen_ep)
        specs = llama_shard_specs(MOE, train[0])
        full = {s.name: full_tensor(s, 0) for s in specs}
        stage = hl.train.coords(rank).pp
        local = {s.name: full[s.name] if s.expert is not None
                 else train_shard(full[s.name], s, hl.train, rank) for s in specs
                 if s.stage == stage and (s.expert is None or s.expert in el.train_experts(rank))}
        t = hc.reshard_from_state_dict(local, specs, hl, experts=el)
        assert isinstance(t, hc.MoeResharder) and isinstance(t, hc.Transition)
        stats = t.to_generation()
        got = dict(t.named_generation_weights(hf_names=False))
        for s in specs:
            want = expected_gen(full[s.name], s, el, rank) if s.expert is not None \
                else gen_shard(full[s.name], s, hl, rank)
            if want is None:
                assert s.name not in got
            else:
                assert torch.equal(got[s.name], want), (train, gen, ep, gen_ep, s.name)
        expert_bytes = sum(s.nbytes for s in specs if s.expert is not None)
        dense_min = t.dense.minimum_received_bytes()
        assert stats.received_bytes == t.minimum_received_bytes() == \
            dense_min + el.received_fraction() * expert_bytes
        hf = dict(t.named_generation_weights())  # Hugging Face names, experts' split
        assert all(".experts." not in n or n.endswith((".w1.weight", ".w2.weight", ".w3.weight"))
                   for n in hf), sorted(hf)[:4]
        t.to_training()
        out.append(stats.received_bytes)
    return out


def test_public_entry_reshards_a_mixture_of_experts(pool4):
    for received in pool4.run(check_public_entry, ENTRY_CASES):
        assert all(r > 0 for r in received)


def check_public_entry_refuses(rank, world):
    import hybridflow_comm as hc

    hl = HybridLayout(ParallelLayout(1, 1, 4), pp_g=1, tp_g=1)
    el = ExpertLayout(hl, MOE.num_experts, ep=4)
    specs = llama_shard_specs(MOE, 1)
    full = {s.name: full_tensor(s, 0) for s in specs}
    local = {s.name: full[s.name] for s in specs}  # every expert: not this rank's alone
    try:
        hc.reshard_from_state_dict(local, specs, hl, experts=el)
    except ValueError as exc:
        return str(exc)


def test_public_entry_refuses_experts_of_another_block(pool4):
    for rank, msg in enumerate(pool4.run(check_public_entry_refuses)):
        assert f"rank {rank}: " in msg and "held by the ranks of another EP block" in msg
