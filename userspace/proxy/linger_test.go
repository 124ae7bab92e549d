package proxy

import (
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The lingering close's decisions, which both paths follow (linger.go):
// the budget, what each read's result leads to, and when it is over.
func TestLingering(t *testing.T) {
	var g lingering
	if g.on() {
		t.Fatal("the zero lingering is on")
	}
	cfg := Config{}
	cfg.Waits.Linger = 123 * time.Millisecond
	if d := g.begin(&cfg); d != cfg.Waits.Linger {
		t.Fatalf("begin: %v, want Waits.Linger (%v)", d, cfg.Waits.Linger)
	}
	if !g.on() {
		t.Fatal("not on after begin")
	}
	steps := []struct {
		n    int
		err  error
		want lingerNext
	}{
		{lingerChunk, nil, lingerAgain},
		{-1, unix.EINTR, lingerAgain},
		{-1, unix.EAGAIN, lingerWait},
		{100, nil, lingerAgain},
	}
	for i, s := range steps {
		if got := g.read(s.n, s.err); got != s.want {
			t.Fatalf("read %d (%d, %v): %d, want %d", i, s.n, s.err, got, s.want)
		}
	}
	if g.left != lingerBytes-lingerChunk-100 {
		t.Fatalf("budget left %d, want %d (only bytes read count)", g.left, lingerBytes-lingerChunk-100)
	}
	// The budget: reading up to it goes on, the read that spends it closes.
	for g.left > lingerChunk {
		if got := g.read(lingerChunk, nil); got != lingerAgain {
			t.Fatalf("read with %d left: %d, want again", g.left, got)
		}
	}
	if got := g.read(int(g.left), nil); got != lingerDone || g.on() {
		t.Fatalf("the read that spends the budget: %d on=%v, want done and off", got, g.on())
	}

	// Every other end closes: the client's end (a system call's 0 bytes,
	// a net.Conn's io.EOF, with bytes or without), an error, the read
	// deadline.
	for _, end := range []struct {
		n   int
		err error
	}{
		{0, nil},
		{0, io.EOF},
		{10, io.EOF},
		{-1, unix.ECONNRESET},
		{0, os.ErrDeadlineExceeded},
	} {
		g.begin(&cfg)
		if got := g.read(end.n, end.err); got != lingerDone {
			t.Fatalf("read (%d, %v): %d, want done", end.n, end.err, got)
		}
	}
}

// A worker that resets the connection while the request body is still
// going up: tetherd's 502 (sent) reaches the client, and then the end of
// the connection as a FIN, never a reset over the answer, since the
// client connection lingers over the body bytes it did not read. On the
// loop (a Content-Length body, spliced up) and on a goroutine (a chunked
// body, which the loop hands over) alike. The client sends a first part,
// waits for the reset, then sends more than one read of tetherd's takes:
// that read's write up fails, and the rest is unread when tetherd answers.
func TestGatewayFailureLingersOverBody(t *testing.T) {
	const part1, part2 = 64 << 10, 192 << 10
	for _, tc := range []struct{ name, head string }{
		{"loop", "POST /up HTTP/1.1\r\nHost: a\r\nContent-Length: 8388608\r\n\r\n"},
		{"goroutine", "POST /up HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n40000\r\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reset := make(chan struct{})
			be := newBackend(t, func(c *bconn) {
				if _, err := readHeadFrom(c.br); err != nil {
					return
				}
				io.ReadFull(c.br, make([]byte, 16<<10)) // some of the body, then a reset
				c.SetLinger(0)
				c.Close()
				close(reset)
			})
			p := startProxy(t, []string{be.addr}, func(c *Config) {
				c.Waits.Linger = 10 * time.Second // ended by the client's FIN below, not by the clock
			})
			c, br := p.dial()
			wrote := make(chan error, 1)
			go func() {
				if _, err := io.WriteString(c, tc.head+strings.Repeat("x", part1)); err != nil {
					wrote <- err
					return
				}
				<-reset
				_, err := io.WriteString(c, strings.Repeat("y", part2)) // then the client waits: the rest never comes
				wrote <- err
			}()
			resp, body := readResp(t, br, false)
			if resp.StatusCode != 502 || resp.Header.Get("X-Tether-Upstream-State") != "sent" || body != sentError(502) {
				t.Fatalf("got %d %v %q, want the 502 (sent)", resp.StatusCode, resp.Header, body)
			}
			if err := <-wrote; err != nil {
				t.Fatalf("the client's body: %v, want taken (drained), not reset", err)
			}
			c.(*net.TCPConn).CloseWrite() // the client gives up its body: the lingering ends
			expectClosed(t, c, br)        // EOF: a reset fails this
		})
	}
}
