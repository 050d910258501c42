#!/usr/bin/env bash
# Fetch the wheels a GPU machine without network needs to run tvm_deform (TVM and its FFI for
# the machine's Python 3.12, and xgboost for MetaSchedule's cost model), split them into two
# parts of at most 54 MiB (one per device call), and check that each part plus the repository's
# working tree (what every device call carries) stays under the per-call limit with margin. Run
# here, in the repository root; the parts land in .gpu/ (git-ignored). See CONTRIBUTING.md,
# "Running on a GPU".
#   bash lab/pack_gpu_wheels.sh [PYTHON_VERSION [XGBOOST_VERSION]]
# (defaults 3.12, the GPU machine's Python, and xgboost-cpu 3.4.1, which needs 3.12; the
# rehearsal, lab/rehearse_gpu_session.sh, packs for this machine's Python and xgboost instead)
set -euo pipefail
python_version=${1:-3.12}
xgboost_version=${2:-3.4.1}
rm -rf .gpu/download
mkdir -p .gpu/download
python3 -m pip download --no-deps --only-binary=:all: --python-version "$python_version" \
    --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .gpu/download \
    apache-tvm==0.27.0.post1 apache-tvm-ffi==0.1.14.post1 "xgboost-cpu==$xgboost_version"
rm -f .gpu/wheels.tar .gpu/wheels.tar.part-*
tar -cf .gpu/wheels.tar -C .gpu/download .
split -b 54m .gpu/wheels.tar .gpu/wheels.tar.part-
rm .gpu/wheels.tar
bash lab/check_carry_sizes.sh .gpu/wheels.tar.part-*
