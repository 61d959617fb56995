"""Every real MindFormers YAML in ../shared/mindformers-configs plans or is rejected naming a key; spot checks
of MindFormers' own numbers."""
import json
import warnings
from pathlib import Path

import pytest

import msparallel_ds as msp
from msparallel_ds.config import ConfigWarning

SHARED = Path(__file__).resolve().parents[2] / "shared" / "mindformers-configs"
FILES = sorted(SHARED.glob("*.yaml")) if SHARED.is_dir() else []
needs_shared = pytest.mark.skipif(not FILES, reason=f"{SHARED} is absent (it ships beside the repo in CI only)")


def plan(name, world_size=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return msp.make_plan(msp.load_config(SHARED / name), world_size=world_size)


@needs_shared
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_every_real_config_plans_or_names_a_key(path):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p = msp.make_plan(msp.load_config(path))
    except msp.ConfigError as exc:
        assert exc.issues and all(i.key and "." in i.key for i in exc.issues), str(exc)
        return
    d = json.loads(p.to_json())
    m = d["mesh"]
    assert d["world_size"] == m["pp"] * m["dp"] * m["cp"] * m["tp"]
    assert m["cp"] == m["cp_ring"] * m["cp_ulysses"]
    assert p.summary()
    assert p.to_deepspeed()["zero_optimization"]["stage"] == d["zero_stage"]


@needs_shared
def test_llama3_1_70b_finetune():
    p = plan("llama3_1__finetune_llama3_1_70b.yaml")
    assert (p.mesh.dp, p.mesh.tp, p.mesh.pp, p.mesh.cp) == (1, 8, 8, 1)
    assert p.fine_grain_interleave == 2 and p.sequence_parallel and p.micro_batch_num == 256
    assert p.global_batch_size == 256 and p.world_size == 64 and p.zero_stage == 1
    assert p.vocab_parallel and p.pp_schedule == "1f1b" and p.layers_per_stage == [[10] * 8]
    assert p.compute_dtype == "bf16" and p.gradient_clipping == 1.0


@needs_shared
def test_qwen2_5_14b_128k_ring():
    p = plan("qwen2_5__finetune_qwen25_14b_128k.yaml")
    assert p.mesh.cp == 16 and p.mesh.cp_ring == 16 and p.cp_algo == "ring"
    assert (p.mesh.dp, p.mesh.tp, p.mesh.pp) == (1, 2, 2) and p.world_size == 64
    assert p.global_batch_size == 64 and p.recompute.mode == "full"


@needs_shared
def test_qwen2_7b_interleave_two_copies():
    p = plan("qwen2__finetune_qwen2_7b.yaml")
    assert p.micro_batch_interleave_num == 2 and p.global_batch_size == 1 * 2 * 2
    assert (p.mesh.dp, p.mesh.tp) == (2, 4) and p.sequence_parallel


@needs_shared
def test_gradient_accumulation_and_offsets():
    p = plan("qwen2_5__finetune_qwen2_5_0_5b_8k.yaml")  # pp=1: bs 1 x dp 8 x mbi 1 x gas 8
    assert p.global_batch_size == 64 and p.gradient_accumulation_steps == 8
    p = plan("yi__pretrain_yi_34b.yaml")  # 60 layers, pp 4, offset [-1, 1, 1, -1]
    assert p.layers_per_stage == [[14, 16, 16, 14]] and p.global_batch_size == 56
    p = plan("deepseek3__finetune_deepseek3_671b.yaml")  # 61 layers + 1 MTP over 16 stages
    assert p.layers_per_stage == [[4] * 15 + [2]] and p.global_batch_size == 16 * 32


@needs_shared
def test_pipeline_interleave_and_hpz_note():
    p = plan("telechat2__finetune_telechat_115b.yaml")
    assert p.pp_schedule == "interleaved_1f1b" and p.pp_virtual_stages == 3
    assert [sum(r) for r in p.layers_per_stage] == [30, 31, 35]
    p = plan("telechat2__finetune_telechat_39b_a12b.yaml")
    assert p.zero_stage == 1 and any("optimizer_weight_shard_size=2" in n for n in p.notes)


@needs_shared
def test_seq_schedulers_plan_as_1f1b_with_a_warning():
    with pytest.warns(ConfigWarning, match="pipeline_scheduler=seqpipe: the sequence-chunked pipeline"):
        msp.load_config(SHARED / "qwen2_5__finetune_qwen2.5_72B_32K.yaml")  # seqpipe, seq_split_num 8
    assert plan("qwen2_5__finetune_qwen2.5_72B_32K.yaml").pp_schedule == "1f1b"
    assert plan("telechat3__finetune_telechat3_36b.yaml").pp_schedule == "interleaved_1f1b"  # seqpipe, vpp 2


@needs_shared
def test_world_size_checked_against_real_config():
    assert plan("llama2__pretrain_llama2_70b.yaml", 64).world_size == 64
    with pytest.raises(msp.ConfigError, match="2x4x1x8 = 64"):
        plan("llama2__pretrain_llama2_70b.yaml", 32)
