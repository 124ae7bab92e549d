package registry

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/worker"
)

// fakeHealth answers probes from a per-url switch.
type fakeHealth struct {
	mu   sync.Mutex
	down map[string]bool
}

func (f *fakeHealth) set(url string, up bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.down == nil {
		f.down = map[string]bool{}
	}
	f.down[url] = !up
}

func (f *fakeHealth) probe(ctx context.Context, url string) error {
	f.mu.Lock()
	down := f.down[url]
	f.mu.Unlock()
	if down {
		return errors.New("down")
	}
	return nil
}

func newReg(t *testing.T, fh *fakeHealth, mod func(*Options)) *Registry {
	t.Helper()
	o := Options{
		Stats:  stats.NewHeap(),
		Probe:  fh.probe,
		Config: Config{StartupTimeout: 2 * time.Second, RemoveGrace: 2 * time.Second},
		Log:    slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
	if mod != nil {
		mod(&o)
	}
	r := New(o)
	t.Cleanup(r.Close)
	return r
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return c
}

func wurl(i int) string { return fmt.Sprintf("http://127.0.0.1:%d", 20000+i) }

func TestParseURL(t *testing.T) {
	for _, c := range []struct{ in, canon, addr string }{
		{"http://127.0.0.1:8000", "http://127.0.0.1:8000", "127.0.0.1:8000"},
		{"http://LocalHost:8000/", "http://localhost:8000", "localhost:8000"},
		{"HTTP://h", "http://h", "h:80"},
		{"http://[::1]:9", "http://[::1]:9", "[::1]:9"},
	} {
		canon, addr, err := ParseURL(c.in)
		if err != nil || canon != c.canon || addr != c.addr {
			t.Errorf("ParseURL(%q) = %q, %q, %v; want %q, %q", c.in, canon, addr, err, c.canon, c.addr)
		}
	}
	for _, bad := range []string{"", " ", "https://h:1", "ftp://h:1", "h:1", "http://", "http://u:p@h:1",
		"http://h:1/x", "http://h:1?q=1", "http://h:0", "http://h:70000", "http://h:x", "://"} {
		if _, _, err := ParseURL(bad); !errors.Is(err, ErrBadURL) {
			t.Errorf("ParseURL(%q): err %v, want ErrBadURL", bad, err)
		}
	}
}

func slots(r *Registry) map[int]string {
	m := map[int]string{}
	for i, w := range r.Table().Snapshot() {
		if w != nil {
			m[i] = w.URL
		}
	}
	return m
}

func TestSlotsAreStable(t *testing.T) {
	fh := &fakeHealth{}
	r := newReg(t, fh, nil)
	for i := 0; i < 4; i++ {
		in, err := r.Add(ctx(t), wurl(i), OriginAdmin)
		if err != nil || in.Slot != i || in.State != StateHealthy || in.WorkerID != fmt.Sprint(i) {
			t.Fatalf("add %d: %+v, %v", i, in, err)
		}
	}
	// Remove slot 1: slot 1 empty, others unchanged.
	if in, err := r.Remove("1"); err != nil || in.State != StateRemoved || in.URL != wurl(1) {
		t.Fatalf("remove: %+v %v", in, err)
	}
	want := map[int]string{0: wurl(0), 2: wurl(2), 3: wurl(3)}
	if got := slots(r); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("after remove: %v, want %v", got, want)
	}
	if r.Table().Get(1) != nil {
		t.Fatal("slot 1 not empty")
	}
	// Removed by url (escaped or not) works too.
	if _, err := r.Remove("http%3A%2F%2F127.0.0.1%3A20003"); err != nil {
		t.Fatal(err)
	}
	if err := r.WaitRetired(ctx(t), 1); err != nil {
		t.Fatal(err)
	}
	if err := r.WaitRetired(ctx(t), 3); err != nil {
		t.Fatal(err)
	}
	// The next add takes the first free slot: 1, then 3, then 4.
	for i, wantSlot := range []int{1, 3, 4} {
		in, err := r.Add(ctx(t), wurl(10+i), OriginAdmin)
		if err != nil || in.Slot != wantSlot {
			t.Fatalf("add: slot %d err %v, want slot %d", in.Slot, err, wantSlot)
		}
	}
	want = map[int]string{0: wurl(0), 1: wurl(10), 2: wurl(2), 3: wurl(11), 4: wurl(12)}
	if got := slots(r); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("after re-add: %v, want %v", got, want)
	}
	if got := r.URLs(); len(got) != 5 || got[1] != wurl(10) {
		t.Fatalf("URLs: %v", got)
	}
}

