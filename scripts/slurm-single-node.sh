#!/usr/bin/env bash
# A Slurm on this one host, for trying launch/slurm.py's jobs (Debian / Ubuntu, as root):
# installs Debian's slurm-wlm and munge with apt, writes a minimal slurm.conf, creates the
# munge key, starts munged, slurmctld and one slurmd per Slurm node (no systemd needed)
# and waits until `sinfo` shows every node idle. Idempotent: a second run with the
# daemons up and the same config only checks that the nodes are idle.
#
# The host is shown to Slurm as SLURM_NODES nodes (default 2: a job's trainer node and
# its engine node), named `hostname -s`-0, -1, ... (the host's name alone when
# SLURM_NODES=1), each a slurmd of its own (`slurmd -N`, its own port) with an equal share
# of the host's CPUs (at least 1) and of its memory (RealMemory from `free`), all at the
# host's address, in one partition "debug".
#
#   sudo scripts/slurm-single-node.sh           # then: sinfo; pytest tests/distributed/test_slurm_launcher.py
#   sudo SLURM_NODES=3 scripts/slurm-single-node.sh   # 2 trainer nodes + 1 engine node
#   sudo scripts/slurm-single-node.sh stop      # stop the daemons
#
# No accounting database (sacct has nothing): a job's end state is in
# /var/log/slurm/jobcomp.log (jobcomp/filetxt) and `scontrol show job` keeps it for an
# hour (MinJobAge). Processes are tracked without cgroups (proctrack/linuxproc,
# task/none): it runs in containers, and binds nothing to cores.
set -euo pipefail

CONF=/etc/slurm/slurm.conf
HOST=$(hostname -s)
NODES=${SLURM_NODES:-2}
[[ $NODES =~ ^[1-9][0-9]*$ ]] || { echo "SLURM_NODES=$NODES: give a count >= 1" >&2; exit 1; }
LOG_DIR=/var/log/slurm
STATE_DIR=/var/lib/slurm

die() { echo "slurm-single-node: $*" >&2; exit 1; }
alive() { [[ -f $1 ]] && kill -0 "$(cat "$1" 2>/dev/null)" 2>/dev/null; }

stop_daemons() {
    local pidfile
    for pidfile in /run/slurmd-*.pid /run/slurmctld.pid /run/munge/munged.pid; do
        if alive "$pidfile"; then
            kill "$(cat "$pidfile")"
            for _ in $(seq 50); do alive "$pidfile" || break; sleep 0.2; done
        fi
        rm -f "$pidfile"
    done
}

if [[ ${1:-} == stop ]]; then
    stop_daemons
    echo "slurm-single-node: munged, slurmctld and slurmd stopped"
    exit 0
fi
[[ $(id -u) == 0 ]] || die "run as root (it installs packages and starts daemons)"

# --- packages ---------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
        || ! command -v munged >/dev/null || ! command -v sbatch >/dev/null; then
    echo "slurm-single-node: installing slurm-wlm and munge (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends slurm-wlm munge
fi

# --- munge ------------------------------------------------------------------------------
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key

# --- slurm.conf ---------------------------------------------------------------------------
CPUS=$(( $(nproc) / NODES )); (( CPUS >= 1 )) || CPUS=1
MEM_MB=$(free -m | awk -v n="$NODES" '/^Mem:/ {print int($2 * 0.9 / n)}')
NODE_NAMES=() NODE_LINES=""
for ((i = 0; i < NODES; i++)); do
    name=$HOST-$i
    (( NODES == 1 )) && name=$HOST
    NODE_NAMES+=("$name")
    NODE_LINES+="NodeName=$name NodeHostname=$HOST NodeAddr=$HOST Port=$((6818 + i)) CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN"$'\n'
done
ALL_NODES=$(IFS=,; echo "${NODE_NAMES[*]}")
NEW_CONF=$(cat <<EOF
# written by scripts/slurm-single-node.sh: $NODES Slurm node(s) on this host, for testing
ClusterName=mlogra-dev
SlurmctldHost=$HOST
AuthType=auth/munge
SlurmUser=slurm
SlurmdUser=root
StateSaveLocation=$STATE_DIR/slurmctld
SlurmdSpoolDir=$STATE_DIR/slurmd-%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG_DIR/jobcomp.log
MinJobAge=3600
ReturnToService=2
KillWait=10
${NODE_LINES%$'\n'}
PartitionName=debug Nodes=$ALL_NODES Default=YES MaxTime=INFINITE State=UP
EOF
)
if [[ ! -f $CONF || $(cat "$CONF") != "$NEW_CONF" ]]; then
    echo "slurm-single-node: writing $CONF ($ALL_NODES: CPUs=$CPUS, RealMemory=$MEM_MB each)"
    stop_daemons  # a new config: start the daemons afresh
    install -d /etc/slurm
    printf '%s\n' "$NEW_CONF" > "$CONF"
fi
install -d -o slurm -g slurm "$LOG_DIR" "$STATE_DIR" "$STATE_DIR/slurmctld"

# --- daemons ------------------------------------------------------------------------------
if ! alive /run/munge/munged.pid; then
    runuser -u munge -- /usr/sbin/munged
fi
munge -n | unmunge >/dev/null || die "munge does not work: see /var/log/munge/munged.log"
alive /run/slurmctld.pid || slurmctld
for name in "${NODE_NAMES[@]}"; do
    install -d "$STATE_DIR/slurmd-$name"
    alive "/run/slurmd-$name.pid" || slurmd -N "$name"
done

# --- wait until every node is idle ----------------------------------------------------
states=""
for _ in $(seq 120); do
    states=$(sinfo -h -N -p debug -o "%N %T" 2>/dev/null || true)
    down=$(awk '$2 ~ /^(down|drain|fail)/ {print $1}' <<< "$states")
    for name in $down; do scontrol update NodeName="$name" State=RESUME 2>/dev/null || true; done
    ready=$(awk '$2 ~ /^(idle|mixed|allocated|planned)$/' <<< "$states" | wc -l)
    (( ready == NODES )) && break
    sleep 0.5
done
(( ready == NODES )) || die "not every node is up after 60 s (${states:-no nodes listed}): see \
$LOG_DIR/slurmctld.log and $LOG_DIR/slurmd-*.log"
sinfo
echo "slurm-single-node: up ($ALL_NODES)"
