package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// The subscriber: one per publisher (an engine, or one data-parallel rank
// of it). It keeps its own reconnect (backoff from MinBackoff to
// MaxBackoff) and reads the sequence numbers, not the connection, to know
// what it missed:
//
//   - the next sequence number: applied;
//   - a gap: the missed batches are replayed from the replay endpoint
//     (a DEALER asking the engine's ROUTER from the first missed), then
//     the batch is applied; without a replay endpoint, or when the replay
//     fails or comes back short, the engine's entries are cleared first
//     (ClearReplayFailed, ClearGap) and refill from the events that follow;
//   - a sequence number going backwards: the engine restarted, its cache
//     is empty: cleared (ClearRestart) and replayed from 0;
//   - the connection lost: cleared at once (ClearLost: a dead engine's
//     cache is gone, and what it sent meanwhile is unknown); on the next
//     connection the engine's buffer is replayed from 0 to refill it.
//
// A malformed message is counted and dropped (its sequence number is
// still taken as seen).

// ClearReason says why a subscriber cleared its engine's entries.
type ClearReason uint8

// Clear reasons.
const (
	ClearRestart      ClearReason = iota + 1 // sequence went backwards
	ClearLost                                // connection lost
	ClearGap                                 // a gap and no replay endpoint
	ClearReplayFailed                        // a gap the replay did not fill
)

func (r ClearReason) String() string {
	switch r {
	case ClearRestart:
		return "restart"
	case ClearLost:
		return "lost"
	case ClearGap:
		return "gap"
	case ClearReplayFailed:
		return "replay-failed"
	}
	return "?"
}

// Handler receives a subscriber's batches, in sequence order, and its
// clears, from the subscriber's goroutine.
type Handler interface {
	Apply(b *Batch)
	Clear(r ClearReason)
}

// Config is one subscription.
type Config struct {
	Endpoint string // tcp://host:port of the engine's PUB socket
	Replay   string // tcp://host:port of its replay ROUTER ("": none)
	Topic    string // subscription prefix ("" : everything)

	DialTimeout   time.Duration // default 1s
	ReplayTimeout time.Duration // a whole replay; default 2s
	MinBackoff    time.Duration // default 50ms
	MaxBackoff    time.Duration // default 2s
	Log           *slog.Logger
}

func (c *Config) provision() {
	if c.DialTimeout <= 0 {
		c.DialTimeout = time.Second
	}
	if c.ReplayTimeout <= 0 {
		c.ReplayTimeout = 2 * time.Second
	}
	if c.MinBackoff <= 0 {
		c.MinBackoff = 50 * time.Millisecond
	}
	if c.MaxBackoff <= 0 {
		c.MaxBackoff = 2 * time.Second
	}
	if c.Log == nil {
		c.Log = slog.New(slog.DiscardHandler)
	}
}

// Stats are a subscriber's counters.
type Stats struct {
	Connected      bool   `json:"connected"`
	Batches        uint64 `json:"batches"`         // applied
	Events         uint64 `json:"events"`          // in applied batches
	Malformed      uint64 `json:"malformed"`       // messages dropped
	Gaps           uint64 `json:"gaps"`            // sequence gaps seen
	Replays        uint64 `json:"replays"`         // replays asked
	ReplayFailures uint64 `json:"replay_failures"` // replays that failed or came back short
	Restarts       uint64 `json:"restarts"`        // sequence went backwards
	Lost           uint64 `json:"lost"`            // connections lost
	Clears         uint64 `json:"clears"`          // entries cleared, all reasons
	LastSeq        uint64 `json:"last_seq"`
}

// Subscriber reads one publisher until Close.
type Subscriber struct {
	cfg Config
	h   Handler

	connected                                       atomic.Bool
	batches, events, malformed, gaps, replays       atomic.Uint64
	replayFailures, restarts, lost, clears, lastSeq atomic.Uint64

	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{}
	mu     sync.Mutex
	conn   *zconn // the live connection (Close closes it)

	// the goroutine's own state
	have  bool
	next  uint64
	dec   *Decoder
	batch Batch
}

