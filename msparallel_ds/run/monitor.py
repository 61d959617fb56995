"""MFLossMonitor: a progress line every per_print_times steps on rank 0 (loss, lr, grad norm, tokens/s, step time,
MFU estimate) and a tqdm progress bar on rank 0 when stderr is a terminal (progress=None; True/False force it),
output_dir/metrics.jsonl with one JSON object per step, TensorBoard scalars when asked.

grad norm: the global norm before clipping, which the engines compute every step in every layout (for clipping and
the finite check); 'off' (null in metrics.jsonl) only where nothing computed one (a DeepSpeed override
zero_optimization.compute_grad_norm: false), rather than a second pass over the gradients to compute it."""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

# dense bf16 peak FLOP/s of accelerators the MFU estimate knows (None elsewhere, e.g. CPU)
_PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "H800": 989e12, "A800": 312e12}


def _peak_flops() -> Optional[float]:
    if os.environ.get("MSPARALLEL_PEAK_FLOPS"):
        return float(os.environ["MSPARALLEL_PEAK_FLOPS"])
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        return next((v for k, v in _PEAK.items() if k in name), None)
    return None


class LossMonitor:
    def __init__(self, output_dir: str, per_print_times: int, total_steps: int, rank: int, world: int,
                 n_params: int, tensorboard: Optional[str] = None, echo=print, progress: Optional[bool] = None,
                 bar_file=None):
        self.every, self.total, self.rank, self.world = max(1, int(per_print_times)), total_steps, rank, world
        self.n_params, self.echo, self.peak = n_params, echo, _peak_flops()
        self._file = self._tb = self._bar = None
        if rank == 0:
            from tqdm.auto import tqdm  # disable=None: no bar when the output is not a terminal (logs, CI)

            self._bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True, file=bar_file,
                             disable=None if progress is None else not progress)
            if not self._bar.disable:  # log lines printed above the bar, not through it
                self.echo = lambda text: self._bar.write(text, file=bar_file)
            os.makedirs(output_dir, exist_ok=True)
            self._file = open(os.path.join(output_dir, "metrics.jsonl"), "a", encoding="utf-8")
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
                self._tb = SummaryWriter(tensorboard)

    def resumed_at(self, step: int) -> None:
        """After a resume: drop the records of steps past the checkpoint, which the run is about to redo."""
        if self._file is None:
            return
        self._bar.update(step - self._bar.n)
        self._file.close()
        path = self._file.name
        with open(path, encoding="utf-8") as f:
            keep = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(keep)
        self._file = open(path, "a", encoding="utf-8")

    def log(self, step: int, loss: float, lr: Optional[float], grad_norm: Optional[float], tokens: int,
            seconds: float, aux_loss: Optional[float] = None, mtp_loss: Optional[float] = None) -> dict:
        tps = tokens / seconds if seconds > 0 else 0.0
        mfu = 6 * self.n_params * tps / (self.peak * self.world) if self.peak else None
        rec = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tps,
               "step_time_s": seconds, "mfu": mfu}
        if aux_loss is not None:
            rec["aux_loss"] = aux_loss
        if mtp_loss is not None:
            rec["mtp_loss"] = mtp_loss
        if self.rank != 0:
            return rec
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        self._bar.update(step - self._bar.n)
        self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        if self._tb is not None:
            for k, v in rec.items():
                if k != "step" and v is not None:
                    self._tb.add_scalar(f"train/{k}", v, step)
        if step % self.every == 0 or step == self.total:
            extra = "".join(f", {k} {rec[k]:.5f}" for k in ("aux_loss", "mtp_loss") if k in rec)
            self.echo(f"step {step}/{self.total} loss {loss:.6f}{extra}, lr {lr if lr is None else f'{lr:.3e}'}, "
                      f"grad norm {'off' if grad_norm is None else f'{grad_norm:.4f}'}, {tps:.0f} tokens/s, "
                      f"{seconds * 1000:.0f} ms/step, MFU {'n/a' if mfu is None else f'{mfu:.1%}'}")
        return rec

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
