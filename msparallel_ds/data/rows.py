"""TrainRows: one dp rank's rows of a dataset, in MindSpore's order, resumable at any row."""
from __future__ import annotations

from typing import Callable, Dict, Iterator, Sequence

import numpy as np

from .order import dp_positions


class TrainRows:
    """This dp rank's rows: `for row in rows` (epoch 0), `rows.epoch(e, start=i)` to resume, `len(rows)` rows per
    epoch. Each row is a dict of numpy arrays named by the YAML's input_columns."""

    def __init__(self, n_rows: int, get: Callable[[int], Dict[str, np.ndarray]],
                 order: Callable[[int], np.ndarray], dp_rank: int, dp_size: int, columns: Sequence[str], kind: str):
        self.n_rows, self._get, self._order = n_rows, get, order
        self.dp_rank, self.dp_size, self.columns, self.kind = dp_rank, dp_size, list(columns), kind
        self._positions = dp_positions(n_rows, dp_rank, dp_size)

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
