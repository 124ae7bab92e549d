package daemon

import (
	"flag"
	"fmt"
	"strings"

	"github.com/tether-rl/tether/userspace/config"
	"github.com/tether-rl/tether/userspace/kvindex"
	"github.com/tether-rl/tether/userspace/registry"
	"github.com/tether-rl/tether/userspace/route"
)

// The settings of placement from the engines' KV-cache events, declared
// once with their defaults (RegisterFlags).
func (o *KVEventsOptions) settings() []config.Setting {
	return []config.Setting{
		config.Str(&o.Template, "kv-events", "", "subscribe to every worker's KV-cache events at this ZMQ endpoint, {host} the worker's host (e.g. tcp://{host}:5557; a worker added with \"kv_events\" uses its own), and place requests carrying token ids where their prefix is cached; \"\": only workers that name their own", nil),
		config.Str(&o.ReplayTemplate, "kv-events-replay", "", "the engines' replay endpoint, {host} the worker's host (e.g. tcp://{host}:5558); \"\": none (a gap clears the engine's entries)", nil),
		config.Num(&o.Ranks, "kv-events-ranks", 1, config.Positive, "data-parallel ranks per worker publishing apart, at the endpoint's port + rank"),
		config.Num(&o.MaxEntries, "kv-index-max", kvindex.DefaultMaxEntries, config.Positive, "bound of the KV index in engine × block entries (stores past it are dropped and counted)"),
		config.Num(&o.TokensPerRequest, "kv-request-tokens", float64(route.DefaultTokensPerRequest), config.Positive, "KV placement: the work of one request in flight on an engine, in prompt tokens"),
		config.Bool(&o.On, "kv-events-workers", false, "turn KV placement on without --kv-events (workers added with \"kv_events\" only)"),
		config.List(&o.Workers, "worker-kv-events", nil, false, "URL=ENDPOINT[,REPLAY]: this worker's own KV-event publisher (and replay endpoint), over --kv-events, e.g. 'http://10.0.0.7:8001=tcp://10.0.0.7:5567,tcp://10.0.0.7:5568' (repeatable: engines sharing a host publish on different ports); turns KV placement on, as --kv-events-workers; with --cluster, written into the table with the start-up worker's entry"),
	}
}

// Validate checks the endpoint templates and every --worker-kv-events.
func (o KVEventsOptions) Validate() error {
	for _, t := range []struct{ flag, v string }{{"--kv-events", o.Template}, {"--kv-events-replay", o.ReplayTemplate}} {
		if t.v != "" {
			if err := checkKVEndpoint(t.flag, t.v); err != nil {
				return err
			}
		}
	}
	_, err := o.workerEndpoints()
	return err
}

// workerEndpoints reads --worker-kv-events: canonical worker URL ->
// endpoint, replay. A URL named twice is refused.
func (o KVEventsOptions) workerEndpoints() (map[string][2]string, error) {
	m := make(map[string][2]string, len(o.Workers))
	for _, s := range o.Workers {
		u, ep, err := parseWorkerKVEvents(s)
		if err != nil {
			return nil, err
		}
		if _, dup := m[u]; dup {
			return nil, fmt.Errorf("--worker-kv-events: %s named twice", u)
		}
		m[u] = ep
	}
	return m, nil
}

// parseWorkerKVEvents reads one --worker-kv-events URL=ENDPOINT[,REPLAY]:
// the worker's URL as the registry writes it (registry.ParseURL, as an
// admin add's; a prefill's ?bootstrap_port=N taken off, as --prefill's),
// its endpoint and replay endpoint (tcp://host:port, checked as the admin
// API's "kv_events"). The URL ends at the last "=tcp://".
func parseWorkerKVEvents(s string) (string, [2]string, error) {
	const want = "want URL=tcp://host:port[,tcp://host:port], e.g. http://10.0.0.7:8001=tcp://10.0.0.7:5567"
	i := strings.LastIndex(s, "=tcp://")
	if i < 0 {
		return "", [2]string{}, fmt.Errorf("--worker-kv-events %q: %s", s, want)
	}
	raw, eps := s[:i], s[i+1:]
	ep, rp, hasReplay := strings.Cut(eps, ",")
	if err := checkKVEndpoint("--worker-kv-events: endpoint", ep); err != nil {
		return "", [2]string{}, err
	}
	if hasReplay {
		if err := checkKVEndpoint("--worker-kv-events: replay endpoint", rp); err != nil {
			return "", [2]string{}, err
		}
	}
	u, _, err := registry.SplitBootstrapPort(raw)
	if err == nil {
		u, _, err = registry.ParseURL(u)
	}
	if err != nil {
		return "", [2]string{}, fmt.Errorf("--worker-kv-events %q: %w", s, err)
	}
	return u, [2]string{ep, rp}, nil
}

// RegisterFlags registers the KV-event settings on fs.
func (o *KVEventsOptions) RegisterFlags(fs *flag.FlagSet) { config.Register(fs, o.settings()) }
