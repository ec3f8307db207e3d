"""REINFORCE++-baseline, Dr. GRPO, OPO and pass@k against references written here from the papers'
formulas as float64 python loops over rows and tokens (no shared vectorised code): uneven,
shuffled groups with string uids, right padding, a hole inside a response, an empty response,
garbage at masked positions, float32 scores with a large offset, identical-score groups, and
pass@k against a brute-force enumeration of all k-subsets."""

import itertools
import math
import statistics

import pytest
import torch

from rlhf.algos.advantages import dr_grpo, grpo_passk, opo, reinforce_pp_baseline

SEEDS = [0, 1, 2, 3]
T = 7


# Inputs -------------------------------------------------------------------------------------
def _batch(seed: int, sizes=range(2, 9), n_groups: int = 6):
    """Mask ``[B, T]`` and shuffled string uids for groups of random sizes drawn from ``sizes``:
    random right padding, a hole inside row 0's response and an all-masked last row."""
    g = torch.Generator().manual_seed(seed)
    sizes = list(sizes)
    uid = []
    for k in range(n_groups):
        n = sizes[int(torch.randint(len(sizes), (1,), generator=g))]
        uid += [f"prompt-{seed}-{k}"] * n
    uid = [uid[i] for i in torch.randperm(len(uid), generator=g).tolist()]
    rows = len(uid)
    mask = torch.zeros(rows, T, dtype=torch.bool)
    for b in range(rows):
        mask[b, :int(torch.randint(1, T + 1, (1,), generator=g))] = True    # right padding
    mask[0, :] = True
    mask[0, 2] = False                                                       # a hole
    mask[rows - 1, :] = False                                                # an empty response
    return g, mask, uid


def _valid(mask, b):
    return [t for t in range(mask.shape[1]) if mask[b, t]]


def _scores(rewards, mask):
    return [sum(float(rewards[b, t]) for t in _valid(mask, b)) for b in range(mask.shape[0])]


def _members(uid):
    out: dict = {}
    for i, u in enumerate(uid):
        out.setdefault(u, []).append(i)
    return out


def _on_tokens(seq, mask):
    return [[seq[b] if mask[b, t] else 0.0 for t in range(mask.shape[1])]
            for b in range(mask.shape[0])]


def _close(actual: torch.Tensor, expected, tol=1e-9):
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64),
                               atol=tol, rtol=tol)


