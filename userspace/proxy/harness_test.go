package proxy

import (
	"bufio"
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/upstream"
	"github.com/tether-rl/tether/userspace/worker"
)

// testProxy is a proxy on loopback in front of the given backend addresses.
type testProxy struct {
	t      testing.TB
	srv    *Server
	ln     net.Listener
	table  *worker.Table
	router *route.Router
	stats  *stats.Table
}

func (p *testProxy) addr() string { return p.ln.Addr().String() }

func startProxy(t testing.TB, backends []string, tweak func(*Config)) *testProxy {
	t.Helper()
	return startProxyOn(t, backends, tweak, false)
}

// startProxyOn is startProxy; goroutines: its listener has no event loop
// (not a *net.TCPListener), every connection is served the goroutine way.
func startProxyOn(t testing.TB, backends []string, tweak func(*Config), goroutines bool) *testProxy {
	t.Helper()
	tab := worker.NewTable()
	st := stats.NewHeap()
	for i, a := range backends {
		tab.Put(&worker.Worker{Slot: i, URL: "http://" + a, Addr: a, Stats: st.Worker(i),
			Pool: upstream.New(a, st.Worker(i), upstream.Options{})})
	}
	rt := &route.Router{Table: tab}
	cfg := Config{Router: rt, Table: tab, InstanceID: "test", Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if tweak != nil {
		tweak(&cfg)
	}
	lc := net.ListenConfig{}
	lc.SetMultipathTCP(false)
	ln, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := New(cfg)
	done := make(chan struct{})
	served := ln
	if goroutines {
		served = struct{ net.Listener }{ln}
	}
	go func() { srv.Serve(served, st.Slot(0)); close(done) }()
	t.Cleanup(func() {
		srv.Close()
		<-done
		for _, w := range tab.Snapshot() {
			if w != nil {
				w.Pool.Close()
			}
		}
	})
	return &testProxy{t: t, srv: srv, ln: ln, table: tab, router: rt, stats: st}
}

// rawBackend is a TCP server whose connections are handled by fn.
func rawBackend(t testing.TB, fn func(c net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { defer c.Close(); fn(c) }()
		}
	}()
	return ln.Addr().String()
}

// httpBackend is a net/http server.
func httpBackend(t *testing.T, h http.Handler) string {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &http.Server{Handler: h}
	go s.Serve(ln)
	t.Cleanup(func() { s.Close() })
	return ln.Addr().String()
}

// dial opens a raw client connection to the proxy.
func (p *testProxy) dial() (net.Conn, *bufio.Reader) {
	p.t.Helper()
	c, err := net.Dial("tcp", p.addr())
	if err != nil {
		p.t.Fatal(err)
	}
	p.t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(20 * time.Second))
	return c, bufio.NewReader(c)
}

// roundTrip sends raw and reads one response.
func (p *testProxy) roundTrip(raw string) (*http.Response, string) {
	p.t.Helper()
	c, br := p.dial()
	if _, err := io.WriteString(c, raw); err != nil {
		p.t.Fatal(err)
	}
	return readResp(p.t, br, strings.HasPrefix(raw, "HEAD "))
}

func readResp(t testing.TB, br *bufio.Reader, head bool) (*http.Response, string) {
	t.Helper()
	method := "GET"
	if head {
		method = "HEAD"
	}
	resp, err := http.ReadResponse(br, &http.Request{Method: method})
	if err != nil {
		t.Fatalf("read response: %v", err)
	}
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("read body: %v", err)
	}
	return resp, string(b)
}
