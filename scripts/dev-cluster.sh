#!/usr/bin/env bash
# A single-node Slurm 22.05 cluster on loopback, with accounting, for development and tests.
#
#   scripts/dev-cluster.sh start    install (if missing) and start; no-op when already up
#   scripts/dev-cluster.sh stop     cancel every job, then stop the daemons
#   scripts/dev-cluster.sh status   sinfo and daemon pids; exit 0 when up, 3 when not
#   scripts/dev-cluster.sh restart  stop then start (fresh state)
#
#   scripts/dev-cluster.sh multi start [N]       a second cluster beside it, of N nodes (default 3)
#   scripts/dev-cluster.sh multi stop            cancel its jobs, stop its daemons
#   scripts/dev-cluster.sh multi status          its daemons and nodes; exit 3 when not up
#   scripts/dev-cluster.sh multi conf            print its slurm.conf (clients: SLURM_CONF=that)
#   scripts/dev-cluster.sh multi kill-node NAME  lose a node: SIGKILL its slurmd and every process of its jobs
#
# The multi-node cluster (ClusterName tangram-multi) runs its own slurmctld (port 6917) and one
# slurmd per node (`slurmd -N nK`: NodeAddr 127.0.0.(K+1), port 6920+K, spool and log of its own),
# its state under $TANGRAM_DEVCLUSTER_MULTI_DIR (default $TANGRAM_DEVCLUSTER_DIR/multi); it shares
# munge and the accounting daemon (slurmdbd) of the single-node cluster (started first when they
# are not up), so both clusters run at once.  Node n1 alone is partition `head` (for a coordinator),
# the others the default partition `cpu`, $TANGRAM_DEVCLUSTER_MULTI_CPUS CPUs each (default 4).
# A node that stops answering is DOWN after SlurmdTimeout=10 s and its jobs end NODE_FAIL
# (JobRequeue=0: Slurm does not start them again).  `multi start` begins from fresh controller
# state and spools; its job ids follow those its accounting holds (no two of its jobs share one).
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
# the clients below talk to the cluster they mean: the single-node one through /etc/slurm,
# the multi-node one through its own file (multi_run)
unset SLURM_CONF

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

