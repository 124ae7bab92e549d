package cluster

// The fleet's weight-sync state, shared by every replica (docs/cluster.md,
// "Weight sync across replicas"). One key, /tether/<name>/fleet:
//
//	{"phase":"paused","mode":"abort","target":"v7",
//	 "versions":{"http://10.0.1.5:30001":"v7", ...},
//	 "by":"<instance id>","at":"<RFC 3339>",
//	 "phase_by":"<instance id>","phase_at":"<RFC 3339>"}
//
// A replica writes it (read-modify-write, guarded by the key's revision)
// when a pause or resume goes through it (the phase: last writer wins, so
// a resume through B ends a pause made through A) and after a weight
// update (the target and the workers' versions; the phase is kept). Every
// replica watches it and gives the phase to its fleet.Fleet as the
// cluster's (SetRemote), with the target and versions (the same fences
// everywhere). A replica that cannot see etcd, or has not read the key yet
// since start-up, holds generation requests rather than admits them: it
// cannot know whether a sync began (bounded by the hold's --pause-timeout).

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/tether-rl/tether/userspace/fleet"
)

// FleetRecord is the value of the fleet key.
type FleetRecord struct {
	Phase    string            `json:"phase"`
	Mode     string            `json:"mode,omitempty"`
	Target   string            `json:"target,omitempty"`
	Versions map[string]string `json:"versions,omitempty"`
	// By and At: the replica (its instance id) that wrote last, and when
	// (its clock).
	By string `json:"by"`
	At string `json:"at"`
	// PhaseBy and PhaseAt: the replica that set the phase, and when.
	PhaseBy string `json:"phase_by,omitempty"`
	PhaseAt string `json:"phase_at,omitempty"`
}

// FleetKey is the fleet key's name.
func (s *Store) FleetKey() string { return s.prefix + "fleet" }

// LoadFleet reads the fleet key: its record (ok false: absent), the
// key's mod revision and the store's revision at the read.
func (s *Store) LoadFleet(parent context.Context) (rec FleetRecord, ok bool, modRev, rev int64, err error) {
	ctx, cancel := s.ctx(parent)
	defer cancel()
	resp, err := s.cli.Get(ctx, s.FleetKey())
	if err != nil {
		return FleetRecord{}, false, 0, 0, unavailable(err)
	}
	if len(resp.Kvs) == 0 {
		return FleetRecord{}, false, 0, resp.Header.Revision, nil
	}
	kv := resp.Kvs[0]
	if err := json.Unmarshal(kv.Value, &rec); err != nil {
		return FleetRecord{}, false, kv.ModRevision, resp.Header.Revision, fmt.Errorf("%s: bad JSON: %v", s.FleetKey(), err)
	}
	return rec, true, kv.ModRevision, resp.Header.Revision, nil
}

// UpdateFleet changes the fleet key in a transaction guarded by its
// revision (retried on a race; an unreadable value is replaced), within
// ctx: change gets the record, whether it existed and its mod revision (0:
// absent). It returns what was written and its revision.
func (s *Store) UpdateFleet(ctx context.Context, change func(rec *FleetRecord, existed bool, modRev int64)) (FleetRecord, int64, error) {
	key := s.FleetKey()
	for attempt := 0; attempt < 16; attempt++ {
		resp, err := s.cli.Get(ctx, key)
		if err != nil {
			return FleetRecord{}, 0, unavailable(err)
		}
		var rec FleetRecord
		cmp := clientv3.Compare(clientv3.CreateRevision(key), "=", 0)
		existed, modRev := false, int64(0)
		if len(resp.Kvs) > 0 {
			modRev = resp.Kvs[0].ModRevision
			cmp = clientv3.Compare(clientv3.ModRevision(key), "=", modRev)
			existed = json.Unmarshal(resp.Kvs[0].Value, &rec) == nil
			if !existed {
				rec = FleetRecord{}
			}
		}
		change(&rec, existed, modRev)
		val, _ := json.Marshal(rec)
		tr, err := s.cli.Txn(ctx).If(cmp).Then(clientv3.OpPut(key, string(val))).Commit()
		if err != nil {
			return FleetRecord{}, 0, unavailable(err)
		}
		if tr.Succeeded {
			return rec, tr.Header.Revision, nil
		}
	}
	return FleetRecord{}, 0, unavailable(errors.New("fleet key writes kept conflicting"))
}

