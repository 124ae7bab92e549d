#!/usr/bin/env bash
# make vmtest: tether's kernel-level tests on real kernels, in qemu.
#
#   testenv/vm/vmtest.sh                       the matrix: Debian's 5.10, 6.1, 6.12
#   VM_KERNELS=6.1 VM_SYSTEMD=6.1 testenv/vm/vmtest.sh     what CI runs
#
# Once, cached in .vmcache/ (ignored by git; delete it to start over): a
# minimal Debian 12 root filesystem (debootstrap) with systemd, and each
# kernel's package from Debian's archive, unpacked into that root with its
# own initramfs. Then, per kernel: a throwaway copy-on-write overlay of the
# root image, booted under qemu (KVM where /dev/kvm is usable, software
# emulation otherwise) with systemd as PID 1, and the binaries built here
# shared read-only over 9p. Inside, testenv/vm/guest.sh runs the kernel-level
# tests and a tetherd smoke test, and on VM_SYSTEMD's kernel also installs
# the .deb (make deb) with apt and runs testenv/systemd-e2e.sh under systemd.
# The guest writes its results back over 9p; the summary goes to stdout and
# .vmcache/summary.md.
#
# Knobs (environment): VM_KERNELS (default "5.10 6.1 6.12"), VM_SYSTEMD (the
# kernel whose boot also runs the systemd check; "none" for none; default
# 6.1), VM_TIMEOUT (seconds per boot, default 3600), VM_BOOT_TIMEOUT (seconds
# until the guest must have started its run, default 600), VM_MEM (MiB,
# default 3072), VM_CPUS (default 2), DEBIAN_MIRROR, VMCACHE.
#
# A VM that cannot boot is a failure (always; CI=true never turns it into a
# skip). Missing host tools (qemu, debootstrap) are a failure under CI=true
# and a loud skip otherwise.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
CACHE=${VMCACHE:-$ROOT/.vmcache}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
KERNELS=${VM_KERNELS:-5.10 6.1 6.12}
SYSTEMD_KERNEL=${VM_SYSTEMD:-6.1}
TIMEOUT=${VM_TIMEOUT:-3600}
BOOT_TIMEOUT=${VM_BOOT_TIMEOUT:-600}
MEM=${VM_MEM:-3072}
CPUS=${VM_CPUS:-2}
GO=${GO:-go}
# Bump to rebuild the cached root filesystem (its package list changed).
ROOTFS_VERSION=1
ROOTFS_PKGS=systemd,systemd-sysv,udev,dbus,kmod,initramfs-tools,busybox,curl,iproute2,procps,less,apt

log() { printf '[vmtest %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "FAIL: $*"; exit 1; }

suite_of() {
  case "$1" in
    5.10) echo bullseye ;;
    6.1) echo bookworm ;;
    6.12) echo trixie ;;
    *) die "unknown kernel $1 (known: 5.10 bullseye, 6.1 bookworm, 6.12 trixie)" ;;
  esac
}

need_tools() {
  local missing=()
  for t in qemu-system-x86_64 qemu-img debootstrap mkfs.ext4 dpkg-deb apt-get; do
    command -v "$t" >/dev/null || missing+=("$t")
  done
  [ "${#missing[@]}" = 0 ] && return 0
  if [ "${CI:-}" = true ]; then
    die "missing host tools: ${missing[*]} (apt-get install qemu-system-x86 qemu-utils debootstrap e2fsprogs)"
  fi
  log "SKIP (loud): missing host tools: ${missing[*]}; apt-get install qemu-system-x86 qemu-utils debootstrap e2fsprogs"
  exit 0
}

