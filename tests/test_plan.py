"""Plan derivations: mesh in DESIGN.md's rank order, batch math, ZeRO, schedules, recompute, memory."""
import pytest

import msparallel_ds as msp
from msparallel_ds.memory import GIB

SHAPE = {"num_layers": 8, "num_heads": 8, "n_kv_heads": 4, "hidden_size": 64, "seq_length": 128,
         "vocab_size": 256, "use_flash_attention": True}


def plan(pc=None, model=None, world_size=None, **top):
    d = {"parallel_config": pc or {}, "model": {"model_config": {**SHAPE, **(model or {})}}}
    d.update(top)
    return msp.make_plan(d, world_size=world_size)


@pytest.mark.parametrize("algo,ring_attn,u,expect", [
    ("colossalai_cp", False, 1, ("allgather", 4, 1)),
    ("colossalai_cp", True, 1, ("ring", 4, 1)),
    ("ulysses_cp", False, 1, ("ulysses", 1, 4)),
    ("hybrid_cp", False, 2, ("hybrid", 2, 2)),
])
def test_cp_algorithm_and_mesh_split(algo, ring_attn, u, expect):
    p = plan({"context_parallel": 4, "context_parallel_algo": algo, "ulysses_degree_in_cp": u},
             {"use_ring_attention": ring_attn, "num_heads": 16, "n_kv_heads": 8})
    assert (p.cp_algo, p.mesh.cp_ring, p.mesh.cp_ulysses) == expect
    assert p.mesh.shape == (1, 1, expect[1], expect[2], 1)


def test_no_cp_means_no_algorithm():
    assert plan().cp_algo is None


@pytest.mark.parametrize("pc,top,gbs,mbn,gas", [
    ({"data_parallel": 2, "pipeline_stage": 2, "micro_batch_num": 4}, {"runner_config": {"batch_size": 3,
      "gradient_accumulation_steps": 5}}, 3 * 2 * 4 * 1, 4, 1),
    ({"data_parallel": 2}, {"runner_config": {"batch_size": 3, "gradient_accumulation_steps": 5},
                            "micro_batch_interleave_num": 2}, 3 * 2 * 2 * 5, 1, 5),
    ({"data_parallel": 4, "pipeline_stage": 2, "micro_batch_num": 8}, {"micro_batch_interleave_num": 2},
     1 * 4 * 8 * 2, 8, 1),
    ({"data_parallel": 2, "model_parallel": 2, "context_parallel": 2}, {"runner_config": {"batch_size": 2}},
     2 * 2, 1, 1),  # tp and cp ranks share samples
])
def test_global_batch_follows_mindformers(pc, top, gbs, mbn, gas):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = plan(pc, **top)
    assert (p.global_batch_size, p.micro_batch_num, p.gradient_accumulation_steps) == (gbs, mbn, gas)
    ds = p.to_deepspeed()
    assert ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * p.mesh.dp == gbs
    assert "train_batch_size" not in ds  # our mpu supplies dp


@pytest.mark.parametrize("par,stage", [
    ({}, 0),
    ({"enable_parallel_optimizer": True}, 1),
    ({"enable_parallel_optimizer": True, "parallel_optimizer_config": {"optimizer_level": "level2"}}, 2),
    ({"enable_parallel_optimizer": True, "parallel_optimizer_config": {"gradient_accumulation_shard": True}}, 2),
    ({"enable_parallel_optimizer": True, "parallel_optimizer_config": {"optimizer_level": "level3"}}, 3),
    ({"enable_parallel_optimizer": False, "parallel_optimizer_config": {"optimizer_level": "level3"}}, 0),
])
def test_zero_stage_from_optimizer_parallel(par, stage):
    p = plan({"data_parallel": 2, "context_parallel": 2}, parallel=par)
    assert p.zero_stage == stage and p.zero.group_size == 4


