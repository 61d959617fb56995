"""Only here to ship the top-level ops/ CUDA sources inside wheels (metadata lives in pyproject.toml).

The kernels' sources stay in ops/ (DESIGN.md); a wheel carries a copy as msparallel_ds/ops/csrc, where
msparallel_ds.ops finds them for its JIT build. Source checkouts and editable installs read ops/ directly.
"""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

OPS_SUFFIXES = {".cu", ".cuh", ".h", ".cpp"}


class BuildPyWithOps(build_py):
    def run(self):
        super().run()
        src = Path(__file__).resolve().parent / "ops"
        dst = Path(self.build_lib) / "msparallel_ds" / "ops" / "csrc"
        self.mkpath(str(dst))
        for f in sorted(src.iterdir()):
            if f.suffix in OPS_SUFFIXES:
                self.copy_file(str(f), str(dst / f.name))


setup(cmdclass={"build_py": BuildPyWithOps})
