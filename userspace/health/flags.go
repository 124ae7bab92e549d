package health

import (
	"flag"
	"fmt"
	"strings"

	"github.com/tether-rl/tether/userspace/config"
)

// settings declares Config's settings: tetherd's flags, their defaults
// and ranges (RegisterFlags, Validate).
func (c *Config) settings() []config.Setting {
	return []config.Setting{
		config.Num(&c.Interval, "health-interval", DefaultInterval, config.Positive, "active health checks (GET /health) of every worker this often").Type("duration"),
		config.Num(&c.Timeout, "health-timeout", DefaultTimeout, config.Positive, "a health check without a 2xx answer in this time failed").Type("duration"),
		config.Str(&c.Path, "health-path", Path, "the endpoint the health checks GET on every worker (e.g. /health_generate)", parsePath),
	}
}

func parsePath(p string) (string, error) {
	if !strings.HasPrefix(p, "/") {
		return "", fmt.Errorf("--health-path %q: want an absolute path such as /health", p)
	}
	return p, nil
}

// RegisterFlags registers tetherd's health-check flags on fs, writing c
// (each setting starting at its default).
func (c *Config) RegisterFlags(fs *flag.FlagSet) { config.Register(fs, c.settings()) }
