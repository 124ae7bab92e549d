package proxy

// A client that leaves mid-exchange: the upstream closes at once, and the
// worker is not blamed.

import (
	"bufio"
	"io"
	"net"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
)

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
		// Promptly, not at some later deadline: the watch sees the close.
		// (Bounded loosely: software-emulated kernels are slow.)
		if d := at.Sub(left); d > 4*time.Second {
			t.Fatalf("upstream closed %v after the client left", d)
		}
	case <-time.After(8 * time.Second):
		t.Fatal("upstream never closed after the client left")
	}
	ctr := p.srv.Counters()
	testenv.WaitFor(t, "the exchange's end to be counted", func() bool { return ctr.ClientAborted.Load()+ctr.BadGateway.Load() > 0 })
	w := p.stats.Worker(0).Load()
	if p.srv.Counters().BadGateway.Load() != 0 || w.Errors != 0 || p.srv.Counters().ClientAborted.Load() != 1 {
		t.Fatalf("client abort counted as 502 %d / worker errors %d / aborted %d", p.srv.Counters().BadGateway.Load(), w.Errors, p.srv.Counters().ClientAborted.Load())
	}
}
