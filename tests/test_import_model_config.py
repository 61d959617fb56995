"""The model an imported MindFormers YAML describes: RoPE (theta, scaling type, its fields) reaches the HF config and
the logits (compared with MindFormers' own rotary tables, tests/fixtures/mindspore/rope, and with HF models built
directly with those values); a strategy file next to the rank folders is found; a YAML with no model is refused."""
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

FIX = Path(__file__).parent / "fixtures" / "mindspore"
CONFIGS = Path(__file__).resolve().parents[2] / "shared" / "mindformers-configs"


def _rotary(config, n):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    x = torch.zeros(1, n, 1)
    return LlamaRotaryEmbedding(config)(x, torch.arange(n)[None])


def test_legacy_rope_equals_mindformers_freqs_mgr():
    """Each legacy extend_method's HF table (cos, sin times HF's attention scaling) equals MindFormers' FreqsMgr."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from msparallel_ds.models.llama import legacy_hf_config

    meta = json.loads((FIX / "rope" / "cases.json").read_text())
    tables = load_file(str(FIX / "rope" / "freqs.safetensors"))
    n = meta["max_position_embedding"]
    for name, case in meta["cases"].items():
        mc = {"type": "LlamaConfig", "hidden_size": 4 * meta["head_dim"], "num_heads": 4, "num_layers": 1,
              "max_position_embedding": n, "seq_length": n, **case}
        model_type, kw = legacy_hf_config(mc)
        cos, sin = _rotary(AutoConfig.for_model(model_type, **kw), n)
        assert torch.allclose(cos[0], tables[f"{name}.cos"], atol=2e-6), name
        assert torch.allclose(sin[0], tables[f"{name}.sin"], atol=2e-6), name
    # the check can fail: HF's default table (theta 1e4, what a dropped theta gives) is another table
    default_cos, _ = _rotary(AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4), n)
    assert not torch.allclose(default_cos[0], tables["none_theta1e6.cos"], atol=1e-3)


def test_rope_keys_reach_rope_parameters():
    from msparallel_ds.checkpoint.rope import legacy_rope_parameters, mcore_rope_parameters

    assert mcore_rope_parameters({"rope_theta": "1e6"}, {}) == {"rope_type": "default", "rope_theta": 1e6}
    assert mcore_rope_parameters({"rotary_base": 5e5, "rope_scaling": {"type": "linear", "factor": 2}},
                                 {"rope_theta": 1e4}) == {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}
    yarn = mcore_rope_parameters({"theta": 1e4, "position_embedding_type": "yarn", "scaling_factor": 40,
                                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                  "max_position_embeddings": 4096}, {})
    assert yarn == {"rope_theta": 1e4, "rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
                    "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
    assert mcore_rope_parameters({"rotary_percent": 0.5}, {})["partial_rotary_factor"] == 0.5
    # a pretrained config.json's old-style keys are carried, the YAML's win
    assert mcore_rope_parameters({}, {"rope_theta": 1e6, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}) \
        == {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e6}
    assert mcore_rope_parameters({}, {}) is None
    assert legacy_rope_parameters({"theta": 1e4, "extend_method": "NTK", "scaling_factor": 4}) \
        == {"rope_type": "default", "rope_theta": 4e4}
    for mc, words in [({"extend_method": "YARN", "scaling_factor": {"factor": 4.0}}, "lacks original_max"),
                      ({"extend_method": "DYNAMIC_NTK"}, "extend_method='DYNAMIC_NTK'"),
                      ({"theta": "ten"}, "theta='ten' is not a number")]:
        with pytest.raises(ValueError, match=words):
            legacy_rope_parameters(mc)
    for mc, words in [({"use_rope_scaling": True}, "use_rope_scaling"), ({"position_embedding_type": "mrope"},
                                                                         "position_embedding_type")]:
        with pytest.raises(ValueError, match=words):
            mcore_rope_parameters(mc, {})


def _yaml_with(tmp_path, source: Path, **model_config):
    raw = yaml.safe_load(source.read_text())
    raw["model"]["model_config"].update(model_config)
    path = tmp_path / f"edited_{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _direct(model_type, ref, **config):
    """The HF model built directly with these values (not through our import), holding the reference weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, attn_implementation="eager", **config),
                                             dtype=torch.float32)
    model.load_state_dict(ref, strict=True)
    return model.eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("family", ["qwen3_mcore", "llama_legacy"])
