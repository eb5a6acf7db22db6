"""Every example once per epoch, each optimizer step's examples split between the ranks."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader


class StepShardSampler:
    """Batches of one rank: each optimizer step takes the next `per_rank x world` examples of a seeded
    permutation and gives rank r its contiguous share; the last, short step is split as evenly as
    possible. Every example once per epoch over all ranks (no padding by repetition, nothing dropped),
    and ceil(N / (per_rank x world)) steps on every rank. Same permutation as accelerate's
    SeedableRandomSampler (randperm seeded with seed + epoch), so one rank sees the order of the
    baseline's padded batches."""

    def __init__(self, n: int, per_rank: int, world: int, rank: int, seed: int, shuffle: bool = True):
        self.n, self.per_rank, self.world, self.rank, self.seed, self.shuffle = n, per_rank, world, rank, seed, shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-self.n // (self.per_rank * self.world))

    def order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n, generator=generator).tolist()

    def __iter__(self):
        order = self.order()
        # The next pass is the next epoch as soon as this one starts (set_epoch may still choose): the
        # Trainer reads exactly the epoch's steps and never exhausts this generator, so an increment after
        # the loop never ran and every epoch repeated the first one's order.
        self.epoch += 1
        step = self.per_rank * self.world
        for start in range(0, self.n, step):
            chunk = order[start:start + step]
            base, extra = divmod(len(chunk), self.world)
            lo = self.rank * base + min(self.rank, extra)
            yield chunk[lo:lo + base + (self.rank < extra)]



class EpochDataLoader(DataLoader):
    """The Trainer calls set_epoch before each epoch (a resumed run too): the epoch's order."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)
