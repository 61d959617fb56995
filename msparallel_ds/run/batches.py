"""This dp rank's rows -> one step's batch of tensors. The data position is a function of the step (epoch =
step // steps_per_epoch), so a resumed run reads exactly the rows the uninterrupted run would have.

Targets as MindFormers trains them, passed to train_batch already shifted (`shift_labels`: token t's target, S per
row): MindRecord rows hold seq_length + 1 tokens and MindFormers' llama trains input_ids[:, :-1] on
input_ids[:, 1:] (or labels[:, 1:]), masking the targets of pad_token_id inputs and of ignore labels (-100);
input_sliced_sig rows are already split (tokens and their targets). GPTDataset and HF-handler rows hold input_ids
with already shifted labels (and loss_mask).

A MindRecord loss_mask column (named in train_dataset.input_columns) counts as MindFormers 2.x counts it: 2.x hands
columns to the model by name (DataOrderWrapperCell), and llama (models/llama/llama.py:642-676) then takes
loss_mask[:, :-1] (aligned with the input tokens, like input_ids[:, :-1]) as the loss mask in place of the pad mask;
the mcore GPTModel also multiplies in labels != -100, as here (a -100 label never counts). MindFormers 1.3.2 hands
columns over by position, where a third column lands in llama's input_position (unused in training): it ignores
loss_mask. attention_mask columns are not read (llama uses one as a [B, 1, S, S] attention mask, not a loss mask)."""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import torch

from ..config.errors import ConfigError, ConfigIssue
from ..labels import IGNORE_INDEX


def _to_hf(row: Dict[str, np.ndarray], kind: str, sliced: bool, pad: Optional[int]) -> Dict[str, np.ndarray]:
    ids = row["input_ids"].astype(np.int64)
    if kind == "MindDataset":
        labels = row.get("labels", ids).astype(np.int64).copy()
        mask = row.get("loss_mask")
        if not sliced:  # MindFormers: tokens = input_ids[:, :-1], labels = labels[:, 1:], loss_mask[:, :-1]
            ids, labels = ids[:-1], labels[1:].copy()
            mask = None if mask is None else mask[:-1]
        if mask is not None:  # input_mask = loss_mask, in place of the pad mask
            labels[mask == 0] = IGNORE_INDEX
        elif pad is not None:  # input_mask = tokens != pad_token_id
            labels[ids == pad] = IGNORE_INDEX
        return {"input_ids": ids, "shift_labels": labels}
    target = row["labels"].astype(np.int64).copy()
    if "loss_mask" in row:
        target[row["loss_mask"] == 0] = IGNORE_INDEX
    out = {"input_ids": ids, "shift_labels": target}
    if "position_ids" in row:
        out["position_ids"] = row["position_ids"].astype(np.int64)
    return out


class StepBatches:
    """batch(step) -> {input_ids, shift_labels[, position_ids]} [rows_per_step, seq] for this dp rank; `pad`: the
    model's pad_token_id (MindRecord rows: its inputs get no target), None for none."""

    def __init__(self, rows, rows_per_step: int, global_rows: int, seq_length: int, sliced: bool,
                 pad: Optional[int] = None):
        self.rows, self.rows_per_step, self.sliced, self.pad = rows, rows_per_step, sliced, pad
        self.steps_per_epoch = rows.n_rows // global_rows
        if self.steps_per_epoch < 1:
            raise ConfigError(ConfigIssue("train_dataset", f"{rows.n_rows} rows", f"are fewer than one global batch "
                                          f"({global_rows} rows)", "add data or lower runner_config.batch_size"))
        first = _to_hf(next(iter(rows)), rows.kind, sliced, pad)
        if seq_length and len(first["input_ids"]) != seq_length:
            raise ConfigError(ConfigIssue("model.model_config.seq_length", seq_length, f"does not match the data: "
                                          f"its rows train {len(first['input_ids'])} tokens ({rows.kind}"
                                          f"{', rows of seq_length + 1' if rows.kind == 'MindDataset' else ''})",
                                          "set seq_length to the data's or re-make the data"))
        self._epoch, self._positions = None, None

    def batch(self, step: int) -> Dict[str, torch.Tensor]:
        epoch, i = divmod(step, self.steps_per_epoch)
        start = i * self.rows_per_step
        rows: List[dict] = [_to_hf(r, self.rows.kind, self.sliced, self.pad) for _, r in
                            zip(range(self.rows_per_step), self.rows.epoch(epoch, start))]
        lengths = {len(r["input_ids"]) for r in rows}
        if len(lengths) != 1:
            raise ConfigError(ConfigIssue("train_dataset", sorted(lengths), "rows of one batch differ in length",
                                          "pad the data to seq_length (MindFormers batches equal lengths)"))
        return {k: torch.as_tensor(np.stack([r[k] for r in rows])) for k in rows[0]}
