#!/usr/bin/env bash
# A single-node Slurm 22.05 cluster on loopback, with accounting, for development and tests.
#
#   scripts/dev-cluster.sh start    install (if missing) and start; no-op when already up
#   scripts/dev-cluster.sh stop     cancel every job, then stop the daemons
#   scripts/dev-cluster.sh status   sinfo and daemon pids; exit 0 when up, 3 when not
#   scripts/dev-cluster.sh restart  stop then start (fresh state)
#
# Runs as root, needs no systemd.  Every `start` that actually starts the daemons begins
# from fresh state: the slurmctld state directory is wiped AND the accounting database
# dropped together (job ids restart at 1, so keeping either alone mixes old and new jobs).
#
# Layout:
#   /etc/slurm/{slurm,gres,slurmdbd}.conf   written by this script (marked; a foreign
#                                           slurm.conf is never overwritten)
#   $TANGRAM_DEVCLUSTER_DIR (default /var/lib/tangram-devcluster)
#       state/ spool/  slurmctld state and slurmd spool (wiped each start)
#       mysql/         MariaDB data directory (socket only, no TCP)
#       run/           pid files and the MariaDB socket
#       log/           daemon logs (truncated each start)
#
# The node: NodeName=localhost (127.0.0.1), $TANGRAM_DEVCLUSTER_CPUS CPUs (default 16,
# more than the machine has, allowed by SlurmdParameters=config_overrides),
# $TANGRAM_DEVCLUSTER_MEM_MB memory (default 16000) and 4 fake GPUs through gres backed
# by character devices.  Partitions: `cpu` (default) and `gpu`, same node.
set -euo pipefail

BASE=${TANGRAM_DEVCLUSTER_DIR:-/var/lib/tangram-devcluster}
ETC=${TANGRAM_DEVCLUSTER_ETC:-/etc/slurm}
CPUS=${TANGRAM_DEVCLUSTER_CPUS:-16}
MEM_MB=${TANGRAM_DEVCLUSTER_MEM_MB:-16000}
TIMEOUT=${TANGRAM_DEVCLUSTER_TIMEOUT:-60}
CLUSTER=tangram-dev
MARKER="# managed by tangram-hpc scripts/dev-cluster.sh"
PACKAGES=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server)
MYSQL_SOCK=$BASE/run/mysqld.sock

log() { echo "dev-cluster: $*" >&2; }
die() { echo "dev-cluster: error: $*" >&2; exit 1; }

