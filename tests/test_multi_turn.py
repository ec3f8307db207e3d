"""Multi-turn rollouts with tools (rlhf.tools): the turn loop against a scripted generator
(ids against the chat template's rendering, masks, log-probs, tool failures, limits), the
call format, the tool catalog and the rollout log."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

import rlhf.tools
from rlhf.config_run import LogConfig, RolloutConfig, SandboxConfig
from rlhf.controller import Batch
from rlhf.prompts import encode_prompts
from rlhf.rollout_log import rollout_records, write_rollouts
from rlhf.task import Example, load_tokenizer
from rlhf.tools.catalog import Tool, ToolCatalog, load_catalog, tool_schema
from rlhf.tools.chat import render
from rlhf.tools.formats import HermesFormat
from rlhf.tools.multi_turn import MultiTurn, truncate_middle
from engine.sampling import SamplingParams
from tests.tool_chat import save_tool_tokenizer

CALL = '<tool_call>{{"name": "{}", "arguments": {}}}</tool_call>'


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(save_tool_tokenizer(str(tmp_path_factory.mktemp("tok"))))


@rlhf.tools.tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


@rlhf.tools.tool
def fail(x: str) -> str:
    """Always raises.

    Args:
        x: anything
    """
    raise ValueError(f"bad {x}")


@rlhf.tools.tool
def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke"


def catalog(*fns) -> ToolCatalog:
    return ToolCatalog([Tool(f.__name__, f, tool_schema(f)) for f in fns])


class ScriptedModel:
    """A generator whose reply to a context is ``policy(context_text)`` (+ EOS), with
    log-prob ``-(k + 1) / 100`` for the k-th token of each reply."""

    def __init__(self, tok, policy) -> None:
        self.tok, self.policy, self.calls = tok, policy, []

    def __call__(self, batch: Batch, s: SamplingParams) -> Batch:
        self.calls.append((len(batch), s.max_new_tokens))
        ctx = [[i for i, m in zip(row, mask) if m] for row, mask in
               zip(batch["input_ids"].tolist(), batch["attention_mask"].tolist())]
        replies = [(self.tok.tok(self.policy(self.tok.tok.decode(c)),
                                 add_special_tokens=False)["input_ids"]
                    + [self.tok.eos_id])[:s.max_new_tokens] for c in ctx]
        n = max(len(r) for r in replies)
        out = torch.full((len(batch), n), self.tok.pad_id)
        mask = torch.zeros((len(batch), n), dtype=torch.int64)
        lps = torch.zeros((len(batch), n))
        for i, r in enumerate(replies):
            out[i, :len(r)] = torch.tensor(r)
            mask[i, :len(r)] = 1
            lps[i, :len(r)] = -(torch.arange(len(r)) + 1) / 100
        return Batch({"input_ids": torch.cat([batch["input_ids"], out], 1),
                      "attention_mask": torch.cat([batch["attention_mask"], mask], 1),
                      "response_mask": mask, "rollout_log_probs": lps},
                     dict(batch.non_tensors), {"gen_s": 0.5})


def prompts(tok, rows: list[Example], samples: int = 1) -> Batch:
    return encode_prompts(rows, tok, 512, samples, 0)


def loop(tok, cat, max_response_len=512, **settings) -> MultiTurn:
    return MultiTurn(cat, tok, RolloutConfig(tools="x", **settings), 2048, max_response_len)


def sampling(tok) -> SamplingParams:
    return SamplingParams(max_new_tokens=256, temperature=1.0, eos_token_id=tok.eos_id,
                          pad_token_id=tok.pad_id)


def adder(ctx: str) -> str:
    """Calls ``add`` once, then answers with the last tool result."""
    if "<tool_response>" not in ctx:
        return CALL.format("add", json.dumps({"a": 12, "b": 30}))
    return "The answer is " + ctx.rsplit("<tool_response>\n", 1)[1].split("\n")[0] + "."


ROW = Example([{"role": "user", "content": "What is 12 plus 30?"}], "42", "t", {"k": 1})


def test_ids_are_the_templates_rendering_of_the_decoded_conversation(tok):
    mt = loop(tok, catalog(add))
    batch, metrics = mt.run(prompts(tok, [ROW], samples=2), sampling(tok),
                            ScriptedModel(tok, adder))
    messages = batch["messages"][0]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[1]["tool_calls"][0]["function"] == {"name": "add",
                                                        "arguments": {"a": 12, "b": 30}}
    assert messages[2]["content"] == "42" and batch["solution_str"][0] == "The answer is 42."
    assert batch["extra_info"][0] == {"k": 1, "messages": messages}
    schemas = [tool_schema(add)]
    ids = batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist()
    # the template ends the last assistant turn with a newline the model never samples
    assert tok.tok.decode(ids) + "\n" == render(tok.tok, messages, schemas, False)
    width = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
    response = batch["input_ids"][0, width:]
    mask = batch["response_mask"][0].bool()
    sampled = tok.tok.decode(response[mask].tolist())
    assert sampled == CALL.format("add", json.dumps({"a": 12, "b": 30})) + "<|im_end|>" \
        + "The answer is 42.<|im_end|>"
    lps = batch["rollout_log_probs"][0]
    assert torch.all(lps[~mask] == 0) and torch.all(lps[mask] < 0)
    assert lps[mask][0] == pytest.approx(-0.01)  # each turn's first token: its own log-prob
    tool_ids = response[~mask & batch["attention_mask"][0, width:].bool()]
    assert "<tool_response>\n42\n</tool_response>" in tok.tok.decode(tool_ids.tolist())
    assert metrics["rollout/turns_mean"] == 2 and metrics["rollout/tool_calls_mean"] == 1
    assert metrics["rollout/tool_errors"] == 0 and metrics["rollout/template_mismatch"] == 0
    assert batch["num_turns"] == [2, 2]


def test_tool_failures_become_messages_never_crashes(tok):
    bad = ['<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',  # missing b
           CALL.format("nope", "{}"), "<tool_call>{not json}</tool_call>",
           CALL.format("fail", json.dumps({"x": "y"})),
           CALL.format("slow", json.dumps({"seconds": 5})), "<tool_call>{\"name\": \"add\""]

    def policy(ctx: str) -> str:
        return "done" if "<tool_response>" in ctx else "\n".join(bad)

    mt = loop(tok, catalog(add, fail, slow), 2048, tool_timeout_s=0.3)
    t0 = time.monotonic()
    batch, metrics = mt.run(prompts(tok, [ROW]), sampling(tok), ScriptedModel(tok, policy))
    assert time.monotonic() - t0 < 4  # the 5 s call was abandoned at its timeout
    results = [m["content"] for m in batch["messages"][0] if m["role"] == "tool"]
    assert len(results) == 6 and all(r.startswith("Error:") for r in results)
    assert "needs argument(s) ['b']" in results[0] and "unknown tool 'nope'" in results[1]
    assert "not valid JSON" in results[2] and "ValueError: bad y" in results[3]
    assert "timed out" in results[4] and "not closed" in results[5]
    assert metrics["rollout/tool_errors"] == 6 and metrics["rollout/tool_timeouts"] == 1


def test_calls_run_concurrently_within_the_bound(tok):
    running, peak, lock = [0], [0], threading.Lock()

    @rlhf.tools.tool
    def wait(n: int) -> int:
        """Waits a little.

        Args:
            n: returned as is
        """
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.1)
        with lock:
            running[0] -= 1
        return n

    def policy(ctx: str) -> str:
        return "ok" if "<tool_response>" in ctx else "\n".join(
            CALL.format("wait", json.dumps({"n": k})) for k in range(3))

    mt = loop(tok, catalog(wait), 2048, max_parallel_tool_calls=2)
    batch, _ = mt.run(prompts(tok, [ROW], samples=3), sampling(tok), ScriptedModel(tok, policy))
    assert peak[0] == 2  # 9 calls over 3 trajectories, at most 2 at once
    assert [m["content"] for m in batch["messages"][2] if m["role"] == "tool"] == ["0", "1", "2"]


def test_turn_and_length_limits(tok):
    def always_call(ctx: str) -> str:
        return CALL.format("add", json.dumps({"a": 1, "b": 2}))

    model = ScriptedModel(tok, always_call)
    batch, m = loop(tok, catalog(add), max_turns=3).run(prompts(tok, [ROW]), sampling(tok),
                                                         model)
    assert m["rollout/turns_mean"] == 3 and m["rollout/tool_calls_mean"] == 2  # last unanswered
    assert batch["messages"][0][-1]["role"] == "assistant"
    short = loop(tok, catalog(add), max_response_len=40, max_turns=8)
    model = ScriptedModel(tok, always_call)
    batch, m = short.run(prompts(tok, [ROW]), sampling(tok), model)
    assert batch["response_mask"].shape[1] <= 40 and m["rollout/turns_mean"] < 8
    assert all(n <= 40 for _rows, n in model.calls)


def test_environment_per_trajectory_and_extra_info(tok, tmp_path):
    (tmp_path / "env_tools.py").write_text('''
import rlhf.tools
CLOSED = []

@rlhf.tools.environment
class Counter:
    def __init__(self, row):
        self.n = row["extra_info"]["start"]

    def reset(self):
        return f"The counter starts at {self.n}."

    @rlhf.tools.tool
    def bump(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: the increment
        """
        self.n += by
        return self.n

    def close(self):
        CLOSED.append(self.n)

