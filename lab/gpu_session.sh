#!/usr/bin/env bash
# The second device call of a GPU session (CONTRIBUTING.md, "Running on a GPU"), run in the repository
# root on the GPU machine: join the two parts of TVM's packed install (lab/pack_gpu_wheels.sh;
# the first stashed by the first call, in .gpu-stash/ and in /tmp/gpu-stash/, the second
# carried now in .gpu/), unpack it into /tmp/site, install this package there without network,
# then build, check, time and tune with python lab/gpu_session.py.
#   bash lab/gpu_session.sh OUT_DIR [gpu_session options, e.g. --round work/round1]
set -euo pipefail
out=${1:?usage: lab/gpu_session.sh OUT_DIR [options]}
shift
mkdir -p /tmp/site "$out"
out=$(cd "$out" && pwd)
repo=$(pwd)
# (find fails on a folder that is not there, e.g. the stash of a machine released since)
parts=$( { find .gpu .gpu-stash /tmp/gpu-stash -name 'site.tar.xz.part-*' 2>/dev/null || true; } \
    | awk -F/ '{print $NF, $0}' | sort -u -k1,1 | cut -d' ' -f2)
if (($(wc -l <<<"$parts") != 2)); then
    echo "expected the two parts of site.tar.xz (the first call stashes one), found: $parts"
    exit 1
fi
# Python's tarfile, not xz(1), which a bare image may lack.
xargs cat <<<"$parts" | python3 -c '
import sys, tarfile
with tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz") as packed:
    packed.extractall("/tmp/site", **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))
'
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
    --target /tmp/site .
# TVM's CUDA runtime (tvm/lib/libtvm_runtime_cuda.so) needs libcudart.so.13, and TVM skips
# CUDA without a word when it cannot load it: point the loader at the CUDA runtime that torch's
# own wheels bring (the copy torch loads anyway), else at the toolkit's.
cudart=$(python3 -c '
import glob, site
dirs = [p + "/nvidia/cu13/lib" for p in site.getsitepackages()]
dirs += ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"]
print(next((d for d in dirs if glob.glob(d + "/libcudart.so.13*")), ""))
')
echo "libcudart.so.13 from: ${cudart:-not found, the default search path}"
if [[ -n $cudart ]]; then export LD_LIBRARY_PATH=$cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; fi
# nvcc 13.0 is on the GPU image and was seen building kernels that run there.
export PYTHONUNBUFFERED=1 TVM_DEFORM_CACHE_DIR=/tmp/tvm_deform_cache TVM_CUDA_COMPILE_MODE=nvcc
# Run from outside the repository: from its root, Python would import the source tree, which
# lacks the installed layout (schedules/ is installed as tvm_deform.schedules).
# Paths among the options (--round work/round1b) are taken from the repository root.
options=()
for option in "$@"; do
    if [[ $option != /* && -e $option ]]; then option=$repo/$option; fi
    options+=("$option")
done
cd /tmp
python3 "$repo/lab/gpu_session.py" --out "$out" ${options[@]+"${options[@]}"} 2>&1 | tee "$out/log.txt"
