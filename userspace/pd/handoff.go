package pd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/jsonedit"
)

func (s *Server) serveVLLM(ctx context.Context, w ResponseWriter, req *Request, chooser PairChooser) error {
	return s.serve(ctx, w, req, chooser, s.vllmAttempt)
}

// requestID is the id both legs of an attempt carry (in the NIXL
// protocol's RequestIDHeader): the client's (marked on a retry), or a new
// one.
func requestID(req *Request, attempt int) string {
	id := req.Header.Get(handoff.RequestIDHeader)
	if id == "" {
		return newID("pd-")
	}
	if attempt > 0 {
		return fmt.Sprintf("%s-retry%d", id, attempt)
	}
	return id
}

func (s *Server) vllmAttempt(ctx context.Context, w ResponseWriter, req *Request, r *request, pair Pair, attempt int, last func() bool) (bool, error) {
	route := pair.String()
	if pair.Reason != "" {
		route += " " + pair.Reason
	}
	id := requestID(req, attempt)
	pbody, err := vllmPrefillBody(r)
	if err != nil {
		writeError(w, http.StatusBadGateway, "upstream_error", err.Error())
		return false, err
	}
	// The legs run one after the other, each in this goroutine: a client
	// that leaves ends ctx, which closes the leg's connection (how vLLM
	// aborts) and so ends the leg at once.
	h := s.legHeader(req, id)
	pctx, pcancel := context.WithCancel(ctx)
	p := s.wholeNow(pctx, pair.Prefill, req, h, pbody, s.cfg.MaxPrefillAnswer)
	pcancel()
	if ctx.Err() != nil {
		s.Counters.ClientGone.Add(1)
		s.Counters.LegsCancelled.Add(1) // its connection closed: aborted
		return false, ctx.Err()
	}
	switch {
	case p.failed():
		s.Counters.PrefillFailed.Add(1)
		if last() {
			s.giveUp(w, &p, route, "prefill")
		}
		return true, legErr("prefill", &p)
	case p.status() > 299 || p.status() < 200:
		s.Counters.PrefillRefused.Add(1)
		forward(w, &p, route, s.cfg.RouteHeader)
		return false, legErr("prefill", &p)
	}
	dbody := req.Body
	params := kvParams(p.body)
	if params == nil && prefillAborted(handoff, p.body) {
		// Aborted (a pause in abort mode, an abort by id): no KV to hand
		// over. As a failed leg: once more on a new pair (which waits out
		// a pause in the hold); the last attempt's answer goes to the
		// client as it is.
		s.Counters.PrefillFailed.Add(1)
		if last() {
			s.giveUp(w, &p, route, "prefill")
		}
		return true, errors.New("pd: the prefill was aborted")
	}
	if params != nil {
		if dbody, err = r.obj.Apply(jsonedit.Set(handoff.KVParams, params)); err != nil {
			writeError(w, http.StatusBadGateway, "upstream_error", err.Error())
			return false, err
		}
	} else {
		s.Counters.MissingKVParams.Add(1)
		if !s.cfg.LetMissingKVParamsThrough {
			err := errors.New("the prefill answered without " + handoff.KVParams + ": the decode would recompute the whole prompt")
			writeError(w, http.StatusBadGateway, "upstream_error", err.Error())
			return false, fmt.Errorf("pd: %w", err)
		}
		s.Counters.PassedWithoutKVParams.Add(1)
	}
	dctx, dcancel := context.WithCancel(ctx)
	defer dcancel()
	d := s.firstNow(dctx, pair.Decode, req, h, dbody)
	if ctx.Err() != nil {
		d.done()
		s.Counters.ClientGone.Add(1)
		s.Counters.LegsCancelled.Add(1) // its connection closed: aborted
		return false, ctx.Err()
	}
	switch {
	case d.failed():
		s.Counters.DecodeFailed.Add(1)
		if last() {
			s.giveUp(w, &d, route, "decode")
		}
		return true, legErr("decode", &d)
	case d.status() > 299 || d.status() < 200:
		s.Counters.DecodeRefused.Add(1)
		forward(w, &d, route, s.cfg.RouteHeader)
		return false, legErr("decode", &d)
	}
	defer d.done()
	err = s.relay(ctx, w, &d, route, nil, nil)
	switch {
	case err == nil:
		s.Counters.Served.Add(1)
	case errors.Is(err, errClient):
		s.Counters.ClientGone.Add(1)
		s.Counters.LegsCancelled.Add(1) // dcancel closes its connection: vLLM aborts
	default:
		s.Counters.MidStream.Add(1)
	}
	return false, err
}

// prefillAborted: the prefill's answer says it was aborted (a pause in
// abort mode, an abort by id), in its engine's words: it has no KV to
// hand over, and is a failed leg, not a missing handoff.
func prefillAborted(w *dialect.PDWire, answer []byte) bool {
	if w.AbortedFinish == "" {
		return false
	}
	var a map[string]json.RawMessage
	if json.Unmarshal(answer, &a) != nil {
		return false
	}
	var choices []map[string]json.RawMessage
	if json.Unmarshal(a[w.Choices], &choices) != nil {
		return false
	}
	for _, c := range choices {
		var reason string
		if json.Unmarshal(c[w.FinishReason], &reason) == nil && reason == w.AbortedFinish {
			return true
		}
	}
	return false
}
