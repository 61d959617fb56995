"""MindFormers 2.1 DeepSeek-V4 weight names (import-mindspore / export-mindspore), against checkpoints MindSpore wrote
from the instantiated 2.1 cell (tests/fixtures/mindspore/make_v4_fixture.py: PyNativeDeepseekV4ForCausalLM filled by
the model's own weight_converters from DeepSeek-native reference weights). The HF reference is transformers' own
`from_pretrained` of those native weights (its conversion_mapping), so no mapping here is written twice.

Tiny model: hidden 32, 4 layers (sliding, compressed sparse attention + lightning indexer, heavily compressed at rate
128, sliding), 2 hyper-connection streams, 8 routed experts top-2 (layer 0 hash-routed) + 1 shared, vocab 64."""
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers.models.deepseek_v4", reason="HF DeepseekV4ForCausalLM needs transformers >= 5.24")
from msparallel_ds.checkpoint.mindformers import export_mindspore, import_mindspore, mindformers_to_hf  # noqa: E402
from msparallel_ds.checkpoint.weight_map import MappingError, to_hf, to_mf  # noqa: E402

FIX = Path(__file__).parent / "fixtures" / "mindspore" / "deepseek4"
WHEEL = Path(__file__).parent / "fixtures" / "mindformers21" / "pretrain_deepseek4_flash.yaml"
MODEL = dict(model_type="deepseek_v4", architectures="DeepseekV4ForCausalLM", vocab_size=64, hidden_size=32,
             num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1.0e-6,
             multi_latent_attention=True, mla_qkv_concat=True, o_groups=2, o_lora_rank=8, q_lora_rank=16,
             qk_rope_head_dim=8, qk_nope_head_dim=8, qk_layernorm=True, v_head_dim=16, num_nextn_predict_layers=0,
             params_dtype="float32", compute_dtype="float32", moe_intermediate_size=8, routed_scaling_factor=1.5,
             num_hash_layers=1, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
             moe_router_score_function="sqrtsoftplus", moe_grouped_gemm=True, enable_hyper_connections=True,
             num_residual_streams=2, index_n_heads=2, index_head_dim=8, index_topk=4,
             experimental_attention_variant="dsv4_hybrid", compress_ratios=[0, 4, 128, 0], csa_window_size=8,
             compress_rope_theta=160000, position_embedding_type="yarn", rotary_scaling_factor=16, beta_fast=32,
             beta_slow=1, mscale=1, mscale_all_dim=1, rope_theta=10000.0)  # the wheel configs' RoPE keys


def _yaml(tmp_path, **model):
    """A MindFormers 2.1 pynative YAML (the wheel deepseek4 configs' layout: the model keys under `model:`)."""
    path = tmp_path / f"v4_{len(list(tmp_path.glob('v4_*.yaml')))}.yaml"
    doc = {"parallelism": {"tensor_parallel": 1, "expert_parallel": 1},
           "training": {"local_batch_size": 1, "global_batch_size": 1}, "model": {**MODEL, **model}}
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """HF's own load of the native reference weights: (model, state dict)."""
    from transformers import DeepseekV4ForCausalLM

    folder = tmp_path_factory.mktemp("native")
    shutil.copy(FIX / "config.json", folder / "config.json")
    shutil.copy(FIX / "reference.safetensors", folder / "model.safetensors")
    model = DeepseekV4ForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    return model, {n: t.detach().clone() for n, t in model.state_dict().items()}


def _state(folder):
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    return model, model.state_dict()


def _assert_same(got: dict, want: dict):
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


