#!/usr/bin/env bash
# Download the bitsandbytes wheel a lent GPU machine needs (Python 3.12, manylinux x86_64; it
# has torch, transformers and peft but not bitsandbytes, and no network) into .whl/, here,
# before the run; benchmarks/gpu_check.sh installs it from there when bitsandbytes is missing.
# The version is the one this repository's CPU venv is tested with.
set -eu -o pipefail
cd "$(dirname "$0")/.."
BNB_VERSION=${BNB_VERSION:-0.50.2}
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "bitsandbytes==${BNB_VERSION}"
ls -l .whl
