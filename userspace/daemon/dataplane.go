package daemon

import (
	"fmt"
	"time"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/proxy"
)

// The data plane's settings are proxy.Config's own fields (Options.Proxy):
// cmd/tetherd's flags write into them, and New hands the struct to
// proxy.New with the wiring (router, table, hooks) filled in. A zero
// setting takes the default below, the one the flags show.

// DataPlaneDefaults is tetherd's default for every data-plane setting of
// proxy.Config (the flags' defaults; New fills a zero field
// with its value). A zero value here has a meaning of its own:
// MaxBodyBytes 0 is no limit (tetherd's flag defaults to
// DefaultMaxBodyBytes), MaxConns 0 derives the cap from the descriptor
// limit (proxy.DefaultMaxConns), ParkAfter 0 parks at once.
//
// TODO(proxy): these values are proxy.Config.setDefaults'; once package
// proxy exports them (Default* constants or an exported Provision), this
// function returns those and the numbers are written once.
func DataPlaneDefaults() proxy.Config {
	return proxy.Config{
		ResponseTimeout:   30 * time.Minute,
		StreamIdleTimeout: 5 * time.Minute,
		IdleTimeout:       120 * time.Second,
		HeadTimeout:       30 * time.Second,
		IOTimeout:         120 * time.Second,
		QueueSize:         DefaultMaxQueue,
		QueueTimeout:      30 * time.Second,
		LocalBodyBudget:   64 << 20,
		SpliceMin:         16 << 10,
		Limits: httphead.Limits{
			RequestLine: httphead.DefaultRequestLine,
			Head:        httphead.DefaultHead,
			Fields:      httphead.DefaultFields,
			ChunkExt:    httphead.MaxChunkExtBytes,
		},
	}
}

// DefaultMaxQueue is the requests that may wait per worker at its
// max_in_flight (--max-queue), and the fleet's hold per worker during a
// weight sync (fleet.Config.MaxHeldPerWorker).
const DefaultMaxQueue = 1024

// DefaultMaxBodyBytes is --max-body-bytes' default (RL bodies are large);
// proxy.Config.MaxBodyBytes 0, the library's zero, is no limit.
const DefaultMaxBodyBytes = 16 << 30

// provisionDataPlane fills c's zero settings with DataPlaneDefaults and
// resolves MaxConns 0 from the descriptor limit.
func provisionDataPlane(c *proxy.Config) {
	def := DataPlaneDefaults()
	for _, d := range []struct{ p, def *time.Duration }{
		{&c.ResponseTimeout, &def.ResponseTimeout},
		{&c.StreamIdleTimeout, &def.StreamIdleTimeout},
		{&c.IdleTimeout, &def.IdleTimeout},
		{&c.HeadTimeout, &def.HeadTimeout},
		{&c.IOTimeout, &def.IOTimeout},
		{&c.QueueTimeout, &def.QueueTimeout},
	} {
		if *d.p == 0 {
			*d.p = *d.def
		}
	}
	for _, n := range []struct{ p, def *int }{
		{&c.QueueSize, &def.QueueSize},
		{&c.Limits.RequestLine, &def.Limits.RequestLine},
		{&c.Limits.Head, &def.Limits.Head},
		{&c.Limits.Fields, &def.Limits.Fields},
		{&c.Limits.ChunkExt, &def.Limits.ChunkExt},
	} {
		if *n.p == 0 {
			*n.p = *n.def
		}
	}
	if c.LocalBodyBudget == 0 {
		c.LocalBodyBudget = def.LocalBodyBudget
	}
	if c.SpliceMin == 0 {
		c.SpliceMin = def.SpliceMin
	}
	if c.MaxConns == 0 {
		c.MaxConns = proxy.DefaultMaxConns(proxy.NoFile())
	}
}

// validateDataPlane refuses out-of-range data-plane settings, naming the
// flag (zero is the default, provisionDataPlane).
func validateDataPlane(c *proxy.Config) error {
	for _, b := range []struct {
		flag string
		bad  bool
		want string
	}{
		{"response-timeout", c.ResponseTimeout < 0, "a duration > 0"},
		{"stream-idle-timeout", c.StreamIdleTimeout < 0, "a duration > 0"},
		{"idle-timeout", c.IdleTimeout < 0, "a duration > 0"},
		{"head-timeout", c.HeadTimeout < 0, "a duration > 0"},
		{"io-timeout", c.IOTimeout < 0, "a duration > 0"},
		{"queue-timeout", c.QueueTimeout < 0, "a duration > 0"},
		{"splice-min", c.SpliceMin < 0, "a size > 0"},
		{"max-body-bytes", c.MaxBodyBytes < 0, "a size >= 0 (0: no limit)"},
		{"max-conns", c.MaxConns < 0, "a count >= 0 (0: from the descriptor limit)"},
		{"max-queue", c.QueueSize < -1, "a count > 0, or -1: no queue"},
		{"local-body-budget", c.LocalBodyBudget < 0, "a size > 0"},
		{"max-request-line", c.Limits.RequestLine < 0, "a size > 0"},
		{"max-head-bytes", c.Limits.Head < 0, "a size > 0"},
		{"max-header-fields", c.Limits.Fields < 0, "a count > 0"},
		{"max-chunk-ext-bytes", c.Limits.ChunkExt < 0, "a size > 0"},
	} {
		if b.bad {
			return fmt.Errorf("--%s: negative; want %s", b.flag, b.want)
		}
	}
	return nil
}
