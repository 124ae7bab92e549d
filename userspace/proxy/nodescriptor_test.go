package proxy

import (
	"bufio"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/upstream"
	"github.com/tether-rl/tether/userspace/worker"
)

// A connect that finds no descriptor (EMFILE) is answered 502 not-sent at
// once, the first connect or the redial after a refusal alike, and the
// client connection lingers over a request body not read yet, so the
// client reads the answer and then the end (a FIN), never a reset.
//
// The descriptor limit is lowered for the whole test process (as
// upstream's TestDialLocalFailure does) only while the client's socket
// is open and accepted, and raised again before anything else is opened.

// noDescriptors lowers RLIMIT_NOFILE's soft limit to 3: from then on no
// descriptor can be opened (0-2 are open). The returned function, also a
// cleanup, restores it.
func noDescriptors(t *testing.T) (restore func()) {
	t.Helper()
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	low := lim
	low.Cur = 3
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &low); err != nil {
		t.Skip("cannot lower RLIMIT_NOFILE:", err)
	}
	var once sync.Once
	restore = func() {
		once.Do(func() {
			if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
				panic(err)
			}
		})
	}
	t.Cleanup(restore)
	return restore
}

// expectNotSent502 reads tetherd's 502 for a request that never reached a
// worker, then the connection's end.
func expectNotSent502(t *testing.T, p *testProxy, c net.Conn, br *bufio.Reader, restore func()) {
	t.Helper()
	resp, body := readResp(t, br, false)
	restore()
	if resp.StatusCode != 502 || resp.Header.Get("X-Tether-Upstream-State") != "not-sent" || !resp.Close {
		t.Fatalf("got %d %v close=%v, want 502 not-sent with Connection: close", resp.StatusCode, resp.Header, resp.Close)
	}
	raw := string(upstreamError(502, false, true))
	if want := raw[strings.Index(raw, "\r\n\r\n")+4:]; body != want {
		t.Fatalf("body %q, want %q", body, want)
	}
	expectClosed(t, c, br) // EOF: a reset fails this
	if n := p.srv.Counters().BadGateway.Load(); n != 1 {
		t.Fatalf("502s counted: %d, want 1", n)
	}
}

// uploadWithoutDescriptors takes this process's descriptors away, sends
// a request whose body is longer than what was sent of it, and expects
// the 502 not-sent, then the end (EOF: a reset fails), the sent bytes
// drained, and a local failure counted.
func uploadWithoutDescriptors(t *testing.T, p *testProxy, c net.Conn, br *bufio.Reader) {
	t.Helper()
	failures := upstream.LocalFailures.Load()
	restore := noDescriptors(t)
	const sent = 128 << 10 // below lingerBytes: the lingering reads all of it
	wrote := make(chan error, 1)
	go func() {
		_, err := io.WriteString(c, "POST /up HTTP/1.1\r\nHost: a\r\nContent-Length: "+strconv.Itoa(8<<20)+"\r\n\r\n"+strings.Repeat("x", sent))
		wrote <- err
	}()
	expectNotSent502(t, p, c, br, restore)
	if err := <-wrote; err != nil {
		t.Fatalf("the client's body: %v, want taken (drained), not reset", err)
	}
	if upstream.LocalFailures.Load() == failures {
		t.Fatal("no local failure counted")
	}
}

// The first connect finds no descriptor; the client is sending a body
// larger than what tetherd reads with the head. (The loop has a splice
// pipe kept from an earlier upload: without one, the pipe it would open
// for the body finds no descriptor first: TestNoDescriptorForPipe.)
func TestNoDescriptorLingersOverBody(t *testing.T) {
	be := newBackend(t, func(c *bconn) {
		if _, _, err := c.readRequest(); err != nil {
			return
		}
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
	})
	p := startProxy(t, []string{be.addr}, nil)
	// An upload (spliced: its pipe is kept), its upstream socket closed.
	resp, body := p.roundTrip("POST /first HTTP/1.1\r\nHost: a\r\nConnection: close\r\nContent-Length: 65536\r\n\r\n" + strings.Repeat("y", 65536))
	if resp.StatusCode != 200 || body != "ok" {
		t.Fatalf("first upload: %d %q", resp.StatusCode, body)
	}
	testenv.WaitFor(t, "the upstream socket to close", func() bool { return p.srv.upSockets.Load() == 0 })

	c, br := p.dial()
	testenv.WaitFor(t, "the client to be accepted", func() bool { return p.srv.Counters().Accepted.Load() == 2 })
	uploadWithoutDescriptors(t, p, c, br)
	if n := be.accepts.Load(); n != 1 {
		t.Fatalf("the worker got %d connections, want 1 (the first upload)", n)
	}
}

