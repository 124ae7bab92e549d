package proxy

// One exchange, two drivers. An exchange is one request proxied to a
// worker and its response relayed back; the event loop drives it on raw
// non-blocking sockets (loop_*.go), a goroutine drives it with blocking
// calls on a net.TCPConn where the loop does not run it (gor_*.go: a
// queue wait, an upgrade, a hand-off). Both keep the same facts of it
// here, under one name each, conclude it in outcome.go, and keep only
// their own I/O state apart: lx (the loop's) and gx (the goroutine's).

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
	done      bool // the response ended at its framing
}

// gx is the goroutine path's own state of an exchange.
type gx struct {
	uc      *upstream.Conn // the upstream connection (upstream.Pool's)
	sent100 bool           // a 100 Continue went to the client (never a second)
	// reroutable: a refused connect is reported (refused), not answered.
	reroutable, refused bool
	// learn, when the router set one, is shown the final status and the
	// first body bytes before they go to the client (learned session ids:
	// route/learn.go); lsc frames its view of a chunked body.
	learn *route.Learner
	lsc   httphead.Chunked
	// linger: the answer went out over a request body not all read; the
	// client connection lingers (lingerClose) once the exchange is
	// accounted and its worker's place and socket given back (proxy).
	linger bool
}

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
