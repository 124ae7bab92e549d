// Package cluster keeps many tetherd replicas on one worker table through
// etcd: slot → worker, claimed with transactions, watched by every
// replica and applied to its local registry. Health stays local: each
// replica judges the workers it can reach (docs/cluster.md).
//
// Keys, under /tether/<name>/:
//
//	workers/<slot, 4 digits>   {"url":..., "draining":bool, "max_in_flight":n, "role":r, "bootstrap_port":p,
//	                            "kv_events":"tcp://host:port", "kv_events_replay":"tcp://host:port"}
//	urls/<canonical url, path-escaped>   the slot, decimal
//
// Both keys of a worker are written and deleted in one transaction; a
// self-registered worker attaches both to its lease, so they vanish
// together when it stops renewing.
package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
)

// Spec is a worker's entry in etcd.
type Spec struct {
	URL         string `json:"url"`
	Draining    bool   `json:"draining,omitempty"`
	MaxInFlight uint64 `json:"max_in_flight,omitempty"`
	// Role: "prefill" or "decode" in a P/D fleet ("": regular, or
	// learned by each replica from the engine); a prefill's bootstrap
	// port (0: unknown).
	Role          string `json:"role,omitempty"`
	BootstrapPort int    `json:"bootstrap_port,omitempty"`
	// KVEvents: the worker's own KV-event publisher (tcp://host:port;
	// "": the replica's --kv-events template or --worker-kv-events) and
	// its replay endpoint, as the admin API's "kv_events" and
	// "kv_events_replay": every replica subscribes to it.
	KVEvents       string `json:"kv_events,omitempty"`
	KVEventsReplay string `json:"kv_events_replay,omitempty"`
	// Lease is set (by the reader) when the entry lives on a lease: a
	// self-registered worker.
	Lease int64 `json:"-"`
}

// MaxWorkers bounds the slots (the BPF worker maps hold 1024).
const MaxWorkers = 1024

var (
	// ErrDuplicate: the URL already has a slot.
	ErrDuplicate = errors.New("worker already registered")
	// ErrNotFound: no such worker in the table.
	ErrNotFound = errors.New("no such worker")
	// ErrFull: every slot is taken.
	ErrFull = errors.New("no free slot")
	// ErrUnavailable: etcd could not be reached.
	ErrUnavailable = errors.New("cluster store (etcd) unavailable")
)

// Store reads and writes one cluster's worker table.
type Store struct {
	cli    *clientv3.Client
	prefix string
	// OpTimeout bounds each etcd call; past it the store says
	// ErrUnavailable.
	OpTimeout time.Duration
}

// ParseEndpoints reads --cluster: etcd://HOST:PORT[,HOST:PORT...].
func ParseEndpoints(s string) ([]string, error) {
	rest, ok := strings.CutPrefix(s, "etcd://")
	if !ok || rest == "" {
		return nil, fmt.Errorf("--cluster %q: want etcd://HOST:PORT[,HOST:PORT...]", s)
	}
	var eps []string
	for _, hp := range strings.Split(rest, ",") {
		if _, port, found := strings.Cut(hp, ":"); !found || port == "" || strings.ContainsAny(hp, "/ ") {
			return nil, fmt.Errorf("--cluster: endpoint %q: want HOST:PORT", hp)
		}
		eps = append(eps, "http://"+hp)
	}
	return eps, nil
}

// ValidName checks a cluster name (the key prefix).
func ValidName(name string) error {
	if name == "" || strings.ContainsAny(name, "/ \t\n") || len(name) > 64 {
		return fmt.Errorf("--cluster-name %q: want 1..64 characters, no '/' or spaces", name)
	}
	return nil
}

