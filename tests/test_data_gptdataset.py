"""GPTDataset through Megatron-Core vs MindFormers' own copy: the samples (every column), their order and the dp
split equal tests/fixtures/gptdataset (written and read by MindFormers 2.1.0's code, split by MindSpore 2.7)."""
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("megatron.core")

from msparallel_ds.config.errors import ConfigError  # noqa: E402
from msparallel_ds.data import open_train_dataset  # noqa: E402
from msparallel_ds.data.order import dp_positions  # noqa: E402

FIX = Path(__file__).resolve().parent / "fixtures" / "gptdataset"
EXP = np.load(FIX / "expected.npz")
CASES = {
    "single": dict(data_path=["1", "docs_a"], sizes=[50, 0, 0], create_attention_mask=True),
    "blended": dict(data_path=["0.3", "docs_a", "0.7", "docs_b"], sizes=[40, 0, 0]),
    "resetpos": dict(data_path=["1", "docs_a"], sizes=[30, 0, 0], seed=7, reset_position_ids=True, eod_mask_loss=True),
}


def _cfg(case):
    c = dict(CASES[case])
    sizes = c.pop("sizes")
    c["data_path"] = [p if i % 2 == 0 else str(FIX / p) for i, p in enumerate(c["data_path"])]
    conf = {"seed": c.pop("seed", 1234), "seq_length": 16, "split": "1, 0, 0", "eod": 1, "pad": -1,
            "create_attention_mask": False, **c}
    cols = ["input_ids", "labels", "loss_mask", "position_ids"] + (["attention_mask"] if conf["create_attention_mask"]
                                                                    else [])
    return {"train_dataset": {"data_loader": {"type": "BlendedMegatronDatasetDataLoader", "datasets_type": "GPTDataset",
                                              "sizes": sizes, "config": conf, "shuffle": False},
                              "input_columns": cols}}, cols


def test_samples_and_dp_split_equal_mindformers():
    for case in CASES:
        cfg, cols = _cfg(case)
        rows = open_train_dataset(cfg)
        assert rows.n_rows == int(EXP[f"{case}/len"]), case
        got = list(rows)
        for c in cols:
            want = EXP[f"{case}/{c}"]
            assert np.array_equal(np.stack([r[c] for r in got]), want.astype(np.int32)), (case, c)
        for n in (2, 3):
            for k in range(n):
                assert dp_positions(rows.n_rows, k, n).tolist() == EXP[f"{case}/shard{k}of{n}"].tolist()
        if case == "blended":  # a dp rank reads the MindFormers rows at its positions
            r1 = open_train_dataset(cfg, dp_rank=1, dp_size=3)
            ids = np.stack([r["input_ids"] for r in r1])
            assert np.array_equal(ids, EXP["blended/input_ids"][EXP["blended/shard1of3"]])


def test_bad_input_names_the_key(tmp_path):
    cfg, _ = _cfg("single")
    cfg["train_dataset"]["data_loader"]["config"]["data_path"] = ["1", str(tmp_path / "nope")]
    with pytest.raises(ConfigError, match=r"config.data_path.*\.bin"):
        open_train_dataset(cfg)
    cfg, _ = _cfg("single")
    cfg["train_dataset"]["input_columns"] = ["input_ids", "labels"]
    with pytest.raises(ConfigError, match="train_dataset.input_columns"):
        open_train_dataset(cfg)
