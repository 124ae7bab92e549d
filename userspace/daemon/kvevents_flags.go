package daemon

import (
	"flag"

	"github.com/tether-rl/tether/userspace/config"
	"github.com/tether-rl/tether/userspace/kvindex"
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
	}
}

// RegisterFlags registers the KV-event settings on fs.
func (o *KVEventsOptions) RegisterFlags(fs *flag.FlagSet) { config.Register(fs, o.settings()) }
