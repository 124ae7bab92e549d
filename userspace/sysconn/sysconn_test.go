package sysconn

import (
	"context"
	"net"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/testenv"
)

// The helpers reach a Go socket's descriptor without making it blocking,
// and see what they should: options set, the accept queue, a peer's close.
func TestHelpers(t *testing.T) {
	lc := net.ListenConfig{Control: ReusePort}
	lc.SetMultipathTCP(false)
	l, err := lc.Listen(context.Background(), "tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ln := l.(*net.TCPListener)
	var reuse int
	if err := Control(ln, func(fd int) error {
		reuse, err = unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEPORT)
		return err
	}); err != nil || reuse != 1 {
		t.Fatalf("SO_REUSEPORT %d %v", reuse, err)
	}
	c, err := net.Dial("tcp4", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	testenv.WaitFor(t, "the connection in the accept queue", func() bool {
		q, _ := AcceptQueue(ln)
		return q == 1
	})
	sc, err := ln.AcceptTCP()
	if err != nil {
		t.Fatal(err)
	}
	defer sc.Close()
	if !SetRcvLowat(sc, 4096) {
		t.Fatal("SO_RCVLOWAT refused")
	}
	raw, _ := sc.SyscallConn()
	if FD(raw) < 0 {
		t.Fatal("no descriptor")
	}
	// Still non-blocking: a peek of a quiet peer says empty at once.
	var st PeekState
	raw.Read(func(fd uintptr) bool { st = Peek(fd); return true })
	if st != PeekEmpty || PeerGone(raw) {
		t.Fatalf("quiet peer: %v", st)
	}
	c.Close()
	testenv.WaitFor(t, "the peer's close seen", func() bool { return PeerGone(raw) })
	if err := Control(sc, func(int) error { return syscall.EINVAL }); err != syscall.EINVAL {
		t.Fatalf("Control lost f's error: %v", err)
	}
}

// Unpoll takes a listener out of the Go runtime's poller (the net package
// registered it) and of any other epoll set, but not out of those kept.
func TestUnpoll(t *testing.T) {
	lc := net.ListenConfig{}
	lc.SetMultipathTCP(false)
	ln, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	mine, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(mine)
	var fd int
	Control(ln.(*net.TCPListener), func(s int) error { fd = s; return nil })
	if err := unix.EpollCtl(mine, unix.EPOLL_CTL_ADD, fd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(fd)}); err != nil {
		t.Fatal(err)
	}
	n, err := Unpoll(fd, mine)
	if err != nil || n != 1 {
		t.Fatalf("Unpoll: %d sets left, %v; want the runtime's one", n, err)
	}
	if n, _ := Unpoll(fd, mine); n != 0 {
		t.Fatalf("second Unpoll left %d sets, want 0", n)
	}
	// The kept set still watches it: a connection makes it readable.
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ev := make([]unix.EpollEvent, 1)
	if k, err := unix.EpollWait(mine, ev, 5000); k != 1 || err != nil {
		t.Fatalf("kept set: %d events, %v", k, err)
	}
	// Closing the listener afterwards is fine (the runtime's delete of a
	// descriptor it no longer watches is ignored).
	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
}

// Recv and Send behave as unix.Read and unix.Write on a non-blocking
// socket: EAGAIN when there is nothing (room), the bytes, 0 at the peer's
// FIN, and EPIPE (never SIGPIPE) once the peer is gone.
func TestRecvSend(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	a, b := fds[0], fds[1]
	defer unix.Close(a)
	var buf [16]byte
	if n, err := Recv(a, buf[:]); n != -1 || err != unix.EAGAIN {
		t.Fatalf("empty: %d %v, want -1 EAGAIN", n, err)
	}
	if n, err := Send(b, []byte("hello")); n != 5 || err != nil {
		t.Fatalf("send: %d %v", n, err)
	}
	if n, err := Recv(a, buf[:]); n != 5 || err != nil || string(buf[:5]) != "hello" {
		t.Fatalf("recv: %d %v %q", n, err, buf[:n])
	}
	unix.Close(b)
	if n, err := Recv(a, buf[:]); n != 0 || err != nil {
		t.Fatalf("at the peer's FIN: %d %v, want 0 and no error", n, err)
	}
	if n, err := Send(a, []byte("x")); n != -1 || err != unix.EPIPE {
		t.Fatalf("send to a closed peer: %d %v, want -1 EPIPE", n, err)
	}
	// A full socket: EAGAIN.
	if fds, err = unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fds[0])
	defer unix.Close(fds[1])
	big := make([]byte, 1<<20)
	for {
		n, err := Send(fds[0], big)
		if err == unix.EAGAIN {
			if n != -1 {
				t.Fatalf("EAGAIN with n %d", n)
			}
			break
		}
		if err != nil || n <= 0 {
			t.Fatalf("filling: %d %v", n, err)
		}
	}
}