func TestBadInputChangesNothing(t *testing.T) {
	fh := &fakeHealth{}
	r := newReg(t, fh, nil)
	if _, err := r.Add(ctx(t), wurl(0), OriginAdmin); err != nil {
		t.Fatal(err)
	}
	before := fmt.Sprint(r.List())
	for _, c := range []struct {
		u    string
		want error
	}{
		{"", ErrBadURL}, {"https://127.0.0.1:1", ErrBadURL}, {"nonsense", ErrBadURL},
		{wurl(0), ErrDuplicate}, {"http://127.0.0.1:20000/", ErrDuplicate},
	} {
		if _, err := r.Add(ctx(t), c.u, OriginAdmin); !errors.Is(err, c.want) {
			t.Errorf("Add(%q): %v, want %v", c.u, err, c.want)
		}
	}
	for _, id := range []string{"7", "-1", wurl(5), ""} {
		if _, err := r.Remove(id); !errors.Is(err, ErrNotFound) {
			t.Errorf("Remove(%q): %v, want ErrNotFound", id, err)
		}
		if _, err := r.Drain(id); !errors.Is(err, ErrNotFound) {
			t.Errorf("Drain(%q): %v, want ErrNotFound", id, err)
		}
	}
	if _, err := r.Get("https://x:1"); !errors.Is(err, ErrBadURL) {
		t.Errorf("Get(https): %v", err)
	}
	if after := fmt.Sprint(r.List()); after != before {
		t.Fatalf("state changed:\n%s\n%s", before, after)
	}
}

func TestAddWaitsForHealth(t *testing.T) {
	fh := &fakeHealth{}
	fh.set(wurl(0), false)
	r := newReg(t, fh, func(o *Options) { o.StartupTimeout = 300 * time.Millisecond })
	// Never healthy: 'unavailable', slot freed.
	if _, err := r.Add(ctx(t), wurl(0), OriginAdmin); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("add of a dead worker: %v", err)
	}
	if len(r.List()) != 0 || r.Table().Get(0) != nil {
		t.Fatalf("dead worker left behind: %+v", r.List())
	}
	// Comes up while Add waits: pending meanwhile, then healthy.
	done := make(chan error, 1)
	r.opts.StartupTimeout = 5 * time.Second
	go func() { _, err := r.Add(ctx(t), wurl(0), OriginAdmin); done <- err }()
	waitFor(t, func() bool { l := r.List(); return len(l) == 1 && l[0].State == StatePending })
	if r.Table().Get(0) != nil {
		t.Fatal("pending worker routable")
	}
	fh.set(wurl(0), true)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if w := r.Table().Get(0); w == nil || w.State() != worker.Healthy {
		t.Fatal("worker not routable after add")
	}
	// Removing a pending worker cancels its Add.
	fh.set(wurl(1), false)
	go func() { _, err := r.Add(ctx(t), wurl(1), OriginAdmin); done <- err }()
	waitFor(t, func() bool { return len(r.List()) == 2 })
	if _, err := r.Remove(wurl(1)); err != nil {
		t.Fatal(err)
	}
	if err := <-done; !errors.Is(err, ErrNotFound) {
		t.Fatalf("cancelled add: %v", err)
	}
	// A caller that gives up cancels too, and leaves nothing behind.
	fh.set(wurl(2), false)
	c, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := r.Add(c, wurl(2), OriginAdmin); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("add with a cancelled context: %v", err)
	}
	if len(r.List()) != 1 {
		t.Fatalf("left behind: %+v", r.List())
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	testenv.WaitFor(t, "the registry's state", cond)
}

