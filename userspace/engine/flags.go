package engine

import (
	"flag"

	"github.com/tether-rl/tether/userspace/config"
)

// settings declares Settings' settings: tetherd's flags, their defaults
// and ranges (RegisterFlags, Validate).
func (s *Settings) settings() []config.Setting {
	return []config.Setting{
		config.Num(&s.UpdateTimeout, "update-timeout", DefaultUpdateTimeout, config.Positive, "longest each worker's call of a fanned-out weight update may take (> 0)"),
	}
}

// RegisterFlags registers tetherd's engine-endpoint flags on fs, writing
// s (each setting starting at its default).
func (s *Settings) RegisterFlags(fs *flag.FlagSet) { config.Register(fs, s.settings()) }