// The loop has no splice pipe to lend the body and cannot open one: the
// same 502 not-sent and lingering, before any connect (not a hand-off to
// a goroutine, which could not be lent the socket and would reset it).
func TestNoDescriptorForPipe(t *testing.T) {
	be := newBackend(t, func(c *bconn) {})
	p := startProxy(t, []string{be.addr}, nil)
	c, br := p.dial()
	testenv.WaitFor(t, "the client to be accepted", func() bool { return p.srv.Counters().Accepted.Load() == 1 })
	uploadWithoutDescriptors(t, p, c, br)
	if n := p.srv.Counters().Handoffs.Load(); n != 0 {
		t.Fatalf("%d hand-offs: the loop did not answer", n)
	}
	if n := be.accepts.Load(); n != 0 {
		t.Fatalf("the worker got %d connections, want none", n)
	}
}

// The same on the goroutine path (a listener without a loop): the
// pool's connect fails with upstream.ErrLocal.
func TestNoDescriptorLingersOverBodyGoroutine(t *testing.T) {
	be := newBackend(t, func(c *bconn) {})
	p := startProxy(t, []string{be.addr}, nil)
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { p.srv.Serve(struct{ net.Listener }{ln}, nil); close(done) }()
	t.Cleanup(func() { ln.Close(); <-done })
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(20 * time.Second))
	br := bufio.NewReader(c)
	testenv.WaitFor(t, "the client to be accepted", func() bool { return p.srv.Counters().Accepted.Load() == 1 })
	uploadWithoutDescriptors(t, p, c, br)
}

// fullListener is a worker address whose accept queue is full: a connect
// to it stays in progress (its SYNs dropped) until the dialer gives up.
func fullListener(t *testing.T) string {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := unix.Listen(fd, 0); err != nil { // one connection fills the queue
		t.Fatal(err)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	addr := "127.0.0.1:" + strconv.Itoa(sa.(*unix.SockaddrInet4).Port)
	filler, err := net.Dial("tcp4", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { filler.Close() })
	return addr
}

// The first connect does not complete within the dial timeout; the one
// retry finds no descriptor: 502 not-sent from the loop, as for a first
// connect, not a hand-off to a goroutine (which could not even be lent
// the client's socket).
func TestNoDescriptorOnRedial(t *testing.T) {
	p := startProxy(t, nil, nil)
	addr := fullListener(t)
	w := &worker.Worker{Slot: 0, URL: "http://" + addr, Addr: addr, Stats: p.stats.Worker(0),
		Pool: upstream.New(addr, p.stats.Worker(0), upstream.Options{DialTimeout: 200 * time.Millisecond})}
	p.table.Put(w)
	c, br := p.dial()
	testenv.WaitFor(t, "the client to be accepted", func() bool { return p.srv.Counters().Accepted.Load() == 1 })
	io.WriteString(c, "GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
	testenv.WaitFor(t, "the first connect", func() bool { return p.srv.upSockets.Load() == 1 })
	if n := p.srv.Counters().Handoffs.Load(); n != 0 {
		t.Fatalf("%d hand-offs before the retry: the loop did not run the request", n)
	}
	failures := upstream.LocalFailures.Load()
	restore := noDescriptors(t)
	expectNotSent502(t, p, c, br, restore)
	if n := p.srv.Counters().Handoffs.Load(); n != 0 {
		t.Fatalf("%d hand-offs to a goroutine, want the loop's own 502", n)
	}
	if upstream.LocalFailures.Load() == failures {
		t.Fatal("no local failure counted")
	}
}

// doneRouter counts the routing decisions given back (Decision.Done).
type doneRouter struct {
	Router
	done atomic.Int64
}

func (r *doneRouter) Route(req *httphead.Request, body []byte) route.Decision {
	d := r.Router.Route(req, body)
	d.Done = func() { r.done.Add(1) }
	return d
}

// A request the loop routes but hands to a goroutine (its worker is named
// by a host name, which the goroutine path resolves), when no descriptor
// is left to lend the goroutine the socket: the connection is dropped,
// and its routing decision is given back (a policy's count of requests
// in flight would otherwise never go down).
func TestNoDescriptorForHandoffReleasesDecision(t *testing.T) {
	be := newBackend(t, func(c *bconn) {})
	var rt *doneRouter
	named := "localhost:" + be.addr[strings.LastIndex(be.addr, ":")+1:]
	p := startProxy(t, []string{named}, func(c *Config) { rt = &doneRouter{Router: c.Router}; c.Router = rt })
	c, _ := p.dial()
	testenv.WaitFor(t, "the client to be accepted", func() bool { return p.srv.Counters().Accepted.Load() == 1 })
	restore := noDescriptors(t)
	io.WriteString(c, "GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
	testenv.WaitFor(t, "the decision given back", func() bool { return rt.done.Load() == 1 })
	restore()
	if n := p.srv.Counters().Handoffs.Load(); n != 1 {
		t.Fatalf("%d hand-offs, want 1 (a host name to resolve)", n)
	}
	if n := be.accepts.Load(); n != 0 {
		t.Fatalf("the worker got %d connections", n)
	}
}
