"""End-to-end GRPO throughput: our runtime against TRL's GRPOTrainer, in one run.

    python bench/e2e.py [--shape tiny|small|qwen2.5-0.5b|smollm2-135m] [--nproc 2]
                        [--steps 8] [--prompts P] [--samples S] [--tp 1] [--rounds 3]
                        [--micro-batch M]
                        [--device cpu|cuda] [--precision fp32|bf16] [--json PATH]
    python bench/e2e.py --placement disaggregated --max-staleness 1 --nproc 4 [--steps 30]
                        (our async run on a rollout pool vs our colocated synchronous run:
                        bench/e2e_async.py)
    python bench/e2e.py --multi-turn [--nproc 2] [--steps 8] [--rounds 3] [--tool-latency-s S]
                        (multi-turn GRPO with a tool vs single-turn GRPO generating as many
                        tokens: bench/e2e_multi_turn.py)

``--shape tiny`` (the figures of record): the GRPO recipe's actor (2 layers, hidden 64,
24-token character vocabulary, seeded weights saved to a local HF folder, nothing
downloaded), addition prompts of 8 tokens, responses up to 6 tokens, exact-match reward.
``--shape small`` (bench/shapes.py): a seeded Qwen2-style model of 12.6M parameters with an
8,192-token BPE built here, prompts of exactly 64 tokens cut from the bench corpus (a JSONL
file our runtime reads through ``data.train_files``), responses of exactly 128 tokens on both
sides (EOS masked until then: ``data.min_new_tokens`` for ours, HF's ``min_new_tokens`` in
TRL's ``generation_kwargs``; checked) and a word-list reward computed by the same function on
both sides (bench/e2e_small.py).  ``--shape smollm2-135m``: the real checkpoint
SmolLM2-135M-Instruct where its package is installed (bench/real_checkpoint.py; the JSON's
``real_weights``), its own tokenizer, chat prompts asking for the sum of two numbers (a JSONL
file both sides read; rendered by the checkpoint's chat template), responses of up to 64 tokens
that end at EOS on both sides, and a reward of 1 where the response's last number is the sum
(one function on both sides); 8 prompts x 4 samples by default; without the package, seeded
weights of its sizes, as ``small``.  ``tiny`` and ``small``: 16 prompts x 4 samples by
default (the shape's row).  All shapes: temperature 1, KL to a reference model as a loss (k3,
coefficient 0.01), fp32, constant lr, one optimizer step per iteration, the rollout's own
log-probs as the old policy's (TRL takes them from its loss forward), and the same cores:
ours as ``--nproc`` gloo ranks of one thread each (actor training tp ``--tp``, the rest data
parallel), TRL as one process with ``--nproc`` threads (past ``tiny`` without gradient
checkpointing, which ours does not do either; ``tiny`` keeps TRL's default).

Tokens/s = (prompt + response tokens, padding excluded) / wall time of one iteration
(generation, reference, reward, update), median over the iterations after the first
(warm-up); each contender runs ``--rounds`` times, alternating with the other, and the
medians of the runs are compared.  Time per phase (median seconds per iteration): ours from
its metrics.jsonl (``timing_s/*``), TRL's from timers around its generation, reference
forward, reward and loss/update.  Prints and optionally writes ``{"ours_tokens_per_s",
"trl_tokens_per_s", "ratio", "ours_phases_s", "trl_phases_s", "rounds", "shape",
"real_weights", "argv"}``.
``--device cuda`` (``--precision`` bf16 by default there, :func:`bench.timing.bench_device`):
our ranks run with ``device=cuda precision=bf16`` (one GPU: ``--nproc 1``), TRL's trainer on
the same GPU (``use_cpu=False``, ``bf16=True``, the model loaded in bfloat16), generation
through transformers' ``generate`` (no vLLM) with the dynamic cache TRL uses by default; its
phase timers synchronise the device before reading the clock.  ``--shape qwen2.5-0.5b``
(Qwen2.5-0.5B's sizes, random weights) is the GPU shape: 16 prompts x 8 samples, prompts of
64 tokens, responses of exactly 512, as ``small`` otherwise.  ``--micro-batch M``: sequences
per forward/backward on each side (ours ``data.micro_batch_size``, TRL
``per_device_train_batch_size`` with gradient accumulation over the iteration's sequences: one
optimizer step per iteration on both sides); default the whole rank's share of the iteration.
The JSON's ``device`` names the card.
TRL is an optional dev dependency (``pip install -r requirements-dev.txt``); HF_HUB_OFFLINE=1
is set for it.  On a machine shared with other jobs, ``OMP_WAIT_POLICY=PASSIVE`` in the
environment (both sides inherit it) keeps TRL's OpenMP threads from spin-waiting, which on
oversubscribed cores slows HF generation down by several times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench import e2e_async, e2e_multi_turn  # noqa: E402
from bench.peers import require_peer  # noqa: E402
from bench.real_checkpoint import REWARD_FILE as REAL_REWARD_FILE  # noqa: E402
from bench.real_checkpoint import checkpoint_folder  # noqa: E402
from bench.report import emit_json  # noqa: E402
from bench.shapes import add_shape_argument, get_shape  # noqa: E402
from bench.timing import BenchDevice, add_device_arguments, bench_device  # noqa: E402

RESPONSE_LEN, PROMPT_LEN, KL_COEF, LR = 6, 8, 0.01, 1e-4
NPROC = 2
"""``--nproc`` against TRL: our ranks, TRL's threads."""
REWARD_FILE = os.path.join(ROOT, "bench", "e2e_small.py")
CPU = BenchDevice(torch.device("cpu"), "fp32")


