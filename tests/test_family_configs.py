"""Real GLM and GPT-2 training YAMLs (glm2, glm4-9b from ../shared/mindformers-configs; glm3, gpt2 13b from the
1.3.2 wheel, tests/fixtures/mindformers_yaml) import as HF models (the importer's ChatGLM2Config / GPT2Config
mapping), and, scaled down (hidden 64, 4-8 layers, seq 32, the same parallel keys on 4 ranks), start and train two
steps through msp.initialize with the YAML's own optimizer and lr schedule on 4 gloo processes; plus the config and
weight maps of
GPT-2 both ways."""
import copy
from pathlib import Path

import pytest
import torch
import yaml

from harness import run_distributed

SHARED = Path(__file__).resolve().parents[2] / "shared" / "mindformers-configs"
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "mindformers_yaml"
YAMLS = {"glm2": SHARED / "glm2__run_glm2_6b_finetune_800T_A2_64G.yaml",
         "glm4_9b": SHARED / "glm4__finetune_glm4_9b.yaml",
         "glm3": FIXTURES / "glm3__run_glm3_6b_finetune_800T_A2_64G.yaml",
         "gpt2_13b": FIXTURES / "gpt2__run_gpt2_13b_910b.yaml"}
SEQ, VOCAB = 32, 256


def scaled(name):
    """The YAML with its model shrunk and its parallel_config fitted to 4 ranks (dp8 -> dp4; glm4's pp4 with its
    uneven offsets and per-stage recompute counts kept, on 8 layers)."""
    doc = yaml.safe_load(YAMLS[name].read_text())
    mc = doc["model"]["model_config"]
    par = doc["parallel_config"]
    layers = 8 if par.get("pipeline_stage", 1) > 1 else 4
    if mc["type"] == "GPT2Config":
        mc.update(hidden_size=64, num_heads=4, num_layers=layers, vocab_size=VOCAB, seq_length=SEQ,
                  max_position_embeddings=SEQ, eos_token_id=1)
    else:
        mc.update(hidden_size=64, num_attention_heads=4, kv_channels=16, ffn_hidden_size=96, num_layers=layers,
                  padded_vocab_size=VOCAB, seq_length=SEQ, multi_query_group_num=2, pad_token_id=0, eos_token_id=1)
    if par.get("pipeline_stage", 1) > 1:
        par.update(data_parallel=1, micro_batch_num=4)
        rc = doc["recompute_config"]
        rc["recompute"] = [1, 1, 2, 1]  # per stage, within the offsets' 1, 2, 4, 1 layers
    else:
        par["data_parallel"] = 4
    doc["runner_config"]["batch_size"] = min(doc["runner_config"]["batch_size"], 2)
    return doc


def _train(rank, world_size, names, tmp):
    import warnings

    from transformers import AutoModelForCausalLM

    import msparallel_ds as msp
    from msparallel_ds.checkpoint.mindformers_model import model_from_yaml

    out = {}
    for name in names:
        path = Path(tmp) / f"{name}.rank{rank}.yaml"  # one file per rank: no rank reads a half-written one
        path.write_text(yaml.safe_dump(scaled(name)))
        hf = model_from_yaml(path).hf_config
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf).float()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = msp.initialize(model, msp.load_config(str(path)), total_steps=2)  # the YAML's optimizer + lr
        lay = engine.layout
        rows = engine.micro_batch_size * engine.gradient_accumulation_steps
        g = torch.Generator().manual_seed(7)
        losses = []
        for _ in range(2):
            ids = torch.randint(0, VOCAB, (rows * lay.size("dp"), SEQ), generator=g)
            share = ids[lay.rank("dp") * rows:(lay.rank("dp") + 1) * rows]
            losses.append(engine.train_batch({"input_ids": share, "labels": share.clone()}).item())
        out[name] = {"losses": losses, "arch": type(model).__name__, "mesh": {n: lay.size(n) for n in ("dp", "pp")},
                     "recompute": sorted(engine.applied.recompute) if hasattr(engine, "applied") else None,
                     "head_dim": getattr(hf, "head_dim", None), "act": getattr(hf, "activation_function", None)}
    return out


@pytest.mark.distributed
@pytest.mark.skipif(not SHARED.is_dir(), reason=f"{SHARED} is absent (it ships beside the repo in CI only)")
def test_scaled_real_configs_train_two_steps(tmp_path):
    results = run_distributed(_train, 4, list(YAMLS), str(tmp_path), timeout=300)
    r = results[0]
    assert r["glm2"]["arch"] == r["glm3"]["arch"] == r["glm4_9b"]["arch"] == "GlmForCausalLM"
    assert r["gpt2_13b"]["arch"] == "GPT2LMHeadModel" and r["gpt2_13b"]["act"] == "quick_gelu"  # fast_gelu
    assert r["glm2"]["head_dim"] == 16 and r["glm4_9b"]["mesh"] == {"dp": 1, "pp": 4}
    assert r["glm2"]["mesh"] == {"dp": 4, "pp": 1}
    for name, res in r.items():
        assert all(torch.isfinite(torch.tensor(loss)) and 4.0 < loss < 7.0 for loss in res["losses"]), (name, res)
    assert r["glm2"]["recompute"] == ["0", "1", "2", "3"]  # recompute: true, every layer through the GLM adapter


