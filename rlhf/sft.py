"""Supervised fine-tuning: a user's own model and data, or the built-in addition task.

The SFT of a user's model is here; the command also runs the built-in task's warm start
(:mod:`rlhf.sft_builtin`)::

    python -m rlhf.sft --model DIR --data FILE.jsonl --out OUT [--steps N] [--batch B]
                       [--lr LR] [--max-len L] [--tools FILE.py,builtin:python]
                       [device=auto|cpu|cuda] [precision=auto|fp32|bf16]
    torchrun --nproc_per_node=2 -m rlhf.sft --model DIR --data FILE.jsonl --out OUT
    python -m rlhf.sft --out runs/cache/sft [--steps 400] [--noise 0.3] [--carry-errors 0.6]
                       [key=value ...]      (the built-in task; actor.model.init_from=DIR:
                                             continue from DIR)

``DIR`` is a transformers checkpoint folder (config.json, safetensors and the tokenizer
files); ``FILE`` (jsonl, or parquet) holds one demonstration a row, in either form::

    {"prompt": str | [{role, content}, ...], "response": str}
        tokens = encode_prompt(prompt) + tokens(response) + [eos]   (as rlhf.train renders
                                                                     the prompt)
    {"messages": [{role, content}, ..., {"role": "assistant", "content": str}, ...]}
        tokens = the conversation through the tokenizer's chat template

With ``--tools`` (the same list as ``rollout.tools``) the template also renders the tools'
schemas (the row's ``tools`` names, or all), and ``messages`` may hold assistant turns with
``tool_calls`` (``[{"type": "function", "function": {"name", "arguments"}}]``) and ``tool``
results (``{"role": "tool", "name", "content"}``): the loss is on the assistant's tokens,
calls included, never on tool results.

Rows longer than ``--max-len`` tokens (default: the model's max_position_embeddings) are
dropped.  Under torchrun each rank trains on its share of every batch (data parallel, the
engine all-reduces the gradients); rank 0 writes ``OUT``: an HF checkpoint, the tokenizer
files and ``sft_meta.json``.  Loss, both paths: token cross-entropy on the response (every
assistant turn) and its eos only; prompt tokens are masked.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import random
import re
import shutil
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.hf_interop import read_hf_config, read_hf_head
from engine.llama_spec import LlamaConfig
from hybridflow_comm.devices import Precision, init_process_group
from hybridflow_comm.groups import Group
from rlhf.builders import run_precision
from rlhf.config import load_config, resolve_devices
from rlhf.sft_builtin import main_builtin
from rlhf.sft_loop import META, train_steps
from rlhf.task import HFTokenizer, load_tokenizer
from rlhf.task.tokenizer import pad_sequences
from rlhf.workers.specs import ModelSpec

DATA_SEED = 0  # the user path's row order (one shuffle per epoch)
GROUP_TIMEOUT_S = 1800.0  # torch.distributed's own default for a job's collectives
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


# A user's rows ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Demo:
    """One tokenized demonstration."""

    input_ids: list[int]
    loss_mask: list[int]
    """1 on the tokens the loss trains (the response or assistant turns, and their eos)."""


def read_rows(path: str) -> list[tuple[str, object]]:
    """``(where, row)`` of every row of a jsonl file (blank lines skipped) or a parquet file;
    ``where`` is ``path:line`` (``path:row i``) for messages."""
    if not os.path.isfile(path):
        raise ValueError(f"--data file {path!r} does not exist")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        out = [(f"{path}:row {i}", r) for i, r in enumerate(pq.read_table(path).to_pylist())]
    else:
        out = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    out.append((f"{path}:{n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
    if not out:
        raise ValueError(f"--data file {path!r} has no rows")
    return out


def encode_row(row, tok: HFTokenizer, where: str, tools=None) -> Demo:
    """A ``messages`` row or a ``prompt`` + ``response`` row (see the module docstring);
    ``tools`` is the ``--tools`` catalog (:class:`rlhf.tools.catalog.ToolCatalog`) or None."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object, got {row!r:.80}")
    if "messages" in row:
        try:
            schemas = tools.schemas(row.get("tools")) if tools is not None else None
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        return encode_messages(row["messages"], tok, where, schemas)
    if "prompt" in row and "response" in row:
        return encode_prompt_response(row["prompt"], row["response"], tok, where)
    raise ValueError(f"{where}: a row needs 'messages' (a chat list with an assistant turn) or "
                     f"'prompt' and 'response'; it has {sorted(row)}")


