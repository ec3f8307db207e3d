"""Time to reward: our GRPO against TRL's GRPOTrainer, held-out accuracy against wall time.

    python bench/learning.py [--budget-s 10] [--nproc 2] [--points 20] [--json PATH]
                             [--png PATH] [--work DIR] [--model smollm2-135m] [key=value ...]

``--model smollm2-135m``: the real pretrained checkpoint (:mod:`rlhf.real_model`) instead of
the main job's tiny SFT policy, on chat prompts that ask for the sum of two numbers from 1 to
99 with the number only (examples/real_model: training rows and disjoint held-out rows, the
reward 1 when the response's last number is the sum), the real main job's GRPO settings
(:data:`rlhf.real_job.GRPO`).
Both sides read the same rows in the same order (our prompt stream), TRL's as conversational
prompts through the same chat template, and are scored by the same reward file.

Both sides start from the main job's SFT checkpoint (``rlhf.main_job.warm_start()``: both SFT
phases, built once and cached in runs/cache) and run the main job's GRPO settings
(``rlhf.main_job.RL_OVERRIDES`` plus the ``key=value`` arguments) on the same 2 cores: ours as
``--nproc`` torchrun ranks of one thread each, TRL as one process of ``--nproc`` threads
(HF_HUB_OFFLINE=1).  TRL's settings are derived from the same run config
(:func:`trl_settings`): same prompts in the same order, prompts per generation, samples per
prompt, temperature, max response length, sequences per optimizer step, epochs, lr (constant),
Adam, gradient clipping, clip ratio, KL coefficient (0 when ours has no KL loss), group std
normalisation, loss aggregation, fp32 and the same rule reward (our ``CompositeReward``).

Time axis, one rule for both: the sum of the iterations' wall times -- ours each iteration's
prompts + program call (generation, reference, reward, update: ``timing_s/step`` of a run),
TRL each optimizer step from ``on_step_begin`` to ``on_step_end`` (generation, reference,
reward, update).  Process start-up, model loading and every save and evaluation are outside.
Each side stops at the first iteration that ends past ``--budget-s``, and saves its policy (an
HF folder) at the first iteration ending past each of ``--points`` equal fractions of it.

One evaluator for both, after both runs: greedy decoding (HF ``generate``, prompts of one
length per batch, so no padding) of ``task_of(cfg).heldout_examples(data.val_size)``, exact
match of the response before ``<eos>`` (:func:`heldout_accuracy`).  The SFT checkpoint is the
point at time 0 of both curves; it is also scored by our engine's evaluator in our worker
(``evaluator_check``: the two must agree).

Speedup = the time TRL takes to reach its final accuracy / the time ours takes to reach the
same accuracy, each the first crossing of the curve interpolated linearly between points;
null (with the reason and ``speedup_at_most``) when ours never reaches it or when TRL ends no
higher than it started.  Writes ``{"ours", "trl", "speedup", ...}`` (hyperparameters of both
sides included) to ``--json`` and the curves to ``--png``; prints one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # run as a script (or by torchrun): the repo root importable
    sys.path.insert(0, ROOT)

from bench.peers import require_peer  # noqa: E402
from bench.report import write_json  # noqa: E402
from rlhf.real_model import NAME as REAL_MODEL  # noqa: E402

# our loss_agg_mode -> TRL's loss_type with the same normalisation (one process, no grad accum)
TRL_LOSS_TYPE = {"token-mean": "dapo", "seq-mean-token-mean": "grpo",
                 "seq-mean-token-sum-norm": "dr_grpo"}
MIN_TRL_STEP_S = 0.02  # sizes TRL's dataset: more optimizer steps than the budget can hold


# The run's settings ----------------------------------------------------------------------------
def main_job_settings() -> tuple[str, list[str], str]:
    """``(sft_dir, rl_overrides, source)`` of :mod:`rlhf.main_job`."""
    from rlhf import main_job

    return main_job.SFT_DIR, list(main_job.RL_OVERRIDES), "rlhf.main_job.RL_OVERRIDES"




def real_model_settings(work: str) -> tuple[str, list[str], str]:
    """``(model_dir, rl_overrides, source)`` of ``--model smollm2-135m``: the converted
    checkpoint, the main job's GRPO settings on it and the example's rows written under
    ``work``."""
    from rlhf import real_job

    model, rows = real_job.prepare(os.path.join(work, "data"),
                                   os.path.join(ROOT, real_job.DEFAULT_DIR))
    return model, [*real_job.GRPO, *rows], "rlhf.real_job.GRPO"


def bench_overrides(rl: list[str], extra: list[str], sft_dir: str, work: str) -> list[str]:
    """The run config of both sides: the main job's, the user's, then the bench's own (no
    logging, checkpoints or evaluation inside the run; iterations bounded by the budget).  Our
    actor trains data-parallel (the main job's TP=2 shows the reshard on 4 ranks; on 2 ranks
    of this tiny model TP only adds gloo all-reduces per layer), overridable as any key."""
    return [*rl, "actor.layout={pp: 1, tp: 1, dp: 0, gen_tp: 1}", *extra, f"actor.model.init_from={sft_dir}", "iterations=1000000",
            "eval_every=0", "eval_pass_k=0", f"log.runs_dir={work}", "log.run_name=ours",
            "log.tensorboard=false", "log.progress=false", "log.plot=false",
            "checkpoint.resume=never", "checkpoint.save_every=0"]


def trl_settings(cfg) -> tuple[dict, list[str]]:
    """GRPOConfig arguments equal to ``cfg``'s GRPO settings, and notes on what differs."""
    a, d, o, loss = cfg.algo, cfg.data, cfg.actor.optim, cfg.actor.loss
    builtin = cfg.reward.kind == "rule" and d.train_files is None
    rows = cfg.reward.kind == "function" and d.train_files is not None \
        and d.val_files is not None
    if a.name != "grpo" or not (builtin or rows):
        raise ValueError(f"bench.learning compares GRPO on the built-in task with a rule "
                         f"reward, or on data files with a reward function and held-out files; "
                         f"got algo.name={a.name!r}, reward.kind={cfg.reward.kind!r}, "
                         f"data.train_files={d.train_files!r}, data.val_files={d.val_files!r}")
    if loss.loss_agg_mode not in TRL_LOSS_TYPE:
        raise ValueError(f"actor.loss.loss_agg_mode={loss.loss_agg_mode!r} has no TRL "
                         f"loss_type; use one of {sorted(TRL_LOSS_TYPE)}")
    notes = []
    if a.kl_mode == "reward":
        notes.append("ours puts the KL in the reward, TRL in the loss (beta = algo.kl_coef)")
    if a.kl_mode != "none" and a.kl_coef and a.kl_estimator != "k3":
        notes.append(f"ours uses the {a.kl_estimator} KL estimator, TRL k3")
    if loss.entropy_coeff:
        notes.append(f"ours has entropy_coeff={loss.entropy_coeff}, TRL none")
    if loss.mode not in (None, "vanilla"):
        notes.append(f"ours uses the {loss.mode!r} policy loss, TRL the clipped one")
    if cfg.reward.overlong_buffer:
        notes.append("ours has an overlong penalty, TRL none")
    low = loss.clip_ratio if loss.clip_ratio_low is None else loss.clip_ratio_low
    high = loss.clip_ratio if loss.clip_ratio_high is None else loss.clip_ratio_high
    kw = dict(
        per_device_train_batch_size=d.mini_batch_size,  # sequences per optimizer step
        gradient_accumulation_steps=1, steps_per_generation=d.num_mini_batches,
        num_generations=d.samples_per_prompt, num_iterations=a.epochs,
        max_completion_length=d.max_response_len, temperature=d.temperature, top_p=1.0,
        top_k=0, learning_rate=o.lr, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=o.betas[0], adam_beta2=o.betas[1], adam_epsilon=o.eps,
        weight_decay=o.weight_decay, max_grad_norm=o.max_grad_norm or 0.0,
        beta=a.kl_coef if a.kl_mode != "none" else 0.0, epsilon=low, epsilon_high=high,
        scale_rewards="group" if a.norm_adv_by_std else "none",
        loss_type=TRL_LOSS_TYPE[loss.loss_agg_mode], mask_truncated_completions=False,
        bf16=False, seed=cfg.seed)
    return kw, notes


