package proxy

// The lingering close, decided here for both data paths: after an answer
// sent before the client's request body was all read, the client
// connection is half-closed and what the client still sends is read and
// dropped, at most lingerBytes (framing.go) for at most Waits.Linger,
// before the close. Closing with unread bytes would make the kernel send
// a reset, which can destroy the answer before the client reads it.
//
// lingering holds that budget and says, after each read, whether to read
// again, wait for the socket (the loop), or close. Each path does only its
// own I/O around it: the loop's lingerClose and drain (loop_finish.go: a
// raw socket, the deadline its connection's one deadline,
// loop_deadline.go's expire), the goroutine's lingerClose (gor_head.go: a
// net.TCPConn, a read deadline).

import (
	"time"

	"golang.org/x/sys/unix"
)

// lingerChunk: the size of each read of a lingering close (a buffer on the
// reader's stack).
const lingerChunk = 4096

// lingering is a lingering close's budget: the bytes it may still read
// and drop. The zero value is not lingering.
type lingering struct {
	left int32
}

// lingerNext is what a lingering close does after a read.
type lingerNext uint8

const (
	lingerAgain lingerNext = iota // read again
	lingerWait                    // nothing to read now: wait for more, or the deadline
	lingerDone                    // close: the client's end, an error, the deadline, or the budget spent
)

// begin starts lingering and returns how long it may last (Waits.Linger),
// counted from now.
func (g *lingering) begin(cfg *Config) time.Duration {
	g.left = lingerBytes
	return cfg.Waits.Linger
}

// on reports whether a lingering close runs (begun, the budget not spent).
func (g *lingering) on() bool { return g.left > 0 }

// read accounts for one read's result (n bytes, err as the read returned
// them: a system call's errno or a net.Conn's error) and says what comes
// next.
func (g *lingering) read(n int, err error) lingerNext {
	if n > 0 {
		g.left -= int32(min(n, lingerBytes))
		if g.left <= 0 {
			g.left = 0
			return lingerDone
		}
		if err == nil {
			return lingerAgain
		}
	}
	switch err {
	case unix.EINTR:
		return lingerAgain
	case unix.EAGAIN:
		return lingerWait
	}
	return lingerDone // the client's end (0, nil), an error, the read deadline
}
