#!/usr/bin/env bash
# Check, before any device call, that what each call would carry fits: the working tree that
# every call carries (tracked files and untracked ones git does not ignore) plus one of the
# given parts must stay under 60 MiB (the limit is 64 MiB), and no part may exceed 56 MiB.
#   bash tools/check_carry_sizes.sh [PART...]
set -euo pipefail
mib=$((1024 * 1024))
# (files deleted but still in git's index are skipped)
tree=$( (git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null || true) \
    | tail -1 | cut -f1)
echo "working tree: $((tree / 1024)) KiB"
status=0
for part in "$@"; do
    size=$(stat -c %s "$part")
    total=$((tree + size))
    echo "$part: $((size / 1024)) KiB, with the tree $((total / 1024)) KiB"
    if ((size > 56 * mib)); then echo "  too large: a part may carry at most 56 MiB"; status=1; fi
    if ((total > 60 * mib)); then echo "  too large: a call may carry at most 60 MiB"; status=1; fi
done
if ((tree > 20 * mib)); then echo "the working tree alone is over 20 MiB"; status=1; fi
exit $status
