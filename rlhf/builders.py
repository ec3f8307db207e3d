"""Config -> worker specs and worker groups.  The only place where the run config meets the
workers: each worker gets its own typed section (:mod:`rlhf.workers.specs`) built here from
the config's fields by name; no default is restated.

Roles and where they run (pools from :func:`rlhf.world_plan.validate_for_world`)::

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

import dataclasses
import functools
import importlib
import inspect
import os

from engine.hf_interop import INDEX_FILE, SINGLE_FILE, read_hf_head
from engine.sampling import SamplingParams, derive_seed
from hybridflow_comm.devices import Precision
from hybridflow_comm.layout import HybridLayout, ParallelLayout
from rlhf.algos import KLLossTerm
from rlhf.checkpoint import resolve_resume
from rlhf.config import MAX_MODEL_PARAMS, Config
from rlhf.controller import Controller, WorkerGroup
from rlhf.model_arch import llama_config
from rlhf.planner.models import ModelShape
from rlhf.programs import Roles, algorithm
from rlhf.programs.async_rl import RolloutPool
from rlhf.programs.registry import VALUE_ROLES
from rlhf.task import (AdditionTask, CharTokenizer, CostRule, is_tokenizer_dir, load_tokenizer,
                       read_dataset)
from rlhf.task.reward_fn import load_function
from rlhf.tools.multi_turn import MultiTurnRollouts
from rlhf.tools.setup import multi_turn_of
from rlhf.workers import (ActorSpec, ActorWorker, CostWorker, CriticSpec, CriticWorker,
                          ModelSpec, OverlongShaping, ReferenceSpec, ReferenceWorker,
                          RewardWorker, ScoreSpec, UpdateSpec)
from rlhf.workers.rollout import PushingActorWorker, RolloutSpec, RolloutWorker, SyncSpec
from rlhf.world_plan import WorldPlan


def tokenizer_path(cfg: Config) -> str | None:
    """``tokenizer``, else the actor's init_from folder when it holds an HF tokenizer or the
    built-in one saved by rlhf.sft; None = the built-in character tokenizer."""
    if cfg.tokenizer is not None:
        return cfg.tokenizer
    init = cfg.actor.model.init_from
    if init and (is_tokenizer_dir(init) or os.path.isfile(os.path.join(init, "tokenizer.json"))):
        return init
    return None


def tokenizer_of(cfg: Config):
    return load_tokenizer(tokenizer_path(cfg))


def task_of(cfg: Config) -> AdditionTask:
    d = cfg.data
    return AdditionTask(d.min_digits, d.max_digits, d.num_operands, d.seed)


def check_run(cfg: Config, tokenizer) -> None:
    """ValueError naming the values unless every model, tokenizer, dataset, reward function and
    resume checkpoint of the run can be loaded and fits the lengths (run on every rank before
    any process group exists, so a bad input never reaches a collective)."""
    check_rollout_engine(cfg)
    for role in cfg.roles:
        try:
            _check_model(cfg, role)
        except ValueError as e:
            raise ValueError(f"{role}: {e}") from None
    actor = llama_config(cfg.actor.model)
    if cfg.actor.router_aux_loss_coef is not None and not actor.num_experts:
        raise ValueError(f"actor.router_aux_loss_coef={cfg.actor.router_aux_loss_coef} but the "
                         f"actor ({actor.model_type}) has no experts")
    if cfg.actor.router_replay and not actor.num_experts:
        raise ValueError(f"actor.router_replay=true but the actor ({actor.model_type}) has no "
                         f"experts")
    if cfg.actor.router_replay and cfg.rollout.engine != "native":
        raise ValueError(f"actor.router_replay=true needs rollout.engine=native (the engine that "
                         f"records the routing), got rollout.engine={cfg.rollout.engine!r}")
    vocab = actor.vocab_size
    builtin = isinstance(tokenizer, CharTokenizer)
    if tokenizer.vocab_size > vocab or (builtin and tokenizer.vocab_size != vocab):
        raise ValueError(f"the actor's vocab_size={vocab} but the tokenizer "
                         f"({tokenizer_path(cfg) or 'built-in'}) has {tokenizer.vocab_size} "
                         f"tokens: use a tokenizer made for this model (tokenizer=DIR) or set "
                         f"actor.model.vocab_size={tokenizer.vocab_size}")
    if cfg.reward.function is not None:
        _check_reward_function(cfg.reward.function)
    multi_turn_of(cfg, tokenizer)
    for key in ("train_files", "val_files"):
        _check_dataset(cfg, key, tokenizer)
    try:
        resolve_resume(cfg.checkpoint.resume, cfg.checkpoint.dir
                       or os.path.join(cfg.log.run_dir, "checkpoints"))
    except OSError as e:
        raise ValueError(f"checkpoint.resume={cfg.checkpoint.resume!r}: {e}") from None
    if cfg.data.train_files is None:
        task = task_of(cfg)
        need = task.max_prompt_chars + 1  # + <bos>
        if cfg.data.max_prompt_len < need:
            raise ValueError(f"data.max_prompt_len={cfg.data.max_prompt_len} < {need} (longest "
                             f"prompt of max_digits={task.max_digits}, num_operands="
                             f"{task.num_operands}, plus <bos>)")


def check_rollout_engine(cfg: Config) -> None:
    """``rollout.engine=vllm`` needs vllm importable and a GPU (ValueError in one line)."""
    if cfg.rollout.engine != "vllm":
        return
    if cfg.device == "cpu":
        raise ValueError("rollout.engine='vllm' runs on GPUs only but device='cpu'; set "
                         "device=cuda (or auto), or rollout.engine=native")
    try:
        importlib.import_module("vllm")
    except ImportError as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"rollout.engine='vllm' but vllm cannot be imported ({why}); install "
                         f"it (pip install -r requirements-vllm.txt) or set "
                         f"rollout.engine=native") from None


def _check_model(cfg: Config, role: str) -> None:
    """The role's architecture is sane and its checkpoint (if any) holds weights."""
    llama = llama_config(cfg.model_of(role))  # init_from readable, explicit sizes agree with it
    params = ModelShape(role, llama).params
    if params > MAX_MODEL_PARAMS:
        raise ValueError(f"the model has about {params:.2e} parameters (hidden_size="
                         f"{llama.hidden_size}, num_layers={llama.num_layers}, vocab_size="
                         f"{llama.vocab_size}), more than {MAX_MODEL_PARAMS:.2e}; use smaller "
                         f"model sizes")
    init = _init_from(cfg, role)
    if init is None:
        return
    if not any(os.path.isfile(os.path.join(init, f)) for f in (SINGLE_FILE, INDEX_FILE)):
        raise ValueError(f"model init_from={init!r} has config.json but no weights ({SINGLE_FILE} "
                         f"or {INDEX_FILE}); save the checkpoint with save_pretrained")
    if role in ("actor", "reference") and read_hf_head(init) == "value":
        raise ValueError(f"model init_from={init!r} is a value-head checkpoint (a reward model);"
                         f" the policy needs a causal LM checkpoint")