shared_config() {  # the settings both clusters' slurm.conf share
    cat <<'EOF'
AuthType=auth/munge
MailProg=/bin/true
MpiDefault=none
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
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=5
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobCompType=jobcomp/none
EOF
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
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd.log
$(shared_config)
GresTypes=gpu
AccountingStorageTRES=gres/gpu
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

# -- the multi-node cluster -------------------------------------------------------------------
MBASE=${TANGRAM_DEVCLUSTER_MULTI_DIR:-$BASE/multi}
MCONF=$MBASE/slurm.conf
MCLUSTER=tangram-multi
MCPUS=${TANGRAM_DEVCLUSTER_MULTI_CPUS:-4}

multi_run() { SLURM_CONF=$MCONF "$@"; }

multi_nodes() {  # the node names of the written configuration
    [[ -s $MCONF ]] && sed -n 's/^NodeName=\([^ ]*\) .*/\1/p' "$MCONF"
}

write_multi_config() {
    local n=$1 k last
    # fresh controller state would number jobs from 1 again, as earlier jobs in the accounting
    last=$({ sacct -M "$MCLUSTER" -a -X -n -P -o jobid -S 1970-01-02T00:00:00 2>/dev/null || true; } \
        | sed 's/[^0-9].*//' | sort -n | tail -1)
    cat >"$MCONF" <<EOF
$MARKER (multi-node mode)
ClusterName=$MCLUSTER
FirstJobId=$((${last:-0} + 1))
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=6917
SlurmUser=root
StateSaveLocation=$MBASE/state
SlurmdSpoolDir=$MBASE/spool/%n
SlurmctldPidFile=$MBASE/run/slurmctld.pid
SlurmdPidFile=$MBASE/run/slurmd-%n.pid
SlurmctldLogFile=$MBASE/log/slurmctld.log
SlurmdLogFile=$MBASE/log/slurmd-%n.log
$(shared_config)
# a lost node is DOWN, and its jobs NODE_FAIL, within seconds; Slurm does not start them again
SlurmdTimeout=10
JobRequeue=0
EOF
    for ((k = 1; k <= n; k++)); do
        echo "NodeName=n$k NodeAddr=127.0.0.$((k + 1)) Port=$((6920 + k)) CPUs=$MCPUS RealMemory=$MEM_MB State=UNKNOWN" >>"$MCONF"
    done
    echo "PartitionName=head Nodes=n1 Default=NO MaxTime=INFINITE State=UP" >>"$MCONF"
    echo "PartitionName=cpu Nodes=$(seq -s, -f 'n%g' 2 "$n") Default=YES MaxTime=INFINITE State=UP" >>"$MCONF"
}

multi_up() {
    pid_alive "$MBASE/run/slurmctld.pid" || return 1
    local node
    for node in $(multi_nodes); do pid_alive "$MBASE/run/slurmd-$node.pid" || return 1; done
    multi_run scontrol ping 2>/dev/null | grep -q "is UP"
}

multi_all_idle() {
    [[ -n $(multi_run sinfo -h -N -o %N 2>/dev/null) ]] \
        && [[ -z $(multi_run sinfo -h -N -o '%N %T' 2>/dev/null | awk '$2 != "idle"') ]]
}

cmd_multi_start() {
    local n=${1:-3}
    [[ $(id -u) == 0 ]] || die "multi start needs root"
    [[ $n =~ ^[0-9]+$ ]] && ((n >= 2 && n <= 200)) || die "multi start: 2 to 200 nodes, not '$n'"
    if multi_up && [[ $(multi_nodes | wc -l) == "$n" ]]; then log "multi: already running"; return 0; fi
    # munge and slurmdbd are the single-node cluster's
    if ! pid_alive "$BASE/run/slurmdbd.pid" || ! pid_alive /run/munge/munged.pid; then cmd_start; fi
    multi_stop_daemons quiet
    rm -rf "$MBASE/state" "$MBASE/spool" "$MBASE/log"
    mkdir -p "$MBASE/state" "$MBASE/run" "$MBASE/log"
    write_multi_config "$n"
    local node
    for node in $(multi_nodes); do mkdir -p "$MBASE/spool/$node"; done
    /usr/sbin/slurmctld -i -f "$MCONF"
    wait_for "$TIMEOUT" "the multi-node slurmctld" multi_ping
    for node in $(multi_nodes); do /usr/sbin/slurmd -N "$node" -f "$MCONF"; done
    wait_for "$TIMEOUT" "every node of the multi-node cluster to become idle" multi_all_idle
    log "multi: up (SLURM_CONF=$MCONF): $(multi_run sinfo -h -o '%P %D %T %C' | tr '\n' ';')"
}

multi_ping() { multi_run scontrol ping | grep -q "is UP"; }

multi_stop_daemons() {
    local quiet=${1:-}
    [[ -s $MCONF ]] || return 0
    if pid_alive "$MBASE/run/slurmctld.pid"; then
        local ids
        ids=$(multi_run squeue -h -o %i 2>/dev/null | tr '\n' ' ' || true)
        if [[ -n ${ids// /} ]]; then
            # shellcheck disable=SC2086
            multi_run scancel $ids 2>/dev/null || true
            local deadline=$((SECONDS + 15))
            while ((SECONDS < deadline)) && [[ -n $(multi_run squeue -h -t R,CG,PD -o %i 2>/dev/null) ]]; do sleep 0.2; done
        fi
    fi
    local file
    for file in "$MBASE"/run/slurmd-*.pid "$MBASE/run/slurmctld.pid"; do
        [[ -e $file ]] || continue
        if pid_alive "$file"; then
            local pid; pid=$(cat "$file")
            [[ -n $quiet ]] || log "multi: stopping $(basename "$file" .pid) ($pid)"
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

# The processes of a node's jobs: each job step's slurmstepd listens on a socket in the node's
# spool directory, and every process of the step descends from it (bubblewrap's sandboxes too);
# a process that left the tree (a double fork) still carries the node's name in its environment.
node_step_pids() {
    ss -xlpH 2>/dev/null | awk -v dir="$MBASE/spool/$1/" 'index($5, dir) == 1' | grep -o 'pid=[0-9]*' | cut -d= -f2
}

node_env_pids() {
    local files
    files=$(grep -lzx "SLURMD_NODENAME=$1" /proc/[0-9]*/environ 2>/dev/null) || return 0
    # shellcheck disable=SC2086
    grep -lzx "SLURM_CLUSTER_NAME=$MCLUSTER" $files 2>/dev/null | cut -d/ -f3 || true
}

with_descendants() {  # the pids given and every process below them
    ps -e -o pid=,ppid= | awk -v roots="$*" '
        BEGIN { n = split(roots, r, " "); for (i = 1; i <= n; i++) keep[r[i]] = 1 }
        { parent[$1] = $2 }
        END {
            do { more = 0; for (p in parent) if (!(p in keep) && (parent[p] in keep)) { keep[p] = 1; more = 1 } } while (more)
            for (p in keep) print p
        }'
}

cmd_multi_kill_node() {
    local node=${1:-}
    [[ $(id -u) == 0 ]] || die "multi kill-node needs root"
    [[ -n $node ]] && multi_nodes | grep -qx "$node" || die "multi kill-node: no node '$node' (nodes: $(multi_nodes | tr '\n' ' '))"
    local pids=() pid
    pid_alive "$MBASE/run/slurmd-$node.pid" && pids+=("$(cat "$MBASE/run/slurmd-$node.pid")")
    # All stopped first (none forks or reports in between: the job steps at once, then what the
    # slower sweep of environments finds), then all killed.
    for pid in $(with_descendants "${pids[@]}" $(node_step_pids "$node")); do pids+=("$pid"); done
    kill -STOP "${pids[@]}" 2>/dev/null || true
    # shellcheck disable=SC2046
    for pid in $(with_descendants $(node_env_pids "$node") $(node_step_pids "$node")); do pids+=("$pid"); done
    kill -STOP "${pids[@]}" 2>/dev/null || true
    kill -KILL "${pids[@]}" 2>/dev/null || true
    rm -f "$MBASE/run/slurmd-$node.pid"
    log "multi: node $node lost: killed its slurmd and its jobs' processes ($(printf '%s\n' "${pids[@]}" | sort -u | wc -l) in all)"
}

cmd_multi_status() {
    [[ -s $MCONF ]] || { echo "multi-node cluster: not configured ($MCONF)"; return 3; }
    local up=0 file
    for file in "$MBASE/run/slurmctld.pid" $(multi_nodes | sed "s|.*|$MBASE/run/slurmd-&.pid|"); do
        if pid_alive "$file"; then printf '%-12s pid %s\n' "$(basename "$file" .pid)" "$(cat "$file")"
        else printf '%-12s not running\n' "$(basename "$file" .pid)"; up=3; fi
    done
    multi_run sinfo -N 2>/dev/null || up=3
    return $up
}

cmd_multi() {
    case ${1:-} in
        start) cmd_multi_start "${2:-3}" ;;
        stop) [[ $(id -u) == 0 ]] || die "multi stop needs root"; multi_stop_daemons; log "multi: stopped" ;;
        status) cmd_multi_status ;;
        conf) echo "$MCONF" ;;
        kill-node) cmd_multi_kill_node "${2:-}" ;;
        *) echo "usage: $0 multi start [N]|stop|status|conf|kill-node NAME" >&2; exit 2 ;;
    esac
}

case ${1:-} in
    start) cmd_start ;;
    stop) cmd_stop ;;
    restart) cmd_stop; cmd_start ;;
    status) cmd_status ;;
    multi) shift; cmd_multi "$@" ;;
    *) echo "usage: $0 start|stop|restart|status|multi ..." >&2; exit 2 ;;
esac
