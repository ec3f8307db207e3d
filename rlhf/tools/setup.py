"""The multi-turn loop of a run from its config (``rollout.tools`` and the rest of the
``rollout`` section), checked before any process group exists."""

from __future__ import annotations

import sys

from rlhf.config_run import SandboxConfig
from rlhf.tools.builtin import builtin_tools
from rlhf.tools.catalog import ToolCatalog, load_catalog
from rlhf.tools.chat import continuation
from rlhf.tools.formats import get_format
from rlhf.tools.multi_turn import MultiTurn
from rlhf.tools.sandbox import isolation_problem


def check_sandbox(sandbox) -> None:
    """ValueError in one line when the local sandbox cannot isolate on this host (unless
    ``rollout.sandbox.isolation=none``, which is warned about)."""
    if sandbox.backend != "local":
        return
    if sandbox.isolation == "none":
        print("[rlhf] warning: rollout.sandbox.isolation=none: the python tool runs model-written "
              "code as a plain child process (limits only, no isolation)", file=sys.stderr,
              flush=True)
        return
    problem = isolation_problem()
    if problem is not None:
        raise ValueError(f"rollout.tools uses builtin:python but the sandbox cannot isolate "
                         f"here: {problem}; set rollout.sandbox.isolation=none to run without "
                         f"isolation, or rollout.sandbox.backend=sandbox_fusion")


_CATALOGS: dict[tuple[str, SandboxConfig], ToolCatalog] = {}


def tool_catalog(spec: str, sandbox: SandboxConfig | None = None) -> ToolCatalog:
    """The tools of ``spec`` (``rollout.tools`` or ``rlhf.sft --tools``), loaded once per
    process: the run's check (:func:`rlhf.builders.check_run`) and its roles
    (:func:`rlhf.builders.build_roles`) both read the run's loop (:func:`multi_turn_of`), and a
    user's tool file runs its module code once.  The catalog holds no trajectory's state (each
    trajectory opens its own :class:`~rlhf.tools.catalog.ToolBox`), so one serves every loop.
    A spec that fails to load is not kept: the next call raises again."""
    key = (str(spec), sandbox or SandboxConfig())
    if key not in _CATALOGS:
        _CATALOGS[key] = load_catalog(key[0], builtin_tools(key[1]))
    return _CATALOGS[key]


def multi_turn_of(cfg, tokenizer) -> MultiTurn | None:
    """The run's :class:`MultiTurn` loop; None without ``rollout.tools`` (one-turn
    rollouts).  ValueError naming the value for a tool file, format, tokenizer or sandbox
    that cannot work."""
    r = cfg.rollout
    if r.tools is None:
        return None
    get_format(r.tool_format)
    catalog = tool_catalog(r.tools, r.sandbox)
    if "builtin:python" in [s.strip() for s in r.tools.split(",")]:
        check_sandbox(r.sandbox)
    tok = getattr(tokenizer, "tok", None)
    if tok is None or not getattr(tok, "chat_template", None):
        raise ValueError("rollout.tools needs a tokenizer with a chat template that renders "
                         "tools (tokenizer=DIR of an HF tokenizer, e.g. Qwen2.5's); the "
                         "built-in task's tokenizer has none")
    check_template(tok, catalog.schemas())
    return MultiTurn(catalog, tokenizer, r, cfg.data.max_prompt_len, cfg.data.max_response_len)


def check_template(tok, schemas: list[dict]) -> None:
    """ValueError unless the chat template renders a tool round trip by appending (what
    token-in, token-out multi-turn rollouts need), tried on a made-up conversation."""
    name = schemas[0]["function"]["name"] if schemas else "tool"
    assistant = {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {"name": name,
                                                                  "arguments": {}}}]}
    try:
        continuation(tok, [{"role": "user", "content": "hi"}], assistant, "",
                     [{"role": "tool", "name": name, "content": "ok"}], schemas)
    except Exception as e:
        raise ValueError(f"rollout.tools: the tokenizer's chat template cannot render a tool "
                         f"call and its result ({type(e).__name__}: {e})") from None
