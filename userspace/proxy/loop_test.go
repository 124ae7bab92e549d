package proxy

import (
	"bufio"
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/uring"
)

// Connections live in their listener's event loop without a goroutine:
// idle, reading a head, or in an exchange the loop runs. One that a
// goroutine served (here a chunked upload, which the loop hands over)
// comes back to the loop after ParkAfter. Every next request is answered,
// a client that leaves while idle is cleaned up, and the idle timeout
// still closes the rest.
func TestConnectionsLiveInTheLoop(t *testing.T) {
	testenv.CheckLeaks(t)
	be := httpBackend(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		io.WriteString(w, "ok")
	}))
	// The idle timeout must outlast setting up the 50 connections (under
	// emulation on a busy host that took over 3 s, and the first ones
	// were closed before all were parked).
	p := startProxy(t, []string{be}, func(c *Config) { c.ParkAfter = 50 * time.Millisecond; c.IdleTimeout = 15 * time.Second })
	const n = 50
	type client struct {
		c  net.Conn
		br *bufio.Reader
	}
	g0 := runtime.NumGoroutine()
	var cs []client
	get := "GET /x HTTP/1.1\r\nHost: x\r\n\r\n"
	upload := "POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
	for i := range n {
		c, br := p.dial()
		req := get
		if i%2 == 1 {
			req = upload // served by a goroutine, then given back
		}
		io.WriteString(c, req)
		if resp, _ := readResp(t, br, false); resp.StatusCode != 200 {
			t.Fatal(resp.Status)
		}
		cs = append(cs, client{c, br})
	}
	testenv.WaitFor(t, "all held by the loop", func() bool { return p.srv.Counters().Parked.Load() == n })
	if g := runtime.NumGoroutine(); g > g0+5 {
		t.Fatalf("%d goroutines with %d idle connections (was %d before them)", g, n, g0)
	}
	// Back to work: each answered on its connection.
	for i, c := range cs {
		req := get
		if i%2 == 0 {
			req = upload
		}
		io.WriteString(c.c, req)
		if resp, body := readResp(t, c.br, false); resp.StatusCode != 200 || body != "ok" {
			t.Fatalf("client %d, second request: %d %q", i, resp.StatusCode, body)
		}
	}
	// Back in the loop; half of the clients leave while idle.
	testenv.WaitFor(t, "all held again", func() bool { return p.srv.Counters().Parked.Load() == n })
	for _, c := range cs[:n/2] {
		c.c.Close()
	}
	testenv.WaitFor(t, "the departed cleaned up", func() bool {
		return p.srv.Counters().Open.Load() == n/2 && p.srv.Counters().Parked.Load() == n/2
	})
	// The idle timeout closes the others.
	for _, c := range cs[n/2:] {
		c.c.SetReadDeadline(time.Now().Add(30 * time.Second))
		if _, err := c.br.ReadByte(); err != io.EOF {
			t.Fatalf("open past the idle timeout: %v, want EOF", err)
		}
	}
	testenv.WaitFor(t, "nothing open", func() bool { return p.srv.Counters().Open.Load() == 0 && p.srv.Counters().Parked.Load() == 0 })
}

