"""Every MindFormers rule (and ours) gives one clear ConfigError issue naming key, value, rule and fix."""
import warnings

import pytest

import msparallel_ds as msp
from msparallel_ds.config import ConfigWarning

SHAPE = {"num_layers": 8, "num_heads": 8, "n_kv_heads": 4, "hidden_size": 64, "seq_length": 128,
         "vocab_size": 256, "use_flash_attention": True}


def cfg(pc=None, model=None, **top):
    d = {"parallel_config": pc or {}, "model": {"model_config": {**SHAPE, **(model or {})}}}
    d.update(top)
    return d


def issue(d, key):
    with pytest.raises(msp.ConfigError) as ei:
        msp.make_plan(msp.load_config(d))
    err = ei.value
    hits = [i for i in err.issues if i.key == key]
    assert hits, f"no issue for {key}: {err}"
    text = str(hits[0])
    assert key in text and hits[0].fix, text
    return hits[0], err


def test_world_size_must_equal_product_of_degrees():
    c = msp.load_config(cfg({"data_parallel": 2, "model_parallel": 2, "pipeline_stage": 2, "micro_batch_num": 2}))
    assert msp.make_plan(c, world_size=8).world_size == 8
    with pytest.raises(msp.ConfigError) as ei:
        msp.make_plan(c, world_size=6)
    msg = str(ei.value)
    assert "2x2x1x2 = 8" in msg and "data_parallel" in msg and "pipeline_stage" in msg


def test_hybrid_ulysses_degree_must_divide_cp():
    i, _ = issue(cfg({"context_parallel": 4, "context_parallel_algo": "hybrid_cp", "ulysses_degree_in_cp": 3}),
                 "parallel_config.ulysses_degree_in_cp")
    assert "must divide parallel_config.context_parallel=4" in str(i) and "[1, 2, 4]" in i.fix


def test_hybird_spelling_is_accepted_as_hybrid():
    p = msp.make_plan(cfg({"context_parallel": 4, "context_parallel_algo": "hybird_cp", "ulysses_degree_in_cp": 2}))
    assert p.cp_algo == "hybrid" and (p.mesh.cp_ring, p.mesh.cp_ulysses) == (2, 2)


def test_unknown_parallel_config_key_suggests_closest():
    i, _ = issue(cfg({"data_paralel": 2}), "parallel_config.data_paralel")
    assert "data_parallel" in i.fix


def test_optimizer_shard_is_deprecated_with_warning():
    with pytest.warns(ConfigWarning, match="optimizer_shard"):
        msp.load_config(cfg({"optimizer_shard": True}))


def test_ulysses_kv_heads_split_or_replicated():
    i, _ = issue(cfg({"context_parallel": 3, "model_parallel": 2, "context_parallel_algo": "ulysses_cp"},
                     model={"num_heads": 12}), "model.model_config.n_kv_heads")
    assert "model_parallel=2 x ulysses degree 3 = 6: neither divides the other" in str(i)


@pytest.mark.parametrize("pc", [
    {"model_parallel": 8},
    {"context_parallel": 4, "context_parallel_algo": "ulysses_cp", "model_parallel": 2},
    {"context_parallel": 4, "context_parallel_algo": "hybrid_cp", "ulysses_degree_in_cp": 4, "model_parallel": 2},
])
def test_kv_heads_fewer_than_shards_are_replicated_with_a_warning(pc):
    """MindFormers refuses n_kv_heads % (mp x ulysses) != 0; we replicate kv heads (shards % kv == 0), and say so."""
    with pytest.warns(ConfigWarning, match="n_kv_heads=4 is not divisible.*= 8.*replicated 2x"):
        msp.load_config(cfg(pc))


@pytest.mark.parametrize("pc,model,key", [
    ({"model_parallel": 3}, {}, "model.model_config.num_heads"),
    ({"model_parallel": 4}, {"num_heads": 12, "n_kv_heads": 6}, "model.model_config.n_kv_heads"),
])
def test_heads_must_divide_over_mp_times_ulysses(pc, model, key):
    issue(cfg(pc, model=model), key)


def test_gqa_heads_must_divide():
    issue(cfg(model={"num_heads": 8, "n_kv_heads": 3}), "model.model_config.n_kv_heads")


