package fleet

import (
	"sort"
	"strconv"

	"github.com/tether-rl/tether/userspace/worker"
)

// The state handed to a successor (upgrade) and kept in the cluster
// store, and the report of GET /fleet.

// State is what a tetherd hands its successor (upgrade) and what the
// cluster store holds: the phase, the pause's mode, the target and the
// versions.
type State struct {
	Phase    string            `json:"phase"`
	Mode     string            `json:"mode,omitempty"`
	Target   string            `json:"target,omitempty"`
	Versions map[string]string `json:"versions,omitempty"`
}

// Export returns this replica's state.
func (f *Fleet) Export() State {
	f.mu.Lock()
	defer f.mu.Unlock()
	st := State{Phase: f.local.String(), Mode: f.mode, Target: f.target, Versions: map[string]string{}}
	var in map[string]bool // the workers in the table: versions of others are not handed on
	if f.cfg.Table != nil {
		in = map[string]bool{}
		for _, w := range f.cfg.Table.Snapshot() {
			if w != nil {
				in[w.URL] = true
			}
		}
	}
	for u, v := range f.versions {
		if in == nil || in[u] {
			st.Versions[u] = v
		}
	}
	return st
}

// Import takes a predecessor's state (upgrade).
func (f *Fleet) Import(st State) {
	p, _ := ParsePhase(st.Phase)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.local, f.mode, f.target = p, st.Mode, st.Target
	for u, v := range st.Versions {
		f.versions[u] = v
	}
	f.effectiveLocked()
	f.refenceLocked()
}

// The report (GET /fleet).

// WorkerReport is one worker in GET /fleet.
type WorkerReport struct {
	Slot          int    `json:"slot"`
	URL           string `json:"url"`
	Engine        string `json:"engine"`
	State         string `json:"state"` // serving, paused, updating, fenced (version), unhealthy, draining
	WeightVersion string `json:"weight_version"`
	InFlight      uint64 `json:"in_flight"`
}

// Report is GET /fleet.
type Report struct {
	Phase         string         `json:"phase"`
	Mode          string         `json:"mode,omitempty"`
	PhaseSinceS   float64        `json:"phase_since_s"`
	Epoch         uint64         `json:"epoch"`
	TargetVersion string         `json:"target_version"`
	Held          int            `json:"held"`
	HeldTotal     uint64         `json:"held_total"`
	Released      uint64         `json:"released_total"`
	HoldFull      uint64         `json:"hold_full_total"`
	HoldTimeouts  uint64         `json:"hold_timeouts_total"`
	HoldLeft      uint64         `json:"hold_left_total"` // clients that left while held
	Cycles        uint64         `json:"pauses_total"`
	ClusterLink   string         `json:"cluster_link,omitempty"` // "down" when the store cannot be seen
	Workers       []WorkerReport `json:"workers"`
}

// WorkerState names a worker's state in the sync.
func (f *Fleet) WorkerState(w *worker.Worker) string {
	fb := w.Fenced()
	switch {
	case fb&worker.FenceUpdating != 0:
		return "updating"
	case fb&worker.FenceVersion != 0:
		return "fenced"
	case f.Phase() != Serving:
		return "paused"
	}
	switch w.BaseState() {
	case worker.Unhealthy:
		return "unhealthy"
	case worker.Draining:
		return "draining"
	}
	return "serving"
}

// Report returns the fleet as GET /fleet shows it.
func (f *Fleet) Report() Report {
	var ws []*worker.Worker
	var epoch uint64
	if f.cfg.Table != nil {
		ws, epoch = f.cfg.Table.Snapshot(), f.cfg.Table.Epoch()
	}
	f.mu.Lock()
	r := Report{Phase: f.Phase().String(), Mode: f.mode, PhaseSinceS: round3(f.cfg.Now().Sub(f.since).Seconds()),
		Epoch: epoch, TargetVersion: f.target, Held: len(f.waiters), Cycles: f.cycles, Workers: []WorkerReport{}}
	if f.linkDown {
		r.ClusterLink = "down"
	}
	versions := make(map[string]string, len(f.versions))
	for u, v := range f.versions {
		versions[u] = v
	}
	f.mu.Unlock()
	r.HeldTotal, r.Released, r.HoldFull, r.HoldTimeouts, r.HoldLeft = f.heldTotal.Load(), f.released.Load(), f.full.Load(), f.timeouts.Load(), f.left.Load()
	for _, w := range ws {
		if w == nil {
			continue
		}
		r.Workers = append(r.Workers, WorkerReport{Slot: w.Slot, URL: w.URL, Engine: w.Engine().String(), State: f.WorkerState(w),
			WeightVersion: versions[w.URL], InFlight: uint64(max(w.Admitted(), 0))})
	}
	sort.Slice(r.Workers, func(i, j int) bool { return r.Workers[i].Slot < r.Workers[j].Slot })
	return r
}

func round3(x float64) float64 {
	v, _ := strconv.ParseFloat(strconv.FormatFloat(x, 'f', 3, 64), 64)
	return v
}
