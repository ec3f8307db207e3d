"""Multi-turn rollouts with tools, run by the controller around any :class:`Rollouts`.

::

    turn k:  one batched generation over the trajectories still running (their whole
             context: prompt, earlier turns, tool results), each up to what is left of
             data.max_response_len
             -> parse each turn's calls (rollout.tool_format); a turn without calls, the
                last turn, or a turn that did not end with EOS ends its trajectory
             -> run every call of every trajectory at once (rollout.max_parallel_tool_calls)
             -> append the template's text for the results and the next generation prompt

The response of a trajectory is every id after its prompt: the model's sampled ids
(``response_mask`` 1, their rollout log-probs kept) and the template's and tools' ids
(``response_mask`` 0, log-prob 0), so log-probs, KL, entropy and every loss see the model's
tokens only (:mod:`rlhf.tools.chat` for how the ids are made).  Each row then carries
``solution_str`` (its final assistant message, what the reward reads) and ``extra_info``
with ``messages`` (the whole conversation, tool calls and results included).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from engine.sampling import SamplingParams, derive_seed
from rlhf.controller import Batch, Future
from rlhf.programs.rollout_sources import IterationRollout, Rollouts, group_heads
from rlhf.tools.calls import ToolResult, ToolRunner
from rlhf.tools.catalog import ToolBox, ToolCatalog
from rlhf.tools.chat import continuation, prompt_ids
from rlhf.tools.formats import ToolCall, get_format

Generate = Callable[[Batch, SamplingParams], Future | Batch]


@dataclass
class Trajectory:
    """One sample's conversation and ids."""

    box: ToolBox
    messages: list[dict]
    prompt: list[int]
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    """1 for the model's sampled ids, 0 for the template's and the tools'."""
    log_probs: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    mismatches: int = 0
    done: bool = False
    calls: list[ToolCall] = field(default_factory=list)
    """The last turn's calls, waiting for their results."""
    last: list[int] = field(default_factory=list)
    """The last turn's sampled ids."""

    def add(self, ids: list[int], model: bool, log_probs: list[float] | None = None) -> None:
        self.response += ids
        self.mask += [int(model)] * len(ids)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)

    def solution(self) -> str:
        """The final assistant message's text."""
        last = [m for m in self.messages if m["role"] == "assistant"]
        return last[-1]["content"] if last else ""


def first_messages(prompt) -> list[dict]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) \
        else [dict(m) for m in prompt]


