"""MoE configuration (issue 14): MindFormers' legacy `moe_config:` and mcore model_config MoE keys -> MoESettings,
each MindFormers rule broken once is refused under its key (rules and citations: msparallel_ds/config/moe.py), the
plan's expert-parallel sizes and MoE-aware memory, and the YAML checked against HF MoE configs (no downloads)."""
from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path

import pytest
import yaml

import msparallel_ds as msp
import msparallel_ds.cli as cli
from msparallel_ds.config import ConfigError, ConfigWarning
from msparallel_ds.moe.settings import MoESettings, check_model

SHARED = Path(__file__).resolve().parents[2] / "shared" / "mindformers-configs"
FILES = sorted(SHARED.glob("*.yaml")) if SHARED.is_dir() else []
needs_shared = pytest.mark.skipif(not FILES, reason=f"{SHARED} is absent (it ships beside the repo in CI only)")
EP_FILES = [p for p in FILES
            if (yaml.safe_load(p.read_text()).get("parallel_config") or {}).get("expert_parallel", 1) > 1]
SHAPE = {"num_layers": 4, "num_heads": 8, "n_kv_heads": 4, "hidden_size": 64, "intermediate_size": 128,
         "seq_length": 128, "vocab_size": 256, "compute_dtype": "bfloat16"}
LEGACY = {"parallel_config": {"data_parallel": 4, "model_parallel": 2, "expert_parallel": 4, "use_seq_parallel": True},
          "moe_config": {"expert_num": 8, "num_experts_chosen": 2, "routing_policy": "TopkRouterV2",
                         "aux_loss_types": ["expert"], "aux_loss_factors": [0.01]},
          "model": {"model_config": dict(SHAPE)}}
MCORE = {"use_legacy": False,
         "parallel_config": {"data_parallel": 2, "model_parallel": 2, "expert_parallel": 4, "use_seq_parallel": True},
         "model": {"model_config": {**SHAPE, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                    "moe_router_load_balancing_type": "gbs_aux_loss", "moe_aux_loss_coeff": 0.001}}}


def load(doc):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return msp.load_config(copy.deepcopy(doc))