func TestHealthHysteresisAndPanic(t *testing.T) {
	fh := &fakeHealth{}
	r := newReg(t, fh, func(o *Options) { o.Failures, o.Successes = 3, 2 })
	r.Put(0, wurl(0), OriginConfig)
	r.Put(1, wurl(1), OriginConfig)
	w0, w1 := r.Table().Get(0), r.Table().Get(1)
	fail := errors.New("boom")
	r.Report(w0, false, fail, false)
	r.Report(w0, false, fail, false)
	if w0.State() != worker.Healthy {
		t.Fatal("unhealthy after 2 failures")
	}
	r.Report(w0, true, nil, false) // resets the count
	r.Report(w0, false, fail, false)
	r.Report(w0, false, fail, true)
	if w0.State() != worker.Healthy {
		t.Fatal("a success did not reset the failures")
	}
	r.Report(w0, false, fail, false)
	if w0.State() != worker.Unhealthy {
		t.Fatal("healthy after 3 failures")
	}
	in, _ := r.Get("0")
	if in.Healthy || in.State != StateUnhealthy || in.LastError != "boom" || in.ConsecutiveFailures != 3 {
		t.Fatalf("info: %+v", in)
	}
	if r.Panic() {
		t.Fatal("panic with a healthy worker")
	}
	for i := 0; i < 3; i++ {
		r.Report(w1, false, fail, false)
	}
	if !r.Panic() || r.PanicEntered() != 1 {
		t.Fatal("no panic with every worker unhealthy")
	}
	r.Report(w1, true, nil, false)
	if w1.State() != worker.Unhealthy {
		t.Fatal("healthy after 1 success")
	}
	r.Report(w1, true, nil, false)
	if w1.State() != worker.Healthy || r.Panic() {
		t.Fatal("not healthy after 2 successes")
	}
	// A stale observation (a worker no longer in its slot) is ignored.
	stale := &worker.Worker{Slot: 1}
	for i := 0; i < 5; i++ {
		r.Report(stale, false, fail, false)
	}
	if w1.State() != worker.Healthy {
		t.Fatal("stale report applied")
	}
	r.ForceHealth(1, false, "process exited")
	if w1.State() != worker.Unhealthy {
		t.Fatal("ForceHealth")
	}
}

func TestDrain(t *testing.T) {
	fh := &fakeHealth{}
	r := newReg(t, fh, nil)
	r.Put(0, wurl(0), OriginConfig)
	r.Put(1, wurl(1), OriginConfig)
	in, err := r.Drain("1")
	if err != nil || in.State != StateDraining || !in.Healthy {
		t.Fatalf("drain: %+v %v", in, err)
	}
	w1 := r.Table().Get(1)
	if w1 == nil || w1.State() != worker.Draining {
		t.Fatal("draining worker left its slot or kept routing")
	}
	// Health changes keep it draining, and its health is still tracked.
	for i := 0; i < 3; i++ {
		r.Report(w1, false, errors.New("x"), false)
	}
	if w1.State() != worker.Draining {
		t.Fatal("health check undid the drain")
	}
	if in, _ := r.Get("1"); in.Healthy {
		t.Fatal("health not tracked while draining")
	}
	// The draining worker does not count for panic mode.
	if r.Panic() {
		t.Fatal("panic with a healthy routable worker")
	}
	if in, err := r.Drain(wurl(1)); err != nil || in.State != StateDraining {
		t.Fatal("drain twice", err)
	}
}

// TestRetireWaitsForInFlight: a removed worker keeps its slot reserved
// while it has requests in flight; its slot counters reset only when a new
// worker takes the slot, and never under a request still running.
func TestRetireWaitsForInFlight(t *testing.T) {
	fh := &fakeHealth{}
	r := newReg(t, fh, nil)
	r.Put(0, wurl(0), OriginConfig)
	w := r.Table().Get(0)
	w.Stats.Begin() // a request in flight
	w.Stats.AddUp(100)
	if _, err := r.Remove("0"); err != nil {
		t.Fatal(err)
	}
	l := r.List()
	if len(l) != 1 || l[0].State != StateRemoved || l[0].InFlight != 1 {
		t.Fatalf("list while retiring: %+v", l)
	}
	// The slot is not free yet: a new worker goes to slot 1.
	in, err := r.Add(ctx(t), wurl(1), OriginAdmin)
	if err != nil || in.Slot != 1 {
		t.Fatalf("add while retiring: %+v %v", in, err)
	}
	w.Stats.End(false)
	if err := r.WaitRetired(ctx(t), 0); err != nil {
		t.Fatal(err)
	}
	// Counters stay until a new worker takes the slot...
	if s := w.Stats.Load(); s.Requests != 1 || s.BytesUp != 100 {
		t.Fatalf("counters reset at removal: %+v", s)
	}
	in, err = r.Add(ctx(t), wurl(2), OriginAdmin)
	if err != nil || in.Slot != 0 {
		t.Fatalf("add after retire: %+v %v", in, err)
	}
	if s := r.Table().Get(0).Stats.Load(); s.Requests != 0 || s.BytesUp != 0 || s.InFlight != 0 {
		t.Fatalf("counters not reset for the new worker: %+v", s)
	}
}

