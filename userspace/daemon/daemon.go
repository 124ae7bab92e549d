// Package daemon wires tetherd together: listeners, counters, the worker
// table, the router and the data plane, plus the demo workers of --demo.
// cmd/tetherd turns flags into Options; tests run the same code in-process.
package daemon

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"sync"
	"time"

	"github.com/tether-rl/tether/userspace/demo"
	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/proxy"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/upstream"
)

// Options are tetherd's settings.
type Options struct {
	Listen          string        // data-plane address, e.g. 127.0.0.1:8080
	Listeners       int           // sockets in the SO_REUSEPORT group; default 1
	Workers         []string      // backend URLs, slot = index
	Demo            int           // start this many demo workers and route to them
	BadSession      string        // "spread" (default) or "reject"
	ResponseTimeout time.Duration // default 30m
	Pool            upstream.Options
	Limits          httphead.Limits
	Log             *slog.Logger
}

// Daemon is a running tetherd.
type Daemon struct {
	opts       Options
	log        *slog.Logger
	InstanceID string
	Table      *route.Table
	Router     *route.Router
	Proxy      *proxy.Server
	Stats      *stats.Table
	demos      []*demo.Server
	lns        []net.Listener
	wg         sync.WaitGroup
}

// ParseWorkerURL checks a worker URL and returns its dial address.
func ParseWorkerURL(raw string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return "", fmt.Errorf("worker url %q: %w", raw, err)
	}
	switch u.Scheme {
	case "http":
	case "https":
		return "", fmt.Errorf("worker url %q: https backends are not supported (tether speaks plain HTTP/1.1 upstream)", raw)
	default:
		return "", fmt.Errorf("worker url %q: scheme must be http", raw)
	}
	if u.Host == "" || u.User != nil || (u.Path != "" && u.Path != "/") || u.RawQuery != "" {
		return "", fmt.Errorf("worker url %q: want http://host:port", raw)
	}
	host, port := u.Hostname(), u.Port()
	if port == "" {
		port = "80"
	}
	return net.JoinHostPort(host, port), nil
}

func badSessionMode(s string) (route.BadSession, error) {
	switch s {
	case "", "spread":
		return route.BadSessionSpread, nil
	case "reject":
		return route.BadSessionReject, nil
	}
	return 0, fmt.Errorf("--bad-session %q: want spread or reject", s)
}

// New validates opts, starts demo workers if asked, and opens the
// listeners. Serve starts the data plane.
func New(opts Options) (*Daemon, error) {
	if opts.Log == nil {
		opts.Log = slog.Default()
	}
	if opts.Listeners <= 0 {
		opts.Listeners = 1
	}
	if opts.Listeners > stats.MaxSlots {
		return nil, fmt.Errorf("--listeners %d: at most %d", opts.Listeners, stats.MaxSlots)
	}
	bad, err := badSessionMode(opts.BadSession)
	if err != nil {
		return nil, err
	}
	if opts.Demo < 0 || opts.Demo > 256 {
		return nil, fmt.Errorf("--demo %d: want 0..256", opts.Demo)
	}
	if opts.Demo == 0 && len(opts.Workers) == 0 {
		return nil, errors.New("no workers: give --worker URL (repeatable) or --demo N")
	}
	if len(opts.Workers)+opts.Demo > stats.MaxWorkers {
		return nil, fmt.Errorf("too many workers: at most %d", stats.MaxWorkers)
	}
	addrs := make([]string, 0, len(opts.Workers))
	for _, w := range opts.Workers {
		a, err := ParseWorkerURL(w)
		if err != nil {
			return nil, err
		}
		addrs = append(addrs, a)
	}

	var idb [8]byte
	rand.Read(idb[:])
	d := &Daemon{opts: opts, log: opts.Log, InstanceID: hex.EncodeToString(idb[:]), Table: route.NewTable()}
	ok := false
	defer func() {
		if !ok {
			d.Close()
		}
	}()
	for i := 0; i < opts.Demo; i++ {
		s, err := demo.Start("127.0.0.1:0", demo.Options{Index: len(opts.Workers) + i})
		if err != nil {
			return nil, fmt.Errorf("start demo worker %d: %w", i, err)
		}
		d.demos = append(d.demos, s)
		opts.Workers = append(opts.Workers, s.URL())
		addrs = append(addrs, s.Addr())
	}

	lns, tab, err := openListeners(opts.Listen, opts.Listeners, opts.Log)
	if err != nil {
		return nil, err
	}
	d.lns, d.Stats = lns, tab

	for i, u := range opts.Workers {
		ws := d.Stats.Worker(i)
		d.Table.Put(&route.Worker{Slot: i, URL: u, Addr: addrs[i], Stats: ws, Pool: upstream.New(addrs[i], ws, opts.Pool)})
	}
	d.Router = &route.Router{Table: d.Table, BadSession: bad}
	d.Proxy = proxy.New(proxy.Config{
		Router:          d.Router,
		Table:           d.Table,
		Limits:          opts.Limits,
		ResponseTimeout: opts.ResponseTimeout,
		InstanceID:      d.InstanceID,
		Log:             opts.Log,
	})
	ok = true
	return d, nil
}

// Addr is the data-plane address actually bound.
func (d *Daemon) Addr() string { return d.lns[0].Addr().String() }

// Demos returns the demo workers started by --demo.
func (d *Daemon) Demos() []*demo.Server { return d.demos }

// Serve runs the data plane until Shutdown.
func (d *Daemon) Serve() {
	for i, ln := range d.lns {
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			if err := d.Proxy.Serve(ln, d.Stats.Slot(i)); err != nil {
				d.log.Error("listener stopped", "slot", i, "err", err)
			}
		}()
	}
	d.log.Info("tetherd serving", "listen", d.Addr(), "listeners", len(d.lns), "workers", len(d.opts.Workers), "instance_id", d.InstanceID)
}

// Shutdown stops accepting, finishes requests in progress (bounded by ctx)
// and releases everything.
func (d *Daemon) Shutdown(ctx context.Context) error {
	var err error
	if d.Proxy != nil {
		err = d.Proxy.Shutdown(ctx)
	}
	d.wg.Wait()
	d.Close()
	return err
}

// Close releases everything at once.
func (d *Daemon) Close() {
	if d.Proxy != nil {
		d.Proxy.Close()
	}
	for _, ln := range d.lns {
		ln.Close()
	}
	for _, w := range d.Table.Snapshot() {
		if w != nil {
			w.Pool.Close()
		}
	}
	for _, s := range d.demos {
		s.Close()
	}
}
