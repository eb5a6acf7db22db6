"""Every example exactly once per epoch across ranks, on CPU with simulated ranks.

The packed trainer's StepShardSampler replaces accelerate's even-batch sharding, which repeated
examples when the row count did not divide (48 repeats for 2,000 rows on 8 ranks at 16 per rank).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from training.fastpath.batches import PackedCollator
from training.fastpath.sampler import StepShardSampler  # noqa: E402


@pytest.mark.parametrize("n, per_rank, world", [(2000, 16, 8), (250, 16, 1), (2001, 16, 8), (37, 4, 3),
                                                 (5, 2, 4)])
def test_every_example_once_and_equal_step_counts(n, per_rank, world):
    ranks = [list(StepShardSampler(n, per_rank, world, rank, seed=42)) for rank in range(world)]
    steps = -(-n // (per_rank * world))
    assert all(len(batches) == steps for batches in ranks)  # the same number of optimizer steps on every rank
    assert all(len(StepShardSampler(n, per_rank, world, r, seed=42)) == steps for r in range(world))
    seen = [i for batches in ranks for batch in batches for i in batch]
    assert sorted(seen) == list(range(n))  # no duplicate, no drop
    for step in range(steps):  # each step takes the next per_rank x world examples of one permutation
        sizes = [len(ranks[r][step]) for r in range(world)]
        assert max(sizes) - min(sizes) <= 1 and max(sizes) <= per_rank


def test_same_permutation_on_every_rank_and_new_one_per_epoch():
    one = StepShardSampler(64, 16, 1, 0, seed=7)
    four = [list(StepShardSampler(64, 4, 4, r, seed=7)) for r in range(4)]
    epoch0 = list(one)
    for step, batch in enumerate(epoch0):  # the ranks' shares of a step are the one-rank step's examples
        assert sorted(i for shares in four for i in shares[step]) == sorted(batch)
    assert list(one) != epoch0  # the sampler moved to epoch 1: another order
    # As the Trainer reads it: exactly the epoch's steps, never the generator's end.
    read = StepShardSampler(64, 16, 1, 0, seed=7)
    epochs = []
    for _ in range(3):
        batches = iter(read)
        epochs.append([next(batches) for _ in range(len(read))])
    assert epochs[0] == epoch0 and epochs[1] != epochs[0] and epochs[2] not in epochs[:2]


def test_empty_share_still_steps():
    collated = PackedCollator(pad_token_id=1)([])
    assert len(collated["micro_batches"]) == 1
    assert collated["micro_batches"][0]["num_targets"] == 0
