package proxy

// The goroutine path's endings: each failure is concluded by outcome.go
// (conclude, gatewayVerdict, brokenVerdict), and the verdict applied to
// the net.TCPConn (apply).

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

// conclude ends a failed exchange as outcome.go decides; it reports
// whether the client connection may go on (never).
func (c *conn) conclude(x *exchange, f fault) bool {
	return c.apply(x, c.s.conclude(f, x.reached(f.stage == stageBodyUp)))
}

// apply carries out v on the client connection; the close itself, and
// the lingering (x.linger), come once the exchange is accounted (proxy).
// It reports whether the client connection may go on (never).
func (c *conn) apply(x *exchange, v verdict) bool {
	switch v.end {
	case endAbort:
		x.fr.reuse = false // the upstream closes, so the worker sees it
		return false
	case endEarly:
		return false // the worker's answer went out (earlyAnswer), the connection lingers
	}
	x.take(v)
	switch v.end {
	case endReject:
		x.linger = c.answerClosing(v.answer)
	case endGateway:
		if v.answer != nil {
			c.writeClient(v.answer)
		}
		x.linger = v.linger
	case endCut:
		if v.reset {
			// A body framed by the close would look complete after a
			// FIN: a reset is the only way to show the cut. Bytes
			// already queued to the client arrive before the error.
			c.c.SetLinger(0)
		}
	}
	return false
}

// clientLeft ends an exchange whose client left (a write to it failed, or
// the watch saw it go): nothing to answer.
func (c *conn) clientLeft(x *exchange) bool {
	return c.apply(x, c.s.conclude(fault{gone: true}, x.reached(false)))
}

// refusedOrFail ends an exchange whose worker could not be connected to
// (nothing was sent): reported as refused when the request may be placed
// again, else a 502 not-sent. When the connect failed for want of this
// host's descriptors or ports (upstream.ErrLocal), no other worker would
// fare better: 502 at once, and the log says so (once per episode); the
// connection of a request with a body then lingers (x.linger), so that
// no reset over a body not all read destroys the answer.
func (c *conn) refusedOrFail(x *exchange, err error) bool {
	if errors.Is(err, upstream.ErrLocal) {
		c.s.logLocalShortage(err)
		return c.apply(x, c.s.gatewayVerdict(502, x.reached(c.req.HasBody())))
	}
	if x.reroutable {
		x.refused, x.failed = true, true
		return false
	}
	return c.fail(x, 502)
}

// fail ends an exchange with a worker error: status if no response head
// went out; either way the client connection closes.
func (c *conn) fail(x *exchange, status int) bool {
	return c.apply(x, c.s.gatewayVerdict(status, x.reached(false)))
}

// bodyFailed handles a relay error after the response head went out: the
// client must see the truncation, so its connection closes.
func (c *conn) bodyFailed(x *exchange, err error) bool {
	x.fr.reuse = false
	return c.conclude(x, fault{stage: stageRelay, gone: c.clientGone()})
}
