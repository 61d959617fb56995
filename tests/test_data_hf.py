"""HFDataLoader vs MindFormers' own AlpacaInstructDataHandler (tests/fixtures/hfdata, made by its code with a tiny
local tokenizer): the same input_ids and labels, in order, split over dp ranks; nothing downloads."""
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("datasets")

from msparallel_ds.config.errors import ConfigError  # noqa: E402
from msparallel_ds.data import open_train_dataset  # noqa: E402

FIX = Path(__file__).resolve().parent / "fixtures" / "hfdata"
EXP = np.load(FIX / "expected.npz")


def _cfg(seq, padding, legacy):
    return {"use_legacy": legacy, "pretrained_model_dir": str(FIX / "tokenizer"),
            "train_dataset": {"input_columns": ["input_ids", "labels"], "data_loader": {
                "type": "HFDataLoader", "load_func": "load_dataset", "path": "json", "split": "train",
                "data_files": str(FIX / "alpaca.json"), "shuffle": False,
                "handler": [{"type": "AlpacaInstructDataHandler", "seq_length": seq, "padding": padding,
                             "tokenizer": {"padding_side": "right", "trust_remote_code": True}}]}}}


def test_alpaca_rows_equal_mindformers_and_dp_split():
    for case, seq, padding, legacy in (("pad", 48, True, False), ("nopad_legacy", 40, False, True)):
        rows = list(open_train_dataset(_cfg(seq, padding, legacy)))
        for c in ("input_ids", "labels"):
            want = np.split(EXP[f"{case}/{c}"], np.cumsum(EXP[f"{case}/{c}_len"])[:-1])
            assert len(rows) == len(want) == 7
            for got, w in zip(rows, want):
                assert np.array_equal(got[c].astype(np.int32), w), (case, c)
    r = open_train_dataset(_cfg(48, True, False), dp_rank=1, dp_size=2)
    ids = [x["input_ids"] for x in r]
    want = np.split(EXP["pad/input_ids"], 7)
    assert len(ids) == 4 and all(np.array_equal(a, want[i]) for a, i in zip(ids, [1, 3, 5, 0]))


def test_bad_input_names_the_key(tmp_path):
    cfg = _cfg(48, True, False)
    cfg["train_dataset"]["data_loader"]["path"] = "tatsu-lab/alpaca"
    with pytest.raises(ConfigError, match=r"data_loader.path.*hub"):
        open_train_dataset(cfg)
    cfg = _cfg(48, True, False)
    cfg["train_dataset"]["data_loader"]["data_files"] = str(tmp_path / "none.json")
    with pytest.raises(ConfigError, match="data_loader.data_files"):
        open_train_dataset(cfg)
    cfg = _cfg(48, True, False)
    del cfg["pretrained_model_dir"]
    with pytest.raises(ConfigError, match=r"handler\[0\].tokenizer.pretrained_model_dir"):
        open_train_dataset(cfg)
