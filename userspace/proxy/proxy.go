// Package proxy is tether's HTTP/1.1 data plane. Each listener has an
// event loop (loop*.go): one goroutine locked to its OS thread around an
// epoll set, holding its connections as raw non-blocking sockets. The loop
// reads and parses request heads (httphead), routes, and runs the common
// exchange itself: the rewritten head up a loop-owned upstream socket, a
// Content-Length body and long response bodies moved by splice(2), the
// response relayed by its framing. Whatever it does not run (chunked or
// Expect bodies, tetherd's own endpoints, queued or learned requests,
// malformed heads) it hands to a goroutine (gor_*.go), which serves the
// connection until it is idle and then gives it back. Both paths drive
// one exchange (exchange.go) through the same phases, taking their
// decisions from the same functions: the response's steps,
// framing and the 1xx policy (framing.go), the failure ladder
// (outcome.go), the client watch (watch.go), admission and the accept
// back-off (accept.go). Nothing ever holds a whole body.
package proxy

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tether-rl/tether/userspace/config"
	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/sysconn"
	"github.com/tether-rl/tether/userspace/upstream"
	"github.com/tether-rl/tether/userspace/worker"
)

// Config configures a Server. Zero durations take the defaults.
type Config struct {
	Router Router
	Table  *worker.Table // the workers, for /health
	Limits httphead.Limits
	// PeekBody: before routing a request with a body, wait until this many
	// body bytes (or the whole body, if shorter) are buffered, so that the
	// router can read a key from them. 0: route on the head alone.
	PeekBody int
	// PeekMax: a Router that is a PeekMorer may ask for more of a
	// Content-Length body than PeekBody before it decides (peek.go), up
	// to this many body bytes in all (at most 64 MiB; 0: the default,
	// 1 MiB; negative: never past PeekBody). The request's buffer grows
	// (pooled) to what is asked; the bytes buffered go up after the
	// head, the rest is spliced as before. Not for a chunked body nor
	// Expect: 100-continue (PeekBody's limit).
	PeekMax int
	// PeekBudget bounds the bytes all large buffers (bufs.go) may hold
	// while a buffer grows for PeekMax: past it the request is routed on
	// what it has. Default 256 MiB.
	PeekBudget int64
	// RouteHeader, when set, names a response header added to every
	// proxied response: "<slot> <reason>" of its routing decision
	// (tetherd --route-header).
	RouteHeader string

	// ResponseTimeout bounds the wait for the first byte of a response
	// head (504 after it). Agent turns are long: default 30 minutes.
	ResponseTimeout time.Duration
	// MaxBodyBytes bounds a request body (0: no limit): a Content-Length
	// above it is answered 413 before anything is forwarded; a chunked body
	// that grows past it (framing counted) is cut and answered 413, its
	// upstream connection closed.
	MaxBodyBytes int64
	// StreamIdleTimeout: a streamed (chunked or close-delimited) response
	// body with no byte from the worker for this long is cut (the client
	// sees the truncation), so a stopped engine does not hold its clients
	// for ResponseTimeout; default 5 minutes.
	StreamIdleTimeout time.Duration
	// IdleTimeout closes a client keep-alive connection with no request;
	// default 120s.
	IdleTimeout time.Duration
	// HeadTimeout bounds reading a request head once its first byte came;
	// default 30s.
	HeadTimeout time.Duration
	// IOTimeout bounds every body read or write that makes no progress;
	// default 120s.
	IOTimeout time.Duration
	// MaxConns caps the client connections open at once (0: no cap). At
	// the cap the accept loops pause: new connections wait in the
	// kernel's accept queue until one closes, rather than failing for
	// want of descriptors (DefaultMaxConns derives it from the fd limit).
	MaxConns int
	// QueueSize: a request whose worker is at its max_in_flight waits in
	// that worker's queue, up to this many per worker; past it, or after
	// QueueTimeout, it gets 503 with Retry-After. 0: 1024; negative: no
	// queue (503 at once).
	QueueSize int
	// QueueTimeout bounds a request's wait in a worker's queue; default
	// 30s.
	QueueTimeout time.Duration
	// LocalBodyBudget caps the bytes held at once, across all
	// connections, by the bodies of requests tetherd answers itself
	// (each at most MaxLocalBody): past it such a request gets 503 with
	// Retry-After instead of raising RSS. Default 64 MiB.
	LocalBodyBudget int64
	// ParkAfter: a connection that a goroutine served (a streamed body,
	// Expect, a local or queued request: loop.go) goes back to its
	// listener's event loop once idle this long; 0: at once. Negative:
	// never (it waits on its goroutine to the idle timeout).
	ParkAfter time.Duration
	// Ring: the event loops batch a wake-up's socket reads and writes
	// through an io_uring (loop_ring.go); unset: they do. Set to false, or
	// without io_uring (kernel.io_uring_disabled, a seccomp filter), each
	// read and write is its own system call.
	Ring config.Optional[bool]
	// Waits are the data plane's internal waits; tests shorten them to
	// sequence events instead of sleeping past them.
	Waits Waits
	// SpliceMin: body remainders of at least this many bytes move with
	// splice(2); smaller ones are copied through the buffer. Default 16 KiB
	// (bench/measurements.md, "Copy or splice: the threshold, measured").
	SpliceMin int64

	// InstanceID is reported by /health; stable for the process.
	InstanceID string
	// Local returns the handler for tetherd's own endpoints on the data
	// port (abort fan-out, admin when allowed), or nil to proxy.
	Local func(method, path []byte) http.Handler
	// Observe, when set, is called once per proxied request at its end
	// with the worker slot, the response status class (status/100; 0 when
	// no status was relayed: the client left or the request was refused
	// mid-body) and the time since routing. It runs on the data path: it
	// must not block or allocate (metrics.Metrics.Observe).
	Observe func(worker int, codeClass int, d time.Duration)
	// Hold, when set, keeps requests from workers during a fleet weight
	// sync (hold.go, userspace/fleet).
	Hold Hold
	// PD, when set, serves the generation requests of a prefill/decode
	// fleet over pairs (pd.go).
	PD PD

	Log *slog.Logger
}

