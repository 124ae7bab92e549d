#!/usr/bin/env bash
# tetherd under a real systemd (PID 1): upgrades and restarts under load,
# the fd store, the watchdog, reload and stop. For a VM:
#
#   make vmtest                  (testenv/vm/: installs the .deb with apt, runs this with --installed)
#   vagrant up && vagrant ssh -c 'cd /vagrant && sudo testenv/systemd-e2e.sh'   (make install)
#
# Without --installed it installs tether from this tree (make install,
# /usr/local); with --installed it uses the tetherd, tetherctl, tether-demo
# and tetherd.service already installed (the .deb: /usr/bin). Then it runs
# tetherd as the tetherd.service unit in front of two tether-demo workers and:
#
#  1. sends requests without pause (4 clients, one request after the other,
#     a new connection each) while it upgrades tetherd 10 times (tetherctl
#     upgrade) and restarts it 5 times (systemctl restart): 0 failed
#     requests allowed;
#  2. checks the fd store: the listening sockets after a restart are the
#     same kernel sockets (inode numbers) as before, and BPF steering, if
#     on at the start, is still on after the restarts;
#  3. reload (systemctl reload, SIGHUP): a third worker in the file is added,
#     the process stays; a broken file is refused, the process stays;
#  4. watchdog: tetherd stopped with SIGSTOP (hung) is killed by systemd
#     after WatchdogSec and started again, on the stored sockets;
#  5. stop, right after an upgrade (the main process is not systemd's
#     child): a streamed response in progress completes, the main process
#     exits by itself (no SIGKILL), the unit ends inactive with
#     Result=success, the port is closed.
#
# It fails on any of these. The configuration it writes to
# /etc/tether/tetherd.json is replaced by the one that was there at the end.
# Prints one figures line: "e2e: requests=N failed=F upgrades=10 restarts=5 ...".
set -euo pipefail
cd "$(dirname "$0")"
installed=0
[ "${1:-}" = --installed ] && installed=1
[ "$(id -u)" = 0 ] || { echo "run as root (sudo)" >&2; exit 1; }
[ "$(cat /proc/1/comm)" = systemd ] || { echo "needs systemd as PID 1 (the VM)" >&2; exit 1; }

if [ "$installed" = 0 ]; then
  (cd .. && make install PREFIX=/usr/local >/dev/null)
  BIN=/usr/local/bin
else
  BIN=$(dirname "$(command -v tetherd)")
fi
systemctl cat tetherd.service >/dev/null
say() { echo "e2e [$(date +%T)] $*"; }
fail() { say "FAIL: $*"; journalctl -u tetherd --no-pager -n 40 || true; exit 1; }
mainpid() { systemctl show -p MainPID --value tetherd; }
# The inode numbers of the sockets listening on :8080 (0x1F90). Not ss -e:
# it fails on a socket whose cgroup is gone (a restart makes a new one).
inodes() { awk '$4 == "0A" && $2 ~ /:1F90$/ {print "ino:" $10}' /proc/net/tcp /proc/net/tcp6 | sort | tr '\n' ' '; }
req() {
  curl -sf -m 10 -o /dev/null -XPOST "http://127.0.0.1:8080/sessions/w$1-0123456789abcdef0123456789abcdef/v1/chat/completions" \
    -d '{"messages":[{"role":"user","content":"hi"}]}'
}

conf=/etc/tether/tetherd.json
saved=$(mktemp)
cp "$conf" "$saved" 2>/dev/null || : >"$saved"
# Each worker streams 20 chunks 100 ms apart: a streamed request lasts ~2 s.
for i in 0 1 2; do
  systemd-run --quiet --unit "tether-demo-$i" --collect "$BIN/tether-demo" --listen "127.0.0.1:3000$i" --index "$i" \
    --stream-delay 100ms --stream-chunks 20
