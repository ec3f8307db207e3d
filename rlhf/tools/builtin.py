"""Built-in tools, named ``builtin:<name>`` in ``rollout.tools``.

``python`` runs the model's program in the sandbox of ``rollout.sandbox``
(:mod:`rlhf.tools.sandbox`) and answers with what it printed (and its error, if it failed).
"""

from __future__ import annotations

from collections.abc import Callable

from rlhf.config_run import SandboxConfig
from rlhf.tools.sandbox import SandboxResult, run_python


def describe(result: SandboxResult) -> str:
    """The text the model reads for a sandbox run."""
    parts = [result.stdout] if result.stdout else []
    if result.exit_code not in (0, None) or result.stderr:
        parts.append(result.stderr)
    if result.timed_out or result.killed:
        parts.append(f"[stopped: {result.killed or 'wall_time'} limit]")
    elif result.exit_code not in (0, None):
        parts.append(f"[exit code {result.exit_code}]")
    return "\n".join(p.rstrip("\n") for p in parts) or "[no output]"


def builtin_tools(sandbox: SandboxConfig) -> dict[str, Callable]:
    """Name -> tool function of every built-in tool, bound to the run's sandbox settings."""

    def python(code: str) -> str:
        """Run a Python 3 program in a sandbox (standard library only, no network, no
        files kept between calls) and return what it printed.

        Args:
            code: the program's source code; print the values you need to see.
        """
        return describe(run_python(code, sandbox))

    return {"python": python}