@rlhf.tools.tool
def secret(extra_info: dict) -> str:
    """The row's secret."""
    return extra_info["secret"]
''')
    cat = load_catalog(str(tmp_path / "env_tools.py"), {})
    assert sorted(cat.tools) == ["bump", "secret"]
    assert "extra_info" not in json.dumps(cat.tools["secret"].schema)

    def policy(ctx: str) -> str:
        n = ctx.count("<tool_response>")
        return [CALL.format("bump", '{"by": 5}'), CALL.format("secret", "{}"), "end"][min(n, 2)]

    rows = [Example("go", "", "t", {"start": 10 * k, "secret": f"s{k}"}) for k in (1, 2)]
    batch, _ = loop(tok, cat).run(prompts(tok, rows), sampling(tok), ScriptedModel(tok, policy))
    for k, msgs in zip((1, 2), batch["messages"]):
        assert msgs[1] == {"role": "user", "content": f"The counter starts at {10 * k}."}
        assert [m["content"] for m in msgs if m["role"] == "tool"] == [str(10 * k + 5), f"s{k}"]
    closed = cat.tools["bump"].fn.__globals__["CLOSED"]
    assert sorted(closed) == [15, 25]


def test_a_rows_tools_limit_its_schemas_and_calls(tok):
    row = Example("hi", "", "t", None, ["add"])
    seen = []

    def policy(ctx: str) -> str:
        seen.append(ctx)
        return "ok" if "<tool_response>" in ctx else CALL.format("fail", '{"x": "1"}')

    batch, _ = loop(tok, catalog(add, fail)).run(prompts(tok, [row]), sampling(tok),
                                                 ScriptedModel(tok, policy))
    assert '"name": "add"' in seen[0] and '"name": "fail"' not in seen[0]
    assert "unknown tool 'fail'" in batch["messages"][0][2]["content"]
    with pytest.raises(ValueError, match="names tools \\['nope'\\]"):
        catalog(add).allowed(["nope"])


def test_truncate_middle_keeps_head_and_tail(tok):
    text = "".join(f"{k} " for k in range(200))
    out = truncate_middle(tok.tok, text, 20)
    assert out.startswith("0 1") and out.rstrip().endswith("199") and "tokens cut" in out
    n = len(tok.tok(text, add_special_tokens=False)["input_ids"])
    assert f"[{n - 20} tokens cut]" in out
    assert truncate_middle(tok.tok, "short", 20) == "short"


def test_hermes_format():
    content, calls = HermesFormat().parse(
        'Let me see.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>')
    assert content == "Let me see." and [(c.name, c.arguments) for c in calls] == \
        [("a", {"x": 1}), ("b", {"y": 2})]
    assert HermesFormat().parse("no calls") == ("no calls", [])
    content, calls = HermesFormat().parse('<tool_call>{"name": 3}</tool_call>')
    assert calls[0].error and not calls[0].name and content == '<tool_call>{"name": 3}</tool_call>'
    content, calls = HermesFormat().parse('ok <tool_call>{"name": "a"')
    assert content == 'ok <tool_call>{"name": "a"' and "not closed" in calls[0].error


def test_tool_schema_is_transformers_schema_without_extra_info():
    from transformers.utils import get_json_schema

    @rlhf.tools.tool
    def lookup(key: str, limit: int = 3, extra_info: dict | None = None) -> list:
        """Look a key up.

        Args:
            key: what to look up
            limit: how many results
            extra_info: the row's extra_info
        """

    def plain(key: str, limit: int = 3) -> list:
        """Look a key up.

        Args:
            key: what to look up
            limit: how many results
        """

    expected = get_json_schema(plain)
    expected["function"]["name"] = "lookup"
    assert tool_schema(lookup) == expected


def test_catalog_errors(tmp_path):
    (tmp_path / "none.py").write_text("def f(): pass\n")
    with pytest.raises(ValueError, match="no @rlhf.tools.tool"):
        load_catalog(str(tmp_path / "none.py"), {})
    with pytest.raises(ValueError, match="'builtin:shell' is not a built-in tool"):
        load_catalog("builtin:shell", {"python": add})
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        catalog(add, add)
    with pytest.raises(ValueError, match="does not exist"):
        load_catalog(str(tmp_path / "missing.py"), {})
    with pytest.raises(ValueError, match="no docstring"):
        rlhf.tools.tool(lambda: 1)
    with pytest.raises(ValueError, match="rollout.max_turns=0"):
        RolloutConfig(max_turns=0)
    with pytest.raises(ValueError, match="sandbox_fusion needs rollout.sandbox.url"):
        SandboxConfig(backend="sandbox_fusion")
    with pytest.raises(ValueError, match="log.rollouts_every=-1"):
        LogConfig(rollouts_every=-1)


def test_rollout_records(tok, tmp_path):
    batch, _ = loop(tok, catalog(add)).run(prompts(tok, [ROW]), sampling(tok),
                                           ScriptedModel(tok, adder))
    batch.tensors["scores"] = torch.tensor([1.0])
    rec = rollout_records(batch, tok)[0]
    mask = batch["response_mask"][0]
    width = batch["input_ids"].shape[1] - mask.shape[0]
    real = int(batch["attention_mask"][0, width:].sum())
    assert rec["response_tokens"] == int(mask.sum()) and rec["tool_tokens"] == real - int(mask.sum())
    assert rec["num_turns"] == 2 and rec["num_tool_calls"] == 1 and rec["reward"] == 1.0
    path = write_rollouts(str(tmp_path), 3, [rec])
    assert path.endswith("rollouts/iter_3.jsonl")
    assert json.loads(open(path).read()) == rec


def test_builtin_python_tool_runs_in_the_sandbox(tok):
    from rlhf.tools.builtin import builtin_tools

    cat = load_catalog("builtin:python", builtin_tools(SandboxConfig(wall_time_s=10, cpu_time_s=1)))
    assert cat.tools["python"].schema["function"]["parameters"]["required"] == ["code"]
    snippets = ["print(6 * 7)", "import os; print(sorted(os.listdir('/')))",
                "while True: pass", "raise KeyError('k')"]

    def policy(ctx: str) -> str:
        k = ctx.count("<tool_response>")
        return "done" if k else "\n".join(CALL.format("python", json.dumps({"code": c}))
                                          for c in snippets)

    batch, m = loop(tok, cat, 2048, tool_timeout_s=30).run(prompts(tok, [ROW]), sampling(tok),
                                                           ScriptedModel(tok, policy))
    out = [msg["content"] for msg in batch["messages"][0] if msg["role"] == "tool"]
    assert out[0] == "42"
    assert "work" not in out[1] and "tmp" in out[1]  # the sandbox's root, not the host's
    assert "[stopped: cpu_time limit]" in out[2]
    assert "KeyError: 'k'" in out[3] and "[exit code 1]" in out[3]
    assert m["rollout/tool_errors"] == 0  # the tool ran each time; the programs failed


def test_setup_refuses_a_sandbox_that_cannot_isolate(tok, monkeypatch, tmp_path):
    from types import SimpleNamespace

    import rlhf.tools.setup as setup

    monkeypatch.setattr(setup, "isolation_problem", lambda: "unshare not found")
    cfg = SimpleNamespace(rollout=RolloutConfig(tools="builtin:python"),
                          data=SimpleNamespace(max_prompt_len=64, max_response_len=64))
    with pytest.raises(ValueError, match="cannot isolate here: unshare not found; set "
                                         "rollout.sandbox.isolation=none"):
        setup.multi_turn_of(cfg, tok)
    cfg.rollout = RolloutConfig(tools="builtin:python",
                                sandbox=SandboxConfig(isolation="none"))
    assert setup.multi_turn_of(cfg, tok) is not None
    cfg.rollout = RolloutConfig(tools="builtin:python", tool_format="xml")
    with pytest.raises(ValueError, match="rollout.tool_format='xml' is not one of"):
        setup.multi_turn_of(cfg, tok)
    cfg.rollout = RolloutConfig(tools="builtin:python",
                                sandbox=SandboxConfig(isolation="none"))
    with pytest.raises(ValueError, match="chat template that renders tools"):
        setup.multi_turn_of(cfg, object())  # the built-in task's tokenizer


def test_a_runs_tool_files_load_once(tok, tmp_path):
    """The run's check and its roles both build the loop (rlhf.builders.check_run,
    build_roles): one catalog, the user's file executed once."""
    from types import SimpleNamespace

    import rlhf.tools.setup as setup

    runs = tmp_path / "imports.txt"
    (tmp_path / "once_tools.py").write_text(f"""
import rlhf.tools

with open({str(runs)!r}, "a") as f:
    f.write("imported\\n")

@rlhf.tools.tool
def twice(x: int) -> int:
    \"\"\"Double.

    Args:
        x: a number
    \"\"\"
    return 2 * x
""")
    cfg = SimpleNamespace(rollout=RolloutConfig(tools=str(tmp_path / "once_tools.py")),
                          data=SimpleNamespace(max_prompt_len=64, max_response_len=64))
    checked, built = setup.multi_turn_of(cfg, tok), setup.multi_turn_of(cfg, tok)
    assert checked.catalog is built.catalog and sorted(built.catalog.tools) == ["twice"]
    assert runs.read_text() == "imported\n"


def test_the_tools_of_docs_tools_md_load_and_run(tmp_path):
    import pathlib

    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "tools.md").read_text()
    code = doc.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "doc_tools.py").write_text(code)
    cat = load_catalog(str(tmp_path / "doc_tools.py"), {})
    row = {"prompt": "hi", "extra_info": {"codes": {"kiwi": "123"}, "files": {"a.txt": "x"}}}
    box = cat.open(row)
    assert box.first_messages() == [{"role": "user", "content": "Files: ['a.txt']"}]
    assert box.bound("lookup")(name="kiwi") == "123"
    assert box.bound("cat")(path="a.txt") == "x"
    assert [s["function"]["name"] for s in box.schemas] == ["lookup", "cat"]
    box.close()


class Done:
    """A finished call, as a worker group's future reads."""

    def __init__(self, value):
        self.value = value

    def wait(self):
        return self

    def get(self):
        return self.value


class FakeActor:
    """An actor that logs its layout holds and generations (the scripted adder model)."""

    def __init__(self, tok):
        self.log, self.model = [], ScriptedModel(tok, adder)

    holding = False

    def hold_generation(self, hold):
        if hold == self.holding:  # as the actor worker: a layout is held once
            raise RuntimeError(f"hold_generation({hold}) but it is {self.holding}")
        self.holding = hold
        self.log.append(("hold", hold))
        return Done([0.25, 0.5])

    def generate_sequences(self, batch, sampling):
        self.log.append(("generate", len(batch)))
        return Done(self.model(batch, sampling))


def test_a_colocated_actor_holds_its_generation_layout_for_all_turns(tok):
    from rlhf.programs.iteration import Iteration
    from rlhf.programs.rollout_sources import ActorRollouts
    from rlhf.tools.multi_turn import MultiTurnRollouts

    actor = FakeActor(tok)
    rollouts = MultiTurnRollouts(ActorRollouts(actor), loop(tok, catalog(add)))
    it = Iteration(algo=None, sampling=sampling(tok), greedy=sampling(tok), timer=None,
                   kl_ctrl=None, lagrange=None, mini_batch_size=2, more_prompts=None)
    out = rollouts.take(prompts(tok, [ROW], samples=2), it, greedy=False)
    assert actor.log == [("hold", True), ("generate", 2), ("generate", 2), ("hold", False)]
    assert out.batch.meta["reshard_s"] == 0.5  # the one transition (slowest rank)


def test_multi_turn_rollouts_are_a_full_rollouts_source(tok):
    """Every method of the Rollouts protocol, and a session around several multi-turn
    rollouts holds the actor's generation layout once (the calls inside hold none)."""
    from rlhf.programs.rollout_sources import ActorRollouts, Rollouts
    from rlhf.tools.multi_turn import MultiTurnRollouts

    protocol = [m for m in vars(Rollouts) if not m.startswith("_")]
    assert sorted(protocol) == ["generate", "push", "session", "start", "submit", "take"]
    assert [m for m in protocol if not callable(getattr(MultiTurnRollouts, m, None))] == []
    actor = FakeActor(tok)
    rollouts = MultiTurnRollouts(ActorRollouts(actor), loop(tok, catalog(add)))
    rows = prompts(tok, [ROW], samples=2)
    with rollouts.session() as held:
        first = rollouts.generate(rows, sampling(tok))
        second = rollouts.submit(rows, sampling(tok))
    assert held["reshard_s"] == 0.5
    assert actor.log == [("hold", True)] + [("generate", 2)] * 4 + [("hold", False)]
    assert isinstance(second, Batch) and len(second) == len(first) == 2
    assert torch.equal(second["input_ids"], first["input_ids"])
    assert second.meta["reshard_s"] == first.meta["reshard_s"] == 0.0  # inside the block
    assert rollouts.held is None
    alone = rollouts.submit(rows, sampling(tok))  # outside a block: a session of its own
    assert actor.log[-4:] == [("hold", True), ("generate", 2), ("generate", 2), ("hold", False)]
    assert alone.meta["reshard_s"] == 0.5


def test_sft_rows_with_tool_calls_train_on_the_assistants_tokens_only(tok):
    from rlhf.sft import encode_messages

    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 30}}}
    messages = [{"role": "user", "content": "What is 12 plus 30?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "add", "content": "42"},
                {"role": "assistant", "content": "The answer is 42."}]
    demo = encode_messages(messages, tok, "row 1", [tool_schema(add)])
    assert tok.tok.decode(demo.input_ids) == render(tok.tok, messages, [tool_schema(add)],
                                                    False)
    trained = [i for i, m in zip(demo.input_ids, demo.loss_mask) if m]
    assert tok.tok.decode(trained) == (CALL.format("add", json.dumps({"a": 12, "b": 30}))
                                       + "<|im_end|>The answer is 42.<|im_end|>")
    with pytest.raises(ValueError, match="give the tools with --tools"):
        encode_messages(messages, tok, "row 1")


def test_setup_refuses_a_template_that_rewrites_earlier_turns(tok, monkeypatch):
    from rlhf.tools.setup import check_template

    check_template(tok.tok, [tool_schema(add)])  # the test template appends
    rewriting = tok.tok.chat_template.replace(
        "{{- '<|im_start|>assistant\\n' }}{%- generation %}",
        "{{- '<|im_start|>assistant\\n' }}{%- if not loop.last %}[old]{%- endif %}"
        "{%- generation %}")
    assert rewriting != tok.tok.chat_template
    monkeypatch.setattr(tok.tok, "chat_template", rewriting)
    with pytest.raises(ValueError, match="cannot render a tool call and its result"):
        check_template(tok.tok, [tool_schema(add)])


def test_prompts_are_fitted_with_their_tools_rendered(tok, capsys):
    from rlhf.prompts import fitting_prompts

    mt = loop(tok, catalog(add, fail))
    plain, limited = Example("hi", "", "t"), Example("hi", "", "t", None, ["add"])
    ids = mt.example_prompt_ids(limited)
    assert ids == mt._start(prompts(tok, [limited]), 0).prompt  # what the first turn sees
    assert len(mt.example_prompt_ids(plain)) > len(ids) > len(tok.encode_prompt("hi"))
    kept = fitting_prompts([plain, limited], tok, len(ids), "data.train_files",
                           mt.example_prompt_ids)
    assert kept == [limited] and "dropped 1 of 2 prompts" in capsys.readouterr().out


def test_overlap_runs_one_halfs_tools_while_the_other_half_generates(tok):
    events = []

    @rlhf.tools.tool
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first integer
            b: the second integer
        """
        events.append(("tool", a))
        return a + b

    class Pending:
        def __init__(self, rows, out):
            self.rows, self.out = rows, out

        def get(self):
            events.append(("get", self.rows))
            return self.out

    model = ScriptedModel(tok, adder)

    def submit(batch, s):
        events.append(("submit", s.first_row))
        return Pending(s.first_row, model(batch, s))

    rows = [Example([{"role": "user", "content": f"What is {k} plus 30?"}], "", "t")
            for k in (1, 2, 3, 4)]
    plain, _ = loop(tok, catalog(add)).run(prompts(tok, rows), sampling(tok), model)
    events.clear()
    both, _ = loop(tok, catalog(add), overlap_tools=True).run(prompts(tok, rows),
                                                             sampling(tok), submit)
    assert [e for e in events if e[0] != "tool"] == [
        ("submit", 0), ("submit", 2), ("get", 0), ("submit", 0), ("get", 2), ("submit", 2),
        ("get", 0), ("get", 2)]
    # the first half's calls ran after the second half's turn was issued, before it was read
    assert events.index(("tool", 12)) < events.index(("get", 2))
    for key in ("input_ids", "attention_mask", "response_mask", "rollout_log_probs"):
        assert torch.equal(both[key], plain[key]), key
    assert both["messages"] == plain["messages"]
