package loadpoll

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/tether-rl/tether/userspace/worker"
)

// One worker's poll: the load endpoint it serves (detected, then kept),
// the reading handed to placement, the failures counted.

// poll reads one worker's engine.
func (p *Poller) poll(ctx context.Context, w *worker.Worker, st *wstate) {
	st.polled++
	if st.ep == epNone && st.polled%redetectRounds != 1 {
		return
	}
	sig, ep, err := p.read(ctx, w, st)
	select {
	case <-p.stop:
		return
	default:
	}
	if err != nil {
		st.failures++
		if errors.Is(err, errNoEndpoint) {
			st.ep = epNone
			if w.EngineKnown() {
				w.ForgetEngineSignals(st.failures, err)
			}
			return
		}
		if w.EngineKnown() && st.failures < staleRounds {
			w.NoteEngineFailure(st.failures, err)
		} else {
			if w.EngineKnown() {
				p.opts.Log.Warn("engine load endpoint not answering: placing the worker by its in-flight count", "slot", w.Slot, "url", w.URL, "err", err)
			}
			w.ForgetEngineSignals(st.failures, err)
		}
		return
	}
	if st.failures >= staleRounds && st.ep != epUnknown {
		p.opts.Log.Info("engine load endpoint answering again", "slot", w.Slot, "url", w.URL)
	}
	st.failures = 0
	st.ep = ep
	st.lastOK = p.opts.Now()
	if sig.WeightVersion == "" {
		sig.WeightVersion = st.version
	}
	vetoed, low := false, 0.0
	if e := p.placement(); e != nil {
		vetoed = e.Veto(w.EngineVetoed(), sig)
		low = e.VetoLow(sig)
	}
	if vetoed != w.EngineVetoed() {
		p.opts.Log.Info("engine veto", "slot", w.Slot, "vetoed", vetoed, "kv_usage", sig.KVUsage, "waiting", sig.Waiting)
	}
	w.SetEngineSignals(sig, vetoed, low, st.lastOK)
}

var errNoEndpoint = errors.New("no load endpoint (neither /v1/loads nor engine metrics on /metrics)")

// read reads the signals from the endpoint known to work, or detects one.
func (p *Poller) read(ctx context.Context, w *worker.Worker, st *wstate) (worker.EngineSignals, endpoint, error) {
	base := strings.TrimSuffix(w.URL, "/")
	if st.ep == epUnknown || st.ep == epNone || st.ep == epLoads {
		body, code, err := p.get(ctx, base+"/v1/loads")
		if err != nil {
			return worker.EngineSignals{}, epUnknown, err
		}
		if code == http.StatusOK {
			sig, err := parseLoads(body)
			if err == nil {
				w.SetEngine(worker.EngineSGLang)
				if st.polled%versionRounds == 1 {
					if v, ok := p.weightVersion(ctx, base); ok {
						st.version = v
					}
				}
				return sig, epLoads, nil
			}
			if st.ep == epLoads {
				return worker.EngineSignals{}, epUnknown, err
			}
		} else if st.ep == epLoads && code != http.StatusNotFound {
			return worker.EngineSignals{}, epUnknown, fmt.Errorf("GET /v1/loads: %d", code)
		}
	}
	body, code, err := p.get(ctx, base+"/metrics")
	if err != nil {
		return worker.EngineSignals{}, epUnknown, err
	}
	if code != http.StatusOK {
		if st.ep == epMetrics && code != http.StatusNotFound {
			return worker.EngineSignals{}, epUnknown, fmt.Errorf("GET /metrics: %d", code)
		}
		return worker.EngineSignals{}, epNone, errNoEndpoint
	}
	sig, kind, ok := parseMetrics(body, st)
	if !ok {
		return worker.EngineSignals{}, epNone, errNoEndpoint
	}
	w.SetEngine(kind)
	if kind == worker.EngineSGLang && st.polled%versionRounds == 1 {
		if v, ok := p.weightVersion(ctx, base); ok {
			st.version = v
		}
	}
	return sig, epMetrics, nil
}

func (p *Poller) get(ctx context.Context, url string) ([]byte, int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, 0, err
	}
	req.Header.Set("User-Agent", "tetherd-loadpoll")
	if p.opts.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+p.opts.APIKey)
	}
	resp, err := p.client.Do(req)
	if err != nil {
		return nil, 0, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxBody))
	if err != nil {
		return nil, 0, err
	}
	return body, resp.StatusCode, nil
}

// weightVersion reads SGLang's GET /get_weight_version.
func (p *Poller) weightVersion(ctx context.Context, base string) (string, bool) {
	body, code, err := p.get(ctx, base+"/get_weight_version")
	if err != nil || code != http.StatusOK {
		return "", false
	}
	var v struct {
		WeightVersion any `json:"weight_version"`
	}
	if json.Unmarshal(body, &v) != nil || v.WeightVersion == nil {
		return "", false
	}
	switch x := v.WeightVersion.(type) {
	case string:
		return x, true
	case float64:
		return strconv.FormatFloat(x, 'f', -1, 64), true
	}
	return "", false
}
