package fleet

import (
	"flag"

	"github.com/tether-rl/tether/userspace/config"
)

// settings declares Settings' settings: tetherd's flags, their defaults
// and ranges (RegisterFlags, Validate).
func (s *Settings) settings() []config.Setting {
	return []config.Setting{
		config.Num(&s.HoldTimeout, "pause-timeout", DefaultHoldTimeout, config.Positive, "longest a generation request is held while the fleet is paused for a weight sync (the hold takes --max-queue per worker); then 503 with Retry-After (> 0)"),
	}
}

// RegisterFlags registers tetherd's fleet flags on fs, writing s (each
// setting starting at its default).
func (s *Settings) RegisterFlags(fs *flag.FlagSet) { config.Register(fs, s.settings()) }