// A gentle shutdown closes parked connections once idle past the grace,
// and returns.
func TestShutdownClosesParked(t *testing.T) {
	be := httpBackend(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	p := startProxy(t, []string{be}, func(c *Config) { c.ParkAfter = 20 * time.Millisecond })
	c, br := p.dial()
	io.WriteString(c, "GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
	readResp(t, br, false)
	testenv.WaitFor(t, "parked", func() bool { return p.srv.Counters().Parked.Load() == 1 })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := p.srv.ShutdownGently(ctx, 100*time.Millisecond); err != nil {
		t.Fatalf("shutdown: %v", err)
	}
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := br.ReadByte(); err != io.EOF {
		t.Fatalf("parked connection after shutdown: %v", err)
	}
}

// A loop blocks in epoll_wait holding its P: GOMAXPROCS goes one above the
// loops, unless the GOMAXPROCS variable fixed it.
func TestProcsForLoops(t *testing.T) {
	if os.Getenv("GOMAXPROCS") != "" {
		t.Skip("SKIP: the GOMAXPROCS variable is set, which ProcsForLoops respects")
	}
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(2))
	if n := ProcsForLoops(2); n != 3 || runtime.GOMAXPROCS(0) != 3 {
		t.Fatalf("2 loops on 2 Ps: %d (GOMAXPROCS %d), want 3", n, runtime.GOMAXPROCS(0))
	}
	if n := ProcsForLoops(1); n != 3 {
		t.Fatalf("1 loop on 3 Ps: %d, want 3 (never lowered)", n)
	}
}

// A close-delimited body spliced by the loop reaches a slow reader whole:
// the worker's close ends the body only once the pipe is empty.
func TestCloseDelimitedSlowReader(t *testing.T) {
	testenv.CheckLeaks(t)
	const size = 8 << 20
	gone := make(chan struct{})
	var worker atomic.Pointer[net.Conn]
	be := rawBackend(t, func(c net.Conn) {
		defer close(gone)
		defer c.Close()
		worker.Store(&c)
		br := bufio.NewReader(c)
		if _, err := http.ReadRequest(br); err != nil {
			return
		}
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n\r\n")
		buf := make([]byte, 64<<10)
		for i := range buf {
			buf[i] = byte(i)
		}
		for sent := 0; sent < size; sent += len(buf) {
			if _, err := c.Write(buf); err != nil {
				return
			}
		}
		// The close ends the body.
	})
	p := startProxy(t, []string{be}, nil)
	c, br := p.dial()
	io.WriteString(c, "GET /blob HTTP/1.1\r\nHost: x\r\n\r\n")
	// The worker done and gone before the client reads; or, where the
	// sockets and the pipe cannot hold the whole body (their sizes are the
	// kernel's autotuning), as much as they hold queued: the worker held
	// back by the proxy's closed window.
	testenv.WaitFor(t, "the worker gone or held back before the client reads", func() bool {
		select {
		case <-gone:
			return true
		default:
		}
		w := worker.Load()
		return w != nil && heldBack(*w)
	})
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	n, err := io.Copy(io.Discard, resp.Body)
	if err != nil || n != size {
		t.Fatalf("read %d bytes (%v), want %d", n, err, size)
	}
}

// A client that half-closes after its request is never kept until the
// idle timeout. A FIN read with the request (one event) is answered, then
// the connection ends; a FIN that comes while the worker works means the
// client left (as the goroutine path's watch and nginx read it): the
// upstream closes, so the engine cancels. Either way the connection ends
// at once.
func TestHalfClosedClientNotKept(t *testing.T) {
	testenv.CheckLeaks(t)
	be := httpBackend(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	p := startProxy(t, []string{be}, func(c *Config) { c.IdleTimeout = time.Minute })
	for range 20 {
		c, br := p.dial()
		io.WriteString(c, "GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
		c.(*net.TCPConn).CloseWrite()
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if resp, err := http.ReadResponse(br, nil); err == nil {
			if b, err := io.ReadAll(resp.Body); err != nil || string(b) != "ok" {
				t.Fatalf("answer %q, %v", b, err)
			}
		}
		if _, err := br.ReadByte(); err != io.EOF {
			t.Fatalf("after the answer: %v, want EOF (closed at once)", err)
		}
		c.Close()
	}
	testenv.WaitFor(t, "the connections gone", func() bool { return p.srv.Counters().Open.Load() == 0 })
}

// Content-Length uploads run in the loop (spliced past the buffered
// bytes): whole, in order, on one keep-alive connection, fast or trickled,
// and a small request after a big one is not held back by the big one's
// SO_RCVLOWAT. No goroutine is involved.
func TestUploadsInTheLoop(t *testing.T) {
	testenv.CheckLeaks(t)
	be := httpBackend(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := sha256.New()
		n, _ := io.Copy(h, r.Body)
		fmt.Fprintf(w, "%d %x", n, h.Sum(nil))
	}))
	p := startProxy(t, []string{be}, nil)
	c, br := p.dial()
	post := func(body []byte, trickle bool) {
		t.Helper()
		head := fmt.Sprintf("POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n", len(body))
		go func() {
			if !trickle {
				c.Write(append([]byte(head), body...))
				return
			}
			c.Write([]byte(head))
			for i := 0; i < 10; i++ {
				time.Sleep(20 * time.Millisecond) // a trickle: the body in ten pieces
				c.Write(body[i*len(body)/10 : (i+1)*len(body)/10])
			}
		}()
		resp, got := readResp(t, br, false)
		sum := sha256.Sum256(body)
		if want := fmt.Sprintf("%d %x", len(body), sum); resp.StatusCode != 200 || got != want {
			t.Fatalf("%d-byte body (trickled %v): %d %q, want %q", len(body), trickle, resp.StatusCode, got, want)
		}
	}
	rnd := rand.New(rand.NewPCG(1, 2))
	body := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rnd.Uint32())
		}
		return b
	}
	post(body(5<<20), false)
	post(body(20<<10), false)
	post(body(3<<20+17), false)
	post(body(300<<10), true)
	io.WriteString(c, "GET /small HTTP/1.1\r\nHost: x\r\n\r\n")
	c.SetReadDeadline(time.Now().Add(2 * time.Second))
	if resp, got := readResp(t, br, false); resp.StatusCode != 200 || got != fmt.Sprintf("0 %x", sha256.Sum256(nil)) {
		t.Fatalf("small request after the uploads: %d %q", resp.StatusCode, got)
	}
	if n := p.srv.Counters().Handoffs.Load(); n != 0 {
		t.Fatalf("%d requests handed to a goroutine, want 0", n)
	}
}

