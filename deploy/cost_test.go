package deploy

import (
	"io"
	"net/http"
	"net/url"
	"syscall"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/history"
)

// cpu is this process's CPU time (user and system).
func cpu(t *testing.T) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// TestPageCost measures what the live page costs tetherd with 64
// workers: the CPU of serving GET /ui/state (a full answer, as on the
// page's first load, with the 15-minute history full and 20 syncs of 64
// engines on the timeline, and the incremental one every later refresh
// asks for), against the same wall time idle, and the page refreshing
// every 2 s must cost under 1% of a core. The figures are logged.
func TestPageCost(t *testing.T) {
	if raceEnabled {
		t.Skip("SKIPPED: CPU figures under the race detector are not tetherd's; measured without it: go test -run TestPageCost -v ./deploy")
	}
	const workers = 64
	fx := newFixturePoll(t, workers, 0, "", time.Second)
	testenv.WaitForWithin(t, "every engine's signals", time.Minute, func() bool {
		n := 0
		for _, w := range fx.d.Table.Snapshot() {
			if w != nil && w.EngineKnown() {
				n++
			}
		}
		return n == workers
	})
	// The timeline full: MaxSyncs syncs, each pause, update, resume over
	// the 64 engines.
	for i := 0; i < history.MaxSyncs; i++ {
		fx.post(t, "/pause_generation", `{"mode":"abort"}`)
		fx.post(t, "/update_weights_from_disk", `{"model_path":"/m"}`)
		fx.post(t, "/continue_generation", "")
	}
	// The history full: 15 minutes of samples with 64 engines' KV each.
	ring := fx.d.UIHistory()
	t0 := time.Now().Add(-15 * time.Minute)
	kv := make([]history.KV, workers)
	for i := range kv {
		kv[i] = history.KV{Slot: i, Usage: float64(i) / workers}
	}
	for i := 0; i <= history.DefaultSamples; i++ {
		ring.Add(t0.Add(time.Duration(i)*history.DefaultInterval), history.Reading{Requests: uint64(i * 5000), Held: i % 7, KV: kv})
	}
	last := ring.Points()[ring.Len()-1].T

	get := func(q string) int {
		resp, err := fx.client.Get(fx.admin + "/ui/state" + q)
		if err != nil {
			t.Fatal(err)
		}
		n, _ := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("GET /ui/state%s: %d", q, resp.StatusCode)
		}
		return int(n)
	}
	// measure: the CPU of n answers minus that of the same wall time
	// idle, per answer (the best of three rounds: the machine is shared).
	measure := func(q string, n int) (time.Duration, int) {
		best, size := time.Duration(1<<62), 0
		for round := 0; round < 3; round++ {
			c0, w0 := cpu(t), time.Now()
			for i := 0; i < n; i++ {
				size = get(q)
			}
			busy, wall := cpu(t)-c0, time.Since(w0)
			c1 := cpu(t)
			time.Sleep(wall) // the same span idle: the engines' and the poller's own CPU
			idle := cpu(t) - c1
			if per := (busy - idle) / time.Duration(n); per < best {
				best = per
			}
		}
		return max(best, 0), size
	}
	get("") // warm
	full, fullSize := measure("", 50)
	incr, incrSize := measure("?since="+url.QueryEscape(last.Format(time.RFC3339Nano)), 50)
	const every = 2 * time.Second
	// The page: one full answer when it opens, then an incremental one
	// every 2 s (one new sample in three of them).
	share := float64(incr) / float64(every)
	t.Logf("GET /ui/state with %d workers, 20 syncs and 15 min of history: full answer %d bytes, %v CPU; incremental %d bytes, %v CPU",
		workers, fullSize, full.Round(time.Microsecond), incrSize, incr.Round(time.Microsecond))
	t.Logf("the page refreshing every %v: %.3f%% of a core (a full answer every refresh would be %.3f%%)", every, share*100, float64(full)/float64(every)*100)
	if share >= 0.01 {
		t.Fatalf("the page costs %.2f%% of a core, over 1%%", share*100)
	}
	if full >= every/100 {
		t.Errorf("even a full answer every refresh should stay under 1%% of a core: %v per answer", full)
	}
}
