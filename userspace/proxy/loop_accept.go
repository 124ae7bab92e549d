package proxy

// A loop's accepting: accept4 on its own copy of the listening socket
// until the queue is empty, under the server's MaxConns (accept.go), and
// the start of each accepted connection.

import (
	"net/netip"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/userspace/sysconn"
)

// accept takes connections until the queue is empty, the server is at
// MaxConns (paused until a place frees), or accept fails for want of
// descriptors (backing off, 5 ms doubling to 500 ms, or until a place
// frees). Each is logged once per episode. Under the cap, idle upstream
// sockets that fill its descriptor budget are given up for a new client,
// or it waits until the next tick (fdRoom).
func (l *loop) accept() {
	s := l.s
	for l.lfd >= 0 {
		if l.retryAt != 0 && l.now < l.retryAt {
			return
		}
		if !s.tryAdmit(l) {
			return
		}
		// The loops' idle upstream sockets count toward the cap's
		// reserve: the loop gives up its own, oldest first, to make room
		// for the client's descriptors; if the other loops' still fill
		// it, the client waits in the kernel's queue (accepted, it would
		// find no descriptor for its upstream connection), looked at
		// again next tick.
		for !l.fdRoomForClient() {
			if !l.dropOldestIdle() {
				s.unadmit()
				s.wg.Done()
				l.retryAt = l.now + l.tick
				l.setDue(l.retryAt)
				return
			}
		}
		fd, ip, err := sysconn.Accept(l.lfd)
		if err != nil {
			s.unadmit()
			s.wg.Done()
			switch {
			case err == unix.EAGAIN:
				return
			case err == unix.EINTR || err == unix.ECONNABORTED:
				continue
			}
			l.backoff = s.acceptFailed(err, l.backoff)
			l.retryAt = l.now + int64(l.backoff)
			s.waitForDescriptor(l)
			l.setDue(l.retryAt)
			return
		}
		if l.backoff != 0 {
			l.backoff, l.retryAt = 0, 0
			s.acceptResumed()
		}
		l.opened(fd, ip)
	}
}

// opened starts serving an accepted socket.
func (l *loop) opened(fd int, ip netip.Addr) {
	s := l.s
	if l.nodelay == 0 {
		l.nodelay = -1
		if v, err := unix.GetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY); err == nil && v != 0 {
			l.nodelay = 1
		}
	}
	if l.nodelay < 0 {
		unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
	}
	c := &conn{s: s, fd: fd, lp: l, slot: l.slot, ip: ip}
	s.counters.Accepted.Add(1)
	s.counters.Open.Add(1)
	l.slot.Opened()
	if !l.hold(c) {
		return
	}
	c.idleSince.Store(l.now)
	l.setDeadline(c, s.cfg.IdleTimeout)
	// The request usually came with the handshake's last packet or just
	// after: read now rather than after one more epoll_wait (an EAGAIN
	// costs one read; the edge of a later arrival still comes).
	c.readable = true
	l.drive(c, stepRead)
}
