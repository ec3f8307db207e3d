"""Smoke cases of the generation bench (``make bench``; the ``small`` one marked slow): every
figure is there and the agreement checks hold, not the speed goals (those are for
``--shape small`` on a quiet machine, reported by the bench itself)."""

import json

import pytest

from bench import generation
from bench.shapes import bench_corpus, build_bpe_tokenizer, get_shape



def test_corpus_prompts_are_left_padded_corpus_text(tmp_path):
    tok = build_bpe_tokenizer(tmp_path, get_shape("small").vocab)
    ids, mask = generation.corpus_prompts(tok, 6, 64)
    assert ids.shape == mask.shape == (6, 64)
    text = " ".join(bench_corpus())
    for row, m in zip(ids, mask):
        n = int(m.sum())
        assert 32 <= n <= 64 and m[64 - n:].all() and not m[:64 - n].any()
        assert (row[:64 - n] == tok.pad_token_id).all()
        assert tok.decode(row[64 - n:].tolist()) in text


def _run(tmp_path, argv: list[str]) -> dict:
    path = tmp_path / "generation.json"
    argv = argv + ["--repeat", "1", "--no-multirank", "--profile", "--json", str(path)]
    assert generation.main(argv) == 0
    result = json.loads(path.read_text())
    assert result["argv"] == argv
    assert result["ratio"] > 0 and result["greedy_match_tie_aware"], result["first_mismatch"]
    assert result["max_logprob_diff"] < 1e-3  # the same weights (q/k/v biases included)
    # early exit is bit-identical where the decode kernels compute every row (fixed-tree sums,
    # engine/early_exit.py); on the Python layers BLAS may round a row of a compacted batch
    # otherwise (tests/test_generation_early_exit.py holds that case up to near-ties)
    assert result["early_exit"]["identical"] or not result["decode_kernels"]
    assert result["early_exit"]["compactions"] >= 1
    assert result["profile"]["decode_step_ms"] > 0
    return result


def test_generation_tiny_smoke(benchmark, tmp_path, keep_threads):
    result = benchmark.pedantic(_run, args=(tmp_path, ["--batch", "8", "--new-tokens", "8"]),
                                rounds=1, iterations=1)
    assert result["shape"]["name"] == "tiny" and result["decode_kernels"] in (True, False)
    assert result["config"]["model"]["vocab_size"] == 128  # the figures of record's model
    benchmark.extra_info["ratio"] = result["ratio"]


@pytest.mark.slow
def test_generation_small_smoke(benchmark, tmp_path, keep_threads):
    result = benchmark.pedantic(_run, args=(tmp_path, ["--shape", "small", "--batch", "8",
                                                       "--new-tokens", "16"]),
                                rounds=1, iterations=1)
    assert result["shape"] == get_shape("small").describe()
    assert result["config"]["prompt_len"] == get_shape("small").prompt_len
    benchmark.extra_info["ratio"] = result["ratio"]
