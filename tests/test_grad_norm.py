"""engine.global_grad_norm (what `msparallel-ds train` logs as grad norm) is the unsharded model's gradient norm in
the layouts where DeepSpeed keeps none: ZeRO-0 with its fp32 clipping on (it drops the norm it computes) and off,
and the pipeline engine. Step 1, before any update: one reference."""
import pytest

from engine_cases import global_batch, tiny_config, tiny_model
from harness import run_distributed

pytestmark = pytest.mark.distributed
ROWS = 4  # global batch
CASES = {"zero0_dp2_tp2_clip": dict(dp=2, tp=2, sp=True, zero=0, bs=2, clip=1.0),
         "zero0_dp2_tp2_noclip": dict(dp=2, tp=2, zero=0, bs=2, clip=0.0),
         "pp2_dp2_noclip": dict(dp=2, zero=0, bs=1, clip=0.0, pp=2)}


def _norms(rank, world):
    import msparallel_ds as msp

    out = {}
    ids, labels = global_batch(0, ROWS)
    for name, kw in CASES.items():
        kw = dict(kw)
        pp = kw.pop("pp", 1)
        cfg = tiny_config(**kw)
        if pp > 1:
            cfg["parallel_config"].update(pipeline_stage=pp, micro_batch_num=2)
        engine = msp.initialize(tiny_model, msp.load_config(cfg))
        dp, d = engine.layout.size("dp"), engine.layout.rank("dp")
        share = slice(d * ROWS // dp, (d + 1) * ROWS // dp)
        engine.train_batch({"input_ids": ids[share], "labels": labels[share]})
        out[name] = engine.global_grad_norm
    return out


def test_global_grad_norm_equals_the_unsharded_models():
    import torch

    model = tiny_model()
    ids, labels = global_batch(0, ROWS)
    model(input_ids=ids, labels=labels).loss.backward()
    want = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    for rank, got in enumerate(run_distributed(_norms, 4, timeout=240)):
        for name, norm in got.items():
            assert norm is not None and abs(norm - want) / want < 1e-5, (rank, name, norm, want)
