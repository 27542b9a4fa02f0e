#!/usr/bin/env bash
# The multi-node harness: real MPI nodes on one machine (see docs/multinode.md).
#
#   tools/multinode.sh test [PART...]    the MPI tests, a training run and a killed rank across
#                                        2-3 MPI nodes (PART: collectives suite train kill)
#   tools/multinode.sh bench [RATE]      all-reduce over a shaped link (default 1gbit), 2 nodes x 2
#   tools/multinode.sh run LAYOUT -- CMD one command under the launcher, e.g. run 2,2 -- mpdl info
#
# MPICH's launcher (Hydra) starts one proxy per "host" through tools/fake-ssh, so the ranks of
# different hosts are different MPI nodes (COMM_TYPE_SHARED splits them) and MPI sends every byte
# between them through its network module (libfabric's tcp provider), never shared memory.
# As root with `ip netns`, each host is its own network namespace (10.77.0.K on interface mn0,
# joined through a bridge in a namespace of its own, links shaped with tc's tbf); otherwise the
# hosts share this machine's loopback, and the script says why. Every namespace is removed on exit,
# failed or not. A LAYOUT is the ranks of each node: 3,2 is 3 ranks on host 1 and 2 on host 2.
#
# Variables: VENV (default .venv), MPI_TIMEOUT (seconds per mpiexec run, default 420),
# MN_NETNS=0 (hosts without namespaces even where they are possible), MN_RATE (tc rate of every
# link in `test`, default none).
set -euo pipefail
# `auto` chooses with the defaults here (no first-use calibration written into ~/.cache), as in
# the pytest suites (tests/conftest.py); MPDL_AUTO_CACHE=DIR measures into DIR instead.
export MPDL_AUTO_CACHE="${MPDL_AUTO_CACHE:-off}"
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${VENV:-.venv}
case $VENV in /*) ;; *) VENV=$ROOT/$VENV ;; esac
PY=$VENV/bin/python
MPIEXEC=$VENV/bin/mpiexec
MPI_TIMEOUT=${MPI_TIMEOUT:-420}
export MPDL_MN_NETNS="mpdlmn-$$-"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
# shellcheck source=tools/mn-net.sh
source "$ROOT/tools/mn-net.sh"

say() { echo "multinode: $*"; }

launcher=$("$MPIEXEC" --version 2>/dev/null || true)
if [[ $launcher != *HYDRA* ]]; then
  say "SKIP: $MPIEXEC is not MPICH's Hydra launcher (the harness needs -launcher ssh)"
  exit 0
fi

NETNS=0
HOSTS_MADE=0
if [[ ${MN_NETNS:-1} == 0 ]]; then
  say "hosts without network namespaces (MN_NETNS=0): they share this machine's loopback"
else
  why=$(mn_net_check)
  if [[ -z $why ]]; then
    NETNS=1
  else
    say "no network namespaces ($why): the hosts share this machine's loopback, links unshaped"
  fi
fi
QDISCS=""
if [[ $NETNS == 1 ]]; then
  QDISCS=$(mn_tc_check)
  [[ $QDISCS == *tbf* ]] || say "no tbf qdisc in this kernel: links are not rate-limited"
  [[ $QDISCS == *netem* ]] || say "no netem qdisc in this kernel: links get no added delay (rate limits only)"
fi

cleanup() { [[ $HOSTS_MADE == 1 ]] && mn_net_down; HOSTS_MADE=0; }
trap cleanup EXIT
trap 'exit 130' INT TERM

# hosts_up N [RATE]: N hosts, their links shaped to RATE where tc allows it.
hosts_up() {
  local n=$1 rate=${2:-}
  cleanup
  if [[ $NETNS == 1 ]]; then
    [[ $QDISCS == *tbf* ]] || rate=""
    HOSTS_MADE=1
    mn_net_up "$n" "$rate"
    # MPICH between nodes: libfabric's tcp provider on each namespace's own interface
    export MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=mn0
    say "$n hosts, each a network namespace on 10.77.0.0/24, links ${rate:-unshaped}"
  else
    # (MPICH's default, UCX, would reach the other "node" through shared memory, and its tcp
    # transport refuses the loopback interface)
    export MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=lo
    say "$n hosts on this machine's loopback"
  fi
}

# hostlist LAYOUT: Hydra's -hosts argument for the layout (3,2 -> host1:3,host2:2).
hostlist() {
  local k=0 n out=""
  IFS=, read -ra counts <<<"$1"
  for n in "${counts[@]}"; do
    k=$((k + 1))
    if [[ $NETNS == 1 ]]; then out+="10.77.0.$k:$n,"; else out+="h$k:$n,"; fi
  done
  echo "${out%,}"
}

# launch LAYOUT CMD...: CMD on every rank of the layout, under a wall-clock limit.
launch() {
  local layout=$1 np=0 n; shift
  IFS=, read -ra counts <<<"$layout"
  for n in "${counts[@]}"; do np=$((np + n)); done
  local pre=() iface=()
  if [[ $NETNS == 1 ]]; then pre=(ip netns exec "${MPDL_MN_NETNS}h1"); iface=(-iface mn0); fi
  MN_EXPECT_NODES=$layout timeout -k 10 "$MPI_TIMEOUT" "${pre[@]}" "$MPIEXEC" -launcher ssh \
    -launcher-exec "$ROOT/tools/fake-ssh" "${iface[@]}" -hosts "$(hostlist "$layout")" -n "$np" "$@"
}

# check_layout LAYOUT: `mpdl info` across the hosts must report exactly those nodes.
check_layout() {
  local layout=$1 json
  json=$(launch "$layout" "$VENV/bin/mpdl" info --json)
  say "layout $layout: $(echo "$json" | "$PY" tools/check_layout.py "$layout")"
}

pytest_mpi() { launch "$1" "$PY" -m mpi4py -m pytest -q --with-mpi -p no:cacheprovider --timeout=240 "${@:2}"; }

# the all-to-all tests each collectives layout runs: every algorithm against MPI_Alltoall(v),
# every dtype, one rank's bad counts
ALLTOALL_ACROSS_NODES="matches_mpi_every_count or alltoallv_matches or bad_input"

# run_tests [PART...]: collectives, suite, train, kill (default: all four).
run_tests() {
  local started=$SECONDS parts=("$@") layout
  [[ ${#parts[@]} -gt 0 ]] || parts=(collectives suite train kill)
  hosts_up 3 "${MN_RATE:-}"
  for part in "${parts[@]}"; do
    case $part in
      collectives)
        for layout in 1,1 2,1 2,2 3,2 2,2,2 1,3,2; do
          check_layout "$layout"
          say "== collectives across nodes $layout"
          pytest_mpi "$layout" tests/mpi/test_collectives.py tests/mpi/test_nodes.py
          say "== all-to-all across nodes $layout (hierarchical over the real nodes)"
          pytest_mpi "$layout" tests/mpi/test_alltoall.py -k "$ALLTOALL_ACROSS_NODES"
        done ;;
      suite)
        # (the collectives part runs test_collectives.py and test_nodes.py on these layouts too:
        # where it is among the parts, the suite leaves them out)
        local again=()
        [[ " ${parts[*]} " == *" collectives "* ]] &&
          again=(--ignore=tests/mpi/test_collectives.py --ignore=tests/mpi/test_nodes.py)
        for layout in 2,2 2,1; do
          say "== the rest of the MPI test suite across nodes $layout"
          pytest_mpi "$layout" tests/mpi "${again[@]}"
        done ;;
      train) say "== training across 2 nodes against one rank"; train_invariance ;;
      kill) say "== a killed rank on one node ends the job on both"; killed_rank ;;
      *) echo "unknown part $part (collectives, suite, train, kill)" >&2; return 2 ;;
    esac
  done
  say "all multi-node tests passed (${parts[*]}) in $((SECONDS - started)) s"
}

# train_invariance: `mpdl train` (float64) on 2 nodes of 2 ranks and on one rank, same global
# batch, with the node-aware algorithms and ZeRO (sharded across both nodes, and hybrid: sharded
# within a node): the losses and final parameters must agree.
train_invariance() {
  local out strategy
  local base=(train --epochs 2 --dtype float64 --global-batch-size 64 --seed 3 --no-progress)
  out=$(mktemp -d)
  launch 1 "$VENV/bin/mpdl" "${base[@]}" --json "$out/one.jsonl" --checkpoint "$out/one" \
    | tail -n 1
  for strategy in "--algorithm hierarchical" "--algorithm shm" "--zero 3" "--zero 2 --zero-hybrid"; do
    rm -rf "$out/nodes" "$out/nodes.jsonl"
    # shellcheck disable=SC2086  # the strategy's flags split into words on purpose
    launch 2,2 "$VENV/bin/mpdl" "${base[@]}" $strategy --json "$out/nodes.jsonl" \
      --checkpoint "$out/nodes" | tail -n 1
    say "$strategy, 2 nodes x 2 ranks against 1 rank:"
    "$PY" tools/compare_runs.py "$out/nodes" "$out/one"
  done
  rm -rf "$out"
}

# killed_rank: rank 3 (on host 2) is killed by SIGKILL between two all-reduces; the job must end
# with an error, saying so, well before the run's wall-clock limit (a hang would reach it).
killed_rank() {
  local rc=0 started=$SECONDS log
  log=$(mktemp)
  MPI_TIMEOUT=90 launch 2,2 "$PY" -c '
import os, signal, time
import numpy as np
from mpi4py import MPI
from mpdl import collectives as C
C.allreduce(np.ones(1000), algorithm="hierarchical")
print("first all-reduce done", flush=True)
if MPI.COMM_WORLD.Get_rank() == 3:
    os.kill(os.getpid(), signal.SIGKILL)
C.allreduce(np.ones(1000), algorithm="hierarchical")
time.sleep(300)
' >"$log" 2>&1 || rc=$?
  local done_ranks killed
  done_ranks=$(grep -c "first all-reduce done" "$log" || true)
  killed=$(grep -c "EXIT CODE: 9" "$log" || true)
  grep -Eq "RUNNING AT (10\.77\.0\.2|h2)\b" "$log" || killed=0  # and it ran on host 2
  rm -f "$log"
  # (the killed rank's own line may be lost with it: the launcher's report is the evidence)
  if [[ $rc == 0 || $rc == 124 || $rc == 137 || $killed == 0 ]]; then
    say "FAIL: status $rc after $((SECONDS - started)) s, $done_ranks ranks reached the kill," \
        "launcher reported a rank killed by signal 9: $killed"
    return 1
  fi
  say "the job ended with status $rc after $((SECONDS - started)) s ($done_ranks ranks printed" \
      "their first all-reduce; the launcher reported the rank killed by signal 9)"
}

# run_bench [RATE]: 2 hosts x 2 ranks, links shaped to RATE; `mpdl calibrate` measures them (into
# a cost model of its own, under bench-out/multinode/), then `mpdl bench` sets the all-reduces side
# by side with the cost model's predictions.
run_bench() {
  local rate=${1:-1gbit} out=${MN_OUT:-$ROOT/bench-out/multinode}
  mkdir -p "$out"
  hosts_up 2 "$rate"
  [[ $NETNS == 1 && $QDISCS == *tbf* ]] || say "links are not shaped here: the figures are the loopback's"
  check_layout 2,2
  export MPDL_COST_MODEL="$out/costmodel-$rate.json"
  rm -f "$MPDL_COST_MODEL"
  say "== mpdl calibrate across the 2 nodes (into $MPDL_COST_MODEL)"
  launch 2,2 "$VENV/bin/mpdl" calibrate -n "${MN_CALIBRATE_ITERS:-10}"
  say "== mpdl bench allreduce -b 1M -e 64M -f 4, links $rate"
  launch 2,2 "$VENV/bin/mpdl" bench allreduce -b 1M -e 64M -f 4 -n "${MN_ITERS:-5}" -w 1 \
    --algorithms "${MN_ALGORITHMS:-hierarchical,ring,rabenseifner,shm,mpi,auto}" --check \
    --json "$out/bench-$rate.jsonl"
}

case ${1:-test} in
  test) shift; run_tests "$@" ;;
  run)
    layout=${2:?usage: multinode.sh run LAYOUT -- CMD...}; shift 2; [[ ${1:-} == -- ]] && shift
    IFS=, read -ra counts <<<"$layout"
    hosts_up "${#counts[@]}" "${MN_RATE:-}"
    launch "$layout" "$@" ;;
  bench) run_bench "${2:-1gbit}" ;;
  *) echo "usage: $0 test | bench [RATE] | run LAYOUT -- CMD..." >&2; exit 2 ;;
esac