def _check_reward_function(spec: str) -> None:
    """``spec`` imports and names a callable that takes verl's four arguments."""
    try:
        fn = load_function(spec)
    except SystemExit as e:
        raise ValueError(f"reward.function={spec!r}: importing it called sys.exit({e.code})"
                         ) from None
    try:
        inspect.signature(fn).bind("data_source", "solution_str", "ground_truth", None)
    except TypeError as e:
        raise ValueError(f"reward.function={spec!r} cannot be called as compute_score("
                         f"data_source, solution_str, ground_truth, extra_info): {e}") from None
    except ValueError:
        pass  # a callable without a signature (a builtin): it is called as it is


ENCODED_ROWS = 1000
"""Prompts that :func:`check_run` encodes at least (a prompt format the tokenizer cannot take
shows in the first rows; encoding a large dataset whole would slow every start)."""


def _check_dataset(cfg: Config, key: str, tokenizer) -> None:
    """``data.<key>`` (if set) exists and parses into rows with prompts (all of them), the
    first :data:`ENCODED_ROWS` prompts encode, and some prompt fits ``data.max_prompt_len``."""
    d, files = cfg.data, getattr(cfg.data, key)
    if files is None:
        return
    missing = [p.strip() for p in files.split(",") if p.strip() and not os.path.exists(p.strip())]
    if missing:
        raise ValueError(f"data.{key}: {missing} do not exist")
    try:
        rows = read_dataset(files, d.prompt_key, d.ground_truth_key)
        shortest = None
        for i, row in enumerate(rows):
            n = len(tokenizer.encode_prompt(row.prompt))
            shortest = n if shortest is None else min(shortest, n)
            if shortest <= d.max_prompt_len and i + 1 >= ENCODED_ROWS:
                break
    except Exception as e:  # noqa: BLE001 - a user's file read by third-party readers
        why = str(e) if type(e) is ValueError else f"{type(e).__name__}: {e}"
        raise ValueError(f"data.{key}: {why}") from None
    if shortest > d.max_prompt_len:
        raise ValueError(f"data.{key}: all {len(rows)} prompts are longer than "
                         f"data.max_prompt_len={d.max_prompt_len} tokens (shortest: "
                         f"{shortest}); raise it")


def run_precision(cfg: Config) -> Precision:
    """The value of the run's precision, which :func:`rlhf.config.resolve_devices` resolved
    on this rank's device (ValueError naming the fix for a config still saying ``auto``).
    Every model of the run is built in it and every trained role's engine takes it."""
    return Precision.named(cfg.precision)


