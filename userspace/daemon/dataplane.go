package daemon

import (
	"github.com/tether-rl/tether/userspace/proxy"
)

// The data plane's settings are proxy.Config's own fields (Options.Proxy):
// the flags proxy.Config registers (RegisterFlags) write into them, and
// New hands the struct to
// proxy.New with the wiring (router, table, hooks) filled in. A zero
// setting takes package proxy's default (proxy.Config.Provision), the one
// the flags show.

// DataPlaneDefaults is tetherd's default for every data-plane setting of
// proxy.Config (the flags' defaults; New fills a zero field with its
// value): proxy.Defaults, whose numbers are written in package proxy. A
// zero value here has a meaning of its own: MaxBodyBytes 0 is no limit
// (tetherd's flag defaults to DefaultMaxBodyBytes), MaxConns 0 derives
// the cap from the descriptor limit (proxy.DefaultMaxConns), ParkAfter 0
// parks at once.
func DataPlaneDefaults() proxy.Config { return proxy.Defaults() }

// DefaultMaxQueue is the requests that may wait per worker at its
// max_in_flight (--max-queue, proxy.DefaultQueueSize), and the fleet's
// hold per worker during a weight sync (fleet.Config.MaxHeldPerWorker).
const DefaultMaxQueue = proxy.DefaultQueueSize

// DefaultMaxBodyBytes is --max-body-bytes' default (RL bodies are large);
// proxy.Config.MaxBodyBytes 0, the library's zero, is no limit.
const DefaultMaxBodyBytes = proxy.DefaultMaxBodyBytes

// provisionDataPlane fills c's zero settings with proxy's defaults and
// resolves MaxConns 0 from the descriptor limit (tetherd's choice; the
// library's 0 is no cap).
func provisionDataPlane(c *proxy.Config) {
	c.Provision()
	if c.MaxConns == 0 {
		c.MaxConns = proxy.DefaultMaxConns(proxy.NoFile())
	}
}
