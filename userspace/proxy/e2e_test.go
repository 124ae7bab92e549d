package proxy

import (
	"bufio"
	"bytes"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/demo"
	"github.com/tether-rl/tether/userspace/upstream"
)

// TestMain fails the package when a test leaves goroutines or file
// descriptors behind.
func TestMain(m *testing.M) {
	if os.Getenv(faultBackendEnv) != "" {
		faultBackend() // a worker process for fault_process_test.go
		return
	}
	flag.BoolVar(&noRing, "syscalls", false, "event loops without io_uring (the fallback path)")
	flag.Parse()
	strictRing = true
	// No test of the package may leave a goroutine, descriptor or pipe
	// behind.
	os.Exit(testenv.RunNoLeaks(m))
}

// tbackend is a raw TCP backend that counts connections, records every
// byte it receives and closes everything when the test ends.
type tbackend struct {
	addr    string
	ln      net.Listener
	accepts atomic.Int64
	active  atomic.Int64

	mu    sync.Mutex
	got   []byte
	conns map[*net.TCPConn]struct{}
	wg    sync.WaitGroup
}

// bconn is one backend connection; reads are recorded.
type bconn struct {
	*net.TCPConn
	b  *tbackend
	n  int64 // accept number, from 1
	br *bufio.Reader
}

// waitSent waits (up to 10 s) until the peer has acknowledged every byte
// written to c: what a reset would discard from the send queue has all
// reached the proxy. It runs on a backend goroutine, where a test may not
// fail now (testenv.WaitFor): it polls, and the test fails on what the
// client got if it gives up.
func (c *bconn) waitSent() {
	raw, err := c.SyscallConn()
	if err != nil {
		return
	}
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		n := -1
		raw.Control(func(fd uintptr) { n, _ = unix.IoctlGetInt(int(fd), unix.SIOCOUTQ) })
		if n == 0 {
			return
		}
	}
}

func (c *bconn) Read(p []byte) (int, error) {
	n, err := c.TCPConn.Read(p)
	if n > 0 {
		c.b.mu.Lock()
		c.b.got = append(c.b.got, p[:n]...)
		c.b.mu.Unlock()
	}
	return n, err
}

func newBackend(t *testing.T, fn func(c *bconn)) *tbackend {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b := &tbackend{addr: ln.Addr().String(), ln: ln, conns: make(map[*net.TCPConn]struct{})}
	b.wg.Add(1)
	go func() {
		defer b.wg.Done()
		for {
			nc, err := ln.Accept()
			if err != nil {
				return
			}
			tc := nc.(*net.TCPConn)
			n := b.accepts.Add(1)
			b.active.Add(1)
			b.mu.Lock()
			b.conns[tc] = struct{}{}
			b.mu.Unlock()
			b.wg.Add(1)
			go func() {
				defer b.wg.Done()
				defer b.active.Add(-1)
				defer func() {
					b.mu.Lock()
					delete(b.conns, tc)
					b.mu.Unlock()
					tc.Close()
				}()
				tc.SetDeadline(time.Now().Add(10 * time.Second))
				c := &bconn{TCPConn: tc, b: b, n: n}
				c.br = bufio.NewReader(c)
				fn(c)
			}()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		b.mu.Lock()
		for c := range b.conns {
			c.Close()
		}
		b.mu.Unlock()
		b.wg.Wait()
	})
	return b
}

// answerEach is a backend handler that answers every request on its
// connection with resp.
func answerEach(resp string) func(*bconn) {
	return func(c *bconn) {
		for {
			if _, _, err := c.readRequest(); err != nil {
				return
			}
			io.WriteString(c, resp)
		}
	}
}

func (b *tbackend) received() []byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]byte(nil), b.got...)
}

func (b *tbackend) reset() {
	b.mu.Lock()
	b.got = nil
	b.mu.Unlock()
}

// waitIdle waits until no backend connection is open.
func (b *tbackend) waitIdle(t *testing.T, d time.Duration) {
	t.Helper()
	testenv.WaitForWithin(t, "no backend connection open", d, func() bool { return b.active.Load() == 0 })
}

// readHeadFrom reads one request or response head, CRLFCRLF included.
func readHeadFrom(br *bufio.Reader) (string, error) {
	var sb strings.Builder
	for {
		line, err := br.ReadString('\n')
		sb.WriteString(line)
		if err != nil {
			return sb.String(), err
		}
		if line == "\r\n" {
			return sb.String(), nil
		}
	}
}

