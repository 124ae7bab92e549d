package loadpoll

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"github.com/tether-rl/tether/userspace/dialect"
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

var errNoEndpoint = errors.New("no load endpoint (neither " + loadsPath() + " nor engine metrics on " + dialect.MetricsCall.Path + ")")

// loadsPath is the JSON load endpoint's path, for messages.
func loadsPath() string {
	c, _, _ := dialect.LoadsCall()
	return c.Path
}

// read reads the signals from the endpoint known to work, or detects one
// (what serves it is dialect's to say).
func (p *Poller) read(ctx context.Context, w *worker.Worker, st *wstate) (worker.EngineSignals, endpoint, error) {
	base := strings.TrimSuffix(w.URL, "/")
	if c, kind, ok := dialect.LoadsCall(); ok && (st.ep == epUnknown || st.ep == epNone || st.ep == epLoads) {
		body, code, err := p.get(ctx, base, c)
		if err != nil {
			return worker.EngineSignals{}, epUnknown, err
		}
		if code == http.StatusOK {
			l, err := dialect.ParseLoads(kind, body)
			if err == nil {
				w.SetEngine(kind)
				p.readVersion(ctx, base, kind, st)
				return signals(l), epLoads, nil
			}
			if st.ep == epLoads {
				return worker.EngineSignals{}, epUnknown, err
			}
		} else if st.ep == epLoads && code != http.StatusNotFound {
			return worker.EngineSignals{}, epUnknown, fmt.Errorf("%s %s: %d", c.Method, c.Path, code)
		}
	}
	c := dialect.MetricsCall
	body, code, err := p.get(ctx, base, c)
	if err != nil {
		return worker.EngineSignals{}, epUnknown, err
	}
	if code != http.StatusOK {
		if st.ep == epMetrics && code != http.StatusNotFound {
			return worker.EngineSignals{}, epUnknown, fmt.Errorf("%s %s: %d", c.Method, c.Path, code)
		}
		return worker.EngineSignals{}, epNone, errNoEndpoint
	}
	l, kind, next, ok := dialect.ParseMetrics(body, st.counters)
	if !ok {
		return worker.EngineSignals{}, epNone, errNoEndpoint
	}
	st.counters = next
	w.SetEngine(kind)
	p.readVersion(ctx, base, kind, st)
	return signals(l), epMetrics, nil
}

// signals is a dialect reading as placement takes it.
func signals(l dialect.Load) worker.EngineSignals {
	return worker.EngineSignals{Running: l.Running, Waiting: l.Waiting, KVUsage: l.KVUsage, HitRate: l.HitRate,
		MaxRunning: l.MaxRunning, Source: l.Source}
}

func (p *Poller) get(ctx context.Context, base string, c dialect.Call) ([]byte, int, error) {
	a, err := p.client.Do(ctx, base, c, "")
	if err != nil {
		return nil, 0, err
	}
	return a.Body, a.Status, nil
}

// readVersion reads the weight version of an engine of kind that serves
// one, every versionRounds polls.
func (p *Poller) readVersion(ctx context.Context, base string, kind dialect.Kind, st *wstate) {
	c, ok := dialect.VersionCall(kind)
	if !ok || st.polled%versionRounds != 1 {
		return
	}
	body, code, err := p.get(ctx, base, c)
	if err != nil || code != http.StatusOK {
		return
	}
	if v, ok := dialect.ParseVersion(body); ok {
		st.version = v
	}
}
