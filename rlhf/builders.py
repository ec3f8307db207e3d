"""Config -> plain arguments and worker groups.  The only place where the run config meets the
workers: everything below this module takes plain values.

Roles and where they run (pools from :func:`rlhf.config.validate_for_world`)::

    actor        ActorWorker     (HybridEngine)        trained
    reference    ReferenceWorker (frozen policy)       kl_mode != none
    critic       CriticWorker    (value head)          ppo, safe_rlhf          trained
    cost_critic  CriticWorker    (cost values)         safe_rlhf               trained
    reward       RewardWorker    reward model and/or rules
    cost         CostWorker      cost model or cost rule                        safe_rlhf

A rule-only reward (or cost) has no model: its worker group is plain CPU arithmetic on the
critic's pool (or the actor's when there is no critic), one DP rank per pool rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from engine.hf_interop import read_hf_config
from engine.sampling import SamplingParams
from engine.train import OptimConfig
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from rlhf.config import Config, WorldPlan
from rlhf.controller import Controller, WorkerGroup
from rlhf.task import AdditionTask, CharTokenizer, CostRule
from rlhf.workers import (ActorWorker, CostWorker, CriticWorker, ModelArgs, PolicyLossArgs,
                          ReferenceWorker, RewardWorker, ScoreArgs, ValueLossArgs)


@dataclass
class Roles:
    """The worker groups of one run (None for a role the algorithm does not use)."""

    actor: WorkerGroup
    reward: WorkerGroup
    reference: WorkerGroup | None = None
    critic: WorkerGroup | None = None
    cost_critic: WorkerGroup | None = None
    cost: WorkerGroup | None = None

    def checkpointed(self) -> dict[str, WorkerGroup]:
        """Role name -> group, for every role with weights."""
        return {k: v for k, v in vars(self).items() if v is not None}


def task_of(cfg: Config) -> AdditionTask:
    d = cfg.data
    return AdditionTask(d.min_digits, d.max_digits, d.num_operands, d.seed)


def check_run(cfg: Config, tokenizer: CharTokenizer) -> None:
    """ValueError naming the values unless the task fits the model and the lengths and every
    ``init_from`` folder exists (run on every rank before any process group exists)."""
    for role in cfg.roles:
        args = model_args(cfg, role, "lm")
        if not args.init_from:
            continue
        if not os.path.isfile(os.path.join(args.init_from, "config.json")):
            raise ValueError(f"{role}: model init_from={args.init_from!r} is not an HF-format "
                             f"folder (no config.json); create it with rlhf.sft / rlhf.train_rm")
        mine, theirs = args.config.to_dict(), read_hf_config(args.init_from).to_dict()
        diff = {k: (mine[k], theirs[k]) for k in mine if k != "dtype" and mine[k] != theirs[k]}
        if diff:
            raise ValueError(f"{role}: model init_from={args.init_from!r} has another "
                             f"architecture, (config, checkpoint): {diff}")
    vocab = cfg.actor.model.vocab_size
    if vocab != tokenizer.vocab_size:
        raise ValueError(f"actor.model.vocab_size={vocab} but the task tokenizer has "
                         f"{tokenizer.vocab_size} tokens; set actor.model.vocab_size="
                         f"{tokenizer.vocab_size}")
    if cfg.data.dataset is None:
        task = task_of(cfg)
        need = task.max_prompt_chars + 1  # + <bos>
        if cfg.data.max_prompt_len < need:
            raise ValueError(f"data.max_prompt_len={cfg.data.max_prompt_len} < {need} (longest "
                             f"prompt of max_digits={task.max_digits}, num_operands="
                             f"{task.num_operands}, plus <bos>)")


def model_args(cfg: Config, role: str, head: str, seed_offset: int = 0) -> ModelArgs:
    own = cfg.role(role).model
    init = (own or cfg.actor.model).init_from
    if own is None and role in ("reward_model", "cost_model"):
        init = None  # a reward model never starts from the policy checkpoint by accident
    return ModelArgs(cfg.model_of(role).llama(), head, init, cfg.seed + seed_offset)


def optim_of(cfg: Config, role: str) -> OptimConfig:
    r = cfg.role(role)
    return OptimConfig(lr=r.lr, weight_decay=r.weight_decay, max_grad_norm=r.max_grad_norm)


def policy_loss_args(cfg: Config, plan: WorldPlan) -> PolicyLossArgs:
    a, d = cfg.algo, cfg.data
    return PolicyLossArgs(
        epochs=a.epochs, mini_batch_rows=d.mini_batch_size // plan.roles["actor"].dp,
        micro_batch_size=d.micro_batch_size, clip_ratio=a.clip_ratio,
        clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c, entropy_coeff=a.entropy_coeff,
        loss_agg_mode=a.loss_agg_mode,
        kl_loss_coef=a.kl_coef if a.kl_mode == "loss" else None, kl_estimator=a.kl_estimator)


def value_loss_args(cfg: Config, plan: WorldPlan, role: str) -> ValueLossArgs:
    a, d = cfg.algo, cfg.data
    keys = ("cost_values", "cost_returns") if role == "cost_critic" else ("values", "returns")
    return ValueLossArgs(a.epochs, d.mini_batch_size // plan.roles[role].dp, d.micro_batch_size,
                         a.value_clip, a.loss_agg_mode, *keys)


def sampling_of(cfg: Config, step: int, tokenizer: CharTokenizer,
                greedy: bool = False) -> SamplingParams:
    """Rollout sampling of iteration ``step`` (seeded by run seed and step: resumable)."""
    return SamplingParams(max_new_tokens=cfg.data.max_response_len,
                          temperature=0.0 if greedy else cfg.data.temperature,
                          eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
                          seed=cfg.seed * 1_000_003 + step)


def _rule_group(ctl: Controller, plan: WorldPlan, cls: type, args: ScoreArgs,
                name: str) -> WorkerGroup:
    pool = plan.roles["critic" if "critic" in plan.roles else "actor"].pool
    layout = HybridLayout(ParallelLayout(1, 1, len(pool)), 1, 1)
    return ctl.group(cls, layout, pool=list(pool), name=name, args=(args,),
                     values_in_replies=True)


def build_roles(ctl: Controller, cfg: Config, plan: WorldPlan) -> Roles:
    """Create every worker group of the run (collective over the job, in a fixed order)."""
    p, r = plan.roles, cfg.reward

    def group(role: str, cls: type, *args) -> WorkerGroup:
        # the programs read every output: values come with the replies (no fetch round trip)
        return ctl.group(cls, p[role].layout, pool=list(p[role].pool), name=role, args=args,
                         values_in_replies=True)

    actor = group("actor", ActorWorker, model_args(cfg, "actor", "lm"), optim_of(cfg, "actor"),
                  policy_loss_args(cfg, plan))
    reference = group("reference", ReferenceWorker, model_args(cfg, "actor", "lm")) \
        if "reference" in p else None
    critic = group("critic", CriticWorker, model_args(cfg, "critic", "value", 1),
                   optim_of(cfg, "critic"), value_loss_args(cfg, plan, "critic")) \
        if "critic" in p else None
    cost_critic = group("cost_critic", CriticWorker, model_args(cfg, "cost_critic", "value", 2),
                        optim_of(cfg, "cost_critic"), value_loss_args(cfg, plan, "cost_critic")) \
        if "cost_critic" in p else None
    rules = dict(r.rule_weights) if r.kind in ("rule", "both") else {}
    if "reward_model" in p:
        reward = group("reward_model", RewardWorker, ScoreArgs(
            model_args(cfg, "reward_model", "value", 3), r.model_weight, rules))
    else:
        reward = _rule_group(ctl, plan, RewardWorker, ScoreArgs(rule_weights=rules), "reward")
    cost = None
    if cfg.algo.name == "safe_rlhf":
        if "cost_model" in p:
            cost = group("cost_model", CostWorker,
                         ScoreArgs(model_args(cfg, "cost_model", "value", 4)))
        else:
            rule = CostRule(r.forbidden_digit, r.max_answer_len)
            cost = _rule_group(ctl, plan, CostWorker, ScoreArgs(cost_rule=rule), "cost")
    return Roles(actor, reward, reference, critic, cost_critic, cost)