// readRequest reads a whole request (Content-Length or chunked body) and
// returns its head and its body (de-chunked).
func (c *bconn) readRequest() (string, []byte, error) {
	head, err := readHeadFrom(c.br)
	if err != nil {
		return head, nil, err
	}
	var cl int64
	chunked := false
	for _, l := range strings.Split(head, "\r\n") {
		name, val, ok := strings.Cut(l, ":")
		if !ok {
			continue
		}
		val = strings.TrimSpace(val)
		switch strings.ToLower(name) {
		case "content-length":
			cl, _ = strconv.ParseInt(val, 10, 64)
		case "transfer-encoding":
			chunked = true
		}
	}
	if chunked {
		body, err := readChunkedBody(c.br)
		return head, body, err
	}
	body := make([]byte, cl)
	_, err = io.ReadFull(c.br, body)
	return head, body, err
}

// readChunk reads one chunk; data is nil for the last one (whose trailer
// section is consumed too).
func readChunk(br *bufio.Reader) ([]byte, error) {
	line, err := br.ReadString('\n')
	if err != nil {
		return nil, err
	}
	if !strings.HasSuffix(line, "\r\n") {
		return nil, fmt.Errorf("chunk size line %q", line)
	}
	sz, _, _ := strings.Cut(strings.TrimSuffix(line, "\r\n"), ";")
	n, err := strconv.ParseInt(sz, 16, 64)
	if err != nil {
		return nil, fmt.Errorf("chunk size %q", sz)
	}
	if n == 0 {
		for {
			l, err := br.ReadString('\n')
			if err != nil {
				return nil, err
			}
			if l == "\r\n" {
				return nil, nil
			}
		}
	}
	data := make([]byte, n+2)
	if _, err := io.ReadFull(br, data); err != nil {
		return nil, err
	}
	if string(data[n:]) != "\r\n" {
		return nil, fmt.Errorf("no CRLF after chunk data")
	}
	return data[:n], nil
}

func readChunkedBody(br *bufio.Reader) ([]byte, error) {
	var body []byte
	for {
		d, err := readChunk(br)
		if err != nil {
			return body, err
		}
		if d == nil {
			return body, nil
		}
		body = append(body, d...)
	}
}

// readAll reads the client connection until EOF; a timeout is an error
// (the connection was not closed).
func readAll(t *testing.T, c net.Conn, br *bufio.Reader) []byte {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	b, err := io.ReadAll(br)
	if err != nil {
		t.Fatalf("reading to EOF: %v (got %q)", err, b)
	}
	return b
}

// splitResponse parses a raw response head and returns it with the raw
// bytes that follow it.
func splitResponse(t *testing.T, raw []byte, method string) (*http.Response, []byte) {
	t.Helper()
	i := bytes.Index(raw, []byte("\r\n\r\n"))
	if i < 0 {
		t.Fatalf("no response head in %q", raw)
	}
	resp, err := http.ReadResponse(bufio.NewReader(bytes.NewReader(raw[:i+4])), &http.Request{Method: method})
	if err != nil {
		t.Fatalf("response head %q: %v", raw[:i+4], err)
	}
	return resp, raw[i+4:]
}

// expectClosed checks that the proxy closed the client connection: the
// next read is EOF (not a timeout) with nothing more.
func expectClosed(t *testing.T, c net.Conn, br *bufio.Reader) {
	t.Helper()
	if rest := readAll(t, c, br); len(rest) > 0 {
		t.Fatalf("bytes after the response: %q", rest)
	}
}

// sentError is the body of tetherd's 502/504 for a request that reached
// the worker (X-Tether-Upstream-State: sent).
func sentError(code int) string {
	r := string(upstreamErrors[code][1][0])
	return r[strings.Index(r, "\r\n\r\n")+4:]
}

func fixedError(code int) string {
	return `{"error":{"code":` + strconv.Itoa(code) + `,"message":"` + errorText[code] + `"}}` + "\n"
}

// --- 7. pipelining ---

