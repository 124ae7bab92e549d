package daemon

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/tether-rl/tether/userspace/admin"
	"github.com/tether-rl/tether/userspace/cluster"
	"github.com/tether-rl/tether/userspace/health"
	"github.com/tether-rl/tether/userspace/history"
	"github.com/tether-rl/tether/userspace/metrics"
	"github.com/tether-rl/tether/userspace/registry"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/supervisor"
	"github.com/tether-rl/tether/userspace/sysd"
	"github.com/tether-rl/tether/userspace/worker"
)

// The control plane: worker registry, health checks, supervisor of --spawn
// processes, metrics and the admin API. daemon.go calls newRegistry before
// the router and the proxy exist, newControl after, startControl from
// Serve and stopControl from Shutdown and Close.

// DefaultAdmin is the admin API's default address (cmd/tetherd --admin).
const DefaultAdmin = "127.0.0.1:8081"

// originStarted is the origin of Options.StartedWorkers (tetherd --demo's):
// removable, not reloaded.
const originStarted registry.Origin = "demo"

type control struct {
	// Cluster mode (cluster.go).
	store     *cluster.Store
	replica   *cluster.Replica
	shared    *cluster.SharedSessions // --cluster-share-sessions; closed with the routing's sticky table
	fleet     *cluster.FleetSync      // the fleet's weight-sync state in etcd
	claimStop context.CancelFunc
	claims    sync.WaitGroup

	prober   registry.Prober
	trimStop chan struct{} // ends startTrim's watch
	adminLn  net.Listener
	adminSrv *http.Server
	reloadMu sync.Mutex
	reload   []func(Options) (func(), error)
	stopOnce sync.Once
	ui       *uiParts // the live page's history, syncs and baseline (ui.go)
}

// newRegistry creates the registry, reserves slots 0..Spawn-1 for the
// --spawn processes and puts the start-up workers (Workers, then
// StartedWorkers) in the slots after them.
func (d *Daemon) newRegistry(opts Options) error {
	d.ctl.prober = opts.Health.Prober(opts.WorkerAPIKey)
	d.Registry = registry.New(registry.Options{
		Config: opts.Registry,
		Table:  d.Table,
		Stats:  d.Stats,
		Pool:   opts.Pool,
		Self:   selfEndpoints(d.Addr(), opts.Admin),
		Probe:  d.ctl.prober,
		OnPut: func(w *worker.Worker) {
			if d.Metrics != nil {
				d.Metrics.SetWorker(w)
			}
			if d.ctl.ui != nil {
				d.ctl.ui.onPut(w)
			}
		},
		Log: d.log,
	})
	if opts.Spawn.N > 0 {
		sup, err := supervisor.New(supervisor.Options{
			Config:         opts.Spawn,
			StartupTimeout: opts.Registry.StartupTimeout,
			Probe:          d.ctl.prober,
			Registry:       d.Registry,
			Stdout:         opts.SpawnOutput,
			Stderr:         opts.SpawnOutput,
			Log:            d.log,
		})
		if err != nil {
			return err
		}
		d.Supervisor = sup
		for i, u := range sup.URLs() {
			if err := d.Registry.Reserve(i, u, registry.OriginSpawn); err != nil {
				return fmt.Errorf("--spawn: %w", err)
			}
		}
	}
	all := append(opts.Workers[:len(opts.Workers):len(opts.Workers)], opts.StartedWorkers...)
	if opts.Cluster != "" {
		return d.startCluster(opts, all)
	}
	for i, u := range all {
		origin := registry.OriginConfig
		if i >= len(opts.Workers) {
			origin = originStarted
		}
		if _, err := d.Registry.Put(opts.Spawn.N+i, u, origin); err != nil {
			return fmt.Errorf("worker %s: %w", u, err)
		}
	}
	return nil
}

