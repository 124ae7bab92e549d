package proxy

// The goroutine path: a connection an event loop handed over (or one of a
// listener without a loop) is served on its own goroutine, one request at
// a time (serveOne): routed (held while the fleet syncs: hold.go), placed
// in its worker's queue, sent (gor_request.go), and its response relayed
// (gor_response.go), each outcome decided as outcome.go says.

import (
	"bytes"
	"context"
	"time"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/worker"
)

// serve runs the connection on a goroutine until it ends, or until it is
// idle again and goes back to its event loop (Config.ParkAfter).
func (c *conn) serve() {
	if c.c == nil && !c.attach() {
		// Not lent the socket (no descriptor): a routing decision the
		// loop handed over is given back unserved.
		if h := c.hand; h.decided && h.dec.Done != nil {
			h.dec.Done()
		}
		c.finish()
		return
	}
	for {
		ok := c.serveOne()
		if c.wantPark {
			c.wantPark = false
			if c.detach() {
				return // c belongs to its loop now: not one more access
			}
			if c.c == nil {
				break
			}
			c.noPark = true // could not: wait here, to the idle timeout
			continue
		}
		// A response that went out before the server began closing
		// promised keep-alive: with an idle grace (ShutdownGently) the
		// next request is still read and answered (with Connection:
		// close).
		if !ok || c.s.closing.Load() && c.s.idleGrace.Load() == 0 {
			break
		}
	}
	c.finish()
}

// serveOne handles one request; it reports whether the connection may
// carry another. A connection handed over by its loop starts where the
// loop left it (c.hand).
func (c *conn) serveOne() bool {
	h := c.hand
	c.hand = handoff{}
	switch {
	case h.reject != 0:
		c.rejectAndClose(h.reject) // (concluded by the loop)
		return false
	case h.decided:
		return c.serveDecision(h.dec, c.bufferedBody(), h.refused, true)
	case h.held:
		return c.serveDecision(route.Decision{}, c.bufferedBody(), false, false)
	}
	if err := c.readHead(); err != nil {
		if e, ok := err.(*httphead.Error); ok {
			if bytes.HasPrefix(c.buf[c.r:c.w], h2Preface) {
				c.s.rejectVerdict(e.Status) // (counted; the answer is HTTP/2's)
				c.refuseHTTP2()
				return false
			}
			c.rejectRequest(e.Status)
		}
		return false
	}
	c.s.counters.Requests.Add(1)
	req := c.req
	c.r += req.HeadLen

	if h := c.localHandler(); h != nil {
		c.s.counters.Local.Add(1)
		return c.serveLocal(h)
	}
	if c.pdTakes() {
		return c.servePD()
	}
	var peek []byte
	if req.HasBody() {
		peek = c.peekBody()
	}
	if lim := c.s.cfg.MaxBodyBytes; lim > 0 && req.ContentLength > lim {
		// Too large by its own account: 413 before anything is forwarded.
		c.rejectRequest(413)
		return false
	}
	return c.serveDecision(route.Decision{}, peek, false, false)
}

// bufferedBody returns the body bytes buffered behind the consumed head.
func (c *conn) bufferedBody() []byte {
	end := c.w
	if !c.req.HasBody() {
		end = c.r
	} else if cl := c.req.ContentLength; cl >= 0 && int64(end-c.r) > cl {
		end = c.r + int(cl)
	}
	return c.buf[c.r:end]
}

// serveDecision routes the request unless routed (peek: its buffered body
// bytes, as the router sees them) and proxies it; refused: the decision's
// worker already refused the connect, nothing sent (the loop tried it), so
// place it again. A request the fleet holds (a weight sync: hold.go) waits
// before it is routed, and is placed again when the hold lifts.
func (c *conn) serveDecision(dec route.Decision, peek []byte, refused, routed bool) bool {
	var until time.Time
	for {
		if !routed {
			if c.held(nil) {
				if ok, keep := c.holdWait(nil, &until); !ok {
					return keep
				}
			}
			dec = c.s.cfg.Router.Route(c.req, peek)
			if h := c.s.cfg.Hold; h != nil && c.held(dec.Worker) {
				if fw := h.Forwarding(); fw != nil {
					// Retiring after an upgrade: to the successor.
					if dec.Done != nil {
						dec.Done()
					}
					dec = route.Decision{Worker: fw, Reason: route.ReasonReroute}
				}
			}
		}
		keep, held := c.serveRouted(dec, peek, refused)
		if !held {
			return keep
		}
		if ok, keep := c.holdWait(dec.Worker, &until); !ok {
			return keep
		}
		routed, refused = false, false
	}
}

