"""A MindRecord loss_mask column (MindFormers 2.x SFT data: input_ids, labels with -100, loss_mask) counts as
MindFormers 2.x counts it (msparallel_ds/run/batches.py): tokens masked by loss_mask[:, :-1] or with a -100 target
add nothing to the loss (the engine's token mean counts only non -100 targets: tests/test_shift_labels.py), pad
tokens the mask keeps do. Files written by MindSpore's FileWriter
(tests/fixtures/mindrecord/make_loss_mask.py); the rows equal what MindSpore's MindDataset read back."""
from pathlib import Path

import numpy as np

from msparallel_ds.data import open_train_dataset

FIX = Path(__file__).resolve().parent / "fixtures" / "mindrecord"
COLS = ["input_ids", "labels", "loss_mask"]
ROWS = np.load(FIX / "loss_mask_rows.npz")


def _cfg():
    return {"train_dataset": {"data_loader": {"type": "MindDataset", "dataset_dir": str(FIX / "loss_mask"),
                                              "shuffle": False}, "input_columns": COLS},
            "runner_config": {"batch_size": 4}}


def _want_targets(i):
    """MindFormers 2.x llama: targets labels[1:], loss mask loss_mask[:-1] (no pad mask once loss_mask is given);
    a -100 label never counts."""
    t = ROWS["labels"][i][1:].astype(np.int64).copy()
    t[ROWS["loss_mask"][i][:-1] == 0] = -100
    return t


def test_rows_equal_mindspore_and_loss_mask_sets_the_targets():
    from msparallel_ds.run.batches import StepBatches

    rows = open_train_dataset(_cfg())
    for i, row in enumerate(rows):
        for c in COLS:
            assert np.array_equal(row[c], ROWS[c][i]), (c, i)
    batches = StepBatches(rows, 4, 4, 16, sliced=False, pad=0)
    for step in range(4):
        b = batches.batch(step)
        for j in range(4):
            i = step * 4 + j
            assert np.array_equal(b["input_ids"][j].numpy(), ROWS["input_ids"][i][:-1])
            assert np.array_equal(b["shift_labels"][j].numpy(), _want_targets(i)), i
    pads = sum(int(((ROWS["input_ids"][i][:-1] == 0) & (_want_targets(i) != -100)).sum()) for i in range(16))
    assert pads > 0  # the fixture holds pad inputs that the mask keeps
