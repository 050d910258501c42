#!/usr/bin/env bash
# Check, before any device call, that what each call would carry fits: the working tree that
# every call carries (tracked files and untracked ones git does not ignore) plus one of the
# given parts, plus ROUND if set (a round of tuning candidates carried beside the part, packed
# or its directory), must stay under CALL_MIB (default 60, under a 64 MiB transfer limit), and no part may
# exceed PART_MIB (default 40).
#   [CALL_MIB=60] [PART_MIB=40] [ROUND=work/round1.tar.xz] bash lab/check_carry_sizes.sh [PART...]
set -euo pipefail
mib=$((1024 * 1024))
call_mib=${CALL_MIB:-60}
part_mib=${PART_MIB:-40}
# (files deleted but still in git's index are skipped)
tree=$( (git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null || true) \
    | tail -1 | cut -f1)
echo "working tree: $((tree / 1024)) KiB"
round=0
if [[ -n ${ROUND:-} ]]; then
    round=$(du -sb "$ROUND" | cut -f1)
    echo "round $ROUND: $((round / 1024)) KiB"
fi
status=0
for part in "$@"; do
    size=$(stat -c %s "$part")
    total=$((tree + size + round))
    echo "$part: $((size / 1024)) KiB, with the tree${ROUND:+ and the round} $((total / 1024)) KiB"
    if ((size > part_mib * mib)); then
        echo "  too large: a part may carry at most $part_mib MiB"; status=1
    fi
    if ((total > call_mib * mib)); then
        echo "  too large: a call may carry at most $call_mib MiB"; status=1
    fi
done
if (($# == 0 && tree + round > call_mib * mib)); then
    echo "too large: a call may carry at most $call_mib MiB"; status=1
fi
if ((tree > 20 * mib)); then echo "the working tree alone is over 20 MiB"; status=1; fi
exit $status
