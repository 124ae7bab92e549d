package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/worker"
)

// MaxLocalBody bounds the body of a request tetherd answers itself: control
// endpoints take small JSON, but a weight update fanned out to every
// engine may carry serialized tensors (SGLang update_weights_from_tensor);
// LocalBodyBudget bounds what all of them hold at once.
const MaxLocalBody = 16 << 20

// localHandler returns the handler for a request tetherd answers itself.
// A percent-encoded path (/abort%5Frequest) is matched in its decoded
// form, as the handlers (and any HTTP server) read it: an encoded local
// path is never silently proxied to one worker.
func (c *conn) localHandler() http.Handler {
	h, _ := c.local()
	return h
}

// local returns the handler for a request tetherd answers itself, and
// whether it is one of the probes (/health, /readiness, /liveness: quick,
// never blocking, so an event loop may run them itself).
func (c *conn) local() (http.Handler, bool) {
	req := c.req
	path := req.Path
	if q := bytes.IndexByte(path, '?'); bytes.IndexByte(path, '%') >= 0 && (q < 0 || bytes.IndexByte(path[:q], '%') >= 0) {
		raw := path
		if q >= 0 {
			raw = path[:q]
		}
		// An encoded '?' is part of the path, not a query: such a path is
		// no local endpoint (and isPath would read it as a query).
		if dec, err := url.PathUnescape(string(raw)); err == nil && !strings.Contains(dec, "?") {
			path = []byte(dec)
		}
	}
	switch {
	case isPath(path, "/health"):
		return http.HandlerFunc(c.s.serveHealth), true
	case isPath(path, "/readiness"):
		return http.HandlerFunc(c.s.serveReadiness), true
	case isPath(path, "/liveness"):
		return http.HandlerFunc(c.s.serveLiveness), true
	}
	if c.s.cfg.Local != nil {
		return c.s.cfg.Local(req.Method, path), false
	}
	return nil, false
}

// HealthBody is the JSON of GET /health and /readiness.
type HealthBody struct {
	// Status: "ok" (/health) or "ready" (/readiness) when some worker can
	// take work (200), else "no healthy workers" / "not ready" (503).
	Status     string `json:"status"`
	InstanceID string `json:"instance_id"`
	// SessionServerInstanceID repeats InstanceID under the name the miles
	// agent server reads (a change means "session server identity
	// changed"); --instance-id sets it.
	SessionServerInstanceID string `json:"session_server_instance_id"`
	Workers                 int    `json:"workers"`
	TotalWorkers            int    `json:"total_workers"`
	HealthyWorkers          int    `json:"healthy_workers"`
}

// health counts the workers: in the table, and healthy.
func (s *Server) health() HealthBody {
	var n, healthy int
	for _, wk := range s.cfg.Table.Snapshot() {
		if wk == nil {
			continue
		}
		n++
		if wk.BaseState() == worker.Healthy {
			healthy++
		}
	}
	return HealthBody{InstanceID: s.cfg.InstanceID, SessionServerInstanceID: s.cfg.InstanceID,
		Workers: n, TotalWorkers: n, HealthyWorkers: healthy}
}

func getOnly(w http.ResponseWriter, r *http.Request) bool {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		writeJSONError(w, 405, "method not allowed")
		return false
	}
	return true
}

func writeHealth(w http.ResponseWriter, code int, b HealthBody) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(b)
}

// serveHealth: 200 while some worker is healthy, else 503 (a router with
// nothing to route to is not healthy to a load balancer either).
func (s *Server) serveHealth(w http.ResponseWriter, r *http.Request) {
	s.serveProbe(w, r, "ok", "no healthy workers")
}

// serveReadiness: sgl-model-gateway's readiness probe, 503 when no worker
// can take work.
func (s *Server) serveReadiness(w http.ResponseWriter, r *http.Request) {
	s.serveProbe(w, r, "ready", "not ready")
}

// serveProbe answers the worker counts with status up (200) while some
// worker is healthy, else down (503).
func (s *Server) serveProbe(w http.ResponseWriter, r *http.Request, up, down string) {
	if !getOnly(w, r) {
		return
	}
	b := s.health()
	code := http.StatusOK
	b.Status = up
	if b.HealthyWorkers == 0 {
		code, b.Status = http.StatusServiceUnavailable, down
	}
	writeHealth(w, code, b)
}

