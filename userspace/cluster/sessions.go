package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/tether-rl/tether/userspace/sticky"
)

// Shared sessions (--cluster-share-sessions): the sticky table (learned
// bare session ids, sticky assignments, remembered spills) stays local for
// every lookup, and each new or changed assignment is also written to etcd
// under sessions/<key hash, 16 hex digits>, on a lease as long as its TTL;
// every replica watches that prefix and copies what the others wrote into
// its own table. The data path never waits for etcd: writes go through a
// bounded queue to one writer goroutine that commits what is queued in
// one transaction (a full queue drops and counts).
//
// The value names the worker by identity (worker.ID of its URL, the
// same on every replica) and slot, and carries the TTL left: expiry times
// are CLOCK_MONOTONIC and mean nothing on another host.

type sharedEntry struct {
	Worker uint32 `json:"w"`
	ID     uint32 `json:"id"`
	TTL    int64  `json:"ttl"` // ns left when written
}

// SharedSessions is a sticky.Table whose assignments every replica sees.
type SharedSessions struct {
	local sticky.Table
	store *Store
	log   *slog.Logger

	queue   chan op
	dropped atomic.Uint64
	written atomic.Uint64
	copied  atomic.Uint64

	leaseMu sync.Mutex
	leases  map[int64]leaseBucket // by TTL in seconds

	cancel context.CancelFunc
	done   sync.WaitGroup
}

type op struct {
	key    uint64
	e      sticky.Entry
	delete bool
}

type leaseBucket struct {
	id      clientv3.LeaseID
	expires time.Time // when entries on it vanish (at the earliest)
}

// ShareSessions wraps local; Close stops the writer and the watch.
func ShareSessions(store *Store, local sticky.Table, log *slog.Logger) *SharedSessions {
	ctx, cancel := context.WithCancel(context.Background())
	s := &SharedSessions{local: local, store: store, log: log, queue: make(chan op, 16384),
		leases: map[int64]leaseBucket{}, cancel: cancel}
	s.done.Add(2)
	go s.writer(ctx)
	go s.watch(ctx)
	return s
}

func (s *SharedSessions) prefix() string { return s.store.prefix + "sessions/" }

// Close stops sharing (the local table stays with its owner).
func (s *SharedSessions) Close() error {
	s.cancel()
	s.done.Wait()
	if c, ok := s.local.(interface{ Close() error }); ok {
		return c.Close()
	}
	return nil
}

// Counts: assignments written to etcd, copied from other replicas, and
// dropped because the queue was full.
func (s *SharedSessions) Counts() (written, copied, dropped uint64) {
	return s.written.Load(), s.copied.Load(), s.dropped.Load()
}

func (s *SharedSessions) publish(o op) {
	select {
	case s.queue <- o:
	default:
		s.dropped.Add(1)
	}
}

// Lookup reads the local table (the watch keeps it current).
func (s *SharedSessions) Lookup(key uint64) (sticky.Entry, bool) { return s.local.Lookup(key) }

// Insert stores e unless key has an entry, and shares it when stored.
func (s *SharedSessions) Insert(key uint64, e sticky.Entry) (sticky.Entry, bool) {
	cur, ok := s.local.Insert(key, e)
	if ok {
		s.publish(op{key: key, e: e})
	}
	return cur, ok
}

// Put stores e and shares it when it names another worker than the entry
// it replaces, or renews an entry whose shared copy would soon expire.
func (s *SharedSessions) Put(key uint64, e sticky.Entry) {
	old, had := s.local.Lookup(key)
	s.local.Put(key, e)
	now := sticky.Now()
	if had && old.ID == e.ID && old.Worker == e.Worker && old.Live(now) && old.Expires-now > (e.Expires-now)/2 {
		return // a TTL refresh: the shared copy still has more than half to live
	}
	s.publish(op{key: key, e: e})
}

// Delete removes key here and everywhere.
func (s *SharedSessions) Delete(key uint64) bool {
	ok := s.local.Delete(key)
	s.publish(op{key: key, delete: true})
	return ok
}

// Errors counts the local table's failures.
func (s *SharedSessions) Errors() uint64 { return s.local.Errors() }

// Shared: the table is seen beyond this process.
func (s *SharedSessions) Shared() bool { return true }

// Range walks the local copy (every replica's assignments are copied in).
func (s *SharedSessions) Range(f func(key uint64, e sticky.Entry) bool) {
	if r, ok := s.local.(sticky.Ranger); ok {
		r.Range(f)
	}
}

