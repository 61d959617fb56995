"""Hardening round 2, item 8: the Trainer's resume never reaches DeepSpeed's pickle loader for a folder that is
not ours. Before the fix MindFormersTrainer.train fell back to DeepSpeed's loader (torch.load weights_only=False)
and a crafted mp_rank_00_model_states.pt ran its payload (the marker file below was created)."""
import os
import pathlib

from harness import run_distributed


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # what a crafted pickle does: call any function on load
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def _resume_cases(rank, world_size, root):
    import deepspeed
    import torch
    import transformers.trainer as hf_trainer

    from msparallel_ds.integrations.trainer import load_deepspeed_weights_only
    from msparallel_ds.runtime import disable_inference_shm_build

    disable_inference_shm_build()
    res = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
               "bf16": {"enabled": stage == 3}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        x = torch.randn(2, 4)
        engine.backward(engine(x.to(engine.module[0].weight.dtype)).float().sum())
        engine.step()
        folder = os.path.join(root, f"z{stage}")
        engine.save_checkpoint(folder, tag="global_step1")  # the Trainer's naming
        want = {k: v.clone() for k, v in engine.module.state_dict().items()}
        if stage < 3:
            with torch.no_grad():
                for p in engine.module.parameters():
                    p.zero_()
        # DeepSpeed's own, genuine files still load (weights-only, with DeepSpeed's plain data classes allowed)
        load_deepspeed_weights_only(hf_trainer.deepspeed_load_checkpoint, engine, folder)
        got = engine.module.state_dict()
        res[f"genuine_z{stage}"] = all(torch.equal(got[k], want[k]) for k in want) if stage < 3 else True
        # a crafted file in its place is refused, and its payload never runs
        marker = os.path.join(root, f"pwned{stage}")
        target = "mp_rank_00_model_states.pt" if stage < 3 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
        torch.save({"module": _Payload(marker)}, os.path.join(folder, "global_step1", target))
        try:
            load_deepspeed_weights_only(hf_trainer.deepspeed_load_checkpoint, engine, folder)
            res[f"crafted_z{stage}"] = "loaded"
        except ValueError as e:
            res[f"crafted_z{stage}"] = str(e)
        res[f"ran_z{stage}"] = os.path.exists(marker)
    return res


def test_trainer_resume_never_unpickles_foreign_deepspeed_files(tmp_path):
    (res,) = run_distributed(_resume_cases, 1, str(tmp_path), timeout=180)
    for stage in (2, 3):
        assert res[f"genuine_z{stage}"], stage
        assert not res[f"ran_z{stage}"], f"ZeRO-{stage}: the crafted pickle ran"
        msg = res[f"crafted_z{stage}"]
        assert "weights-only" in msg and "Unsupported global" in msg and str(tmp_path) in msg and "\n" not in msg, msg
