package main

import (
	"flag"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/tether-rl/tether/userspace/daemon"
	"github.com/tether-rl/tether/userspace/engine"
	"github.com/tether-rl/tether/userspace/loadpoll"
	"github.com/tether-rl/tether/userspace/route"
)

// keyHeaders is --key-header: repeatable, each a comma-separated list,
// writing into p; the first use replaces the default list.
type keyHeaders struct {
	p   *[]string
	set bool
}

func (k *keyHeaders) String() string {
	if k.p == nil { // the zero value (flag's -h): the default, as ever
		return strings.Join(route.DefaultKeyHeaders, ",")
	}
	return strings.Join(*k.p, ",")
}

func (k *keyHeaders) Set(v string) error {
	if !k.set {
		*k.p, k.set = nil, true
	}
	for _, h := range strings.Split(v, ",") {
		if h = strings.TrimSpace(h); h != "" {
			*k.p = append(*k.p, h)
		}
	}
	return nil
}

// count is a flag holding a count (>= 0).
type count struct {
	name string
	n    int
}

func (c *count) String() string { return strconv.Itoa(c.n) }

func (c *count) Set(v string) error {
	n, err := strconv.Atoi(strings.TrimSpace(v))
	if err != nil || n < 0 {
		return fmt.Errorf("--%s %q: want a whole number >= 0", c.name, v)
	}
	c.n = n
	return nil
}

// routingFlags registers the routing policy and engine endpoint flags; the
// returned func copies them into o after Parse.
func routingFlags(fs *flag.FlagSet, o *daemon.RoutingOptions) func() {
	ks, kdef := &o.Keys, route.DefaultPolicySettings() // the policy's settings
	ls, ldef := &o.Learn, route.DefaultLearnSettings() // the learning's
	es, edef := &o.Engine, route.DefaultEngineConfig() // engine-aware placement's
	fs.StringVar(&o.Policy, "policy", "hash", "placement of requests with a routing key (no /sessions/ path): hash (consistent hashing, bounded load) or sticky (sticky least loaded)")
	ks.KeyHeaders = slices.Clone(kdef.KeyHeaders)
	fs.Var(&keyHeaders{p: &ks.KeyHeaders}, "key-header", "routing key header, first non-empty value wins (repeatable or comma list; case-insensitive; default X-Session-ID,X-SMG-Routing-Key)")
	positiveVar(fs, &ks.LoadFactor, "hash-load-factor", kdef.LoadFactor, "--policy=hash: relative overload bound c: a key spills from its owner only above c × the mean in flight (and above --hash-spill-min)")
	spillMin := &count{name: "hash-spill-min", n: kdef.SpillMin}
	fs.Var(spillMin, "hash-spill-min", "--policy=hash: absolute overload bound: a key spills from its owner only more than this many requests in flight above the mean (and above --hash-load-factor); 0: the relative bound alone")
	positiveVar(fs, &ks.SpillTTL, "hash-spill-ttl", kdef.SpillTTL, "--policy=hash: a spilled key keeps going to the worker it spilled to while its owner stays overloaded, remembered this long after its last request")
	positiveVar(fs, &ks.StickyTTL, "sticky-ttl", kdef.StickyTTL, "--policy=sticky: a key's assignment expires this long after its last use (or on POST /finish_session)")
	fs.StringVar(&o.StickyStore, "sticky-store", "auto", "sticky table (--policy=sticky keys, spills, learned session ids): auto (pinned BPF LRU map shared by every tetherd and kept across restarts, else in-process), bpf (required) or memory (forgotten on restart)")
	learn := fs.Bool("learn-sessions", true, "learn the worker of bare (not w<idx>-) session ids from the 2xx JSON answers to POST --learn-session-path, and route /sessions/{id}/... there")
	fs.StringVar(&ls.CreatePath, "learn-session-path", ldef.CreatePath, "the path whose POST creates a session (--learn-sessions)")
	fs.StringVar(&ls.IDField, "learn-session-field", ldef.IDField, "top-level field of the create answer holding the new session id (--learn-sessions)")
	positiveVar(fs, &ls.TTL, "learn-session-ttl", ldef.TTL, "a learned session id is forgotten this long after its last request (or on DELETE /sessions/{id})")
	fs.StringVar(&o.Keyless, "keyless", "least", "requests without a key: least (fewest in flight, rotating tie-break), p2c (less loaded of two random workers) or prefix (hash the first --peek-bytes of the body, bounded load)")
	positiveOrNoneVar(fs, &o.PeekBytes, "peek-bytes", route.DefaultPrefixBytes, "body bytes read before routing (request id \"rid\", --keyless=prefix, the prompt of GRPO groups), at most 16384; -1: none")
	positiveVar(fs, &o.MaxTrackedRequests, "max-tracked-requests", engine.DefaultMaxOwners, "request ids remembered for abort routing (oldest dropped beyond)")
	fs.DurationVar(&o.EnginePoll, "engine-poll", loadpoll.DefaultConfig().Interval, "read every worker's engine load (SGLang /v1/loads, vLLM or SGLang /metrics) this often and place keyless work, new keys and sessions by it; 0: off (placement by tetherd's in-flight counts alone)")
	positiveVar(fs, &es.KVVeto, "kv-veto", edef.KVVeto, "an engine at this KV cache usage (0..1) or above takes no new keys, sessions or keyless work until it is 0.1 below (>= 1: never)")
	waitingVeto := &count{name: "waiting-veto", n: edef.WaitingVeto}
	fs.Var(waitingVeto, "waiting-veto", "an engine with more than this many requests waiting takes no new keys, sessions or keyless work until at most half wait; 0: no bound")
	groupMax := &count{name: "group-max", n: edef.GroupMax}
	fs.Var(groupMax, "group-max", "keyless requests with the same prompt (a GRPO group's samples) go to one engine, up to this many in flight there, then to the next best; 0: no grouping")
	routeHeader := fs.Bool("route-header", false, "add X-Tether-Route: <slot> <reason> to every proxied response (debugging a rollout)")
	kvEventsFlags(fs, &o.KVEvents) // issue 28: kvevents_flags.go
	engineEndpoints := fs.Bool("engine-endpoints", true, "serve /abort_request, /abort_requests, /abort_until_idle, /flush_cache, /get_loads and /finish_session on the data port (false: proxy them)")
	return func() {
		ks.SpillMin = spillMin.n
		if ks.SpillMin == 0 {
			ks.SpillMin = -1 // none (0 in route.PolicySettings is the default)
		}
		o.NoLearnSessions = !*learn
		if o.EnginePoll == 0 {
			o.EnginePoll = -1 // off (0 in RoutingOptions is the default)
		}
		es.WaitingVeto = waitingVeto.n
		if es.WaitingVeto == 0 {
			es.WaitingVeto = -1 // none (0 in route.EngineConfig is the default)
		}
		es.GroupMax = groupMax.n
		if es.GroupMax == 0 {
			es.GroupMax = -1
		}
		if *routeHeader {
			o.RouteHeader = RouteHeaderName
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

// RouteHeaderName is the response header of --route-header.
const RouteHeaderName = "X-Tether-Route"