@dataclass(frozen=True)
class Contest:
    """What both contenders run on.

    Attributes:
        shape: the ``--shape`` name.
        folder: HF checkpoint folder with its tokenizer.
        prompt_len / response_len: tokens per prompt (at most) and per response (at most;
            exactly, for the seeded shapes past ``tiny``: both sides get min-new-tokens =
            response_len).
        prompts_file: JSONL of prompts (past ``tiny``); None = the built-in addition task.
        checkpoint: the real checkpoint's folder, which ``folder`` links to (its chat
            prompts of sums and their reward); None: seeded weights.
        device / precision: where both sides run (``cpu``/``cuda``) and in what (``fp32``/
            ``bf16``).
        micro_batch: sequences per forward/backward on a rank (None: the rank's whole share).
    """

    shape: str
    folder: str
    prompt_len: int
    response_len: int
    prompts_file: str | None = None
    device: str = "cpu"
    precision: str = "fp32"
    micro_batch: int | None = None
    checkpoint: str | None = None

    @property
    def exact_lengths(self) -> bool:
        """Every response must have ``response_len`` tokens (checked on both sides); with a
        real checkpoint responses end at its EOS instead."""
        return self.prompts_file is not None and self.checkpoint is None

    @property
    def reward_file(self) -> str | None:
        """The file of the reward both sides compute (None: the addition task's own)."""
        if self.prompts_file is None:
            return None
        return REWARD_FILE if self.checkpoint is None else REAL_REWARD_FILE


def make_model(folder: str) -> None:
    """Seeded weights of the GRPO recipe's actor + a transformers tokenizer, in ``folder``."""
    from engine.hf_interop import save_hf_checkpoint
    from hybridflow_comm.groups import build_hybrid_groups
    from hybridflow_comm.layout import HybridLayout, ParallelLayout
    from rlhf.task import CharTokenizer
    from rlhf.workers.common import build_model
    from rlhf.workers.specs import ModelSpec

    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    spec = ModelSpec(config=model_config("tiny"), head="lm", init_from=None, seed=0,
                     fresh_head=False, lora=None, lora_init_from=None)
    save_hf_checkpoint(build_model(spec, groups), folder)
    make_trl_ready(folder, CharTokenizer.build())


def make_trl_ready(folder: str, tok) -> None:
    """What TRL needs beside our HF checkpoint in ``folder``: ``architectures`` in its
    config.json (TRL builds its reference model from it) and the CharTokenizer ``tok`` as
    transformers tokenizer files."""
    from transformers import PreTrainedTokenizerFast

    with open(os.path.join(folder, "config.json")) as f:
        hf = json.load(f)
    hf["architectures"] = ["LlamaForCausalLM"]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f)
    PreTrainedTokenizerFast(tokenizer_object=tok.tok, bos_token="<bos>", eos_token="<eos>",
                            pad_token="<pad>", unk_token="<unk>",
                            padding_side="left").save_pretrained(folder)


def model_config(shape_name: str):
    """The :class:`engine.llama_spec.LlamaConfig` of the checkpoint :func:`prepare` writes:
    the GRPO recipe's actor at ``tiny``, the table's row otherwise."""
    if shape_name != "tiny":
        return get_shape(shape_name, rl=True).llama_config()
    from rlhf.config import load_config
    from rlhf.model_arch import llama_config

    return llama_config(load_config(["algo=grpo"]).actor.model)


