"""Every estimator, loss and KL estimator against a reference written here with python loops
over rows and tokens (no shared vectorised code), on random masked inputs, several seeds."""

import dataclasses
import math
import statistics

import pytest
import torch

from rlhf import algos
from rlhf.config import PolicyLossConfig

SEEDS = [0, 1, 2]
B, T = 6, 7
BOUNDS = {"log_ratio_clamp": 20.0, "k3_clamp": 10.0}        # the defaults of rlhf.config


def _kl_term(estimator: str) -> algos.KLLossTerm:
    return algos.KLLossTerm(coef=0.1, estimator=estimator, **BOUNDS)


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T, dtype=torch.bool)
    for b in range(B):
        length = int(torch.randint(1, T + 1, (1,), generator=g))
        mask[b, length:] = False                      # right padding
    mask[1, 1] = False                                 # a hole inside a response
    mask[B - 1, :] = False                             # an empty response
    rnd = lambda: torch.randn(B, T, generator=g, dtype=torch.float64)  # noqa: E731
    return g, mask, rnd


def _valid(mask, b):
    return [t for t in range(mask.shape[1]) if mask[b, t]]


def _ref_whiten(x, mask):
    vals = [x[b][t] for b in range(len(x)) for t in _valid(mask, b)]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return [[(x[b][t] - mean) / math.sqrt(var + 1e-8) if mask[b, t] else 0.0
             for t in range(mask.shape[1])] for b in range(len(x))]


def _close(actual: torch.Tensor, expected, tol=1e-9):
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64),
                               atol=tol, rtol=tol)


# Advantage estimators ------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("whiten", [False, True])
def test_gae(seed, whiten):
    _, mask, rnd = _inputs(seed)
    r, v = rnd(), rnd()
    gamma, lam = 0.9, 0.8
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        idx = _valid(mask, b)
        a_next = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            v_next = float(v[b, idx[k + 1]]) if k + 1 < len(idx) else 0.0
            delta = float(r[b, t]) + gamma * v_next - float(v[b, t])
            a_next = delta + gamma * lam * a_next
            adv[b][t] = a_next
            ret[b][t] = a_next + float(v[b, t])
    expected_adv = _ref_whiten(adv, mask) if whiten else adv
    a, R = algos.gae(r, v, mask, gamma, lam, whiten=whiten)
    _close(a, expected_adv, 1e-7)
    _close(R, ret)


@pytest.mark.parametrize("seed", SEEDS)
def test_remax(seed):
    g, mask, rnd = _inputs(seed)
    r = rnd()
    base = torch.randn(B, generator=g, dtype=torch.float64)
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in _valid(mask, b):
            ret[b][t] = sum(float(r[b, u]) for u in _valid(mask, b) if u >= t)
            adv[b][t] = ret[b][t] - float(base[b])
    a, R = algos.remax(r, base, mask)
    _close(a, adv)
    _close(R, ret)


def _groups(seed):
    # groups of unequal size, including a group of one, not contiguous
    return ["a", "b", "a", "c", "b", "a"] if seed % 2 == 0 else [3, 3, 1, 1, 1, 7]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo(seed, norm_by_std):
    _, mask, rnd = _inputs(seed)
    r = rnd()
    uid = _groups(seed)
    score = [sum(float(r[b, t]) for t in _valid(mask, b)) for b in range(B)]
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        members = [score[j] for j in range(B) if uid[j] == uid[b]]
        if len(members) == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = statistics.mean(members), statistics.stdev(members)
        a = (score[b] - mean) / (std + 1e-6) if norm_by_std else score[b] - mean
        for t in _valid(mask, b):
            adv[b][t] = a
    a, R = algos.grpo(r, mask, uid, norm_by_std=norm_by_std)
    _close(a, adv, 1e-7)
    _close(R, adv, 1e-7)


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo(seed):
    _, mask, rnd = _inputs(seed)
    r = rnd()
    uid = torch.tensor([0, 1, 0, 2, 1, 0]) if seed % 2 else _groups(seed)
    ids = uid.tolist() if isinstance(uid, torch.Tensor) else uid
    score = [sum(float(r[b, t]) for t in _valid(mask, b)) for b in range(B)]
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        others = [score[j] for j in range(B) if ids[j] == ids[b] and j != b]
        a = score[b] - sum(others) / len(others) if others else score[b]
        for t in _valid(mask, b):
            adv[b][t] = a
    a, _ = algos.rloo(r, mask, uid)
    _close(a, adv)


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_pp(seed):
    _, mask, rnd = _inputs(seed)
    r = rnd()
    gamma = 0.95
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in _valid(mask, b):
            later = [u for u in _valid(mask, b) if u >= t]
            ret[b][t] = sum(gamma ** k * float(r[b, u]) for k, u in enumerate(later))
    a, R = algos.reinforce_pp(r, mask, gamma)
    _close(R, ret)
    _close(a, _ref_whiten(ret, mask), 1e-7)