// lease returns a lease on which an entry lives at least ttl: one per TTL
// (in seconds), replaced once it has less than ttl left, so an entry lives
// between ttl and 1.25 × ttl.
func (s *SharedSessions) lease(ctx context.Context, ttl time.Duration) (clientv3.LeaseID, error) {
	secs := int64(ttl/time.Second) + 1
	s.leaseMu.Lock()
	defer s.leaseMu.Unlock()
	if b, ok := s.leases[secs]; ok && time.Until(b.expires) > ttl {
		return b.id, nil
	}
	grant := secs + secs/4 + 1
	lctx, cancel := s.store.ctx(ctx)
	defer cancel()
	l, err := s.store.cli.Grant(lctx, grant)
	if err != nil {
		return 0, unavailable(err)
	}
	s.leases[secs] = leaseBucket{id: l.ID, expires: time.Now().Add(time.Duration(grant) * time.Second)}
	return l.ID, nil
}

func (s *SharedSessions) key(k uint64) string { return fmt.Sprintf("%s%016x", s.prefix(), k) }

// maxBatch: queued assignments written in one transaction (etcd's
// default --max-txn-ops is 128).
const maxBatch = 128

// writer writes the queued assignments to etcd, batched: whatever is
// queued when it is free goes in one transaction.
func (s *SharedSessions) writer(ctx context.Context) {
	defer s.done.Done()
	batch := make([]op, 0, maxBatch)
	for {
		batch = batch[:0]
		select {
		case <-ctx.Done():
			return
		case o := <-s.queue:
			batch = append(batch, o)
		}
	more:
		for len(batch) < maxBatch {
			select {
			case o := <-s.queue:
				batch = append(batch, o)
			default:
				break more
			}
		}
		ops := make([]clientv3.Op, 0, len(batch))
		var err error
		for _, o := range batch {
			if o.delete {
				ops = append(ops, clientv3.OpDelete(s.key(o.key)))
				continue
			}
			ttl := time.Duration(o.e.Expires - sticky.Now())
			if ttl <= 0 {
				continue
			}
			var lease clientv3.LeaseID
			if lease, err = s.lease(ctx, ttl); err != nil {
				break
			}
			v, _ := json.Marshal(sharedEntry{Worker: o.e.Worker, ID: o.e.ID, TTL: int64(ttl)})
			ops = append(ops, clientv3.OpPut(s.key(o.key), string(v), clientv3.WithLease(lease)))
		}
		if err == nil && len(ops) > 0 {
			wctx, cancel := s.store.ctx(ctx)
			_, err = s.store.cli.Txn(wctx).Then(ops...).Commit()
			cancel()
		}
		if err != nil {
			s.dropped.Add(uint64(len(batch)))
			continue
		}
		s.written.Add(uint64(len(ops)))
	}
}

// watch copies the other replicas' assignments into the local table (its
// own come back too, and are the same).
func (s *SharedSessions) watch(ctx context.Context) {
	defer s.done.Done()
	for ctx.Err() == nil {
		lctx, cancel := s.store.ctx(ctx)
		resp, err := s.store.cli.Get(lctx, s.prefix(), clientv3.WithPrefix())
		cancel()
		if err != nil {
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Second):
			}
			continue
		}
		for _, kv := range resp.Kvs {
			s.apply(kv.Key, kv.Value, false)
		}
		wch := s.store.cli.Watch(clientv3.WithRequireLeader(ctx), s.prefix(), clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1))
		for wr := range wch {
			if wr.Err() != nil {
				break
			}
			for _, ev := range wr.Events {
				s.apply(ev.Kv.Key, ev.Kv.Value, ev.Type == clientv3.EventTypeDelete)
			}
		}
	}
}

func (s *SharedSessions) apply(key, value []byte, deleted bool) {
	hexKey, ok := strings.CutPrefix(string(key), s.prefix())
	if !ok {
		return
	}
	k, err := strconv.ParseUint(hexKey, 16, 64)
	if err != nil {
		return
	}
	if deleted {
		s.local.Delete(k)
		return
	}
	var e sharedEntry
	if json.Unmarshal(value, &e) != nil || e.TTL <= 0 {
		return
	}
	cur, had := s.local.Lookup(k)
	if had && cur.ID == e.ID && cur.Worker == e.Worker && cur.Live(sticky.Now()) {
		return // already known (our own write, or a renewal)
	}
	s.local.Put(k, sticky.Entry{Worker: e.Worker, ID: e.ID, Expires: sticky.Now() + e.TTL})
	s.copied.Add(1)
}
