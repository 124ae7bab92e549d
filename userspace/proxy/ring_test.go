package proxy

import (
	"io"
	"log/slog"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/upstream"
)

// An upstream event that waited for a queued operation is judged by what
// is true when it is delivered: a socket gone idle meanwhile is dropped
// only if the worker closed it or wrote unasked (not for the readiness of
// the exchange that just read it), and an exchange that is not the one
// the event was for gets only a hang-up.
func TestDeferredUpstreamEvents(t *testing.T) {
	st := stats.NewHeap()
	pool := upstream.New("127.0.0.1:1", st.Worker(0), upstream.Options{})
	defer pool.Close()
	l := &loop{s: New(Config{Log: slog.New(slog.NewTextHandler(io.Discard, nil))}),
		ups: map[int32]*upconn{}, idle: map[*upstream.Pool]*upstream.Idle[*upconn]{}}
	idle := func(t *testing.T) (*upconn, int) {
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK, 0)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Close(fds[1]) })
		u := &upconn{fd: fds[0], pool: pool}
		l.ups[int32(u.fd)] = u
		if l.idle[pool] == nil {
			l.idle[pool] = new(upstream.Idle[*upconn])
		}
		l.idle[pool].Push(u, 1<<20)
		return u, fds[1]
	}
	open := func(u *upconn) bool { return u.fd >= 0 && l.ups[int32(u.fd)] == u }

	t.Run("stale readiness, quiet socket: kept", func(t *testing.T) {
		u, _ := idle(t)
		l.upDeferred(u, 7, unix.EPOLLIN)
		if !open(u) {
			t.Fatal("a healthy idle connection was dropped for its last exchange's readiness")
		}
		l.closeUp(u)
	})
	t.Run("worker wrote unasked: dropped", func(t *testing.T) {
		u, peer := idle(t)
		unix.Write(peer, []byte("x"))
		l.upDeferred(u, 7, unix.EPOLLIN)
		if open(u) {
			t.Fatal("an idle connection with unasked bytes was kept")
		}
	})
	t.Run("worker closed: dropped", func(t *testing.T) {
		u, _ := idle(t)
		l.upDeferred(u, 7, unix.EPOLLIN|unix.EPOLLRDHUP)
		if open(u) {
			t.Fatal("an idle connection the worker closed was kept")
		}
	})
	t.Run("another exchange: readiness dropped", func(t *testing.T) {
		u, _ := idle(t)
		c := &conn{x: &exchange{lx: lx{id: 9, phase: phaseHead}}}
		u.cl = c
		l.upDeferred(u, 7, unix.EPOLLIN)
		if c.x.sock.upReady || !open(u) {
			t.Fatal("an event of exchange 7 was delivered to exchange 9")
		}
		u.cl = nil
		l.closeUp(u)
	})
}
