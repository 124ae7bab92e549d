package proxy

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
)

// docs/http-framing.md rule 18 on the response side: a response whose Connection field
// names its own framing field would reach the client unframed on a
// kept-alive connection (the next response glued to its body). It is a
// broken backend: 502, and that upstream connection is never reused.
func TestResponseConnectionNamesFraming(t *testing.T) {
	for _, tc := range []struct{ name, resp string }{
		{"content-length", "HTTP/1.1 200 OK\r\nConnection: Content-Length\r\nContent-Length: 2\r\n\r\nok"},
		{"transfer-encoding", "HTTP/1.1 200 OK\r\nConnection: Transfer-Encoding\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			be := newBackend(t, answerEach(tc.resp))
			p := startProxy(t, []string{be.addr}, nil)
			c, br := p.dial()
			io.WriteString(c, "GET /a HTTP/1.1\r\nHost: a\r\n\r\nGET /b HTTP/1.1\r\nHost: a\r\n\r\n")
			raw := readAll(t, c, br)
			resp, body := splitResponse(t, raw, "GET")
			if resp.StatusCode != 502 || !resp.Close || string(body) != sentError(502) {
				t.Fatalf("client got %q, want the fixed 502 and a close", raw)
			}
			be.waitIdle(t, 2*time.Second) // the upstream connection was closed, not pooled
			if n := p.table.Get(0).Pool.Idle(); n != 0 {
				t.Fatalf("%d pooled connections after a broken response", n)
			}
		})
	}
}

// Trailer is end-to-end (RFC 9110 §6.6.2): kept both ways with the chunked
// body whose trailers it announces; dropped with them when tetherd
// de-chunks for an HTTP/1.0 client.
func TestTrailerFieldForwarded(t *testing.T) {
	const response = "HTTP/1.1 200 OK\r\nTrailer: X-Sum\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nX-Sum: 1\r\n\r\n"
	be := newBackend(t, answerEach(response))
	p := startProxy(t, []string{be.addr}, nil)
	c, br := p.dial()
	const req = "POST / HTTP/1.1\r\nHost: a\r\nTrailer: X-Sum\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nX-Sum: 1\r\n\r\n"
	io.WriteString(c, req)
	head, err := readHeadFrom(br)
	if err != nil {
		t.Fatal(err)
	}
	body, err := readChunkedRaw(br)
	if err != nil {
		t.Fatal(err)
	}
	if got := string(be.received()); !strings.Contains(got, "Trailer: X-Sum\r\n") || !strings.HasSuffix(got, "0\r\nX-Sum: 1\r\n\r\n") {
		t.Errorf("backend got %q: Trailer field or trailer lost", got)
	}
	if !strings.Contains(head, "Trailer: X-Sum\r\n") || body != "2\r\nok\r\n0\r\nX-Sum: 1\r\n\r\n" {
		t.Errorf("client got %q + %q: Trailer field or trailer lost", head, body)
	}

	// HTTP/1.0: de-chunked, so neither framing nor trailers remain.
	raw := readAllFrom(t, p, "GET / HTTP/1.0\r\n\r\n")
	if strings.Contains(raw, "Trailer") || strings.Contains(raw, "Transfer-Encoding") || !strings.HasSuffix(raw, "\r\n\r\nok") {
		t.Errorf("HTTP/1.0 client got %q, want the body alone with no Trailer or Transfer-Encoding", raw)
	}
}

// readChunkedRaw reads a chunked body as sent, framing and trailers included.
func readChunkedRaw(br interface {
	ReadString(byte) (string, error)
}) (string, error) {
	var sb strings.Builder
	last := false
	for {
		line, err := br.ReadString('\n')
		sb.WriteString(line)
		if err != nil {
			return sb.String(), err
		}
		switch {
		case last && line == "\r\n":
			return sb.String(), nil
		case line == "0\r\n":
			last = true
		}
	}
}

func readAllFrom(t *testing.T, p *testProxy, raw string) string {
	t.Helper()
	c, br := p.dial()
	io.WriteString(c, raw)
	return string(readAll(t, c, br))
}