def test_fine_grain_interleave_needs_sp_or_cp():
    i, _ = issue(cfg({"model_parallel": 2}, {"fine_grain_interleave": 2}), "model.model_config.fine_grain_interleave")
    assert "use_seq_parallel" in i.fix
    assert msp.make_plan(cfg({"model_parallel": 2, "use_seq_parallel": True},
                             {"fine_grain_interleave": 2})).fine_grain_interleave == 2
    assert msp.make_plan(cfg({"model_parallel": 2, "context_parallel": 2},
                             {"fine_grain_interleave": 2})).fine_grain_interleave == 2


def test_fine_grain_interleave_inert_without_mp():
    with pytest.warns(ConfigWarning, match="only acts with model_parallel > 1"):
        p = msp.make_plan(cfg({"use_seq_parallel": True}, {"fine_grain_interleave": 2}))
    assert p.fine_grain_interleave == 1


def test_vocab_emb_dp_forced_false_with_pipeline():
    with pytest.warns(ConfigWarning, match="vocab_emb_dp"):
        p = msp.make_plan(cfg({"model_parallel": 2, "pipeline_stage": 2, "micro_batch_num": 2, "vocab_emb_dp": True}))
    assert p.vocab_parallel
    assert not msp.make_plan(cfg({"model_parallel": 2, "vocab_emb_dp": True})).vocab_parallel
    assert msp.make_plan(cfg({"model_parallel": 2, "vocab_emb_dp": False})).vocab_parallel


def test_micro_batch_num_at_least_pipeline_stage():
    i, _ = issue(cfg({"pipeline_stage": 4, "micro_batch_num": 2}), "parallel_config.micro_batch_num")
    assert ">= parallel_config.pipeline_stage=4" in str(i)
    # ignored without a pipeline
    assert msp.make_plan(cfg({"micro_batch_num": 1})).micro_batch_num == 1


def test_num_layers_at_least_pipeline_stage():
    issue(cfg({"pipeline_stage": 4, "micro_batch_num": 4}, {"num_layers": 3, "offset": [0, 0, 0, 3]}),
          "model.model_config.num_layers")


def test_recompute_list_longer_than_pp():
    d = cfg({"pipeline_stage": 2, "micro_batch_num": 2}, recompute_config={"recompute": [1, 1, 1]})
    i, _ = issue(d, "recompute_config.recompute")
    assert "only 2 pipeline stages" in str(i)
    d = cfg({"pipeline_stage": 2, "micro_batch_num": 2},
            recompute_config={"select_recompute": {r"feed_forward\.mul": [1, 1, 1]}})
    issue(d, r"recompute_config.select_recompute['feed_forward\\.mul']")


@pytest.mark.parametrize("offset,fragment", [
    ([1, 0], None),
    ([0, 0, 1], "one value per pipeline stage (2)"),
    ([1, -1], "must sum to num_layers % (pipeline_stage x pp_interleave_num) = 9 % 2 = 1, but sums to 0"),
    ([-5, 6], "leaves a stage without layers"),
])
def test_offset_rules(offset, fragment):
    d = cfg({"pipeline_stage": 2, "micro_batch_num": 2}, {"num_layers": 9, "offset": offset})
    if fragment is None:
        assert msp.make_plan(d).layers_per_stage == [[5, 4]]
        return
    i, _ = issue(d, "model.model_config.offset")
    assert fragment in str(i)


def test_offset_per_virtual_chunk():
    par = {"pipeline_config": {"pipeline_interleave": True}}
    d = cfg({"pipeline_stage": 2, "micro_batch_num": 4}, {"num_layers": 10, "pp_interleave_num": 2,
                                                          "offset": [[1, 0], [0, 1]]}, parallel=par)
    p = msp.make_plan(d)
    assert p.layers_per_stage == [[3, 2], [2, 3]] and p.pp_schedule == "interleaved_1f1b"
    assert p.pp_virtual_stages == 2
    # MindFormers sums a flat list (2 == 10 % 4) but then applies it to both chunks: 12 layers, not 10
    d["model"]["model_config"]["offset"] = [1, 1]
    i, _ = issue(d, "model.model_config.offset")
    assert "gives 12 layers in total, not 10" in str(i)