def _garbage(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with NaN, +inf, -inf cycling over the positions where ``mask`` is 0."""
    out = x.clone()
    off = ~mask
    bad = torch.tensor([math.nan, math.inf, -math.inf], dtype=x.dtype)
    out[off] = bad[torch.arange(int(off.sum())) % 3]
    return out


def _last_token(scores, mask, dtype=torch.float64):
    """Each row's score on its last valid token (an empty row gets nothing)."""
    r = torch.zeros(mask.shape, dtype=dtype)
    for b, s in enumerate(scores):
        idx = _valid(mask, b)
        if idx:
            r[b, idx[-1]] = s
    return r


# References from the papers -----------------------------------------------------------------
def _ref_reinforce_pp_baseline(rewards, mask, uid):
    """(whiten(b), b) on the tokens, b_i = s_i - mean of its group (s_i for a group of one)."""
    s = _scores(rewards, mask)
    b = [0.0] * len(s)
    for rows in _members(uid).values():
        mean = statistics.fmean(s[i] for i in rows) if len(rows) > 1 else 0.0
        for i in rows:
            b[i] = s[i] - mean
    tokens = [b[i] for i in range(len(b)) for _ in _valid(mask, i)]
    mean = statistics.fmean(tokens)
    var = sum((v - mean) ** 2 for v in tokens) / (len(tokens) - 1)
    adv = [(v - mean) / math.sqrt(var + 1e-8) for v in b]
    return _on_tokens(adv, mask), _on_tokens(b, mask)


def _ref_dr_grpo(rewards, mask, uid):
    """s_i - mean_g, no std (a group of one keeps s_i, as GRPO in verl)."""
    s = _scores(rewards, mask)
    a = [0.0] * len(s)
    for rows in _members(uid).values():
        mean = statistics.fmean(s[i] for i in rows) if len(rows) > 1 else 0.0
        for i in rows:
            a[i] = s[i] - mean
    return _on_tokens(a, mask)


def _ref_opo(rewards, mask, uid):
    """s_i - sum_j L_j s_j / sum_j L_j over the group's rows, L = valid tokens; 0 if L_i = 0."""
    s = _scores(rewards, mask)
    length = [len(_valid(mask, b)) for b in range(len(s))]
    a = [0.0] * len(s)
    for rows in _members(uid).values():
        den = sum(length[j] for j in rows)
        base = sum(length[j] * s[j] for j in rows) / den if den else 0.0
        for i in rows:
            a[i] = s[i] - base if length[i] else 0.0
    return _on_tokens(a, mask)


def _ref_passk(scores, uid, k):
    """Chen et al. 2025, eqs. for R_bar, sigma, A_pos, A_neg, with math.comb in floats."""
    a = [0.0] * len(scores)
    for rows in _members(uid).values():
        n = len(rows)
        n_neg = sum(1 for i in rows if scores[i] == 0)
        r_bar = 1 - math.comb(n_neg, k) / math.comb(n, k)
        sigma = math.sqrt(r_bar * (1 - r_bar))
        for i in rows:
            if sigma == 0:
                a[i] = 0.0
            elif scores[i] == 1:
                a[i] = (1 - r_bar) / sigma
            else:
                a[i] = (1 - r_bar - math.comb(n_neg - 1, k - 1) / math.comb(n - 1, k - 1)) / sigma
    return a


def _enumerate_passk(scores, uid, k):
    """The definition: every k-subset S of a group has reward max_{j in S} s_j; a sample's
    advantage is the mean of (R_S - mean R) / std R over the subsets that contain it.  The
    closed form's sigma = sqrt(R_bar (1 - R_bar)) is the population std of the Bernoulli R_S,
    so the normalisations agree and the whole advantage is compared."""
    a = [0.0] * len(scores)
    for rows in _members(uid).values():
        subsets = list(itertools.combinations(rows, k))
        reward = {S: max(scores[j] for j in S) for S in subsets}
        mean = statistics.fmean(reward.values())
        std = statistics.pstdev(reward.values())
        for i in rows:
            if std == 0:
                continue
            a[i] = statistics.fmean((reward[S] - mean) / std for S in subsets if i in S)
    return a


def _binary_batch(seed, sizes=range(2, 9), n_groups=6):
    g, mask, uid = _batch(seed, sizes, n_groups)
    p = torch.rand(n_groups, generator=g)            # groups from mostly wrong to mostly right
    by_uid = {u: i for i, u in enumerate(dict.fromkeys(uid))}
    scores = [float(torch.rand(1, generator=g) < p[by_uid[u]]) for u in uid]
    scores[-1] = 0.0                                  # the empty response scores 0
    return mask, uid, scores


# Against the references ---------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_pp_baseline_dr_grpo_opo_match_the_formulas(seed):
    g, mask, uid = _batch(seed)
    r = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    adv, ret = reinforce_pp_baseline(r, mask, uid)
    want_adv, want_ret = _ref_reinforce_pp_baseline(r, mask, uid)
    _close(adv, want_adv)
    _close(ret, want_ret)
    for f, ref in ((dr_grpo, _ref_dr_grpo), (opo, _ref_opo)):
        adv, ret = f(r, mask, uid)
        _close(adv, ref(r, mask, uid))
        assert torch.equal(adv, ret)
        assert adv.dtype == torch.float64


def test_opo_weights_by_length():
    """Hand-checked: lengths 1 and 3, scores 0 and 1: b = 3/4; an empty row stays out."""
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    r = torch.tensor([[0.0, 9, 9], [0, 0, 1], [5, 5, 5]], dtype=torch.float64)
    adv, _ = opo(r, mask, ["a", "a", "a"])
    _close(adv, [[-0.75, 0, 0], [0.25, 0.25, 0.25], [0, 0, 0]])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("k", [1, 2])
def test_grpo_passk_matches_the_formula_and_the_enumeration(seed, k):
    mask, uid, scores = _binary_batch(seed)
    r = _last_token(scores, mask)
    adv, ret = grpo_passk(r, mask, uid, k)
    want = _ref_passk(scores, uid, k)
    _close(adv, _on_tokens(want, mask))
    _close(adv, _on_tokens(_enumerate_passk(scores, uid, k), mask))
    assert torch.equal(adv, ret)


@pytest.mark.parametrize("k", range(1, 9))
def test_grpo_passk_enumerates_every_group_composition(k):
    """Every (N, N_neg) with k <= N <= 8 in one shuffled batch, against all k-subsets."""
    uid, scores = [], []
    for n in range(k, 9):
        for n_neg in range(n + 1):
            uid += [f"n{n}-neg{n_neg}"] * n
            scores += [0.0] * n_neg + [1.0] * (n - n_neg)
    perm = torch.randperm(len(uid), generator=torch.Generator().manual_seed(k)).tolist()
    uid, scores = [uid[i] for i in perm], [scores[i] for i in perm]
    mask = torch.ones(len(uid), 2, dtype=torch.bool)
    adv, _ = grpo_passk(_last_token(scores, mask), mask, uid, k)
    want = _enumerate_passk(scores, uid, k)
    _close(adv, _on_tokens(want, mask), tol=1e-12)
    # the advantages of a group sum to 0: each subset's centred reward is counted k times
    for rows in _members(uid).values():
        assert abs(sum(float(adv[i, 0]) for i in rows)) < 1e-12


def test_grpo_passk_by_hand():
    mask = torch.ones(4, 1, dtype=torch.bool)
    # N=4, one correct, k=2: R_bar = 1 - C(3,2)/C(4,2) = 1/2, sigma = 1/2,
    # A_pos = (1/2)/(1/2) = 1, A_neg = (1/2 - C(2,1)/C(3,1)) / (1/2) = -1/3
    adv, _ = grpo_passk(torch.tensor([[0.0], [1], [0], [0]]), mask, [0] * 4, 2)
    _close(adv, [[-1 / 3], [1], [-1 / 3], [-1 / 3]], tol=1e-6)
    # N=4, two correct, k=2: R_bar = 5/6, sigma = sqrt(5)/6, A = +-(1/6)/sigma = +-1/sqrt(5)
    adv, _ = grpo_passk(torch.tensor([[1.0], [0], [1], [0]]), mask, [0] * 4, 2)
    c = 1 / math.sqrt(5)
    _close(adv, [[c], [-c], [c], [-c]], tol=1e-6)
    # k=1 is GRPO with the population std: (s - p) / sqrt(p (1 - p))
    s = [1.0, 0, 0, 0]
    adv, _ = grpo_passk(torch.tensor([[v] for v in s]), mask, [0] * 4, 1)
    p = 0.25
    _close(adv, [[(v - p) / math.sqrt(p * (1 - p))] for v in s], tol=1e-6)


def test_grpo_passk_zero_when_no_subset_can_fail_or_pass():
    mask = torch.ones(9, 2, dtype=torch.bool)
    uid = ["all-right"] * 3 + ["all-wrong"] * 3 + ["one-wrong"] * 3
    s = [1.0, 1, 1, 0, 0, 0, 0, 1, 1]
    adv, ret = grpo_passk(_last_token(s, mask, torch.float32), mask, uid, 2)
    assert adv.dtype == torch.float32
    assert torch.equal(adv, torch.zeros_like(adv)) and torch.equal(ret, adv)


def test_groups_of_one():
    """A lone sample keeps its score (mean 0, as GRPO in verl) except in OPO, whose baseline is
    the sample itself; pass@1 of one sample cannot vary (sigma = 0)."""
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]], dtype=torch.bool)
    r = _last_token([2.0, 1.0, 0.0], mask)
    uid = ["x", "y", "z"]
    _close(dr_grpo(r, mask, uid)[0], [[2, 2], [1, 0], [0, 0]])
    _close(reinforce_pp_baseline(r, mask, uid)[1], [[2, 2], [1, 0], [0, 0]])
    _close(opo(r, mask, uid)[0], [[0, 0], [0, 0], [0, 0]])
    rb = _last_token([1.0, 0.0, 1.0], mask)
    _close(grpo_passk(rb, mask, uid, 1)[0], [[0, 0], [0, 0], [0, 0]])


