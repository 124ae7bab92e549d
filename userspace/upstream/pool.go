// Package upstream keeps the keep-alive connections to one backend worker:
// a LIFO pool of idle connections with a size limit and an idle timeout,
// checked for liveness before reuse, and dialing with one retry on a failed
// connect. It never retries a request: that decision belongs to the proxy,
// which knows whether a request byte went out.
package upstream

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/sysconn"
)

// Options configure a Pool. Zero values take the defaults.
type Options struct {
	MaxIdle     int           // idle connections kept; default 64
	IdleTimeout time.Duration // an idle connection older than this is closed; default 60s
	DialTimeout time.Duration // default 5s
}

func (o Options) withDefaults() Options {
	if o.MaxIdle <= 0 {
		o.MaxIdle = 64
	}
	if o.IdleTimeout <= 0 {
		o.IdleTimeout = 60 * time.Second
	}
	if o.DialTimeout <= 0 {
		o.DialTimeout = 5 * time.Second
	}
	return o
}

// Conn is one connection to the backend.
type Conn struct {
	*net.TCPConn
	raw   syscall.RawConn
	idle  time.Time // when it was put back
	pool  *Pool
	fresh bool // dialed for this request, never used before

	peekFn func(uintptr) bool
	peeked sysconn.PeekState

	// ReadFirst's state, its callback bound once.
	readFn func(uintptr) bool
	rp     []byte
	rn     int
	rerr   error
	rskip  bool
}

// Reused reports whether the connection served an earlier request.
func (c *Conn) Reused() bool { return !c.fresh }

// Retry reasons counted by the pool.
const (
	RetryConnect    = iota // a connect failed and was tried again
	RetryDeadPooled        // a pooled connection was found closed before use
	RetryReasons
)

// Pool is the connection pool of one backend.
type Pool struct {
	addr   string
	opts   Options
	stats  *stats.Worker
	dialer net.Dialer

	mu     sync.Mutex
	idle   Idle[*Conn]
	closed bool

	retries [RetryReasons]atomic.Uint64
	stop    chan struct{}
}

// ErrClosed is returned by Get after Close.
var ErrClosed = errors.New("upstream pool closed")

// ErrLocal wraps a connect that failed for want of this host's resources
// (descriptors, memory, ephemeral ports): the worker is not to blame, so
// it counts as no connect failure of the worker (passive health checks
// read those) and is not tried again at once.
var ErrLocal = errors.New("local resources exhausted")

// LocalFailures counts the connects that failed with ErrLocal, in every
// pool of the process.
var LocalFailures atomic.Uint64

// IdleConns counts the idle connections of every pool of the process:
// descriptors held for no request (the proxy's admission counts them
// against its connection cap).
var IdleConns atomic.Int64

// LocalShortage reports whether a dial error is this host's shortage:
// EMFILE / ENFILE (descriptors), ENOBUFS / ENOMEM, EADDRNOTAVAIL (no
// ephemeral port left). Such a failure says nothing about the worker.
func LocalShortage(err error) bool {
	for _, e := range []error{syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM, syscall.EADDRNOTAVAIL} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// New returns a pool dialing addr (host:port). Counters go to w.
func New(addr string, w *stats.Worker, opts Options) *Pool {
	opts = opts.withDefaults()
	p := &Pool{addr: addr, opts: opts, stats: w, stop: make(chan struct{})}
	p.dialer.Timeout = opts.DialTimeout
	p.dialer.SetMultipathTCP(false)
	go p.janitor()
	return p
}

// Addr is the backend address.
func (p *Pool) Addr() string { return p.addr }

// Retries returns how many retries of the given reason happened.
func (p *Pool) Retries(reason int) uint64 { return p.retries[reason].Load() }

// Get returns a live connection: an idle one that passed the liveness
// check, or a new one (a failed connect is tried once more).
func (p *Pool) Get(ctx context.Context) (*Conn, error) {
	for {
		c := p.pop()
		if c == nil {
			break
		}
		if c.alive() {
			return c, nil
		}
		p.retries[RetryDeadPooled].Add(1)
		p.stats.Retried()
		c.discard()
	}
	c, err := p.dial(ctx)
	if err == nil {
		return c, nil
	}
	reason, ok := Attempt{Local: ctx.Err() != nil || errors.Is(err, ErrLocal)}.Retry()
	if !ok {
		return nil, err // tetherd's own shortage: not the worker's failure
	}
	p.Retried(reason)
	return p.dial(ctx)
}

// Redial returns a new connection, for the one retry (Attempt.Retry) of a
// request whose connection failed before its first byte went up; reason
// is the one Retry gave.
func (p *Pool) Redial(ctx context.Context, reason int) (*Conn, error) {
	p.Retried(reason)
	return p.dial(ctx)
}

func (p *Pool) dial(ctx context.Context) (*Conn, error) {
	nc, err := p.dialer.DialContext(ctx, "tcp", p.addr)
	if err != nil {
		if LocalShortage(err) {
			LocalFailures.Add(1)
			return nil, fmt.Errorf("connect %s: %w: %w", p.addr, ErrLocal, err)
		}
		return nil, fmt.Errorf("connect %s: %w", p.addr, err)
	}
	tc := nc.(*net.TCPConn)
	raw, err := tc.SyscallConn()
	if err != nil {
		tc.Close()
		return nil, fmt.Errorf("connect %s: %w", p.addr, err)
	}
	p.stats.ConnOpened()
	c := &Conn{TCPConn: tc, raw: raw, pool: p, fresh: true}
	c.peekFn = c.peek
	return c, nil
}

func (p *Pool) pop() *Conn {
	p.mu.Lock()
	defer p.mu.Unlock()
	c, ok := p.idle.Pop()
	if !ok {
		return nil
	}
	IdleConns.Add(-1)
	return c
}

// Put returns a connection whose last exchange ended exactly at a message
// boundary. The caller must not use it afterwards.
func (p *Pool) Put(c *Conn) {
	// An expired deadline would make the next liveness check (and use)
	// fail on a healthy connection.
	c.SetDeadline(time.Time{})
	c.fresh = false
	c.idle = time.Now()
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		c.discard()
		return
	}
	evict, evicted := p.idle.Push(c, p.opts.MaxIdle)
	if !evicted {
		IdleConns.Add(1)
	}
	p.mu.Unlock()
	if evicted {
		evict.discard()
	}
}

