package sysd

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/testenv"
)

// notifySocket opens a unixgram socket as $NOTIFY_SOCKET, as systemd does.
func notifySocket(t *testing.T) *net.UnixConn {
	t.Helper()
	path := filepath.Join(t.TempDir(), "notify")
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	t.Setenv("NOTIFY_SOCKET", path)
	return c
}

// receive reads one notification and the descriptors that came with it.
func receive(t *testing.T, c *net.UnixConn) (string, []int) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	buf, oob := make([]byte, 4096), make([]byte, unix.CmsgSpace(4*8))
	n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		t.Fatal(err)
	}
	var fds []int
	if oobn > 0 {
		msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range msgs {
			f, err := unix.ParseUnixRights(&m)
			if err != nil {
				t.Fatal(err)
			}
			fds = append(fds, f...)
		}
	}
	return string(buf[:n]), fds
}

func TestNotify(t *testing.T) {
	t.Setenv("NOTIFY_SOCKET", "")
	if sent, err := Notify("READY=1"); sent || err != nil {
		t.Fatalf("without NOTIFY_SOCKET: %v %v", sent, err)
	}
	c := notifySocket(t)
	if sent, err := Notify("READY=1\nMAINPID=" + strconv.Itoa(os.Getpid())); !sent || err != nil {
		t.Fatalf("notify: %v %v", sent, err)
	}
	if msg, fds := receive(t, c); msg != "READY=1\nMAINPID="+strconv.Itoa(os.Getpid()) || len(fds) != 0 {
		t.Fatalf("got %q %v", msg, fds)
	}
	// FDSTORE: the listener travels as SCM_RIGHTS and still accepts.
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	f, _ := ln.(*net.TCPListener).File()
	defer f.Close()
	if _, err := Notify("FDSTORE=1\nFDNAME=listener-0", f); err != nil {
		t.Fatal(err)
	}
	msg, fds := receive(t, c)
	if msg != "FDSTORE=1\nFDNAME=listener-0" || len(fds) != 1 {
		t.Fatalf("fd store: %q %v", msg, fds)
	}
	got, err := TCPListener(os.NewFile(uintptr(fds[0]), "listener-0"))
	if err != nil {
		t.Fatal(err)
	}
	defer got.Close()
	if got.Addr().String() != ln.Addr().String() {
		t.Fatalf("stored socket is %v, want %v", got.Addr(), ln.Addr())
	}
	t.Setenv("NOTIFY_SOCKET", "relative/path")
	if _, err := Notify("READY=1"); err == nil {
		t.Error("a relative NOTIFY_SOCKET was accepted")
	}
}

func TestWatchdogInterval(t *testing.T) {
	t.Setenv("WATCHDOG_USEC", "")
	if WatchdogInterval() != 0 {
		t.Fatal("watchdog without WATCHDOG_USEC")
	}
	t.Setenv("WATCHDOG_USEC", "20000000")
	t.Setenv("WATCHDOG_PID", strconv.Itoa(os.Getpid()))
	if got := WatchdogInterval(); got != 10*time.Second {
		t.Fatalf("interval %v, want half of 20s", got)
	}
	t.Setenv("WATCHDOG_PID", "1")
	if WatchdogInterval() != 0 {
		t.Fatal("watchdog meant for another process")
	}
}

// TestListeners runs itself as the activated child: systemd sets
// LISTEN_PID to the child's pid, which the helper takes from the
// environment at start.
func TestListeners(t *testing.T) {
	if os.Getenv("SYSD_TEST_CHILD") == "1" {
		os.Setenv("LISTEN_PID", strconv.Itoa(os.Getpid()))
		ls, err := Listeners()
		if err != nil || len(ls) != 2 || ls[0].Name != "data" || ls[1].Name != "admin" {
			fmt.Printf("listeners %v %v\n", ls, err)
			os.Exit(1)
		}
		for _, l := range ls {
			ln, err := TCPListener(l.File)
			if err != nil {
				fmt.Println(err)
				os.Exit(1)
			}
			fmt.Printf("%s=%s\n", l.Name, ln.Addr())
		}
		if os.Getenv("LISTEN_FDS") != "" {
			fmt.Println("LISTEN_FDS left for children")
			os.Exit(1)
		}
		os.Exit(0)
	}
	var files []*os.File
	var want string
	for _, name := range []string{"data", "admin"} {
		ln, err := net.Listen("tcp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		f, _ := ln.(*net.TCPListener).File()
		defer f.Close()
		files = append(files, f)
		want += name + "=" + ln.Addr().String() + "\n"
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestListeners$")
	cmd.Env = append(os.Environ(), "SYSD_TEST_CHILD=1", "LISTEN_FDS=2", "LISTEN_FDNAMES=data:admin")
	cmd.ExtraFiles = files // fds 3 and 4
	out, err := cmd.Output()
	if err != nil || string(out) != want {
		t.Fatalf("child: %v %q, want %q", err, out, want)
	}
}

// nonblocking reports whether the listener's socket is in O_NONBLOCK mode.
func nonblocking(t *testing.T, ln *net.TCPListener) bool {
	t.Helper()
	rc, _ := ln.SyscallConn()
	var fl int
	rc.Control(func(fd uintptr) { fl, _ = unix.FcntlInt(fd, unix.F_GETFL, 0) })
	return fl&unix.O_NONBLOCK != 0
}

// Handing a listening socket on (Dup, then Notify with FDSTORE, even
// File.Fd) leaves it non-blocking for the listener still accepting in this
// process: a blocking accept could not be woken by closing the listener.
// (net.TCPListener.File followed by Fd, as os/exec's ExtraFiles do, makes
// the shared open file description blocking: an old tetherd then hung in
// accept4 after an upgrade.)
func TestDupKeepsNonblocking(t *testing.T) {
	c := notifySocket(t)
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln := l.(*net.TCPListener)
	defer ln.Close()
	f, err := Dup(ln)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := Notify("FDSTORE=1\nFDNAME=data-0", f); err != nil {
		t.Fatal(err)
	}
	receive(t, c)
	f.Fd() // as os/exec does with ExtraFiles: harmless on Dup's file
	if !nonblocking(t, ln) {
		t.Fatal("the listener became blocking")
	}
	// And Close still ends a pending Accept.
	done := make(chan error, 1)
	go func() { _, err := ln.Accept(); done <- err }()
	testenv.WaitFor(t, "the Accept pending", func() bool { return waitingInAccept("sysd.TestDupKeepsNonblocking.") })
	ln.Close()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Accept not woken by Close")
	}
}

// waitingInAccept reports whether a goroutine started by the function
// named by caller (package.Func.) waits in a TCPListener's Accept: parked
// on the poller (the listener non-blocking) or in accept4 (blocking).
func waitingInAccept(caller string) bool {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, caller) && strings.Contains(g, "(*TCPListener).Accept") &&
			(strings.Contains(g, "runtime_pollWait") || strings.Contains(g, "accept4")) {
			return true
		}
	}
	return false
}