def test_import_export_reimport_match_the_mindformers_cell(tmp_path, reference):
    ref_model, ref = reference
    config = _yaml(tmp_path)
    report = import_mindspore(str(FIX / "deepseek4.safetensors"), str(tmp_path / "hf"), config)
    assert report["tensors"] == len(ref) and report["model_type"] == "deepseek_v4"
    model, state = _state(tmp_path / "hf")
    _assert_same(dict(state), ref)
    assert model.config.layer_types == ["sliding_attention", "compressed_sparse_attention",
                                        "heavily_compressed_attention", "sliding_attention"]
    assert model.config.mlp_layer_types == ["hash_moe", "moe", "moe", "moe"] and model.config.hc_mult == 2
    rope = load_file(str(FIX / "rope.safetensors"))  # the cell's own tables: sliding RoPE, compressed-layer YaRN
    for kind in ("main", "compress"):
        torch.testing.assert_close(getattr(model.model.rotary_emb, f"{kind}_inv_freq"), rope[kind], rtol=1e-6, atol=0)
        assert getattr(model.model.rotary_emb, f"{kind}_attention_scaling") == 1.0
    ids = torch.randint(0, 64, (2, 136), generator=torch.Generator().manual_seed(0))  # > 128: an HCA entry exists
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref_model(ids).logits)

    cell = load_file(str(FIX / "deepseek4.safetensors"))  # what MindSpore saved from the cell
    for fmt in ("safetensors", "ckpt"):
        out = tmp_path / f"export.{fmt}"
        export_mindspore(str(tmp_path / "hf"), str(out), config, fmt=fmt)
        if fmt == "safetensors":  # the cell's every tensor, names, dtypes (int32 tid2eid) and values
            _assert_same(load_file(str(out)), cell)
        _, again, _, _ = mindformers_to_hf(str(out), config)
        _assert_same(again, ref)


def test_mindformers_converter_layout_and_frozen_tensors(tmp_path, reference):
    """MindFormers' own converter writes routed experts 2-D ([E*H, 2I] / [E*I, H]) and no token counters, frozen
    hyper-connection gammas or q_rms_gamma: that imports the same. A gamma other than 1 is refused, naming it."""
    _, ref = reference
    config = _yaml(tmp_path)
    cell = load_file(str(FIX / "deepseek4.safetensors"))
    frozen = ("tokens_per_expert", "rms_weight", "q_rms_gamma")
    conv = {n: t.reshape(-1, t.shape[-1]) if ".experts.weight" in n else t for n, t in cell.items()
            if not n.endswith(frozen)}
    save_file(conv, str(tmp_path / "converted.safetensors"), metadata={"format": "ms"})
    _, hf, _, _ = mindformers_to_hf(str(tmp_path / "converted.safetensors"), config)
    _assert_same(hf, ref)

    cell["decoder.layers.2.ffn_hc.rms_weight"] = cell["decoder.layers.2.ffn_hc.rms_weight"] * 1.5
    save_file(cell, str(tmp_path / "gamma.safetensors"), metadata={"format": "ms"})
    with pytest.raises(MappingError, match=r"decoder\.layers\.2\.ffn_hc\.rms_weight.*other than 1"):
        mindformers_to_hf(str(tmp_path / "gamma.safetensors"), config)


