"""Hardening round 2, item 10: inputs that ended in a traceback now end in one line naming the file or key, exit 2.
Before: RecursionError (deep YAML via plan's auto_parallel_source), AttributeError/KeyError (strategy JSON that is
a list or lacks keys), SafetensorError (truncated .safetensors), UnpicklingError (crafted pytorch_model.bin in
export), KeyError / StrictDataclass errors (convert-checkpoint model_config without model_type or with list values),
ZeroDivisionError / TypeError (num_heads: 0, num_layers: [..] in an import config), JSONDecodeError without a file
name (malformed msp_sharded.json)."""
import json
import os
import pathlib
import shutil

import pytest
import torch
import yaml

FIX = pathlib.Path(__file__).parent / "fixtures" / "mindspore"


class _Payload:
    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path("/tmp/msparallel_ds_hardening_pwned"),))


def _cases(tmp: pathlib.Path) -> list:
    from safetensors.torch import save_file

    from msparallel_ds.checkpoint.format import FILE, FORMAT, atomic_save

    legacy, mp2 = FIX / "llama_legacy", FIX / "llama_mp2"
    out = []
    (tmp / "deep.yaml").write_text("a:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 400)))
    out.append((["plan", tmp / "deep.yaml"], ["deep.yaml", "nested more than 32"]))
    for name, data in {"list.json": [1, 2], "nokey.json": {"parallel_layout_item": {"w": {"dev_matrix": [2]}}}}.items():
        (tmp / name).write_text(json.dumps(data))
        out.append((["import-mindspore", mp2, tmp / "o", "--config", mp2 / "model.yaml", "--strategy", tmp / name],
                    [name]))
    shutil.copytree(FIX / "qwen3_mcore", tmp / "qw")
    cut = tmp / "qw" / "model-00002-of-00002.safetensors"
    cut.write_bytes(cut.read_bytes()[:-100])
    out.append((["import-mindspore", tmp / "qw" / "model.safetensors.index.json", tmp / "o", "--config",
                 FIX / "qwen3_mcore" / "model.yaml"], ["model-00002-of-00002.safetensors", "not a readable"]))
    (tmp / "hfbin").mkdir()
    save_file({"x": torch.zeros(1)}, str(tmp / "x.safetensors"))
    cfg = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 64, "vocab_size": 64, "architectures": ["LlamaForCausalLM"]}
    (tmp / "hfbin" / "config.json").write_text(json.dumps(cfg))
    torch.save({"model.embed_tokens.weight": _Payload()}, tmp / "hfbin" / "pytorch_model.bin")
    out.append((["export-mindspore", tmp / "hfbin", tmp / "e.ckpt", "--config", legacy / "model.yaml"],
                ["hfbin", "pytorch_model.bin holds objects other than tensors"]))
    for key, val in {"num_heads": 0, "num_layers": [1, 2]}.items():
        raw = yaml.safe_load((legacy / "model.yaml").read_text())
        raw["model"]["model_config"][key] = val
        (tmp / f"{key}.yaml").write_text(yaml.safe_dump(raw))
        out.append((["import-mindspore", legacy / "llama_legacy.ckpt", tmp / "o", "--config", tmp / f"{key}.yaml"],
                    [f"{key}.yaml", f"model.model_config.{key}={val!r}"]))
    for key, mc in {"nomodeltype": {"hidden_size": 4}, "listvalues": {"model_type": "llama", "hidden_size": [4]}}.items():
        atomic_save({"format": FORMAT, "params": {"w": {"fp32": torch.zeros(2)}}, "optimizer_step": 0.0,
                     "global_steps": 0, "lr_scheduler": None, "model_config": mc}, str(tmp / key / FILE))
        out.append((["convert-checkpoint", tmp / key, tmp / "c", "--to-config", legacy / "model.yaml"],
                    [f"{key}/{FILE}", "model_config"]))
    return out


def test_user_errors_are_one_line_naming_the_file_exit_2(tmp_path, capsys):
    from msparallel_ds import cli

    for argv, needles in _cases(tmp_path):
        code = cli.main([str(a) for a in argv])
        err = capsys.readouterr().err
        lines = [ln for ln in err.strip().splitlines() if ln.startswith("error")]
        assert code == 2 and "Traceback" not in err and len(lines) == 1, (argv, err)
        assert all(n in lines[0] for n in needles), (needles, lines[0])
    assert not os.path.exists("/tmp/msparallel_ds_hardening_pwned")


def test_malformed_sharded_index_names_the_file(tmp_path):
    from msparallel_ds.checkpoint.format import SHARDED_INDEX, read_for_layout

    for text in ("{", "[1]", '{"mesh": 3}'):
        (tmp_path / SHARDED_INDEX).write_text(text)
        with pytest.raises(ValueError, match=rf"{SHARDED_INDEX}: not a convert-checkpoint index"):
            read_for_layout(str(tmp_path), None)