def test_context_parallel_needs_flash_attention_when_switched_off():
    i, _ = issue(cfg({"context_parallel": 2}, {"use_flash_attention": False}), "model.model_config.use_flash_attention")
    assert "true" in i.fix


@pytest.mark.parametrize("pc,seq,fragment", [
    ({"context_parallel": 4, "context_parallel_algo": "colossalai_cp"}, 100, "divisible by 8"),
    ({"context_parallel": 4, "context_parallel_algo": "ulysses_cp"}, 102, "divisible by 4"),
    ({"model_parallel": 4, "use_seq_parallel": True}, 102, "for sequence parallel"),
])
def test_sequence_must_split_evenly(pc, seq, fragment):
    model = {"num_heads": 16, "n_kv_heads": 16}
    i, _ = issue(cfg(pc, {**model, "seq_length": seq}), "model.model_config.seq_length")
    assert fragment in str(i)
    msp.make_plan(cfg(pc, {**model, "seq_length": 128}))


def test_seq_schedulers_run_as_1f1b_with_mindformers_constraints_and_zero_bubble_v_shape():
    # seqpipe/seqvpp/seqsmartvpp: the nearest schedule, same math, one warning; MindFormers' own constraints hold
    pp2 = {"pipeline_stage": 2, "micro_batch_num": 2}
    par = {"pipeline_config": {"pipeline_scheduler": "seqpipe"}}
    with pytest.warns(ConfigWarning, match="seqpipe: the sequence-chunked pipeline .* runs 1F1B with the same math"):
        assert msp.make_plan(cfg({**pp2, "seq_split_num": 4}, parallel=par)).pp_schedule == "1f1b"
    vpar = {"pipeline_config": {"pipeline_scheduler": "seqvpp", "pipeline_interleave": True}}
    with pytest.warns(ConfigWarning, match="runs interleaved 1F1B"):
        p = msp.make_plan(cfg({**pp2, "seq_split_num": 2}, {"pp_interleave_num": 2}, parallel=vpar))
    assert p.pp_schedule == "interleaved_1f1b" and p.pp_virtual_stages == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        issue(cfg(pp2, {"pp_interleave_num": 2}, parallel=vpar), "parallel_config.seq_split_num")  # seqvpp: > 1
        issue(cfg(pp2, parallel=par, recompute_config={"recompute": True}), "recompute_config.recompute")
        issue(cfg({**pp2, "seq_split_num": 4}, parallel=par, use_legacy=False), "parallel_config.seq_split_num")
    par = {"pipeline_config": {"pipeline_scheduler": "zero_bubble_v"}}
    issue(cfg({"pipeline_stage": 2, "micro_batch_num": 2}, parallel=par), "parallel.pipeline_config.pipeline_scheduler")
    par = {"pipeline_config": {"pipeline_scheduler": "zero_bubble_v", "pipeline_interleave": True}}
    p = msp.make_plan(cfg({"pipeline_stage": 2, "micro_batch_num": 2}, {"pp_interleave_num": 2}, parallel=par))
    assert p.pp_schedule == "zero_bubble_v" and p.pp_virtual_stages == 2
    # a scheduler without a pipeline is irrelevant
    msp.make_plan(cfg({}, parallel={"pipeline_config": {"pipeline_scheduler": "seqpipe"}}))


def test_optimizer_weight_shard_size_must_divide_group():
    par = {"enable_parallel_optimizer": True, "parallel_optimizer_config": {"optimizer_weight_shard_size": 3}}
    issue(cfg({"data_parallel": 4}, parallel=par), "parallel.parallel_optimizer_config.optimizer_weight_shard_size")


def test_all_problems_are_listed_at_once():
    d = cfg({"context_parallel": 4, "context_parallel_algo": "hybrid_cp", "ulysses_degree_in_cp": 3,
             "pipeline_stage": 4, "micro_batch_num": 1, "model_parallel": 3})
    with pytest.raises(msp.ConfigError) as ei:
        msp.load_config(d)
    keys = set(ei.value.keys)
    assert {"parallel_config.ulysses_degree_in_cp", "parallel_config.micro_batch_num",
            "model.model_config.num_heads"} <= keys
    assert f"{len(ei.value.issues)} problems" in str(ei.value)


