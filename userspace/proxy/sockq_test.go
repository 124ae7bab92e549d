package proxy

// Socket queues seen from outside the proxy: what a test waits on instead
// of sleeping "long enough" for the proxy to have read what was sent.

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/testenv"
)

// unacked returns how many bytes written to c its peer has not yet
// acknowledged (SIOCOUTQ), -1 if c has no socket (closed).
func unacked(c net.Conn) int {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return -1
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return -1
	}
	n := -1
	raw.Control(func(fd uintptr) {
		if v, err := unix.IoctlGetInt(int(fd), unix.SIOCOUTQ); err == nil {
			n = v
		}
	})
	return n
}

// peerUnread returns how many bytes wait unread in the receive queue of
// the socket at the other end of c, an IPv4 connection within this host
// (and network namespace): its rx_queue in /proc/net/tcp. -1 when not
// found.
func peerUnread(c net.Conn) int {
	fs := procTCP(c.RemoteAddr(), c.LocalAddr())
	if fs == nil {
		return -1
	}
	_, rx, _ := strings.Cut(fs[4], ":") // tx_queue:rx_queue
	n, err := strconv.ParseUint(rx, 16, 32)
	if err != nil {
		return -1
	}
	return int(n)
}

// heldBack reports whether c's socket has data to send that its peer's
// receive window does not let it send: its zero window probe timer runs
// (timer 4 in /proc/net/tcp). The peer takes no more until its owner reads.
func heldBack(c net.Conn) bool {
	fs := procTCP(c.LocalAddr(), c.RemoteAddr())
	if fs == nil {
		return false
	}
	tr, _, _ := strings.Cut(fs[5], ":") // tr:tm->when
	return tr == "04"
}

// procTCP returns the fields of the /proc/net/tcp line of the socket with
// the given local and remote IPv4 addresses (this network namespace), nil
// if there is none.
func procTCP(local, remote net.Addr) []string {
	l, r := procAddr(local), procAddr(remote)
	if l == "" || r == "" {
		return nil
	}
	f, err := os.Open("/proc/net/tcp")
	if err != nil {
		return nil
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// sl local_address rem_address st tx_queue:rx_queue tr:tm->when ...
		if fs := strings.Fields(sc.Text()); len(fs) >= 6 && fs[1] == l && fs[2] == r {
			return fs
		}
	}
	return nil
}

// openTo counts this namespace's sockets connected to addr (an IPv4
// host:port) that are still ESTABLISHED: a socket whose peer closed is in
// CLOSE_WAIT once its FIN was processed, which under load may come after
// the peer's close returned.
func openTo(t testing.TB, addr string) int {
	ta, err := net.ResolveTCPAddr("tcp4", addr)
	if err != nil {
		t.Fatal(err)
	}
	r := procAddr(ta)
	f, err := os.Open("/proc/net/tcp")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	n := 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// sl local_address rem_address st ...
		if fs := strings.Fields(sc.Text()); len(fs) >= 4 && fs[2] == r && fs[3] == "01" {
			n++
		}
	}
	return n
}

// procAddr writes a TCP address as /proc/net/tcp does: the IPv4 address
// as a native-endian word, then the port, in hex. "" if not IPv4.
func procAddr(a net.Addr) string {
	ta, ok := a.(*net.TCPAddr)
	if !ok || ta.IP.To4() == nil {
		return ""
	}
	return fmt.Sprintf("%08X:%04X", binary.NativeEndian.Uint32(ta.IP.To4()), ta.Port)
}

// waitPeerRead waits until the other end of c has read everything written
// to c: all of it acknowledged, none of it left in the peer's receive
// queue. What is written to c next comes to the peer in a later read.
func waitPeerRead(t testing.TB, c net.Conn, what string) {
	t.Helper()
	testenv.WaitFor(t, what, func() bool { return unacked(c) == 0 && peerUnread(c) == 0 })
}
