import os

import pytest

from tests.multirank import RankPool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pool(world_size: int):
    pool = RankPool(world_size)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="module")
def pool2():
    """Two gloo ranks, started once per test module."""
    yield from _pool(2)


@pytest.fixture(scope="module")
def real_checkpoint() -> str:
    """The HF folder of the real checkpoint (rlhf/real_model.py, converted once into the
    repository's runs/cache); skipped with the reason where its package is not installed."""
    from rlhf.real_model import DEFAULT_DIR, RealModelUnavailable, ensure_hf_folder

    try:
        return ensure_hf_folder(os.path.join(ROOT, DEFAULT_DIR))
    except RealModelUnavailable as e:
        pytest.skip(f"the real checkpoint is not installed: {e}")


@pytest.fixture(scope="module")
def pool4():
    """Four gloo ranks, started once per test module."""
    yield from _pool(4)
