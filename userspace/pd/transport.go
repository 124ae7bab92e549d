package pd

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"sync"
	"syscall"
	"time"
)

// legTransport is the legs' default transport: HTTP/1.1 over pooled
// keep-alive connections, each exchange run in the caller's goroutine.
// net/http's Transport runs two goroutines per connection and hands every
// request and answer between them and the caller (in profiles of tetherd
// under P/D load, those handovers and the scheduler's work for them were
// the largest cost after the system calls); the framing is still
// net/http's (Request.Write, ReadResponse). Cancelling a request's context
// closes its connection, which is how vLLM aborts. A pooled connection
// the engine closed while it idled is found before reuse (a peek that
// must find nothing to read) and dropped; a request is never sent twice.
// URLs other than http go to the fallback (net/http's Transport).
type legTransport struct {
	dial     func(ctx context.Context, network, addr string) (net.Conn, error)
	fallback *http.Transport
	maxIdle  int // per host

	mu   sync.Mutex
	idle map[string][]*legConn
}

func newLegTransport() *legTransport {
	return &legTransport{
		dial:     (&net.Dialer{Timeout: 2 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		fallback: NewTransport(),
		maxIdle:  256,
		idle:     map[string][]*legConn{},
	}
}

// legConn is one connection to an engine.
type legConn struct {
	c   net.Conn
	br  *bufio.Reader
	bw  *bufio.Writer
	key string
}

// CloseIdleConnections closes the pooled connections.
func (t *legTransport) CloseIdleConnections() {
	t.mu.Lock()
	idle := t.idle
	t.idle = map[string][]*legConn{}
	t.mu.Unlock()
	for _, l := range idle {
		for _, c := range l {
			c.c.Close()
		}
	}
	t.fallback.CloseIdleConnections()
}

// get returns a pooled connection to key that is still open, or a new one.
func (t *legTransport) get(ctx context.Context, key string) (*legConn, error) {
	for {
		t.mu.Lock()
		l := t.idle[key]
		if len(l) == 0 {
			t.mu.Unlock()
			break
		}
		c := l[len(l)-1]
		l[len(l)-1] = nil
		t.idle[key] = l[:len(l)-1]
		t.mu.Unlock()
		if c.br.Buffered() == 0 && idleOpen(c.c) {
			return c, nil
		}
		c.c.Close()
	}
	nc, err := t.dial(ctx, "tcp", key)
	if err != nil {
		return nil, err
	}
	return &legConn{c: nc, br: bufio.NewReaderSize(nc, 4<<10), bw: bufio.NewWriterSize(nc, 4<<10), key: key}, nil
}

// put pools c, or closes it when the pool is full.
func (t *legTransport) put(c *legConn) {
	t.mu.Lock()
	if l := t.idle[c.key]; len(l) < t.maxIdle {
		t.idle[c.key] = append(l, c)
		t.mu.Unlock()
		return
	}
	t.mu.Unlock()
	c.c.Close()
}

// idleOpen reports whether an idle connection is still usable: nothing to
// read on it (an engine's close, reset, or bytes it should not have sent
// make it unusable).
func idleOpen(c net.Conn) bool {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return true
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	open := false
	var b [1]byte
	err = rc.Read(func(fd uintptr) bool {
		n, _, err := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		open = n < 0 && (err == syscall.EAGAIN || err == syscall.EWOULDBLOCK)
		return true
	})
	return err == nil && open
}

// RoundTrip sends req and reads its answer's head on a connection of its
// own; the answer's body gives the connection back once read to its end
// (closed before: the connection is closed).
func (t *legTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Scheme != "http" {
		return t.fallback.RoundTrip(req)
	}
	ctx := req.Context()
	key := req.URL.Host
	if req.URL.Port() == "" {
		key = net.JoinHostPort(req.URL.Hostname(), "80")
	}
	c, err := t.get(ctx, key)
	if err != nil {
		closeBody(req)
		return nil, err
	}
	stop := context.AfterFunc(ctx, func() { c.c.Close() })
	fail := func(err error) (*http.Response, error) {
		stop()
		c.c.Close()
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		return nil, err
	}
	if err := req.Write(c.bw); err != nil {
		return fail(err)
	}
	if err := c.bw.Flush(); err != nil {
		return fail(err)
	}
	var resp *http.Response
	for {
		resp, err = http.ReadResponse(c.br, req)
		if err != nil {
			return fail(err)
		}
		if resp.StatusCode >= 200 || resp.StatusCode == http.StatusSwitchingProtocols {
			break
		}
		resp.Body.Close() // 1xx: the answer follows
	}
	resp.Body = &legBody{rc: resp.Body, t: t, c: c, stop: stop, keep: !resp.Close && !req.Close}
	return resp, nil
}

func closeBody(req *http.Request) {
	if req.Body != nil {
		req.Body.Close()
	}
}

// legBody is an answer's body: read to its end, it gives its connection
// back to the pool. Close may come while a Read waits (it closes the
// connection, which ends the Read).
type legBody struct {
	rc   io.ReadCloser
	t    *legTransport
	c    *legConn
	stop func() bool
	keep bool
	mu   sync.Mutex
	err  error // the body's end: io.EOF, the error that ended it, errBodyClosed
}

var errBodyClosed = errors.New("pd: read on a closed answer body")

func (b *legBody) Read(p []byte) (int, error) {
	b.mu.Lock()
	err := b.err
	b.mu.Unlock()
	if err != nil {
		return 0, err
	}
	n, err := b.rc.Read(p)
	if err == nil {
		return n, nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.err != nil {
		return n, b.err // closed meanwhile
	}
	b.err = err
	// Pooled only at the end of an answer the engine keeps the
	// connection open after, and if the cancel has not fired (it closes
	// the connection).
	if b.stop() && err == io.EOF && b.keep {
		b.t.put(b.c)
	} else {
		b.c.c.Close()
	}
	b.c = nil
	return n, err
}

func (b *legBody) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.err == nil {
		b.err = errBodyClosed
		b.stop()
		b.c.c.Close()
		b.c = nil
	}
	return nil
}
