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
	"github.com/tether-rl/tether/userspace/engine"
	"github.com/tether-rl/tether/userspace/fleet"
	"github.com/tether-rl/tether/userspace/stats"
)

type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

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
	logLevel     string
	pprof        string
}

// parse reads the flags, then the config file (--config) for the flags not
// on the command line. SIGHUP calls it again on the same arguments.
func parse(args []string) (*cli, error) {
	fs := flag.NewFlagSet("tetherd", flag.ContinueOnError)
	var workers multiFlag
	c := &cli{fs: fs}
	opts := &c.opts
	fs.StringVar(&opts.Listen, "listen", "127.0.0.1:8080", "data-plane address")
	fs.Var(&workers, "worker", "backend worker URL (repeatable; slot = order given)")
	fs.IntVar(&c.demo, "demo", 0, fmt.Sprintf("start N built-in demo session workers on loopback and route to them (at most %d)", maxDemo))
	fs.StringVar(&opts.Cluster, "cluster", "", "etcd://HOST:PORT[,HOST:PORT...]: keep the worker table in etcd, shared by every tetherd of the same --cluster-name (docs/cluster.md)")
	fs.StringVar(&opts.ClusterName, "cluster-name", "", "the cluster's name, the key prefix /tether/<name>/ in etcd (default \"default\" with --cluster)")
	fs.BoolVar(&opts.ClusterShareSessions, "cluster-share-sessions", false, "with --cluster: also write each new sticky assignment (learned session ids, sticky keys, spills) to etcd, so every replica routes the session the same way")
	fs.StringVar(&opts.BadSession, "bad-session", "spread", "session id naming no worker: spread or reject (404)")
	dp, def := &opts.Proxy, daemon.DataPlaneDefaults() // the data plane's settings (proxy.Config)
	positiveVar(fs, &dp.ResponseTimeout, "response-timeout", def.ResponseTimeout, "wait for the first response byte before 504")
	positiveVar(fs, &dp.SpliceMin, "splice-min", def.SpliceMin, "body remainders of at least this many bytes move with splice(2), smaller ones are copied")
	positiveVar(fs, &dp.IdleTimeout, "idle-timeout", def.IdleTimeout, "close a client keep-alive connection idle this long")
	fs.DurationVar(&dp.ParkAfter, "park-after", def.ParkAfter, "a connection a goroutine served (streamed body, Expect, local or queued request) goes back to its listener's event loop once idle this long (0: at once; -1s: never)")
	ioUring := fs.Bool("io-uring", !def.NoRing, "event loops batch each wake-up's socket reads and writes through an io_uring (one io_uring_enter instead of a system call each); false, or a kernel that refuses io_uring: one system call each")
	positiveVar(fs, &dp.HeadTimeout, "head-timeout", def.HeadTimeout, "a request head not complete this long after its first byte gets 408 (slowloris)")
	positiveVar(fs, &dp.IOTimeout, "io-timeout", def.IOTimeout, "a request or response body that makes no progress this long ends the exchange")
	positiveVar(fs, &dp.StreamIdleTimeout, "stream-idle-timeout", def.StreamIdleTimeout, "a streamed response (SSE, chunked) whose worker sends nothing this long is cut, visibly to the client (a stopped engine frees its clients)")
	fs.Int64Var(&dp.MaxBodyBytes, "max-body-bytes", daemon.DefaultMaxBodyBytes, "largest request body in bytes (RL bodies are large): a Content-Length above it gets 413 before anything is forwarded, a chunked body growing past it is cut with 413; 0: no limit")
	fs.IntVar(&dp.MaxConns, "max-conns", 0, "most client connections open at once; at it, accepting pauses and new connections wait in the kernel's queue (0: (descriptor limit - reserve) / 2, at least 16; the reserve is 256 descriptors, or an eighth of a limit under 2048)")
	positiveOrNoneVar(fs, &dp.QueueSize, "max-queue", def.QueueSize, "requests that may wait per worker once it is at its max_in_flight; more: 503 with Retry-After (-1: no queue)")
	positiveVar(fs, &dp.QueueTimeout, "queue-timeout", def.QueueTimeout, "longest wait in a worker's queue; then 503 with Retry-After")
	positiveVar(fs, &opts.Fleet.HoldTimeout, "pause-timeout", fleet.DefaultSettings().HoldTimeout, "longest a generation request is held while the fleet is paused for a weight sync (the hold takes --max-queue per worker); then 503 with Retry-After")
	positiveVar(fs, &opts.Engine.UpdateTimeout, "update-timeout", engine.DefaultSettings().UpdateTimeout, "longest each worker's call of a fanned-out weight update may take")
	positiveVar(fs, &dp.LocalBodyBudget, "local-body-budget", def.LocalBodyBudget, "bytes the bodies of requests tetherd answers itself (abort, flush, admin on the data port) may hold at once, across connections; past it: 503 with Retry-After")
	positiveVar(fs, &dp.Limits.RequestLine, "max-request-line", def.Limits.RequestLine, "longest request line in bytes; longer: 414")
	positiveVar(fs, &dp.Limits.Head, "max-head-bytes", def.Limits.Head, "largest request head in bytes; larger: 431")
	positiveVar(fs, &dp.Limits.ChunkExt, "max-chunk-ext-bytes", def.Limits.ChunkExt, "most chunk-extension bytes in one chunked request body; more: 400")
	positiveVar(fs, &dp.Limits.Fields, "max-header-fields", def.Limits.Fields, "most header fields in a request; more: 431")
	fs.IntVar(&opts.Listeners, "listeners", defaultListeners(runtime.NumCPU()), fmt.Sprintf("listener sockets in the SO_REUSEPORT group (default: one per CPU, at most %d)", stats.MaxSlots))
	fs.StringVar(&opts.BPF, "bpf", "auto", "BPF listener steering: auto (fall back to the kernel hash with one warning), required, or off")
	fs.StringVar(&opts.PinDir, "bpf-pin-dir", "", "bpffs directory for the pinned maps (default /sys/fs/bpf/tether/v<ABI>)")
	fs.DurationVar(&c.grace, "shutdown-grace", 30*time.Second, "on SIGTERM, time given to requests in progress (0: none, they are cut)")
	fs.DurationVar(&c.drainTimeout, "drain-timeout", 15*time.Minute, "after an upgrade (SIGUSR2), time the old process gives its requests and streams in flight (generations can be long)")
	fs.DurationVar(&c.upgradeWait, "upgrade-timeout", time.Minute, "on SIGUSR2, time the new process gets to serve; past it, or if it exits, the old one keeps serving")
	fs.StringVar(&c.pidfile, "pidfile", "", "write the PID of the current tetherd here (atomically; the new process rewrites it after an upgrade)")
	fs.StringVar(&c.logLevel, "log-level", "info", "debug, info, warn or error")
	fs.StringVar(&c.pprof, "pprof", "", "serve net/http/pprof on this address (debugging; keep it on loopback)")
	configFile := fs.String("config", "", "JSON file whose fields are these flags' names, e.g. {\"worker\":[URL,...],\"bad-session\":\"reject\"}; the command line wins; SIGHUP reloads the workers and policies")
	routingDone := routingFlags(fs, &opts.Routing)
	controlDone := controlFlags(fs, opts)
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if *configFile != "" {
		explicit := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { explicit[f.Name] = true })
		if err := config.Load(fs, *configFile, explicit, "config"); err != nil {
			return nil, err
		}
	}
	routingDone()
	if err := controlDone(fs.Args()); err != nil {
		return nil, err
	}
	if opts.Listeners < 1 || opts.Listeners > stats.MaxSlots {
		return nil, fmt.Errorf("--listeners %d: want 1..%d", opts.Listeners, stats.MaxSlots)
	}
	if c.grace < 0 {
		return nil, errors.New("--shutdown-grace: negative")
	}
	if c.drainTimeout <= 0 || c.upgradeWait <= 0 {
		return nil, errors.New("--drain-timeout and --upgrade-timeout: want a duration > 0")
	}
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(c.logLevel)); err != nil {
		return nil, fmt.Errorf("--log-level: %w", err)
	}
	opts.Log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl}))
	opts.Workers = workers
	dp.NoRing = !*ioUring
	return c, nil
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
			idle = daemon.RetireIdleGrace
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