def contest(shape_name: str, work: str, device: str = "cpu", precision: str = "fp32",
            micro_batch: int | None = None) -> Contest:
    """What ``shape_name`` runs on, its files named under ``work`` (:func:`prepare` writes
    them); the shape's real checkpoint where it has one and it is available."""
    folder = os.path.join(work, "model")
    run_on = dict(device=device, precision=precision, micro_batch=micro_batch)
    if shape_name == "tiny":
        return Contest("tiny", folder, PROMPT_LEN, RESPONSE_LEN, **run_on)
    shape = get_shape(shape_name, rl=True)
    return Contest(shape_name, folder, shape.prompt_len, shape.response_len,
                   os.path.join(work, "prompts.jsonl"), checkpoint=checkpoint_folder(shape),
                   **run_on)


def prepare(c: Contest, prompts: int, steps: int) -> None:
    """Write the model (in ``c.precision``), tokenizer and (past ``tiny``) the prompts of
    ``c``; a real checkpoint is linked, not copied."""
    if c.prompts_file is None:
        make_model(c.folder)
        return
    if c.checkpoint is not None:
        prepare_checkpoint(c, prompts * steps)
        return
    from bench.e2e_small import make_small_model, write_prompts
    from hybridflow_comm.devices import precision_dtype

    shape = replace(get_shape(c.shape, rl=True), dtype=precision_dtype(c.precision))
    tok = make_small_model(c.folder, shape)
    write_prompts(c.prompts_file, tok, c.prompt_len, prompts * steps)


def prepare_checkpoint(c: Contest, count: int) -> None:
    """``c.folder`` as a link to the real checkpoint and ``count`` sum prompts, each of
    which must fit ``c.prompt_len`` (a longer one our runtime would drop, TRL not)."""
    from bench.real_checkpoint import write_rows
    from rlhf.task.hf_tokenizer import HFTokenizer

    os.symlink(c.checkpoint, c.folder)
    tok = HFTokenizer(c.folder)
    longest = max(len(tok.encode_prompt(r["prompt"])) for r in write_rows(c.prompts_file, count))
    if longest > c.prompt_len:
        raise ValueError(f"a prompt has {longest} tokens, more than prompt_len={c.prompt_len}")


def describe(c: Contest, prompts: int, samples: int) -> dict:
    """The shape as recorded in the JSON (``tiny``: the recipe actor e2e runs, not the table's
    row, which is the generation benches' tiny model)."""
    if c.shape != "tiny":
        return get_shape(c.shape, rl=True).describe() | {
            "prompts": prompts, "samples": samples, "real_weights": c.checkpoint is not None}
    m = model_config("tiny")
    return {"name": "tiny", "model": "GRPO recipe actor", "hidden": m.hidden_size,
            "layers": m.num_layers, "heads": m.num_heads, "kv_heads": m.num_kv_heads,
            "ffn": m.intermediate_size, "vocab": m.vocab_size, "prompt_len": c.prompt_len,
            "response_len": c.response_len, "prompts": prompts, "samples": samples}


def median_phases(per_step: list[dict[str, float]]) -> dict[str, float]:
    """Median seconds per phase over the iterations after the first (warm-up)."""
    keys = sorted({k for d in per_step[1:] for k in d})
    return {k: statistics.median(d.get(k, 0.0) for d in per_step[1:]) for k in keys}


def our_overrides(c: Contest, nproc: int, steps: int, work: str, tp: int, prompts: int,
                  samples: int) -> list[str]:
    """The ``rlhf.train`` overrides of our run on ``nproc`` ranks (``work`` its runs folder)."""
    args = ["algo=grpo", f"iterations={steps}", f"actor.model.init_from={c.folder}",
            f"data.prompts_per_iter={prompts}", f"data.samples_per_prompt={samples}",
            f"data.mini_batch_size={prompts * samples}",
            f"data.micro_batch_size={c.micro_batch or prompts * samples // nproc * tp}",
            f"data.max_response_len={c.response_len}", f"data.max_prompt_len={c.prompt_len}",
            f"actor.layout.tp={tp}", "algo.recompute_log_prob=false", "algo.kl_mode=loss",
            "algo.kl_estimator=k3", f"algo.kl_coef={KL_COEF}",
            f"actor.optim.lr={LR}", f"log.runs_dir={work}", "log.run_name=ours",
            "checkpoint.resume=never", "checkpoint.save_every=1000000", "log.progress=false",
            "log.tensorboard=false", "log.plot=false", f"device={c.device}",
            f"precision={c.precision}"]
    if c.prompts_file is not None:
        args += [f"data.train_files={c.prompts_file}", "reward.kind=function",
                 f"reward.function={c.reward_file}:compute_score"]
    if c.exact_lengths:
        args.append(f"data.min_new_tokens={c.response_len}")
    return args


