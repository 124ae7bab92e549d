package sysconn

import (
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// PeekState is what a non-blocking MSG_PEEK of one byte saw on a socket.
type PeekState int

const (
	PeekEmpty  PeekState = iota // nothing to read: the peer is quiet (EAGAIN)
	PeekData                    // bytes are waiting
	PeekClosed                  // EOF or an error: the peer closed or reset
)

// Peek looks at fd without reading from it or blocking. It makes the
// recvfrom(2) call itself: x/sys's wrapper allocates a sockaddr per call,
// and this runs once per request.
func Peek(fd uintptr) PeekState {
	var b [1]byte
	n, _, errno := syscall.Syscall6(syscall.SYS_RECVFROM, fd, uintptr(unsafe.Pointer(&b[0])), 1,
		syscall.MSG_PEEK|syscall.MSG_DONTWAIT, 0, 0)
	switch {
	case errno == syscall.EAGAIN:
		return PeekEmpty
	case errno != 0 || n == 0:
		return PeekClosed
	}
	return PeekData
}

// PeerShutdown reports, without blocking, whether the peer of fd shut down
// its sending side or reset the connection, even with bytes still waiting
// to be read (where Peek only sees PeekData).
func PeerShutdown(fd uintptr) bool {
	return pollNow(fd)&(unix.POLLRDHUP|unix.POLLHUP|unix.POLLERR) != 0
}

// PeerReset reports, without blocking, whether the connection on fd was
// reset or is shut down both ways, even with bytes still waiting to be read.
func PeerReset(fd uintptr) bool {
	return pollNow(fd)&(unix.POLLHUP|unix.POLLERR) != 0
}

// pollNow returns fd's poll(2) events now (POLLRDHUP asked for).
func pollNow(fd uintptr) int16 {
	fds := [1]unix.PollFd{{Fd: int32(fd), Events: unix.POLLRDHUP}}
	if n, err := unix.Poll(fds[:], 0); err != nil || n != 1 {
		return 0
	}
	return fds[0].Revents
}

// PeerGone reports, without blocking, whether the peer of raw closed or
// reset the connection. A reset with unread bytes still queued (a body the
// client was sending) counts: a peek alone sees only the bytes.
func PeerGone(raw syscall.RawConn) bool {
	gone := false
	raw.Read(func(fd uintptr) bool {
		switch Peek(fd) {
		case PeekClosed:
			gone = true
		case PeekData:
			gone = PeerReset(fd)
		}
		return true
	})
	return gone
}
