"""MindFormers names of DeepSeek-V3 (2.1 mcore: MLA split and fused, grouped experts, shared experts, router bias, MTP
layer) and of legacy moe_config Qwen2-MoE (shared experts + gate), against checkpoints MindSpore wrote from the
instantiated MindFormers cells (tests/fixtures/mindspore/make_moe_fixtures.py): import gives the reference weights and
the reference model's logits, export gives back the fixture's tensors under the fixture's names, round trips are
exact."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

FIX = Path(__file__).parent / "fixtures" / "mindspore"
CONFIGS = Path(__file__).resolve().parents[2] / "shared" / "mindformers-configs"
CASES = {"qwen2_moe": ("qwen2_moe_legacy", "qwen2_moe_legacy.ckpt", "model.yaml"),
         "ds3_split": ("deepseek3_mcore", "deepseek3_split.safetensors", "model_split.yaml"),
         "ds3_qkv_concat": ("deepseek3_mcore", "deepseek3_qkv_concat.safetensors", "model_qkv_concat.yaml")}


def _reference(folder: str) -> dict:
    from safetensors.torch import load_file

    return _fused(load_file(str(FIX / folder / "reference.safetensors")))


def _fused(ref: dict) -> dict:
    """HF tensors in the hub format (one matrix per expert; transformers writes Qwen2-MoE so) or fused, in
    transformers 5's fused expert layout (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    out, experts = {}, {}
    for name, t in ref.items():
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep or not tail.split(".")[0].isdigit():
            out[name] = t
            continue
        e, proj = tail.split(".")[:2]
        experts.setdefault(head, {}).setdefault(proj, {})[int(e)] = t
    for head, projs in experts.items():
        n = len(projs["down_proj"])
        out[f"{head}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]]) for e in range(n)])
        out[f"{head}.mlp.experts.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(n)])
    return out


def _import(case: str, out: Path, cli: bool = False) -> dict:
    from safetensors.torch import load_file

    folder, src, config = CASES[case]
    if cli:
        res = subprocess.run([sys.executable, "-m", "msparallel_ds.cli", "import-mindspore", str(FIX / folder / src),
                              str(out), "--config", str(FIX / folder / config)], capture_output=True, text=True,
                             timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert res.returncode == 0 and "imported" in res.stdout, res.stdout + res.stderr
    else:
        from msparallel_ds.checkpoint.mindformers import import_mindspore

        import_mindspore(str(FIX / folder / src), str(out), str(FIX / folder / config))
    return _fused(load_file(str(out / "model.safetensors")))


def _model(config, state: dict):
    """The HF model of `config` holding `state` (MTP layers added when the state has them), eval, fp32, eager."""
    from transformers import AutoModelForCausalLM

    from msparallel_ds.models.mtp import add_mtp_layers

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    if getattr(config, "num_nextn_predict_layers", 0) and config.model_type == "deepseek_v3":
        add_mtp_layers(model, config.num_nextn_predict_layers)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return model.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_import_gives_the_reference_weights_and_logits(tmp_path, case):
    """Every tensor equals the reference (MTP layer, router bias and fused expert tensors included) and the imported
    folder's model gives the logits of the model built from the reference weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    got = _import(case, tmp_path / "hf", cli=case == "ds3_split")
    ref = _reference(CASES[case][0])
    assert set(got) == set(ref), (set(got) ^ set(ref))
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    config = AutoConfig.from_pretrained(str(tmp_path / "hf"))
    if case.startswith("ds3"):
        assert config.num_nextn_predict_layers == 1 and "model.layers.2.eh_proj.weight" in got
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in got
    ids = (torch.arange(24).reshape(2, 12) * 5) % 64
    imported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    with torch.no_grad():
        a, b = imported(ids).logits, _model(config, ref)(ids).logits
    assert torch.equal(a, b)
    _model(config, got)  # the MTP layer's tensors load into models/mtp.py's layer strictly


@pytest.mark.parametrize("case", list(CASES))
def test_export_gives_the_fixture_back(tmp_path, case):
    """HF -> MindFormers names: the fixture MindSpore wrote, tensor for tensor under the same names (its dropout seeds
    and router token counters, training state with no HF counterpart, are not written); and import of that export
    is the identity."""
    from msparallel_ds.checkpoint.mindformers import export_mindspore, import_mindspore

    folder, src, config = CASES[case]
    hf = _import(case, tmp_path / "hf")
    fmt = "safetensors" if src.endswith(".safetensors") else "ckpt"
    exported = tmp_path / f"out.{fmt}"
    export_mindspore(str(tmp_path / "hf"), str(exported), str(FIX / folder / config), fmt=fmt)
    theirs = _read(FIX / folder / src)
    mine = _read(exported)
    state = {n for n, t in theirs.items() if t.dim() == 0 or n.endswith((".expert_load", ".fi_accu"))}
    assert set(mine) == set(theirs) - state, set(mine) ^ (set(theirs) - state)
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)
    import_mindspore(str(exported), str(tmp_path / "back"), str(FIX / folder / config))
    back = _fused(_import_file(tmp_path / "back"))
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    if case == "ds3_qkv_concat":
        assert "decoder.layers.0.self_attention.linear_qkv.weight" in mine
        assert "mtp.layers.0.transformer_layer.self_attention.linear_kvb.weight" in mine


def _read(path: Path) -> dict:
    if path.suffix == ".ckpt":
        from msparallel_ds.checkpoint.mindspore_files import read_ckpt

        return read_ckpt(str(path))
    from safetensors.torch import load_file

    return load_file(str(path))


def _import_file(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_real_yamls():
    """The real Qwen2-MoE 57B YAML (legacy moe_config with 8 shared experts' worth of gated shared expert) makes HF
    Qwen2-MoE's config; the 2.1 DeepSeek-V3 671B YAML keeps its MTP layer and split MLA projections
    (mla_qkv_concat: False); legacy DeepSeek YAMLs (research/deepseek3) are one clear refusal."""
    from msparallel_ds.checkpoint.mindformers_model import model_from_yaml

    c = model_from_yaml(CONFIGS / "qwen2_moe__pretrain_qwen2_57b.yaml").hf_config
    assert (c.model_type, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == ("qwen2_moe", 64, 8, 2560)
    assert (c.shared_expert_intermediate_size, c.norm_topk_prob, c.qkv_bias) == (2560 * 8, False, True)
    ds3 = Path("/tmp/mf-2.1.0/configs/deepseek3/pretrain_deepseek3_671b.yaml")
    if ds3.is_file():
        m = model_from_yaml(ds3)
        assert m.hf_config.num_nextn_predict_layers == 1 and m.qkv_concat is False
    with pytest.raises(ValueError, match=r"type='DeepseekV3Config' \(legacy DeepSeek"):
        model_from_yaml(CONFIGS / "deepseek3__pretrain_deepseek3_671b.yaml")


def test_unmappable_shared_experts_are_refused(tmp_path):
    """Legacy shared experts without their sigmoid gate have no HF Qwen2-MoE counterpart: one clear error."""
    from msparallel_ds.checkpoint.mindformers_model import model_from_yaml

    raw = yaml.safe_load((FIX / "qwen2_moe_legacy" / "model.yaml").read_text())
    raw["moe_config"]["use_shared_expert_gating"] = False
    path = tmp_path / "nogate.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="moe_config.use_shared_expert_gating=False"):
        model_from_yaml(path)


def test_run_model_keeps_the_mtp_layers(tmp_path):
    """`msparallel-ds train`'s model (run/model.py build_model): a DeepSeek-V3 MindSpore checkpoint, or the HF folder
    imported from it, loads the MTP layer's weights too (HF's own loader skips layers past num_hidden_layers); a YAML
    that trains no MTP (mtp depth absent) leaves them out instead of failing the strict load."""
    from msparallel_ds.run.model import build_model

    folder, src, config = CASES["ds3_split"]
    raw = yaml.safe_load((FIX / folder / config).read_text())
    ref = _reference(folder)
    _import("ds3_split", tmp_path / "hf")
    for load in (FIX / folder / src, tmp_path / "hf"):
        model = build_model({**raw, "load_checkpoint": str(load)}, str(FIX / folder / config), seed=0)
        state = model.state_dict()
        assert "model.layers.2.eh_proj.weight" in state
        assert all(torch.equal(state[k], ref[k]) for k in ref), load
    del raw["model"]["model_config"]["num_nextn_predict_layers"]  # MindFormers and HF default: 1 MTP layer saved
    path = tmp_path / "no_mtp_key.yaml"
    path.write_text(yaml.safe_dump(raw))
    model = build_model({**raw, "load_checkpoint": str(FIX / folder / src)}, str(path), seed=0)
    assert "model.layers.2.eh_proj.weight" not in model.state_dict()