// A backend that answers before reading the whole upload (413 and a
// close) makes the body relay fail: the client gets that answer, not a
// 502, and its connection closes.
func TestEarlyAnswerDuringUpload(t *testing.T) {
	be := newBackend(t, func(c *bconn) {
		if _, err := readHeadFrom(c.br); err != nil {
			return
		}
		io.WriteString(c, "HTTP/1.1 413 Content Too Large\r\nConnection: close\r\nContent-Length: 8\r\n\r\ntoo big\n")
		// returns: closed with the body unread, so the kernel resets
	})
	p := startProxy(t, []string{be.addr}, nil)
	c, br := p.dial()
	const n = 8 << 20
	go func() {
		io.WriteString(c, "POST /up HTTP/1.1\r\nHost: a\r\nContent-Length: 8388608\r\n\r\n")
		c.Write(bytes.Repeat([]byte("x"), n))
	}()
	resp, body := readResp(t, br, false)
	if resp.StatusCode != 413 || body != "too big\n" || !resp.Close {
		t.Fatalf("client got %d close=%v %q, the backend answered 413", resp.StatusCode, resp.Close, body)
	}
	expectClosed(t, c, br)
	if n := p.srv.Counters().BadGateway.Load(); n != 0 {
		t.Fatalf("%d 502s counted for a backend that answered", n)
	}
}

// A backend that sends its 100 late (after tetherd's 1 s wait): tetherd
// has told the client to send by then, and the client sees exactly one 100
// before the final answer.
func TestExpectContinueLate100(t *testing.T) {
	late := make(chan struct{})
	be := newBackend(t, func(c *bconn) {
		if _, err := readHeadFrom(c.br); err != nil {
			return
		}
		<-late // a busy backend: its 100 comes after tetherd's own
		io.WriteString(c, "HTTP/1.1 100 Continue\r\n\r\n")
		b := make([]byte, 5)
		if _, err := io.ReadFull(c.br, b); err != nil {
			return
		}
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
	})
	p := startProxy(t, []string{be.addr}, func(c *Config) { c.Waits.Continue = 50 * time.Millisecond })
	c, br := p.dial()
	start := time.Now()
	io.WriteString(c, "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	head, err := readHeadFrom(br) // a client that waits for the 100
	if err != nil || head != "HTTP/1.1 100 Continue\r\n\r\n" {
		t.Fatalf("after %v: %q (%v), want a 100", time.Since(start), head, err)
	}
	close(late)
	io.WriteString(c, "hello")
	resp, body := readResp(t, br, false)
	if resp.StatusCode != 200 || body != "ok" {
		t.Fatalf("got %d %q after the 100, want the final 200 (and no second 100)", resp.StatusCode, body)
	}
}

// A client that pipelines its next request while the first is in progress
// and then leaves: the upstream (the generation) still closes at once.
func TestClientAbortAfterPipelinedBytes(t *testing.T) {
	arrived, gone := make(chan struct{}), make(chan struct{})
	be := newBackend(t, func(c *bconn) {
		if _, err := readHeadFrom(c.br); err != nil {
			return
		}
		close(arrived)
		c.br.ReadByte() // blocks until tetherd closes the connection
		close(gone)
	})
	p := startProxy(t, []string{be.addr}, nil)
	c, _ := p.dial()
	io.WriteString(c, "GET /long HTTP/1.1\r\nHost: a\r\n\r\n")
	select { // the request is with the worker: the proxy watches the client
	case <-arrived:
	case <-time.After(10 * time.Second):
		t.Fatal("the request never reached the backend")
	}
	io.WriteString(c, "GET /next HTTP/1.1\r\nHost: a\r\n\r\n")
	// Whether the pipelined bytes are read before the close or with it,
	// the upstream closes and one abort is counted.
	c.Close()
	select {
	case <-gone:
	case <-time.After(3 * time.Second):
		t.Fatal("upstream still open 3s after the client left")
	}
	ctr := p.srv.Counters()
	testenv.WaitFor(t, "the abort to be counted", func() bool { return ctr.ClientAborted.Load()+ctr.BadGateway.Load() > 0 })
	if n := ctr.ClientAborted.Load(); n != 1 {
		t.Fatalf("client aborts %d, want 1", n)
	}
}

// A client that leaves while its body is still queued (more than the
// buffer holds) is a client abort, reset or not, Expect or not: never a 502
// or a worker error. (A peek sees the queued bytes and not the reset.)
func TestClientLeavesWithBodyQueued(t *testing.T) {
	body := strings.Repeat("x", 50000)
	for _, tc := range []struct {
		name, head string
		reset      bool
	}{
		{"expect length reset", "Expect: 100-continue\r\nContent-Length: 100000\r\n", true},
		{"expect chunked reset", "Expect: 100-continue\r\nTransfer-Encoding: chunked\r\n", true},
		{"length reset", "Content-Length: 100000\r\n", true},
		{"expect length close", "Expect: 100-continue\r\nContent-Length: 100000\r\n", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			be := httpBackend(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				io.Copy(io.Discard, r.Body)
			}))
			p := startProxy(t, []string{be}, nil)
			const n = 10
			for i := 0; i < n; i++ {
				c, _ := p.dial()
				raw := "POST / HTTP/1.1\r\nHost: x\r\n" + tc.head + "\r\n"
				if strings.Contains(tc.head, "chunked") {
					raw += fmt.Sprintf("%x\r\n", 2*len(body))
				}
				io.WriteString(c, raw+body)
				if tc.reset {
					c.(*net.TCPConn).SetLinger(0)
				}
				c.Close()
			}
			ctr := p.srv.Counters()
			testenv.WaitFor(t, fmt.Sprintf("the ends of %d exchanges to be counted", n), func() bool {
				return ctr.ClientAborted.Load()+ctr.BadGateway.Load()+ctr.Rejected.Load() >= n
			})
			if bg, ab, errs := ctr.BadGateway.Load(), ctr.ClientAborted.Load(), p.stats.Worker(0).Load().Errors; bg != 0 || errs != 0 || ab != n {
				t.Fatalf("bad gateway %d, worker errors %d, client aborts %d: want 0, 0, %d", bg, errs, ab, n)
			}
		})
	}
}

