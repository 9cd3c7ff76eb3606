"""Sharding: which output shards a task owns (`--shard I/N`, Slurm array tasks, cron)."""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.job import JobError


@dataclass(frozen=True)
class ShardSelector:
    """Task `index` of `count` owns shards k with k % count == index."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise JobError(f"--shard {self.index}/{self.count}: need 0 <= I < N and N >= 1")

    def owns(self, k: int) -> bool:
        return k % self.count == self.index

    def num_owned(self, num_shards: int) -> int:
        """How many of a job's shards 0 .. num_shards - 1 this task owns."""
        return len(range(self.index, num_shards, self.count))

    def task_label(self) -> str:
        """The text ' of task I/N' for one task of several, '' for a run that is the whole job:
        what the run's summary lines add to the counts that are the task's own."""
        return "" if self.count == 1 else f" of task {self}"

    @classmethod
    def parse(cls, text: str) -> ShardSelector:
        """Parse 'I/N' (0-based I)."""
        i, _, n = text.partition("/")
        try:
            index, count = int(i), int(n)
        except ValueError:
            raise JobError(f"--shard {text!r}: expected I/N, e.g. --shard 0/4") from None
        return cls(index, count)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def shard_of(index: int, shard_rows: int) -> int:
    """The shard holding the input row at global position `index`."""
    return index // shard_rows
