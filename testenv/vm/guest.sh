#!/bin/bash
# Runs inside the VM (systemd as PID 1, root), from the host's 9p share at
# /mnt/host (testenv/vm/vmtest.sh puts it there, with the binaries built on
# the host). The kernel command line says what to run:
#   tether.vmtest=tests          the kernel-level tests and the smoke test
#   tether.vmtest=tests,systemd  and then the .deb + testenv/systemd-e2e.sh
#   tether.out=NAME              results go to /mnt/host/out/NAME/
# Every step has a timeout; the summary is /mnt/host/out/NAME/summary.
set -uo pipefail
H=/mnt/host
arg() { tr ' ' '\n' </proc/cmdline | sed -n "s/^$1=//p" | tail -n1; }
MODE=$(arg tether.vmtest)
OUT=$H/out/$(arg tether.out)
mkdir -p "$OUT"
SUM=$OUT/summary
: >"$SUM"
FAILED=0
say() { echo "vmtest: $*"; }
put() { echo "$1=$2" >>"$SUM"; }
# Test binaries run without Go here: a stand-in `go` answers the tests'
# `go build -o OUT ./cmd/X` with the binary built on the host.
export PATH=$H/bin:$PATH
export CI=true # a missing requirement fails instead of skipping
export GOTRACEBACK=all
cd /root

put kernel "$(uname -r)"
put mode "$MODE"
say "kernel $(uname -r), $(nproc) CPUs, $(awk '/MemTotal/{print int($2/1024)" MiB"}' /proc/meminfo), mode $MODE"
mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf

# One test binary: NAME, TIMEOUT (s), binary path relative to tests/, args.
# Run from a copy of its package directory (testdata).
run_test() {
  local name=$1 limit=$2 rel=$3; shift 3
  local dir=/root/t/$(dirname "$rel")
  [ -d /root/t ] || cp -r "$H/tests" /root/t
  local start=$SECONDS rc
  say "test $name: $rel $* (limit ${limit}s)"
  (cd "$dir" && timeout -k 10 "$limit" "./$(basename "$rel")" -test.v -test.count=1 -test.timeout "$((limit - 5))s" "$@") >"$OUT/test-$name.log" 2>&1
  rc=$?
  local pass fail skip
  pass=$(grep -c -- '--- PASS' "$OUT/test-$name.log")
  fail=$(grep -c -- '--- FAIL' "$OUT/test-$name.log")
  skip=$(grep -c -- '--- SKIP' "$OUT/test-$name.log")
  local verdict=PASS
  if [ "$rc" != 0 ]; then verdict=FAIL; FAILED=1; fi
  [ "$rc" = 124 ] && verdict="FAIL(timeout)"
  put "test.$name" "$verdict pass=$pass fail=$fail skip=$skip time=$((SECONDS - start))s"
  say "test $name: $verdict ($pass passed, $fail failed, $skip skipped, $((SECONDS - start))s)"
  if [ "$verdict" != PASS ]; then
    # The failing tests by name, and their first messages, in the summary
    # itself: CI shows the summary, not the guest's logs.
    put "test.$name.failed" "$(grep -o -- '--- FAIL: [^ ]*' "$OUT/test-$name.log" | cut -d' ' -f3 | sort -u | tr '\n' ' ' | cut -c1-300)"
    # go test -v prints a test's messages before its --- FAIL line.
    put "test.$name.first_error" "$(grep -m1 -B1 -E -- '--- FAIL|^panic' "$OUT/test-$name.log" | head -n1 | sed 's/^[[:space:]]*//' | cut -c1-300)"
    grep -E -- '--- FAIL|^(FAIL|panic)|_test.go:[0-9]+:' "$OUT/test-$name.log" | head -n 40 | sed 's/^/  | /'
  fi
}

# tetherd in front of two demo workers with real requests. Prints the
# number of failed requests out of N; leaves its log in $OUT/smoke-NAME.log.
smoke() {
  local name=$1; shift
  local log=$OUT/smoke-$name.log
  local pin=/sys/fs/bpf/tether-smoke-$name
  rm -rf "$pin"
  timeout 300 "$H/bin/tetherd" --listen 127.0.0.1:18080 --admin 127.0.0.1:18081 --listeners 2 \
    --worker http://127.0.0.1:13000 --worker http://127.0.0.1:13001 "$@" >"$log" 2>&1 &
  local pid=$!
  local i
  for i in $(seq 600); do
    grep -q 'msg="tetherd serving"' "$log" && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if ! grep -q 'msg="tetherd serving"' "$log"; then
    wait "$pid" 2>/dev/null
    echo "not-serving"
    return
  fi
  local n=40 bad=0 body
  for i in $(seq "$n"); do
    body=$(curl -sf -m 20 -XPOST "http://127.0.0.1:18080/sessions/w$((i % 2))-0123456789abcdef0123456789abcd$(printf %02d "$i")/v1/chat/completions" \
      -H 'Content-Type: application/json' -d '{"messages":[{"role":"user","content":"hi"}],"max_tokens":4}') || { bad=$((bad + 1)); continue; }
    case $body in *choices*) ;; *) bad=$((bad + 1)) ;; esac
  done
  "$H/bin/tetherctl" status --admin 127.0.0.1:18081 >"$OUT/smoke-$name.status" 2>&1 || true
  kill -TERM "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  echo "$bad/$n"
}

