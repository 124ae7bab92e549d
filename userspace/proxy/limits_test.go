package proxy

import (
	"bufio"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
)

func logTo(b *testenv.Buffer) *slog.Logger { return slog.New(slog.NewTextHandler(b, nil)) }

// At MaxConns the accept loop pauses: a further client waits in the
// kernel's queue, unanswered, and is served as soon as a connection
// closes; the pause is logged once per episode, not per connection.
func TestMaxConnsPausesAccept(t *testing.T) {
	testenv.CheckLeaks(t)
	be := httpBackend(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	var logs testenv.Buffer
	p := startProxy(t, []string{be}, func(c *Config) { c.MaxConns = 2; c.Log = logTo(&logs) })
	get := "GET /x HTTP/1.1\r\nHost: x\r\n\r\n"
	var held []net.Conn
	for range 2 {
		c, br := p.dial()
		io.WriteString(c, get)
		readResp(t, br, false)
		held = append(held, c)
	}
	testenv.WaitFor(t, "2 open connections", func() bool { return p.srv.Counters().Open.Load() == 2 })

	// Three more clients: connected (the kernel's queue) but not accepted.
	type waiting struct {
		c    net.Conn
		br   *bufio.Reader
		done chan struct{}
	}
	var ws []waiting
	for range 3 {
		c, br := p.dial()
		io.WriteString(c, get)
		w := waiting{c, br, make(chan struct{})}
		go func() { defer close(w.done); w.br.Peek(1) }()
		ws = append(ws, w)
	}
	select {
	case <-ws[0].done:
		t.Fatal("a connection past MaxConns was served")
	case <-time.After(200 * time.Millisecond):
	}
	if n := logs.Count("accepting paused"); n != 1 {
		t.Fatalf("%d pause lines, want 1 for the episode:\n%s", n, logs.String())
	}
	// Each close lets one waiting client in.
	stepsFrom := time.Now()
	for i, w := range ws {
		held[0].Close()
		held = held[1:]
		<-w.done
		if resp, _ := readResp(t, w.br, false); resp.StatusCode != 200 {
			t.Fatalf("client %d: %d", i, resp.StatusCode)
		}
		held = append(held, w.c)
	}
	if o := p.srv.Counters().Open.Load(); o > 2 {
		t.Fatalf("%d open, cap 2", o)
	}
	for _, c := range held {
		c.Close()
	}
	steps := time.Since(stepsFrom)
	testenv.WaitFor(t, "connections closed", func() bool { return p.srv.Counters().Open.Load() == 0 })
	// Each episode is logged once when it begins and once when it has
	// been over for episodeQuiet, however many clients waited in it.
	pauses := p.srv.Counters().AcceptPauses.Load()
	testenv.WaitFor(t, "a resume line per episode", func() bool { return uint64(logs.Count("accepting resumed")) == pauses })
	if n := logs.Count("accepting paused"); uint64(n) != pauses {
		t.Fatalf("%d pause lines for %d episodes:\n%s", n, pauses, logs.String())
	}
	// The clients came in one by one, each let in as a place freed: one
	// episode. Only a stall of the machine past episodeQuiet between two
	// steps ends it early (then the next pause starts another, at most
	// one per step).
	if pauses != 1 && (steps < episodeQuiet || pauses > uint64(1+len(ws))) {
		t.Fatalf("%d pause episodes for %d waiting clients let in over %v, want 1", pauses, len(ws), steps)
	}
}

// failingListener fails its first Accept calls with EMFILE.
type failingListener struct {
	net.Listener
	fail  atomic.Int64 // failures left
	calls atomic.Int64
}

func (l *failingListener) Accept() (net.Conn, error) {
	l.calls.Add(1)
	if l.fail.Add(-1) >= 0 {
		return nil, &net.OpError{Op: "accept", Net: "tcp", Err: syscall.EMFILE}
	}
	return l.Listener.Accept()
}

// An accept failing for want of descriptors backs off (never a spin) and
// is logged once when it begins and once when it ends; service resumes.
func TestAcceptFailureBacksOff(t *testing.T) {
	be := httpBackend(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	var logs testenv.Buffer
	p := startProxy(t, []string{be}, func(c *Config) { c.Log = logTo(&logs) })
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	fl := &failingListener{Listener: ln}
	fl.fail.Store(1 << 40)
	done := make(chan struct{})
	go func() { p.srv.Serve(fl, nil); close(done) }()
	defer func() { ln.Close(); <-done }()
	time.Sleep(400 * time.Millisecond) // measuring the retry rate over a span
	calls := fl.calls.Load()
	// 5, 10, 20, ... ms: about 7 tries in 400 ms; a spin makes thousands.
	if calls > 12 {
		t.Fatalf("%d accept calls in 400 ms: spinning", calls)
	}
	fl.fail.Store(0)
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	if resp, _ := readResp(t, bufio.NewReader(c), false); resp.StatusCode != 200 {
		t.Fatalf("after the failures: %d", resp.StatusCode)
	}
	if n := logs.Count("accept failing"); n != 1 {
		t.Fatalf("%d failure lines, want 1:\n%s", n, logs.String())
	}
	testenv.WaitFor(t, "the resume line", func() bool { return logs.Count("accept resumed") == 1 })
	if !strings.Contains(logs.String(), "too many open files") {
		t.Fatalf("the log does not name the cause:\n%s", logs.String())
	}
}

// heldBackend answers each request once release is closed, counting the
// requests it holds at once.
type heldBackend struct {
	addr    string
	release chan struct{}
	now     atomic.Int64
	max     atomic.Int64
	seen    atomic.Int64
}

func newHeldBackend(t *testing.T) *heldBackend {
	b := &heldBackend{release: make(chan struct{})}
	b.addr = httpBackend(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.seen.Add(1)
		n := b.now.Add(1)
		for m := b.max.Load(); n > m && !b.max.CompareAndSwap(m, n); m = b.max.Load() {
		}
		<-b.release
		b.now.Add(-1)
		io.WriteString(w, "done")
	}))
	return b
}

