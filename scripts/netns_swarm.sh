#!/usr/bin/env bash
# The 2-stage pipeline bench (scripts/bench_pipeline.py) across two network namespaces, with the shaped
# link's bandwidth set by the kernel (tc tbf) instead of the in-process shaper.
#
# ROOT ONLY: it creates two network namespaces, two veth pairs and tc qdiscs, and deletes all of them on
# exit (trap on EXIT/INT/TERM), whatever happens. Nothing outside those namespaces is touched: no routes,
# no firewall rules, no interfaces in the host namespace; all traffic stays between the two namespaces.
#
#   sudo scripts/netns_swarm.sh --check            # setup, measure both paths, teardown (~15 s)
#   sudo scripts/netns_swarm.sh --quick            # setup, bench --quick across the namespaces, teardown
#   sudo scripts/netns_swarm.sh                    # the full bench (about 3 minutes on 2 idle cores)
#   sudo scripts/netns_swarm.sh --bandwidth-mbps 20 --delay-ms 10 --timeout-s 600 -- --microbatches 8
#
# Topology (10.77.0.0/24 is a private test range; the addresses exist only inside these namespaces):
#
#   crucible-a-PID (stage 0)                         crucible-b-PID (stage 1)
#     ca0 10.77.0.1/30 <---- veth, unshaped ---->      cb0 10.77.0.2/30    unshaped_dense variant
#     ca1 10.77.0.5/30 <---- veth, tc tbf ------>      cb1 10.77.0.6/30    shaped variants
#                            (tbf RATE on both egresses: each direction gets RATE)
#
# This kernel has no netem, so the one-way delay cannot come from tc: the bench adds it in user space
# (node/pipeline/transport.py Shaper.delay_ms, on the receiving side) and runs with --tc-shaped, so its in-process
# shaper paces nothing and tbf alone sets the bandwidth.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

ORIG_ARGS="$*"
MODE=full
BW_MBPS=20
DELAY_MS=10
TIMEOUT_S=600
EXTRA=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --check) MODE=check ;;
        --quick) MODE=quick ;;
        --bandwidth-mbps) BW_MBPS="$2"; shift ;;
        --delay-ms) DELAY_MS="$2"; shift ;;
        --timeout-s) TIMEOUT_S="$2"; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) echo "netns_swarm.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done

if [[ $(id -u) -ne 0 ]]; then
    echo "netns_swarm.sh must run as root: it creates network namespaces, veth pairs and tc qdiscs" \
         "(try: sudo $0 $ORIG_ARGS). Without root, run 'python -m scripts.bench_pipeline', which shapes links" \
         "in process." >&2
    exit 1
fi
for tool in ip tc timeout; do
    command -v "$tool" >/dev/null || { echo "netns_swarm.sh: '$tool' is not installed (iproute2, coreutils)" >&2; exit 1; }
done
if ! [[ $BW_MBPS =~ ^[0-9]+([.][0-9]+)?$ && $DELAY_MS =~ ^[0-9]+([.][0-9]+)?$ && $TIMEOUT_S =~ ^[0-9]+$ ]]; then
    echo "netns_swarm.sh: --bandwidth-mbps, --delay-ms and --timeout-s take numbers (example: --bandwidth-mbps 20)" >&2
    exit 2
fi

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY="$REPO/.venv/bin/python"
[[ -x $PY ]] || PY=$(command -v python3)
NSA="crucible-a-$$"
NSB="crucible-b-$$"
A0=10.77.0.1 B0=10.77.0.2 A1=10.77.0.5 B1=10.77.0.6

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    for ns in "$NSA" "$NSB"; do
        if ip netns list | grep -qw "$ns"; then
            # processes this script started inside its own namespaces (the bench, a probe), if still alive
            for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
            ip netns del "$ns" 2>/dev/null || echo "netns_swarm.sh: could not delete namespace $ns" >&2
        fi
    done
    echo "netns_swarm.sh: removed namespaces $NSA and $NSB" >&2
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