def test_type_errors_are_all_reported_with_key_paths():
    d = {"parallel_config": {"data_parallel": "two", "model_parallel": 0, "use_seq_parallel": "yes"},
         "model": {"model_config": {"num_heads": -3}}, "runner_config": {"batch_size": 1.5}}
    with pytest.raises(msp.ConfigError) as ei:
        msp.load_config(d)
    assert {"parallel_config.data_parallel", "parallel_config.model_parallel", "parallel_config.use_seq_parallel",
            "model.model_config.num_heads", "runner_config.batch_size"} <= set(ei.value.keys)


@pytest.mark.parametrize("mode", [0, "data_parallel"])
def test_data_parallel_mode_resets_model_parallel(mode):
    d = cfg({"data_parallel": 2, "model_parallel": 2, "use_seq_parallel": True}, parallel={"parallel_mode": mode})
    with pytest.warns(ConfigWarning, match="resets"):
        c = msp.load_config(d)
    p = msp.make_plan(c, world_size=8)
    assert p.mesh.as_dict() == {"pp": 1, "dp": 8, "cp": 1, "cp_ring": 1, "cp_ulysses": 1, "tp": 1}
    assert not p.sequence_parallel


def test_stand_alone_is_one_device():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        c = msp.load_config(cfg({"data_parallel": 4}, use_parallel=False))
    assert msp.make_plan(c).world_size == 1
    with pytest.raises(msp.ConfigError):
        msp.make_plan(c, world_size=4)


def test_config_is_immutable():
    c = msp.load_config(cfg({"data_parallel": 2}))
    with pytest.raises(Exception):
        c.parallel_config.data_parallel = 4
    assert c.dp == 2


def test_errors_use_the_spelling_the_yaml_used():
    d = {"parallel_config": {"model_parallel": 3},
         "model": {"model_config": {"num_attention_heads": 8, "num_key_value_heads": 4}}}
    with pytest.raises(msp.ConfigError) as ei:
        msp.load_config(d)
    assert ei.value.keys == ["model.model_config.num_attention_heads"]
    with pytest.raises(msp.ConfigError) as ei:
        msp.load_config({"model": {"model_config": {"num_hidden_layers": -1}}})
    assert ei.value.keys == ["model.model_config.num_hidden_layers"]


def test_parallelism_shard_zero_is_rejected():
    with pytest.raises(msp.ConfigError) as ei:
        msp.load_config({"parallelism": {"data_parallel_shard": 0}})
    assert ei.value.keys == ["parallelism.data_parallel_shard"]


def test_one_line_yaml_text_with_slashes_is_text_not_a_path():
    c = msp.load_config("{parallel_config: {data_parallel: 2}, output_dir: ./out/x}")
    assert c.dp == 2


def test_dynamic_loss_scale_matches_mindspore_cell():
    rw = {"scale_sense": {"type": "DynamicLossScaleUpdateCell", "loss_scale_value": 1000, "scale_factor": 4,
                          "scale_window": 50}}
    p = msp.make_plan({"model": {"model_config": {"compute_dtype": "float16"}}, "runner_wrapper": rw})
    fp16 = p.to_deepspeed()["fp16"]
    assert fp16["hysteresis"] == 1 and fp16["loss_scale_window"] == 50 and fp16["initial_scale_power"] == 10
    assert any("scale_factor=4" in n for n in p.notes) and any("2^10" in n for n in p.notes)


# ---------------------------------------------------------------------------------------------- MindFormers 2.1 fidelity
# Sources (mindformers 2.1.0 wheel): tools/utils.py:39-48 and core/context/validators.py:52-60 (parallel_mode
# spellings, MANUAL_PARALLEL = STAND_ALONE); core/parallel_config.py:63-74 (degrees validated as positive ints when
# the parallel config is built, before trainer/base_trainer.py:280-297 resets them), and
# modules/transformer/transformer.py:591-613 (hybrid ulysses rule on the YAML's values);
# parallel_core/training_graph/transformer/utils.py:569-603 (mcore LayerSetting: sum(offset) == num_layers %
# (pp*vpp) with num_layers excluding MTP, head and tail stages may hold 0 layers); MindSpore's optimizer sharding
# (a shard size >= the data-parallel group shards over the whole group).
def test_manual_parallel_runs_as_stand_alone():
    with pytest.warns(ConfigWarning, match="MANUAL_PARALLEL as STAND_ALONE"):
        c = msp.load_config(cfg({"data_parallel": 2, "model_parallel": 2},
                                parallel={"parallel_mode": "MANUAL_PARALLEL"}))
    assert c.parallel.parallel_mode == "stand_alone"
    assert msp.make_plan(c).mesh.as_dict() == {"pp": 1, "dp": 1, "cp": 1, "cp_ring": 1, "cp_ulysses": 1, "tp": 1}
    assert msp.load_config(cfg({}, parallel={"parallel_mode": "SEMI_AUTO_PARALLEL"})).parallel.parallel_mode == \
        "semi_auto_parallel"


