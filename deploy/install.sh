#!/usr/bin/env bash
# Install the ft systemd units, the environment file and the pinned-memory limit; enable ft.target.
#
#   sudo deploy/install.sh                          # GPU worker 0, no CPU expert workers
#   sudo deploy/install.sh --cpu-workers auto       # + one CPU expert worker per NUMA node (cpu/hybrid)
#   deploy/install.sh --dry-run                     # print what it would do, change nothing
#   deploy/install.sh --prefix /tmp/root            # write the files under a prefix (no user, no systemctl)
#
# Options: --prefix DIR (default /), --dry-run, --user NAME (default ft), --ft-bin PATH (default
# /usr/local/bin/ft), --gpus "0" (GPU worker instances), --cpu-workers N|auto (default 0),
# --numa-nodes "0 1" (default: read /sys/devices/system/node), --no-enable.
# An existing /etc/ft/ft.env is kept (it holds the API key); the new one is written beside it as ft.env.new.
set -euo pipefail

PREFIX=/
DRY_RUN=0
SERVICE_USER=ft
FT_BIN=/usr/local/bin/ft
GPUS="0"
CPU_WORKERS=0
NUMA_NODES=""
ENABLE=1
HERE="$(cd "$(dirname "$0")" && pwd)"
UNITS=(ft.target ft-coordinator.service ft-gpu-worker@.service ft-cpu-worker@.service)

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "install.sh: error: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) PREFIX="${2:?--prefix needs a directory}"; shift 2 ;;
        --dry-run) DRY_RUN=1; shift ;;
        --user) SERVICE_USER="${2:?--user needs a name}"; shift 2 ;;
        --ft-bin) FT_BIN="${2:?--ft-bin needs a path}"; shift 2 ;;
        --gpus) GPUS="${2?--gpus needs a list}"; shift 2 ;;
        --cpu-workers) CPU_WORKERS="${2:?--cpu-workers needs N or auto}"; shift 2 ;;
        --numa-nodes) NUMA_NODES="${2:?--numa-nodes needs a list}"; shift 2 ;;
        --no-enable) ENABLE=0; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
done

case "$FT_BIN" in /*) ;; *) die "--ft-bin must be an absolute path (systemd needs one), got $FT_BIN" ;; esac
PREFIX="${PREFIX%/}"
ROOT_INSTALL=0
[ -z "$PREFIX" ] && ROOT_INSTALL=1
UNIT_DIR="$PREFIX/etc/systemd/system"
ENV_DIR="$PREFIX/etc/ft"
LIMITS_FILE="$PREFIX/etc/security/limits.d/ft.conf"

if [ -z "$NUMA_NODES" ]; then
    NUMA_NODES="$(ls -d /sys/devices/system/node/node[0-9]* 2>/dev/null | sed 's#.*/node##' | sort -n | tr '\n' ' ')"
    NUMA_NODES="${NUMA_NODES:-0}"
fi
read -r -a NODES <<< "$NUMA_NODES"
if [ "$CPU_WORKERS" = auto ]; then
    CPU_WORKERS=${#NODES[@]}
fi
case "$CPU_WORKERS" in ''|*[!0-9]*) die "--cpu-workers must be a number or auto, got $CPU_WORKERS" ;; esac

say() { echo "$*"; }
run() {                         # a command that changes the system
    if [ "$DRY_RUN" = 1 ]; then echo "would run: $*"; else echo "+ $*"; "$@"; fi
}
put() {                         # put DEST MODE < content
    local dest="$1" mode="$2" tmp
    tmp="$(mktemp)"
    cat > "$tmp"
    if [ "$DRY_RUN" = 1 ]; then
        echo "would write $dest (mode $mode, $(wc -l < "$tmp") lines)"
        rm -f "$tmp"
        return
    fi
    mkdir -p "$(dirname "$dest")"
    install -m "$mode" "$tmp" "$dest"
    rm -f "$tmp"
    echo "wrote $dest"
}
unit_text() {                   # the unit with this install's binary and user
    sed -e "s#/usr/local/bin/ft #$FT_BIN #" -e "s#^User=ft\$#User=$SERVICE_USER#" \
        -e "s#^Group=ft\$#Group=$SERVICE_USER#" "$HERE/$1"
}

