#!/usr/bin/env bash
# A multi-node Ray cluster on this one machine: a head and NUM_NODES-1 more raylets, each with its own CPU count,
# all under one state folder, so multi-node placement, shared storage and Ray jobs can be tried without a cluster.
#   launch/local_cluster.sh start    # prints `export RAY_ADDRESS=...` (GCS) and the dashboard / job address
#   launch/local_cluster.sh status   # the nodes and resources, or "not running"
#   launch/local_cluster.sh stop     # stops this cluster only
# `stop` kills the processes recorded at start (and their children), never a bare `ray stop`, which would stop
# every Ray instance on the machine. Settings (environment): LOCAL_CLUSTER_DIR (state folder, default
# /tmp/draft_opd_cluster), NUM_NODES (2), NODE_CPUS (1), HEAD_PORT (6390), DASHBOARD_PORT (8275), WORKER_PORTS (30000),
# DRAFT_OPD_STORAGE_DIR (the storage dir every node sees, as cluster/cpu_2node.yaml reads it; default
# <state folder>/storage).
set -euo pipefail

STATE=${LOCAL_CLUSTER_DIR:-/tmp/draft_opd_cluster}
NUM_NODES=${NUM_NODES:-2}
NODE_CPUS=${NODE_CPUS:-1}
HEAD_PORT=${HEAD_PORT:-6390}
DASHBOARD_PORT=${DASHBOARD_PORT:-8275}
WORKER_PORTS=${WORKER_PORTS:-30000}  # node i's workers bind ports WORKER_PORTS + 1000 i ... + 999
STORAGE_DIR=${DRAFT_OPD_STORAGE_DIR:-$STATE/storage}
TMP=$STATE/ray  # Ray's temp dir (short: Ray's socket paths must stay under ~107 characters)
ADDRESS=127.0.0.1:$HEAD_PORT
# A head started by `ray start` turns token authentication on by default, and a raylet or driver joining by an
# explicit address then has no token. This cluster listens on the loopback address only: no tokens.
export RAY_AUTH_MODE=disabled

# Every port a node would otherwise take at its default (the dashboard agent's 52365, the client server's
# 10001) gets a distinct value, so this cluster never collides with another Ray on the machine.
node_ports() {  # $1 = node index
  local base=$((HEAD_PORT + 100 + 10 * $1))
  echo "--node-manager-port=$base --object-manager-port=$((base + 1)) \
--dashboard-agent-listen-port=$((base + 2)) --dashboard-agent-grpc-port=$((base + 3)) \
--metrics-export-port=$((base + 4)) --runtime-env-agent-port=$((base + 5))"
}

# Every process of this cluster has the temp dir on its command line; Ray's workers (renamed `ray::...`) and the
# drivers of jobs are their descendants.
own_pids() { ps -eo pid=,args= | awk -v t="$TMP" 'index($0, t) && !/awk/ {print $1}'; }

descendants() {  # the pids given and every descendant of them
  local table; table=$(ps -eo pid=,ppid=)
  local todo=("$@") out=() p
  while ((${#todo[@]})); do
    p=${todo[0]}; todo=("${todo[@]:1}"); out+=("$p")
    while read -r c; do [[ -n $c ]] && todo+=("$c"); done < <(awk -v p="$p" '$2 == p {print $1}' <<<"$table")
  done
  printf '%s\n' "${out[@]}" | sort -u
}

running() { [[ -s $STATE/pids ]] && kill -0 "$(head -1 "$STATE/pids")" 2>/dev/null; }

failed() {  # a start that failed half-way: stop what did start, show why
  tail -20 "$STATE/start.log" >&2
  own_pids >"$STATE/pids"
  stop >/dev/null
  exit 1
}

start() {
  if running; then echo "already running: export RAY_ADDRESS=$(cat "$STATE/address")"; return 0; fi
  mkdir -p "$STATE" "$STORAGE_DIR"
  local common=(--num-gpus=0 --temp-dir="$TMP" --disable-usage-stats)
  # shellcheck disable=SC2046
  ray start --head --node-ip-address=127.0.0.1 --port="$HEAD_PORT" --num-cpus="$NODE_CPUS" \
    --include-dashboard=true --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT" \
    --ray-client-server-port=$((HEAD_PORT + 1)) --min-worker-port="$WORKER_PORTS" \
    --max-worker-port=$((WORKER_PORTS + 999)) --labels="draft-opd/node=0" "${common[@]}" $(node_ports 0) \
    >"$STATE/start.log" 2>&1 || failed
  for ((i = 1; i < NUM_NODES; i++)); do
    # shellcheck disable=SC2046
    ray start --address="$ADDRESS" --node-ip-address=127.0.0.1 --num-cpus="$NODE_CPUS" \
      --min-worker-port=$((WORKER_PORTS + 1000 * i)) --max-worker-port=$((WORKER_PORTS + 999 + 1000 * i)) \
      --labels="draft-opd/node=$i" "${common[@]}" $(node_ports "$i") \
      >>"$STATE/start.log" 2>&1 || failed
  done
  own_pids >"$STATE/pids"
  echo "$ADDRESS" >"$STATE/address"
  echo "local cluster: $NUM_NODES node(s) x $NODE_CPUS CPU(s), storage $STORAGE_DIR"
  echo "export RAY_ADDRESS=$ADDRESS"
  echo "dashboard / Ray jobs: http://127.0.0.1:$DASHBOARD_PORT"
}

stop() {
  [[ -s $STATE/pids ]] || { echo "not running"; return 0; }
  local roots pids
  # the recorded pids plus any process started since that names this cluster's temp dir
  mapfile -t roots < <({ cat "$STATE/pids"; own_pids; } | sort -u)
  mapfile -t pids < <(descendants "${roots[@]}")
  kill -TERM "${pids[@]}" 2>/dev/null || true
  for _ in $(seq 20); do
    kill -0 "${pids[@]}" 2>/dev/null || break
    sleep 0.5
  done
  kill -KILL "${pids[@]}" 2>/dev/null || true
  rm -f "$STATE/pids" "$STATE/address"
  echo "stopped the local cluster (${#pids[@]} processes)"
}

status() {
  if ! running; then echo "not running"; return 1; fi
  echo "export RAY_ADDRESS=$(cat "$STATE/address")"
  RAY_ADDRESS=$(cat "$STATE/address") ray status 2>/dev/null | sed -n '/Node status/,/Demands/p'
}

case ${1:-} in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
