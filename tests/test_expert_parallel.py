"""Expert parallelism on 4 gloo ranks against one process.

The MoE layer (engine.expert_parallel): outputs, the load-balancing loss, and the gradients of
the inputs, the router and every expert (owners' gradients summed over their expert-DP group)
for ep 2 and 4, folded over DP, over TP, and over both.  The training engine: loss, grad norm,
load-balancing loss, every gradient of step 1 and the weights after 3 AdamW steps at ep 2 and
4 beside tp, pp and dp, equal to the single process's (fp32, atol 1e-5), with storage identity
of the experts' parameters and gradients.  The HybridEngine (also with LoRA adapters) against
ep 1, HF load and export at EP layouts against transformers, and the planner's all-to-all
bytes and expert memory against what the engine sends and allocates."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from engine.expert_parallel import moe_block_ep
from engine.hybrid_engine import HybridEngine
from engine.lora import LoraConfig
from engine.llama_spec import LlamaConfig, init_full_state_dict
from engine.model import ParallelLlama, load_full_state_dict
from engine.moe import MoeRouting, moe_block
from engine.router_loss import RouterLoss
from engine.sampling import SamplingParams
from engine.train import OptimConfig, TrainEngine
from hybridflow_comm.expert_layout import ExpertLayout
from hybridflow_comm.expert_reshard import MoeResharder
from hybridflow_comm.strided import logical_from_stacked
from hybridflow_comm.groups import Group, build_expert_groups, build_hybrid_groups
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from tests import test_engine_parallel as ep_ref

E, H, F, TOKENS = 8, 12, 10, 9
ROUTING = MoeRouting(top_k=2, norm_topk=True)
CASES = [(1, 4, 4), (1, 4, 2), (2, 2, 4), (2, 2, 2), (4, 1, 4), (4, 1, 2)]  # (tp, dp, ep)


def full_weights():
    g = torch.Generator().manual_seed(0)
    w = {"router": torch.randn(E, H, generator=g, dtype=torch.float64)}
    for e in range(E):
        w[f"experts.{e}.gate_up"] = torch.randn(2 * F, H, generator=g, dtype=torch.float64) / 3
        w[f"experts.{e}.down_proj"] = torch.randn(H, F, generator=g, dtype=torch.float64) / 3
    return w


def tokens_of(dp_rank):
    g = torch.Generator().manual_seed(100 + dp_rank)
    x = torch.randn(1, TOKENS, H, generator=g, dtype=torch.float64)
    return x, torch.randn(1, TOKENS, H, generator=g, dtype=torch.float64)


def reference(dp):
    """Every DP rank's tokens through the unsplit layer: outputs, x grads, summed weight
    grads (loss = sum over DP ranks of <out, g> + the load-balancing terms)."""
    w = {k: v.clone().requires_grad_() for k, v in full_weights().items()}
    outs, xgrads, aux = [], [], []
    for d in range(dp):
        x, g = tokens_of(d)
        x.requires_grad_()
        loss = RouterLoss(weight=0.1)
        out = moe_block(x, w, ROUTING, None, loss)
        ((out * g).sum() + loss.weighted()).backward()
        outs.append(out.detach())
        xgrads.append(x.grad)
        aux.append(loss.total().item())
    return outs, xgrads, {k: v.grad for k, v in w.items()}, aux


def _group(families, rank, name):
    for ranks, pg in families[name]:
        if rank in ranks:
            return Group(ranks=tuple(ranks), rank=ranks.index(rank), pg=pg if len(ranks) > 1 else None)
    raise AssertionError(name)


def check_ep_layer(rank, world, cases):
    results = []
    for tp, dp, ep in cases:
        hl = HybridLayout(ParallelLayout(pp=1, tp=tp, dp=dp), pp_g=1, tp_g=1)
        el = ExpertLayout(hl, E, ep=ep)
        families = {}  # every rank creates every group, in one order
        for name, groups in (("tp", hl.train.tp_groups()), ("dp", hl.train.dp_groups()),
                             ("ep", el.ep_groups()), ("edp", el.expert_dp_groups())):
            families[name] = [(g, dist.new_group(g)) for g in groups]
        tp_group, dp_group = _group(families, rank, "tp"), _group(families, rank, "dp")
        ep_group, edp_group = _group(families, rank, "ep"), _group(families, rank, "edp")
        assert [ep_group.ranks.index(r) for r in ep_group.ranks] == \
            [el.coords(r).ep for r in ep_group.ranks]  # member k holds the k-th block
        full = full_weights()
        mine = ["router"] + [f"experts.{e}.{p}" for e in el.train_experts(rank)
                             for p in ("gate_up", "down_proj")]
        w = {k: full[k].clone().requires_grad_() for k in mine}
        d = hl.train.coords(rank).dp
        x, g = tokens_of(d)
        x.requires_grad_()
        loss = RouterLoss(weight=0.1)
        out = moe_block_ep(x, w, ROUTING, E, ep_group, tp_group if tp > 1 else None, loss)
        ((out * g).sum() + loss.weighted()).backward()
        router = w["router"].grad.clone()
        dist.all_reduce(router, group=dp_group.pg) if dp_group.pg is not None else None
        experts = {}
        for k in mine[1:]:
            grad = w[k].grad.clone()
            if edp_group.pg is not None:
                dist.all_reduce(grad, group=edp_group.pg)
            experts[k] = grad
        results.append(((tp, dp, ep), d, out.detach(), x.grad, router, experts,
                        loss.total().item()))
    return results


@pytest.mark.parametrize("chunk", [CASES[:3], CASES[3:]], ids=["a", "b"])
def test_expert_parallel_layer_equals_the_unsplit_layer(pool4, chunk):
    compare_layer_cases(pool4, chunk)


def compare_layer_cases(pool, chunk=CASES):
    """Every case of ``chunk`` on the pool's 4 ranks against :func:`reference`."""
    refs = {dp: reference(dp) for dp in {c[1] for c in chunk}}
    for rank_results in pool.run(check_ep_layer, chunk):
        for case, d, out, xgrad, router, experts, aux in rank_results:
            outs, xgrads, wgrads, auxs = refs[case[1]]
            torch.testing.assert_close(out, outs[d], rtol=1e-6, atol=1e-9, msg=str(case))
            torch.testing.assert_close(xgrad, xgrads[d], rtol=1e-6, atol=1e-9, msg=str(case))
            torch.testing.assert_close(router, wgrads["router"], rtol=1e-6, atol=1e-9)
            assert aux == pytest.approx(auxs[d], rel=1e-12)
            assert len(experts) == 2 * E // case[2]
            for k, grad in experts.items():
                torch.testing.assert_close(grad, wgrads[k], rtol=1e-6, atol=1e-9,
                                           msg=f"{case} {k}")