// Defaults of Config's settings: the values tetherd's flags show
// (daemon.DataPlaneDefaults is Defaults), written here once.
const (
	DefaultResponseTimeout   = 30 * time.Minute // agent turns are long
	DefaultStreamIdleTimeout = 5 * time.Minute
	DefaultIdleTimeout       = 120 * time.Second
	DefaultHeadTimeout       = 30 * time.Second
	DefaultIOTimeout         = 120 * time.Second
	DefaultQueueSize         = 1024 // also the fleet's hold per worker (tetherd)
	DefaultQueueTimeout      = 30 * time.Second
	DefaultLocalBodyBudget   = 64 << 20
	DefaultSpliceMin         = 16 << 10 // bench/measurements.md
	DefaultPeekMax           = 1 << 20
	DefaultPeekBudget        = 256 << 20
)

// Defaults returns a Config whose settings are all at their defaults, and
// no wiring. Settings whose zero is a meaning of its own stay zero:
// MaxBodyBytes (no limit), MaxConns (no cap), ParkAfter (park at once),
// Ring (unset: batch through io_uring).
func Defaults() Config {
	var c Config
	c.Provision()
	return c
}

// Provision fills c's zero (or, for durations and sizes, negative)
// settings with their defaults: the Default* constants and httphead's
// limits. A negative QueueSize (no queue) is kept; the wiring is not
// touched.
func (c *Config) Provision() {
	for _, d := range []struct {
		p   *time.Duration
		def time.Duration
	}{
		{&c.ResponseTimeout, DefaultResponseTimeout},
		{&c.StreamIdleTimeout, DefaultStreamIdleTimeout},
		{&c.IdleTimeout, DefaultIdleTimeout},
		{&c.HeadTimeout, DefaultHeadTimeout},
		{&c.IOTimeout, DefaultIOTimeout},
		{&c.QueueTimeout, DefaultQueueTimeout},
	} {
		if *d.p <= 0 {
			*d.p = d.def
		}
	}
	if c.QueueSize == 0 {
		c.QueueSize = DefaultQueueSize
	}
	if c.LocalBodyBudget <= 0 {
		c.LocalBodyBudget = DefaultLocalBodyBudget
	}
	if c.SpliceMin <= 0 {
		c.SpliceMin = DefaultSpliceMin
	}
	if c.PeekMax == 0 {
		c.PeekMax = DefaultPeekMax
	}
	if c.PeekBudget <= 0 {
		c.PeekBudget = DefaultPeekBudget
	}
	if !c.Ring.IsSet() {
		c.Ring = config.Some(true)
	}
	for _, n := range []struct {
		p   *int
		def int
	}{
		{&c.Limits.RequestLine, httphead.DefaultRequestLine},
		{&c.Limits.Head, httphead.DefaultHead},
		{&c.Limits.Fields, httphead.DefaultFields},
		{&c.Limits.ChunkExt, httphead.MaxChunkExtBytes},
	} {
		if *n.p == 0 {
			*n.p = n.def
		}
	}
}

