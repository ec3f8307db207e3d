"""Token ids of a tool conversation through the tokenizer's chat template, token in, token
out: the model's sampled ids are kept as sampled, and only what the template adds between
turns (the end of the assistant turn after its last sampled token, the tool results, the
next generation prompt) is rendered and appended.

For a turn the template renders as ``G + A`` (``G`` the conversation so far with its
generation prompt, ``A`` the assistant message), the model sampled the text ``S``; when ``A``
starts with ``S`` the ids appended are those of ``A[len(S):] + R`` (``R`` the template's text
for the new messages and the next generation prompt), so the whole sequence is the template's
rendering of the decoded conversation.  When the template writes the turn otherwise (it
re-formats the calls' JSON, say) the sampled ids stay, ``R`` follows them and the turn counts
as a template mismatch (``rollout/template_mismatch``).
"""

from __future__ import annotations


def render(tok, messages: list[dict], tools: list[dict] | None,
           add_generation_prompt: bool) -> str:
    """The chat template's text of ``messages`` (``tok`` a transformers tokenizer)."""
    if not tok.chat_template:
        raise ValueError(f"tokenizer {getattr(tok, 'name_or_path', '')!r} has no chat_template: "
                         f"multi-turn rollouts render tool results through it")
    return tok.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                   add_generation_prompt=add_generation_prompt)


def encode_text(tok, text: str) -> list[int]:
    """Ids of rendered template text (its special tokens parsed, none added)."""
    return list(tok(text, add_special_tokens=False)["input_ids"])


def prompt_ids(tok, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """Ids of the first generation prompt."""
    return encode_text(tok, render(tok, messages, tools, add_generation_prompt=True))


def continuation(tok, history: list[dict], assistant: dict, sampled_text: str,
                 new_messages: list[dict], tools: list[dict] | None) -> tuple[list[int], bool]:
    """``(ids, exact)``: what follows the model's sampled ids of ``assistant`` when
    ``new_messages`` (tool results) join the conversation, through the next generation
    prompt; ``exact`` when the sampled text is how the template writes the turn.

    Args:
        history: the messages before the assistant turn.
        assistant: the assistant turn as a message (content and tool_calls).
        sampled_text: the decoded sampled ids of the turn, special tokens kept.
    """
    before = render(tok, history, tools, add_generation_prompt=True)
    through = render(tok, history + [assistant], tools, add_generation_prompt=False)
    after = render(tok, history + [assistant] + new_messages, tools, add_generation_prompt=True)
    if not (through.startswith(before) and after.startswith(through)):
        raise ValueError("the chat template renders an earlier conversation differently once "
                         "messages follow it; multi-turn rollouts need a template that only "
                         "appends")
    turn, rest = through[len(before):], after[len(through):]
    if turn.startswith(sampled_text):
        return encode_text(tok, turn[len(sampled_text):] + rest), True
    return encode_text(tok, rest), False