done
write_conf() { # the workers 0..$1-1
  local ws="" i
  for i in $(seq 0 $(($1 - 1))); do ws="$ws${ws:+, }\"http://127.0.0.1:3000$i\""; done
  printf '{"listen": "127.0.0.1:8080", "admin": "127.0.0.1:8081", "worker": [%s]}\n' "$ws" >"$conf"
}
write_conf 2
cleanup() {
  [ -n "${load:-}" ] && kill $load 2>/dev/null || true
  systemctl stop tetherd tether-demo-0 tether-demo-1 tether-demo-2 2>/dev/null || true
  if [ -s "$saved" ]; then cp "$saved" "$conf"; fi
  rm -f "$saved"
}
trap cleanup EXIT
systemctl daemon-reload
t_start=$(date '+%Y-%m-%d %H:%M:%S')
systemctl restart tetherd
systemctl is-active --quiet tetherd || fail "tetherd not active after start"
bpf=on
journalctl -u tetherd --since "$t_start" --no-pager | grep -q 'BPF steering unavailable' && bpf=off
say "tetherd active, MainPID $(mainpid), sockets $(inodes), BPF steering $bpf"

# 1. Load: LOADERS (4) clients, each one request after the other on a new
# connection, counting, until stopped.
LOADERS=${LOADERS:-4}
counts=$(mktemp -d)
loaders=()
for l in $(seq "$LOADERS"); do
  : >"$counts/$l"
  (
    n=0
    while :; do
      n=$((n + 1))
      if req $((n % 2)); then echo ok >>"$counts/$l"; else echo FAIL >>"$counts/$l"; echo "$(date +%T.%N) loader $l: request $n failed" >&2; fi
    done
  ) &
  loaders+=($!)
done
load="${loaders[*]}"
for i in $(seq 10); do
  before=$(mainpid)
  "$BIN/tetherctl" upgrade --pidfile /run/tetherd/tetherd.pid --timeout 60s >/dev/null || fail "upgrade $i"
  # The new process announces MAINPID= itself; systemd reads it a moment later.
  for _ in $(seq 50); do after=$(mainpid); [ "$after" != "$before" ] && break; sleep 0.1; done
  [ "$after" != "$before" ] || fail "upgrade $i: MainPID still $before"
  say "upgrade $i: MainPID $before -> $after"
  sleep 0.5
done
ino_before=$(inodes)
t_restarts=$(date '+%Y-%m-%d %H:%M:%S')
for i in $(seq 5); do
  systemctl restart tetherd
  say "restart $i: MainPID $(mainpid)"
  sleep 0.5
done
ino_after=$(inodes)
kill $load; wait $load 2>/dev/null || true
requests=0 failed=0
for l in $(seq "$LOADERS"); do
  n=$(grep -c -e '^ok$' -e '^FAIL$' "$counts/$l" || true)
  f=$(grep -c '^FAIL$' "$counts/$l" || true)
  requests=$((requests + n)) failed=$((failed + f))
done
rm -rf "$counts"
systemctl is-active --quiet tetherd || fail "not active after the restarts"
say "10 upgrades, 5 restarts: $requests requests, $failed failed"
[ "$failed" = 0 ] || fail "$failed failed requests"

# 2. The fd store: the same listening sockets before and after the restarts.
say "listening sockets before the restarts: $ino_before; after: $ino_after"
[ -n "$ino_before" ] && [ "$ino_before" = "$ino_after" ] || fail "the listening sockets changed across restarts (fd store not used)"
journalctl -u tetherd --since "$t_start" --no-pager | grep -q 'systemd fd store: socket' && fail "the journal says a socket was not stored"
if [ "$bpf" = on ] && journalctl -u tetherd --since "$t_restarts" --no-pager | grep -q 'BPF steering unavailable'; then
  fail "BPF steering lost across a restart (the stored sockets not put back into their slots)"
fi

