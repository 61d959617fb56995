"""engine.save / engine.load: a run resumed from a checkpoint takes the same steps as the uninterrupted run, under
the same layout, under another layout (tp2 x cp2 -> dp2 x tp2, dp2 x tp2 ZeRO-2 -> tp4 + SP), and in one process."""
import pytest
from engine_cases import global_batch, tiny_config, tiny_model
from harness import run_distributed

pytestmark = pytest.mark.distributed

ROWS = 4  # global batch rows (tiny_config bs per dp rank = 4 / dp)
LAYOUTS = {
    "tp2xcp2": dict(tp=2, cp=2, ring=True, sp=True, bs=4),
    "dp2xtp2_zero2": dict(dp=2, tp=2, zero=2, bs=2),
    "dp2xtp2": dict(dp=2, tp=2, sp=True, vocab_dp=False, bs=2),
    "tp4_sp": dict(tp=4, sp=True, bs=4),
    "one": dict(bs=4, zero=0),
}


def _engine(name):
    import torch

    import msparallel_ds as msp

    return msp.initialize(tiny_model(), msp.load_config(tiny_config(**LAYOUTS[name])),
                          optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1))


def _steps(engine, first, last):
    lay = engine.layout
    rows, d = ROWS // lay.size("dp"), lay.rank("dp")
    out = []
    for step in range(first, last):
        ids, labels = global_batch(step, ROWS)
        out.append(engine.train_batch({"input_ids": ids[d * rows:(d + 1) * rows],
                                       "labels": labels[d * rows:(d + 1) * rows]}).item())
    return out


def _uninterrupted_and_save(rank, world, name, ckpt):
    engine = _engine(name)
    first = _steps(engine, 0, 2)
    engine.save(ckpt)
    return first + _steps(engine, 2, 4)


def _resume(rank, world, names, ckpt):
    out = {}
    for name in names:  # several layouts, one after another, in the same processes
        engine = _engine(name)
        info = engine.load(ckpt)
        out[name] = (_steps(engine, 2, 4), info)
    return out


def test_resume_equals_uninterrupted_under_any_layout(tmp_path):
    """Saved from tp2 x cp2 (ring, SP, ZeRO-1); resumed there, in dp2 x tp2 (vocab parallel), dp2 x tp2 ZeRO-2,
    tp4 + SP (kv heads replicated) and in one process."""
    ckpt = str(tmp_path / "ckpt")
    full = run_distributed(_uninterrupted_and_save, 4, "tp2xcp2", ckpt, timeout=300)[0]
    assert abs(full[3] - full[2]) > 1e-3  # the steps really move the loss
    resumed = run_distributed(_resume, 4, ["tp2xcp2", "dp2xtp2", "dp2xtp2_zero2", "tp4_sp"], ckpt, timeout=300)[0]
    resumed.update(run_distributed(_resume, 1, ["one"], ckpt, timeout=300)[0])
    for name, (losses, info) in resumed.items():
        assert info["global_steps"] == 2 and info["optimizer_step"] == 2, (name, info)
        assert max(abs(a - b) / b for a, b in zip(losses, full[2:])) <= 1e-5, (name, losses, full)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    def fake():
        from types import SimpleNamespace
        return SimpleNamespace(ds=None)

    from msparallel_ds.checkpoint import load_checkpoint

    with pytest.raises(FileNotFoundError, match="no msparallel_ds checkpoint"):
        load_checkpoint(fake(), str(tmp_path))
