"""The peers the benches compare against (TRL, Ray), pinned in requirements-dev.txt.

A bench whose peer is missing stops before any work with the install line to run, not a
traceback from deep inside the run.
"""

from __future__ import annotations

import importlib.util

INSTALL = "pip install -r requirements-dev.txt  (or: make bench, which installs it)"


def peer_missing(module: str) -> str | None:
    """The install hint when ``module`` cannot be imported here, else None."""
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed: {INSTALL}"
    return None


def require_peer(module: str, bench: str) -> None:
    """Exit with the install line when ``bench``'s peer ``module`` is missing."""
    hint = peer_missing(module)
    if hint:
        raise SystemExit(f"{bench} compares against {module}, but {hint}")
