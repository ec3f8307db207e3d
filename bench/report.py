"""How a benchmark hands out its result dict: a JSON line on stdout and the ``--json`` file."""

from __future__ import annotations

import json


def write_json(result: dict, path: str | None, indent: int = 1) -> None:
    """Write ``result`` to ``path`` (the ``--json`` option; nothing when None)."""
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=indent)


def emit_json(result: dict, path: str | None) -> None:
    """Print ``result`` as one JSON line and write it to ``path`` (see :func:`write_json`)."""
    print(json.dumps(result))
    write_json(result, path)
