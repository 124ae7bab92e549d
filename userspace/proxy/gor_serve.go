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
	"github.com/tether-rl/tether/userspace/upstream"
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
		c.rejectAndClose(h.reject)
		return false
	case h.decided:
		return c.serveDecision(h.dec, c.bufferedBody(), h.refused, true)
	case h.held:
		return c.serveDecision(route.Decision{}, c.bufferedBody(), false, false)
	}
	if err := c.readHead(); err != nil {
		if e, ok := err.(*httphead.Error); ok {
			c.s.count(countRejected)
			if bytes.HasPrefix(c.buf[c.r:c.w], h2Preface) {
				c.refuseHTTP2()
				return false
			}
			c.rejectAndClose(e.Status)
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
	var peek []byte
	if req.HasBody() {
		peek = c.peekBody()
	}
	if lim := c.s.cfg.MaxBodyBytes; lim > 0 && req.ContentLength > lim {
		// Too large by its own account: 413 before anything is forwarded.
		c.s.count(countRejected)
		c.rejectAndClose(413)
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
		c.s.count(countRejected)
		// The body was not read: the connection cannot go on after it.
		keep := req.KeepAlive && !req.HasBody()
		resp := errorResponse(dec.Status, !keep)
		if dec.Reason == route.ReasonBadTarget {
			resp = pick(badTargetResponse, !keep)
		}
		if c.writeClient(resp) == nil && req.HasBody() {
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
	x := exchange{w: w, req: reqTraits{head: c.req.IsMethod("HEAD"), http10: c.req.Minor == 0},
		gx: gx{learn: learn, reroutable: reroutable}}
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
	keep = c.proxyExchange(&x)
	st := x.status
	if x.prog.sentHead {
		st = c.resp.Status
	}
	var took time.Duration
	if c.s.cfg.Observe != nil {
		took = time.Since(start)
	}
	c.s.exchangeEnded(w, x.failed, !x.refused, st, took)
	if x.learn != nil && !x.refused {
		c.learn = nil
		x.learn.End()
	}
	if x.uc != nil {
		if x.fr.reuse {
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
		c.s.count(countClientAborted)
		return false
	case worker.QueueFull:
		c.s.count(countQueueFull)
	case worker.QueueTimeout:
		c.s.count(countQueueTimeout)
	}
	return c.answerBusy()
}

// answerBusy answers 503 with Retry-After to a request that was not sent
// (safe to retry); it reports whether the connection may go on.
func (c *conn) answerBusy() bool {
	// The body was not read: the connection cannot go on after it.
	keep := c.req.KeepAlive && !c.req.HasBody()
	if c.writeClient(pick(busyResponse, !keep)) == nil && c.req.HasBody() {
		c.lingerClose()
	}
	return keep
}

func (c *conn) proxyExchange(x *exchange) bool {
	req := c.req
	cfg := &c.s.cfg
	up, err := x.w.Pool.Get(context.Background())
	if err != nil {
		return c.refusedOrFail(x, err)
	}
	x.uc = up

	out := c.appendUpstreamHead(c.out[:0], x.w, c.rt)

	// Body bytes already buffered behind the head go in the same write,
	// unless the client waits for 100 Continue.
	waitContinue := req.Expect100 && req.HasBody()
	sc := httphead.Chunked{ExtLimit: cfg.Limits.ChunkExt}
	var sent int64 // Content-Length body bytes sent
	if !waitContinue {
		out, sent, err = c.appendBuffered(out, &sc, 0)
		if err != nil {
			c.out = out[:0]
			return c.sendFailed(x, err, 0)
		}
	}
	c.out = out[:0]
	up.SetWriteDeadline(time.Now().Add(cfg.IOTimeout))
	n, err := up.Write(out)
	if reason, ok := (upstream.Attempt{Sent: n > 0, Reused: up.Reused(), Connected: true}).Retry(); err != nil && ok {
		// The pooled connection died between the liveness check and the
		// write, and not one request byte went out: the one retry.
		up.Discard()
		x.uc = nil
		if up, err = x.w.Pool.Redial(context.Background(), reason); err != nil {
			return c.refusedOrFail(x, err)
		}
		x.uc = up
		up.SetWriteDeadline(time.Now().Add(cfg.IOTimeout))
		n, err = up.Write(out)
	}
	x.prog.sentUp = n > 0
	x.w.Stats.AddUp(int64(n))
	if err != nil {
		return c.fail(x, 502)
	}

	c.ubuf = c.s.getBuf()
	var uw int // bytes in ubuf
	if waitContinue {
		// Wait briefly for the backend's 100 (or a final answer); a backend
		// that ignores Expect gets the body anyway, as curl does.
		up.SetReadDeadline(time.Now().Add(c.s.cfg.Waits.Continue))
		status, nw, err := c.readResponseHead(x, uw)
		uw = nw
		switch {
		case err == nil && status == 100:
			// Relayed to the client (once) by readResponseHead.
		case err == nil:
			// A final answer before the body: relay it, then close (the
			// client's body was never read).
			c.relayResponse(x, uw, false)
			x.linger = true
			return false
		case !isTimeout(err):
			return c.answerFailed(x, err)
		case req.Minor == 1:
			// The backend is silent: tell the client to send (RFC 9110
			// §10.1.1 lets a proxy do so) rather than leave a client that
			// waits for the 100 stalled until a timeout. A late 100 from
			// the backend is then dropped: the client sees exactly one.
			if err := c.writeClient(continue100); err != nil {
				return c.clientLeft(x)
			}
			x.sent100 = true
		}
		var nout []byte
		nout, sent, err = c.appendBuffered(c.out[:0], &sc, 0)
		if err == nil && len(nout) > 0 {
			_, err = up.Write(nout)
			x.w.Stats.AddUp(int64(len(nout)))
		}
		c.out = nout[:0]
		if err != nil {
			return c.sendFailed(x, err, uw)
		}
	}

	// The rest of the request body.
	if err := c.relayRequestBody(x, &sc, sent); err != nil {
		return c.sendFailed(x, err, uw)
	}

	// Watch the client while the backend works: if it leaves, close the
	// upstream connection at once so the engine cancels the generation.
	c.watchClient(up)
	keep := c.awaitAndRelay(x, uw)
	if c.stopWatch() {
		keep = c.clientLeft(x) // (the watch closed the upstream)
	}
	return keep
}
