package proxy

// One exchange, two drivers. An exchange is one request proxied to a
// worker and its response relayed back; the event loop drives it on raw
// non-blocking sockets (loop_*.go), a goroutine drives it with blocking
// calls on a net.TCPConn where no loop runs it (gor_*.go: a
// queue wait, an upgrade, a hand-off), through the same phases
// (loop_exchange.go's table). Both keep the same facts of it here, under
// one name each, change them by the same transitions (below: newExchange,
// wentUp, retrySend, giveUpBody, reusable; framing.go's response steps),
// conclude it in outcome.go, and keep only their own I/O state apart: lx
// (the loop's) and gx (the goroutine's).

import (
	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/upstream"
	"github.com/tether-rl/tether/userspace/worker"
)

// exchange is the state of one proxied request.
type exchange struct {
	w      *worker.Worker
	status int  // for Config.Observe: tetherd's own answer (the relayed one: the response's)
	failed bool // counts as a worker error

	req  reqTraits
	fr   respFraming // framing.go's frameResponse (keep: the request's, until the head)
	prog progress
	// reqLeft: the Content-Length request body's bytes still to go up.
	reqLeft int64
	rt      routeNote        // the decision the response head names (Config.RouteHeader)
	uw      int              // response head bytes read into conn.ubuf
	left    int64            // the response's Content-Length bytes still to come
	sc      httphead.Chunked // the chunked response body's framing, as it streams
	// linger: the answer goes out over a request body not all read (given
	// up for the worker's early answer: giveUpBody; or a failure's
	// verdict): the client connection then closes, lingering (linger.go).
	// The loop carries it out in end and apply, the goroutine path once
	// the exchange is accounted and its worker's place and socket given
	// back (proxy).
	linger bool

	lx // the loop's sockets, pipe and buffers (loop_exchange.go)
	gx // the goroutine path's connection and learner
}

// reqTraits: what of the request shapes its response. Taken before the
// body is relayed: the goroutine path reads a chunked body into the
// buffer the head was parsed from, so the head's slices no longer hold
// the head after it.
type reqTraits struct {
	head   bool // a HEAD request: no body follows the response head
	http10 bool // the client speaks HTTP/1.0
}

// progress: how far the exchange got (what a failure may still do).
type progress struct {
	connected bool // a connect of this exchange succeeded (no second try after)
	redialed  bool // the one connect retry was made
	sentUp    bool // a request byte went up (a failure is 502 sent, never retried)
	sentHead  bool // the response head went to the client (a failure is a cut)
	sent100   bool // a 100 Continue went to the client (never a second)
	done      bool // the response ended at its framing
}

// gx is the goroutine path's own state of an exchange.
type gx struct {
	uc  *upstream.Conn   // the upstream connection (upstream.Pool's)
	rsc httphead.Chunked // the chunked request body's framing, as it goes up
	// reroutable: a refused connect is reported (refused), not answered.
	reroutable, refused bool
	// learn, when the router set one, is shown the final status and the
	// first body bytes before they go to the client (learned session ids:
	// route/learn.go); lsc frames its view of a chunked body.
	learn *route.Learner
	lsc   httphead.Chunked
}

// newExchange is the exchange of req to w, before its I/O state.
func newExchange(w *worker.Worker, req *httphead.Request) exchange {
	return exchange{w: w, req: reqTraits{head: req.IsMethod("HEAD"), http10: req.Minor == 0},
		fr: respFraming{keep: req.KeepAlive}, reqLeft: max(req.ContentLength, 0)}
}

// giveUpBody is the early answer's rule (outcome.go, rule 3): the worker
// answered before it took the whole request body, so the rest of the
// body is not read; its answer goes out over it, the client connection
// then lingers and closes, and the upstream connection, left
// mid-request, is never reused. The loop gives the body up as the upload
// fails and waits for the answer (earlyAnswer); a goroutine once the
// answer came (earlyAnswer, or a final answer to Expect: 100-continue).
func (x *exchange) giveUpBody() { x.linger, x.fr.keep, x.fr.reuse = true, false, false }

// wentUp records n request bytes written up: once one went, a failure
// is never retried and its 502 says sent.
func (x *exchange) wentUp(n int64) {
	if n > 0 {
		x.prog.sentUp = true
	}
	x.w.Stats.AddUp(n)
}

// retrySend is the send's retry rule (upstream.Attempt.Retry) for a
// write up that failed on a connection reused (or not) from the idle set:
// a pooled connection that died before it took a byte gets the one redial
// (reason: upstream.Retry*), which the driver makes and records
// (prog.redialed).
func (x *exchange) retrySend(reused bool) (reason int, ok bool) {
	return upstream.Attempt{Sent: x.prog.sentUp, Reused: reused, Connected: x.prog.connected, Retried: x.prog.redialed}.Retry()
}

// reusable: the upstream connection goes back to the idle set (the
// response ended at its framing, and nothing made it unfit).
func (x *exchange) reusable() bool { return x.fr.reuse && x.prog.done }

// bodySent: the whole request body went up (frameResponse's bodySent).
func (x *exchange) bodySent() bool { return !x.linger }

// peekWant is how many body bytes the router is shown before the request
// is routed (Config.PeekBody): never beyond the body, nor beyond the room
// the buffer has behind the head. Both drivers wait for them (the loop:
// peekShort; a goroutine: peekBody).
func (s *Server) peekWant(req *httphead.Request, room int) int {
	want := s.cfg.PeekBody
	if req.ContentLength >= 0 && int64(want) > req.ContentLength {
		want = int(req.ContentLength)
	}
	return min(want, room)
}
