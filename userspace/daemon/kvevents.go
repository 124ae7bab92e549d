package daemon

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/tether-rl/tether/userspace/kvevents"
	"github.com/tether-rl/tether/userspace/kvindex"
	"github.com/tether-rl/tether/userspace/registry"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/worker"
)

// KV-cache events: a subscriber per worker with events (and per
// data-parallel rank), feeding one kvindex.Index that route's prefix
// placement reads. The endpoint of a worker is its own, set at run time
// (SetWorkerKVEvents: the admin API's "kv_events", or the --cluster
// table's, cluster.go), else named on the command line
// (--worker-kv-events), else the --kv-events template with the worker's
// host filled in. A reconcile every kvReconcile starts and stops
// subscribers as workers come and go, and clears a worker's entries when
// it turns unhealthy, draining or fenced (counted as health clears).

// KVEventsOptions are the settings of KV-event placement.
type KVEventsOptions struct {
	// On turns it on without a template (workers' own endpoints only).
	On bool
	// Template: tcp://{host}:5557, {host} the worker's host ("": off
	// unless a worker names its own endpoint).
	Template string
	// ReplayTemplate: the replay endpoint, likewise ("": none).
	ReplayTemplate string
	// Ranks: data-parallel ranks per worker publishing apart, at the
	// endpoint's port + rank (and the replay's). Default 1.
	Ranks int
	// MaxEntries bounds the index (kvindex.DefaultMaxEntries).
	MaxEntries int
	// TokensPerRequest: route.PrefixConfig's.
	TokensPerRequest float64
	// Workers: --worker-kv-events, each URL=ENDPOINT[,REPLAY]: a worker's
	// own publisher (parseWorkerKVEvents); any turns placement on.
	Workers []string
}

// enabled says whether KV-event placement runs: a template, a worker's
// own endpoint on the command line, or --kv-events-workers.
func (o KVEventsOptions) enabled() bool { return o.Template != "" || o.On || len(o.Workers) > 0 }

const kvReconcile = 100 * time.Millisecond

type kvWiring struct {
	opts  KVEventsOptions
	x     *kvindex.Index
	place *route.PrefixPlacement
	table *worker.Table

	mu        sync.Mutex
	static    map[string][2]string // worker URL -> endpoint, replay: --worker-kv-events
	overrides map[string][2]string // likewise, set at run time (admin API, cluster table): over static
	subs      map[string]*kvSub    // worker URL + "#" + rank
	healthClr uint64
	stop      chan struct{}
	done      chan struct{}
}

type kvSub struct {
	slot     int
	rank     int
	endpoint string
	replay   string
	id       kvindex.EngineID
	sub      *kvevents.Subscriber
	down     bool // cleared for the worker's state
}

type kvHandler struct {
	x  *kvindex.Index
	id kvindex.EngineID
}

func (h kvHandler) Apply(b *kvevents.Batch)    { h.x.Apply(h.id, b.Events) }
func (h kvHandler) Clear(kvevents.ClearReason) { h.x.Clear(h.id) }

// checkKVEndpoint validates a tcp://host:port endpoint or template: a
// host to connect to ({host}, a name or an address; not an engine's bind
// form tcp://*:port) and a port 1..65535.
func checkKVEndpoint(what, s string) error {
	a, ok := strings.CutPrefix(s, "tcp://")
	if !ok {
		return fmt.Errorf("%s %q: want tcp://host:port", what, s)
	}
	a = strings.ReplaceAll(a, "{host}", "h")
	h, p, err := net.SplitHostPort(a)
	if n, perr := strconv.Atoi(p); err != nil || perr != nil || n < 1 || n > 65535 || h == "" || h == "*" || strings.ContainsAny(h, "/,@ ") {
		return fmt.Errorf("%s %q: want tcp://host:port (the engine's host, a port 1..65535)", what, s)
	}
	return nil
}

func startKVEvents(o KVEventsOptions, rt *route.Router, t *worker.Table) (*kvWiring, error) {
	if o.Ranks <= 0 {
		o.Ranks = 1
	}
	if o.Template != "" {
		if err := checkKVEndpoint("--kv-events", o.Template); err != nil {
			return nil, err
		}
	}
	if o.ReplayTemplate != "" {
		if err := checkKVEndpoint("--kv-events-replay", o.ReplayTemplate); err != nil {
			return nil, err
		}
	}
	static, err := o.workerEndpoints()
	if err != nil {
		return nil, err
	}
	x := kvindex.New(kvindex.Config{MaxEntries: o.MaxEntries})
	p, err := route.NewPrefixPlacement(route.PrefixConfig{Index: x, TokensPerRequest: o.TokensPerRequest})
	if err != nil {
		return nil, err
	}
	rt.SetPrefixPlacement(p)
	k := &kvWiring{opts: o, x: x, place: p, table: t, static: static, overrides: map[string][2]string{},
		subs: map[string]*kvSub{}, stop: make(chan struct{}), done: make(chan struct{})}
	go k.run()
	return k, nil
}

// SetWorkerKVEvents sets the KV-events endpoint of the worker at url
// (tcp://host:port; "" back to --worker-kv-events or the template) and
// its replay endpoint. With --cluster it goes through the table (an entry
// not there yet gets it with its add), so that every replica subscribes.
func (d *Daemon) SetWorkerKVEvents(url, endpoint, replay string) error {
	if endpoint != "" {
		if err := checkKVEndpoint("kv_events", endpoint); err != nil {
			return err
		}
	}
	if replay != "" {
		if err := checkKVEndpoint("kv_events_replay", replay); err != nil {
			return err
		}
	}
	if d.kv == nil {
		return errors.New("kv_events: KV-event placement is off")
	}
	canon, _, err := registry.ParseURL(url)
	if err != nil {
		return err
	}
	if d.ctl.replica != nil {
		_, err := d.ctl.replica.SetKVEvents(canon, endpoint, replay)
		return err
	}
	d.kv.set(canon, endpoint, replay)
	return nil
}

