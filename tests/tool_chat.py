"""A local byte-level BPE tokenizer with a ChatML template that renders tools and tool
results in the Hermes layout (Qwen2.5's), for the multi-turn tests: nothing downloaded."""

from __future__ import annotations

BOS, EOS, PAD, IM_START = "<|endoftext|>", "<|im_end|>", "<|pad|>", "<|im_start|>"

# Tools as a system block; assistant calls as <tool_call> lines; consecutive tool results in
# one user turn of <tool_response> blocks.  {% generation %} marks the assistant's tokens.
TOOL_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- 'Tools:\\n<tools>' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>"
    "<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' and loop.first %}"
    "{%- elif m['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- generation %}{{- m['content'] }}"
    "{%- for c in m.get('tool_calls') or [] %}"
    "{%- if m['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>{\"name\": \"' + c['function']['name'] + '\", \"arguments\": '"
    " + (c['function']['arguments'] | tojson) + '}</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}"
    "{%- elif m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CORPUS = ["user\n", "assistant\n", "system\n", "Tools:\n<tools>", "</tools>",
          '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>',
          "<tool_response>\n42\n</tool_response>", "What is 12 plus 30? The answer is 42.",
          "Error: unknown tool. timed out after raised ValueError", "Let me compute it."]


def tool_tokenizer(vocab_size: int = 400):
    """A ``transformers.PreTrainedTokenizerFast`` (byte-level BPE) with :data:`TOOL_TEMPLATE`,
    eos ``<|im_end|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, IM_START, EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=None,
        additional_special_tokens=[IM_START], chat_template=TOOL_TEMPLATE,
        model_max_length=4096, clean_up_tokenization_spaces=False)


def save_tool_tokenizer(folder: str) -> str:
    tool_tokenizer().save_pretrained(folder)
    return folder
