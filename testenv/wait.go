package testenv

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// WaitFor polls cond until it holds, failing the test after 10 s with what
// it was waiting for. Tests wait on events this way, never on a sleep
// guessed to be long enough.
func WaitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	WaitForWithin(t, what, 10*time.Second, cond)
}

// WaitForWithin is WaitFor with its own bound: a test that asserts how
// soon something happens (a change seen by every replica within 1 s), or
// waits for something slow (a spawned process).
func WaitForWithin(t testing.TB, what string, d time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	// Polled from 50 µs up to every 5 ms: a condition that is about to
	// hold costs microseconds, not a 5 ms sleep (a fuzz target waits on
	// every input).
	every := 50 * time.Microsecond
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s (%v)", what, d)
		}
		time.Sleep(every)
		every = min(2*every, 5*time.Millisecond)
	}
}

// Buffer is a bytes.Buffer safe for concurrent writers (a log sink, a
// command's output) that a test reads while they write.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

// String returns what was written so far.
func (b *Buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// Count returns how many times sub was written so far.
func (b *Buffer) Count(sub string) int { return strings.Count(b.String(), sub) }

// Resources are what a test may leak: goroutines, open descriptors, and
// the pipes among them (splice pipes).
type Resources struct {
	Goroutines, FDs, Pipes int
}

func (r Resources) String() string {
	return fmt.Sprintf("%d goroutines, %d fds (%d pipes)", r.Goroutines, r.FDs, r.Pipes)
}

// goroutines counts the goroutines, less the one os/signal starts for
// good on the first signal.Notify (not a leak of whichever test came
// first).
func goroutines() int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	n := 0
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.HasPrefix(g, "goroutine ") && !strings.Contains(g, "os/signal.signal_recv") {
			n++
		}
	}
	return n
}

// Snapshot counts this process's goroutines, descriptors and pipes.
func Snapshot() Resources {
	r := Resources{Goroutines: goroutines()}
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

// RunNoLeaks runs a package's tests (a TestMain calls it) and fails the
// package when they leave goroutines, descriptors or pipes behind, after
// waiting up to 10 s for them to wind down (splice pipes close through
// finalizers: the wait runs the GC). It returns the exit code.
func RunNoLeaks(m *testing.M) int {
	if ln, err := net.Listen("tcp4", "127.0.0.1:0"); err == nil {
		ln.Close() // the network poller's own descriptors are not a leak
	}
	before := Snapshot()
	code := m.Run()
	if code != 0 {
		return code
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		runtime.GC()
		now := Snapshot()
		if now.Goroutines <= before.Goroutines && now.FDs <= before.FDs && now.Pipes <= before.Pipes {
			return 0
		}
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			fmt.Fprintf(os.Stderr, "LEAK: before %v, after %v\n", before, now)
			if ents, err := os.ReadDir("/proc/self/fd"); err == nil {
				for _, e := range ents {
					l, _ := os.Readlink("/proc/self/fd/" + e.Name())
					fmt.Fprintf(os.Stderr, "  fd %s -> %s\n", e.Name(), l)
				}
			}
			os.Stderr.Write(buf[:runtime.Stack(buf, true)])
			return 1
		}
		time.Sleep(20 * time.Millisecond)
	}
}
