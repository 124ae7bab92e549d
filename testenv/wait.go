package testenv

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"
)

// WaitFor polls cond until it holds, failing the test after 10 s with what
// it was waiting for. Tests wait on events this way, never on a sleep
// guessed to be long enough.
func WaitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// Resources are what a test may leak: goroutines, open descriptors, and
// the pipes among them (splice pipes).
type Resources struct {
	Goroutines, FDs, Pipes int
}

func (r Resources) String() string {
	return fmt.Sprintf("%d goroutines, %d fds (%d pipes)", r.Goroutines, r.FDs, r.Pipes)
}

// Snapshot counts this process's goroutines, descriptors and pipes.
func Snapshot() Resources {
	r := Resources{Goroutines: runtime.NumGoroutine()}
	ents, _ := os.ReadDir("/proc/self/fd")
	for _, e := range ents {
		r.FDs++
		if l, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && strings.HasPrefix(l, "pipe:") {
			r.Pipes++
		}
	}
	return r
}

// CheckLeaks snapshots the process now and, when the test ends (after its
// other cleanups, so register it first), waits up to 10 s for the
// goroutines, descriptors and pipes to come back to that level, failing
// with both snapshots and the goroutine dump if they do not. Splice pipes
// cached by the runtime are closed by finalizers: the wait runs the GC.
func CheckLeaks(t testing.TB) {
	t.Helper()
	before := Snapshot()
	t.Cleanup(func() {
		deadline := time.Now().Add(10 * time.Second)
		for {
			runtime.GC()
			now := Snapshot()
			if now.Goroutines <= before.Goroutines && now.FDs <= before.FDs && now.Pipes <= before.Pipes {
				return
			}
			if time.Now().After(deadline) {
				buf := make([]byte, 1<<20)
				buf = buf[:runtime.Stack(buf, true)]
				t.Errorf("leak: before %v, after %v\n%s", before, now, buf)
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
}
