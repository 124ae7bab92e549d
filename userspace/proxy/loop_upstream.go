package proxy

// A loop's own upstream sockets: one set of idle ones per worker
// (upstream.Idle, the pool's rule), kept in the epoll set with EPOLLRDHUP, so that a worker's close is seen
// when it happens instead of being peeked at each reuse; non-blocking
// connects; the events of the sockets in use.

import (
	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/userspace/sysconn"
	"github.com/tether-rl/tether/userspace/upstream"
)

// upconn is an upstream socket of a loop.
type upconn struct {
	fd         int
	seq        uint32
	pool       *upstream.Pool
	cl         *conn // the exchange using it; nil while idle
	connecting bool
	fresh      bool
	since      int64 // idle since
}

// upstream returns the loop's most recently idle connection to p, or a new
// one (its connect possibly in progress).
func (l *loop) upstream(p *upstream.Pool, sa unix.Sockaddr) (*upconn, error) {
	if set := l.idle[p]; set != nil {
		if u, ok := set.Pop(); ok {
			l.s.counters.UpstreamIdle.Add(-1)
			u.fresh = false
			return u, nil
		}
	}
	return l.dial(p, sa)
}

// dial opens a new connection to p (its connect possibly in progress).
// Out of descriptors (EMFILE, ENFILE), the loop gives up its oldest idle
// upstream socket and tries once more: a request is worth more than a
// connection kept for a later one.
func (l *loop) dial(p *upstream.Pool, sa unix.Sockaddr) (*upconn, error) {
	if !l.fdRoom(1) {
		l.dropOldestIdle() // at the cap's budget: the new socket takes an idle one's place
	}
	u, err := l.dialOnce(p, sa)
	if err != nil && fdShortage(err) && l.dropOldestIdle() {
		u, err = l.dialOnce(p, sa)
	}
	return u, err
}

// fdShortage reports whether err is the want of a descriptor.
func fdShortage(err error) bool { return err == unix.EMFILE || err == unix.ENFILE }

func (l *loop) dialOnce(p *upstream.Pool, sa unix.Sockaddr) (*upconn, error) {
	family := unix.AF_INET
	if _, ok := sa.(*unix.SockaddrInet6); ok {
		family = unix.AF_INET6
	}
	fd, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
	err = unix.Connect(fd, sa)
	if err != nil && err != unix.EINPROGRESS {
		unix.Close(fd)
		return nil, err
	}
	u := &upconn{fd: fd, seq: l.nextSeq(), pool: p, connecting: err != nil, fresh: true}
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(fd), Pad: int32(u.seq)}
	if err := unix.EpollCtl(l.epfd, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
		unix.Close(fd)
		return nil, err
	}
	l.ups[int32(fd)] = u
	l.s.upSockets.Add(1)
	if !u.connecting {
		p.Stats().ConnOpened()
	}
	return u, nil
}

// closeUp closes an upstream socket.
func (l *loop) closeUp(u *upconn) {
	if u.fd < 0 {
		return
	}
	delete(l.ups, int32(u.fd))
	unix.Close(u.fd)
	l.s.upSockets.Add(-1)
	u.fd = -1
	if !u.connecting {
		u.pool.Stats().ConnClosed()
	}
}

// putIdle keeps u for the next request to its worker (the loop's share of
// the pool's MaxIdle, the oldest evicted); it stays in the epoll set, so a
// worker that closes it is seen when it does, not at the next use.
func (l *loop) putIdle(u *upconn) {
	u.cl = nil
	p := u.pool
	if p.Closed() || !l.fdRoom(l.s.nloops.Load()) {
		// (Kept, it would leave no descriptor for each loop's next
		// connect: fdRoom.)
		l.closeUp(u)
		return
	}
	u.since = l.now
	set := l.idle[p]
	if set == nil {
		set = new(upstream.Idle[*upconn])
		l.idle[p] = set
	}
	if old, evicted := set.Push(u, l.maxIdle(p)); evicted {
		l.closeUp(old)
		l.s.counters.UpstreamIdle.Add(-1)
	}
	l.s.counters.UpstreamIdle.Add(1)
	l.setDue(u.since + int64(p.Options().IdleTimeout))
}

