#!/usr/bin/env bash
# Device check of miles.train on one or more GPUs, sized for under 10 minutes on one H200 (not
# yet run on one: every GPU figure in it is untested on GPU). Run it in a copy of the tree; it
# needs no network. A bare machine needs Python 3.12 and torch: carry everything else as wheels
# in MILES_WHEELS (transformers, safetensors, megatron-core, sglang and its kernels,
# torch-memory-saver, ...). A step whose package is missing prints SKIP with the package's
# name; one that needs a second GPU, or a GPU in the CPU form, says so too.
# Prints one PASS/FAIL/SKIP line per check and exits 1 when any check failed.
#
#   bash scripts/gpu_check.sh                # on a machine with one or more GPUs
#   bash scripts/gpu_check.sh --cpu          # the same steps on CPU at CI size (CI runs this)
#   bash scripts/gpu_check.sh --dry-gpus N   # the GPU form on any machine, N GPUs faked (CI runs 1 and 2)
#
# --dry-gpus is the only place GPU visibility is faked: nothing runs on a device; every package
# check runs for real, and every training step puts the exact command of its GPU form through
# the trainer's start checks before it is skipped, saying it needs a GPU.
# MILES_WHEELS=/dir installs every wheel in /dir first (pip --no-deps --no-index);
# MILES_MEGATRON_WHEEL=/path/megatron_core-*.whl installs one carried megatron-core.
# PYTHON picks the interpreter (default: python3).
set -uo pipefail
cd "$(dirname "$0")/.."

usage="usage: bash scripts/gpu_check.sh [--cpu | --dry-gpus N]"
mode=()
if [ "${1:-}" = "--cpu" ] && [ $# -eq 1 ]; then
    mode=(--cpu)
elif [ "${1:-}" = "--dry-gpus" ] && [ $# -eq 2 ] && [[ "$2" =~ ^[1-9][0-9]*$ ]]; then
    mode=(--dry-gpus "$2")
elif [ $# -gt 0 ]; then
    echo "$usage" >&2
    exit 2
fi
python="${PYTHON:-python3}"
workdir="${MILES_DEVICE_CHECK_DIR:-$(mktemp -d -t miles-device-check.XXXXXX)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the tree itself, not an installed copy
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if [ -n "${MILES_WHEELS:-}" ]; then
    shopt -s nullglob
    wheels=("$MILES_WHEELS"/*.whl)
    shopt -u nullglob
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "MILES_WHEELS=$MILES_WHEELS holds no .whl files" >&2
        exit 2
    fi
    "$python" -m pip install --quiet --no-deps --no-index "${wheels[@]}" || exit 1
fi
if [ -n "${MILES_MEGATRON_WHEEL:-}" ]; then
    "$python" -m pip install --quiet --no-deps --no-index "$MILES_MEGATRON_WHEEL" || exit 1
fi

failed=0
started=$SECONDS
log="$workdir/verdicts.log"
mkdir -p "$workdir" && : > "$log"
# Without the expected device nothing else can run: stop at the first line.
"$python" -m miles.ci.machine.device_check platform "${mode[@]}" --workdir "$workdir/platform" | tee -a "$log"
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
for step in parity generate grpo megatron-parity megatron-grpo sglang sglang-grpo megatron-moe multi-gpu; do
    "$python" -m miles.ci.machine.device_check "$step" "${mode[@]}" --workdir "$workdir/$step" | tee -a "$log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
done

skipped=$(grep -c '^SKIP' "$log")
echo "device check: $([ $failed -eq 0 ] && echo passed || echo FAILED) in $((SECONDS - started))s, $skipped step(s) skipped (work dir $workdir)"
exit $failed