class BudgetClock:
    """One side's training time (the sum of its iterations' wall times) and the marks --
    ``points`` equal fractions of ``budget_s`` -- at which it saves its policy."""

    def __init__(self, budget_s: float, points: int) -> None:
        self.budget_s, self.elapsed, self.step_s = budget_s, 0.0, []
        self.marks = [budget_s * (i + 1) / points for i in range(points)]

    def tick(self, dt: float) -> bool:
        """Count an iteration of ``dt`` seconds; True when it passed a mark (save now)."""
        self.elapsed += dt
        self.step_s.append(dt)
        passed = bool(self.marks) and self.elapsed >= self.marks[0]
        while self.marks and self.elapsed >= self.marks[0]:
            self.marks.pop(0)
        return passed

    @property
    def done(self) -> bool:
        return self.elapsed >= self.budget_s

    def save_record(self, folder: str) -> dict:
        return {"step": len(self.step_s), "time_s": self.elapsed, "folder": folder}


# Our side (rank 0 of a torchrun job) -----------------------------------------------------------
def ours_worker(spec: dict) -> None:
    from rlhf.controller import run
    from rlhf.train import validated

    cfg, plan = validated(spec["overrides"])
    code = run(lambda ctl: _ours_program(ctl, cfg, plan, spec))
    sys.stdout.flush()
    os._exit(code)  # as rlhf.train: no teardown of live gloo groups


