"""Issue 16, training state: a non-finite step stops with an error naming the step and is never saved over a good
checkpoint; engine.load checks names, shapes, the saved model config and checksums before touching any tensor;
the pipeline follows the sequence length; a save failing on one rank is the same error on every rank (no barrier
hang), disk full says so, and a stale temporary file is removed by the next save."""
import errno
import os

import pytest
from engine_cases import tiny_config, tiny_model
from harness import run_distributed


def _killed_save_temp(folder):
    """The temporary file a save killed mid-write leaves (its process is gone): ours to sweep (issue 41, H4)."""
    import subprocess
    import sys

    from msparallel_ds.checkpoint.folder import tmp_prefix

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return os.path.join(folder, f"{tmp_prefix(int(gone.stdout))}killed.pt")


# ------------------------------------------------------------------------------------------ in the pytest process
def test_stale_temp_file_is_removed_and_disk_full_is_named(tmp_path, monkeypatch):
    import torch

    from msparallel_ds.checkpoint import format as fmt

    path = str(tmp_path / fmt.FILE)
    open(_killed_save_temp(str(tmp_path)), "wb").write(b"x" * 1000)  # a save killed by SIGTERM
    fmt.atomic_save({"format": fmt.FORMAT, "step": 1}, path)
    assert os.listdir(tmp_path) == [fmt.FILE]

    def full_disk(obj, f):  # torch's writer chains the OSError under its own RuntimeError
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos") from e

    monkeypatch.setattr(torch, "save", full_disk)
    record = {"format": fmt.FORMAT, "params": {"w": {"fp32": torch.ones(2)}}}
    with pytest.raises(fmt.CheckpointSaveError, match=f"no space left on device writing {path}"):
        fmt.write_agreed(record, path)
    monkeypatch.undo()
    assert fmt.read_checkpoint_file(path, fmt.FORMAT)["step"] == 1 and os.listdir(tmp_path) == [fmt.FILE]
    bad = {"format": fmt.FORMAT, "params": {"w": {"fp32": torch.tensor([1.0, float("nan")])}}}
    with pytest.raises(fmt.CheckpointSaveError, match=r"refusing to write non-finite.*w/fp32"):
        fmt.write_agreed(bad, path)
    assert fmt.read_checkpoint_file(path, fmt.FORMAT)["step"] == 1


def test_finite_guard_message_names_the_step():
    from msparallel_ds.loss import check_finite_step

    check_finite_step(3, loss=1.0, grad_norm=2.0)
    with pytest.raises(FloatingPointError, match=r"loss is nan at step 4 \(engine.global_steps=3.*learning rate"):
        check_finite_step(3, loss=float("nan"))


# ------------------------------------------------------------------------------------------ one process
def _snapshot(engine):
    import torch

    weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    opt = engine.ds.optimizer
    state = {id(p): {k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for p, s in opt.state.items()}
    return weights, state


def _same(a, b):
    import torch

    return a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and a[1].keys() == \
        b[1].keys() and all(torch.equal(a[1][i][k], b[1][i][k]) for i in a[1] for k in a[1][i])


def _edited(src, dst, edit):
    import torch

    from msparallel_ds.checkpoint import format as fmt

    ck = torch.load(os.path.join(src, fmt.FILE), weights_only=True)
    edit(ck)
    fmt.atomic_save(ck, os.path.join(dst, fmt.FILE))
    return dst


def _flip_a_byte(src, dst):
    """Flip one byte inside the stored data of the last parameter's weight (the zip entries are not compressed)."""
    import shutil

    import torch

    from msparallel_ds.checkpoint import format as fmt

    ck = torch.load(os.path.join(src, fmt.FILE), weights_only=True)
    t = ck["params"][list(ck["params"])[-1]]["fp32"]
    raw = open(os.path.join(src, fmt.FILE), "rb").read()
    at = raw.find(t.contiguous().view(torch.uint8).numpy().tobytes()[:64])
    assert at > 0
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, fmt.FILE), os.path.join(dst, fmt.FILE))
    with open(os.path.join(dst, fmt.FILE), "r+b") as f:
        f.seek(at + 17)
        b = f.read(1)
        f.seek(at + 17)
        f.write(bytes([b[0] ^ 0x10]))
    return dst