for ns in "$NSA" "$NSB"; do
    if ip netns list | grep -qw "$ns"; then
        echo "netns_swarm.sh: namespace $ns already exists; delete it (ip netns del $ns) or rerun" >&2
        trap - EXIT
        exit 1
    fi
done

echo "netns_swarm.sh: creating $NSA, $NSB; shaped path ${BW_MBPS} Mbit/s per direction (tc tbf)" \
     "+ ${DELAY_MS} ms one way (in process)" >&2
ip netns add "$NSA"
ip netns add "$NSB"
# veths created directly inside the namespaces: no name can clash with the host's interfaces
ip link add ca0 netns "$NSA" type veth peer name cb0 netns "$NSB"
ip link add ca1 netns "$NSA" type veth peer name cb1 netns "$NSB"
ip -n "$NSA" addr add "$A0/30" dev ca0
ip -n "$NSB" addr add "$B0/30" dev cb0
ip -n "$NSA" addr add "$A1/30" dev ca1
ip -n "$NSB" addr add "$B1/30" dev cb1
for ns in "$NSA" "$NSB"; do ip -n "$ns" link set lo up; done
ip -n "$NSA" link set ca0 up; ip -n "$NSA" link set ca1 up
ip -n "$NSB" link set cb0 up; ip -n "$NSB" link set cb1 up
# tbf on both egresses of the shaped pair: burst = 20 ms of bytes at the rate (at least 32 KB; tbf
# segments GSO super-packets larger than that), latency 200 ms bounds its queue (TCP backs off on drops)
BURST_BYTES=$("$PY" -c "print(max(32768, int($BW_MBPS * 1e6 / 8 * 0.02)))")
ip netns exec "$NSA" tc qdisc add dev ca1 root tbf rate "${BW_MBPS}mbit" burst "$BURST_BYTES" latency 200ms
ip netns exec "$NSB" tc qdisc add dev cb1 root tbf rate "${BW_MBPS}mbit" burst "$BURST_BYTES" latency 200ms
ip netns exec "$NSA" tc qdisc show dev ca1 >&2

probe() {  # probe NAME HOST MBYTES: stream MBYTES from A to HOST in B, print Mbit/s seen by the receiver
    local name=$1 host=$2 mbytes=$3
    ip netns exec "$NSB" timeout 60 "$PY" -c "
import socket, time
srv = socket.create_server(('$host', 7700))  # a fresh, empty namespace: nothing else can hold the port
srv.settimeout(30)
c, _ = srv.accept(); n = 0; t = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    t = t or time.monotonic(); n += len(b)
print(f'$name: {n / 1e6:.1f} MB at {n * 8 / (time.monotonic() - t) / 1e6:.1f} Mbit/s')
" &
    local rx=$!
    ip netns exec "$NSA" timeout 60 "$PY" -c "
import socket, time
for _ in range(100):
    try:
        s = socket.create_connection(('$host', 7700), timeout=5); break
    except OSError: time.sleep(0.1)
s.sendall(b'x' * ($mbytes * 1000 * 1000)); s.close()
"
    wait "$rx"
}

case "$MODE" in
    check)
        probe "unshaped veth" "$B0" 200
        probe "tbf veth (${BW_MBPS} Mbit/s)" "$B1" "$("$PY" -c "print(max(1, int($BW_MBPS * 0.25)))")"
        ;;
    quick|full)
        BENCH=(--host "$B0" --shaped-host "$B1" --listen-host 0.0.0.0 --tc-shaped
               --bandwidth-mbps "$BW_MBPS" --delay-ms "$DELAY_MS" --stage1-prefix "ip netns exec $NSB")
        [[ $MODE == quick ]] && BENCH+=(--quick)
        cd "$REPO"
        # in the background + wait: a signal to this script interrupts `wait` at once and the EXIT trap
        # kills what runs in the namespaces (a foreground child would delay the trap until it exits)
        ip netns exec "$NSA" timeout --kill-after=10 "$TIMEOUT_S" "$PY" -m scripts.bench_pipeline \
            "${BENCH[@]}" ${EXTRA[@]+"${EXTRA[@]}"} &
        wait $!
        ;;
esac
