"""Tools of multi-turn rollouts: the user's decorators, the tool catalog of a run, the call
formats, the sandbox of the built-in ``python`` tool and the turn loop.

A tool is a typed, documented function::

    import rlhf.tools

    @rlhf.tools.tool
    def add(a: int, b: int) -> int:
        \"\"\"Add two integers.

        Args:
            a: the first integer
            b: the second integer
        \"\"\"
        return a + b

and an environment is a class made once per trajectory from its data row, whose
``@rlhf.tools.tool`` methods are that trajectory's tools (:func:`environment`).
"""

from rlhf.tools.decorators import environment, is_environment, is_tool, tool

__all__ = ["environment", "is_environment", "is_tool", "tool"]
