package proxy

// The client watch, one rule for both drivers: while its exchange runs,
// the client's socket is watched without being read (a pipelined request
// waits its turn), and a client whose side of the connection ended (its
// FIN, a reset, an error: watchSeesLeft), even behind bytes not read yet,
// has left: its exchange ends at once as outcome.go concludes a client
// gone (endAbort), the upstream connection closed, so that the engine
// cancels the generation. The loop watches through the client socket's
// epoll events (clientEvent, from the first byte up); a goroutine after
// Waits.Watch, a blocking wait for readability (watch, below; a local
// handler's wait, a queue's or the hold's too: the stop function).

import (
	"context"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/userspace/sysconn"
	"github.com/tether-rl/tether/userspace/upstream"
)

// leftEvents are the events (poll's and epoll's, the same bits) of a
// client socket whose peer left: its FIN (RDHUP), a reset or an error.
const leftEvents = unix.POLLRDHUP | unix.POLLHUP | unix.POLLERR

// watchSeesLeft is the watch's rule on a client socket's events.
func watchSeesLeft(ev uint32) bool { return ev&leftEvents != 0 }

// pollEvents returns fd's poll(2) events now, POLLRDHUP asked for.
func pollEvents(fd uintptr) uint32 {
	fds := [1]unix.PollFd{{Fd: int32(fd), Events: unix.POLLRDHUP}}
	if n, err := unix.Poll(fds[:], 0); err != nil || n != 1 {
		return 0
	}
	return uint32(uint16(fds[0].Revents))
}

// clientGone reports whether the client closed or reset its connection.
// It ends the client watch first: while the watch waits it holds the read
// side, and sysconn.PeerGone would block until the client sends or leaves. A
// departure the watch saw is reported here once (the stopWatch after the
// exchange then reports false, so it is not counted twice).
func (c *conn) clientGone() bool {
	if c.watchTimer != nil && c.stopWatch() {
		c.watchGone.Store(false)
		return true
	}
	c.c.SetReadDeadline(time.Time{})
	return sysconn.PeerGone(c.raw)
}

// watchClient arranges that, if the backend is still working after
// Waits.Watch, a goroutine waits (without reading) for the client to close
// or reset; then it closes up at once, so the engine cancels the
// generation. stopWatch ends the watch and reports whether the client left.
func (c *conn) watchClient(up *upstream.Conn) {
	c.startWatch(up, nil)
}

// watchLocal watches the client while a local handler runs (abort waves
// can last minutes): if it leaves, stop is called.
func (c *conn) watchLocal(stop context.CancelFunc) {
	c.startWatch(nil, stop)
}

func (c *conn) startWatch(up *upstream.Conn, stop context.CancelFunc) {
	// The watch waits under the client's read deadline: clear what the
	// head or body reads left, or it would give up after IdleTimeout.
	c.c.SetReadDeadline(time.Time{})
	c.watchUp, c.watchStop = up, stop
	c.watchGone.Store(false)
	c.watchWG.Add(1)
	if c.watchTimer == nil {
		c.watchTimer = time.AfterFunc(c.s.cfg.Waits.Watch, c.watch)
	} else {
		c.watchTimer.Reset(c.s.cfg.Waits.Watch)
	}
}

func (c *conn) stopWatch() bool {
	if c.watchTimer.Stop() {
		c.watchWG.Done() // never started
		return false
	}
	// Running or ran: wake it (a deadline in the past ends its wait, even
	// one it has not begun yet) and wait for it.
	c.c.SetReadDeadline(aLongTimeAgo)
	c.watchWG.Wait()
	return c.watchGone.Load()
}

// watch runs in the timer's goroutine.
func (c *conn) watch() {
	defer c.watchWG.Done()
	if c.watchFn == nil {
		c.watchFn = c.watchPeek
	}
	c.raw.Read(c.watchFn)
}

// watchPeek is watch's RawConn.Read callback: until the rule sees the
// client gone, it waits for the next event on the socket (more bytes of a
// pipelined request, a FIN, a reset): edge-triggered, so no spinning.
func (c *conn) watchPeek(fd uintptr) bool {
	if !watchSeesLeft(pollEvents(fd)) {
		return false
	}
	c.watchGone.Store(true)
	if c.watchUp != nil {
		c.watchUp.Close()
	}
	if c.watchStop != nil {
		c.watchStop()
	}
	return true
}