// Start validates cfg and starts the subscriber's goroutine.
func Start(cfg Config, h Handler) (*Subscriber, error) {
	cfg.provision()
	if _, err := hostPort(cfg.Endpoint); err != nil {
		return nil, err
	}
	if cfg.Replay != "" {
		if _, err := hostPort(cfg.Replay); err != nil {
			return nil, err
		}
	}
	s := &Subscriber{cfg: cfg, h: h, done: make(chan struct{}), dec: NewDecoder()}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	go s.run()
	return s, nil
}

// Config returns the subscription.
func (s *Subscriber) Config() Config { return s.cfg }

// Stats returns the counters.
func (s *Subscriber) Stats() Stats {
	return Stats{Connected: s.connected.Load(), Batches: s.batches.Load(), Events: s.events.Load(),
		Malformed: s.malformed.Load(), Gaps: s.gaps.Load(), Replays: s.replays.Load(),
		ReplayFailures: s.replayFailures.Load(), Restarts: s.restarts.Load(), Lost: s.lost.Load(),
		Clears: s.clears.Load(), LastSeq: s.lastSeq.Load()}
}

// Close stops the subscriber and waits for its goroutine.
func (s *Subscriber) Close() {
	s.cancel()
	s.mu.Lock()
	if s.conn != nil {
		s.conn.close()
	}
	s.mu.Unlock()
	<-s.done
}

func (s *Subscriber) run() {
	defer close(s.done)
	addr, _ := hostPort(s.cfg.Endpoint)
	backoff := s.cfg.MinBackoff
	var frames [][]byte
	for s.ctx.Err() == nil {
		z, err := s.dial(addr, "SUB")
		if err == nil {
			sub := append([]byte{1}, s.cfg.Topic...)
			if err = z.send(sub); err != nil {
				z.close()
			}
		}
		if err != nil {
			if s.ctx.Err() != nil {
				return
			}
			s.cfg.Log.Debug("kv events: connect failed", "endpoint", s.cfg.Endpoint, "err", err)
			select {
			case <-s.ctx.Done():
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, s.cfg.MaxBackoff)
			continue
		}
		if !s.keep(z) {
			return
		}
		backoff = s.cfg.MinBackoff
		s.connected.Store(true)
		s.cfg.Log.Info("kv events: subscribed", "endpoint", s.cfg.Endpoint)
		for {
			frames, err = z.recv(frames)
			if err != nil {
				break
			}
			s.message(frames)
		}
		s.connected.Store(false)
		s.keep(nil)
		z.close()
		if s.ctx.Err() != nil {
			return
		}
		s.cfg.Log.Info("kv events: publisher lost", "endpoint", s.cfg.Endpoint, "err", err)
		s.lost.Add(1)
		s.clear(ClearLost)
		s.have = false
	}
}

// keep records the live connection; false when Close came first.
func (s *Subscriber) keep(z *zconn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if z != nil && s.ctx.Err() != nil {
		z.close()
		return false
	}
	s.conn = z
	return true
}