def check_all_to_all_bytes(rank, world, cases):
    """Bytes this rank sends to other EP members (all-to-alls of rows, forward and backward)
    for one layer over a balanced routing replayed on the TP group's ``tp * E`` tokens: token
    ``n``'s slot ``j`` goes to expert ``(n // tp * k + j) % E``, so every rank's share sends
    ``k`` rows to each expert."""
    from engine.route_trace import RouteTrace

    sent, real = [], dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None):
        if input_split_sizes is not None:  # rows, not the count table
            me = dist.get_rank(group=group)
            row = input[0].numel() * input.element_size() if input.numel() else 0
            sent[-1] += sum(n for i, n in enumerate(input_split_sizes) if i != me) * row
        return real(output, input, output_split_sizes, input_split_sizes, group=group)

    dist.all_to_all_single = counting
    try:
        for tp, dp, ep in cases:
            hl = HybridLayout(ParallelLayout(pp=1, tp=tp, dp=dp), pp_g=1, tp_g=1)
            el = ExpertLayout(hl, E, ep=ep)
            families = {name: [(g, dist.new_group(g)) for g in groups]
                        for name, groups in (("tp", hl.train.tp_groups()),
                                             ("ep", el.ep_groups()))}
            tp_group, ep_group = _group(families, rank, "tp"), _group(families, rank, "ep")
            full = full_weights()
            w = {k: full[k].clone().requires_grad_() for k in
                 ["router"] + [f"experts.{e}.{p}" for e in el.train_experts(rank)
                               for p in ("gate_up", "down_proj")]}
            n, k = tp * E, ROUTING.top_k
            x = torch.randn(1, n, H, dtype=torch.float64, generator=torch.Generator()
                            .manual_seed(7)).requires_grad_()
            token = torch.arange(n)[:, None] // tp * k + torch.arange(k)
            trace = RouteTrace(replay=(token % E)[:, None, :])
            sent.append(0)
            out = moe_block_ep(x, w, ROUTING, E, ep_group, tp_group if tp > 1 else None,
                               trace=trace)
            out.sum().backward()
    finally:
        dist.all_to_all_single = real
    return sent


