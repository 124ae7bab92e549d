// Package kvindex is the index of what each engine's KV cache holds, built
// from the engines' own KV-cache events (package kvevents) and keyed by
// tether's chained hash of token ids (hash.go), per LoRA adapter: for a
// request's token ids (scan.go, read from the body without a tokenizer) it
// tells how many leading blocks each engine holds. A block held by several
// engines is one table entry with one bit per engine, and one entry in
// each engine's map from its own block hash (used to find a stored block's
// parent and to apply removals). Memory is bounded by Config.MaxEntries
// (engine × block pairs); stores past it are dropped and counted.
//
// Engines are (worker, data-parallel rank) pairs, at most MaxEngines at
// once, each registered under a name (Register) and cleared on its
// engine's restart, a lost publisher, AllBlocksCleared or removal.
package kvindex

import (
	"errors"
	"sync"
	"sync/atomic"

	"github.com/tether-rl/tether/userspace/kvevents"
)

// MaxEngines is how many engines (worker × DP rank) one index tracks.
const MaxEngines = 64

// DefaultMaxEntries bounds engine × block entries: 4 Mi, about 8 engines
// with half a million cached blocks each (~ 200 MiB at the figure of
// BenchmarkMemoryPerBlock).
const DefaultMaxEntries = 4 << 20

// maxBlockSize bounds the block size the index takes from events (the
// scanner's block buffer; hybrid models use 768).
const maxBlockSize = 1024

// EngineID names an engine in the index: 0..MaxEngines-1.
type EngineID uint8

// Config is the index's settings.
type Config struct {
	MaxEntries int // 0: DefaultMaxEntries
}

// Index is safe for concurrent use: lookups share a read lock, a batch of
// events takes the write lock once.
type Index struct {
	mu      sync.RWMutex
	tab     table
	engines [MaxEngines]*engine
	names   map[string]EngineID
	live    atomic.Uint64 // bits of the registered engines
	entries int           // engine × block pairs
	max     int

	blockSize atomic.Int32
	loras     atomic.Pointer[map[string]bool] // adapter names seen in events

	capDrops   atomic.Uint64 // stores dropped at MaxEntries
	orphans    atomic.Uint64 // stored blocks whose parent the engine never announced
	mismatched atomic.Uint64 // events with another block size, or tokens not a whole number of blocks
	credits    creditTable
}

type engine struct {
	name   string
	bit    uint64
	hashes map[uint64]uint64 // the engine's block hash -> index key
	// counters, read without the lock
	stored, removed, cleared atomic.Uint64
	blocks                   atomic.Int64
}

// New returns an empty index.
func New(cfg Config) *Index {
	if cfg.MaxEntries <= 0 {
		cfg.MaxEntries = DefaultMaxEntries
	}
	x := &Index{tab: newTable(1024), names: map[string]EngineID{}, max: cfg.MaxEntries}
	x.credits.init()
	m := map[string]bool{}
	x.loras.Store(&m)
	return x
}

// ErrFull: MaxEngines engines are registered.
var ErrFull = errors.New("kvindex: too many engines")

// Register returns the id of the engine named name, adding it (empty) if
// new.
func (x *Index) Register(name string) (EngineID, error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if id, ok := x.names[name]; ok {
		return id, nil
	}
	for i, e := range x.engines {
		if e == nil {
			x.engines[i] = &engine{name: name, bit: 1 << uint(i), hashes: map[uint64]uint64{}}
			x.names[name] = EngineID(i)
			x.live.Store(x.live.Load() | 1<<uint(i))
			return EngineID(i), nil
		}
	}
	return 0, ErrFull
}

// Unregister clears the engine and frees its id.
func (x *Index) Unregister(id EngineID) {
	x.mu.Lock()
	defer x.mu.Unlock()
	e := x.engines[id]
	if e == nil {
		return
	}
	x.credits.forget(id)
	x.clearLocked(e)
	delete(x.names, e.name)
	x.engines[id] = nil
	x.live.Store(x.live.Load() &^ e.bit)
}

// Clear drops everything the engine holds (a restart, a lost publisher,
// AllBlocksCleared, an unhealthy or fenced worker).
func (x *Index) Clear(id EngineID) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.credits.forget(id) // before the entries: no reader sees one without the other
	if e := x.engines[id]; e != nil {
		x.clearLocked(e)
	}
}

func (x *Index) clearLocked(e *engine) {
	for _, k := range e.hashes {
		x.tab.andNot(k, e.bit)
	}
	x.entries -= len(e.hashes)
	e.hashes = map[uint64]uint64{}
	e.blocks.Store(0)
	e.cleared.Add(1)
}

