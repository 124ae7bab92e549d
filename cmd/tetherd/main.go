// Command tetherd is tether's router daemon: an HTTP/1.1 proxy that keeps
// every session of an RL rollout on the worker that owns it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	_ "net/http/pprof"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"syscall"
	"time"

	"github.com/tether-rl/tether/userspace/config"
	"github.com/tether-rl/tether/userspace/daemon"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/supervisor"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fmt.Fprintln(os.Stderr, "tetherd:", err)
		os.Exit(1)
	}
}

// defaultListeners is one listener per CPU, at most as many as the
// steering maps have slots (a host with more CPUs starts with that many).
// Each listener's event loop holds an OS thread of its own (a goroutine
// locked to it around one epoll set: proxy.Server.Serve), and GOMAXPROCS
// is raised to one above the loops (proxy.ProcsForLoops).
func defaultListeners(cpus int) int { return max(1, min(cpus, stats.MaxSlots)) }

// cli is what the command line and the config file say.
type cli struct {
	fs           *flag.FlagSet
	opts         daemon.Options
	demo         int
	grace        time.Duration
	drainTimeout time.Duration
	upgradeWait  time.Duration
	pidfile      string
	logLevel     logLevel
	pprof        string
	configFile   string
}

// logLevel is --log-level.
type logLevel slog.Level

func (l logLevel) String() string { return strings.ToLower(slog.Level(l).String()) }

func parseLogLevel(s string) (logLevel, error) {
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(s)); err != nil {
		return 0, fmt.Errorf("--log-level: %w", err)
	}
	return logLevel(lvl), nil
}

// settings are tetherd's own flags: the process (demo workers, shutdown,
// upgrade, pidfile, logs) and --listeners, whose default is the host's.
func (c *cli) settings() []config.Setting {
	return []config.Setting{
		config.Num(&c.demo, "demo", 0, config.Any, fmt.Sprintf("start N built-in demo session workers on loopback and route to them (at most %d)", maxDemo)).Type("int"),
		config.Num(&c.opts.Listeners, "listeners", defaultListeners(runtime.NumCPU()), config.Positive, fmt.Sprintf("listener sockets in the SO_REUSEPORT group (default: one per CPU, at most %d)", stats.MaxSlots)).Type("int").HideDefault(),
		config.Num(&c.grace, "shutdown-grace", 30*time.Second, config.NonNegative, "on SIGTERM, time given to requests in progress (0: none, they are cut)").Type("duration"),
		config.Num(&c.drainTimeout, "drain-timeout", 15*time.Minute, config.Positive, "after an upgrade (SIGUSR2), the longest the old process stays: it answers its requests and streams in flight (generations can be long) and the requests still sent on its keep-alive connections, which it closes once idle for --idle-timeout").Type("duration"),
		config.Num(&c.upgradeWait, "upgrade-timeout", time.Minute, config.Positive, "on SIGUSR2, time the new process gets to serve; past it, or if it exits, the old one keeps serving").Type("duration"),
		config.Str(&c.pidfile, "pidfile", "", "write the PID of the current tetherd here (atomically; the new process rewrites it after an upgrade)", nil),
		config.Mode(&c.logLevel, "log-level", logLevel(slog.LevelInfo), "debug, info, warn or error", parseLogLevel),
		config.Str(&c.pprof, "pprof", "", "serve net/http/pprof on this address (debugging; keep it on loopback)", nil),
		config.Str(&c.configFile, "config", "", "JSON file whose fields are these flags' names, e.g. {\"worker\":[URL,...],\"bad-session\":\"reject\"}; the command line wins; SIGHUP reloads the workers and policies", nil),
	}
}

// RegisterFlags registers tetherd's own flags on fs.
func (c *cli) RegisterFlags(fs *flag.FlagSet) { config.Register(fs, c.settings()) }

// parse reads the flags, then the config file (--config) for the flags not
// on the command line. SIGHUP calls it again on the same arguments. Each
// component's settings register their own flags, writing the component's
// settings directly.
func parse(args []string) (*cli, error) {
	fs := flag.NewFlagSet("tetherd", flag.ContinueOnError)
	config.Usage(fs)
	c := &cli{fs: fs}
	o := &c.opts
	for _, r := range []interface{ RegisterFlags(*flag.FlagSet) }{
		c,                   // tetherd's own
		o,                   // the daemon's: listen, workers, cluster, admin API
		&o.Proxy,            // the data plane
		&o.Fleet,            // weight syncs' hold
		&o.Engine,           // engine endpoints
		&o.Health,           // active health checks
		&o.Registry,         // worker life
		&o.Spawn,            // --spawn
		&o.Routing,          // routing modes, engine polling
		&o.Routing.Keys,     // the policy's bounds
		&o.Routing.Learn,    // learned session ids
		&o.Routing.Engine,   // engine-aware placement
		&o.Routing.KVEvents, // placement from the engines' KV-cache events
	} {
		r.RegisterFlags(fs)
	}
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if c.configFile != "" {
		explicit := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { explicit[f.Name] = true })
		if err := config.Load(fs, c.configFile, explicit, "config"); err != nil {
			return nil, err
		}
	}
	if o.Listeners > stats.MaxSlots {
		return nil, fmt.Errorf("--listeners %d: want 1..%d", o.Listeners, stats.MaxSlots)
	}
	for _, secret := range []struct {
		p   *string
		env string
	}{{&o.AdminToken, "TETHER_ADMIN_TOKEN"}, {&o.WorkerAPIKey, "TETHER_WORKER_API_KEY"}} {
		if *secret.p == "" {
			*secret.p = os.Getenv(secret.env)
		}
	}
	if err := spawnCommand(&o.Spawn, fs.Args()); err != nil {
		return nil, err
	}
	o.Log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.Level(c.logLevel)}))
	return c, nil
}

