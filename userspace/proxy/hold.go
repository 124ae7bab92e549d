package proxy

import (
	"context"
	"time"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/worker"
)

// Hold keeps requests from reaching workers while the fleet's weights are
// synced (userspace/fleet). A held request waits in tetherd before it is
// routed, on a goroutine, its client watched; it is routed when the hold
// lifts, in arrival order, or answered 503 with Retry-After when the hold
// is full or its wait passes the pause timeout. Nothing is ever sent to a
// worker while the request is held.
//
// Held runs on every proxied request (event loops included) and must
// cost an atomic load or two and allocate nothing. It is asked before
// routing (w nil: is the whole fleet holding?) and again once the request
// holds its place with worker w: an admission that raced with a pause is
// taken back there, so that a pause that saw no such admission knows
// nothing new can reach an engine.
type Hold interface {
	Held(req *httphead.Request, w *worker.Worker) bool
	// Wait blocks until a request held for w (nil: the whole fleet) may be
	// routed again (or something changed that may free it: the caller
	// routes it again and asks Held again), gone closes, or until passes.
	Wait(w *worker.Worker, gone <-chan struct{}, until time.Time) worker.HoldResult
	// Timeout bounds a request's whole time in the hold.
	Timeout() time.Duration
	// Forwarding returns the worker every released request goes to
	// instead of being routed (a retiring tetherd's successor), or nil.
	Forwarding() *worker.Worker
}

// held reports whether c's request must wait (w nil: before routing).
func (c *conn) held(w *worker.Worker) bool {
	h := c.s.cfg.Hold
	return h != nil && h.Held(c.req, w)
}

// holdWait waits in the fleet's hold while the client is watched; until
// (zero: set now) bounds the request's whole time held, across waits. It
// reports whether the request may be routed; if not, it was answered
// (503 + Retry-After) or its client left, and keep says whether the
// connection may go on.
func (c *conn) holdWait(w *worker.Worker, until *time.Time) (ok, keep bool) {
	h := c.s.cfg.Hold
	if until.IsZero() {
		*until = time.Now().Add(h.Timeout())
	}
	ctx, cancel := context.WithCancel(context.Background())
	c.s.counters.Held.Add(1)
	c.watchLocal(cancel)
	res := h.Wait(w, ctx.Done(), *until)
	c.stopWatch()
	cancel()
	c.s.counters.Held.Add(-1)
	c.c.SetReadDeadline(time.Time{})
	switch res {
	case worker.HoldReleased:
		return true, true
	case worker.HoldLeft:
		return false, c.notAdmitted(worker.QueueLeft)
	case worker.HoldFull:
		c.s.count(countHoldFull)
	default:
		c.s.count(countHoldTimeout)
	}
	return false, c.answerBusy()
}