// FleetSync keeps a fleet.Fleet's cluster phase, target and versions
// equal to the fleet key, and writes this replica's changes to it.
type FleetSync struct {
	store *Store
	fl    *fleet.Fleet
	self  string
	log   *slog.Logger

	// mu serializes writes and the application of what is read: a write's
	// own revision is known before its watch event comes back.
	mu     sync.Mutex
	rev    int64       // the latest revision applied or written
	keyRev int64       // the key's mod revision, last known (0: absent)
	remote fleet.Phase // the key's phase, last known
	down   bool        // the key cannot be seen (not read yet, or etcd out of reach)
	// published is the phase this replica last wrote (or tried to): a
	// local phase that differs is a change about to be written, which a
	// resume read from the key must not undo.
	published fleet.Phase
	// A change of this replica that could not be written (etcd out of
	// reach): its phase and/or its target and versions, made when the key
	// was at base. It is written once etcd answers if nobody wrote the
	// key since; otherwise the key's newer state wins.
	dirtyPhase, dirtyVersions bool
	base                      int64

	writes, writeErrors, applied atomic.Uint64

	stop, done chan struct{}
	stopOnce   sync.Once
	startOnce  sync.Once
	started    bool
}

// FleetStatus is the fleet key's link, for GET /cluster and tests.
type FleetStatus struct {
	Up       bool   `json:"up"`
	Phase    string `json:"phase"` // the key's, last known
	Revision int64  `json:"revision"`
	// Unwritten: a change of this replica's waits to be written.
	Unwritten   bool   `json:"unwritten,omitempty"`
	Writes      uint64 `json:"writes"`
	WriteErrors uint64 `json:"write_errors"`
	Applied     uint64 `json:"applied"`
}

// NewFleetSync returns the sync of fl with the store's fleet key; self
// names this replica in what it writes (its instance id, the same across
// an upgrade). Until Start's first read, fl holds generation requests.
func NewFleetSync(store *Store, fl *fleet.Fleet, self string, log *slog.Logger) *FleetSync {
	s := &FleetSync{store: store, fl: fl, self: self, log: log, down: true, stop: make(chan struct{}), done: make(chan struct{})}
	s.published, _ = fl.LocalPhase()
	fl.SetRemote(fleet.Serving, true)
	return s
}

// Start begins reading and watching the key.
func (s *FleetSync) Start() {
	s.startOnce.Do(func() {
		s.started = true
		go s.run()
	})
}

// Close stops the watch.
func (s *FleetSync) Close() {
	s.stopOnce.Do(func() { close(s.stop) })
	s.startOnce.Do(func() {})
	if s.started {
		<-s.done
	}
}

// Status returns the key's link.
func (s *FleetSync) Status() FleetStatus {
	s.mu.Lock()
	defer s.mu.Unlock()
	return FleetStatus{Up: !s.down, Phase: s.remote.String(), Revision: s.rev, Unwritten: s.dirtyPhase || s.dirtyVersions,
		Writes: s.writes.Load(), WriteErrors: s.writeErrors.Load(), Applied: s.applied.Load()}
}