def test_hpz_only_at_zero3_and_threshold():
    par = {"enable_parallel_optimizer": True,
           "parallel_optimizer_config": {"optimizer_level": "level3", "optimizer_weight_shard_size": 2,
                                         "parallel_optimizer_threshold": 64}}
    p = plan({"data_parallel": 8}, parallel=par)
    z = p.to_deepspeed()["zero_optimization"]
    assert z["zero_hpz_partition_size"] == 2 and z["stage3_param_persistence_threshold"] == 64 * 1024 // 4


def test_reduce_bucket_from_gradient_aggregation_group():
    p4 = plan({"gradient_aggregation_group": 4}, parallel={"enable_parallel_optimizer": True})
    p8 = plan({"gradient_aggregation_group": 8}, parallel={"enable_parallel_optimizer": True})
    assert p4.zero.reduce_bucket_size >= p8.zero.reduce_bucket_size >= 1_000_000


@pytest.mark.parametrize("sched,vpp,expect", [
    ("1f1b", 1, "1f1b"), ("1f1b", 2, "interleaved_1f1b"), ("gpipe", 1, "gpipe"), ("zero_bubble_v", 2, "zero_bubble_v"),
])
def test_pipeline_schedule(sched, vpp, expect):
    par = {"pipeline_config": {"pipeline_scheduler": sched, "pipeline_interleave": vpp > 1}}
    p = plan({"pipeline_stage": 2, "micro_batch_num": 4}, {"pp_interleave_num": vpp}, parallel=par)
    assert p.pp_schedule == expect and p.pp_virtual_stages == vpp


def test_recompute_plans():
    pc = {"pipeline_stage": 2, "micro_batch_num": 2}
    assert plan(pc, recompute_config={"recompute": True}).recompute.mode == "full"
    r = plan(pc, recompute_config={"recompute": [3, 1]}).recompute
    assert r.mode == "layers" and r.layers == [[3, 1]]
    r = plan(pc, recompute_config={"select_recompute": True}).recompute
    assert r.mode == "select" and set(r.select) == {r"feed_forward\.mul", r"feed_forward\.w1\.activation\.silu"}
    r = plan(pc, recompute_config={"select_recompute": {r"mlp\.act": [2, 0]}, "select_comm_recompute": True}).recompute
    assert r.select == {r"mlp\.act": [[2, 0]]} and r.select_comm == {r".*\.norm": "all"}
    r = plan(pc, recompute_config={"select_recompute": ["a\\.b"]}).recompute
    assert r.select == {"a\\.b": "all"}
    assert plan(pc).recompute.mode == "none"


def test_recompute_counts_spread_over_virtual_chunks():
    par = {"pipeline_config": {"pipeline_interleave": True}}
    r = plan({"pipeline_stage": 2, "micro_batch_num": 2}, {"pp_interleave_num": 2},
             parallel=par, recompute_config={"recompute": [3, 1]}).recompute
    assert r.layers == [[2, 1], [1, 0]]


def test_precision_loss_scale_and_clipping():
    rw = {"scale_sense": {"type": "DynamicLossScaleUpdateCell", "loss_scale_value": 65536, "scale_factor": 2,
                          "scale_window": 1000}, "use_clip_grad": True, "max_grad_norm": 0.5}
    p = plan(model={"compute_dtype": "float16"}, runner_wrapper=rw)
    assert (p.loss_scale.kind, p.loss_scale.initial, p.gradient_clipping) == ("dynamic", 65536, 0.5)
    ds = p.to_deepspeed()
    assert ds["fp16"]["loss_scale"] == 0 and ds["fp16"]["initial_scale_power"] == 16
    p = plan(model={"compute_dtype": "bfloat16"}, runner_wrapper=rw)
    assert p.loss_scale.kind is None and "bf16" in p.to_deepspeed() and p.notes
    p = plan(model={"compute_dtype": "float16"}, runner_wrapper={"scale_sense": 1024})
    assert p.to_deepspeed()["fp16"]["loss_scale"] == 1024 and p.to_deepspeed()["gradient_clipping"] == 0.0


