package pd

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"
)

// refuse answers a request Serve cannot take.
func (s *Server) refuse(w ResponseWriter, err error) error {
	switch {
	case errors.Is(err, errSamples):
		s.Counters.RefusedN.Add(1)
		writeError(w, http.StatusBadRequest, "invalid_request_error", err.Error())
	default:
		s.Counters.BadRequest.Add(1)
		writeError(w, http.StatusBadRequest, "invalid_request_error", "the body must be one JSON object: "+err.Error())
	}
	return err
}

// attemptFunc runs one attempt on a pair; it answers the client unless it
// asks for a retry (retry true) and last() is false. It calls last() only
// once a leg failed, when it is known whether a pause ran meanwhile.
type attemptFunc func(ctx context.Context, w ResponseWriter, req *Request, r *request, p Pair, attempt int, last func() bool) (retry bool, err error)

// PauseCounter, when a PairChooser is one too, tells the attempts of a
// pause: Holds returns how many times the fleet began holding requests
// (a weight sync's pause, here or through another replica) and whether it
// holds now. An attempt that fails while a pause began or holds (its legs
// aborted by the pause, not by the pair's fault) is not charged: the
// request is tried again (Choose waits out the pause) up to maxAttempts
// in all, and the pair is released as not failed.
type PauseCounter interface {
	Holds() (n uint64, holding bool)
}

// maxAttempts bounds a request's attempts: one, one more after a failure,
// and those retried after pauses.
const maxAttempts = 6

// serve runs the attempts: one, and one more on a new pair after a
// failure before the client had a byte (and, with a PauseCounter, one
// more after each attempt a pause failed). A chooser that is an Observer
// is told of the attempt that answered (not of one retried).
func (s *Server) serve(ctx context.Context, w ResponseWriter, req *Request, chooser PairChooser, run attemptFunc) error {
	r, err := inspect(req.Body)
	if err != nil {
		return s.refuse(w, err)
	}
	ob, _ := chooser.(Observer)
	var sw *statusWriter
	if ob != nil {
		sw = &statusWriter{w: w}
		w = sw
	}
	pc, _ := chooser.(PauseCounter)
	var failed *Pair
	charged := 0 // attempts failed by their pair
	for attempt := 0; ; attempt++ {
		start := time.Now()
		var holds uint64
		if pc != nil {
			holds, _ = pc.Holds()
		}
		pair, err := chooser.Choose(ctx, req, attempt, failed)
		if err != nil {
			s.Counters.NoPair.Add(1)
			writeError(w, http.StatusServiceUnavailable, "no_pair", fmt.Sprintf("no prefill/decode pair: %v", err))
			return err
		}
		if attempt > 0 {
			s.Counters.Retries.Add(1)
		}
		// The attempt's end, decided once: paused (a pause began or holds
		// since its choice), last (its failure goes to the client).
		var decided, paused, last bool
		decide := func() {
			if decided {
				return
			}
			decided = true
			if pc != nil {
				n, holding := pc.Holds()
				paused = n != holds || holding
			}
			last = ctx.Err() == nil && (attempt == maxAttempts-1 || !paused && charged >= 1)
		}
		retry, err := run(ctx, w, req, r, pair, attempt, func() bool { decide(); return last })
		if retry {
			decide()
		}
		chooser.Release(pair, err != nil && !paused)
		if retry && ctx.Err() != nil {
			// The legs failed because the client left (their contexts
			// ended): no retry, no answer.
			s.Counters.ClientGone.Add(1)
			if ob != nil {
				ob.Observe(pair, sw.status, time.Since(start))
			}
			return ctx.Err()
		}
		if retry && !last {
			s.cfg.Log.Debug("pd: retrying on a new pair", "pair", pair.String(), "paused", paused, "err", err)
			if paused {
				s.Counters.PausedRetries.Add(1)
				failed = nil // the pair was not at fault: its affinity holds
			} else {
				charged++
				failed = &pair
			}
			continue
		}
		if ob != nil {
			ob.Observe(pair, sw.status, time.Since(start))
		}
		return err
	}
}

func (s *Server) serveSGLang(ctx context.Context, w ResponseWriter, req *Request, chooser PairChooser) error {
	return s.serve(ctx, w, req, chooser, s.sglangAttempt)
}

// giveUp answers the last attempt's failure: the engine's 5xx as it is, or
// a 502 of tether's own.
func (s *Server) giveUp(w ResponseWriter, l *legResult, route, what string) {
	s.Counters.GaveUp.Add(1)
	if l.err == nil && l.resp != nil {
		forward(w, l, route, s.cfg.RouteHeader)
		return
	}
	writeError(w, http.StatusBadGateway, "upstream_error", fmt.Sprintf("%s failed: %v", what, l.err))
}

func legErr(what string, l *legResult) error {
	if l.err != nil {
		return fmt.Errorf("pd: %s: %w", what, l.err)
	}
	return fmt.Errorf("pd: %s answered %d", what, l.status())
}

