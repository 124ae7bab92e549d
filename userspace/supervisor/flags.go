package supervisor

import (
	"flag"

	"github.com/tether-rl/tether/userspace/config"
)

// settings declares Config's settings: tetherd's flags, their defaults
// and ranges (RegisterFlags, Validate). Command is the command line after
// "--", not a flag.
func (c *Config) settings() []config.Setting {
	return []config.Setting{
		config.Num(&c.N, "spawn", 0, config.NonNegative, "start N worker processes in slots 0..N-1: tetherd --spawn N -- CMD ARGS ({index} {count} {port} {host} {fd} replaced)").Type("int"),
		config.Num(&c.Grace, "spawn-grace", DefaultGrace, config.Positive, "on stop, time between SIGTERM and SIGKILL to the --spawn processes").Type("duration"),
	}
}

// RegisterFlags registers tetherd's --spawn flags on fs, writing c (each
// setting starting at its default).
func (c *Config) RegisterFlags(fs *flag.FlagSet) { config.Register(fs, c.settings()) }