// An upload that stops coming for --io-timeout gets 408 (the client's
// fault, not the worker's), and its connection closes.
func TestStalledUpload408(t *testing.T) {
	testenv.CheckLeaks(t)
	be := httpBackend(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.Copy(io.Discard, r.Body) }))
	p := startProxy(t, []string{be}, func(c *Config) { c.IOTimeout = 200 * time.Millisecond })
	c, br := p.dial()
	io.WriteString(c, "POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
	c.Write(make([]byte, 40000))
	start := time.Now()
	if resp, _ := readResp(t, br, false); resp.StatusCode != 408 || !resp.Close {
		t.Fatalf("stalled upload: %d close=%v, want 408 and close", resp.StatusCode, resp.Close)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("408 after %v", d)
	}
	expectClosed(t, c, br)
	if e := p.stats.Worker(0).Load().Errors; e != 0 {
		t.Fatalf("%d worker errors for a client that stalled", e)
	}
	if n := p.srv.Counters().Handoffs.Load(); n != 0 {
		t.Fatalf("%d handoffs: the loop did not run it", n)
	}
}

// A long Content-Length body raises the upstream socket's SO_RCVLOWAT;
// however the body ends (here one splice takes it from far above the mark
// to its end: the client read late, so it all waited in the socket), the
// socket goes back idle with the default mark: the next answer on it, a
// few bytes, must not wait for 256 KiB that never come.
func TestLowatResetForTheNextAnswer(t *testing.T) {
	testenv.CheckLeaks(t)
	const size = 3 << 20
	var sent atomic.Pointer[net.Conn] // the worker's connection, once it writes the big answer
	var written atomic.Bool           // the big answer all written
	be := rawBackend(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		for i := 0; ; i++ {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			io.Copy(io.Discard, req.Body)
			if i == 0 {
				fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n", size)
				sent.Store(&c)
				c.Write(make([]byte, size))
				written.Store(true)
				continue
			}
			io.WriteString(c, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
		}
	})
	p := startProxy(t, []string{be}, nil)
	c, br := p.dial()
	io.WriteString(c, "GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
	// All of it queued at the proxy before the client reads, or as much
	// as the kernel's buffers take (the worker held back by the proxy's
	// closed window: 3 MiB need not fit).
	testenv.WaitFor(t, "the answer queued at the proxy before the client reads", func() bool {
		c := sent.Load()
		return c != nil && (written.Load() && unacked(*c) == 0 || heldBack(*c))
	})
	if resp, body := readResp(t, br, false); resp.StatusCode != 200 || len(body) != size {
		t.Fatalf("big: %d, %d bytes", resp.StatusCode, len(body))
	}
	io.WriteString(c, "GET /small HTTP/1.1\r\nHost: x\r\n\r\n")
	c.SetReadDeadline(time.Now().Add(3 * time.Second))
	if resp, body := readResp(t, br, false); resp.StatusCode != 200 || body != "hello" {
		t.Fatalf("small: %d %q", resp.StatusCode, body)
	}
}

// peekRouter records the body bytes each routing decision saw.
type peekRouter struct {
	inner Router
	seen  chan int
}

func (r peekRouter) Route(req *httphead.Request, body []byte) route.Decision {
	r.seen <- len(body)
	return r.inner.Route(req, body)
}

// The router reads a key from the first Config.PeekBody body bytes: the
// loop waits for them when the head came alone, as the goroutine path
// does, and still runs the exchange itself.
func TestLoopWaitsForPeekedBody(t *testing.T) {
	testenv.CheckLeaks(t)
	be := httpBackend(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n, _ := io.Copy(io.Discard, r.Body)
		fmt.Fprint(w, n)
	}))
	seen := make(chan int, 4)
	p := startProxy(t, []string{be}, func(c *Config) {
		c.PeekBody = 64
		c.Router = peekRouter{inner: c.Router, seen: seen}
	})
	c, br := p.dial()
	io.WriteString(c, "POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
	waitPeerRead(t, c, "the proxy to read the head alone")
	c.Write(make([]byte, 100))
	if resp, body := readResp(t, br, false); resp.StatusCode != 200 || body != "100" {
		t.Fatalf("%d %q", resp.StatusCode, body)
	}
	if n := <-seen; n < 64 {
		t.Fatalf("the router saw %d body bytes, want at least 64", n)
	}
	if n := p.srv.Counters().Handoffs.Load(); n != 0 {
		t.Fatalf("%d handoffs, want the loop to run it", n)
	}
}

