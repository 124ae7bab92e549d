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
)

// An HTTP/2 client with prior knowledge is told, in HTTP/2, to use
// HTTP/1.1 (SETTINGS, then GOAWAY HTTP_1_1_REQUIRED), not dropped.
func TestHTTP2PriorKnowledgeRefused(t *testing.T) {
	p := startProxy(t, nil, nil)
	c, br := p.dial()
	defer c.Close()
	c.Write([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00"))
	got, _ := io.ReadAll(br)
	if len(got) < 9+17 || got[3] != 0x4 || got[9+3] != 0x7 {
		t.Fatalf("answer %x", got)
	}
	if code := got[9+9+4 : 9+9+8]; string(code) != "\x00\x00\x00\x0d" {
		t.Fatalf("GOAWAY error code %x, want HTTP_1_1_REQUIRED", code)
	}
	if !strings.Contains(string(got), "HTTP/1.1 only") {
		t.Errorf("no reason in %q", got)
	}
}

// tetherd's 502 says whether the request reached the worker: a refused
// connect is "not-sent" (safe to retry), a worker that died after taking
// the request is "sent".
func TestUpstreamStateHeader(t *testing.T) {
	ln, _ := net.Listen("tcp4", "127.0.0.1:0")
	refused := ln.Addr().String()
	ln.Close()
	dies := rawBackend(t, func(c net.Conn) {
		bufio.NewReader(c).ReadString('\n') // take the request, then die
	})
	for _, tc := range []struct {
		addr, want string
	}{{refused, "not-sent"}, {dies, "sent"}} {
		p := startProxy(t, []string{tc.addr}, nil)
		resp, body := p.roundTrip("POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
		if resp.StatusCode != 502 || resp.Header.Get(UpstreamStateHeader) != tc.want {
			t.Errorf("%s: %d %s=%q %s", tc.want, resp.StatusCode, UpstreamStateHeader, resp.Header.Get(UpstreamStateHeader), body)
		}
	}
}

// A streamed response whose worker goes silent (a stopped engine) is cut
// after StreamIdleTimeout, visibly (no last chunk), rather than holding
// its client for ResponseTimeout.
func TestStreamIdleTimeout(t *testing.T) {
	stall := make(chan struct{})
	defer close(stall)
	be := rawBackend(t, func(c net.Conn) {
		bufio.NewReader(c).ReadString('\n')
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
		io.WriteString(c, "6\r\ndata:1\r\n")
		<-stall // the engine stops sending
	})
	p := startProxy(t, []string{be}, func(c *Config) { c.StreamIdleTimeout = 200 * time.Millisecond })
	c, br := p.dial()
	defer c.Close()
	io.WriteString(c, "GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
	start := time.Now()
	c.SetReadDeadline(time.Now().Add(30 * time.Second))
	b, _ := io.ReadAll(br)
	if d := time.Since(start); d > 15*time.Second {
		t.Fatalf("the stalled stream held its client %v", d)
	}
	if !strings.Contains(string(b), "data:1") || strings.HasSuffix(string(b), "0\r\n\r\n") {
		t.Fatalf("client got %q: want the first event and a visible truncation", b)
	}
}

// MaxBodyBytes: a Content-Length above it is answered 413 before a byte
// is forwarded; a chunked body growing past it is cut with a 413; a body
// within it goes through.
func TestMaxBodyBytes(t *testing.T) {
	var got atomic.Int64 // requests the backend saw
	be := httpBackend(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got.Add(1)
		io.Copy(io.Discard, r.Body)
		io.WriteString(w, "ok")
	}))
	p := startProxy(t, []string{be}, func(c *Config) { c.MaxBodyBytes = 100 << 10 })
	resp, _ := p.roundTrip(fmt.Sprintf("POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n", 200<<10))
	if resp.StatusCode != 413 || got.Load() != 0 {
		t.Fatalf("Content-Length above the limit: %d, backend saw %d requests", resp.StatusCode, got.Load())
	}
	c, br := p.dial()
	defer c.Close()
	io.WriteString(c, "POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
	chunk := strings.Repeat("a", 32<<10)
	for i := 0; i < 8; i++ { // 256 KiB
		if _, err := fmt.Fprintf(c, "%x\r\n%s\r\n", len(chunk), chunk); err != nil {
			break // cut off
		}
	}
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, _ = readResp(t, br, false)
	if resp.StatusCode != 413 {
		t.Fatalf("chunked body past the limit: %d", resp.StatusCode)
	}
	small := strings.Repeat("b", 50<<10)
	resp, body := p.roundTrip(fmt.Sprintf("POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s", len(small), small))
	if resp.StatusCode != 200 || body != "ok" {
		t.Fatalf("a body within the limit: %d %q", resp.StatusCode, body)
	}
}
