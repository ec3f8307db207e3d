"""Every command of the README's ``bash`` blocks runs as written.

The commands are read from README.md the way bash reads a block (a trailing backslash joins
lines, ``#`` starts a comment), so a command added to the README is checked here with no
change to this file; a line this module cannot check fails :func:`test_every_line_is_checked`.

* ``python -m rlhf.train ARGS`` and ``torchrun [options] -m rlhf.train ARGS``: ``rlhf.train
  --check ARGS`` in a fresh process against the world the command launches (``WORLD_SIZE`` =
  ``--nnodes`` x ``--nproc_per_node``) must accept them (exit 0).  A one-process command (the
  README's command for development) also runs in full.
* ``make TARGET``: the Makefile has the target (``make`` itself is what CI runs).

The files a README user brings are made in the folder each command runs in, under the names the
README gives them: ``DIR`` (a tiny Llama with an HF byte-level BPE tokenizer, written by
transformers), ``train.jsonl`` and ``val.jsonl`` (addition prompts short enough for the shipped
recipes' lengths) and ``my_reward.py`` (the GSM8K-style example's ``compute_score``).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tests.example_data import make_example_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
HANG_GUARD_S = 600
"""Seconds before a command counts as hung (a guard only: nothing here is timed)."""


@dataclass(frozen=True)
class Command:
    """One command of a README ``bash`` block."""

    line: int
    """README line where the command starts."""
    argv: tuple[str, ...]
    """The words bash would pass, comments dropped."""

    @property
    def id(self) -> str:
        return f"README:{self.line}"

    def rlhf_module(self) -> tuple[str, tuple[str, ...], int] | None:
        """``(module, args, world size)`` of a ``python -m rlhf.*`` or ``torchrun ... -m
        rlhf.*`` command; None for any other."""
        argv = self.argv
        if argv[:2] == ("python", "-m") and len(argv) > 2:
            module, args, world = argv[2], argv[3:], 1
        elif argv[:1] == ("torchrun",) and "-m" in argv:
            i = argv.index("-m")
            module, args, world = argv[i + 1], argv[i + 2:], _torchrun_world(argv[1:i])
        else:
            return None
        return (module, args, world) if module.startswith("rlhf.") else None


def _torchrun_world(options: tuple[str, ...]) -> int:
    """Ranks of a torchrun launch: ``--nnodes`` x ``--nproc_per_node`` (each 1 by default)."""
    values, it = {}, iter(options)
    for opt in it:
        name, sep, value = opt.partition("=")
        if name in ("--nnodes", "--nproc_per_node", "--nproc-per-node"):
            values[name.replace("-", "_").strip("_")] = int(value if sep else next(it))
    return values.get("nnodes", 1) * values.get("nproc_per_node", 1)


def bash_commands(text: str) -> list[Command]:
    """Every command of the ``bash`` fenced blocks of ``text``, as bash splits them."""
    out, block = [], None
    for n, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"^```(\w*)\s*$", line)
        if fence and block is None:
            block = [] if fence.group(1) == "bash" else False
            continue
        if fence:
            if block:
                out += _split_block(block)
            block = None
            continue
        if block is not False and block is not None:
            block.append((n, line))
    return out


def _split_block(lines: list[tuple[int, str]]) -> list[Command]:
    out, pending, first = [], "", 0
    for n, line in lines:
        if not pending:
            first = n
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        argv = shlex.split(pending + line, comments=True)
        pending = ""
        if argv:
            out.append(Command(first, tuple(argv)))
    assert not pending, f"README:{first}: a bash block ends inside a continued line"
    return out


COMMANDS = bash_commands(open(README, encoding="utf-8").read())
RLHF = [c for c in COMMANDS if c.rlhf_module()]
ONE_PROCESS = [c for c in RLHF if c.rlhf_module()[0] == "rlhf.train" and c.rlhf_module()[2] == 1]


def test_every_line_is_checked():
    """Each command is one this module runs (or a make target): a line it cannot read, e.g.
    the continuation of a command whose backslash was lost, fails here."""
    unknown = [f"{c.id}: {shlex.join(c.argv)}" for c in COMMANDS
               if c.argv[0] != "make" and c.rlhf_module() is None]
    assert not unknown, unknown
    others = [f"{c.id}: {c.rlhf_module()[0]}" for c in RLHF if c.rlhf_module()[0] != "rlhf.train"]
    assert not others, f"no check for these entry points yet: {others}"
    assert RLHF and ONE_PROCESS, "the README shows no rlhf.train command"


def test_make_targets_exist():
    makefile = open(os.path.join(ROOT, "Makefile"), encoding="utf-8").read()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    missing = [f"{c.id}: {shlex.join(c.argv)}" for c in COMMANDS
               if c.argv[0] == "make" and not set(c.argv[1:]) <= targets]
    assert not missing, missing


# The files a README user brings ---------------------------------------------------------------
@pytest.fixture(scope="module")
def user_files(tmp_path_factory) -> str:
    """A folder holding ``DIR``, ``train.jsonl``, ``val.jsonl`` and ``my_reward.py``."""
    import torch
    import transformers

    root = tmp_path_factory.mktemp("readme_user")
    example = root / "example"
    make_example_module().build(str(example), seed=0, train=1, val=1, sft=1)
    tok = transformers.AutoTokenizer.from_pretrained(str(example / "tokenizer"))
    # the model's vocabulary padded to a multiple of 8 (as real checkpoints pad theirs), so
    # that the recipes' tp=2 splits it
    cfg = transformers.LlamaConfig(
        vocab_size=-(-len(tok) // 8) * 8, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(root / "DIR"))
    tok.save_pretrained(str(root / "DIR"))
    rows = [{"prompt": f"{a}+{b}=", "ground_truth": str(a + b), "data_source": "sum"}
            for a in range(5) for b in range(5)]
    for name in ("train.jsonl", "val.jsonl"):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    shutil.copy(os.path.join(ROOT, "examples", "gsm8k_style", "reward.py"),
                root / "my_reward.py")
    shutil.rmtree(example)
    return str(root)


def _env(world: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return env | {"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(world)}


def _run(argv: list[str], cwd: str, world: int) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=_env(world), capture_output=True, text=True,
                          timeout=HANG_GUARD_S)


@pytest.mark.parametrize("command", RLHF, ids=lambda c: c.id)
def test_command_passes_its_checks(command, user_files, tmp_path):
    """``rlhf.train --check`` accepts the command's arguments on its world."""
    module, args, world = command.rlhf_module()
    cwd = tmp_path / "run"
    shutil.copytree(user_files, cwd)
    res = _run([sys.executable, "-m", module, "--check", *args], str(cwd), world)
    assert res.returncode == 0, f"{command.id} on {world} rank(s): {res.stderr[-3000:]}"
    assert res.stdout.startswith("[rlhf] configuration valid: "), res.stdout
    assert f"world={world} " in res.stdout, res.stdout


@pytest.mark.parametrize("command", ONE_PROCESS, ids=lambda c: c.id)
def test_one_process_command_runs(command, user_files, tmp_path):
    """The one-process command trains to the end and writes its metrics."""
    module, args, _ = command.rlhf_module()
    cwd = tmp_path / "run"
    shutil.copytree(user_files, cwd)
    res = _run([sys.executable, "-m", module, *args], str(cwd), 1)
    assert res.returncode == 0, f"{command.id}: {res.stderr[-3000:]}"
    metrics = glob.glob(str(cwd / "runs" / "*" / "metrics.jsonl"))
    assert len(metrics) == 1, metrics
    assert open(metrics[0], encoding="utf-8").read().strip(), "no metrics written"
