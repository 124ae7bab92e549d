package proxy

// A loop's time: one deadline per connection, a sweep when one is due
// (at most every tick), and the scheduling the loop
// thread needs from the Go runtime (GOMAXPROCS, the yield).

import (
	"os"
	"runtime"
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
		idle := !c.busy && c.buf == nil && c.linger == 0
		if closing && idle && now-c.idleSince.Load() >= grace {
			l.closeConn(c)
			continue
		}
		if c.deadline != 0 && now >= c.deadline {
			l.expire(c)
			continue
		}
		if c.deadline != 0 {
			l.setDue(c.deadline)
		}
	}
	for p, list := range l.idle {
		closed := p.Closed()
		keep := list[:0]
		for _, u := range list {
			if closed || now-u.since > int64(p.Options().IdleTimeout) {
				l.closeUp(u)
				l.s.counters.UpstreamIdle.Add(-1)
				continue
			}
			keep = append(keep, u)
		}
		if len(keep) == 0 {
			delete(l.idle, p)
			continue
		}
		l.idle[p] = keep
		l.setDue(keep[0].since + int64(p.Options().IdleTimeout))
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
func (l *loop) expire(c *conn) {
	c.deadline = 0
	switch {
	case c.linger > 0:
		l.closeConn(c) // lingered long enough
	case c.busy:
		l.expireExchange(c) // fast.go
	case c.peekWait:
		// The first body bytes the router wants did not come: a
		// goroutine parses the head again and routes on what it gets
		// (conn.peekBody).
		c.peekWait = false
		l.handoff(c, handoff{})
	case c.r < c.w:
		// A slow client in the middle of a head: 408, answered (and
		// lingered) the goroutine way.
		l.s.counters.Rejected.Add(1)
		l.handoff(c, handoff{reject: 408})
	default:
		l.closeConn(c) // idle timeout
	}
}

// ProcsForLoops raises GOMAXPROCS to one more than the event loops (unless
// the GOMAXPROCS variable fixes it), and returns the value in force. A
// loop blocks in epoll_wait on its own thread, its P held in a syscall;
// with no P idle, the runtime's sysmon takes that P away after 20 µs, and
// the loop must win one back each time it wakes: futex wake-ups and
// context switches on every pass. One P more keeps one idle (measured on
// 2 cores, 2 loops, keep-alive load: futex calls per request 0.16 → 0.02,
// context switches 0.58 → 0.37, req/s +16%; docs/ARCHITECTURE.md).
func ProcsForLoops(loops int) int {
	n := runtime.GOMAXPROCS(0)
	if os.Getenv("GOMAXPROCS") != "" || n > loops {
		return n
	}
	runtime.GOMAXPROCS(loops + 1)
	return loops + 1
}

// yieldEvery: a busy loop goes through the scheduler this often. The
// runtime's sysmon preempts a goroutine that has not been scheduled for
// 10 ms, and takes the P of one in a system call with it; every such take
// resets sysmon to waking each 20 µs. The loop goroutine, always running
// or in epoll_wait, was taken from every 10 ms, so sysmon never slept
// long. Yielding first (measured, 2 loops, keep-alive load, per 2 s):
// nanosleep 5,500 → 200, futex 1,000 → 2,600, context switches 22,000 →
// 14,800.
const yieldEvery = int64(8 * time.Millisecond)
