"""The plan's parameter counts and memory for DeepSeek-V2/V3: Multi-head Latent Attention (MLA) checked against a
real tiny transformers DeepseekV3ForCausalLM, its tensor-parallel split, multi-token-prediction (MTP) layers on the
last stage, and the two DeepSeek-V3 671B YAMLs."""
from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import yaml

import msparallel_ds as msp
from msparallel_ds.model_params import Params, attention, dense_layer, moe_layer, mtp_extra
from msparallel_ds.moe.plan import stage_layer_kinds, stage_params

SHARED = Path(__file__).resolve().parents[2] / "shared" / "mindformers-configs"
V3_FILES = [SHARED / f"deepseek3__{k}_deepseek3_671b.yaml" for k in ("pretrain", "finetune")]
needs_shared = pytest.mark.skipif(not all(p.is_file() for p in V3_FILES), reason=f"{SHARED} is absent")

MLA = {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16}
SHAPE = {"num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 64, "intermediate_size": 128,
         "vocab_size": 128, "seq_length": 128, "use_flash_attention": True, "compute_dtype": "bfloat16", **MLA}
MOE = {"n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32,
       "first_k_dense_replace": 1}


def doc(pc=None, **model):
    return {"use_legacy": False, "parallel_config": {"use_seq_parallel": True, **(pc or {})},
            "model": {"model_config": {k: v for k, v in {**SHAPE, **MOE, **model}.items() if v is not None}}}


def plan(d):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return msp.make_plan(msp.load_config(copy.deepcopy(d)))


def hf_layers(q_lora_rank):
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV3Config(
        hidden_size=64, num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=2, topk_group=1, q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=32,
        intermediate_size=128, vocab_size=128)
    layers = transformers.DeepseekV3ForCausalLM(hf).model.layers
    return [sum(p.numel() for p in layer.parameters()) for layer in layers]


@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_mla_layer_counts_match_transformers_deepseek_v3(q_lora_rank):
    hf = hf_layers(q_lora_rank)
    cfg = msp.load_config(doc(q_lora_rank=q_lora_rank))
    rest, experts = moe_layer(cfg, cfg.moe, 1)
    assert dense_layer(cfg).total == hf[0]  # first_k_dense_replace = 1
    assert rest.total + experts == hf[1] == hf[3]


def test_tensor_parallel_splits_only_the_per_head_projections():
    cfg = msp.load_config(doc())
    # h 64, n 4, q_lora 32, kv_lora 16, rope 8, nope 16, v 16: q_b 32*4*24, kv_b 16*4*32, o 4*16*64 split;
    # q_a 64*32 + q_a_layernorm 32, kv_a_proj_with_mqa 64*24 + kv_a_layernorm 16 replicated
    split, whole = 32 * 96 + 16 * 128 + 4 * 16 * 64, 64 * 32 + 32 + 64 * 24 + 16
    assert attention(cfg.model) == Params(split, whole)
    assert dense_layer(cfg).per_rank(2) == (split + 3 * 64 * 128 + 2 * 64) // 2 + whole
    rest, experts = moe_layer(cfg, cfg.moe, 2)
    assert rest.per_rank(2) == (split + 3 * 64 * 32 + 2 * 64) // 2 + whole + 8 * 64  # router replicated
    assert experts == 4 * 3 * 64 * 32
    p = plan(doc({"model_parallel": 2, "data_parallel": 2, "expert_parallel": 2}))
    embed = 2 * 128 * 64 // (2 if p.vocab_parallel else 1) + 64  # pp 1: embedding, head and the final norm
    layers = dense_layer(cfg).per_rank(2) + 3 * (rest.per_rank(2) + experts)
    assert p.memory.params_per_rank == layers + embed and p.memory.expert_params_per_rank == 3 * experts
    no_q_lora = msp.load_config(doc(q_lora_rank=0)).model
    assert attention(no_q_lora) == Params(64 * 96 + 16 * 128 + 4 * 16 * 64, 64 * 24 + 16)


def test_mtp_adds_its_layer_to_the_last_stage():
    h, tp = 64, 2
    cfg = msp.load_config(doc())
    rest, experts = moe_layer(cfg, cfg.moe, 1)
    mtp = (rest.split + 2 * h * h) // tp + rest.replicated + 3 * h + experts  # MoE decoder + eh_proj + 3 norms
    assert mtp_extra(cfg.model) == Params(2 * h * h, 3 * h)
    pc = {"model_parallel": tp, "pipeline_stage": 2, "micro_batch_num": 2}
    off = {"offset": [-1, 1]}  # mcore: stages of 1 and 3 decoder layers; MTP outside the split, on stage 2
    base, with_mtp = plan(doc(pc, **off)), plan(doc(pc, num_nextn_predict_layers=1, mtp_loss_factor=0.3, **off))
    assert stage_layer_kinds(with_mtp) == [(1, 0, 0), (0, 3, 1)]
    assert stage_params(base)[0] == stage_params(with_mtp)[0]
    assert sum(stage_params(with_mtp)[1]) - sum(stage_params(base)[1]) == mtp
    embed = 128 * h // (tp if with_mtp.vocab_parallel else 1)  # pp > 1: the MTP layers need the embedding too
    assert with_mtp.memory.params_per_rank - base.memory.params_per_rank == mtp + embed
    assert any("MTP: 1 layer(s) on the last stage, outside the layer split (mcore), loss x0.3" in n
               for n in with_mtp.notes)
    legacy = plan({**doc(pc, num_nextn_predict_layers=1, offset=[0, 1]), "use_legacy": True})  # split: 4 + 1
    assert stage_layer_kinds(legacy) == [(1, 1, 0), (0, 2, 1)]


@needs_shared
@pytest.mark.parametrize("path", V3_FILES, ids=lambda p: p.stem)
def test_deepseek_v3_671b_counts_mla_and_mtp(path):
    p = plan(yaml.safe_load(path.read_text()))
    m = p.memory
    assert m is not None and 0 < m.total_gib < float("inf")
    notes = " ".join(p.notes)
    assert "MLA attention: q_lora 1536, kv_lora 512 (latent KV cache 576 per token), rope 64, nope 128, v 128" in notes
    assert "MTP: 1 layer(s) on the last stage, counted in the layer split (legacy), loss x0.3" in notes
    # legacy: 61 + 1 MTP layers over pp 16 ([4]*15 + [2]), tp 4, ep 8 of 256 experts, vocab parallel.
    # MLA attention: split q_b 1536*128*192 + kv_b 512*128*256 + o 128*128*7168 = 171,966,464;
    # replicated q_a 7168*1536 + 1536 + kv_a 7168*576 + 512 = 15,140,864 (187.1M in all, as DeepSeek-V3).
    # MoE layer per rank: (attention split + shared 3*7168*2048 + norms 2*7168) / 4 + replicated + router 256*7168
    # = 70,981,120, plus 32 local experts x 3*7168*2048 = 1,409,286,144. The worst stage holds 4 MoE layers and the
    # head 129280*7168/4 and the final norm 7168: 4 * 1,480,267,264 + 231,676,928 (about 6.15B; 671B / 128 pp x ep
    # groups = 5.2B, and each rank holds its attention and shared experts once per tp rank on top).
    assert stage_layer_kinds(p)[-1] == (0, 1, 1) and stage_layer_kinds(p)[0] == (3, 1, 0)
    assert m.params_per_rank == 4 * (70_981_120 + 1_409_286_144) + 231_669_760 + 7168  # head + final norm
    assert m.expert_params_per_rank == 4 * 1_409_286_144
