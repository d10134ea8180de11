"""`ParamShard`: a rank's slice of a full parameter, and the full parameter from the slices."""

from __future__ import annotations

import torch

from tpc.compiler.tensor import ParamShard


def test_unequal_segments_round_trip():
    """A fused QKV with grouped-query attention: q 8 rows, k and v 4 each, cut for 2 ranks."""
    full = torch.arange(16 * 3).reshape(16, 3)
    shard = ParamShard("qkv.weight", 0, (8, 4, 4), 2)
    assert shard.ranges(0) == [(0, 4), (8, 10), (12, 14)]
    assert shard.ranges(1) == [(4, 8), (10, 12), (14, 16)]
    parts = [shard.take(full, r) for r in range(2)]
    assert torch.equal(parts[1][:, 0], torch.tensor([4, 5, 6, 7, 10, 11, 14, 15]) * 3)
    assert torch.equal(shard.join(parts), full)


def test_a_split_along_columns_and_a_replicated_parameter():
    full = torch.randn(3, 8)
    cols = ParamShard("down.weight", 1, (8,), 4)
    assert torch.equal(cols.take(full, 2), full[:, 4:6])
    assert torch.equal(cols.join([cols.take(full, r) for r in range(4)]), full)
    whole = ParamShard("norm.weight", 0, (), 4)
    assert whole.replicated and torch.equal(whole.take(full, 3), full)
