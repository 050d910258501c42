#!/usr/bin/env bash
# Rehearse a GPU session's two device calls here, on the CPU, with the same scripts: pack TVM's
# install in two parts (for this machine's Python), run the first call's command
# (lab/gpu_stash.sh) with the first part in .gpu/, then the second call's (lab/gpu_session.sh)
# with the second part there and the session on the CPU (--device cpu --quick). Runs in a
# clone of the repository (its committed tree, as a device call carries it) in a scratch
# directory, with this checkout's .venv first on PATH (torch comes from there, as from the GPU
# image there), or the virtual environment VENV names (e.g. one with the GPU machine's torch).
#   [VENV=DIR] bash lab/rehearse_gpu_session.sh [OUT_DIR]
set -euo pipefail
root=$(pwd)
venv=$(realpath "${VENV:-$root/.venv}")
if [[ ! -x $venv/bin/python3 ]]; then echo "no virtual environment at $venv" >&2; exit 1; fi
work=$(mktemp -d)
out=${1:-$work/out}
trap 'rm -rf "$work/repo" /tmp/site /tmp/gpu-stash' EXIT
git clone -q "$root" "$work/repo"
cd "$work/repo"
export PATH="$venv/bin:$PATH"
version=$(python3 -c 'import sys; print(f"{sys.version_info.major}.{sys.version_info.minor}")')
bash lab/pack_gpu_wheels.sh "$version"
# A small round of candidates for this CPU (built by this checkout's tvm-deform, on PATH),
# timed in both calls as a GPU's rounds are.
tvm-deform tune-round --workload seed --count 2 --work-dir "$work/tune" --out work/round
parts=(.gpu/site.tar.xz.part-*)
if ((${#parts[@]} != 2)); then echo "expected two parts, got ${#parts[@]}"; exit 1; fi
mkdir -p "$work/later"
mv "${parts[1]}" "$work/later/"
rm -rf /tmp/site /tmp/gpu-stash
mkdir -p "$out"
bash lab/gpu_stash.sh && python3 lab/time_round.py work/round.tar.xz --out "$out/round1.jsonl"
mv "$work/later/$(basename "${parts[1]}")" .gpu/
bash lab/gpu_session.sh "$out" --device cpu --quick --checks 2 --round work/round.tar.xz
python3 - "$out" <<'PY'
import json, sys
results = json.load(open(f"{sys.argv[1]}/gpu_results.json"))
failed = [step for step, entry in results.items() if isinstance(entry, dict) and entry.get("ok") is False]
paths = results["environment"]["value"]
installed = all(paths[k].startswith("/tmp/site/") for k in ("tvm_path", "tvm_deform_path"))
if not ((results.get("round") or {}).get("value") or {}).get("timed"):
    failed.append("round (nothing timed)")
timed_first = sum('"run_secs"' in line for line in open(f"{sys.argv[1]}/round1.jsonl"))
if not timed_first:
    failed.append("the first call's round (nothing timed)")
print("rehearsal:", "steps failed: " + ", ".join(failed) if failed else "every step passed")
print("packages imported from the install in /tmp/site:", installed, paths)
sys.exit(1 if failed or not installed else 0)
PY