// Validate refuses out-of-range settings (zero is the default), naming
// tetherd's flag of each (settings, flags.go).
func (c *Config) Validate() error { return config.Validate(c.settings()) }

func (c *Config) setDefaults() {
	c.Provision()
	if c.QueueSize < 0 {
		c.QueueSize = 0
	}
	c.Waits.setDefaults()
	if c.Log == nil {
		c.Log = slog.Default()
	}
}

// Waits: zero fields take the defaults.
type Waits struct {
	// Continue: how long a request with Expect: 100-continue waits for
	// the worker's 100 (or a final answer) before its body is sent
	// anyway, as curl does; default 1s.
	Continue time.Duration
	// EarlyAnswer: after a request body failed to go up, how long to look
	// for a final answer the worker sent early (413, 401 and close): one
	// that was sent is already queued; default 100ms.
	EarlyAnswer time.Duration
	// Linger: after an answer to a request whose body was not read, how
	// long the client is read (and discarded) before the close, so the
	// answer is not destroyed by a reset; default 500ms.
	Linger time.Duration
	// Watch: an exchange still running after this long gets a client
	// watch (a client that leaves closes the upstream); quick ones pay
	// nothing for it; default 2ms.
	Watch time.Duration
}

func (w *Waits) setDefaults() {
	for _, d := range []struct {
		p   *time.Duration
		def time.Duration
	}{{&w.Continue, time.Second}, {&w.EarlyAnswer, 100 * time.Millisecond}, {&w.Linger, 500 * time.Millisecond}, {&w.Watch, 2 * time.Millisecond}} {
		if *d.p <= 0 {
			*d.p = d.def
		}
	}
}

// Router picks a worker for a request; body is the start of the request
// body that is already buffered (see Config.PeekBody).
type Router interface {
	Route(req *httphead.Request, body []byte) route.Decision
}

// Rerouter is a Router that can place a request again when its worker
// refused the connection, so nothing was sent (route.Router.Reroute): the
// client then gets its answer from another worker instead of a 502. A
// Decision without Worker means the request stays pinned (502 not-sent).
type Rerouter interface {
	Reroute(req *httphead.Request, body []byte, d route.Decision) route.Decision
}

// Server runs the data plane on any number of listeners.
type Server struct {
	cfg      Config
	peekMore PeekMorer // the Router's, when the peek may grow (Config.PeekMax)

	ringOnce sync.Once // "no io_uring" logged once

	mu        sync.Mutex
	conns     map[*conn]struct{} // the connections goroutines serve (c.c set); a loop holds its own (loop.conns)
	listeners map[net.Listener]struct{}
	wg        sync.WaitGroup // connections
	accepting sync.WaitGroup // accept loops (Serve)
	closing   atomic.Bool
	// open counts client connections admitted (accept.go): at
	// Config.MaxConns the accept loops wait on freed.
	open     int
	freed    *sync.Cond         // signalled (under mu) when a connection ends or the server closes
	freedGen uint64             // connections ended (under mu)
	loops    map[*loop]struct{} // one per TCP listener (loop.go)
	// placeWaiters: loops that stopped accepting at MaxConns (or for want
	// of descriptors), woken when a place frees.
	// true: for a descriptor (accept failing), false: for a place.
	placeWaiters map[*loop]bool
	closed       bool         // Close ran (under mu)
	nloops       atomic.Int64 // loops serving now (each keeps its share of a pool's idle connections)
	// capped and acceptFailing: the episodes of accepting paused at
	// MaxConns and of accept failing, logged once each (accept.go).
	capped, acceptFailing episode
	localBytes            atomic.Int64 // local-endpoint body bytes held now (Config.LocalBodyBudget)
	localLogged           atomic.Int64 // last logLocalShortage line (UnixNano)
	upSockets             atomic.Int64 // the event loops' upstream sockets, in use and idle (loop.spareFDs)
	// idleGrace (ns): while shutting down gently, a keep-alive connection
	// is closed only once idle this long (ShutdownGently).
	idleGrace atomic.Int64

	counters Counters
}