def encode_prompt_response(prompt, response, tok: HFTokenizer, where: str) -> Demo:
    """``encode_prompt(prompt) + tokens(response) + [eos]``; the loss on the last two parts."""
    if not isinstance(response, str):
        raise ValueError(f"{where}: response must be a string, got {type(response).__name__}")
    try:
        head = tok.encode_prompt(prompt)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    answer = list(tok.tok(response, add_special_tokens=False)["input_ids"]) + [tok.eos_id]
    return Demo(head + answer, [0] * len(head) + [1] * len(answer))


def encode_messages(messages, tok: HFTokenizer, where: str,
                    tools: list[dict] | None = None) -> Demo:
    """The conversation through the chat template; the loss on every assistant turn.

    The assistant tokens come from the template's ``{% generation %}`` blocks when it has
    them, else from rendering the conversation up to each assistant turn (with the generation
    prompt) and taking the tokens the turn adds, up to and including the first eos.  An eos
    right after a marked span is marked too: the model must learn to stop.  ``tools``: the
    schemas the template renders (None: no tools).
    """
    ok = isinstance(messages, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str) for m in messages)
    if not ok:
        raise ValueError(f"{where}: messages must be a list of {{role, content}} objects with "
                         f"string values, got {messages!r:.120}")
    if tools is None and any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        raise ValueError(f"{where}: messages hold tool calls or results; give the tools with "
                         f"--tools FILE.py so the template renders their schemas")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: messages has no assistant turn to train on (roles "
                         f"{[m['role'] for m in messages]})")
    template = tok.tok.chat_template
    if not template:
        raise ValueError(f"{where}: tokenizer {tok.path!r} has no chat_template, so messages "
                         f"cannot be rendered; use prompt/response rows")
    if _GENERATION_BLOCK.search(template):
        enc = tok.tok.apply_chat_template(messages, tools=tools, tokenize=True,
                                          return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
    else:
        ids, mask = _assistant_mask_by_prefix(messages, tok, where, tools)
    mask = _mark_eos_after_spans(ids, mask, tok.eos_id)
    if not any(mask):
        raise ValueError(f"{where}: the chat template of {tok.path!r} marks no assistant token")
    return Demo(ids, mask)


def _render(tok: HFTokenizer, messages: list[dict], generation_prompt: bool,
            tools: list[dict] | None = None) -> list[int]:
    enc = tok.tok.apply_chat_template(messages, tools=tools,
                                      add_generation_prompt=generation_prompt,
                                      tokenize=True, return_dict=True)
    return list(enc["input_ids"])


def _assistant_mask_by_prefix(messages: list[dict], tok: HFTokenizer, where: str,
                              tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    ids = _render(tok, messages, False, tools)
    mask = [0] * len(ids)
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = _render(tok, messages[:k], True, tools)
        turn = _render(tok, messages[:k + 1], False, tools)
        if ids[:len(turn)] != turn or turn[:len(head)] != head:
            raise ValueError(f"{where}: the chat template does not render turn {k} as a prefix "
                             f"of the conversation, so its tokens cannot be found; use a "
                             f"template with {{% generation %}} blocks, or prompt/response rows")
        new = turn[len(head):]
        end = new.index(tok.eos_id) + 1 if tok.eos_id in new else len(new)
        mask[len(head):len(head) + end] = [1] * end
    return ids, mask


def _mark_eos_after_spans(ids: list[int], mask: list[int], eos: int) -> list[int]:
    out = list(mask)
    for i in range(len(ids) - 1):
        if mask[i] and not mask[i + 1] and ids[i] != eos and ids[i + 1] == eos:
            out[i + 1] = 1
    return out


def encode_rows(rows: list[tuple[str, object]], tok: HFTokenizer, max_len: int,
                tools=None) -> tuple[list[Demo], int]:
    """Every row encoded (``tools``: the ``--tools`` catalog or None); those longer than
    ``max_len`` tokens dropped.

    Returns:
        The kept demonstrations and how many were dropped (ValueError if all were).
    """
    demos = [encode_row(row, tok, where, tools) for where, row in rows]
    kept = [d for d in demos if len(d.input_ids) <= max_len]
    if not kept:
        shortest = min(len(d.input_ids) for d in demos)
        raise ValueError(f"all {len(demos)} rows are longer than --max-len={max_len} tokens "
                         f"(the shortest has {shortest}); raise --max-len")
    return kept, len(demos) - len(kept)


# A user's batches ------------------------------------------------------------------------------
def sft_user_batch(demos: list[Demo], pad_id: int) -> dict[str, torch.Tensor]:
    """The demonstrations right-padded to the longest::

        input_ids       [B, S]    | prompt ...... | response ... eos | pad ... pad |
        attention_mask  [B, S]    | 1 ........... | 1 ............ 1 | 0 ....... 0 |
        loss_mask       [B, S-1]  the token mask shifted by one: ``log_probs[:, t]`` is the
                                  log-prob of token ``t + 1``
    """
    ids, attn = pad_sequences([d.input_ids for d in demos], pad_id, "right")
    mask, _ = pad_sequences([d.loss_mask for d in demos], 0, "right")
    return {"input_ids": ids, "attention_mask": attn.long(),
            "loss_mask": mask[:, 1:].to(torch.float32)}


def dp_share(batch: dict[str, torch.Tensor], dp: int, dp_rank: int) -> dict[str, torch.Tensor]:
    """Rank ``dp_rank``'s consecutive rows, with ``loss_weight = loss_mask * dp / tokens``
    (tokens: the loss tokens of the whole batch), so that the engine's mean over DP ranks is
    the token mean of the whole batch, as one process computes it."""
    rows = batch["input_ids"].shape[0] // dp
    part = {k: v[dp_rank * rows:(dp_rank + 1) * rows] for k, v in batch.items()}
    part["loss_weight"] = part.pop("loss_mask") * (dp / batch["loss_mask"].sum())
    return part


def weighted_nll(outputs: dict, mb: dict) -> torch.Tensor:
    return -(outputs["log_probs"] * mb["loss_weight"]).sum()


@functools.lru_cache(maxsize=4)
def _epoch_order(n: int, epoch: int) -> tuple[int, ...]:
    order = list(range(n))
    random.Random(f"sft-data:{DATA_SEED}:{epoch}").shuffle(order)
    return tuple(order)


def batch_rows(n: int, batch: int, step: int) -> list[int]:
    """Row indices of step ``step``: the ``step``-th slice of ``batch`` of a stream of epochs,
    each a fresh shuffle of ``range(n)`` (a batch may span two epochs)."""
    return [_epoch_order(n, epoch)[i] for epoch, i in
            (divmod(pos, n) for pos in range(step * batch, (step + 1) * batch))]


# A user's run ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class UserSFT:
    """A validated SFT run on a user's model and data (every rank builds the same one, before
    any collective)."""

    model_dir: str
    data: str
    out: str
    config: LlamaConfig
    """The checkpoint's architecture, its parameters in ``precision``."""
    precision: Precision
    """The run's resolved precision (:func:`run_device`)."""
    tok: HFTokenizer
    demos: tuple[Demo, ...]
    dropped: int
    """Rows dropped as longer than ``max_len``."""
    token_ids: dict
    """bos/eos/pad ids of the source config.json, carried into the saved one."""
    steps: int
    batch: int
    lr: float
    max_len: int


def prepare_user(a: argparse.Namespace, world: int, precision: Precision) -> UserSFT:
    """Check the arguments, the checkpoint folder and every row (ValueError naming the fix);
    the model in ``precision`` (the run's, resolved: :func:`run_device`)."""
    for flag, v in (("--steps", a.steps), ("--batch", a.batch)):
        if v < 1:
            raise ValueError(f"{flag}={v} must be >= 1")
    if not a.lr > 0:
        raise ValueError(f"--lr={a.lr} must be > 0")
    if a.batch % world:
        raise ValueError(f"--batch={a.batch} must be a multiple of the {world} ranks (each "
                         f"trains on an equal share of every batch)")
    config_path = os.path.join(a.model, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"--model {a.model!r} is not a transformers checkpoint folder: it has "
                         f"no config.json")
    config = read_hf_config(a.model, dtype=precision.param_dtype)
    head = read_hf_head(a.model)
    if head != "lm":
        raise ValueError(f"--model {a.model!r} has a value head; SFT needs a *ForCausalLM "
                         f"checkpoint")
    tok = load_tokenizer(a.model)
    if not isinstance(tok, HFTokenizer):
        raise ValueError(f"--model {a.model!r} has no transformers tokenizer files "
                         f"(tokenizer_config.json); save the tokenizer beside the model")
    if tok.vocab_size > config.vocab_size:
        raise ValueError(f"the tokenizer of {a.model!r} has {tok.vocab_size} tokens but the "
                         f"model's vocab_size is {config.vocab_size}")
    max_pos = config.max_position_embeddings
    max_len = max_pos if a.max_len is None else a.max_len
    if not 2 <= max_len <= max_pos:
        raise ValueError(f"--max-len={max_len} must be in [2, {max_pos}] (the model's "
                         f"max_position_embeddings)")
    tools = None
    if getattr(a, "tools", None) is not None:
        from rlhf.tools.setup import tool_catalog

        tools = tool_catalog(a.tools)
    demos, dropped = encode_rows(read_rows(a.data), tok, max_len, tools)
    with open(config_path) as f:
        hf = json.load(f)
    token_ids = {k: hf[k] for k in TOKEN_ID_KEYS if hf.get(k) is not None}
    return UserSFT(model_dir=a.model, data=a.data, out=a.out, config=config,
                   precision=precision, tok=tok,
                   demos=tuple(demos), dropped=dropped, token_ids=token_ids, steps=a.steps,
                   batch=a.batch, lr=a.lr, max_len=max_len)


def train_user(job: UserSFT, device: torch.device = torch.device("cpu")) -> dict:
    """Train on this process's world (one rank, or every rank of an initialized process group,
    data parallel) on ``device`` and save ``job.out`` from rank 0.

    Returns:
        ``first_loss`` (step 0, before any update), ``loss`` (last step), ``time_s``.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1

    def batch_at(step: int, dp: Group) -> dict[str, torch.Tensor]:
        rows = [job.demos[i] for i in batch_rows(len(job.demos), job.batch, step)]
        return dp_share(sft_user_batch(rows, job.tok.pad_id), dp.size, dp.rank)

    spec = ModelSpec(config=job.config, head="lm", init_from=job.model_dir, seed=0,
                     fresh_head=False, lora=None, lora_init_from=None)
    result = train_steps(spec, world=world, steps=job.steps, lr=job.lr, batch_at=batch_at,
                         loss_fn=weighted_nll, out=job.out, device=device,
                         precision=job.precision)
    if not dist.is_initialized() or dist.get_rank() == 0:
        _write_extras(job, result, world)
    if world > 1:
        dist.barrier()  # OUT is complete on every rank's return
    return result


def _write_extras(job: UserSFT, result: dict, world: int) -> None:
    """Tokenizer files, the source's generation defaults and special-token ids (the engine
    writes the architecture only; HF generate and vLLM stop at these), and sft_meta.json."""
    out = job.out
    job.tok.save_files(out)
    gen = os.path.join(job.model_dir, "generation_config.json")
    if os.path.isfile(gen) and os.path.abspath(job.model_dir) != os.path.abspath(out):
        shutil.copyfile(gen, os.path.join(out, "generation_config.json"))
    if job.token_ids:
        with open(os.path.join(out, "config.json")) as f:
            hf = json.load(f)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(hf | job.token_ids, f, indent=2, sort_keys=True)
    with open(job.data, "rb") as f:
        data_sha = hashlib.sha256(f.read()).hexdigest()
    settings = {"model": os.path.abspath(job.model_dir), "data": os.path.abspath(job.data),
                "data_sha256": data_sha, "steps": job.steps, "batch": job.batch, "lr": job.lr,
                "max_len": job.max_len, "world": world}
    with open(os.path.join(out, META), "w") as f:
        json.dump({"settings": settings, "rows": len(job.demos), "dropped": job.dropped,
                   **result}, f)


USER_OVERRIDES = ("device", "precision")
"""The run-config keys a ``--model`` run takes (as ``rlhf.train``: auto|cpu|cuda, auto|fp32|bf16)."""


def run_device(overrides: list[str]) -> tuple[torch.device, Precision]:
    """This rank's device and precision from the ``device=`` / ``precision=`` overrides, read
    and resolved by the run config as ``rlhf.train`` does (:func:`rlhf.config.resolve_devices`;
    ValueError naming a bad value)."""
    cfg, device = resolve_devices(load_config(overrides))
    return device, run_precision(cfg)


def main_user(a: argparse.Namespace) -> int:
    """SFT of ``--model`` on ``--data``; exit code 2 (and the reason) for a bad input."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    main_rank = os.environ.get("RANK", "0") == "0"
    try:
        device, precision = run_device(a.overrides)
        job = prepare_user(a, world, precision)
    except ValueError as e:
        if main_rank:
            print(f"[sft] error: {e}", file=sys.stderr, flush=True)
        return 2
    if main_rank:
        if job.dropped:
            print(f"[sft] warning: dropped {job.dropped} of {job.dropped + len(job.demos)} "
                  f"rows longer than --max-len={job.max_len} tokens", file=sys.stderr)
        print(f"[sft] {len(job.demos)} rows, {job.steps} steps of {job.batch} on {world} "
              f"rank(s), lr {job.lr}", flush=True)
    if world > 1 and not dist.is_initialized():
        init_process_group(device, GROUP_TIMEOUT_S)
    result = train_user(job, device)
    if main_rank:
        print(f"[sft] saved {job.out} (loss {result['first_loss']:.4f} -> "
              f"{result['loss']:.4f}, {result['time_s']:.1f} s)", flush=True)
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output folder (HF format)")
    p.add_argument("--model", help="a user's transformers checkpoint folder (with tokenizer)")
    p.add_argument("--data", help="a user's SFT rows (jsonl or parquet; with --model)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=32, help="rows per step (over all ranks)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (decays to 10%%)")
    p.add_argument("--max-len", type=int, default=None,
                   help="drop longer rows (--model; default: max_position_embeddings)")
    p.add_argument("--tools", default=None,
                   help="tool files and builtin:<name> (as rollout.tools) whose schemas the "
                        "chat template renders (--model runs)")
    p.add_argument("--noise", type=float, default=0.0,
                   help="built-in task: fraction of SFT answers replaced by a wrong answer")
    p.add_argument("--carry-errors", type=float, default=0.0,
                   help="built-in task: fraction of SFT answers to carrying problems given "
                        "without the carry")
    p.add_argument("overrides", nargs="*", help="key=value run-config overrides (--model: "
                   "device= and precision= only)")
    a = p.parse_args(argv)
    if (a.model is None) != (a.data is None):
        p.error("--model and --data go together (a user's model and its SFT rows)")
    if a.model is None:
        if a.max_len is not None or a.tools is not None:
            p.error("--max-len and --tools apply to --model/--data runs")
        return main_builtin(a)
    if a.noise or a.carry_errors:
        p.error("--noise and --carry-errors apply to the built-in task only")
    other = [o for o in a.overrides if o.partition("=")[0] not in USER_OVERRIDES]
    if other:
        p.error(f"{other}: with --model only {'=, '.join(USER_OVERRIDES)}= are taken (the "
                f"rest of the run config applies to the built-in task)")
    return main_user(a)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    if dist.is_initialized():
        # As rlhf.train: no gloo teardown at interpreter exit (it can abort a finished job).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