# 1. the service user (in the video and render groups for /dev/nvidia* and /dev/dri)
if [ "$ROOT_INSTALL" = 1 ]; then
    if id -u "$SERVICE_USER" >/dev/null 2>&1; then
        say "user $SERVICE_USER exists"
    else
        run useradd --system --user-group --home-dir /var/lib/ft --create-home --shell /usr/sbin/nologin "$SERVICE_USER"
    fi
    for group in video render; do
        if getent group "$group" >/dev/null; then run usermod -aG "$group" "$SERVICE_USER"; fi
    done
else
    say "skipped (prefix $PREFIX): creating user $SERVICE_USER"
fi

# 2. the units
for unit in "${UNITS[@]}"; do
    unit_text "$unit" | put "$UNIT_DIR/$unit" 0644
done

# 3. NUMA placement of the CPU expert workers (only where there are several nodes to choose from)
if [ "$CPU_WORKERS" -gt 0 ] && [ "${#NODES[@]}" -gt 1 ]; then
    for ((i = 0; i < CPU_WORKERS; i++)); do
        node="${NODES[$((i % ${#NODES[@]}))]}"
        dropin="$UNIT_DIR/ft-cpu-worker@$i.service.d/numa.conf"
        printf '%s\n' "# written by deploy/install.sh: CPU expert worker $i on NUMA node $node" "[Service]" \
            "CPUAffinity=numa" "NUMAPolicy=preferred" "NUMAMask=$node" | put "$dropin" 0644
    done
else
    say "no NUMA drop-ins (${#NODES[@]} node(s), $CPU_WORKERS CPU worker(s)): the workers split the cores themselves"
fi

# 4. the environment file (kept if present: it holds the API key)
if [ -e "$ENV_DIR/ft.env" ]; then
    say "kept $ENV_DIR/ft.env; the shipped one goes to $ENV_DIR/ft.env.new"
    sed "s/^FT_NUM_CPU_WORKERS=.*/FT_NUM_CPU_WORKERS=$CPU_WORKERS/" "$HERE/ft.env" | put "$ENV_DIR/ft.env.new" 0640
else
    sed "s/^FT_NUM_CPU_WORKERS=.*/FT_NUM_CPU_WORKERS=$CPU_WORKERS/" "$HERE/ft.env" | put "$ENV_DIR/ft.env" 0640
fi
if [ "$ROOT_INSTALL" = 1 ]; then
    run chown "root:$SERVICE_USER" "$ENV_DIR/ft.env"
fi

# 5. pinned memory: the units set LimitMEMLOCK=infinity; this covers `ft` run by hand as the user
printf '# written by deploy/install.sh: cudaHostRegister pins the whole expert store\n%s - memlock unlimited\n' \
    "$SERVICE_USER" | put "$LIMITS_FILE" 0644

# 6. enable the target and its instances
ENABLE_UNITS=(ft.target ft-coordinator.service)
for gpu in $GPUS; do ENABLE_UNITS+=("ft-gpu-worker@$gpu.service"); done
for ((i = 0; i < CPU_WORKERS; i++)); do ENABLE_UNITS+=("ft-cpu-worker@$i.service"); done
if [ "$ENABLE" = 0 ]; then
    say "not enabling (--no-enable): ${ENABLE_UNITS[*]}"
elif [ "$ROOT_INSTALL" = 1 ]; then
    run systemctl daemon-reload
    run systemctl enable "${ENABLE_UNITS[@]}"
    say "start with: systemctl start ft.target   (edit /etc/ft/ft.env first: model path, ports, API key)"
else
    say "skipped (prefix $PREFIX): systemctl daemon-reload; systemctl enable ${ENABLE_UNITS[*]}"
fi