# 3. Reload: a third worker appears, the process stays; a bad file changes nothing.
pid=$(mainpid)
write_conf 3
since=$(date '+%Y-%m-%d %H:%M:%S')
systemctl reload tetherd
sleep 1
[ "$(mainpid)" = "$pid" ] || fail "reload replaced the process"
journalctl -u tetherd --since "$since" --no-pager | grep -q 'configuration reloaded.*workers_added=\[http://127.0.0.1:30002\]' || fail "reload: no 'configuration reloaded workers_added=[http://127.0.0.1:30002]'"
"$BIN/tetherctl" workers list | grep -q 127.0.0.1:30002 || fail "reload: the third worker is not in the table"
req 2 || fail "reload: a request to the new worker failed"
echo '{"listen": ' >"$conf"
since=$(date '+%Y-%m-%d %H:%M:%S')
systemctl reload tetherd || true
sleep 1
systemctl is-active --quiet tetherd && [ "$(mainpid)" = "$pid" ] || fail "a refused reload stopped tetherd"
journalctl -u tetherd --since "$since" --no-pager | grep -q 'reload refused' || fail "a bad file was not refused"
write_conf 3
say "reload: worker added, bad file refused, MainPID $pid throughout"

# 4. Watchdog: a hung tetherd (SIGSTOP) is killed and restarted by systemd.
wd=$(systemctl show -p WatchdogUSec --value tetherd)
restarts=$(systemctl show -p NRestarts --value tetherd)
pid=$(mainpid)
ino_before=$(inodes)
since=$(date '+%Y-%m-%d %H:%M:%S')
kill -STOP "$pid"
say "watchdog: MainPID $pid stopped (SIGSTOP), WatchdogSec=$wd"
t0=$SECONDS
until [ "$(systemctl show -p NRestarts --value tetherd)" -gt "$restarts" ] && systemctl is-active --quiet tetherd && [ "$(mainpid)" != "$pid" ]; do
  [ $((SECONDS - t0)) -lt 180 ] || fail "watchdog: no restart within 180s"
  sleep 1
done
journalctl -u tetherd --since "$since" --no-pager | grep -qi 'watchdog timeout' || fail "watchdog: the journal does not say 'Watchdog timeout'"
until req 0; do [ $((SECONDS - t0)) -lt 240 ] || fail "watchdog: the restarted tetherd does not answer"; sleep 0.5; done
say "watchdog: killed and restarted after $((SECONDS - t0))s, MainPID $(mainpid), sockets kept: $([ "$ino_before" = "$(inodes)" ] && echo yes || echo no)"

# 5. Stop: a streamed response in progress completes; the port closes.
# After an upgrade, so that the main process is not systemd's child (systemd
# does not wait for such a process after SIGTERM: the unit's ExecStop does).
before=$(mainpid)
"$BIN/tetherctl" upgrade --pidfile /run/tetherd/tetherd.pid --timeout 60s >/dev/null || fail "upgrade before stop"
for _ in $(seq 50); do [ "$(mainpid)" != "$before" ] && break; sleep 0.1; done
until req 0; do [ $((SECONDS - t0)) -lt 300 ] || fail "no answer after the upgrade before stop"; sleep 0.2; done
since=$(date '+%Y-%m-%d %H:%M:%S')
stream=$(mktemp)
curl -sfN -m 60 -XPOST http://127.0.0.1:8080/sessions/w0-0123456789abcdef0123456789abcdef/v1/chat/completions \
  -d '{"messages":[{"role":"user","content":"hi"}],"stream":true}' >"$stream" &
c=$!
sleep 0.7
t0=$SECONDS
mp=$(mainpid)
systemctl stop tetherd
wait "$c" || fail "stop: the stream in progress failed"
grep -q 'data: \[DONE\]' "$stream" || fail "stop: the stream in progress was cut"
rm -f "$stream"
[ "$(systemctl show -p ActiveState --value tetherd)" = inactive ] || fail "stop: not inactive"
[ "$(systemctl show -p Result --value tetherd)" = success ] || fail "stop: Result=$(systemctl show -p Result --value tetherd)"
req 0 2>/dev/null && fail "stop: the port still answers"
journalctl -u tetherd --since "$since" --no-pager | grep -q "Killing process $mp .*SIGKILL" && fail "stop: systemd killed the main process $mp with SIGKILL"
say "stop after an upgrade: the stream completed, MainPID $mp exited by itself, inactive, Result=success, port closed ($((SECONDS - t0))s)"

echo "e2e: requests=$requests failed=$failed loaders=$LOADERS upgrades=10 restarts=5 bpf=$bpf fdstore=kept reload=ok watchdog=restarted stop=clean"