# Losses -------------------------------------------------------------------------------------
def _ref_agg(loss, mask, mode):
    """The aggregation modes from their formulas: token-mean / token-sum over every valid token;
    seq-mean-* = mean over the non-empty rows of a per-row quantity."""
    rows, width = mask.shape
    vals = [loss[b][t] for b in range(rows) for t in _valid(mask, b)]
    if mode == "token-mean":
        return sum(vals) / len(vals)
    if mode == "token-sum":
        return sum(vals)
    per_seq = []
    for b in range(rows):
        v = [loss[b][t] for t in _valid(mask, b)]
        if not v:
            continue                                   # an empty row is not a sequence
        per_seq.append({"seq-mean-token-sum": sum(v), "seq-mean-token-mean": sum(v) / len(v),
                        "seq-mean-token-sum-norm": sum(v) / width}[mode])
    return sum(per_seq) / len(per_seq)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_agg_loss(seed, mode):
    _, mask, rnd = _inputs(seed)
    x = rnd()
    got = algos.agg_loss(x, mask, mode)
    assert math.isclose(float(got), _ref_agg(x.tolist(), mask, mode), rel_tol=1e-12, abs_tol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
@pytest.mark.parametrize("clip", [(0.2, None, None, None), (0.2, 0.2, 0.28, None),
                                  (0.2, None, None, 3.0)])
def test_policy_loss(seed, mode, clip):
    g, mask, rnd = _inputs(seed)
    eps, lo, hi, c = clip
    old = rnd() * 0.3 - 1.0
    logp = (old + rnd() * 1.5).requires_grad_(True)
    A = rnd()
    eps_lo = eps if lo is None else lo
    eps_hi = eps if hi is None else hi
    per_tok = [[None] * T for _ in range(B)]
    n_clip = n_lower = n = 0
    kl = 0.0
    for b in range(B):
        for t in _valid(mask, b):
            ratio = torch.exp(logp[b, t] - old[b, t])          # scalar autograd graph per token
            a = float(A[b, t])
            l1 = -a * ratio
            l2 = -a * torch.clamp(ratio, 1 - eps_lo, 1 + eps_hi)
            f1, f2 = float(l1.detach()), float(l2.detach())
            l = l1 if f1 >= f2 else l2
            n_clip += f2 > f1
            if c is not None and a < 0 and max(f1, f2) > -a * c:
                l = torch.tensor(-a * c, dtype=torch.float64)
                n_lower += 1
            per_tok[b][t] = l
            kl += float(old[b, t] - logp[b, t].detach())
            n += 1
    for b in range(B):
        for t in range(T):
            if per_tok[b][t] is None:
                per_tok[b][t] = torch.tensor(0.0, dtype=torch.float64)
    ref = _ref_agg(per_tok, mask, mode)
    ref.backward()
    ref_grad = logp.grad.clone()
    logp.grad = None
    loss, m = algos.policy_loss(logp, old, A, mask, clip_ratio=eps, clip_ratio_low=lo,
                                clip_ratio_high=hi, clip_ratio_c=c, loss_agg_mode=mode)
    loss.backward()
    assert math.isclose(float(loss.detach()), float(ref.detach()), rel_tol=1e-10, abs_tol=1e-12)
    torch.testing.assert_close(logp.grad, ref_grad, atol=1e-12, rtol=1e-10)
    assert math.isclose(float(m["clipfrac"]), n_clip / n, abs_tol=1e-12)
    assert math.isclose(float(m["clipfrac_lower"]), n_lower / n, abs_tol=1e-12)
    assert math.isclose(float(m["approx_kl"]), kl / n, rel_tol=1e-10, abs_tol=1e-12)
    if c is not None:
        assert n_lower > 0  # the dual clip was exercised


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip_range", [0.2, None])
def test_value_loss(seed, clip_range):
    _, mask, rnd = _inputs(seed)
    old, ret = rnd(), rnd()
    vals = old + rnd() * 0.5
    per_tok = [[0.0] * T for _ in range(B)]
    n_clip = n = 0
    for b in range(B):
        for t in _valid(mask, b):
            v, o, R = float(vals[b, t]), float(old[b, t]), float(ret[b, t])
            l1 = (v - R) ** 2
            if clip_range is None:
                per_tok[b][t] = l1
            else:
                vc = o + min(max(v - o, -clip_range), clip_range)
                l2 = (vc - R) ** 2
                per_tok[b][t] = max(l1, l2)
                n_clip += l2 > l1
            n += 1
    loss, m = algos.value_loss(vals, old, ret, mask, clip_range, "token-mean")
    assert math.isclose(float(loss), 0.5 * _ref_agg(per_tok, mask, "token-mean"), rel_tol=1e-10)
    assert math.isclose(float(m["vf_clipfrac"]), n_clip / n, abs_tol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_entropy(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 4, 5, generator=g, dtype=torch.float64) * 2
    h = algos.entropy_from_logits(logits)
    for i in range(3):
        for j in range(4):
            z = [float(x) for x in logits[i, j]]
            zs = sum(math.exp(x) for x in z)
            p = [math.exp(x) / zs for x in z]
            assert math.isclose(float(h[i, j]), -sum(q * math.log(q) for q in p), rel_tol=1e-10)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    loss, m = algos.entropy_loss(h, mask, coeff=0.01, loss_agg_mode="token-mean")
    mean = sum(float(h[i, j]) for i in range(3) for j in range(4) if mask[i, j]) / 6
    assert math.isclose(float(m["entropy"]), mean, rel_tol=1e-12)
    assert math.isclose(float(loss), -0.01 * mean, rel_tol=1e-12)


# KL ----------------------------------------------------------------------------------------
def _ref_k(x, est, log_ratio_clamp=20.0, k3_clamp=10.0):
    """Schulman's estimators with the documented bounds: |x| <= 20, |k3| <= 10."""
    x = min(max(x, -log_ratio_clamp), log_ratio_clamp)
    k3 = min(max(math.exp(-x) - 1 + x, -k3_clamp), k3_clamp)
    return {"k1": x, "k2": 0.5 * x * x, "k3": k3}[est]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("est", algos.KL_ESTIMATORS)
def test_kl_estimators_and_penalty(seed, est):
    g, mask, rnd = _inputs(seed)
    logp, ref = rnd() - 1, rnd() - 1
    k = algos.kl_estimate(logp, ref, est, **BOUNDS)
    for b in range(B):
        for t in range(T):
            assert math.isclose(float(k[b, t]), _ref_k(float(logp[b, t] - ref[b, t]), est),
                                rel_tol=1e-10, abs_tol=1e-12)
    scores = torch.randn(B, generator=g, dtype=torch.float64)
    tok_scores = algos.scores_to_token_rewards(scores, mask)
    beta = 0.05
    rewards, m = algos.kl_penalty_rewards(tok_scores, logp, ref, mask, beta, est, **BOUNDS)
    expected = [[0.0] * T for _ in range(B)]
    seq_kl = []
    for b in range(B):
        idx = _valid(mask, b)
        ks = [_ref_k(float(logp[b, t] - ref[b, t]), est) for t in idx]
        for t, kv in zip(idx, ks):
            expected[b][t] = (float(scores[b]) if t == idx[-1] else 0.0) - beta * kv
        seq_kl.append(sum(ks) / len(ks) if ks else 0.0)
    _close(rewards, expected)
    assert math.isclose(float(m["kl"]), sum(seq_kl) / B, rel_tol=1e-10, abs_tol=1e-12)
    loss, _ = algos.kl_loss(logp, ref, mask, est, "seq-mean-token-mean", **BOUNDS)
    ref_mat = [[_ref_k(float(logp[b, t] - ref[b, t]), est) for t in range(T)] for b in range(B)]
    assert math.isclose(float(loss), _ref_agg(ref_mat, mask, "seq-mean-token-mean"), rel_tol=1e-10)


def test_k3_is_nonnegative_and_unbiased():
    # E_{a ~ p}[k1] = E[k3] = KL(p || q) on a small categorical; k3 >= 0 pointwise
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    kl = sum(float(p[i] * math.log(p[i] / q[i])) for i in range(3))
    for est in ("k1", "k3"):
        k = algos.kl_estimate(p.log(), q.log(), est, **BOUNDS)
        assert math.isclose(float((p * k).sum()), kl, rel_tol=1e-12)
    assert (algos.kl_estimate(p.log(), q.log(), "k3", **BOUNDS) >= 0).all()


def test_kl_controllers():
    ctl = algos.make_kl_controller("adaptive", 0.1, target_kl=1.0, horizon=100.0)
    beta = 0.1
    for kl in [0.5, 1.1, 3.0, 0.0]:
        err = min(max(kl / 1.0 - 1, -0.2), 0.2)
        beta = beta * (1 + err * 10 / 100.0)
        assert math.isclose(ctl.update(kl, 10), beta, rel_tol=1e-12)
    state = ctl.state_dict()
    other = algos.make_kl_controller("adaptive", 0.5, target_kl=2.0, horizon=1.0)
    other.load_state_dict(state)
    assert other.value == ctl.value and other.target == 1.0
    fixed = algos.make_kl_controller("fixed", 0.2, target_kl=1.0, horizon=100.0)
    assert fixed.update(100.0, 10) == 0.2
    with pytest.raises(ValueError, match="kind='pid'"):
        algos.make_kl_controller("pid", 0.1, target_kl=1.0, horizon=100.0)
    with pytest.raises(ValueError, match="'k4'"):
        algos.kl_estimate(torch.zeros(1), torch.zeros(1), "k4", **BOUNDS)


# Safe-RLHF ---------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_safe_rlhf(seed):
    _, mask, rnd = _inputs(seed)
    r, v, c, cv = rnd(), rnd(), rnd().abs(), rnd()
    lag = algos.LagrangeMultiplier(init=0.5, lr=0.2, cost_limit=0.3, max_value=2.0)
    value = 0.5
    for mean_cost in [1.0, 0.0, 0.0, 0.0, 5.0, 20.0]:
        value = min(max(0.0, value + 0.2 * (mean_cost - 0.3)), 2.0)
        assert math.isclose(lag.update(mean_cost), value, rel_tol=1e-12)
    lag.value = 0.7
    out = algos.safe_rlhf_advantages(r, v, c, cv, mask, lag.value, gamma=1.0, lam=0.9,
                                     whiten=True)
    a_r, _ = algos.gae(r, v, mask, 1.0, 0.9, True)
    a_c, _ = algos.gae(c, cv, mask, 1.0, 0.9, True)
    for b in range(B):
        for t in range(T):
            want = (float(a_r[b, t]) - 0.7 * float(a_c[b, t])) / 1.7
            assert math.isclose(float(out["advantages"][b, t]), want, rel_tol=1e-10, abs_tol=1e-12)


# Registered estimators --------------------------------------------------------------------
def _iteration(algo: str, lagrange: float = 0.0):
    from engine.sampling import SamplingParams
    from rlhf.config import AlgoConfig
    from rlhf.metrics import PhaseTimer
    from rlhf.programs import Iteration

    sp = SamplingParams(max_new_tokens=4, temperature=1.0)
    return Iteration(algo=AlgoConfig(name=algo, gamma=1.0, lam=0.95, whiten_advantages=True),
                     sampling=sp, greedy=sp, timer=PhaseTimer(),
                     kl_ctrl=algos.FixedKLController(0.0),
                     lagrange=algos.LagrangeMultiplier(lagrange, 0.1, 0.0), mini_batch_size=8,
                     more_prompts=None)


def test_registered_advantage_estimators():
    from rlhf.controller import Batch
    from rlhf.programs import ALGORITHMS, algorithm

    _, mask, rnd = _inputs(0)
    r, v = rnd(), rnd()
    batch = Batch(tensors={"token_level_rewards": r, "response_mask": mask, "values": v,
                           "reward_baselines": torch.zeros(B, dtype=torch.float64),
                           "token_level_costs": r, "cost_values": v},
                  non_tensors={"uid": _groups(0)})
    direct = {"ppo": algos.gae(r, v, mask, 1.0, 0.95, True)[0],
              "remax": algos.remax(r, torch.zeros(B, dtype=torch.float64), mask)[0],
              "grpo": algos.grpo(r, mask, _groups(0), True)[0],
              "rloo": algos.rloo(r, mask, _groups(0))[0],
              "reinforce_pp": algos.reinforce_pp(r, mask, 1.0)[0],
              "safe_rlhf": algos.gae(r, v, mask, 1.0, 0.95, True)[0],   # lagrange 0: reward only
              "dr_grpo": algos.grpo(r, mask, _groups(0), False)[0],
              "opo": algos.opo(r, mask, _groups(0))[0],
              "reinforce_pp_baseline": algos.reinforce_pp_baseline(r, mask, _groups(0))[0]}
    # GRPO's estimator under another policy loss, and DAPO (GRPO's after the group filter)
    for name in ("dapo", "gspo", "cispo", "clip_cov", "kl_cov", "gmpo", "sapo", "gpg"):
        direct[name] = direct["grpo"]
    # pass@k: 0/1 scores, groups of 3 and k = 2
    pairs = ["a", "b", "a", "b", "b", "a"]
    binary = algos.scores_to_token_rewards(torch.tensor([1., 0, 0, 1, 0, 1], dtype=r.dtype),
                                           mask)
    passk = algos.grpo_passk(binary, mask, pairs, 2)[0]
    assert set(direct) | {"grpo_passk"} == set(ALGORITHMS)
    for name, want in direct.items():
        got = algorithm(name).advantage(batch, _iteration(name))["advantages"]
        torch.testing.assert_close(got, want)
    it = _iteration("grpo_passk")
    it = dataclasses.replace(it, algo=dataclasses.replace(it.algo, pass_k=2))
    got = algorithm("grpo_passk").advantage(
        Batch(tensors={"token_level_rewards": binary, "response_mask": mask},
              non_tensors={"uid": pairs}), it)["advantages"]
    assert got.abs().sum() > 0
    torch.testing.assert_close(got, passk)
    with pytest.raises(ValueError, match="algo='ppo' needs batch field 'values'"):
        algorithm("ppo").advantage({"token_level_rewards": r, "response_mask": mask},
                                   _iteration("ppo"))
    with pytest.raises(ValueError, match=r"shape \(6, 6\)"):
        algos.gae(r[:, :6], v[:, :6], mask, 1.0, 0.9, True)


@pytest.mark.parametrize("seed", SEEDS)
def test_actor_loss_is_the_sum_of_its_terms(seed):
    g, mask, rnd = _inputs(seed)
    old, ref, A = rnd() - 1, rnd() - 1, rnd()
    logp = old + 0.3 * rnd()
    logits = torch.randn(B, T, 5, generator=g, dtype=torch.float64)
    H = algos.entropy_from_logits(logits)
    cfg = PolicyLossConfig(loss_agg_mode="seq-mean-token-sum", clip_ratio=0.2,
                           clip_ratio_high=0.3, clip_ratio_c=None, entropy_coeff=0.01)
    loss, m = algos.actor_loss(logp, old, A, mask, pg_loss=algos.get_policy_loss("ppo"), cfg=cfg,
                               ref_log_prob=ref, kl=_kl_term("k2"), entropy=H)
    # each term from the loop references above
    pg = _ref_agg([[max(-float(A[b, t]) * math.exp(float(logp[b, t] - old[b, t])),
                        -float(A[b, t]) * min(max(math.exp(float(logp[b, t] - old[b, t])), 0.8),
                                              1.3)) for t in range(T)] for b in range(B)],
                  mask, "seq-mean-token-sum")
    kl = _ref_agg([[_ref_k(float(logp[b, t] - ref[b, t]), "k2") for t in range(T)]
                   for b in range(B)], mask, "seq-mean-token-sum")
    ent = _ref_agg(H.tolist(), mask, "seq-mean-token-sum")
    assert math.isclose(float(loss), pg + 0.1 * kl - 0.01 * ent, rel_tol=1e-10, abs_tol=1e-12)
    assert {"pg_loss", "clipfrac", "approx_kl", "kl_loss", "entropy"} <= set(m)
    plain, m2 = algos.actor_loss(logp, old, A, mask, pg_loss=algos.get_policy_loss("ppo"),
                                 cfg=cfg)
    assert math.isclose(float(plain), pg, rel_tol=1e-10) and "kl_loss" not in m2


def test_actor_loss_kl_term_settings():
    from rlhf.config import AlgoConfig

    _, mask, rnd = _inputs(0)
    x = rnd()
    cfg = PolicyLossConfig()
    ppo = algos.get_policy_loss("ppo")
    with pytest.raises(ValueError, match="ref_log_prob None"):
        algos.actor_loss(x, x, x, mask, pg_loss=ppo, cfg=cfg, kl=_kl_term("k1"))
    with pytest.raises(ValueError, match="kl=None"):
        algos.actor_loss(x, x, x, mask, pg_loss=ppo, cfg=cfg, ref_log_prob=x)
    for bad, match in [({"coef": -0.1}, "coef=-0.1"), ({"estimator": "k9"}, "'k9'"),
                       ({"k3_clamp": 0.0}, "k3_clamp=0.0")]:
        with pytest.raises(ValueError, match=match):
            algos.KLLossTerm(**{"coef": 0.1, "estimator": "k1", **BOUNDS, **bad})
    assert algos.KLLossTerm.of(AlgoConfig(kl_mode="reward")) is None
    term = algos.KLLossTerm.of(AlgoConfig(kl_mode="loss", kl_coef=0.3, kl_estimator="k2",
                                          kl_log_ratio_clamp=7.0, kl_k3_clamp=4.0))
    assert term == algos.KLLossTerm(coef=0.3, estimator="k2", log_ratio_clamp=7.0, k3_clamp=4.0)


# Group statistics in float32 -------------------------------------------------------------
def _ref_grpo(scores, norm_by_std, eps=1e-6):
    """GRPO from its formula, float64 python loop: (s - mean_g) / (std_g + eps)."""
    out = []
    for i, s in enumerate(scores):
        members = [float(v) for v in scores]          # one group
        mean = statistics.mean(members)
        std = statistics.stdev(members)
        out.append((float(s) - mean) / (std + eps) if norm_by_std else float(s) - mean)
    return out


def test_grpo_group_std_survives_a_large_offset_in_float32():
    s = torch.tensor([100.00, 100.01, 100.02, 100.03], dtype=torch.float32)
    got = algos.grpo_scores(s, [0, 0, 0, 0], norm_by_std=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor([-1.162, -0.387, 0.387, 1.162]),
                               atol=1e-3, rtol=0)
    g = torch.Generator().manual_seed(0)
    for offset in (5.0, 100.0, 1000.0):
        for spread in (0.01, 0.1):
            for n in (2, 4, 8):
                for _ in range(20):
                    s = (offset + spread * torch.randn(n, generator=g)).float()
                    # the answer in float64 of the same float32 scores
                    for norm in (True, False):
                        got = algos.grpo_scores(s, [7] * n, norm_by_std=norm)
                        torch.testing.assert_close(got.double(), torch.tensor(
                            _ref_grpo(s.tolist(), norm), dtype=torch.float64),
                            atol=1e-3, rtol=0)


def test_identical_scores_give_exactly_zero_advantage():
    g = torch.Generator().manual_seed(0)
    scores, uid = [], []
    for k in range(600):
        n = int(torch.randint(3, 9, (1,), generator=g))
        value = float(torch.randn(1, generator=g) * 10 ** float(torch.randint(-3, 4, (1,),
                                                                          generator=g)))
        scores += [value] * n
        uid += [f"p{k}"] * n
    s = torch.tensor(scores, dtype=torch.float32)
    zero = torch.zeros_like(s)
    for norm in (True, False):
        assert torch.equal(algos.grpo_scores(s, uid, norm_by_std=norm), zero)
    assert torch.equal(algos.rloo_scores(s, uid), zero)
    # through the token-level estimators: the score on the last token of each response
    mask = torch.ones(len(scores), 3, dtype=torch.bool)
    rewards = algos.scores_to_token_rewards(s, mask)
    for adv in (algos.grpo(rewards, mask, uid, True)[0], algos.grpo(rewards, mask, uid, False)[0],
                algos.rloo(rewards, mask, uid)[0]):
        assert torch.equal(adv, torch.zeros_like(adv))


# Garbage at masked positions -------------------------------------------------------------
def _garbage(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with NaN, +inf, -inf cycling over the positions where ``mask`` is 0."""
    out = x.detach().clone()
    off = ~mask.bool()
    bad = torch.tensor([math.nan, math.inf, -math.inf], dtype=x.dtype)
    out[off] = bad[torch.arange(int(off.sum())) % 3]
    return out


def _same(clean, dirty):
    """Equal nested results (tensors or dicts of tensors), all finite."""
    if isinstance(clean, dict):
        assert clean.keys() == dirty.keys()
        for k in clean:
            _same(clean[k], dirty[k])
        return
    if isinstance(clean, (tuple, list)):
        for a, b in zip(clean, dirty):
            _same(a, b)
        return
    assert torch.isfinite(dirty).all(), dirty
    assert torch.equal(clean, dirty), (clean, dirty)


@pytest.mark.parametrize("seed", SEEDS)
def test_garbage_at_masked_positions_changes_nothing(seed):
    g, mask, rnd = _inputs(seed)
    r, v, c, cv, old, ref, A, H = (rnd() for _ in range(8))
    lp_clean = rnd() * 0.5 - 1
    bad = {k: _garbage(t, mask) for k, t in dict(r=r, v=v, c=c, cv=cv, old=old, ref=ref, A=A,
                                                   H=H, lp=lp_clean).items()}
    clean = dict(r=r, v=v, c=c, cv=cv, old=old, ref=ref, A=A, H=H, lp=lp_clean)
    uid = _groups(seed)
    base = torch.randn(B, generator=g, dtype=torch.float64)
    estimators = {
        "masked_sum": lambda x: (algos.masked_sum(x["r"], mask),
                                 algos.masked_sum(x["r"], mask, -1)),
        "masked_mean": lambda x: (algos.masked_mean(x["r"], mask),
                                  algos.masked_mean(x["r"], mask, -1)),
        "masked_var": lambda x: algos.masked_var(x["r"], mask),
        "masked_whiten": lambda x: algos.masked_whiten(x["r"], mask),
        "gae": lambda x: algos.gae(x["r"], x["v"], mask, 0.9, 0.8, True),
        "remax": lambda x: algos.remax(x["r"], base, mask),
        "grpo": lambda x: algos.grpo(x["r"], mask, uid, True),
        "dr_grpo": lambda x: algos.grpo(x["r"], mask, uid, False),
        "rloo": lambda x: algos.rloo(x["r"], mask, uid),
        "reinforce_pp": lambda x: algos.reinforce_pp(x["r"], mask, 0.95),
        "safe_rlhf": lambda x: algos.safe_rlhf_advantages(x["r"], x["v"], x["c"], x["cv"], mask,
                                                          0.5, gamma=1.0, lam=0.9, whiten=True),
        "kl_penalty": lambda x: algos.kl_penalty_rewards(x["r"], x["lp"], x["ref"], mask, 0.1,
                                                         "k3", **BOUNDS),
    }
    for name, f in estimators.items():
        _same(f(clean), f(bad))
    empty_score = torch.tensor([1.0, 2, 3, 4, 5, math.nan], dtype=torch.float64)  # row 5: empty
    _same(algos.scores_to_token_rewards(empty_score.nan_to_num(0.0), mask),
          algos.scores_to_token_rewards(empty_score, mask))

    def losses(x, mode):
        lp = x["lp"].clone().requires_grad_(True)
        vals = x["v"].clone().requires_grad_(True)
        out = {
            "policy": algos.policy_loss(lp, x["old"], x["A"], mask, clip_ratio=0.2,
                                        clip_ratio_low=None, clip_ratio_high=0.28,
                                        clip_ratio_c=3.0, loss_agg_mode=mode),
            "value": algos.value_loss(vals, x["old"], x["r"], mask, 0.2, mode),
            "entropy": algos.entropy_loss(x["H"], mask, 0.01, mode),
            **{f"kl_{e}": algos.kl_loss(lp, x["ref"], mask, e, mode, **BOUNDS)
               for e in algos.KL_ESTIMATORS},
            "actor": algos.actor_loss(lp, x["old"], x["A"], mask,
                                      pg_loss=algos.get_policy_loss("ppo"),
                                      cfg=PolicyLossConfig(loss_agg_mode=mode, entropy_coeff=0.01,
                                                           clip_ratio_c=None),
                                      ref_log_prob=x["ref"], kl=_kl_term("k3"),
                                      entropy=x["H"]),
            "agg": (algos.agg_loss(lp, mask, mode), {}),
        }
        total = sum(loss for loss, _ in out.values())
        total.backward()
        return ({k: (loss.detach(), m) for k, (loss, m) in out.items()}, lp.grad, vals.grad)

    for mode in algos.LOSS_AGG_MODES:
        _same(losses(clean, mode), losses(bad, mode))


# KL bounds ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kl_estimators_are_bounded_with_finite_gradients(dtype):
    x = torch.tensor([-1000.0, -40.0, -20.5, -3.0, -2.0, -0.5, 0.0, 0.5, 3.0, 20.5, 40.0,
                      1000.0], dtype=dtype)
    for est in algos.KL_ESTIMATORS:
        lp = x.clone().requires_grad_(True)
        k = algos.kl_estimate(lp, torch.zeros_like(x), est, **BOUNDS)
        k.sum().backward()
        k = k.detach()
        assert torch.isfinite(k).all() and torch.isfinite(lp.grad).all()
        for i, xi in enumerate(x.tolist()):
            assert math.isclose(float(k[i]), _ref_k(xi, est), rel_tol=1e-6, abs_tol=1e-6)
            # d/dx of the formula where no bound is active, 0 where one is
            xc = min(max(xi, -20.0), 20.0)
            raw3 = math.exp(-xc) - 1 + xc
            active = abs(xi) > 20 or (est == "k3" and abs(raw3) > 10)
            want = 0.0 if active else {"k1": 1.0, "k2": xi, "k3": 1 - math.exp(-xi)}[est]
            assert math.isclose(float(lp.grad[i]), want, rel_tol=1e-5, abs_tol=1e-6), (est, xi)
    k3 = algos.kl_estimate(x, torch.zeros_like(x), "k3", **BOUNDS)
    assert float(k3.max()) == 10.0 and float(k3.min()) >= 0.0
    assert float(algos.kl_estimate(x, torch.zeros_like(x), "k1", **BOUNDS).abs().max()) == 20.0
    # other bounds are honoured, and a non-positive one is refused
    tight = algos.kl_estimate(x, torch.zeros_like(x), "k3", log_ratio_clamp=1.0, k3_clamp=0.5)
    assert float(tight.max()) == 0.5
    with pytest.raises(ValueError, match="k3_clamp=0"):
        algos.kl_estimate(x, x, "k3", log_ratio_clamp=1.0, k3_clamp=0)


def test_kl_loss_of_one_wild_token_stays_bounded():
    mask = torch.ones(2, 3, dtype=torch.bool)
    lp = torch.full((2, 3), -1.0, requires_grad=True)
    ref = torch.full((2, 3), -1.0)
    ref[0, 1] = 35.0                                    # log-ratio -36: raw k3 ~ 4e15
    loss, m = algos.kl_loss(lp, ref, mask, "k3", "token-mean", **BOUNDS)
    loss.backward()
    assert math.isclose(float(loss.detach()), 10.0 / 6, rel_tol=1e-6)
    assert torch.isfinite(lp.grad).all() and float(lp.grad[0, 1]) == 0.0


def test_kl_bounds_are_config_fields():
    from rlhf.config import AlgoConfig

    a = AlgoConfig()
    assert (a.kl_log_ratio_clamp, a.kl_k3_clamp) == (20.0, 10.0)
    assert BOUNDS == {"log_ratio_clamp": a.kl_log_ratio_clamp, "k3_clamp": a.kl_k3_clamp}
    with pytest.raises(ValueError, match="kl_k3_clamp=0"):
        AlgoConfig(kl_k3_clamp=0.0)
    with pytest.raises(ValueError, match="kl_log_ratio_clamp=-1"):
        AlgoConfig(kl_log_ratio_clamp=-1.0)


def test_docs_list_every_algorithm_and_default():
    import dataclasses
    import pathlib

    from rlhf.config import AlgoConfig, PolicyLossConfig, ValueLossConfig
    from rlhf.programs import ALGORITHMS

    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "algorithms.md").read_text()
    for name in ALGORITHMS:
        assert f"\n| `{name}` |" in doc, f"docs/algorithms.md has no row for {name}"
    def as_yaml(v) -> str:
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    for section, cls in (("algo", AlgoConfig), ("actor.loss", PolicyLossConfig),
                         ("critic.loss", ValueLossConfig)):
        for f in dataclasses.fields(cls):
            row = f"| `{section}.{f.name}` | `{as_yaml(f.default)}` |"
            assert row in doc, f"docs/algorithms.md: expected the row {row!r}"
