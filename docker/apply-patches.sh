#!/usr/bin/env bash
# Apply every *.patch in PATCH_DIR, in name order, to the source tree TARGET.
#
# usage: apply-patches.sh PATCH_DIR TARGET
#
# A patch that is already in the tree (it applies in reverse) is reported and skipped, so a
# rebuild on a patched tree or an upstream release that merged the fix does not fail. A patch
# that neither applies nor is already there stops the build with git's reason.
set -euo pipefail

if [[ $# -ne 2 ]]; then
    echo "usage: $0 PATCH_DIR TARGET" >&2
    exit 2
fi
patch_dir=$(cd "$1" && pwd)
target=$2
if [[ ! -d "$target" ]]; then
    echo "error: patch target $target is not a directory" >&2
    exit 2
fi
cd "$target"

shopt -s nullglob
patches=("$patch_dir"/*.patch)
if [[ ${#patches[@]} -eq 0 ]]; then
    echo "apply-patches: no patches in $patch_dir"
    exit 0
fi
for patch in "${patches[@]}"; do
    name=$(basename "$patch")
    if git apply --check "$patch" 2>/dev/null; then
        git apply "$patch"
        echo "applied: $name"
    elif git apply --reverse --check "$patch" 2>/dev/null; then
        echo "already applied, skipped: $name"
    else
        echo "error: $name does not apply to $target and is not already applied;" \
            "rebase it on the new source or delete it if upstream fixed the problem differently" >&2
        git apply --check "$patch" >&2 || true
        exit 1
    fi
done
