package proxy

// Keep-alive on both sides: upstream connections pooled across requests
// and clients, idle client connections that hold nothing.

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
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

// A pooled connection keeps no expired deadline: with a short response
// timeout, the next request still reuses it.
func TestPooledConnKeepsNoDeadline(t *testing.T) {
	be, accepts := okBackend(t)
	p := startProxy(t, []string{be}, func(cfg *Config) { cfg.ResponseTimeout = 200 * time.Millisecond })
	for i := 0; i < 2; i++ {
		if resp, _ := p.roundTrip("GET / HTTP/1.1\r\nHost: a\r\n\r\n"); resp.StatusCode != 200 {
			t.Fatalf("request %d: %d", i, resp.StatusCode)
		}
		time.Sleep(400 * time.Millisecond) // idle past the response timeout
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
