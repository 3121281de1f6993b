#!/usr/bin/env bash
# The GPU check (docs/device-check.md): tierlm's device suites and benchmarks on one NVIDIA GPU, no network.
#
#   bash scripts/device_check.sh                 on the GPU machine; report in $OUT (else ./device-report/)
#   bash scripts/device_check.sh --dry-run       the same steps on this CPU, smaller (DEVICE_CHECK_DRY_RUN=1)
#
# Wheels for what the machine lacks come from .device-wheels/ (scripts/device_wheels.sh). PYTHON picks the
# interpreter (default: python3, the one that has torch on the device machine). Options: scripts/device_check.py.
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/device_check.py "$@"