def plan(doc, world_size=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return msp.make_plan(load(doc), world_size=world_size)


def mutate(doc, section, **changes):
    out = copy.deepcopy(doc)
    target = out["model"]["model_config"] if section == "model_config" else out.setdefault(section, {})
    for k, v in changes.items():
        if v is None:
            target.pop(k, None)
        else:
            target[k] = v
    return out


def refused(doc):
    with pytest.raises(msp.ConfigError) as info:
        plan(doc)
    return info.value


# --- settings: MindFormers' meaning of each key -------------------------------------------------------------------

def test_legacy_settings_follow_mindformers_defaults():
    s = load(LEGACY).moe
    assert isinstance(s, MoESettings) and s.source == "moe_config"
    assert (s.num_experts, s.top_k, s.capacity_factor, s.drop_policy) == (8, 2, 1.1, "probs")  # MoEConfig defaults
    assert (s.aux_loss_coeff, s.aux_loss_scope, s.z_loss_coeff, s.expert_bias) == (0.01, "sub_sequence", 0.0, False)
    assert s.moe_intermediate_size is None and s.expert_model_parallel is None
    assert load(mutate(LEGACY, "moe_config", num_experts_chosen=None)).moe.top_k == 1  # MindFormers' default
    assert load(mutate(LEGACY, "moe_config", use_gmm=True)).moe.capacity_factor is None  # MoEV3 is dropless
    assert load(mutate(LEGACY, "moe_config", capacity_factor=-1)).moe.capacity_factor is None  # dynamic capacity
    assert load(mutate(LEGACY, "moe_config", enable_sdrop=True)).moe.drop_policy == "position"
    v1 = mutate(LEGACY, "moe_config", routing_policy="TopkRouterV1", aux_loss_types=None, aux_loss_factors=None,
                aux_loss_factor=0.02)
    assert load(v1).moe.aux_loss_coeff == 0.02  # TopkRouterV1 scales by aux_loss_factor (1.3.2)
    dense = mutate(LEGACY, "moe_config", expert_num=1, num_experts_chosen=1)
    assert load(dense).moe is None  # expert_num 1 is a dense model in MindFormers
    d = load(LEGACY).moe.as_dict()
    assert set(d) == {"source", "num_experts", "top_k", "capacity_factor", "drop_policy", "aux_loss_coeff",
                      "aux_loss_scope", "z_loss_coeff", "shared_experts", "shared_expert_intermediate_size",
                      "moe_intermediate_size", "first_k_dense_replace", "norm_topk_prob", "expert_bias",
                      "bias_update_rate", "expert_model_parallel", "routed_scaling_factor", "router_dtype"}


def test_mcore_settings_and_spellings():
    s = load(MCORE).moe
    assert s.source == "model_config" and (s.num_experts, s.top_k, s.moe_intermediate_size) == (8, 2, 32)
    assert (s.capacity_factor, s.drop_policy, s.aux_loss_scope, s.aux_loss_coeff) == (None, "probs", "global_batch",
                                                                                       0.001)
    other = mutate(MCORE, "model_config", num_experts=None, n_routed_experts=8, moe_router_load_balancing_type=None,
                   moe_token_drop_policy=False, moe_expert_capacity_factor=-1.0, n_shared_experts=2)
    s = load(other).moe
    assert s.num_experts == 8 and s.key("num_experts") == "model.model_config.n_routed_experts"
    assert (s.aux_loss_scope, s.drop_policy, s.capacity_factor) == ("sub_sequence", "probs", None)  # 2.1 defaults
    assert s.shared_size(128) == 2 * 32  # n_shared x moe_intermediate_size
    # mcore never drops and has no z-loss: the capacity factor is only validated (transformer_config.py:2448-2455),
    # moe_z_loss_coeff read by nothing under parallel_core/training_graph/transformer/moe (router.py:427-437)
    with pytest.warns(ConfigWarning, match="moe_expert_capacity_factor=1.25: MindFormers' mcore MoE never drops"):
        assert msp.load_config(mutate(MCORE, "model_config", moe_expert_capacity_factor=1.25)).moe.capacity_factor \
            is None
    with pytest.warns(ConfigWarning, match="moe_z_loss_coeff=0.001: MindFormers' mcore MoE has no router z-loss"):
        assert msp.load_config(mutate(MCORE, "model_config", moe_z_loss_coeff=1e-3)).moe.z_loss_coeff == 0.0
    # routed_scaling_factor (utils.py:358 spelling moe_router_topk_scaling_factor) and norm_topk_prob are read
    scaled = mutate(MCORE, "model_config", routed_scaling_factor=1.5, norm_topk_prob=False)
    s = load(scaled).moe
    assert (s.routed_scaling_factor, s.norm_topk_prob) == (1.5, False)
    assert any("routing weights not normalised, x1.5 (router.py:290-295)" in n for n in plan(scaled).notes)
    s = load(mutate(MCORE, "model_config", moe_router_topk_scaling_factor=2.5)).moe
    assert s.key("routed_scaling_factor") == "model.model_config.moe_router_topk_scaling_factor"
    assert load(mutate(LEGACY, "moe_config", routed_scaling_factor=2.5)).moe.routed_scaling_factor == 2.5
    for raw, key in ((mutate(MCORE, "model_config", routed_scaling_factor=0),
                      "model.model_config.routed_scaling_factor"),
                     (mutate(LEGACY, "moe_config", routed_scaling_factor=-1.0), "moe_config.routed_scaling_factor")):
        with pytest.raises(ConfigError, match=re.escape(key) + ".*must be > 0"):
            load(raw)


def test_no_moe_keys_and_expert_parallel_is_allowed():
    doc = {"parallel_config": {"data_parallel": 4, "expert_parallel": 2}, "model": {"model_config": dict(SHAPE)}}
    p = plan(doc)
    assert p.moe is None and p.expert_parallel == 2 and p.expert_data_parallel == 2
    assert any("HF model's experts" in n for n in p.notes)
    assert plan({}).moe is None and plan({}).expert_data_parallel == 1


def test_warnings_only_where_semantics_change():
    with pytest.warns(ConfigWarning, match="aux_loss_factor=0.05 has no effect"):
        s = msp.load_config(mutate(LEGACY, "moe_config", aux_loss_types=None, aux_loss_factors=None,
                                   aux_loss_factor=0.05))
    assert s.moe.aux_loss_coeff == 0.0
    with pytest.warns(ConfigWarning, match="device"):
        msp.load_config(mutate(LEGACY, "moe_config", aux_loss_types=["expert", "device"], aux_loss_factors=[0.1, 0.2]))
    with pytest.warns(ConfigWarning, match="do not read moe_config"):
        cfg = msp.load_config({**MCORE, "moe_config": {"expert_num": 4}})
    assert cfg.moe.num_experts == 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # performance-only keys are silent
        msp.load_config(mutate(LEGACY, "moe_config", use_fused_ops_topkrouter=True, group_wise_a2a=True,
                               comp_comm_parallel=False, ep_extend_tp=True, callback_moe_droprate=False))


# --- each rule broken once: one error under its key -----------------------------------------------------------------

GMM = {"parallel_config": {"data_parallel": 2, "context_parallel": 2, "expert_parallel": 4},
       "moe_config": {"expert_num": 8, "num_experts_chosen": 2, "routing_policy": "TopkRouterV2"},
       "model": {"model_config": dict(SHAPE)}}
NO_MOE = {"parallel_config": {"data_parallel": 2, "model_parallel": 2, "expert_parallel": 2, "use_seq_parallel": True}}
MUTATIONS = [  # (base, section, changes, the one key refused)
    (LEGACY, "moe_config", {"expert_num": 6}, "moe_config.expert_num"),  # expert_num % ep (1.3.2 moe.py)
    (LEGACY, "moe_config", {"num_experts_chosen": 9}, "moe_config.num_experts_chosen"),
    (LEGACY, "moe_config", {"aux_loss_factor": 1.0}, "moe_config.aux_loss_factor"),
    (LEGACY, "moe_config", {"expert_model_parallel": 3}, "moe_config.expert_model_parallel"),
    (LEGACY, "moe_config", {"expert_nums": 8}, "moe_config.expert_nums"),  # unknown key (typo)
    (LEGACY, "moe_config", {"routing_policy": "TopkRouterV3"}, "moe_config.routing_policy"),
    (LEGACY, "moe_config", {"aux_loss_types": ["expert", "tokens"]}, "moe_config.aux_loss_types"),
    (LEGACY, "moe_config", {"aux_loss_factors": [0.01, 0.02]}, "moe_config.aux_loss_factors"),
    (LEGACY, "moe_config", {"expert_num": "eight"}, "moe_config.expert_num"),
    (LEGACY, "moe_config", {"router_dense_type": "int8"}, "moe_config.router_dense_type"),
    (LEGACY, "parallel_config", {"data_parallel": 2}, "parallel_config.expert_parallel"),  # dp x cp % ep
    (LEGACY, "parallel_config", {"use_seq_parallel": False}, "parallel_config.use_seq_parallel"),  # check_rules
    (GMM, "moe_config", {"use_gmm": True}, "parallel_config.expert_parallel"),  # use_gmm: dp x mp % ep
    (MCORE, "model_config", {"num_experts": 6}, "model.model_config.num_experts"),  # num_experts % ep
    (MCORE, "parallel_config", {"data_parallel": 1, "context_parallel": 2}, "parallel_config.expert_parallel"),
    (MCORE, "model_config", {"moe_router_load_balancing_type": "aux_loss"},
     "model.model_config.moe_router_load_balancing_type"),
    (MCORE, "model_config", {"moe_token_drop_policy": "random"}, "model.model_config.moe_token_drop_policy"),
    (MCORE, "model_config", {"n_routed_experts": 8}, "model.model_config.num_experts"),  # two spellings at once
    (MCORE, "model_config", {"moe_aux_loss_coef": 0.1}, "model.model_config.moe_aux_loss_coef"),  # typo
    (MCORE, "model_config", {"num_experts_per_tok": 9}, "model.model_config.num_experts_per_tok"),
    (MCORE, "model_config", {"n_group": 2, "topk_group": 3}, "model.model_config.topk_group"),
    (MCORE, "model_config", {"first_k_dense_replace": 5}, "model.model_config.first_k_dense_replace"),
    (MCORE, "model_config", {"moe_aux_loss_coeff": -0.1}, "model.model_config.moe_aux_loss_coeff"),
    (NO_MOE, "parallel_config", {"expert_parallel": 8}, "parallel_config.expert_parallel"),  # dp x cp x tp % ep
]


@pytest.mark.parametrize("base, section, changes, key", MUTATIONS,
                         ids=[f"{k}={list(c.values())}" for _, _, c, k in MUTATIONS])
def test_each_moe_rule_broken_once_names_its_key(base, section, changes, key):
    plan(base)  # the base plans
    err = refused(mutate(base, section, **changes))
    assert err.keys == [key], str(err)
    issue = err.issues[0]
    assert issue.rule and issue.fix, str(err)


def test_moe_without_sequence_parallel_is_refused_for_legacy_only():
    """tools/check_rules.py:169-176 (MoE with mp > 1 needs SP) reads moe_config: the legacy MoE only. mcore MoE with
    model_parallel > 1 and SP off plans (each tp rank routes its own sequence slice: models/moe.py)."""
    assert refused(mutate(LEGACY, "parallel_config", use_seq_parallel=False)).keys == ["parallel_config.use_seq_parallel"]
    for doc in (MCORE, NO_MOE):
        p = plan(mutate(doc, "parallel_config", use_seq_parallel=False))
        assert p.mesh.tp == 2 and p.expert_parallel > 1 and not p.sequence_parallel


def test_typo_fix_names_the_closest_key_and_parallelism_spelling():
    assert "did you mean `expert_num`" in str(refused(mutate(LEGACY, "moe_config", expert_nums=8)))
    assert "moe_aux_loss_coeff" in str(refused(mutate(MCORE, "model_config", moe_aux_loss_coef=0.1)))
    doc = {"parallelism": {"data_parallel_shard": 2, "tensor_parallel": 2, "expert_parallel": 8,
                           "sequence_parallel": True}}
    assert refused(doc).keys == ["parallelism.expert_parallel"]
    auto = {"parallelism": {"data_parallel_shard": -1, "tensor_parallel": 2, "expert_parallel": 4,
                            "sequence_parallel": True}}
    assert plan(auto, world_size=8).expert_data_parallel == 2  # dp 4 x tp 2 / ep 4
    with pytest.raises(msp.ConfigError, match="parallelism.expert_parallel"):
        plan(auto, world_size=2)  # dp taken from the world size: 1 x 2 does not fold ep 4
    err = refused(mutate(MCORE, "model_config", num_experts=6, moe_router_load_balancing_type="x"))
    assert len(err.issues) == 2  # every problem at once


# --- plan: sizes, notes, summary, memory ----------------------------------------------------------------------------

def test_plan_records_ep_edp_and_describes_moe():
    p = plan(MCORE)
    assert p.moe == load(MCORE).moe and (p.expert_parallel, p.expert_data_parallel) == (4, 1)
    d = p.as_dict()
    assert d["expert_data_parallel"] == 1 and d["moe"]["num_experts"] == 8 and d["moe"]["source"] == "model_config"
    text = " ".join(p.notes)
    assert "not built" not in text and "edp = dp x cp x tp / ep = 2x1x2/4 = 1" in text
    assert "dropless" in text and "global batch" in text
    assert "ep 4, edp 1" in p.summary()
    legacy = " ".join(plan(LEGACY).notes)
    assert "capacity factor 1.1" in legacy and "splits each expert over model_parallel=2" in legacy
    assert "expert_parallel: 8 holds as few as MindFormers" in legacy


def test_memory_counts_experts_by_hand():
    doc = mutate(MCORE, "model_config", first_k_dense_replace=1, n_shared_experts=1)
    m = plan(doc).memory
    h, ffn, kv = 64, 128, 32
    attention = 2 * h * h + 2 * h * kv + 2 * h
    dense = (attention + 3 * h * ffn) // 2  # tp 2
    moe = (attention + 3 * h * 32) // 2 + 8 * h  # shared expert split over tp, router replicated
    experts = 3 * (8 // 4) * 3 * h * 32  # three MoE layers x 2 local experts
    embed = 2 * 256 * h + h  # embedding + head + final norm, pp 1, vocab_emb_dp
    assert m.expert_params_per_rank == experts and m.params_per_rank == dense + 3 * moe + embed + experts
    zero = mutate(doc, "parallel_config", data_parallel=4, expert_parallel=2)
    zero["parallel"] = {"enable_parallel_optimizer": True}
    p = plan(zero)
    assert p.expert_data_parallel == 4 and p.memory.expert_params_per_rank == 2 * experts
    want = 12 * ((p.memory.params_per_rank - 2 * experts) / 4 + 2 * experts / 4) / (1 << 30)  # ZeRO-1 over dp, edp
    assert p.memory.optimizer_gib == pytest.approx(want)
    dense_doc = copy.deepcopy(MCORE)
    dense_doc["model"]["model_config"] = dict(SHAPE)
    assert plan(dense_doc).memory.expert_params_per_rank == 0


def test_memory_shrinks_with_more_expert_parallel():
    totals = [plan(mutate(MCORE, "parallel_config", expert_parallel=ep)).memory.total_gib for ep in (1, 2, 4)]
    assert totals[0] > totals[1] > totals[2]


# --- the real configs with expert_parallel > 1 ------------------------------------------------------------------

def _valid_eps(doc):
    out = []
    for ep in range(1, 257):
        try:
            out.append((ep, plan(mutate(doc, "parallel_config", expert_parallel=ep))))
        except msp.ConfigError:
            continue
    return out


@needs_shared
@pytest.mark.parametrize("path", EP_FILES, ids=lambda p: p.stem)
def test_real_configs_with_expert_parallel_plan_with_experts(path):
    doc = yaml.safe_load(path.read_text())
    if path.stem == "deepseek2__finetune_deepseek2_236B":  # mp 8 without SP: MindFormers >= 1.6 refuses it
        assert refused(doc).keys == ["parallel_config.use_seq_parallel"]
        doc["parallel_config"]["use_seq_parallel"] = True
    p = plan(doc)
    assert p.moe is not None and p.moe.num_experts and p.expert_parallel > 1
    assert p.memory is not None and p.memory.expert_params_per_rank > 0
    assert p.expert_data_parallel * p.expert_parallel == p.mesh.dp * p.mesh.cp * p.mesh.tp
    without = copy.deepcopy(doc)  # the same strategy with no MoE keys: the dense estimate of before
    without.pop("moe_config", None)
    for k in [k for k in without["model"]["model_config"] if k.startswith("moe_") or k in ("num_experts",)]:
        without["model"]["model_config"].pop(k)
    assert plan(without).memory.total_gib < p.memory.total_gib
    eps = _valid_eps(doc)
    assert p.expert_parallel in [ep for ep, _ in eps]
    totals = [q.memory.total_gib for _, q in eps]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == len(totals)


@needs_shared
def test_deepseek_v3_counts_its_experts():
    p = plan(yaml.safe_load((SHARED / "deepseek3__pretrain_deepseek3_671b.yaml").read_text()))
    # 61 + 1 MTP layers over 16 stages ([4]*15 + [2]); the first 3 are dense, so stage 1 holds 4 MoE layers
    assert p.memory.expert_params_per_rank == 4 * (256 // 8) * 3 * 7168 * 2048
    assert (p.moe.capacity_factor, p.moe.first_k_dense_replace, p.expert_data_parallel) == (None, 3, 8)
    # was 5.1 GiB before experts were counted; 32.5 before the pipeline engine's flat copy of the expert gradients at
    # their all-reduce (10.5 GiB, after the activations are freed), three fp32 logits-sized tensors and the stages'
    # receive buffers were counted (benchmarks/memory.py measures each of them); 41.7 until that all-reduce went by
    # buckets of reduce_bucket_size elements (the dense parameters / gradient_aggregation_group 4): now its copy is
    # one bucket and the activations' moment is the peak; below the YAML's 55GB device memory
    m = p.memory
    assert m.grad_sync_gib == p.zero.reduce_bucket_size * 2 / 2**30 < 0.5
    assert m.total_gib == pytest.approx(m.weights_gib + m.grads_gib + m.optimizer_gib + m.activations_gib
                                        + m.logits_gib + m.buffers_gib)
    assert 30 < m.total_gib < 40


@needs_shared
def test_cli_plan_shows_ep_and_edp(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cli.main(["plan", str(SHARED / "qwen3_moe__pretrain_qwen3_30b_a3b_4k.yaml")]) == 0
    out = capsys.readouterr().out
    assert "ep 4, edp 1" in out and "routed experts" in out


# --- check_model: the YAML against the HF model ---------------------------------------------------------------------

def _hf():
    from transformers import LlamaConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    return {"qwen3": Qwen3MoeConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
            "mixtral": MixtralConfig(num_local_experts=8, num_experts_per_tok=2),
            "qwen2": Qwen2MoeConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48),
            "llama": LlamaConfig()}


def test_check_model_accepts_a_matching_model():
    hf = _hf()
    check_model(load(MCORE).moe, hf["qwen3"], 4)
    check_model(load(LEGACY).moe, hf["mixtral"], 4)  # num_local_experts
    check_model(None, hf["mixtral"], 8)  # no MoE keys: only the ep checks
    check_model(None, hf["llama"], 1)


@pytest.mark.parametrize("settings_doc, model, ep, key, text", [
    (mutate(MCORE, "model_config", num_experts=16), "qwen3", 4, "model.model_config.num_experts", "= 8"),
    (mutate(MCORE, "model_config", num_experts=None, n_routed_experts=16), "qwen3", 4,
     "model.model_config.n_routed_experts", "= 8"),
    (mutate(LEGACY, "moe_config", num_experts_chosen=None), "mixtral", 4, "moe_config.num_experts_chosen",
     "num_experts_per_tok = 2"),  # MindFormers' top-1 default vs Mixtral's top-2
    (mutate(LEGACY, "moe_config", expert_num=16), "mixtral", 4, "moe_config.expert_num", "= 8"),
    (MCORE, "qwen2", 4, "model.model_config.moe_intermediate_size", "moe_intermediate_size = 48"),
    (None, "mixtral", 16, "parallel_config.expert_parallel", "8 routed experts"),
    (None, "qwen3", 3, "parallel_config.expert_parallel", "must divide"),
    (None, "llama", 2, "parallel_config.expert_parallel", "no experts"),
])
def test_check_model_names_the_key(settings_doc, model, ep, key, text):
    settings = load(settings_doc).moe if settings_doc is not None else None
    with pytest.raises(msp.ConfigError) as info:
        check_model(settings, _hf()[model], ep)
    assert info.value.keys == [key] and text in str(info.value), str(info.value)


def test_check_model_dense_hf_with_moe_yaml():
    with pytest.raises(msp.ConfigError) as info:
        check_model(load(LEGACY).moe, _hf()["llama"], 4)
    assert info.value.keys == ["parallel_config.expert_parallel", "moe_config.expert_num"]
