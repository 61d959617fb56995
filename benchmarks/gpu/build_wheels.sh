#!/usr/bin/env bash
# Wheels the GPU machine lacks, for its CPython 3.12 manylinux x86_64, into .gpu_wheels/ (git-ignored; carried with
# the device call, see benchmarks/gpu/README.md). Run here, on the CPU machine, from anywhere:
#     benchmarks/gpu/build_wheels.sh [DEST]        # default DEST: <repo>/.gpu_wheels
# The GPU machine (torch 2.11 + CUDA 13, no package registry) has torch, transformers, accelerate, numpy, pyyaml,
# safetensors, protobuf, packaging, tqdm, pytest; it lacks DeepSpeed and pydantic. So: DeepSpeed (the version
# installed here, built as a wheel with DS_BUILD_OPS=0: pure Python, its ops JIT-build on first use) and its
# requirements, pydantic with pydantic_core, pytest-timeout. The project itself is not wheeled: the working tree
# travels and run.sh puts it first on PYTHONPATH. One version of each package (two stop pip's --target install).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DEST=${1:-$ROOT/.gpu_wheels}
PY=${PYTHON:-python}
ver() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }

DS_VER=${DS_VER:-$(ver deepspeed)}
PYD_VER=${PYD_VER:-$(ver pydantic)}
rm -rf "$DEST"
mkdir -p "$DEST"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# DeepSpeed from its sdist, no native ops (DS_BUILD_OPS=0), built against the torch installed here (setup.py
# imports torch; the wheel is py3-none-any and JIT-builds any op it needs on the GPU machine).
"$PY" -m pip download -q --no-deps --no-binary=:all: -d "$TMP/sdist" "deepspeed==$DS_VER"
DS_BUILD_OPS=0 DS_SKIP_CUDA_CHECK=1 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" \
    "$TMP"/sdist/deepspeed-*.tar.gz

# Binary and pure-Python wheels for the GPU machine's interpreter (pip matches each manylinux tag exactly).
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
PKGS=("pydantic==$PYD_VER" "pydantic_core==$(ver pydantic_core)" "annotated_types==$(ver annotated_types)"
      "typing_inspection==$(ver typing_inspection)" "typing_extensions==$(ver typing_extensions)"
      "hjson==$(ver hjson)" "ninja==$(ver ninja)" "py-cpuinfo==$(ver py-cpuinfo)" "msgpack==$(ver msgpack)"
      "einops==$(ver einops)" "psutil==$(ver psutil)" "pytest-timeout==$(ver pytest-timeout)")
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --abi abi3 --abi none "${PLAT[@]}" -d "$DEST" "${PKGS[@]}"

# Every requirement of DeepSpeed and pydantic is either carried or on the GPU machine (its package list).
ON_GPU=" torch numpy packaging tqdm nvidia-ml-py "
for w in "$DEST"/deepspeed-*.whl "$DEST"/pydantic-*.whl; do
    for req in $(unzip -p "$w" '*/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' \
                 | sed -E 's/^Requires-Dist: *([A-Za-z0-9_.-]+).*/\1/' | tr 'A-Z_.' 'a-z--'); do
        norm=$(echo "$req" | tr 'A-Z_.' 'a-z--')
        if ! ls "$DEST" | tr 'A-Z_.' 'a-z--' | grep -q "^${norm}-[0-9]" && [[ "$ON_GPU" != *" $norm "* ]]; then
            echo "build_wheels.sh: $(basename "$w") requires $req, neither carried nor on the GPU machine" >&2
            exit 1
        fi
    done
done
ls -la "$DEST"
du -sh "$DEST"
