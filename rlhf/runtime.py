"""The training loop on the controller: prompts, one program call per iteration, metrics,
checkpoints and resume.

Checkpoint contents (one folder per save, see :mod:`rlhf.checkpoint`)::

    <role>/                         DCP folder: every rank's blocks of the role's weights and
                                    (trained roles) Adam moments and step, by HF name
    state.pt                        next step, prompt-stream position, KL controller, Lagrange
                                    multiplier, controller RNG

The controller only names folders: each rank writes its own blocks (no tensor goes through
the controller or one rank), in a background thread while training goes on
(:class:`Checkpointer`).  Global names and shapes make it layout-free: a run resumes on
another world size or layout, each rank reading the saved chunks that overlap its shards.
Sampling seeds are a pure function of (seed, step), so a resumed run repeats an uninterrupted
run exactly on CPU.
"""

from __future__ import annotations

import os
import shutil
import time

from rlhf.algos import LagrangeMultiplier, make_kl_controller
from rlhf.builders import build_roles, sampling_of, task_of, tokenizer_of
from rlhf.evaluation import Evaluator, evaluation_examples
from rlhf.prompts import encode_prompts, fitting_prompts
from rlhf.checkpoint import (PendingCheckpoint, begin_checkpoint, capture_rng_state,
                             commit_checkpoint, read_state, resolve_resume, restore_rng_state)
from rlhf.config import Config, save_config
from rlhf.controller import Batch, Controller
from rlhf.metrics import MetricsLogger, PhaseTimer, memory_metrics
from rlhf.programs import Iteration, Roles, algorithm
from rlhf.rollout_log import rollout_records, write_rollouts
from rlhf.task import PromptStream, read_dataset
from rlhf.world_plan import WorldPlan


class RunState:
    """Controller-side state that a checkpoint must restore."""

    def __init__(self, cfg: Config, tok, encode=None) -> None:
        a, d = cfg.algo, cfg.data
        source = fitting_prompts(read_dataset(d.train_files, d.prompt_key, d.ground_truth_key),
                                 tok, d.max_prompt_len, "data.train_files", encode) \
            if d.train_files else task_of(cfg)
        self.step = 0
        self.stream = PromptStream(source, seed=cfg.data.seed)
        self.kl_ctrl = make_kl_controller(a.kl_ctrl, a.kl_coef, a.kl_target, a.kl_horizon)
        self.lagrange = LagrangeMultiplier(a.lagrange_init, a.lagrange_lr, a.cost_limit,
                                           a.lagrange_max)

    def state_dict(self) -> dict:
        return {"step": self.step, "stream": self.stream.state_dict(),
                "kl_ctrl": self.kl_ctrl.state_dict(), "lagrange": self.lagrange.state_dict(),
                "rng": capture_rng_state()}

    def load_state_dict(self, s: dict) -> None:
        self.step = int(s["step"])
        self.stream.load_state_dict(s["stream"])
        self.kl_ctrl.load_state_dict(s["kl_ctrl"])
        self.lagrange.load_state_dict(s["lagrange"])
        restore_rng_state(s["rng"])


