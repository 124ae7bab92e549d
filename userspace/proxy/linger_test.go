package proxy

import (
	"io"
	"os"
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
