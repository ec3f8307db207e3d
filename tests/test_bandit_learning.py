"""Every registered algorithm learns on a bandit task (issues 18 and 23).

A tabular policy, one logit table per prompt and response position::

    logits  [N_PROMPTS, T, V]     token 0 = EOS (ends the response, mask 1 on it)
    reward  1 if the response's first token is its prompt's favoured token, else 0

Each iteration does, on one process and with no worker, what the algorithm's program and the
actor/critic workers do: sample ``samples_per_prompt`` responses to each prompt of the recipe's
``data.prompts_per_iter`` (uids per prompt), score them, fill the fields the registry entry
asks for (values of a tabular critic, greedy baselines, costs), :func:`shape_rewards`, the
registered advantage, then ``algo.epochs`` passes of Adam steps over the recipe's mini-batches
(and micro-batches) on :func:`rlhf.algos.actor_loss` with the recipe's ``actor.loss`` section.
The expected reward ``E[R] = mean_p pi_p(favoured_p at position 0)`` is exact, so the check has
no sampling noise: it starts at 1/V and must end above 0.7 (every algorithm reaches 0.85 or
more, whatever the sampling seed; with the sign of the advantages flipped every one falls below
0.02).  Safe-RLHF must also end within its recipe's ``cost_limit``.

Every name in :data:`rlhf.programs.ALGORITHMS` is driven; one whose recipe or batch fields the
harness cannot supply fails here rather than being skipped.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.sampling import SamplingParams
from rlhf.algos import (KLLossTerm, LagrangeMultiplier, actor_loss, agg_count,
                        agg_denominator, entropy_from_logits, get_policy_loss,
                        make_kl_controller, varied_groups)
from rlhf.config import load_config
from rlhf.controller import Batch
from rlhf.metrics import PhaseTimer
from rlhf.programs import ALGORITHMS, Iteration, algorithm
from rlhf.programs.steps import advantages, shape_rewards

N_PROMPTS, T, V, EOS = 4, 3, 5, 0
FAVOURED = torch.tensor([1, 2, 3, 1])   # reward 1 iff the first token is this one
COSTLY = 4                              # Safe-RLHF: each occurrence of this token costs 1
ITERATIONS = 20
ACTOR_LR, CRITIC_LR = 0.15, 0.2
START, GOAL = 1.0 / V, 0.7              # E[R] of the uniform policy; E[R] required at the end
COST_TOL = 0.02


class TabularPolicy:
    """``softmax(logits[prompt, t])`` at response position ``t``, whatever came before."""

    def __init__(self) -> None:
        self.logits = torch.zeros(N_PROMPTS, T, V, requires_grad=True)

    def sample(self, prompt: torch.Tensor, gen: torch.Generator | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(responses, response_mask)``, ``[B, T]`` each; greedy (lowest id on ties) when
        ``gen`` is None.  Pad 0 and mask 0 after EOS."""
        b = prompt.shape[0]
        tokens = torch.zeros(b, T, dtype=torch.long)
        mask = torch.zeros(b, T, dtype=torch.long)
        alive = torch.ones(b, dtype=torch.bool)
        with torch.no_grad():
            for t in range(T):
                probs = torch.softmax(self.logits[prompt, t], -1)
                tok = (probs.argmax(-1) if gen is None
                       else torch.multinomial(probs, 1, generator=gen).squeeze(1))
                tokens[:, t] = torch.where(alive, tok, torch.zeros_like(tok))
                mask[:, t] = alive.long()
                alive = alive & (tok != EOS)
        return tokens, mask

    def log_probs(self, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` log-probs of ``tokens`` (differentiable)."""
        return torch.log_softmax(self.logits[prompt], -1).gather(-1, tokens[..., None])[..., 0]

    def entropy(self, prompt: torch.Tensor) -> torch.Tensor:
        return entropy_from_logits(self.logits[prompt])

    def expected_reward(self) -> float:
        """``E[R]`` over prompts, exact."""
        p0 = torch.softmax(self.logits[:, 0].detach(), -1)                    # [P, V]
        return float(p0[torch.arange(N_PROMPTS), FAVOURED].mean())

    def expected_cost(self) -> float:
        """``E[#COSTLY tokens]`` over prompts, exact: ``sum_t P(reach t) pi_t(COSTLY)``."""
        p = torch.softmax(self.logits.detach(), -1)                           # [P, T, V]
        reach = torch.cumprod(torch.cat([torch.ones(N_PROMPTS, 1), 1 - p[:, :-1, EOS]], 1), 1)
        return float((reach * p[:, :, COSTLY]).sum(1).mean())


def score(prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return (tokens[:, 0] == FAVOURED[prompt]).float()


def cost(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ((tokens == COSTLY) & mask.bool()).sum(-1).float()


def rollout(name: str, cfg, step: int, policy: TabularPolicy, ref: torch.Tensor | None,
            critics: dict[str, torch.Tensor], gen: torch.Generator) -> Batch:
    """One iteration's scored batch with every field the registry entry of ``name`` reads."""
    spec, n = algorithm(name), cfg.data.samples_per_prompt
    prompt = (torch.arange(cfg.data.prompts_per_iter) % N_PROMPTS).repeat_interleave(n)
    uid = [f"{step}/{i // n}" for i in range(len(prompt))]
    tokens, mask = policy.sample(prompt, gen)
    with torch.no_grad():
        lp = policy.log_probs(prompt, tokens) * mask
    tensors = {"prompt": prompt, "responses": tokens, "response_mask": mask,
               "rollout_log_probs": lp, "scores": score(prompt, tokens)}
    if cfg.algo.recompute_log_prob:
        tensors["old_log_probs"] = lp.clone()
    if ref is not None:
        ref_lp = torch.log_softmax(ref[prompt], -1).gather(-1, tokens[..., None])[..., 0]
        tensors["ref_log_probs"] = ref_lp * mask
    for role, table in critics.items():
        key = "cost_values" if role == "cost_critic" else "values"
        tensors[key] = table.detach()[prompt] * mask
    if spec.cost:
        tensors["costs"] = cost(tokens, mask)
    if spec.greedy_baseline:  # ReMax: the greedy response's score, per prompt
        first = prompt[::n]
        greedy, _ = policy.sample(first, None)
        tensors["reward_baselines"] = score(first, greedy).repeat_interleave(n)
    batch = Batch(tensors, {"uid": uid})
    if name == "dapo":  # dynamic sampling: drop the groups whose scores are all equal
        batch = batch.rows(varied_groups(batch["scores"], uid).nonzero().squeeze(1))
    return batch


def micro_batches(batch: Batch, mini: int, micro: int) -> list[list[Batch]]:
    """What the workers step on: mini-batches of ``mini`` rows, each split in micro-batches
    of ``micro`` rows (a last short one where the batch is short, as after DAPO's filter)."""
    return [[m.rows(slice(j, j + micro)) for j in range(0, len(m), micro)]
            for m in (batch.rows(slice(i, i + mini)) for i in range(0, len(batch), mini))]


def update_actor(cfg, policy: TabularPolicy, opt: torch.optim.Optimizer,
                 batch: Batch) -> None:
    a, loss_cfg = cfg.algo, cfg.actor.loss
    pg_loss = get_policy_loss(loss_cfg.mode or algorithm(a.name).policy_loss)
    kl = KLLossTerm.of(a)
    for _ in range(a.epochs):
        for mbs in micro_batches(batch, cfg.data.mini_batch_size, cfg.data.micro_batch_size):
            mode = loss_cfg.loss_agg_mode
            d = agg_denominator(sum(agg_count(mb["response_mask"], mode) for mb in mbs), mode)
            opt.zero_grad()
            for mb in mbs:  # the micro-batch losses with the mini-batch's denominator add up
                loss, _ = actor_loss(
                    policy.log_probs(mb["prompt"], mb["responses"]), mb["old_log_probs"],
                    mb["advantages"], mb["response_mask"], pg_loss=pg_loss, cfg=loss_cfg,
                    ref_log_prob=None if kl is None else mb["ref_log_probs"], kl=kl,
                    entropy=policy.entropy(mb["prompt"]), denominator=d)
                loss.backward()
            opt.step()


def update_critic(cfg, role: str, table: torch.Tensor, opt: torch.optim.Optimizer,
                  batch: Batch) -> None:
    """The tabular critic ``[N_PROMPTS, T]`` on the registered value loss."""
    values, returns = (("cost_values", "cost_returns") if role == "cost_critic"
                       else ("values", "returns"))
    section = cfg.role(role).loss
    value_loss = algorithm(cfg.algo.name).value_loss
    for _ in range(cfg.algo.epochs):
        for mbs in micro_batches(batch, cfg.data.mini_batch_size, cfg.data.micro_batch_size):
            mode = section.loss_agg_mode
            d = agg_denominator(sum(agg_count(mb["response_mask"], mode) for mb in mbs), mode)
            opt.zero_grad()
            for mb in mbs:
                loss, _ = value_loss(table[mb["prompt"]], mb[values], mb[returns],
                                     mb["response_mask"], section.value_clip, mode, d)
                loss.backward()
            opt.step()


@dataclasses.dataclass
class Run:
    reward: list[float]
    """Exact E[R] before the first and after every iteration."""
    cost: list[float]
    """Exact E[cost] likewise."""
    cost_limit: float


def train(name: str, iterations: int = ITERATIONS, seed: int = 0) -> Run:
    """``iterations`` iterations of ``name`` with its shipped recipe, sampling with ``seed``."""
    cfg = load_config([f"algo={name}"])
    a, spec = cfg.algo, algorithm(name)
    gen = torch.Generator().manual_seed(seed)
    policy = TabularPolicy()
    ref = policy.logits.detach().clone() if a.kl_mode != "none" else None
    opt = torch.optim.Adam([policy.logits], lr=ACTOR_LR)
    critics = {role: torch.zeros(N_PROMPTS, T, requires_grad=True) for role in spec.critics}
    critic_opts = {role: torch.optim.Adam([t], lr=CRITIC_LR) for role, t in critics.items()}
    sampling = SamplingParams(max_new_tokens=T, temperature=cfg.data.temperature,
                              eos_token_id=EOS, seed=0)
    it = Iteration(algo=a, sampling=sampling, greedy=dataclasses.replace(sampling, temperature=0),
                   timer=PhaseTimer(),
                   kl_ctrl=make_kl_controller(a.kl_ctrl, a.kl_coef, a.kl_target, a.kl_horizon),
                   lagrange=LagrangeMultiplier(a.lagrange_init, a.lagrange_lr, a.cost_limit,
                                               a.lagrange_max),
                   mini_batch_size=cfg.data.mini_batch_size, more_prompts=None)
    run = Run([policy.expected_reward()], [policy.expected_cost()], a.cost_limit)
    for step in range(iterations):
        batch = rollout(name, cfg, step, policy, ref, critics, gen)
        if len(batch):
            batch, _ = shape_rewards(batch, it)
            batch = advantages(batch, it)
            if spec.cost:  # as the Safe-RLHF program: after the advantage, before the updates
                it.lagrange.update(float(batch["costs"].mean()))
            for role, table in critics.items():
                update_critic(cfg, role, table, critic_opts[role], batch)
            update_actor(cfg, policy, opt, batch)
        run.reward.append(policy.expected_reward())
        run.cost.append(policy.expected_cost())
    return run


def test_expected_values_are_exact():
    """The analytic E[R] and E[cost] match a Monte-Carlo estimate of a random policy."""
    policy = TabularPolicy()
    with torch.no_grad():
        policy.logits.normal_(generator=torch.Generator().manual_seed(3))
    prompt = torch.arange(N_PROMPTS).repeat(20_000)
    tokens, mask = policy.sample(prompt, torch.Generator().manual_seed(4))
    assert abs(float(score(prompt, tokens).mean()) - policy.expected_reward()) < 0.01
    assert abs(float(cost(tokens, mask).mean()) - policy.expected_cost()) < 0.015
    assert bool((mask[:, 0] == 1).all()) and bool((mask[:, 1:] <= mask[:, :-1]).all())
    assert TabularPolicy().expected_reward() == pytest.approx(START)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_algorithm_learns(name):
    run = train(name)
    assert run.reward[0] == pytest.approx(START)
    assert run.reward[-1] > GOAL, f"{name}: E[R] {run.reward[0]:.3f} -> {run.reward[-1]:.3f}"
    if algorithm(name).cost:  # the Lagrange multiplier holds the constraint E[cost] <= limit
        assert run.cost[-1] <= run.cost_limit + COST_TOL, \
            f"{name}: E[cost] {run.cost[0]:.3f} -> {run.cost[-1]:.3f} > {run.cost_limit}"