if [[ $MODE == *tests* ]]; then
  demos=()
  for i in 0 1; do
    "$H/bin/tether-demo" --listen "127.0.0.1:1300$i" --index "$i" >"$OUT/demo-$i.log" 2>&1 &
    demos+=($!)
  done
  sleep 1

  # Assists: what tetherd itself says on this kernel, under the defaults.
  r=$(smoke default)
  put smoke.default "$r failed"
  say "smoke (defaults): $r failed requests"
  [ "$r" = "0/40" ] || FAILED=1
  if grep -q 'BPF steering unavailable' "$OUT/smoke-default.log"; then
    put assist.bpf_steering "off: $(grep -o 'BPF steering unavailable.*' "$OUT/smoke-default.log" | head -n1 | grep -o 'err=.*' | cut -c1-200)"
    FAILED=1 # every kernel of the matrix (5.10 on) must steer
  else
    put assist.bpf_steering "on: $(grep -o 'msg="BPF steering on".*' "$OUT/smoke-default.log" | head -n1 | cut -c1-300)"
  fi
  if grep -q 'socket calls one by one' "$OUT/smoke-default.log"; then
    put assist.io_uring "off: $(grep -o 'socket calls one by one.*' "$OUT/smoke-default.log" | head -n1 | grep -o 'err=.*' | cut -c1-200)"
  else
    put assist.io_uring on
  fi
  put smoke.default.warnings "$(grep -c 'level=WARN' "$OUT/smoke-default.log")"
  grep 'level=WARN\|level=ERROR' "$OUT/smoke-default.log" | sed 's/^/  | /'
  # tcp_migrate_req: queued connections of a drained listener move (kernel
  # hash path; the BPF program migrates itself), 5.14+.
  # (Debian's 5.10 shows the sysctl without the migration behind it.)
  if [ -e /proc/sys/net/ipv4/tcp_migrate_req ]; then put kernel.tcp_migrate_req "present (moves queues from 5.14 only)"; else put kernel.tcp_migrate_req absent; fi

  # --bpf=required: serves with steering, or refuses to start and says why.
  r=$(smoke required --bpf=required)
  put smoke.bpf_required "$r"
  say "smoke (--bpf=required): $r"
  if [ "$r" = not-serving ]; then
    put smoke.bpf_required.error "$(tail -n1 "$OUT/smoke-required.log" | cut -c1-300)"
    # Every kernel of the matrix steers (5.10 on): refusing is a failure.
    FAILED=1
  elif [ "$r" != 0/40 ]; then
    FAILED=1
  fi
  r=$(smoke syscalls --io-uring=false)
  put smoke.io_uring_off "$r failed"
  [ "$r" = 0/40 ] || FAILED=1

  run_test uring 300 userspace/uring/uring.test
  run_test sysconn 300 userspace/sysconn/sysconn.test
  # BPF steering on every kernel of the matrix (bpf_loop form from 5.17,
  # bounded-loop form below): the bpf and listener tests count everywhere.
  run_test bpf 600 bpf/bpf.test
  run_test listener 900 userspace/listener/listener.test
  burst=$(grep -o 'burst of [0-9]* connections over [0-9]* listeners.*' "$OUT/test-listener.log" | head -n1)
  put listener.burst_balance "${burst:-missing}"
  run_test upgrade 1500 cmd/tetherd/tetherd.test -test.run '^(TestUpgradeUnderLoad|TestUpgradePooledClients)$'
  run_test proxy-uring "${VM_PROXY_TIMEOUT:-1500}" userspace/proxy/proxy.test
  run_test proxy-syscalls "${VM_PROXY_TIMEOUT:-1500}" userspace/proxy/proxy.test -syscalls
  kill "${demos[@]}" 2>/dev/null
fi

