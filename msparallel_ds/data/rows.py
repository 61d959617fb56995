"""TrainRows: one dp rank's rows of a dataset, in MindSpore's order, resumable at any row.

Which rows a dp rank reads (MindFormers dataset/base_dataset.py _generate_shard_info):
  - full_batch (semi-auto / auto parallel with parallel.full_batch: every rank reads the whole stream, MindSpore
    slices each global batch): rank d takes rows [t*G + d*B, t*G + (d+1)*B) of global batch t (B = rows per dp rank
    per step, G = B x dp); the stream has no sampler split (MindSpore's num_shards None).
  - otherwise (data parallel, full_batch false, stand-alone): MindSpore's distributed sampler, num_shards = dp:
    positions d, d+dp, ... wrapping around (data/order.py). With B = 1 both give the same rows.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterator, NamedTuple, Sequence

import numpy as np

from .order import dp_positions


class Table(NamedTuple):
    """A dataset as the readers open it: n rows, row access, the epoch's order (epoch, sharded) -> row numbers."""

    n_rows: int
    get: Callable[[int], Dict[str, np.ndarray]]
    order: Callable[[int, bool], np.ndarray]
    columns: Sequence[str]
    kind: str


def rank_positions(n_rows: int, dp_rank: int, dp_size: int, full_batch: bool, rows_per_step: int) -> np.ndarray:
    if not full_batch:
        return dp_positions(n_rows, dp_rank, dp_size)
    g = rows_per_step * dp_size
    steps = n_rows // g
    base = np.arange(steps, dtype=np.int64)[:, None] * g + dp_rank * rows_per_step
    return (base + np.arange(rows_per_step, dtype=np.int64)[None, :]).reshape(-1)


class TrainRows:
    """This dp rank's rows: `for row in rows` (epoch 0), `rows.epoch(e, start=i)` to resume, `len(rows)` rows per
    epoch. Each row is a dict of numpy arrays named by the YAML's input_columns."""

    def __init__(self, n_rows: int, get: Callable[[int], Dict[str, np.ndarray]],
                 order: Callable[[int], np.ndarray], positions: np.ndarray, columns: Sequence[str], kind: str):
        self.n_rows, self._get, self._order, self._positions = n_rows, get, order, positions
        self.columns, self.kind = list(columns), kind

    def __len__(self) -> int:
        return len(self._positions)

    def positions(self, epoch: int = 0) -> np.ndarray:
        """Global row numbers this rank reads in `epoch`, in order."""
        return self._order(epoch)[self._positions]

    def epoch(self, epoch: int = 0, start: int = 0) -> Iterator[Dict[str, np.ndarray]]:
        for pos in self.positions(epoch)[start:]:
            yield self._get(int(pos))

    def __iter__(self) -> Iterator[Dict[str, np.ndarray]]:
        return self.epoch(0)