pid_alive() {  # pid_alive FILE -> 0 when the pid in FILE is a live process
    [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

PIDFILES=(
    "munged:/run/munge/munged.pid"
    "mariadbd:$BASE/run/mariadbd.pid"
    "slurmdbd:$BASE/run/slurmdbd.pid"
    "slurmctld:$BASE/run/slurmctld.pid"
    "slurmd:$BASE/run/slurmd.pid"
)

wait_for() {  # wait_for SECONDS WHAT CMD... -> polls CMD every 0.1 s
    local secs=$1 what=$2; shift 2
    local deadline=$((SECONDS + secs))
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            die "timed out after ${secs}s waiting for $what (logs in $BASE/log)"
        fi
        sleep 0.1
    done
}

port_listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

ensure_packages() {
    local missing=()
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    ((${#missing[@]} == 0)) && return 0
    [[ $(id -u) == 0 ]] || die "packages missing (${missing[*]}) and not root"
    log "installing ${missing[*]}"
    # apt starts no daemon here (no systemd); policy-rc.d keeps it that way under sysvinit too.
    local rc_d=/usr/sbin/policy-rc.d created=0
    if [[ ! -e $rc_d ]]; then printf '#!/bin/sh\nexit 101\n' >"$rc_d"; chmod +x "$rc_d"; created=1; fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null; }
    ((created)) && rm -f "$rc_d"
    return 0
}

write_config() {
    mkdir -p "$ETC"
    if [[ -e $ETC/slurm.conf ]] && ! grep -qF "$MARKER" "$ETC/slurm.conf"; then
        die "$ETC/slurm.conf exists and was not written by this script; refusing to overwrite it"
    fi
    cat >"$ETC/slurm.conf" <<EOF
$MARKER
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmUser=root
AuthType=auth/munge
MailProg=/bin/true
MpiDefault=none
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups on these machines
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=256
SlurmdParameters=config_overrides
ReturnToService=2
# fast turnaround for tests: no 3 s batch delay, short kill wait, quick cleanup
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
KillWait=5
MinJobAge=300
InactiveLimit=0
MessageTimeout=10
GresTypes=gpu
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=5
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStorageTRES=gres/gpu
JobCompType=jobcomp/none
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB Gres=gpu:4 State=UNKNOWN
PartitionName=cpu Nodes=localhost Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=localhost Default=NO MaxTime=INFINITE State=UP
EOF
    # Fake GPUs: gres needs existing character devices (regular files are rejected).
    cat >"$ETC/gres.conf" <<EOF
$MARKER
AutoDetect=off
NodeName=localhost Name=gpu File=/dev/null,/dev/zero,/dev/full,/dev/urandom
EOF
    cat >"$ETC/slurmdbd.conf" <<EOF
$MARKER
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
PidFile=$BASE/run/slurmdbd.pid
LogFile=$BASE/log/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$ETC/slurmdbd.conf"
}

start_munge() {
    pid_alive /run/munge/munged.pid && return 0
    install -d -o munge -g munge -m 0755 /run/munge
    # munged refuses to run as root
    runuser -u munge -- /usr/sbin/munged
    wait_for "$TIMEOUT" "munged" test -S /run/munge/munge.socket.2
}

mariadb_up() { mariadb-admin --socket="$MYSQL_SOCK" -u root ping; }

start_mariadb() {
    if ! pid_alive "$BASE/run/mariadbd.pid"; then
        if [[ ! -d $BASE/mysql/mysql ]]; then
            log "initialising MariaDB in $BASE/mysql"
            install -d -o mysql -g mysql "$BASE/mysql"
            mariadb-install-db --user=mysql --datadir="$BASE/mysql" --auth-root-authentication-method=socket \
                --skip-test-db >"$BASE/log/mariadb-install.log" 2>&1 || die "mariadb-install-db failed; see $BASE/log/mariadb-install.log"
        fi
        chown mysql:mysql "$BASE/run"
        setsid /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$BASE/mysql" --skip-networking \
            --socket="$MYSQL_SOCK" --pid-file="$BASE/run/mariadbd.pid" --log-error="$BASE/log/mariadb.log" \
            --innodb-buffer-pool-size=64M </dev/null >/dev/null 2>&1 &
    fi
    wait_for "$TIMEOUT" "MariaDB socket $MYSQL_SOCK" mariadb_up
}

slurm_up() {
    for entry in "${PIDFILES[@]}"; do pid_alive "${entry#*:}" || return 1; done
    scontrol ping 2>/dev/null | grep -q "is UP"
}

node_idle() { [[ $(sinfo -h -n localhost -o %T 2>/dev/null | head -1) == idle ]]; }

cmd_start() {
    [[ $(id -u) == 0 ]] || die "start needs root"
    if slurm_up; then log "already running"; return 0; fi
    ensure_packages
    # half-up (a daemon died): begin again from nothing
    stop_daemons quiet
    mkdir -p "$BASE/run" "$BASE/log"
    write_config
    : >"$BASE/log/slurmctld.log"; : >"$BASE/log/slurmd.log"; : >"$BASE/log/slurmdbd.log"
    rm -rf "$BASE/state" "$BASE/spool"
    mkdir -p "$BASE/state" "$BASE/spool"

    start_munge
    start_mariadb
    # fresh accounting together with the fresh controller state
    mariadb --socket="$MYSQL_SOCK" -u root -e "DROP DATABASE IF EXISTS slurm_acct_db" \
        || die "could not drop the accounting database"
    # slurmdbd reaches MariaDB through the unix socket named here
    MYSQL_UNIX_PORT=$MYSQL_SOCK /usr/sbin/slurmdbd
    # slurmdbd returns before it listens; slurmctld on fresh state must find it
    wait_for "$TIMEOUT" "slurmdbd on port 6819" port_listening 6819
    /usr/sbin/slurmctld -i
    wait_for "$TIMEOUT" "slurmctld" bash -c 'scontrol ping | grep -q "is UP"'
    /usr/sbin/slurmd -N localhost
    wait_for "$TIMEOUT" "node localhost to become idle" node_idle
    log "up: $(sinfo -h -o '%P %D %T %C' | tr '\n' ';')"
}

stop_daemons() {
    local quiet=${1:-}
    # Running jobs survive a killed slurmd: cancel them first, while slurmctld is up.
    if pid_alive "$BASE/run/slurmctld.pid"; then
        local ids
        ids=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ' || true)
        if [[ -n ${ids// /} ]]; then
            # shellcheck disable=SC2086
            scancel $ids 2>/dev/null || true
            local deadline=$((SECONDS + 15))
            while ((SECONDS < deadline)) && [[ -n $(squeue -h -t R,CG,PD -o %i 2>/dev/null) ]]; do sleep 0.2; done
        fi
    fi
    local i
    for ((i = ${#PIDFILES[@]} - 1; i >= 0; i--)); do
        local name=${PIDFILES[i]%%:*} file=${PIDFILES[i]#*:}
        if pid_alive "$file"; then
            local pid; pid=$(cat "$file")
            [[ -n $quiet ]] || log "stopping $name ($pid)"
            kill "$pid" 2>/dev/null || true
            local deadline=$((SECONDS + 20))
            while kill -0 "$pid" 2>/dev/null; do
                if ((SECONDS >= deadline)); then kill -9 "$pid" 2>/dev/null || true; break; fi
                sleep 0.1
            done
        fi
        rm -f "$file"
    done
}

cmd_stop() {
    [[ $(id -u) == 0 ]] || die "stop needs root"
    stop_daemons
    log "stopped"
}

cmd_status() {
    local up=0
    for entry in "${PIDFILES[@]}"; do
        local name=${entry%%:*} file=${entry#*:}
        if pid_alive "$file"; then printf '%-10s pid %s\n' "$name" "$(cat "$file")"
        else printf '%-10s not running\n' "$name"; up=3; fi
    done
    if ((up == 0)); then sinfo; else return 3; fi
}

case ${1:-} in
    start) cmd_start ;;
    stop) cmd_stop ;;
    restart) cmd_stop; cmd_start ;;
    status) cmd_status ;;
    *) echo "usage: $0 start|stop|restart|status" >&2; exit 2 ;;
esac
