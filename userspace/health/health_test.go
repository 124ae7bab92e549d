package health

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/registry"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/worker"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// backend is a worker that can die and come back on the same port.
type backend struct {
	t      *testing.T
	addr   string
	status atomic.Int32
	srv    *http.Server
}

func newBackend(t *testing.T) *backend {
	b := &backend{t: t}
	b.status.Store(200)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b.addr = ln.Addr().String()
	b.serve(ln)
	t.Cleanup(b.stop)
	return b
}

func (b *backend) url() string { return "http://" + b.addr }

func (b *backend) serve(ln net.Listener) {
	b.srv = &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(int(b.status.Load()))
	})}
	go b.srv.Serve(ln)
}

func (b *backend) stop() {
	if b.srv != nil {
		b.srv.Close()
		b.srv = nil
	}
}

func (b *backend) restart() {
	ln, err := net.Listen("tcp", b.addr)
	if err != nil {
		b.t.Fatalf("rebind %s: %v", b.addr, err)
	}
	b.serve(ln)
}

func waitState(t *testing.T, w *worker.Worker, want worker.State) {
	t.Helper()
	testenv.WaitFor(t, fmt.Sprintf("worker %d %v", w.Slot, want), func() bool { return w.State() == want })
}

func TestProber(t *testing.T) {
	b := newBackend(t)
	p := NewProber(time.Second)
	if err := p(context.Background(), b.url()); err != nil {
		t.Fatal(err)
	}
	b.status.Store(503)
	if err := p(context.Background(), b.url()); err == nil {
		t.Fatal("503 counted as healthy")
	}
	b.stop()
	if err := p(context.Background(), b.url()); err == nil {
		t.Fatal("dead worker counted as healthy")
	}
	// A worker that never answers: the timeout.
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	defer ln.Close()
	start := time.Now()
	if err := NewProber(100*time.Millisecond)(context.Background(), "http://"+ln.Addr().String()); err == nil || time.Since(start) > 2*time.Second {
		t.Fatalf("silent worker: %v after %v", err, time.Since(start))
	}
}

// TestDiesAndComesBack: a worker that dies goes unhealthy after
// --health-failures checks (panic mode: it is the only one), and healthy
// again after --health-successes once it is back on its port.
func TestDiesAndComesBack(t *testing.T) {
	b := newBackend(t)
	other := newBackend(t)
	reg := registry.New(registry.Options{Stats: stats.NewHeap(), Config: registry.Config{Failures: 2, Successes: 2}, Log: quiet})
	defer reg.Close()
	reg.Put(0, b.url(), registry.OriginConfig)
	reg.Put(1, other.url(), registry.OriginConfig)
	c := New(reg, Options{Config: Config{Interval: 30 * time.Millisecond, Timeout: 500 * time.Millisecond}, Log: quiet})
	c.Start()
	defer c.Stop()
	w := reg.Table().Get(0)

	b.stop()
	waitState(t, w, worker.Unhealthy)
	if reg.Panic() {
		t.Fatal("panic with a healthy worker left")
	}
	b.restart()
	waitState(t, w, worker.Healthy)

	// 5xx answers fail too; every worker down is panic mode, not 503s.
	b.status.Store(500)
	other.status.Store(503)
	waitState(t, w, worker.Unhealthy)
	waitState(t, reg.Table().Get(1), worker.Unhealthy)
	if !reg.Panic() {
		t.Fatal("every worker unhealthy, no panic mode")
	}
	other.status.Store(200)
	waitState(t, reg.Table().Get(1), worker.Healthy)
	if reg.Panic() {
		t.Fatal("panic mode not over")
	}
}

// TestPassive: connect failures on the data path make a worker unhealthy
// long before the next active check.
func TestPassive(t *testing.T) {
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	dead := "http://" + ln.Addr().String()
	ln.Close()
	reg := registry.New(registry.Options{Stats: stats.NewHeap(), Config: registry.Config{Failures: 3, Successes: 1}, Log: quiet})
	defer reg.Close()
	reg.Put(0, dead, registry.OriginConfig)
	w := reg.Table().Get(0)
	c := New(reg, Options{Config: Config{Interval: time.Hour}, PassiveInterval: 10 * time.Millisecond, Log: quiet, Probe: NewProber(time.Second)})
	c.Start()
	defer c.Stop()
	// The initial active check fails: once the registry counted it, one
	// failure of the three.
	testenv.WaitFor(t, "the initial check's failure counted", func() bool {
		in, err := reg.Get("0")
		return err == nil && in.ConsecutiveFailures >= 1
	})
	if w.State() != worker.Healthy {
		t.Fatal("unhealthy after one failed check (want 3)")
	}
	// Passive checks count the connect failures after their first look at
	// a worker (its baseline): wait for it (a fixed sleep here was a race
	// with the first passive tick).
	testenv.WaitFor(t, "the passive checks' baseline", func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		_, ok := c.seen[w]
		return ok
	})
	// The data plane fails to connect (and retries once).
	if _, err := w.Pool.Get(context.Background()); err == nil {
		t.Fatal("connected to a closed port")
	}
	waitState(t, w, worker.Unhealthy)
}

// A configured path and API key: engines started with --api-key answer
// 401 without it; SGLang users check /health_generate.
func TestProberPathAndKey(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/health_generate" || r.Header.Get("Authorization") != "Bearer sk-1" {
			w.WriteHeader(401)
			return
		}
	}))
	defer srv.Close()
	if err := NewProber(time.Second)(context.Background(), srv.URL); err == nil {
		t.Fatal("default prober passed a keyed engine")
	}
	if err := NewProberWith(ProbeOptions{Timeout: time.Second, APIKey: "sk-1"})(context.Background(), srv.URL); err == nil {
		t.Fatal("wrong path passed")
	}
	if err := NewProberWith(ProbeOptions{Timeout: time.Second, Path: "/health_generate", APIKey: "sk-1"})(context.Background(), srv.URL); err != nil {
		t.Fatal(err)
	}
}
