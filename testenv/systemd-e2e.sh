#!/usr/bin/env bash
# The upgrade and restart test under a real systemd (PID 1), for the VM:
#
#   vagrant up
#   vagrant ssh -c 'cd /vagrant && sudo testenv/systemd-e2e.sh'
#
# It installs tether (make install), runs tetherd as the tetherd.service
# unit in front of two tether-demo workers, and sends requests without
# pause while it upgrades tetherd 10 times (tetherctl upgrade) and restarts
# it 5 times (systemctl restart). It fails on any failed request, or a
# unit that is not active afterwards. Bounded: about a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "run as root (sudo)" >&2; exit 1; }
[ "$(cat /proc/1/comm)" = systemd ] || { echo "needs systemd as PID 1 (the VM)" >&2; exit 1; }

make install PREFIX=/usr/local >/dev/null
for i in 0 1; do
  systemd-run --unit "tether-demo-$i" --collect /usr/local/bin/tether-demo --listen "127.0.0.1:3000$i" --index "$i"
done
cat > /etc/tether/tetherd.json <<JSON
{"listen": "127.0.0.1:8080", "admin": "127.0.0.1:8081",
 "worker": ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]}
JSON
cleanup() {
  systemctl stop tetherd tether-demo-0 tether-demo-1 2>/dev/null || true
  kill "${load:-0}" 2>/dev/null || true
}
trap cleanup EXIT
systemctl daemon-reload
systemctl restart tetherd
systemctl is-active --quiet tetherd

# Load: one request after the other, counting failures, until stopped.
fails=$(mktemp)
echo 0 > "$fails"
(
  n=0
  while :; do
    if ! curl -sf -m 10 -o /dev/null -XPOST http://127.0.0.1:8080/sessions/w1-0123456789abcdef0123456789abcdef/v1/chat/completions \
         -d '{"messages":[{"role":"user","content":"hi"}]}'; then
      n=$((n + 1)); echo "$n" > "$fails"
    fi
  done
) &
load=$!

for i in $(seq 10); do
  /usr/local/bin/tetherctl upgrade --pidfile /run/tetherd/tetherd.pid --timeout 60s
  sleep 0.5
done
for i in $(seq 5); do
  systemctl restart tetherd
  sleep 0.5
done
kill "$load"; wait "$load" 2>/dev/null || true
systemctl is-active --quiet tetherd
n=$(cat "$fails")
echo "10 upgrades, 5 restarts: $n failed requests"
[ "$n" = 0 ]