def test_memory_estimate_by_hand():
    # 8 layers, h=64, 8 heads (head_dim 8), 4 kv heads, ffn = 256*ceil(8*64/3/256) = 256, V=256, s=128, b=1, fp16
    p = plan(model={"compute_dtype": "float16"})
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 256 + 2 * 64
    params = 8 * per_layer + 2 * 256 * 64 + 64  # embedding, head and the final norm
    m = p.memory
    assert m.params_per_rank == params
    assert m.weights_gib == pytest.approx(params * 2 / GIB) and m.optimizer_gib == pytest.approx(params * 12 / GIB)
    # what a HF Llama layer saves per token, fp16 (n = 2): two norms' fp32 input + normalized x (64 x (4 + n)
    # each), their outputs (64 x n each), q, k, v, attention output (2*64 + 2*32) and SwiGLU's 4 x 256, n bytes each;
    # checked against measured tensor peaks in benchmarks/memory.py (was Korthikanti's GPT formula, 34 s*b*h)
    act = 8 * 128 * (2 * 64 * (4 + 2) + 2 * 64 * 2 + (2 * 64 + 2 * 32 + 4 * 256) * 2)
    assert m.activations_gib == pytest.approx(act / GIB)


def test_memory_responds_to_parallelism():
    base = plan({"data_parallel": 4}).memory
    z1 = plan({"data_parallel": 4}, parallel={"enable_parallel_optimizer": True}).memory
    assert z1.optimizer_gib == pytest.approx(base.optimizer_gib / 4) and z1.grads_gib == base.grads_gib
    tp = plan({"model_parallel": 2, "use_seq_parallel": True}).memory
    assert tp.weights_gib < base.weights_gib and tp.activations_gib < base.activations_gib
    rc = plan(recompute_config={"recompute": True}).memory
    assert rc.activations_gib < rc.activations_no_recompute_gib == base.activations_gib
    cp = plan({"context_parallel": 2}).memory
    assert cp.activations_gib == pytest.approx(base.activations_gib / 2)
    assert plan(model={"num_layers": None}).memory is None


def test_parallelism_schema():
    d = {"parallelism": {"data_parallel_shard": 2, "tensor_parallel": 2, "context_parallel": 2,
                         "context_parallel_method": "hybrid", "ulysses_degree_in_cp": 2, "pipeline_parallel": 2,
                         "pipeline_parallel_interleave_num": 2, "pipeline_parallel_schedule": "interleaved_1f1b",
                         "sequence_parallel": True, "micro_batch_num": 4},
         "model": {"model_config": SHAPE}}
    p = msp.make_plan(d)
    assert p.mesh.shape == (2, 2, 1, 2, 2) and p.cp_algo == "hybrid" and p.sequence_parallel
    assert p.pp_schedule == "interleaved_1f1b" and p.pp_virtual_stages == 2 and p.zero_stage == 3
    auto = msp.make_plan({"parallelism": {"tensor_parallel": 2}}, world_size=8)
    assert auto.mesh.dp == 4 and auto.world_size == 8
    with pytest.raises(msp.ConfigError) as ei:
        msp.load_config({"parallelism": {"tensor_parallel": 2, "context_parallel_method": "bogus"}})
    assert "parallelism.context_parallel_method" in ei.value.keys
    # MindFormers 2.1 (pynative trainer _compute_data_parallel_size): data_parallel = world // (tp x cp x pp) = 4;
    # data_parallel_shard 2 shards over 2 and replicates over 4 // 2 (HSDP: ZeRO-3 with a 2-rank sub-group)
    hsdp = msp.make_plan({"parallelism": {"data_parallel_shard": 2, "tensor_parallel": 2}}, world_size=8)
    assert hsdp.mesh.dp == 4 and hsdp.zero.stage == 3 and hsdp.zero.hpz_partition_size == 2
    with pytest.raises(msp.ConfigError) as ei:
        msp.make_plan({"parallelism": {"data_parallel_shard": 2, "tensor_parallel": 2}}, world_size=7)
    assert "parallelism.data_parallel_shard" in str(ei.value)


