// Package health checks tetherd's workers. Active checks GET /health on
// every worker each Interval (2xx within Timeout is a success); passive
// ones watch the data plane's connect failures (upstream.RetryConnect on
// each worker's pool) and count them as a failed check, with an immediate
// active check to confirm. The registry turns the observations into state
// changes with hysteresis (--health-failures, --health-successes).
//
// Marking every worker unhealthy never turns into a 503 storm: the router
// then routes to all of them (reason panic) and the registry says so once
// in the log and in tether_panic.
package health

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/tether-rl/tether/userspace/config"
	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/registry"
	"github.com/tether-rl/tether/userspace/upstream"
	"github.com/tether-rl/tether/userspace/worker"
	"github.com/tether-rl/tether/userspace/workerclient"
)

// Defaults of Config, and of the flags that set them (cmd/tetherd:
// --health-interval, --health-timeout, --health-path). The hysteresis
// (--health-failures, --health-successes) is the registry's: its settings
// and defaults are registry.Config's.
const (
	DefaultInterval = 5 * time.Second
	DefaultTimeout  = 2 * time.Second
)

// Path is the endpoint checked on every worker (--health-path's default).
const Path = "/health"

// Config is the active checks' settings (tetherd's --health-interval,
// --health-timeout, --health-path), apart from the wiring (Options).
// Zero fields take the defaults (Provision).
type Config struct {
	Interval time.Duration // between active checks of a worker; DefaultInterval
	Timeout  time.Duration // of one check; DefaultTimeout
	// Path is the endpoint checked (SGLang users often check
	// /health_generate); default Path.
	Path string
}

// DefaultConfig is Config with every field at its default.
func DefaultConfig() Config {
	var c Config
	c.Provision()
	return c
}

// Provision fills c's zero (or negative) fields with the defaults.
func (c *Config) Provision() {
	if c.Interval <= 0 {
		c.Interval = DefaultInterval
	}
	if c.Timeout <= 0 {
		c.Timeout = DefaultTimeout
	}
	if c.Path == "" {
		c.Path = Path
	}
}

// Validate refuses out-of-range settings (zero is the default), naming
// tetherd's flag (settings, flags.go).
func (c Config) Validate() error { return config.Validate(c.settings()) }

// Prober returns the prober of c's timeout and path, sending apiKey as a
// Bearer token when set (NewProberWith).
func (c Config) Prober(apiKey string) registry.Prober {
	return NewProberWith(ProbeOptions{Timeout: c.Timeout, Path: c.Path, APIKey: apiKey})
}

// NewProber returns a prober that GETs url+"/health" with the given
// timeout on a fresh connection (so that a worker that went away is seen
// at once, not through a stale pooled connection).
func NewProber(timeout time.Duration) registry.Prober {
	return NewProberWith(ProbeOptions{Timeout: timeout})
}

// ProbeOptions configure a prober. Zero values take the defaults.
type ProbeOptions struct {
	Timeout time.Duration // of one check; default DefaultTimeout
	// Path is the endpoint checked (SGLang users often check
	// /health_generate); default Path.
	Path string
	// APIKey, when set, is sent as "Authorization: Bearer KEY" (engines
	// started with --api-key answer 401 to a check without it).
	APIKey string
}

// NewProberWith returns a prober: GET url+Path with a 2xx answer within
// the timeout is healthy.
func NewProberWith(o ProbeOptions) registry.Prober {
	timeout, path := o.Timeout, o.Path
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	if path == "" {
		path = Path
	}
	client := workerclient.New(workerclient.Options{
		DialTimeout:    timeout,
		Timeout:        timeout,
		MaxIdlePerHost: 0, // a fresh connection for every check
		MaxHeaderBytes: 64 << 10,
		MaxBody:        64 << 10,
		APIKey:         o.APIKey,
		UserAgent:      "tetherd-health",
	})
	check := dialect.Call{Method: http.MethodGet, Path: path}
	return func(ctx context.Context, url string) error {
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		a, err := client.Do(ctx, strings.TrimSuffix(url, "/"), check, "")
		if errors.Is(err, workerclient.ErrCutShort) {
			err = nil // the answer's status decides (its body is not read further)
		}
		if err != nil {
			return err
		}
		if !a.OK() {
			return fmt.Errorf("GET %s: %s", path, a.StatusText)
		}
		return nil
	}
}

// Options configure a Checker: its settings (Config) and wiring. Zero
// values take the defaults.
type Options struct {
	Config
	// PassiveInterval: how often the connect-failure counters are read;
	// default min(Interval, 250ms).
	PassiveInterval time.Duration
	// Probe overrides the HTTP prober (tests).
	Probe registry.Prober
	Log   *slog.Logger
}