// Apply applies a batch's events from engine id. Events about an offload
// tier (medium other than the device) are skipped.
func (x *Index) Apply(id EngineID, evs []kvevents.Event) {
	x.mu.Lock()
	defer x.mu.Unlock()
	e := x.engines[id]
	if e == nil {
		return
	}
	for i := range evs {
		ev := &evs[i]
		if !ev.OnDevice() {
			continue
		}
		switch ev.Kind {
		case kvevents.Stored:
			x.storeLocked(e, ev)
		case kvevents.Removed:
			for _, h := range ev.Hashes {
				if k, ok := e.hashes[h]; ok {
					delete(e.hashes, h)
					x.tab.andNot(k, e.bit)
					x.entries--
					e.removed.Add(1)
				}
			}
			e.blocks.Store(int64(len(e.hashes)))
		case kvevents.Cleared:
			x.clearLocked(e)
		}
	}
}

func (x *Index) storeLocked(e *engine, ev *kvevents.Event) {
	n := len(ev.Hashes)
	if n == 0 {
		return
	}
	bs := ev.BlockSize
	if len(ev.Tokens)%n != 0 || (bs != 0 && len(ev.Tokens) != bs*n) {
		x.mismatched.Add(1)
		return
	}
	if bs == 0 {
		bs = len(ev.Tokens) / n
	}
	if bs <= 0 || bs > maxBlockSize {
		x.mismatched.Add(1)
		return
	}
	if cur := int(x.blockSize.Load()); cur == 0 {
		x.blockSize.Store(int32(bs))
	} else if cur != bs {
		x.mismatched.Add(1)
		return
	}
	salt := Salt(ev.LoRA)
	if ev.LoRA != "" {
		x.noteLoRA(ev.LoRA)
	}
	chain := uint64(rootChain)
	if ev.HasParent {
		pk, ok := e.hashes[ev.Parent]
		if !ok {
			x.orphans.Add(1)
			return
		}
		chain = pk ^ salt
	}
	for i, h := range ev.Hashes {
		chain = blockHash(chain, ev.Tokens[i*bs:(i+1)*bs])
		k := key(chain, salt)
		if old, ok := e.hashes[h]; ok {
			if old == k {
				continue
			}
			x.tab.andNot(old, e.bit) // the engine reused a hash for other tokens
			x.entries--
		}
		if x.entries >= x.max {
			delete(e.hashes, h)
			x.capDrops.Add(1)
			break
		}
		e.hashes[h] = k
		x.tab.or(k, e.bit)
		x.entries++
		e.stored.Add(1)
	}
	e.blocks.Store(int64(len(e.hashes)))
}

func (x *Index) noteLoRA(name string) {
	if (*x.loras.Load())[name] {
		return
	}
	old := *x.loras.Load()
	m := make(map[string]bool, len(old)+1)
	for k := range old {
		m[k] = true
	}
	m[name] = true
	x.loras.Store(&m)
}

// KnowsLoRA reports whether some event named this adapter (a vLLM request
// names its adapter in "model").
func (x *Index) KnowsLoRA(name []byte) bool { return (*x.loras.Load())[string(name)] }

// BlockSize is the block size learned from the events (0: none yet).
func (x *Index) BlockSize() int { return int(x.blockSize.Load()) }

// EngineStats is one engine's part of the index.
type EngineStats struct {
	Blocks                   int64  // blocks indexed now
	Stored, Removed, Cleared uint64 // blocks stored, removed; clears
}

// Engine returns the engine's counters (ok false: not registered).
func (x *Index) Engine(id EngineID) (EngineStats, bool) {
	x.mu.RLock()
	e := x.engines[id]
	x.mu.RUnlock()
	if e == nil {
		return EngineStats{}, false
	}
	return EngineStats{Blocks: e.blocks.Load(), Stored: e.stored.Load(), Removed: e.removed.Load(), Cleared: e.cleared.Load()}, true
}

// Stats is the whole index.
type Stats struct {
	Entries    int    // engine × block pairs
	Keys       int    // distinct blocks
	Bytes      int    // memory estimate: the table and the engines' maps
	MaxEntries int    // the cap
	CapDrops   uint64 // stores dropped at the cap
	Orphans    uint64 // stored blocks with an unknown parent
	Mismatched uint64 // events of another block size or malformed token runs
	BlockSize  int
}

// bytesPerMapEntry estimates a Go map[uint64]uint64 entry (16 bytes of
// key and value, a control byte, load factor 7/8, growth headroom).
const bytesPerMapEntry = 40

// Stats returns the index's figures.
func (x *Index) Stats() Stats {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return Stats{Entries: x.entries, Keys: x.tab.n, Bytes: x.tab.bytes() + bytesPerMapEntry*x.entries,
		MaxEntries: x.max, CapDrops: x.capDrops.Load(), Orphans: x.orphans.Load(),
		Mismatched: x.mismatched.Load(), BlockSize: x.BlockSize()}
}