// set sets or ("" endpoint) drops the run-time endpoint of a worker.
func (k *kvWiring) set(url, endpoint, replay string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if endpoint == "" {
		delete(k.overrides, url)
	} else {
		k.overrides[url] = [2]string{endpoint, replay}
	}
}

func (k *kvWiring) run() {
	defer close(k.done)
	t := time.NewTicker(kvReconcile)
	defer t.Stop()
	for {
		k.reconcile()
		select {
		case <-k.stop:
			return
		case <-t.C:
		}
	}
}

func (k *kvWiring) close() {
	close(k.stop)
	<-k.done
	k.mu.Lock()
	defer k.mu.Unlock()
	for n, s := range k.subs {
		s.sub.Close()
		delete(k.subs, n)
	}
}

// endpointFor fills a template with a host and adds rank to its port.
func endpointFor(tmpl, host string, rank int) string {
	if tmpl == "" {
		return ""
	}
	s := strings.ReplaceAll(tmpl, "{host}", host)
	if rank == 0 {
		return s
	}
	a := strings.TrimPrefix(s, "tcp://")
	h, p, err := net.SplitHostPort(a)
	if err != nil {
		return s
	}
	n, err := strconv.Atoi(p)
	if err != nil {
		return s
	}
	return "tcp://" + net.JoinHostPort(h, strconv.Itoa(n+rank))
}

func (k *kvWiring) reconcile() {
	k.mu.Lock()
	defer k.mu.Unlock()
	seen := map[string]bool{}
	slots := map[int][]kvindex.EngineID{}
	for _, w := range k.table.Snapshot() {
		if w == nil {
			continue
		}
		host, _, err := net.SplitHostPort(w.Addr)
		if err != nil {
			host = w.Addr
		}
		ep, rp := k.opts.Template, k.opts.ReplayTemplate
		if o, ok := k.static[w.URL]; ok {
			ep, rp = o[0], o[1]
		}
		if o, ok := k.overrides[w.URL]; ok {
			ep, rp = o[0], o[1]
		}
		if ep == "" {
			continue
		}
		healthy := w.State() == worker.Healthy
		for r := 0; r < k.opts.Ranks; r++ {
			name := w.URL + "#" + strconv.Itoa(r)
			e, rep := endpointFor(ep, host, r), endpointFor(rp, host, r)
			s := k.subs[name]
			if s != nil && (s.endpoint != e || s.replay != rep || s.slot != w.Slot) {
				k.dropLocked(name, s)
				s = nil
			}
			if s == nil {
				id, err := k.x.Register(name)
				if err != nil {
					continue // kvindex.MaxEngines reached: placed as before
				}
				sub, err := kvevents.Start(kvevents.Config{Endpoint: e, Replay: rep}, kvHandler{k.x, id})
				if err != nil {
					k.x.Unregister(id)
					continue
				}
				s = &kvSub{slot: w.Slot, rank: r, endpoint: e, replay: rep, id: id, sub: sub}
				k.subs[name] = s
			}
			seen[name] = true
			if !healthy && !s.down {
				k.x.Clear(s.id)
				k.healthClr++
			}
			s.down = !healthy
			slots[w.Slot] = append(slots[w.Slot], s.id)
		}
	}
	for name, s := range k.subs {
		if !seen[name] {
			k.dropLocked(name, s)
		}
	}
	for _, w := range k.table.Snapshot() {
		if w != nil {
			k.place.SetEngines(w.Slot, slots[w.Slot])
		}
	}
}

func (k *kvWiring) dropLocked(name string, s *kvSub) {
	s.sub.Close()
	k.x.Unregister(s.id)
	delete(k.subs, name)
}

// KVEngineStatus is one subscription's state (GET /workers, /metrics,
// tetherctl status).
type KVEngineStatus struct {
	Slot     int    `json:"slot"`
	Rank     int    `json:"rank"`
	Endpoint string `json:"endpoint"`
	Replay   string `json:"replay,omitempty"`
	kvevents.Stats
	Blocks int64 `json:"blocks_indexed"`
}

// KVEventsStatus returns every subscription's state, by worker URL, and
// the index's figures; ok false when KV-event placement is off.
func (d *Daemon) KVEventsStatus() (map[string][]KVEngineStatus, kvindex.Stats, bool) {
	if d.kv == nil {
		return nil, kvindex.Stats{}, false
	}
	k := d.kv
	k.mu.Lock()
	defer k.mu.Unlock()
	out := map[string][]KVEngineStatus{}
	for name, s := range k.subs {
		url := name[:strings.LastIndexByte(name, '#')]
		es, _ := k.x.Engine(s.id)
		out[url] = append(out[url], KVEngineStatus{Slot: s.slot, Rank: s.rank, Endpoint: s.endpoint, Replay: s.replay,
			Stats: s.sub.Stats(), Blocks: es.Blocks})
	}
	return out, k.x.Stats(), true
}

// decorateKVEvents adds the worker's subscriptions to GET /workers.
func (d *Daemon) decorateKVEvents(in *registry.Info) {
	if d.kv == nil {
		return
	}
	st, _, _ := d.KVEventsStatus()
	if s := st[in.URL]; len(s) > 0 {
		in.KVEvents = s
	}
}