# Garbage, offsets, identical groups ----------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_garbage_at_masked_positions_changes_nothing(seed):
    g, mask, uid = _batch(seed)
    r = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    dirty = _garbage(r, mask)
    _, _, scores = _binary_batch(seed)
    rb = _last_token(scores, mask)
    runs = [(f, r, dirty) for f in (reinforce_pp_baseline, dr_grpo, opo)]
    runs += [(lambda x, m, u: grpo_passk(x, m, u, 2), rb, _garbage(rb, mask))]
    for f, clean, bad in runs:
        for a, b in zip(f(clean, mask, uid), f(bad, mask, uid)):
            assert torch.isfinite(b).all()
            assert torch.equal(a, b)


@pytest.mark.parametrize("seed", SEEDS)
def test_float32_scores_with_a_large_offset(seed):
    g, mask, uid = _batch(seed)
    s = (1000.0 + 0.01 * torch.randn(mask.shape[0], generator=g)).float()
    r32 = _last_token(s.tolist(), mask, torch.float32)
    r64 = r32.double()          # the float64 answer for the same float32 scores
    adv, ret = reinforce_pp_baseline(r32, mask, uid)
    want_adv, want_ret = _ref_reinforce_pp_baseline(r64, mask, uid)
    assert adv.dtype == ret.dtype == torch.float32
    _close(adv, want_adv, tol=1e-3)
    _close(ret, want_ret, tol=1e-3)
    for f, ref in ((dr_grpo, _ref_dr_grpo), (opo, _ref_opo)):
        adv, _ = f(r32, mask, uid)
        assert adv.dtype == torch.float32
        _close(adv, ref(r64, mask, uid), tol=1e-3)
    assert float(ret.abs().max()) > 1e-3              # the 1e-2 spread survived the offset


