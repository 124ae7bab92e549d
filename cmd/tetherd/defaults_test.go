package main

import (
	"reflect"
	"strings"
	"testing"

	"github.com/tether-rl/tether/userspace/daemon"
	"github.com/tether-rl/tether/userspace/engine"
	"github.com/tether-rl/tether/userspace/fleet"
	"github.com/tether-rl/tether/userspace/health"
	"github.com/tether-rl/tether/userspace/loadpoll"
	"github.com/tether-rl/tether/userspace/proxy"
	"github.com/tether-rl/tether/userspace/registry"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/supervisor"
)

// componentFlags: every flag whose value lands in a component's settings,
// the field it writes (a path in daemon.Options) and a value other than
// its default.
var componentFlags = []struct{ flag, field, other string }{
	{"response-timeout", "Proxy.ResponseTimeout", "77s"},
	{"stream-idle-timeout", "Proxy.StreamIdleTimeout", "77s"},
	{"idle-timeout", "Proxy.IdleTimeout", "77s"},
	{"head-timeout", "Proxy.HeadTimeout", "77s"},
	{"io-timeout", "Proxy.IOTimeout", "77s"},
	{"park-after", "Proxy.ParkAfter", "1s"},
	{"io-uring", "Proxy.NoRing", "false"},
	{"splice-min", "Proxy.SpliceMin", "4096"},
	{"max-body-bytes", "Proxy.MaxBodyBytes", "1000"},
	{"max-conns", "Proxy.MaxConns", "100"},
	{"max-queue", "Proxy.QueueSize", "-1"},
	{"queue-timeout", "Proxy.QueueTimeout", "77s"},
	{"local-body-budget", "Proxy.LocalBodyBudget", "1000"},
	{"max-request-line", "Proxy.Limits.RequestLine", "100"},
	{"max-head-bytes", "Proxy.Limits.Head", "1000"},
	{"max-header-fields", "Proxy.Limits.Fields", "10"},
	{"max-chunk-ext-bytes", "Proxy.Limits.ChunkExt", "10"},
	{"pause-timeout", "Fleet.HoldTimeout", "77s"},
	{"update-timeout", "Engine.UpdateTimeout", "77s"},
	{"health-interval", "Health.Interval", "77s"},
	{"health-timeout", "Health.Timeout", "77s"},
	{"health-path", "Health.Path", "/health_generate"},
	{"health-failures", "Registry.Failures", "7"},
	{"health-successes", "Registry.Successes", "7"},
	{"worker-startup-timeout", "Registry.StartupTimeout", "77s"},
	{"remove-grace", "Registry.RemoveGrace", "77s"},
	{"max-in-flight", "Registry.MaxInFlight", "8"},
	{"spawn-grace", "Spawn.Grace", "77s"},
	{"engine-poll", "Routing.EnginePoll", "3s"},
	{"key-header", "Routing.Keys.KeyHeaders", "X-A"},
	{"hash-load-factor", "Routing.Keys.LoadFactor", "2"},
	{"hash-spill-min", "Routing.Keys.SpillMin", "5"},
	{"hash-spill-ttl", "Routing.Keys.SpillTTL", "77s"},
	{"sticky-ttl", "Routing.Keys.StickyTTL", "77s"},
	{"learn-session-path", "Routing.Learn.CreatePath", "/s2"},
	{"learn-session-field", "Routing.Learn.IDField", "id"},
	{"learn-session-ttl", "Routing.Learn.TTL", "77s"},
	{"kv-veto", "Routing.Engine.KVVeto", "0.5"},
	{"waiting-veto", "Routing.Engine.WaitingVeto", "5"},
	{"group-max", "Routing.Engine.GroupMax", "5"},
}

// notFlags: component settings no flag writes (the wiring, tests' knobs;
// Spawn.Command is the command line after "--").
var notFlags = map[string]bool{
	"Proxy.Router": true, "Proxy.Table": true, "Proxy.PeekBody": true, "Proxy.RouteHeader": true,
	"Proxy.InstanceID": true, "Proxy.Local": true, "Proxy.Observe": true, "Proxy.Hold": true, "Proxy.Log": true,
	"Proxy.Waits": true, "Spawn.N": true, "Spawn.Command": true,
	"Routing.Learn.MaxScan": true, "Routing.Engine.MoveMargin": true, "Routing.Engine.MoveSlack": true,
}