// newControl creates the metrics, the admin API and its listener, once the
// router and the proxy exist.
func (d *Daemon) newControl(opts Options) error {
	d.Metrics = metrics.New(metrics.Sources{
		Stats:     d.Stats,
		Table:     d.Table,
		Router:    d.Router,
		Registry:  d.Registry,
		Proxy:     d.Proxy.Counters(),
		Listeners: func() int { return len(d.lns) },
		Steering:  d.steering,
		Fleet:     d.Fleet,
		Cluster: func() (bool, uint64, uint64, bool) {
			st := d.ClusterStatus()
			if st == nil {
				return false, 0, 0, false
			}
			return st.Up, st.Applied, st.Skipped, true
		},
	})
	d.registerKVMetrics() // kvevents_metrics.go

	for _, w := range d.Table.Snapshot() {
		if w != nil {
			d.Metrics.SetWorker(w)
		}
	}
	var writer admin.Writer = d.Registry
	var clusterStatus func() any
	if d.ctl.replica != nil {
		writer = d.ctl.replica
		clusterStatus = func() any { return d.ClusterStatus() }
	}
	d.Admin = admin.New(admin.Config{
		Registry:    d.Registry,
		Writer:      writer,
		Cluster:     clusterStatus,
		Metrics:     d.Metrics.Handler(),
		Health:      http.HandlerFunc(d.serveAdminHealth),
		Routing:     func() any { return d.RoutingCounts() },
		Fleet:       func() any { return d.Fleet.Report() },
		Decorate:    d.decorateWorker,
		Token:       opts.AdminToken,
		UI:          d.uiConfig(),
		Log:         d.log,
		SetKVEvents: d.SetWorkerKVEvents,
	})
	d.snapshotBaseline()
	inherited := opts.Inherited.Take(fdAdmin)
	if opts.Admin != "" && inherited != nil {
		ln, err := sysd.TCPListener(inherited)
		inherited.Close()
		if err != nil {
			return fmt.Errorf("upgrade: admin socket: %w", err)
		}
		d.ctl.adminLn = ln
	} else if opts.Admin != "" {
		ln, err := net.Listen("tcp", opts.Admin)
		if err != nil {
			return fmt.Errorf("--admin %s: %w", opts.Admin, err)
		}
		d.ctl.adminLn = ln
	} else if inherited != nil {
		inherited.Close() // the admin API is off now
	}
	if ln := d.ctl.adminLn; ln != nil {
		d.Registry.AddSelf(selfEndpoints(ln.Addr().String())...)
		if opts.AdminToken == "" && !isLoopback(ln.Addr()) {
			d.log.Warn("admin API listens beyond loopback without --admin-token: anyone who reaches it can add and remove workers", "admin", ln.Addr().String())
		}
	}
	if opts.AdminOnDataPort && opts.AdminToken == "" {
		d.log.Warn("admin API served on the data port without --admin-token", "listen", opts.Listen)
	}
	return nil
}

// adminReadTimeout bounds reading an admin request, body included.
var adminReadTimeout = 30 * time.Second

// selfEndpoints returns the ip:port endpoints of tetherd's own listen
// addresses (an unspecified host, 0.0.0.0 or ::, stands for every address
// of the host), so that none of them is taken for a worker.
func selfEndpoints(addrs ...string) []string {
	var out []string
	var local []net.IP
	for _, a := range addrs {
		host, port, err := net.SplitHostPort(a)
		if err != nil || port == "0" || port == "" {
			continue
		}
		ip := net.ParseIP(host)
		switch {
		case host == "" || ip != nil && ip.IsUnspecified():
			if local == nil {
				local = []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}
				if ifas, err := net.InterfaceAddrs(); err == nil {
					for _, ifa := range ifas {
						if n, ok := ifa.(*net.IPNet); ok {
							local = append(local, n.IP)
						}
					}
				}
			}
			for _, l := range local {
				out = append(out, net.JoinHostPort(l.String(), port))
			}
		case ip != nil:
			out = append(out, net.JoinHostPort(ip.String(), port))
		default:
			if ips, err := net.LookupHost(host); err == nil {
				for _, s := range ips {
					if p := net.ParseIP(s); p != nil {
						out = append(out, net.JoinHostPort(p.String(), port))
					}
				}
			}
		}
	}
	return out
}

