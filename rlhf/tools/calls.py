"""Running a turn's tool calls: concurrently (at most ``rollout.max_parallel_tool_calls`` at
once, over every trajectory), each within ``rollout.tool_timeout_s``.

Whatever goes wrong in a call (a call the format could not read, an unknown tool, arguments
the tool does not take, an exception, a timeout) becomes the call's result text, which the
model reads as the tool's answer; nothing of it reaches the run.  A call past its timeout is
abandoned in its (daemon) thread: a Python function cannot be stopped from outside; the
built-in ``python`` tool stops its own process at the sandbox's wall time.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
from dataclasses import dataclass

from rlhf.tools.catalog import ToolBox
from rlhf.tools.formats import ToolCall


@dataclass(frozen=True)
class ToolResult:
    """What one call gave the model."""

    text: str
    error: bool = False
    """The call failed (unreadable, unknown tool, bad arguments, exception, timeout)."""
    timed_out: bool = False
    seconds: float = 0.0


def result_text(value) -> str:
    """A tool's return value as the text the model reads (JSON for dicts and lists)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list, tuple)):
        try:
            return json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            pass
    return str(value)


def _argument_error(box: ToolBox, call: ToolCall) -> str | None:
    params = box.tools[call.name].schema["function"]["parameters"]
    known, required = set(params.get("properties", {})), set(params.get("required", []))
    unknown = sorted(set(call.arguments) - known)
    missing = sorted(required - set(call.arguments))
    if unknown:
        return f"tool {call.name!r} takes no argument(s) {unknown}; it takes {sorted(known)}"
    if missing:
        return f"tool {call.name!r} needs argument(s) {missing}"
    return None


def _invoke(fn, arguments: dict):
    out = fn(**arguments)
    return asyncio.run(out) if inspect.iscoroutine(out) else out


class ToolRunner:
    """Runs calls of many trajectories at once (``max_parallel`` threads at most)."""

    def __init__(self, max_parallel: int, timeout_s: float) -> None:
        self.slots = threading.BoundedSemaphore(max_parallel)
        self.timeout_s = timeout_s

    def run(self, jobs: list[tuple[ToolBox, ToolCall]]) -> list[ToolResult]:
        """Results of ``jobs`` in order; returns when every call ended or timed out."""
        results: list[ToolResult | None] = [None] * len(jobs)
        threads = []
        for i, (box, call) in enumerate(jobs):
            problem = self._problem(box, call)
            if problem is not None:
                results[i] = ToolResult(f"Error: {problem}", error=True)
                continue
            if not self.slots.acquire(timeout=self.timeout_s):  # slots held by abandoned calls
                results[i] = ToolResult(f"Error: tool {call.name!r} found no free slot within "
                                        f"{self.timeout_s:g} s", error=True, timed_out=True)
                continue
            t = threading.Thread(target=self._call, args=(box, call, results, i), daemon=True,
                                 name=f"tool-{call.name}")
            t.start()
            threads.append((i, call, t, time.monotonic()))
        for i, call, t, t0 in threads:
            t.join(max(0.0, self.timeout_s - (time.monotonic() - t0)))
            if t.is_alive():  # abandoned; its slot is freed when it returns
                results[i] = ToolResult(f"Error: tool {call.name!r} timed out after "
                                        f"{self.timeout_s:g} s", error=True, timed_out=True,
                                        seconds=self.timeout_s)
        return results

    @staticmethod
    def _problem(box: ToolBox, call: ToolCall) -> str | None:
        if call.error is not None:
            return f"malformed tool call: {call.error}"
        if call.name not in box.tools:
            return f"unknown tool {call.name!r}; the tools are {sorted(box.tools)}"
        return _argument_error(box, call)

    def _call(self, box: ToolBox, call: ToolCall, results: list, i: int) -> None:
        t0 = time.monotonic()
        try:
            value = _invoke(box.bound(call.name), call.arguments)
            result = ToolResult(result_text(value), seconds=time.monotonic() - t0)
        except Exception as e:
            result = ToolResult(f"Error: tool {call.name!r} raised {type(e).__name__}: {e}",
                                error=True, seconds=time.monotonic() - t0)
        finally:
            self.slots.release()
        if results[i] is None:  # not already reported as timed out
            results[i] = result
