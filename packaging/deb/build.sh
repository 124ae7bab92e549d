#!/usr/bin/env bash
# make deb: a Debian package of tether, built with dpkg-deb (no new tool).
#
#   packaging/deb/build.sh [OUTDIR]       -> OUTDIR/tether_<version>_<arch>.deb (default bin/)
#
# Contents: /usr/bin/{tetherd,tetherctl,tether-demo}, the unit
# /lib/systemd/system/tetherd.service (cmd/tetherd/tetherd.service with
# /usr/local -> /usr), /etc/tether/tetherd.json (a conffile: the example
# configuration), /usr/share/doc/tether/ (README, operations, vmtest).
# The binaries are static (CGO_ENABLED=0): the package depends on no library.
# Version: VERSION, else 0.0.0+git<commit time>.<commit> (-dirty when the
# tree has changes), so a newer commit sorts newer for apt.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-bin}
GO=${GO:-go}
ARCH=${GOARCH:-$($GO env GOARCH)}
if [ -z "${VERSION:-}" ]; then
  if git rev-parse --git-dir >/dev/null 2>&1; then
    VERSION=0.0.0+git$(TZ=UTC git log -1 --date=format-local:%Y%m%d%H%M%S --format=%cd).$(git rev-parse --short=12 HEAD)
    git diff --quiet HEAD -- 2>/dev/null || VERSION=$VERSION.dirty
  else
    VERSION=0.0.0+local
  fi
fi
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
chmod 0755 "$stage"
install -d -m 0755 "$stage/DEBIAN" "$stage/usr/bin" "$stage/lib/systemd/system" "$stage/etc/tether" "$stage/usr/share/doc/tether"
CGO_ENABLED=0 GOARCH=$ARCH $GO build -trimpath -o "$stage/usr/bin/" ./cmd/tetherd ./cmd/tetherctl ./cmd/tether-demo
sed 's|/usr/local|/usr|g' cmd/tetherd/tetherd.service >"$stage/lib/systemd/system/tetherd.service"
install -m 0644 cmd/tetherd/tetherd.example.json "$stage/etc/tether/tetherd.json"
for f in README.md docs/operations.md docs/vmtest.md; do
  [ -e "$f" ] && install -m 0644 "$f" "$stage/usr/share/doc/tether/$(basename "$f")"
done
cat >"$stage/usr/share/doc/tether/copyright" <<'TXT'
tether: session-affine HTTP/1.1 router for LLM RL rollouts.
Source: https://github.com/tether-rl/tether
TXT
install -m 0755 packaging/deb/postinst packaging/deb/prerm packaging/deb/postrm "$stage/DEBIAN/"
echo /etc/tether/tetherd.json >"$stage/DEBIAN/conffiles"
size=$(du -sk --exclude=DEBIAN "$stage" | cut -f1)
cat >"$stage/DEBIAN/control" <<CTL
Package: tether
Version: $VERSION
Architecture: $ARCH
Maintainer: tether developers <tether@users.noreply.github.com>
Installed-Size: $size
Section: net
Priority: optional
Recommends: systemd
Homepage: https://github.com/tether-rl/tether
Description: session-affine HTTP/1.1 router for LLM RL rollouts
 tetherd routes an RL trainer's rollout requests to inference workers
 (SGLang, vLLM), keeping each session on the worker that holds its prefix
 cache; BPF steering of its SO_REUSEPORT listeners and io_uring on the data
 path where the kernel has them. tetherctl drives it: status, workers,
 listener drains, zero-downtime upgrades. tether-demo is a stand-in worker.
 .
 The unit tetherd.service is installed but not enabled:
 systemctl enable --now tetherd (configuration: /etc/tether/tetherd.json).
CTL
mkdir -p "$OUT"
deb=$OUT/tether_${VERSION}_${ARCH}.deb
dpkg-deb --root-owner-group -Zxz --build "$stage" "$deb" >/dev/null
echo "$deb"
