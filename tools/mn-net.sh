# Network namespaces for the multi-node harness (sourced by tools/multinode.sh).
#
# mn_net_up N [RATE]: hosts 1..N, each a namespace ${MPDL_MN_NETNS}hK with one interface mn0
# (10.77.0.K/24) on a veth pair whose other end sits on a bridge in namespace ${MPDL_MN_NETNS}br.
# Nothing is created in, or routed to, the machine's own namespace. With RATE (a tc rate such as
# 1gbit), every host's mn0 sends through a tbf qdisc of that rate: each link is shaped both ways.
# mn_net_down removes every namespace of the prefix (and with them their interfaces).

mn_net_check() {
  # Prints why namespaces cannot be made here, or nothing when they can.
  if [[ $(id -u) != 0 ]]; then echo "not root"; return; fi
  if ! command -v ip >/dev/null; then echo "no ip command (iproute2)"; return; fi
  local probe="${MPDL_MN_NETNS}probe"
  if ! ip netns add "$probe" 2>/dev/null; then echo "ip netns add fails here"; return; fi
  if ! ip netns exec "$probe" ip link add mnbr type bridge 2>/dev/null; then
    ip netns del "$probe"; echo "no bridge support in the kernel"; return
  fi
  if ! ip netns exec "$probe" ip link add mnv0 type veth peer name mnv1 2>/dev/null; then
    ip netns del "$probe"; echo "no veth support in the kernel"; return
  fi
  ip netns del "$probe"
}

mn_tc_check() {
  # Prints "tbf" and/or "netem" for the qdiscs the kernel offers (probed on a throwaway namespace).
  local probe="${MPDL_MN_NETNS}probe" found=""
  command -v tc >/dev/null || return 0
  ip netns add "$probe" 2>/dev/null || return 0
  ip netns exec "$probe" ip link add mnv0 type veth peer name mnv1
  ip netns exec "$probe" tc qdisc add dev mnv0 root tbf rate 1gbit burst 256kb latency 20ms \
    2>/dev/null && found="tbf" && ip netns exec "$probe" tc qdisc del dev mnv0 root
  ip netns exec "$probe" tc qdisc add dev mnv0 root netem delay 1ms 2>/dev/null && found="$found netem"
  ip netns del "$probe"
  echo "$found"
}

mn_net_up() {
  local n=$1 rate=${2:-} br="${MPDL_MN_NETNS}br" k ns
  ip netns add "$br"
  ip netns exec "$br" ip link add mnbr type bridge
  ip netns exec "$br" ip link set mnbr up
  for ((k = 1; k <= n; k++)); do
    ns="${MPDL_MN_NETNS}h$k"
    ip netns add "$ns"
    ip netns exec "$br" ip link add "h$k" type veth peer name mn0 netns "$ns"
    ip netns exec "$br" ip link set "h$k" master mnbr up
    ip netns exec "$ns" ip link set lo up
    ip netns exec "$ns" ip addr add "10.77.0.$k/24" dev mn0
    ip netns exec "$ns" ip link set mn0 up
    if [[ -n $rate ]]; then
      ip netns exec "$ns" tc qdisc add dev mn0 root tbf rate "$rate" burst 512kb latency 50ms
    fi
  done
}

mn_net_down() {
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
    [[ $ns == "${MPDL_MN_NETNS}"* ]] && ip netns del "$ns"
  done
  return 0
}
