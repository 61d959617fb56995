"""Finding, compiling and loading the CUDA sources of ops/ (no Triton).

Sources, first found wins: $MSPARALLEL_OPS_SRC; the copy a wheel ships inside the package (msparallel_ds/ops/csrc,
copied from ops/ by setup.py's build_py; MANIFEST.in puts ops/ in the sdist); the repository's top-level ops/
(source checkout or `pip install -e .`). The kernels live in .cu files that include only CUDA headers; binding.cpp is the only file
that includes torch, so `compile_check` (and CI) can compile every kernel with nvcc alone, without a GPU.

JIT build: torch.utils.cpp_extension.load with ninja, cached under $TORCH_EXTENSIONS_DIR (torch's default cache
otherwise); concurrent ranks wait on torch's lock and share one build. Targets: sm_80 and sm_90a cubins plus
compute_80 PTX (so newer GPUs JIT it); $MSPARALLEL_OPS_ARCHS overrides the cubin list ("80;90a").
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

NAME = "msparallel_ds_ring_ops"
CUDA_SOURCES = ("ring_attn_fwd.cu", "ring_attn_bwd.cu", "merge.cu")
BINDING = "binding.cpp"
HEADERS = ("ring_attn.h", "common.cuh")
ENV_SRC = "MSPARALLEL_OPS_SRC"
ENV_ARCHS = "MSPARALLEL_OPS_ARCHS"
DEFAULT_ARCHS = ("80", "90a")
MIN_CAPABILITY = (8, 0)  # mma.sync m16n8k16 bf16, cp.async, ldmatrix
# What torch.utils.cpp_extension passes to every nvcc call (COMMON_NVCC_FLAGS); the compile check uses the same
# defines so that it compiles what the JIT build compiles.
TORCH_NVCC_DEFINES = ("-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                      "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr")
NVCC_OPT = ("-O3", "-std=c++17", "-lineinfo")


class OpsUnavailable(RuntimeError):
    """The fused CUDA kernels cannot be used here; the message says why and what to do."""


def source_dir() -> Path:
    """The directory holding ops/'s sources (see the module docstring for the search order)."""
    here = Path(__file__).resolve().parent
    candidates = [Path(os.environ[ENV_SRC])] if os.environ.get(ENV_SRC) else []
    candidates += [here / "csrc", here.parents[1] / "ops"]
    for c in candidates:
        if all((c / f).is_file() for f in (BINDING, *CUDA_SOURCES, *HEADERS)):
            return c
    raise OpsUnavailable(f"the CUDA sources of msparallel_ds.ops were not found (looked in "
                         f"{', '.join(str(c) for c in candidates)}); install from a source checkout or set "
                         f"{ENV_SRC} to its ops/ directory")


def archs() -> tuple[str, ...]:
    raw = os.environ.get(ENV_ARCHS)
    if not raw:
        return DEFAULT_ARCHS
    out = tuple(a.strip().replace("sm_", "").replace(".", "") for a in raw.replace(",", ";").split(";") if a.strip())
    if not out:
        raise OpsUnavailable(f"{ENV_ARCHS}={raw!r} names no architecture (e.g. '80;90a')")
    return out


def gencode_flags(arch_list: Sequence[str], ptx: bool = True) -> list[str]:
    """-gencode flags: one cubin per arch, plus compute_80 PTX for GPUs newer than the list."""
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in arch_list]
    if ptx:
        flags.append("-gencode=arch=compute_80,code=compute_80")
    return flags


# ------------------------------------------------------------------------------------------------ compile check
@dataclass
class CompileResult:
    source: str
    arch: str
    returncode: int
    seconds: float
    output: str


