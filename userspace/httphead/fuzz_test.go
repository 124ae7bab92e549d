package httphead

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"testing"

	"github.com/tether-rl/tether/testenv"
)

// fuzzLimits: the defaults, or small limits so that the limit paths (414,
// 431) are reachable by short inputs.
func fuzzLimits(small bool) Limits {
	if small {
		return Limits{RequestLine: 40, Head: 200, Fields: 6}
	}
	return Limits{}
}

func seedRequests(f *testing.F) {
	for _, tc := range requestAccepts {
		if len(tc.in) < 1024 {
			f.Add([]byte(tc.in), false)
			f.Add([]byte(tc.in), true)
		}
	}
	for _, tc := range requestRejects {
		if len(tc.in) < 1024 {
			f.Add([]byte(tc.in), false)
		}
	}
	f.Add([]byte(benchHead+"0123456789"), false)
	// The documented net/http disagreement (malformed percent-encoding).
	f.Add([]byte(head("GET /%zz?%q HTTP/1.1", "Host: a")), false)
	f.Add([]byte(head("GET http://a%41:8/x HTTP/1.1")), false)
	f.Add([]byte(head("GET http://[::1]:/?#x HTTP/1.1")), false)
	f.Add([]byte(head("GET / HTTP/1.1", "Host: [::1]", "Connection: x, close", "Connection: keep-alive")), false)
	f.Add([]byte(head("POST / HTTP/1.1", "Host: a", "Transfer-Encoding: chunked")+"5\r\nhello\r\n0\r\n\r\n"), false)
}

// summary renders everything ParseRequest reports, to compare two parses.
func summary(err error, r *Request) string {
	if err != nil {
		if err == ErrIncomplete {
			return "incomplete"
		}
		return fmt.Sprintf("error %d", statusOf(err))
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "%q %q %q %d host=%q/%v cl=%d ch=%v ka=%v e100=%v xff=%q len=%d\n",
		r.Method, r.Target, r.Path, r.Minor, r.Host, r.HostRewritten, r.ContentLength, r.Chunked,
		r.KeepAlive, r.Expect100, r.XFF, r.HeadLen)
	for _, f := range r.Fields {
		fmt.Fprintf(&sb, "%q %q %q %v\n", f.Name, f.Value, f.Line, f.Drop)
	}
	return sb.String()
}

var requestStatuses = []int{400, 405, 414, 417, 431, 501}

