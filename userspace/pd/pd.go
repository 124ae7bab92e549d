// Package pd serves one client request over a prefill/decode (P/D) pair of
// engines, in SGLang's bootstrap protocol or vLLM's NIXL protocol, as a
// blocking driver over HTTP/1.1: the proxy reads the request's head and
// body, picks nothing itself, and calls
//
//	err := srv.Serve(ctx, w, &pd.Request{Method, Path, Header, Body}, chooser)
//
// from a goroutine (its goroutine path). Serve asks chooser for a pair
// ([PairChooser]: placement and load stay with the router), speaks to both
// engines, writes the answer to w (an http.ResponseWriter or anything with
// its three methods; Flush is called when w has one) and returns once the
// client's answer is over. ctx ends when the client leaves: both legs are
// then cancelled and aborted. The error says why an answer failed, for the
// log; the client has had its answer either way.
//
// Only generation requests go to Serve (SGLang's /generate,
// /v1/completions, /v1/chat/completions; vLLM's two OpenAI paths), with a
// JSON object body; a body that is not one is a 400. Control calls (abort,
// pause, weight updates, flush) are the engine package's to fan out to
// every prefill and decode engine.
//
// The protocols are spoken in the engines' words, which are
// userspace/dialect's (dialect.PDWire, from each engine's file: sglang.go
// for the bootstrap protocol, vllm.go for NIXL): pd names no body field,
// header or path of an engine.
//
// # Bootstrap rooms (Protocol SGLang)
//
// The prefill's host, its bootstrap port (null for the engine's default)
// and a room (uniform in 0..2^63-1, new for every attempt) are set at the
// top level of the body, replacing any the client sent; a batch gets
// lists, one room per item. A request id is added where the client sent
// none (one per item for a batch), the same on both legs, so both sides
// can be aborted by it. The same body goes to P and D at once; the client
// gets D's status, headers and stream. P's answer is read and discarded,
// except when the client asked for input logprobs: P's are put in front
// of D's, in the whole answer or in each SSE event ([DONE] passes
// untouched). Only the top level of the body and of the merged objects is
// touched ([jsonedit]).
//
// # KV handoff (Protocol VLLM, NIXL)
//
// One request id header (the client's, or a new one) on both legs. P gets
// the client's body with the protocol's prefill edits (a remote decode
// asked for, not streamed, one token, one sample, no minimum). D then gets
// the client's body with the handoff object P returned, and D's answer
// goes to the client. P answering without one is counted
// (MissingKVParams) and answered 502 unless
// Config.LetMissingKVParamsThrough (D then recomputes the prompt:
// PassedWithoutKVParams). Closing a leg's connection aborts it.
//
// # n > 1
//
// Every sample needs its own room or handoff (one NIXL handoff has one
// consumer), and sharing one hangs. A request for n samples in the
// protocol's words that is not streamed, has no seed, no request id of
// the client's in its body and one prompt is sent as n requests of one
// sample, at once, each over a pair of its own (a client's request id
// header gets "-<i>" for sample i), and their answers make one: the
// OpenAI paths' choices, indexed 0..n-1, with the usage summed, or a list
// of the n answers (SGLang's native answer to n); a sample answered
// otherwise than 2xx is the answer. Any other request for several
// samples (in any engine's words: dialect.PDSamples) is refused with a
// 400 that says why.
//
// # Failures
//
// Before the client has a byte (D's answer is held until its first body
// bytes, or its end), a leg that fails or answers 5xx cancels the other at
// once (its connection closed, and an abort by id where the protocol has one), then the
// request is tried once more on a new pair ([PairChooser.Choose] is told
// the pair that failed) with new rooms. P's 4xx goes to the client as it
// is; so does D's 4xx, and the last attempt's 5xx. After the first byte a
// failed decode ends the answer visibly: an SSE stream with one
// `data: {"error": ...}` event (valid JSON), any other body cut short
// (chunked, without its last chunk); the prefill, if still running, is
// cancelled and aborted. A prefill still answering when D is done is left
// Config.PrefillGrace, then cancelled and aborted, in the background
// ([Server.Close] waits for those). Every outcome is counted in [Counters].
//
// # Transport
//
// The legs use net/http's client on a transport of pd's own (transport.go:
// keep-alive per engine, no proxy from the environment, no compression,
// HTTP/1.1 only, each exchange in its caller's goroutine, framed by
// net/http's Request.Write and ReadResponse; Config.Transport may replace
// it): cancelling a leg's context closes its connection, which is how
// vLLM aborts a request; chunked and length-framed answers are decoded for
// the logprob merge and the first-byte hold. vLLM's two legs run in
// Serve's goroutine, one after the other; SGLang's two at once, each on a
// goroutine. The proxy's own splice path is not used because an answer
// must be held and may be rewritten.
package pd

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"sync"
	"time"

	"github.com/tether-rl/tether/userspace/dialect"
)

