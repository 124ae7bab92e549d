package bpf

import (
	"context"
	"net"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/testenv"
)

// TestInsertAfterRestart: a listening socket that outlives its tetherd
// (kept in systemd's fd store across `systemctl restart`, or owned by
// systemd with socket activation) stays in the pinned listener_sockets
// array, so the next tetherd, which is no upgrade, finds it there: putting
// it into the same slot again must work (it failed with EBUSY, and every
// restart under the unit fell back to the kernel hash: make vmtest), into
// another slot must not.
func TestInsertAfterRestart(t *testing.T) {
	testenv.RequireBPF(t)
	pin := testenv.BPFFS(t)
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1)
		}); err != nil {
			return err
		}
		return serr
	}}
	lc.SetMultipathTCP(false)
	l, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln := l.(*net.TCPListener)
	defer ln.Close()

	a, err := Open(pin)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Insert(0, ln); err != nil {
		t.Fatal(err)
	}
	a.Close() // the process ends; the socket lives on

	b, err := Open(pin)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if err := b.Insert(0, ln); err != nil {
		t.Fatalf("the same socket into the same slot after a restart: %v", err)
	}
	if err := b.Insert(1, ln); err == nil {
		t.Fatal("the same socket into a second slot was accepted")
	}
}
