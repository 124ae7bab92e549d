package upstream

import (
	"syscall"
	"unsafe"
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
