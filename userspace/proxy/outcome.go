package proxy

import (
	"sync/atomic"
	"time"

	"github.com/tether-rl/tether/userspace/worker"
)

// Outcomes: every way an exchange can fail is decided here, in one order,
// so the data path never writes its own ladder (caddy's reverse proxy does
// the same with statusError). Before the response head went out, the
// client gets an answer; after, only a visible cut.
//
// decide is that order, a pure function of where the exchange was (its
// stage) and what happened; conclude turns its ending into a verdict
// (every counter, the failure, the status, the answer, the close), which
// each driver applies to its socket: the loop to a raw descriptor
// (loop_finish.go's apply), the goroutine path to a net.TCPConn
// (gor_outcome.go's apply).
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
// lingering close (linger.go) (verdict.linger), so that no reset over the
// unread bytes destroys the answer.

// counted is one of the error and abort counters (Counters): they are
// incremented here, by count, and nowhere else.
type counted uint8

const (
	countRejected      counted = iota // tetherd answered a 4xx of its own
	countBadGateway                   // 502
	countTimeout                      // 504
	countTruncated                    // a response cut after its head
	countClientAborted                // the client left before the response ended
	countQueueFull                    // 503: the worker's queue was full
	countQueueTimeout                 // 503: the wait in the queue timed out
	countHoldFull                     // 503: the fleet's hold was full
	countHoldTimeout                  // 503: the wait in the hold timed out
	countLocalBusy                    // 503: LocalBodyBudget
)

// count increments the counter of what.
func (s *Server) count(what counted) {
	c := &s.counters
	[...]*atomic.Uint64{
		countRejected:      &c.Rejected,
		countBadGateway:    &c.BadGateway,
		countTimeout:       &c.Timeouts,
		countTruncated:     &c.Truncated,
		countClientAborted: &c.ClientAborted,
		countQueueFull:     &c.QueueFull,
		countQueueTimeout:  &c.QueueTimeouts,
		countHoldFull:      &c.HoldFull,
		countHoldTimeout:   &c.HoldTimeouts,
		countLocalBusy:     &c.LocalBusy,
	}[what].Add(1)
}

// gatewayAnswer counts tetherd's own 502 or 504 and returns it, closing
// the connection (sent: a request byte reached the worker).
func (s *Server) gatewayAnswer(status int, sent bool) []byte {
	switch status {
	case 502:
		s.count(countBadGateway)
	case 504:
		s.count(countTimeout)
	}
	return upstreamError(status, sent, true)
}

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

// reached is how far a failed exchange got, what its verdict depends on
// besides the fault.
type reached struct {
	sentUp   bool // a request byte went up: a 502/504 says "sent"
	sentHead bool // the response head went to the client: nothing more to answer
	unread   bool // the request body was not all read: the close lingers after an answer
	closeCut bool // the client's copy of the body ends at the close: a cut is a reset
}

// verdict is how a failed exchange ends on its client connection; the
// client connection always closes after it, and the upstream connection
// is never reused.
type verdict struct {
	end    ending
	status int    // tetherd's own answer, for Config.Observe (0: none)
	answer []byte // written to the client before the close (nil: nothing)
	failed bool   // counts as a worker error
	linger bool   // the close lingers (linger.go) over a request body not all read
	reset  bool   // the close is a reset (SO_LINGER 0): a cut must be visible
}

// conclude decides f (decide) and counts it: the verdict each driver
// applies. endEarly's answer is the worker's, relayed by the driver.
func (s *Server) conclude(f fault, r reached) verdict {
	e, status := decide(f)
	switch e {
	case endAbort:
		s.count(countClientAborted)
	case endReject:
		// The client's fault (a limit, its framing, a body stalled for
		// --io-timeout: 408); a half-sent request dies with its upstream.
		s.count(countRejected)
		return verdict{end: e, status: status, answer: errorResponse(status, true), linger: true}
	case endGateway:
		return s.gatewayVerdict(status, r)
	case endCut:
		s.count(countTruncated)
		return verdict{end: e, failed: true, reset: r.closeCut}
	}
	return verdict{end: e}
}

// gatewayVerdict is a worker error (502, 504): answered, and counted, if
// no response head went out; then the close, lingering over a request
// body not all read.
func (s *Server) gatewayVerdict(status int, r reached) verdict {
	v := verdict{end: endGateway, failed: true, linger: r.unread && !r.sentHead}
	if !r.sentHead {
		v.status = status
		v.answer = s.gatewayAnswer(status, r.sentUp)
	}
	return v
}

// brokenVerdict is a response whose first body bytes break its framing
// (docs/http-framing.md rule 22): counted as cut, answered 502 while no
// head went out.
func (s *Server) brokenVerdict(r reached) verdict {
	s.count(countTruncated)
	return s.gatewayVerdict(502, r)
}

// reached is how far x got; unread is the driver's to say (the loop
// knows the body bytes left, a goroutine the stage it failed at).
func (x *exchange) reached(unread bool) reached {
	return reached{sentUp: x.prog.sentUp, sentHead: x.prog.sentHead, unread: unread, closeCut: x.fr.closeCut}
}

// take records v in x, before a driver applies it to its socket.
func (x *exchange) take(v verdict) {
	x.failed, x.fr.reuse = v.failed, false
	if v.status != 0 {
		x.status = v.status
	}
}
