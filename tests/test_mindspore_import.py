"""import-mindspore / export-mindspore on checkpoints written by a real MindSpore (tests/fixtures/mindspore, made once
by make_fixtures.py with MindSpore 2.7 and MindFormers 2.1.0's own conversion rules; see its README): the imported
HF folders hold the reference weights and give the reference model's logits; sliced per-rank checkpoints merge by
their strategy file; export -> import is the identity; every bad input is one clear error and writes nothing."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

FIX = Path(__file__).parent / "fixtures" / "mindspore"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _reference(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "reference.safetensors"))


def _cli(*args, ok=True):
    res = subprocess.run([sys.executable, "-m", "msparallel_ds.cli", *map(str, args)], capture_output=True, text=True,
                         timeout=300, env=ENV)
    assert (res.returncode == 0) == ok, res.stdout + res.stderr
    return res


def _logits(model_dir_or_model, ids):
    from transformers import AutoModelForCausalLM

    model = (AutoModelForCausalLM.from_pretrained(str(model_dir_or_model), dtype=torch.float32,
                                                  attn_implementation="eager")
             if isinstance(model_dir_or_model, (str, Path)) else model_dir_or_model)
    with torch.no_grad():
        return model(ids).logits


def _reference_model(imported: Path, ref: dict, dtype=None):
    """The HF model of the imported config.json holding the reference weights (rounded like the checkpoint)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(imported), attn_implementation="eager")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: (v.to(dtype).float() if dtype else v) for k, v in ref.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    return model.eval()


def _check_import(out: Path, ref: dict, dtype=None):
    from safetensors.torch import load_file

    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(ref)
    worst = max((got[k].float() - (ref[k].to(dtype).float() if dtype else ref[k])).abs().max().item() for k in ref)
    assert worst <= 1e-6, worst
    ids = torch.arange(12).reshape(2, 6) % 64
    a, b = _logits(out, ids), _logits(_reference_model(out, ref, dtype), ids)
    assert (a - b).abs().max().item() <= 1e-5
    return got


@pytest.mark.parametrize("case", [
    ("llama_legacy", "llama_legacy.ckpt", "model.yaml", None),
    ("llama_legacy", "llama_legacy_qkv_concat_bf16.ckpt", "model_qkv_concat.yaml", torch.bfloat16),
    ("qwen3_mcore", "model.safetensors.index.json", "model.yaml", None),
    ("qwen3_mcore", "qwen3_fp16.safetensors", "model.yaml", torch.float16),
    ("llama_mp2", ".", "model.yaml", None),
], ids=["legacy-ckpt", "legacy-qkv-concat-bf16", "mcore-safetensors-index", "mcore-fp16", "mp2-sliced-opt-shard"])
def test_import_matches_the_reference(tmp_path, case):
    folder, src, config, dtype = case
    out = tmp_path / "hf"
    res = _cli("import-mindspore", FIX / folder / src, out, "--config", FIX / folder / config)
    assert "imported" in res.stdout
    got = _check_import(out, _reference(FIX / ("llama_legacy" if folder == "llama_mp2" else folder)), dtype)
    assert dtype is None or all(t.dtype == dtype for t in got.values())


def _copy_ckpt_with(tmp_path, edit):
    """The legacy merged fixture re-written (by our writer) after `edit(tensors)`."""
    from msparallel_ds.checkpoint.mindspore_files import read_ckpt, write_ckpt

    tensors = read_ckpt(str(FIX / "llama_legacy" / "llama_legacy.ckpt"))
    edit(tensors)
    path = tmp_path / f"edited_{len(list(tmp_path.iterdir()))}.ckpt"
    write_ckpt(str(path), tensors)
    return path