func TestPipeliningMixed(t *testing.T) {
	be := httpBackend(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.Header().Set("X-Path", r.URL.Path)
		switch {
		case strings.HasPrefix(r.URL.Path, "/nocontent/"):
			w.WriteHeader(204)
		case r.Method == "HEAD":
			w.Header().Set("Content-Length", "1234")
			w.WriteHeader(200)
		case len(b) == 0:
			io.WriteString(w, "get "+r.URL.Path)
		default:
			w.Write(b)
		}
	}))
	p := startProxy(t, []string{be}, nil)
	c, br := p.dial()

	const n, split = 20, 10
	type want struct {
		path, method, body string
		status             int
	}
	var wants []want
	var first, second bytes.Buffer
	for i := 0; i < n; i++ {
		out := &first
		if i > split {
			out = &second
		}
		kinds := []string{"get", "cl", "chunked", "head", "nocontent"}
		kind := kinds[i%len(kinds)]
		path := fmt.Sprintf("/%s/%d", kind, i)
		body := strings.Repeat(fmt.Sprintf("body-%d.", i), i+1)
		switch {
		case i == split:
			// Its body straddles two TCP writes: the rest of it and the
			// requests after it come later.
			body = strings.Repeat("0123456789", 3000)
			fmt.Fprintf(out, "POST %s HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n%s", path, len(body), body[:1000])
			second.WriteString(body[1000:])
			wants = append(wants, want{path, "POST", body, 200})
		case kind == "get":
			fmt.Fprintf(out, "GET %s HTTP/1.1\r\nHost: a\r\n\r\n", path)
			wants = append(wants, want{path, "GET", "get " + path, 200})
		case kind == "cl":
			fmt.Fprintf(out, "POST %s HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n%s", path, len(body), body)
			wants = append(wants, want{path, "POST", body, 200})
		case kind == "chunked":
			fmt.Fprintf(out, "POST %s HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n1;ext=1\r\n!\r\n0\r\n\r\n", path, len(body), body)
			wants = append(wants, want{path, "POST", body + "!", 200})
		case kind == "head":
			fmt.Fprintf(out, "HEAD %s HTTP/1.1\r\nHost: a\r\n\r\n", path)
			wants = append(wants, want{path, "HEAD", "", 200})
		case kind == "nocontent":
			fmt.Fprintf(out, "GET %s HTTP/1.1\r\nHost: a\r\n\r\n", path)
			wants = append(wants, want{path, "GET", "", 204})
		}
	}
	if _, err := c.Write(first.Bytes()); err != nil {
		t.Fatal(err)
	}
	waitPeerRead(t, c, "the proxy to read the first write")
	if _, err := c.Write(second.Bytes()); err != nil {
		t.Fatal(err)
	}
	for i, w := range wants {
		resp, body := readResp(t, br, w.method == "HEAD")
		if resp.StatusCode != w.status || body != w.body || resp.Header.Get("X-Path") != w.path {
			t.Fatalf("response %d (%s %s): status %d path %q body %.60q", i, w.method, w.path, resp.StatusCode, resp.Header.Get("X-Path"), body)
		}
		if w.method == "HEAD" && resp.Header.Get("Content-Length") != "1234" {
			t.Fatalf("HEAD response lost its Content-Length: %v", resp.Header)
		}
	}
	// Nothing extra: the connection is idle and still open.
	c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if b, err := br.ReadByte(); !isTimeout(err) {
		t.Fatalf("after the last response: %q %v", b, err)
	}
}

// --- 5. SSE latency ---

// TestSSELatency: each SSE event reaches the client on its own, before the
// worker writes anything more. The worker writes event j and then waits
// until the client has read it (or gives up after a hang guard): a proxy
// that held an event back for more data would never deliver it. The lag is
// logged, not asserted (it depends on the machine, and on emulation).
func TestSSELatency(t *testing.T) {
	const events = 5
	read := make(chan int, events)
	be := newBackend(t, func(c *bconn) {
		for { // one stream per request, on a keep-alive connection
			if _, _, err := c.readRequest(); err != nil {
				return
			}
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
			for j := 0; j < events; j++ {
				ev := fmt.Sprintf("data: %d\n\n", j)
				fmt.Fprintf(c, "%x\r\n%s\r\n", len(ev), ev)
				select {
				case <-read:
				case <-time.After(10 * time.Second): // hang guard: the client's read fails the test first
				}
			}
			io.WriteString(c, "0\r\n\r\n")
		}
	})
	p := startProxy(t, []string{be.addr}, nil)
	c, br := p.dial()
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(8 * time.Second))
	io.WriteString(c, "POST /sessions/w0-x/v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}")
	if _, err := readHeadFrom(br); err != nil {
		t.Fatal(err)
	}
	for j := 0; j < events; j++ {
		start := time.Now()
		d, err := readChunk(br)
		if err != nil || string(d) != fmt.Sprintf("data: %d\n\n", j) {
			t.Fatalf("event %d did not reach the client on its own (the worker writes nothing more until it does): %q %v", j, d, err)
		}
		if j > 0 {
			t.Logf("event %d reached the client %v after the previous one was read", j, time.Since(start))
		}
		read <- j
	}
	if d, err := readChunk(br); d != nil || err != nil {
		t.Fatalf("last chunk: %q %v", d, err)
	}
}

// --- 8. Expect: 100-continue ---