def test_identical_scores_give_exactly_zero():
    g = torch.Generator().manual_seed(0)
    uid, scores = [], []
    for k in range(300):
        n = int(torch.randint(2, 9, (1,), generator=g))
        # a full float64 mantissa, so a weighted mean of equal values would round
        value = float(torch.randn(1, generator=g, dtype=torch.float64)
                      * 10 ** float(torch.randint(-3, 4, (1,), generator=g)))
        value += 1000.0 * (k % 2)
        uid += [f"p{k}"] * n
        scores += [value] * n
    rows = len(uid)
    mask = torch.zeros(rows, T, dtype=torch.bool)
    for b in range(rows):                              # uneven lengths: OPO's weights differ
        mask[b, :int(torch.randint(1, T + 1, (1,), generator=g))] = True
    for dtype in (torch.float32, torch.float64):
        r = _last_token(scores, mask, dtype)
        zero = torch.zeros_like(r)
        adv, ret = reinforce_pp_baseline(r, mask, uid)
        assert torch.equal(ret, zero) and torch.equal(adv, zero)   # whiten(0) = 0
        for f in (dr_grpo, opo):
            for out in f(r, mask, uid):
                assert torch.equal(out, zero)


# Errors --------------------------------------------------------------------------------------
def test_grpo_passk_rejects_non_binary_scores():
    mask = torch.ones(4, 2, dtype=torch.bool)
    uid = ["a", "a", "b", "b"]
    for bad in (0.5, 1.001, -0.01, math.nan, 2.0):
        r = _last_token([1.0, 0.0, bad, 1.0], mask)
        with pytest.raises(ValueError, match=f"row 2 has score {bad!r}"):
            grpo_passk(r, mask, uid, 1)
    # within 1e-6 of 0 or 1 is accepted, and counts as that value
    r = _last_token([1.0 - 1e-7, 0.0, 1e-7, 1.0], mask)
    adv, _ = grpo_passk(r, mask, uid, 1)
    _close(adv[:, 0], [1.0, -1.0, -1.0, 1.0], tol=1e-12)


def test_grpo_passk_rejects_bad_k():
    mask = torch.ones(5, 1, dtype=torch.bool)
    uid = ["a", "a", "a", "b", "b"]
    r = _last_token([1.0, 0, 0, 1, 0], mask)
    with pytest.raises(ValueError, match="k=3 and a group of N=2"):
        grpo_passk(r, mask, uid, 3)
    for k in (0, -1):
        with pytest.raises(ValueError, match=f"k >= 1, got k={k}"):
            grpo_passk(r, mask, uid, k)
    # k is checked before the scores are looked at
    with pytest.raises(ValueError, match="k=3"):
        grpo_passk(r * 0.5, mask, uid, 3)
    with pytest.raises(TypeError):
        grpo_passk(r, mask, uid, 2.0)
    with pytest.raises(ValueError, match="4 ids"):
        grpo_passk(r, mask, uid[:4], 1)