// serveLiveness: tetherd itself is alive (whatever its workers).
func (s *Server) serveLiveness(w http.ResponseWriter, r *http.Request) {
	if !getOnly(w, r) {
		return
	}
	w.Header().Set("Content-Type", "application/json")
	io.WriteString(w, `{"status":"alive"}`+"\n")
}

func writeJSONError(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{"code": code, "message": msg}})
}

// localWriter buffers a local handler's (small) response.
type localWriter struct {
	h      http.Header
	status int
	body   bytes.Buffer
	out    bytes.Buffer // the answer as sent (response)
}

// reset readies a reused writer (a loop's, for probes) for the next answer.
func (w *localWriter) reset() {
	clear(w.h)
	w.status = 0
	w.body.Reset()
	w.out.Reset()
}

func (w *localWriter) Header() http.Header { return w.h }
func (w *localWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
}
func (w *localWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = 200
	}
	return w.body.Write(p)
}

// serveLocal reads the (bounded) body, runs h and writes its answer.
func (c *conn) serveLocal(h http.Handler) bool {
	req := c.req
	// Everything is taken from the head before the body is read: a chunked
	// body is read into the buffer the head was parsed from, so the head's
	// slices (method, target, fields) are gone after it.
	u, err := url.ParseRequestURI(string(req.Path))
	if err != nil {
		c.rejectAndClose(400)
		return false
	}
	hr := &http.Request{
		Method:     string(req.Method),
		URL:        u,
		RequestURI: string(req.Target),
		Proto:      "HTTP/1." + strconv.Itoa(req.Minor),
		ProtoMajor: 1,
		ProtoMinor: req.Minor,
		Header:     make(http.Header, len(req.Fields)),
		Host:       string(req.Host),
		RemoteAddr: c.c.RemoteAddr().String(),
	}
	for i := range req.Fields {
		f := &req.Fields[i]
		hr.Header.Add(string(f.Name), string(f.Value))
	}
	isHead := req.IsMethod("HEAD")
	// Bodies held at once across connections are capped: a request that
	// would pass Config.LocalBodyBudget gets 503 before its body is read.
	// The place is given back as soon as the handler is done with the
	// body, before the answer goes out.
	held := localReserve(req)
	if held > 0 && c.s.localBytes.Add(held) > c.s.cfg.LocalBodyBudget {
		c.s.localBytes.Add(-held)
		c.s.count(countLocalBusy)
		if c.writeClient(localBusyResponse[1]) == nil {
			c.lingerClose()
		}
		return false
	}
	unhold := func() {
		c.s.localBytes.Add(-held)
		held = 0
	}
	defer unhold()
	body, err := c.readLocalBody()
	if err != nil {
		if e, ok := err.(*httphead.Error); ok {
			c.rejectAndClose(e.Status)
		} else if isTimeout(err) {
			c.rejectAndClose(408) // a body that stopped coming
		}
		return false
	}
	hr.ContentLength = int64(len(body))
	hr.Body = io.NopCloser(bytes.NewReader(body))
	ctx, cancel := context.WithTimeout(context.Background(), c.s.cfg.ResponseTimeout)
	defer cancel()
	hr = hr.WithContext(ctx)
	lw := &localWriter{h: make(http.Header)}
	// A client that leaves cancels the handler (abort waves, fan-outs).
	c.watchLocal(cancel)
	panicked := c.runLocal(h, lw, hr)
	hr.Body, body = nil, nil
	unhold()
	gone := c.stopWatch()
	c.watchStop = nil
	if gone {
		c.s.count(countClientAborted)
		return false
	}
	if panicked {
		c.rejectAndClose(500)
		return false
	}
	keep := req.KeepAlive && !c.s.closing.Load()
	if err := c.writeClient(lw.response(isHead, keep)); err != nil {
		return false
	}
	return keep
}

// response is the local handler's answer as sent: its status, its header
// fields but the framing ones, Content-Length, Connection: close when the
// connection ends, and the body (none for HEAD).
func (w *localWriter) response(isHead, keep bool) []byte {
	if w.status == 0 {
		w.status = 200
	}
	out := &w.out
	out.WriteString("HTTP/1.1 " + strconv.Itoa(w.status) + " " + StatusText(w.status) + "\r\n")
	w.h.Del("Content-Length")
	w.h.Del("Connection")
	w.h.Del("Transfer-Encoding")
	w.h.Write(out)
	out.WriteString("Content-Length: " + strconv.Itoa(w.body.Len()) + "\r\n")
	if !keep {
		out.WriteString("Connection: close\r\n")
	}
	out.WriteString("\r\n")
	if !isHead {
		out.Write(w.body.Bytes())
	}
	return out.Bytes()
}

