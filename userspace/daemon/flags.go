package daemon

import (
	"flag"
	"fmt"

	"github.com/tether-rl/tether/bpf"
	"github.com/tether-rl/tether/userspace/config"
	"github.com/tether-rl/tether/userspace/engine"
	"github.com/tether-rl/tether/userspace/loadpoll"
	"github.com/tether-rl/tether/userspace/route"
)

// The daemon's own settings: tetherd's flags that write Options and
// RoutingOptions directly (RegisterFlags), declared once with their
// defaults and ranges, which Options' checks (checkRanges) reuse. The
// components' settings structs register their own flags (their
// RegisterFlags); cmd/tetherd lists them.

// RouteHeaderName is the response header of --route-header.
const RouteHeaderName = "X-Tether-Route"

// StickyStore is where the sticky table is kept (--sticky-store).
type StickyStore string

const (
	// StickyAuto: the pinned BPF LRU map when BPF works, else in-process.
	StickyAuto StickyStore = "auto"
	// StickyBPF: the pinned BPF map, or fail.
	StickyBPF StickyStore = "bpf"
	// StickyMemory: in-process (forgotten on restart).
	StickyMemory StickyStore = "memory"
)

// ParseStickyStore parses a --sticky-store value.
func ParseStickyStore(s string) (StickyStore, error) {
	switch m := StickyStore(s); m {
	case StickyAuto, StickyBPF, StickyMemory:
		return m, nil
	}
	return "", fmt.Errorf("--sticky-store %q: want auto, bpf or memory", s)
}

func parseAdmin(s string) (string, error) {
	if s == "off" {
		return "", nil
	}
	return s, nil
}

func (o *Options) settings() []config.Setting {
	return []config.Setting{
		config.Str(&o.Listen, "listen", "127.0.0.1:8080", "data-plane address", nil),
		config.List(&o.Workers, "worker", nil, false, "backend worker URL (repeatable; slot = order given)"),
		config.Str(&o.Cluster, "cluster", "", "etcd://HOST:PORT[,HOST:PORT...]: keep the worker table in etcd, shared by every tetherd of the same --cluster-name (docs/cluster.md)", nil),
		config.Str(&o.ClusterName, "cluster-name", "", "the cluster's name, the key prefix /tether/<name>/ in etcd (default \"default\" with --cluster)", nil),
		config.Bool(&o.ClusterShareSessions, "cluster-share-sessions", false, "with --cluster: also write each new sticky assignment (learned session ids, sticky keys, spills) to etcd, so every replica routes the session the same way"),
		config.Mode(&o.BadSession, "bad-session", route.BadSessionSpread, "session id naming no worker: spread or reject (404)", route.ParseBadSession),
		config.Mode(&o.BPF, "bpf", bpf.ModeAuto, "BPF listener steering: auto (fall back to the kernel hash with one warning), required, or off", bpf.ParseMode),
		config.Str(&o.PinDir, "bpf-pin-dir", "", "bpffs directory for the pinned maps (default /sys/fs/bpf/tether/v<ABI>)", nil),
		config.Str(&o.Admin, "admin", DefaultAdmin, "admin API address (worker registry, loads, /metrics); \"off\" or \"\": none", parseAdmin),
		config.Bool(&o.AdminOnDataPort, "admin-on-data-port", false, "also serve the admin API (/add_worker, /workers, /metrics, ...) on the data port; otherwise those paths are proxied like any other"),
		config.Str(&o.AdminToken, "admin-token", "", "require \"Authorization: Bearer TOKEN\" on the admin API, wherever served (default: $TETHER_ADMIN_TOKEN)", nil),
		config.Str(&o.InstanceID, "instance-id", "", "the id /health reports as instance_id and session_server_instance_id (miles' launcher passes one; default: random per process)", nil),
		config.Str(&o.WorkerAPIKey, "worker-api-key", "", "the workers' API key (engines started with --api-key): sent as a Bearer token on health checks and on the fan-outs of clients that send no Authorization (default: $TETHER_WORKER_API_KEY)", nil),
	}
}

// RegisterFlags registers the daemon's own flags on fs, writing o (each
// setting starting at its default); --listeners is tetherd's (its
// default depends on the host).
func (o *Options) RegisterFlags(fs *flag.FlagSet) { config.Register(fs, o.settings()) }

func (o *RoutingOptions) settings() []config.Setting {
	return []config.Setting{
		config.Mode(&o.Policy, "policy", route.PolicyHash, "placement of requests with a routing key (no /sessions/ path): hash (consistent hashing, bounded load) or sticky (sticky least loaded)", route.ParsePolicy),
		config.Mode(&o.StickyStore, "sticky-store", StickyAuto, "sticky table (--policy=sticky keys, spills, learned session ids): auto (pinned BPF LRU map shared by every tetherd and kept across restarts, else in-process), bpf (required) or memory (forgotten on restart)", ParseStickyStore),
		config.Switch(&o.LearnSessions, "learn-sessions", true, "learn the worker of bare (not w<idx>-) session ids from the 2xx JSON answers to POST --learn-session-path, and route /sessions/{id}/... there"),
		config.Mode(&o.Keyless, "keyless", route.KeylessLeast, "requests without a key: least (fewest in flight, rotating tie-break), p2c (less loaded of two random workers) or prefix (hash the first --peek-bytes of the body, bounded load)", route.ParseKeyless),
		config.Num(&o.PeekBytes, "peek-bytes", route.DefaultPrefixBytes, config.PositiveOrNone, "body bytes read before routing (request id \"rid\", --keyless=prefix, the prompt of GRPO groups), at most 16384; -1: none"),
		config.Num(&o.MaxTrackedRequests, "max-tracked-requests", engine.DefaultMaxOwners, config.Positive, "request ids remembered for abort routing (oldest dropped beyond) (> 0)"),
		config.Opt(&o.EnginePoll, "engine-poll", loadpoll.DefaultInterval, config.Any, "read every worker's engine load (its engine's load endpoint, else its Prometheus metrics) this often and place keyless work, new keys and sessions by it; 0: off (placement by tetherd's in-flight counts alone)").Type("duration"),
		config.Flag(&o.RouteHeader, "route-header", RouteHeaderName, "add X-Tether-Route: <slot> <reason> to every proxied response (debugging a rollout)"),
		config.Switch(&o.EngineEndpoints, "engine-endpoints", true, "serve the engines' abort, cache-flush, loads and finish_session endpoints on the data port, in each engine's words (false: proxy them)"),
	}
}

// RegisterFlags registers the routing flags of the daemon's own on fs,
// writing o (each setting starting at its default); the policy's,
// learning's and placement's settings register theirs (route).
func (o *RoutingOptions) RegisterFlags(fs *flag.FlagSet) { config.Register(fs, o.settings()) }