func (s *Subscriber) dial(addr, socketType string) (*zconn, error) {
	d := net.Dialer{Timeout: s.cfg.DialTimeout, KeepAlive: 5 * time.Second}
	c, err := d.DialContext(s.ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	z, _, err := handshake(c, socketType, false, s.cfg.DialTimeout)
	if err != nil {
		c.Close()
		return nil, err
	}
	return z, nil
}

func (s *Subscriber) clear(r ClearReason) {
	s.clears.Add(1)
	s.h.Clear(r)
}

// split reads [topic,] seq, payload.
func split(frames [][]byte) (seq uint64, payload []byte, ok bool) {
	switch len(frames) {
	case 2:
		frames = frames[0:]
	case 3:
		frames = frames[1:]
	default:
		return 0, nil, false
	}
	if len(frames[0]) != 8 {
		return 0, nil, false
	}
	return binary.BigEndian.Uint64(frames[0]), frames[1], true
}

func (s *Subscriber) message(frames [][]byte) {
	seq, payload, ok := split(frames)
	if !ok {
		s.malformed.Add(1)
		return
	}
	switch {
	case !s.have:
		// The first batch on this connection: what came before it is
		// in the engine's replay buffer (slow joiner, or tetherd started
		// after the engine).
		if seq > 0 && s.cfg.Replay != "" {
			s.catchUp(0, seq, true)
		}
	case seq == s.next:
	case seq > s.next:
		s.gaps.Add(1)
		if s.cfg.Replay != "" {
			s.catchUp(s.next, seq, false)
		} else {
			s.clear(ClearGap)
		}
	default:
		s.restarts.Add(1)
		s.cfg.Log.Info("kv events: engine restarted", "endpoint", s.cfg.Endpoint, "seq", seq, "expected", s.next)
		s.clear(ClearRestart)
		if seq > 0 && s.cfg.Replay != "" {
			s.catchUp(0, seq, true)
		}
	}
	s.apply(seq, payload)
}

func (s *Subscriber) apply(seq uint64, payload []byte) {
	s.have, s.next = true, seq+1
	s.lastSeq.Store(seq)
	if err := s.dec.Decode(payload, &s.batch); err != nil {
		s.malformed.Add(1)
		s.cfg.Log.Debug("kv events: malformed batch dropped", "endpoint", s.cfg.Endpoint, "seq", seq, "err", err)
		return
	}
	s.batch.Seq = seq
	s.batches.Add(1)
	s.events.Add(uint64(len(s.batch.Events)))
	s.h.Apply(&s.batch)
}

// catchUp replays [from, to) and applies it. fresh: the entries hold
// nothing from before from (a new connection, a restarted engine), so a
// hole only means fewer entries; otherwise a hole clears them first.
func (s *Subscriber) catchUp(from, to uint64, fresh bool) {
	s.replays.Add(1)
	got, err := s.replay(from, to)
	expect := from
	failed := err != nil
	for _, r := range got {
		if r.seq < expect || r.seq >= to {
			continue
		}
		if r.seq != expect {
			failed = true
			if !fresh {
				s.clear(ClearReplayFailed)
				fresh = true
			}
		}
		s.apply(r.seq, r.payload)
		expect = r.seq + 1
	}
	if expect != to {
		failed = true
		if !fresh {
			s.clear(ClearReplayFailed)
		}
	}
	if failed {
		s.replayFailures.Add(1)
		s.cfg.Log.Info("kv events: replay short", "endpoint", s.cfg.Replay, "from", from, "to", to, "reached", expect, "err", err)
	}
}

type replayed struct {
	seq     uint64
	payload []byte
}

// endSeq marks the end of a replay: seq -1.
const endSeq = ^uint64(0)

// replay asks the engine's ROUTER for the batches from from on and reads
// them up to the end marker (or to, or the timeout).
func (s *Subscriber) replay(from, to uint64) ([]replayed, error) {
	addr, _ := hostPort(s.cfg.Replay)
	z, err := s.dial(addr, "DEALER")
	if err != nil {
		return nil, err
	}
	defer z.close()
	stop := context.AfterFunc(s.ctx, func() { z.close() })
	defer stop()
	z.c.SetDeadline(time.Now().Add(s.cfg.ReplayTimeout))
	var start [8]byte
	binary.BigEndian.PutUint64(start[:], from)
	if err := z.send(nil, start[:]); err != nil {
		return nil, err
	}
	var out []replayed
	var frames [][]byte
	for {
		frames, err = z.recv(frames)
		if err != nil {
			return out, fmt.Errorf("replay: %w", err)
		}
		for len(frames) > 0 && len(frames[0]) == 0 {
			frames = frames[1:] // the DEALER's empty delimiter
		}
		seq, payload, ok := split(frames)
		if !ok {
			return out, errors.New("replay: malformed reply")
		}
		if seq == endSeq {
			return out, nil
		}
		out = append(out, replayed{seq, append([]byte(nil), payload...)})
		if seq+1 >= to {
			return out, nil // the live stream has the rest
		}
	}
}
