package pd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/jsonedit"
)

// legResult is a leg's answer: its head and either its first body bytes
// (first) or its whole body (whole), or the error that ended it first.
type legResult struct {
	resp *http.Response // body open only for a 2xx from first
	body []byte         // whole: the body kept (up to the limit); first: a non-2xx body
	err  error          // no head, or the body failed before its end (whole) / first bytes (first)
	buf  *[]byte        // first: the pooled buffer body lies in
}

// bufs are the 32 KiB buffers of a decode's first bytes and of the relay.
var bufs = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

func getBuf() *[]byte  { return bufs.Get().(*[]byte) }
func putBuf(b *[]byte) { bufs.Put(b) }

// done closes a first leg's answer and gives its buffer back.
func (l *legResult) done() {
	if l.resp != nil {
		l.resp.Body.Close()
	}
	if l.buf != nil {
		putBuf(l.buf)
		l.buf, l.body = nil, nil
	}
}

func (l *legResult) status() int {
	if l.resp == nil {
		return 0
	}
	return l.resp.StatusCode
}

// failed reports a leg that failed or answered 5xx.
func (l *legResult) failed() bool { return l.err != nil || l.status() >= 500 }

// hopByHop are the fields not passed between a client and an engine.
var hopByHop = []string{"Connection", "Keep-Alive", "Proxy-Connection", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade", "Content-Length", "Host",
	"Accept-Encoding"}

// legHeader is the header of both legs of an attempt: the client's
// end-to-end fields (none of hopByHop, nor any its Connection field
// lists), a Content-Type, and id in the protocol's request id header
// (id ""; none). The legs share it: the transport only reads it.
func (s *Server) legHeader(req *Request, id string) http.Header {
	var listed []string
	if c := req.Header.Get("Connection"); c != "" {
		for _, f := range strings.Split(c, ",") {
			listed = append(listed, http.CanonicalHeaderKey(strings.TrimSpace(f)))
		}
	}
	h := make(http.Header, len(req.Header)+2)
	for k, v := range req.Header {
		if !isHopByHop(k) && !slices.Contains(listed, k) {
			h[k] = v
		}
	}
	if len(h["Content-Type"]) == 0 || h["Content-Type"][0] == "" {
		h["Content-Type"] = []string{"application/json"}
	}
	if id != "" {
		h.Set(s.wire.RequestIDHeader, id)
	}
	return h
}

func isHopByHop(k string) bool {
	for _, h := range hopByHop {
		if k == h {
			return true
		}
	}
	return false
}

func (s *Server) legRequest(ctx context.Context, w Worker, req *Request, h http.Header, body []byte) (*http.Request, error) {
	method := req.Method
	if method == "" {
		method = http.MethodPost
	}
	hr, err := http.NewRequestWithContext(ctx, method, strings.TrimSuffix(w.URL, "/")+req.Path, bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("pd: %w", err)
	}
	hr.Header = h
	return hr, nil
}

// whole sends a leg and reads its whole answer, keeping up to keep bytes
// (the rest is read and dropped), on a goroutine of its own.
func (s *Server) whole(ctx context.Context, w Worker, req *Request, h http.Header, body []byte, keep int64) <-chan legResult {
	ch := make(chan legResult, 1)
	hr, err := s.legRequest(ctx, w, req, h, body)
	if err != nil {
		ch <- legResult{err: err}
		return ch
	}
	go func() { ch <- s.wholeOf(hr, keep) }()
	return ch
}

// wholeNow is whole in the caller's goroutine.
func (s *Server) wholeNow(ctx context.Context, w Worker, req *Request, h http.Header, body []byte, keep int64) legResult {
	hr, err := s.legRequest(ctx, w, req, h, body)
	if err != nil {
		return legResult{err: err}
	}
	return s.wholeOf(hr, keep)
}

func (s *Server) wholeOf(hr *http.Request, keep int64) legResult {
	resp, err := s.client.Do(hr)
	if err != nil {
		return legResult{err: err}
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, keep))
	if err == nil {
		_, err = io.Copy(io.Discard, resp.Body)
	}
	resp.Body.Close()
	return legResult{resp: resp, body: b, err: err}
}

// first sends a leg and waits for its head and, for a 2xx, its first body
// bytes (body, or nothing at an empty body's end); another status's body
// is read whole. It runs on a goroutine of its own.
func (s *Server) first(ctx context.Context, w Worker, req *Request, h http.Header, body []byte) <-chan legResult {
	ch := make(chan legResult, 1)
	hr, err := s.legRequest(ctx, w, req, h, body)
	if err != nil {
		ch <- legResult{err: err}
		return ch
	}
	go func() { ch <- s.firstOf(hr) }()
	return ch
}

// firstNow is first in the caller's goroutine.
func (s *Server) firstNow(ctx context.Context, w Worker, req *Request, h http.Header, body []byte) legResult {
	hr, err := s.legRequest(ctx, w, req, h, body)
	if err != nil {
		return legResult{err: err}
	}
	return s.firstOf(hr)
}

