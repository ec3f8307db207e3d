import pytest

from tests.multirank import RankPool


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
def pool4():
    """Four gloo ranks, started once per test module."""
    yield from _pool(4)