func FuzzParseRequest(f *testing.F) {
	seedRequests(f)
	f.Fuzz(func(t *testing.T, data []byte, small bool) {
		lim := fuzzLimits(small)
		var req Request
		err := ParseRequest(data, lim, &req)
		got := summary(err, &req)

		// Only ErrIncomplete or an *Error with a known status.
		if err != nil && err != ErrIncomplete && !slices.Contains(requestStatuses, statusOf(err)) {
			t.Fatalf("unexpected error %#v", err)
		}

		// The result does not depend on what the Request held before.
		dirty := Request{Fields: make([]Field, 3, 8), Host: b("x"), XFF: b("y"), HostRewritten: true,
			Chunked: true, ContentLength: 5, KeepAlive: true, Expect100: true, HeadLen: 99}
		if d := summary(ParseRequest(data, lim, &dirty), &dirty); d != got {
			t.Fatalf("reused Request: %s\nfresh: %s", d, got)
		}

		if err != nil {
			if err != ErrIncomplete {
				// A rejection is final: more bytes never make it acceptable.
				for _, more := range []string{"\r\n\r\n", "\n", "x: y\r\n\r\n"} {
					var r2 Request
					if e2 := ParseRequest(append(slices.Clip(data), more...), lim, &r2); e2 == nil || e2 == ErrIncomplete {
						t.Fatalf("rejected (%v) but accepted with %q appended: %v", err, more, e2)
					}
				}
			}
			return
		}

		// Structural invariants of an accepted head.
		if req.HeadLen < 4 || req.HeadLen > len(data) || string(data[req.HeadLen-4:req.HeadLen]) != "\r\n\r\n" {
			t.Fatalf("HeadLen %d of %d", req.HeadLen, len(data))
		}
		h := data[:req.HeadLen]
		for i, fl := range req.Fields {
			if !testenv.Within(fl.Line, h) || !bytes.HasSuffix(fl.Line, []byte("\r\n")) {
				t.Fatalf("field %d Line %q is not a CRLF line of the head", i, fl.Line)
			}
			if !testenv.Within(fl.Name, fl.Line) || !testenv.Within(fl.Value, fl.Line) || !isToken(fl.Name) {
				t.Fatalf("field %d Name/Value %q/%q not in its line", i, fl.Name, fl.Value)
			}
			if !bytes.HasPrefix(fl.Line, append(slices.Clip(fl.Name), ':')) {
				t.Fatalf("field %d line %q does not start with %q:", i, fl.Line, fl.Name)
			}
			if bytes.ContainsAny(fl.Value, "\r\n\x00") || bytes.HasPrefix(fl.Value, []byte(" ")) || bytes.HasSuffix(fl.Value, []byte(" ")) {
				t.Fatalf("field %d value %q", i, fl.Value)
			}
			if equalFold(fl.Name, "Host") && req.HostRewritten && !fl.Drop {
				t.Fatal("Host field kept with an absolute-form target")
			}
			// Nothing of an h2c offer reaches a worker (docs/http-framing.md rule 20): Upgrade is
			// among hopByHop, HTTP2-Settings goes named or not.
			for _, hop := range append([]string{"X-Forwarded-For", "HTTP2-Settings"}, hopByHop...) {
				if equalFold(fl.Name, hop) && !fl.Drop {
					t.Fatalf("hop-by-hop %q kept", fl.Name)
				}
			}
		}
		if req.ContentLength < -1 {
			t.Fatalf("ContentLength %d", req.ContentLength)
		}
		if req.Chunked && req.ContentLength >= 0 {
			t.Fatal("both chunked and Content-Length")
		}
		if req.Minor != 0 && req.Minor != 1 || req.KeepAlive && req.Minor != 1 || req.Chunked && req.Minor != 1 {
			t.Fatalf("Minor %d KeepAlive %v Chunked %v", req.Minor, req.KeepAlive, req.Chunked)
		}
		if !testenv.Within(req.Method, h) || !testenv.Within(req.Target, h) || !isToken(req.Method) || req.IsMethod("CONNECT") {
			t.Fatalf("method %q target %q", req.Method, req.Target)
		}
		if !req.HostRewritten && !bytes.Equal(req.Path, req.Target) || len(req.Path) == 0 ||
			req.Path[0] != '/' && string(req.Path) != "*" || bytes.IndexByte(req.Path, '#') >= 0 {
			t.Fatalf("Path %q for target %q", req.Path, req.Target)
		}
		if req.Minor == 1 && req.Host == nil {
			t.Fatal("HTTP/1.1 without a Host")
		}
		if len(req.Target) > lim.withDefaults().RequestLine || req.HeadLen > lim.withDefaults().Head || len(req.Fields) > lim.withDefaults().Fields {
			t.Fatalf("limits exceeded: target %d head %d fields %d", len(req.Target), req.HeadLen, len(req.Fields))
		}

		// Independent of what follows the head.
		for _, tail := range []string{"", "GET / HTTP/1.1\r\n\r\n", "\x00\r\n\n\r", strings.Repeat("z", 300)} {
			buf := append(slices.Clone(h), tail...)
			var r2 Request
			if s := summary(ParseRequest(buf, lim, &r2), &r2); s != got {
				t.Fatalf("with %q after the head:\n%s\nwithout:\n%s", tail, s, got)
			}
		}

		// Every proper prefix of the head is incomplete.
		step := 1
		if len(h) > 2048 {
			step = len(h)/1024 + 1
		}
		for n := 0; n < len(h); n += step {
			var r2 Request
			if e := ParseRequest(slices.Clone(h[:n]), lim, &r2); e != ErrIncomplete {
				t.Fatalf("prefix %d/%d: %v, want ErrIncomplete", n, len(h), e)
			}
		}
	})
}

