package proxy

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/tether-rl/tether/userspace/pd"
)

// fakePD answers as its fn says; it takes POST /generate.
type fakePD struct {
	fn    func(ctx context.Context, w pd.ResponseWriter, req *pd.Request) error
	ready atomic.Bool
	last  atomic.Pointer[pd.Request]
}

func (f *fakePD) Takes(method, path []byte) bool {
	return string(method) == "POST" && string(path) == "/generate"
}
func (f *fakePD) Serve(ctx context.Context, w pd.ResponseWriter, req *pd.Request) error {
	f.last.Store(req)
	return f.fn(ctx, w, req)
}
func (f *fakePD) Ready() (bool, bool) { return true, f.ready.Load() }

// TestPDHook: a request the P/D hook takes reaches Serve with its head and
// whole body (Content-Length or chunked); the answer's framing: its
// Content-Length, else chunked with every write flushed, HTTP/1.0 ended by
// the close; a failure after a chunked body began ends it without its last
// chunk (an event stream: properly, its error event in it) and closes the
// connection; other paths are proxied as before; readiness follows Ready.
func TestPDHook(t *testing.T) {
	f := &fakePD{}
	var mode atomic.Value
	f.fn = func(_ context.Context, w pd.ResponseWriter, req *pd.Request) error {
		switch mode.Load().(string) {
		case "length":
			w.Header().Set("Content-Length", "5")
			w.Header().Set("X-Tether-Route", "p0+d1 test")
			w.WriteHeader(200)
			w.Write([]byte("hello"))
		case "stream":
			w.Header().Set("Content-Type", "text/event-stream")
			w.WriteHeader(200)
			for _, ev := range []string{"data: 1\n\n", "data: 2\n\n", "data: [DONE]\n\n"} {
				w.Write([]byte(ev))
				w.(interface{ Flush() }).Flush()
			}
		case "cut":
			w.WriteHeader(200)
			w.Write([]byte("partial"))
			return errors.New("decode broke")
		case "sse-error":
			w.Header().Set("Content-Type", "text/event-stream")
			w.WriteHeader(200)
			w.Write([]byte("data: 1\n\n"))
			w.Write([]byte(`data: {"error":{"message":"decode failed"}}` + "\n\n"))
			return errors.New("decode broke")
		}
		return nil
	}
	backend := httpBackend(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "proxied") }))
	p := startProxy(t, []string{backend}, func(c *Config) { c.PD = f })

	mode.Store("length")
	resp, body := p.roundTrip("POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 12\r\nX-A: b\r\n\r\n{\"text\":\"a\"}")
	if resp.StatusCode != 200 || body != "hello" || resp.ContentLength != 5 || resp.Header.Get("X-Tether-Route") != "p0+d1 test" {
		t.Fatalf("length: %d %q %v", resp.StatusCode, body, resp.Header)
	}
	if r := f.last.Load(); r.Method != "POST" || r.Path != "/generate" || string(r.Body) != `{"text":"a"}` || r.Header.Get("X-A") != "b" {
		t.Fatalf("Serve got %+v", r)
	}
	mode.Store("stream")
	resp, body = p.roundTrip("POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n2\r\n1}\r\n0\r\n\r\n")
	if resp.StatusCode != 200 || body != "data: 1\n\ndata: 2\n\ndata: [DONE]\n\n" || len(resp.TransferEncoding) != 1 {
		t.Fatalf("stream: %d %q %v", resp.StatusCode, body, resp.TransferEncoding)
	}
	if r := f.last.Load(); string(r.Body) != `{"a":1}` {
		t.Fatalf("chunked body: %q", r.Body)
	}
	resp, body = p.roundTrip("POST /generate HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}")
	if resp.StatusCode != 200 || body != "data: 1\n\ndata: 2\n\ndata: [DONE]\n\n" || !resp.Close {
		t.Fatalf("HTTP/1.0: %d %q close=%v", resp.StatusCode, body, resp.Close)
	}
	// Cut: the client sees a body that ends without its last chunk.
	mode.Store("cut")
	c, br := p.dial()
	io.WriteString(c, "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
	r, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if b, err := io.ReadAll(r.Body); err == nil || string(b) != "partial" {
		t.Fatalf("cut: %q %v, want the partial body and an error", b, err)
	}
	mode.Store("sse-error")
	c, br = p.dial()
	io.WriteString(c, "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
	resp, body = readResp(t, br, false)
	if !strings.HasSuffix(body, `data: {"error":{"message":"decode failed"}}`+"\n\n") {
		t.Fatalf("sse error: %q", body)
	}
	if n, err := br.ReadByte(); err != io.EOF {
		t.Fatalf("the connection goes on after a failed answer: %v %v", n, err)
	}
	// Not taken: proxied.
	if resp, body := p.roundTrip("POST /v1/other HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"); body != "proxied" {
		t.Fatalf("other path: %d %q", resp.StatusCode, body)
	}
	// Readiness: a P/D fleet without a healthy pair is not ready.
	if resp, _ := p.roundTrip("GET /readiness HTTP/1.1\r\nHost: x\r\n\r\n"); resp.StatusCode != 503 {
		t.Fatalf("readiness without a pair: %d", resp.StatusCode)
	}
	f.ready.Store(true)
	if resp, _ := p.roundTrip("GET /readiness HTTP/1.1\r\nHost: x\r\n\r\n"); resp.StatusCode != 200 {
		t.Fatalf("readiness with a pair: %d", resp.StatusCode)
	}
}
