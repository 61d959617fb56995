"""pipeline.split on one process: MindFormers' layer split (offset int / per stage / per virtual chunk, V order for
zero_bubble_v), HF names kept, chained stage forwards equal the full model; bad pipeline keys fail before training."""
import pytest
import torch

import msparallel_ds as msp
from msparallel_ds.config.rules import layers_per_stage
from msparallel_ds.pipeline.split import layer_ranges, split_model, stage_chunks


def _model(layers=6):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attention_dropout=0.0, attn_implementation="eager", tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).float().eval()


@pytest.mark.parametrize("pp,vpp,offset,schedule,expected", [
    (2, 1, [1, -1], "1f1b", [range(0, 4), range(4, 6)]),
    (2, 1, 0, "gpipe", [range(0, 3), range(3, 6)]),
    # per virtual chunk: counts [[2, 1], [2, 1]]; chunk c of rank r is stage c*pp + r
    (2, 2, [[1, 0], [1, 0]], "interleaved_1f1b", [range(0, 2), range(2, 3), range(3, 5), range(5, 6)]),
    # V shape: rank 0 holds stages 0 and 3, so stage 3 takes counts[1][0] = 2 layers and stage 2 counts[1][1] = 1
    (2, 2, [[1, 0], [1, 0]], "zero_bubble_v", [range(0, 2), range(2, 3), range(3, 4), range(4, 6)]),
])
def test_layer_ranges(pp, vpp, offset, schedule, expected):
    counts = layers_per_stage(6, pp, vpp, offset)
    assert layer_ranges(counts, schedule) == expected


def test_stage_chunks():
    assert stage_chunks(4, 2, 1, "interleaved_1f1b") == [1, 5]
    assert stage_chunks(4, 2, 1, "zero_bubble_v") == [1, 6]
    assert stage_chunks(4, 1, 3, "1f1b") == [3]


@pytest.mark.parametrize("vpp,offset,schedule", [(1, [1, -1], "1f1b"), (2, [[1, 0], [1, 0]], "interleaved_1f1b"),
                                                 (2, [[1, 0], [1, 0]], "zero_bubble_v")])
def test_chained_stages_equal_the_model_and_keep_hf_names(vpp, offset, schedule):
    pp = 2
    counts = layers_per_stage(6, pp, vpp, offset)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    full = _model()
    with torch.no_grad():
        want = full(input_ids=ids).logits
    stages, names = {}, set()
    for rank in range(pp):
        model = _model()  # every rank builds the same weights
        mods, view, sids = split_model(model, counts, rank, schedule)
        stages.update(zip(sids, mods))
        local = {n for n, _ in view.named_parameters()}
        assert not names & local  # no parameter lives on two ranks
        names |= local
        for m in mods:  # each stage's names are HF names of its own layers
            layer_names = {n.split(".")[2] for n, _ in m.named_parameters() if n.startswith("model.layers.")}
            assert layer_names == {str(i) for i in m.layer_ids}
    assert names == {n for n, _ in full.named_parameters()}
    pos = torch.arange(16).expand(2, 16)
    x = ids
    with torch.no_grad():
        for s in range(pp * vpp):
            x = stages[s](x, position_ids=pos)
    assert torch.allclose(x, want, atol=1e-5), (x - want).abs().max()


def test_split_refuses_a_layer_count_mismatch_and_cuts_the_mtp_layers_to_the_last_stage():
    """MTP layers (after the decoder's) go to the last stage with the embedding (pipeline.shared joins the copies);
    the first stage's layer count excludes them. A tied head is no longer refused (pipeline.shared)."""
    from msparallel_ds.models.mtp import add_mtp_layers

    with pytest.raises(ValueError, match="model.model_config.num_layers"):
        split_model(_model(6), [[2, 2]], 0, "1f1b")
    model = _model(4)
    add_mtp_layers(model, 1)
    (last,), _, _ = split_model(model, [[2, 2]], 1, "1f1b", mtp=1)
    (first,), _, _ = split_model(model, [[2, 2]], 0, "1f1b", mtp=1)
    assert last.layer_ids == [2, 3] and sorted(last.body.layers) == ["2", "3", "4"]
    assert last.body.embed_tokens is model.model.embed_tokens and first.layer_ids == [0, 1]
    assert sorted(first.body.layers) == ["0", "1"]


def _yaml(**par):
    return {"parallel_config": {"data_parallel": 1, "pipeline_stage": 2, "micro_batch_num": 2},
            "parallel": {"pipeline_config": par.pop("pipeline_config", {})},
            "model": {"model_config": {"num_layers": 4, "num_heads": 4, "hidden_size": 64, "vocab_size": 256,
                                       **par}}}


@pytest.mark.parametrize("sched", ["seqpipe", "seqvpp", "seqsmartvpp"])
def test_initialize_refuses_a_seq_scheduler_breaking_mindformers_rules_before_training(sched):
    """seq* schedulers run as 1F1B (tests/test_pipeline.py), but a YAML MindFormers refuses for them is refused
    before any weight moves: full recompute (legacy models), and seqvpp without seq_split_num > 1."""
    key = "parallel_config.seq_split_num" if sched == "seqvpp" else "recompute_config.recompute"
    yaml = _yaml(pipeline_config={"pipeline_scheduler": sched})
    yaml["recompute_config"] = {"recompute": True}
    with pytest.raises(msp.ConfigError, match=key.replace(".", r"\.")):
        msp.initialize(_model(4), yaml)


def test_initialize_refuses_bad_offsets_before_training():
    with pytest.raises(msp.ConfigError, match=r"model\.model_config\.offset.*must sum to"):
        msp.initialize(_model(4), _yaml(offset=[1, 1]))


@pytest.mark.parametrize("who", ["MindFormersAccelerator", "MindFormersTrainer"])
def test_accelerate_and_trainer_refuse_a_pipeline_before_any_group(who):
    """Neither loop can drive a schedule: a clear error pointing to msp.initialize, before torch.distributed starts."""
    import torch.distributed as dist

    from msparallel_ds.integrations.accelerate import MindFormersAccelerator
    from msparallel_ds.integrations.trainer import MindFormersTrainer

    cfg = {"parallel_config": {"data_parallel": 2, "pipeline_stage": 2, "micro_batch_num": 2},
           "model": {"model_config": {"num_layers": 4}}}
    build = {"MindFormersAccelerator": lambda: MindFormersAccelerator(cfg),
             "MindFormersTrainer": lambda: MindFormersTrainer(model=None, parallel_config=cfg)}[who]
    with pytest.raises(ValueError, match=rf"pipeline_stage=2: {who} cannot drive a pipeline.*msp.initialize"):
        build()
    assert not dist.is_initialized()
