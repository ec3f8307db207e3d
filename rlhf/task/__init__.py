"""The built-in verifiable task (multi-digit addition): tokenizer, data, rule-based rewards."""

from rlhf.task.arithmetic import AdditionTask, CostRule, Example, corrupt_answer
from rlhf.task.datasets import (PromptStream, read_dataset, read_jsonl, read_parquet,
                                write_jsonl)
from rlhf.task.rewards import (REWARD_FUNCTIONS, CompositeReward, RewardOutput, exact_match,
                               format_ok, partial_digits)
from rlhf.task.tokenizer import CharTokenizer

__all__ = ["AdditionTask", "CostRule", "Example", "corrupt_answer", "PromptStream",
           "read_dataset", "read_jsonl", "read_parquet", "write_jsonl", "REWARD_FUNCTIONS",
           "CompositeReward", "RewardOutput", "exact_match", "format_ok", "partial_digits",
           "CharTokenizer"]