// Checker runs the checks of one registry.
type Checker struct {
	opts  Options
	reg   *registry.Registry
	probe registry.Prober

	mu       sync.Mutex
	running  map[*worker.Worker]bool   // a check in progress
	seen     map[*worker.Worker]uint64 // connect failures already counted
	stop     chan struct{}
	kick     chan struct{}
	wg       sync.WaitGroup
	started  bool
	stopOnce sync.Once
}

// New returns a checker for reg; Start runs it.
func New(reg *registry.Registry, opts Options) *Checker {
	opts.Config.Provision()
	if opts.PassiveInterval <= 0 {
		opts.PassiveInterval = min(opts.Interval, 250*time.Millisecond)
	}
	if opts.Log == nil {
		opts.Log = slog.Default()
	}
	p := opts.Probe
	if p == nil {
		p = opts.Config.Prober("") // the timeout and path set
	}
	return &Checker{opts: opts, reg: reg, probe: p,
		running: map[*worker.Worker]bool{}, seen: map[*worker.Worker]uint64{},
		stop: make(chan struct{}), kick: make(chan struct{}, 1)}
}

// Prober returns the prober in use.
func (c *Checker) Prober() registry.Prober { return c.probe }

// Start checks every worker at once, then every Interval.
func (c *Checker) Start() {
	c.mu.Lock()
	if c.started {
		c.mu.Unlock()
		return
	}
	c.started = true
	c.mu.Unlock()
	c.wg.Add(1)
	go c.run()
}

// CheckNow asks for a round of checks as soon as possible.
func (c *Checker) CheckNow() {
	select {
	case c.kick <- struct{}{}:
	default:
	}
}

// Stop ends the checks and waits for those in progress.
func (c *Checker) Stop() {
	c.stopOnce.Do(func() { close(c.stop) })
	c.wg.Wait()
}

func (c *Checker) run() {
	defer c.wg.Done()
	active := time.NewTicker(c.opts.Interval)
	defer active.Stop()
	passive := time.NewTicker(c.opts.PassiveInterval)
	defer passive.Stop()
	c.checkAll()
	for {
		select {
		case <-c.stop:
			return
		case <-active.C:
			c.checkAll()
		case <-c.kick:
			c.checkAll()
		case <-passive.C:
			c.passive()
		}
	}
}

func (c *Checker) checkAll() {
	for _, w := range c.reg.Workers() {
		c.check(w)
	}
}

// check runs one active check of w unless one is already running.
func (c *Checker) check(w *worker.Worker) {
	c.mu.Lock()
	if c.running[w] {
		c.mu.Unlock()
		return
	}
	c.running[w] = true
	c.mu.Unlock()
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), c.opts.Timeout)
		go func() {
			select {
			case <-c.stop:
				cancel()
			case <-ctx.Done():
			}
		}()
		err := c.probe(ctx, w.URL)
		stopped := false
		select {
		case <-c.stop:
			stopped = true
		default:
		}
		cancel()
		// A check that could not even open its socket (this host is out
		// of descriptors or ports) is no verdict on the worker.
		if !stopped && err != nil && upstream.LocalShortage(err) {
			c.opts.Log.Debug("health check skipped: local resources exhausted", "slot", w.Slot, "err", err)
		} else if !stopped {
			c.reg.Report(w, err == nil, err, false)
			if err != nil {
				c.opts.Log.Debug("health check failed", "slot", w.Slot, "url", w.URL, "err", err)
			}
		}
		c.mu.Lock()
		delete(c.running, w)
		c.mu.Unlock()
	}()
}

// passive counts new connect failures of the data plane as failed checks
// and confirms each with an active check.
func (c *Checker) passive() {
	ws := c.reg.Workers()
	live := make(map[*worker.Worker]bool, len(ws))
	var failed []*worker.Worker
	c.mu.Lock()
	for _, w := range ws {
		live[w] = true
		n := w.Pool.Retries(upstream.RetryConnect)
		last, ok := c.seen[w]
		c.seen[w] = n
		if ok && n > last {
			failed = append(failed, w)
		}
	}
	for w := range c.seen {
		if !live[w] {
			delete(c.seen, w)
		}
	}
	c.mu.Unlock()
	for _, w := range failed {
		c.reg.Report(w, false, fmt.Errorf("connect to %s failed on the data path", w.Addr), true)
		c.check(w)
	}
}