func TestExpectContinueNetHTTP(t *testing.T) {
	be := httpBackend(t, echoHandler())
	p := startProxy(t, []string{be}, nil)
	c, br := p.dial()
	io.WriteString(c, "POST /e HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
	resp, _ := readResp(t, br, false)
	if resp.Proto != "HTTP/1.1" || resp.Status != "100 Continue" {
		t.Fatalf("first response %s %s, want HTTP/1.1 100 Continue", resp.Proto, resp.Status)
	}
	// The body goes only now; a second 100 would show up as the next response.
	io.WriteString(c, "hello")
	resp, body := readResp(t, br, false)
	if resp.StatusCode != 200 || body != "hello" {
		t.Fatalf("final response %d %q", resp.StatusCode, body)
	}
	// The connection goes on.
	io.WriteString(c, "GET /after HTTP/1.1\r\nHost: a\r\n\r\n")
	if resp, _ := readResp(t, br, false); resp.StatusCode != 200 || resp.Header.Get("X-Path") != "/after" {
		t.Fatalf("next request: %d %v", resp.StatusCode, resp.Header)
	}
}

func TestExpectContinueFinalWithout100(t *testing.T) {
	for _, status := range []int{417, 401} {
		t.Run(strconv.Itoa(status), func(t *testing.T) {
			upstreamEOF := make(chan struct{})
			be := newBackend(t, func(c *bconn) {
				if _, err := readHeadFrom(c.br); err != nil {
					return
				}
				fmt.Fprintf(c, "HTTP/1.1 %d Nope\r\nContent-Length: 0\r\n\r\n", status)
				// The body never came: this connection must not be reused.
				if _, err := c.br.ReadByte(); err == io.EOF {
					close(upstreamEOF)
				}
			})
			p := startProxy(t, []string{be.addr}, func(c *Config) { c.Waits.Linger = 50 * time.Millisecond })
			c, br := p.dial()
			io.WriteString(c, "PUT /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
			resp, _ := readResp(t, br, false)
			if resp.StatusCode != status || !resp.Close {
				t.Fatalf("got %d close=%v, want %d with Connection: close", resp.StatusCode, resp.Close, status)
			}
			expectClosed(t, c, br)
			select {
			case <-upstreamEOF:
			case <-time.After(2 * time.Second):
				t.Fatal("upstream connection kept open")
			}
		})
	}
}

func TestExpectContinueDuplicate100(t *testing.T) {
	cases := []struct {
		name string
		// before: written after the head, before reading the body;
		// after: written after the body.
		before, after string
	}{
		{"two before body", "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 100 Continue\r\n\r\n", ""},
		{"one before one after", "HTTP/1.1 100 Continue\r\n\r\n", "HTTP/1.1 100 Continue\r\n\r\n"},
		{"two after body", "HTTP/1.1 100 Continue\r\n\r\n", "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 100 Continue\r\n\r\n"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			be := newBackend(t, func(c *bconn) {
				if _, err := readHeadFrom(c.br); err != nil {
					return
				}
				io.WriteString(c, tc.before)
				body := make([]byte, 5)
				if _, err := io.ReadFull(c.br, body); err != nil {
					return
				}
				io.WriteString(c, tc.after+"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"+string(body))
				io.Copy(io.Discard, c)
			})
			p := startProxy(t, []string{be.addr}, nil)
			c, br := p.dial()
			io.WriteString(c, "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
			resp, _ := readResp(t, br, false)
			if resp.StatusCode != 100 {
				t.Fatalf("first response %d, want 100", resp.StatusCode)
			}
			io.WriteString(c, "hello")
			resp, body := readResp(t, br, false)
			if resp.StatusCode != 200 || body != "hello" {
				t.Fatalf("after the body: %d %q (a second 100 reached the client?)", resp.StatusCode, body)
			}
			c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
			if b, err := br.ReadByte(); !isTimeout(err) {
				t.Fatalf("after the response: %q %v", b, err)
			}
		})
	}
}

// --- 9. HTTP/1.0 clients ---

func TestHTTP10Client(t *testing.T) {
	cases := []struct {
		name, req string
		resp      []string // backend writes, in order
		body      string
	}{
		{"chunked is de-chunked", "GET /c HTTP/1.0\r\n\r\n",
			[]string{"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\n\r\n5\r\nhello\r\n", "6;x=y\r\n world\r\n0\r\nX-T: 1\r\n\r\n"}, "hello world"},
		{"chunked in one piece", "GET /c HTTP/1.0\r\nHost: h\r\n\r\n",
			[]string{"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"}, "hello world"},
		{"content-length", "GET /l HTTP/1.0\r\n\r\n",
			[]string{"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"}, "hello"},
		{"keep-alive asked", "GET /k HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
			[]string{"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"}, "hello"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			heads := make(chan string, 1)
			be := newBackend(t, func(c *bconn) {
				h, err := readHeadFrom(c.br)
				if err != nil {
					return
				}
				heads <- h
				for i, w := range tc.resp {
					if i > 0 {
						time.Sleep(20 * time.Millisecond) // the answer comes in pieces
					}
					io.WriteString(c, w)
				}
				io.Copy(io.Discard, c)
			})
			p := startProxy(t, []string{be.addr}, nil)
			c, br := p.dial()
			io.WriteString(c, tc.req)
			raw := readAll(t, c, br) // EOF: the connection was closed
			resp, body := splitResponse(t, raw, "GET")
			if resp.StatusCode != 200 || !resp.Close || !bytes.Contains(raw, []byte("\r\nConnection: close\r\n")) {
				t.Fatalf("response %q, want 200 with Connection: close", raw)
			}
			if resp.Header.Get("Transfer-Encoding") != "" || len(resp.TransferEncoding) > 0 {
				t.Fatalf("Transfer-Encoding sent to an HTTP/1.0 client: %q", raw)
			}
			if string(body) != tc.body {
				t.Fatalf("body %q, want %q", body, tc.body)
			}
			if h := <-heads; !strings.Contains(h, " HTTP/1.1\r\n") {
				t.Fatalf("upstream request not HTTP/1.1: %q", h)
			}
		})
	}
}

// A large chunked body (chunks longer than the splice threshold) reaches an
// HTTP/1.0 client de-chunked, byte for byte.
func TestHTTP10ClientLargeChunked(t *testing.T) {
	const size, seed = 1 << 20, 7
	s, err := demo.Start("127.0.0.1:0", demo.Options{Index: 0})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	p := startProxy(t, []string{s.Addr()}, nil)
	c, br := p.dial()
	fmt.Fprintf(c, "GET /sessions/w0-a/blob?size=%d&seed=%d&chunked=1 HTTP/1.0\r\n\r\n", size, seed)
	raw := readAll(t, c, br)
	resp, body := splitResponse(t, raw, "GET")
	if resp.StatusCode != 200 || !resp.Close || len(resp.TransferEncoding) > 0 {
		t.Fatalf("head %d %v", resp.StatusCode, resp.Header)
	}
	want, _ := io.ReadAll(demo.Blob(size, seed))
	if !bytes.Equal(body, want) {
		t.Fatalf("body of %d bytes differs from the blob of %d", len(body), len(want))
	}
}

// Long chunks move by splice (the rest of each chunk past the copied first
// bytes), short ones are copied and framed: whatever the mix and however
// the worker's writes fall, an HTTP/1.1 client gets the chunked body byte
// for byte, an HTTP/1.0 client its data, and both connections stay in
// step (the next request on each is answered).
func TestLongChunksRelayedExactly(t *testing.T) {
	rnd := rand.New(rand.NewPCG(1, 2))
	piece := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rnd.Uint32())
		}
		return b
	}
	var body, data []byte
	for _, n := range []int{1 << 20, 5, 70 << 10, 16 << 10, (16 << 10) - 1, 300 << 10, 3} {
		d := piece(n)
		data = append(data, d...)
		body = fmt.Appendf(body, "%x", n)
		if n == 5 {
			body = append(body, ";ext=1"...)
		}
		body = append(body, "\r\n"...)
		body = append(body, d...)
		body = append(body, "\r\n"...)
	}
	body = append(body, "0\r\nX-Trailer: t\r\n\r\n"...)
	be := newBackend(t, func(c *bconn) {
		for {
			if _, err := readHeadFrom(c.br); err != nil {
				return
			}
			io.WriteString(c, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
			// In uneven writes, some ending inside a size line or a
			// chunk's end, so that a read of the copy meets every state.
			for rest, k := body, 0; len(rest) > 0; k++ {
				n := min(len(rest), []int{7, 100 << 10, 3, 1 << 20, 40 << 10}[k%5])
				if _, err := c.Write(rest[:n]); err != nil {
					return
				}
				rest = rest[n:]
			}
		}
	})
	p := startProxy(t, []string{be.addr}, nil)
	c, br := p.dial()
	defer c.Close()
	c.SetDeadline(time.Now().Add(20 * time.Second))
	for i := 0; i < 2; i++ { // the second proves the client connection kept in step
		fmt.Fprintf(c, "GET /sessions/w0-a/x HTTP/1.1\r\nHost: x\r\n\r\n")
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("response %d: %v", i, err)
		}
		got, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || !bytes.Equal(got, data) || resp.Trailer.Get("X-Trailer") != "t" {
			t.Fatalf("response %d: %d data bytes (want %d, equal %v), trailer %q, err %v", i, len(got), len(data), bytes.Equal(got, data), resp.Trailer.Get("X-Trailer"), err)
		}
	}
	// The wire bytes themselves, chunk sizes and extensions included.
	c2, br2 := p.dial()
	defer c2.Close()
	c2.SetDeadline(time.Now().Add(20 * time.Second))
	fmt.Fprintf(c2, "GET /sessions/w0-a/x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
	if _, raw := splitRawHead(t, readAll(t, c2, br2)); !bytes.Equal(raw, body) {
		t.Fatalf("chunked body of %d bytes differs from the worker's %d", len(raw), len(body))
	}
	// HTTP/1.0: the data alone, to the close.
	c3, br3 := p.dial()
	defer c3.Close()
	c3.SetDeadline(time.Now().Add(20 * time.Second))
	fmt.Fprintf(c3, "GET /sessions/w0-a/x HTTP/1.0\r\n\r\n")
	if _, raw := splitRawHead(t, readAll(t, c3, br3)); !bytes.Equal(raw, data) {
		t.Fatalf("HTTP/1.0: %d bytes, want the %d data bytes", len(raw), len(data))
	}
}

