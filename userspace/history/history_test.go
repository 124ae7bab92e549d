package history

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
)

func TestRingBoundedAndRates(t *testing.T) {
	r := NewRing(3)
	t0 := time.Unix(1000, 0)
	for i := 0; i <= 5; i++ {
		r.Add(t0.Add(time.Duration(i)*time.Second), Reading{Requests: uint64(i * 10), Held: i})
	}
	pts := r.Points()
	if len(pts) != 3 || r.Len() != 3 {
		t.Fatalf("kept %d points, want 3 (the ring's bound)", len(pts))
	}
	for i, p := range pts {
		if p.Held != i+3 || p.ReqPerSec != 10 {
			t.Fatalf("point %d: %+v (want held %d, 10/s, oldest first)", i, p, i+3)
		}
	}
}

func TestRingCounterResetIsNoRate(t *testing.T) {
	r := NewRing(4)
	t0 := time.Unix(1000, 0)
	r.Add(t0, Reading{Requests: 100})
	r.Add(t0.Add(time.Second), Reading{Requests: 5})
	if p := r.Points(); len(p) != 1 || p[0].ReqPerSec != 0 {
		t.Fatalf("a counter that went back: %+v", p)
	}
}

func TestSyncsGroupAndBound(t *testing.T) {
	s := NewSyncs()
	t0 := time.Unix(1000, 0)
	s.Add(Step{Kind: "update", Start: t0}) // no pause: its own sync
	s.Add(Step{Kind: "quiesce", Start: t0}, Step{Kind: "pause", Start: t0, Held: 7})
	s.Add(Step{Kind: "update", Start: t0, Failed: 1})
	s.Add(Step{Kind: "resume", Start: t0, DurationS: 1})
	l := s.List()
	if len(l) != 2 || l[0].Open || len(l[0].Steps) != 4 || l[0].Failed != 1 || l[0].HeldPeak != 7 || l[0].End == nil {
		t.Fatalf("syncs: %+v", l)
	}
	if l[1].Open {
		t.Fatalf("the update-only sync was not closed by the next pause: %+v", l[1])
	}
	for i := 0; i < MaxSyncs+5; i++ {
		s.Add(Step{Kind: "pause", Start: t0})
	}
	for i := 0; i < MaxSteps+3; i++ {
		s.Add(Step{Kind: "update", Start: t0})
	}
	l = s.List()
	if len(l) != MaxSyncs || len(l[0].Steps) != MaxSteps || l[0].Dropped != 4 {
		t.Fatalf("bounds: %d syncs, %d steps, %d dropped", len(l), len(l[0].Steps), l[0].Dropped)
	}
}

func TestStepsFromAnswers(t *testing.T) {
	t0 := time.Unix(1000, 0)
	for _, c := range []struct {
		name, kind, body string
		status           int
		want             []string // kinds
		check            func(t *testing.T, st []Step)
	}{
		{"pause abort", "pause", `{"mode":"abort","quiet":true,"held":3,"abort_waves":2,"quiesce_s":0.5,"successful":[{"worker":0,"status":200,"elapsed_s":0.1}],"failed":[{"worker":1,"error":"timeout","elapsed_s":5}],"still_running":[]}`, 502,
			[]string{"quiesce", "pause"}, func(t *testing.T, st []Step) {
				if st[0].AbortWaves != 2 || st[0].DurationS != 0.5 || st[1].Held != 3 || st[1].Failed != 1 || len(st[1].Engines) != 2 || st[1].DurationS != 0.5 {
					t.Fatalf("%+v", st)
				}
			}},
		{"pause keep", "pause", `{"mode":"keep","quiet":true,"held":0,"quiesce_s":0,"successful":[],"failed":[]}`, 200, []string{"pause"}, nil},
		{"resume", "resume", `{"released":4,"fenced":[2],"successful":[],"failed":[]}`, 200, []string{"resume"}, func(t *testing.T, st []Step) {
			if st[0].Released != 4 || len(st[0].Fenced) != 1 {
				t.Fatalf("%+v", st)
			}
		}},
		{"refused", "update", `{"error":{"code":400,"message":"body must be a JSON object"}}`, 400, []string{"update"}, func(t *testing.T, st []Step) {
			if st[0].Failed != 1 || st[0].Message == "" {
				t.Fatalf("%+v", st)
			}
		}},
		{"not json", "update", `oops`, 500, []string{"update"}, func(t *testing.T, st []Step) {
			if st[0].Failed != 1 {
				t.Fatalf("%+v", st)
			}
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			st := Steps(c.kind, "/p", t0, time.Second, c.status, []byte(c.body), false)
			var kinds []string
			for _, s := range st {
				kinds = append(kinds, s.Kind)
			}
			if strings.Join(kinds, ",") != strings.Join(c.want, ",") {
				t.Fatalf("kinds %v, want %v", kinds, c.want)
			}
			if c.check != nil {
				c.check(t, st)
			}
		})
	}
}

