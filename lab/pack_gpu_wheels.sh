#!/usr/bin/env bash
# Pack what a GPU machine without network needs to run tvm_deform: TVM and its FFI installed
# for the machine's Python (3.12 by default) into a folder, that folder as one xz-compressed tar
# (about 63 MiB, where the wheels take 104), split into two equal parts, one per device call,
# so that each call has room beside its part for a tuning round (CONTRIBUTING.md, "Running on a
# GPU"). Then checks that each part plus the repository's working tree stays under the per-call
# limit with margin. Run here, in the repository root (needs network); the parts land in .gpu/
# (git-ignored) as site.tar.xz.part-aa and -ab.
#   bash lab/pack_gpu_wheels.sh [PYTHON_VERSION [XGBOOST_VERSION]]
# XGBOOST_VERSION (e.g. 3.4.1, which needs Python 3.12) adds xgboost-cpu, which only tuning on
# the GPU machine itself needs (lab/gpu_session.py --trials); rounds of candidates built here
# are timed without it.
set -euo pipefail
python_version=${1:-3.12}
xgboost_version=${2:-}
packages=(apache-tvm==0.27.0.post1 apache-tvm-ffi==0.1.14.post1)
if [[ -n $xgboost_version ]]; then packages+=("xgboost-cpu==$xgboost_version"); fi
rm -rf .gpu
mkdir -p .gpu/site
python3 -m pip install -q --no-deps --no-compile --only-binary=:all: \
    --python-version "$python_version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --target .gpu/site "${packages[@]}"
tar -C .gpu/site -cf - . | xz -9 -T0 >.gpu/site.tar.xz
rm -rf .gpu/site
split -n 2 .gpu/site.tar.xz .gpu/site.tar.xz.part-
rm .gpu/site.tar.xz
bash lab/check_carry_sizes.sh .gpu/site.tar.xz.part-*