def test_planner_all_to_all_bytes_equal_what_the_layer_sends(pool4):
    """The planner's per-layer all-to-all bytes (rlhf.planner.simulator.all_to_all_bytes),
    four times (dispatch and return, forward and backward), are the bytes every rank sends."""
    from rlhf.planner import simulator as sim
    from rlhf.planner.models import ModelShape
    from rlhf.planner.strategy import Strategy

    shape = ModelShape("moe", LlamaConfig(vocab_size=64, hidden_size=H, intermediate_size=F,
                                          num_layers=1, num_heads=2, num_kv_heads=2,
                                          num_experts=E, num_experts_per_tok=ROUTING.top_k,
                                          tie_word_embeddings=False, model_type="mixtral"))
    for sent in pool4.run(check_all_to_all_bytes, CASES):
        for (tp, dp, ep), got in zip(CASES, sent, strict=True):
            want = 4 * sim.all_to_all_bytes(shape, tp * E, Strategy(1, tp, dp, 1, tp, ep), 8)
            assert got == want > 0, ((tp, dp, ep), got, want)


# The training engine under expert parallelism against the single process ---------------------

MOE = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_layers=2,
                  num_heads=8, num_kv_heads=4, tie_word_embeddings=False, num_experts=E,
                  num_experts_per_tok=2, model_type="mixtral", router_aux_loss_coef=0.01)
ENGINE_LAYOUTS = [(1, 1, 4, 4), (1, 1, 4, 2), (1, 2, 2, 4), (1, 2, 2, 2), (1, 4, 1, 2),
                  (2, 1, 2, 2), (2, 2, 1, 2)]  # (pp, tp, dp, ep)
STACKED_LAYOUTS = [(1, 2, 2, 4, 2), (2, 2, 1, 2, 2)]  # (+ gen tp: down_proj stored as pieces)
STEPS, ATOL = 3, 1e-5


def build_engine(pp, tp, dp, ep, gen_tp=1):
    hl = HybridLayout(ParallelLayout(pp, tp, dp), 1, gen_tp)
    pool = list(range(hl.world_size))
    groups = build_hybrid_groups(hl, pool=pool)
    experts = build_expert_groups(ExpertLayout(hl, E, ep=ep), pool=pool)
    model = ParallelLlama(MOE, groups, experts=experts)
    return model, TrainEngine(model, OptimConfig(**ep_ref.ADAM, max_grad_norm=0.05))


def engine_reference():
    full = init_full_state_dict(MOE, seed=3)
    model, eng = build_engine(1, 1, 1, 1)
    load_full_state_dict(model, full)
    mbs = ep_ref.make_micro_batches()
    ref = {"full": full, "metrics": []}
    for step in range(STEPS):
        ref["metrics"].append(eng.train_step(mbs, ep_ref.policy_loss, temperature=1.0))
        if step == 0:
            ref["grads"] = {n: p.grad.clone() for n, p in model.params.items()}
    ref["weights"] = {n: p.detach().clone() for n, p in model.params.items()}
    return ref