// Dial connects to etcd (lazily: an unreachable cluster is not an error
// here, each call says so).
func Dial(endpoints []string, name string) (*Store, error) {
	if err := ValidName(name); err != nil {
		return nil, err
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:            endpoints,
		DialTimeout:          2 * time.Second,
		DialKeepAliveTime:    2 * time.Second,
		DialKeepAliveTimeout: 2 * time.Second,
		AutoSyncInterval:     0,
		Logger:               quietLogger(),
		// Reconnect within ~2 s of etcd coming back, however long it was
		// away (gRPC's default backoff grows to 2 minutes).
		DialOptions: []grpc.DialOption{grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 2 * time.Second},
			MinConnectTimeout: 2 * time.Second,
		})},
	})
	if err != nil {
		return nil, fmt.Errorf("etcd client: %w", err)
	}
	return &Store{cli: cli, prefix: "/tether/" + name + "/", OpTimeout: 2 * time.Second}, nil
}

// Close closes the etcd client.
func (s *Store) Close() error { return s.cli.Close() }

// Client is the etcd client (leases, watches).
func (s *Store) Client() *clientv3.Client { return s.cli }

func (s *Store) workersPrefix() string   { return s.prefix + "workers/" }
func (s *Store) slotKey(slot int) string { return fmt.Sprintf("%s%04d", s.workersPrefix(), slot) }
func (s *Store) urlKey(u string) string  { return s.prefix + "urls/" + url.PathEscape(u) }

// slotOf parses a workers/ key.
func (s *Store) slotOf(key []byte) (int, bool) {
	rest, ok := strings.CutPrefix(string(key), s.workersPrefix())
	if !ok || len(rest) != 4 {
		return 0, false
	}
	n, err := strconv.Atoi(rest)
	return n, err == nil && n >= 0 && n < MaxWorkers
}

func (s *Store) ctx(parent context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(parent, s.OpTimeout)
}

// unavailable wraps an etcd failure.
func unavailable(err error) error { return fmt.Errorf("%w: %v", ErrUnavailable, err) }

// Table is the worker table read at a revision.
type Table struct {
	Workers  map[int]Spec
	Revision int64
	// Bad lists the keys under the prefix that could not be read (logged
	// and skipped by the watcher).
	Bad []string
}

// Load reads the whole table.
func (s *Store) Load(parent context.Context) (Table, error) {
	ctx, cancel := s.ctx(parent)
	defer cancel()
	resp, err := s.cli.Get(ctx, s.workersPrefix(), clientv3.WithPrefix())
	if err != nil {
		return Table{}, unavailable(err)
	}
	t := Table{Workers: make(map[int]Spec, len(resp.Kvs)), Revision: resp.Header.Revision}
	for _, kv := range resp.Kvs {
		slot, spec, err := s.decode(kv.Key, kv.Value)
		if err != nil {
			t.Bad = append(t.Bad, string(kv.Key)+": "+err.Error())
			continue
		}
		spec.Lease = kv.Lease
		t.Workers[slot] = spec
	}
	return t, nil
}

func (s *Store) decode(key, value []byte) (int, Spec, error) {
	slot, ok := s.slotOf(key)
	if !ok {
		return 0, Spec{}, errors.New("not a slot key")
	}
	var spec Spec
	if err := json.Unmarshal(value, &spec); err != nil {
		return 0, Spec{}, fmt.Errorf("bad JSON: %v", err)
	}
	if spec.URL == "" {
		return 0, Spec{}, errors.New("no url")
	}
	return slot, spec, nil
}

