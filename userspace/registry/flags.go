package registry

import (
	"flag"

	"github.com/tether-rl/tether/userspace/config"
)

// settings declares Config's settings: tetherd's flags, their defaults
// and ranges (RegisterFlags, Validate).
func (c *Config) settings() []config.Setting {
	return []config.Setting{
		config.Num(&c.Failures, "health-failures", DefaultFailures, config.Positive, "consecutive failed checks (or data-path connect failures) that make a worker unhealthy").Type("int"),
		config.Num(&c.Successes, "health-successes", DefaultSuccesses, config.Positive, "consecutive good checks that make an unhealthy worker healthy again").Type("int"),
		config.Num(&c.StartupTimeout, "worker-startup-timeout", DefaultStartupTimeout, config.Positive, "wait this long for an added or spawned worker's first good /health").Type("duration"),
		config.Num(&c.RemoveGrace, "remove-grace", DefaultRemoveGrace, config.Positive, "a removed worker's requests in flight get this long before its connections are closed and its slot reused").Type("duration"),
		config.Num(&c.MaxInFlight, "max-in-flight", 0, config.NonNegative, "every worker's capacity: at or above this many requests in flight a worker takes no new keys (0: none; per worker: PATCH /workers/{id} {\"max_in_flight\":N} or max_in_flight in POST /workers)").Type("uint"),
	}
}

// RegisterFlags registers tetherd's registry flags on fs, writing c (each
// setting starting at its default).
func (c *Config) RegisterFlags(fs *flag.FlagSet) { config.Register(fs, c.settings()) }