// A chunked body read after the head reuses the buffer the head was parsed
// from. Nothing of the head may be read after that: not the method when
// framing the response (a body starting "HEAD" once made a POST's response
// bodiless, leaving its body in a pooled upstream connection, for the next
// client), not the target or fields of a local endpoint.
func TestChunkedBodyOverwritesNoHead(t *testing.T) {
	t.Run("proxied", func(t *testing.T) {
		be := newBackend(t, answerEach("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"))
		p := startProxy(t, []string{be.addr}, nil)
		c, br := p.dial()
		io.WriteString(c, "POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n")
		waitPeerRead(t, c, "the proxy to read the head and the chunk size") // the rest arrives in a later read
		io.WriteString(c, "HEAD\r\n0\r\n\r\n")
		c.SetReadDeadline(time.Now().Add(3 * time.Second))
		if resp, body := readResp(t, br, false); resp.StatusCode != 200 || body != "hello" {
			t.Fatalf("got %d %q, want the 5-byte body", resp.StatusCode, body)
		}
		if resp, body := p.roundTrip("GET /b HTTP/1.1\r\nHost: x\r\n\r\n"); resp.StatusCode != 200 || body != "hello" {
			t.Fatalf("next client got %d %q", resp.StatusCode, body)
		}
	})
	t.Run("local", func(t *testing.T) {
		var got atomic.Value
		p := startProxy(t, nil, func(cfg *Config) {
			cfg.Local = func(method, path []byte) http.Handler {
				if !bytes.HasPrefix(path, []byte("/local")) {
					return nil
				}
				return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					b, _ := io.ReadAll(r.Body)
					got.Store(r.Method + " " + r.URL.String() + " " + r.Header.Get("X-Token") + " " + string(b))
				})
			}
		})
		c, br := p.dial()
		q := "POST /local?id=BBBB HTTP/1.1\r\nX-Token: evil"
		io.WriteString(c, "POST /local?id=AAAA HTTP/1.1\r\nHost: x\r\nX-Token: t\r\nTransfer-Encoding: chunked\r\n\r\n"+fmt.Sprintf("%x\r\n", len(q)))
		waitPeerRead(t, c, "the proxy to read the head and the chunk size") // the rest arrives in a later read
		io.WriteString(c, q+"\r\n0\r\n\r\n")
		c.SetReadDeadline(time.Now().Add(3 * time.Second))
		if resp, _ := readResp(t, br, false); resp.StatusCode != 200 {
			t.Fatalf("local endpoint answered %d", resp.StatusCode)
		}
		if s, _ := got.Load().(string); s != "POST /local?id=AAAA t "+q {
			t.Fatalf("handler saw %q", s)
		}
	})
}