// Claim gives url the lowest free slot, in a transaction that also
// claims the URL: two replicas never hand out one slot twice, nor one URL
// two slots. With lease != 0 both keys live on that lease. A URL already
// registered returns its slot and ErrDuplicate.
func (s *Store) Claim(parent context.Context, spec Spec, lease clientv3.LeaseID) (int, error) {
	val, _ := json.Marshal(spec)
	uk := s.urlKey(spec.URL)
	var opts []clientv3.OpOption
	if lease != 0 {
		opts = append(opts, clientv3.WithLease(lease))
	}
	for attempt := 0; attempt < 32; attempt++ {
		ctx, cancel := s.ctx(parent)
		resp, err := s.cli.Get(ctx, s.workersPrefix(), clientv3.WithPrefix(), clientv3.WithKeysOnly())
		if err != nil {
			cancel()
			return 0, unavailable(err)
		}
		used := make(map[int]bool, len(resp.Kvs))
		for _, kv := range resp.Kvs {
			if n, ok := s.slotOf(kv.Key); ok {
				used[n] = true
			}
		}
		slot := -1
		for i := 0; i < MaxWorkers; i++ {
			if !used[i] {
				slot = i
				break
			}
		}
		if slot < 0 {
			cancel()
			return 0, fmt.Errorf("%w (at most %d workers)", ErrFull, MaxWorkers)
		}
		sk := s.slotKey(slot)
		tr, err := s.cli.Txn(ctx).
			If(clientv3.Compare(clientv3.CreateRevision(sk), "=", 0), clientv3.Compare(clientv3.CreateRevision(uk), "=", 0)).
			Then(clientv3.OpPut(sk, string(val), opts...), clientv3.OpPut(uk, strconv.Itoa(slot), opts...)).
			Else(clientv3.OpGet(uk)).
			Commit()
		cancel()
		if err != nil {
			return 0, unavailable(err)
		}
		if tr.Succeeded {
			return slot, nil
		}
		if kvs := tr.Responses[0].GetResponseRange().Kvs; len(kvs) > 0 {
			n, _ := strconv.Atoi(string(kvs[0].Value))
			return n, fmt.Errorf("%w: %s (slot %d)", ErrDuplicate, spec.URL, n)
		}
		// The slot was taken meanwhile: look again.
	}
	return 0, unavailable(errors.New("slot claims kept conflicting"))
}

// Release deletes the worker in slot, if it is still url.
func (s *Store) Release(parent context.Context, slot int, u string) error {
	ctx, cancel := s.ctx(parent)
	defer cancel()
	uk := s.urlKey(u)
	tr, err := s.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.Value(uk), "=", strconv.Itoa(slot))).
		Then(clientv3.OpDelete(s.slotKey(slot)), clientv3.OpDelete(uk)).
		Commit()
	if err != nil {
		return unavailable(err)
	}
	if !tr.Succeeded {
		return fmt.Errorf("%w: %s in slot %d", ErrNotFound, u, slot)
	}
	return nil
}

// Update changes the spec of the worker in slot (still url), keeping its
// lease, with a compare on its revision (retried on a race).
func (s *Store) Update(parent context.Context, slot int, u string, change func(*Spec)) error {
	sk := s.slotKey(slot)
	for attempt := 0; attempt < 16; attempt++ {
		ctx, cancel := s.ctx(parent)
		resp, err := s.cli.Get(ctx, sk)
		if err != nil {
			cancel()
			return unavailable(err)
		}
		if len(resp.Kvs) == 0 {
			cancel()
			return fmt.Errorf("%w: slot %d", ErrNotFound, slot)
		}
		kv := resp.Kvs[0]
		_, spec, err := s.decode(kv.Key, kv.Value)
		if err != nil || spec.URL != u {
			cancel()
			return fmt.Errorf("%w: %s in slot %d", ErrNotFound, u, slot)
		}
		change(&spec)
		val, _ := json.Marshal(spec)
		tr, err := s.cli.Txn(ctx).
			If(clientv3.Compare(clientv3.ModRevision(sk), "=", kv.ModRevision)).
			Then(clientv3.OpPut(sk, string(val), clientv3.WithIgnoreLease())).
			Commit()
		cancel()
		if err != nil {
			return unavailable(err)
		}
		if tr.Succeeded {
			return nil
		}
	}
	return unavailable(errors.New("updates kept conflicting"))
}

// Ping checks that etcd answers (a linearizable read of one key).
func (s *Store) Ping(parent context.Context) error {
	ctx, cancel := s.ctx(parent)
	defer cancel()
	if _, err := s.cli.Get(ctx, s.prefix+"ping", clientv3.WithCountOnly()); err != nil {
		return unavailable(err)
	}
	return nil
}
