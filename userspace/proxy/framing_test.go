package proxy

import (
	"bytes"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
)

// Requests of docs/http-framing.md that tether must reject:
// the status, Connection: close, the connection closed after the answer,
// and not one byte of the message at the backend.
func TestRequestFramingRejected(t *testing.T) {
	const h = "Host: a\r\n"
	post := func(fields, body string) string {
		return "POST /sessions/w0-a/x HTTP/1.1\r\n" + h + fields + "\r\n" + body
	}
	chunked := func(body string) string { return post("Transfer-Encoding: chunked\r\n", body) }
	longLine := "GET /" + strings.Repeat("a", 9000) + " HTTP/1.1\r\n" + h + "\r\n"
	bigHead := "GET / HTTP/1.1\r\n" + h + strings.Repeat("X-Big: "+strings.Repeat("b", 1000)+"\r\n", 70) + "\r\n"
	manyFields := "GET / HTTP/1.1\r\n" + h + strings.Repeat("X-F: 1\r\n", 200) + "\r\n"
	var amplified strings.Builder // many tiny chunks with long extensions
	for i := 0; i < 200; i++ {
		amplified.WriteString("1;" + strings.Repeat("e", 30) + "\r\nx\r\n")
	}
	amplified.WriteString("0\r\n\r\n")

	cases := []struct {
		row, name, raw string
		status         int
	}{
		{"1", "TE and CL", post("Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", "0\r\n\r\n"), 400},
		{"1", "CL and TE", post("Transfer-Encoding: chunked\r\nContent-Length: 5\r\n", "0\r\n\r\n"), 400},
		{"2", "chunked not last", post("Transfer-Encoding: chunked, gzip\r\n", "0\r\n\r\n"), 400},
		{"2", "chunked twice", post("Transfer-Encoding: chunked, chunked\r\n", "0\r\n\r\n"), 400},
		{"2", "two TE fields", post("Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n", "0\r\n\r\n"), 400},
		{"2", "identity", post("Transfer-Encoding: identity\r\n", ""), 400},
		{"2", "gzip alone", post("Transfer-Encoding: gzip\r\n", ""), 400},
		{"2", "empty TE", post("Transfer-Encoding: \r\n", ""), 400},
		{"2", "quoted", post("Transfer-Encoding: \"chunked\"\r\n", "0\r\n\r\n"), 400},
		{"2", "xchunked", post("Transfer-Encoding: xchunked\r\n", "0\r\n\r\n"), 400},
		{"2", "unsupported coding", post("Transfer-Encoding: gzip, chunked\r\n", "0\r\n\r\n"), 501},
		{"3", "TE in HTTP/1.0", "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400},
		{"4", "two CL", post("Content-Length: 5\r\nContent-Length: 5\r\n", "hello"), 400},
		{"4", "CL list", post("Content-Length: 5, 5\r\n", "hello"), 400},
		{"4", "CL plus", post("Content-Length: +5\r\n", "hello"), 400},
		{"4", "CL minus", post("Content-Length: -5\r\n", "hello"), 400},
		{"4", "CL inner space", post("Content-Length: 5 5\r\n", "hello"), 400},
		{"4", "CL hex", post("Content-Length: 0x5\r\n", "hello"), 400},
		{"4", "CL 20 digits", post("Content-Length: 00000000000000000005\r\n", "hello"), 400},
		{"6", "obs-fold", "GET / HTTP/1.1\r\n" + h + "X-A: b\r\n c\r\n\r\n", 400},
		{"6", "obs-fold tab", "GET / HTTP/1.1\r\n" + h + "X-A: b\r\n\tc\r\n\r\n", 400},
		{"7", "bare LF in head", "GET / HTTP/1.1\n" + h + "\r\n", 400},
		{"7", "bare LF ending head", "GET / HTTP/1.1\r\n" + h + "\n", 400},
		{"7", "bare CR in field", "GET / HTTP/1.1\r\n" + h + "X-A: b\rc\r\n\r\n", 400},
		{"7", "bare LF after chunk data", chunked("5\r\nhello\n0\r\n\r\n"), 400},
		{"7", "bare CR in chunk size line", chunked("5\rhello\r\n0\r\n\r\n"), 400},
		{"7", "bare LF ending chunked body", chunked("0\r\n\n"), 400},
		{"8", "NUL in value", "GET / HTTP/1.1\r\n" + h + "X-A: b\x00c\r\n\r\n", 400},
		{"8", "DEL in value", "GET / HTTP/1.1\r\n" + h + "X-A: b\x7fc\r\n\r\n", 400},
		{"8", "control in value", "GET / HTTP/1.1\r\n" + h + "X-A: b\x01c\r\n\r\n", 400},
		{"8", "bad name byte", "GET / HTTP/1.1\r\n" + h + "X(A): b\r\n\r\n", 400},
		{"8", "space in name", "GET / HTTP/1.1\r\n" + h + "X A: b\r\n\r\n", 400},
		{"9", "space before colon", "GET / HTTP/1.1\r\nHost : a\r\n\r\n", 400},
		{"9", "space before first field", "GET / HTTP/1.1\r\n " + h + "\r\n", 400},
		{"10", "double space", "GET  / HTTP/1.1\r\n" + h + "\r\n", 400},
		{"10", "missing space", "GET /HTTP/1.1\r\n" + h + "\r\n", 400},
		{"10", "trailing space", "GET / HTTP/1.1 \r\n" + h + "\r\n", 400},
		{"10", "HTTP/2.0", "GET / HTTP/2.0\r\n" + h + "\r\n", 400},
		{"10", "lowercase version", "GET / http/1.1\r\n" + h + "\r\n", 400},
		{"10", "HTTP/0.9", "GET /\r\n\r\n", 400},
		{"10", "method not a token", "G@T / HTTP/1.1\r\n" + h + "\r\n", 400},
		{"10", "control byte in target", "GET /a\x01b HTTP/1.1\r\n" + h + "\r\n", 400},
		{"10", "non-ASCII in target", "GET /\xc3\xa9 HTTP/1.1\r\n" + h + "\r\n", 400},
		{"12", "no Host", "GET / HTTP/1.1\r\n\r\n", 400},
		{"12", "two Host", "GET / HTTP/1.1\r\n" + h + h + "\r\n", 400},
		{"12", "bad Host", "GET / HTTP/1.1\r\nHost: a/b\r\n\r\n", 400},
		{"12", "Host with userinfo", "GET / HTTP/1.1\r\nHost: u@a\r\n\r\n", 400},
		{"13", "request line too long", longLine, 414},
		{"13", "head too large", bigHead, 431},
		{"13", "too many fields", manyFields, 431},
		{"14", "0x size", chunked("0x5\r\nhello\r\n0\r\n\r\n"), 400},
		{"14", "plus size", chunked("+5\r\nhello\r\n0\r\n\r\n"), 400},
		{"14", "underscore size", chunked("5_0\r\nhello\r\n0\r\n\r\n"), 400},
		{"14", "space before size", chunked(" 5\r\nhello\r\n0\r\n\r\n"), 400},
		{"14", "space inside size", chunked("5 0\r\nhello\r\n0\r\n\r\n"), 400},
		{"14", "17 hex digits", chunked("00000000000000005\r\nhello\r\n0\r\n\r\n"), 400},
		{"14", "no CRLF after data", chunked("5\r\nhelloX\r\n0\r\n\r\n"), 400},
		{"14", "no size", chunked("\r\nhello\r\n0\r\n\r\n"), 400},
		{"17", "unknown expectation", "GET / HTTP/1.1\r\n" + h + "Expect: 200-ok\r\n\r\n", 417},
		{"18", "Connection names CL", post("Connection: Content-Length\r\nContent-Length: 5\r\n", "hello"), 400},
		{"18", "Connection names TE", post("Connection: Transfer-Encoding\r\nTransfer-Encoding: chunked\r\n", "0\r\n\r\n"), 400},
		{"18", "Connection names Host", "GET / HTTP/1.1\r\n" + h + "Connection: Host\r\n\r\n", 400},
		{"18", "Connection names XFF", "GET / HTTP/1.1\r\n" + h + "Connection: close, X-Forwarded-For\r\nX-Forwarded-For: 1.2.3.4\r\n\r\n", 400},
		// CVE-2025-22871 (Go): bare LF ending a chunk size line.
		{"CVE-2025-22871", "bare LF after chunk size", chunked("5\nhello\r\n0\r\n\r\n"), 400},
		{"CVE-2025-22871", "bare LF after chunk ext", chunked("5;a=b\nhello\r\n0\r\n\r\n"), 400},
		// CVE-2025-55315 (Kestrel): LF inside a chunk extension.
		{"CVE-2025-55315", "LF in chunk extension", chunked("5;a\nb\r\nhello\r\n0\r\n\r\n"), 400},
		{"CVE-2025-55315", "CR in chunk extension", chunked("5;a\rb\r\nhello\r\n0\r\n\r\n"), 400},
		// CVE-2023-39326 (Go): chunk-extension amplification.
		{"CVE-2023-39326", "one huge extension", chunked("1;" + strings.Repeat("e", 5000) + "\r\nx\r\n0\r\n\r\n"), 400},
		{"CVE-2023-39326", "many small extensions", chunked(amplified.String()), 400},
	}

	be := newBackend(t, func(c *bconn) { io.Copy(io.Discard, c) })
	p := startProxy(t, []string{be.addr}, nil)
	for _, tc := range cases {
		t.Run(tc.row+"/"+tc.name, func(t *testing.T) {
			be.reset()
			c, br := p.dial()
			// A write may fail once the proxy answered and closed.
			c.Write([]byte(tc.raw))
			raw := readAll(t, c, br) // EOF: the proxy closed the connection
			resp, body := splitResponse(t, raw, "GET")
			if resp.StatusCode != tc.status {
				t.Fatalf("status %d, want %d (%q)", resp.StatusCode, tc.status, raw)
			}
			if !resp.Close || !bytes.Contains(raw, []byte("\r\nConnection: close\r\n")) {
				t.Fatalf("no Connection: close in %q", raw)
			}
			if string(body) != fixedError(tc.status) {
				t.Fatalf("body %q, want the fixed error", body)
			}
			be.waitIdle(t, 2*time.Second)
			if got := be.received(); len(got) > 0 {
				t.Fatalf("the backend received %q", got)
			}
		})
	}
}

// docs/http-framing.md rule 20: an `Upgrade: h2c` offer is never taken. The request
// is served over HTTP/1.1 with Upgrade, HTTP2-Settings and the Connection
// tokens naming them removed, on the loop's path and on the goroutine's
// alike; nothing h2c reaches the worker, and the client connection stays
// an HTTP/1.1 keep-alive one. Another upgrade (websocket) is stripped the
// same way: tether tunnels none.
func TestUpgradeH2CServedOverHTTP11(t *testing.T) {
	const offer = "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n"
	for _, tc := range []struct {
		name, req, body string
		loop            bool // the event loop runs it (else a goroutine)
	}{
		{"loop GET", "GET /a HTTP/1.1\r\nHost: a\r\n" + offer + "X-Kept: 1\r\n\r\n", "", true},
		{"loop POST", "POST /a HTTP/1.1\r\nHost: a\r\nUpgrade: h2c\r\nContent-Length: 5\r\nConnection: http2-settings, upgrade\r\nhttp2-settings: AAMAAABkAAQAAP__\r\nX-Kept: 1\r\n\r\nhello", "hello", true},
		{"loop Upgrade alone", "GET /a HTTP/1.1\r\nHost: a\r\nUpgrade: H2C\r\nX-Kept: 1\r\n\r\n", "", true},
		{"loop HTTP2-Settings alone", "GET /a HTTP/1.1\r\nHost: a\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\nX-Kept: 1\r\n\r\n", "", true},
		{"loop websocket and h2c", "GET /a HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket, h2c\r\nX-Kept: 1\r\n\r\n", "", true},
		{"goroutine chunked", "POST /a HTTP/1.1\r\nHost: a\r\n" + offer + "Transfer-Encoding: chunked\r\nX-Kept: 1\r\n\r\n5\r\nhello\r\n0\r\n\r\n", "hello", false},
		{"goroutine Expect", "POST /a HTTP/1.1\r\nHost: a\r\n" + offer + "Expect: 100-continue\r\nContent-Length: 5\r\nX-Kept: 1\r\n\r\nhello", "hello", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			heads := make(chan string, 4)
			be := newBackend(t, func(c *bconn) {
				for {
					head, body, err := c.readRequest()
					if err != nil {
						return
					}
					heads <- head + "\n" + string(body)
					fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
				}
			})
			// The worker sends no 100: the body goes up after this wait.
			p := startProxy(t, []string{be.addr}, func(c *Config) { c.Waits.Continue = 20 * time.Millisecond })
			c, br := p.dial()
			for i := range 2 { // the client connection stays open for the next request
				handoffs := p.srv.Counters().Handoffs.Load()
				io.WriteString(c, tc.req)
				c.SetReadDeadline(time.Now().Add(10 * time.Second))
				line, err := br.Peek(12)
				if err == nil && string(line) == "HTTP/1.1 100" && strings.Contains(tc.req, "Expect: 100-continue") {
					readHeadFrom(br) // the interim answer to Expect, then the final one
					line, err = br.Peek(12)
				}
				if err != nil || string(line) != "HTTP/1.1 200" {
					t.Fatalf("request %d: %q (%v), want HTTP/1.1 200 (no 101, no 400)", i, line, err)
				}
				resp, body := readResp(t, br, false)
				if resp.StatusCode != 200 || body != tc.body || resp.Close || resp.Header.Get("Upgrade") != "" {
					t.Fatalf("request %d: %d close=%v upgrade=%q %q", i, resp.StatusCode, resp.Close, resp.Header.Get("Upgrade"), body)
				}
				got := <-heads
				low := strings.ToLower(got)
				for _, banned := range []string{"upgrade", "http2-settings", "connection:", "h2c", "websocket"} {
					if strings.Contains(low, banned) {
						t.Fatalf("request %d: the worker saw %q:\n%s", i, banned, got)
					}
				}
				if !strings.Contains(got, "\r\nX-Kept: 1") || !strings.HasSuffix(got, "\n"+tc.body) {
					t.Fatalf("request %d: the worker got\n%s", i, got)
				}
				if ran := p.srv.Counters().Handoffs.Load() == handoffs; ran != tc.loop {
					t.Fatalf("request %d: run by the loop %v, want %v", i, ran, tc.loop)
				}
			}
		})
	}
}