// A long chunk arrives in pieces from a worker that keeps its connection:
// the loop splices it with a raised SO_RCVLOWAT, and whatever stops the
// splice (the rest under --splice-min, the chunk's end), the last bytes
// under the batch still wake the loop: the answer ends at once, not at
// the stream idle timeout, and the worker's connection serves the next
// request. With --splice-min above the batch (256 KiB), the rest of the
// chunk falls back to the copy while the mark was raised.
func TestChunkEndWakesTheLoop(t *testing.T) {
	const size, piece1, piece3 = 4 << 20, 3 << 20, 100 << 10
	data := make([]byte, size)
	for i := range data {
		data[i] = byte(i * 7)
	}
	for _, spliceMin := range []int64{0, 2 << 20} {
		t.Run(fmt.Sprint("splice-min=", spliceMin), func(t *testing.T) {
			be := newBackend(t, func(c *bconn) {
				// The worker's pieces go once the proxy took the last: none
				// unacknowledged, and what is unread at its end is under
				// the batch (bytes the loop was not meant to wake for yet).
				taken := func() {
					testenv.WaitFor(t, "the proxy to take the piece", func() bool {
						n := peerUnread(c)
						return unacked(c) == 0 && n >= 0 && n < batchLowat
					})
				}
				for {
					if _, err := readHeadFrom(c.br); err != nil {
						return
					}
					fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n", size)
					c.Write(data[:piece1])
					taken()
					c.Write(data[piece1 : size-piece3])
					taken()
					c.Write(append(data[size-piece3:len(data):len(data)], "\r\n0\r\n\r\n"...))
				}
			})
			p := startProxy(t, []string{be.addr}, func(c *Config) {
				c.StreamIdleTimeout = time.Minute // a missed wake-up shows as the client's deadline
				if spliceMin > 0 {
					c.SpliceMin = spliceMin
				}
			})
			c, br := p.dial()
			defer c.Close()
			c.SetDeadline(time.Now().Add(15 * time.Second))
			for i := 0; i < 2; i++ {
				fmt.Fprintf(c, "GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
				resp, err := http.ReadResponse(br, nil)
				if err != nil {
					t.Fatalf("response %d: %v", i, err)
				}
				got, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				if err != nil || !bytes.Equal(got, data) {
					t.Fatalf("response %d: %d of %d bytes, %v", i, len(got), size, err)
				}
			}
			if n := be.accepts.Load(); n != 1 {
				t.Fatalf("the worker accepted %d connections, want 1 (kept alive)", n)
			}
		})
	}
}

// splitRawHead splits a raw response at the end of its head.
func splitRawHead(t *testing.T, raw []byte) (string, []byte) {
	t.Helper()
	i := bytes.Index(raw, []byte("\r\n\r\n"))
	if i < 0 {
		t.Fatalf("no head in %d bytes", len(raw))
	}
	return string(raw[:i+4]), raw[i+4:]
}

// --- 10. backend dies in the middle of a body ---

func TestBackendDiesMidBody(t *testing.T) {
	part := strings.Repeat("x", 100)
	big := strings.Repeat("y", 300<<10)
	cases := []struct {
		name, head, sent string
		reset            bool
	}{
		{"content-length", "HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n", part, false},
		{"chunked mid-chunk", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", "3e8\r\n" + part, false},
		{"content-length reset", "HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n", part, true},
		{"chunked reset", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", "3e8\r\n" + part, true},
		// Large bodies move with SO_RCVLOWAT batching: a backend that dies
		// with less than a batch queued must still end the response.
		{"large content-length", "HTTP/1.1 200 OK\r\nContent-Length: 4194304\r\n\r\n", big, false},
		{"large content-length reset", "HTTP/1.1 200 OK\r\nContent-Length: 4194304\r\n\r\n", big, true},
		{"large chunk", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", "400000\r\n" + big, false},
		{"large chunk reset", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", "400000\r\n" + big, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			be := newBackend(t, func(c *bconn) {
				if _, err := readHeadFrom(c.br); err != nil {
					return
				}
				io.WriteString(c, tc.head+tc.sent)
				if tc.reset {
					c.waitSent() // the proxy relays what came first
					c.SetLinger(0)
				}
			})
			p := startProxy(t, []string{be.addr}, nil)
			for i := 1; i <= 2; i++ {
				c, br := p.dial()
				io.WriteString(c, "GET / HTTP/1.1\r\nHost: a\r\n\r\n")
				raw := readAll(t, c, br)
				resp, body := splitResponse(t, raw, "GET")
				if resp.StatusCode != 200 || string(body) != tc.sent {
					t.Fatalf("request %d: status %d, %d body bytes, want the %d bytes sent and EOF", i, resp.StatusCode, len(body), len(tc.sent))
				}
				if got := be.accepts.Load(); got != int64(i) {
					t.Fatalf("request %d: backend accepted %d connections", i, got)
				}
				be.waitIdle(t, 2*time.Second)
			}
			pool := p.table.Get(0).Pool
			if r := pool.Retries(upstream.RetryDeadPooled); r != 0 || pool.Idle() != 0 {
				t.Fatalf("the broken connection went back to the pool (dead pooled %d, idle %d)", r, pool.Idle())
			}
		})
	}
}

// --- 11. client leaves in the middle of a stream ---

func TestClientAbortClosesUpstream(t *testing.T) {
	const within = 100 * time.Millisecond
	t.Run("demo worker", func(t *testing.T) {
		s, err := demo.Start("127.0.0.1:0", demo.Options{Index: 0})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		p := startProxy(t, []string{s.Addr()}, nil)
		testenv.Timed(t, func() error {
			c, br := p.dial()
			io.WriteString(c, "POST /sessions/w0-abc/slow?chunks=5&delay_ms=3000 HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n")
			if _, err := readHeadFrom(br); err != nil {
				t.Fatal(err)
			}
			if d, err := readChunk(br); err != nil || !bytes.Contains(d, []byte(`"seq":0`)) {
				t.Fatalf("first event %q %v", d, err)
			}
			cancelled, aborted := s.Cancelled(), p.srv.Counters().ClientAborted.Load()
			c.Close()
			start := time.Now()
			var took time.Duration
			testenv.WaitForWithin(t, "the worker cancelled and the client abort counted", 2*time.Second, func() bool {
				if took == 0 && s.Cancelled() != cancelled {
					took = time.Since(start)
				}
				return s.Cancelled() != cancelled && p.srv.Counters().ClientAborted.Load() != aborted
			})
			if took == 0 {
				took = time.Since(start)
			}
			if n := p.srv.Counters().ClientAborted.Load() - aborted; n != 1 {
				t.Fatalf("ClientAborted counted %d times", n)
			}
			if took > within {
				return fmt.Errorf("worker cancelled %v after the client left", took)
			}
			return nil
		})
	})
	t.Run("raw backend", func(t *testing.T) {
		gone := make(chan time.Time, 1)
		be := newBackend(t, func(c *bconn) {
			if _, err := readHeadFrom(c.br); err != nil {
				return
			}
			io.WriteString(c, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\ndata:\n\r\n")
			c.br.ReadByte() // blocks until the proxy closes the connection
			gone <- time.Now()
		})
		p := startProxy(t, []string{be.addr}, nil)
		testenv.Timed(t, func() error {
			c, br := p.dial()
			io.WriteString(c, "GET /stream HTTP/1.1\r\nHost: a\r\n\r\n")
			if _, err := readHeadFrom(br); err != nil {
				t.Fatal(err)
			}
			if _, err := readChunk(br); err != nil {
				t.Fatal(err)
			}
			c.Close()
			start := time.Now()
			select {
			case at := <-gone:
				if d := at.Sub(start); d > within {
					return fmt.Errorf("upstream closed %v after the client left", d)
				}
			case <-time.After(2 * time.Second):
				t.Fatal("upstream connection still open after the client left")
			}
			return nil
		})
	})
}

// --- 12. pooled connections and retries ---

func TestDeadPooledConnDetected(t *testing.T) {
	be := newBackend(t, func(c *bconn) {
		if _, _, err := c.readRequest(); err != nil {
			return
		}
		// Answer as if the connection stayed open, then close it while idle
		// (a backend's idle timeout).
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
	})
	p := startProxy(t, []string{be.addr}, nil)
	c, br := p.dial()
	for i := 1; i <= 2; i++ {
		io.WriteString(c, "GET / HTTP/1.1\r\nHost: a\r\n\r\n")
		resp, body := readResp(t, br, false)
		if resp.StatusCode != 200 || body != "ok" {
			t.Fatalf("request %d: %d %q", i, resp.StatusCode, body)
		}
		be.waitIdle(t, 2*time.Second)
		// The worker's FIN reaches the pooled socket and the loop closes
		// its end.
		testenv.WaitFor(t, "the proxy to close the upstream connection the worker closed", func() bool {
			return p.stats.Worker(0).Load().Conns == 0
		})
	}
	// The event loop keeps idle upstream sockets in its epoll set: the
	// close is seen when it happens, so the next request dials at once
	// instead of meeting the dead socket (the goroutine path's pool peeks
	// at reuse: upstream.TestPool*).
	pool := p.table.Get(0).Pool
	if r := pool.Retries(upstream.RetryDeadPooled); r != 0 {
		t.Fatalf("dead pooled retries %d, want 0 (dropped when it closed)", r)
	}
	if a := be.accepts.Load(); a != 2 {
		t.Fatalf("backend accepts %d, want 2", a)
	}
}

func TestNoRetryAfterRequestWritten(t *testing.T) {
	cases := []struct {
		name   string
		pooled bool // a first request primes the pool
	}{{"fresh connection", false}, {"pooled connection", true}}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var served atomic.Int64
			be := newBackend(t, func(c *bconn) {
				for {
					if _, _, err := c.readRequest(); err != nil {
						return
					}
					if served.Add(1) == 1 && tc.pooled {
						io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
						continue
					}
					return // the request arrived: close without an answer
				}
			})
			p := startProxy(t, []string{be.addr}, nil)
			c, br := p.dial()
			if tc.pooled {
				io.WriteString(c, "GET /prime HTTP/1.1\r\nHost: a\r\n\r\n")
				if resp, _ := readResp(t, br, false); resp.StatusCode != 200 {
					t.Fatalf("priming request: %d", resp.StatusCode)
				}
			}
			io.WriteString(c, "POST /gen HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n\r\nbody")
			resp, body := readResp(t, br, false)
			if resp.StatusCode != 502 || body != sentError(502) || resp.Header.Get(UpstreamStateHeader) != "sent" || !resp.Close {
				t.Fatalf("got %d close=%v %q", resp.StatusCode, resp.Close, body)
			}
			expectClosed(t, c, br)
			// A retry, if any, was made before the 502: once no upstream
			// connection is open at either end, none is still under way.
			testenv.WaitFor(t, "no upstream connection open", func() bool {
				return be.active.Load() == 0 && p.stats.Worker(0).Load().Conns == 0
			})
			pool := p.table.Get(0).Pool
			if a := be.accepts.Load(); a != 1 {
				t.Fatalf("backend accepted %d connections: the request was retried", a)
			}
			if n := served.Load(); n != map[bool]int64{false: 1, true: 2}[tc.pooled] {
				t.Fatalf("backend read %d requests", n)
			}
			if r := pool.Retries(upstream.RetryConnect) + pool.Retries(upstream.RetryDeadPooled); r != 0 {
				t.Fatalf("%d retries", r)
			}
		})
	}
}