def ours(c: Contest, nproc: int, steps: int, work: str, tp: int, prompts: int,
         samples: int) -> dict:
    args = our_overrides(c, nproc, steps, work, tp, prompts, samples)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "rlhf.train", *args]
    subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), check=True,
                   stdout=subprocess.DEVNULL)
    from rlhf.metrics import read_metrics

    recs = read_metrics(os.path.join(work, "ours", "metrics.jsonl"))
    phases = [{k.removeprefix("timing_s/"): v for k, v in r.items() if k.startswith("timing_s/")}
              for r in recs]
    lengths = [r["response/length_mean"] for r in recs]
    if c.exact_lengths and min(lengths) != c.response_len:
        raise RuntimeError(f"ours: mean response lengths {lengths} per iteration, not all "
                           f"{c.response_len}: the token counts of the two sides would differ")
    return {"tokens_per_s": statistics.median(r["perf/throughput_tokens_per_s"]
                                              for r in recs[1:]),
            "phases_s": median_phases(phases), "response_len_mean": lengths}


def trl_worker(c: Contest, out: str, steps: int, threads: int, prompts: int,
               samples: int) -> None:
    """TRL GRPOTrainer on the same model and task (runs in its own process)."""
    import time

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bench.timing import sync
    from rlhf.metrics import PhaseTimer

    torch.set_num_threads(threads)
    if c.prompts_file is None:
        from rlhf.task import AdditionTask

        task = AdditionTask(1, 2)
        data = Dataset.from_list([{"prompt": "<bos>" + e.prompt, "answer": e.answer}
                                  for e in task.examples(0, prompts * steps)])

        def reward(completions, answer, **_):
            return [float(c.strip() == a) for c, a in zip(completions, answer)]
    elif c.checkpoint is not None:
        from bench.real_checkpoint import read_rows, trl_reward as reward

        data = Dataset.from_list(read_rows(c.prompts_file))
    else:
        from bench.e2e_small import read_prompts, trl_reward as reward

        data = Dataset.from_list([{"prompt": p} for p in read_prompts(c.prompts_file)])

    class Timed(GRPOTrainer):
        """GRPOTrainer with a phase timer around generation, reference forward and reward
        (the rest of scoring is ``adv``; the rest of the step is ``update_actor``); each phase
        ends with its device work (:func:`bench.timing.sync`)."""

        timer = PhaseTimer()

        def _timed(self, phase: str, fn, *args, **kwargs):
            with self.timer(phase):
                out = fn(*args, **kwargs)
                sync(c.device)
                return out

        def _generate_and_score_completions(self, inputs):
            return self._timed("score", super()._generate_and_score_completions, inputs)

        def _generate(self, prompts):
            return self._timed("gen", super()._generate, prompts)

        def _calculate_rewards(self, *args, **kwargs):
            return self._timed("reward", super()._calculate_rewards, *args, **kwargs)

        def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
            if model is not self.ref_model:  # the loss forward (or an old-policy forward)
                return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
            return self._timed("ref", super()._get_per_token_logps_and_entropies, model,
                               *args, **kwargs)

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.phases: list[dict[str, float]] = []

        def on_step_begin(self, *a, **k):
            Timed.timer.reset()
            sync(c.device)
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync(c.device)
            p = dict(Timed.timer.times)
            p["step"] = time.perf_counter() - self.t0
            score = p.pop("score", 0.0)
            p["adv"] = score - sum(p.get(k, 0.0) for k in ("gen", "ref", "reward"))
            p["update_actor"] = p["step"] - score
            self.phases.append(p)

    timer = StepTimer()
    extra = {} if c.shape == "tiny" else {"gradient_checkpointing": False}
    if c.exact_lengths:  # HF generate's MinNewTokensLengthLogitsProcessor, as ours
        extra["generation_kwargs"] = {"min_new_tokens": c.response_len}
    micro = c.micro_batch or prompts * samples  # one optimizer step per iteration
    args = GRPOConfig(output_dir=os.path.join(os.path.dirname(out), "trl"),
                      use_cpu=c.device == "cpu", per_device_train_batch_size=micro,
                      gradient_accumulation_steps=prompts * samples // micro,
                      num_generations=samples,
                      max_completion_length=c.response_len, beta=KL_COEF, learning_rate=LR,
                      temperature=1.0, max_steps=steps, logging_steps=1, save_strategy="no",
                      report_to="none", shuffle_dataset=False, loss_type="dapo",
                      dataloader_num_workers=0, bf16=c.precision == "bf16",  # as ours
                      lr_scheduler_type="constant", **extra)  # a constant lr, as ours
    dtype = torch.bfloat16 if c.precision == "bf16" else torch.float32
    trainer = Timed(model=AutoModelForCausalLM.from_pretrained(c.folder, dtype=dtype),
                    reward_funcs=reward, args=args, train_dataset=data,
                    processing_class=AutoTokenizer.from_pretrained(c.folder),
                    callbacks=[timer])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "num_tokens" in h]
    tokens = [h["num_tokens"] for h in logs]
    per_step = [b - a for a, b in zip([0.0] + tokens[:-1], tokens)]
    times = [p["step"] for p in timer.phases]
    rates = [n / t for n, t in zip(per_step, times)][1:]
    with open(out, "w") as f:
        json.dump({"tokens_per_s": statistics.median(rates), "step_s": times,
                   "phases_s": median_phases(timer.phases),
                   "response_len_mean": [h["completions/mean_length"] for h in logs],
                   "response_len_min": [h["completions/min_length"] for h in logs]}, f)


