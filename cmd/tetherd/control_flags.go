package main

import (
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/tether-rl/tether/userspace/daemon"
	"github.com/tether-rl/tether/userspace/health"
	"github.com/tether-rl/tether/userspace/registry"
	"github.com/tether-rl/tether/userspace/supervisor"
)

// controlFlags registers the control-plane flags (admin API, health checks,
// worker life, --spawn); the returned func checks them after Parse (and
// after the config file), taking the positional arguments: the --spawn
// command given after "--".
func controlFlags(fs *flag.FlagSet, o *daemon.Options) func(args []string) error {
	fs.StringVar(&o.Admin, "admin", daemon.DefaultAdmin, "admin API address (worker registry, loads, /metrics); \"off\" or \"\": none")
	fs.BoolVar(&o.AdminOnDataPort, "admin-on-data-port", false, "also serve the admin API (/add_worker, /workers, /metrics, ...) on the data port; otherwise those paths are proxied like any other")
	fs.StringVar(&o.AdminToken, "admin-token", "", "require \"Authorization: Bearer TOKEN\" on the admin API, wherever served (default: $TETHER_ADMIN_TOKEN)")
	h, hdef := &o.Health, health.DefaultConfig()      // the health checks' settings
	r, rdef := &o.Registry, registry.DefaultConfig()  // the registry's
	sp, spdef := &o.Spawn, supervisor.DefaultConfig() // the supervisor's
	fs.DurationVar(&h.Interval, "health-interval", hdef.Interval, "active health checks (GET /health) of every worker this often")
	fs.DurationVar(&h.Timeout, "health-timeout", hdef.Timeout, "a health check without a 2xx answer in this time failed")
	fs.IntVar(&r.Failures, "health-failures", rdef.Failures, "consecutive failed checks (or data-path connect failures) that make a worker unhealthy")
	fs.IntVar(&r.Successes, "health-successes", rdef.Successes, "consecutive good checks that make an unhealthy worker healthy again")
	fs.StringVar(&o.InstanceID, "instance-id", "", "the id /health reports as instance_id and session_server_instance_id (miles' launcher passes one; default: random per process)")
	fs.StringVar(&h.Path, "health-path", hdef.Path, "the endpoint the health checks GET on every worker (e.g. /health_generate)")
	fs.StringVar(&o.WorkerAPIKey, "worker-api-key", "", "the workers' API key (engines started with --api-key): sent as a Bearer token on health checks and on the fan-outs of clients that send no Authorization (default: $TETHER_WORKER_API_KEY)")
	fs.DurationVar(&r.StartupTimeout, "worker-startup-timeout", rdef.StartupTimeout, "wait this long for an added or spawned worker's first good /health")
	fs.DurationVar(&r.RemoveGrace, "remove-grace", rdef.RemoveGrace, "a removed worker's requests in flight get this long before its connections are closed and its slot reused")
	fs.Uint64Var(&r.MaxInFlight, "max-in-flight", rdef.MaxInFlight, "every worker's capacity: at or above this many requests in flight a worker takes no new keys (0: none; per worker: PATCH /workers/{id} {\"max_in_flight\":N} or max_in_flight in POST /workers)")
	fs.IntVar(&sp.N, "spawn", spdef.N, "start N worker processes in slots 0..N-1: tetherd --spawn N -- CMD ARGS ({index} {count} {port} {host} {fd} replaced)")
	fs.DurationVar(&sp.Grace, "spawn-grace", spdef.Grace, "on stop, time between SIGTERM and SIGKILL to the --spawn processes")
	return func(args []string) error {
		if o.Admin == "off" {
			o.Admin = ""
		}
		if o.AdminToken == "" {
			o.AdminToken = os.Getenv("TETHER_ADMIN_TOKEN")
		}
		if o.WorkerAPIKey == "" {
			o.WorkerAPIKey = os.Getenv("TETHER_WORKER_API_KEY")
		}
		if !strings.HasPrefix(h.Path, "/") { // "" too: the flag's zero is not a default
			return fmt.Errorf("--health-path %q: want an absolute path such as /health", h.Path)
		}
		for _, c := range []struct {
			name string
			bad  bool
			want string
		}{
			{"health-interval", h.Interval <= 0, "a duration > 0"},
			{"health-timeout", h.Timeout <= 0, "a duration > 0"},
			{"health-failures", r.Failures < 1, "at least 1"},
			{"health-successes", r.Successes < 1, "at least 1"},
			{"worker-startup-timeout", r.StartupTimeout <= 0, "a duration > 0"},
			{"remove-grace", r.RemoveGrace <= 0, "a duration > 0"}, // 0 would be the registry's default, not none
			{"spawn", sp.N < 0, "0 or more"},
			{"spawn-grace", sp.Grace <= 0, "a duration > 0"},
		} {
			if c.bad {
				return fmt.Errorf("--%s %s: want %s", c.name, fs.Lookup(c.name).Value, c.want)
			}
		}
		switch {
		case len(args) > 0 && sp.N == 0:
			return fmt.Errorf("unexpected arguments: %q (a worker command goes with --spawn N -- CMD ARGS)", args)
		case len(args) == 0 && sp.N > 0:
			return fmt.Errorf("--spawn %d: give the worker command after --, e.g. --spawn %d -- tether-demo --listen 127.0.0.1:{port} --index {index}", sp.N, sp.N)
		}
		sp.Command = args
		return nil
	}
}
