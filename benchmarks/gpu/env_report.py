"""Stage 1 of benchmarks/gpu/run.sh: what the machine has (GPU, driver, torch / CUDA, nvcc, compute capability,
the packages the project imports and where each was imported from), and the arch the ops build targets.

    python benchmarks/gpu/env_report.py --json OUT.json        # exit 1 when torch, deepspeed or msparallel_ds fail
"""
from __future__ import annotations

import argparse
import importlib
import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"error: {exc}"


def ops_arch(cap: tuple[int, int]) -> str:
    """The cubin arch for MSPARALLEL_OPS_ARCHS: sm_90a on Hopper (what the kernels are compile-checked for), the
    plain capability elsewhere."""
    return "90a" if cap == (9, 0) else f"{cap[0]}{cap[1]}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    rep: dict = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
                 "machine": platform.machine()}
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap,clocks.max.sm",
                "--format=csv,noheader"])
    rep["nvidia_smi"] = smi
    rep["driver"] = smi.split(",")[1].strip() if smi and smi.count(",") >= 3 else None
    nvcc = _run(["nvcc", "--version"])
    if nvcc is None:
        from msparallel_ds.ops import _build

        path = _build.find_nvcc()
        nvcc = _run([path, "--version"]) if path else None
    # "Cuda compilation tools, release 13.0, V13.0.88" -> "V13.0.88"
    release = [ln for ln in (nvcc or "").splitlines() if "release" in ln]
    rep["nvcc"] = release[0].split(",")[-1].strip() if release else nvcc
    bad = []
    try:
        import torch

        rep.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
                   cudnn=torch.backends.cudnn.version() if torch.cuda.is_available() else None)
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            cap = (p.major, p.minor)
            rep.update(gpu_name=p.name, gpu_count=torch.cuda.device_count(), capability=f"{p.major}.{p.minor}",
                       multiprocessors=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 2),
                       l2_mib=round(getattr(p, "L2_cache_size", 0) / 2**20, 1), ops_arch=ops_arch(cap),
                       flash_sdp=torch.backends.cuda.flash_sdp_enabled(), bf16=torch.cuda.is_bf16_supported())
    except Exception as exc:  # noqa: BLE001
        bad.append(f"torch: {type(exc).__name__}: {exc}")
    pkgs = {}
    for name in ("deepspeed", "transformers", "accelerate", "pydantic", "pydantic_core", "yaml", "safetensors",
                 "google.protobuf", "numpy", "ninja", "hjson", "msgpack", "einops", "psutil", "cpuinfo", "pytest",
                 "pytest_timeout", "msparallel_ds"):
        try:
            mod = importlib.import_module(name)
            pkgs[name] = {"version": getattr(mod, "__version__", None), "file": getattr(mod, "__file__", None)}
        except Exception as exc:  # noqa: BLE001  (report every missing piece, not just the first)
            pkgs[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            if name in ("deepspeed", "transformers", "pydantic", "msparallel_ds"):
                bad.append(f"{name}: {pkgs[name]['error']}")
    rep["packages"] = pkgs
    try:
        from msparallel_ds import ops

        rep["ops_unavailable_reason"] = ops.unavailable_reason()
        rep["ops_source_dir"] = str(ops.source_dir())
    except Exception as exc:  # noqa: BLE001
        bad.append(f"msparallel_ds.ops: {type(exc).__name__}: {exc}")
    rep["import_errors"] = bad
    Path(a.json).write_text(json.dumps(rep, indent=1))
    print(json.dumps({k: v for k, v in rep.items() if k != "packages"}, indent=1))
    for name, info in pkgs.items():
        print(f"{name:<16} {info.get('version') or info.get('error', '')} {info.get('file') or ''}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
