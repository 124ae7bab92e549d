// Package testenv holds helpers for tether's kernel-level tests: throwaway
// network namespaces, veth pairs, a private bpffs per test, and the
// requirement checks that skip (loudly) on a developer's machine but fail
// in CI, where root and BPF are part of the contract.
package testenv

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// InCI reports whether the tests run in CI (CI=true), where a missing
// requirement is a failure, not a skip.
func InCI() bool { return os.Getenv("CI") == "true" }

func missing(t testing.TB, what, why string) {
	t.Helper()
	if InCI() {
		t.Fatalf("FAIL (needs %s, CI=true): %s", what, why)
	}
	t.Skipf("SKIP (needs %s): %s", what, why)
}

// RequireRoot skips the test (fails it in CI) unless it runs as root.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		missing(t, "root", "run the kernel-level tests with sudo (make test does)")
	}
}

// RequireBPF skips the test (fails it in CI) unless this process can create
// BPF maps: root with CAP_BPF and a kernel with the bpf syscall.
func RequireBPF(t testing.TB) {
	t.Helper()
	RequireRoot(t)
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		missing(t, "BPF", fmt.Sprintf("cannot create a BPF map: %v", err))
		return
	}
	m.Close()
}

// NetNS is a network namespace. Sockets belong to the namespace of the
// thread that creates them, so create listeners and client connections
// inside Do; accepting and reading/writing existing sockets works from any
// goroutine.
type NetNS struct {
	handle netns.NsHandle
}

// NewNetNS creates a fresh network namespace with its loopback up, closed
// when the test ends. The calling goroutine's thread is left where it was.
func NewNetNS(t testing.TB) *NetNS {
	t.Helper()
	RequireRoot(t)
	var (
		ns  netns.NsHandle
		err error
	)
	onThread(t, func(orig netns.NsHandle) {
		ns, err = netns.New() // unshare(CLONE_NEWNET): switches this thread
		if err != nil {
			return
		}
		if serr := netns.Set(orig); serr != nil {
			err = fmt.Errorf("restore netns: %w", serr)
		}
	})
	if err != nil {
		t.Fatalf("new netns: %v", err)
	}
	n := &NetNS{handle: ns}
	t.Cleanup(func() { n.handle.Close() })

	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatalf("netlink in netns: %v", err)
	}
	defer h.Close()
	lo, err := h.LinkByName("lo")
	if err != nil {
		t.Fatalf("netns lo: %v", err)
	}
	if err := h.LinkSetUp(lo); err != nil {
		t.Fatalf("netns lo up: %v", err)
	}
	return n
}

// WithNetNS runs fn inside a fresh network namespace (see NewNetNS).
func WithNetNS(t testing.TB, fn func()) *NetNS {
	t.Helper()
	n := NewNetNS(t)
	n.Do(t, fn)
	return n
}

// Do runs fn on the calling goroutine with its thread switched into the
// namespace, and switches back.
func (n *NetNS) Do(t testing.TB, fn func()) {
	t.Helper()
	var err error
	onThread(t, func(orig netns.NsHandle) {
		if err = netns.Set(n.handle); err != nil {
			return
		}
		defer func() {
			if serr := netns.Set(orig); serr != nil {
				// The thread stays locked (see onThread) and dies with
				// the goroutine: it never serves another one.
				panic(fmt.Sprintf("testenv: cannot restore netns: %v", serr))
			}
		}()
		fn()
	})
	if err != nil {
		t.Fatalf("enter netns: %v", err)
	}
}

// Dial connects from inside the namespace.
func (n *NetNS) Dial(t testing.TB, network, addr string) (net.Conn, error) {
	t.Helper()
	var (
		c   net.Conn
		err error
	)
	n.Do(t, func() { c, err = net.Dial(network, addr) })
	return c, err
}

// Sysctl writes /proc/sys/<name> (e.g. "net/core/somaxconn") as seen from
// inside the namespace, for the per-namespace net sysctls.
func (n *NetNS) Sysctl(t testing.TB, name, value string) {
	t.Helper()
	var err error
	n.Do(t, func() { err = os.WriteFile(filepath.Join("/proc/sys", name), []byte(value), 0o644) })
	if err != nil {
		t.Fatalf("sysctl %s=%s: %v", name, value, err)
	}
}

// onThread runs fn with the goroutine locked to its thread; fn gets the
// thread's original namespace. If fn panics the thread is not unlocked, so
// Go discards it rather than reuse it in a foreign namespace.
func onThread(t testing.TB, fn func(orig netns.NsHandle)) {
	t.Helper()
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		t.Fatalf("current netns: %v", err)
	}
	defer orig.Close()
	fn(orig)
	runtime.UnlockOSThread()
}

// Veth creates a veth pair with one end in a and the other in b, assigns
// the CIDR addresses (e.g. "10.99.0.1/24" — only ever inside the test's own
// namespaces) and brings both ends up. The pair goes with the namespaces.
func Veth(t testing.TB, a, b *NetNS, cidrA, cidrB string) (nameA, nameB string) {
	t.Helper()
	nameA, nameB = "tva"+randHex(3), "tvb"+randHex(3)
	ha, err := netlink.NewHandleAt(a.handle)
	if err != nil {
		t.Fatalf("netlink: %v", err)
	}
	defer ha.Close()
	hb, err := netlink.NewHandleAt(b.handle)
	if err != nil {
		t.Fatalf("netlink: %v", err)
	}
	defer hb.Close()
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: nameA}, PeerName: nameB, PeerNamespace: netlink.NsFd(b.handle)}
	if err := ha.LinkAdd(veth); err != nil {
		t.Fatalf("add veth: %v", err)
	}
	for _, end := range []struct {
		h          *netlink.Handle
		name, cidr string
	}{{ha, nameA, cidrA}, {hb, nameB, cidrB}} {
		l, err := end.h.LinkByName(end.name)
		if err != nil {
			t.Fatalf("veth %s: %v", end.name, err)
		}
		addr, err := netlink.ParseAddr(end.cidr)
		if err != nil {
			t.Fatalf("veth address %q: %v", end.cidr, err)
		}
		if err := end.h.AddrAdd(l, addr); err != nil {
			t.Fatalf("veth %s address: %v", end.name, err)
		}
		if err := end.h.LinkSetUp(l); err != nil {
			t.Fatalf("veth %s up: %v", end.name, err)
		}
	}
	// Wait for carrier: a SYN sent before it is lost and retried a second later.
	for _, end := range []struct {
		h    *netlink.Handle
		name string
	}{{ha, nameA}, {hb, nameB}} {
		deadline := time.Now().Add(2 * time.Second)
		for {
			l, err := end.h.LinkByName(end.name)
			if err == nil && l.Attrs().OperState == netlink.OperUp {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("veth %s: no carrier after 2s", end.name)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	return nameA, nameB
}

// BPFFS mounts a private bpffs instance for the test and returns a pin
// directory inside it; it is unmounted (dropping every pin) when the test
// ends. Tests never touch /sys/fs/bpf, so a running tetherd's pins are safe.
func BPFFS(t testing.TB) string {
	t.Helper()
	RequireBPF(t)
	dir := filepath.Join(t.TempDir(), "bpffs")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("bpf", dir, "bpf", 0, "mode=0700"); err != nil {
		missing(t, "a bpffs mount", fmt.Sprintf("mount -t bpf on %s: %v", dir, err))
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount test bpffs %s: %v", dir, err)
		}
	})
	return filepath.Join(dir, "tether-test-"+randHex(4), "v1")
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
