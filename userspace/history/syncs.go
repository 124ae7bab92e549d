package history

import (
	"bytes"
	"encoding/json"
	"math"
	"net/http"
	"sync"
	"time"

	"github.com/tether-rl/tether/userspace/dialect"
)

// The weight syncs' timeline: each call to tetherd's pause, update and
// resume endpoints (userspace/engine) is a step, read from its answer;
// a pause opens a sync, a resume closes it, updates go into the open one
// (or one of their own when no pause is open).

// Bounds of the timeline.
const (
	MaxSyncs = 20 // syncs kept, the newest
	MaxSteps = 64 // steps kept per sync (a chunked update may make many: the rest are counted)
	// maxAnswer bounds the part of an answer read (per-worker answers of
	// 64 workers fit); a longer answer's step keeps its status and time.
	maxAnswer = 4 << 20
)

// Call is one engine's call in a step.
type Call struct {
	Slot      int     `json:"slot"`
	DurationS float64 `json:"duration_s"`
	Status    int     `json:"status,omitempty"`
	Error     string  `json:"error,omitempty"`
}

// Step is one part of a sync.
type Step struct {
	Kind      string    `json:"kind"` // pause, quiesce, update, resume
	Path      string    `json:"path"`
	Start     time.Time `json:"start"`
	DurationS float64   `json:"duration_s"`
	Status    int       `json:"status"` // the HTTP status tetherd answered
	// The pause and its quiesce.
	Mode         string `json:"mode,omitempty"`
	AbortWaves   int    `json:"abort_waves,omitempty"`
	Quiet        *bool  `json:"quiet,omitempty"`
	StillRunning int    `json:"still_running,omitempty"`
	Held         int    `json:"held,omitempty"`     // requests held at the pause's end
	Released     int    `json:"released,omitempty"` // held requests released by the resume
	Version      string `json:"version,omitempty"`  // the fleet's target after an update
	Fenced       []int  `json:"fenced,omitempty"`
	Engines      []Call `json:"engines,omitempty"`
	Failed       int    `json:"failed"`
	Message      string `json:"message,omitempty"`
}

// Sync is one weight sync: its steps in order.
type Sync struct {
	ID      uint64     `json:"id"`
	Start   time.Time  `json:"start"`
	End     *time.Time `json:"end,omitempty"` // the resume's end; nil while open
	Open    bool       `json:"open"`
	Steps   []Step     `json:"steps"`
	Dropped int        `json:"dropped_steps,omitempty"` // past MaxSteps
	Failed  int        `json:"failed"`                  // engine calls that failed, every step
	// HeldPeak: the most requests held at the end of a step.
	HeldPeak int `json:"held_peak"`
}

// Syncs is the timeline of the last MaxSyncs syncs, safe for concurrent
// use.
type Syncs struct {
	mu   sync.Mutex
	list []*Sync // oldest first
	seq  uint64
}

// NewSyncs returns an empty timeline.
func NewSyncs() *Syncs { return &Syncs{} }

// List returns copies of the syncs, newest first.
func (s *Syncs) List() []Sync {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Sync, 0, len(s.list))
	for i := len(s.list) - 1; i >= 0; i-- {
		c := *s.list[i]
		c.Steps = append([]Step(nil), c.Steps...)
		out = append(out, c)
	}
	return out
}

// Add appends steps: a pause opens a new sync (closing an open one, which
// a resume never ended), a resume closes the open one, an update joins it.
func (s *Syncs) Add(steps ...Step) {
	if len(steps) == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var cur *Sync
	if n := len(s.list); n > 0 && s.list[n-1].Open {
		cur = s.list[n-1]
	}
	first := steps[0]
	if first.Kind == "pause" || first.Kind == "quiesce" || cur == nil {
		if cur != nil {
			cur.Open = false
		}
		s.seq++
		cur = &Sync{ID: s.seq, Start: first.Start, Open: true}
		s.list = append(s.list, cur)
		if len(s.list) > MaxSyncs {
			s.list = append(s.list[:0], s.list[len(s.list)-MaxSyncs:]...)
		}
	}
	for _, st := range steps {
		if len(cur.Steps) < MaxSteps {
			cur.Steps = append(cur.Steps, st)
		} else {
			cur.Dropped++
		}
		cur.Failed += st.Failed
		cur.HeldPeak = max(cur.HeldPeak, st.Held)
		if st.Kind == "resume" {
			end := st.Start.Add(time.Duration(st.DurationS * float64(time.Second)))
			cur.End, cur.Open = &end, false
		}
	}
}

