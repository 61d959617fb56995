"""Readers of MindFormers' training data, without MindSpore: `open_train_dataset(cfg, dp_rank, dp_size)`.

  MindDataset                        MindRecord shards (+ .db index)                 data/mindrecord.py
  BlendedMegatronDatasetDataLoader   Megatron .bin/.idx through GPTDataset           data/megatron.py
  HFDataLoader                       HF datasets (local) + MindFormers' handlers     data/hf.py
Each rank reads only its dp share (MindSpore's distributed-sampler rule, data/order.py); tp/cp/pp peers of a dp rank
see the same rows. Orders are MindSpore's own, checked against files MindSpore wrote (tests/fixtures/).
"""
from __future__ import annotations

from .rows import TrainRows
from .source import open_train_dataset, train_dataset_section

__all__ = ["open_train_dataset", "TrainRows", "train_dataset_section"]
