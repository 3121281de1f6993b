#!/usr/bin/env bash
# Build an offline wheelhouse from one install set, for an air-gapped machine.
#
#   wheels/build_wheelhouse.sh <set> [out-dir]        e.g.  wheels/build_wheelhouse.sh nvidia-arm64-cu130
#
# Run it from the repository root on a connected machine with the SAME OS, CPU architecture and Python
# version as the target (pip downloads wheels for the interpreter running it). Then copy out-dir over and run
#
#   pip install --no-index --find-links <out-dir> -r <out-dir>/requirements.txt
#
# The set's "-e ." line becomes a built tierlm wheel (with the same extras), so the target needs no checkout.
set -euo pipefail

set_name="${1:?usage: wheels/build_wheelhouse.sh <cpu|nvidia-x86_64-cu130|nvidia-arm64-cu130|apple-silicon> [out-dir]}"
set_file="wheels/${set_name%.txt}.txt"
out="${2:-wheelhouse/${set_name%.txt}}"
python="${PYTHON:-python3}"

[[ -f pyproject.toml && -f "$set_file" ]] || { echo "run from the repository root; no $set_file here" >&2; exit 2; }
mkdir -p "$out"

# tierlm itself as a wheel (setuptools leaves a build/ folder behind: remove it unless it was already there).
[[ -e build ]] && keep_build=1 || keep_build=0
"$python" -m pip wheel --no-deps --wheel-dir "$out" . >/dev/null
[[ $keep_build == 1 ]] || rm -rf build
version="$("$python" -c 'import tomllib;print(tomllib.load(open("pyproject.toml","rb"))["project"]["version"])' 2>/dev/null \
  || "$python" -c 'from importlib.metadata import version;print(version("tierlm"))')"
wheel="$(ls "$out"/tierlm-"$version"-*.whl | head -n1)"

# requirements.txt for the target: the set's requirement lines (no options, no "-e ."), plus tierlm pinned
# with the same extras.
extras="$(sed -nE 's/^-e \.(\[[^]]*\])?.*$/\1/p' "$set_file" | head -n1)"
grep -vE '^\s*(-|#|$)' "$set_file" > "$out/requirements.txt"
echo "tierlm${extras}==${version}" >> "$out/requirements.txt"

# Download every dependency (index options in the set are honoured: e.g. the cu130 index for torch).
grep -E '^\s*--(extra-)?index-url' "$set_file" | tr '\n' ' ' > "$out/.index-options" || true
# shellcheck disable=SC2046
"$python" -m pip download --dest "$out" $(cat "$out/.index-options") \
  -r <(grep -v '^tierlm' "$out/requirements.txt") "${wheel}${extras}"
rm -f "$out/.index-options"
echo "wheelhouse ready: $out  (install: pip install --no-index --find-links $out -r $out/requirements.txt)"