func isLoopback(a net.Addr) bool {
	ta, ok := a.(*net.TCPAddr)
	return ok && ta.IP.IsLoopback()
}

// steering feeds the BPF program's decision counters to the metrics;
// ok=false without BPF steering.
func (d *Daemon) steering() (metrics.Steering, bool) {
	if d.Group == nil || d.Group.Steering() == nil {
		return metrics.Steering{}, false
	}
	dec, err := d.Group.Steering().Decisions()
	if err != nil {
		return metrics.Steering{}, false
	}
	return metrics.Steering{
		Selected:   dec.Selected[:],
		MigratedTo: dec.MigratedTo[:],
		Fallbacks: map[string]uint64{
			"no_slot":    dec.FallbackNoSlot,
			"select_err": dec.FallbackSelectErr,
		},
	}, true
}

// localHook is the proxy's Config.Local: tetherd's own endpoints on the
// data port. The admin API is there only with --admin-on-data-port;
// otherwise /add_worker and the others are proxied like any other path.
func (d *Daemon) localHook(opts Options) func(method, path []byte) http.Handler {
	var hooks []func(method, path []byte) http.Handler
	if opts.AdminOnDataPort {
		hooks = append(hooks, func(method, path []byte) http.Handler { return d.Admin.DataPort(method, path) })
	}
	if d.routing != nil && d.routing.local != nil {
		// engine endpoints (routing.go); the sync's steps recorded for the page
		hooks = append(hooks, history.Recording(d.routing.local, d.ctl.ui.syncs))
	}
	switch len(hooks) {
	case 0:
		return nil
	case 1:
		return hooks[0]
	}
	return func(method, path []byte) http.Handler {
		for _, h := range hooks {
			if x := h(method, path); x != nil {
				return x
			}
		}
		return nil
	}
}

// observe is the proxy's Config.Observe.
func (d *Daemon) observe(worker, codeClass int, dur time.Duration) {
	d.Metrics.Observe(worker, codeClass, dur)
}

// serveAdminHealth is GET /health on the admin listener.
func (d *Daemon) serveAdminHealth(w http.ResponseWriter, r *http.Request) {
	counts := d.Registry.Counts()
	status := "ok"
	if counts[registry.StateHealthy] == 0 {
		status = "degraded"
	}
	w.Header().Set("Content-Type", "application/json")
	fmt.Fprintf(w, `{"status":%q,"instance_id":%q,"healthy_workers":%d,"unhealthy_workers":%d,"draining_workers":%d,"pending_workers":%d,"panic":%t}`+"\n",
		status, d.InstanceID, counts[registry.StateHealthy], counts[registry.StateUnhealthy],
		counts[registry.StateDraining], counts[registry.StatePending], d.Registry.Panic())
}

// startControl starts the admin API, the health checks and the --spawn
// processes.
func (d *Daemon) startControl(opts Options) {
	if ln := d.ctl.adminLn; ln != nil {
		// ReadTimeout bounds the whole request, body included: a body
		// trickled a byte at a time does not hold a connection open
		// (the handlers themselves may take long: an add waits for health).
		d.ctl.adminSrv = &http.Server{Handler: d.Admin, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: adminReadTimeout, IdleTimeout: 2 * time.Minute}
		srv := d.ctl.adminSrv
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				d.log.Error("admin API stopped", "err", err)
			}
		}()
		d.log.Info("admin API serving", "admin", ln.Addr().String(), "token", opts.AdminToken != "", "on_data_port", opts.AdminOnDataPort)
	}
	d.Health = health.New(d.Registry, health.Options{
		Config: opts.Health,
		Probe:  d.ctl.prober,
		Log:    d.log,
	})
	d.Health.Start()
	if d.Supervisor != nil {
		d.Supervisor.Start()
	}
	d.ctl.trimStop = make(chan struct{})
	d.startTrim(d.ctl.trimStop)
	d.startUI()
}

