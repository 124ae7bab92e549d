// Package fleet holds the state of a weight sync across every worker:
// the fleet's phase (serving → pausing → paused → serving), the hold that
// keeps generation requests in tetherd while the fleet is not serving, the
// weight version of each worker against the fleet's target, and the
// fences (route/fence.go) that keep a worker whose weights are being
// updated, or are not the fleet's, from new work.
//
// The HTTP side (pause, update and resume fanned out in each engine's
// dialect) is userspace/engine's fleet.go; this package has no I/O of its
// own and is what the data path asks, an atomic load per request:
//
//	Held(method, w)   before routing (w nil) and once a place with w is
//	                  taken: does this request wait?
//	Wait(w, gone, t)  the wait itself, FIFO, released in arrival order
//
// Only requests that may generate are held: GET, HEAD and OPTIONS go
// through (model lists, server info, metrics), so do the engines' own
// control calls a trainer may make while the fleet is paused (Bypass:
// /collective_rpc, /load_lora_adapter, /tokenize, ...), and tetherd's own
// control endpoints are answered by tetherd, never proxied.
package fleet

import (
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/route"
)

// Phase of the fleet.
type Phase int32

const (
	Serving Phase = iota // requests reach the engines
	Pausing              // a pause is being carried out: new requests are held
	Paused               // the engines are paused and quiet: requests are held
)

func (p Phase) String() string {
	switch p {
	case Pausing:
		return "pausing"
	case Paused:
		return "paused"
	}
	return "serving"
}

// ParsePhase is the inverse of Phase.String.
func ParsePhase(s string) (Phase, bool) {
	switch s {
	case "serving", "":
		return Serving, true
	case "pausing":
		return Pausing, true
	case "paused":
		return Paused, true
	}
	return Serving, false
}

// Config configures a Fleet.
type Config struct {
	Table *route.Table
	// MaxHeldPerWorker bounds the hold: at most this many requests per
	// worker in the table (at least this many in all) wait at once; past
	// it 503 with Retry-After. Default 1024 (--max-queue).
	MaxHeldPerWorker int
	// HoldTimeout bounds one request's time in the hold (--pause-timeout);
	// DefaultHoldTimeout.
	HoldTimeout time.Duration
	// Now is the clock (tests); default time.Now.
	Now func() time.Time
}

// Fleet is the sync state of one tetherd (in cluster mode, kept equal on
// every replica through the cluster store).
type Fleet struct {
	cfg Config

	// phase is read on every request that may generate: atomic.
	phase atomic.Int32
	// local is the phase this replica set itself; remote the one the
	// cluster store says; linkDown: this replica cannot see the store (it
	// holds rather than admits). phase = the most restrictive.
	local, remote Phase
	linkDown      bool

	mu      sync.Mutex
	waiters []*waiter // FIFO
	mode    string    // the pause's mode, as asked
	since   time.Time // the phase's start
	target  string    // the fleet's weight version ("": none set)
	// versions: each worker's weight version by URL ("": unknown).
	versions map[string]string
	updating map[string]bool
	cycles   uint64 // pauses begun
	// open: a vLLM start_weight_update was fanned out and its
	// finish_weight_update not yet: the weights are in flux.
	open    bool
	openSeq uint64 // which open update a bound's timer closes
	// pauseSeq numbers the pauses begun here (BeginPause): a pause that
	// was resumed, or superseded by another, while it quiesced does not
	// pause the fleet at its end.
	pauseSeq uint64
	// round: the version name tetherd gives a weights update that names
	// none, the same for every call of one sync (per-engine calls too),
	// until the phase changes or a fleet-wide update closes it.
	round  string
	rounds uint64

	heldTotal, released, full, timeouts, left atomic.Uint64

	// forward, once set (a tetherd retiring after an upgrade while the
	// fleet is held), takes every held request: they go to the new
	// process, which holds them until the resume it will be sent.
	forward atomic.Pointer[route.Worker]

	// ask, when set, asks a worker its weight version (GET
	// /get_weight_version: userspace/engine) and records it: a worker that
	// joins with the fleet's weights is unfenced without an update.
	ask func(w *route.Worker)
}

// SetAsk sets how a joining worker of unknown version is asked its
// version (in the background).
func (f *Fleet) SetAsk(ask func(w *route.Worker)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ask = ask
}

type waiter struct {
	ch   chan struct{}
	done bool // ch closed
}

// DefaultHoldTimeout is Config.HoldTimeout's default (tetherd
// --pause-timeout's).
const DefaultHoldTimeout = 5 * time.Minute

