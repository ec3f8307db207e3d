"""The example's one tool: the secret code of a name, known only to the data row.

Each row's ``extra_info`` holds its name and code (``{"name": "kalom", "code": "417"}``); the
run passes it to ``lookup`` (a parameter named ``extra_info`` is filled from the row and is not
part of the schema the model sees).  Use it with ``rollout.tools=examples/tool_use/tools.py``
and ``rlhf.sft --tools examples/tool_use/tools.py``.
"""

import rlhf.tools

UNKNOWN = "unknown name"


@rlhf.tools.tool
def lookup(name: str, extra_info: dict) -> str:
    """Look up the secret code of a name.

    Args:
        name: the name, as written in the question
    """
    if name.strip() == extra_info["name"]:
        return extra_info["code"]
    return UNKNOWN