// A worker at its max_in_flight holds further requests in its queue (never
// more than max_in_flight reach it), answers 503 + Retry-After when the
// queue is full, and serves the queued ones in turn.
func TestWorkerQueue(t *testing.T) {
	testenv.CheckLeaks(t)
	be := newHeldBackend(t)
	p := startProxy(t, []string{be.addr}, func(c *Config) { c.QueueSize = 2; c.QueueTimeout = time.Minute })
	w := p.table.Get(0)
	w.SetMaxInFlight(2)
	type result struct {
		code int
		body string
	}
	results := make(chan result, 4)
	send := func() {
		c, br := p.dial()
		io.WriteString(c, "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
		resp, body := readResp(t, br, false)
		results <- result{resp.StatusCode, body}
	}
	for range 2 {
		go send()
	}
	testenv.WaitFor(t, "2 requests at the worker", func() bool { return be.now.Load() == 2 })
	for range 2 {
		go send()
	}
	testenv.WaitFor(t, "2 requests queued", func() bool { return w.Queued() == 2 })

	resp, body := p.roundTrip("POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") == "" || resp.Header.Get(UpstreamStateHeader) != "not-sent" {
		t.Fatalf("queue full: %d %v %s", resp.StatusCode, resp.Header, body)
	}
	close(be.release)
	for range 4 {
		if r := <-results; r.code != 200 || r.body != "done" {
			t.Fatalf("queued request: %d %q", r.code, r.body)
		}
	}
	if m := be.max.Load(); m != 2 {
		t.Fatalf("the worker held %d requests at once, max_in_flight 2", m)
	}
	if be.seen.Load() != 4 || p.srv.Counters().QueueFull.Load() != 1 {
		t.Fatalf("worker saw %d, queue_full %d", be.seen.Load(), p.srv.Counters().QueueFull.Load())
	}
}

// A queued request times out with 503 + Retry-After; one whose client
// leaves frees its place in line and never reaches the worker.
func TestWorkerQueueTimeoutAndClientLeaves(t *testing.T) {
	testenv.CheckLeaks(t)
	be := newHeldBackend(t)
	p := startProxy(t, []string{be.addr}, func(c *Config) { c.QueueTimeout = 150 * time.Millisecond })
	w := p.table.Get(0)
	w.SetMaxInFlight(1)
	first := make(chan int, 1)
	go func() {
		c, br := p.dial()
		io.WriteString(c, "GET /held HTTP/1.1\r\nHost: x\r\n\r\n")
		resp, _ := readResp(t, br, false)
		first <- resp.StatusCode
	}()
	testenv.WaitFor(t, "a request at the worker", func() bool { return be.now.Load() == 1 })

	start := time.Now()
	resp, _ := p.roundTrip("GET /queued HTTP/1.1\r\nHost: x\r\n\r\n")
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") != "1" {
		t.Fatalf("queue timeout: %d %v", resp.StatusCode, resp.Header)
	}
	if d := time.Since(start); d < 100*time.Millisecond {
		t.Fatalf("answered after %v: did not wait in the queue", d)
	}
	if p.srv.Counters().QueueTimeouts.Load() != 1 {
		t.Fatal("queue timeout not counted")
	}

	// A client that leaves while queued: a second proxy with a long queue
	// timeout, its worker (the same backend) also at its limit.
	p2 := startProxy(t, []string{be.addr}, func(c *Config) { c.QueueTimeout = time.Minute })
	w2 := p2.table.Get(0)
	w2.SetMaxInFlight(1)
	second := make(chan int, 1)
	go func() {
		c, br := p2.dial()
		io.WriteString(c, "GET /held HTTP/1.1\r\nHost: x\r\n\r\n")
		resp, _ := readResp(t, br, false)
		second <- resp.StatusCode
	}()
	testenv.WaitFor(t, "a request at the worker through the second proxy", func() bool { return be.now.Load() == 2 })
	c, _ := p2.dial()
	io.WriteString(c, "GET /leaves HTTP/1.1\r\nHost: x\r\n\r\n")
	testenv.WaitFor(t, "the request queued", func() bool { return w2.Queued() == 1 })
	aborted := p2.srv.Counters().ClientAborted.Load()
	c.Close()
	testenv.WaitFor(t, "the queue emptied by the client leaving", func() bool { return w2.Queued() == 0 })
	testenv.WaitFor(t, "the abort counted", func() bool { return p2.srv.Counters().ClientAborted.Load() == aborted+1 })
	close(be.release)
	if code := <-first; code != 200 {
		t.Fatalf("first request %d", code)
	}
	if code := <-second; code != 200 {
		t.Fatalf("second proxy's first request %d", code)
	}
	if be.seen.Load() != 2 {
		t.Fatalf("the worker saw %d requests, want only the two held ones", be.seen.Load())
	}
	testenv.WaitFor(t, "every place given back", func() bool { return w.Admitted() == 0 && w2.Admitted() == 0 })
}

