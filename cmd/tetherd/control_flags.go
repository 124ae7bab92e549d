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
	fs.DurationVar(&o.HealthInterval, "health-interval", health.DefaultInterval, "active health checks (GET /health) of every worker this often")
	fs.DurationVar(&o.HealthTimeout, "health-timeout", health.DefaultTimeout, "a health check without a 2xx answer in this time failed")
	fs.IntVar(&o.HealthFailures, "health-failures", health.DefaultFailures, "consecutive failed checks (or data-path connect failures) that make a worker unhealthy")
	fs.IntVar(&o.HealthSuccesses, "health-successes", health.DefaultSuccesses, "consecutive good checks that make an unhealthy worker healthy again")
	fs.StringVar(&o.InstanceID, "instance-id", "", "the id /health reports as instance_id and session_server_instance_id (miles' launcher passes one; default: random per process)")
	fs.StringVar(&o.HealthPath, "health-path", health.Path, "the endpoint the health checks GET on every worker (e.g. /health_generate)")
	fs.StringVar(&o.WorkerAPIKey, "worker-api-key", "", "the workers' API key (engines started with --api-key): sent as a Bearer token on health checks and on the fan-outs of clients that send no Authorization (default: $TETHER_WORKER_API_KEY)")
	fs.DurationVar(&o.WorkerStartupTimeout, "worker-startup-timeout", registry.DefaultStartupTimeout, "wait this long for an added or spawned worker's first good /health")
	fs.DurationVar(&o.RemoveGrace, "remove-grace", registry.DefaultRemoveGrace, "a removed worker's requests in flight get this long before its connections are closed and its slot reused")
	fs.Uint64Var(&o.MaxInFlight, "max-in-flight", 0, "every worker's capacity: at or above this many requests in flight a worker takes no new keys (0: none; per worker: PATCH /workers/{id} {\"max_in_flight\":N} or max_in_flight in POST /workers)")
	fs.IntVar(&o.Spawn, "spawn", 0, "start N worker processes in slots 0..N-1: tetherd --spawn N -- CMD ARGS ({index} {count} {port} {host} {fd} replaced)")
	fs.DurationVar(&o.SpawnGrace, "spawn-grace", supervisor.DefaultGrace, "on stop, time between SIGTERM and SIGKILL to the --spawn processes")
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
		if !strings.HasPrefix(o.HealthPath, "/") {
			return fmt.Errorf("--health-path %q: want an absolute path such as /health", o.HealthPath)
		}
		for _, c := range []struct {
			name string
			bad  bool
			want string
		}{
			{"health-interval", o.HealthInterval <= 0, "a duration > 0"},
			{"health-timeout", o.HealthTimeout <= 0, "a duration > 0"},
			{"health-failures", o.HealthFailures < 1, "at least 1"},
			{"health-successes", o.HealthSuccesses < 1, "at least 1"},
			{"worker-startup-timeout", o.WorkerStartupTimeout <= 0, "a duration > 0"},
			{"remove-grace", o.RemoveGrace <= 0, "a duration > 0"}, // 0 would be the registry's default, not none
			{"spawn", o.Spawn < 0, "0 or more"},
			{"spawn-grace", o.SpawnGrace <= 0, "a duration > 0"},
		} {
			if c.bad {
				return fmt.Errorf("--%s %s: want %s", c.name, fs.Lookup(c.name).Value, c.want)
			}
		}
		switch {
		case len(args) > 0 && o.Spawn == 0:
			return fmt.Errorf("unexpected arguments: %q (a worker command goes with --spawn N -- CMD ARGS)", args)
		case len(args) == 0 && o.Spawn > 0:
			return fmt.Errorf("--spawn %d: give the worker command after --, e.g. --spawn %d -- tether-demo --listen 127.0.0.1:{port} --index {index}", o.Spawn, o.Spawn)
		}
		o.SpawnCommand = args
		return nil
	}
}
