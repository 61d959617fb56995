"""Issue 41 hardening, in the pytest process: the newest checkpoint in a folder is what loads (a save removes the
converted shards it supersedes; a folder mixing formats is an error), convert-checkpoint verifies the source's
crc32s and writes checksums into every shard, and saves into one folder are serialized (a second save in flight is
a clear error; only our own temporary files of a process that is gone are swept, never a user's file)."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from engine_cases import tiny_config, tiny_model

ONE = SimpleNamespace(size=lambda name: 1, rank=lambda name: 0)  # the layout of one process


def _record(step=1):
    from msparallel_ds.checkpoint import format as fmt

    model = tiny_model()
    params = {n: {"fp32": p.detach().clone()} for n, p in model.named_parameters()}
    return {"format": fmt.FORMAT, "params": params, "optimizer_step": float(step), "global_steps": step,
            "lr_scheduler": None, "model_config": model.config.to_dict(), "checksum": "crc32",
            "checksums": fmt.checksums(params)}


def _gone_pid():
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def test_a_save_supersedes_converted_shards_and_a_mix_is_an_error(tmp_path):
    from msparallel_ds.checkpoint import format as fmt
    from msparallel_ds.checkpoint.convert import convert_checkpoint

    src, conv = tmp_path / "src", tmp_path / "conv"
    fmt.atomic_save(_record(1), str(src / fmt.FILE))
    convert_checkpoint(str(src), str(conv), tiny_config())
    assert fmt.read_for_layout(str(conv), ONE)[0]["global_steps"] == 1
    fmt.write_agreed(_record(5), str(conv / fmt.FILE))  # engine.save into the converted folder (global rank 0)
    assert sorted(os.listdir(conv)) == [fmt.FILE]
    ck, sliced = fmt.read_for_layout(str(conv), ONE)
    assert ck["global_steps"] == 5 and not sliced  # the new save, not the stale shards
    (conv / fmt.SHARDED_INDEX).write_text(json.dumps({"format": fmt.SHARDED_FORMAT}))  # left by an older version
    with pytest.raises(ValueError, match="different formats.*msp_sharded.json, msp_universal.pt"):
        fmt.read_for_layout(str(conv), ONE)


def test_convert_verifies_checksums_and_writes_them(tmp_path):
    import torch

    from msparallel_ds.checkpoint import format as fmt
    from msparallel_ds.checkpoint.convert import convert_checkpoint

    good, bad = _record(), _record()
    name = list(bad["params"])[-1]
    bad["params"][name]["fp32"][0, 0] += 1.0  # flipped bytes after the checksum was taken
    fmt.atomic_save(bad, str(tmp_path / "bad" / fmt.FILE))
    with pytest.raises(ValueError, match=f"{name}/fp32 does not match its checksum"):
        convert_checkpoint(str(tmp_path / "bad"), str(tmp_path / "bad_out"), tiny_config(dp=2, tp=2))
    assert not (tmp_path / "bad_out").exists()
    fmt.atomic_save(good, str(tmp_path / "good" / fmt.FILE))
    convert_checkpoint(str(tmp_path / "good"), str(tmp_path / "out"), tiny_config(dp=2, tp=2))
    for rank in range(2):
        shard = torch.load(tmp_path / "out" / fmt.shard_file(0, rank), weights_only=True)
        assert shard["checksums"] == fmt.checksums(shard["params"]) and shard["checksums"]
        fmt.verify_checksums(shard, shard["params"], "converted")


def test_saves_into_one_folder_are_serialized_and_only_our_stale_temps_swept(tmp_path):
    from msparallel_ds.checkpoint import format as fmt
    from msparallel_ds.checkpoint.folder import SAVE_LOCK, tmp_prefix

    folder, path = str(tmp_path), str(tmp_path / fmt.FILE)
    user = tmp_path / ".tmp-notes.pt"  # a user's file that happens to match the old sweep pattern
    user.write_bytes(b"mine")
    in_flight = tmp_path / f"{tmp_prefix(os.getppid())}a.pt"  # another live process's save, mid-write
    in_flight.write_bytes(b"half")
    killed = tmp_path / f"{tmp_prefix(_gone_pid())}b.pt"  # a save whose process is gone
    killed.write_bytes(b"half")
    fmt.write_agreed({"format": fmt.FORMAT, "params": {}, "step": 1}, path)
    assert user.exists() and in_flight.exists() and not killed.exists()
    (tmp_path / SAVE_LOCK).write_text(json.dumps({"host": tmp_prefix().split("-")[2], "pid": os.getppid()}))
    with pytest.raises(fmt.CheckpointSaveError, match=f"another save into {folder} is in flight"):
        fmt.write_agreed({"format": fmt.FORMAT, "params": {}, "step": 2}, path)
    assert fmt.read_checkpoint_file(path, fmt.FORMAT)["step"] == 1
    (tmp_path / SAVE_LOCK).write_text(json.dumps({"host": tmp_prefix().split("-")[2], "pid": _gone_pid()}))
    fmt.write_agreed({"format": fmt.FORMAT, "params": {}, "step": 3}, path)  # a killed save's lock is taken over
    assert fmt.read_checkpoint_file(path, fmt.FORMAT)["step"] == 3 and not (tmp_path / SAVE_LOCK).exists()


def test_convert_to_the_sharded_format(tmp_path):
    """convert-checkpoint SRC DST --sharded: the single file as a sharded (DCP) folder, every chunk checksummed;
    the CLI needs exactly one of --to-config / --sharded."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader, load

    from msparallel_ds.checkpoint import format as fmt
    from msparallel_ds.checkpoint import sharded
    from msparallel_ds.cli import main

    rec = _record(3)
    fmt.atomic_save(rec, str(tmp_path / "src" / fmt.FILE))
    assert main(["convert-checkpoint", str(tmp_path / "src"), str(tmp_path / "dst")]) == 2
    assert main(["convert-checkpoint", str(tmp_path / "src"), str(tmp_path / "dst"), "--sharded"]) == 0
    man = sharded.read_manifest(str(tmp_path / "dst"))
    data = str(tmp_path / "dst" / man["data"])
    md = FileSystemReader(data).read_metadata()
    sharded._verify(data, md, man["checksums"], 0, 1, "dst")
    back = {f"{n}/fp32": torch.empty_like(r["fp32"]) for n, r in rec["params"].items()}
    load(back, storage_reader=FileSystemReader(data), no_dist=True)
    assert all(torch.equal(back[f"{n}/fp32"], r["fp32"]) for n, r in rec["params"].items())
    assert torch.load(f"{data}/progress.pt", weights_only=True)["global_steps"] == 3
    with pytest.raises(ValueError, match="sharded checkpoint.*no conversion needed"):
        from msparallel_ds.checkpoint.convert import convert_checkpoint
        convert_checkpoint(str(tmp_path / "dst"), str(tmp_path / "again"), tiny_config(dp=2, tp=2))