// Local endpoints' bodies are capped across connections: past
// LocalBodyBudget a request gets 503 + Retry-After before its body is read;
// the budget comes back when the handler ends.
func TestLocalBodyBudget(t *testing.T) {
	testenv.CheckLeaks(t)
	release := make(chan struct{})
	in := make(chan struct{}, 4)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		in <- struct{}{}
		<-release
		io.WriteString(w, "{}")
	})
	p := startProxy(t, nil, func(c *Config) {
		c.LocalBodyBudget = 3 << 19 // room for one 1 MiB body, not two
		c.Local = func(method, path []byte) http.Handler {
			if string(path) == "/abort_request" {
				return h
			}
			return nil
		}
	})
	body := strings.Repeat("x", 1<<20) // small enough for the socket buffers when refused
	req := "POST /abort_request HTTP/1.1\r\nHost: x\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\n\r\n" + body
	first := make(chan int, 1)
	go func() {
		resp, _ := p.roundTrip(req)
		first <- resp.StatusCode
	}()
	<-in
	resp, _ := p.roundTrip(req)
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("past the budget: %d %v", resp.StatusCode, resp.Header)
	}
	close(release)
	if code := <-first; code != 200 {
		t.Fatalf("first: %d", code)
	}
	if resp, _ := p.roundTrip(req); resp.StatusCode != 200 {
		t.Fatalf("after the first ended: %d", resp.StatusCode)
	}
	if held := p.srv.localBytes.Load(); held != 0 {
		t.Fatalf("%d bytes still counted", held)
	}
	if p.srv.Counters().LocalBusy.Load() != 1 {
		t.Fatal("local_busy not counted")
	}
}

