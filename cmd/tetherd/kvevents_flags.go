package main

import (
	"flag"

	"github.com/tether-rl/tether/userspace/daemon"
	"github.com/tether-rl/tether/userspace/kvindex"
	"github.com/tether-rl/tether/userspace/route"
)

// kvEventsFlags: placement from the engines' KV-cache events (issue 28).
func kvEventsFlags(fs *flag.FlagSet, o *daemon.KVEventsOptions) {
	fs.StringVar(&o.Template, "kv-events", "", "subscribe to every worker's KV-cache events at this ZMQ endpoint, {host} the worker's host (e.g. tcp://{host}:5557; a worker added with \"kv_events\" uses its own), and place requests carrying token ids where their prefix is cached; \"\": only workers that name their own")
	fs.StringVar(&o.ReplayTemplate, "kv-events-replay", "", "the engines' replay endpoint, {host} the worker's host (e.g. tcp://{host}:5558); \"\": none (a gap clears the engine's entries)")
	fs.IntVar(&o.Ranks, "kv-events-ranks", 1, "data-parallel ranks per worker publishing apart, at the endpoint's port + rank")
	fs.IntVar(&o.MaxEntries, "kv-index-max", kvindex.DefaultMaxEntries, "bound of the KV index in engine × block entries (stores past it are dropped and counted)")
	fs.Float64Var(&o.TokensPerRequest, "kv-request-tokens", route.DefaultTokensPerRequest, "KV placement: the work of one request in flight on an engine, in prompt tokens")
	fs.BoolVar(&o.On, "kv-events-workers", false, "turn KV placement on without --kv-events (workers added with \"kv_events\" only)")
}
