// Package sticky is the table of key -> owning worker that routing keeps:
// the assignments of --policy=sticky, the remembered spills of
// --policy=hash and the learned bare session ids (each under its own key
// hash), with the worker's slot and identity and a CLOCK_MONOTONIC expiry.
//
// Two implementations share one interface and one semantics:
//
//   - BPF: the sticky_sessions BPF_MAP_TYPE_LRU_HASH of bpf/steer.c (u64 key
//     -> struct tether_sticky), pinned in bpffs, so that every tetherd process
//     of the host and the next one after an upgrade see the same table.
//   - Memory: an in-process LRU of the same capacity, used when BPF is off.
//
// The table only stores; the policy (route/policy_sticky.go) decides when an
// entry is stale (expired, or its worker gone or unhealthy), when to refresh
// a TTL (at most every few seconds) and what to assign on a miss. Expiry
// times are CLOCK_MONOTONIC nanoseconds (bpf_ktime_get_ns), see Now, so that
// processes agree on them.
package sticky

import (
	"time"

	"golang.org/x/sys/unix"
)

// MaxEntries is the capacity of a table: TETHER_MAX_STICKY in
// headers/tether.h (bpf.MaxSticky).
const MaxEntries = 65536

// Entry is one key's owner.
type Entry struct {
	Worker uint32 // worker slot (where the worker was when stored)
	// ID is the worker's identity (worker.ID of its URL): the entry
	// names the worker, not its slot, so it is stale once another worker
	// holds the slot and follows its worker to another slot. 0: an entry of
	// a tetherd that stored no identity, which matches no worker.
	ID      uint32
	Expires int64 // CLOCK_MONOTONIC deadline, ns (see Now)
}

// Live reports whether e has not expired at now.
func (e Entry) Live(now int64) bool { return e.Expires > now }

// Table maps routing key hashes to owners. Implementations are safe for
// concurrent use and bounded (least recently used entries are evicted).
// Lookup returns entries whether expired or not: the caller judges them.
type Table interface {
	// Lookup returns the entry of key.
	Lookup(key uint64) (Entry, bool)
	// Insert stores e under key unless key has an entry; then it returns
	// that entry and false.
	Insert(key uint64, e Entry) (Entry, bool)
	// Put stores e under key, replacing any entry.
	Put(key uint64, e Entry)
	// Delete removes key's entry and reports whether there was one.
	Delete(key uint64) bool
	// Errors counts failed operations (BPF map syscalls other than "no
	// such key"); a failed lookup reads as a miss, a failed store is
	// dropped.
	Errors() uint64
	// Shared reports whether other processes see the table (BPF).
	Shared() bool
}

// Monotonic clock: CLOCK_MONOTONIC, read once, then advanced with Go's
// monotonic clock (which is CLOCK_MONOTONIC too, through the vDSO) instead
// of a clock_gettime syscall per request.
var (
	monoBase  int64
	monoStart time.Time
)

func init() {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err == nil {
		monoBase = ts.Nano()
	}
	monoStart = time.Now()
}

// Now returns CLOCK_MONOTONIC in nanoseconds, the clock of bpf_ktime_get_ns
// and of Entry.Expires.
func Now() int64 { return monoBase + int64(time.Since(monoStart)) }