// Discard closes a connection that must not be reused.
func (c *Conn) Discard() { c.discard() }

func (c *Conn) discard() {
	c.TCPConn.Close()
	c.pool.stats.ConnClosed()
}

// alive checks, without blocking or consuming, that the backend has not
// closed the connection (EOF), reset it, or sent unsolicited bytes.
//
// The check is made on every reuse, however recent the connection's
// return: skipping it for connections back in the pool a moment ago
// (bench/measurements.md, "The event loop") made requests that met a
// worker killed a moment before fail with 502 "sent" instead of being
// placed again (TestRefusedConnectRerouted). An event loop that keeps idle
// upstream sockets in epoll with EPOLLRDHUP can drop it safely.
func (c *Conn) alive() bool {
	if time.Since(c.idle) > c.pool.opts.IdleTimeout {
		return false
	}
	err := c.raw.Read(c.peekFn)
	return err == nil && c.peeked == sysconn.PeekEmpty
}

// peek is the RawConn.Read callback of alive, bound once per connection
// (a closure per call would allocate).
func (c *Conn) peek(fd uintptr) bool {
	c.peeked = sysconn.Peek(fd)
	return true
}

// Retried counts a retry (Attempt.Retry), the pool's own or one made on an
// event loop's own connections (userspace/proxy).
func (p *Pool) Retried(reason int) {
	p.retries[reason].Add(1)
	p.stats.Retried()
}

// Closed reports whether Close was called (the worker left the table): an
// event loop's own idle connections to it are then closed too.
func (p *Pool) Closed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.closed
}

// Options returns the pool's options, defaults filled in.
func (p *Pool) Options() Options { return p.opts }

// Stats returns the counters of the pool's worker.
func (p *Pool) Stats() *stats.Worker { return p.stats }

// Idle returns the number of idle connections.
func (p *Pool) Idle() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.idle.Len()
}

// Close closes the idle connections; connections in use are closed by
// their users (Put after Close discards).
func (p *Pool) Close() {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	idle := p.idle.TakeAll()
	IdleConns.Add(-int64(len(idle)))
	p.mu.Unlock()
	close(p.stop)
	for _, c := range idle {
		c.discard()
	}
}

// janitor closes connections idle for longer than the idle timeout, oldest
// first (the bottom of the stack), so a quiet backend holds no sockets.
func (p *Pool) janitor() {
	t := time.NewTicker(p.opts.IdleTimeout / 2)
	defer t.Stop()
	for {
		select {
		case <-p.stop:
			return
		case now := <-t.C:
			var stale []*Conn
			p.mu.Lock()
			for {
				c, ok := p.idle.Oldest()
				if !ok || now.Sub(c.idle) <= p.opts.IdleTimeout {
					break
				}
				p.idle.DropOldest()
				stale = append(stale, c)
			}
			IdleConns.Add(-int64(len(stale)))
			p.mu.Unlock()
			for _, c := range stale {
				c.discard()
			}
		}
	}
}
