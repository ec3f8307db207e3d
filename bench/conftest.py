"""Fixtures shared by the bench smoke tests (bench/test_bench_*.py)."""

import pytest
import torch


@pytest.fixture
def keep_threads():
    """Restore torch's intra-op thread count after a bench that sets ``--threads``."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