# The root filesystem: Debian 12, minimal, systemd as init, a unit that runs
# the test when the kernel command line asks for it, and nothing else.
build_rootfs() {
  local dir=$CACHE/rootfs
  if [ -e "$dir/.tether-rootfs-v$ROOTFS_VERSION" ]; then return; fi
  [ "$(id -u)" = 0 ] || die "building the root filesystem needs root (debootstrap)"
  log "debootstrap: Debian 12 root filesystem into $dir (once; a few minutes)"
  rm -rf "$dir" "$dir.tmp" "$CACHE/rootfs.img" "$CACHE"/kernels
  mkdir -p "$CACHE"
  debootstrap --variant=minbase --include="$ROOTFS_PKGS" bookworm "$dir.tmp" "$MIRROR" \
    >"$CACHE/debootstrap.log" 2>&1 || { tail -n 30 "$CACHE/debootstrap.log"; die "debootstrap failed (log: $CACHE/debootstrap.log)"; }
  local r=$dir.tmp
  echo tether-vm >"$r/etc/hostname"
  printf '127.0.0.1 localhost\n127.0.1.1 tether-vm\n' >"$r/etc/hosts"
  printf '/dev/vda / ext4 rw,relatime 0 1\n' >"$r/etc/fstab"
  # No password for root on the console (a throwaway VM without network).
  sed -i 's/^root:[^:]*:/root::/' "$r/etc/shadow"
  # Small initramfs, only what finding the root needs; gzip (5.10 too).
  sed -i 's/^MODULES=.*/MODULES=list/; s/^COMPRESS=.*/COMPRESS=gzip/' "$r/etc/initramfs-tools/initramfs.conf"
  printf 'virtio_pci\nvirtio_blk\next4\n' >>"$r/etc/initramfs-tools/modules"
  # Quiet, fast boots: no network to wait for, no timers.
  chroot "$r" systemctl mask systemd-networkd-wait-online.service apt-daily.timer apt-daily-upgrade.timer \
    e2scrub_all.timer fstrim.timer systemd-timesyncd.service >/dev/null 2>&1 || true
  mkdir -p "$r/mnt/host"
  cat >"$r/usr/local/sbin/tether-vmtest" <<'SH'
#!/bin/sh
# Mounts the host's share and runs its guest.sh; powers off whatever happens.
trap 'sync; systemctl poweroff --no-block' EXIT
modprobe 9pnet_virtio 2>/dev/null; modprobe 9p 2>/dev/null
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 tether /mnt/host || { echo "tether-vmtest: cannot mount the 9p share"; exit 1; }
echo "tether-vmtest: guest started on $(uname -r)"
/bin/bash /mnt/host/guest.sh
SH
  chmod 0755 "$r/usr/local/sbin/tether-vmtest"
  cat >"$r/etc/systemd/system/tether-vmtest.service" <<'UNIT'
[Unit]
Description=tether VM test run (testenv/vm/guest.sh from the host's 9p share)
ConditionKernelCommandLine=tether.vmtest
After=multi-user.target

[Service]
Type=oneshot
ExecStart=/usr/local/sbin/tether-vmtest
StandardOutput=journal+console
StandardError=journal+console
TimeoutStartSec=infinity

[Install]
WantedBy=multi-user.target
UNIT
  chroot "$r" systemctl enable tether-vmtest.service >/dev/null 2>&1
  touch "$r/.tether-rootfs-v$ROOTFS_VERSION"
  mv "$r" "$dir"
}

# apt, pointed at one Debian suite, with its own lists and cache in .vmcache.
apt_suite() {
  local tool=$1 suite=$2; shift 2
  local d=$CACHE/apt/$suite
  "$tool" -q -o Dir::Etc::SourceList="$d/sources.list" -o Dir::Etc::SourceParts=/dev/null \
    -o Dir::State::Lists="$d/lists" -o Dir::Cache="$d/cache" -o Dir::State::status=/dev/null \
    -o APT::Get::List-Cleanup=false -o Debug::NoLocking=true "$@"
}

# A kernel of the matrix: Debian's package for that suite, unpacked into the
# root filesystem, its modules indexed and an initramfs made in a chroot;
# vmlinuz and initrd copied out for qemu. Cached per kernel.
build_kernel() {
  local k=$1 suite kdir=$CACHE/kernels/$1
  if [ -e "$kdir/release" ]; then return; fi
  suite=$(suite_of "$k")
  local d=$CACHE/apt/$suite
  mkdir -p "$d/lists/partial" "$d/cache/archives/partial" "$kdir"
  local m=$MIRROR
  echo "deb $m $suite main" >"$d/sources.list"
  log "kernel $k: Debian $suite's linux-image-amd64 from $m"
  if ! apt_suite apt-get "$suite" update >"$kdir/apt.log" 2>&1; then
    # Suites that left deb.debian.org live on archive.debian.org.
    echo "deb http://archive.debian.org/debian $suite main" >"$d/sources.list"
    apt_suite apt-get "$suite" update >>"$kdir/apt.log" 2>&1 || { cat "$kdir/apt.log"; die "apt update for $suite failed"; }
  fi
  local pkg
  pkg=$(apt_suite apt-cache "$suite" depends linux-image-amd64 2>/dev/null | sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*\).*/\1/p' | head -n1)
  [ -n "$pkg" ] || die "kernel $k: no linux-image-<version> in $suite's linux-image-amd64"
  log "kernel $k: $pkg"
  (cd "$kdir" && rm -f ./*.deb && apt_suite apt-get "$suite" download "$pkg" >>"$kdir/apt.log" 2>&1) || { cat "$kdir/apt.log"; die "download $pkg failed"; }
  local x=$kdir/x
  rm -rf "$x" && mkdir -p "$x"
  dpkg-deb -x "$kdir"/*.deb "$x"
  # The root is merged-/usr (lib -> usr/lib): move an unmerged package's
  # /lib under /usr before copying it in.
  for top in lib bin sbin; do
    if [ -d "$x/$top" ] && [ ! -L "$x/$top" ]; then
      mkdir -p "$x/usr/$top" && cp -a "$x/$top/." "$x/usr/$top/" && rm -rf "${x:?}/$top"
    fi
  done
  local rel
  rel=$(ls "$x/usr/lib/modules")
  [ -n "$rel" ] || die "kernel $k: no modules in $pkg"
  cp -a "$x/." "$CACHE/rootfs/"
  rm -rf "$x" "$kdir"/*.deb
  unshare -m sh -c "mount -t proc proc '$CACHE/rootfs/proc' && mount -t sysfs sys '$CACHE/rootfs/sys' && mount --bind /dev '$CACHE/rootfs/dev' &&
    chroot '$CACHE/rootfs' depmod -a '$rel' && chroot '$CACHE/rootfs' update-initramfs -c -k '$rel'" >>"$kdir/apt.log" 2>&1 \
    || { tail -n 30 "$kdir/apt.log"; die "kernel $k: depmod/initramfs failed"; }
  cp "$CACHE/rootfs/boot/vmlinuz-$rel" "$kdir/vmlinuz"
  cp "$CACHE/rootfs/boot/initrd.img-$rel" "$kdir/initrd"
  rm -f "$CACHE/rootfs.img" # the root changed: the image is made again
  echo "$rel" >"$kdir/release"
  log "kernel $k: $rel ready"
}

build_image() {
  local img=$CACHE/rootfs.img
  if [ -e "$img" ]; then return; fi
  log "root image: mkfs.ext4 -d (sparse, 4 GiB)"
  rm -f "$img.tmp"
  mkfs.ext4 -q -F -L tetherroot -d "$CACHE/rootfs" "$img.tmp" 4G
  mv "$img.tmp" "$img"
}

# The packages whose tests run in the VM (kernel-level: io_uring, sockets,
# BPF steering, listeners, the upgrade handover, the data path).
TEST_PKGS="userspace/uring userspace/sysconn bpf userspace/listener cmd/tetherd userspace/proxy"

# What the guest needs, built here: static binaries, test binaries, the
# .deb, the guest scripts, a stand-in `go` for the tests that build tetherd.
build_share() {
  local share=$CACHE/share
  rm -rf "$share"
  mkdir -p "$share/bin" "$share/tests" "$share/out" "$share/deb"
  local race=() cgo=0
  if [ "${VM_RACE:-0}" = 1 ]; then race=(-race); cgo=1; fi
  log "build: tetherd, tetherctl, tether-demo; test binaries of $TEST_PKGS ${race[*]}"
  CGO_ENABLED=$cgo $GO build "${race[@]}" -trimpath -o "$share/bin/" ./cmd/tetherd ./cmd/tetherctl ./cmd/tether-demo
  for p in $TEST_PKGS; do
    mkdir -p "$share/tests/$p"
    CGO_ENABLED=$cgo $GO test "${race[@]}" -c -o "$share/tests/$p/$(basename "$p").test" "./$p"
    if [ -d "$p/testdata" ]; then cp -r "$p/testdata" "$share/tests/$p/"; fi
  done
  cp -r headers "$share/tests/" # bpf's TestHeaderMirror reads ../headers
  log "build: the .deb (make deb)"
  packaging/deb/build.sh "$share/deb" >/dev/null
  cp testenv/vm/guest.sh testenv/systemd-e2e.sh "$share/"
  cat >"$share/bin/go" <<'SH'
#!/bin/sh
# In the VM there is no Go: `go build -o OUT PKG` (what the tests run to get
# tetherd or tether-demo) copies the binary built on the host instead.
[ "$1" = build ] || { echo "vm go stand-in: only 'go build -o OUT PKG'" >&2; exit 2; }
shift; out=; pkg=
while [ $# -gt 0 ]; do case $1 in -o) out=$2; shift 2 ;; -*) shift ;; *) pkg=$1; shift ;; esac; done
exec cp "/mnt/host/bin/$(basename "$pkg")" "${out:-.}"
SH
  chmod 0755 "$share/bin/go"
}

# KVM where it works (a /dev/kvm can be there and not work: nested
# virtualisation without the CPU features, or a sandbox's stand-in): a
# kernel that prints its banner within 20 s under KVM says it does.
# Otherwise software emulation (TCG), 10-30x slower. VM_ACCEL=kvm|tcg forces.
ACCEL=
accel() {
  if [ -z "$ACCEL" ]; then
    ACCEL="-accel tcg,thread=multi -cpu max"
    if [ "${VM_ACCEL:-}" = kvm ]; then
      ACCEL="-accel kvm -cpu host"
    elif [ "${VM_ACCEL:-}" != tcg ] && [ -w /dev/kvm ]; then
      local k probe
      k=$(ls "$CACHE"/kernels/*/vmlinuz | head -n1)
      probe=$(mktemp)
      (timeout 20 qemu-system-x86_64 -nodefaults -no-user-config -machine pc -accel kvm -cpu host -m 256 \
        -display none -no-reboot -nic none -kernel "$k" -append "console=ttyS0 panic=-1" -serial "file:$probe") >/dev/null 2>&1 || true
      if grep -q 'Linux version' "$probe"; then ACCEL="-accel kvm -cpu host"
      else log "/dev/kvm is there but a kernel does not start under it: software emulation (TCG)"; fi
      rm -f "$probe"
    fi
  fi
  echo "$ACCEL"
}

# One boot: kernel $1, what to run $2 (tests, tests+systemd). Returns 0 if
# the guest ran and wrote result=PASS.
boot() {
  local k=$1 mode=$2 kdir=$CACHE/kernels/$1 run=$CACHE/run/$1
  local out=$CACHE/share/out/$k rel
  rel=$(cat "$kdir/release")
  rm -rf "$run" "$out"
  mkdir -p "$run" "$out"
  qemu-img create -q -f qcow2 -F raw -b "$CACHE/rootfs.img" "$run/overlay.qcow2"
  local a; a=$(accel)
  log "boot $k ($rel) [$a] mode=$mode, limit ${TIMEOUT}s; console: $run/console.log"
  local start=$SECONDS
  # shellcheck disable=SC2086
  timeout -k 10 "$TIMEOUT" qemu-system-x86_64 -nodefaults -no-user-config -machine pc $a \
    -m "$MEM" -smp "$CPUS" -display none -no-reboot -nic none \
    -kernel "$kdir/vmlinuz" -initrd "$kdir/initrd" \
    -append "root=/dev/vda rw console=ttyS0 panic=-1 quiet systemd.show_status=0 tether.vmtest=$mode tether.out=$k" \
    -drive "file=$run/overlay.qcow2,if=virtio,format=qcow2,cache=unsafe" \
    -virtfs "local,path=$CACHE/share,mount_tag=tether,security_model=none,id=tether" \
    -serial "file:$run/console.log" &
  local q=$!
  # The guest's own lines, live.
  tail -n +1 -F "$run/console.log" 2>/dev/null --pid=$q | grep --line-buffered -E 'vmtest|tether-vmtest|  \||Kernel panic|end Kernel' | sed -u "s/^/[$k] /" &
  local t=$!
  local booted=0
  while kill -0 "$q" 2>/dev/null; do
    if [ "$booted" = 0 ]; then
      if grep -q 'tether-vmtest: guest started' "$run/console.log" 2>/dev/null; then
        booted=1; log "$k: booted in $((SECONDS - start))s"
      elif [ $((SECONDS - start)) -gt "$BOOT_TIMEOUT" ]; then
        log "$k: FAIL: the guest did not start its run within ${BOOT_TIMEOUT}s; last console lines:"
        tail -n 40 "$run/console.log" >&2
        kill "$q" 2>/dev/null
        break
      fi
    fi
    sleep 2
  done
  local rc=0
  wait "$q" || rc=$?
  sleep 1; kill "$t" 2>/dev/null || true; wait "$t" 2>/dev/null || true
  echo "time=$((SECONDS - start))s" >>"$out/summary" 2>/dev/null
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    log "$k: FAIL: qemu ran past ${TIMEOUT}s"; echo "result=FAIL (timeout)" >>"$out/summary"; return 1
  fi
  if [ "$booted" = 0 ]; then
    echo "result=FAIL (did not boot)" >>"$out/summary"
    tail -n 40 "$run/console.log" >&2
    return 1
  fi
  grep -q '^result=PASS' "$out/summary"
}

run_all() {
  build_share
  accel >/dev/null # probe KVM once, here (not in each boot's subshell)
  local total=$SECONDS failed=0 report=$CACHE/summary.md
  for k in $KERNELS; do
    local mode=tests
    [ "$k" = "$SYSTEMD_KERNEL" ] && mode=tests,systemd
    boot "$k" "$mode" || failed=1
  done
  if [ "$SYSTEMD_KERNEL" != none ] && ! grep -qwF -- "$SYSTEMD_KERNEL" <<<"$KERNELS"; then
    build_kernel "$SYSTEMD_KERNEL"; build_image
    boot "$SYSTEMD_KERNEL" systemd || failed=1
  fi
  {
    echo "# make vmtest: $(date -u +%Y-%m-%dT%H:%M:%SZ), $(accel | awk '{print $2}'), $((SECONDS - total))s"
    echo
    for k in $KERNELS $( [ "$SYSTEMD_KERNEL" != none ] && ! grep -qwF -- "$SYSTEMD_KERNEL" <<<"$KERNELS" && echo "$SYSTEMD_KERNEL"); do
      echo "## $k"
      echo '```'
      cat "$CACHE/share/out/$k/summary" 2>/dev/null || echo "result=FAIL (no summary)"
      echo '```'
    done
  } >"$report"
  cat "$report"
  log "summary written to $report; logs in $CACHE/share/out/<kernel>/"
  if [ "$failed" != 0 ]; then log "FAIL"; exit 1; fi
  log "PASS"
}

prepare() {
  need_tools
  build_rootfs
  for k in $KERNELS; do build_kernel "$k"; done
  build_image
}

case "${1:-all}" in
  prepare) prepare ;;                      # root filesystem, kernels, image (cached)
  build) build_share ;;                    # binaries, test binaries, .deb into .vmcache/share
  boot) prepare; accel >/dev/null; boot "${2:?kernel}" "${3:-tests}" ;;   # one boot of the last build: boot 6.1 tests,systemd
  all) prepare; run_all ;;
  *) echo "usage: $0 [all|prepare|build|boot KERNEL [tests|systemd|tests,systemd]]" >&2; exit 2 ;;
esac
