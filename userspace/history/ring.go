// Package history keeps what tetherd's live page (GET /ui) draws over
// time, in memory and bounded: a ring of samples taken every few seconds
// (requests per second, held requests, each engine's KV usage: the last
// 15 minutes by default) and the timeline of the last weight syncs (pause,
// quiesce and its abort waves, each engine's update call, resume), read
// from the answers of tetherd's own sync endpoints. Nothing here is on the
// data path: the sampler reads counters every Interval, and the recorder
// wraps only the sync endpoints' handlers (Recording).
package history

import (
	"sync"
	"time"
)

// Defaults: 180 samples 5 s apart, 15 minutes.
const (
	DefaultInterval = 5 * time.Second
	DefaultSamples  = 180
)

// KV is one engine's KV usage in a sample.
type KV struct {
	Slot  int     `json:"slot"`
	Usage float64 `json:"kv"`
}

// Point is one sample.
type Point struct {
	T         time.Time `json:"t"`
	ReqPerSec float64   `json:"rps"`  // requests read from clients per second, by this process
	Held      int       `json:"held"` // requests held by the fleet's hold
	KV        []KV      `json:"kv,omitempty"`
}

// Reading is what a sample reads: this process's requests read so far (a
// counter), the requests held now, and each engine's KV usage.
type Reading struct {
	Requests uint64
	Held     int
	KV       []KV
}

// Ring is a bounded ring of samples, safe for concurrent use.
type Ring struct {
	mu    sync.Mutex
	buf   []Point
	next  int
	full  bool
	last  Reading
	lastT time.Time
}

// NewRing returns a ring of n samples (n <= 0: DefaultSamples).
func NewRing(n int) *Ring {
	if n <= 0 {
		n = DefaultSamples
	}
	return &Ring{buf: make([]Point, n)}
}

// Add records reading r taken at t; the rate is against the reading
// before it (the first reading only sets the base).
func (r *Ring) Add(t time.Time, rd Reading) {
	r.mu.Lock()
	defer r.mu.Unlock()
	first := r.lastT.IsZero()
	p := Point{T: t, Held: rd.Held, KV: rd.KV}
	if !first {
		if dt := t.Sub(r.lastT).Seconds(); dt > 0 && rd.Requests >= r.last.Requests {
			p.ReqPerSec = float64(rd.Requests-r.last.Requests) / dt
		}
	}
	r.last, r.lastT = rd, t
	if first {
		return
	}
	r.buf[r.next] = p
	r.next++
	if r.next == len(r.buf) {
		r.next, r.full = 0, true
	}
}

// Points returns the samples, oldest first.
func (r *Ring) Points() []Point {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []Point
	if r.full {
		out = make([]Point, 0, len(r.buf))
		out = append(out, r.buf[r.next:]...)
	} else {
		out = make([]Point, 0, r.next)
	}
	return append(out, r.buf[:r.next]...)
}

// Since returns the samples taken after t, oldest first (all of them for
// a zero t).
func (r *Ring) Since(t time.Time) []Point {
	pts := r.Points()
	if t.IsZero() {
		return pts
	}
	i := len(pts)
	for i > 0 && pts[i-1].T.After(t) {
		i--
	}
	return pts[i:]
}

// Len is the number of samples kept.
func (r *Ring) Len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.full {
		return len(r.buf)
	}
	return r.next
}

// Sampler reads every Interval into a Ring until stopped.
type Sampler struct {
	Ring     *Ring
	Interval time.Duration
	Read     func() Reading
	stop     chan struct{}
	done     chan struct{}
}

// Start takes a first reading at once and then one every Interval
// (DefaultInterval when zero), until Stop.
func (s *Sampler) Start() {
	if s.Interval <= 0 {
		s.Interval = DefaultInterval
	}
	s.stop, s.done = make(chan struct{}), make(chan struct{})
	s.Ring.Add(time.Now(), s.Read())
	go func() {
		defer close(s.done)
		t := time.NewTicker(s.Interval)
		defer t.Stop()
		for {
			select {
			case <-s.stop:
				return
			case now := <-t.C:
				s.Ring.Add(now, s.Read())
			}
		}
	}()
}

// Stop ends the sampling (once Started; a second Stop does nothing).
func (s *Sampler) Stop() {
	if s.stop == nil {
		return
	}
	select {
	case <-s.stop:
	default:
		close(s.stop)
	}
	<-s.done
}
