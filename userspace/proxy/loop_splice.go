package proxy

// Splicing a long response body (pumpSplice): the bytes go from the
// worker's socket into a pipe and from the pipe to the client's socket
// with splice(2), never through user space, as the goroutine path's
// conn.move does. A body of at least batchMin also raises the upstream
// socket's SO_RCVLOWAT to batchLowat, so that one wake-up moves a big
// batch, and lowers it again for the last batchLowat bytes.

import (
	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/userspace/httphead"
)

// pipe is a splice pipe of a loop.
type pipe struct {
	r, w int
	size int
}

// splicing reports whether x's body moves by splice (and gives it a pipe).
func (l *loop) splicing(x *lx) bool {
	if x.pipe != nil {
		return true
	}
	if x.fr.dechunk || !(x.fr.kind == httphead.BodyClose || x.fr.kind == httphead.BodyLength && x.left >= l.s.cfg.SpliceMin) {
		return false
	}
	x.pipe = l.getPipe()
	if x.pipe == nil {
		return false
	}
	if x.fr.kind == httphead.BodyLength && x.left >= batchMin {
		x.body.upLowat = unix.SetsockoptInt(x.up.fd, unix.SOL_SOCKET, unix.SO_RCVLOWAT, batchLowat) == nil
	}
	return true
}

// pumpSplice moves the body: the pipe is emptied to the client first, then
// filled from the worker (an EAGAIN on an empty pipe is the socket's). It
// returns the ending when the exchange ended; otherwise stepOn, with
// x.prog.done, or a socket that would block (x.sock.blocked: the client's;
// !x.sock.upReady: the worker's).
func (l *loop) pumpSplice(c *conn) step {
	x := c.x
	p := x.pipe
	const flags = unix.SPLICE_F_NONBLOCK | unix.SPLICE_F_MOVE
	for {
		if x.inPipe > 0 {
			n, err := unix.Splice(p.r, nil, c.fd, nil, x.inPipe, flags)
			switch {
			case n > 0:
				x.inPipe -= int(n)
				l.setDeadline(c, l.bodyTimeout(x))
				continue
			case err == unix.EINTR:
				continue
			case err == unix.EAGAIN:
				x.sock.blocked = true
				l.setDeadline(c, l.s.cfg.IOTimeout)
				return stepOn
			}
			return leaveAborted
		}
		if x.fr.kind == httphead.BodyLength && x.left == 0 || x.body.upEOF {
			x.prog.done = true // the pipe is empty too
			return stepOn
		}
		if !x.sock.upReady {
			return stepOn
		}
		want := p.size
		if x.fr.kind == httphead.BodyLength && x.left < int64(want) {
			want = int(x.left)
		}
		if x.body.upLowat && x.left <= batchLowat {
			l.lowerLowat(x)
		}
		n, err := unix.Splice(x.up.fd, nil, p.w, nil, want, flags)
		switch {
		case n > 0:
			x.w.Stats.AddDown(n)
			x.inPipe += int(n)
			if x.fr.kind == httphead.BodyLength {
				x.left -= n
				if x.body.upLowat && x.left <= batchLowat {
					// One splice can take the body past the mark and to
					// its end: the socket goes back to its pool with the
					// default mark, or a later body's tail would never
					// wake the loop.
					l.lowerLowat(x)
				}
			}
			continue
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			x.sock.upReady = false
			continue // x.sock.upReady false: return (after nothing is left in the pipe)
		case err == nil && x.fr.kind == httphead.BodyClose:
			// The worker's close ends the body, once the pipe is empty.
			x.body.upEOF, x.fr.reuse, x.fr.keep = true, false, false
			continue
		}
		return l.bodyFailed(c)
	}
}

// getPipe returns a free pipe of the loop (1 MiB where the system allows),
// or nil if none can be made (the body is copied instead).
func (l *loop) getPipe() *pipe {
	if n := len(l.pipes); n > 0 {
		p := l.pipes[n-1]
		l.pipes = l.pipes[:n-1]
		return p
	}
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_NONBLOCK|unix.O_CLOEXEC); err != nil {
		return nil
	}
	size, err := unix.FcntlInt(uintptr(fds[1]), unix.F_SETPIPE_SZ, 1<<20)
	if err != nil {
		size, _ = unix.FcntlInt(uintptr(fds[1]), unix.F_GETPIPE_SZ, 0)
	}
	if size <= 0 {
		size = 64 << 10
	}
	return &pipe{r: fds[0], w: fds[1], size: size}
}

// putPipe keeps an empty pipe for the next body (a few per loop); one
// holding bytes is closed.
func (l *loop) putPipe(p *pipe, empty bool) {
	if empty && len(l.pipes) < 8 {
		l.pipes = append(l.pipes, p)
		return
	}
	unix.Close(p.r)
	unix.Close(p.w)
}

// lowerLowat gives the upstream socket its default SO_RCVLOWAT back.
func (l *loop) lowerLowat(x *lx) {
	unix.SetsockoptInt(x.up.fd, unix.SOL_SOCKET, unix.SO_RCVLOWAT, 1)
	x.body.upLowat = false
}
