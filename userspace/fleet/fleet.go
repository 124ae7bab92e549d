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
// control calls a trainer may make while the fleet is paused
// (dialect.IsNeverHeld: collective RPCs, LoRA adapters, tokenizing, ...),
// and tetherd's own
// control endpoints are answered by tetherd, never proxied.
package fleet

import (
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tether-rl/tether/userspace/config"
	"github.com/tether-rl/tether/userspace/worker"
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
	Table *worker.Table
	// MaxHeldPerWorker bounds the hold: at most this many requests per
	// worker in the table (at least this many in all) wait at once; past
	// it 503 with Retry-After. Default 1024 (--max-queue).
	MaxHeldPerWorker int
	// Settings: HoldTimeout (--pause-timeout).
	Settings
	// Now is the clock (tests); default time.Now.
	Now func() time.Time
}

// Fleet is the sync state of one tetherd (in cluster mode, kept equal on
// every replica through the cluster store).
type Fleet struct {
	cfg Config

	// phase is read on every request that may generate: atomic.
	phase atomic.Int32
	// holds counts the times the phase in effect left serving (a pause
	// here or through another replica, a lost store link): Holds.
	holds atomic.Uint64
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
	// open: an update that opens (dialect.OpenUpdate) was fanned out
	// and the one that closes it not yet: the weights are in flux.
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
	forward atomic.Pointer[worker.Worker]

	// ask, when set, asks a worker its weight version (userspace/engine,
	// in the engine's words) and records it: a worker that
	// joins with the fleet's weights is unfenced without an update.
	ask func(w *worker.Worker)
}

// SetAsk sets how a joining worker of unknown version is asked its
// version (in the background).
func (f *Fleet) SetAsk(ask func(w *worker.Worker)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ask = ask
}

type waiter struct {
	ch   chan struct{}
	done bool // ch closed
}

// DefaultHoldTimeout is Settings.HoldTimeout's default (tetherd
// --pause-timeout's).
const DefaultHoldTimeout = 5 * time.Minute

// Settings are the fleet's settings (tetherd's --pause-timeout), apart
// from the wiring (Config). Zero fields take the defaults (Provision).
type Settings struct {
	// HoldTimeout bounds one request's time in the hold;
	// DefaultHoldTimeout.
	HoldTimeout time.Duration
}

// DefaultSettings is Settings with every field at its default.
func DefaultSettings() Settings {
	var s Settings
	s.Provision()
	return s
}

// Provision fills s's zero (or negative) fields with the defaults.
func (s *Settings) Provision() {
	if s.HoldTimeout <= 0 {
		s.HoldTimeout = DefaultHoldTimeout
	}
}

// Validate refuses a negative setting (zero is the default), naming
// tetherd's flag (settings, flags.go).
func (s Settings) Validate() error { return config.Validate(s.settings()) }

// New returns a serving fleet.
func New(cfg Config) *Fleet {
	if cfg.MaxHeldPerWorker <= 0 {
		cfg.MaxHeldPerWorker = 1024
	}
	cfg.Settings.Provision()
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

// Holds reports how many times the phase in effect has left serving, and
// whether it holds now: a request's work that failed while this changed
// (or while it holds) may have been aborted by a pause, not by its
// engine's fault.
func (f *Fleet) Holds() (n uint64, holding bool) {
	return f.holds.Load(), f.Phase() != Serving
}

// Timeout bounds a request's time in the hold.
func (f *Fleet) Timeout() time.Duration { return f.cfg.HoldTimeout }

// Phases.

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
		if old == Serving {
			f.holds.Add(1)
		}
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