// provisioned is what the components make of zero settings: each
// component's own defaults (its DefaultConfig or Provision), and
// tetherd's choices where a component's zero means something else
// (MaxBodyBytes 0 is no limit for the library).
func provisioned() daemon.Options {
	p := proxy.Defaults()
	p.MaxBodyBytes = daemon.DefaultMaxBodyBytes
	return daemon.Options{
		Proxy:    p,
		Fleet:    fleet.DefaultSettings(),
		Engine:   engine.DefaultSettings(),
		Health:   health.DefaultConfig(),
		Registry: registry.DefaultConfig(),
		Spawn:    supervisor.DefaultConfig(),
		Routing: daemon.RoutingOptions{
			EnginePoll: loadpoll.DefaultConfig().Interval,
			Keys:       route.DefaultPolicySettings(),
			Learn:      route.DefaultLearnSettings(),
			Engine:     route.DefaultEngineConfig(),
		},
	}
}

func field(o *daemon.Options, path string) reflect.Value {
	v := reflect.ValueOf(o).Elem()
	for _, name := range strings.Split(path, ".") {
		v = v.FieldByName(name)
		if !v.IsValid() {
			return v
		}
	}
	return v
}

// TestFlagDefaultsAreTheComponents': a default is written once. For every
// flag that writes a component's setting, tetherd without that flag holds
// the component's provisioned default, and the flag does write that field;
// every setting of the components' configs (proxy, health, registry,
// supervisor, fleet, engine, route's policy, learning and engine-aware
// placement) has its flag in the table (or is wiring), so a new setting
// cannot bring a second default.
func TestFlagDefaultsAreTheComponents(t *testing.T) {
	base := []string{"--listen", "127.0.0.1:0", "--demo", "1"}
	c, err := parse(base)
	if err != nil {
		t.Fatal(err)
	}
	want := provisioned()
	covered := map[string]bool{}
	for _, f := range componentFlags {
		covered[f.field] = true
		if c.fs.Lookup(f.flag) == nil {
			t.Errorf("--%s: no such flag", f.flag)
			continue
		}
		got, def := field(&c.opts, f.field), field(&want, f.field)
		if !got.IsValid() {
			t.Errorf("--%s: no field %s", f.flag, f.field)
			continue
		}
		if !reflect.DeepEqual(got.Interface(), def.Interface()) {
			t.Errorf("--%s defaults to %v, the component's %s to %v", f.flag, got, f.field, def)
		}
		set, err := parse(append(base, "--"+f.flag+"="+f.other))
		if err != nil {
			t.Errorf("--%s=%s: %v", f.flag, f.other, err)
			continue
		}
		if reflect.DeepEqual(field(&set.opts, f.field).Interface(), def.Interface()) {
			t.Errorf("--%s=%s does not reach %s", f.flag, f.other, f.field)
		}
	}
	// Spawn.N: --spawn's default is none, and supervisor's is no process.
	if c.opts.Spawn.N != want.Spawn.N {
		t.Errorf("--spawn defaults to %d", c.opts.Spawn.N)
	}
	for _, comp := range []string{"Proxy", "Fleet", "Engine", "Health", "Registry", "Spawn", "Routing.Keys", "Routing.Learn", "Routing.Engine"} {
		walk(field(&want, comp).Type(), comp, func(path string) {
			if !covered[path] && !notFlags[path] {
				t.Errorf("%s: a component setting with no flag in componentFlags (nor in notFlags)", path)
			}
		})
	}
}

// walk calls leaf with the path of every field of t, descending into the
// structs it holds by value (Proxy.Limits) unless the struct itself is
// named in notFlags.
func walk(t reflect.Type, prefix string, leaf func(string)) {
	for i := range t.NumField() {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		path := prefix + "." + f.Name
		if f.Anonymous {
			path = prefix // an embedded struct's fields are the outer one's
		}
		if f.Type.Kind() == reflect.Struct && !notFlags[path] {
			walk(f.Type, path, leaf)
			continue
		}
		leaf(path)
	}
}