def find_nvcc() -> str | None:
    """nvcc on PATH, else under $CUDA_HOME / $CUDA_PATH / /usr/local/cuda."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def compile_check(out_dir: os.PathLike, arch_list: Sequence[str] = DEFAULT_ARCHS, jobs: int | None = None,
                  nvcc: str | None = None, extra: Sequence[str] = ()) -> list[CompileResult]:
    """`nvcc -c` every .cu of ops/ once, for all archs in one call (the host side is compiled once), the files in
    parallel processes; object files go to out_dir (nothing is cached in the repo). Needs only nvcc: the .cu files
    include CUDA headers only. Same defines as torch's JIT build (TORCH_NVCC_DEFINES)."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise OpsUnavailable("nvcc not found (PATH, CUDA_HOME, /usr/local/cuda)")
    src = source_dir()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def one(f: str) -> CompileResult:
        cmd = [nvcc, "-c", *NVCC_OPT, *TORCH_NVCC_DEFINES, *extra, *gencode_flags(arch_list, ptx=False),
               str(src / f), "-o", str(out / f"{Path(f).stem}.o")]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        return CompileResult(f, ",".join(arch_list), proc.returncode, time.perf_counter() - t0,
                             " ".join(cmd) + "\n" + proc.stdout + proc.stderr)

    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 2) as pool:
        return list(pool.map(one, CUDA_SOURCES))


# ------------------------------------------------------------------------------------------------ JIT build / load
_MODULE = None
_FAILURE: str | None = None


def unavailable_reason(require_device: bool = True, device=None) -> str | None:
    """Why the kernels cannot run in this process on `device` (default: the current CUDA device); None when they
    can, as far as can be told without building."""
    import torch

    if torch.version.cuda is None:
        return f"PyTorch {torch.__version__} was built without CUDA (install a CUDA build of torch)"
    if not require_device:
        return None
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return (f"the GPU ({torch.cuda.get_device_name(device)}, sm_{cap[0]}{cap[1]}) is older than sm_80; the "
                f"fused kernels need tensor-core mma.sync with bf16 (Ampere or newer)")
    return None


def build_directory() -> Path:
    """Where torch.utils.cpp_extension builds and caches NAME (same rule as torch; nothing is created here)."""
    import torch

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        acc = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
        root = os.path.join(get_default_build_root(),
                            f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{acc}")
    return Path(root) / NAME


def is_built() -> bool:
    """A compiled module sits in the cache (it may still be rebuilt on load if the sources changed)."""
    try:
        return any(build_directory().glob(f"{NAME}*.so"))
    except Exception:  # noqa: BLE001  (no CUDA torch, unreadable cache: not built)
        return False


def loaded():
    """The extension module if this process has loaded it already, else None (never builds)."""
    return _MODULE


def load(*, build: bool = True, require_device: bool = True, verbose: bool = False):
    """The compiled extension, built on first use (minutes; cached after). Raises OpsUnavailable with the reason
    when CUDA, a suitable GPU, nvcc or the sources are missing, or the build fails (the failure is remembered, so
    a process does not retry a broken build on every call)."""
    global _MODULE, _FAILURE
    if _MODULE is not None:
        return _MODULE
    reason = unavailable_reason(require_device)
    if reason:
        raise OpsUnavailable(f"msparallel_ds.ops: {reason}")
    if _FAILURE is not None:
        raise OpsUnavailable(_FAILURE)
    if not build and not is_built():
        raise OpsUnavailable(f"msparallel_ds.ops is not built yet (cache {build_directory()}); run "
                             f"`python -m msparallel_ds.ops build`")
    src = source_dir()
    from torch.utils.cpp_extension import load as cpp_load

    try:
        _MODULE = cpp_load(name=NAME, sources=[str(src / BINDING), *(str(src / f) for f in CUDA_SOURCES)],
                           extra_cflags=["-O3", "-std=c++17"],
                           extra_cuda_cflags=[*NVCC_OPT, *gencode_flags(archs())],
                           extra_include_paths=[str(src)], with_cuda=True, verbose=verbose)
    except Exception as exc:  # compiler missing or failing, link errors: one clear error, remembered
        _FAILURE = (f"msparallel_ds.ops: building the CUDA kernels from {src} failed ({type(exc).__name__}: "
                    f"{str(exc).strip()[-2000:]}); needs nvcc (CUDA_HOME) and ninja (`pip install ninja`)")
        raise OpsUnavailable(_FAILURE) from exc
    return _MODULE
