package fleet

import (
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/worker"
)

func req(method, path string) *httphead.Request {
	return &httphead.Request{Method: []byte(method), Path: []byte(path)}
}

func newFleet(t *testing.T, n int) (*Fleet, *worker.Table) {
	tab := worker.NewTable()
	f := New(Config{Table: tab, Settings: Settings{HoldTimeout: time.Minute}})
	st := stats.NewHeap()
	for i := 0; i < n; i++ {
		tab.Put(&worker.Worker{Slot: i, URL: "http://w" + string(rune('0'+i)), Stats: st.Worker(i)})
	}
	return f, tab
}

// What is held, by phase, method, path and fence.
func TestHeld(t *testing.T) {
	f, tab := newFleet(t, 2)
	w0 := tab.Get(0)
	for _, c := range []struct {
		name  string
		setup func()
		req   *httphead.Request
		w     *worker.Worker
		held  bool
	}{
		{"serving", func() {}, req("POST", "/generate"), nil, false},
		{"paused generate", func() { f.SetPhase(Paused, "abort") }, req("POST", "/generate"), nil, true},
		{"paused, routed", func() {}, req("POST", "/v1/completions"), w0, true},
		{"paused GET", func() {}, req("GET", "/v1/models"), nil, false},
		{"paused control call", func() {}, req("POST", "/collective_rpc?x=1"), nil, false},
		{"paused tokenize", func() {}, req("POST", "/tokenize"), nil, false},
		{"serving again", func() { f.SetPhase(Serving, "") }, req("POST", "/generate"), w0, false},
		{"fenced worker", func() { w0.Fence(worker.FenceVersion) }, req("POST", "/generate"), w0, true},
		{"fenced, not routed", func() {}, req("POST", "/generate"), nil, false},
		{"another worker", func() {}, req("POST", "/generate"), tab.Get(1), false},
	} {
		c.setup()
		if got := f.Held(c.req, c.w); got != c.held {
			t.Errorf("%s: held %v, want %v", c.name, got, c.held)
		}
	}
	w0.Unfence(worker.FenceVersion)
	// Retiring: everything that may generate goes to the successor,
	// which is itself never held.
	succ := &worker.Worker{Slot: -1}
	f.Forward(succ)
	if !f.Held(req("POST", "/generate"), nil) || f.Held(req("POST", "/generate"), succ) || f.Held(req("GET", "/x"), nil) {
		t.Error("forwarding: wrong hold")
	}
}

// A waiter is released by a resume, times out, or leaves with its client;
// the bound on the hold answers HoldFull.
func TestWait(t *testing.T) {
	f, _ := newFleet(t, 1)
	f.cfg.MaxHeldPerWorker = 2
	f.SetPhase(Paused, "abort")
	got := make(chan worker.HoldResult, 2)
	for i := 0; i < 2; i++ {
		go func() { got <- f.Wait(nil, nil, time.Now().Add(time.Minute)) }()
	}
	testenv.WaitFor(t, "two held", func() bool { return f.HeldNow() == 2 })
	if r := f.Wait(nil, nil, time.Now().Add(time.Minute)); r != worker.HoldFull {
		t.Fatalf("a third past the bound: %v", r)
	}
	f.SetPhase(Serving, "")
	for i := 0; i < 2; i++ {
		if r := <-got; r != worker.HoldReleased {
			t.Fatalf("released: %v", r)
		}
	}
	f.SetPhase(Paused, "abort")
	if r := f.Wait(nil, nil, time.Now().Add(10*time.Millisecond)); r != worker.HoldTimeout {
		t.Fatalf("timeout: %v", r)
	}
	gone := make(chan struct{})
	close(gone)
	if r := f.Wait(nil, gone, time.Now().Add(time.Minute)); r != worker.HoldLeft || f.HeldNow() != 0 {
		t.Fatalf("left: %v, %d still held", r, f.HeldNow())
	}
	if c := f.Counts(); c.Released != 2 || c.Full != 1 || c.Timeouts != 1 {
		t.Fatalf("counts %+v", c)
	}
}

// A pause overtaken by a resume, or by another pause, does not finish.
func TestPauseStates(t *testing.T) {
	f, _ := newFleet(t, 1)
	a := f.BeginPause("abort")
	f.SetPhase(Serving, "")
	if st := f.FinishPause(a); st != PauseResumed || f.Phase() != Serving {
		t.Fatalf("a resumed pause finished: %v %v", st, f.Phase())
	}
	a = f.BeginPause("abort")
	b := f.BeginPause("wait")
	if st := f.FinishPause(a); st != PauseSuperseded || f.Phase() != Pausing {
		t.Fatalf("a superseded pause: %v %v", st, f.Phase())
	}
	if st := f.FinishPause(b); st != PauseOurs || f.Phase() != Paused {
		t.Fatalf("the later pause: %v %v", st, f.Phase())
	}
}

// One name per sync for unnamed updates; the next sync gets another.
func TestRoundVersion(t *testing.T) {
	f, _ := newFleet(t, 1)
	f.BeginPause("abort")
	v := f.RoundVersion()
	if f.RoundVersion() != v {
		t.Fatal("two names in one sync")
	}
	f.SetPhase(Serving, "")
	if f.RoundVersion() == v {
		t.Fatal("the same name in the next sync")
	}
}

// A worker that joins a fleet with a target is fenced until its version
// is the target's; an open chunked update ends at its bound.
func TestFences(t *testing.T) {
	f, tab := newFleet(t, 1)
	f.SetVersion("http://w0", "v1")
	f.SetTarget("v1")
	tab.Put(&worker.Worker{Slot: 1, URL: "http://w1", Stats: stats.NewHeap().Worker(1)})
	if tab.Get(1).Fenced()&worker.FenceVersion == 0 || tab.Get(0).Fenced() != 0 {
		t.Fatal("a joining worker of unknown version is not fenced")
	}
	f.SetVersion("http://w1", "v1")
	if tab.Get(1).Fenced() != 0 {
		t.Fatal("still fenced at the target")
	}
	f.Updating(tab.Get(0), true)
	f.SetUpdateOpen(true, 20*time.Millisecond)
	testenv.WaitFor(t, "the open update's bound", func() bool { return !f.UpdateOpen() && tab.Get(0).Fenced() == 0 })
}
