// Package sysconn holds tether's raw-socket work in one place: the
// non-blocking peeks and polls that tell whether a peer left, socket
// options (SO_REUSEPORT, SO_RCVLOWAT), TCP_INFO, and running a function on
// a Go socket's descriptor without taking it out of the runtime's hands
// (no File, which would make it blocking).
package sysconn

import (
	"net"
	"syscall"

	"golang.org/x/sys/unix"
)

// Control runs f on c's descriptor (a listener or a connection) and
// returns f's error, or the error of reaching the descriptor.
func Control(c syscall.Conn, f func(fd int) error) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var ferr error
	if err := rc.Control(func(fd uintptr) { ferr = f(int(fd)) }); err != nil {
		return err
	}
	return ferr
}

// FD returns raw's descriptor number (-1 if closed). Only for registering
// it elsewhere (an epoll set): the runtime still owns it.
func FD(raw syscall.RawConn) int {
	fd := -1
	raw.Control(func(s uintptr) { fd = int(s) })
	return fd
}

// ReusePort is a net.ListenConfig Control that sets SO_REUSEPORT before
// the bind.
func ReusePort(_, _ string, c syscall.RawConn) error {
	var serr error
	err := c.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1)
	})
	if err != nil {
		return err
	}
	return serr
}

// SetRcvLowat sets SO_RCVLOWAT on c (the socket wakes its reader only once
// n bytes are queued) and reports whether it took.
func SetRcvLowat(c *net.TCPConn, n int) bool {
	return Control(c, func(fd int) error {
		return unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVLOWAT, n)
	}) == nil
}

// AcceptQueue returns the connections waiting in a listening socket's
// accept queue (TCP_INFO's tcpi_unacked on a listener).
func AcceptQueue(ln *net.TCPListener) (int, error) {
	var info *unix.TCPInfo
	err := Control(ln, func(fd int) error {
		var err error
		info, err = unix.GetsockoptTCPInfo(fd, unix.IPPROTO_TCP, unix.TCP_INFO)
		return err
	})
	if err != nil {
		return 0, err
	}
	return int(info.Unacked), nil
}
