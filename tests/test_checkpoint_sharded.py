"""Sharded checkpoints (torch.distributed.checkpoint): engine.save(dir, sharded=True) writes each rank's chunks, and
engine.load resumes them under another layout with the same steps as the uninterrupted run: saved from dp2 x tp2 + SP
(ZeRO-1), resumed in tp2 x cp2, dp2 x tp2 ZeRO-2, tp4 + SP, the pipeline engine (pp2 x dp2, ZeRO-1) and one process;
saved from pp2 x dp2 and resumed in dp2 x tp2. async_save returns before the files are written and training goes on.
No rank writes the whole state, every chunk carries a crc32 (a flipped byte is an error, nothing loaded)."""
import os

import pytest
from engine_cases import global_batch, tiny_config, tiny_model
from harness import run_distributed

pytestmark = pytest.mark.distributed

ROWS = 4


def _cfg(name):
    layouts = {"dp2xtp2": dict(dp=2, tp=2, sp=True, vocab_dp=False, bs=2), "tp2xcp2": dict(tp=2, cp=2, ring=True,
               sp=True, bs=4), "dp2xtp2_zero2": dict(dp=2, tp=2, zero=2, bs=2), "tp4_sp": dict(tp=4, sp=True, bs=4),
               "one": dict(bs=4, zero=0), "pp2xdp2": dict(dp=2, bs=1)}
    c = tiny_config(**layouts[name])
    if name == "pp2xdp2":
        c["parallel_config"].update(pipeline_stage=2, micro_batch_num=2)
        c["parallel"]["pipeline_config"] = {"pipeline_interleave": False, "pipeline_scheduler": "1f1b"}
    return c


def _engine(name):
    import torch

    import msparallel_ds as msp

    return msp.initialize(tiny_model(), msp.load_config(_cfg(name)),
                          optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1))


def _steps(engine, first, last):
    lay = engine.layout
    rows, d = ROWS // lay.size("dp"), lay.rank("dp")
    out = []
    for step in range(first, last):
        ids, labels = global_batch(step, ROWS)
        out.append(engine.train_batch({"input_ids": ids[d * rows:(d + 1) * rows],
                                       "labels": labels[d * rows:(d + 1) * rows]}).item())
    return out


def _own_bytes(folder, rank):
    data = [d for d in os.listdir(folder) if d.startswith("dcp-")]
    assert len(data) == 1, os.listdir(folder)
    return sum(os.path.getsize(os.path.join(folder, data[0], f)) for f in os.listdir(os.path.join(folder, data[0]))
               if f.startswith(f"__{rank}_"))


def _save_runs(rank, world, root):
    from msparallel_ds.checkpoint.sharded import wait_pending

    out = {}
    engine = _engine("dp2xtp2")
    out["dp2xtp2"] = _steps(engine, 0, 2)
    engine.save(os.path.join(root, "sync"), sharded=True)
    engine.save(os.path.join(root, "async"), async_save=True)  # returns once staged; training goes on
    out["dp2xtp2"] += _steps(engine, 2, 4)
    wait_pending()
    out["bytes"] = _own_bytes(os.path.join(root, "sync"), rank)
    import torch

    from msparallel_ds.checkpoint.sharded import CheckpointSaveError

    if rank == 3:  # a NaN only in one rank's ZeRO partition of the fp32 weights (the module weights are finite)
        with torch.no_grad():
            engine.ds.optimizer.single_partition_of_fp32_groups[0][0] = float("nan")
    try:
        engine.save(os.path.join(root, "async"), async_save=True)  # refused before returning; the async one stays
        out["nan_save"] = "saved"
    except CheckpointSaveError as e:
        out["nan_save"] = str(e)
    from safetensors.torch import load_file

    from msparallel_ds.checkpoint.monitor import CheckpointSaver

    engine = _engine("pp2xdp2")  # MindFormers' CheckpointMonitor: every 2 steps, keep 1, merged HF folder, async
    saver = CheckpointSaver(engine, os.path.join(root, "run"), save_steps=2, keep_max=1, integrated_save=True,
                            async_save=True)
    out["pp2xdp2"] = []
    for k in range(1, 5):
        out["pp2xdp2"] += _steps(engine, k - 1, k)
        if k == 2:
            engine.save(os.path.join(root, "pp"), sharded=True)
        saver.step(k)
    saver.finish()
    last = os.path.join(root, "run", "checkpoint", "step-00000004")
    out["run"] = sorted(os.listdir(os.path.dirname(last)))
    hf = load_file(os.path.join(last, "hf", "model.safetensors"))
    out["hf_equal"] = all(torch.equal(hf[n], p.detach().float()) for n, p in engine.model.named_parameters())
    return out