// Publish writes this replica's sync state to the key, within the store's
// operation timeout: with phase, a pause or resume that went through this
// replica (the key takes its phase and mode, keeps its target and
// versions); without, a weight update (the key takes its target and
// versions, keeps its phase). engine.Config.OnPhase calls it; the state
// written is the fleet's when the write is made (st is what changed).
func (s *FleetSync) Publish(st fleet.State, phase bool) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if phase {
		s.published, _ = fleet.ParsePhase(st.Phase)
	}
	err := s.writeLocked(phase, !phase)
	if err != nil {
		what := "the weight update (target " + st.Target + ")"
		if phase {
			what = "the phase " + st.Phase
		}
		s.log.Error("cluster: the fleet key was not written: other replicas do not know "+what+"; this replica holds its own state and writes it once etcd answers, unless another replica wrote the key meanwhile", "err", err)
	}
	return err
}

// writeLocked writes this replica's phase (phase) and/or target and
// versions (vers) to the key, with any change that could not be written
// before if the key has not changed since (s.mu held). On a failure the
// change is kept to be written later.
func (s *FleetSync) writeLocked(phase, vers bool) error {
	st := s.fl.Export()
	p, _ := fleet.ParsePhase(st.Phase)
	ctx, cancel := context.WithTimeout(context.Background(), s.store.OpTimeout)
	defer cancel()
	now := time.Now().UTC().Format(time.RFC3339Nano)
	var stale bool // the key changed since the unwritten change: dropped
	rec, rev, err := s.store.UpdateFleet(ctx, func(rec *FleetRecord, existed bool, modRev int64) {
		wp, wv := phase, vers
		stale = (s.dirtyPhase || s.dirtyVersions) && modRev != s.base
		if !stale {
			wp, wv = wp || s.dirtyPhase, wv || s.dirtyVersions
		}
		if wp || !existed {
			rec.Phase, rec.Mode = p.String(), st.Mode
			if p == fleet.Serving {
				rec.Mode = ""
			}
			rec.PhaseBy, rec.PhaseAt = s.self, now
		}
		if wv || !existed {
			rec.Target = st.Target
			if rec.Versions == nil {
				rec.Versions = map[string]string{}
			}
			for u, v := range st.Versions {
				rec.Versions[u] = v
			}
		}
		rec.By, rec.At = s.self, now
	})
	if err != nil {
		s.writeErrors.Add(1)
		if !s.dirtyPhase && !s.dirtyVersions {
			s.base = s.keyRev
		}
		s.dirtyPhase, s.dirtyVersions = s.dirtyPhase || phase, s.dirtyVersions || vers
		return err
	}
	s.writes.Add(1)
	if stale {
		s.log.Warn("cluster: a change of this replica's that could not be written is dropped: another replica wrote the fleet key since")
	}
	if s.dirtyPhase && !stale || phase {
		s.published = p
	}
	s.dirtyPhase, s.dirtyVersions = false, false
	if rev > s.rev {
		// What the key holds now is known: no need to wait for the watch.
		s.rev, s.keyRev = rev, rev
		s.remote, _ = fleet.ParsePhase(rec.Phase)
		s.resumeLocked(rec.PhaseBy)
		s.fl.SetRemote(s.remote, s.down)
	}
	return nil
}

// run reads the key and watches it until stopped; any failure: hold, and
// read again once etcd answers.
func (s *FleetSync) run() {
	defer close(s.done)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { <-s.stop; cancel() }()
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		rec, ok, modRev, rev, err := s.store.LoadFleet(ctx)
		if err != nil && errors.Is(err, ErrUnavailable) {
			s.setDown(err)
			select {
			case <-ctx.Done():
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, 2*time.Second)
			continue
		}
		backoff = 100 * time.Millisecond
		if err != nil {
			// There but unreadable: the last known phase stays.
			s.log.Warn("cluster: skipping a bad fleet key", "err", err)
			s.apply(FleetRecord{}, false, modRev, rev, true, false)
		} else {
			s.apply(rec, ok, modRev, rev, true, true)
		}
		s.watch(ctx, rev)
	}
}