def test_plan_json_keys():
    d = plan({"model_parallel": 2, "use_seq_parallel": True}).as_dict()
    for k in ("world_size", "mesh", "global_batch_size", "micro_batch_size", "gradient_accumulation_steps",
              "micro_batch_num", "micro_batch_interleave_num", "fine_grain_interleave", "zero_stage", "cp_algo",
              "sequence_parallel", "vocab_parallel", "pp_schedule", "pp_virtual_stages", "recompute", "memory"):
        assert k in d
    assert set(d["mesh"]) == {"pp", "dp", "cp", "cp_ring", "cp_ulysses", "tp"}


def test_activation_swap_from_swap_config_and_mcore_cpu_offloading():
    """swap_config.layer_swap (MindFormers tools/check_rules.py _check_swap) and mcore's cpu_offloading +
    cpu_offloading_num_layers (layer_swap's format) give the layers whose activations stay on the host."""
    import msparallel_ds as msp

    def plan(d):
        return msp.make_plan(msp.load_config(d))

    swap = {"swap": True, "layer_swap": [{"layers": [2, 0], "backward_prefetch": 1}, {"layers": [2]}]}
    assert plan({"swap_config": swap}).activation_offload == (0, 2)
    assert plan({"swap_config": {**swap, "layer_swap": [{"layers": True}]}}).as_dict()["activation_offload"] == "all"
    assert plan({"swap_config": {**swap, "swap": False}}).activation_offload is None
    mcore = {"model": {"model_config": {"cpu_offloading": True, "cpu_offloading_num_layers": [{"layers": [1]}]}}}
    assert plan(mcore).as_dict()["activation_offload"] == [1]
    with_ops = plan({"swap_config": {**swap, "op_swap": {"attention": []}}})
    assert any("op_swap" in n for n in with_ops.notes)
    with pytest.raises(msp.ConfigError, match="swap_config.default_prefetch"):
        msp.load_config({"swap_config": {"swap": True, "default_prefetch": 0}})


def test_plan_says_why_it_has_no_memory_estimate():
    import msparallel_ds as msp

    plan = msp.make_plan(msp.load_config({"pretrained_model_dir": "/models/Qwen3-32B",
                                          "model": {"model_config": {"num_layers": 4}}}))
    assert plan.memory is None
    note = next(n for n in plan.notes if n.startswith("no memory estimate"))
    assert "num_heads, hidden_size, vocab_size, seq_length" in note and "'/models/Qwen3-32B'" in note
    assert "lacks num_layers" in next(n for n in msp.make_plan(msp.load_config({})).notes if "lacks" in n)


def test_swap_config_rules_follow_mindformers():
    """tools/check_rules.py (mindformers 2.1.0): default_prefetch >= 1 only when swap is on (l.353-368); with swap
    on the recompute lists lose their length <= pipeline_stage limit (l.316-325); layer_swap layers may be nested."""
    import msparallel_ds as msp

    off = msp.load_config({"swap_config": {"swap": False, "default_prefetch": 0}})
    assert msp.make_plan(off).activation_offload is None
    with pytest.raises(msp.ConfigError, match="swap_config.default_prefetch"):
        msp.load_config({"swap_config": {"swap": True, "default_prefetch": 0}})
    long_list = {"recompute_config": {"recompute": [1, 1, 1]}}
    with pytest.raises(msp.ConfigError, match="recompute_config.recompute"):
        msp.load_config(long_list)
    swap = {"swap": True, "layer_swap": [{"layers": [[0, 1], [3]]}]}
    assert msp.make_plan(msp.load_config({**long_list, "swap_config": swap})).activation_offload == (0, 1, 3)