def truncate_middle(tok, text: str, max_tokens: int) -> str:
    """``text`` within ``max_tokens`` tokens: its head and tail, the cut marked."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    head = max_tokens // 2
    tail = max_tokens - head
    cut = len(ids) - max_tokens
    return (tok.decode(ids[:head]) + f"\n...[{cut} tokens cut]...\n"
            + (tok.decode(ids[-tail:]) if tail else ""))


class MultiTurn:
    """The turn loop of one run.

    Args:
        catalog: the run's tools.
        tokenizer: the run's :class:`rlhf.task.hf_tokenizer.HFTokenizer` (a chat template
            that renders tools).
        settings: the ``rollout`` section.
        max_prompt_len, max_response_len: ``data.max_prompt_len`` (the rendered prompt with
            its tools' schemas) and ``data.max_response_len`` (every turn's ids together).
    """

    def __init__(self, catalog: ToolCatalog, tokenizer, settings, max_prompt_len: int,
                 max_response_len: int) -> None:
        self.catalog, self.tokenizer = catalog, tokenizer
        self.tok = tokenizer.tok
        self.settings = settings
        self.format = get_format(settings.tool_format)
        self.runner = ToolRunner(settings.max_parallel_tool_calls, settings.tool_timeout_s)
        self.max_prompt_len, self.max_response_len = max_prompt_len, max_response_len

    def example_prompt_ids(self, example) -> list[int]:
        """The first generation prompt of a data row (an :class:`rlhf.task.Example`), its
        tools' schemas rendered (without what an environment's ``reset()`` would add)."""
        return prompt_ids(self.tok, first_messages(example.prompt),
                          self.catalog.schemas(example.tools))

    def run(self, prompts: Batch, sampling: SamplingParams, submit: Generate
            ) -> tuple[Batch, dict[str, float]]:
        """Every row of ``prompts`` (with ``prompt`` and ``tools`` among its non-tensors)
        rolled out over up to ``rollout.max_turns`` turns; returns the batch and its
        ``rollout/`` metrics.

        ``submit(batch, sampling)`` issues one turn's generation and returns its rows or a
        future of them.  With ``rollout.overlap_tools`` the rows go in two halves whose turns
        alternate: both halves' generations are issued first, and each half's tool calls run
        while the other half's generation (issued before them) goes on."""
        trajs = [self._start(prompts, i) for i in range(len(prompts))]
        timing = {"gen_s": 0.0, "reshard_s": 0.0, "tools_s": 0.0}
        n = len(trajs)
        halves = 2 if self.settings.overlap_tools and n > 1 else 1
        groups = [list(range(k * n // halves, (k + 1) * n // halves)) for k in range(halves)]
        try:
            pending = deque((0, live, self._submit(trajs, live, prompts, sampling, 0, submit))
                            for live in groups)
            while pending:
                turn, live, out = pending.popleft()
                self._receive(trajs, live, out, timing)
                t0 = time.perf_counter()
                self._tools(trajs, live, last_turn=turn == self.settings.max_turns - 1)
                timing["tools_s"] += time.perf_counter() - t0
                live = [i for i in live if not trajs[i].done]
                if live:
                    pending.append((turn + 1, live, self._submit(trajs, live, prompts, sampling,
                                                                 turn + 1, submit)))
        finally:
            for t in trajs:
                t.box.close()
        return self._batch(trajs, prompts, timing), self._metrics(trajs, timing)

    def _start(self, prompts: Batch, i: int) -> Trajectory:
        nt = prompts.non_tensors
        row = {"prompt": nt["prompt"][i], "ground_truth": nt["answer"][i],
               "data_source": nt["data_source"][i], "extra_info": nt["extra_info"][i],
               "tools": nt.get("tools", [None] * len(prompts))[i]}
        box = self.catalog.open(row)
        messages = first_messages(row["prompt"]) + box.first_messages()
        ids = prompt_ids(self.tok, messages, box.schemas)
        if len(ids) > self.max_prompt_len:
            box.close()
            raise ValueError(f"prompt {row['prompt']!r:.80} with its tools' schemas is {len(ids)} "
                             f"tokens, more than data.max_prompt_len={self.max_prompt_len}; "
                             f"raise it")
        return Trajectory(box, messages, ids)

    def _submit(self, trajs: list[Trajectory], live: list[int], prompts: Batch,
                sampling: SamplingParams, turn: int, submit: Generate):
        """Issue turn ``turn`` of the trajectories ``live`` (their whole contexts); row ``i``
        of the call samples as row ``live[0] + i`` of the batch."""
        budget = max(self.max_response_len - len(trajs[i].response) for i in live)
        ids, mask = self.tokenizer.pad_batch([trajs[i].prompt + trajs[i].response for i in live],
                                             "left")
        batch = Batch({"input_ids": ids, "attention_mask": mask.long()},
                      {k: [v[i] for i in live] for k, v in prompts.non_tensors.items()})
        s = replace(sampling, max_new_tokens=budget, seed=derive_seed(sampling.seed, "turn", turn),
                    min_new_tokens=min(sampling.min_new_tokens, budget) if turn == 0 else 0,
                    first_row=sampling.first_row + live[0])
        return submit(batch, s)

    def _receive(self, trajs: list[Trajectory], live: list[int], out, timing: dict) -> None:
        """Take the turn ``out`` (rows, or their future) generated for ``live``."""
        out = out if isinstance(out, Batch) else out.get()  # a Future: the rows, here
        timing["gen_s"] += float(out.meta.get("gen_s", 0.0))
        timing["reshard_s"] += float(out.meta.get("reshard_s", 0.0))
        width = out["input_ids"].shape[1] - out["response_mask"].shape[1]
        responses = out["input_ids"][:, width:].tolist()  # host: the turns are parsed as text
        kept = out["response_mask"].bool().tolist()
        lps = out["rollout_log_probs"].float().tolist()
        for row, i in enumerate(live):
            n = min(sum(kept[row]), self.max_response_len - len(trajs[i].response))
            self._take_turn(trajs[i], responses[row][:n], lps[row][:n])

    def _take_turn(self, t: Trajectory, ids: list[int], log_probs: list[float]) -> None:
        t.add(ids, True, log_probs)
        t.turns += 1
        text = self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        content, calls = self.format.parse(text)
        message = {"role": "assistant", "content": content}
        readable = [c.message() for c in calls if c.error is None]
        if readable:
            message["tool_calls"] = readable
        t.messages.append(message)
        t.calls, t.last = calls, ids
        ended = bool(ids) and ids[-1] == self.tokenizer.eos_id
        if not calls or not ended or len(t.response) >= self.max_response_len:
            t.done = True

    def _tools(self, trajs: list[Trajectory], live: list[int], last_turn: bool) -> None:
        calling = [i for i in live if not trajs[i].done]
        if last_turn:
            for i in calling:
                trajs[i].done = True
            return
        jobs = [(trajs[i].box, c) for i in calling for c in trajs[i].calls]
        results = iter(self.runner.run(jobs))
        for i in calling:
            t = trajs[i]
            self._answer(t, [(c, next(results)) for c in t.calls])

    def _answer(self, t: Trajectory, answered: list[tuple[ToolCall, ToolResult]]) -> None:
        s = self.settings
        replies = [{"role": "tool", "name": c.name or "invalid",
                    "content": truncate_middle(self.tok, r.text, s.max_tool_response_tokens)}
                   for c, r in answered]
        t.tool_calls += len(answered)
        t.tool_errors += sum(r.error for _c, r in answered)
        t.tool_timeouts += sum(r.timed_out for _c, r in answered)
        history, assistant = t.messages[:-1], t.messages[-1]
        sampled = self.tok.decode(t.last, skip_special_tokens=False,
                                  clean_up_tokenization_spaces=False)
        ids, exact = continuation(self.tok, history, assistant, sampled, replies, t.box.schemas)
        t.mismatches += not exact
        if len(t.response) + len(ids) >= self.max_response_len:
            t.done = True  # no room for the results and another turn
            return
        t.messages += replies
        t.add(ids, False)

    def _batch(self, trajs: list[Trajectory], prompts: Batch, timing: dict) -> Batch:
        width = max(len(t.prompt) for t in trajs)
        n = max(1, max(len(t.response) for t in trajs))
        pad = self.tokenizer.pad_id
        ids = torch.full((len(trajs), width + n), pad, dtype=torch.int64)
        attn = torch.zeros_like(ids)
        mask = torch.zeros((len(trajs), n), dtype=torch.int64)
        lps = torch.zeros((len(trajs), n), dtype=torch.float32)
        for i, t in enumerate(trajs):
            p, r = len(t.prompt), len(t.response)
            ids[i, width - p:width] = torch.tensor(t.prompt)
            ids[i, width:width + r] = torch.tensor(t.response, dtype=torch.int64)
            attn[i, width - p:width + r] = 1
            mask[i, :r] = torch.tensor(t.mask, dtype=torch.int64)
            lps[i, :r] = torch.tensor(t.log_probs, dtype=torch.float32)
        nt = dict(prompts.non_tensors)
        nt["extra_info"] = [dict(e or {}) | {"messages": t.messages}
                            for e, t in zip(nt["extra_info"], trajs)]
        nt["messages"] = [t.messages for t in trajs]
        nt["solution_str"] = [t.solution() for t in trajs]
        nt["num_turns"] = [t.turns for t in trajs]
        nt["num_tool_calls"] = [t.tool_calls for t in trajs]
        return Batch({"input_ids": ids, "attention_mask": attn, "response_mask": mask,
                      "rollout_log_probs": lps}, nt,
                     {"gen_s": timing["gen_s"], "reshard_s": timing["reshard_s"],
                      "prompt_len": width})

    @staticmethod
    def _metrics(trajs: list[Trajectory], timing: dict) -> dict[str, float]:
        n = len(trajs)
        return {"rollout/turns_mean": sum(t.turns for t in trajs) / n,
                "rollout/tool_calls_mean": sum(t.tool_calls for t in trajs) / n,
                "rollout/tool_errors": float(sum(t.tool_errors for t in trajs)),
                "rollout/tool_timeouts": float(sum(t.tool_timeouts for t in trajs)),
                "rollout/template_mismatch": float(sum(t.mismatches for t in trajs)),
                "timing_s/tools": timing["tools_s"]}


class MultiTurnRollouts:
    """A run's :class:`rlhf.programs.rollout_sources.Rollouts` with tools: every rollout (the
    iteration's, ReMax's greedy ones, DAPO's refills, the held-out evaluation's) is a
    :class:`MultiTurn` loop whose turns the wrapped rollouts generate, with the newest
    weights, in one :meth:`~rlhf.programs.rollout_sources.Rollouts.session` (a colocated actor
    reshards to its generation layout once for all the turns)."""

    def __init__(self, inner: Rollouts, loop: MultiTurn) -> None:
        self.inner, self.loop = inner, loop
        self.held: dict[str, float] | None = None
        """The open :meth:`session`'s transition (``reshard_s``); None outside one."""

    def start(self, step: int) -> dict[str, float]:
        return self.inner.start(step)

    def take(self, prompts: Batch, it, greedy: bool) -> IterationRollout:
        with self.session() as held:
            batch, metrics = self.loop.run(prompts, it.sampling, self.inner.submit)
            base = self.loop.run(group_heads(prompts), it.greedy, self.inner.submit)[0] \
                if greedy else None
        batch.meta["reshard_s"] += held["reshard_s"]
        return IterationRollout(batch, base, metrics)

    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        with self.session() as held:
            batch = self.loop.run(prompts, sampling, self.inner.submit)[0]
        batch.meta["reshard_s"] += held["reshard_s"]
        return batch

    def submit(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """:meth:`generate`, run now: the turns wait on the controller for each other's tool
        results, so nothing can be left in flight; the rows come back as they are."""
        return self.generate(prompts, sampling)

    def push(self) -> dict[str, float]:
        return self.inner.push()

    @contextmanager
    def session(self):
        """A block of several :meth:`generate`/:meth:`take` calls with the same weights: the
        wrapped rollouts' session, opened once for the block (the calls inside open none, as
        an actor cannot hold its generation layout twice).  Yields ``reshard_s`` as the
        wrapped session does; 0 for a block inside an open one."""
        if self.held is not None:
            yield {"reshard_s": 0.0}
            return
        with self.inner.session() as held:
            self.held = held
            try:
                yield held
            finally:
                self.held = None