// watch applies the key's changes from rev+1 until the watch fails or
// etcd stops answering (checked every second).
func (s *FleetSync) watch(parent context.Context, rev int64) {
	ctx, cancel := context.WithCancel(clientv3.WithRequireLeader(parent))
	defer cancel()
	wch := s.store.cli.Watch(ctx, s.store.FleetKey(), clientv3.WithRev(rev+1))
	ping := time.NewTicker(time.Second)
	defer ping.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-ping.C:
			if err := s.store.Ping(ctx); err != nil {
				s.setDown(err)
				return
			}
		case wr, ok := <-wch:
			if !ok || wr.Err() != nil {
				if ok {
					s.setDown(wr.Err())
				}
				return
			}
			for _, ev := range wr.Events {
				if ev.Type == clientv3.EventTypeDelete {
					// Deleted (by hand): no sync going on.
					s.apply(FleetRecord{}, false, 0, ev.Kv.ModRevision, false, true)
					continue
				}
				var rec FleetRecord
				if err := json.Unmarshal(ev.Kv.Value, &rec); err != nil {
					s.log.Warn("cluster: skipping a bad fleet key", "key", string(ev.Kv.Key), "err", err)
					continue
				}
				s.apply(rec, true, ev.Kv.ModRevision, ev.Kv.ModRevision, false, true)
			}
		}
	}
}

// apply gives the fleet what the key holds (exists false: no key, the
// fleet serves; keyRev: its mod revision) as of revision at. fresh: a read
// after (re)connecting, the key as of the store's revision at (a change
// this replica could not write is written first if the key has not moved
// since); else a watch event of the key's change at. Either is skipped if
// this replica knows a later revision (its own write came after). good
// false: the value could not be read; only the link comes up.
func (s *FleetSync) apply(rec FleetRecord, exists bool, keyRev, at int64, fresh, good bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if fresh {
		if s.down {
			s.log.Info("cluster: the fleet key is in sight", "key", s.store.FleetKey())
		}
		s.down = false
		if good && (s.dirtyPhase || s.dirtyVersions) {
			if keyRev == s.base {
				if err := s.writeLocked(false, false); err == nil {
					s.log.Info("cluster: a change of this replica's made while etcd was out of reach is written", "phase", s.remote.String())
					return
				}
			} else {
				s.dirtyPhase, s.dirtyVersions = false, false
				s.log.Warn("cluster: a change of this replica's that could not be written is dropped: another replica wrote the fleet key since")
			}
		}
	}
	if !good || at < s.rev || (!fresh && at == s.rev) {
		s.fl.SetRemote(s.remote, s.down)
		return
	}
	s.rev, s.keyRev = at, keyRev
	s.applied.Add(1)
	p := fleet.Serving
	if exists {
		if q, ok := fleet.ParsePhase(rec.Phase); ok {
			p = q
		} else {
			s.log.Warn("cluster: the fleet key names an unknown phase: holding", "phase", rec.Phase)
			p = fleet.Paused
		}
		// Versions and target at once: no worker is fenced in between.
		s.fl.SetVersions(rec.Target, rec.Versions)
	}
	s.remote = p
	s.resumeLocked(rec.PhaseBy)
	s.fl.SetRemote(p, s.down)
}

// resumeLocked: the key says serving (a resume through any replica, or
// the key deleted): this replica's own pause ends too, unless its phase
// changed since it last wrote it (that write comes next, and wins) or a
// change of it waits to be written (s.mu held).
func (s *FleetSync) resumeLocked(by string) {
	if s.remote != fleet.Serving || s.dirtyPhase {
		return
	}
	if lp, _ := s.fl.LocalPhase(); lp != fleet.Serving && lp == s.published {
		s.fl.SetPhase(fleet.Serving, "")
		s.published = fleet.Serving
		s.log.Info("cluster: the fleet key says serving: this replica's pause ends", "phase_by", by)
	}
}

// setDown: the key is out of sight; the fleet holds (last known phase,
// link down).
func (s *FleetSync) setDown(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.down {
		s.log.Error("cluster link down: generation requests are held until the fleet key is in sight again (or --pause-timeout)", "err", err)
	}
	s.down = true
	s.fl.SetRemote(s.remote, true)
}