def _init_from(cfg: Config, role: str) -> str | None:
    """The HF folder the role's model starts from (None: a fresh init)."""
    own = cfg.role(role).model
    if own is None and role in ("reward_model", "cost_model"):
        return None  # a reward model never starts from the policy checkpoint by accident
    return (own or cfg.actor.model).init_from


def model_spec(cfg: Config, role: str, head: str, seed_offset: int = 0,
               adapters: bool = True) -> ModelSpec:
    """The role's model, its parameters in the run's precision (:func:`run_precision`);
    ``adapters``: with the role's LoRA section (``<role>.lora``; False for the reference, which
    is the actor's model without adapters)."""
    section = cfg.role(role)
    init = _init_from(cfg, role)
    lora = getattr(section, "lora", None) if adapters else None
    config = llama_config(cfg.model_of(role), run_precision(cfg))
    coef = getattr(section, "router_aux_loss_coef", None)
    if coef is not None and config.num_experts:
        config = dataclasses.replace(config, router_aux_loss_coef=float(coef))
    return ModelSpec(config=config, head=head,
                     init_from=init,
                     seed=cfg.seed + seed_offset, fresh_head=role in VALUE_ROLES,
                     lora=lora.engine_config() if lora is not None else None,
                     lora_init_from=lora.init_from if lora is not None else None)


def token_budget(cfg: Config, role: str) -> int | None:
    """The role's tokens per micro-batch with use_dynamic_bsz, else None."""
    section = cfg.role(role)
    return section.max_token_len_per_micro_batch if section.use_dynamic_bsz else None


def update_spec(cfg: Config, plan: WorldPlan, role: str) -> UpdateSpec:
    return UpdateSpec(epochs=cfg.algo.epochs,
                      mini_batch_rows=cfg.data.mini_batch_size // plan.roles[role].dp,
                      micro_batch_size=cfg.data.micro_batch_size,
                      max_tokens=token_budget(cfg, role))


def actor_spec(cfg: Config, plan: WorldPlan) -> ActorSpec:
    a = cfg.algo
    return ActorSpec(model=model_spec(cfg, "actor", "lm"), precision=run_precision(cfg),
                     optim=cfg.actor.optim, loss=cfg.actor.loss,
                     update=update_spec(cfg, plan, "actor"), algo=a.name,
                     kl_loss=KLLossTerm.of(a), temperature=cfg.data.temperature,
                     offload_during_generation=cfg.actor.offload_during_generation,
                     rollout=cfg.rollout, router_replay=cfg.actor.router_replay)


def reference_spec(cfg: Config) -> ReferenceSpec:
    return ReferenceSpec(model=model_spec(cfg, "actor", "lm", adapters=False),
                         precision=run_precision(cfg), temperature=cfg.data.temperature,
                         max_tokens=token_budget(cfg, "actor"),
                         micro_batch_size=cfg.data.micro_batch_size)


def critic_spec(cfg: Config, plan: WorldPlan, role: str, seed_offset: int) -> CriticSpec:
    keys = ("cost_values", "cost_returns") if role == "cost_critic" else ("values", "returns")
    section = cfg.role(role)
    return CriticSpec(model=model_spec(cfg, role, "value", seed_offset),
                      precision=run_precision(cfg), optim=section.optim, loss=section.loss,
                      update=update_spec(cfg, plan, role), algo=cfg.algo.name,
                      value_key=keys[0], return_key=keys[1])


def sampling_of(cfg: Config, step: int, tokenizer, greedy: bool = False,
                evaluation: bool = False) -> SamplingParams:
    """Rollout sampling of iteration ``step``: its own random stream, a pure function of the
    run seed and the step (resumable; each generation replica derives its own from it).
    ``evaluation``: for held-out prompts, without ``data.min_new_tokens``."""
    return SamplingParams(max_new_tokens=cfg.data.max_response_len,
                          temperature=0.0 if greedy else cfg.data.temperature,
                          eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
                          min_new_tokens=0 if evaluation else cfg.data.min_new_tokens,
                          seed=derive_seed(cfg.seed, "rollout", step))


def _rule_group(ctl: Controller, plan: WorldPlan, cls: type, args: ScoreSpec,
                name: str) -> WorkerGroup:
    pool = plan.roles["critic" if "critic" in plan.roles else "actor"].pool
    layout = HybridLayout(ParallelLayout(1, 1, len(pool)), 1, 1)
    return ctl.group(cls, layout, pool=list(pool), name=name, args=(args,),
                     values_in_replies=True)