// Counters are the data plane's own event counts (the per-worker ones live
// in stats.Worker).
type Counters struct {
	Accepted      atomic.Uint64
	Requests      atomic.Uint64 // requests read from clients
	Local         atomic.Uint64 // answered by tetherd itself
	Rejected      atomic.Uint64 // malformed or refused requests (4xx from tether)
	BadGateway    atomic.Uint64 // 502
	Timeouts      atomic.Uint64 // 504
	Truncated     atomic.Uint64 // response cut short by the backend
	ClientAborted atomic.Uint64 // client left before the response ended

	// Buffers is how many 16 KiB buffers the server's connections hold
	// now: idle ones hold none (TestIdleConnectionsHoldNoBuffer).
	Buffers atomic.Int64
	// LargeBytes is how many bytes the buffers larger than 16 KiB hold
	// now (bufs.go): grown heads, streamed chunked bodies, bodies read
	// further for the router (Config.PeekMax, bounded by PeekBudget).
	LargeBytes atomic.Int64
	// PeekMore counts the requests whose body was read further because
	// the router asked (Config.PeekMax); PeekBudgetFull those the router
	// asked for more that were routed on what they had, the large
	// buffers at Config.PeekBudget.
	PeekMore       atomic.Uint64
	PeekBudgetFull atomic.Uint64
	// Open is how many client connections are open now; AcceptPauses
	// counts the episodes in which accepting paused (connection cap
	// reached, or accept failing for want of descriptors).
	Open         atomic.Int64
	AcceptPauses atomic.Uint64
	// Queued is how many requests wait in a worker's queue now;
	// QueueFull and QueueTimeouts count the 503s of full and expired
	// queues; LocalBusy the local requests refused by LocalBodyBudget.
	Queued        atomic.Int64
	QueueFull     atomic.Uint64
	QueueTimeouts atomic.Uint64
	// Held is how many requests the fleet's hold keeps now (hold.go);
	// HoldFull and HoldTimeouts count its 503s.
	Held         atomic.Int64
	HoldFull     atomic.Uint64
	HoldTimeouts atomic.Uint64
	LocalBusy    atomic.Uint64
	// Parked is how many client connections the event loops hold now
	// (idle, reading a head, or in an exchange the loop runs): none of
	// them has a goroutine.
	Parked atomic.Int64
	// UpstreamIdle is how many idle upstream connections the event loops
	// keep (each loop its own, per worker; upstream.Pool holds the
	// goroutines').
	UpstreamIdle atomic.Int64
	// Handoffs counts the connections an event loop gave to a goroutine
	// (a request it does not run itself, loop.go).
	Handoffs atomic.Uint64
	// RingOps counts the socket reads and writes the event loops batched
	// through their io_uring, RingSubmits the io_uring_enter calls that
	// carried them (loop_ring.go).
	RingOps     atomic.Uint64
	RingSubmits atomic.Uint64
}

// New returns a server.
func New(cfg Config) *Server {
	cfg.setDefaults()
	s := &Server{cfg: cfg, conns: make(map[*conn]struct{}), listeners: make(map[net.Listener]struct{}),
		loops: map[*loop]struct{}{}, placeWaiters: map[*loop]bool{}}
	s.freed = sync.NewCond(&s.mu)
	s.setPeekMore()
	return s
}

// logLocalShortage logs a connect that failed for want of this host's
// resources, at most once every 10 s (one line per episode, not one per
// request).
func (s *Server) logLocalShortage(err error) {
	now := time.Now().UnixNano()
	last := s.localLogged.Load()
	if now-last < int64(10*time.Second) || !s.localLogged.CompareAndSwap(last, now) {
		return
	}
	s.cfg.Log.Error("upstream connects fail for want of local resources (too many open files? raise LimitNOFILE / ulimit -n): answering 502, workers not blamed",
		"err", err, "total", upstream.LocalFailures.Load())
}

// Counters returns the server's counters.
func (s *Server) Counters() *Counters { return &s.counters }

// Shutdown stops accepting, closes idle connections, lets every request in
// progress finish (answering it with Connection: close), and waits for
// them until ctx ends; then it closes what is left.
func (s *Server) Shutdown(ctx context.Context) error { return s.ShutdownGently(ctx, 0) }

// WaitAcceptStopped returns once every accept loop has returned (after
// ShutdownGently or Close began).
func (s *Server) WaitAcceptStopped() { s.accepting.Wait() }

