package route

// Learned affinity for bare session ids. Session servers that know nothing
// of tether mint plain ids (uuids) instead of w<idx>- ones, so the id of a
// turn does not say which worker holds the session. The router learns it
// from the server itself: when a POST to the create path (default
// /sessions) went to worker k and k's 2xx JSON answer carries the new id
// (field session_id), id -> k goes into the sticky table (the pinned BPF
// LRU map: the next tetherd after an upgrade or restart still knows it);
// /sessions/{id}/... of a learned id then goes to k, and DELETE
// /sessions/{id} forgets it once k answered it.
//
// The answer is never delayed or altered: the proxy shows the Learner the
// status and the body bytes as they pass (at most MaxScan of them, those
// it copies anyway; spliced bytes are not seen), and the entry is stored
// before those bytes go to the client, so a client that reads its id and
// sends the next turn at once finds it learned.

import (
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/keyhash"
	"github.com/tether-rl/tether/userspace/sticky"
	"github.com/tether-rl/tether/userspace/worker"
)

// Learning defaults.
const (
	DefaultCreatePath = "/sessions"
	DefaultIDField    = "session_id"
	DefaultLearnTTL   = 2 * time.Hour
	DefaultLearnScan  = 4096
)

// LearnSettings are the learning's settings (tetherd's
// --learn-session-path, --learn-session-field, --learn-session-ttl),
// apart from its wiring (LearnConfig). Zero fields take the defaults
// (Provision); NewLearning validates them.
type LearnSettings struct {
	// CreatePath is the path whose POST creates a session (a query is
	// allowed after it); default DefaultCreatePath.
	CreatePath string
	// IDField names the top-level field of the 2xx JSON answer that holds
	// the new id (a string or a number); default DefaultIDField.
	IDField string
	// TTL: an entry expires this long after the session's last request;
	// default DefaultLearnTTL.
	TTL time.Duration
	// MaxScan bounds the answer bytes read for the id; default
	// DefaultLearnScan.
	MaxScan int
}

// DefaultLearnSettings is LearnSettings with every field at its default.
func DefaultLearnSettings() LearnSettings {
	var s LearnSettings
	s.Provision()
	return s
}

// Provision fills s's zero fields with the defaults.
func (s *LearnSettings) Provision() {
	if s.CreatePath == "" {
		s.CreatePath = DefaultCreatePath
	}
	if s.IDField == "" {
		s.IDField = DefaultIDField
	}
	if s.TTL == 0 {
		s.TTL = DefaultLearnTTL
	}
	if s.MaxScan <= 0 {
		s.MaxScan = DefaultLearnScan
	}
}

// LearnConfig configures a Learning: its settings and its wiring. Zero
// values take the defaults.
type LearnConfig struct {
	LearnSettings
	// Table holds the entries; required.
	Table sticky.Table
	// Now is the clock of expiries (CLOCK_MONOTONIC ns); default sticky.Now.
	Now func() int64
}

// Learning remembers which worker created each bare session id. It is safe
// for concurrent use.
type Learning struct {
	cfg     LearnConfig
	ttl     int64
	refresh int64
	// n counts events; a reload's Learning takes over its predecessor's
	// (Router.SetLearning), so counts run on across SIGHUPs.
	n *learnCounters
}

type learnCounters struct {
	learned   atomic.Uint64
	noID      atomic.Uint64
	forgotten atomic.Uint64
}

// NewLearning validates cfg and returns the learning.
func NewLearning(cfg LearnConfig) (*Learning, error) {
	cfg.LearnSettings.Provision()
	if !strings.HasPrefix(cfg.CreatePath, "/") || strings.ContainsAny(cfg.CreatePath, "?# \t") {
		return nil, fmt.Errorf("--learn-session-path %q: want an absolute path without query", cfg.CreatePath)
	}
	if cfg.TTL < time.Second {
		return nil, fmt.Errorf("--learn-session-ttl %v: want at least 1s", cfg.TTL)
	}
	if cfg.Table == nil {
		return nil, errors.New("learned sessions without a sticky table")
	}
	if cfg.Now == nil {
		cfg.Now = sticky.Now
	}
	return &Learning{cfg: cfg, ttl: int64(cfg.TTL), refresh: int64(min(DefaultStickyRefresh, cfg.TTL/4)), n: new(learnCounters)}, nil
}

// Config returns the settings, defaults applied.
func (l *Learning) Config() LearnConfig { return l.cfg }

// LearnCounts are a Learning's event counts.
type LearnCounts struct {
	Learned   uint64 // ids stored from create answers
	NoID      uint64 // 2xx create answers without a usable id in the bytes read
	Forgotten uint64 // entries removed by a DELETE /sessions/{id}
}

// Counts returns the event counts.
func (l *Learning) Counts() LearnCounts {
	return LearnCounts{Learned: l.n.learned.Load(), NoID: l.n.noID.Load(), Forgotten: l.n.forgotten.Load()}
}

// SessionKeyHash is the sticky table key of a bare session id: its own
// hash domain, so that an id never collides with a routing key of the same
// text (X-Session-ID).
func SessionKeyHash(id []byte) uint64 {
	return keyhash.Mix(keyhash.FNV1a(keyhash.FNV1aString(keyhash.Offset, "tether-session\x00"), id))
}

