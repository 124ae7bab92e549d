package proxy

// Splicing a long response body (pumpSplice): the bytes go from the
// worker's socket into a pipe and from the pipe to the client's socket
// with splice(2), never through user space. framing.go's spliceBody says which bytes may: a
// Content-Length remainder of at least SpliceMin, a body that ends at the
// close, and the rest of a chunked body's current chunk when at least
// SpliceMin of it is left (its end and the next chunk's size line are
// read and framed by the copy in pump, then the next chunk's data is
// spliced again). The upstream socket is batched (batch.go) by what is
// left of the Content-Length body or the chunk's data, and its mark
// lowered before the rest of a chunk is copied (splicing): the copy never
// reads under a raised mark.

import (
	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/userspace/httphead"
)

// pipe is a splice pipe of a loop.
type pipe struct {
	r, w int
	size int
}

// splicing reports whether x's next body bytes move by splice (and gives
// it a pipe): while its pipe holds bytes, or spliceBody says so.
func (l *loop) splicing(x *exchange) bool {
	if x.inPipe > 0 {
		return true
	}
	if spliceBody(x.fr.kind, x.left, &x.sc, x.fr.dechunk, l.s.cfg.SpliceMin) == 0 {
		if x.fr.kind != httphead.BodyChunked {
			return x.pipe != nil
		}
		// The rest of a chunk whose splice stopped short is copied: the
		// copy reads with the default mark, or a rest (and the chunk's
		// end) under the batch would never wake the loop.
		x.body.upLowat.lower(x.up.fd)
		return false
	}
	if x.pipe != nil {
		return true
	}
	x.pipe, _ = l.getPipe()
	return x.pipe != nil
}

// pumpSplice moves the body: the pipe is emptied to the client first, then
// filled from the worker (an EAGAIN on an empty pipe is the socket's). It
// returns the ending when the exchange ended; otherwise stepOn, with
// x.prog.done, or a socket that would block (x.sock.blocked: the client's;
// !x.sock.upReady: the worker's), or (chunked) the current chunk's data
// all through the pipe, its end to be read by the copy (x.sc.Data() 0).
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
		rest := spliceRest(x)
		if rest == 0 {
			return stepOn // a chunk's data is through: its end and the next size line are pump's copy
		}
		if !x.sock.upReady {
			return stepOn
		}
		x.body.upLowat.mark(x.up.fd, rest)
		want := p.size
		if rest > 0 {
			want = int(min(rest, int64(want)))
		}
		n, err := unix.Splice(x.up.fd, nil, p.w, nil, want, flags)
		switch {
		case n > 0:
			x.w.Stats.AddDown(n)
			x.inPipe += int(n)
			switch x.fr.kind {
			case httphead.BodyLength:
				x.left -= n
			case httphead.BodyChunked:
				x.sc.Skip(n)
			}
			// One splice can take the body (or chunk) past the mark and
			// to its end: the mark is lowered at once, or the next bytes
			// the framing must read (a later body's on a reused socket,
			// the chunk's end) would never wake the loop.
			x.body.upLowat.mark(x.up.fd, spliceRest(x))
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
// or the error that kept one from being made (a response body is then
// copied instead; a request body's exchange ends: noDescriptor). Out of
// descriptors, it gives up the oldest idle upstream sockets (a pipe takes
// two) and tries once more, as dial does.
func (l *loop) getPipe() (*pipe, error) {
	if n := len(l.pipes); n > 0 {
		p := l.pipes[n-1]
		l.pipes = l.pipes[:n-1]
		return p, nil
	}
	var fds [2]int
	err := unix.Pipe2(fds[:], unix.O_NONBLOCK|unix.O_CLOEXEC)
	if fdShortage(err) && l.dropOldestIdle() {
		l.dropOldestIdle()
		err = unix.Pipe2(fds[:], unix.O_NONBLOCK|unix.O_CLOEXEC)
	}
	if err != nil {
		return nil, err
	}
	size, err := unix.FcntlInt(uintptr(fds[1]), unix.F_SETPIPE_SZ, 1<<20)
	if err != nil {
		size, _ = unix.FcntlInt(uintptr(fds[1]), unix.F_GETPIPE_SZ, 0)
	}
	if size <= 0 {
		size = 64 << 10
	}
	return &pipe{r: fds[0], w: fds[1], size: size}, nil
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

// spliceRest is how many body bytes the splice may still take before the
// framing must read: a Content-Length body's rest, the rest of a chunk's
// data (0 between chunks), or -1 for a body that ends at the close.
func spliceRest(x *exchange) int64 {
	switch x.fr.kind {
	case httphead.BodyLength:
		return x.left
	case httphead.BodyChunked:
		return x.sc.Data()
	}
	return -1
}
