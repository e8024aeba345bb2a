#!/usr/bin/env bash
# Bring up a one-node SLURM cluster on this machine (slurmctld + slurmd on localhost),
# for CI and for trying the SLURM profile without a real cluster.
#
# Idempotent: installs Debian's slurm-wlm and munge when missing, (re)writes
# /etc/slurm/slurm.conf for this host (real CPU count and memory from `slurmd -C`),
# starts munged, slurmctld and slurmd when they are not running, and waits until
# `sinfo` shows the node idle. Needs root. No systemd, no cgroups, no accounting:
# made for containers and CI VMs. Stop it with scripts/slurm/stop-cluster.sh.
#
# Environment: SLURM_PARTITION (default: debug), SLURM_WAIT_S (default: 60),
#              SLURM_GPUS (default: 0; N > 0 declares N GPUs as gres/gpu with
#              /dev/nvidia0..N-1, for a one-node GPU box).
set -euo pipefail

PARTITION="${SLURM_PARTITION:-debug}"
WAIT_S="${SLURM_WAIT_S:-60}"
GPUS="${SLURM_GPUS:-0}"
CONF_DIR=/etc/slurm
CONF="$CONF_DIR/slurm.conf"

log() { echo "start-cluster: $*" >&2; }
die() { echo "start-cluster: error: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "needs root (it installs packages and starts daemons)"

# 1. Packages.
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    log "installing slurm-wlm and munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q slurm-wlm munge >/dev/null
fi

# 2. munge: key, directories, daemon.
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [ ! -s /etc/munge/munge.key ]; then
    log "creating /etc/munge/munge.key"
    if command -v mungekey >/dev/null; then
        mungekey --create --force --keyfile=/etc/munge/munge.key
    else
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged --force
    for _ in $(seq 1 50); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break
        sleep 0.1
    done
    munge -n | unmunge >/dev/null || die "munged does not answer"
fi

# 3. slurm.conf for this host.
HOST="$(hostname -s)"
NODE_LINE="$(slurmd -C | head -n 1)"          # NodeName=... CPUs=... RealMemory=...
case "$NODE_LINE" in NodeName=*) ;; *) die "unexpected 'slurmd -C' output: $NODE_LINE" ;; esac
NODE_LINE="${NODE_LINE/NodeName=* CPUs=/NodeName=$HOST CPUs=}"
GRES_LINE=""
if [ "$GPUS" -gt 0 ]; then
    NODE_LINE="$NODE_LINE Gres=gpu:$GPUS"
    GRES_LINE="GresTypes=gpu"
    : > "$CONF_DIR/gres.conf"
    for i in $(seq 0 $((GPUS - 1))); do
        echo "NodeName=$HOST Name=gpu File=/dev/nvidia$i" >> "$CONF_DIR/gres.conf"
    done
fi
install -d -m 0755 "$CONF_DIR"
install -d -o slurm -g slurm -m 0755 /var/spool/slurmctld /var/log/slurm /run/slurm
install -d -m 0755 /var/spool/slurmd
NEW_CONF="$(mktemp)"
cat > "$NEW_CONF" <<CONF
# Written by embedpipe scripts/slurm/start-cluster.sh: a one-node cluster on $HOST.
ClusterName=embedpipe
SlurmctldHost=$HOST
SlurmUser=slurm
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
# No cgroups in a container, no accounting database.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
SchedulerType=sched/backfill
ReturnToService=2
# Keep finished jobs visible to squeue long enough for Snakemake's status checks
# (the executor plugin queries squeue when sacct has no accounting behind it).
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=10
MpiDefault=none
$GRES_LINE
$NODE_LINE State=UNKNOWN
PartitionName=$PARTITION Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
CHANGED=0
if ! cmp -s "$NEW_CONF" "$CONF"; then
    install -m 0644 "$NEW_CONF" "$CONF"
    CHANGED=1
    log "wrote $CONF ($NODE_LINE)"
fi
rm -f "$NEW_CONF"
# Debian's slurm-wlm reads cgroup.conf only with cgroup plugins; none are used here.

running() { pgrep -x "$1" >/dev/null 2>&1; }

# 4. Daemons. A changed configuration restarts them.
if [ "$CHANGED" -eq 1 ]; then
    for d in slurmd slurmctld; do
        pid="$(cat "/run/slurm/$d.pid" 2>/dev/null || true)"
        if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
            log "restarting $d (configuration changed)"
            kill "$pid"
            for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
        fi
    done
fi
if ! running slurmctld; then
    log "starting slurmctld"
    /usr/sbin/slurmctld
fi
if ! running slurmd; then
    log "starting slurmd"
    /usr/sbin/slurmd
fi

# 5. Wait for the node to be idle (resume it when it came back down/drained).
deadline=$(( $(date +%s) + WAIT_S ))
while :; do
    state="$(sinfo -h -n "$HOST" -o '%t' 2>/dev/null | head -n 1 || true)"
    case "$state" in
        idle|mix|alloc) break ;;
        down*|drain*|drng*|unk*|"") 
            if [ -n "$state" ] && [ "${state#unk}" = "$state" ]; then
                scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
            fi ;;
    esac
    if [ "$(date +%s)" -ge "$deadline" ]; then
        tail -n 20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
        die "node $HOST is '$state' after ${WAIT_S}s (logs above)"
    fi
    sleep 1
done
log "cluster up: partition '$PARTITION', node $HOST ($state)"
sinfo