if [[ $MODE == *systemd* ]]; then
  say "systemd: PID 1 is $(cat /proc/1/comm), systemd $(systemctl --version | head -n1 | awk '{print $2}')"
  # As a user would: apt installs the package (no network here; it needs none).
  deb=$(ls "$H"/deb/tether_*.deb | head -n1)
  cp "$deb" /root/
  if DEBIAN_FRONTEND=noninteractive apt-get install -y "/root/$(basename "$deb")" >"$OUT/apt-install.log" 2>&1; then
    put deb.install "PASS $(basename "$deb")"
  else
    put deb.install FAIL; FAILED=1; tail -n 20 "$OUT/apt-install.log"
  fi
  # The package's defaults: the shipped unit and /etc/tether/tetherd.json
  # untouched, started by systemctl; demo workers added over the admin API.
  for i in 0 1; do
    systemd-run --quiet --unit "demo-$i" --collect /usr/bin/tether-demo --listen "127.0.0.1:3100$i" --index "$i"
  done
  systemctl start tetherd
  sleep 1
  if systemctl is-active --quiet tetherd; then
    for i in 0 1; do tetherctl workers add "http://127.0.0.1:3100$i" >>"$OUT/deb-defaults.log" 2>&1; done
    ok=0
    for i in $(seq 20); do
      curl -sf -m 20 -XPOST "http://127.0.0.1:8080/sessions/w$((i % 2))-00000000000000000000000000000a$(printf %02d "$i")/v1/chat/completions" \
        -d '{"messages":[{"role":"user","content":"hi"}]}' -o /dev/null && ok=$((ok + 1))
    done
    tetherctl status >>"$OUT/deb-defaults.log" 2>&1
    put deb.defaults "$ok/20 requests answered by the unit's defaults ($(systemctl show -p ExecMainPID --value tetherd) $(systemctl show -p ActiveState --value tetherd))"
    [ "$ok" = 20 ] || FAILED=1
    # apt upgrades a running tetherd in place (postinst: tetherctl upgrade):
    # the same package with a higher version.
    before=$(systemctl show -p MainPID --value tetherd)
    rm -rf /root/up && dpkg-deb -R "/root/$(basename "$deb")" /root/up
    sed -i 's/^Version: .*/&+vmtest1/' /root/up/DEBIAN/control
    dpkg-deb -Znone -b /root/up /root/tether-up.deb >/dev/null
    if DEBIAN_FRONTEND=noninteractive apt-get install -y /root/tether-up.deb >>"$OUT/apt-install.log" 2>&1; then
      after=$(systemctl show -p MainPID --value tetherd)
      ok=0
      for i in $(seq 10); do
        curl -sf -m 20 -XPOST "http://127.0.0.1:8080/sessions/w$((i % 2))-00000000000000000000000000000b$(printf %02d "$i")/v1/chat/completions" \
          -d '{"messages":[{"role":"user","content":"hi"}]}' -o /dev/null && ok=$((ok + 1))
      done
      if [ "$after" != "$before" ] && systemctl is-active --quiet tetherd && [ "$ok" = 10 ]; then
        put deb.upgrade "PASS apt upgraded the running tetherd in place: MainPID $before -> $after, $ok/10 requests after"
      else
        put deb.upgrade "FAIL MainPID $before -> $after, active $(systemctl is-active tetherd), $ok/10 requests after"; FAILED=1
      fi
    else
      put deb.upgrade "FAIL apt-get install of the higher version"; FAILED=1
    fi
  else
    put deb.defaults "FAIL: unit not active"; FAILED=1
  fi
  journalctl -u tetherd --no-pager -o short-monotonic >"$OUT/journal-deb-defaults.log"
  systemctl stop tetherd demo-0 demo-1
  # The e2e script, on the installed package.
  start=$SECONDS
  if timeout -k 10 "${VM_E2E_TIMEOUT:-1800}" bash "$H/systemd-e2e.sh" --installed >"$OUT/systemd-e2e.log" 2>&1; then
    put systemd.e2e "PASS $(grep -E '^e2e:' "$OUT/systemd-e2e.log" | tail -n1) time=$((SECONDS - start))s"
  else
    put systemd.e2e "FAIL $(tail -n1 "$OUT/systemd-e2e.log") time=$((SECONDS - start))s"; FAILED=1
  fi
  sed 's/^/  | /' "$OUT/systemd-e2e.log" | tail -n 60
  journalctl -u tetherd --no-pager -o short-monotonic >"$OUT/journal-tetherd.log"
fi

if [ "$FAILED" = 0 ]; then put result PASS; else put result FAIL; fi
say "summary:"
sed 's/^/  /' "$SUM"
sync