def test_imported_logits_keep_theta_and_rope_scaling(tmp_path, family):
    """Import with theta 1e6 + a rope scaling: the imported model's logits equal those of the HF model built with
    those values directly, and differ from the default rope's (what a dropped key gives)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from msparallel_ds.checkpoint.mindformers import import_mindspore

    ref = load_file(str(FIX / family / "reference.safetensors"))
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "qwen3_mcore":
        yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4, "beta_fast": 32.0,
                "beta_slow": 1.0}
        config = _yaml_with(tmp_path, FIX / family / "model.yaml", rope_scaling=yarn)
        src, model_type = FIX / family / "model.safetensors.index.json", "qwen3"
        common.update(head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=16)
        rope = {**yarn, "rope_theta": 1e6}
    else:
        llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 4}
        config = _yaml_with(tmp_path, FIX / family / "model.yaml", theta=1e6, extend_method="LLAMA3",
                            scaling_factor=llama3)
        src, model_type = FIX / family / "llama_legacy.ckpt", "llama"
        common.update(rms_norm_eps=1e-5, max_position_embeddings=16)
        rope = {"rope_type": "llama3", "rope_theta": 1e6, **llama3}
    import_mindspore(str(src), str(tmp_path / "hf"), str(config))
    imported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    ids = torch.arange(24).reshape(2, 12) % 64
    got = _logits(imported, ids)
    assert (got - _logits(_direct(model_type, ref, rope_parameters=rope, **common), ids)).abs().max() <= 1e-5
    plain = _logits(_direct(model_type, ref, **common), ids)
    assert (got - plain).abs().max() > 1e-3


def test_partial_rotary_refused_where_hf_ignores_it(tmp_path):
    from msparallel_ds.checkpoint.mindformers_model import model_from_yaml

    config = _yaml_with(tmp_path, FIX / "qwen3_mcore" / "model.yaml", rotary_percent=0.5)
    with pytest.raises(ValueError, match="partial rotary factor .*0.5.*rotates whole heads"):
        model_from_yaml(config)


def test_strategy_file_next_to_rank_folders_is_found(tmp_path):
    """`strategy_ckpt_save_file: ./ckpt_strategy.ckpt` (the real YAMLs' name) next to the rank folders, or one
    level up: found without --strategy; two candidates: one clear error."""
    from safetensors.torch import load_file

    from msparallel_ds.checkpoint.mindformers import import_mindspore

    ref = load_file(str(FIX / "llama_legacy" / "reference.safetensors"))
    strategy = FIX / "llama_mp2" / "strategy" / "ckpt_strategy_rank_0.ckpt"
    for where in ("inside", "above"):
        ckpt = tmp_path / where / "checkpoint"
        for r in range(4):
            shutil.copytree(FIX / "llama_mp2" / f"rank_{r}", ckpt / f"rank_{r}")
        shutil.copy(strategy, (ckpt if where == "inside" else ckpt.parent) / "ckpt_strategy.ckpt")
        out = tmp_path / where / "hf"
        import_mindspore(str(ckpt), str(out), str(FIX / "llama_mp2" / "model.yaml"))
        got = load_file(str(out / "model.safetensors"))
        assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref), where
    shutil.copy(strategy, tmp_path / "inside" / "checkpoint" / "ckpt_strategy_rank_1.ckpt")
    with pytest.raises(ValueError, match="several strategy files .*--strategy"):
        import_mindspore(str(tmp_path / "inside" / "checkpoint"), str(tmp_path / "x"),
                         str(FIX / "llama_mp2" / "model.yaml"))
    assert not (tmp_path / "x").exists()


def test_yaml_without_a_model_is_refused(tmp_path):
    from msparallel_ds.checkpoint.mindformers_model import model_from_yaml

    with pytest.raises(ValueError, match=r"model.model_config names no model \(no `type`"):
        model_from_yaml(CONFIGS / "general__run_general_task.yaml")
    bare = tmp_path / "bare.yaml"
    bare.write_text("runner_config: {batch_size: 1}\n")
    with pytest.raises(ValueError, match="no model: / model.model_config section"):
        model_from_yaml(bare)


def test_legacy_mixtral_moe_config_round_trip(tmp_path):
    """A legacy LlamaConfig YAML with moe_config (MindFormers' Mixtral, research/mixtral/convert_weight.py): export
    writes its names and stacking (router.dense; ffn.w1 / w2 / w3 = the experts' gate / down / up stacked), import
    returns the identical tensors and the same logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from msparallel_ds.checkpoint.mindformers import export_mindspore, import_mindspore
    from msparallel_ds.checkpoint.mindspore_files import read_ckpt

    raw = yaml.safe_load((FIX / "llama_legacy" / "model.yaml").read_text())
    raw["moe_config"] = {"expert_num": 4, "num_experts_chosen": 2, "capacity_factor": 1.1, "aux_loss_factor": 0.05,
                         "routing_policy": "TopkRouterV2"}
    config = tmp_path / "mixtral.yaml"
    config.write_text(yaml.safe_dump(raw))
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "mixtral", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))  # the YAML's theta (HF Mixtral: 1e6)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.1)
    hf.eval().save_pretrained(str(tmp_path / "hf"))
    export_mindspore(str(tmp_path / "hf"), str(tmp_path / "mixtral.ckpt"), str(config))
    mf = read_ckpt(str(tmp_path / "mixtral.ckpt"))
    up = hf.model.layers[1].mlp.experts
    assert torch.equal(mf["model.layers.1.feed_forward.ffn.w1.weight"], up.gate_up_proj[:, :64])
    assert torch.equal(mf["model.layers.1.feed_forward.ffn.w3.weight"], up.gate_up_proj[:, 64:])
    assert torch.equal(mf["model.layers.1.feed_forward.ffn.w2.weight"], up.down_proj)
    assert torch.equal(mf["model.layers.1.feed_forward.router.dense.weight"], hf.model.layers[1].mlp.gate.weight)
    assert {"model.tok_embeddings.embedding_weight", "model.norm_out.weight", "lm_head.weight",
            "model.layers.0.attention.wq.weight", "model.layers.0.attention_norm.weight"} <= set(mf)
    import_mindspore(str(tmp_path / "mixtral.ckpt"), str(tmp_path / "back"), str(config))
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32).eval()
    assert back.config.model_type == "mixtral" and back.config.num_local_experts == 4
    ref = dict(hf.named_parameters())
    assert all(torch.equal(p, ref[n]) for n, p in back.named_parameters())
    ids = torch.arange(24).reshape(2, 12) % 64
    assert torch.equal(_logits(back, ids), _logits(hf, ids))
    raw["moe_config"]["shared_expert_num"] = 1
    config.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="moe_config.use_shared_expert_gating=False"):  # ungated: no HF counterpart
        import_mindspore(str(tmp_path / "mixtral.ckpt"), str(tmp_path / "x"), str(config))