// respSummary renders everything ParseResponse reports.
func respSummary(err error, r *Response) string {
	if err != nil {
		if err == ErrIncomplete {
			return "incomplete"
		}
		return fmt.Sprintf("error %d", statusOf(err))
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "%d %d cl=%d ch=%v close=%v len=%d\n", r.Minor, r.Status, r.ContentLength, r.Chunked, r.Close, r.HeadLen)
	for _, f := range r.Fields {
		fmt.Fprintf(&sb, "%q %q %q %v\n", f.Name, f.Value, f.Line, f.Drop)
	}
	return sb.String()
}

func FuzzParseResponse(f *testing.F) {
	for _, tc := range responseCases {
		f.Add([]byte(tc.in), false)
	}
	f.Add([]byte(head("HTTP/1.1 200 OK", "Connection: x-a, close", "X-A: 1", "Transfer-Encoding: chunked")+"2\r\nok\r\n0\r\n\r\n"), true)
	f.Fuzz(func(t *testing.T, data []byte, small bool) {
		lim := fuzzLimits(small)
		var resp Response
		err := ParseResponse(data, lim, &resp)
		got := respSummary(err, &resp)

		// Only ErrIncomplete or a 502: the backend broke the protocol.
		if err != nil && err != ErrIncomplete && statusOf(err) != 502 {
			t.Fatalf("unexpected error %#v", err)
		}
		dirty := Response{Fields: make([]Field, 3, 8), Chunked: true, ContentLength: 5, Close: true, HeadLen: 99, Status: 7}
		if d := respSummary(ParseResponse(data, lim, &dirty), &dirty); d != got {
			t.Fatalf("reused Response: %s\nfresh: %s", d, got)
		}
		if err != nil {
			if err != ErrIncomplete {
				for _, more := range []string{"\r\n\r\n", "\n", "x: y\r\n\r\n"} {
					var r2 Response
					if e2 := ParseResponse(append(slices.Clip(data), more...), lim, &r2); e2 == nil || e2 == ErrIncomplete {
						t.Fatalf("rejected (%v) but accepted with %q appended: %v", err, more, e2)
					}
				}
			}
			return
		}

		if resp.HeadLen < 4 || resp.HeadLen > len(data) || string(data[resp.HeadLen-4:resp.HeadLen]) != "\r\n\r\n" {
			t.Fatalf("HeadLen %d of %d", resp.HeadLen, len(data))
		}
		h := data[:resp.HeadLen]
		if resp.Status < 100 || resp.Status > 999 || resp.Minor != 0 && resp.Minor != 1 {
			t.Fatalf("status %d minor %d", resp.Status, resp.Minor)
		}
		if resp.Chunked && (resp.ContentLength >= 0 || resp.Minor == 0) || resp.ContentLength < -1 {
			t.Fatalf("framing: chunked %v CL %d minor %d", resp.Chunked, resp.ContentLength, resp.Minor)
		}
		// The framing tetherd relays by is the framing the client sees:
		// the field that carries it is never dropped (docs/http-framing.md rule 18).
		framing := 0
		for i, fl := range resp.Fields {
			if !testenv.Within(fl.Line, h) || !bytes.HasSuffix(fl.Line, []byte("\r\n")) || !isToken(fl.Name) ||
				!bytes.HasPrefix(fl.Line, append(slices.Clip(fl.Name), ':')) {
				t.Fatalf("field %d %q is not a header line of the head", i, fl.Line)
			}
			if bytes.ContainsAny(fl.Value, "\r\n\x00") {
				t.Fatalf("field %d value %q", i, fl.Value)
			}
			for _, hop := range hopByHop {
				if equalFold(fl.Name, hop) && !fl.Drop {
					t.Fatalf("hop-by-hop %q kept", fl.Name)
				}
			}
			if equalFold(fl.Name, "Content-Length") || equalFold(fl.Name, "Transfer-Encoding") {
				if fl.Drop {
					t.Fatalf("framing field %q dropped", fl.Name)
				}
				framing++
			}
		}
		if (resp.Chunked || resp.ContentLength >= 0) != (framing == 1) || framing > 1 {
			t.Fatalf("%d framing fields for chunked %v CL %d", framing, resp.Chunked, resp.ContentLength)
		}
		for _, tail := range []string{"", "HTTP/1.1 200 OK\r\n\r\n", "\x00\r\n\n\r", strings.Repeat("z", 300)} {
			var r2 Response
			if s := respSummary(ParseResponse(append(slices.Clone(h), tail...), lim, &r2), &r2); s != got {
				t.Fatalf("with %q after the head:\n%s\nwithout:\n%s", tail, s, got)
			}
		}
		step := 1
		if len(h) > 2048 {
			step = len(h)/1024 + 1
		}
		for n := 0; n < len(h); n += step {
			var r2 Response
			if e := ParseResponse(slices.Clone(h[:n]), lim, &r2); e != ErrIncomplete {
				t.Fatalf("prefix %d/%d: %v, want ErrIncomplete", n, len(h), e)
			}
		}
	})
}