// spawnCommand takes the positional arguments: the --spawn command given
// after "--".
func spawnCommand(sp *supervisor.Config, args []string) error {
	switch {
	case len(args) > 0 && sp.N == 0:
		return fmt.Errorf("unexpected arguments: %q (a worker command goes with --spawn N -- CMD ARGS)", args)
	case len(args) == 0 && sp.N > 0:
		return fmt.Errorf("--spawn %d: give the worker command after --, e.g. --spawn %d -- tether-demo --listen 127.0.0.1:{port} --index {index}", sp.N, sp.N)
	}
	sp.Command = args
	return nil
}

func run(args []string) error {
	c, err := parse(args)
	if err != nil {
		return err
	}
	opts := c.opts
	log := opts.Log
	// The binary to start on an upgrade: the path this one was started
	// from (a new binary installed there is what runs next).
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("executable path: %w", err)
	}
	// Signals are ours from the start: a SIGUSR2 (upgrade) that came
	// before the handler would kill the process (its default action).
	sig := make(chan os.Signal, 4)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGUSR2)
	if opts.Inherited, err = inherited(); err != nil {
		return err
	}
	if c.pprof != "" {
		go func() { log.Error("pprof stopped", "err", http.ListenAndServe(c.pprof, nil)) }()
	}
	stopDemos, err := startDemos(&opts, c.demo)
	if err != nil {
		return err
	}
	defer stopDemos() // after the daemon's shutdown or retirement below
	d, err := daemon.New(opts)
	if err != nil {
		return err
	}
	d.Serve()
	if opts.Inherited != nil && opts.Inherited.From != 0 {
		notifyMainPID(log, opts.Inherited.From)
	}
	if err := d.Ready(); err != nil {
		log.Warn("upgrade: could not tell the old process", "err", err)
	}
	if c.pidfile != "" {
		if err := writePidfile(c.pidfile, os.Getpid()); err != nil {
			log.Error("pidfile", "err", err)
		}
	}
	// With the sockets in systemd's fd store they outlive this process:
	// on SIGTERM clients are moved over gently, as after an upgrade.
	stored := false
	if clusterSynced(d, opts.Inherited, sig, log) {
		stored = notifyReady(d, log)
	}
	if c.demo > 0 && opts.Inherited == nil {
		fmt.Fprintf(os.Stderr, "\ntether is running with %d demo workers. Try:\n"+
			"  curl -s -XPOST http://%[2]s/sessions\n"+
			"  curl -s http://%[2]s/sessions/<session_id>/v1/chat/completions -d '{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}'\n"+
			"  curl -s http://%[2]s/health\n\n", c.demo, d.Addr())
	}
	stopWatchdog := watchdog(log)
	defer stopWatchdog()
	for s := range sig {
		switch s {
		case syscall.SIGHUP:
			notify(log, "RELOADING=1\nMONOTONIC_USEC="+monotonicUsec())
			reload(d, args, c)
			notify(log, "READY=1")
			continue
		case syscall.SIGUSR2:
			log.Info("upgrade: starting the new tetherd", "exe", exe)
			p, err := d.Upgrade(exe, args, os.Stderr, c.upgradeWait)
			if err != nil {
				log.Error("upgrade failed: this process keeps serving", "err", err)
				continue
			}
			log.Info("upgrade: the new tetherd serves; finishing the requests in flight here", "new_pid", p.Pid, "drain_timeout", c.drainTimeout)
			ctx, cancel := context.WithTimeout(context.Background(), c.drainTimeout)
			defer cancel()
			return d.Retire(ctx)
		}
		notify(log, "STOPPING=1")
		log.Info("shutting down", "signal", s.String(), "grace", c.grace)
		ctx, cancel := context.WithTimeout(context.Background(), c.grace)
		defer cancel()
		idle := time.Duration(0)
		if stored {
			idle = daemon.StopIdleGrace
		}
		err := d.ShutdownGently(ctx, idle)
		if c.pidfile != "" {
			removePidfile(c.pidfile, os.Getpid())
		}
		return err
	}
	return nil
}

var reloadable = map[string]bool{"worker": true, "bad-session": true, "config": true}

// The routing flags a SIGHUP applies (daemon registers the reload).
func init() {
	for _, f := range daemon.RoutingReloadable {
		reloadable[f] = true
	}
}

// reload reads the command line and the config file again and applies the
// worker list and policies. An invalid configuration changes nothing.
func reload(d *daemon.Daemon, args []string, running *cli) {
	log := running.opts.Log
	n, err := parse(args)
	if err != nil {
		log.Error("reload refused: the running configuration is kept", "err", err)
		return
	}
	running.fs.VisitAll(func(f *flag.Flag) {
		if nf := n.fs.Lookup(f.Name); nf != nil && !reloadable[f.Name] && nf.Value.String() != f.Value.String() {
			if f.Name == "admin-token" {
				log.Warn("reload: this change takes effect on restart", "flag", f.Name)
				return
			}
			log.Warn("reload: this change takes effect on restart", "flag", f.Name, "running", f.Value.String(), "new", nf.Value.String())
		}
	})
	n.opts.Log = log
	if err := d.Reload(n.opts); err != nil {
		log.Error("reload refused: the running configuration is kept", "err", err)
	}
}
