package proxy

import (
	"errors"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/upstream"
)

// Outcomes: every way an exchange can fail is decided here, in one order,
// so the data path never writes its own ladder (caddy's reverse proxy does
// the same with statusError). Before the response head went out, the
// client gets an answer; after, only a visible cut.
//
// While the request goes up (sendFailed), in this order:
//  1. the client's own framing or a limit (*httphead.Error: 400, 413, ...):
//     that status, nothing more goes up;
//  2. the client left: nothing to answer (client_aborted);
//  3. the worker answered early (it stopped reading: 413, 401 + close):
//     that answer, then the client connection closes;
//  4. a body that made no progress for --io-timeout: 408 (the client
//     stopped sending; the half-sent request dies with its upstream);
//  5. anything else: 502 (X-Tether-Upstream-State says whether bytes went).
//
// While waiting for the response head (answerFailed): the client left →
// nothing; a timeout → 504; anything else → 502.
//
// After the head (bodyFailed): the client left → nothing; else the cut is
// made visible (close; a reset for a close-delimited body).

// sendFailed decides a failure while the request was being sent; uw bytes
// of an answer may already be in the upstream buffer.
func (c *conn) sendFailed(x *exchange, err error, uw int) bool {
	var herr *httphead.Error
	switch {
	case errors.As(err, &herr):
		c.s.counters.Rejected.Add(1)
		c.rejectAndClose(herr.Status)
	case c.clientGone():
		c.s.counters.ClientAborted.Add(1)
	case c.earlyAnswer(x, uw):
	case isTimeout(err):
		c.s.counters.Rejected.Add(1)
		c.rejectAndClose(408)
	default:
		return c.fail(x, 502)
	}
	return false
}

// answerFailed decides a failure while waiting for the response head.
func (c *conn) answerFailed(x *exchange, err error) bool {
	if c.clientGone() {
		c.s.counters.ClientAborted.Add(1) // the watch may have closed up: not the worker's fault
		return false
	}
	return c.fail(x, statusOf(err))
}

// statusOf is tetherd's answer to an upstream failure: 504 for a timeout,
// else 502.
func statusOf(err error) int {
	if isTimeout(err) {
		return 504
	}
	return 502
}

// refusedOrFail ends an exchange whose worker could not be connected to
// (nothing was sent): reported as refused when the request may be placed
// again, else a 502 not-sent. When the connect failed for want of this
// host's descriptors or ports (upstream.ErrLocal), no other worker would
// fare better: 502 at once, and the log says so (once per episode).
func (c *conn) refusedOrFail(x *exchange, err error) bool {
	if errors.Is(err, upstream.ErrLocal) {
		c.s.logLocalShortage(err)
		return c.fail(x, 502)
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
	if c.clientGone() {
		c.s.counters.ClientAborted.Add(1)
		return false
	}
	x.failed = true
	c.s.counters.Truncated.Add(1)
	if x.closeDelimited {
		// A body framed by the close would look complete after a FIN:
		// a reset (SO_LINGER 0) is the only way to show the cut. Bytes
		// already queued to the client arrive before the error.
		c.c.SetLinger(0)
	}
	return false
}