// fdRoom reports whether, under Config.MaxConns, n more descriptors fit
// in the ones the cap budgets for sockets (fdsPerConn per connection: the
// client's socket and one upstream socket) besides those held now: the
// open client connections and the upstream sockets, the loops' (in use
// and idle) and upstream.Pool's idle ones. An idle upstream socket holds a
// descriptor the cap did not count (it is no client's): past the budget,
// one is closed rather than kept (putIdle), a new connect takes an idle
// socket's place (dial), and a new client waits in the kernel's queue
// (accept), so that under a descriptor limit (ulimit -n, from which the
// default cap is derived) neither a connect nor an accept fails with
// EMFILE for want of what idle sockets hold. Without a cap, always true.
func (l *loop) fdRoom(n int64) bool {
	return l.fdRoomOf(n, upstream.IdleConns.Load())
}

// fdRoomForClient is fdRoom for a new client: without the goroutine
// path's idle pools, which no loop can close (their janitor does, within
// a minute): counted, they could keep clients in the kernel's queue while
// far below the cap.
func (l *loop) fdRoomForClient() bool { return l.fdRoomOf(fdsPerConn, 0) }

func (l *loop) fdRoomOf(n, poolIdle int64) bool {
	max := int64(l.s.cfg.MaxConns)
	if max <= 0 {
		return true
	}
	held := l.s.counters.Open.Load() + l.s.upSockets.Load() + poolIdle
	return held+n <= fdsPerConn*max
}

// dropOldestIdle closes the loop's idle upstream socket that has been idle
// longest (to any worker), for a descriptor; false if the loop has none.
func (l *loop) dropOldestIdle() bool {
	var oldest *upconn
	for _, set := range l.idle {
		if u, ok := set.Oldest(); ok && (oldest == nil || u.since < oldest.since) {
			oldest = u
		}
	}
	if oldest == nil {
		return false
	}
	l.dropIdle(oldest)
	return true
}

// dropIdle closes an idle upstream socket the worker closed (or wrote to
// unasked).
func (l *loop) dropIdle(u *upconn) {
	if set := l.idle[u.pool]; set != nil && set.Remove(u) {
		l.s.counters.UpstreamIdle.Add(-1)
	}
	l.closeUp(u)
}

// upEvent handles an event on an upstream socket: an idle one the worker
// closed is dropped; one in use moves its exchange on (exchangeEvent).
func (l *loop) upEvent(u *upconn, ev uint32) {
	c := u.cl
	if c == nil {
		if ev&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
			l.dropIdle(u)
		}
		return
	}
	l.drive(c, l.exchangeEvent(c, u, ev))
}

// exchangeEvent handles an event on u, the upstream socket of c's exchange.
func (l *loop) exchangeEvent(c *conn, u *upconn, ev uint32) step {
	x := c.x
	if u.connecting {
		if ev&(unix.EPOLLOUT|unix.EPOLLERR|unix.EPOLLHUP) == 0 {
			return stepWait
		}
		if err := sysconn.SocketError(u.fd); err != nil {
			return l.connectFailed(c)
		}
		x.prog.connected = true
		u.connecting = false
		u.pool.Stats().ConnOpened()
		return stepSend
	}
	if ev&(unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		x.sock.upHup = true
	}
	if ev&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		x.sock.upReady = true
	}
	switch x.phase {
	case phaseSend:
		if x.sendBody && x.sock.upReady && !interimAhead(u.fd) {
			// The head went up, the body read further for the router
			// (peek.go) is going: an answer now is early, as in upload.
			return l.earlyAnswer(c, l.s.cfg.ResponseTimeout)
		}
		if ev&(unix.EPOLLOUT|unix.EPOLLERR|unix.EPOLLHUP) != 0 {
			return stepSend
		}
		return stepWait
	case phaseUpload:
		if x.sock.upReady && !interimAhead(u.fd) {
			// The worker answers before it has the whole body (a 413, a
			// 401): relay that answer (outcome.go, rule 3).
			return l.earlyAnswer(c, l.s.cfg.ResponseTimeout)
		}
		if ev&unix.EPOLLOUT != 0 {
			return stepUpload
		}
		return stepWait
	}
	return stepRelay
}

// maxIdle is the loop's share of p's MaxIdle: the loops together keep
// about as many idle connections to a worker as one pool would (at least
// 4 each), not MaxIdle each: 64 loops would otherwise hold 64 × 64 idle
// sockets per worker.
func (l *loop) maxIdle(p *upstream.Pool) int {
	n := max(int(l.s.nloops.Load()), 1)
	return max(4, (p.Options().MaxIdle+n-1)/n)
}