def _yaml_with(tmp_path, source: Path, **model_config):
    raw = yaml.safe_load(source.read_text())
    raw["model"]["model_config"].update(model_config)
    path = tmp_path / f"edited_{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_bad_inputs_are_one_clear_error_and_write_nothing(tmp_path):
    legacy = FIX / "llama_legacy"
    out = tmp_path / "out"
    cases = [
        # a shape the YAML's model does not have
        ((legacy / "llama_legacy.ckpt", "--config", _yaml_with(tmp_path, legacy / "model.yaml", intermediate_size=48)),
         ["model.layers.0.feed_forward.w1.weight", "(64, 32)", "(48, 32)"]),
        # a name no map knows, and a missing one
        ((_copy_ckpt_with(tmp_path, lambda t: t.update({"model.layers.0.attention.extra.weight": torch.zeros(2)})),
          "--config", legacy / "model.yaml"), ["unknown name model.layers.0.attention.extra.weight"]),
        ((_copy_ckpt_with(tmp_path, lambda t: t.pop("model.layers.1.ffn_norm.weight")), "--config",
          legacy / "model.yaml"), ["missing model.layers.1.post_attention_layernorm.weight"]),
        # half of a gate/up pair
        ((_copy_ckpt_with(tmp_path, lambda t: t.pop("model.layers.0.feed_forward.w3.weight")), "--config",
          legacy / "model.yaml"), ["missing model.layers.0.mlp.up_proj.weight"]),
        # per-rank slices without their strategy file
        ((FIX / "llama_mp2", "--config", FIX / "llama_mp2" / "model.yaml", "--strategy", tmp_path / "none"),
         ["none"]),
    ]
    for args, needles in cases:
        res = _cli("import-mindspore", args[0], out, *args[1:], ok=False)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        for needle in needles:
            assert needle in res.stderr, (needle, res.stderr)
        assert not out.exists()


def test_strategy_that_misses_a_sliced_parameter(tmp_path):
    """A strategy file without the layout of a sliced parameter: the error names it (not a silent wrong tensor)."""
    from msparallel_ds.checkpoint.mindspore_files.proto import ParallelStrategyMap

    src = tmp_path / "run"
    shutil.copytree(FIX / "llama_mp2", src)
    path = src / "strategy" / "ckpt_strategy_rank_0.ckpt"
    msg = ParallelStrategyMap()
    msg.ParseFromString(path.read_bytes())
    keep = [item for item in msg.parallel_layout_item if item.param_name != "model.layers.1.attention.wo.weight"]
    del msg.parallel_layout_item[:]
    msg.parallel_layout_item.extend(keep)
    path.write_bytes(msg.SerializeToString())
    res = _cli("import-mindspore", src, tmp_path / "out", "--config", src / "model.yaml", ok=False)
    assert "model.layers.1.attention.wo.weight" in res.stderr and "strategy" in res.stderr, res.stderr


@pytest.mark.parametrize("case", [("llama_legacy", "model.yaml", "legacy.ckpt"),
                                  ("llama_legacy", "model_qkv_concat.yaml", "fused.ckpt"),
                                  ("qwen3_mcore", "model.yaml", "mcore.safetensors")], ids=["legacy", "fused", "mcore"])
