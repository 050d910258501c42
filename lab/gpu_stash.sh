#!/usr/bin/env bash
# The first device call of a GPU session (CONTRIBUTING.md, "Running on a GPU"), run in the repository
# root on the GPU machine: keep the part of TVM's packed install (lab/pack_gpu_wheels.sh) this
# call carried in .gpu/ for the second call, in .gpu-stash/ (an ignored folder of the checkout
# there) and in /tmp/gpu-stash/, then print what the machine has that the second call relies on.
#   bash lab/gpu_stash.sh
set -uo pipefail
mkdir -p .gpu-stash /tmp/gpu-stash
for part in .gpu/site.tar.xz.part-*; do
    cp "$part" /tmp/gpu-stash/ && mv "$part" .gpu-stash/ || exit 1
done
ls -l .gpu-stash /tmp/gpu-stash
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available())'
command -v nvcc g++ || true
nvcc --version | tail -1 || true
