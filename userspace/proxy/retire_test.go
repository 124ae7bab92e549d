package proxy

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
)

// A process that hands its clients to a successor (ShutdownGently with
// KeepIdle) closes no idle keep-alive connection on its own account: a
// client that pauses and then sends on its pooled connection, on the
// loop's path and on a goroutine's, is answered (with Connection: close),
// and the shutdown returns once the clients' connections ended.
func TestRetireKeepsIdleConnections(t *testing.T) {
	// ParkAfter -1: a connection a goroutine served stays with it, idle;
	// 300 ms: it goes back to the loop after a while, retiring or not.
	for name, park := range map[string]time.Duration{"park-never": -1, "park-after-300ms": 300 * time.Millisecond} {
		t.Run(name, func(t *testing.T) { retireKeepsIdle(t, park) })
	}
}

func retireBackend(t *testing.T) string {
	return httpBackend(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		io.WriteString(w, "ok")
	}))
}

// retireGently starts ShutdownGently(KeepIdle) and returns once the
// listener is closed (the server is retiring), with the channel of its
// result.
func retireGently(t *testing.T, p *testProxy) chan error {
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		done <- p.srv.ShutdownGently(ctx, KeepIdle)
	}()
	testenv.WaitFor(t, "the listener closed", func() bool {
		c, err := net.DialTimeout("tcp", p.addr(), time.Second)
		if err == nil {
			c.Close()
		}
		return err != nil
	})
	return done
}

func retireKeepsIdle(t *testing.T, park time.Duration) {
	p := startProxy(t, []string{retireBackend(t)}, func(c *Config) { c.IdleTimeout = time.Minute; c.ParkAfter = park })
	loopConn, loopBR := p.dial()
	io.WriteString(loopConn, "GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
	if resp, body := readResp(t, loopBR, false); resp.StatusCode != 200 || body != "ok" || resp.Close {
		t.Fatalf("before: %d %q close=%v", resp.StatusCode, body, resp.Close)
	}
	// A chunked body is served on a goroutine (loop.fast).
	gorConn, gorBR := p.dial()
	io.WriteString(gorConn, "POST /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n")
	if resp, body := readResp(t, gorBR, false); resp.StatusCode != 200 || body != "ok" || resp.Close {
		t.Fatalf("before, goroutine: %d %q close=%v", resp.StatusCode, body, resp.Close)
	}
	testenv.WaitFor(t, "the loop's connection parked", func() bool { return p.srv.Counters().Parked.Load() >= 1 })
	done := retireGently(t, p)
	// The clients' pause between two requests (the workload: longer than
	// the 1 s an idle connection was given before).
	time.Sleep(1500 * time.Millisecond)
	for name, cc := range map[string]struct {
		c   net.Conn
		req string
	}{
		"loop":      {loopConn, "GET /a2 HTTP/1.1\r\nHost: x\r\n\r\n"},
		"goroutine": {gorConn, "POST /b2 HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n"},
	} {
		if _, err := io.WriteString(cc.c, cc.req); err != nil {
			t.Fatalf("%s: write on the pooled connection: %v", name, err)
		}
	}
	for name, br := range map[string]*bufio.Reader{"loop": loopBR, "goroutine": gorBR} {
		resp, body := readResp(t, br, false)
		if resp.StatusCode != 200 || body != "ok" || !resp.Close {
			t.Fatalf("%s: request on a pooled connection while retiring: %d %q close=%v, want 200 \"ok\" with Connection: close", name, resp.StatusCode, body, resp.Close)
		}
		if _, err := br.ReadByte(); err != io.EOF {
			t.Fatalf("%s: after the Connection: close answer: %v, want EOF", name, err)
		}
	}
	if err := <-done; err != nil {
		t.Fatalf("shutdown: %v", err)
	}
}

// What bounds a retiring process: a connection left idle closes at the
// idle timeout, never before, and then the shutdown returns.
func TestRetireClosesAtIdleTimeout(t *testing.T) {
	const idle = 2 * time.Second
	p := startProxy(t, []string{retireBackend(t)}, func(c *Config) { c.IdleTimeout = idle })
	c, br := p.dial()
	sent := time.Now() // before the connection went idle
	io.WriteString(c, "GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
	readResp(t, br, false)
	done := retireGently(t, p)
	c.SetReadDeadline(time.Now().Add(time.Minute))
	if _, err := br.ReadByte(); err != io.EOF {
		t.Fatalf("idle connection: %v, want EOF at the idle timeout", err)
	}
	if d := time.Since(sent); d < idle {
		t.Fatalf("closed %v after its last request, before the idle timeout (%v)", d, idle)
	}
	if err := <-done; err != nil {
		t.Fatalf("shutdown: %v", err)
	}
}

// hasPending sees bytes waiting without taking them, and nothing in an
// empty queue or at the peer's FIN.
func TestHasPending(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	cl, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	sc, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer sc.Close()
	raw, _ := sc.(*net.TCPConn).SyscallConn()
	pending := func() (p bool) {
		raw.Control(func(fd uintptr) { p = hasPending(int(fd)) })
		return
	}
	if pending() {
		t.Fatal("pending on an empty connection")
	}
	io.WriteString(cl, "GET / HTTP/1.1\r\n")
	testenv.WaitFor(t, "the bytes pending", pending)
	if !pending() {
		t.Fatal("peeking took the bytes")
	}
	b := make([]byte, 64)
	n, _ := sc.Read(b)
	if !strings.HasPrefix(string(b[:n]), "GET") {
		t.Fatalf("read %q after peeking", b[:n])
	}
	cl.Close()
	sc.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := sc.Read(b); err != io.EOF {
		t.Fatalf("after the FIN: %v", err)
	}
	if pending() {
		t.Fatal("pending at EOF")
	}
}
