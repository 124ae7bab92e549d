package daemon

import (
	"sync"
	"time"

	"github.com/tether-rl/tether/userspace/admin"
	"github.com/tether-rl/tether/userspace/history"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/worker"
)

// The live page's wiring (admin/ui.go): the history sampled every 5 s,
// the weight syncs' timeline recorded from the engine endpoints' answers
// (history.Recording, around the local hook: nothing on the proxied
// path), the listeners and steering, and the counters at start (GET
// /baseline).

type uiParts struct {
	started time.Time
	ring    *history.Ring
	syncs   *history.Syncs
	sampler *history.Sampler

	mu    sync.Mutex
	taken bool
	base  admin.Baseline
	urls  map[int]string // each slot's worker at the snapshot
}

func newUIParts() *uiParts {
	return &uiParts{started: time.Now(), ring: history.NewRing(history.DefaultSamples), syncs: history.NewSyncs()}
}

// snapshotBaseline takes the counters as they are at the start, once the
// start-up workers are in their slots (whose counters the registry reset
// or, after an upgrade, kept).
func (d *Daemon) snapshotBaseline() {
	u := d.ctl.ui
	u.mu.Lock()
	defer u.mu.Unlock()
	u.base = admin.Baseline{Instance: d.InstanceID, Started: u.started.UTC(), Workers: []admin.WorkerBaseline{}, Listeners: []admin.ListenerCounts{}}
	u.urls = map[int]string{}
	for i := 0; i < stats.MaxWorkers; i++ {
		c := d.Stats.Worker(i).Load()
		w := d.Table.Get(i)
		if w != nil {
			u.urls[i] = w.URL
		}
		if c == (stats.WorkerSnapshot{}) && w == nil {
			continue
		}
		u.base.Workers = append(u.base.Workers, admin.WorkerBaseline{Slot: i, Requests: c.Requests, Errors: c.Errors, BytesUp: c.BytesUp, BytesDown: c.BytesDown, Retries: c.Retries})
	}
	for i := range d.lns {
		l := d.Stats.Slot(i).Load()
		u.base.Listeners = append(u.base.Listeners, admin.ListenerCounts{Slot: i, Accepted: l.Accepted, Closed: l.Closed})
	}
	u.taken = true
}

// baselineOnPut: a worker put in a slot after the snapshot, other than
// the slot's worker then, starts from zero (the registry reset the
// slot's totals): its baseline is zero.
func (u *uiParts) onPut(w *worker.Worker) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if !u.taken || u.urls[w.Slot] == w.URL {
		return
	}
	u.urls[w.Slot] = w.URL
	for i := range u.base.Workers {
		if u.base.Workers[i].Slot == w.Slot {
			u.base.Workers[i] = admin.WorkerBaseline{Slot: w.Slot}
		}
	}
}

func (u *uiParts) baseline() admin.Baseline {
	u.mu.Lock()
	defer u.mu.Unlock()
	b := u.base
	b.Workers = append([]admin.WorkerBaseline(nil), b.Workers...)
	b.Listeners = append([]admin.ListenerCounts(nil), b.Listeners...)
	return b
}

// uiConfig is the admin API's UIConfig.
func (d *Daemon) uiConfig() *admin.UIConfig {
	u := d.ctl.ui
	return &admin.UIConfig{Instance: d.InstanceID, Started: u.started, Listeners: d.uiListeners, History: u.ring, Syncs: u.syncs, Baseline: u.baseline}
}

// uiListeners reads each listener's counters and the BPF steering.
func (d *Daemon) uiListeners() []admin.Listener {
	out := make([]admin.Listener, len(d.lns))
	steer, steered := d.steering()
	var sum float64
	for i := range out {
		l := d.Stats.Slot(i).Load()
		out[i] = admin.Listener{Slot: i, Active: l.Active, Accepted: l.Accepted, Closed: l.Closed, Steered: steered}
		if steered {
			if i < len(steer.Selected) {
				out[i].Selected = steer.Selected[i]
			}
			if i < len(steer.MigratedTo) {
				out[i].Migrated = steer.MigratedTo[i]
			}
			sum += float64(out[i].Selected)
		} else {
			sum += float64(l.Accepted)
		}
	}
	for i := range out {
		if sum > 0 {
			n := out[i].Accepted
			if steered {
				n = out[i].Selected
			}
			out[i].Share = float64(n) / sum
		}
	}
	return out
}

// uiReading is one history sample: this process's requests, the hold,
// each engine's KV usage.
func (d *Daemon) uiReading() history.Reading {
	rd := history.Reading{Requests: d.Proxy.Counters().Requests.Load(), Held: d.Fleet.HeldNow()}
	for _, w := range d.Table.Snapshot() {
		if w == nil {
			continue
		}
		if v, ok := w.EngineState(); ok && v.Source != "" && v.KVUsage >= 0 {
			rd.KV = append(rd.KV, history.KV{Slot: w.Slot, Usage: v.KVUsage})
		}
	}
	return rd
}

// UIHistory is the live page's sample ring (tests fill it).
func (d *Daemon) UIHistory() *history.Ring { return d.ctl.ui.ring }

func (d *Daemon) startUI() {
	u := d.ctl.ui
	u.sampler = &history.Sampler{Ring: u.ring, Interval: history.DefaultInterval, Read: d.uiReading}
	u.sampler.Start()
}

func (d *Daemon) stopUI() {
	if u := d.ctl.ui; u != nil && u.sampler != nil {
		u.sampler.Stop()
	}
}
