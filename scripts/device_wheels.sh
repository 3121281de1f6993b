#!/usr/bin/env bash
# Prepare the wheels scripts/device_check.sh installs on a GPU machine that has no network.
#
#   scripts/device_wheels.sh [out-dir]          (default out-dir: .device-wheels, git-ignored)
#
# Run it from a checkout where PyPI is reachable and tierlm is installed the CI way (pip install -r wheels/cpu.txt):
# the versions pinned are the ones installed here, i.e. the ones CI tests. It downloads manylinux x86_64 wheels
# (cp312 and cp311, plus py3-none-any ones) of tierlm's dependencies and the test tools, their dependencies
# included, and never torch, triton, nvidia-* or numpy, which a GPU machine's torch install already has.
# Writes <out-dir>/requirements.txt (the pins) and prints the folder's size: carry the folder to the device
# machine (device tool: carry [".device-wheels"]); the whole working tree that travels must stay under 64 MiB.
#
# Environment: PYTHON (default python3), DEVICE_WHEELS_PYTHONS (default "3.12 3.11"; 3.12 is the device image's).
set -euo pipefail
cd "$(dirname "$0")/.."

out="${1:-.device-wheels}"
python="${PYTHON:-python3}"
pythons="${DEVICE_WHEELS_PYTHONS:-3.12 3.11}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# A pip configuration may name local indexes this machine lacks: keep their warnings out of the report.
quiet() { "$@" 2> >(grep -v "is neither a file nor a directory" >&2); }

mkdir -p "$out"
# The pins: tierlm's requirements and the test tools, with everything they need, at the versions installed here.
"$python" scripts/device_deps.py closure > "$out/requirements.txt"
echo "$(grep -c . "$out/requirements.txt") distributions pinned in $out/requirements.txt"

# pip matches each manylinux_2_N tag exactly: name every glibc from 2.17 (manylinux2014) to 2.39 (Ubuntu 24.04).
platforms=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for n in $(seq 17 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done

status=0
for v in $pythons; do
  echo "== wheels for CPython $v"
  if ! quiet "$python" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version "$v" \
        "${platforms[@]}" -d "$out" -r "$out/requirements.txt"; then
    # One call failed: retry one by one so the report names the distributions without a wheel.
    while read -r req; do
      "$python" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version "$v" \
        "${platforms[@]}" -d "$out" "$req" >/dev/null 2>&1 || { echo "   no wheel for CPython $v: $req" >&2; \
        [[ $v == 3.12 ]] && status=1; }
    done < "$out/requirements.txt"
  fi
done

# Never torch and what comes with it: the GPU machine's own build must stay the one that runs.
if ls "$out" | grep -Ei '^(torch|triton|nvidia_|numpy)-' >&2; then
  echo "error: torch/triton/nvidia/numpy wheels in $out: remove them" >&2
  exit 1
fi
count=$(ls "$out"/*.whl | wc -l)
size_kib=$(du -sk "$out" | cut -f1)
echo "$count wheels in $out: $((size_kib / 1024)) MiB ($size_kib KiB)"
if (( size_kib > 56 * 1024 )); then
  echo "warning: over 56 MiB; with the repository the device tool's 64 MiB limit may be exceeded" >&2
fi
exit $status
