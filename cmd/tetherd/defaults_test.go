package main

import (
	"flag"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/userspace/config"
	"github.com/tether-rl/tether/userspace/daemon"
	"github.com/tether-rl/tether/userspace/engine"
	"github.com/tether-rl/tether/userspace/fleet"
	"github.com/tether-rl/tether/userspace/health"
	"github.com/tether-rl/tether/userspace/proxy"
	"github.com/tether-rl/tether/userspace/registry"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/supervisor"
)

// components are the settings structs whose every field is a flag's
// (or wiring, notFlags), by path in daemon.Options.
var components = []string{"Proxy", "Fleet", "Engine", "Health", "Registry", "Spawn", "Routing.Keys", "Routing.Learn", "Routing.Engine"}

// notFlags: component settings no flag writes (the wiring, tests' knobs;
// Spawn.Command is the command line after "--").
var notFlags = map[string]bool{
	"Proxy.Router": true, "Proxy.Table": true, "Proxy.PeekBody": true, "Proxy.RouteHeader": true,
	"Proxy.InstanceID": true, "Proxy.Local": true, "Proxy.Observe": true, "Proxy.Hold": true, "Proxy.Log": true,
	"Proxy.Waits": true, "Proxy.PD": true, "Spawn.Command": true,
	"Routing.Learn.MaxScan": true, "Routing.Engine.MoveMargin": true, "Routing.Engine.MoveSlack": true,
}

// otherStrings are values other than the default for string flags.
var otherStrings = map[string]string{"health-path": "/h", "learn-session-path": "/s2", "learn-session-field": "id", "key-header": "X-A"}

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
			Keys:   route.DefaultPolicySettings(),
			Learn:  route.DefaultLearnSettings(),
			Engine: route.DefaultEngineConfig(),
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

// other returns a value of f other than its default, or false.
func other(f *flag.Flag) (string, bool) {
	if s, ok := otherStrings[f.Name]; ok {
		return s, true
	}
	def := f.DefValue
	if b, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && b.IsBoolFlag() {
		return strconv.FormatBool(def != "true"), true
	}
	if n, err := strconv.ParseInt(def, 10, 64); err == nil {
		return strconv.FormatInt(n+7, 10), true
	}
	if d, err := time.ParseDuration(def); err == nil {
		return (d + 7*time.Second).String(), true
	}
	if x, err := strconv.ParseFloat(def, 64); err == nil {
		return strconv.FormatFloat(x/2, 'g', -1, 64), true
	}
	return "", false
}

// TestFlagDefaultsAreTheComponents': a default is written once. Each flag
// is set to another value, and the component setting it writes is found
// (not listed): the one field that changed. Without the flag, that field
// holds the component's provisioned default. Every setting of the
// components' configs (proxy, health, registry, supervisor, fleet,
// engine, route's policy, learning and engine-aware placement) is written
// by a flag (or is wiring), so a new setting cannot bring a second
// default.
func TestFlagDefaultsAreTheComponents(t *testing.T) {
	base := []string{"--listen", "127.0.0.1:0", "--demo", "1"}
	c, err := parse(base)
	if err != nil {
		t.Fatal(err)
	}
	want := provisioned()
	var leaves []string
	for _, comp := range components {
		walk(field(&want, comp).Type(), comp, func(path string) { leaves = append(leaves, path) })
	}
	writes := map[string]string{} // field path: the flag writing it
	c.fs.VisitAll(func(f *flag.Flag) {
		v, ok := other(f)
		if !ok {
			return
		}
		args := append(base[:len(base):len(base)], "--"+f.Name+"="+v)
		if f.Name == "spawn" {
			args = append(args, "--", "true")
		}
		set, err := parse(args)
		if err != nil {
			t.Errorf("--%s=%s: %v", f.Name, v, err)
			return
		}
		var changed []string
		for _, path := range leaves {
			if !reflect.DeepEqual(field(&set.opts, path).Interface(), field(&c.opts, path).Interface()) {
				changed = append(changed, path)
			}
		}
		if len(changed) > 1 && f.Name != "spawn" {
			t.Errorf("--%s writes %d settings: %v", f.Name, len(changed), changed)
		}
		for _, path := range changed {
			writes[path] = f.Name
		}
	})
	for _, path := range leaves {
		if notFlags[path] {
			continue
		}
		name, ok := writes[path]
		if !ok {
			t.Errorf("%s: a component setting no flag writes (nor in notFlags)", path)
			continue
		}
		if got, def := field(&c.opts, path), field(&want, path); !reflect.DeepEqual(got.Interface(), def.Interface()) {
			t.Errorf("--%s defaults to %v, the component's %s to %v", name, got, path, def)
		}
	}
	if len(writes) < 40 {
		t.Errorf("only %d settings written by flags: %v", len(writes), writes)
	}
}

// walk calls leaf with the path of every field of t, descending into the
// structs it holds by value (Proxy.Limits) unless the struct itself is
// named in notFlags or is a setting (config.Optional).
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
		optional := f.Type.PkgPath() == reflect.TypeFor[config.Optional[int]]().PkgPath() && strings.HasPrefix(f.Type.Name(), "Optional[")
		if f.Type.Kind() == reflect.Struct && !notFlags[path] && !optional {
			walk(f.Type, path, leaf)
			continue
		}
		leaf(path)
	}
}
