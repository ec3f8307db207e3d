"""Reward of the tool-use example, in verl's ``compute_score`` signature.

``score`` is 1.0 when the final assistant message states the row's code in the answer format
(``The code is 417.``), else 0.0.  ``used_tool`` (logged, not rewarded) is 1.0 when the
conversation holds a tool result, i.e. the model called a tool; ``extra_info["messages"]``, the
whole conversation, is there in multi-turn runs only.  Standard library only.
"""

import re

ANSWER = re.compile(r"The code is (\d+)\.")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    found = ANSWER.findall(solution_str or "")
    messages = (extra_info or {}).get("messages") or []
    return {"score": float(bool(found) and found[-1] == str(ground_truth)),
            "used_tool": float(any(m.get("role") == "tool" for m in messages))}
