package main

import (
	"flag"
	"strings"

	"github.com/tether-rl/tether/userspace/daemon"
	"github.com/tether-rl/tether/userspace/route"
)

// keyHeaders is --key-header: repeatable, each a comma-separated list; the
// first use replaces the default list.
type keyHeaders struct {
	list []string
	set  bool
}

func (k *keyHeaders) String() string {
	if !k.set {
		return strings.Join(route.DefaultKeyHeaders, ",")
	}
	return strings.Join(k.list, ",")
}

func (k *keyHeaders) Set(v string) error {
	if !k.set {
		k.list, k.set = nil, true
	}
	for _, h := range strings.Split(v, ",") {
		if h = strings.TrimSpace(h); h != "" {
			k.list = append(k.list, h)
		}
	}
	return nil
}

// routingFlags registers the routing policy and engine endpoint flags; the
// returned func copies them into o after Parse.
func routingFlags(fs *flag.FlagSet, o *daemon.RoutingOptions) func() {
	var keys keyHeaders
	fs.StringVar(&o.Policy, "policy", "hash", "placement of requests with a routing key (no /sessions/ path): hash (consistent hashing, bounded load) or sticky (sticky least loaded)")
	fs.Var(&keys, "key-header", "routing key header, first non-empty value wins (repeatable or comma list; case-insensitive; default X-Session-ID,X-SMG-Routing-Key)")
	fs.Float64Var(&o.HashLoadFactor, "hash-load-factor", route.DefaultLoadFactor, "--policy=hash: a worker with more than c × mean requests in flight passes a key to its ring successor")
	fs.DurationVar(&o.StickyTTL, "sticky-ttl", route.DefaultStickyTTL, "--policy=sticky: a key's assignment expires this long after its last use (or on POST /finish_session)")
	fs.StringVar(&o.StickyStore, "sticky-store", "auto", "--policy=sticky table: auto (pinned BPF LRU map shared by every tetherd, else in-process), bpf (required) or memory")
	fs.StringVar(&o.Keyless, "keyless", "least", "requests without a key: least (fewest in flight, rotating tie-break), p2c (less loaded of two random workers) or prefix (hash the first --peek-bytes of the body, bounded load)")
	fs.IntVar(&o.PeekBytes, "peek-bytes", route.DefaultPrefixBytes, "body bytes read before routing (request id \"rid\", --keyless=prefix); -1: none")
	fs.IntVar(&o.MaxTrackedRequests, "max-tracked-requests", 1<<20, "request ids remembered for abort routing (oldest dropped beyond)")
	engineEndpoints := fs.Bool("engine-endpoints", true, "serve /abort_request, /abort_requests, /abort_until_idle, /flush_cache, /get_loads and /finish_session on the data port (false: proxy them)")
	return func() {
		if keys.set {
			o.KeyHeaders = keys.list
		}
		o.NoEngineEndpoints = !*engineEndpoints
	}
}

// The routing flags a SIGHUP applies (daemon registers the reload).
func init() {
	for _, f := range daemon.RoutingReloadable {
		reloadable[f] = true
	}
}