class Checkpointer:
    """Asynchronous checkpoints of a run, at most one pending.

    :meth:`start` returns once every rank of every role has copied its blocks (then writes
    them in the background); :meth:`finish` waits for the files and makes the checkpoint
    complete (before that a crash leaves only an ignored ``.tmp-`` folder).

    Args:
        roles: the run's worker groups.
        root: checkpoint root folder.
        keep_last: complete checkpoints to keep; 0 keeps all.
    """

    def __init__(self, roles: Roles, root: str, keep_last: int) -> None:
        self.roles, self.root, self.keep_last = roles, root, keep_last
        self._pending: PendingCheckpoint | None = None

    def start(self, state: RunState) -> None:
        """Checkpoint ``state.step``: the controller state now, the roles' blocks in parallel
        (a still pending checkpoint is finished first)."""
        self.finish()
        pending = begin_checkpoint(self.root, state.step, state.state_dict())
        groups = self.roles.checkpointed()
        for call in [g.save_checkpoint(os.path.join(pending.tmp, name))
                     for name, g in groups.items()]:
            call.wait()
        self._pending = pending

    def finish(self) -> str | None:
        """Complete the pending checkpoint (None if there is none); returns its path."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        for call in [g.finish_checkpoint() for g in self.roles.checkpointed().values()]:
            call.wait()
        return commit_checkpoint(pending, self.keep_last)


def save(roles: Roles, state: RunState, root: str, keep_last: int) -> str:
    """A complete checkpoint of ``state.step`` (start and finish at once)."""
    ckpt = Checkpointer(roles, root, keep_last)
    ckpt.start(state)
    return ckpt.finish()


def export_hf(roles: Roles, tok, run_dir: str, merged: bool = False) -> str:
    """The actor as an HF checkpoint (config.json, safetensors, tokenizer files; with LoRA a
    PEFT adapter) in ``<run_dir>/hf/actor``, replaced whole (written beside it, then
    renamed); ``merged``: also the LoRA actor with its adapters merged in ``hf/actor_merged``."""
    def writer(save):
        def write(tmp: str) -> None:
            save(tmp).wait()
            tok.save_files(tmp)
        return write

    if merged:
        _replace_folder(os.path.join(run_dir, "hf", "actor_merged"),
                        writer(roles.actor.save_hf_merged))
    return _replace_folder(os.path.join(run_dir, "hf", "actor"), writer(roles.actor.save_hf))


def _replace_folder(final: str, write) -> str:
    """``write(tmp)`` into a folder beside ``final``, then renamed over it."""
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    old = final + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.isdir(final):
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def restore(roles: Roles, state: RunState, path: str) -> None:
    """Load checkpoint ``path`` into the roles (each rank reads its own chunks) and ``state``."""
    s = read_state(path)
    for call in [g.load_checkpoint(os.path.join(path, name))
                 for name, g in roles.checkpointed().items()]:
        call.wait()
    state.load_state_dict(s)


def next_prompts(cfg: Config, state: RunState, tok) -> Batch:
    """The next ``data.prompts_per_iter`` prompts of the stream, encoded (uids = stream
    positions, so every prompt of the run has its own)."""
    d = cfg.data
    first_uid = state.stream.position
    return encode_prompts(state.stream.next_batch(d.prompts_per_iter), tok, d.max_prompt_len,
                          d.samples_per_prompt, first_uid)


def iteration_of(cfg: Config, state: RunState, tok, timer: PhaseTimer
                 ) -> Iteration:
    return Iteration(algo=cfg.algo, sampling=sampling_of(cfg, state.step, tok),
                     greedy=sampling_of(cfg, state.step, tok, greedy=True), timer=timer,
                     kl_ctrl=state.kl_ctrl, lagrange=state.lagrange,
                     mini_batch_size=cfg.data.mini_batch_size, more_prompts=lambda: next_prompts(cfg, state, tok))


def train(ctl: Controller, cfg: Config, plan: WorldPlan) -> list[dict]:
    """Run ``cfg`` on the controller's job; returns the metric records this process logged."""
    tok = tokenizer_of(cfg)  # cfg passed check_run on every rank before launch (rlhf.train)
    run_dir = cfg.log.run_dir
    root = cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints")
    resume_from = resolve_resume(cfg.checkpoint.resume, root)
    roles = build_roles(ctl, cfg, plan)
    ckpt = Checkpointer(roles, root, cfg.checkpoint.keep_last)
    encode = prompt_encoder(roles)
    state = RunState(cfg, tok, encode)
    held_out = evaluation_examples(cfg, tok, encode)
    val = Evaluator(cfg, tok, held_out) if held_out else None
    if resume_from:
        restore(roles, state, resume_from)
        print(f"[rlhf] resumed from {resume_from} at step {state.step}", flush=True)
    roles.rollout.start(state.step)  # disaggregated: the rollout pool gets the actor's weights
    os.makedirs(run_dir, exist_ok=True)
    save_config(cfg, os.path.join(run_dir, "config.yaml"))
    program = algorithm(cfg.algo.name).program
    records = []
    logger = MetricsLogger(run_dir, cfg.iterations, start_step=state.step,
                           tensorboard=cfg.log.tensorboard, progress=cfg.log.progress)
    # the first record: the starting policy's held-out score (a fresh run only) and the
    # actor's weights per rank (its flat buffer: with the generation slots, if it generates)
    start = val.run(roles, state.step) if val is not None and state.step == 0 else {}
    start["memory/actor_weights_gb"] = max(roles.actor.weight_bytes().get()) / 2**30
    while state.step < cfg.iterations:
        timer = PhaseTimer()
        t0 = time.perf_counter()
        prompts = next_prompts(cfg, state, tok)
        batch, metrics = program(roles, prompts, iteration_of(cfg, state, tok, timer))
        metrics |= roles.rollout.push()  # disaggregated: the new weights go to the rollout pool
        step_s = time.perf_counter() - t0
        ckpt.finish()  # the last save's files were written while this iteration ran
        tokens = int(batch["attention_mask"].sum())
        metrics |= _task_metrics(batch) | timer.metrics() | {
            "timing_s/reshard": float(batch.meta.get("reshard_s", 0.0)),
            "reshard/bytes": float(batch.meta.get("reshard_bytes", 0)),
            "timing_s/step": step_s, "perf/throughput_tokens_per_s": tokens / step_s,
            "perf/tokens": tokens}
        metrics |= start
        if val is not None and val.due(state.step):
            metrics |= val.run(roles, state.step)
        metrics |= memory_metrics(ctl.take_memory())  # this iteration's phases, evaluation too
        start = {}
        records.append(logger.log(state.step, metrics))
        every = cfg.log.rollouts_every
        if every and state.step % every == 0:
            write_rollouts(run_dir, state.step, rollout_records(batch, tok))
        state.step += 1
        every = cfg.checkpoint.save_every
        if (every and state.step % every == 0) or state.step == cfg.iterations:
            ckpt.start(state)
            export_hf(roles, tok, run_dir,
                      merged=cfg.log.export_merged and bool(cfg.actor.lora.rank))
    ckpt.finish()
    logger.close(plot=cfg.log.plot)
    return records


def prompt_encoder(roles: Roles):
    """How the run renders a row's prompt: with the row's tools on a multi-turn run; None
    (the tokenizer's ``encode_prompt``) otherwise."""
    loop = getattr(roles.rollout, "loop", None)
    return loop.example_prompt_ids if loop is not None else None


def _task_metrics(batch: Batch) -> dict[str, float]:
    out = {"reward/mean": float(batch["scores"].mean()),
           "response/length_mean": float(batch["response_mask"].float().sum(1).mean())}
    for k, v in batch.tensors.items():
        if k.startswith("reward/"):
            out[f"{k}/mean"] = float(v.float().mean())
    if "advantages" in batch.tensors:
        m = batch["response_mask"].float()
        out["adv/mean"] = float((batch["advantages"] * m).sum() / m.sum().clamp(min=1))
    return out
