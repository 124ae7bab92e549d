package proxy

// The client watch: while the worker works, a client that leaves closes
// the upstream connection at once (the engine cancels the generation).

import (
	"context"
	"time"

	"github.com/tether-rl/tether/userspace/sysconn"
	"github.com/tether-rl/tether/userspace/upstream"
)

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

// watchPeek is watch's RawConn.Read callback.
func (c *conn) watchPeek(fd uintptr) bool {
	switch sysconn.Peek(fd) {
	case sysconn.PeekEmpty:
		return false // nothing yet: wait for readability
	case sysconn.PeekData:
		// A pipelined request waits for its turn; the client may still
		// leave behind it (FIN or reset after the bytes), which a peek
		// cannot see. Until then, wait for the next event on the socket
		// (more bytes, FIN, reset): edge-triggered, so no spinning.
		if !sysconn.PeerShutdown(fd) {
			return false
		}
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