def _ours_program(ctl, cfg, plan, spec: dict) -> None:
    from rlhf.builders import build_roles, tokenizer_of
    from rlhf.evaluation import Evaluator, evaluation_examples
    from rlhf.metrics import PhaseTimer
    from rlhf.programs import algorithm
    from rlhf.runtime import RunState, iteration_of, next_prompts

    tok = tokenizer_of(cfg)
    roles = build_roles(ctl, cfg, plan)
    state, program = RunState(cfg, tok), algorithm(cfg.algo.name).program
    start = Evaluator(cfg, tok, evaluation_examples(cfg, tok)).run(roles, 0)
    clock, saves, rewards = BudgetClock(spec["budget_s"], spec["points"]), [], []
    while not clock.done:  # rlhf.runtime.train's iteration, timed the same way
        t0 = time.perf_counter()
        prompts = next_prompts(cfg, state, tok)
        batch, _ = program(roles, prompts, iteration_of(cfg, state, tok, PhaseTimer()))
        state.step += 1
        if clock.tick(time.perf_counter() - t0):
            folder = os.path.join(spec["out"], f"step{state.step}")
            roles.actor.save_hf(folder).wait()
            saves.append(clock.save_record(folder))
        rewards.append(float(batch["scores"].mean()))
    with open(os.path.join(spec["out"], "result.json"), "w") as f:
        json.dump({"saves": saves, "step_s": clock.step_s, "reward_mean": rewards,
                   "engine_accuracy_at_0": start["val/accuracy"]}, f)