// New returns a serving fleet.
func New(cfg Config) *Fleet {
	if cfg.MaxHeldPerWorker <= 0 {
		cfg.MaxHeldPerWorker = 1024
	}
	if cfg.HoldTimeout <= 0 {
		cfg.HoldTimeout = DefaultHoldTimeout
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	f := &Fleet{cfg: cfg, versions: map[string]string{}, updating: map[string]bool{}, since: cfg.Now()}
	if cfg.Table != nil {
		cfg.Table.SetHook(f.onChange)
	}
	return f
}

// Phase returns the phase in effect.
func (f *Fleet) Phase() Phase { return Phase(f.phase.Load()) }

// Timeout bounds a request's time in the hold.
func (f *Fleet) Timeout() time.Duration { return f.cfg.HoldTimeout }

// safe reports whether a method never generates (never held).
func safe(method []byte) bool {
	switch string(method) {
	case "GET", "HEAD", "OPTIONS":
		return true
	}
	return false
}

// Bypass are the paths of engine control calls a trainer may send while
// the fleet is paused (so they are never held), besides tetherd's own:
// their engines serve them paused, and holding them would deadlock the
// trainer that waits for them before it resumes.
var Bypass = map[string]bool{
	"/collective_rpc": true, "/weight_checker": true, "/start_draft_weight_update": true,
	"/get_weights_by_name": true, "/load_lora_adapter": true, "/unload_lora_adapter": true,
	"/v1/load_lora_adapter": true, "/v1/unload_lora_adapter": true,
	"/tokenize": true, "/detokenize": true, "/v1/tokenize": true, "/v1/detokenize": true,
	"/get_world_size": true, "/fetch_weights": true,
	"/init_weights_send_group_for_remote_instance": true, "/send_weights_to_remote_instance": true,
}

// Held reports whether req must wait now: the fleet is not serving, or w
// (nil: not routed yet) is fenced, or this tetherd is retiring (Forward).
// Serving and unfenced, it is one atomic load or two.
func (f *Fleet) Held(req *httphead.Request, w *route.Worker) bool {
	fw := f.forward.Load()
	if fw == nil && f.phase.Load() == int32(Serving) && (w == nil || w.Fenced() == 0) {
		return false
	}
	if w != nil && w == fw {
		return false
	}
	return !safe(req.Method) && !bypass(req.Path)
}

// bypass reports whether path (its query cut) is a control call never held.
func bypass(path []byte) bool {
	for i, c := range path {
		if c == '?' {
			path = path[:i]
			break
		}
	}
	return Bypass[string(path)]
}

func (f *Fleet) clearLocked(w *route.Worker) bool {
	return f.forward.Load() != nil || f.Phase() == Serving && (w == nil || w.Fenced() == 0)
}

// Forward hands every held request, now and from now on, to w (nil: no
// more): a tetherd that retires after an upgrade while the fleet is held
// sends them to its successor through the data port, where they are held
// again until the resume, instead of keeping them until its pause timeout.
func (f *Fleet) Forward(w *route.Worker) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.forward.Store(w)
	if w != nil {
		f.wakeLocked()
	}
}

// Forwarding returns where held requests go instead (nil: they wait).
func (f *Fleet) Forwarding() *route.Worker { return f.forward.Load() }

// Wait holds a request until the fleet serves and w (nil: any) is not
// fenced, or something changed that may free it (a fence lifted, a worker
// added, a phase changed: the caller routes it again and asks Held
// again, so a worker removed or replaced meanwhile is not waited for),
// gone closes, or until passes. Waiters are woken in arrival order.
func (f *Fleet) Wait(w *route.Worker, gone <-chan struct{}, until time.Time) route.HoldResult {
	f.mu.Lock()
	if f.clearLocked(w) {
		f.mu.Unlock()
		return route.HoldReleased
	}
	if len(f.waiters) >= f.maxHeldLocked() {
		f.mu.Unlock()
		f.full.Add(1)
		return route.HoldFull
	}
	wt := &waiter{ch: make(chan struct{})}
	f.waiters = append(f.waiters, wt)
	f.heldTotal.Add(1)
	f.mu.Unlock()
	d := until.Sub(f.cfg.Now())
	if d < 0 {
		d = 0
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-wt.ch:
		f.released.Add(1)
		return route.HoldReleased
	case <-t.C:
		f.drop(wt)
		f.timeouts.Add(1)
		return route.HoldTimeout
	case <-gone:
		f.drop(wt)
		f.left.Add(1)
		return route.HoldLeft
	}
}

