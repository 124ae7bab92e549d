package proxy

// The goroutine path's endings: each failure is put to outcome.go's
// decide, and the verdict carried out on the connection.

import (
	"errors"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/upstream"
)

// sendFailed ends an exchange whose request body failed to go up; uw
// bytes of an answer may already be in the upstream buffer. What is
// looked at is looked at in decide's order: the client's own error, the
// client gone, then an early answer (read, and relayed, only then).
func (c *conn) sendFailed(x *exchange, err error, uw int) bool {
	f := fault{stage: stageBodyUp, timeout: isTimeout(err)}
	var herr *httphead.Error
	if errors.As(err, &herr) {
		f.reject = herr.Status
	} else if f.gone = c.clientGone(); !f.gone {
		f.answered = c.earlyAnswer(x, uw)
	}
	return c.conclude(x, f)
}

// answerFailed ends an exchange whose response head did not come.
func (c *conn) answerFailed(x *exchange, err error) bool {
	// (The watch may have closed up: a client gone is not the worker's fault.)
	return c.conclude(x, fault{stage: stageWait, gone: c.clientGone(), timeout: isTimeout(err)})
}

// conclude carries out decide's verdict on f; it reports whether the
// client connection may go on (never).
func (c *conn) conclude(x *exchange, f fault) bool {
	e, status := decide(f)
	switch e {
	case endAbort:
		c.s.counters.ClientAborted.Add(1)
	case endReject:
		c.s.counters.Rejected.Add(1)
		x.linger = c.reject(status)
	case endGateway:
		c.fail(x, status)
		// The body was not all read: no reset over the answer.
		x.linger = f.stage == stageBodyUp && !x.sentHead
		return false
	case endCut:
		x.failed = true
		c.s.counters.Truncated.Add(1)
		if x.closeDelimited {
			// A body framed by the close would look complete after a FIN:
			// a reset (SO_LINGER 0) is the only way to show the cut. Bytes
			// already queued to the client arrive before the error.
			c.c.SetLinger(0)
		}
	}
	// endEarly: the worker's answer went out, the connection lingered.
	return false
}

// refusedOrFail ends an exchange whose worker could not be connected to
// (nothing was sent): reported as refused when the request may be placed
// again, else a 502 not-sent. When the connect failed for want of this
// host's descriptors or ports (upstream.ErrLocal), no other worker would
// fare better: 502 at once, and the log says so (once per episode); the
// connection of a request with a body then lingers (x.linger), so that
// no reset over a body not all read destroys the answer (the loop's
// noDescriptor likewise).
func (c *conn) refusedOrFail(x *exchange, err error) bool {
	if errors.Is(err, upstream.ErrLocal) {
		c.s.logLocalShortage(err)
		c.fail(x, 502)
		x.linger = c.req.HasBody()
		return false
	}
	if x.reroutable {
		x.refused, x.failed = true, true
		return false
	}
	return c.fail(x, 502)
}

// fail answers status if no response head went out yet; either way the
// client connection closes.
func (c *conn) fail(x *exchange, status int) bool {
	x.failed = true
	if !x.sentHead {
		x.status = status
		switch status {
		case 502:
			c.s.counters.BadGateway.Add(1)
		case 504:
			c.s.counters.Timeouts.Add(1)
		}
		c.writeClient(upstreamError(status, x.sentUp, true))
	}
	return false
}

// bodyFailed handles a relay error after the response head went out: the
// client must see the truncation, so its connection closes.
func (c *conn) bodyFailed(x *exchange, err error) bool {
	x.reuse = false
	return c.conclude(x, fault{stage: stageRelay, gone: c.clientGone()})
}
