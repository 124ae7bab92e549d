package pd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	"github.com/tether-rl/tether/userspace/jsonedit"
)

func (s *Server) serveVLLM(ctx context.Context, w ResponseWriter, req *Request, chooser PairChooser) error {
	return s.serve(ctx, w, req, chooser, s.vllmAttempt)
}

// requestID is the X-Request-Id both legs of an attempt carry: the
// client's (marked on a retry), or a new one.
func requestID(req *Request, attempt int) string {
	id := req.Header.Get("X-Request-Id")
	if id == "" {
		return newID("pd-")
	}
	if attempt > 0 {
		return fmt.Sprintf("%s-retry%d", id, attempt)
	}
	return id
}

func (s *Server) vllmAttempt(ctx context.Context, w ResponseWriter, req *Request, r *request, pair Pair, attempt int, last bool) (bool, error) {
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
	pctx, pcancel := context.WithCancel(ctx)
	pch := s.whole(pctx, pair.Prefill, req, pbody, id, s.cfg.MaxPrefillAnswer)
	var p legResult
	select {
	case p = <-pch:
		pcancel()
	case <-ctx.Done():
		s.Counters.ClientGone.Add(1)
		s.cancelLeg(pcancel, pch, pair.Prefill, nil) // the closed connection aborts it
		return false, ctx.Err()
	}
	switch {
	case p.failed():
		s.Counters.PrefillFailed.Add(1)
		if last {
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
	if params == nil && prefillAborted(p.body) {
		// Aborted (a pause in abort mode, an abort by id): no KV to hand
		// over. As a failed leg: once more on a new pair (which waits out
		// a pause in the hold); the last attempt's answer goes to the
		// client as it is.
		s.Counters.PrefillFailed.Add(1)
		if last {
			s.giveUp(w, &p, route, "prefill")
		}
		return true, errors.New("pd: the prefill was aborted")
	}
	if params != nil {
		if dbody, err = r.obj.Apply(jsonedit.Set("kv_transfer_params", params)); err != nil {
			writeError(w, http.StatusBadGateway, "upstream_error", err.Error())
			return false, err
		}
	} else {
		s.Counters.MissingKVParams.Add(1)
		if !s.cfg.LetMissingKVParamsThrough {
			err := errors.New("the prefill answered without kv_transfer_params: the decode would recompute the whole prompt")
			writeError(w, http.StatusBadGateway, "upstream_error", err.Error())
			return false, fmt.Errorf("pd: %w", err)
		}
		s.Counters.PassedWithoutKVParams.Add(1)
	}
	dctx, dcancel := context.WithCancel(ctx)
	defer dcancel()
	dch := s.first(dctx, pair.Decode, req, dbody, id)
	var d legResult
	select {
	case d = <-dch:
	case <-ctx.Done():
		s.Counters.ClientGone.Add(1)
		s.cancelLeg(dcancel, dch, pair.Decode, nil)
		return false, ctx.Err()
	}
	switch {
	case d.failed():
		s.Counters.DecodeFailed.Add(1)
		if last {
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

// prefillAborted reports a prefill's answer with finish reason abort (vLLM's
// connector hands over no KV for an aborted request).
func prefillAborted(answer []byte) bool {
	var a struct {
		Choices []struct {
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
	}
	if json.Unmarshal(answer, &a) != nil {
		return false
	}
	for _, c := range a.Choices {
		if c.FinishReason == "abort" {
			return true
		}
	}
	return false
}
