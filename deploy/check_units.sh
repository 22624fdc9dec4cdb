#!/usr/bin/env bash
# Check the units with systemd's own tools (no running systemd needed):
#   systemd-analyze verify              no warnings, no errors
#   systemd-analyze security --offline  every service's exposure at most MAX_EXPOSURE (default 4.0)
# Used by .ci/run; tests/deploy/test_deploy.py makes the same checks where systemd-analyze is installed.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
MAX_EXPOSURE="${MAX_EXPOSURE:-4.0}"
command -v systemd-analyze >/dev/null || { echo "check_units.sh: systemd-analyze is not installed" >&2; exit 2; }
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
printf '#!/bin/sh\nexit 0\n' > "$WORK/ft" && chmod 755 "$WORK/ft"      # verify wants an executable ExecStart
bash "$HERE/install.sh" --prefix "$WORK/root" --ft-bin "$WORK/ft" --no-enable > /dev/null
UNITS="$WORK/root/etc/systemd/system"
for template in ft-gpu-worker@.service ft-cpu-worker@.service; do        # verify wants instances
    cp "$UNITS/$template" "$UNITS/${template/@./@0.}"
done
status=0
out="$(cd "$UNITS" && systemd-analyze verify ft.target ft-coordinator.service ft-gpu-worker@0.service \
    ft-cpu-worker@0.service 2>&1)" || status=1
if [ -n "$out" ] || [ "$status" != 0 ]; then
    echo "systemd-analyze verify:"; echo "$out"; status=1
fi
for unit in ft-coordinator.service ft-gpu-worker@.service ft-cpu-worker@.service; do
    level="$(systemd-analyze security --offline=yes "$HERE/$unit" 2>&1 | sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p')"
    if [ -z "$level" ] || awk -v l="$level" -v m="$MAX_EXPOSURE" 'BEGIN { exit !(l > m) }'; then
        echo "systemd-analyze security: $unit exposure ${level:-unknown} (at most $MAX_EXPOSURE)"; status=1
    else
        echo "$unit: exposure $level"
    fi
done
exit "$status"
