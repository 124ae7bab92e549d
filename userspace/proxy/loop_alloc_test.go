//go:build !race

// (The race detector allocates.)

package proxy

import (
	"bytes"
	"net"
	"runtime"
	"testing"
)

// TestLoopRequestAllocatesNothing: a keep-alive request the loop proxies
// itself (no body, a Content-Length response) allocates nothing in the
// process once the loop's free lists are warm: client and worker here read
// and write fixed buffers, so every allocation counted is the proxy's.
func TestLoopRequestAllocatesNothing(t *testing.T) {
	resp := []byte("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
	bl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer bl.Close()
	go func() {
		for {
			c, err := bl.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				buf := make([]byte, 4096)
				have := 0
				for {
					n, err := c.Read(buf[have:])
					if err != nil {
						return
					}
					have += n
					for {
						i := bytes.Index(buf[:have], []byte("\r\n\r\n"))
						if i < 0 {
							break
						}
						have = copy(buf, buf[i+4:have])
						if _, err := c.Write(resp); err != nil {
							return
						}
					}
				}
			}()
		}
	}()
	p := startProxy(t, []string{bl.Addr().String()}, nil)
	c, err := net.Dial("tcp", p.addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	req := []byte("GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
	in := make([]byte, 4096)
	one := func() {
		if _, err := c.Write(req); err != nil {
			t.Fatal(err)
		}
		// The relayed head differs from the worker's (the proxy's headers):
		// read until the body's 5 bytes ended it.
		have := 0
		for {
			n, err := c.Read(in[have:])
			if err != nil {
				t.Fatal(err)
			}
			have += n
			if i := bytes.Index(in[:have], []byte("\r\n\r\n")); i >= 0 && have >= i+4+5 {
				if !bytes.HasSuffix(in[:have], []byte("hello")) {
					t.Fatalf("response %q", in[:have])
				}
				return
			}
		}
	}
	for range 200 {
		one()
	}
	const n = 2000
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for range n {
		one()
	}
	runtime.ReadMemStats(&after)
	per := float64(after.Mallocs-before.Mallocs) / n
	t.Logf("%.3f allocations per request", per)
	if per > 0.5 {
		t.Errorf("%.2f allocations per proxied request, want none", per)
	}
	if got := p.srv.counters.Handoffs.Load(); got != 0 {
		t.Errorf("%d requests handed to a goroutine: the loop did not serve them", got)
	}
}