// DefaultMaxConns keeps busy connections within the descriptor limit.
func TestDefaultMaxConns(t *testing.T) {
	for _, tc := range []struct {
		nofile uint64
		want   int
	}{{0, 16}, {64, 28}, {256, 112}, {1024, 448}, {20000, 9872}, {1 << 20, 524160}, {1 << 62, 1 << 30}} {
		if got := DefaultMaxConns(tc.nofile); got != tc.want {
			t.Errorf("DefaultMaxConns(%d) = %d, want %d", tc.nofile, got, tc.want)
		}
	}
}

// Under MaxConns, idle upstream sockets count toward the descriptors the
// cap budgets for (two per connection): with two clients open at a cap of
// 2, the two upstream sockets their concurrent requests needed are not
// both kept idle (that would leave no descriptor for the next connect);
// one is, and serves the next request.
func TestIdleUpstreamCountsTowardMaxConns(t *testing.T) {
	arrived := make(chan struct{}, 2)
	release := make(chan struct{})
	var accepts atomic.Int64
	be := rawBackend(t, func(c net.Conn) {
		accepts.Add(1)
		br := bufio.NewReader(c)
		for first := true; ; first = false {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			io.Copy(io.Discard, req.Body)
			if first {
				arrived <- struct{}{}
				<-release // both requests in flight: two upstream sockets
			}
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		}
	})
	p := startProxy(t, []string{be}, func(c *Config) { c.MaxConns = 2 })
	get := "GET /x HTTP/1.1\r\nHost: x\r\n\r\n"
	var cs []net.Conn
	var brs []*bufio.Reader
	for range 2 {
		c, br := p.dial()
		io.WriteString(c, get)
		cs, brs = append(cs, c), append(brs, br)
	}
	<-arrived
	<-arrived
	close(release)
	for i, br := range brs {
		if resp, body := readResp(t, br, false); resp.StatusCode != 200 || body != "ok" {
			t.Fatalf("client %d: %d %q", i, resp.StatusCode, body)
		}
	}
	ctr := p.srv.Counters()
	testenv.WaitFor(t, "both exchanges to end", func() bool { return ctr.UpstreamIdle.Load()+int64(p.table.Get(0).Pool.Idle()) >= 1 })
	if idle := ctr.UpstreamIdle.Load() + int64(p.table.Get(0).Pool.Idle()); idle != 1 {
		t.Fatalf("%d idle upstream sockets kept with 2 clients open at a cap of 2, want 1", idle)
	}
	io.WriteString(cs[0], get)
	if resp, _ := readResp(t, brs[0], false); resp.StatusCode != 200 {
		t.Fatalf("next request: %d", resp.StatusCode)
	}
	if n := accepts.Load(); n != 2 {
		t.Fatalf("backend saw %d connections, want 2 (the kept one reused)", n)
	}
	for _, c := range cs {
		c.Close()
	}
}
