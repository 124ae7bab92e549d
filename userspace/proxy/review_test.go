package proxy

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/upstream"
)

// okBackend answers every request head on a connection with a 2-byte body
// and counts the connections it accepted.
func okBackend(t *testing.T) (string, *atomic.Int64) {
	var accepts atomic.Int64
	addr := rawBackend(t, func(c net.Conn) {
		accepts.Add(1)
		br := bufio.NewReader(c)
		for {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			io.Copy(io.Discard, req.Body)
			io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		}
	})
	return addr, &accepts
}

// The client watch must outlive the read deadline the head read left: a
// client leaving after IdleTimeout still closes the upstream at once, and
// that is not counted against the worker.
func TestWatchOutlivesIdleDeadline(t *testing.T) {
	upClosed := make(chan time.Time, 1)
	be := rawBackend(t, func(c net.Conn) {
		readHeadFrom(bufio.NewReader(c))
		var b [1]byte
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		c.Read(b[:]) // until the proxy closes
		upClosed <- time.Now()
	})
	p := startProxy(t, []string{be}, func(cfg *Config) { cfg.IdleTimeout = 200 * time.Millisecond })
	c, _ := p.dial()
	io.WriteString(c, "GET /long HTTP/1.1\r\nHost: a\r\n\r\n")
	time.Sleep(600 * time.Millisecond) // past the idle deadline
	left := time.Now()
	c.Close()
	select {
	case at := <-upClosed:
		if d := at.Sub(left); d > time.Second {
			t.Fatalf("upstream closed %v after the client left", d)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("upstream never closed after the client left")
	}
	ctr := p.srv.Counters()
	testenv.WaitFor(t, "the exchange's end to be counted", func() bool { return ctr.ClientAborted.Load()+ctr.BadGateway.Load() > 0 })
	w := p.stats.Worker(0).Load()
	if p.srv.Counters().BadGateway.Load() != 0 || w.Errors != 0 || p.srv.Counters().ClientAborted.Load() != 1 {
		t.Fatalf("client abort counted as 502 %d / worker errors %d / aborted %d", p.srv.Counters().BadGateway.Load(), w.Errors, p.srv.Counters().ClientAborted.Load())
	}
}

// HTTP/1.0 clients are never sent a 1xx (RFC 9110 §15.2).
func TestHTTP10NoContinue(t *testing.T) {
	be := rawBackend(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		if req.Header.Get("Expect") != "" {
			io.WriteString(c, "HTTP/1.1 100 Continue\r\n\r\n")
		}
		io.Copy(io.Discard, req.Body)
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
	})
	p := startProxy(t, []string{be}, nil)
	c, br := p.dial()
	io.WriteString(c, "POST /x HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\nhello")
	line, err := br.ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "HTTP/1.1 200") {
		t.Fatalf("first line %q (%v), want the final 200", line, err)
	}
}

// A pooled connection keeps no expired deadline: with a short response
// timeout, the next request still reuses it.
func TestPooledConnKeepsNoDeadline(t *testing.T) {
	be, accepts := okBackend(t)
	p := startProxy(t, []string{be}, func(cfg *Config) { cfg.ResponseTimeout = 200 * time.Millisecond })
	for i := 0; i < 2; i++ {
		if resp, _ := p.roundTrip("GET / HTTP/1.1\r\nHost: a\r\n\r\n"); resp.StatusCode != 200 {
			t.Fatalf("request %d: %d", i, resp.StatusCode)
		}
		time.Sleep(400 * time.Millisecond)
	}
	if r := p.table.Get(0).Pool.Retries(upstream.RetryDeadPooled); r != 0 || accepts.Load() != 1 {
		t.Fatalf("dead-pooled %d, backend connections %d: a healthy connection was discarded", r, accepts.Load())
	}
}

// A client connection that closes (HTTP/1.0, Connection: close) does not
// cost its clean upstream connection.
func TestUpstreamPooledWhenClientCloses(t *testing.T) {
	be, accepts := okBackend(t)
	p := startProxy(t, []string{be}, nil)
	for _, raw := range []string{
		"GET / HTTP/1.0\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
		"GET / HTTP/1.0\r\n\r\n",
	} {
		if resp, _ := p.roundTrip(raw); resp.StatusCode != 200 {
			t.Fatalf("%q: %d", raw, resp.StatusCode)
		}
		// The client may read the response before tetherd hands the
		// upstream connection back: wait for it, bounded.
		pool := p.table.Get(0).Pool
		testenv.WaitFor(t, "the upstream connection idle again", func() bool {
			return int64(pool.Idle())+p.srv.Counters().UpstreamIdle.Load() == 1
		})
	}
	if n := accepts.Load(); n != 1 {
		t.Fatalf("backend saw %d connections for 3 sequential requests, want 1 (pooled)", n)
	}
}

// Idle keep-alive connections hold no 16 KiB buffer: one is taken when a
// request's bytes arrive and given back when nothing is left buffered.
func TestIdleConnectionsHoldNoBuffer(t *testing.T) {
	be, _ := okBackend(t)
	p := startProxy(t, []string{be}, nil)
	before := p.srv.Counters().Buffers.Load()
	const n = 50
	for i := 0; i < n; i++ {
		c, br := p.dial()
		io.WriteString(c, "GET / HTTP/1.1\r\nHost: a\r\n\r\n")
		if resp, body := readResp(t, br, false); resp.StatusCode != 200 || body != "ok" {
			t.Fatalf("request %d: %d %q", i, resp.StatusCode, body)
		}
		// c stays open and idle (closed at cleanup)
	}
	testenv.WaitFor(t, fmt.Sprintf("%d idle keep-alive connections to hold no buffer", n), func() bool {
		return p.srv.Counters().Buffers.Load() == before
	})
}
