package proxy

// The P/D hook: in a fleet of prefill and decode workers, a generation
// request is served over a pair (userspace/pd) instead of being proxied to
// one worker. The event loop hands it to the goroutine path (loop_head.go
// asks pdTakes), which waits in the fleet's hold like any generation
// request, reads the whole body (at most MaxLocalBody), and calls
// Config.PD.Serve with a writer over the client connection (pdWriter: the
// answer's status and fields, its body framed by Content-Length, chunked,
// or by the connection's end for an HTTP/1.0 client).

import (
	"bufio"
	"context"
	"errors"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/pd"
)

// PD serves generation requests over prefill/decode pairs.
type PD interface {
	// Takes reports whether the request goes to a pair. Event loops ask
	// it of every request: it must not block or allocate.
	Takes(method, path []byte) bool
	// Serve answers req on w (pd.Server.Serve with the router's
	// chooser); ctx ends when the client leaves.
	Serve(ctx context.Context, w pd.ResponseWriter, req *pd.Request) error
	// Ready reports whether the fleet is a P/D fleet (active) and, if so,
	// whether it can serve (a healthy prefill and a healthy decode):
	// /health and /readiness say so.
	Ready() (active, ready bool)
}

// pdTakes reports whether c's (parsed) request goes to a pair.
func (c *conn) pdTakes() bool {
	p := c.s.cfg.PD
	return p != nil && p.Takes(c.req.Method, c.req.Path)
}

// servePD serves c's request over a pair; it reports whether the
// connection may carry another.
func (c *conn) servePD() bool {
	req := c.req
	if lim := c.s.cfg.MaxBodyBytes; lim > 0 && req.ContentLength > lim {
		c.s.count(countRejected)
		c.rejectAndClose(413)
		return false
	}
	var until time.Time
	for c.held(nil) {
		if ok, keep := c.holdWait(nil, &until); !ok {
			return keep
		}
	}
	// Everything is taken from the head before the body is read (it may
	// be read into the buffer the head was parsed from).
	preq := &pd.Request{Method: string(req.Method), Path: string(req.Path), Header: make(http.Header, len(req.Fields))}
	for i := range req.Fields {
		f := &req.Fields[i]
		preq.Header.Add(string(f.Name), string(f.Value))
	}
	w := &pdWriter{c: c, h: make(http.Header), minor: req.Minor, isHead: req.IsMethod("HEAD"),
		keep: req.KeepAlive && !c.s.closing.Load(), length: -1}
	body, err := c.readLocalBody()
	if err != nil {
		c.rejectBody(err)
		return false
	}
	preq.Body = body
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c.watchLocal(cancel)
	serr := c.s.cfg.PD.Serve(ctx, w, preq)
	gone := c.stopWatch()
	c.watchStop = nil
	c.c.SetReadDeadline(time.Time{})
	if gone {
		c.s.count(countClientAborted)
		w.release()
		return false
	}
	// The connection stays on its goroutine while idle (to IdleTimeout)
	// instead of going back to its loop: every generation request of a
	// P/D fleet is served here, and the handover each way (a descriptor
	// lent as a net.Conn and given back) cost more than the rest of the
	// proxy's work on a request.
	c.noPark = true
	return w.finish(serr)
}

// rejectBody answers a body that could not be read (too large, broken:
// its status; too slow: 408), as serveLocal does; a connection error
// closes quietly.
func (c *conn) rejectBody(err error) {
	if e, ok := err.(*httphead.Error); ok {
		c.rejectAndClose(e.Status)
	} else if isTimeout(err) {
		c.rejectAndClose(408)
	}
}

// errNoPDAnswer: Serve returned without writing an answer.
var errNoPDAnswer = errors.New("proxy: no answer from the prefill/decode pair")

// pdWriter is pd.Serve's writer over the client connection.
type pdWriter struct {
	c       *conn
	h       http.Header
	bw      *bufio.Writer
	minor   int
	isHead  bool
	keep    bool
	wrote   bool
	status  int
	chunked bool
	noBody  bool
	length  int64 // Content-Length given (-1: none)
	sent    int64
	err     error
	scratch []byte
}

func (w *pdWriter) Header() http.Header { return w.h }

// deadlineWriter writes to the client, each write bounded by IOTimeout.
type deadlineWriter struct{ c *conn }

func (d deadlineWriter) Write(p []byte) (int, error) {
	d.c.c.SetWriteDeadline(time.Now().Add(d.c.s.cfg.IOTimeout))
	return d.c.c.Write(p)
}