def test_reset_modes_still_reject_bad_degrees_and_check_ulysses_first():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        issue(cfg({"data_parallel": -2}, use_parallel=False), "parallel_config.data_parallel")
        issue(cfg({"model_parallel": 1.5}, parallel={"parallel_mode": 0}), "parallel_config.model_parallel")
        issue(cfg({"context_parallel": 4, "context_parallel_algo": "hybrid_cp", "ulysses_degree_in_cp": 3},
                  use_parallel=False), "parallel_config.ulysses_degree_in_cp")
        # a valid hybrid split is reset with the rest and not checked against the reset context_parallel = 1
        c = msp.load_config(cfg({"context_parallel": 4, "context_parallel_algo": "hybrid_cp",
                                 "ulysses_degree_in_cp": 2}, use_parallel=False))
    assert msp.make_plan(c).world_size == 1


def test_optimizer_weight_shard_size_over_the_group_warns_and_shards_the_whole_group():
    par = {"enable_parallel_optimizer": True, "parallel_optimizer_config": {"optimizer_weight_shard_size": 256}}
    with pytest.warns(ConfigWarning, match="optimizer_weight_shard_size=256 is larger than"):
        p = msp.make_plan(msp.load_config(cfg({"data_parallel": 4}, parallel=par)))
    assert p.zero.group_size == 4 and p.zero.hpz_partition_size is None


def test_mcore_offsets_exclude_mtp_and_allow_empty_head_and_tail_stages():
    pp16 = {"pipeline_stage": 16, "micro_batch_num": 16}
    model = {"num_layers": 16, "mtp_depth": 1, "offset": 0}
    p = msp.make_plan(msp.load_config(cfg(pp16, model, use_legacy=False)))  # deepseek3 12b pp16
    assert p.layers_per_stage == [[1] * 16]
    i, _ = issue(cfg(pp16, model), "model.model_config.offset")  # legacy counts the MTP layer
    assert "(num_layers + mtp_depth) % (pipeline_stage x pp_interleave_num)" in str(i)
    pp4 = {"pipeline_stage": 4, "micro_batch_num": 4}
    head_empty = {"num_layers": 6, "offset": [-1, 1, 1, 1]}
    assert msp.make_plan(msp.load_config(cfg(pp4, head_empty, use_legacy=False))).layers_per_stage == [[0, 2, 2, 2]]
    issue(cfg(pp4, head_empty), "model.model_config.offset")
    i, _ = issue(cfg(pp4, {"num_layers": 6, "offset": [1, -1, 1, 1]}, use_legacy=False), "model.model_config.offset")
    assert "middle stage" in str(i)
    i, _ = issue(cfg(pp4, {"num_layers": 16, "mtp_num_layers": 1, "offset": 1}, use_legacy=False),
                 "model.model_config.offset")
    assert "num_layers % " in str(i)


