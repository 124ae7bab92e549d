package route

import (
	"flag"
	"fmt"
	"strings"

	"github.com/tether-rl/tether/userspace/config"
)

// The settings of route's policy, learning and engine-aware placement:
// tetherd's flags with their defaults (RegisterFlags); the constructors
// (NewPolicy, NewLearning, NewEnginePlacement) check them, naming these
// flags.

func (s *PolicySettings) settings() []config.Setting {
	return []config.Setting{
		config.List(&s.KeyHeaders, "key-header", DefaultKeyHeaders, true, "routing key header, first non-empty value wins (repeatable or comma list; case-insensitive; default "+strings.Join(DefaultKeyHeaders, ",")+")"),
		config.Num(&s.LoadFactor, "hash-load-factor", DefaultLoadFactor, config.Positive, "--policy=hash: relative overload bound c: a key spills from its owner only above c × the mean in flight (and above --hash-spill-min) (> 0)"),
		config.Opt(&s.SpillMin, "hash-spill-min", DefaultSpillMin, config.NonNegative, "--policy=hash: absolute overload bound: a key spills from its owner only more than this many requests in flight above the mean (and above --hash-load-factor); 0: the relative bound alone"),
		config.Num(&s.SpillTTL, "hash-spill-ttl", DefaultSpillTTL, config.Positive, "--policy=hash: a spilled key keeps going to the worker it spilled to while its owner stays overloaded, remembered this long after its last request (> 0)"),
		config.Num(&s.StickyTTL, "sticky-ttl", DefaultStickyTTL, config.Positive, "--policy=sticky: a key's assignment expires this long after its last use (or on POST /finish_session) (> 0)"),
	}
}

// RegisterFlags registers the policy's flags on fs, writing s (each
// setting starting at its default).
func (s *PolicySettings) RegisterFlags(fs *flag.FlagSet) { config.Register(fs, s.settings()) }

func (s *LearnSettings) settings() []config.Setting {
	return []config.Setting{
		config.Str(&s.CreatePath, "learn-session-path", DefaultCreatePath, "the path whose POST creates a session (--learn-sessions)", nil),
		config.Str(&s.IDField, "learn-session-field", DefaultIDField, "top-level field of the create answer holding the new session id (--learn-sessions)", nil),
		config.Num(&s.TTL, "learn-session-ttl", DefaultLearnTTL, config.Positive, "a learned session id is forgotten this long after its last request (or on DELETE /sessions/{id}) (> 0)"),
	}
}

// RegisterFlags registers the learning's flags on fs, writing s (each
// setting starting at its default).
func (s *LearnSettings) RegisterFlags(fs *flag.FlagSet) { config.Register(fs, s.settings()) }

func (c *EngineConfig) settings() []config.Setting {
	return []config.Setting{
		config.Num(&c.KVVeto, "kv-veto", DefaultKVVeto, config.Positive, "an engine at this KV cache usage (0..1) or above takes no new keys, sessions or keyless work until it is 0.1 below (>= 1: never) (> 0)"),
		config.Opt(&c.WaitingVeto, "waiting-veto", DefaultWaitingVeto, config.NonNegative, "an engine with more than this many requests waiting takes no new keys, sessions or keyless work until at most half wait; 0: no bound"),
		config.Opt(&c.GroupMax, "group-max", DefaultGroupMax, config.NonNegative, "keyless requests with the same prompt (a GRPO group's samples) go to one engine, up to this many in flight there, then to the next best; 0: no grouping"),
	}
}

// RegisterFlags registers engine-aware placement's flags on fs, writing c
// (each setting starting at its default).
func (c *EngineConfig) RegisterFlags(fs *flag.FlagSet) { config.Register(fs, c.settings()) }

// Validate refuses settings out of their flags' ranges (zero, unset, is
// the default), naming the flag.
func (s PolicySettings) Validate() error { return config.Validate(s.settings()) }

// Validate refuses settings out of their flags' ranges, naming the flag.
func (s LearnSettings) Validate() error { return config.Validate(s.settings()) }

// Validate refuses settings out of their flags' ranges, naming the flag.
func (c EngineConfig) Validate() error { return config.Validate(c.settings()) }

// String is the --bad-session value of b.
func (b BadSession) String() string {
	if b == BadSessionReject {
		return "reject"
	}
	return "spread"
}

// ParseBadSession parses a --bad-session value.
func ParseBadSession(s string) (BadSession, error) {
	switch s {
	case "spread":
		return BadSessionSpread, nil
	case "reject":
		return BadSessionReject, nil
	}
	return 0, fmt.Errorf("--bad-session %q: want spread or reject", s)
}