# TRL's side (its own process) ------------------------------------------------------------------
def trl_worker(spec: dict) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf.builders import task_of
    from rlhf.config import load_config
    from rlhf.prompts import fitting_prompts
    from rlhf.task import CompositeReward, PromptStream, read_dataset
    from rlhf.task.hf_tokenizer import HFTokenizer
    from rlhf.task.reward_fn import load_function

    torch.set_num_threads(spec["threads"])
    cfg, kw = load_config(spec["overrides"]), spec["trl_args"]
    per_gen = kw["steps_per_generation"] * kw["num_iterations"]  # optimizer steps a rollout
    max_steps = math.ceil(spec["budget_s"] / MIN_TRL_STEP_S / per_gen) * per_gen
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    count = max_steps // per_gen * cfg.data.prompts_per_iter
    if cfg.data.train_files is None:  # the built-in task and its rule reward
        stream = PromptStream(task_of(cfg), seed=cfg.data.seed)  # ours' prompts, in ours' order
        data = Dataset.from_list([{"prompt": "<bos>" + e.prompt, "answer": e.answer}
                                  for e in stream.next_batch(count)])
        reward = CompositeReward.from_weights(cfg.reward.rule_weights)

        def rule_reward(completions, answer, **_):
            return reward(completions, answer).total.tolist()
    else:  # data rows (chat prompts: TRL renders them with the same template) and a function
        rows = fitting_prompts(read_dataset(cfg.data.train_files), HFTokenizer(spec["model"]),
                               cfg.data.max_prompt_len, "data.train_files")
        stream = PromptStream(rows, seed=cfg.data.seed)
        data = Dataset.from_list([{"prompt": e.prompt, "answer": e.answer,
                                   "data_source": e.data_source}
                                  for e in stream.next_batch(count)])
        score = load_function(cfg.reward.function)

        def rule_reward(completions, answer, data_source, **_):
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            return [float(score(d, t, a)) for t, a, d in zip(texts, answer, data_source)]

    clock, saves = BudgetClock(spec["budget_s"], spec["points"]), []

    class Budget(TrainerCallback):
        def on_step_begin(self, args, state, control, **_):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **_):
            if clock.tick(time.perf_counter() - self.t0):
                folder = os.path.join(spec["out"], f"step{state.global_step}")
                model.save_pretrained(folder)
                saves.append(clock.save_record(folder))
            control.should_training_stop = clock.done

    args = GRPOConfig(output_dir=os.path.join(spec["out"], "trainer"), use_cpu=True,
                      max_steps=max_steps, logging_steps=1, save_strategy="no",
                      report_to="none", shuffle_dataset=False, dataloader_num_workers=0,
                      disable_dropout=True, disable_tqdm=True, **kw)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(spec["model"]),
                          reward_funcs=rule_reward, args=args, train_dataset=data,
                          processing_class=tokenizer,
                          callbacks=[Budget()])
    trainer.train()
    effective = {k: getattr(args, k) for k in [*kw, "generation_batch_size", "optim",
                                                "top_entropy_quantile", "importance_sampling_level",
                                                "repetition_penalty", "disable_dropout"]}
    with open(os.path.join(spec["out"], "result.json"), "w") as f:
        json.dump({"saves": saves, "step_s": clock.step_s, "effective_args": effective,
                   "reward_mean": [h["reward"] for h in trainer.state.log_history
                                   if "reward" in h]}, f, default=str)