// Backend responses with bad framing (rows 22-23): 502 before anything was
// sent, and the backend connection is closed, never reused.
func TestResponseFramingBad(t *testing.T) {
	cases := []struct{ name, resp string }{
		{"CL and TE", "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"},
		{"two CL", "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello"},
		{"CL list", "HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\nhello"},
		{"CL sign", "HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\nhello"},
		{"TE gzip", "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nhello"},
		{"TE in HTTP/1.0", "HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"},
		{"two-digit status", "HTTP/1.1 20 OK\r\nContent-Length: 0\r\n\r\n"},
		{"HTTP/2 status line", "HTTP/2 200 OK\r\nContent-Length: 0\r\n\r\n"},
		{"no status line", "Content-Length: 0\r\n\r\n"},
		{"garbage", "hello there\r\n\r\n"},
		{"status without space", "HTTP/1.1 200OK\r\nContent-Length: 0\r\n\r\n"},
		{"obs-fold", "HTTP/1.1 200 OK\r\nX-A: b\r\n c\r\nContent-Length: 0\r\n\r\n"},
		{"bare LF", "HTTP/1.1 200 OK\nContent-Length: 0\n\n"},
		{"bad field name", "HTTP/1.1 200 OK\r\nX A: b\r\nContent-Length: 0\r\n\r\n"},
		{"bad chunk size", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n"},
		{"101 not asked for", "HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			upstreamEOF := make(chan struct{})
			be := newBackend(t, func(c *bconn) {
				if _, err := readHeadFrom(c.br); err != nil {
					return
				}
				io.WriteString(c, tc.resp)
				if _, err := io.Copy(io.Discard, c); err == nil {
					close(upstreamEOF)
				}
			})
			p := startProxy(t, []string{be.addr}, nil)
			c, br := p.dial()
			io.WriteString(c, "GET / HTTP/1.1\r\nHost: a\r\n\r\n")
			raw := readAll(t, c, br)
			resp, body := splitResponse(t, raw, "GET")
			if resp.StatusCode != 502 || !resp.Close || string(body) != sentError(502) {
				t.Fatalf("got %q, want the fixed 502 with Connection: close", raw)
			}
			select {
			case <-upstreamEOF:
			case <-time.After(2 * time.Second):
				t.Fatal("backend connection kept open")
			}
			if p.table.Get(0).Pool.Idle() != 0 {
				t.Fatal("broken backend connection pooled")
			}
		})
	}
}

