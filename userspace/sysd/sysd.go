// Package sysd speaks systemd's service protocols without libsystemd: the
// notify socket (sd_notify(3): READY=1, RELOADING=1, STOPPING=1, MAINPID=,
// WATCHDOG=1, and FDSTORE=1 with file descriptors passed as SCM_RIGHTS),
// socket activation (sd_listen_fds(3): LISTEN_PID, LISTEN_FDS,
// LISTEN_FDNAMES) and the watchdog interval (WATCHDOG_USEC, WATCHDOG_PID).
// A few dozen lines on x/sys instead of a dependency (go-systemd does the
// same, with more than tether needs).
package sysd

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// First file descriptor passed by socket activation (SD_LISTEN_FDS_START).
const listenFDsStart = 3

// Notify sends state (newline-separated assignments such as "READY=1") to
// the socket named by $NOTIFY_SOCKET, with files passed along (FDSTORE=1).
// Without $NOTIFY_SOCKET (not run by systemd) it does nothing and reports
// false.
func Notify(state string, files ...*os.File) (bool, error) {
	path := os.Getenv("NOTIFY_SOCKET")
	if path == "" {
		return false, nil
	}
	if path[0] == '@' { // abstract namespace
		path = "\x00" + path[1:]
	} else if path[0] != '/' {
		return false, fmt.Errorf("NOTIFY_SOCKET %q: want an absolute path or @abstract", path)
	}
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return false, fmt.Errorf("notify socket: %w", err)
	}
	defer unix.Close(fd)
	var oob []byte
	if len(files) > 0 {
		fds := make([]int, len(files))
		for i, f := range files {
			if fds[i], err = RawFD(f); err != nil {
				return false, err
			}
		}
		oob = unix.UnixRights(fds...)
	}
	if err := unix.Sendmsg(fd, []byte(state), oob, &unix.SockaddrUnix{Name: path}, 0); err != nil {
		return false, fmt.Errorf("notify %q: %w", firstLine(state), err)
	}
	return true, nil
}

func firstLine(s string) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i]
	}
	return s
}

// Listener is a socket passed by systemd (socket activation or the fd
// store), with its name (FDNAME / FileDescriptorName=).
type Listener struct {
	Name string
	File *os.File
}

// Listeners returns the sockets systemd passed to this process
// ($LISTEN_FDS for $LISTEN_PID, named by $LISTEN_FDNAMES) and unsets those
// variables so that children do not take them too. None: nil.
func Listeners() ([]Listener, error) {
	defer func() {
		os.Unsetenv("LISTEN_PID")
		os.Unsetenv("LISTEN_FDS")
		os.Unsetenv("LISTEN_FDNAMES")
	}()
	pid := os.Getenv("LISTEN_PID")
	if pid == "" {
		return nil, nil
	}
	if p, err := strconv.Atoi(pid); err != nil || p != os.Getpid() {
		return nil, nil // meant for another process
	}
	n, err := strconv.Atoi(os.Getenv("LISTEN_FDS"))
	if err != nil || n < 0 {
		return nil, fmt.Errorf("LISTEN_FDS %q: not a count", os.Getenv("LISTEN_FDS"))
	}
	var names []string
	if v := os.Getenv("LISTEN_FDNAMES"); v != "" {
		names = strings.Split(v, ":")
	}
	out := make([]Listener, n)
	for i := range n {
		fd := listenFDsStart + i
		unix.CloseOnExec(fd)
		name := "unknown"
		if i < len(names) {
			name = names[i]
		}
		out[i] = Listener{Name: name, File: os.NewFile(uintptr(fd), name)}
	}
	return out, nil
}

// WatchdogInterval returns the interval systemd expects WATCHDOG=1 pings
// at (half of WatchdogSec, as sd_watchdog_enabled(3) advises), or 0 when
// the watchdog is off for this process.
func WatchdogInterval() time.Duration {
	usec := os.Getenv("WATCHDOG_USEC")
	if usec == "" {
		return 0
	}
	if pid := os.Getenv("WATCHDOG_PID"); pid != "" {
		if p, err := strconv.Atoi(pid); err != nil || p != os.Getpid() {
			return 0
		}
	}
	n, err := strconv.ParseInt(usec, 10, 64)
	if err != nil || n <= 0 {
		return 0
	}
	return time.Duration(n) * time.Microsecond / 2
}

// RawFD returns f's descriptor without File.Fd's side effect: Fd puts the
// descriptor in blocking mode, and O_NONBLOCK belongs to the open file
// description, which a dup of a listening socket shares with the listener
// still accepting in this process (its accept would then block in the
// kernel, where closing the listener cannot wake it).
func RawFD(f *os.File) (int, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return 0, err
	}
	fd := -1
	if err := rc.Control(func(u uintptr) { fd = int(u) }); err != nil {
		return 0, err
	}
	return fd, nil
}

// Dup returns a new descriptor of a socket (close-on-exec), leaving its
// blocking mode alone (unlike net.TCPListener.File, which makes the
// socket blocking for this process too: see RawFD).
func Dup(c syscall.Conn) (*os.File, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	nfd := -1
	var derr error
	if err := rc.Control(func(fd uintptr) {
		nfd, derr = unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 3)
	}); err != nil {
		return nil, err
	}
	if derr != nil {
		return nil, fmt.Errorf("dup: %w", derr)
	}
	return os.NewFile(uintptr(nfd), "socket"), nil
}

// TCPListener turns a passed socket into a listener, checking that it is a
// listening TCP socket.
func TCPListener(f *os.File) (*net.TCPListener, error) {
	ln, err := net.FileListener(f)
	if err != nil {
		return nil, fmt.Errorf("socket %s: %w", f.Name(), err)
	}
	tl, ok := ln.(*net.TCPListener)
	if !ok {
		ln.Close()
		return nil, errors.New("socket " + f.Name() + ": not a TCP listener")
	}
	return tl, nil
}
