"""MindRecord reader vs MindSpore: rows and orders equal to what MindSpore 2.7's MindDataset gave for files its
FileWriter wrote (tests/fixtures/mindrecord, made by make_fixtures.py there)."""
import shutil
from pathlib import Path

import numpy as np
import pytest

from msparallel_ds.config.errors import ConfigError
from msparallel_ds.data import open_train_dataset
from msparallel_ds.data.mindrecord import MindRecordFiles

FIX = Path(__file__).resolve().parent / "fixtures" / "mindrecord"
EXP = np.load(FIX / "expected.npz")
COLS = {"pretrain": ["input_ids"], "sft": ["input_ids", "labels", "attention_mask"]}


def _cfg(case, **loader):
    return {"train_dataset": {"data_loader": {"type": "MindDataset", "dataset_dir": str(FIX / case), **loader},
                              "input_columns": COLS[case], "seed": 0}}


@pytest.mark.parametrize("case", ["pretrain", "sft"])
def test_rows_equal_mindspore(case):
    table = MindRecordFiles(sorted(str(p) for p in (FIX / case).iterdir() if not p.name.endswith(".db")),
                            COLS[case], "k")
    for c in COLS[case]:
        lens = EXP[f"{case}/rows/{c}_len"]
        want = np.split(EXP[f"{case}/rows/{c}"], np.cumsum(lens)[:-1])
        assert len(table) == len(want)
        for i, w in enumerate(want):
            got = table[i][c]
            assert got.dtype == np.int32 and np.array_equal(got, w), (case, c, i)


@pytest.mark.parametrize("case", ["pretrain", "sft"])
def test_orders_equal_mindspore(case):
    def order(rows, epoch=0):
        return [int(r["input_ids"][0]) for r in rows.epoch(epoch)]
    assert order(open_train_dataset(_cfg(case, shuffle=False))) == EXP[f"{case}/plain/order"].tolist()
    for n in (2, 3):
        for k in range(n):
            rows = open_train_dataset(_cfg(case, shuffle=False), dp_rank=k, dp_size=n)
            assert order(rows) == EXP[f"{case}/shard{k}of{n}/order"].tolist(), (n, k)
    for seed in (0, 1234):
        cfg = _cfg(case, shuffle=True)
        cfg["train_dataset"]["seed"] = seed
        rows = open_train_dataset(cfg)
        for e in range(2):
            assert order(rows, e) == EXP[f"{case}/shuffle_seed{seed}_epoch{e}/order"].tolist(), (seed, e)
        for n, k in ((2, 1), (3, 2)):
            rows = open_train_dataset(cfg, dp_rank=k, dp_size=n)
            for e in range(2):
                assert order(rows, e) == EXP[f"{case}/shuffle_seed{seed}_shard{k}of{n}_epoch{e}/order"].tolist()


def test_one_file_name_reads_all_its_shards_and_resume_start():
    cfg = {"train_dataset": {"data_loader": {"type": "MindDataset", "shuffle": False,
                                             "dataset_files": str(FIX / "pretrain" / "data.mindrecord0")}}}
    rows = open_train_dataset(cfg)
    assert len(rows) == 40
    assert [int(r["input_ids"][0]) for r in rows.epoch(0, start=37)] == [37, 38, 39]


def test_bad_input_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match="train_dataset.data_loader.dataset_dir"):
        open_train_dataset({"train_dataset": {"data_loader": {"type": "MindDataset", "dataset_dir": str(tmp_path)}}})
    with pytest.raises(ConfigError, match="train_dataset.input_columns.*'labels'"):
        open_train_dataset(_cfg("pretrain") | {"train_dataset": {**_cfg("pretrain")["train_dataset"],
                                                                  "input_columns": ["input_ids", "labels"]}})
    with pytest.raises(ConfigError, match="train_dataset.data_loader"):
        open_train_dataset({"runner_config": {"batch_size": 1}})
    big = _cfg("pretrain")
    big["runner_config"] = {"batch_size": 16, "gradient_accumulation_steps": 2}
    with pytest.raises(ConfigError, match="fewer than one step"):
        open_train_dataset(big, dp_rank=0, dp_size=2)
    shutil.copy(FIX / "pretrain" / "data.mindrecord0", tmp_path / "x.mindrecord0")
    with pytest.raises(ConfigError, match=r"no index .*\.db"):
        open_train_dataset({"train_dataset": {"data_loader": {"type": "MindDataset", "dataset_dir": str(tmp_path)}}})


def test_full_batch_ranks_slice_each_global_batch_of_the_unsplit_stream():
    """parallel_mode 1 + full_batch (MindFormers' default for semi-auto): every rank reads MindSpore's unsplit order
    (num_shards None, shuffle chained over epochs) and takes its contiguous rows of each global batch."""
    cfg = _cfg("pretrain", shuffle=True)
    cfg.update(parallel={"parallel_mode": 1, "full_batch": True}, runner_config={"batch_size": 3})
    for e in range(2):
        stream = EXP[f"pretrain/shuffle_seed0_epoch{e}/order"].tolist()
        for d in range(2):
            got = [int(r["input_ids"][0]) for r in open_train_dataset(cfg, dp_rank=d, dp_size=2).epoch(e)]
            want = [stream[t * 6 + d * 3 + j] for t in range(40 // 6) for j in range(3)]
            assert got == want, (e, d)
    cfg["parallel"]["full_batch"] = False  # data-parallel style: MindSpore's distributed sampler
    rows = open_train_dataset(cfg, dp_rank=1, dp_size=2)
    assert [int(r["input_ids"][0]) for r in rows.epoch(1)] == EXP["pretrain/shuffle_seed0_shard1of2_epoch1/order"].tolist()


def test_shuffle_order_past_the_paired_draws_equals_mindspore():
    """50001 rows: std::shuffle's one-position-per-draw branch (tests/fixtures/mindrecord/make_large_order.py)."""
    import hashlib
    import json

    from msparallel_ds.data.order import dp_positions, minddataset_order

    ref = json.loads((FIX / "large_order.json").read_text())
    n, seed = ref["rows"], ref["seed"]
    got = {f"epoch{e}": minddataset_order(n, e, seed, True, sharded=False) for e in range(2)}
    got["shard1of2_epoch0"] = minddataset_order(n, 0, seed, True, sharded=True)[dp_positions(n, 1, 2)]
    for k, v in got.items():
        assert v[:16].tolist() == ref[k]["head"] and len(v) == ref[k]["len"], k
        assert hashlib.sha256(v.astype(np.int64).tobytes()).hexdigest() == ref[k]["sha256"], k