// Row 24: more than Content-Length, or a body where none may be, is not
// forwarded, and the backend connection is not reused; the client
// connection goes on.
func TestResponseExtraBytes(t *testing.T) {
	cases := []struct {
		name, method, resp, body string
	}{
		{"more than CL", "GET", "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhelloEXTRA", "hello"},
		{"body after 204", "GET", "HTTP/1.1 204 No Content\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nforgd", ""},
		{"body after 304", "GET", "HTTP/1.1 304 Not Modified\r\n\r\nEXTRA", ""},
		{"body after HEAD", "HEAD", "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			upstreamEOF := make(chan struct{})
			be := newBackend(t, func(c *bconn) {
				if _, err := readHeadFrom(c.br); err != nil {
					return
				}
				if c.n == 1 {
					io.WriteString(c, tc.resp)
					if _, err := io.Copy(io.Discard, c); err == nil {
						close(upstreamEOF)
					}
					return
				}
				io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecond")
				io.Copy(io.Discard, c)
			})
			p := startProxy(t, []string{be.addr}, nil)
			c, br := p.dial()
			fmt.Fprintf(c, "%s /first HTTP/1.1\r\nHost: a\r\n\r\n", tc.method)
			resp, body := readResp(t, br, tc.method == "HEAD")
			if body != tc.body {
				t.Fatalf("first response %d body %q, want %q", resp.StatusCode, body, tc.body)
			}
			select {
			case <-upstreamEOF:
			case <-time.After(2 * time.Second):
				t.Fatal("backend connection with extra bytes kept open")
			}
			// The client connection is intact: the next answer is the
			// second backend connection's, not the leftover bytes.
			io.WriteString(c, "GET /second HTTP/1.1\r\nHost: a\r\n\r\n")
			resp, body = readResp(t, br, false)
			if resp.StatusCode != 200 || body != "second" {
				t.Fatalf("second response %d %q", resp.StatusCode, body)
			}
			if a := be.accepts.Load(); a != 2 {
				t.Fatalf("backend accepts %d, want 2", a)
			}
		})
	}
}

