package metrics

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tether-rl/tether/userspace/fleet"
	"github.com/tether-rl/tether/userspace/worker"
)

// The weight sync (userspace/fleet): the fleet's phase, the hold, and
// each worker's weight version and state in the sync.
var (
	dFleetPhase = prometheus.NewDesc("tether_fleet_phase",
		"The fleet's weight-sync phase: 1 for the phase in effect (serving, pausing, paused).", []string{"phase"}, nil)
	dFleetHeld = prometheus.NewDesc("tether_fleet_held",
		"Generation requests held in tetherd now (the fleet is not serving, or their worker is fenced).", nil, nil)
	dFleetHeldTotal = prometheus.NewDesc("tether_fleet_held_total",
		"Requests and the hold, by outcome: released (a wake: the request is placed again, and held again if it must), timeout (answered 503 with Retry-After), left (its client left), full (refused at once: 503 with Retry-After).", []string{"outcome"}, nil)
	dFleetPauses = prometheus.NewDesc("tether_fleet_pauses_total",
		"Pauses of the fleet begun through this tetherd.", nil, nil)
	dFleetEpoch = prometheus.NewDesc("tether_fleet_epoch",
		"The membership epoch: it changes whenever a worker is added to or removed from a slot.", nil, nil)
	dFleetTarget = prometheus.NewDesc("tether_fleet_target_version_info",
		"The fleet's target weight version (1; absent until an update through tetherd sets one).", []string{"version"}, nil)
	dWorkerVersion = prometheus.NewDesc("tether_worker_weight_version_info",
		"Each worker's weight version as tetherd knows it (1).", []string{"slot", "url", "version"}, nil)
	dWorkerSync = prometheus.NewDesc("tether_worker_sync_state",
		"Each worker's state in the weight sync: 1 for its state (serving, paused, updating, fenced: its version is not the fleet's, unhealthy, draining).", []string{"slot", "url", "state"}, nil)
)

var syncStates = []string{"serving", "paused", "updating", "fenced", "unhealthy", "draining"}

type fleetCollector struct {
	f   *fleet.Fleet
	tab *worker.Table
}

func (c fleetCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{dFleetPhase, dFleetHeld, dFleetHeldTotal, dFleetPauses, dFleetEpoch, dFleetTarget, dWorkerVersion, dWorkerSync} {
		ch <- d
	}
}

func (c fleetCollector) Collect(ch chan<- prometheus.Metric) {
	rep := c.f.Report()
	for _, p := range []fleet.Phase{fleet.Serving, fleet.Pausing, fleet.Paused} {
		ch <- gauge(dFleetPhase, b2f(rep.Phase == p.String()), p.String())
	}
	ch <- gauge(dFleetHeld, float64(rep.Held))
	ch <- counter(dFleetHeldTotal, rep.Released, "released")
	ch <- counter(dFleetHeldTotal, rep.HoldFull, "full")
	ch <- counter(dFleetHeldTotal, rep.HoldTimeouts, "timeout")
	ch <- counter(dFleetHeldTotal, rep.HoldLeft, "left")
	ch <- counter(dFleetPauses, rep.Cycles)
	ch <- gauge(dFleetEpoch, float64(rep.Epoch))
	if rep.TargetVersion != "" {
		ch <- gauge(dFleetTarget, 1, rep.TargetVersion)
	}
	for _, w := range rep.Workers {
		slot := strconv.Itoa(w.Slot)
		if w.WeightVersion != "" {
			ch <- gauge(dWorkerVersion, 1, slot, w.URL, w.WeightVersion)
		}
		for _, s := range syncStates {
			ch <- gauge(dWorkerSync, b2f(w.State == s), slot, w.URL, s)
		}
	}
}