// Protocol is how a pair is driven.
type Protocol int

const (
	// SGLang: bootstrap rooms, both legs at once.
	SGLang Protocol = iota
	// VLLM: NIXL, prefill first, then decode with the prefill's KV
	// handoff.
	VLLM
)

func (p Protocol) String() string {
	switch p {
	case SGLang:
		return "sglang"
	case VLLM:
		return "vllm"
	}
	return fmt.Sprintf("protocol(%d)", int(p))
}

// Request is a client's request as the proxy read it: the end-to-end
// header fields (hop-by-hop ones, Host and Content-Length are dropped by
// Serve) and the whole body (jsonedit.ReadBody reads one under a limit).
type Request struct {
	Method string
	Path   string // path and query, as sent to the engines
	Header http.Header
	Body   []byte
}

// ResponseWriter is what Serve writes the answer to: http.ResponseWriter's
// methods. A writer that also has Flush() is flushed after every piece of
// a streamed answer.
type ResponseWriter interface {
	Header() http.Header
	WriteHeader(status int)
	Write(p []byte) (int, error)
}

// Worker is one engine of a pair.
type Worker struct {
	URL           string // base URL, "http://host:port"
	Slot          int    // the router's slot, for the route header
	BootstrapPort int    // SGLang prefill's bootstrap port; 0: null (the engine's default)
}

// Pair is a prefill and a decode chosen for one attempt.
type Pair struct {
	Prefill, Decode Worker
	Reason          string // why the chooser picked them, for the route header
}

func (p Pair) String() string { return fmt.Sprintf("p%d+d%d", p.Prefill.Slot, p.Decode.Slot) }

// PairChooser places requests: the router's policies and loads.
type PairChooser interface {
	// Choose picks a pair for attempt (0, then 1 after a failure before
	// the client had a byte; failed is the pair that failed, nil on
	// attempt 0). The pair's loads count the request from here.
	Choose(ctx context.Context, req *Request, attempt int, failed *Pair) (Pair, error)
	// Release ends the request's count on the pair; failed says the
	// attempt failed on it.
	Release(p Pair, failed bool)
}

// Observer, when a PairChooser is one too, is told of every request
// answered over a pair: the pair of the attempt that answered (a failed
// attempt retried on another pair is not observed), the status the client
// got (0: none, the client left first) and the time from the pair's
// choice to the answer's end. Serve calls it after Release.
type Observer interface {
	Observe(p Pair, status int, took time.Duration)
}

// statusWriter keeps the status written through it (for an Observer).
type statusWriter struct {
	w      ResponseWriter
	status int
}

func (s *statusWriter) Header() http.Header { return s.w.Header() }
func (s *statusWriter) Write(p []byte) (int, error) {
	if s.status == 0 {
		s.status = http.StatusOK
	}
	return s.w.Write(p)
}
func (s *statusWriter) Flush() { flush(s.w) }

func (s *statusWriter) WriteHeader(status int) {
	if s.status == 0 {
		s.status = status
	}
	s.w.WriteHeader(status)
}

