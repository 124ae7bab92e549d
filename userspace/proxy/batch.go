package proxy

// Batching a large body, one rule for both drivers: while at least
// batchMin bytes of a body are still to come, the receiving socket's
// SO_RCVLOWAT is batchLowat, so that a wake-up brings a batch rather than
// each ~64 KiB segment; for the last batchLowat bytes it has its default
// again, so that the end of a body never waits for bytes that will not
// come. The goroutine path applies it in conn.move (a net.TCPConn), the
// loop with lowat (upload: the client's socket; pumpSplice: the
// worker's). The figures behind the two sizes: bench/measurements.md
// ("Copy or splice").

import "golang.org/x/sys/unix"

const (
	batchMin   = 1 << 20
	batchLowat = 256 << 10
)

// batchMark is the rule: the SO_RCVLOWAT a socket takes with rest bytes
// of the body still to come, given whether its mark is raised now:
// batchLowat (raise it), 1 (lower it), or 0 (leave it).
func batchMark(raised bool, rest int64) int {
	switch {
	case raised && rest <= batchLowat:
		return 1
	case !raised && rest >= batchMin:
		return batchLowat
	}
	return 0
}

// lowat is whether a raw socket's SO_RCVLOWAT is raised (the loop's).
type lowat bool

// mark applies batchMark to fd for rest bytes still to come.
func (b *lowat) mark(fd int, rest int64) {
	switch batchMark(bool(*b), rest) {
	case batchLowat:
		*b = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVLOWAT, batchLowat) == nil
	case 1:
		b.lower(fd)
	}
}

// lower gives fd its default mark back, if it was raised: before a copy
// reads the socket, and before the socket serves anything else.
func (b *lowat) lower(fd int) {
	if *b {
		unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVLOWAT, 1)
		*b = false
	}
}
