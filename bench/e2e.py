"""End-to-end GRPO throughput: our runtime against TRL's GRPOTrainer, in one run.

    python bench/e2e.py [--nproc 2] [--steps 8] [--prompts 16] [--samples 4] [--tp 1]
                        [--rounds 3] [--json PATH]

Same tiny Llama (the GRPO recipe's actor: 2 layers, hidden 64, 24-token character vocabulary,
seeded weights saved to a local HF folder, nothing downloaded), same addition prompts,
16 prompts x 4 samples by default, responses up to 6 tokens, temperature 1, exact-match reward, KL to a
reference model as a loss (k3, coefficient 0.01), one optimizer step per iteration, the
rollout's own log-probs as the old policy's (TRL takes them from its loss forward), and the
same 2 cores: ours as ``--nproc`` gloo ranks of one thread each (actor training tp
``--tp``, the rest data parallel), TRL as one process with ``--nproc`` threads.  Tokens/s = (prompt + response tokens, padding excluded) / wall time of
one iteration (generation, reference, reward, update), median over the iterations after the
first (warm-up); each contender runs ``--rounds`` times, alternating with the other, and the
medians of the runs are compared.  Prints and optionally writes
``{"ours_tokens_per_s", "trl_tokens_per_s", "ratio", "rounds"}``.  TRL is an optional dev dependency
(requirements-dev.txt); HF_HUB_OFFLINE=1 is set for it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, ROOT)

from bench.report import emit_json  # noqa: E402

RESPONSE_LEN, PROMPT_LEN, KL_COEF, LR = 6, 8, 0.01, 1e-4


def make_model(folder: str) -> None:
    """Seeded weights of the GRPO recipe's actor + a transformers tokenizer, in ``folder``."""
    from engine.hf_interop import save_hf_checkpoint
    from hybridflow_comm.groups import build_hybrid_groups
    from hybridflow_comm.layout import HybridLayout, ParallelLayout
    from rlhf.config import load_config
    from rlhf.task import CharTokenizer
    from rlhf.workers.common import build_model
    from rlhf.workers.specs import ModelSpec

    cfg = load_config(["algo=grpo"])
    groups = build_hybrid_groups(HybridLayout(ParallelLayout(1, 1, 1), 1, 1))
    spec = ModelSpec(config=cfg.actor.model.llama(), head="lm", init_from=None, seed=0,
                     fresh_head=False)
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


def ours(folder: str, nproc: int, steps: int, work: str, tp: int, prompts: int,
         samples: int) -> float:
    args = ["algo=grpo", f"iterations={steps}", f"actor.model.init_from={folder}",
            f"data.prompts_per_iter={prompts}", f"data.samples_per_prompt={samples}",
            f"data.mini_batch_size={prompts * samples}",
            f"data.micro_batch_size={prompts * samples // nproc * tp}",
            f"data.max_response_len={RESPONSE_LEN}", f"data.max_prompt_len={PROMPT_LEN}",
            f"actor.layout.tp={tp}", "algo.recompute_log_prob=false", "algo.kl_mode=loss", "algo.kl_estimator=k3", f"algo.kl_coef={KL_COEF}",
            f"actor.optim.lr={LR}", f"log.runs_dir={work}", "log.run_name=ours",
            "checkpoint.resume=never", "checkpoint.save_every=1000000", "log.progress=false",
            "log.tensorboard=false", "log.plot=false"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "rlhf.train", *args]
    subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), check=True,
                   stdout=subprocess.DEVNULL)
    from rlhf.metrics import read_metrics

    recs = read_metrics(os.path.join(work, "ours", "metrics.jsonl"))
    return statistics.median(r["perf/throughput_tokens_per_s"] for r in recs[1:])


def trl_worker(folder: str, out: str, steps: int, threads: int, prompts: int,
               samples: int) -> None:
    """TRL GRPOTrainer on the same model and task (runs in its own process)."""
    import time

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf.task import AdditionTask

    torch.set_num_threads(threads)
    task = AdditionTask(1, 2)
    data = Dataset.from_list([{"prompt": "<bos>" + e.prompt, "answer": e.answer}
                              for e in task.examples(0, prompts * steps)])

    def exact(completions, answer, **_):
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    class Timer(TrainerCallback):
        times: list[float] = []

        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self.t0)

    timer = Timer()
    args = GRPOConfig(output_dir=os.path.join(os.path.dirname(out), "trl"), use_cpu=True,
                      per_device_train_batch_size=prompts * samples, num_generations=samples,
                      max_completion_length=RESPONSE_LEN, beta=KL_COEF, learning_rate=LR,
                      temperature=1.0, max_steps=steps, logging_steps=1, save_strategy="no",
                      report_to="none", shuffle_dataset=False, loss_type="dapo",
                      dataloader_num_workers=0, bf16=False,  # fp32 and a constant lr, as ours
                      lr_scheduler_type="constant")
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(folder),
                          reward_funcs=exact, args=args, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(folder),
                          callbacks=[timer])
    trainer.train()
    tokens = [h["num_tokens"] for h in trainer.state.log_history if "num_tokens" in h]
    per_step = [b - a for a, b in zip([0.0] + tokens[:-1], tokens)]
    rates = [n / t for n, t in zip(per_step, timer.times)][1:]
    with open(out, "w") as f:
        json.dump({"tokens_per_s": statistics.median(rates), "step_s": timer.times}, f)


def trl(folder: str, steps: int, threads: int, work: str, prompts: int, samples: int
        ) -> float:
    out = os.path.join(work, "trl.json")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--trl-worker", folder, out,
                    "--steps", str(steps), "--nproc", str(threads), "--prompts", str(prompts),
                    "--samples", str(samples)], cwd=ROOT, check=True,
                   env=dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"),
                   stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)["tokens_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="our ranks = TRL's threads")
    p.add_argument("--steps", type=int, default=8, help="iterations (the first is warm-up)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per iteration")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--tp", type=int, default=1, help="our actor's training tp (dp = nproc/tp)")
    p.add_argument("--rounds", type=int, default=3,
                   help="runs of each contender, alternating; the medians are compared")
    p.add_argument("--json", default=None)
    p.add_argument("--trl-worker", nargs=2, metavar=("MODEL", "OUT"), default=None)
    a = p.parse_args()
    if a.trl_worker:
        trl_worker(*a.trl_worker, a.steps, a.nproc, a.prompts, a.samples)
        return
    ours_runs, trl_runs = [], []
    with tempfile.TemporaryDirectory() as work:
        folder = os.path.join(work, "model")
        make_model(folder)
        for r in range(a.rounds):  # alternate the contenders so drift of the machine is shared
            ours_runs.append(ours(folder, a.nproc, a.steps, os.path.join(work, f"r{r}"), a.tp,
                                  a.prompts, a.samples))
            trl_runs.append(trl(folder, a.steps, a.nproc, work, a.prompts, a.samples))
    ours_tps, trl_tps = statistics.median(ours_runs), statistics.median(trl_runs)
    result = {"ours_tokens_per_s": ours_tps, "trl_tokens_per_s": trl_tps,
              "ratio": ours_tps / trl_tps, "rounds": {"ours": ours_runs, "trl": trl_runs}}
    emit_json(result, a.json)


if __name__ == "__main__":
    main()
