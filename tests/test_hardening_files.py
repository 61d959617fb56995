"""Hardening round 2, the file items (each test says what happened before the fix):
3. .ckpt duplicates and a crc trailer cut off; 7. index entries outside their folder; 9. predictable temp folders
followed through symlinks; 11. checkpoint files created 0600."""
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

FIX = Path(__file__).parent / "fixtures" / "mindspore"


# ------------------------------------------------------------------------------ 3. .ckpt duplicates and lost crc
def test_ckpt_duplicate_tag_is_an_error(tmp_path):
    """Before: two files concatenated (or a damaged writer) holding `a` twice read as the LATER `a`, silently."""
    from msparallel_ds.checkpoint.mindspore_files import read_ckpt, write_ckpt

    write_ckpt(tmp_path / "one.ckpt", {"a": torch.zeros(3), "b": torch.ones(2)})
    write_ckpt(tmp_path / "two.ckpt", {"a": torch.full((3,), 7.0)})
    both = tmp_path / "both.ckpt"
    both.write_bytes((tmp_path / "one.ckpt").read_bytes() + (tmp_path / "two.ckpt").read_bytes())
    with pytest.raises(ValueError, match=r"both\.ckpt: parameter 'a' is written twice"):
        read_ckpt(both)


def test_ckpt_that_lost_its_crc_is_reported(tmp_path):
    """Before: a crc-protected rank file cut at a record boundary (trailer gone) read as a valid shorter file: the
    folder's ranks merged without a word. Now a .ckpt without a trailer among siblings with one is an error, and
    read_ckpt(require_crc=True) refuses a file without one (MindSpore's crc_check=True)."""
    from msparallel_ds.checkpoint.mindspore_files import read_ckpt, read_mindspore_weights, write_ckpt
    from msparallel_ds.checkpoint.mindspore_files.ckpt_file import _TRAILER, has_crc

    src = tmp_path / "mp2"
    shutil.copytree(FIX / "llama_mp2", src)
    for f in sorted(src.glob("rank_*/*.ckpt")):
        write_ckpt(f, read_ckpt(f), crc=True)
    good = read_mindspore_weights(src)  # every file with its crc: reads as before
    victim = next(iter(sorted(src.glob("rank_1/*.ckpt"))))
    victim.write_bytes(victim.read_bytes()[:-_TRAILER])  # cut exactly at the last record boundary
    assert not has_crc(victim) and read_ckpt(victim).keys() == read_ckpt(next(src.glob("rank_0/*.ckpt"))).keys()
    with pytest.raises(ValueError, match=r"rank_1/.*\.ckpt: no crc trailer"):
        read_mindspore_weights(src)
    with pytest.raises(ValueError, match="no crc trailer"):
        read_ckpt(victim, require_crc=True)
    assert good.tensors and read_ckpt(victim)  # alone and not required, the file still reads


# ------------------------------------------------------------------------------ 7. index entries outside the folder
def _victim_and_folder(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "victim").mkdir()
    save_file({"w": torch.ones(2)}, str(tmp_path / "victim" / "x.safetensors"))
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"v": torch.zeros(2)}, str(folder / "own.safetensors"))
    os.symlink(tmp_path / "victim" / "x.safetensors", folder / "link.safetensors")
    return folder


@pytest.mark.parametrize("entry", ["../victim/x.safetensors", "ABS", "link.safetensors"])
def test_index_entries_must_stay_in_their_folder(tmp_path, entry):
    """Before: HF folders' and MindSpore sources' weight maps read `../victim/x.safetensors`, absolute paths and
    symlinks out of the folder (the victim's tensors were loaded)."""
    from msparallel_ds.checkpoint.hf import _weight_files
    from msparallel_ds.checkpoint.mindspore_files import read_mindspore_weights

    folder = _victim_and_folder(tmp_path)
    entry = str(tmp_path / "victim" / "x.safetensors") if entry == "ABS" else entry
    wmap = {"v": "own.safetensors", "w": entry}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    for read in (_weight_files, read_mindspore_weights):
        with pytest.raises(ValueError, match="outside the index's folder") as err:
            read(str(folder) if read is _weight_files else str(folder / "model.safetensors.index.json"))
        assert repr(entry) in str(err.value) and "model.safetensors.index.json" in str(err.value)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"v": "own.safetensors"}}))
    assert _weight_files(str(folder)) == {"v": str((folder / "own.safetensors").resolve())}


# ------------------------------------------------------------------------------ 9 + 11. temp folders and modes
def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_outputs_never_follow_a_planted_link_and_get_the_umask_mode(tmp_path):
    """Before: import-mindspore wrote into DST.tmp-<pid> (makedirs exist_ok), so a symlink planted there sent the
    output into the victim folder; export's DST.tmp-<pid> file the same; checkpoint files were 0600 (mkstemp) next
    to a 0644 index. Now temp names are exclusive (mkdtemp/mkstemp) and modes follow the umask."""
    from msparallel_ds.checkpoint.mindformers import export_mindspore, import_mindspore

    victim = tmp_path / "victim"
    victim.mkdir()
    dst, exported = tmp_path / "hf", tmp_path / "out.safetensors"
    os.symlink(victim, f"{dst.as_posix()}.tmp-{os.getpid()}")
    os.symlink(victim / "planted", f"{exported}.tmp-{os.getpid()}")
    old = os.umask(0o022)
    try:
        legacy = FIX / "llama_legacy"
        import_mindspore(str(legacy / "llama_legacy.ckpt"), str(dst), str(legacy / "model.yaml"))
        export_mindspore(str(dst), str(exported), str(legacy / "model.yaml"), fmt="safetensors")
        layout = tmp_path / "layout"
        import_mindspore(str(legacy / "llama_legacy.ckpt"), str(layout), str(legacy / "model.yaml"),
                         to_layout=str(legacy / "model.yaml"))  # via convert-checkpoint
    finally:
        os.umask(old)
    assert list(victim.iterdir()) == [], "output went through the planted link"
    assert (dst / "model.safetensors").is_file() and exported.is_file()
    assert _mode(dst) == 0o755 and _mode(exported) == 0o644
    files = [p for p in layout.iterdir()]
    assert files and all(_mode(p) == 0o644 for p in files), {p.name: oct(_mode(p)) for p in files}
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name and not p.is_symlink()]