// stopControl stops the --spawn processes (TERM, then KILL after the
// grace or when ctx ends), the admin API and the health checks.
func (d *Daemon) stopControl(ctx context.Context) {
	d.ctl.stopOnce.Do(func() {
		if d.ctl.trimStop != nil {
			close(d.ctl.trimStop)
		}
		d.stopUI()
		if d.Supervisor != nil {
			d.Supervisor.Stop(ctx)
		}
		if d.ctl.adminSrv != nil {
			sctx, cancel := context.WithTimeout(ctx, time.Second)
			d.ctl.adminSrv.Shutdown(sctx)
			cancel()
			d.ctl.adminSrv.Close()
		} else if d.ctl.adminLn != nil {
			d.ctl.adminLn.Close()
		}
		if d.Health != nil {
			d.Health.Stop()
		}
		d.stopCluster()
		if d.Registry != nil {
			d.Registry.Close()
		}
	})
}

// AdminAddr is the admin API's address, or "" when it is off.
func (d *Daemon) AdminAddr() string {
	if d.ctl.adminLn == nil {
		return ""
	}
	return d.ctl.adminLn.Addr().String()
}

// OnReload registers the check of the reloadable options of a SIGHUP
// reload (for example the routing policies): f validates opts and returns
// the function that applies them. Every check runs before anything changes,
// so an invalid configuration changes nothing.
func (d *Daemon) OnReload(f func(Options) (apply func(), err error)) {
	d.ctl.reloadMu.Lock()
	d.ctl.reload = append(d.ctl.reload, f)
	d.ctl.reloadMu.Unlock()
}

// Reload applies a new configuration without dropping a connection: the
// workers of the configuration (--worker, the config file's "worker") are
// reconciled by url, the new ones in the first free slots once healthy,
// the others keeping their slots; workers added through the admin API or
// by --spawn are left alone. --bad-session changes at once. Nothing
// changes if opts is invalid.
func (d *Daemon) Reload(opts Options) error {
	if err := opts.checkRanges(); err != nil {
		return err
	}
	bad := opts.BadSession
	for _, w := range opts.Workers {
		if _, _, err := registry.ParseURL(w); err != nil {
			return fmt.Errorf("worker: %w", err)
		}
	}
	d.ctl.reloadMu.Lock()
	defer d.ctl.reloadMu.Unlock()
	applies := make([]func(), 0, len(d.ctl.reload))
	for _, check := range d.ctl.reload {
		apply, err := check(opts)
		if err != nil {
			return err
		}
		applies = append(applies, apply)
	}
	var added, removed []string
	if d.ctl.replica == nil {
		var err error
		if added, removed, err = d.Registry.Sync(opts.Workers); err != nil {
			return err
		}
	} else if len(opts.Workers) > 0 {
		d.log.Warn("cluster mode: the worker table is in etcd; a reload changes no worker (use the admin API or tetherctl workers)")
	}
	d.Router.SetBadSession(bad)
	for _, apply := range applies {
		apply()
	}
	mode := "spread"
	if bad == route.BadSessionReject {
		mode = "reject"
	}
	d.log.Info("configuration reloaded", "workers_added", added, "workers_removed", removed, "bad_session", mode)
	return nil
}

// decorateWorker adds the weight sync's view of a worker to GET /workers.
func (d *Daemon) decorateWorker(in *registry.Info) {
	if in.Slot < 0 {
		return
	}
	if w := d.Table.Get(in.Slot); w != nil && w.URL == in.URL {
		in.WeightVersion = d.Fleet.Version(w.URL)
		d.decorateKVEvents(in) // kvevents.go
		in.SyncState = d.Fleet.WorkerState(w)
		if d.routing != nil {
			if counts := d.routing.pinned.get(d.routing.sticky); counts != nil {
				n := counts[w.Ident()]
				in.Pinned = &n
			}
		}
	}
}