func (w *pdWriter) WriteHeader(code int) {
	if w.wrote || code < 200 {
		return
	}
	w.wrote, w.status = true, code
	w.bw = pdBufs.Get().(*bufio.Writer)
	w.bw.Reset(deadlineWriter{w.c})
	h := w.h
	for _, k := range []string{"Connection", "Keep-Alive", "Transfer-Encoding", "Trailer", "Upgrade", "Proxy-Connection"} {
		h.Del(k)
	}
	w.length = -1
	if v := h.Get("Content-Length"); v != "" {
		if n, err := strconv.ParseInt(v, 10, 64); err == nil && n >= 0 {
			w.length = n
		} else {
			h.Del("Content-Length")
		}
	}
	switch {
	case code == 204 || code == 304 || w.isHead:
		w.noBody = true
	case w.length >= 0:
	case w.minor >= 1:
		w.chunked = true
	default:
		w.keep = false // HTTP/1.0: the body ends with the connection
	}
	b := w.scratch[:0]
	b = append(b, "HTTP/1.1 "...)
	b = strconv.AppendInt(b, int64(code), 10)
	b = append(b, ' ')
	b = append(b, StatusText(code)...)
	b = append(b, "\r\n"...)
	w.bw.Write(b)
	h.Write(w.bw)
	if w.chunked {
		w.bw.WriteString("Transfer-Encoding: chunked\r\n")
	}
	if !w.keep {
		w.bw.WriteString("Connection: close\r\n")
	}
	w.bw.WriteString("\r\n")
}

func (w *pdWriter) Write(p []byte) (int, error) {
	if !w.wrote {
		w.WriteHeader(http.StatusOK)
	}
	if w.err != nil {
		return 0, w.err
	}
	if w.noBody || len(p) == 0 {
		return len(p), nil
	}
	if w.length >= 0 && w.sent+int64(len(p)) > w.length {
		p = p[:w.length-w.sent] // never past the length announced
	}
	if w.chunked {
		b := strconv.AppendInt(w.scratch[:0], int64(len(p)), 16)
		b = append(b, "\r\n"...)
		w.bw.Write(b)
	}
	_, err := w.bw.Write(p)
	if w.chunked && err == nil {
		_, err = w.bw.WriteString("\r\n")
	}
	if err != nil {
		w.err = err
		return 0, err
	}
	w.sent += int64(len(p))
	return len(p), nil
}

// Flush sends what is buffered (pd flushes after every piece of a
// streamed answer).
func (w *pdWriter) Flush() {
	if w.bw != nil && w.err == nil {
		w.err = w.bw.Flush()
	}
}

// finish ends the answer after Serve returned serr, and reports whether
// the connection may carry another request. An answer that failed after
// its head (serr set while a chunked body ran) is ended without its last
// chunk unless it is an event stream (the error event is in it: ended
// properly), and the connection closes either way.
func (w *pdWriter) finish(serr error) bool {
	if !w.wrote {
		// Serve always answers; a writer it never wrote to is a bug there.
		w.h.Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadGateway)
		w.Write([]byte(`{"error":{"code":502,"message":"no answer from the prefill/decode pair"}}`))
		serr = errNoPDAnswer
	}
	complete := true
	switch {
	case w.noBody:
	case w.chunked:
		if serr == nil || isEventStream(w.h) {
			w.bw.WriteString("0\r\n\r\n")
		} else {
			complete = false
		}
	case w.length >= 0:
		complete = w.sent == w.length
	default:
		complete = false // ends with the connection
	}
	w.Flush()
	ok := w.err == nil && complete && w.keep && serr == nil
	w.release()
	return ok
}

// pdBufs are pdWriter's buffers, one per answer being written.
var pdBufs = sync.Pool{New: func() any { return bufio.NewWriterSize(nil, 32<<10) }}

// release gives the writer's buffer back; nothing is written after.
func (w *pdWriter) release() {
	if w.bw != nil {
		w.bw.Reset(nil)
		pdBufs.Put(w.bw)
		w.bw = nil
		if w.err == nil {
			w.err = errAnswerDone
		}
	}
}

// errAnswerDone: a write after the answer was finished.
var errAnswerDone = errors.New("proxy: the prefill/decode answer is finished")

func isEventStream(h http.Header) bool {
	ct := h.Get("Content-Type")
	return len(ct) >= 17 && ct[:17] == "text/event-stream"
}