func FuzzChunked(f *testing.F) {
	for _, tc := range chunkedValid {
		f.Add([]byte(tc.body), uint64(1))
		f.Add([]byte(tc.body+"GET / HTTP/1.1\r\n\r\n"), uint64(2))
	}
	for _, tc := range chunkedInvalid {
		if len(tc.body) < 1024 {
			f.Add([]byte(tc.body), uint64(3))
		}
	}
	f.Fuzz(func(t *testing.T, data []byte, seed uint64) {
		w := whole(data)
		if w.n < 0 || w.n > len(data) {
			t.Fatalf("n=%d for %d bytes", w.n, len(data))
		}
		if w.done && w.status != 0 || w.status != 0 && w.n >= len(data) {
			t.Fatalf("inconsistent result %v for %d bytes", w, len(data))
		}
		if w.n < len(data) && !w.done && w.status == 0 {
			t.Fatalf("stopped early without reason: %v", w)
		}
		if r := byteByByte(data); r != w {
			t.Fatalf("byte by byte %v, whole %v", r, w)
		}
		rng := rand.New(rand.NewPCG(seed, uint64(len(data))))
		for range 4 {
			if r := randomSplit(data, rng); r != w {
				t.Fatalf("random split %v, whole %v", r, w)
			}
		}
		for _, step := range []int{1, 1 + int(seed%13), 1 << 20} {
			if r := skipping(data, step); r != w {
				t.Fatalf("Data/Skip step %d: %v, whole %v", step, r, w)
			}
		}
		if w.done {
			// The body is self-delimiting: what follows does not matter.
			body := data[:w.n]
			if r := whole(body); r != w {
				t.Fatalf("body alone %v, with the rest %v", r, w)
			}
			for _, tail := range []string{"\r\n", "0\r\n\r\n", "\n\x00"} {
				if r := whole(append(slices.Clone(body), tail...)); r != w {
					t.Fatalf("body + %q: %v, want %v", tail, r, w)
				}
			}
		}
		if w.status != 0 {
			// The error is found at the offending byte: the bytes before it
			// are a valid prefix.
			if r := whole(data[:w.n]); r.status != 0 || r.done {
				t.Fatalf("prefix before the error %v", r)
			}
		}
	})
}

// validHostHeader is net/http's server-side Host check
// (golang.org/x/net/http/httpguts.ValidHostHeader): http.ReadRequest does
// not apply it, http.Server does.
func validHostHeader(h string) bool {
	for i := 0; i < len(h); i++ {
		c := h[i]
		ok := '0' <= c && c <= '9' || 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' ||
			strings.IndexByte("!$%&()*+,-.:;=[']_~", c) >= 0
		if !ok {
			return false
		}
	}
	return true
}

