// Package daemon wires tetherd together: listeners, counters, the worker
// table, the router and the data plane. cmd/tetherd turns flags into
// Options (and starts the demo workers of --demo, handing their URLs in as
// StartedWorkers); tests run the same code in-process.
//
// Each component owns its settings: a struct of its own (proxy.Config's
// settings, health.Config, registry.Config, supervisor.Config,
// fleet.Settings, engine.Settings, route's PolicySettings, LearnSettings
// and EngineConfig) whose flags.go declares each setting once (the flag
// name, help, default and range: userspace/config) for RegisterFlags,
// which registers tetherd's flags writing straight into the struct, and
// for Validate, which holds a setting made in code to the same range and
// names the flag. The daemon's own settings (Options, RoutingOptions) do
// the same (flags.go). Options embeds the components' structs, and New
// hands each to its component whole, with the wiring added; the load
// poller's loadpoll.Config is made of --engine-poll and --health-timeout.
package daemon

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tether-rl/tether/bpf"
	"github.com/tether-rl/tether/userspace/admin"
	"github.com/tether-rl/tether/userspace/config"
	"github.com/tether-rl/tether/userspace/engine"
	"github.com/tether-rl/tether/userspace/fleet"
	"github.com/tether-rl/tether/userspace/health"
	"github.com/tether-rl/tether/userspace/listener"
	"github.com/tether-rl/tether/userspace/metrics"
	"github.com/tether-rl/tether/userspace/proxy"
	"github.com/tether-rl/tether/userspace/registry"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/supervisor"
	"github.com/tether-rl/tether/userspace/upgrade"
	"github.com/tether-rl/tether/userspace/upstream"
	"github.com/tether-rl/tether/userspace/worker"
)

// Options are tetherd's settings.
type Options struct {
	Listen    string   // data-plane address, e.g. 127.0.0.1:8080
	Listeners int      // sockets in the SO_REUSEPORT group, an event loop each; 0: 1 (tetherd's --listeners: one per CPU)
	BPF       bpf.Mode // steering: auto (default, also ""), required or off
	PinDir    string   // bpffs directory of the maps; default bpf.DefaultPinDir
	Workers   []string // backend URLs, slot = index
	// Prefill and Decode are the workers of a P/D fleet (--prefill URL,
	// with ?bootstrap_port=N, and --decode URL), in the slots after
	// Workers' and StartedWorkers' (pd.go).
	Prefill, Decode []string
	// PDProtocol: auto, sglang or vllm (--pd-protocol).
	PDProtocol PDProtocol
	// PDLetMissingKVParams: a vLLM prefill's answer without
	// kv_transfer_params goes on to the decode (which recomputes the
	// prompt) instead of a 502 (--pd-allow-recompute).
	PDLetMissingKVParams bool
	// StartedWorkers are workers the caller started for this tetherd
	// (cmd/tetherd's --demo): in the slots after Workers', origin "demo":
	// removable, left alone by a reload, not handed over by an upgrade.
	StartedWorkers []string
	BadSession     route.BadSession // a session id naming no worker: spread (default) or reject
	// InstanceID names this tetherd in /health (instance_id and miles'
	// session_server_instance_id); default a random id per process.
	InstanceID string
	// Inherited is what the tetherd this one replaces handed over
	// (upgrade.Inherit): its listening sockets, admin socket, pin lock and
	// run-time workers. nil: bind afresh.
	Inherited *upgrade.Inherited
	// Proxy is the data plane's configuration: its flags (RegisterFlags:
	// timeouts, limits, the queue, --max-conns, --io-uring) write its
	// settings straight into it; a zero setting takes DataPlaneDefaults' value
	// (dataplane.go). New fills in the wiring (Router, Table, Local, PD,
	// Observe, Hold, PeekBody, RouteHeader, InstanceID, Log): whatever is
	// there is replaced.
	Proxy proxy.Config
	// Fleet: the weight sync's hold; HoldTimeout bounds a request's time
	// in it (--pause-timeout; default fleet.DefaultHoldTimeout), past it
	// 503 with Retry-After. The hold takes Proxy.QueueSize requests per
	// worker.
	Fleet fleet.Settings
	// Engine: the engine endpoints; UpdateTimeout bounds each worker's
	// weight-update call of a fanned-out update (--update-timeout; default
	// engine.DefaultUpdateTimeout).
	Engine engine.Settings
	Pool   upstream.Options
	Log    *slog.Logger
	// Routing: the policy for requests that name no session, and the
	// engine endpoints (routing.go).
	Routing RoutingOptions

	// Cluster: etcd://HOST:PORT[,...]: the worker table lives in etcd,
	// shared with every tetherd of the same ClusterName (cluster.go).
	Cluster     string
	ClusterName string
	// ClusterShareSessions: new sticky assignments (learned session ids,
	// sticky keys, remembered spills) are also written to etcd and copied
	// by every replica (cluster.SharedSessions).
	ClusterShareSessions bool

	// Control plane (control.go). Each component's settings are its own
	// config, which its flags (RegisterFlags) write into and whose zero fields
	// take the component's defaults (its Provision); New passes them on
	// whole, with the wiring.
	Admin           string // admin API address; "" turns it off (cmd/tetherd: DefaultAdmin)
	AdminOnDataPort bool   // also serve the admin API on the data port
	AdminToken      string // Bearer token the admin API requires, wherever served
	// Health: the active checks (--health-interval, --health-timeout,
	// --health-path); also the load poll's timeout (routing.go).
	Health health.Config
	// Registry: the hysteresis (--health-failures, --health-successes),
	// --worker-startup-timeout (the supervisor's too), --remove-grace and
	// --max-in-flight.
	Registry registry.Config
	// WorkerAPIKey is sent as "Authorization: Bearer KEY" on health checks
	// and on the engine fan-outs of clients that sent no Authorization
	// (engines started with --api-key).
	WorkerAPIKey string
	// Spawn: start Spawn.N worker processes in slots 0..N-1 (--spawn N --
	// CMD, --spawn-grace).
	Spawn       supervisor.Config
	SpawnOutput io.Writer // their stdout and stderr; default tetherd's stderr
}