func (s *Server) sglangAttempt(ctx context.Context, w ResponseWriter, req *Request, r *request, pair Pair, _ int, last func() bool) (bool, error) {
	body, rids, err := sglangBody(r, pair.Prefill)
	if err != nil {
		writeError(w, http.StatusBadGateway, "upstream_error", err.Error())
		return false, err
	}
	route := pair.String()
	if pair.Reason != "" {
		route += " " + pair.Reason
	}
	pctx, pcancel := context.WithCancel(ctx)
	late := false // P handed to lateLeg, which cancels it
	defer func() {
		if !late {
			pcancel()
		}
	}()
	dctx, dcancel := context.WithCancel(ctx)
	keep := int64(64 << 10) // a 4xx to pass on
	if r.logprob {
		keep = s.cfg.MaxPrefillAnswer
	}
	h := s.legHeader(req, "")
	pch := s.whole(pctx, pair.Prefill, req, h, body, keep)
	dch := s.first(dctx, pair.Decode, req, h, body)
	var p, d *legResult
	for d == nil || d.status() < 200 || d.status() > 299 || (r.logprob && p == nil) {
		ev, l := nextLeg(ctx, pch, dch)
		switch ev {
		case prefillEv:
			pch, p = nil, &l
			pcancel()
			switch {
			case p.failed():
				s.Counters.PrefillFailed.Add(1)
				closeFirst(d)
				s.closeLeg(dcancel, dch)
				// The decode is aborted, and so is the prefill whose
				// connection broke (the engine may live on), before a retry
				// that may carry the client's rid there.
				s.abortAll(abortCall{pair.Decode, rids}, abortCall{pair.Prefill, ridsIf(p.err != nil, rids)})
				if last() {
					s.giveUp(w, p, route, "prefill")
				}
				return true, legErr("prefill", p)
			case p.status() > 299:
				s.Counters.PrefillRefused.Add(1)
				closeFirst(d)
				s.cancelLeg(dcancel, dch, pair.Decode, rids)
				forward(w, p, route, s.cfg.RouteHeader)
				return false, legErr("prefill", p)
			}
		case decodeEv:
			dch, d = nil, &l
			switch {
			case d.failed():
				s.Counters.DecodeFailed.Add(1)
				dcancel()
				var prefill []string
				if pch != nil {
					s.closeLeg(pcancel, pch)
					prefill = rids
				}
				s.abortAll(abortCall{pair.Prefill, prefill}, abortCall{pair.Decode, ridsIf(d.err != nil, rids)})
				if last() {
					s.giveUp(w, d, route, "decode")
				}
				return true, legErr("decode", d)
			case d.status() > 299 || d.status() < 200:
				s.Counters.DecodeRefused.Add(1)
				dcancel()
				if pch != nil {
					s.cancelLeg(pcancel, pch, pair.Prefill, rids)
				}
				forward(w, d, route, s.cfg.RouteHeader)
				return false, legErr("decode", d)
			}
		case clientEv:
			s.Counters.ClientGone.Add(1)
			var prefill []string
			if pch != nil {
				s.closeLeg(pcancel, pch)
				prefill = rids
			}
			if d == nil {
				s.closeLeg(dcancel, dch)
			} else {
				dcancel()
				d.done()
			}
			s.abortAll(abortCall{pair.Prefill, prefill}, abortCall{pair.Decode, rids})
			return false, ctx.Err()
		}
	}
	defer dcancel()
	defer d.done()
	var tx *sse
	var whole []byte
	if r.logprob {
		m := newMerger(p.body, &s.Counters.LogprobMerges)
		if isSSE(d.resp.Header) {
			tx = &sse{m: m}
		} else {
			// The whole answer is merged: read before the client has a byte.
			rest, err := io.ReadAll(io.LimitReader(d.resp.Body, s.cfg.MaxPrefillAnswer))
			if err != nil {
				s.Counters.DecodeFailed.Add(1)
				if last() {
					s.giveUp(w, &legResult{err: err}, route, "decode")
				}
				return true, fmt.Errorf("pd: decode: %w", err)
			}
			whole = m.whole(append(d.body, rest...))
		}
	}
	err = s.relay(ctx, w, d, route, tx, whole)
	switch {
	case err == nil:
		s.Counters.Served.Add(1)
		if pch != nil {
			late = true
			s.lateLeg(pcancel, pch, pair.Prefill, rids)
		}
		return false, nil
	case errors.Is(err, errClient):
		s.Counters.ClientGone.Add(1)
	default:
		s.Counters.MidStream.Add(1)
	}
	// The decode's connection is closed (dcancel, deferred) and it is
	// aborted by rid, with the prefill if it still runs.
	s.closeLeg(dcancel, nil)
	var prefill []string
	if pch != nil {
		s.closeLeg(pcancel, pch)
		prefill = rids
	}
	s.abortAll(abortCall{pair.Prefill, prefill}, abortCall{pair.Decode, rids})
	return false, err
}

// The events of an attempt with both legs at once.
const (
	prefillEv = iota
	decodeEv
	clientEv
)

// nextLeg waits for the next leg's result (a nil channel: that leg is
// done) or the client's departure. A prefill's result that is already in
// comes first: a prefill that failed makes its decode fail soon after
// (its room gone), and the cause is the one counted and acted on.
func nextLeg(ctx context.Context, pch, dch <-chan legResult) (int, legResult) {
	select {
	case l := <-pch:
		return prefillEv, l
	default:
	}
	select {
	case l := <-pch:
		return prefillEv, l
	case l := <-dch:
		return decodeEv, l
	case <-ctx.Done():
		return clientEv, legResult{}
	}
}

func isSSE(h http.Header) bool {
	ct := h.Get("Content-Type")
	return len(ct) >= 17 && ct[:17] == "text/event-stream"
}

// closeFirst closes a decode's 2xx answer already received and now dropped.
func closeFirst(d *legResult) {
	if d != nil {
		d.done()
	}
}