func TestRetireBound(t *testing.T) {
	fh := &fakeHealth{}
	r := newReg(t, fh, func(o *Options) { o.RemoveGrace = 50 * time.Millisecond })
	r.Put(0, wurl(0), OriginConfig)
	w := r.Table().Get(0)
	w.Stats.Begin() // never ends within the grace
	r.Remove("0")
	if err := r.WaitRetired(ctx(t), 0); err != nil {
		t.Fatal(err)
	}
	// A new worker in the slot: running totals reset, the gauge is left
	// for the old request to bring back to zero.
	in, err := r.Add(ctx(t), wurl(1), OriginAdmin)
	if err != nil || in.Slot != 0 {
		t.Fatalf("%+v %v", in, err)
	}
	s := r.Table().Get(0).Stats
	if got := s.Load(); got.Requests != 0 || got.InFlight != 1 {
		t.Fatalf("after reuse: %+v", got)
	}
	w.Stats.End(false)
	if s.Pending() != 0 {
		t.Fatal("in flight wrapped")
	}
}

func TestReserveActivateRetarget(t *testing.T) {
	fh := &fakeHealth{}
	var puts atomic.Int32
	r := newReg(t, fh, func(o *Options) { o.OnPut = func(*worker.Worker) { puts.Add(1) } })
	if err := r.Reserve(0, wurl(0), OriginSpawn); err != nil {
		t.Fatal(err)
	}
	if err := r.Reserve(0, wurl(1), OriginSpawn); err == nil {
		t.Fatal("reserved a taken slot")
	}
	// Adds skip the reserved slot.
	in, err := r.Add(ctx(t), wurl(5), OriginAdmin)
	if err != nil || in.Slot != 1 {
		t.Fatalf("%+v %v", in, err)
	}
	if l, _ := r.Get("0"); l.State != StatePending || r.Table().Get(0) != nil {
		t.Fatalf("reserved: %+v", l)
	}
	if err := r.Activate(0); err != nil {
		t.Fatal(err)
	}
	if w := r.Table().Get(0); w == nil || w.State() != worker.Healthy {
		t.Fatal("not active")
	}
	if _, err := r.Remove("0"); !errors.Is(err, ErrManaged) {
		t.Fatalf("removing a spawned worker: %v", err)
	}
	r.ForceHealth(0, false, "exited")
	r.Activate(0) // ready again
	if r.Table().Get(0).State() != worker.Healthy {
		t.Fatal("re-activate")
	}
	old := r.Table().Get(0)
	old.Stats.AddUp(7)
	if err := r.Retarget(0, wurl(9)); err != nil {
		t.Fatal(err)
	}
	nw := r.Table().Get(0)
	if nw == old || nw.URL != wurl(9) || nw.Stats != old.Stats || nw.Stats.Load().BytesUp != 7 {
		t.Fatalf("retarget: %+v", nw)
	}
	if puts.Load() != 3 { // activate, add, retarget
		t.Fatalf("OnPut called %d times", puts.Load())
	}
}

func TestSync(t *testing.T) {
	fh := &fakeHealth{}
	r := newReg(t, fh, nil)
	r.Put(0, wurl(0), OriginConfig)
	r.Put(1, wurl(1), OriginConfig)
	r.Put(2, wurl(2), OriginConfig)
	if _, err := r.Add(ctx(t), wurl(3), OriginAdmin); err != nil {
		t.Fatal(err)
	}
	before := fmt.Sprint(slots(r))
	if _, _, err := r.Sync([]string{wurl(0), "https://x:1"}); err == nil {
		t.Fatal("invalid url accepted")
	}
	if _, _, err := r.Sync([]string{wurl(0), wurl(0)}); err == nil {
		t.Fatal("duplicate accepted")
	}
	if fmt.Sprint(slots(r)) != before {
		t.Fatal("a refused sync changed something")
	}
	// Drop 1, keep 0 and 2, add 7 and 8; the admin worker (3) stays.
	added, removed, err := r.Sync([]string{wurl(2), wurl(7), wurl(0), wurl(8)})
	if err != nil || fmt.Sprint(added) != fmt.Sprint([]string{wurl(7), wurl(8)}) || fmt.Sprint(removed) != fmt.Sprint([]string{wurl(1)}) {
		t.Fatalf("sync: %v %v %v", added, removed, err)
	}
	waitFor(t, func() bool { return len(slots(r)) == 5 })
	got := slots(r)
	for slot, u := range map[int]string{0: wurl(0), 2: wurl(2), 3: wurl(3)} {
		if got[slot] != u {
			t.Fatalf("after sync: %v: slot %d moved", got, slot)
		}
	}
	seen := map[string]bool{}
	for _, u := range got {
		seen[u] = true
	}
	if !seen[wurl(7)] || !seen[wurl(8)] || seen[wurl(1)] {
		t.Fatalf("after sync: %v", got)
	}
	if in, _ := r.Get("3"); in.Origin != OriginAdmin {
		t.Fatal("admin worker adopted though not listed")
	}
	// Listing an admin-added url makes it config-managed.
	r.Sync([]string{wurl(0), wurl(2), wurl(3), wurl(7), wurl(8)})
	if in, _ := r.Get("3"); in.Origin != OriginConfig {
		t.Fatal("listed admin worker not adopted")
	}
}