def test_gpt2_config_and_weight_map_both_ways():
    from transformers import AutoConfig, AutoModelForCausalLM

    from msparallel_ds.checkpoint.weight_map import to_hf, to_mf
    from msparallel_ds.models.gpt2 import Gpt2Family, gpt2_hf_config

    mc = scaled("gpt2_13b")["model"]["model_config"]
    model_type, kw = gpt2_hf_config(mc)
    cfg = AutoConfig.for_model(model_type, **kw)
    assert (cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.n_inner, cfg.n_positions) == (64, 4, 4, 256, SEQ)
    assert cfg.activation_function == "quick_gelu" and cfg.resid_pdrop == 0.1 and cfg.tie_word_embeddings
    for bad in ({"post_layernorm_residual": True}, {"hidden_act": "relu"}):
        with pytest.raises(ValueError, match=f"model.model_config.{next(iter(bad))}="):
            gpt2_hf_config({**mc, **bad})
    model = AutoModelForCausalLM.from_config(cfg)
    hf = {k: v.detach().clone().normal_() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    ops = Gpt2Family().mindformers_weights(cfg, legacy=True)
    mf = to_mf(ops, hf, cfg, fused=True)
    q = mf["backbone.blocks.0.attention.dense1.weight"]  # convert_weight.py: c_attn's q columns, transposed
    assert torch.equal(q, hf["transformer.h.0.attn.c_attn.weight"][:, :64].t())
    assert torch.equal(mf["backbone.blocks.1.output.mapping.weight"], hf["transformer.h.1.mlp.c_fc.weight"])
    back = to_hf(ops, mf, cfg)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


def test_scaling_keeps_the_yaml_keys():
    doc = scaled("glm4_9b")
    assert doc["model"]["model_config"]["offset"] == [-1, 0, 2, -1]
    assert doc["parallel_config"]["use_seq_parallel"] is True and copy.deepcopy(doc) == doc


@pytest.mark.skipif(not SHARED.is_dir(), reason=f"{SHARED} is absent (it ships beside the repo in CI only)")
def test_importer_maps_the_real_glm_yamls_and_names_families_without_adapter():
    from msparallel_ds.checkpoint.mindformers_model import model_from_yaml
    from msparallel_ds.models import GlmFamily

    m = model_from_yaml(YAMLS["glm4_9b"])  # GLM-4-9B as ChatGLM2Config (1.3.2)
    c = m.hf_config
    assert isinstance(m.adapter, GlmFamily) and m.legacy and m.qkv_concat
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == \
        ("glm", 40, 4096, 13696, 151552)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps) == (32, 2, 128, 1.5625e-07)
    assert c.attention_bias and c.rope_parameters["partial_rotary_factor"] == 0.5 and not c.tie_word_embeddings
    with pytest.raises(ValueError, match=r"model\.model_config\.type='TelechatConfig'.*TeleChat.*these run: "
                                         r"parallel_config\.data_parallel"):
        model_from_yaml(SHARED / "telechat2__finetune_telechat_115b.yaml")


def test_yaml_layer_count_over_a_folder_config_refits_uniform_layer_types(tmp_path):
    """A 2.1 template's pretrained_model_dir holds a config.json listing one attention type per layer (Qwen3); a
    YAML with another num_hidden_layers made HF refuse the config ("must be equal to the number of layer_types")."""
    import yaml
    from transformers import AutoConfig

    from msparallel_ds.checkpoint.mindformers_model import model_from_yaml

    folder = tmp_path / "hf"
    AutoConfig.for_model("qwen3", num_hidden_layers=2, hidden_size=64, intermediate_size=128, vocab_size=256,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=8).save_pretrained(folder)
    doc = {"use_legacy": False, "pretrained_model_dir": str(folder),
           "model": {"model_config": {"num_hidden_layers": 4}}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    c = model_from_yaml(path).hf_config
    assert c.num_hidden_layers == 4 and c.layer_types == ["full_attention"] * 4
    cfg = AutoConfig.from_pretrained(folder)
    cfg.layer_types = ["full_attention", "sliding_attention"]
    cfg.save_pretrained(folder)
    with pytest.raises(ValueError, match=r"num_hidden_layers=4 differs from the 2 per-layer attention types"):
        model_from_yaml(path)