def _resume(rank, world, runs):
    out = {}
    for key, name, ckpt in runs:
        engine = _engine(name)
        try:
            info = engine.load(ckpt)
        except ValueError as e:
            out[key] = str(e)
            continue
        out[key] = (_steps(engine, 2, 4), info)
    return out


def _flip(folder):
    data = os.path.join(folder, next(d for d in os.listdir(folder) if d.startswith("dcp-")))
    path = os.path.join(data, "__0_0.distcp")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(os.path.getsize(path) // 2)
        f.write(bytes([b[0] ^ 0x10]))


def _one_process(rank, world, root):
    """A corrupted chunk is an error that loads nothing; an async save dying mid-write keeps the previous one."""
    import torch

    from msparallel_ds.checkpoint import sharded

    resumed = _resume(rank, world, [("one", "one", os.path.join(root, "async"))])
    engine = _engine("one")
    before = [p.detach().clone() for p in engine.model.parameters()]
    try:
        engine.load(os.path.join(root, "flipped"))
        msg = "loaded"
    except ValueError as e:
        msg = str(e)
    untouched = all(torch.equal(a, p) for a, p in zip(before, engine.model.parameters()))
    ckpt = os.path.join(root, "crash")
    _steps(engine, 0, 1)
    engine.save(ckpt, sharded=True)
    _steps(engine, 1, 2)

    def dies(*args):  # the data files are written, the process dies before the manifest
        raise OSError("killed")
    sharded._chunk_crcs, real = dies, sharded._chunk_crcs
    engine.save(ckpt, async_save=True)
    try:
        sharded.wait_pending()
        crashed = "no error"
    except sharded.CheckpointSaveError as e:
        crashed = str(e)
    sharded._chunk_crcs = real
    kept = engine.load(ckpt)["global_steps"]
    engine.save(ckpt, sharded=True)  # the next save sweeps the dead one's data
    return resumed, msg, untouched, crashed, kept, sorted(os.listdir(ckpt))


def test_nonfinite_finds_nan_and_inf():
    import torch

    from msparallel_ds.checkpoint.sharded import _nonfinite

    big = torch.zeros(1 << 16)
    cases = {"nan": big.clone().index_fill_(0, torch.tensor([40000]), float("nan")), "fine": big,
             "-inf": torch.tensor([1.0, -float("inf")]), "inf": torch.tensor([float("inf")]), "empty": torch.zeros(0),
             "int": torch.arange(3)}
    assert _nonfinite(cases) == ["nan", "-inf", "inf"]


def test_sharded_resume_equals_uninterrupted_under_any_layout(tmp_path):
    import shutil

    root = str(tmp_path)
    saved = run_distributed(_save_runs, 4, root, timeout=300)
    full, pp_full = saved[0]["dp2xtp2"], saved[0]["pp2xdp2"]
    assert abs(full[3] - full[2]) > 1e-3
    assert all(r["run"] == ["step-00000004"] and r["hf_equal"] for r in saved), saved  # keep_max=1, merged = live
    total = sum(r["bytes"] for r in saved)
    assert all(0 < r["bytes"] < 0.5 * total for r in saved), [r["bytes"] for r in saved]  # each rank its share
    assert all("refusing to write non-finite" in r["nan_save"] and "/fp32" in r["nan_save"] for r in saved), saved
    sync, asy, pp = (os.path.join(root, n) for n in ("sync", "async", "pp"))
    runs = [("tp2xcp2", "tp2xcp2", sync), ("dp2xtp2_zero2 from async", "dp2xtp2_zero2", asy),
            ("tp4_sp", "tp4_sp", sync), ("pp2xdp2", "pp2xdp2", sync), ("dp2xtp2 from pp", "dp2xtp2", pp)]
    resumed = run_distributed(_resume, 4, runs, timeout=300)[0]
    bad = str(tmp_path / "flipped")
    shutil.copytree(sync, bad)
    _flip(bad)
    one, msg, untouched, crashed, kept, files = run_distributed(_one_process, 1, root, timeout=120)[0]
    resumed.update(one)
    for name, (losses, info) in resumed.items():
        assert info["global_steps"] == 2 and info["optimizer_step"] == 2, (name, info)
        want = pp_full if name == "dp2xtp2 from pp" else full
        tol = 1e-4 if name in ("pp2xdp2", "dp2xtp2 from pp") else 1e-5  # another engine's summation order
        assert max(abs(a - b) / b for a, b in zip(losses, want[2:])) <= tol, (name, losses, want)
    assert "does not match its checksum" in msg and untouched, msg
    assert "killed" in crashed and kept == 1, (crashed, kept)
    assert len(files) == 2 and "msp_checkpoint.json" in files, files