// Config holds a Server's settings.
type Config struct {
	Protocol Protocol
	// Transport for both legs; nil: NewTransport().
	Transport http.RoundTripper
	// LetMissingKVParamsThrough sends D the client's body when a NIXL
	// prefill answers without its KV handoff (D recomputes the prompt),
	// instead of a 502.
	LetMissingKVParamsThrough bool
	// RouteHeader, if set, names a response field that shows the pair
	// ("p<slot>+d<slot>" and the chooser's reason).
	RouteHeader string
	// AbortTimeout bounds an abort call (default 1 s).
	AbortTimeout time.Duration
	// PrefillGrace is how long a prefill may still answer once the decode
	// is done (default 5 s).
	PrefillGrace time.Duration
	// MaxPrefillAnswer bounds how much of P's answer is kept for a
	// logprob merge, and of D's for a whole-answer merge (default 64 MiB).
	MaxPrefillAnswer int64
	Log              *slog.Logger
}

// NewTransport is a net/http transport with the legs' settings; the legs'
// default is one of pd's own over the same settings (legTransport: each
// exchange in its caller's goroutine).
func NewTransport() *http.Transport {
	return &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 2 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        1024,
		MaxIdleConnsPerHost: 256,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
		ForceAttemptHTTP2:   false,
		TLSNextProto:        map[string]func(string, *tls.Conn) http.RoundTripper{},
	}
}

// Server drives pairs. Its methods are safe for concurrent use.
type Server struct {
	cfg        Config
	wire       *dialect.PDWire // the protocol's words
	sampleKeys [][]byte        // its sample fields, quoted (samples.go)
	client     *http.Client
	Counters   Counters
	bg         sync.WaitGroup
	own        interface{ CloseIdleConnections() }
}

// New returns a Server with cfg's defaults filled in.
func New(cfg Config) *Server {
	if cfg.AbortTimeout <= 0 {
		cfg.AbortTimeout = time.Second
	}
	if cfg.PrefillGrace <= 0 {
		cfg.PrefillGrace = 5 * time.Second
	}
	if cfg.MaxPrefillAnswer <= 0 {
		cfg.MaxPrefillAnswer = 64 << 20
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	s := &Server{cfg: cfg, wire: wireOf(cfg.Protocol)}
	s.sampleKeys = sampleKeys(s.wire)
	rt := cfg.Transport
	if rt == nil {
		own := newLegTransport()
		s.own, rt = own, own
	}
	s.client = &http.Client{Transport: rt, CheckRedirect: func(*http.Request, []*http.Request) error {
		return http.ErrUseLastResponse
	}}
	return s
}

// Close waits for the background cancellations and aborts, and closes the
// idle connections of its own transport.
func (s *Server) Close() {
	s.bg.Wait()
	if s.own != nil {
		s.own.CloseIdleConnections()
	}
}

// ErrNoPair is Choose's answer when no pair can take the request (a 503).
var ErrNoPair = errors.New("pd: no prefill/decode pair available")

// Serve answers req over a pair from chooser: see the package comment.
func (s *Server) Serve(ctx context.Context, w ResponseWriter, req *Request, chooser PairChooser) error {
	s.Counters.Requests.Add(1)
	if plan, ok := s.planSamples(req.Body); ok {
		return s.serveSamples(ctx, w, req, chooser, plan)
	}
	return s.serveOne(ctx, w, req, chooser)
}

// serveOne answers a request over one pair (one attempt, and a retry).
func (s *Server) serveOne(ctx context.Context, w ResponseWriter, req *Request, chooser PairChooser) error {
	if s.cfg.Protocol == VLLM {
		return s.serveVLLM(ctx, w, req, chooser)
	}
	return s.serveSGLang(ctx, w, req, chooser)
}

// hostOf returns the host of a base URL (bracketed for IPv6).
func hostOf(base string) (string, error) {
	u, err := url.Parse(base)
	if err != nil || u.Host == "" {
		return "", fmt.Errorf("pd: bad worker URL %q", base)
	}
	h := u.Hostname()
	if ip := net.ParseIP(h); ip != nil && ip.To4() == nil {
		h = "[" + h + "]"
	}
	return h, nil
}
