"""Users' Python files (a reward function, an algorithm) imported as modules of their own."""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType


def import_file(path: str, prefix: str, what: str) -> ModuleType:
    """Execute the ``.py`` file ``path`` as a new module named ``prefix + its stem``.

    Raises:
        ValueError: naming ``what`` (the config key and value that gave the file) with the
            exception the import raised.
    """
    name = prefix + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(f"{what}: importing {path} failed: {type(e).__name__}: {e}") from None
    return module