def check_engine(rank, world, layouts, ref):
    checks = 0
    for layout in layouts:
        model, eng = build_engine(*layout)
        load_full_state_dict(model, ref["full"])
        held = model.experts.layout.train_experts(rank)
        experts = {n for n in model.params if ".experts." in n}
        assert experts == {s.name for s in model.specs if s.expert in held
                           and s.stage == model.stage}  # whole experts of its block only
        per_dp = ep_ref.N_MICRO // layout[2]
        d = model.coords.dp
        mine = ep_ref.make_micro_batches()[d * per_dp:(d + 1) * per_dp]
        for step in range(STEPS):
            metrics = eng.train_step(mine, ep_ref.policy_loss, temperature=1.0)
            exp = ref["metrics"][step]
            for key in ("loss", "grad_norm", "router_aux_loss"):
                assert abs(metrics[key] - exp[key]) < ATOL, (layout, step, key, metrics, exp)
            if step == 0:
                for name, p in model.params.items():
                    spec = next(s for s in model.specs if s.name == name)
                    torch.testing.assert_close(p.grad, model.train_shard(ref["grads"][name], spec),
                                               atol=ATOL, rtol=0, msg=f"{layout} grad {name}")
        for name, p in model.params.items():
            spec = next(s for s in model.specs if s.name == name)
            torch.testing.assert_close(p.detach(), model.train_shard(ref["weights"][name], spec),
                                       atol=ATOL, rtol=0, msg=f"{layout} weight {name}")
            home = model.expert_buffer if name in experts else model.buffer
            assert p.data_ptr() == home.train_view(name).data_ptr()
            grads = eng.expert_grads if name in experts else eng.grads
            assert (p.grad.untyped_storage().data_ptr()
                    == grads.flat[p.dtype].untyped_storage().data_ptr())
        checks += 1
    return checks


@pytest.fixture(scope="module")
def reference_run():
    return engine_reference()


@pytest.mark.parametrize("layout", ENGINE_LAYOUTS + STACKED_LAYOUTS, ids=str)
def test_training_with_expert_parallelism_equals_one_process(pool4, reference_run, layout):
    assert sum(pool4.run(check_engine, [layout], reference_run)) == 4


