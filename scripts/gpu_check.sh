#!/usr/bin/env bash
# One-GPU device check of miles.train, sized for about 5 minutes on one H200 (not yet run on
# one). Run it in a copy of the tree; it installs nothing and needs no network (torch,
# transformers and safetensors must be there; sglang and Transformer Engine may be missing).
# Prints one PASS/FAIL line per step and exits 1 when any step failed.
#
#   bash scripts/gpu_check.sh                # on a machine with one or more GPUs
#   bash scripts/gpu_check.sh --cpu          # the same steps on CPU at CI size (CI runs this)
#
# MILES_MEGATRON_WHEEL=/path/megatron_core-*.whl installs a carried megatron-core first
# (pip --no-deps --no-index). PYTHON picks the interpreter (default: python3).
set -uo pipefail
cd "$(dirname "$0")/.."

mode=()
if [ "${1:-}" = "--cpu" ]; then
    mode=(--cpu)
elif [ -n "${1:-}" ]; then
    echo "usage: bash scripts/gpu_check.sh [--cpu]" >&2
    exit 2
fi
python="${PYTHON:-python3}"
workdir="${MILES_DEVICE_CHECK_DIR:-$(mktemp -d -t miles-device-check.XXXXXX)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the tree itself, not an installed copy
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if [ -n "${MILES_MEGATRON_WHEEL:-}" ]; then
    "$python" -m pip install --quiet --no-deps --no-index "$MILES_MEGATRON_WHEEL" || exit 1
fi

failed=0
started=$SECONDS
# Without the expected device nothing else can run: stop at the first line.
"$python" -m miles.train.device_check platform "${mode[@]}" --workdir "$workdir/platform" || exit 1
for step in parity generate grpo megatron-parity megatron-grpo; do
    "$python" -m miles.train.device_check "$step" "${mode[@]}" --workdir "$workdir/$step" || failed=1
done

echo "device check: $([ $failed -eq 0 ] && echo passed || echo FAILED) in $((SECONDS - started))s (work dir $workdir)"
exit $failed
