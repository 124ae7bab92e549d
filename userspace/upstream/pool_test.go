package upstream

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/sysconn"
)

// backend accepts connections and hands them to fn; it counts accepts.
func backend(t *testing.T, fn func(net.Conn)) (string, *atomic.Int64) {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	var n atomic.Int64
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			n.Add(1)
			go fn(c)
		}
	}()
	return ln.Addr().String(), &n
}

func hold(c net.Conn) { io.Copy(io.Discard, c); c.Close() }

// peekState peeks at c's socket as the pool does at reuse.
func peekState(c *Conn) (s sysconn.PeekState) {
	c.raw.Read(func(fd uintptr) bool { s = sysconn.Peek(fd); return true })
	return s
}

func TestReuseAndLIFO(t *testing.T) {
	addr, _ := backend(t, hold)
	w := new(stats.Worker)
	p := New(addr, w, Options{})
	defer p.Close()
	a, err := p.Get(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	b, _ := p.Get(context.Background())
	if a.Reused() || b.Reused() {
		t.Fatal("fresh connections report reused")
	}
	p.Put(a)
	p.Put(b)
	c, _ := p.Get(context.Background())
	if c != b || !c.Reused() {
		t.Fatal("pool is not LIFO or Reused is wrong")
	}
	if w.Load().Conns != 2 {
		t.Fatalf("conns %d, want 2", w.Load().Conns)
	}
	c.Discard()
	if w.Load().Conns != 1 {
		t.Fatalf("conns after discard %d", w.Load().Conns)
	}
}

func TestDeadPooledConnectionIsReplaced(t *testing.T) {
	closeNow := make(chan net.Conn, 4)
	addr, _ := backend(t, func(c net.Conn) { closeNow <- c })
	w := new(stats.Worker)
	p := New(addr, w, Options{})
	defer p.Close()
	a, err := p.Get(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	p.Put(a)
	(<-closeNow).Close() // the backend closes the idle connection
	testenv.WaitFor(t, "the backend's close to reach the pooled connection", func() bool { return peekState(a) == sysconn.PeekClosed })
	b, err := p.Get(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if b == a || b.Reused() {
		t.Fatal("dead pooled connection was handed out")
	}
	if p.Retries(RetryDeadPooled) != 1 {
		t.Fatalf("dead-pooled retries %d, want 1", p.Retries(RetryDeadPooled))
	}
	select {
	case c := <-closeNow: // the replacement is a new connection
		c.Close()
	case <-time.After(2 * time.Second):
		t.Fatal("no new connection replaced the dead one")
	}
	b.Discard()
}

func TestUnsolicitedBytesDiscard(t *testing.T) {
	addr, _ := backend(t, func(c net.Conn) { c.Write([]byte("HTTP/1.1 200 OK\r\n")); hold(c) })
	p := New(addr, new(stats.Worker), Options{})
	defer p.Close()
	a, _ := p.Get(context.Background())
	testenv.WaitFor(t, "the unsolicited bytes to arrive", func() bool { return peekState(a) == sysconn.PeekData })
	p.Put(a)
	b, err := p.Get(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if b == a {
		t.Fatal("connection with unsolicited bytes was reused")
	}
	b.Discard()
}

func TestIdleLimitAndTimeout(t *testing.T) {
	addr, _ := backend(t, hold)
	w := new(stats.Worker)
	p := New(addr, w, Options{MaxIdle: 2, IdleTimeout: 100 * time.Millisecond})
	defer p.Close()
	var cs []*Conn
	for i := 0; i < 3; i++ {
		c, err := p.Get(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		cs = append(cs, c)
	}
	for _, c := range cs {
		p.Put(c)
	}
	if p.Idle() != 2 || w.Load().Conns != 2 {
		t.Fatalf("idle %d conns %d, want 2 (oldest evicted)", p.Idle(), w.Load().Conns)
	}
	// Taken off the idle list, then closed and counted: wait for both.
	testenv.WaitFor(t, "the idle timeout to close the idle connections", func() bool { return p.Idle() == 0 && w.Load().Conns == 0 })
}

func TestConnectRetriedOnce(t *testing.T) {
	ln, _ := net.Listen("tcp4", "127.0.0.1:0")
	addr := ln.Addr().String()
	ln.Close()
	w := new(stats.Worker)
	p := New(addr, w, Options{DialTimeout: time.Second})
	defer p.Close()
	if _, err := p.Get(context.Background()); err == nil {
		t.Fatal("connect to a closed port succeeded")
	}
	if p.Retries(RetryConnect) != 1 || w.Load().Retries != 1 {
		t.Fatalf("connect retries %d (worker %d), want exactly 1", p.Retries(RetryConnect), w.Load().Retries)
	}
}

func TestPeek(t *testing.T) {
	closeIt := make(chan struct{})
	addr, _ := backend(t, func(c net.Conn) {
		c.Write([]byte("x"))
		<-closeIt
		c.Close()
	})
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	raw, _ := c.(*net.TCPConn).SyscallConn()
	peek := func() (s sysconn.PeekState) {
		raw.Read(func(fd uintptr) bool { s = sysconn.Peek(fd); return true })
		return s
	}
	// Before the byte arrives the socket is quiet (PeekEmpty); once it
	// has, PeekData, until it is read.
	testenv.WaitFor(t, "a peek to see the waiting byte", func() bool { return peek() == sysconn.PeekData })
	var b [1]byte
	c.Read(b[:])
	if s := peek(); s != sysconn.PeekEmpty {
		t.Fatalf("peek on a quiet socket = %v", s)
	}
	close(closeIt)
	testenv.WaitFor(t, "a peek to see the peer's close", func() bool { return peek() == sysconn.PeekClosed })
}

// A connect that fails because this process is out of descriptors is not
// the worker's failure: no connect retry is counted (passive health checks
// read that count), it is not tried again, and the error says ErrLocal.
// (Counted, a descriptor shortage would make every worker look unhealthy
// at once.)
func TestOutOfDescriptorsNotTheWorkers(t *testing.T) {
	addr, _ := backend(t, func(c net.Conn) { c.Close() })
	p := New(addr, stats.NewHeap().Worker(0), Options{})
	defer p.Close()
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	// The limit bounds descriptor numbers: below the lowest free one,
	// every number is taken, so the next socket() fails.
	free := 0
	for ; free < 1<<16; free++ {
		if _, err := os.Lstat(fmt.Sprintf("/proc/self/fd/%d", free)); err != nil {
			break
		}
	}
	low := lim
	low.Cur = uint64(free)
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &low); err != nil {
		t.Fatal(err)
	}
	before := LocalFailures.Load()
	_, err := p.Get(context.Background())
	syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim)
	if !errors.Is(err, ErrLocal) || !errors.Is(err, syscall.EMFILE) {
		t.Fatalf("connect without descriptors: %v, want ErrLocal (EMFILE)", err)
	}
	if n := p.Retries(RetryConnect); n != 0 {
		t.Fatalf("%d connect failures counted against the worker", n)
	}
	if LocalFailures.Load() != before+1 {
		t.Fatalf("local failures %d -> %d, want one, not retried", before, LocalFailures.Load())
	}
	c, err := p.Get(context.Background())
	if err != nil {
		t.Fatalf("after the shortage: %v", err)
	}
	c.Discard()
}