def _one_process(rank, world, root):
    """The reported case (tiny_dp1, lr 1e5, save every step), then load validation on a good checkpoint."""
    import warnings

    import torch

    import msparallel_ds as msp
    from msparallel_ds.checkpoint import format as fmt
    from msparallel_ds.tiny import dp_rows, text_batches, tiny_llama

    out = {}
    cfg = msp.load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "tiny_dp1.yaml"))
    engine = msp.initialize(tiny_llama, cfg, optimizer=lambda p: torch.optim.AdamW(p, lr=1e5))
    diverged = os.path.join(root, "diverged")
    try:
        for batch in text_batches(6, engine.plan.global_batch_size, 64):
            engine.train_batch(dp_rows(batch, engine.layout))
            engine.save(diverged, sharded=False)  # the single file's guards (sharded: test_checkpoint_sharded)
        out["diverged"] = "no error"
    except (FloatingPointError, fmt.CheckpointSaveError) as e:
        out["diverged"] = (type(e).__name__, str(e), engine.global_steps)
    ck = fmt.read_checkpoint_file(os.path.join(diverged, fmt.FILE), fmt.FORMAT)
    out["kept"] = (ck["global_steps"], not fmt.nonfinite_tensors(ck["params"]))

    good = os.path.join(root, "good")
    engine = msp.initialize(tiny_model(), msp.load_config(tiny_config(bs=4, zero=0)),
                            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    batch = text_batches(1, 4, 32)[0]
    engine.train_batch({k: v % 256 for k, v in batch.items()})
    engine.save(good, sharded=False)
    engine.train_batch({k: v % 256 for k, v in batch.items()})  # now the engine differs from the file
    last = [n for n, _ in engine.model.named_parameters()][-1]

    def reshaped(c):
        c["params"][last]["fp32"] = c["params"][last]["fp32"][:-1]

    def other_heads(c):
        c["model_config"]["num_attention_heads"] = 8

    bad = {"shape": _edited(good, os.path.join(root, "shape"), reshaped),
           "config": _edited(good, os.path.join(root, "config"), other_heads),
           "flipped": _flip_a_byte(good, os.path.join(root, "flipped"))}
    for key, folder in bad.items():
        before = _snapshot(engine)
        try:
            engine.load(folder)
            out[key] = "loaded"
        except ValueError as e:
            out[key] = str(e)
        out[key + "_untouched"] = _same(before, _snapshot(engine))
    old = _edited(good, os.path.join(root, "old"), lambda c: c.pop("checksums"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["old"] = engine.load(old)["global_steps"]
    out["old_warning"] = [str(w.message) for w in caught if "checksum" in str(w.message)]
    return out


def test_nan_training_and_load_validation(tmp_path):
    r = run_distributed(_one_process, 1, str(tmp_path), timeout=300)[0]
    kind, message, steps = r["diverged"]
    assert kind == "FloatingPointError" and f"at step {steps + 1} (engine.global_steps={steps}" in message, message
    assert "learning rate" in message and r["kept"] == (steps, True)  # the last finite state, not NaN
    assert "parameter lm_head.weight" in r["shape"] and "does not fit" in r["shape"], r["shape"]
    assert "num_attention_heads=8" in r["config"] and "num_attention_heads=4" in r["config"], r["config"]
    assert "does not match its checksum" in r["flipped"], r["flipped"]
    assert r["shape_untouched"] and r["config_untouched"] and r["flipped_untouched"]
    assert r["old"] == 1 and r["old_warning"]


# ------------------------------------------------------------------------------------------ pp2 on 2 processes
def _pp_config():
    c = tiny_config(clip=1.0)
    c["parallel_config"].update(pipeline_stage=2, micro_batch_num=2)
    c["parallel"]["pipeline_config"] = {"pipeline_interleave": False, "pipeline_scheduler": "1f1b"}
    return c


def _batch(seq):
    import torch

    ids = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(seq))
    return {"input_ids": ids, "labels": ids}


def _pipeline(rank, world, root):
    import time

    import torch

    import msparallel_ds as msp
    from msparallel_ds.checkpoint import format as fmt

    out = {}
    engine = msp.initialize(tiny_model(), msp.load_config(_pp_config()),
                            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    out["losses"] = [engine.train_batch(_batch(s)).item() for s in (32, 16, 32)]  # dynamic padding
    ckpt = os.path.join(root, "pp")
    engine.save(ckpt, sharded=False)  # the single file's guards (sharded: test_checkpoint_sharded)
    if rank == 0:  # disk full on rank 0 only: every rank gets the error, none waits in a barrier
        open(_killed_save_temp(ckpt), "wb").write(b"x" * 100)

        def full(obj, path):
            raise RuntimeError("enforce fail at inline_container.cc:672") from OSError(errno.ENOSPC, "No space")
        fmt.atomic_save, real = full, fmt.atomic_save
    t = time.monotonic()
    try:
        engine.save(ckpt, sharded=False)
        out["full"] = "saved"
    except fmt.CheckpointSaveError as e:
        out["full"] = str(e)
    out["full_s"] = time.monotonic() - t
    if rank == 0:
        fmt.atomic_save = real
    engine.save(ckpt, sharded=False)  # a good save removes the stale temp file
    out["files"] = sorted(os.listdir(ckpt))
    with torch.no_grad():  # NaN weights on the first stage: the step stops, the save refuses, the file stays
        for p in engine.model.parameters():
            p.fill_(float("nan"))
            break
    try:
        engine.train_batch(_batch(32))
    except FloatingPointError as e:
        out["nan_step"] = str(e)
    try:
        engine.save(ckpt, sharded=False)
    except fmt.CheckpointSaveError as e:
        out["nan_save"] = str(e)
    ck = fmt.read_checkpoint_file(os.path.join(ckpt, fmt.FILE), fmt.FORMAT)
    out["kept"] = (ck["global_steps"], not fmt.nonfinite_tensors(ck["params"]))
    return out


def _reference_losses():
    import torch

    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for s in (32, 16, 32):
        loss = model(**_batch(s)).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.distributed
def test_pipeline_sequence_change_save_agreement_and_nan_guard(tmp_path):
    results = run_distributed(_pipeline, 2, str(tmp_path), timeout=300)
    ref = _reference_losses()
    for r in results:
        assert r["losses"] == pytest.approx(ref, rel=1e-4)
        assert "no space left on device writing" in r["full"] and r["full_s"] < 30, r["full"]
        assert r["files"] == ["msp_universal.pt"]
        assert "loss is nan at step 4 (engine.global_steps=3" in r["nan_step"], r["nan_step"]
        assert "refusing to write non-finite" in r["nan_save"] and r["kept"] == (3, True)
