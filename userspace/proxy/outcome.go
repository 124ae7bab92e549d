package proxy

import (
	"time"

	"github.com/tether-rl/tether/userspace/worker"
)

// Outcomes: every way an exchange can fail is decided here, in one order,
// so the data path never writes its own ladder (caddy's reverse proxy does
// the same with statusError). Before the response head went out, the
// client gets an answer; after, only a visible cut.
//
// decide is that order, a pure function of where the exchange was (its
// stage) and what happened; the goroutine path (gor_outcome.go) and the
// loop (loop_finish.go) each carry its verdict out on their sockets.
//
// While the request goes up (stageHeadUp, stageBodyUp), in this order:
//  1. the client's own framing or a limit (*httphead.Error: 400, 413, ...):
//     that status, nothing more goes up;
//  2. the client left: nothing to answer (client_aborted);
//  3. the worker answered early (it stopped reading: 413, 401 + close):
//     that answer, then the client connection closes;
//  4. a body (stageBodyUp) that made no progress for --io-timeout: 408 (the client
//     stopped sending; the half-sent request dies with its upstream);
//  5. anything else: 502 (X-Tether-Upstream-State says whether bytes went).
//
// While waiting for the response head (stageWait): the client left →
// nothing; a timeout → 504 (502 while waiting for an early answer after
// the body failed to go up); anything else → 502.
//
// After the head (stageRelay, or a client that stopped reading): the
// client left → nothing; else the cut is made visible (close; a reset for
// a close-delimited body).
//
// Before any of these, the connect (nothing sent): a refusal is retried
// once, then the request is placed again (or 502 not-sent); a connect,
// first or retried, that finds no descriptor or port on this host
// (upstream.ErrLocal; the loop's EMFILE, ENFILE) is 502 not-sent at once,
// since no other worker would fare better.
//
// A 502/504 answered while the request body was not all read (the body
// failing to go up, or no descriptor for the connect) is followed by the
// lingering close (linger.go), on both paths (loop_finish.go's fail,
// gor_outcome.go's conclude and refusedOrFail), so that no reset over
// the unread bytes destroys the answer.

// exchangeEnded is the accounting of every proxied exchange, on either
// path, once it ended: its result on w (failed: a worker error), its place
// given back, and (observe) Config.Observe told the status class and the
// time it took.
func (s *Server) exchangeEnded(w *worker.Worker, failed, observe bool, status int, took time.Duration) {
	w.Stats.End(failed)
	w.Leave()
	if obs := s.cfg.Observe; obs != nil && observe {
		obs(w.Slot, status/100, took)
	}
}

// stage is where an exchange was when it failed (on the loop, where its
// exchange is between two entries: lx.phase, under the names phaseSend,
// phaseUpload, phaseHead, phaseBody).
type stage uint8

const (
	stageHeadUp stage = iota // the request head (and buffered body bytes) going up
	stageBodyUp              // the rest of the request body going up
	stageWait                // waiting for the response head
	stageRelay               // the response head went out: relaying the body
)

// fault is what happened to a failed exchange.
type fault struct {
	stage    stage
	gone     bool // the client left
	reject   int  // the client's own framing or a limit (*httphead.Error's status)
	answered bool // the worker answered early, and that answer went to the client
	timeout  bool // no progress within its deadline
	early    bool // stageWait: the wait was for an early answer, the body having failed to go up
}

// ending is how a failed exchange ends.
type ending uint8

const (
	endAbort   ending = iota // the client left: nothing to answer (client_aborted)
	endEarly                 // the worker's early answer went out: the client connection lingers and closes
	endReject                // tetherd answers the status (the client's fault: rejected), lingers, closes
	endGateway               // the status (502/504, a worker error) unless a head went out; then the close
	endCut                   // after the head: a visible cut (truncated)
)

// decide is the ladder: how the exchange of f ends, and the status that
// tetherd answers (endReject, endGateway).
func decide(f fault) (ending, int) {
	switch {
	case f.gone:
		return endAbort, 0
	case f.stage == stageRelay:
		return endCut, 0
	case f.reject != 0:
		return endReject, f.reject
	case f.answered:
		return endEarly, 0
	case f.stage == stageBodyUp && f.timeout:
		return endReject, 408
	case f.stage == stageWait && f.timeout && !f.early:
		return endGateway, 504
	}
	return endGateway, 502
}