func (s *Server) firstOf(hr *http.Request) legResult {
	resp, err := s.client.Do(hr)
	if err != nil {
		return legResult{err: err}
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		b, err := io.ReadAll(io.LimitReader(resp.Body, s.cfg.MaxPrefillAnswer))
		resp.Body.Close()
		return legResult{resp: resp, body: b, err: err}
	}
	buf := getBuf()
	for {
		n, err := resp.Body.Read(*buf)
		if n > 0 || err != nil {
			if err == io.EOF {
				err = nil
			} else if err != nil {
				putBuf(buf)
				resp.Body.Close()
				return legResult{resp: resp, err: err}
			}
			return legResult{resp: resp, body: (*buf)[:n], buf: buf}
		}
	}
}

// drop closes whatever a cancelled leg still brings (in the background).
func (s *Server) drop(ch <-chan legResult) {
	if ch == nil {
		return
	}
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		l := <-ch
		l.done()
	}()
}

// abort asks an engine to abort rids (its abort by id, in dialect's
// words), all at once, each bounded by AbortTimeout, and waits for them.
func (s *Server) abort(w Worker, rids []string) {
	var wg sync.WaitGroup
	for _, call := range dialect.For(s.wire.Kind).AbortIDs(rids, nil) {
		rid := strings.Join(call.IDs, ",")
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), s.cfg.AbortTimeout)
			defer cancel()
			hr, err := http.NewRequestWithContext(ctx, call.Method, strings.TrimSuffix(w.URL, "/")+call.Path, bytes.NewReader(call.Body))
			if err == nil {
				hr.Header.Set("Content-Type", "application/json")
				var resp *http.Response
				if resp, err = s.client.Do(hr); err == nil {
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode > 299 {
						err = fmt.Errorf("status %d", resp.StatusCode)
					}
				}
			}
			if err != nil {
				s.Counters.AbortsFailed.Add(1)
				s.cfg.Log.Debug("pd: abort", "worker", w.URL, "rid", rid, "err", err)
				return
			}
			s.Counters.AbortsSent.Add(1)
		}()
	}
	wg.Wait()
}

// abortCall is an abort of rids at a worker (none: nothing to do).
type abortCall struct {
	w    Worker
	rids []string
}

func ridsIf(cond bool, rids []string) []string {
	if cond {
		return rids
	}
	return nil
}

// abortAll makes the abort calls at once, where the protocol aborts by id,
// and waits for them (each bounded by AbortTimeout).
func (s *Server) abortAll(calls ...abortCall) {
	if !s.wire.AbortsByID {
		return
	}
	var wg sync.WaitGroup
	for _, c := range calls {
		if len(c.rids) == 0 {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.abort(c.w, c.rids)
		}()
	}
	wg.Wait()
}

// closeLeg closes a leg's connection (vLLM aborts it so).
func (s *Server) closeLeg(cancel context.CancelFunc, ch <-chan legResult) {
	cancel()
	s.Counters.LegsCancelled.Add(1)
	s.drop(ch)
}

// cancelLeg closes a leg's connection and, where the protocol aborts by
// id, aborts its rids.
func (s *Server) cancelLeg(cancel context.CancelFunc, ch <-chan legResult, w Worker, rids []string) {
	s.closeLeg(cancel, ch)
	s.abortAll(abortCall{w, rids})
}

// lateLeg lets a prefill still running when its decode ended answer for
// PrefillGrace, then cancels and aborts it; in the background.
func (s *Server) lateLeg(cancel context.CancelFunc, ch <-chan legResult, w Worker, rids []string) {
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		t := time.NewTimer(s.cfg.PrefillGrace)
		defer t.Stop()
		select {
		case <-ch:
			cancel()
		case <-t.C:
			s.Counters.LateCancels.Add(1)
			s.cancelLeg(cancel, nil, w, rids)
		}
	}()
}

// writeError answers an error of tether's own, in OpenAI's shape.
func writeError(w ResponseWriter, status int, typ, msg string) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(errorJSON(status, typ, msg))))
	w.WriteHeader(status)
	w.Write(errorJSON(status, typ, msg))
}

func errorJSON(status int, typ, msg string) []byte {
	b := []byte(`{"error":{"message":`)
	b = jsonedit.AppendString(b, msg)
	b = append(b, `,"type":`...)
	b = jsonedit.AppendString(b, typ)
	b = append(b, `,"code":`...)
	b = strconv.AppendInt(b, int64(status), 10)
	return append(b, "}}"...)
}

// copyHead copies an engine's header fields to the client's answer.
func copyHead(dst, src http.Header, keepLength bool) {
	for k, v := range src {
		dst[k] = v
	}
	for _, k := range hopByHop {
		if k == "Content-Length" && keepLength {
			continue
		}
		dst.Del(k)
	}
}

// forward answers the client with a leg's whole non-2xx answer as it is.
func forward(w ResponseWriter, l *legResult, route string, routeHeader string) {
	copyHead(w.Header(), l.resp.Header, false)
	w.Header().Set("Content-Length", strconv.Itoa(len(l.body)))
	if routeHeader != "" {
		w.Header().Set(routeHeader, route)
	}
	w.WriteHeader(l.resp.StatusCode)
	w.Write(l.body)
}

// errClient is a client that could not be written to.
var errClient = errors.New("pd: the client is gone")

func flush(w ResponseWriter) {
	if f, ok := w.(interface{ Flush() }); ok {
		f.Flush()
	}
}
