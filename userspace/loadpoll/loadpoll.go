// Package loadpoll reads the load of every worker's inference engine each
// --engine-poll and hands it to placement (worker.Worker.SetEngineSignals):
// an engine's JSON load endpoint when it answers (running, waiting, token
// usage, cache hit rate, per DP rank), else the engines' Prometheus
// /metrics, parsed by metric name whatever the labels; what to call and
// how to read it is userspace/dialect's. The engine a worker serves, as
// dialect detects it from the answers, is recorded (Worker.SetEngine). A
// worker that exposes neither is placed as before.
//
// Polls run in their own goroutines with the health checks' habits (the
// worker API key, a timeout, no HTTP proxy); the data path only reads the
// atomics they write. An engine that stops answering keeps its last
// reading for two more rounds, then placement forgets it (the worker is
// placed by its in-flight count, and not vetoed) until it answers again.
package loadpoll

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/worker"
	"github.com/tether-rl/tether/userspace/workerclient"
)

// Files: loadpoll.go (the settings, the poller and its rounds), poll.go
// (one worker's poll: the endpoint it serves, its failures).

// Defaults of Config (tetherd's --engine-poll shows DefaultInterval).
const (
	DefaultInterval = time.Second
	// DefaultTimeout caps one poll when Config.Timeout is not given
	// (tetherd gives min(--engine-poll, --health-timeout)).
	DefaultTimeout = 2 * time.Second
)

// Internal rounds and bounds.
const (
	// staleRounds: a reading is used for this many failed rounds after it.
	staleRounds = 3
	// redetectRounds: a worker without a load endpoint is asked again
	// this often (an engine that came up late).
	redetectRounds = 10
	// versionRounds: an engine's weight version is read this often.
	versionRounds = 5
	maxBody       = 4 << 20
)

// Config is the poller's settings (tetherd's --engine-poll), apart from
// the wiring (Options). Zero fields take the defaults (Provision).
type Config struct {
	Interval time.Duration // between rounds; DefaultInterval
	// Timeout of one poll; default min(Interval, DefaultTimeout).
	Timeout time.Duration
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
		c.Timeout = min(c.Interval, DefaultTimeout)
	}
}

// Options configure a Poller: its settings (Config) and wiring.
type Options struct {
	Config
	APIKey string // sent as "Authorization: Bearer KEY"
	Table  *worker.Table
	// Router: its EnginePlacement (the veto thresholds, SetKnown) is read
	// at each round, so a reload applies.
	Router *route.Router
	Log    *slog.Logger
	// Now is the clock (tests); default time.Now.
	Now func() time.Time
}

// Poller polls the engines of a worker table.
type Poller struct {
	opts   Options
	client *workerclient.Client

	mu      sync.Mutex
	state   map[*worker.Worker]*wstate
	stop    chan struct{}
	kick    chan struct{}
	wg      sync.WaitGroup
	started bool
	once    sync.Once
	rounds  uint64
}

// endpoint is what a worker's engine serves.
type endpoint int

const (
	epUnknown endpoint = iota
	epLoads            // the JSON load endpoint (dialect.LoadsCall)
	epMetrics          // the Prometheus /metrics with an engine's names
	epNone             // neither
)

type wstate struct {
	ep       endpoint
	polled   uint64 // rounds polled
	failures int
	lastOK   time.Time
	version  string
	// prefix cache counters at the previous reading (hit rate over the
	// interval).
	counters dialect.Counters
}

// New returns a poller; Start runs it.
func New(o Options) *Poller {
	o.Config.Provision()
	if o.Log == nil {
		o.Log = slog.Default()
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	client := workerclient.New(workerclient.Options{
		DialTimeout:    o.Timeout,
		Timeout:        o.Timeout,
		MaxIdlePerHost: 1,
		IdleTimeout:    max(3*o.Interval, 30*time.Second),
		MaxHeaderBytes: 64 << 10,
		MaxBody:        maxBody,
		APIKey:         o.APIKey,
		UserAgent:      "tetherd-loadpoll",
	})
	return &Poller{opts: o, state: map[*worker.Worker]*wstate{}, client: client,
		stop: make(chan struct{}), kick: make(chan struct{}, 1)}
}

// Start polls at once, then every Interval.
func (p *Poller) Start() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.started {
		return
	}
	p.started = true
	p.wg.Add(1)
	go p.run()
}

// Stop ends the polls and waits for those in progress.
func (p *Poller) Stop() {
	p.once.Do(func() { close(p.stop) })
	p.wg.Wait()
	p.client.Close()
}

// PollNow asks for a round as soon as possible.
func (p *Poller) PollNow() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// Rounds returns how many rounds completed.
func (p *Poller) Rounds() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.rounds
}

func (p *Poller) run() {
	defer p.wg.Done()
	t := time.NewTicker(p.opts.Interval)
	defer t.Stop()
	for {
		p.Round()
		select {
		case <-p.stop:
			return
		case <-t.C:
		case <-p.kick:
		}
	}
}

// Round polls every worker once (concurrently, each within Timeout), then
// updates placement: how many workers have signals, and the hold when
// every engine is vetoed.
func (p *Poller) Round() {
	ws := p.opts.Table.Snapshot()
	ctx, cancel := context.WithTimeout(context.Background(), p.opts.Timeout)
	defer cancel()
	go func() {
		select {
		case <-p.stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	var wg sync.WaitGroup
	p.mu.Lock()
	live := make(map[*worker.Worker]bool, len(ws))
	for _, w := range ws {
		if w == nil {
			continue
		}
		live[w] = true
		st := p.state[w]
		if st == nil {
			st = &wstate{}
			p.state[w] = st
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.poll(ctx, w, st)
		}()
	}
	for w := range p.state {
		if !live[w] {
			delete(p.state, w)
		}
	}
	p.mu.Unlock()
	wg.Wait()
	p.settle(ws)
	p.mu.Lock()
	p.rounds++
	p.mu.Unlock()
}

// settle publishes the count of workers with signals and holds admissions
// while every healthy engine is vetoed.
func (p *Poller) settle(ws []*worker.Worker) {
	known, healthy, vetoed := 0, 0, 0
	for _, w := range ws {
		if w == nil {
			continue
		}
		k := w.EngineKnown()
		if k {
			known++
		}
		if w.State() == worker.Healthy {
			healthy++
			if k && w.EngineVetoed() {
				vetoed++
			}
		}
	}
	all := healthy > 0 && vetoed == healthy
	for _, w := range ws {
		if w == nil {
			continue
		}
		if all && w.EngineVetoed() {
			if w.EngineHold() == 0 {
				w.SetEngineHold(int64(max(w.Admitted(), 1)))
				p.opts.Log.Info("every engine vetoed: holding new requests in tetherd's queue", "slot", w.Slot, "in_flight", w.Admitted())
			}
		} else if w.EngineHold() != 0 {
			w.SetEngineHold(0)
		}
	}
	if e := p.placement(); e != nil {
		e.SetKnown(known)
	}
}

func (p *Poller) placement() *route.EnginePlacement {
	if p.opts.Router == nil {
		return nil
	}
	return p.opts.Router.EnginePlacement()
}
