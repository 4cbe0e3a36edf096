#!/usr/bin/env bash
# Download the wheels of requirements/gpu-check.txt into .whl/ for the GPU machine
# (CPython 3.12, x86-64 Linux; it has no internet): `make gpu-wheels`, here, where pip
# reaches the package index. Then carry .whl/ there and run `make gpu-check`.
#
# The old wheels in .whl/ are removed first, so it holds exactly one version of each
# (two versions of one package stop the install there).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
rm -f .whl/*.whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl -r requirements/gpu-check.txt
ls -l .whl