// withoutDate is an answer with its Date header's value blanked.
func withoutDate(resp string) string {
	return regexp.MustCompile(`(?m)^Date: [^\r\n]*`).ReplaceAllString(resp, "Date: -")
}

// The probes (/health, /readiness, /liveness) are answered by the loop
// itself, byte for byte as the goroutine path answers them, keep-alive
// included.
func TestProbesInTheLoop(t *testing.T) {
	testenv.CheckLeaks(t)
	be := httpBackend(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	p := startProxy(t, []string{be}, nil)
	raw := func(req string) string {
		c, err := net.Dial("tcp", p.addr())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		io.WriteString(c, req)
		b, _ := io.ReadAll(c)
		return string(b)
	}
	for _, probe := range []string{"GET /health", "HEAD /readiness", "GET /liveness?x=1", "POST /health", "GET /health%3Fnot"} {
		loop := raw(probe + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
		before := p.srv.Counters().Handoffs.Load()
		// Expect: 100-continue is left to the goroutine path.
		goroutine := raw(probe + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\nExpect: 100-continue\r\n\r\n")
		if p.srv.Counters().Handoffs.Load() == before && !strings.Contains(probe, "%3F") {
			t.Fatalf("%s with Expect was not handed to a goroutine", probe)
		}
		// The Date header is the second each was written in: the two
		// answers may straddle a second (an emulated kernel took one).
		if withoutDate(loop) != withoutDate(goroutine) {
			t.Fatalf("%s: loop %q, goroutine %q", probe, loop, goroutine)
		}
	}
	handoffs := p.srv.Counters().Handoffs.Load()
	c, br := p.dial()
	for range 3 {
		io.WriteString(c, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
		if resp, body := readResp(t, br, false); resp.StatusCode != 200 || !strings.Contains(body, `"status":"ok"`) {
			t.Fatalf("%d %q", resp.StatusCode, body)
		}
	}
	if n := p.srv.Counters().Handoffs.Load(); n != handoffs {
		t.Fatalf("%d probes handed to goroutines, want 0", n-handoffs)
	}
}

// An idle connection on a loop is its struct and its socket: the parsed
// heads and the head-assembly buffer go back to the loop's free lists
// when it idles, and what only a goroutine uses (gor) is not there. The
// struct fits the 224-byte size class (make soak: 10,000 idle
// connections; one more field moves it to the 240 class).
func TestIdleConnectionHoldsNothing(t *testing.T) {
	if n := unsafe.Sizeof(conn{}); n > 224 {
		t.Fatalf("conn is %d bytes, want <= 224: put what an idle connection does not need in gor or lx", n)
	}
	l := &loop{}
	c := &conn{}
	req, resp, out := l.lendReq(c), l.lendResp(c), l.lendOut(c)
	if req == nil || resp == nil || out == nil || len(out) != 0 {
		t.Fatal("nothing lent")
	}
	c.out = append(out, "GET / HTTP/1.1\r\n"...)
	if l.lendReq(c) != req || l.lendResp(c) != resp {
		t.Fatal("a busy connection's heads were replaced")
	}
	l.takeBack(c)
	if c.req != nil || c.resp != nil || c.out != nil || c.gor != nil {
		t.Fatalf("an idle connection still holds req %p resp %p out %d gor %p", c.req, c.resp, cap(c.out), c.gor)
	}
	// The next request reuses them, the buffer emptied.
	c2 := &conn{}
	if l.lendReq(c2) != req || l.lendResp(c2) != resp || len(l.lendOut(c2)) != 0 || &l.lendOut(c2)[:1][0] != &out[:1][0] {
		t.Fatal("the free lists were not used")
	}
	// A buffer that grew past 4 KiB (a request assembled with its body)
	// is not kept; the lists are bounded.
	c2.out = make([]byte, 0, 64<<10)
	l.takeBack(c2)
	if len(l.outs) != 0 || len(l.reqs) != 1 {
		t.Fatalf("outs %d reqs %d after a grown buffer came back", len(l.outs), len(l.reqs))
	}
	for range 2 * keepFree {
		c := &conn{req: new(httphead.Request)}
		l.takeBack(c)
	}
	if len(l.reqs) != keepFree {
		t.Fatalf("%d free request heads kept, want the bound %d", len(l.reqs), keepFree)
	}
}

// A loop's accepted sockets have TCP_NODELAY (a small answer is not held
// back by Nagle), inherited from the listener rather than set on each.
func TestAcceptedSocketsNoDelay(t *testing.T) {
	testenv.CheckLeaks(t)
	be := httpBackend(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	p := startProxy(t, []string{be}, nil)
	for range 2 { // the first connection tells the loop whether it is inherited
		c, br := p.dial()
		io.WriteString(c, "GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
		if resp, _ := readResp(t, br, false); resp.StatusCode != 200 {
			t.Fatal(resp.Status)
		}
		// The proxy's end of c is a descriptor of this process: find it
		// by its addresses.
		local, remote := c.RemoteAddr().String(), c.LocalAddr().String()
		ents, err := os.ReadDir("/proc/self/fd")
		if err != nil {
			t.Fatal(err)
		}
		found := false
		for _, e := range ents {
			fd, err := strconv.Atoi(e.Name())
			if err != nil {
				continue
			}
			ls, err1 := unix.Getsockname(fd)
			rs, err2 := unix.Getpeername(fd)
			la, ok1 := ls.(*unix.SockaddrInet4)
			ra, ok2 := rs.(*unix.SockaddrInet4)
			if err1 != nil || err2 != nil || !ok1 || !ok2 ||
				net.JoinHostPort(net.IP(la.Addr[:]).String(), strconv.Itoa(la.Port)) != local ||
				net.JoinHostPort(net.IP(ra.Addr[:]).String(), strconv.Itoa(ra.Port)) != remote {
				continue
			}
			found = true
			if v, err := unix.GetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY); err != nil || v == 0 {
				t.Fatalf("the proxy's end of a client connection: TCP_NODELAY %d %v", v, err)
			}
		}
		if !found {
			t.Fatal("the proxy's end of the connection not found among this process's descriptors")
		}
		c.Close()
	}
}

// Where the kernel has io_uring (CI: root, kernel ≥ 6.1), the loops
// make their socket reads and writes through it; with -syscalls (make
// test's second run) nothing goes through it.
//
// What is asserted does not depend on timing: how many operations a
// request costs under load does (a read that finds nothing yet is one
// more; a request a goroutine serves is fewer: CI once saw 639 for 160
// requests), so no count per request is compared. On one connection,
// one request at a time, the loop's head read, its send up and its
// response read each went through the ring, and were counted, before the
// response reaches the client (a batch is counted when it is submitted,
// before its completions queue the next operation): each request the
// loop ran itself raised the count by at least 3.
func TestLoopBatchesThroughRing(t *testing.T) {
	if err := uring.Available(); err != nil {
		t.Skipf("SKIP (loud): no io_uring here (%v): the loops make their system calls one by one", err)
	}
	be := httpBackend(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	p := startProxy(t, []string{be}, nil)
	ctr := p.srv.Counters()
	get := func(c net.Conn, br *bufio.Reader) bool {
		io.WriteString(c, "GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
		if resp, body := readResp(t, br, false); resp.StatusCode != 200 || body != "ok" {
			t.Errorf("%d %q", resp.StatusCode, body)
			return false
		}
		return true
	}

	// One request at a time.
	c, br := p.dial()
	ran := 0
	for i := range 20 {
		ops, handoffs := ctr.RingOps.Load(), ctr.Handoffs.Load()
		if !get(c, br) {
			return
		}
		if ctr.Handoffs.Load() != handoffs {
			continue // a goroutine ran this one (and may read the next head)
		}
		ran++
		if d := ctr.RingOps.Load() - ops; noRing && d != 0 || !noRing && d < 3 {
			t.Fatalf("request %d: %d operations through the ring by the time its response came (-syscalls %v)", i, d, noRing)
		}
	}
	c.Close()
	if ran == 0 {
		t.Fatal("every request was handed to a goroutine: the loop ran none")
	}

	// Several connections at once: their operations share submits.
	const conns, rounds = 8, 20
	var wg sync.WaitGroup
	for range conns {
		c, br := p.dial()
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer c.Close()
			for range rounds {
				if !get(c, br) {
					return
				}
			}
		}()
	}
	wg.Wait()
	ops, submits := ctr.RingOps.Load(), ctr.RingSubmits.Load()
	if noRing {
		if ops != 0 || submits != 0 {
			t.Fatalf("-syscalls: %d operations batched in %d submits", ops, submits)
		}
		return
	}
	// How many share a submit depends on timing (make bench: 0.8 system
	// calls per request under load); an empty submit never happens.
	if submits == 0 || submits > ops {
		t.Fatalf("%d submits for %d operations", submits, ops)
	}
	t.Logf("%d operations in %d submits (%.2f each)", ops, submits, float64(ops)/float64(submits))
}

// A pipelined head that runs to the end of the connection's buffer behind
// a served request is compacted and read on, not left to the head
// timeout (edge-triggered: no new edge comes for bytes already queued).
func TestPipelinedHeadAtBufferEnd(t *testing.T) {
	be := httpBackend(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, r.URL.Path) }))
	p := startProxy(t, []string{be}, func(c *Config) { c.HeadTimeout = time.Minute })
	first := "GET /first HTTP/1.1\r\nHost: x\r\n\r\n"
	// The second head: past the 16 KiB buffer with the first, within it
	// alone.
	pad := strings.Repeat("a", 16<<10-len(first)-100)
	second := "GET /second HTTP/1.1\r\nHost: x\r\nX-Pad: " + pad + "\r\nX-More: " + strings.Repeat("b", 400) + "\r\n\r\n"
	c, br := p.dial()
	start := time.Now()
	io.WriteString(c, first+second)
	for _, want := range []string{"/first", "/second"} {
		c.SetReadDeadline(time.Now().Add(20 * time.Second))
		resp, body := readResp(t, br, false)
		if resp.StatusCode != 200 || body != want {
			t.Fatalf("%d %q, want 200 %q", resp.StatusCode, body, want)
		}
	}
	if d := time.Since(start); d > 20*time.Second {
		t.Fatalf("answered after %v: the second head waited for the head timeout", d)
	}
}