// Kind names what a sync endpoint's path does: pause, resume, update,
// or "" (not a sync step).
func Kind(path []byte) string {
	for i, c := range path {
		if c == '?' {
			path = path[:i]
			break
		}
	}
	e, ok := dialect.Served(path)
	if !ok {
		return ""
	}
	switch e.Op {
	case dialect.OpPause:
		return "pause"
	case dialect.OpResume:
		return "resume"
	case dialect.OpUpdate:
		return "update"
	}
	return ""
}

// Recording wraps tetherd's local-endpoint hook (proxy.Config.Local):
// the sync endpoints' handlers are wrapped to record their steps in s;
// every other path gets local's answer as it is (a nil stays nil, with no
// allocation).
func Recording(local func(method, path []byte) http.Handler, s *Syncs) func(method, path []byte) http.Handler {
	return func(method, path []byte) http.Handler {
		h := local(method, path)
		if h == nil || string(method) != http.MethodPost {
			return h
		}
		kind := Kind(path)
		if kind == "" {
			return h
		}
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			rec := &recorder{ResponseWriter: w}
			start := time.Now()
			h.ServeHTTP(rec, r)
			s.Add(Steps(kind, r.URL.Path, start, time.Since(start), rec.status(), rec.body.Bytes(), rec.over)...)
		})
	}
}

// recorder passes an answer on and keeps its first maxAnswer bytes.
type recorder struct {
	http.ResponseWriter
	code int
	body bytes.Buffer
	over bool
}

func (r *recorder) WriteHeader(code int) {
	if r.code == 0 {
		r.code = code
	}
	r.ResponseWriter.WriteHeader(code)
}

func (r *recorder) Write(p []byte) (int, error) {
	if r.code == 0 {
		r.code = http.StatusOK
	}
	if !r.over {
		if r.body.Len()+len(p) > maxAnswer {
			r.over = true
		} else {
			r.body.Write(p)
		}
	}
	return r.ResponseWriter.Write(p)
}

func (r *recorder) status() int {
	if r.code == 0 {
		return http.StatusOK
	}
	return r.code
}

// answer is what the steps read of the engine endpoints' answers
// (engine.PauseAnswer, ResumeAnswer, ControlAnswer).
type answer struct {
	Mode         string            `json:"mode"`
	Quiet        *bool             `json:"quiet"`
	Held         int               `json:"held"`
	AbortWaves   int               `json:"abort_waves"`
	QuiesceS     *float64          `json:"quiesce_s"`
	StillRunning []json.RawMessage `json:"still_running"`
	Released     int               `json:"released"`
	Version      string            `json:"weight_version"`
	Fenced       []int             `json:"fenced"`
	Successful   []result          `json:"successful"`
	Failed       []result          `json:"failed"`
	Message      string            `json:"message"`
	Error        *struct {
		Message string `json:"message"`
	} `json:"error"`
}

type result struct {
	Worker   int     `json:"worker"`
	Status   int     `json:"status"`
	Error    string  `json:"error"`
	ElapsedS float64 `json:"elapsed_s"`
}

// Steps turns one call's answer into its steps: a pause with a quiesce
// is two (the quiesce, then the engines' pause calls).
func Steps(kind, path string, start time.Time, d time.Duration, status int, body []byte, cut bool) []Step {
	st := Step{Kind: kind, Path: path, Start: start, DurationS: secs(d.Seconds()), Status: status}
	var a answer
	if cut || json.Unmarshal(body, &a) != nil {
		st.Message = "answer not read"
		if status >= 300 {
			st.Failed = 1
		}
		return []Step{st}
	}
	if a.Error != nil {
		st.Message, st.Failed = a.Error.Message, 1
		return []Step{st}
	}
	st.Mode, st.Held, st.Released, st.Version, st.Fenced, st.Message = a.Mode, a.Held, a.Released, a.Version, a.Fenced, a.Message
	for _, list := range [][]result{a.Successful, a.Failed} {
		for _, r := range list {
			st.Engines = append(st.Engines, Call{Slot: r.Worker, DurationS: secs(r.ElapsedS), Status: r.Status, Error: r.Error})
		}
	}
	st.Failed = len(a.Failed)
	if kind != "pause" || a.QuiesceS == nil || (a.Mode != "abort" && a.Mode != "wait") {
		st.Quiet = a.Quiet
		return []Step{st}
	}
	qs := min(max(*a.QuiesceS, 0), d.Seconds()) // within the call
	q := Step{Kind: "quiesce", Path: path, Start: start, DurationS: secs(qs), Status: status, Mode: a.Mode,
		AbortWaves: a.AbortWaves, Quiet: a.Quiet, StillRunning: len(a.StillRunning)}
	st.Start = start.Add(time.Duration(qs * float64(time.Second)))
	st.DurationS = secs(d.Seconds() - qs)
	return []Step{q, st}
}

// secs rounds to the millisecond.
func secs(x float64) float64 { return math.Round(x*1000) / 1000 }