# Sources (mindformers 2.1.0 wheel): core/context/parallel.py:120-150 (STAND_ALONE / MANUAL_PARALLEL with use_parallel:
# initialize_model_parallel(tp=model_parallel, dp, pp, ep, order "tp-ep-pp-dp"), trainer/base_trainer.py:181 (the
# trainer's reset is skipped when RUN_MODE = run_mode is predict), :214 and :280-296 (training outside semi_auto /
# auto parallel: degrees reset to 1, batch_size x gradient_accumulation_steps per card), :320-326 (accumulation
# reset to 1), :544-545 (mcore refuses micro_batch_interleave_num > 1), core/context/parallel.py:49-52
# (auto_pipeline), models/llama/llama.py:117-118 (seq_split_num 1 chunks nothing).
def test_manual_parallel_predict_keeps_the_degrees():
    """predict_deepseek3_671b-style: MANUAL_PARALLEL, use_parallel true, run_mode predict, model_parallel 32: the
    manual groups are real (TP32 on 32 devices, not one device); ep is kept; cp is not one of the manual groups."""
    d = cfg({"data_parallel": 1, "model_parallel": 32, "expert_parallel": 32, "context_parallel": 2,
             "use_seq_parallel": True},
            {"num_heads": 64, "n_kv_heads": 64}, parallel={"parallel_mode": "MANUAL_PARALLEL"}, use_parallel=True,
            run_mode="predict")
    with pytest.warns(ConfigWarning, match="manual groups are initialize_model_parallel.*context_parallel reset"):
        c = msp.load_config(d)
    assert (c.tp, c.dp, c.pp, c.cp, c.ep) == (32, 1, 1, 1, 32)
    assert msp.make_plan(c, world_size=32).world_size == 32
    pp2 = cfg({"data_parallel": 2, "model_parallel": 2, "pipeline_stage": 2, "micro_batch_num": 2,
               "expert_parallel": 2, "use_seq_parallel": True}, parallel={"parallel_mode": "STAND_ALONE"},
              run_mode="predict")  # MindFormers' manual order tp-ep-pp-dp (parallel_state.py:404-410, :301-315)
    with pytest.warns(ConfigWarning, match="rank order: its dense ranks are tp, then pp, then dp outermost.*strided"):
        assert msp.make_plan(msp.load_config(pp2), world_size=8).mesh.as_dict()["pp"] == 2
    train = dict(d, run_mode="train")  # training: MindFormers' trainer resets the degrees (base_trainer.py:280-296)
    with pytest.warns(ConfigWarning, match="resets parallel_config"):
        assert msp.make_plan(msp.load_config(train)).world_size == 1


@pytest.mark.parametrize("mode, use_parallel", [(0, True), ("STAND_ALONE", True), (1, False)])
def test_non_parallel_modes_fold_gradient_accumulation(mode, use_parallel):
    """data_parallel / stand_alone training (and use_parallel false): no gradient accumulation; the per-card batch is
    batch_size x gradient_accumulation_steps, so the global batch is unchanged."""
    d = cfg({"data_parallel": 2}, parallel={"parallel_mode": mode}, use_parallel=use_parallel,
            runner_config={"batch_size": 2, "gradient_accumulation_steps": 4})
    with pytest.warns(ConfigWarning, match=r"gradient_accumulation_steps=4 is reset to 1 .* 2 x 4 = 8"):
        c = msp.load_config(d)
    world = 2 if mode == 0 and use_parallel else 1  # data_parallel takes dp from the world size
    p = msp.make_plan(c, world_size=world)
    assert (p.gradient_accumulation_steps, p.micro_batch_size, p.global_batch_size) == (1, 8, 8 * world)
    kept = msp.make_plan(msp.load_config(cfg({"data_parallel": 2}, runner_config={"batch_size": 2,
                                                                              "gradient_accumulation_steps": 4})))
    assert (kept.gradient_accumulation_steps, kept.micro_batch_size) == (4, 2)  # semi_auto keeps accumulation


def test_mcore_refuses_micro_batch_interleave_and_notes():
    hit, _ = issue(cfg({}, micro_batch_interleave_num=2, use_legacy=False), "micro_batch_interleave_num")
    assert "base_trainer.py:544-545" in str(hit) and "use_legacy: true" in hit.fix
    assert msp.load_config(cfg({}, micro_batch_interleave_num=2)).micro_batch_interleave_num == 2  # legacy runs it
    with pytest.warns(ConfigWarning, match="auto_pipeline=true.*core/context/parallel.py:49-52.*pipeline_stage is used"):
        msp.load_config(cfg({"pipeline_stage": 2, "micro_batch_num": 2}, parallel={"auto_pipeline": True}))
    seqpipe = cfg({"pipeline_stage": 2, "micro_batch_num": 2, "seq_split_num": 1},
                  parallel={"pipeline_config": {"pipeline_scheduler": "seqpipe"}})
    with pytest.warns(ConfigWarning, match="seq_split_num=1: nothing is chunked, in MindFormers either"):
        msp.make_plan(msp.load_config(seqpipe))
