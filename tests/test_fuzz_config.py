"""Bad configurations and bad input files stop ``rlhf.train`` at validation: exit code 2, one
line on stderr naming the key (or file) and the fix, no traceback, and nothing started
(``main`` validates before any process group exists; the cases run it in-process with the
launch replaced by a tripwire).  How fast: ``bench/config_check.py`` (CPU time of a rejection);
the subprocess cases here only guard against a hang.

The cases come from a deterministic generator: for every field of every config section, wrong
types (a string, a list, a mapping where a number belongs, ...), NaN, inf, -inf, negative, zero
and huge sizes, and an unknown key next to the real one; malformed YAML values; bad recipe
files, data files, reward-function files, tokenizer and checkpoint folders, and launch
settings.  A sample runs as real processes: ``python -m rlhf.train`` and torchrun on 2 ranks.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import subprocess
import sys
import typing
from dataclasses import dataclass

import pytest
import torch.distributed

from rlhf import train, train_launch
from rlhf.config import MAX_COUNT, SEED_LIMIT, Config
from rlhf.config_io import _dataclass_of
from rlhf.model_arch import llama_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["actor.layout.tp=1"]  # ppo on a world of one: valid, so each case breaks one thing
HANG_GUARD_S = 300
"""Seconds before a process that should have been rejected counts as hung (a guard only: how
fast a rejection is, bench/config_check.py measures)."""


@dataclass(frozen=True)
class Case:
    """One bad input: ``args`` after BASE (``{tmp}``: the folder of the bad files), ``env``
    settings, and the text the one-line message must contain (the key or the file)."""

    id: str
    args: tuple[str, ...]
    names: str
    env: tuple[tuple[str, str], ...] = ()


# What the generator needs to know about the fields ----------------------------------------
ZERO_OK = {"dp", "gen_pp", "gen_tp", "save_every", "keep_last", "eval_every", "seed", "gamma",
           "lam", "kl_coef", "lagrange_init", "entropy_coeff", "weight_decay", "cost_limit",
           "model_weight", "val_size", "eval_pass_k", "overlong_buffer", "clip_cov_ratio",
           "kl_cov_ratio", "clip_cov_lb", "overlong_penalty_factor", "max_staleness",
           "min_new_tokens", "rollouts_every", "rank", "dropout", "num_experts",
           "router_aux_loss_coef"}
"""Leaf names for which 0 is a valid value (derive it, never, off, no term, ...)."""
NEGATIVE_OK = {"cost_limit", "model_weight", "clip_cov_lb"}
"""Leaf names for which a negative number is a valid value."""
SEEDS = {"seed"}
UNBOUNDED = {"bucket_numel"}
"""Int leaves where a value above MAX_COUNT is valid (a bigger bucket: fewer all-reduces)."""
CHOICES = {"name": "ppoo", "kl_mode": "rewards", "kl_estimator": "k4", "kl_ctrl": "fix",
           "loss_agg_mode": "token_mean", "kind": "rules", "cost_kind": "models",
           "mode": "colocate", "schedule": "1f1b2", "forbidden_digit": "77", "resume": "",
           "run_name": "a/b", "runs_dir": " ", "prompt_key": "", "ground_truth_key": ""}
"""Str fields with a constrained value, and a near miss each."""
# One section per shared type gets every case; the other copies get a sample (the checks are
# the dataclass's own, whatever section holds it).
FULL = ("actor.model.", "actor.layout.", "actor.optim.", "actor.loss.", "critic.loss.")
COPIES = ("critic.", "cost_critic.", "reference.", "reward_model.", "cost_model.")
ACTIVE_PATHS = {"actor.model.init_from": "config.json", "tokenizer": "tokenizer files",
                "data.train_files": "do not exist", "data.val_files": "do not exist",
                "reward.function": "does not exist", "checkpoint.dir": None,
                "checkpoint.resume": "not a complete checkpoint"}


def _leaves(cls: type, prefix: str = "") -> list[tuple[str, typing.Any]]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        inner = _dataclass_of(hints[f.name])
        if inner is not None:
            out += _leaves(inner, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", hints[f.name]))
    return out


def _base(tp) -> type:
    """int, float, bool, str, dict or tuple: the type of a field without ``| None``."""
    if typing.get_origin(tp) in (dict, tuple):
        return typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return _base(args[0]) if args else tp


def _values(key: str, tp) -> list[tuple[str, str]]:
    """``(label, override text)`` of the bad values of one field."""
    leaf, kind = key.rpartition(".")[2], _base(tp)
    if kind is bool:
        return [("str", "maybe"), ("list", "[1]"), ("nan", ".nan")]
    if kind is int:
        out = [("str", "abc"), ("list", "[1, 2]"), ("map", "{a: 1}"), ("float", "1.5"),
               ("nan", ".nan"), ("inf", ".inf"), ("huge", "99999999999999999999"), ("neg", "-1")]
        if leaf not in UNBOUNDED:
            out.append(("above_max", str(SEED_LIMIT if leaf in SEEDS else MAX_COUNT + 1)))
        return out + ([("zero", "0")] if leaf not in ZERO_OK else [])
    if kind is float:
        out = [("str", "abc"), ("list", "[1.0]"), ("nan", ".nan"), ("inf", ".inf"),
               ("neg_inf", "-.inf")]
        out += [("neg", "-1")] if leaf not in NEGATIVE_OK else []
        return out + ([("zero", "0")] if leaf not in ZERO_OK else [])
    if kind is tuple:
        return [("str", "abc"), ("short", "[0.9]"), ("nan", "[.nan, 0.999]"),
                ("inf", "[0.9, .inf]"), ("range", "[0.9, 1.5]")]
    if kind is dict:
        out = [("int", "5"), ("list", "[1]"), ("nan", "{exact: .nan}"), ("inf", "{exact: .inf}")]
        return out + ([("neg", "{actor: -1}"), ("huge", "{actor: 99999999999999999999}")]
                      if leaf == "pool_sizes" else [("unknown", "{bleu: 1.0}")])
    if kind is str:
        out = [("list", "[1, 2]"), ("map", "{a: 1}")]
        if leaf in CHOICES:
            out.append(("near_miss", CHOICES[leaf]))
        if key in ACTIVE_PATHS and ACTIVE_PATHS[key] is not None:
            out.append(("missing", "/nonexistent/x"))
        if key in ACTIVE_PATHS:
            out.append(("empty", ""))
        return out
    if tp is typing.Any and leaf == "target_modules":  # a name or a list of names
        return [("int", "5"), ("map", "{a: 1}"), ("near_miss", "all_linear"),
                ("unknown", "[q_proj, qproj]"), ("empty", "[]")]
    raise AssertionError(f"no bad values for {key}: {tp}")


def _field_cases() -> list[Case]:
    cases, copies = [], set()
    for i, (key, tp) in enumerate(_leaves(Config)):
        leaf, section = key.rpartition(".")[2], key.rpartition(".")[0]
        values = _values(key, tp)
        if key.startswith(COPIES) and not key.startswith(FULL):
            values = [values[i % len(values)]]  # a copy of a section that FULL covers
            copies.add(section)
        else:
            typo = f"{section}.{leaf}_" if section else f"{leaf}_"
            cases.append(Case(f"{key}=unknown_key", (f"{typo}=1",), typo))
        extra = ("reward.kind=function",) if key == "reward.function" else ()
        for label, text in values:
            cases.append(Case(f"{key}={label}", (*extra, f"{key}={text}"), leaf))
    for section in sorted(copies):
        cases.append(Case(f"{section}=unknown_key", (f"{section}.sizee=1",), "sizee"))
    for section in ("algo", "data", "actor", "critic.loss", "reward", "placement", "log",
                    "checkpoint", "actor.model"):
        cases.append(Case(f"{section}=scalar", (f"{section}=3",), section))
        cases.append(Case(f"{section}=list", (f"{section}=[1, 2]",), section))
    return cases


YAML_CASES = [
    Case("yaml=unclosed_map", ("placement.pool_sizes={actor: 2",), "placement.pool_sizes"),
    Case("yaml=unclosed_list", ("actor.optim.betas=[0.9, 0.99",), "actor.optim.betas"),
    Case("yaml=bad_indent", ("data.prompts_per_iter=a: b: c",), "data.prompts_per_iter"),
    Case("yaml=unclosed_quote", ("log.run_name='abc",), "log.run_name"),
    Case("yaml=python_tag", ("log.run_name=!!python/object/apply:os.system [ls]",),
         "log.run_name"),
    Case("yaml=tab", ("data.seed=\t1: 2",), "data.seed"),
    Case("yaml=alias_loop", ("reward.rule_weights=&a [*a]",), "reward.rule_weights"),
    Case("yaml=interpolation", ("actor.optim.lr=${nope.missing}",), "actor.optim.lr"),
    Case("arg=no_equals", ("prompts_per_iter",), "prompts_per_iter"),
    Case("arg=empty_key", ("=3",), "=3"),
    Case("arg=double_dot", ("data..seed=1",), "data..seed"),
    Case("arg=value_as_section", ("actor.optim.lr.x=1",), "actor.optim.lr"),
    Case("arg=algo_unknown", ("algo=dpo",), "dpo"),
    Case("sizes=rollout_tokens", ("data.prompts_per_iter=9000000", "data.max_prompt_len=9000000",
                                  "data.mini_batch_size=9000000", "data.micro_batch_size=9000000"),
         "prompts_per_iter"),
    Case("sizes=model_params", ("actor.model.hidden_size=9999360", "actor.model.num_heads=4",
                                "actor.model.intermediate_size=9999360"), "parameters"),
    Case("sizes=lagrange_max_below_init", ("algo.lagrange_max=0.5",), "lagrange_max"),
    Case("sizes=train_files_blank", ("data.train_files=' , '",), "train_files"),
    Case("float=overflow", ("data.temperature=1e400",), "data.temperature"),
    Case("float=map", ("actor.optim.lr={a: 1}",), "actor.optim.lr"),
    Case("bool=float", ("log.plot=1.5",), "log.plot"),
]

FILE_CASES = [
    Case("recipe=missing", ("recipe={tmp}/nope.yaml",), "nope.yaml"),
    Case("recipe=list", ("recipe={tmp}/list.yaml",), "list.yaml"),
    Case("recipe=scalar", ("recipe={tmp}/scalar.yaml",), "scalar.yaml"),
    Case("recipe=invalid_yaml", ("recipe={tmp}/invalid.yaml",), "invalid.yaml"),
    Case("recipe=binary", ("recipe={tmp}/binary.yaml",), "binary.yaml"),
    Case("recipe=folder", ("recipe={tmp}",), "recipe="),
    Case("recipe=unknown_section", ("recipe={tmp}/unknown_section.yaml",), "actr"),
    Case("recipe=nan_value", ("recipe={tmp}/nan_value.yaml",), "temperature"),
    Case("recipe=section_scalar", ("recipe={tmp}/section_scalar.yaml",), "data"),
    Case("recipe=nul_string", ("recipe={tmp}/nul.yaml",), "run_name"),
    Case("recipe=huge_int", ("recipe={tmp}/huge.yaml",), "iterations"),
    Case("data=missing", ("data.train_files={tmp}/none.jsonl",), "none.jsonl"),
    Case("data=empty", ("data.train_files={tmp}/empty.jsonl",), "empty.jsonl"),
    Case("data=not_json", ("data.train_files={tmp}/not_json.jsonl",), "not_json.jsonl"),
    Case("data=no_prompt", ("data.train_files={tmp}/no_prompt.jsonl",), "no_prompt.jsonl"),
    Case("data=row_is_list", ("data.train_files={tmp}/row_list.jsonl",), "row_list.jsonl"),
    Case("data=prompt_is_number", ("data.train_files={tmp}/prompt_num.jsonl",),
         "prompt_num.jsonl"),
    Case("data=chat_without_template", ("data.train_files={tmp}/chat.jsonl",), "train_files"),
    Case("data=chars_outside_vocab", ("data.train_files={tmp}/letters.jsonl",), "train_files"),
    Case("data=prompts_too_long", ("data.train_files={tmp}/long.jsonl",), "max_prompt_len"),
    Case("data=binary", ("data.train_files={tmp}/binary.jsonl",), "train_files"),
    Case("data=unknown_extension", ("data.train_files={tmp}/rows.csv",), "rows.csv"),
    Case("data=folder_not_dataset", ("data.train_files={tmp}/plain_dir",), "train_files"),
    Case("data=bad_parquet", ("data.train_files={tmp}/bad.parquet",), "train_files"),
    Case("data=second_file_bad", ("data.train_files={tmp}/good.jsonl,{tmp}/not_json.jsonl",),
         "not_json.jsonl"),
    Case("data=val_bad", ("data.val_files={tmp}/no_prompt.jsonl",), "no_prompt.jsonl"),
    Case("data=renamed_key_absent", ("data.train_files={tmp}/good.jsonl",
                                     "data.prompt_key=question"), "question"),
    Case("reward=syntax_error", ("reward.kind=function",
                                 "reward.function={tmp}/syntax.py:compute_score"), "syntax.py"),
    Case("reward=raises_on_import", ("reward.kind=function",
                                     "reward.function={tmp}/raises.py:compute_score"),
         "raises.py"),
    Case("reward=exits_on_import", ("reward.kind=function",
                                    "reward.function={tmp}/exits.py:compute_score"), "exits.py"),
    Case("reward=no_such_function", ("reward.kind=function",
                                     "reward.function={tmp}/good_reward.py:nope"), "nope"),
    Case("reward=not_callable", ("reward.kind=function",
                                 "reward.function={tmp}/good_reward.py:SCALE"), "SCALE"),
    Case("reward=wrong_signature", ("reward.kind=function",
                                    "reward.function={tmp}/good_reward.py:one_arg"), "one_arg"),
    Case("reward=no_colon", ("reward.kind=function", "reward.function={tmp}/good_reward.py"),
         "good_reward.py"),
    Case("reward=function_without_kind", ("reward.function={tmp}/good_reward.py:compute_score",),
         "reward.function"),
    Case("tokenizer=empty_folder", ("tokenizer={tmp}/plain_dir",), "plain_dir"),
    Case("tokenizer=corrupt", ("tokenizer={tmp}/bad_tokenizer",), "bad_tokenizer"),
    Case("init_from=empty_folder", ("actor.model.init_from={tmp}/plain_dir",), "plain_dir"),
    Case("init_from=config_not_json", ("actor.model.init_from={tmp}/ckpt_garbage",),
         "ckpt_garbage"),
    Case("init_from=config_empty", ("actor.model.init_from={tmp}/ckpt_empty",), "ckpt_empty"),
    Case("init_from=config_list", ("actor.model.init_from={tmp}/ckpt_list",), "ckpt_list"),
    Case("init_from=no_weights", ("actor.model.init_from={tmp}/ckpt_no_weights",),
         "ckpt_no_weights"),
    Case("resume=missing", ("checkpoint.resume={tmp}/no_checkpoint",), "no_checkpoint"),
    Case("resume=plain_folder", ("checkpoint.resume={tmp}/plain_dir",), "plain_dir"),
    Case("placement=auto_unknown_profile", ("placement.mode=auto", "placement.profile=nope"),
         "nope"),
    Case("placement=split_on_one_rank", ("placement.mode=split",
                                         "placement.pool_sizes={actor: 1, critic: 1}"),
         "world_size"),
    Case("env=world_size", (), "WORLD_SIZE", (("WORLD_SIZE", "two"),)),
    Case("env=stall_timeout", (), "HYBRIDFLOW_STALL_TIMEOUT_S",
         (("HYBRIDFLOW_STALL_TIMEOUT_S", "-1"),)),
    Case("env=stall_timeout_nan", (), "HYBRIDFLOW_STALL_TIMEOUT_S",
         (("HYBRIDFLOW_STALL_TIMEOUT_S", "nan"),)),
    Case("env=max_message_bytes", (), "MAX_MESSAGE_BYTES",
         (("HYBRIDFLOW_MAX_MESSAGE_BYTES", "lots"),)),
]

CASES = _field_cases() + YAML_CASES + FILE_CASES


def test_generator_is_large_deterministic_and_unique():
    assert len(CASES) >= 200
    assert [c.id for c in CASES] == [c.id for c in _field_cases() + YAML_CASES + FILE_CASES]
    assert len({c.id for c in CASES}) == len(CASES)


# Bad files ----------------------------------------------------------------------------------
def _write(path: str, text: str | bytes) -> None:
    mode = "wb" if isinstance(text, bytes) else "w"
    with open(path, mode) as f:
        f.write(text)


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("bad_inputs")
    t = str(tmp)
    rows = {"good.jsonl": [{"prompt": "1+2=", "ground_truth": "3"}],
            "no_prompt.jsonl": [{"question": "1+2=", "ground_truth": "3"}],
            "row_list.jsonl": [[1, 2]], "prompt_num.jsonl": [{"prompt": 12}],
            "chat.jsonl": [{"prompt": [{"role": "user", "content": "1+2="}]}],
            "letters.jsonl": [{"prompt": "what is one plus two?"}],
            "long.jsonl": [{"prompt": "1+2+3+4+5+6+7+8+9="}]}
    for name, recs in rows.items():
        _write(os.path.join(t, name), "".join(json.dumps(r) + "\n" for r in recs))
    files = {"empty.jsonl": "", "not_json.jsonl": '{"prompt": "1+2="\n', "rows.csv": "a,b\n",
             "bad.parquet": "not parquet", "binary.jsonl": bytes(range(256)) * 4,
             "list.yaml": "- 1\n- 2\n", "scalar.yaml": "3\n", "invalid.yaml": "data: [1,\n  x: 2\n",
             "binary.yaml": b"\xff\xfe\x00\x81" * 64, "unknown_section.yaml": "actr: {lr: 1}\n",
             "nan_value.yaml": "data: {temperature: .nan}\n", "section_scalar.yaml": "data: 5\n",
             "nul.yaml": 'log: {run_name: "a\\0b"}\n', "huge.yaml": f"iterations: {10**30}\n",
             "syntax.py": "def compute_score(:\n", "raises.py": "raise RuntimeError('boom')\n",
             "exits.py": "import sys\nsys.exit(3)\n",
             "good_reward.py": "SCALE = 2\n\ndef compute_score(data_source, solution_str, "
                               "ground_truth, extra_info=None):\n    return 1.0\n\n"
                               "def one_arg(x):\n    return 0.0\n"}
    for name, text in files.items():
        _write(os.path.join(t, name), text)
    for folder in ("plain_dir", "bad_tokenizer", "ckpt_garbage", "ckpt_empty", "ckpt_list"):
        os.makedirs(os.path.join(t, folder))
    _write(os.path.join(t, "bad_tokenizer", "tokenizer_config.json"), "{not json")
    _write(os.path.join(t, "ckpt_garbage", "config.json"), "{not json")
    _write(os.path.join(t, "ckpt_empty", "config.json"), "{}")
    _write(os.path.join(t, "ckpt_list", "config.json"), "[1, 2]")
    from engine.hf_interop import config_to_hf
    from rlhf.config import load_config

    config_to_hf(llama_config(load_config(BASE).actor.model)).save_pretrained(
        os.path.join(t, "ckpt_no_weights"))  # config.json only
    return t


# In-process: every case ----------------------------------------------------------------------
class Started(Exception):
    """main() went past validation: the case was accepted."""


@pytest.fixture
def tripwire(monkeypatch):
    def launch(cfg, plan):
        raise Started

    monkeypatch.setattr(train_launch, "launch", launch)
    monkeypatch.setattr(train, "single_process_env", lambda: None)
    for var in ("RANK", "WORLD_SIZE", "HYBRIDFLOW_STALL_TIMEOUT_S",
                "HYBRIDFLOW_MAX_MESSAGE_BYTES"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input_ends_validation_with_one_line(case, bad_files, tripwire, tmp_path, capfd):
    for var, value in case.env:
        tripwire.setenv(var, value)
    args = [*BASE, f"log.runs_dir={tmp_path}", *(a.replace("{tmp}", bad_files) for a in case.args)]
    try:
        code = train.main(args)
    except Started:
        pytest.fail(f"{case.id}: not rejected, main() reached launch(); args {case.args}")
    out, err = capfd.readouterr()
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("[rlhf] invalid configuration: "), err
    assert "Traceback" not in err + out
    assert case.names.replace("{tmp}", bad_files) in lines[0], lines[0]
    assert not torch.distributed.is_initialized()


def test_the_base_config_is_accepted(tripwire, tmp_path):
    """Every case breaks one thing of a config that main() would start."""
    with pytest.raises(Started):
        train.main([*BASE, f"log.runs_dir={tmp_path}"])


# Real processes: a sample --------------------------------------------------------------------
PROCESS_CASES = [("data.prompts_per_iter=99999999999999999999", "data.prompts_per_iter"),
                 ("data.temperature=.nan", "data.temperature"),
                 ("actor.optim.lr=abc", "actor.optim.lr"),
                 ("data.train_files={tmp}/no_prompt.jsonl", "no_prompt.jsonl"),
                 ("recipe={tmp}/list.yaml", "list.yaml")]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return env | {"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}




def test_sample_through_python_dash_m(bad_files, tmp_path):
    """Each ends with exit code 2, one line on stderr, no traceback."""
    procs = []
    for arg, name in PROCESS_CASES:
        cmd = [sys.executable, "-m", "rlhf.train", *BASE, f"log.runs_dir={tmp_path}",
               arg.replace("{tmp}", bad_files)]
        procs.append((name, subprocess.Popen(cmd, cwd=ROOT, env=_env(), text=True,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)))
    for name, proc in procs:  # started side by side, waited for one after the other
        try:
            out, err = proc.communicate(timeout=HANG_GUARD_S)
        finally:
            proc.kill()
        assert proc.returncode == 2, err
        assert "Traceback" not in out + err
        lines = err.splitlines()
        assert len(lines) == 1 and name in lines[0], err


def test_sample_through_torchrun_on_two_ranks(bad_files, tmp_path):
    """Rank 0 prints the one line (no traceback), rank 1 nothing; the job ends non-zero."""
    procs = []
    for i, (arg, name) in enumerate([PROCESS_CASES[0], PROCESS_CASES[3]]):
        logs = tmp_path / f"logs{i}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", "--redirects", "3", "--log-dir", str(logs),
               "-m", "rlhf.train", f"log.runs_dir={tmp_path}", arg.replace("{tmp}", bad_files)]
        procs.append((name, logs, subprocess.Popen(cmd, cwd=ROOT, env=_env(), text=True,
                                                   stdout=subprocess.PIPE,
                                                   stderr=subprocess.STDOUT)))
    for name, logs, proc in procs:
        try:
            out, _ = proc.communicate(timeout=HANG_GUARD_S)
        finally:
            proc.kill()
        assert proc.returncode != 0, out[-2000:]
        rank0 = open(glob.glob(f"{logs}/*/attempt_0/0/stderr.log")[0]).read()
        rank1 = open(glob.glob(f"{logs}/*/attempt_0/1/stderr.log")[0]).read()
        assert "Traceback" not in rank0 + rank1
        lines = rank0.splitlines()
        assert len(lines) == 1 and lines[0].startswith("[rlhf] invalid configuration: "), rank0
        assert name in lines[0] and rank1 == "", (rank0, rank1)
