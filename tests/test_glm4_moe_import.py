"""GLM-4.5 (HF Glm4MoeForCausalLM) checkpoints under MindFormers 2.1.0's names (tests/fixtures/mindspore/glm4_moe,
written by MindSpore's save_checkpoint with the names the wheel's own Glm4MoePreTrainedModel.weight_mapping /
convert_name give: make_glm4_moe_fixture.py). import-mindspore gives exactly the weights transformers itself loads
from the HF-named reference (its per-expert tensors fused into gate_up_proj / down_proj), the same logits, and
export-mindspore writes the fixture's names and tensors back bit for bit."""
import shutil
from pathlib import Path

import torch

FIX = Path(__file__).parent / "fixtures" / "mindspore" / "glm4_moe"


def test_glm4_moe_import_export_exact_and_logits_equal(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from msparallel_ds.checkpoint.mindformers import export_mindspore, import_mindspore

    ref_dir = tmp_path / "reference"  # the HF hub layout: one matrix per expert, read by transformers itself
    ref_dir.mkdir()
    shutil.copy(FIX / "config.json", ref_dir / "config.json")
    shutil.copy(FIX / "reference.safetensors", ref_dir / "model.safetensors")
    reference = AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32).eval()

    hf_dir = tmp_path / "hf"
    import_mindspore(str(FIX / "glm4_moe.safetensors"), str(hf_dir), str(FIX / "model.yaml"))  # the CLI's command
    imported = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    want, got = reference.state_dict(), imported.state_dict()
    weights = {n for n in want if "rotary_emb" not in n}
    assert weights <= set(got) and all(torch.equal(got[n], want[n]) for n in weights)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in weights  # the router bias (a buffer) comes too
    ids = torch.arange(24).reshape(2, 12) % 64
    with torch.no_grad():
        a, b = imported(ids).logits, reference(ids).logits
    assert torch.equal(a, b) and b.abs().max() > 0.1

    exported = tmp_path / "mf.safetensors"
    export_mindspore(str(hf_dir), str(exported), str(FIX / "model.yaml"), fmt="safetensors")
    mine, theirs = load_file(str(exported)), load_file(str(FIX / "glm4_moe.safetensors"))
    assert set(mine) == set(theirs) and all(torch.equal(mine[n], theirs[n]) for n in theirs)
    assert "decoder.layers.1.mlp.experts.3.gating.weight" in theirs and "decoder.layers.0.mlp.hidden.weight" in theirs


def test_glm4_moe_names_refuse_qk_norm_and_legacy():
    import pytest
    from transformers import AutoConfig

    from msparallel_ds.models import Glm4MoeFamily

    cfg = AutoConfig.for_model("glm4_moe", n_routed_experts=4, use_qk_norm=True)
    with pytest.raises(ValueError, match="use_qk_norm: true: mindformers 2.1.0's glm4_moe weight_mapping"):
        Glm4MoeFamily().mindformers_weights(cfg, legacy=False)
    with pytest.raises(ValueError, match="use_legacy: false"):
        Glm4MoeFamily().mindformers_weights(cfg, legacy=True)