def build_roles(ctl: Controller, cfg: Config, plan: WorldPlan) -> Roles:
    """Create every worker group of the run (collective over the job, in a fixed order)."""
    p, r, precision = plan.roles, cfg.reward, run_precision(cfg)

    def group(role: str, cls: type, *args) -> WorkerGroup:
        # the programs read every output: values come with the replies (no fetch round trip)
        experts = p[role].experts(llama_config(cfg.model_of(role)).num_experts)
        return ctl.group(cls, p[role].layout, pool=list(p[role].pool), name=role, args=args,
                         values_in_replies=True, experts=experts)

    actor = group("actor", ActorWorker if plan.rollout is None else PushingActorWorker,
                  actor_spec(cfg, plan))
    rollout = rollout_pool(ctl, cfg, plan, actor) if plan.rollout is not None else None
    reference = group("reference", ReferenceWorker, reference_spec(cfg)) \
        if "reference" in p else None
    if cfg.actor.lora.rank and cfg.algo.kl_mode != "none":
        reference = actor  # the base with the adapters off (PolicyWorker.compute_ref_log_prob)
    critic = group("critic", CriticWorker, critic_spec(cfg, plan, "critic", 1)) \
        if "critic" in p else None
    cost_critic = group("cost_critic", CriticWorker, critic_spec(cfg, plan, "cost_critic", 2)) \
        if "cost_critic" in p else None
    rules = dict(r.rule_weights) if r.kind in ("rule", "both") else {}
    tok = tokenizer_path(cfg)
    overlong = OverlongShaping(max_len=cfg.data.max_response_len, buffer=r.overlong_buffer,
                               factor=r.overlong_penalty_factor) if r.overlong_buffer else None
    if "reward_model" in p:
        reward = group("reward_model", RewardWorker, ScoreSpec(
            model=model_spec(cfg, "reward_model", "value", 3), precision=precision,
            model_weight=r.model_weight, rule_weights=rules, cost_rule=None, function=None,
            tokenizer=tok, overlong=overlong))
    else:
        reward = _rule_group(ctl, plan, RewardWorker, ScoreSpec(
            model=None, precision=precision, model_weight=0.0, rule_weights=rules,
            cost_rule=None, function=r.function, tokenizer=tok, overlong=overlong), "reward")
    cost = None
    if algorithm(cfg.algo.name).cost:
        if "cost_model" in p:
            cost = group("cost_model", CostWorker, ScoreSpec(
                model=model_spec(cfg, "cost_model", "value", 4), precision=precision,
                model_weight=1.0, rule_weights={}, cost_rule=None, function=None,
                tokenizer=tok, overlong=None))  # the cost is the cost model's score
        else:
            rule = CostRule(r.forbidden_digit, r.max_answer_len)
            cost = _rule_group(ctl, plan, CostWorker, ScoreSpec(
                model=None, precision=precision, model_weight=0.0, rule_weights={},
                cost_rule=rule, function=None, tokenizer=tok, overlong=None), "cost")
    roles = Roles(actor=actor, reward=reward, reference=reference, critic=critic,
                  cost_critic=cost_critic, cost=cost, rollout=rollout)
    loop = multi_turn_of(cfg, tokenizer_of(cfg))
    if loop is not None:
        roles.rollout = MultiTurnRollouts(roles.rollout, loop)
    return roles


def rollout_spec(cfg: Config, sync: SyncSpec) -> RolloutSpec:
    """The rollout pool's workers: the actor's architecture in the run's precision."""
    return RolloutSpec(config=llama_config(cfg.actor.model, run_precision(cfg)), sync=sync,
                       rollout=cfg.rollout, init_from=cfg.actor.model.init_from, seed=cfg.seed,
                       lora=cfg.actor.lora.engine_config(),
                       record_routes=cfg.actor.router_replay)


def rollout_pool(ctl: Controller, cfg: Config, plan: WorldPlan, actor: WorkerGroup
                 ) -> RolloutPool:
    """The rollout pool of a disaggregated run, connected to the actor for the weight push
    (the weights go over when the run starts: :meth:`RolloutPool.start`)."""
    a, g = plan.roles["actor"], plan.rollout
    sync = SyncSpec(train=(a.pp, a.tp, a.dp), gen=(g.pp, g.tp, g.dp), train_ranks=a.pool,
                    gen_ranks=g.pool, experts=None if a.ep == 1 else (
                        llama_config(cfg.actor.model).num_experts, a.ep, a.gen_pp, a.gen_tp))
    group = ctl.group(RolloutWorker, g.layout, pool=list(g.pool), name="rollout",
                      args=(rollout_spec(cfg, sync),), values_in_replies=True)
    for call in [actor.connect_rollout(sync), group.connect_actor()]:  # one collective
        call.wait()
    return RolloutPool(group, actor, cfg.algo.max_staleness,
                       functools.partial(sampling_of, cfg, tokenizer=tokenizer_of(cfg)),
                       cfg.iterations)