# One evaluator for both ------------------------------------------------------------------------
def heldout_accuracy(folder: str, examples, tok, max_new_tokens: int, correct=None) -> float:
    """Greedy accuracy of the HF checkpoint ``folder`` on ``examples``: prompts grouped by
    token length (no padding), responses cut at the first EOS, judged by ``correct(example,
    response) -> bool`` (default: exact match of the answer)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from rlhf.task import exact_match

    correct = correct or (lambda e, text: exact_match(text, e.answer) >= 1)

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                           eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    groups: dict[int, list] = {}
    for e in examples:
        ids = tok.encode_prompt(e.prompt)
        groups.setdefault(len(ids), []).append((ids, e))
    hits = 0
    with torch.no_grad():
        for rows in groups.values():
            ids = torch.tensor([r[0] for r in rows])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
            hits += sum(bool(correct(e, tok.decode_response(r)))
                        for r, (_, e) in zip(out[:, ids.shape[1]:], rows))
    return hits / len(examples)


def time_to_reach(times: list[float], accs: list[float], target: float) -> float | None:
    """First time the piecewise-linear curve reaches ``target`` (None: never)."""
    for i, (t, acc) in enumerate(zip(times, accs)):
        if acc >= target - 1e-9:
            if i == 0:
                return t
            t0, a0 = times[i - 1], accs[i - 1]
            return t0 + (target - a0) / (acc - a0) * (t - t0)
    return None


def speedup_of(ours: dict, trl: dict) -> tuple[float | None, dict]:
    target, start = trl["accuracy"][-1], trl["accuracy"][0]
    t_trl = time_to_reach(trl["time_s"], trl["accuracy"], target)
    t_ours = time_to_reach(ours["time_s"], ours["accuracy"], target)
    detail = {"target_accuracy": target, "trl_time_s": t_trl, "ours_time_s": t_ours}
    if target <= start:
        return None, detail | {"reason": f"TRL ended at accuracy {target:.3f}, not above the "
                                          f"SFT start {start:.3f}: no time to reward to compare"}
    if t_ours is None:
        return None, detail | {
            "reason": f"ours never reached TRL's final accuracy {target:.3f} within "
                      f"{ours['time_s'][-1]:.1f} s", "speedup_at_most": t_trl / ours["time_s"][-1]}
    return t_trl / t_ours, detail


# Driver ----------------------------------------------------------------------------------------
def run_side(name: str, cmd: list[str], env: dict, log: str) -> None:
    with open(log, "w") as f:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT
                              ).returncode
    if code != 0:
        with open(log) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"{name} failed (exit code {code}); end of {log}:\n{tail}")


def trl_model_folder(sft_dir: str, folder: str) -> None:
    """The SFT checkpoint with what TRL needs: ``architectures`` (its reference model) and
    the CharTokenizer as transformers tokenizer files (:func:`bench.e2e.make_trl_ready`)."""
    from bench.e2e import make_trl_ready
    from rlhf.task import CharTokenizer

    os.makedirs(folder)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(sft_dir, name), folder)
    make_trl_ready(folder, CharTokenizer.load(os.path.join(sft_dir, "tokenizer.json")))


def curve(side: dict, start_acc: float, score) -> dict:
    saves = side.pop("saves")
    return {"time_s": [0.0] + [s["time_s"] for s in saves],
            "accuracy": [start_acc] + [score(s["folder"]) for s in saves],
            "iterations": [0] + [s["step"] for s in saves],
            "train_time_s": sum(side["step_s"]), "iterations_run": len(side["step_s"]), **side}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, label in (("ours", "ours (GRPO)"), ("trl", "TRL GRPOTrainer")):
        ax.plot(result[name]["time_s"], result[name]["accuracy"], "o-", label=label)
    d = result["speedup_detail"]
    ax.axhline(d["target_accuracy"], color="gray", ls="--", lw=0.8, label="TRL's final")
    s = result["speedup"]
    ax.set(xlabel="training wall time (s)", ylabel="held-out greedy accuracy",
           title=f"time to reward, {result['nproc']} cores: speedup "
                 + (f"{s:.1f}x" if s is not None else "n/a"))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(budget_s: float = 10.0, nproc: int = 2, points: int = 20, overrides=(),
        sft_dir: str | None = None, work: str | None = None, model: str | None = None) -> dict:
    """Both runs and their evaluation; the result dict (see the module docstring).

    Args:
        budget_s: training seconds per side.
        nproc: our ranks = TRL's threads.
        points: saves (and evaluations) per side after time 0, at equal fractions of budget_s.
        overrides: extra ``key=value`` run-config overrides, after main_job's RL_OVERRIDES.
        sft_dir: an existing SFT checkpoint to start from (None: main_job's, built if needed).
        work: a new folder that keeps the runs and checkpoints (None: a temporary one).
        model: None (the main job's tiny model from its SFT checkpoint) or ``"smollm2-135m"``
            (the real checkpoint on the real-model example's rows and reward).
    """
    if budget_s <= 0 or points < 1 or nproc < 1:
        raise ValueError(f"need budget_s > 0, points >= 1, nproc >= 1; got budget_s={budget_s}, "
                         f"points={points}, nproc={nproc}")
    if work is None:
        with tempfile.TemporaryDirectory() as tmp:
            return run(budget_s, nproc, points, overrides, sft_dir, tmp, model)
    import torch
    from transformers.utils import logging as hf_logging

    from rlhf.builders import task_of
    from rlhf.config import load_config
    from rlhf.task import CharTokenizer, read_dataset
    from rlhf.task.hf_tokenizer import HFTokenizer
    from rlhf.task.reward_fn import load_function

    if model not in (None, REAL_MODEL):
        raise ValueError(f"model={model!r}: choose None (the main job's) or {REAL_MODEL!r}")
    work = os.path.abspath(work)
    os.makedirs(work, exist_ok=True)
    real = model == REAL_MODEL
    if real:
        sft_dir, rl, source = real_model_settings(work)
    else:
        main_sft, rl, source = main_job_settings()
    build_sft = sft_dir is None
    sft_dir = os.path.join(ROOT, main_sft) if build_sft else os.path.abspath(sft_dir)
    overrides = bench_overrides(rl, list(overrides), sft_dir, work)
    cfg = load_config(overrides)
    if not cfg.data.val_size:
        raise ValueError("data.val_size=0: the comparison needs held-out problems")
    trl_args, notes = trl_settings(cfg)
    if build_sft:  # built once, then reused (rlhf.sft caches by settings)
        run_side("SFT", [sys.executable, "-c", "from rlhf.main_job import warm_start; "
                         "warm_start()"], dict(os.environ), os.path.join(work, "sft.log"))
    if real:  # an HF folder with its tokenizer: TRL takes it as it is
        trl_model = sft_dir
    else:
        trl_model = os.path.join(work, "model")
        trl_model_folder(sft_dir, trl_model)
    common = {"budget_s": budget_s, "points": points, "overrides": overrides}
    sides = {}
    for name, env, extra in (
            ("ours", {"OMP_NUM_THREADS": "1"}, {}),
            ("trl", {"OMP_NUM_THREADS": str(nproc), "HF_HUB_OFFLINE": "1",
                     "TRANSFORMERS_OFFLINE": "1"},
             {"model": trl_model, "threads": nproc, "trl_args": trl_args})):
        out = os.path.join(work, name)
        os.makedirs(out)
        spec = os.path.join(work, f"{name}_spec.json")
        with open(spec, "w") as f:
            json.dump({**common, **extra, "out": out}, f)
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                  f"--nproc_per_node={nproc}"] if name == "ours" else [sys.executable]
        load = os.getloadavg()[0]
        run_side(name, [*launch, os.path.abspath(__file__), f"--{name}-worker", spec],
                 dict(os.environ, **env), os.path.join(work, f"{name}.log"))
        with open(os.path.join(out, "result.json")) as f:
            sides[name] = json.load(f)
        # other processes on the cores distort the times (TRL's threads the most): record it
        sides[name]["load_avg_1m_before_after"] = [load, os.getloadavg()[0]]
    torch.set_num_threads(nproc)
    hf_logging.disable_progress_bar()
    if real:
        tok = HFTokenizer(sft_dir)
        examples = read_dataset(cfg.data.val_files)
        reward = load_function(cfg.reward.function)

        def correct(e, text: str) -> bool:
            return float(reward(e.data_source, text, e.answer)) >= 1
    else:
        tok = CharTokenizer.load(os.path.join(sft_dir, "tokenizer.json"))
        examples = task_of(cfg).heldout_examples(cfg.data.val_size)
        correct = None

    def score(folder: str) -> float:
        return heldout_accuracy(folder, examples, tok, cfg.data.max_response_len, correct)

    start = score(sft_dir)
    engine_start = sides["ours"].pop("engine_accuracy_at_0")
    ours, trl = (curve(sides[k], start, score) for k in ("ours", "trl"))
    speedup, detail = speedup_of(ours, trl)
    ours["hyperparameters"] = {k: v for k, v in dataclasses.asdict(cfg).items()
                               if k not in ("log", "checkpoint")}
    trl["hyperparameters"] = trl.pop("effective_args") | {
        "threads": nproc, "max_steps": "budget-bound (a callback stops at budget_s)"}
    return {"ours": ours, "trl": trl, "speedup": speedup, "speedup_detail": detail,
            "goal": ">= 2x", "budget_s": budget_s, "points": points, "nproc": nproc,
            "heldout_size": len(examples), "sft_dir": sft_dir,
            "sft_built_by": "rlhf.main_job.warm_start" if build_sft else "given",
            "model": model or "main job (tiny, SFT)",
            "overrides": overrides, "overrides_source": source, "mapping_notes": notes,
            "evaluator": "HF generate, greedy, one batch per prompt length; "
                         + (f"{cfg.reward.function} >= 1" if real else "exact match"),
            "evaluator_check": {"hf_generate_at_0": start, "ours_engine_at_0": engine_start,
                                "agree": abs(start - engine_start) < 1e-9},
            "time_axis": "sum of per-iteration wall times (ours: prompts + program call; TRL: "
                         "on_step_begin..on_step_end); start-up, loading, saves and "
                         "evaluation excluded on both sides"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-s", type=float, default=10.0, help="training seconds per side")
    p.add_argument("--nproc", type=int, default=2, help="our ranks = TRL's threads")
    p.add_argument("--points", type=int, default=20, help="evaluations after time 0")
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    p.add_argument("--work", default=None, help="keep the runs and checkpoints here")
    p.add_argument("--sft-dir", default=None,
                   help="start from this SFT checkpoint instead of main_job's (not rebuilt)")
    p.add_argument("--model", choices=[REAL_MODEL], default=None,
                   help="the real checkpoint on the real-model example's rows and reward")
    p.add_argument("--ours-worker", metavar="SPEC", help=argparse.SUPPRESS)
    p.add_argument("--trl-worker", metavar="SPEC", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="extra key=value run-config overrides")
    a = p.parse_args()
    for flag, worker in ((a.ours_worker, ours_worker), (a.trl_worker, trl_worker)):
        if flag:
            with open(flag) as f:
                return worker(json.load(f))
    if a.work and os.path.exists(a.work):
        raise ValueError(f"--work {a.work} exists; give a new folder")
    require_peer("trl", "bench/learning.py")
    result = run(a.budget_s, a.nproc, a.points, a.overrides, a.sft_dir, a.work, a.model)
    write_json(result, a.json)
    if a.png:
        plot(result, a.png)
    o, t, s = result["ours"], result["trl"], result["speedup"]
    print(f"[learning] {a.budget_s:.0f} s on {a.nproc} cores, {result['heldout_size']} held-out: "
          f"ours {o['accuracy'][0]:.3f}->{o['accuracy'][-1]:.3f} ({o['iterations_run']} it), "
          f"TRL {t['accuracy'][0]:.3f}->{t['accuracy'][-1]:.3f} ({t['iterations_run']} steps); "
          + (f"speedup {s:.2f}x (goal >= 2x)" if s is not None
             else f"speedup n/a: {result['speedup_detail']['reason']}"), flush=True)


if __name__ == "__main__":
    main()