// A drain asked while the worker is still pending (not yet healthy) holds
// once it comes up: the routing table has it draining, not healthy
// (issue 12: it took a third of the new keys).
func TestDrainWhilePending(t *testing.T) {
	fh := &fakeHealth{}
	fh.set(wurl(3), false)
	r := newReg(t, fh, func(o *Options) { o.StartupTimeout = 5 * time.Second })
	done := make(chan error, 1)
	go func() {
		_, err := r.Add(ctx(t), wurl(3), OriginAdmin)
		done <- err
	}()
	var in Info
	testenv.WaitFor(t, "the add to be pending", func() bool {
		var err error
		in, err = r.Get(wurl(3))
		return err == nil
	})
	if in.State != StatePending {
		t.Fatalf("state %q, want pending", in.State)
	}
	if in, err := r.Drain(wurl(3)); err != nil || in.State != StatePending {
		t.Fatalf("drain while pending: %+v %v", in, err)
	}
	fh.set(wurl(3), true)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	in, _ = r.Get(wurl(3))
	w := r.Table().Get(in.Slot)
	if w == nil || w.State() != worker.Draining {
		t.Fatalf("worker came up as %+v, want draining", w)
	}
	if in, _ := r.Get(wurl(3)); in.State != StateDraining {
		t.Fatalf("listed as %q", in.State)
	}
}

// Adds of unreachable URLs cannot fill the slots: at most MaxPending wait
// for their first good check at once; the next is refused at once.
func TestPendingAddsBounded(t *testing.T) {
	fh := &fakeHealth{}
	for i := 10; i < 13; i++ {
		fh.set(wurl(i), false)
	}
	r := newReg(t, fh, func(o *Options) { o.MaxPending = 2; o.StartupTimeout = 3 * time.Second })
	c, cancel := context.WithCancel(context.Background())
	defer cancel()
	errs := make(chan error, 2)
	for i := 10; i < 12; i++ {
		go func() { _, err := r.Add(c, wurl(i), OriginAdmin); errs <- err }()
	}
	testenv.WaitFor(t, "two adds pending", func() bool { return r.Counts()[StatePending] >= 2 })
	start := time.Now()
	if _, err := r.Add(ctx(t), wurl(12), OriginAdmin); !errors.Is(err, ErrTooManyPending) || time.Since(start) > time.Second {
		t.Fatalf("third pending add: %v after %v, want ErrTooManyPending at once", err, time.Since(start))
	}
	cancel()
	<-errs
	<-errs
	// Once they are gone, adds go through again.
	fh.set(wurl(12), true)
	if _, err := r.Add(ctx(t), wurl(12), OriginAdmin); err != nil {
		t.Fatal(err)
	}
}

// A pending add holds no slot (it takes one once healthy): adds of URLs
// that never come up cannot keep a legitimate one out (issue 12: 1,100 of
// them filled the 1,024 slots for minutes).
func TestPendingHoldsNoSlot(t *testing.T) {
	fh := &fakeHealth{}
	fh.set(wurl(20), false)
	fh.set(wurl(21), false)
	r := newReg(t, fh, func(o *Options) { o.MaxWorkers = 2; o.StartupTimeout = 3 * time.Second })
	c, cancel := context.WithCancel(context.Background())
	defer cancel()
	errs := make(chan error, 2)
	for i := 20; i < 22; i++ {
		go func() { _, err := r.Add(c, wurl(i), OriginAdmin); errs <- err }()
	}
	testenv.WaitFor(t, "two adds pending", func() bool { return r.Counts()[StatePending] >= 2 })
	for _, in := range r.List() {
		if in.State == StatePending && (in.Slot != -1 || in.WorkerID != "") {
			t.Fatalf("a pending worker shows a slot: %+v", in)
		}
	}
	in, err := r.Add(ctx(t), wurl(22), OriginAdmin)
	if err != nil || in.Slot != 0 || r.Table().Get(0) == nil {
		t.Fatalf("legitimate add while 2 are pending in a 2-slot registry: %+v %v", in, err)
	}
	// One of the pending ones comes up: it takes the last slot.
	fh.set(wurl(20), true)
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
	if in, _ := r.Get(wurl(20)); in.Slot != 1 || in.State != StateHealthy {
		t.Fatalf("came up as %+v, want slot 1", in)
	}
	cancel()
	<-errs
}