// drop removes a waiter that stopped waiting.
func (f *Fleet) drop(wt *waiter) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, x := range f.waiters {
		if x == wt {
			f.waiters = append(f.waiters[:i], f.waiters[i+1:]...)
			return
		}
	}
}

func (f *Fleet) maxHeldLocked() int {
	n := 0
	if f.cfg.Table != nil {
		for _, w := range f.cfg.Table.Snapshot() {
			if w != nil {
				n++
			}
		}
	}
	return f.cfg.MaxHeldPerWorker * max(n, 1)
}

// wakeLocked wakes every waiter, in arrival order: each checks whether
// it may go (f.mu held).
func (f *Fleet) wakeLocked() {
	ws := f.waiters
	f.waiters = nil
	for _, wt := range ws {
		if !wt.done {
			wt.done = true
			close(wt.ch)
		}
	}
}

// Held returns how many requests wait in the hold now.
func (f *Fleet) HeldNow() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.waiters)
}

// Counts are the hold's totals.
type Counts struct {
	Held, Released, Full, Timeouts uint64
	Cycles                         uint64
}

// Counts returns the hold's totals.
func (f *Fleet) Counts() Counts {
	f.mu.Lock()
	c := f.cycles
	f.mu.Unlock()
	return Counts{Held: f.heldTotal.Load(), Released: f.released.Load(), Full: f.full.Load(), Timeouts: f.timeouts.Load(), Cycles: c}
}

// --- phases ---

// effectiveLocked recomputes the phase in effect from this replica's,
// the cluster's and the link's (f.mu held), and wakes the hold if it
// became serving.
func (f *Fleet) effectiveLocked() {
	p := f.local
	if f.remote > p {
		p = f.remote
	}
	if f.linkDown && p == Serving {
		p = Paused
	}
	old := Phase(f.phase.Swap(int32(p)))
	if old != p {
		f.since = f.cfg.Now()
	}
	if p == Serving {
		f.wakeLocked()
	}
}

// SetPhase sets this replica's phase (mode: the pause's mode, as asked).
// A pause that begins counts a cycle.
func (f *Fleet) SetPhase(p Phase, mode string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.setPhaseLocked(p, mode)
}

func (f *Fleet) setPhaseLocked(p Phase, mode string) {
	if p != Serving && f.local == Serving {
		f.cycles++
	}
	if p == Serving {
		mode = ""
	}
	if p != f.local && p != Paused {
		f.round = "" // a pause or a resume begins a new sync
	}
	f.local, f.mode = p, mode
	f.effectiveLocked()
}

// BeginPause starts a pause (phase pausing: new requests are held from
// now on) and returns its number, for PauseState and FinishPause.
func (f *Fleet) BeginPause(mode string) uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.pauseSeq++
	f.setPhaseLocked(Pausing, mode)
	return f.pauseSeq
}

// PauseState says what became of pause seq while it ran.
type PauseState int

const (
	PauseOurs       PauseState = iota // still pausing: this pause is in charge
	PauseSuperseded                   // another pause began since: it is in charge
	PauseResumed                      // a resume (here or through another replica) ended it
)

// PauseState reports what became of pause seq.
func (f *Fleet) PauseState(seq uint64) PauseState {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.pauseStateLocked(seq)
}

func (f *Fleet) pauseStateLocked(seq uint64) PauseState {
	switch {
	case f.local == Serving:
		return PauseResumed
	case f.pauseSeq != seq:
		return PauseSuperseded
	}
	return PauseOurs
}

// FinishPause makes pause seq's phase paused if it is still in charge,
// and reports what became of it.
func (f *Fleet) FinishPause(seq uint64) PauseState {
	f.mu.Lock()
	defer f.mu.Unlock()
	st := f.pauseStateLocked(seq)
	if st == PauseOurs {
		f.setPhaseLocked(Paused, f.mode)
	}
	return st
}

// RoundVersion returns the version name for a weights update that names
// none: the same through one sync (every per-engine call of it), a new
// one after the phase changed or a fleet-wide update closed the round
// (CloseRound). Names are unique across processes and replicas.
func (f *Fleet) RoundVersion() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.round == "" {
		// The time (unique across processes and replicas) and a count
		// (unique within this one, whatever the clock's grain).
		f.rounds++
		f.round = "tether-" + strconv.FormatInt(f.cfg.Now().UnixNano(), 36) + "." + strconv.FormatUint(f.rounds, 10)
	}
	return f.round
}

// CloseRound ends the current round: the next unnamed update gets a new
// name.
func (f *Fleet) CloseRound() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.round = ""
}

// LocalPhase returns the phase this replica set (not the cluster's).
func (f *Fleet) LocalPhase() (Phase, string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.local, f.mode
}