// FuzzRequestVsNetHTTP: whatever tether accepts, net/http accepts too and
// reads the same method, target, host and body framing. tether is stricter
// on purpose (obs-fold, bare LF, duplicate Content-Length, ...), so only this
// direction is checked.
func FuzzRequestVsNetHTTP(f *testing.F) {
	seedRequests(f)
	f.Fuzz(func(t *testing.T, data []byte, small bool) {
		var req Request
		if ParseRequest(data, fuzzLimits(small), &req) != nil {
			return
		}
		h := data[:req.HeadLen]
		// Justified: RFC 9112 §2.2 lets a server ignore empty lines before the
		// request line; http.ReadRequest does not (it reads the first line).
		for bytes.HasPrefix(h, []byte("\r\n")) {
			h = h[2:]
		}
		hr, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(h)))
		if err != nil {
			// Justified: net/http's url.ParseRequestURI rejects malformed
			// percent-encoding ("/%zz", "http://a%41/"); tether forwards the
			// target as received and leaves its percent-encoding to the
			// origin (docs/http-framing.md rule 10 bans only control and non-ASCII bytes).
			var ue *url.Error
			if errors.As(err, &ue) && bytes.IndexByte(req.Target, '%') >= 0 {
				if _, perr := url.ParseRequestURI(strings.ReplaceAll(string(req.Target), "%", "%25")); perr == nil {
					return
				}
			}
			t.Fatalf("tether accepts, net/http rejects: %v\n%q", err, h)
		}
		if hr.Method != string(req.Method) {
			t.Fatalf("method %q vs %q", hr.Method, req.Method)
		}
		if hr.RequestURI != string(req.Target) {
			t.Fatalf("target %q vs %q", hr.RequestURI, req.Target)
		}
		if hr.ProtoMajor != 1 || hr.ProtoMinor != req.Minor {
			t.Fatalf("version %s vs minor %d", hr.Proto, req.Minor)
		}
		wantHost := string(req.Host)
		if req.HostRewritten && bytes.IndexByte(req.Host, '%') >= 0 {
			// Justified: for an absolute-form target net/http's url package
			// percent-decodes the authority ("http://a%80/" gives Host
			// "a\x80"); tether forwards it as received, as the Host field,
			// which a backend reads without decoding (pct-encoded is legal
			// in a reg-name, RFC 3986 §3.2.2).
			if dec, err := url.PathUnescape(wantHost); err == nil {
				wantHost = dec
			}
		}
		if hr.Host != wantHost {
			t.Fatalf("host %q vs %q", hr.Host, req.Host)
		}
		if !validHostHeader(string(req.Host)) {
			t.Fatalf("tether accepts Host %q, net/http's server rejects it", req.Host)
		}
		if req.HostRewritten {
			// The origin-form tether forwards is what net/http understood.
			u, err := url.ParseRequestURI(string(req.Path))
			if err != nil {
				t.Fatalf("rewritten path %q: %v", req.Path, err)
			}
			if u.RequestURI() != hr.URL.RequestURI() {
				t.Fatalf("rewritten path %q vs net/http %q", u.RequestURI(), hr.URL.RequestURI())
			}
		}
		switch {
		case req.Chunked:
			if hr.ContentLength != -1 || len(hr.TransferEncoding) != 1 || hr.TransferEncoding[0] != "chunked" {
				t.Fatalf("chunked vs net/http CL=%d TE=%q", hr.ContentLength, hr.TransferEncoding)
			}
		case req.ContentLength >= 0:
			if hr.ContentLength != req.ContentLength || hr.TransferEncoding != nil {
				t.Fatalf("CL %d vs net/http CL=%d TE=%q", req.ContentLength, hr.ContentLength, hr.TransferEncoding)
			}
		default:
			if hr.ContentLength != 0 || hr.TransferEncoding != nil {
				t.Fatalf("no body vs net/http CL=%d TE=%q", hr.ContentLength, hr.TransferEncoding)
			}
		}
		if req.Minor == 1 && req.KeepAlive == hr.Close {
			t.Fatalf("KeepAlive %v vs net/http Close %v", req.KeepAlive, hr.Close)
		}
		if req.Minor == 0 && req.KeepAlive {
			t.Fatal("HTTP/1.0 kept alive")
		}
	})
}