// A local endpoint's handler (an abort wave can last minutes) is cancelled
// when its client leaves, like a proxied request's upstream; a local body
// that stops coming gets a 408.
func TestLocalEndpointClient(t *testing.T) {
	cancelled := make(chan struct{})
	running := make(chan struct{}, 4)
	p := startProxy(t, nil, func(cfg *Config) {
		cfg.IOTimeout = 300 * time.Millisecond
		cfg.Local = func(method, path []byte) http.Handler {
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				select {
				case running <- struct{}{}:
				default:
				}
				io.ReadAll(r.Body)
				select {
				case <-r.Context().Done():
					close(cancelled)
				case <-time.After(5 * time.Second):
				}
			})
		}
	})
	c, _ := p.dial()
	io.WriteString(c, "POST /abort_until_idle?timeout_s=600 HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
	select { // the handler runs: the client leaves in the middle of it
	case <-running:
	case <-time.After(10 * time.Second):
		t.Fatal("the local handler never ran")
	}
	c.Close()
	select {
	case <-cancelled:
	case <-time.After(3 * time.Second):
		t.Fatal("handler still running 3s after its client left")
	}

	c, br := p.dial()
	io.WriteString(c, "POST /abort_request HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{\"r")
	c.SetReadDeadline(time.Now().Add(3 * time.Second))
	if resp, _ := readResp(t, br, false); resp.StatusCode != 408 {
		t.Fatalf("stalled local body: %d, want 408", resp.StatusCode)
	}
}

// A panic in a local handler (a bug) costs its request a 500, not the
// process.
func TestLocalHandlerPanic(t *testing.T) {
	p := startProxy(t, nil, func(cfg *Config) {
		cfg.Local = func(method, path []byte) http.Handler {
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path == "/bug" {
					panic("handler bug")
				}
			})
		}
	})
	if resp, body := p.roundTrip("GET /bug HTTP/1.1\r\nHost: a\r\n\r\n"); resp.StatusCode != 500 || body != fixedError(500) {
		t.Fatalf("panicking handler: %d %q, want the fixed 500", resp.StatusCode, body)
	}
	if resp, _ := p.roundTrip("GET /fine HTTP/1.1\r\nHost: a\r\n\r\n"); resp.StatusCode != 200 {
		t.Fatalf("after the panic: %d", resp.StatusCode)
	}
}

// An HTTP/1.0 client never sees Transfer-Encoding, not even on a HEAD.
func TestHTTP10HeadNoTransferEncoding(t *testing.T) {
	be := newBackend(t, func(c *bconn) {
		if _, err := readHeadFrom(c.br); err != nil {
			return
		}
		io.WriteString(c, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
	})
	p := startProxy(t, []string{be.addr}, nil)
	c, br := p.dial()
	io.WriteString(c, "HEAD /x HTTP/1.0\r\n\r\n")
	c.SetReadDeadline(time.Now().Add(3 * time.Second))
	head, err := readHeadFrom(br)
	if err != nil || !strings.HasPrefix(head, "HTTP/1.1 200") || strings.Contains(strings.ToLower(head), "transfer-encoding") {
		t.Fatalf("got %q (%v)", head, err)
	}
}
