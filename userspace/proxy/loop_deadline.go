package proxy

// A loop's time: one deadline per connection, and a sweep when one is due
// (at most every tick) that expires them, closes idle upstream sockets past
// their pool's idle timeout and retries a paused accept. (The scheduling
// the loop thread needs from the Go runtime, GOMAXPROCS and the yield, is
// loop.go's: ProcsForLoops, yieldEvery.)

import (
	"time"
)

// setDue asks for a sweep at t (or at the next tick after the last one).
func (l *loop) setDue(t int64) {
	if t < l.lastSweep+l.tick {
		t = l.lastSweep + l.tick
	}
	if l.due == 0 || t < l.due {
		l.due = t
	}
}

// setDeadline gives c one deadline (0: none).
func (l *loop) setDeadline(c *conn, d time.Duration) {
	if d == 0 {
		c.deadline = 0
		return
	}
	c.deadline = l.now + int64(d)
	l.setDue(c.deadline)
}

// sweep handles the deadlines that passed and finds the next one.
func (l *loop) sweep() {
	s := l.s
	now := l.now
	l.lastSweep, l.due = now, 0
	closing := s.closing.Load()
	grace := s.idleGrace.Load()
	for _, c := range l.conns {
		idle := !c.busy && c.buf == nil && !c.linger.on()
		if closing && idle && now-c.idleSince.Load() >= grace {
			// (A request that came meanwhile is served: idleclose.go.)
			l.drive(c, l.closeIdle(c))
			continue
		}
		if c.deadline != 0 && now >= c.deadline {
			l.drive(c, l.expire(c))
			continue
		}
		if c.deadline != 0 {
			l.setDue(c.deadline)
		}
	}
	for p, set := range l.idle {
		closed := p.Closed()
		for {
			u, ok := set.Oldest()
			if !ok {
				break
			}
			if !closed && now-u.since <= int64(p.Options().IdleTimeout) {
				l.setDue(u.since + int64(p.Options().IdleTimeout))
				break
			}
			set.DropOldest()
			l.closeUp(u)
			l.s.counters.UpstreamIdle.Add(-1)
		}
		if closed {
			delete(l.idle, p)
		}
	}
	if closing && len(l.conns) > 0 {
		l.setDue(now + int64(50*time.Millisecond))
	}
	if l.retryAt != 0 {
		if now >= l.retryAt {
			l.accept()
		} else {
			l.setDue(l.retryAt)
		}
	}
}

// expire handles a connection whose deadline passed.
func (l *loop) expire(c *conn) step {
	c.deadline = 0
	switch {
	case c.linger.on():
		return leaveClose // lingered long enough
	case c.busy:
		return l.expireExchange(c) // loop_finish.go
	case c.peekWait:
		// The first body bytes the router wants did not come: a
		// goroutine parses the head again and routes on what it gets
		// (conn.peekBody).
		c.peekWait = false
		return l.toGoroutine(c, handoff{})
	case c.r < c.w:
		// A slow client in the middle of a head: 408 (concluded here),
		// answered and lingered the goroutine way.
		l.s.rejectVerdict(408)
		return l.toGoroutine(c, handoff{reject: 408})
	}
	return l.closeIdle(c) // idle timeout
}

// closeIdle closes an idle connection, unless a request came on it since
// the loop last looked (idleclose.go): then it is read and served.
func (l *loop) closeIdle(c *conn) step {
	if hasPending(c.fd) {
		c.readable = true
		return stepRead
	}
	return leaveClose
}
