package proxy

// Closing an idle keep-alive connection, the same on both data paths. HTTP/1.1
// gives a server no way to tell a client "do not send on this connection"
// other than a response that says Connection: close: a client that picks a
// pooled connection and writes its request while the server closes it
// loses that request (a reset or an EOF, and a POST is not retried). So:
//
//   - Before it closes a connection it found idle (the idle timeout, or a
//     shutdown's idle grace), a path looks once more: bytes that came
//     meanwhile are a request, read and served instead (hasPending: the
//     loop's sweep and expire, loop_deadline.go; the goroutine's readHead,
//     gor_head.go). What is left is a request that leaves the client in
//     the microseconds between that look and the close.
//   - A process that hands its sockets to a successor (an upgrade) closes
//     no idle connection on its own account before the idle timeout
//     (ShutdownGently with KeepIdle): every connection's next request is
//     served and answered with Connection: close, and an idle one is
//     closed only when a serving process would have closed it too, at
//     Config.IdleTimeout (longer than the idle timeouts of client pools,
//     which usually close first: Go's default transport 90 s, httpx 5 s,
//     aiohttp 15 s). The process then exits within IdleTimeout of the
//     upgrade, or once its longest request in flight ends, bounded by its
//     drain timeout.

import (
	"time"

	"golang.org/x/sys/unix"
)

// KeepIdle as ShutdownGently's idle grace: keep-alive connections are
// closed only by the idle timeout (Config.IdleTimeout), as while serving.
const KeepIdle time.Duration = -1

// hasPending reports whether bytes wait in fd's receive queue (a request
// written as its idle connection was about to close).
func hasPending(fd int) bool {
	var b [1]byte
	for {
		n, _, err := unix.Recvfrom(fd, b[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
		if err == unix.EINTR {
			continue
		}
		return err == nil && n > 0
	}
}
