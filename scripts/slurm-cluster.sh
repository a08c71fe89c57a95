#!/usr/bin/env bash
# A real two-node SLURM cluster on this machine, for meshrun's SLURM tests and for trying
# `launcher=slurm` without a cluster:
#
#   scripts/slurm-cluster.sh start    # install (Debian packages) if missing, start; idempotent
#   scripts/slurm-cluster.sh status   # exit 0 when both nodes answer
#   scripts/slurm-cluster.sh stop     # stop the daemons, remove namespaces and network
#   scripts/slurm-cluster.sh missing  # the Debian packages start would install (none: empty)
#
# Each node is a network namespace with its own address on a bridge (meshrun-node1 and -2,
# 10.87.0.1 and .2; the controller listens on the bridge, 10.87.0.254) and its own UTS
# namespace whose hostname is the node name, so that gloo advertises the node's address.
# One slurmd per namespace is started through nsenter (`ip netns exec` re-mounts /sys and
# slurmd then fails on cgroups). Accounting runs through slurmdbd + MariaDB, so that sacct
# (what submitit polls for job states) works. Needs root. Logs: /var/log/slurm/.
set -euo pipefail

CLUSTER=meshrun
NODES=(meshrun-node1 meshrun-node2)
SUBNET=10.87.0
BRIDGE=mrbr0
CTL_NAME=$(hostname -s)  # slurmctld runs only where its hostname is the SlurmctldHost
CTL_ADDR=$SUBNET.254
CONF=/etc/slurm/slurm.conf
DBD_CONF=/etc/slurm/slurmdbd.conf
LOGS=/var/log/slurm
HOSTS_MARK="# meshrun slurm-cluster"
DB_PASS=meshrun-local-only  # a local MariaDB user reachable from this host only

log() { echo "slurm-cluster: $*" >&2; }

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

missing_packages() {
    for tool in slurmctld:slurm-wlm slurmdbd:slurmdbd munged:munge mariadbd:mariadb-server \
        ip:iproute2 nsenter:util-linux; do
        command -v "${tool%%:*}" >/dev/null || echo "${tool##*:}"
    done
}

install_packages() {
    local missing
    mapfile -t missing < <(missing_packages)
    [ ${#missing[@]} -eq 0 ] && return
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # one apt at a time with .ci/run's Chromium install (apt-get update does not wait for a lock)
    flock /tmp/meshrun-apt.lock sh -c 'apt-get update -qq &&
        apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=600 "$@" \
        >/dev/null' apt "${missing[@]}"
}

write_config() {
    mkdir -p /etc/slurm "$LOGS" /var/spool/slurmctld /var/spool/slurmd
    cat >"$CONF" <<EOF
# Written by meshrun scripts/slurm-cluster.sh
ClusterName=$CLUSTER
SlurmctldHost=$CTL_NAME($CTL_ADDR)
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
MinJobAge=600
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
EOF
    local i
    for i in "${!NODES[@]}"; do
        echo "NodeName=${NODES[$i]} NodeAddr=$SUBNET.$((i + 1)) CPUs=$(nproc) RealMemory=4096 State=UNKNOWN" >>"$CONF"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >>"$CONF"
    cat >"$DBD_CONF" <<EOF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=/run/slurmdbd.pid
LogFile=$LOGS/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$DBD_CONF"
}

hosts_entries() {
    sed -i "/$HOSTS_MARK\$/d" /etc/hosts
    [ "${1:-}" = remove ] && return
    local i
    for i in "${!NODES[@]}"; do
        echo "$SUBNET.$((i + 1)) ${NODES[$i]} $HOSTS_MARK" >>/etc/hosts
    done
}

start_network() {
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge
        ip addr add "$CTL_ADDR/24" dev "$BRIDGE"
    fi
    ip link set "$BRIDGE" up
    local i node
    for i in "${!NODES[@]}"; do
        node=${NODES[$i]}
        [ -e "/run/netns/$node" ] || ip netns add "$node"
        if ! ip link show "mrv$i" >/dev/null 2>&1; then
            ip link add "mrv$i" type veth peer name eth0 netns "$node"
            ip link set "mrv$i" master "$BRIDGE" up
            ip -n "$node" addr add "$SUBNET.$((i + 1))/24" dev eth0
        fi
        ip -n "$node" link set lo up
        ip -n "$node" link set eth0 up
    done
}

start_services() {
    if ! alive /run/munge/munged.pid; then
        mkdir -p /run/munge && chown munge:munge /run/munge
        runuser -u munge -- /usr/sbin/munged
    fi
    if ! mariadb-admin ping >/dev/null 2>&1; then
        /etc/init.d/mariadb start >/dev/null
    fi
    mariadb <<EOF
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
EOF
    alive /run/slurmdbd.pid || slurmdbd
    wait_for "slurmdbd" timeout 5 sacctmgr -n list cluster
    sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER" ||
        sacctmgr -i add cluster "$CLUSTER" >/dev/null
    alive /run/slurmctld.pid || slurmctld
    local node
    for node in "${NODES[@]}"; do
        alive "/run/slurmd-$node.pid" ||
            nsenter --net="/run/netns/$node" unshare --uts \
                sh -c "hostname $node && exec slurmd -N $node"
    done
}

wait_for() {
    local what=$1 deadline=$((SECONDS + 60))
    shift
    while [ $SECONDS -lt $deadline ]; do
        "$@" >/dev/null 2>&1 && return
        sleep 0.5
    done
    log "$what did not come up (see $LOGS/)"
    exit 1
}

nodes_up() {
    local states
    states=$(timeout 5 sinfo -h -N -o '%N %T' 2>/dev/null) || return 1
    local node
    for node in "${NODES[@]}"; do
        echo "$states" | grep -Eq "^$node (idle|mixed|allocated|completing)\$" || return 1
    done
}

start() {
    install_packages
    write_config
    hosts_entries
    start_network
    start_services
    wait_for "nodes ${NODES[*]}" nodes_up
    log "up: $(sinfo -h -N -o '%N=%T' | tr '\n' ' ')(partition debug)"
}

kill_pidfile() {
    alive "$1" || return 0
    local pid
    pid=$(cat "$1")
    kill "$pid"
    for _ in $(seq 40); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.25
    done
    kill -9 "$pid" 2>/dev/null || true
}

stop() {
    command -v scancel >/dev/null && [ -f "$CONF" ] && scancel --full --quiet 2>/dev/null || true
    local node i
    for node in "${NODES[@]}"; do
        kill_pidfile "/run/slurmd-$node.pid"
    done
    kill_pidfile /run/slurmctld.pid
    kill_pidfile /run/slurmdbd.pid
    [ -x /etc/init.d/mariadb ] && /etc/init.d/mariadb stop >/dev/null 2>&1 || true
    kill_pidfile /run/munge/munged.pid
    for i in "${!NODES[@]}"; do
        ip link del "mrv$i" 2>/dev/null || true
        ip netns del "${NODES[$i]}" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    hosts_entries remove
    log "stopped"
}

case "${1:-}" in
start) start ;;
stop) stop ;;
missing) missing_packages ;;
status)
    if nodes_up; then
        sinfo -N -o '%N %T %c %m'
    else
        log "not running"
        exit 1
    fi
    ;;
*)
    echo "usage: $0 start|stop|status|missing" >&2
    exit 2
    ;;
esac