def trl(c: Contest, steps: int, threads: int, work: str, prompts: int, samples: int) -> dict:
    out = os.path.join(work, "trl.json")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--trl-worker",
                    json.dumps(asdict(c)), out, "--steps", str(steps), "--nproc", str(threads),
                    "--prompts", str(prompts), "--samples", str(samples)], cwd=ROOT, check=True,
                   env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"),
                   stdout=subprocess.DEVNULL)
    with open(out) as f:
        result = json.load(f)
    if c.exact_lengths and min(result["response_len_min"]) != c.response_len:
        raise RuntimeError(f"TRL: shortest responses {result['response_len_min']} per "
                           f"iteration, not all {c.response_len}: the token counts would differ")
    return result


def run(shape: str = "tiny", nproc: int = NPROC, steps: int = 8, prompts: int | None = None,
        samples: int | None = None, tp: int = 1, rounds: int = 3, bd: BenchDevice = CPU,
        micro_batch: int | None = None) -> dict:
    """Both contenders, ``rounds`` times each, alternating, on ``bd``; the result dict of the
    module docstring (prompts / samples default to the shape's row)."""
    row = get_shape(shape, rl=True)
    prompts = row.prompts if prompts is None else prompts
    samples = row.samples if samples is None else samples
    for name, v in (("nproc", nproc), ("steps", steps), ("prompts", prompts),
                    ("samples", samples), ("tp", tp), ("rounds", rounds)):
        if v < 1:
            raise ValueError(f"{name}={v} must be >= 1")
    if steps < 2:
        raise ValueError(f"steps={steps} must be >= 2: the first iteration is warm-up")
    if (prompts * samples) % nproc or nproc % tp:
        raise ValueError(f"prompts x samples = {prompts * samples} must split over "
                         f"nproc={nproc} ranks, and tp={tp} must divide nproc")
    share = prompts * samples // nproc * tp  # sequences a rank trains on per iteration
    if micro_batch is not None and (micro_batch < 1 or share % micro_batch):
        raise ValueError(f"micro_batch={micro_batch} must divide a rank's {share} sequences")
    ours_runs, trl_runs = [], []
    with tempfile.TemporaryDirectory() as work:
        c = contest(shape, work, bd.device.type, bd.precision, micro_batch)
        prepare(c, prompts, steps)
        for r in range(rounds):  # alternate the contenders so drift of the machine is shared
            ours_runs.append(ours(c, nproc, steps, os.path.join(work, f"r{r}"), tp, prompts,
                                  samples))
            trl_runs.append(trl(c, steps, nproc, work, prompts, samples))
    ours_tps = statistics.median(r["tokens_per_s"] for r in ours_runs)
    trl_tps = statistics.median(r["tokens_per_s"] for r in trl_runs)
    return {"ours_tokens_per_s": ours_tps, "trl_tokens_per_s": trl_tps,
            "ratio": ours_tps / trl_tps,
            "ours_phases_s": _median_of_runs([r["phases_s"] for r in ours_runs]),
            "trl_phases_s": _median_of_runs([r["phases_s"] for r in trl_runs]),
            "rounds": {"ours": [r["tokens_per_s"] for r in ours_runs],
                       "trl": [r["tokens_per_s"] for r in trl_runs]},
            "response_len_mean": {"ours": ours_runs[-1]["response_len_mean"],
                                  "trl": trl_runs[-1]["response_len_mean"]},
            "shape": describe(c, prompts, samples), "real_weights": c.checkpoint is not None,
            "device": bd.describe()}


