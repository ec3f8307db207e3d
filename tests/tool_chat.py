"""A local byte-level BPE tokenizer with the tool-use example's ChatML template (tools and
tool results in the Hermes layout, Qwen2.5's), for the multi-turn tests: nothing downloaded."""

from __future__ import annotations

import importlib.util
import pathlib
import sys


def _tool_use_example():
    """``examples/tool_use/make_example.py``, the one copy of the tool chat template."""
    name = "tool_use_make_example"
    if name not in sys.modules:
        path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "tool_use" / \
            "make_example.py"
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


_example = _tool_use_example()
BOS, EOS, PAD, IM_START = _example.BOS, _example.EOS, _example.PAD, _example.IM_START
TOOL_TEMPLATE = _example.TOOL_TEMPLATE

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
