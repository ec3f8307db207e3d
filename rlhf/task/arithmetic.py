"""The built-in verifiable task: multi-digit addition, ``"12+345="`` -> ``"357"``.

Every example is a pure function of ``(seed, split, index)`` (a ``random.Random`` seeded with
that string), so any slice of the data can be regenerated from a checkpointed position, and the
splits (``train``, ``eval``, ``sft``, ``pref``, ``cost``) never share a random stream.

Held-out problems: a fixed tenth of all problems (:func:`is_heldout`, a hash of the problem
text) belongs to split ``heldout`` only; every other split redraws when it hits one, so no
held-out problem ever appears in training, SFT or reward-model data.

Cost rule of the Safe-RLHF variant (:class:`CostRule`): a response is "unsafe" in proportion to

    cost(response) = (# of occurrences of the forbidden digit)
                     + max(0, len(response) - max_answer_len)    (length term only if set)

So a correct answer can be costly (e.g. ``"357"`` with forbidden digit ``7``): reward and cost
pull in different directions, which is what the Lagrange multiplier arbitrates.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

DIGITS = "0123456789"
HELDOUT = "heldout"
"""The split of held-out problems (evaluation only)."""
_HELDOUT_EVERY = 10


def is_heldout(prompt: str) -> bool:
    """Whether a problem (its prompt text, ``"12+34="``) is held out: one in ten, by a stable
    hash (CRC-32), the same on every machine and Python."""
    return zlib.crc32(prompt.encode()) % _HELDOUT_EVERY == 0


@dataclass(frozen=True)
class Example:
    """One prompt row (the built-in task's, or a dataset row in verl's layout)."""

    prompt: str | list
    """Question text, e.g. ``"12+345="``, or a chat list of ``{role, content}`` dicts."""
    answer: str
    """Ground truth, e.g. ``"357"`` (a dataset's ``ground_truth``; "" when it has none)."""
    data_source: str = "arithmetic"
    """Where the row comes from (passed to a reward function)."""
    extra_info: dict | None = None
    """Anything else of the row (passed to a reward function)."""
    tools: list[str] | None = None
    """Names of the tools the row may use in multi-turn rollouts; None = every tool."""


@dataclass(frozen=True)
class AdditionTask:
    """Deterministic addition problems; difficulty set by the operand digit counts."""

    min_digits: int = 1
    """Fewest digits of an operand (>= 1)."""
    max_digits: int = 3
    """Most digits of an operand (>= min_digits, <= 18)."""
    num_operands: int = 2
    """Operands per problem (>= 2): ``a+b`` or ``a+b+c`` ..."""
    seed: int = 0
    """Data seed; with ``split`` and ``index`` it fixes every example."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits <= 18:
            raise ValueError(f"need 1 <= min_digits <= max_digits <= 18, got min_digits="
                             f"{self.min_digits}, max_digits={self.max_digits}")
        if self.num_operands < 2:
            raise ValueError(f"num_operands={self.num_operands} must be >= 2")

    def _rng(self, split: str, index: int) -> random.Random:
        if index < 0:
            raise ValueError(f"example index={index} must be >= 0")
        return random.Random(f"addition:{self.seed}:{split}:{index}")

    def example(self, index: int, split: str = "train") -> Example:
        """Example ``index`` of ``split``: a held-out problem (:func:`is_heldout`) for split
        ``heldout``, any other problem for every other split (redrawn from the same stream)."""
        rng = self._rng(split, index)
        want_heldout = split == HELDOUT
        for _ in range(100_000):  # a tenth of the problems are held out: a few draws
            ops = []
            for _ in range(self.num_operands):
                n = rng.randint(self.min_digits, self.max_digits)
                ops.append(rng.randint(0 if n == 1 else 10 ** (n - 1), 10 ** n - 1))
            prompt = "+".join(map(str, ops)) + "="
            if is_heldout(prompt) == want_heldout:
                return Example(prompt, str(sum(ops)))
        raise ValueError(f"no {'held-out' if want_heldout else 'non-held-out'} problem found "
                         f"for {self}")

    def heldout_examples(self, count: int) -> list[Example]:
        """Up to ``count`` distinct held-out problems (fewer when the task has fewer), in a
        fixed order: the evaluation set of the built-in task."""
        seen: dict[str, Example] = {}
        for i in range(50 * count):
            e = self.example(i, HELDOUT)
            seen.setdefault(e.prompt, e)
            if len(seen) == count:
                break
        return list(seen.values())

    def examples(self, start: int, count: int, split: str = "train") -> list[Example]:
        return [self.example(i, split) for i in range(start, start + count)]

    @property
    def max_prompt_chars(self) -> int:
        return self.num_operands * (self.max_digits + 1)

    @property
    def max_answer_chars(self) -> int:
        return len(str(self.num_operands * (10 ** self.max_digits - 1)))

    # Training data for the warm start and the reward / cost models -------------------------
    def sft_records(self, count: int, start: int = 0) -> list[dict]:
        """``{"prompt", "answer"}`` records with the correct answer (split ``sft``)."""
        return [{"prompt": e.prompt, "answer": e.answer}
                for e in self.examples(start, count, "sft")]

    def noisy_sft_records(self, count: int, start: int = 0, noise: float = 0.0,
                          carry_errors: float = 0.0) -> list[dict]:
        """:meth:`sft_records` with imperfect demonstrations (deterministic per index), which RL
        on the verifiable reward then corrects: a fraction ``noise`` of random wrong answers,
        and on the problems that carry, a fraction ``carry_errors`` answered without carrying
        (:func:`carry_free_sum`, a systematic mistake: above 0.5 the warm start's greedy answer
        to such problems is the wrong one, while sampling still finds the right one)."""
        out = self.sft_records(count, start)
        for i, r in enumerate(out):
            rng = random.Random(f"sft-noise:{start + i}")
            wrong = carry_free_sum(r["prompt"])
            if wrong != r["answer"] and rng.random() < carry_errors:
                r["answer"] = wrong
            elif rng.random() < noise:
                r["answer"] = corrupt_answer(r["answer"], rng)
        return out

    def preference_pairs(self, count: int, start: int = 0) -> list[dict]:
        """``{"prompt", "chosen", "rejected"}``: the correct answer vs a corrupted one."""
        out = []
        for i in range(start, start + count):
            e = self.example(i, "pref")
            rng = self._rng("pref-corrupt", i)
            out.append({"prompt": e.prompt, "chosen": e.answer,
                        "rejected": corrupt_answer(e.answer, rng)})
        return out

    def cost_pairs(self, count: int, rule: "CostRule", start: int = 0) -> list[dict]:
        """``{"prompt", "safer", "unsafer", "safer_cost", "unsafer_cost"}`` with
        ``safer_cost < unsafer_cost`` under ``rule`` (split ``cost``).

        ``safer`` is the answer with every forbidden digit replaced by its neighbour digit;
        ``unsafer`` is ``safer`` with one to two forbidden digits written over or inserted.
        """
        out = []
        for i in range(start, start + count):
            e = self.example(i, "cost")
            rng = self._rng("cost-corrupt", i)
            safer = rule.scrub(e.answer)
            unsafer = safer
            for _ in range(rng.randint(1, 2)):
                pos = rng.randrange(len(unsafer) + 1)
                if rng.random() < 0.5 and pos < len(unsafer):
                    unsafer = unsafer[:pos] + rule.forbidden_digit + unsafer[pos + 1:]
                else:
                    unsafer = unsafer[:pos] + rule.forbidden_digit + unsafer[pos:]
            out.append({"prompt": e.prompt, "safer": safer, "unsafer": unsafer,
                        "safer_cost": rule.cost(safer), "unsafer_cost": rule.cost(unsafer)})
        return out


def carry_free_sum(prompt: str) -> str:
    """The answer of ``"a+b+...="`` computed without carrying: each digit column summed mod 10
    (``"17+25="`` -> ``"32"``; the right answer is 42).  The systematic mistake of a learner
    who has not learned to carry; equal to the right answer when no column carries."""
    ops = prompt.rstrip("=").split("+")
    width = max(len(o) for o in ops)
    cols = [sum(int(o.zfill(width)[i]) for o in ops) % 10 for i in range(width)]
    return str(int("".join(map(str, cols))))


def corrupt_answer(answer: str, rng: random.Random) -> str:
    """A wrong answer near ``answer``: change, drop or add one digit, or be off by a carry."""
    for _ in range(100):
        kind = rng.randrange(4)
        if kind == 0:
            pos = rng.randrange(len(answer))
            cand = answer[:pos] + rng.choice(DIGITS) + answer[pos + 1:]
        elif kind == 1 and len(answer) > 1:
            pos = rng.randrange(len(answer))
            cand = answer[:pos] + answer[pos + 1:]
        elif kind == 2:
            pos = rng.randrange(len(answer) + 1)
            cand = answer[:pos] + rng.choice(DIGITS) + answer[pos:]
        else:
            cand = str(int(answer) + rng.choice((-10, -1, 1, 10)))
        cand = cand.lstrip("0") or "0"
        if cand != answer and not cand.startswith("-"):
            return cand
    raise AssertionError(f"could not corrupt {answer!r}")


@dataclass(frozen=True)
class CostRule:
    """The Safe-RLHF cost of a response (see the module docstring)."""

    forbidden_digit: str = "7"
    """The digit whose every occurrence costs 1."""
    max_answer_len: int | None = None
    """If set, every character beyond this length costs 1."""

    def __post_init__(self) -> None:
        if len(self.forbidden_digit) != 1 or self.forbidden_digit not in DIGITS:
            raise ValueError(f"forbidden_digit={self.forbidden_digit!r} must be one digit")
        if self.max_answer_len is not None and self.max_answer_len < 1:
            raise ValueError(f"max_answer_len={self.max_answer_len} must be >= 1 or None")

    def cost(self, response: str) -> float:
        extra = 0 if self.max_answer_len is None else max(0, len(response) - self.max_answer_len)
        return float(response.count(self.forbidden_digit) + extra)

    def scrub(self, response: str) -> str:
        """``response`` with the forbidden digit replaced by the next digit (mod 10)."""
        repl = DIGITS[(DIGITS.index(self.forbidden_digit) + 1) % 10]
        return response.replace(self.forbidden_digit, repl)
