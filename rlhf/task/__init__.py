"""Tasks and data: the built-in verifiable task (multi-digit addition, its character tokenizer
and rule rewards), users' datasets, HF tokenizers and reward functions."""

from rlhf.task.arithmetic import AdditionTask, CostRule, Example, carry_free_sum, corrupt_answer
from rlhf.task.datasets import (PromptStream, read_dataset, read_jsonl, read_parquet,
                                write_jsonl)
from rlhf.task.rewards import (REWARD_FUNCTIONS, CompositeReward, RewardOutput, exact_match,
                               format_ok, partial_digits)
from rlhf.task.hf_tokenizer import HFTokenizer, is_tokenizer_dir, load_tokenizer
from rlhf.task.tokenizer import CharTokenizer

__all__ = ["AdditionTask", "CostRule", "Example", "carry_free_sum", "corrupt_answer", "PromptStream",
           "read_dataset", "read_jsonl", "read_parquet", "write_jsonl", "REWARD_FUNCTIONS",
           "CompositeReward", "RewardOutput", "exact_match", "format_ok", "partial_digits",
           "CharTokenizer", "HFTokenizer", "is_tokenizer_dir", "load_tokenizer"]