// ShutdownGently is Shutdown for a process that hands its clients to
// another (an upgrade, or systemd's fd store): every response from now on
// says Connection: close, a request read on a keep-alive connection is
// still served, and a keep-alive connection is closed only once it has
// been idle for idleGrace (KeepIdle: only at the idle timeout, as while
// serving; idleclose.go says why). It returns once every connection
// ended, or when ctx ends: then it closes what is left (Close).
func (s *Server) ShutdownGently(ctx context.Context, idleGrace time.Duration) error {
	if idleGrace < 0 {
		idleGrace = s.cfg.IdleTimeout
	}
	s.idleGrace.Store(int64(idleGrace))
	s.closing.Store(true)
	s.mu.Lock()
	for ln := range s.listeners {
		ln.Close()
	}
	for c := range s.conns {
		c.wakeIfIdle(idleGrace)
	}
	for l := range s.loops {
		l.wake() // stop accepting; idle connections go once idle for idleGrace
	}
	s.freed.Broadcast()
	s.mu.Unlock()
	done := make(chan struct{})
	go func() {
		// A connection accepted while the listeners closed is still
		// served: wait for the accept loops to return before counting.
		s.accepting.Wait()
		s.wg.Wait()
		close(done)
	}()
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-done:
			return nil
		case <-ctx.Done():
			s.Close()
			<-done
			return ctx.Err()
		case <-t.C:
			// A connection that went idle after the first pass.
			s.mu.Lock()
			for c := range s.conns {
				c.wakeIfIdle(idleGrace)
			}
			s.mu.Unlock()
		}
	}
}

// Close closes every listener and connection at once.
func (s *Server) Close() {
	s.closing.Store(true)
	s.mu.Lock()
	s.closed = true
	for ln := range s.listeners {
		ln.Close()
	}
	for c := range s.conns {
		if c.c != nil {
			c.c.Close() // a goroutine's: it finishes the connection
		}
	}
	for l := range s.loops {
		l.close() // the loop's: it closes them
	}
	s.freed.Broadcast()
	s.mu.Unlock()
}

var aLongTimeAgo = time.Unix(1, 0)

// isTimeout reports a deadline expiry.
func isTimeout(err error) bool { return errors.Is(err, os.ErrDeadlineExceeded) }

// move sends exactly n bytes from src to dst: splice(2) for remainders of
// at least Config.SpliceMin (or when there is no scratch buffer), a copy
// through scratch below that. Deadlines are renewed for every step, so a
// transfer may take as long as it keeps moving. It reports how many bytes
// moved; errSrcEOF when src ended early.
//
// A large body is batched (batch.go): src's mark is raised for all but
// the last batchLowat bytes, where batchMark lowers it.
func (c *conn) move(dst, src *net.TCPConn, n int64, scratch []byte, timeout time.Duration) (int64, error) {
	if n >= 1<<62 || batchMark(false, n) != batchLowat || !sysconn.SetRcvLowat(src, batchLowat) {
		return c.moveSteps(dst, src, n, scratch, timeout)
	}
	moved, err := c.moveSteps(dst, src, n-batchLowat, scratch, timeout)
	sysconn.SetRcvLowat(src, 1)
	if err != nil {
		return moved, err
	}
	tail, err := c.moveSteps(dst, src, batchLowat, scratch, timeout)
	return moved + tail, err
}

func (c *conn) moveSteps(dst, src *net.TCPConn, n int64, scratch []byte, timeout time.Duration) (int64, error) {
	const step = 4 << 20
	var moved int64
	for moved < n {
		left := n - moved
		now := time.Now()
		src.SetReadDeadline(now.Add(timeout))
		dst.SetWriteDeadline(now.Add(timeout))
		// A Learner that wants the response's first bytes sees them
		// copied (route/learn.go; at most a few KiB); then splice again.
		if len(scratch) == 0 || left >= c.s.cfg.SpliceMin && (c.learn == nil || dst != c.c) {
			if left > step {
				left = step
			}
			c.lr.R, c.lr.N = src, left
			k, err := dst.ReadFrom(&c.lr)
			c.lr.R = nil
			moved += k
			if err != nil {
				return moved, err
			}
			if k < left {
				return moved, errSrcEOF
			}
			continue
		}
		if int64(len(scratch)) < left {
			left = int64(len(scratch))
		}
		k, rerr := src.Read(scratch[:left])
		if k > 0 {
			if c.learn != nil && dst == c.c && !c.learn.Body(scratch[:k]) {
				c.learn = nil
			}
			w, werr := dst.Write(scratch[:k])
			moved += int64(w)
			if werr != nil {
				return moved, werr
			}
		}
		if rerr != nil {
			if rerr == io.EOF {
				return moved, errSrcEOF
			}
			return moved, rerr
		}
	}
	return moved, nil
}

var errSrcEOF = errors.New("source ended early")