def test_mtp_is_mapped_to_layer_n(tmp_path):
    """The MTP map (HF layer N + k: models/deepseek4_mtp.py's layer, models/mtp.py names + hc_head) against the cell's
    mtp.layers.0 tensors, both ways; an MTP YAML imports the cell's MTP checkpoint into exactly the parameters the
    family's MTP layer holds (mindformers_to_hf checks names and shapes against that model); an MTP checkpoint under
    a YAML without MTP is refused naming the mtp tensors (never dropped)."""
    from msparallel_ds.checkpoint.mindformers_model import model_from_yaml
    from msparallel_ds.models.deepseek4_names import mindformers_v4_ops

    cell = load_file(str(FIX / "deepseek4_mtp.safetensors"))
    native = load_file(str(FIX / "reference_mtp.safetensors"))
    cfg = model_from_yaml(_yaml(tmp_path)).hf_config
    ops = mindformers_v4_ops(cfg, 1)
    hf = to_hf(ops, cell, cfg)
    assert torch.equal(hf["model.layers.4.eh_proj.weight"],
                       torch.cat([native["mtp.0.e_proj.weight"], native["mtp.0.h_proj.weight"]], dim=1))
    for hf_name, native_name in (("shared_head.norm.weight", "norm.weight"), ("hc_head.hc_fn", "hc_head_fn"),
                                 ("self_attn.q_a_proj.weight", "attn.wq_a.weight"), ("attn_hc.fn", "hc_attn_fn")):
        assert torch.equal(hf[f"model.layers.4.{hf_name}"], native[f"mtp.0.{native_name}"]), hf_name
    assert not any(n.startswith("model.layers.4.self_attn.compressor") for n in hf)  # MTP attention: sliding only
    _assert_same(to_mf(ops, hf, cfg, fused=True), cell)

    mtp_yaml = _yaml(tmp_path, num_nextn_predict_layers=1, compress_ratios=[0, 4, 128, 0, 0])
    _, imported, _, _ = mindformers_to_hf(str(FIX / "deepseek4_mtp.safetensors"), mtp_yaml)
    assert sorted(imported) == sorted(hf)
    for name, t in hf.items():
        assert torch.equal(imported[name], t), name
    with pytest.raises(MappingError, match=r"unknown name mtp\.layers\.0\.eh_proj\.weight"):
        mindformers_to_hf(str(FIX / "deepseek4_mtp.safetensors"), _yaml(tmp_path))
    with pytest.raises(ValueError, match=r"model\.compress_ratios=\[0, 4, 8, 0\].*0 \(sliding\)"):
        model_from_yaml(_yaml(tmp_path, compress_ratios=[0, 4, 8, 0]))


def test_wheel_deepseek4_yaml_gives_its_model(tmp_path):
    """The wheel's pretrain_deepseek4_flash.yaml (MTP set to 0): its per-layer compress_ratios, hash layers, window,
    streams, head size and RoPE reach the HF config the import builds."""
    from msparallel_ds.checkpoint.mindformers_model import model_from_yaml

    doc = yaml.safe_load(WHEEL.read_text())
    doc["model"]["num_nextn_predict_layers"] = 0
    path = tmp_path / "flash.yaml"
    path.write_text(yaml.safe_dump(doc))
    cfg = model_from_yaml(str(path)).hf_config
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    m = doc["model"]
    assert cfg.layer_types == [kinds[r] for r in m["compress_ratios"][: m["num_hidden_layers"]]]
    assert cfg.mlp_layer_types.count("hash_moe") == m["num_hash_layers"]
    assert (cfg.head_dim, cfg.qk_rope_head_dim, cfg.sliding_window, cfg.hc_mult, cfg.hc_sinkhorn_iters) == (
        m["v_head_dim"], m["qk_rope_head_dim"], m["csa_window_size"], m["num_residual_streams"],
        m["mhc_sinkhorn_iterations"])
    assert cfg.swiglu_limit == m["activation_func_clamp_value"] and cfg.n_routed_experts == m["n_routed_experts"]
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    rotary, rope = DeepseekV4RotaryEmbedding(cfg), load_file(str(FIX / "rope.safetensors"))
    for kind in ("main", "compress"):  # MindFormers' own tables for this YAML (_build_rotary_pos_emb)
        torch.testing.assert_close(getattr(rotary, f"{kind}_inv_freq"), rope[f"flash_{kind}"], rtol=1e-5, atol=0)


def test_csa_dense_mode_is_refused_by_key(tmp_path):
    """model.csa_dense_mode: true (MindFormers 2.1 csa.py:608: no indexer on the ratio-4 layers, every compressed entry
    attended) has no HF counterpart: before, the key was dropped and the model kept its indexer, a silent difference.
    Now one error naming the key and the file; false (every wheel YAML's value) builds the model as before."""
    from msparallel_ds.checkpoint.mindformers_model import model_from_yaml

    path = _yaml(tmp_path, csa_dense_mode=True)
    with pytest.raises(ValueError, match=r"v4_0\.yaml: model\.csa_dense_mode=True is not supported") as err:
        model_from_yaml(path)
    assert "set it to false" in str(err.value)
    assert model_from_yaml(_yaml(tmp_path, csa_dense_mode=False)).hf_config.index_topk == MODEL["index_topk"]
