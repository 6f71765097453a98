"""Block masks reduced from a dense mask: every tile classified as a brute-force scan would."""
import pytest
import torch

from fusion_compiler.patterns.block_masks import BLOCK, _tile_flags, block_density, causal_density


@pytest.mark.parametrize("lq, lk", [(300, 300), (256, 384), (130, 77)])
def test_tile_flags_match_a_scan_of_every_tile(lq, lk):
    keep = torch.rand(2, 1, lq, lk) > 0.2
    keep[0, 0, :128, :128] = True  # a full tile
    keep[1, 0, :, -10:] = False  # empty tiles at the ragged edge
    partial, full = _tile_flags(keep)
    for b in range(2):
        for i in range(partial.shape[-2]):
            for j in range(partial.shape[-1]):
                tile = keep[b, 0, i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
                assert bool(full[b, 0, i, j]) == bool(tile.all())
                assert bool(partial[b, 0, i, j]) == bool(tile.any() and not tile.all())


def test_causal_density_counts_the_causal_tiles():
    i = torch.arange(300)
    kept, _ = block_density(i[:, None] >= i[None])
    assert abs(causal_density(300, 300) - kept) < 1e-6