// SetRemote sets the phase the cluster store says (another replica's
// pause) and whether this replica can see the store at all: a replica
// that cannot holds rather than admits, since it cannot know whether a
// sync began.
func (f *Fleet) SetRemote(p Phase, linkDown bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.remote, f.linkDown = p, linkDown
	f.effectiveLocked()
}

// --- weight versions and fences ---

// onChange runs as the table's membership changes. A worker put into it
// is fenced before it is routable (Putting) and again once it is
// (PutDone: a target set in between reached it too) if the fleet has a
// target and the worker's version differs or is unknown. Once a worker is
// in the table or removed, held requests are woken to be placed again (it
// may be theirs, or theirs may be gone).
func (f *Fleet) onChange(w *route.Worker, ev route.TableEvent) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if ev == route.Removed {
		if len(f.waiters) > 0 {
			f.wakeLocked()
		}
		return
	}
	f.fenceLocked(w)
	if ev == route.Putting {
		return
	}
	if f.target != "" && f.versions[w.URL] == "" && f.ask != nil {
		go f.ask(w)
	}
	if len(f.waiters) > 0 {
		f.wakeLocked()
	}
}

func (f *Fleet) fenceLocked(w *route.Worker) {
	if f.updating[w.URL] {
		w.Fence(route.FenceUpdating)
	} else {
		w.Unfence(route.FenceUpdating)
	}
	if f.target != "" && f.versions[w.URL] != f.target {
		w.Fence(route.FenceVersion)
	} else {
		w.Unfence(route.FenceVersion)
	}
}

// refenceLocked recomputes every worker's fence and wakes the hold if
// some worker became free (f.mu held).
func (f *Fleet) refenceLocked() {
	if f.cfg.Table == nil {
		return
	}
	freed := false
	for _, w := range f.cfg.Table.Snapshot() {
		if w == nil {
			continue
		}
		before := w.Fenced()
		f.fenceLocked(w)
		if before != 0 && w.Fenced() == 0 {
			freed = true
		}
	}
	if freed {
		f.wakeLocked()
	}
}

// Updating fences (true) or frees (false) a worker while a weight update
// call runs on it.
func (f *Fleet) Updating(w *route.Worker, on bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if on {
		f.updating[w.URL] = true
	} else {
		delete(f.updating, w.URL)
	}
	f.refenceLocked()
}

// SetVersion records a worker's weight version.
func (f *Fleet) SetVersion(url, v string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.versions[url] = v
	f.refenceLocked()
}

// SetVersions records workers' versions and sets the target, at once
// (the cluster's fleet key): no worker is fenced in between.
func (f *Fleet) SetVersions(target string, versions map[string]string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for u, v := range versions {
		f.versions[u] = v
	}
	f.target = target
	f.refenceLocked()
}

// Version returns a worker's weight version ("": unknown).
func (f *Fleet) Version(url string) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.versions[url]
}

// SetTarget sets the fleet's weight version: a worker at another version
// takes no new work until it matches. "" lifts the gate.
func (f *Fleet) SetTarget(v string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.target = v
	f.refenceLocked()
}

// Target returns the fleet's weight version ("": none set).
func (f *Fleet) Target() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.target
}

// --- state for upgrades and the cluster ---

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

// --- the report (GET /fleet) ---

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
func (f *Fleet) WorkerState(w *route.Worker) string {
	fb := w.Fenced()
	switch {
	case fb&route.FenceUpdating != 0:
		return "updating"
	case fb&route.FenceVersion != 0:
		return "fenced"
	case f.Phase() != Serving:
		return "paused"
	}
	switch w.BaseState() {
	case route.Unhealthy:
		return "unhealthy"
	case route.Draining:
		return "draining"
	}
	return "serving"
}

// Report returns the fleet as GET /fleet shows it.
func (f *Fleet) Report() Report {
	var ws []*route.Worker
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

// SetUpdateOpen records that a chunked (vLLM start/finish) weight update
// is open: the workers stay fenced as updating until it closes, or until
// bound passes (a trainer that died mid-update does not fence the fleet
// for good).
func (f *Fleet) SetUpdateOpen(on bool, bound time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.open = on
	f.openSeq++
	if !on || bound <= 0 {
		return
	}
	seq := f.openSeq
	time.AfterFunc(bound, func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		if f.open && f.openSeq == seq {
			f.open = false
			clear(f.updating)
			f.refenceLocked()
		}
	})
}

// UpdateOpen reports whether a chunked weight update is open.
func (f *Fleet) UpdateOpen() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.open
}