func TestKind(t *testing.T) {
	for path, want := range map[string]string{"/pause_generation": "pause", "/pause?mode=abort": "pause", "/resume": "resume",
		"/continue_generation": "resume", "/update_weights_from_disk": "update", "/generate": "", "/v1/completions": ""} {
		if got := Kind([]byte(path)); got != want {
			t.Errorf("Kind(%s) = %q, want %q", path, got, want)
		}
	}
}

// Recording passes answers through as they are, records sync steps only,
// and leaves every other path's handler (nil included) alone.
func TestRecording(t *testing.T) {
	s := NewSyncs()
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(200)
		json.NewEncoder(w).Encode(map[string]any{"mode": "abort", "held": 1, "quiesce_s": 0.01, "successful": []any{}, "failed": []any{}})
	})
	local := func(method, path []byte) http.Handler {
		if string(path) == "/generate" {
			return nil
		}
		return h
	}
	rec := Recording(local, s)
	if rec([]byte("POST"), []byte("/generate")) != nil {
		t.Fatal("a proxied path got a handler")
	}
	if allocs := testing.AllocsPerRun(100, func() { rec([]byte("POST"), []byte("/generate")) }); allocs != 0 {
		t.Fatalf("%v allocations on a proxied path", allocs)
	}
	rec([]byte("GET"), []byte("/get_loads")).ServeHTTP(httptest.NewRecorder(), httptest.NewRequest("GET", "/get_loads", nil))
	if len(s.List()) != 0 {
		t.Fatal("a GET was recorded")
	}
	w := httptest.NewRecorder()
	rec([]byte("POST"), []byte("/pause_generation")).ServeHTTP(w, httptest.NewRequest("POST", "/pause_generation", nil))
	if w.Code != 200 || !strings.Contains(w.Body.String(), `"held":1`) {
		t.Fatalf("answer not passed on: %d %s", w.Code, w.Body)
	}
	l := s.List()
	if len(l) != 1 || len(l[0].Steps) != 2 || l[0].Steps[1].Held != 1 {
		t.Fatalf("recorded: %+v", l)
	}
}

func TestSampler(t *testing.T) {
	r := NewRing(10)
	n := uint64(0)
	s := &Sampler{Ring: r, Interval: time.Millisecond, Read: func() Reading { n += 5; return Reading{Requests: n} }}
	s.Start()
	testenv.WaitFor(t, "three samples", func() bool { return r.Len() >= 3 })
	s.Stop()
	s.Stop()
}

// What the recorder adds to a proxied request's local-hook call (the
// data path's only contact with it): a call and a nil check.
func BenchmarkRecordingProxiedPath(b *testing.B) {
	local := func(method, path []byte) http.Handler { return nil }
	rec := Recording(local, NewSyncs())
	m, p := []byte("POST"), []byte("/v1/chat/completions")
	b.Run("bare", func(b *testing.B) {
		for b.Loop() {
			local(m, p)
		}
	})
	b.Run("recording", func(b *testing.B) {
		for b.Loop() {
			rec(m, p)
		}
	})
}