// --- 13. response timeout ---

func TestResponseTimeout504(t *testing.T) {
	upstreamEOF := make(chan struct{})
	be := newBackend(t, func(c *bconn) {
		if _, err := readHeadFrom(c.br); err != nil {
			return
		}
		if _, err := c.br.ReadByte(); err == io.EOF { // never answers
			close(upstreamEOF)
		}
	})
	p := startProxy(t, []string{be.addr}, func(cfg *Config) { cfg.ResponseTimeout = 200 * time.Millisecond })
	c, br := p.dial()
	start := time.Now()
	io.WriteString(c, "GET /never HTTP/1.1\r\nHost: a\r\n\r\n")
	resp, body := readResp(t, br, false)
	d := time.Since(start)
	if resp.StatusCode != 504 || body != sentError(504) || resp.Header.Get(UpstreamStateHeader) != "sent" || !resp.Close {
		t.Fatalf("got %d close=%v %q", resp.StatusCode, resp.Close, body)
	}
	if d < 190*time.Millisecond || d > 10*time.Second { // not held past the timeout (loosely: emulated kernels are slow)
		t.Fatalf("504 after %v, want about 200ms", d)
	}
	expectClosed(t, c, br)
	select {
	case <-upstreamEOF:
	case <-time.After(2 * time.Second):
		t.Fatal("upstream connection kept open after the timeout")
	}
	if n := p.srv.Counters().Timeouts.Load(); n != 1 {
		t.Fatalf("Timeouts %d", n)
	}
}
