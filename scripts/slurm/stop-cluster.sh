#!/usr/bin/env bash
# Stop the one-node SLURM cluster started by scripts/slurm/start-cluster.sh:
# slurmd, slurmctld and munged, by their pid files. Leaves packages and config in place.
set -uo pipefail

stop() {  # name pidfile
    local name="$1" pidfile="$2" pid
    [ -s "$pidfile" ] || return 0
    pid="$(cat "$pidfile")"
    if kill -0 "$pid" 2>/dev/null; then
        echo "stop-cluster: stopping $name ($pid)" >&2
        kill "$pid"
        for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    fi
    rm -f "$pidfile"
}

[ "$(id -u)" -eq 0 ] || { echo "stop-cluster: error: needs root" >&2; exit 1; }
stop slurmd /run/slurm/slurmd.pid
stop slurmctld /run/slurm/slurmctld.pid
if [ "${1:-}" != "--keep-munge" ]; then
    stop munged /run/munge/munged.pid
fi
exit 0