// Daemon is a running tetherd.
type Daemon struct {
	opts       Options
	log        *slog.Logger
	InstanceID string
	Table      *worker.Table
	Fleet      *fleet.Fleet // weight-sync phase, hold and versions
	Router     *route.Router
	Proxy      *proxy.Server
	Stats      *stats.Table
	routing    *routing
	kv         *kvWiring // KV-event placement (kvevents.go); nil: off
	pd         *pdPlane
	Group      *listener.Group
	lns        []net.Listener
	wg         sync.WaitGroup
	retired    atomic.Bool // handed over to a new process (Retire)

	// Control plane (control.go).
	Registry   *registry.Registry
	Health     *health.Checker
	Metrics    *metrics.Metrics
	Admin      *admin.Server
	Supervisor *supervisor.Supervisor // nil without --spawn
	ctl        control
}

// ParseWorkerURL checks a worker URL and returns its dial address.
func ParseWorkerURL(raw string) (string, error) {
	_, addr, err := registry.ParseURL(raw)
	return addr, err
}

// checkRanges refuses out-of-range settings (zero means the default),
// naming the flag: the daemon's own (flags.go) and each component's
// Validate.
func (o *Options) checkRanges() error {
	if o.Listeners < 0 {
		return errors.New("--listeners: negative")
	}
	if err := config.Validate(append(o.settings(), o.Routing.settings()...)); err != nil {
		return err
	}
	for _, v := range []interface{ Validate() error }{&o.Proxy, o.Health, o.Registry, o.Spawn, o.Fleet, o.Engine,
		o.Routing.Keys, o.Routing.Learn, o.Routing.Engine, o.Routing.KVEvents} {
		if err := v.Validate(); err != nil {
			return err
		}
	}
	return nil
}