def held_expert_elements(rank, world, layouts):
    """Expert elements this rank's model allocates at each layout (and at ep=1), and those
    its expert buffer adds for generation (the pieces it receives)."""
    out = []
    for lay in layouts:
        models = [build_engine(*lay[:3], ep)[0] for ep in (lay[3], 1)]
        held = [sum(p.numel() for n, p in m.params.items() if ".experts." in n) for m in models]
        buf = models[0].expert_buffer
        out.append((*held, (buf.gen_nbytes - buf.train_nbytes) // MOE.dtype.itemsize))
    return out


def test_planner_counts_the_experts_a_rank_holds(pool4):
    """The planner's share of the experts per training rank (whole experts ``E / ep`` under
    ep, each cut ``tp`` ways without), the difference ep makes to its
    :func:`rlhf.planner.memory.train_shard_params`, and the experts' part of its generation
    memory beyond the training shard, are what the engine allocates."""
    from rlhf.planner import memory as mem
    from rlhf.planner.models import ModelShape
    from rlhf.planner.strategy import Strategy

    shape = ModelShape("moe", MOE)
    for held in pool4.run(held_expert_elements, ENGINE_LAYOUTS):
        for (pp, tp, dp, ep), (got, got_1, extra) in zip(ENGINE_LAYOUTS, held, strict=True):
            s, s_1 = Strategy(pp, tp, dp, 1, 1, ep), Strategy(pp, tp, dp, 1, 1)
            stage = MOE.num_layers // pp * shape.expert_layer_params
            assert (got, got_1) == (stage / s.expert_split, stage / s_1.expert_split)
            assert got - got_1 == pytest.approx(
                mem.train_shard_params(shape, s) - mem.train_shard_params(shape, s_1), rel=1e-12)
            assert extra == pytest.approx(mem.expert_transition_bytes(
                pp, ep, 1, 1, MOE.num_layers * shape.expert_layer_params), rel=1e-12), \
                ((pp, tp, dp, ep), extra)


HYBRID_LAYOUTS = [((1, 1, 4), (1, 1), 4), ((1, 2, 2), (1, 1), 2), ((2, 1, 2), (1, 1), 2),
                  ((1, 2, 2), (1, 2), 4), ((1, 4, 1), (1, 2), 2), ((1, 2, 2), (1, 2), 4, 2),
                  ((2, 2, 1), (1, 2), 2, 2), ((1, 4, 1), (1, 4), 4, 2)]
"""``(p-t-d, p_g-t_g, ep[, gen_ep])``: the last three generate under generation EP."""
N_NEW = 5


def build_hybrid(train, gen, ep, full, config=MOE, adapters=None, gen_ep=1):
    """The HybridEngine of ``config`` at the layout, weights ``full`` (and, with ``adapters``,
    LoRA adapters of :data:`LORA` on the attention)."""
    from engine.model import load_adapter_state_dict

    hl = HybridLayout(ParallelLayout(*train), *gen)
    pool = list(range(hl.world_size))
    groups = build_hybrid_groups(hl, pool=pool)
    experts = build_expert_groups(ExpertLayout(hl, E, ep=ep, gen_ep=gen_ep), pool=pool)
    model = ParallelLlama(config, groups, experts=experts,
                          lora=None if adapters is None else LORA)
    load_full_state_dict(model, full)
    if adapters is not None:
        load_adapter_state_dict(model, adapters)
    return HybridEngine(model, OptimConfig(**ep_ref.ADAM))


def prompts():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, MOE.vocab_size, (4, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return ids.masked_fill(mask == 0, 0), mask


def one_iteration(engine):
    """Generate (greedy), then one update: the generation views, the rollout, the stats."""
    ids, mask = prompts()
    with engine.generation_mode() as stats:
        views = {n: (logical_from_stacked(t, 1) if t.dim() == 3 else t).clone()
                 for n, t in engine.resharder.generation_params().items()}  # stacked rows
        out = engine.generate_sequences(ids, mask, SamplingParams(max_new_tokens=N_NEW,
                                                                  temperature=0.0))
    d, dp = engine.model.coords.dp, engine.layout.train.dp
    per = ep_ref.N_MICRO // dp
    metrics = engine.train.train_step(ep_ref.make_micro_batches()[d * per:(d + 1) * per],
                                      ep_ref.policy_loss, temperature=1.0)
    return views, out, stats, metrics


def check_hybrid_engine(rank, world, layouts, full, config=MOE):
    """Two iterations of the HybridEngine at ``ep`` against the same layout at ep=1: equal
    generation weights (moved, never computed: bit-exact), rollouts and update metrics.  Under
    generation EP a rank holds its set's experts whole (the reference their generation TP
    pieces, compared piece by piece) and computes only those."""
    checks = 0
    for train, gen, ep, *rest in layouts:
        gen_ep = rest[0] if rest else 1
        ours = build_hybrid(train, gen, ep, full, config, gen_ep=gen_ep)
        ref = build_hybrid(train, gen, 1, full, config)
        assert isinstance(ours.resharder, MoeResharder) and ref.model.experts is None
        if gen_ep > 1:
            assert ours.rollout.experts == ours.model.experts.layout.gen_experts(rank)
            assert len(ours.rollout.experts) == E // gen_ep
        piece, pieces = ref.layout.gen_coords(rank).tp_g, ref.layout.tp_g  # the reference's
        mine = ours.model.experts.layout.gen_piece(rank)
        for it in range(2):
            (v, out, stats, m), (rv, rout, _, rm) = one_iteration(ours), one_iteration(ref)
            held = {n.split(".experts.")[1].split(".")[0] for n in v if ".experts." in n}
            assert held == {str(e) for e in ours.rollout.experts or range(E)}, (train, gen)
            assert v.keys() <= rv.keys(), (train, gen, ep, sorted(v.keys() - rv.keys()))
            for name, t in v.items():
                want = rv[name]
                if t.shape != want.shape:  # a larger piece of the expert here
                    dim = next(d for d in range(t.dim()) if t.shape[d] != want.shape[d])
                    k = pieces // mine.count
                    if not 0 <= piece - mine.index * k < k:
                        continue  # the reference's piece lies in another rank's
                    t = t.chunk(k, dim)[piece - mine.index * k]
                tol = 0 if it == 0 else ATOL  # after an update: the same step, summed apart
                torch.testing.assert_close(t, want, atol=tol, rtol=0, msg=lambda m: f"{train} it {it} {name}: {m}")
            assert torch.equal(out.input_ids, rout.input_ids), (train, gen, ep, it)
            torch.testing.assert_close(out.log_probs, rout.log_probs, atol=ATOL, rtol=0)
            assert abs(m["loss"] - rm["loss"]) < ATOL and stats.version == it + 1
            assert stats.received_bytes == ours.resharder.minimum_received_bytes()
            assert ours.model.expert_buffer.released  # received pieces given back
        checks += 1
    return checks


@pytest.mark.parametrize("layout", HYBRID_LAYOUTS, ids=str)
def test_hybrid_engine_with_expert_parallelism_equals_ep_1(pool4, layout):
    full = init_full_state_dict(MOE, seed=4)
    assert sum(pool4.run(check_hybrid_engine, [layout], full)) == 4


def test_tied_embeddings_across_stages_with_expert_parallelism(pool4):
    """A tied LM head on the last of 2 stages (its copy of the embedding kept in step with
    stage 0's) beside ep=2: as ep=1."""
    tied = dataclasses.replace(MOE, tie_word_embeddings=True)
    full = init_full_state_dict(tied, seed=6)
    layouts = [((2, 1, 2), (1, 1), 2), ((2, 2, 1), (2, 1), 2)]
    assert sum(pool4.run(check_hybrid_engine, layouts, full, tied)) == 4 * len(layouts)


def check_vllm_stream(rank, world, layouts, full):
    """What the vLLM adapter feeds ``load_weights`` at each layout: every tensor of the
    generation stage gathered over the generation TP group, experts included."""
    from engine.vllm_rollout import full_hf_weights

    out = []
    for train, gen, ep in layouts:
        ours = build_hybrid(train, gen, ep, full)
        with ours.generation_mode():
            out.append({n: t.clone() for n, t in full_hf_weights(ours.resharder,
                                                                 ours.groups.gen_tp)})
    return out


def test_vllm_weight_stream_of_an_expert_parallel_model_is_full_hf_tensors(pool4):
    """Experts trained whole on their EP block (down_proj stored as its generation pieces),
    moved to every generation TP rank as its piece, gathered there: the HF state dict."""
    from engine.hf_interop import full_to_hf_state_dict
    from engine.llama_spec import llama_shard_specs

    full = init_full_state_dict(MOE, seed=4)
    want = full_to_hf_state_dict(full, llama_shard_specs(MOE, 1))
    layouts = [((1, 2, 2), (1, 2), 4), ((1, 4, 1), (1, 2), 2), ((2, 1, 2), (1, 1), 2)]
    covered = [set() for _ in layouts]
    for per_rank in pool4.run(check_vllm_stream, layouts, full):
        for k, got in enumerate(per_rank):
            for name, t in got.items():
                assert torch.equal(t, want[name]), (layouts[k], name)
            covered[k] |= got.keys()
    assert all(c == want.keys() for c in covered)
    assert any(".experts." in n for n in want)


LORA = LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "o_proj"))
LORA_LAYOUTS = [((1, 1, 4), (1, 1), 4), ((1, 2, 2), (1, 2), 2)]  # (p-t-d, p_g-t_g, ep)


def check_lora_hybrid_engine(rank, world, layouts, full, adapters):
    """LoRA on the attention of an expert-parallel model: two iterations equal ep=1's; the
    frozen base (experts included) moves at the first transition only, the adapters at each."""
    checks = 0
    for train, gen, ep in layouts:
        ours = build_hybrid(train, gen, ep, full, adapters=adapters)
        ref = build_hybrid(train, gen, 1, full, adapters=adapters)
        assert ours.train.expert_grads is None  # the experts are frozen
        adapter_bytes = ours.adapter_resharder.minimum_received_bytes()
        for it in range(2):
            (v, out, stats, m), (rv, rout, _, rm) = one_iteration(ours), one_iteration(ref)
            assert v.keys() == rv.keys()
            for name, t in v.items():
                assert torch.equal(t, rv[name]), (train, gen, ep, it, name)  # frozen: moved
            assert torch.equal(out.input_ids, rout.input_ids), (train, gen, ep, it)
            torch.testing.assert_close(out.log_probs, rout.log_probs, atol=ATOL, rtol=0)
            assert abs(m["loss"] - rm["loss"]) < ATOL, (train, gen, ep, it, m, rm)
            base = ours.resharder.minimum_received_bytes()
            assert stats.received_bytes == (base if it == 0 else 0) + adapter_bytes
            assert not ours.model.expert_buffer.released  # the received experts are kept
        checks += 1
    return checks


def test_lora_with_expert_parallelism_equals_ep_1(pool4):
    from engine.lora import init_lora_state_dict

    full = init_full_state_dict(MOE, seed=4)
    g = torch.Generator().manual_seed(9)
    adapters = {k: torch.randn(v.shape, generator=g) / 4
                for k, v in init_lora_state_dict(MOE, LORA).items()}  # B != 0: deltas count
    assert sum(pool4.run(check_lora_hybrid_engine, LORA_LAYOUTS, full, adapters)) == \
        4 * len(LORA_LAYOUTS)


def moe_checkpoint(folder):
    """A tiny Qwen3-MoE (4 experts, top 2, 2 layers) saved by transformers."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(str(folder))
    return folder


HF_LAYOUTS = [((1, 1, 4), (1, 1), 4), ((1, 2, 2), (1, 2), 2), ((2, 1, 2), (1, 1), 2),
              ((2, 2, 1), (2, 2), 2)]  # (p-t-d, p_g-t_g, ep); gen tp 2: down_proj stacked


def check_hf_round_trip(rank, world, folder, out_root, layouts):
    """Load the HF checkpoint at each expert-parallel layout and export it again, streamed
    and gathered."""
    from engine.hf_interop import (load_hf_checkpoint, read_hf_config, save_hf_checkpoint,
                                   stream_hf_checkpoint)

    cfg = read_hf_config(folder)
    for i, (train, gen, ep) in enumerate(layouts):
        hl = HybridLayout(ParallelLayout(*train), *gen)
        pool = list(range(hl.world_size))
        groups = build_hybrid_groups(hl, pool=pool)
        experts = build_expert_groups(ExpertLayout(hl, cfg.num_experts, ep=ep), pool=pool)
        model = ParallelLlama(cfg, groups, experts=experts)
        load_hf_checkpoint(model, folder)
        assert len([n for n in model.params if ".experts." in n]) == \
            2 * cfg.num_experts // ep * cfg.num_layers // train[0]  # whole experts of its block
        assert all((p.dim() == 3) == (gen[1] > 1) for n, p in model.params.items()
                   if ".experts." in n and n.endswith("down_proj"))  # pieces under gen tp
        stream_hf_checkpoint(model, f"{out_root}/{i}")
        save_hf_checkpoint(model, f"{out_root}/gathered{i}")
        dist.barrier()
    blocked = f"{out_root}/a_file"  # rank 0 cannot write a folder there: every rank raises
    if rank == 0:
        open(blocked, "w").close()
    dist.barrier()
    try:
        stream_hf_checkpoint(model, blocked)
    except (OSError, RuntimeError) as e:
        return type(e).__name__
    return None


def test_hf_load_and_export_under_expert_parallelism(pool4, tmp_path):
    """Every tensor transformers reads back from the export equals the original checkpoint's
    (load and export move bytes, so bit for bit), at EP 4 and EP 2 beside TP and PP."""
    import transformers

    folder = moe_checkpoint(tmp_path / "moe")
    errors = pool4.run(check_hf_round_trip, str(folder), str(tmp_path / "out"), HF_LAYOUTS)
    assert errors == ["FileExistsError"] + ["RuntimeError"] * 3, errors
    want = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).state_dict()
    for i in range(len(HF_LAYOUTS)):
        for out in (str(i), f"gathered{i}"):
            got = transformers.AutoModelForCausalLM.from_pretrained(
                str(tmp_path / "out" / out)).state_dict()
            assert got.keys() == want.keys()
            for k, v in want.items():
                assert torch.equal(got[k], v), (HF_LAYOUTS[i], out, k)


def check_sharded_checkpoint(rank, world, folder, full):
    """Save after a train step at (1,2,2) ep 2, generation tp 2 (down_proj stored as 2 pieces,
    each expert held by 2 expert-DP replicas); load at (1,1,4) ep 4 and at (1,2,2) without
    ep.  Rank 0 compares the gathered weights and Adam moments, bit for bit."""
    from engine.hf_interop import gather_full_state_dict
    from rlhf.workers.common import ShardCheckpoint

    def state(model, eng):
        moments = {n: eng.optimizer.state[p]["exp_avg"] for n, p in eng.train_params.items()}
        return gather_full_state_dict(model), gather_full_state_dict(model, moments)

    model, eng = build_engine(1, 2, 2, 2, gen_tp=2)
    assert all(p.dim() == 3 for n, p in model.params.items()
               if ".experts." in n and n.endswith("down_proj"))  # stored as 2 pieces
    load_full_state_dict(model, full)
    d, per = model.coords.dp, ep_ref.N_MICRO // 2
    eng.train_step(ep_ref.make_micro_batches()[d * per:(d + 1) * per], ep_ref.policy_loss,
                   temperature=1.0)
    ckpt = ShardCheckpoint(model, eng)
    ckpt.start_save(folder)
    ckpt.finish_save()
    want, equal = state(model, eng), []
    for layout in ((1, 1, 4, 4), (1, 2, 2, 1)):
        other, other_eng = build_engine(*layout)
        ShardCheckpoint(other, other_eng).load(folder)
        got = state(other, other_eng)
        if rank == 0:
            equal += [(layout, kind, n, torch.equal(got[kind][n], t))
                      for kind in (0, 1) for n, t in want[kind].items()]
    return equal


def check_bad_checkpoint_fails_everywhere(rank, world, folder):
    from engine.hf_interop import load_hf_checkpoint, read_hf_config

    cfg = read_hf_config(folder)
    hl = HybridLayout(ParallelLayout(1, 1, 4), 1, 1)
    experts = build_expert_groups(ExpertLayout(hl, cfg.num_experts, ep=4), pool=list(range(4)))
    model = ParallelLlama(cfg, build_hybrid_groups(hl, pool=list(range(4))), experts=experts)
    try:
        load_hf_checkpoint(model, folder)
    except KeyError as e:
        return str(e)
    return None


def test_sharded_checkpoint_of_stacked_experts_moves_between_layouts(pool4, tmp_path):
    full = init_full_state_dict(MOE, seed=8)
    results = pool4.run(check_sharded_checkpoint, str(tmp_path / "ckpt"), full)
    checked = results[0]
    assert len(checked) == 2 * 2 * len(full) and any(".experts." in c[2] for c in checked)
    assert all(c[3] for c in checked), [c[:3] for c in checked if not c[3]][:5]


def test_checkpoint_missing_an_expert_fails_on_every_rank(pool4, tmp_path):
    """One expert's tensor gone: every rank raises (not only the one that trains it), before
    any collective."""
    from safetensors.torch import load_file, save_file

    folder = moe_checkpoint(tmp_path / "moe")
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    gone = "model.layers.1.mlp.experts.3.down_proj.weight"
    del tensors[gone]
    save_file(tensors, str(path), metadata={"format": "pt"})
    msgs = pool4.run(check_bad_checkpoint_fails_everywhere, str(folder))
    assert all(m is not None and gone in m for m in msgs), msgs


def check_rollout_with_other_experts_refused(rank, world):
    from engine.generation import GenerationEngine

    hl = HybridLayout(ParallelLayout(1, 2, 2), 1, 2)
    experts = build_expert_groups(ExpertLayout(hl, E, ep=4, gen_ep=2), pool=list(range(4)))
    groups = build_hybrid_groups(hl, pool=list(range(4)))
    model = ParallelLlama(MOE, groups, experts=experts)
    try:
        HybridEngine(model, OptimConfig(), rollout=GenerationEngine(MOE, groups))
    except ValueError as exc:
        return str(exc), model.generation_experts
    return None, model.generation_experts


def test_a_rollout_computing_other_experts_is_refused_before_any_collective(pool4):
    """Generation EP: a rollout built for every expert (``experts=None``) beside a layout
    that gives each rank half of them fails on every rank at construction."""
    for msg, mine in pool4.run(check_rollout_with_other_experts_refused):
        assert msg.startswith(f"HybridEngine: the rollout computes experts None, the generation "
                              f"layout gives this rank {mine}"), msg
        assert len(mine) == E // 2