def _median_of_runs(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for r in runs for k in r})
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in keys}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_argument(p, default="tiny", rl=True)
    p.add_argument("--nproc", type=int, default=None,
                   help=f"our ranks = TRL's threads (default {NPROC}; --placement "
                        f"disaggregated: {e2e_async.NPROC})")
    p.add_argument("--steps", type=int, default=8, help="iterations (the first is warm-up)")
    p.add_argument("--prompts", type=int, default=None,
                   help="prompts per iteration (default: the shape's, 16)")
    p.add_argument("--samples", type=int, default=None,
                   help="samples per prompt (default: the shape's, 4)")
    p.add_argument("--tp", type=int, default=1, help="our actor's training tp (dp = nproc/tp)")
    p.add_argument("--rounds", type=int, default=3,
                   help="runs of each contender, alternating; the medians are compared")
    p.add_argument("--placement", choices=("colocated", "disaggregated"), default="colocated",
                   help="disaggregated: compare our async run on a rollout pool with our "
                        "colocated synchronous run instead of TRL (bench/e2e_async.py)")
    p.add_argument("--multi-turn", action="store_true",
                   help="compare multi-turn GRPO with a tool against single-turn GRPO of as "
                        "many generated tokens instead of TRL (bench/e2e_multi_turn.py)")
    p.add_argument("--tool-latency-s", type=float, default=0.0,
                   help="--multi-turn: seconds added to every tool call; also runs the "
                        "multi-turn contender with rollout.overlap_tools")
    p.add_argument("--max-staleness", type=int, default=1,
                   help="--placement disaggregated: algo.max_staleness")
    p.add_argument("--budget-s", type=float, default=None,
                   help="--placement disaggregated: wall-clock budget for the reward")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="sequences per forward/backward on a rank, both sides (default: the "
                        "rank's whole share of the iteration)")
    add_device_arguments(p)
    p.add_argument("--json", default=None)
    p.add_argument("--trl-worker", nargs=2, metavar=("CONTEST", "OUT"), default=None,
                   help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.trl_worker:
        trl_worker(Contest(**json.loads(a.trl_worker[0])), a.trl_worker[1], a.steps, a.nproc,
                   a.prompts, a.samples)
        return
    if a.placement == "disaggregated":
        if a.shape != "tiny":
            raise SystemExit("--placement disaggregated runs the main job's model (--shape tiny)")
        nproc = e2e_async.NPROC if a.nproc is None else a.nproc
        result = e2e_async.run(nproc, a.max_staleness, a.steps, a.rounds, a.budget_s)
        emit_json(result | {"argv": sys.argv if argv is None else argv}, a.json)
        return
    if a.multi_turn:
        if a.shape != "tiny" or a.placement != "colocated":
            raise SystemExit("--multi-turn runs the tool-use example's model, colocated")
        result = e2e_multi_turn.run(e2e_multi_turn.NPROC if a.nproc is None else a.nproc,
                                    a.steps, a.rounds, a.prompts or 16, a.samples or 4,
                                    a.tool_latency_s)
        emit_json(result | {"argv": sys.argv if argv is None else argv}, a.json)
        return
    require_peer("trl", "bench/e2e.py")
    nproc = NPROC if a.nproc is None else a.nproc
    try:
        bd = bench_device(a)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    result = run(a.shape, nproc, a.steps, a.prompts, a.samples, a.tp, a.rounds, bd,
                 a.micro_batch)
    emit_json(result | {"argv": sys.argv if argv is None else argv}, a.json)


if __name__ == "__main__":
    main()