def test_export_then_import_is_the_identity(tmp_path, case):
    """HF -> MindFormers names (what an Ascend run loads) -> HF; the legacy export equals the MindSpore-written
    fixture tensor for tensor (same names, same values), so the way back speaks MindFormers' layout."""
    from safetensors.torch import load_file

    folder, config, name = case
    hf_dir = tmp_path / "hf"
    src = "llama_legacy.ckpt" if folder == "llama_legacy" else "model.safetensors.index.json"
    _cli("import-mindspore", FIX / folder / src, hf_dir, "--config", FIX / folder / "model.yaml")
    exported = tmp_path / name
    _cli("export-mindspore", hf_dir, exported, "--config", FIX / folder / config)
    back = tmp_path / "back"
    _cli("import-mindspore", exported, back, "--config", FIX / folder / config)
    a, b = load_file(str(hf_dir / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    if name == "fused.ckpt":  # the MindSpore-written qkv_concat file holds these values rounded to bf16
        from msparallel_ds.checkpoint.mindspore_files import read_ckpt

        mine, theirs = read_ckpt(str(exported)), read_ckpt(str(FIX / folder / "llama_legacy_qkv_concat_bf16.ckpt"))
        weights = {k for k in theirs if k.startswith(("model.", "lm_head"))}
        assert weights == set(mine)
        assert all(torch.equal(mine[k].to(torch.bfloat16), theirs[k]) for k in weights)


def test_to_layout_loads_into_a_tp2_engine(tmp_path):
    """--to-layout writes engine.load's checkpoint pre-sliced for a model_parallel 2 YAML; two gloo processes load
    it and their first loss is the reference model's loss on the same batch."""
    from harness import run_distributed

    raw = yaml.safe_load((FIX / "llama_legacy" / "model.yaml").read_text())
    raw["parallel_config"].update(data_parallel=1, model_parallel=2, pipeline_stage=1)
    raw.setdefault("runner_config", {})["batch_size"] = 2
    raw["use_parallel"] = True
    raw.setdefault("parallel", {})["parallel_mode"] = 1  # semi_auto (the fixture's dp1 x mp1 YAML says data_parallel)
    layout = tmp_path / "tp2.yaml"
    layout.write_text(yaml.safe_dump(raw))
    dst = tmp_path / "engine_ckpt"
    _cli("import-mindspore", FIX / "llama_legacy" / "llama_legacy.ckpt", dst, "--config",
         FIX / "llama_legacy" / "model.yaml", "--to-layout", layout)
    index = json.loads((dst / "msp_sharded.json").read_text())
    assert index["mesh"] == {"pp": 1, "tp": 2} and len(index["files"]) == 2
    hf = tmp_path / "hf"
    _cli("import-mindspore", FIX / "llama_legacy" / "llama_legacy.ckpt", hf, "--config",
         FIX / "llama_legacy" / "model.yaml")
    ids = (torch.arange(32).reshape(2, 16) * 7) % 64
    ref = _reference_model(hf, _reference(FIX / "llama_legacy"))
    with torch.no_grad():
        want = ref(ids, labels=ids).loss.item()
    got = run_distributed(_load_and_step, 2, str(hf), str(layout), str(dst), ids, timeout=300)
    assert all(abs(g - want) / want <= 1e-5 for g in got), (got, want)


def _load_and_step(rank, world, hf_dir, layout, ckpt, ids):
    from transformers import AutoConfig, AutoModelForCausalLM

    import msparallel_ds as msp

    torch.manual_seed(123)  # other weights than the checkpoint's: the load must overwrite all of them
    config = AutoConfig.from_pretrained(hf_dir)
    engine = msp.initialize(AutoModelForCausalLM.from_config(config), msp.load_config(layout),
                            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    engine.load(ckpt)
    return engine.train_batch({"input_ids": ids, "labels": ids}).item()


def test_qwen3_moe_experts_round_trip(tmp_path):
    """mcore Qwen3-MoE: the routed experts go to MindFormers' stacked weight1 [E*H, 2I] (per expert [H, gate|up],
    mindformers 2.1.0 ExpertsConvertOp) and weight2 [E*I, H], the router to mlp.router; export -> import is exact."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from msparallel_ds.checkpoint.mindspore_files import read_ckpt

    kw = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64, num_experts=4,
              num_experts_per_tok=2, mlp_only_layers=[1], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**kw))
    model.save_pretrained(str(tmp_path / "hf"))
    raw = {"use_legacy": False, "model": {"model_config": {"model_type": "qwen3_moe",
                                                           "architectures": "Qwen3MoeForCausalLM", **kw}}}
    config = tmp_path / "moe.yaml"
    config.write_text(yaml.safe_dump(raw))
    _cli("export-mindspore", tmp_path / "hf", tmp_path / "moe.ckpt", "--config", config)
    mf = read_ckpt(str(tmp_path / "moe.ckpt"))
    sd = model.state_dict()
    gate_up = sd["model.layers.0.mlp.experts.gate_up_proj"]
    gate, up = gate_up[:, :16], gate_up[:, 16:]
    assert torch.equal(mf["decoder.layers.0.mlp.experts.weight1"],
                       torch.cat([gate.transpose(1, 2), up.transpose(1, 2)], dim=2).reshape(4 * 32, 32))
    assert torch.equal(mf["decoder.layers.0.mlp.router.weight"], sd["model.layers.0.mlp.gate.weight"])
    assert "decoder.layers.1.mlp.linear_fc1.weight" in mf  # the dense layer keeps the mcore MLP
    _cli("import-mindspore", tmp_path / "moe.ckpt", tmp_path / "back", "--config", config)
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).state_dict()  # HF writes one matrix/expert
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