// Row 18: hop-by-hop fields never reach the backend; every other field
// does, byte-identical and in order (the Connection field may come after
// the fields it names: CVE-2021-33197 was about removal order).
func TestHopByHopRemoved(t *testing.T) {
	heads := make(chan string, 1)
	be := newBackend(t, func(c *bconn) {
		h, err := readHeadFrom(c.br)
		if err != nil {
			return
		}
		heads <- h
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
		io.Copy(io.Discard, c)
	})
	p := startProxy(t, []string{be.addr}, nil)
	c, br := p.dial()
	io.WriteString(c, "GET /hop?q=1 HTTP/1.1\r\n"+
		"X-Foo: a\r\n"+
		"Host: a.example:8080\r\n"+
		"Connection: X-Foo, keep-alive, x-baz\r\n"+
		"Keep-Alive: timeout=5\r\n"+
		"X-Bar:   spaced\tvalue  \r\n"+
		"TE: trailers\r\n"+
		"Upgrade: websocket\r\n"+
		"Proxy-Connection: keep-alive\r\n"+
		"user-agent: t/1\r\n"+
		"X-Baz: gone\r\n"+
		"Accept: */*\r\n"+
		"Connection: Proxy-Authenticate\r\n"+
		"X-Foo: b\r\n"+
		"Cookie: a=1; b=2\r\n"+
		"\r\n")
	resp, _ := readResp(t, br, false)
	if resp.StatusCode != 200 || resp.Close {
		t.Fatalf("status %d close=%v", resp.StatusCode, resp.Close)
	}
	want := "GET /hop?q=1 HTTP/1.1\r\n" +
		"Host: a.example:8080\r\n" +
		"X-Bar:   spaced\tvalue  \r\n" +
		"user-agent: t/1\r\n" +
		"Accept: */*\r\n" +
		"Cookie: a=1; b=2\r\n" +
		"X-Forwarded-For: 127.0.0.1\r\n" +
		"\r\n"
	if got := <-heads; got != want {
		t.Fatalf("backend head\n%q\nwant\n%q", got, want)
	}
}

// Row 14, missing last chunk: the head and the valid chunks were already
// streamed, so "forward nothing" cannot hold; what must hold is that the
// backend never sees a complete message and its connection is closed.
func TestRequestMissingLastChunk(t *testing.T) {
	upstreamEOF := make(chan []byte, 1)
	be := newBackend(t, func(c *bconn) {
		b, _ := io.ReadAll(c)
		upstreamEOF <- b
	})
	p := startProxy(t, []string{be.addr}, nil)
	c, br := p.dial()
	io.WriteString(c, "POST /up HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
	testenv.WaitFor(t, "the valid chunk streamed to the backend", func() bool { return bytes.Contains(be.received(), []byte("hello")) })
	c.(interface{ CloseWrite() error }).CloseWrite()
	raw := readAll(t, c, br) // the client connection is closed
	if bytes.HasPrefix(raw, []byte("HTTP/1.1 2")) {
		t.Fatalf("a success for a truncated body: %q", raw)
	}
	select {
	case got := <-upstreamEOF:
		if bytes.Contains(got, []byte("0\r\n\r\n")) {
			t.Fatalf("the backend saw a terminated body: %q", got)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("backend connection kept open")
	}
}
