"""The KV cache's tiled key layout (engine/kv_cache.py) against plain concatenation.

Keys live in tiles of KEY_TILE positions; a step's keys may cross a tile boundary (a prefill
longer than a tile, or a decode step at the first position of a tile).  The reference is the
list of every step's keys concatenated along the positions."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import KEY_TILE, KVCache, key_tiles, kv_cache_nbytes, tile_keys, untile_keys

B, G, D = 3, 2, 8


@pytest.mark.parametrize("steps", [[1] * 70, [5, KEY_TILE - 6, 1, 1, 1], [KEY_TILE + 3, 2],
                                   [2 * KEY_TILE + 1, 1, KEY_TILE - 2]])
def test_hook_writes_and_returns_every_step_across_tiles(steps):
    g = torch.Generator().manual_seed(sum(steps))
    max_len = sum(steps)
    cache = KVCache(2, B, max_len, G, D, torch.float32)
    assert cache.k.shape == (2, B, G, key_tiles(max_len), D, KEY_TILE)
    written = {layer: ([], []) for layer in range(2)}
    for s in steps:
        for layer in range(2):
            k, v = torch.randn(B, s, G, D, generator=g), torch.randn(B, s, G, D, generator=g)
            written[layer][0].append(k)
            written[layer][1].append(v)
            got_k, got_v = cache.hook(layer)(k, v)
            want_k, want_v = (torch.cat(t, dim=1) for t in written[layer])
            assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        cache.advance(s)
    keys = torch.stack([torch.cat(written[layer][0], dim=1) for layer in range(2)])
    assert torch.equal(cache.keys(0, max_len), keys.permute(0, 1, 3, 4, 2))  # [L, B, G, D, S]
    assert torch.equal(cache.keys(3, max_len - 1), keys.permute(0, 1, 3, 4, 2)[..., 3:-1])
    # positions past the filled ones are zeros (the kernel reads whole tile rows)
    tail = cache.k[:, :, :, -1, :, max_len - (key_tiles(max_len) - 1) * KEY_TILE:]
    assert tail.numel() == 0 or not tail.any()


def test_overflow_raises_before_writing():
    cache = KVCache(1, B, KEY_TILE + 1, G, D, torch.float32)
    cache.hook(0)(torch.ones(B, KEY_TILE, G, D), torch.ones(B, KEY_TILE, G, D))
    cache.advance(KEY_TILE)
    with pytest.raises(RuntimeError, match="KV cache overflow: 66 > max_len=65"):
        cache.hook(0)(torch.ones(B, 2, G, D), torch.ones(B, 2, G, D))
    assert not cache.k[..., 1, :, :].any()


def test_tile_round_trip_and_sizes():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, G, D, 2 * KEY_TILE + 5, generator=g)
    tiles = tile_keys(keys)
    assert tiles.shape == (2, G, 3, D, KEY_TILE) and tiles.is_contiguous()
    assert torch.equal(untile_keys(tiles, 0, keys.shape[-1]), keys)
    assert torch.equal(untile_keys(tiles, KEY_TILE + 1, KEY_TILE + 2), keys[..., 65:66])
    assert torch.equal(tiles[:, :, 1, 3, 7], keys[:, :, 3, KEY_TILE + 7])  # tile 1, dim 3
    assert not tiles[:, :, 2, :, 5:].any()
    inside_one_tile = untile_keys(tiles, 1, 5)
    inside_one_tile.add_(1.0)  # a copy, never a view of the cache
    assert torch.equal(untile_keys(tiles, 1, 5), keys[..., 1:5])
    cache = KVCache(3, B, 2 * KEY_TILE + 5, G, D, torch.float32)
    assert cache.nbytes == kv_cache_nbytes(3, B, 2 * KEY_TILE + 5, G, D, torch.float32)
    assert cache.nbytes == 3 * B * G * D * 4 * (3 * KEY_TILE + 2 * KEY_TILE + 5)


def test_keep_rows_copies_whole_tiles_of_the_kept_rows():
    g = torch.Generator().manual_seed(1)
    cache = KVCache(2, 4, 2 * KEY_TILE, G, D, torch.float32)
    n = KEY_TILE + 9
    cache.hook(0)(torch.randn(4, n, G, D, generator=g), torch.randn(4, n, G, D, generator=g))
    cache.hook(1)(torch.randn(4, n, G, D, generator=g), torch.randn(4, n, G, D, generator=g))
    cache.advance(n)
    before = cache.keys(0, n)
    rows = torch.tensor([3, 0, 0])
    cache.keep_rows_(rows)
    assert cache.k.shape[1] == 3
    assert torch.equal(cache.keys(0, n), before[:, rows])
    assert not cache.keys(n, 2 * KEY_TILE).any()