// serveRouted proxies a routed request; held: nothing was sent, the
// fleet holds it (serveDecision waits and places it again).
func (c *conn) serveRouted(dec route.Decision, peek []byte, refused bool) (keep, held bool) {
	req := c.req
	defer func() {
		if dec.Done != nil {
			dec.Done()
		}
	}()
	if dec.Worker == nil {
		// The body was not read: the connection cannot go on after it.
		keep := req.KeepAlive && !req.HasBody()
		resp := errorResponse(dec.Status, !keep)
		if dec.Reason == route.ReasonBadTarget {
			resp = pick(badTargetResponse, !keep)
		}
		if c.writeClient(c.s.turnAway(countRejected, resp)) == nil && req.HasBody() {
			c.lingerClose()
		}
		return keep, false
	}
	c.noteRoute(dec)
	rr, _ := c.s.cfg.Router.(Rerouter)
	if !refused {
		keep, refused, held = c.proxy(dec.Worker, dec.Learn, rr != nil)
		if !refused {
			return keep, held
		}
	}
	if rr == nil {
		c.writeClient(c.s.gatewayAnswer(502, false))
		return false, false
	}
	// The worker refused the connection: nothing was sent, so another
	// worker may take the request (once).
	if dec.Done != nil {
		dec.Done()
	}
	dec = rr.Reroute(req, peek, dec)
	if dec.Worker == nil {
		c.writeClient(c.s.gatewayAnswer(502, false))
		return false, false
	}
	c.noteRoute(dec)
	keep, _, held = c.proxy(dec.Worker, dec.Learn, false)
	return keep, held
}

// proxy forwards the parsed request to w and relays the response. With
// reroutable set, a worker that refuses the connection gets no answer
// written: proxy reports refused instead, and the caller may place the
// request again.
func (c *conn) proxy(w *worker.Worker, learn *route.Learner, reroutable bool) (keep, refused, held bool) {
	x := newExchange(w, c.req)
	x.rt, x.gx = c.rt, gx{learn: learn, reroutable: reroutable}
	if adm := c.admit(w); adm != worker.Admitted {
		return c.notAdmitted(adm), false, false
	}
	if c.held(w) {
		// A sync began, or w is fenced: nothing was sent; the caller
		// holds the request and places it again.
		w.Leave()
		return true, false, true
	}
	var start time.Time
	if c.s.cfg.Observe != nil {
		start = time.Now()
	}
	w.Stats.Begin()
	keep = c.runExchange(&x)
	var took time.Duration
	if c.s.cfg.Observe != nil {
		took = time.Since(start)
	}
	c.s.exchangeEnded(w, x.failed, !x.refused, x.status, took)
	if x.learn != nil && !x.refused {
		c.learn = nil
		x.learn.End()
	}
	if x.uc != nil {
		if x.reusable() {
			w.Pool.Put(x.uc)
		} else {
			x.uc.Discard()
		}
	}
	if c.ubuf != nil {
		c.s.putBuf(c.ubuf)
		c.ubuf = nil
	}
	if x.linger {
		c.lingerClose()
	}
	return keep, x.refused, false
}

// admit takes a place among w's requests in flight (worker.Worker.Admit):
// at once under its max_in_flight, else after a wait in its queue while
// the client is watched, so a client that leaves frees its place in line.
func (c *conn) admit(w *worker.Worker) worker.Admission {
	cfg := &c.s.cfg
	if w.MaxInFlight() == 0 && w.Queued() == 0 {
		return w.Admit(cfg.QueueSize, cfg.QueueTimeout, nil)
	}
	ctx, cancel := context.WithCancel(context.Background())
	c.s.counters.Queued.Add(1)
	c.watchLocal(cancel)
	adm := w.Admit(cfg.QueueSize, cfg.QueueTimeout, ctx.Done())
	c.stopWatch()
	cancel()
	c.s.counters.Queued.Add(-1)
	c.c.SetReadDeadline(time.Time{})
	return adm
}

// notAdmitted answers a request that got no place with its worker: 503
// with Retry-After (nothing was sent: safe to retry), or nothing if the
// client left. It reports whether the connection may go on.
func (c *conn) notAdmitted(adm worker.Admission) bool {
	switch adm {
	case worker.QueueLeft:
		c.s.clientLeft()
		return false
	case worker.QueueFull:
		return c.answerBusy(countQueueFull)
	}
	return c.answerBusy(countQueueTimeout)
}

// answerBusy answers 503 with Retry-After to a request that was not sent
// (safe to retry), counted as what; it reports whether the connection
// may go on.
func (c *conn) answerBusy(what counted) bool {
	// The body was not read: the connection cannot go on after it.
	keep := c.req.KeepAlive && !c.req.HasBody()
	if c.writeClient(c.s.turnAway(what, pick(busyResponse, !keep))) == nil && c.req.HasBody() {
		c.lingerClose()
	}
	return keep
}

// runExchange drives x through the loop's phases (loop_exchange.go) with
// blocking calls: send (the head and the body bytes buffered behind it,
// or the wait for a 100 Continue), upload (the rest of the body), pump
// (the response); each failure concluded as outcome.go says, the steps
// shared with the loop (framing.go, exchange.go).
func (c *conn) runExchange(x *exchange) bool {
	if keep, ended := c.send(x); ended {
		return keep
	}
	if err := c.upload(x); err != nil {
		return c.sendFailed(x, err)
	}
	return c.pump(x)
}
