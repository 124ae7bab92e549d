package sticky

import (
	"errors"
	"fmt"
	"sync/atomic"
	"unsafe"

	"github.com/cilium/ebpf"

	"github.com/tether-rl/tether/bpf"
)

// MapName is the name of the map in bpf/steer.c and of its pin.
const MapName = "sticky_sessions"

// bpfValue mirrors struct tether_sticky in headers/tether.h.
type bpfValue struct {
	Worker    uint32
	WorkerID  uint32
	ExpiresNs uint64
}

// MapSpec returns the spec of sticky_sessions as bpf/steer.c declares it
// (an LRU hash, u64 -> struct tether_sticky, TETHER_MAX_STICKY entries,
// pinned by name), for tests and for OpenPinned.
func MapSpec() *ebpf.MapSpec {
	return &ebpf.MapSpec{
		Name:       MapName,
		Type:       ebpf.LRUHash,
		KeySize:    8,
		ValueSize:  uint32(unsafe.Sizeof(bpfValue{})),
		MaxEntries: MaxEntries,
		Pinning:    ebpf.PinByName,
	}
}

// BPF is the table kept in a sticky_sessions map: every process holding the
// map sees one table. Each operation is one map syscall.
type BPF struct {
	m      *ebpf.Map
	owned  bool // Close closes m
	errors atomic.Uint64
}

var _ Table = (*BPF)(nil)

// NewBPF returns the table kept in m (typically (*bpf.Steering).StickyMap(),
// or a throwaway map of MapSpec in tests). m stays the caller's.
func NewBPF(m *ebpf.Map) (*BPF, error) {
	if m == nil {
		return nil, errors.New("sticky: nil map")
	}
	spec := MapSpec()
	if m.Type() != spec.Type || m.KeySize() != spec.KeySize || m.ValueSize() != spec.ValueSize {
		return nil, fmt.Errorf("sticky: map %v is %v key %d value %d, want %v key %d value %d",
			m, m.Type(), m.KeySize(), m.ValueSize(), spec.Type, spec.KeySize, spec.ValueSize)
	}
	return &BPF{m: m}, nil
}

// OpenPinned opens the sticky_sessions map pinned in pinDir (a bpffs
// directory such as bpf.DefaultPinDir), creating and pinning it if no
// process did yet. The steering program, when loaded later with the same
// pin directory, reuses it. Close releases the descriptor; the pin stays.
func OpenPinned(pinDir string) (*BPF, error) {
	if err := bpf.EnsurePinDir(pinDir); err != nil {
		return nil, fmt.Errorf("sticky: %w", err)
	}
	m, err := ebpf.NewMapWithOptions(MapSpec(), ebpf.MapOptions{PinPath: pinDir})
	if err != nil {
		return nil, fmt.Errorf("sticky: open %s in %s: %w", MapName, pinDir, err)
	}
	t, err := NewBPF(m)
	if err != nil {
		m.Close()
		return nil, err
	}
	t.owned = true
	return t, nil
}

// Close releases the map descriptor if OpenPinned opened it.
func (t *BPF) Close() error {
	if t.owned {
		return t.m.Close()
	}
	return nil
}

// Map returns the underlying map.
func (t *BPF) Map() *ebpf.Map { return t.m }

// Lookup implements Table.
func (t *BPF) Lookup(key uint64) (Entry, bool) {
	var v bpfValue
	if err := t.m.Lookup(&key, &v); err != nil {
		if !errors.Is(err, ebpf.ErrKeyNotExist) {
			t.errors.Add(1)
		}
		return Entry{}, false
	}
	return Entry{Worker: v.Worker, ID: v.WorkerID, Expires: int64(v.ExpiresNs)}, true
}

// Insert implements Table (BPF_NOEXIST, then a lookup of the winner).
func (t *BPF) Insert(key uint64, e Entry) (Entry, bool) {
	v := bpfValue{Worker: e.Worker, WorkerID: e.ID, ExpiresNs: uint64(e.Expires)}
	err := t.m.Update(&key, &v, ebpf.UpdateNoExist)
	if err == nil {
		return e, true
	}
	if !errors.Is(err, ebpf.ErrKeyExist) {
		t.errors.Add(1)
		return e, true // not stored: route this request as assigned anyway
	}
	if cur, ok := t.Lookup(key); ok {
		return cur, false
	}
	// Evicted or deleted in between: take it.
	t.Put(key, e)
	return e, true
}

// Put implements Table.
func (t *BPF) Put(key uint64, e Entry) {
	v := bpfValue{Worker: e.Worker, WorkerID: e.ID, ExpiresNs: uint64(e.Expires)}
	if err := t.m.Update(&key, &v, ebpf.UpdateAny); err != nil {
		t.errors.Add(1)
	}
}

// Delete implements Table.
func (t *BPF) Delete(key uint64) bool {
	err := t.m.Delete(&key)
	if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.errors.Add(1)
	}
	return err == nil
}

// Errors implements Table.
func (t *BPF) Errors() uint64 { return t.errors.Load() }

// Shared implements Table: true.
func (t *BPF) Shared() bool { return true }