// probeInLoop answers a probe (local reports one) on the event loop: the
// same handler and the same bytes as serveLocal, without a goroutine (load
// balancers and kubelets probe often), and returns what becomes of c
// (stepOn: it serves on). False if the request has a body or an Expect:
// then the goroutine path answers it.
func (l *loop) probeInLoop(c *conn, h http.Handler) (step, bool) {
	req := c.req
	if req.HasBody() || req.Expect100 {
		return stepOn, false
	}
	s := l.s
	s.counters.Requests.Add(1)
	s.counters.Local.Add(1)
	// The loop's writer and request are reused: a probe allocates
	// (almost) nothing.
	if l.probe == nil {
		l.probe = &localWriter{h: make(http.Header)}
		l.probeReq = &http.Request{Header: http.Header{}}
	}
	lw, hr := l.probe, l.probeReq
	lw.reset()
	clear(hr.Header)
	hr.Method = "GET"
	if !req.IsMethod("GET") {
		hr.Method = string(req.Method)
	}
	h.ServeHTTP(lw, hr)
	keep := req.KeepAlive && !s.closing.Load()
	out := lw.response(req.IsMethod("HEAD"), keep)
	c.r += req.HeadLen
	if n, err := unix.Write(c.fd, out); err != nil || n != len(out) || !keep {
		// An answer of a few hundred bytes the socket does not take at
		// once: the client is not reading; close.
		return leaveClose, true
	}
	return stepOn, true
}

// localReserve is what a local request's body may hold: its
// Content-Length, or MaxLocalBody for a chunked one (its size is known only
// once read).
func localReserve(req *httphead.Request) int64 {
	switch {
	case req.Chunked:
		return MaxLocalBody
	case req.ContentLength > MaxLocalBody:
		return 0 // refused with 413 by readLocalBody, nothing held
	case req.ContentLength > 0:
		return req.ContentLength
	}
	return 0
}

// runLocal runs a local handler; a panic in it (a bug) costs this request,
// answered 500, and not the process, as with net/http.
func (c *conn) runLocal(h http.Handler, w http.ResponseWriter, r *http.Request) (panicked bool) {
	defer func() {
		if v := recover(); v != nil {
			panicked = true
			c.s.cfg.Log.Error("local endpoint panicked", "path", r.URL.Path, "panic", v, "stack", string(debug.Stack()))
		}
	}()
	h.ServeHTTP(w, r)
	return false
}

// readLocalBody reads a local request's whole body (at most MaxLocalBody).
func (c *conn) readLocalBody() ([]byte, error) {
	req := c.req
	if req.ContentLength > MaxLocalBody {
		return nil, &httphead.Error{Status: 413, Reason: "local body too large"}
	}
	if req.Expect100 && req.HasBody() {
		if err := c.writeClient([]byte("HTTP/1.1 100 Continue\r\n\r\n")); err != nil {
			return nil, err
		}
	}
	deadline := time.Now().Add(c.s.cfg.IOTimeout)
	c.c.SetReadDeadline(deadline)
	switch {
	case req.ContentLength > 0:
		body := make([]byte, req.ContentLength)
		n := copy(body, c.buf[c.r:c.w])
		c.r += n
		if _, err := io.ReadFull(c.c, body[n:]); err != nil {
			return nil, err
		}
		return body, nil
	case req.Chunked:
		var sc httphead.Chunked
		var body []byte
		for !sc.Done() {
			if c.r == c.w {
				if c.buf == nil {
					c.buf = c.s.getBuf()
				}
				c.r = 0
				n, err := c.c.Read(c.buf)
				c.w = n
				if n == 0 {
					if err == nil {
						err = io.ErrUnexpectedEOF
					}
					return nil, err
				}
			}
			var used int
			var err error
			body, used, err = appendDechunked(body, &sc, c.buf[c.r:c.w])
			c.r += used
			if err != nil {
				return nil, err
			}
			if len(body) > MaxLocalBody {
				return nil, &httphead.Error{Status: 413, Reason: "local body too large"}
			}
		}
		return body, nil
	}
	return nil, nil
}

// isPath reports whether path is p, with or without a query.
func isPath(path []byte, p string) bool {
	if len(path) < len(p) || string(path[:len(p)]) != p {
		return false
	}
	return len(path) == len(p) || path[len(p)] == '?'
}