// New validates opts and opens the listeners. Serve starts the data plane.
func New(opts Options) (*Daemon, error) {
	if opts.Log == nil {
		opts.Log = slog.Default()
	}
	if err := checkCluster(&opts); err != nil {
		return nil, err
	}
	if err := opts.checkRanges(); err != nil {
		return nil, err
	}
	provisionDataPlane(&opts.Proxy)
	if opts.Listeners == 0 {
		opts.Listeners = 1
	}
	if opts.Listeners > stats.MaxSlots {
		return nil, fmt.Errorf("--listeners %d: at most %d", opts.Listeners, stats.MaxSlots)
	}
	bad := opts.BadSession
	if len(opts.Workers) == 0 && len(opts.StartedWorkers) == 0 && len(opts.Prefill)+len(opts.Decode) == 0 && opts.Spawn.N == 0 && opts.Admin == "" && !opts.AdminOnDataPort {
		return nil, errors.New("no workers: give --worker URL (repeatable), --demo N or --spawn N, or an admin API (--admin) to add them later")
	}
	if len(opts.Workers)+len(opts.StartedWorkers)+len(opts.Prefill)+len(opts.Decode)+opts.Spawn.N > stats.MaxWorkers {
		return nil, fmt.Errorf("too many workers: at most %d", stats.MaxWorkers)
	}
	for _, w := range append(opts.Workers[:len(opts.Workers):len(opts.Workers)], opts.StartedWorkers...) {
		if _, err := ParseWorkerURL(w); err != nil {
			return nil, err
		}
	}

	handed, err := handedOver(opts.Inherited)
	if err != nil {
		return nil, err
	}
	id := opts.InstanceID
	if id == "" && handed != nil {
		id = handed.InstanceID
	}
	if id == "" {
		var idb [8]byte
		rand.Read(idb[:])
		id = hex.EncodeToString(idb[:])
	}
	d := &Daemon{opts: opts, log: opts.Log, InstanceID: id, Table: worker.NewTable()}
	d.ctl.ui = newUIParts()
	perWorker := opts.Proxy.QueueSize
	if perWorker <= 0 { // no queue (-1): the hold keeps its own bound
		perWorker = DefaultMaxQueue
	}
	d.Fleet = fleet.New(fleet.Config{Table: d.Table, MaxHeldPerWorker: perWorker, Settings: opts.Fleet})
	ok := false
	defer func() {
		if !ok {
			d.Close()
		}
	}()
	g, err := openListeners(opts)
	if err != nil {
		return nil, err
	}
	d.Group, d.lns, d.Stats = g, g.Listeners(), g.Stats()
	d.pd = newPDPlane(d, opts)

	if err := d.newRegistry(opts); err != nil {
		return nil, err
	}
	d.restoreWorkers(handed)
	if handed != nil && handed.Fleet != nil {
		d.Fleet.Import(*handed.Fleet)
		if p, _ := d.Fleet.LocalPhase(); p != fleet.Serving {
			d.log.Warn("upgrade: the fleet is "+p.String()+" (weight sync): generation requests are held until it resumes", "target_version", d.Fleet.Target())
		}
	}
	d.Router = &route.Router{Table: d.Table}
	d.Router.SetBadSession(bad)
	d.pd.chooser.router = d.Router // P/D placements counted with the router's
	if d.routing, err = setupRouting(opts, d.Group, d.Router, d.shareSessions(opts), d.Fleet, d.fleetSync()); err != nil {
		return nil, err
	}
	d.OnReload(d.routing.reload)
	if kv := opts.Routing.KVEvents; kv.enabled() {
		if d.kv, err = startKVEvents(kv, d.Router, d.Table); err != nil {
			return nil, err
		}
	}
	pc := opts.Proxy // the settings; the wiring:
	pc.Router = d.routing.router
	pc.PeekBody = d.routing.peek
	pc.RouteHeader = d.routing.opts.RouteHeader
	pc.Local = d.localHook(opts)
	pc.Observe = d.observe
	pc.Hold = d.Fleet
	pc.PD = d.pd
	pc.Table = d.Table
	pc.InstanceID = d.InstanceID
	pc.Log = opts.Log
	d.Proxy = proxy.New(pc)
	if err := d.newControl(opts); err != nil {
		return nil, err
	}
	if d.ctl.replica != nil {
		// Only now: its changes reach the metrics and hooks made above.
		d.ctl.replica.Start()
	}
	ok = true
	return d, nil
}

// Addr is the data-plane address actually bound.
func (d *Daemon) Addr() string { return d.lns[0].Addr().String() }

// Serve runs the data plane until Shutdown.
func (d *Daemon) Serve() {
	procs := proxy.ProcsForLoops(len(d.lns))
	for i, ln := range d.lns {
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			if err := d.Proxy.Serve(ln, d.Stats.Slot(i)); err != nil {
				d.log.Error("listener stopped", "slot", i, "err", err)
			}
		}()
	}
	d.log.Info("tetherd serving", "listen", d.Addr(), "listeners", len(d.lns), "gomaxprocs", procs, "workers", len(d.Table.Snapshot()), "instance_id", d.InstanceID)
	d.startControl(d.opts)
}

// Shutdown stops accepting, finishes requests in progress (bounded by ctx)
// and releases everything.
func (d *Daemon) Shutdown(ctx context.Context) error { return d.ShutdownGently(ctx, 0) }

// ShutdownGently is Shutdown for a tetherd whose sockets live on in
// another process (an upgrade's successor, or systemd's fd store until the
// next start): every response says Connection: close, and keep-alive
// connections are closed only once idle for idleGrace
// (proxy.Server.ShutdownGently), so that clients move over instead of
// losing a request written as the connection closed.
func (d *Daemon) ShutdownGently(ctx context.Context, idleGrace time.Duration) error {
	var err error
	if d.Proxy != nil {
		err = d.Proxy.ShutdownGently(ctx, idleGrace)
	}
	d.stopControl(ctx)
	d.wg.Wait()
	d.Close()
	return err
}

// Close releases everything at once.
func (d *Daemon) Close() {
	if d.Proxy != nil {
		d.Proxy.Close()
	}
	if d.Group != nil {
		if d.retired.Load() {
			d.Group.Detach() // the sockets and pins are the new process's
		} else {
			d.Group.Close()
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // at once: SIGTERM then SIGKILL to the --spawn processes
	d.stopControl(ctx)
	for _, w := range d.Table.Snapshot() {
		if w != nil {
			w.Pool.Close()
		}
	}
	d.routing.close()
	if d.kv != nil {
		d.kv.close()
	}
	if d.pd != nil {
		d.pd.close()
	}
}
