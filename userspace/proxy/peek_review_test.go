package proxy

import (
	"bytes"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
)

// A worker that answers before it takes a body the router read further
// (a 413 and a close) makes the write of the buffered body fail: the
// client gets that answer, as it does when the body is spliced
// (TestEarlyAnswerDuringUpload), not a 502; on both drivers, and with
// the router declining as the control.
func TestPeekMoreEarlyAnswer(t *testing.T) {
	testenv.CheckLeaks(t)
	const n = 8 << 20
	for _, upTo := range []int{0, n} {
		for _, gor := range []bool{false, true} {
			t.Run(fmt.Sprintf("upTo=%d/goroutines=%v", upTo, gor), func(t *testing.T) {
				be := newBackend(t, func(c *bconn) {
					if _, err := readHeadFrom(c.br); err != nil {
						return
					}
					io.WriteString(c, "HTTP/1.1 413 Content Too Large\r\nConnection: close\r\nContent-Length: 8\r\n\r\ntoo big\n")
					// returns: closed with the body unread, so the kernel resets
				})
				body := bytes.Repeat([]byte("x"), n)
				r := &moreRouter{upTo: upTo, body: body, seen: make(chan int, 4)}
				p := startProxyOn(t, []string{be.addr}, func(c *Config) {
					c.PeekBody, c.PeekMax = 4096, n
					r.inner = c.Router
					c.Router = r
				}, gor)
				c, br := p.dial()
				go func() {
					fmt.Fprintf(c, "POST /up HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n", n)
					c.Write(body)
				}()
				resp, got := readResp(t, br, false)
				if resp.StatusCode != 413 || got != "too big\n" || !resp.Close {
					t.Fatalf("client got %d close=%v %q, the backend answered 413", resp.StatusCode, resp.Close, got)
				}
				expectClosed(t, c, br)
				if seen := <-r.seen; upTo > 0 && seen != n {
					t.Fatalf("the decision saw %d body bytes, want %d", seen, n)
				}
				if k := p.srv.Counters().BadGateway.Load(); k != 0 {
					t.Fatalf("%d 502s counted for a backend that answered", k)
				}
				cs := p.srv.Counters()
				testenv.WaitFor(t, "the buffers back", func() bool { return cs.LargeBytes.Load() == 0 && cs.Buffers.Load() == 0 })
			})
		}
	}
}

// A worker that answers before it takes a body the router read further
// and then keeps its connection open without reading: the answer is
// relayed as during an upload (the loop: exchangeEvent's early answer),
// not a timeout after --io-timeout.
func TestPeekMoreEarlyAnswerKeptOpen(t *testing.T) {
	testenv.CheckLeaks(t)
	const n = 8 << 20
	for _, upTo := range []int{0, n} {
		for _, gor := range []bool{false, true} {
			t.Run(fmt.Sprintf("upTo=%d/goroutines=%v", upTo, gor), func(t *testing.T) {
				done := make(chan struct{})
				defer close(done)
				be := newBackend(t, func(c *bconn) {
					if _, err := readHeadFrom(c.br); err != nil {
						return
					}
					io.WriteString(c, "HTTP/1.1 413 Content Too Large\r\nContent-Length: 8\r\n\r\ntoo big\n")
					<-done // the body never read
				})
				body := bytes.Repeat([]byte("x"), n)
				r := &moreRouter{upTo: upTo, body: body, seen: make(chan int, 4)}
				p := startProxyOn(t, []string{be.addr}, func(c *Config) {
					c.PeekBody, c.PeekMax = 4096, n
					c.IOTimeout = 2 * time.Second
					r.inner = c.Router
					c.Router = r
				}, gor)
				c, br := p.dial()
				go func() {
					fmt.Fprintf(c, "POST /up HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n", n)
					c.Write(body)
				}()
				resp, got := readResp(t, br, false)
				if resp.StatusCode != 413 || got != "too big\n" {
					t.Fatalf("client got %d %q, the backend answered 413", resp.StatusCode, got)
				}
			})
		}
	}
}