// isCreate reports whether req creates a session: POST to the create path.
func (l *Learning) isCreate(req *httphead.Request) bool {
	return req.IsMethod("POST") && pathIs(req.Path, l.cfg.CreatePath)
}

// pathIs reports whether path is p, possibly followed by a query.
func pathIs(path []byte, p string) bool {
	return len(path) >= len(p) && string(path[:len(p)]) == p && (len(path) == len(p) || path[len(p)] == '?')
}

// lookup returns the live worker that created id, or nil. It pushes the
// entry's expiry back (at most every refresh) and follows a worker that
// moved to another slot.
func (l *Learning) lookup(ws []*worker.Worker, id []byte) *worker.Worker {
	t := l.cfg.Table
	h := SessionKeyHash(id)
	e, ok := t.Lookup(h)
	now := l.cfg.Now()
	if !ok || !e.Live(now) {
		return nil
	}
	w := entryWorker(ws, e)
	if w == nil {
		return nil
	}
	if uint32(w.Slot) != e.Worker || now-(e.Expires-l.ttl) >= l.refresh {
		t.Put(h, sticky.Entry{Worker: uint32(w.Slot), ID: e.ID, Expires: now + l.ttl})
	}
	return w
}

// Forget removes the entry of id and reports whether there was one.
func (l *Learning) Forget(id string) bool {
	if l.cfg.Table.Delete(SessionKeyHash([]byte(id))) {
		l.n.forgotten.Add(1)
		return true
	}
	return false
}

// creating attaches the Learner of a create request to its decision.
func (l *Learning) creating(d Decision) Decision {
	if d.Worker != nil {
		d.Learn = &Learner{l: l, w: d.Worker}
	}
	return d
}

// retarget returns the Learner for the same request sent to w instead
// (Router.Reroute); nil stays nil.
func (x *Learner) retarget(w *worker.Worker) *Learner {
	if x == nil {
		return nil
	}
	if x.delete {
		return x
	}
	return &Learner{l: x.l, w: w}
}

// deleting returns the Learner of DELETE /sessions/{id}.
func (l *Learning) deleting(id []byte) *Learner {
	return &Learner{l: l, key: SessionKeyHash(id), delete: true}
}

// Learner watches the answer to one create or delete request. The proxy
// calls Status with the final status before the response head goes to the
// client, Body with body data (chunk framing removed) before it goes to
// the client, for as long as Status and Body return true, and End once
// the exchange is over. Not safe for concurrent use (one connection).
type Learner struct {
	l      *Learning
	w      *worker.Worker // create: the worker the request went to
	key    uint64         // delete: the id's key
	delete bool
	status int
	seen   int    // body bytes shown so far
	buf    []byte // the body so far, when it came in pieces
	done   bool   // nothing more wanted
	found  bool
}

// Status takes the final response status and reports whether body bytes
// are wanted. A delete forgets the id when the worker answered 2xx, 404
// or 410 (the session is gone either way).
func (x *Learner) Status(code int) bool {
	x.status = code
	if x.delete {
		if code >= 200 && code < 300 || code == 404 || code == 410 {
			if x.l.cfg.Table.Delete(x.key) {
				x.l.n.forgotten.Add(1)
			}
		}
		x.done = true
		return false
	}
	if code < 200 || code >= 300 {
		x.done = true
	}
	return !x.done
}

// Body takes the next body data and reports whether more is wanted. It
// stores the id as soon as the bytes seen contain it.
func (x *Learner) Body(p []byte) bool {
	if x.done {
		return false
	}
	if room := x.l.cfg.MaxScan - x.seen; len(p) > room {
		p = p[:room]
	}
	x.seen += len(p)
	data := p
	if x.buf != nil {
		x.buf = append(x.buf, p...)
		data = x.buf
	}
	id, st := ResponseField(data, x.l.cfg.IDField)
	switch {
	case st == FieldFound:
		x.learn(id)
		x.done = true
	case st == FieldAbsent || x.seen >= x.l.cfg.MaxScan:
		x.done = true
	case x.buf == nil:
		// The id may straddle pieces: keep what came (p is the proxy's
		// buffer, reused after this call).
		x.buf = append(make([]byte, 0, 2*len(p)+64), p...)
	}
	return !x.done
}

// End ends the exchange: a 2xx create answer without an id is counted.
func (x *Learner) End() {
	if !x.delete && !x.found && x.status >= 200 && x.status < 300 {
		x.l.n.noID.Add(1)
	}
	x.buf = nil
}

func (x *Learner) learn(id []byte) {
	x.found = true
	if _, stamped := SessionSlot(id); stamped {
		return // w<idx>- ids route by their slot: nothing to remember
	}
	now := x.l.cfg.Now()
	x.l.cfg.Table.Put(SessionKeyHash(id), sticky.Entry{Worker: uint32(x.w.Slot), ID: x.w.Ident(), Expires: now + x.l.ttl})
	x.l.n.learned.Add(1)
}
