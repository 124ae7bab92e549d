package httphead

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"
)

// head joins lines with CRLF and ends the head with the empty line.
func head(lines ...string) string { return strings.Join(lines, "\r\n") + "\r\n\r\n" }

// statusOf returns the Status of an *Error, 0 for nil and -1 for anything
// else (ErrIncomplete included).
func statusOf(err error) int {
	var e *Error
	switch {
	case err == nil:
		return 0
	case errors.As(err, &e):
		return e.Status
	}
	return -1
}

type rejectCase struct {
	row    int // docs/http-framing.md rule
	name   string
	in     string
	lim    Limits
	status int
}

var longLine = "GET /" + strings.Repeat("a", DefaultRequestLine-len("GET / HTTP/1.1")) // exactly DefaultRequestLine with " HTTP/1.1"

var requestRejects = []rejectCase{
	// 1: TE and CL.
	{1, "TE+CL", head("POST / HTTP/1.1", "Host: a", "Transfer-Encoding: chunked", "Content-Length: 5"), Limits{}, 400},
	{1, "CL+TE", head("POST / HTTP/1.1", "Host: a", "Content-Length: 5", "Transfer-Encoding: chunked"), Limits{}, 400},
	{1, "CL+TE 0", head("POST / HTTP/1.1", "Host: a", "Content-Length: 0", "Transfer-Encoding: chunked"), Limits{}, 400},
	// 2: Transfer-Encoding other than exactly chunked.
	{2, "TE gzip, chunked", head("POST / HTTP/1.1", "Host: a", "Transfer-Encoding: gzip, chunked"), Limits{}, 501},
	{2, "TE deflate,chunked", head("POST / HTTP/1.1", "Host: a", "Transfer-Encoding: deflate,chunked"), Limits{}, 501},
	{2, "TE chunked, gzip", head("POST / HTTP/1.1", "Host: a", "Transfer-Encoding: chunked, gzip"), Limits{}, 400},
	{2, "TE chunked, chunked", head("POST / HTTP/1.1", "Host: a", "Transfer-Encoding: chunked, chunked"), Limits{}, 400},
	{2, "TE repeated field", head("POST / HTTP/1.1", "Host: a", "Transfer-Encoding: chunked", "Transfer-Encoding: chunked"), Limits{}, 400},
	{2, "TE split over fields", head("POST / HTTP/1.1", "Host: a", "Transfer-Encoding: gzip", "Transfer-Encoding: chunked"), Limits{}, 400},
	{2, "TE identity", head("POST / HTTP/1.1", "Host: a", "Transfer-Encoding: identity"), Limits{}, 400},
	{2, "TE identity, chunked", head("POST / HTTP/1.1", "Host: a", "Transfer-Encoding: identity, chunked"), Limits{}, 400},
	{2, "TE gzip", head("POST / HTTP/1.1", "Host: a", "Transfer-Encoding: gzip"), Limits{}, 400},
	{2, "TE empty", head("POST / HTTP/1.1", "Host: a", "Transfer-Encoding:"), Limits{}, 400},
	{2, "TE blank", head("POST / HTTP/1.1", "Host: a", "Transfer-Encoding:   "), Limits{}, 400},
	{2, "TE quoted", head("POST / HTTP/1.1", "Host: a", `Transfer-Encoding: "chunked"`), Limits{}, 400},
	{2, "TE xchunked", head("POST / HTTP/1.1", "Host: a", "Transfer-Encoding: xchunked"), Limits{}, 400},
	{2, "TE chunkedx", head("POST / HTTP/1.1", "Host: a", "Transfer-Encoding: chunkedx"), Limits{}, 400},
	{2, "TE chunked;q", head("POST / HTTP/1.1", "Host: a", "Transfer-Encoding: chunked;q=1"), Limits{}, 400},
	{2, "TE empty element", head("POST / HTTP/1.1", "Host: a", "Transfer-Encoding: , chunked"), Limits{}, 400},
	{2, "TE inner space", head("POST / HTTP/1.1", "Host: a", "Transfer-Encoding: chun ked"), Limits{}, 400},
	{2, "TE vertical tab", head("POST / HTTP/1.1", "Host: a", "Transfer-Encoding: \vchunked"), Limits{}, 400},
	// 3: TE in HTTP/1.0.
	{3, "TE in 1.0", head("POST / HTTP/1.0", "Transfer-Encoding: chunked"), Limits{}, 400},
	{3, "TE in 1.0 with Host", head("POST / HTTP/1.0", "Host: a", "Transfer-Encoding: chunked"), Limits{}, 400},
	// 4: Content-Length.
	{4, "CL twice same", head("POST / HTTP/1.1", "Host: a", "Content-Length: 5", "Content-Length: 5"), Limits{}, 400},
	{4, "CL twice different", head("POST / HTTP/1.1", "Host: a", "Content-Length: 5", "Content-Length: 6"), Limits{}, 400},
	{4, "CL list", head("POST / HTTP/1.1", "Host: a", "Content-Length: 5, 5"), Limits{}, 400},
	{4, "CL list no space", head("POST / HTTP/1.1", "Host: a", "Content-Length: 5,5"), Limits{}, 400},
	{4, "CL plus", head("POST / HTTP/1.1", "Host: a", "Content-Length: +5"), Limits{}, 400},
	{4, "CL minus", head("POST / HTTP/1.1", "Host: a", "Content-Length: -1"), Limits{}, 400},
	{4, "CL inner space", head("POST / HTTP/1.1", "Host: a", "Content-Length: 1 0"), Limits{}, 400},
	{4, "CL hex", head("POST / HTTP/1.1", "Host: a", "Content-Length: 0x10"), Limits{}, 400},
	{4, "CL hex digits", head("POST / HTTP/1.1", "Host: a", "Content-Length: 1a"), Limits{}, 400},
	{4, "CL empty", head("POST / HTTP/1.1", "Host: a", "Content-Length:"), Limits{}, 400},
	{4, "CL 20 digits", head("POST / HTTP/1.1", "Host: a", "Content-Length: 00000000000000000001"), Limits{}, 400},
	{4, "CL 19 digits overflow", head("POST / HTTP/1.1", "Host: a", "Content-Length: 9223372036854775808"), Limits{}, 400},
	{4, "CL 19 nines", head("POST / HTTP/1.1", "Host: a", "Content-Length: 9999999999999999999"), Limits{}, 400},
	{4, "CL decimal point", head("POST / HTTP/1.1", "Host: a", "Content-Length: 5.0"), Limits{}, 400},
	{4, "CL unicode digit", head("POST / HTTP/1.1", "Host: a", "Content-Length: \xd9\xa5"), Limits{}, 400},
	// 6: obs-fold.
	{6, "obs-fold SP", head("GET / HTTP/1.1", "Host: a", "X-A: 1", " 2"), Limits{}, 400},
	{6, "obs-fold HT", head("GET / HTTP/1.1", "Host: a", "X-A: 1", "\t2"), Limits{}, 400},
	{6, "obs-fold of Host", head("GET / HTTP/1.1", "Host: a", " b"), Limits{}, 400},
	// 7: bare LF / bare CR.
	{7, "bare LF after request line", "GET / HTTP/1.1\nHost: a\r\n\r\n", Limits{}, 400},
	{7, "bare LF after field", "GET / HTTP/1.1\r\nHost: a\n\r\n", Limits{}, 400},
	{7, "bare LF final line", "GET / HTTP/1.1\r\nHost: a\r\n\n", Limits{}, 400},
	{7, "bare LF leading line", "\nGET / HTTP/1.1\r\nHost: a\r\n\r\n", Limits{}, 400},
	{7, "bare LF head", "GET / HTTP/1.1\nHost: a\n\n", Limits{}, 400},
	{7, "bare CR in request line", "GET /\r HTTP/1.1\r\nHost: a\r\n\r\n", Limits{}, 400},
	{7, "bare CR line ending", "GET / HTTP/1.1\rHost: a\r\n\r\n", Limits{}, 400},
	{7, "bare CR in value", head("GET / HTTP/1.1", "Host: a", "X-A: 1\r2"), Limits{}, 400},
	{7, "bare CR final", "GET / HTTP/1.1\r\nHost: a\r\n\r\r\n", Limits{}, 400},
	{7, "CR CR LF", "GET / HTTP/1.1\r\r\nHost: a\r\n\r\n", Limits{}, 400},
	{7, "bare CR unterminated", "GET / HTTP/1.1\r\nHost: a\rX", Limits{}, 400},
	// 8: control bytes in values, bad names.
	{8, "NUL in value", head("GET / HTTP/1.1", "Host: a", "X-A: 1\x002"), Limits{}, 400},
	{8, "SOH in value", head("GET / HTTP/1.1", "Host: a", "X-A: \x01"), Limits{}, 400},
	{8, "DEL in value", head("GET / HTTP/1.1", "Host: a", "X-A: \x7f"), Limits{}, 400},
	{8, "ESC in value", head("GET / HTTP/1.1", "Host: a", "X-A: \x1b[0m"), Limits{}, 400},
	{8, "VT in value", head("GET / HTTP/1.1", "Host: a", "X-A: a\vb"), Limits{}, 400},
	{8, "NUL in Host", head("GET / HTTP/1.1", "Host: a\x00b"), Limits{}, 400},
	{8, "empty name", head("GET / HTTP/1.1", "Host: a", ": x"), Limits{}, 400},
	{8, "no colon", head("GET / HTTP/1.1", "Host: a", "X-A"), Limits{}, 400},
	{8, "name with paren", head("GET / HTTP/1.1", "Host: a", "X(A): 1"), Limits{}, 400},
	{8, "name with slash", head("GET / HTTP/1.1", "Host: a", "X/A: 1"), Limits{}, 400},
	{8, "name with at", head("GET / HTTP/1.1", "Host: a", "X@A: 1"), Limits{}, 400},
	{8, "name with quote", head("GET / HTTP/1.1", "Host: a", `"X": 1`), Limits{}, 400},
	{8, "name non-ASCII", head("GET / HTTP/1.1", "Host: a", "X-\xc3\xa9: 1"), Limits{}, 400},
	{8, "name NUL", head("GET / HTTP/1.1", "Host: a", "X\x00: 1"), Limits{}, 400},
	{8, "name tab", head("GET / HTTP/1.1", "Host: a", "X\tA: 1"), Limits{}, 400},
	// 9: whitespace before colon, before the first field.
	{9, "SP before colon", head("GET / HTTP/1.1", "Host : a"), Limits{}, 400},
	{9, "HT before colon", head("GET / HTTP/1.1", "Host\t: a"), Limits{}, 400},
	{9, "SP before colon CL", head("POST / HTTP/1.1", "Host: a", "Content-Length : 5"), Limits{}, 400},
	{9, "SP before colon TE", head("POST / HTTP/1.1", "Host: a", "Transfer-Encoding : chunked"), Limits{}, 400},
	{9, "SP before first field", head("GET / HTTP/1.1", " Host: a"), Limits{}, 400},
	{9, "HT before first field", head("GET / HTTP/1.1", "\tHost: a"), Limits{}, 400},
	// 10: bad request line.
	{10, "leading space", head(" GET / HTTP/1.1", "Host: a"), Limits{}, 400},
	{10, "two spaces after method", head("GET  / HTTP/1.1", "Host: a"), Limits{}, 400},
	{10, "two spaces before version", head("GET /  HTTP/1.1", "Host: a"), Limits{}, 400},
	{10, "trailing space", head("GET / HTTP/1.1 ", "Host: a"), Limits{}, 400},
	{10, "tab separator", head("GET\t/ HTTP/1.1", "Host: a"), Limits{}, 400},
	{10, "no version (HTTP/0.9)", "GET /\r\n\r\n", Limits{}, 400},
	{10, "HTTP/0.9 bare", "GET /\r\n", Limits{}, 400},
	{10, "method only", head("GET", "Host: a"), Limits{}, 400},
	{10, "empty lines then a partial line: incomplete, not an error", "\r\n\r\nX", Limits{}, -1},
	{10, "HTTP/1.2", head("GET / HTTP/1.2", "Host: a"), Limits{}, 400},
	{10, "HTTP/2.0", head("GET / HTTP/2.0", "Host: a"), Limits{}, 400},
	{10, "HTTP/0.9 version", head("GET / HTTP/0.9", "Host: a"), Limits{}, 400},
	{10, "http lowercase", head("GET / http/1.1", "Host: a"), Limits{}, 400},
	{10, "HTTP/1.10", head("GET / HTTP/1.10", "Host: a"), Limits{}, 400},
	{10, "HTTP/01.1", head("GET / HTTP/01.1", "Host: a"), Limits{}, 400},
	{10, "HTTP/1", head("GET / HTTP/1", "Host: a"), Limits{}, 400},
	{10, "method with slash", head("G/ET / HTTP/1.1", "Host: a"), Limits{}, 400},
	{10, "method with colon", head("GET: / HTTP/1.1", "Host: a"), Limits{}, 400},
	{10, "method non-ASCII", head("G\xc9T / HTTP/1.1", "Host: a"), Limits{}, 400},
	{10, "method NUL", head("G\x00T / HTTP/1.1", "Host: a"), Limits{}, 400},
	{10, "target NUL", head("GET /\x00 HTTP/1.1", "Host: a"), Limits{}, 400},
	{10, "target tab", head("GET /a\tb HTTP/1.1", "Host: a"), Limits{}, 400},
	{10, "target DEL", head("GET /\x7f HTTP/1.1", "Host: a"), Limits{}, 400},
	{10, "target non-ASCII", head("GET /caf\xc3\xa9 HTTP/1.1", "Host: a"), Limits{}, 400},
	{10, "target high byte", head("GET /\xff HTTP/1.1", "Host: a"), Limits{}, 400},
	{10, "target fragment", head("GET /a#b HTTP/1.1", "Host: a"), Limits{}, 400},
	{10, "target relative", head("GET a/b HTTP/1.1", "Host: a"), Limits{}, 400},
	{10, "target ftp scheme", head("GET ftp://a/ HTTP/1.1", "Host: a"), Limits{}, 400},
	// 11: target forms.
	{11, "asterisk with GET", head("GET * HTTP/1.1", "Host: a"), Limits{}, 400},
	{11, "asterisk with lowercase options", head("options * HTTP/1.1", "Host: a"), Limits{}, 400},
	{11, "authority-form with GET", head("GET a.example:443 HTTP/1.1", "Host: a.example:443"), Limits{}, 400},
	{11, "CONNECT authority-form", head("CONNECT a.example:443 HTTP/1.1", "Host: a.example:443"), Limits{}, 405},
	{11, "CONNECT origin-form", head("CONNECT / HTTP/1.1", "Host: a"), Limits{}, 405},
	{11, "CONNECT absolute-form", head("CONNECT http://a/ HTTP/1.1", "Host: a"), Limits{}, 405},
	{11, "absolute-form userinfo", head("GET http://u:p@a/ HTTP/1.1", "Host: a"), Limits{}, 400},
	{11, "absolute-form empty authority", head("GET http:///x HTTP/1.1", "Host: a"), Limits{}, 400},
	{11, "absolute-form bad port", head("GET http://a:b/ HTTP/1.1", "Host: a"), Limits{}, 400},
	{11, "absolute-form fragment", head("GET http://a#f HTTP/1.1", "Host: a"), Limits{}, 400},
	{11, "absolute-form path fragment", head("GET http://a/p#f HTTP/1.1", "Host: a"), Limits{}, 400},
	{11, "absolute-form bad IPv6", head("GET http://[::1/ HTTP/1.1", "Host: a"), Limits{}, 400},
	{11, "absolute-form bad Host field", head("GET http://a/ HTTP/1.1", "Host: a b"), Limits{}, 400},
	{11, "absolute-form two Host fields", head("GET http://a/ HTTP/1.1", "Host: a", "Host: b"), Limits{}, 400},
	// 12: Host.
	{12, "1.1 without Host", head("GET / HTTP/1.1", "X-A: 1"), Limits{}, 400},
	{12, "1.1 without fields", head("GET / HTTP/1.1"), Limits{}, 400},
	{12, "two Host", head("GET / HTTP/1.1", "Host: a", "Host: a"), Limits{}, 400},
	{12, "two Host different", head("GET / HTTP/1.1", "Host: a", "host: b"), Limits{}, 400},
	{12, "two Host in 1.0", head("GET / HTTP/1.0", "Host: a", "Host: b"), Limits{}, 400},
	{12, "Host list", head("GET / HTTP/1.1", "Host: a, b"), Limits{}, 400},
	{12, "Host space", head("GET / HTTP/1.1", "Host: a b"), Limits{}, 400},
	{12, "Host slash", head("GET / HTTP/1.1", "Host: a/b"), Limits{}, 400},
	{12, "Host userinfo", head("GET / HTTP/1.1", "Host: u@a"), Limits{}, 400},
	{12, "Host hash", head("GET / HTTP/1.1", "Host: a#b"), Limits{}, 400},
	{12, "Host question", head("GET / HTTP/1.1", "Host: a?b"), Limits{}, 400},
	{12, "Host backslash", head("GET / HTTP/1.1", `Host: a\b`), Limits{}, 400},
	{12, "Host pipe", head("GET / HTTP/1.1", "Host: a|b"), Limits{}, 400},
	{12, "Host bad port", head("GET / HTTP/1.1", "Host: a:8o"), Limits{}, 400},
	{12, "Host two colons", head("GET / HTTP/1.1", "Host: a:1:2"), Limits{}, 400},
	{12, "Host unclosed IPv6", head("GET / HTTP/1.1", "Host: [::1"), Limits{}, 400},
	{12, "Host IPv6 junk", head("GET / HTTP/1.1", "Host: [::1]x"), Limits{}, 400},
	{12, "Host IPv6 bad char", head("GET / HTTP/1.1", "Host: [::g]"), Limits{}, 400},
	{12, "Host IPv6 empty", head("GET / HTTP/1.1", "Host: []"), Limits{}, 400},
	{12, "Host IPv6 one group", head("GET / HTTP/1.1", "Host: [1]:80"), Limits{}, 400},
	{12, "Host IPv6 colons", head("GET / HTTP/1.1", "Host: [:::]"), Limits{}, 400},
	{12, "Host IPv6 too many groups", head("GET / HTTP/1.1", "Host: [1:2:3:4:5:6:7:8:9]"), Limits{}, 400},
	{12, "Host IPv4 in brackets", head("GET / HTTP/1.1", "Host: [1.2.3.4]"), Limits{}, 400},
	{11, "absolute-form empty IPv6", head("GET http://[]:/ HTTP/1.1", "Host: a"), Limits{}, 400},
	{12, "Host non-ASCII", head("GET / HTTP/1.1", "Host: \xc3\xa9.example"), Limits{}, 400},
	// 13: limits.
	{13, "request line over limit", head(longLine+"a HTTP/1.1", "Host: a"), Limits{}, 414},
	{13, "request line over limit, incomplete", longLine + "a HTTP/1.1", Limits{}, 414},
	{13, "request line over small limit", head("GET /abcdef HTTP/1.1", "Host: a"), Limits{RequestLine: 19}, 414},
	{13, "head over limit", head("GET / HTTP/1.1", "Host: a", "X-A: "+strings.Repeat("b", 200)), Limits{Head: 200}, 431},
	{13, "head over limit, incomplete", "GET / HTTP/1.1\r\nHost: a\r\nX-A: " + strings.Repeat("b", 300), Limits{Head: 200}, 431},
	{13, "head over limit by the final CRLF", head("GET / HTTP/1.1", "Host: a") + "", Limits{Head: len(head("GET / HTTP/1.1", "Host: a")) - 1}, 431},
	{13, "too many fields", head("GET / HTTP/1.1", "Host: a", "A: 1", "B: 2", "C: 3"), Limits{Fields: 3}, 431},
	{13, "too many fields default", head(append([]string{"GET / HTTP/1.1", "Host: a"}, repeatField("X-A: 1", DefaultFields)...)...), Limits{}, 431},
	// 17: Expect.
	{17, "Expect foo", head("POST / HTTP/1.1", "Host: a", "Expect: foo", "Content-Length: 1"), Limits{}, 417},
	{17, "Expect empty", head("POST / HTTP/1.1", "Host: a", "Expect:"), Limits{}, 417},
	{17, "Expect 100-continue list", head("POST / HTTP/1.1", "Host: a", "Expect: 100-continue, foo"), Limits{}, 417},
	{17, "Expect 100-continue param", head("POST / HTTP/1.1", "Host: a", "Expect: 100-continue;a=b"), Limits{}, 417},
	{17, "Expect 102-processing", head("POST / HTTP/1.1", "Host: a", "Expect: 102-processing"), Limits{}, 417},
	// 18: Connection naming a protected field.
	{18, "Connection names Content-Length", head("POST / HTTP/1.1", "Host: a", "Connection: Content-Length", "Content-Length: 5"), Limits{}, 400},
	{18, "Connection names Transfer-Encoding", head("POST / HTTP/1.1", "Host: a", "Connection: transfer-encoding", "Transfer-Encoding: chunked"), Limits{}, 400},
	{18, "Connection names Host", head("GET / HTTP/1.1", "Host: a", "Connection: close, HOST"), Limits{}, 400},
	{18, "Connection names X-Forwarded-For", head("GET / HTTP/1.1", "Host: a", "Connection: X-Forwarded-For"), Limits{}, 400},
	{18, "Connection names XFF in second field", head("GET / HTTP/1.1", "Host: a", "Connection: keep-alive", "Connection: x-forwarded-for"), Limits{}, 400},
	{18, "Connection names protected after 8 others", head("GET / HTTP/1.1", "Host: a", "Connection: a1, a2, a3, a4, a5, a6, a7, a8, a9, Host"), Limits{}, 400},
	{18, "Connection bad token", head("GET / HTTP/1.1", "Host: a", "Connection: a b"), Limits{}, 400},
	{18, "Connection quoted", head("GET / HTTP/1.1", "Host: a", `Connection: "close"`), Limits{}, 400},
}

func repeatField(f string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = f
	}
	return out
}

func TestParseRequestRejects(t *testing.T) {
	var req Request
	for _, tc := range requestRejects {
		t.Run(fmt.Sprintf("row%d/%s", tc.row, tc.name), func(t *testing.T) {
			err := ParseRequest([]byte(tc.in), tc.lim, &req)
			if got := statusOf(err); got != tc.status {
				t.Fatalf("ParseRequest(%q) = %v (status %d), want status %d", trunc(tc.in), err, got, tc.status)
			}
			// A rejection is final: more bytes must not change it.
			if tc.status > 0 {
				err2 := ParseRequest([]byte(tc.in+"GET / HTTP/1.1\r\n\r\n"), tc.lim, &req)
				if statusOf(err2) <= 0 {
					t.Fatalf("with more bytes: %v, want a rejection", err2)
				}
			}
		})
	}
}

func trunc(s string) string {
	if len(s) > 120 {
		return s[:100] + fmt.Sprintf("...(%d bytes)", len(s))
	}
	return s
}

// acceptCase is a valid head and what ParseRequest must make of it.
type acceptCase struct {
	row  int
	name string
	in   string
	lim  Limits
	want Request // Fields: only Name/Value/Drop are compared, see check
	// drops lists the names (as received) of dropped fields, in order.
	drops []string
}

var requestAccepts = []acceptCase{
	{5, "GET no body", head("GET / HTTP/1.1", "Host: a"), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: -1, KeepAlive: true}, nil},
	{4, "POST CL", head("POST /x?y=1 HTTP/1.1", "Host: a.example:8080", "Content-Length: 42"), Limits{},
		Request{Method: b("POST"), Target: b("/x?y=1"), Path: b("/x?y=1"), Minor: 1, Host: b("a.example:8080"), ContentLength: 42, KeepAlive: true}, nil},
	{4, "CL zero", head("POST / HTTP/1.1", "Host: a", "Content-Length: 0"), Limits{},
		Request{Method: b("POST"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: 0, KeepAlive: true}, nil},
	{4, "CL OWS", head("POST / HTTP/1.1", "Host: a", "Content-Length: \t 7 \t"), Limits{},
		Request{Method: b("POST"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: 7, KeepAlive: true}, nil},
	{4, "CL leading zeros", head("POST / HTTP/1.1", "Host: a", "Content-Length: 007"), Limits{},
		Request{Method: b("POST"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: 7, KeepAlive: true}, nil},
	{4, "CL max int64", head("POST / HTTP/1.1", "Host: a", "content-length: 9223372036854775807"), Limits{},
		Request{Method: b("POST"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: 1<<63 - 1, KeepAlive: true}, nil},
	{2, "TE chunked", head("POST / HTTP/1.1", "Host: a", "Transfer-Encoding: chunked"), Limits{},
		Request{Method: b("POST"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: -1, Chunked: true, KeepAlive: true}, nil},
	{2, "TE CHUNKED OWS", head("POST / HTTP/1.1", "Host: a", "transfer-encoding: \tCHUNKED "), Limits{},
		Request{Method: b("POST"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: -1, Chunked: true, KeepAlive: true}, nil},
	{19, "HTTP/1.0 no Host", head("GET /a HTTP/1.0"), Limits{},
		Request{Method: b("GET"), Target: b("/a"), Path: b("/a"), Minor: 0, ContentLength: -1}, nil},
	{19, "HTTP/1.0 keep-alive is never kept", head("GET / HTTP/1.0", "Host: a", "Connection: keep-alive", "Keep-Alive: timeout=5"), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 0, Host: b("a"), ContentLength: -1}, []string{"Connection", "Keep-Alive"}},
	{18, "1.1 close", head("GET / HTTP/1.1", "Host: a", "Connection: close"), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: -1}, []string{"Connection"}},
	{18, "1.1 Close token in list", head("GET / HTTP/1.1", "Host: a", "Connection: foo, CLOSE ,"), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: -1}, []string{"Connection"}},
	{18, "1.1 keep-alive", head("GET / HTTP/1.1", "Host: a", "Connection: keep-alive"), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: -1, KeepAlive: true}, []string{"Connection"}},
	{18, "hop-by-hop", head("GET / HTTP/1.1", "Host: a", "Keep-Alive: 5", "Proxy-Connection: keep-alive", "TE: trailers", "Upgrade: websocket", "Trailer: X-Sum", "X-Kept: 1"), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: -1, KeepAlive: true},
		[]string{"Keep-Alive", "Proxy-Connection", "TE", "Upgrade"}}, // Trailer is end-to-end
	{18, "Connection names fields before and after it", head("GET / HTTP/1.1", "Host: a", "X-Before: 1", "x-secret: s", "Connection: X-Secret, x-before", "X-SECRET: t", "X-Kept: 1"), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: -1, KeepAlive: true},
		[]string{"X-Before", "x-secret", "Connection", "X-SECRET"}},
	{18, "Connection names many fields", head("GET / HTTP/1.1", "Host: a", "Connection: a1, a2, a3, a4, a5, a6, a7, a8, a9, a10", "A1: x", "A9: x", "A10: x", "A11: x"), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: -1, KeepAlive: true},
		[]string{"Connection", "A1", "A9", "A10"}},
	{18, "several Connection fields", head("GET / HTTP/1.1", "Host: a", "Connection: x-a", "X-A: 1", "Connection: close", "X-B: 2"), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: -1},
		[]string{"Connection", "X-A", "Connection"}},
	{18, "Connection names Upgrade", head("GET /ws HTTP/1.1", "Host: a", "Connection: Upgrade", "Upgrade: websocket", "Sec-WebSocket-Key: x"), Limits{},
		Request{Method: b("GET"), Target: b("/ws"), Path: b("/ws"), Minor: 1, Host: b("a"), ContentLength: -1, KeepAlive: true},
		[]string{"Connection", "Upgrade"}},
	{17, "Expect 100-continue", head("PUT /f HTTP/1.1", "Host: a", "Expect: 100-Continue", "Content-Length: 3"), Limits{},
		Request{Method: b("PUT"), Target: b("/f"), Path: b("/f"), Minor: 1, Host: b("a"), ContentLength: 3, KeepAlive: true, Expect100: true}, nil},
	{11, "OPTIONS *", head("OPTIONS * HTTP/1.1", "Host: a"), Limits{},
		Request{Method: b("OPTIONS"), Target: b("*"), Path: b("*"), Minor: 1, Host: b("a"), ContentLength: -1, KeepAlive: true}, nil},
	{11, "absolute-form", head("GET http://b.example:81/p?q=1 HTTP/1.1", "Host: a", "X-A: 1"), Limits{},
		Request{Method: b("GET"), Target: b("http://b.example:81/p?q=1"), Path: b("/p?q=1"), Minor: 1, Host: b("b.example:81"), HostRewritten: true, ContentLength: -1, KeepAlive: true},
		[]string{"Host"}},
	{11, "absolute-form HTTPS upper case, no Host field", head("GET HTTPS://B.example HTTP/1.1"), Limits{},
		Request{Method: b("GET"), Target: b("HTTPS://B.example"), Path: b("/"), Minor: 1, Host: b("B.example"), HostRewritten: true, ContentLength: -1, KeepAlive: true}, nil},
	{11, "absolute-form query only", head("GET http://b?x=1 HTTP/1.1", "Host: b"), Limits{},
		Request{Method: b("GET"), Target: b("http://b?x=1"), Path: b("/?x=1"), Minor: 1, Host: b("b"), HostRewritten: true, ContentLength: -1, KeepAlive: true}, []string{"Host"}},
	{11, "absolute-form IPv6", head("GET http://[::1]:8080/ HTTP/1.0", "host: x"), Limits{},
		Request{Method: b("GET"), Target: b("http://[::1]:8080/"), Path: b("/"), Minor: 0, Host: b("[::1]:8080"), HostRewritten: true, ContentLength: -1}, []string{"host"}},
	{11, "absolute-form 1.0", head("GET http://b/x HTTP/1.0"), Limits{},
		Request{Method: b("GET"), Target: b("http://b/x"), Path: b("/x"), Minor: 0, Host: b("b"), HostRewritten: true, ContentLength: -1}, nil},
	{12, "Host IPv6 port", head("GET / HTTP/1.1", "Host: [2001:db8::1]:443"), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("[2001:db8::1]:443"), ContentLength: -1, KeepAlive: true}, nil},
	{12, "Host IPv4-mapped IPv6", head("GET / HTTP/1.1", "Host: [::ffff:192.0.2.1]"), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("[::ffff:192.0.2.1]"), ContentLength: -1, KeepAlive: true}, nil},
	{12, "Host empty", head("GET / HTTP/1.1", "Host:"), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b(""), ContentLength: -1, KeepAlive: true}, nil},
	{12, "Host sub-delims", head("GET / HTTP/1.1", "Host: a-b_c~d.e!$&'()*+,;=%41"), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a-b_c~d.e!$&'()*+,;=%41"), ContentLength: -1, KeepAlive: true}, nil},
	// 20: an h2c offer is served over HTTP/1.1, the upgrade removed:
	// Upgrade, HTTP2-Settings and Connection (with the tokens naming
	// them) never reach the worker; the rest of the request does.
	{20, "Upgrade h2c", head("GET / HTTP/1.1", "Host: a", "Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAAQAAP__", "X-Kept: 1"), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: -1, KeepAlive: true},
		[]string{"Connection", "Upgrade", "HTTP2-Settings"}},
	{20, "Upgrade h2c with a body", head("POST / HTTP/1.1", "Host: a", "Content-Length: 5", "Upgrade: h2c", "Connection: HTTP2-Settings, upgrade", "http2-settings: AAMAAABkAAQAAP__"), Limits{},
		Request{Method: b("POST"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: 5, KeepAlive: true},
		[]string{"Upgrade", "Connection", "http2-settings"}},
	{20, "Upgrade h2c with close", head("GET / HTTP/1.1", "Host: a", "Connection: Upgrade, HTTP2-Settings, close", "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAAQAAP__"), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: -1},
		[]string{"Connection", "Upgrade", "HTTP2-Settings"}},
	{20, "Upgrade H2C alone", head("GET / HTTP/1.1", "Host: a", "Upgrade: H2C"), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: -1, KeepAlive: true},
		[]string{"Upgrade"}},
	{20, "Upgrade list with h2c", head("GET / HTTP/1.1", "Host: a", "Upgrade: websocket, h2c"), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: -1, KeepAlive: true},
		[]string{"Upgrade"}},
	{20, "HTTP2-Settings alone", head("GET / HTTP/1.1", "Host: a", "HTTP2-Settings: AAMAAABkAAQAAP__"), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: -1, KeepAlive: true},
		[]string{"HTTP2-Settings"}},
	{20, "HTTP/1.0 h2c", head("GET / HTTP/1.0", "Host: a", "Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAAQAAP__"), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 0, Host: b("a"), ContentLength: -1},
		[]string{"Connection", "Upgrade", "HTTP2-Settings"}},
	{0, "X-Forwarded-For combined", head("GET / HTTP/1.1", "X-Forwarded-For: 1.1.1.1", "Host: a", "x-forwarded-for: 2.2.2.2, 3.3.3.3 "), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: -1, KeepAlive: true, XFF: b("1.1.1.1, 2.2.2.2, 3.3.3.3")},
		[]string{"X-Forwarded-For", "x-forwarded-for"}},
	{0, "X-Forwarded-For single", head("GET / HTTP/1.1", "Host: a", "X-Forwarded-For: 1.1.1.1"), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: -1, KeepAlive: true, XFF: b("1.1.1.1")},
		[]string{"X-Forwarded-For"}},
	{10, "unknown token method", head("BREW /pot HTTP/1.1", "Host: a"), Limits{},
		Request{Method: b("BREW"), Target: b("/pot"), Path: b("/pot"), Minor: 1, Host: b("a"), ContentLength: -1, KeepAlive: true}, nil},
	{10, "target with query chars", head("GET /a/b;c?d=e&f=%20+g HTTP/1.1", "Host: a"), Limits{},
		Request{Method: b("GET"), Target: b("/a/b;c?d=e&f=%20+g"), Path: b("/a/b;c?d=e&f=%20+g"), Minor: 1, Host: b("a"), ContentLength: -1, KeepAlive: true}, nil},
	{7, "leading empty lines", "\r\n\r\n" + head("GET / HTTP/1.1", "Host: a"), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: -1, KeepAlive: true}, nil},
	{8, "value with obs-text, tab and colon", head("GET / HTTP/1.1", "Host: a", "X-A:\tv\xe9\tw: x "), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: -1, KeepAlive: true}, nil},
	{8, "empty value and token name chars", head("GET / HTTP/1.1", "Host: a", "!#$%&'*+-.^_`|~09aZ:"), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: -1, KeepAlive: true}, nil},
	// 13: limits met exactly are accepted; 8000 octets by default.
	{13, "8000-octet request line", head("GET /"+strings.Repeat("p", 8000-len("GET / HTTP/1.1"))+" HTTP/1.1", "Host: a"), Limits{},
		Request{Method: b("GET"), Target: b("/" + strings.Repeat("p", 8000-len("GET / HTTP/1.1"))), Path: b("/" + strings.Repeat("p", 8000-len("GET / HTTP/1.1"))), Minor: 1, Host: b("a"), ContentLength: -1, KeepAlive: true}, nil},
	{13, "request line at the limit", head(longLine+" HTTP/1.1", "Host: a"), Limits{},
		Request{Method: b("GET"), Target: b(longLine[4:]), Path: b(longLine[4:]), Minor: 1, Host: b("a"), ContentLength: -1, KeepAlive: true}, nil},
	{13, "request line at a small limit", head("GET /abcde HTTP/1.1", "Host: a"), Limits{RequestLine: 19},
		Request{Method: b("GET"), Target: b("/abcde"), Path: b("/abcde"), Minor: 1, Host: b("a"), ContentLength: -1, KeepAlive: true}, nil},
	{13, "head at the limit", head("GET / HTTP/1.1", "Host: a"), Limits{Head: len(head("GET / HTTP/1.1", "Host: a"))},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: -1, KeepAlive: true}, nil},
	{13, "fields at the limit", head("GET / HTTP/1.1", "Host: a", "A: 1", "B: 2"), Limits{Fields: 3},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: -1, KeepAlive: true}, nil},
	{13, "default field limit", head(append([]string{"GET / HTTP/1.1", "Host: a"}, repeatField("X-A: 1", DefaultFields-1)...)...), Limits{},
		Request{Method: b("GET"), Target: b("/"), Path: b("/"), Minor: 1, Host: b("a"), ContentLength: -1, KeepAlive: true}, nil},
}

func b(s string) []byte { return []byte(s) }

func checkRequest(t *testing.T, buf []byte, got *Request, tc acceptCase) {
	t.Helper()
	w := tc.want
	eq := func(what string, g, w []byte) {
		t.Helper()
		if !bytes.Equal(g, w) || (g == nil) != (w == nil) {
			t.Errorf("%s = %q (nil %v), want %q (nil %v)", what, g, g == nil, w, w == nil)
		}
	}
	eq("Method", got.Method, w.Method)
	eq("Target", got.Target, w.Target)
	eq("Path", got.Path, w.Path)
	eq("Host", got.Host, w.Host)
	eq("XFF", got.XFF, w.XFF)
	if got.Minor != w.Minor || got.HostRewritten != w.HostRewritten || got.ContentLength != w.ContentLength ||
		got.Chunked != w.Chunked || got.KeepAlive != w.KeepAlive || got.Expect100 != w.Expect100 {
		t.Errorf("got Minor=%d HostRewritten=%v ContentLength=%d Chunked=%v KeepAlive=%v Expect100=%v\n"+
			"want Minor=%d HostRewritten=%v ContentLength=%d Chunked=%v KeepAlive=%v Expect100=%v",
			got.Minor, got.HostRewritten, got.ContentLength, got.Chunked, got.KeepAlive, got.Expect100,
			w.Minor, w.HostRewritten, w.ContentLength, w.Chunked, w.KeepAlive, w.Expect100)
	}
	if got.HeadLen != len(tc.in) {
		t.Errorf("HeadLen = %d, want %d", got.HeadLen, len(tc.in))
	}
	if want := w.ContentLength > 0 || w.Chunked; got.HasBody() != want {
		t.Errorf("HasBody = %v, want %v", got.HasBody(), want)
	}
	var drops []string
	for _, f := range got.Fields {
		if f.Drop {
			drops = append(drops, string(f.Name))
		}
	}
	if strings.Join(drops, "|") != strings.Join(tc.drops, "|") {
		t.Errorf("dropped %q, want %q", drops, tc.drops)
	}
	checkFieldSlices(t, buf[:got.HeadLen], got.Fields)
}

// checkFieldSlices verifies every field against the raw head: Line is the
// exact line (CRLF included) in order, Name is the bytes before the colon,
// Value the bytes after it without OWS, all aliasing buf.
func checkFieldSlices(t *testing.T, buf []byte, fs []Field) {
	t.Helper()
	// Recompute the field lines independently.
	start := 0
	for bytes.HasPrefix(buf[start:], []byte("\r\n")) {
		start += 2
	}
	i := bytes.Index(buf[start:], []byte("\r\n")) + 2 + start // skip the start line
	for k, f := range fs {
		j := bytes.Index(buf[i:], []byte("\r\n"))
		if j < 0 {
			t.Fatalf("field %d: no line left in head", k)
		}
		line := buf[i : i+j+2]
		if !bytes.Equal(f.Line, line) || &f.Line[0] != &buf[i] {
			t.Errorf("field %d: Line = %q, want %q aliasing the buffer", k, f.Line, line)
		}
		colon := bytes.IndexByte(line, ':')
		if !bytes.Equal(f.Name, line[:colon]) || &f.Name[0] != &buf[i] {
			t.Errorf("field %d: Name = %q, want %q", k, f.Name, line[:colon])
		}
		v := strings.Trim(string(line[colon+1:len(line)-2]), " \t")
		if string(f.Value) != v {
			t.Errorf("field %d: Value = %q, want %q", k, f.Value, v)
		}
		if len(f.Value) > 0 {
			off := i + colon + 1 + strings.Index(string(line[colon+1:]), v)
			if &f.Value[0] != &buf[off] {
				t.Errorf("field %d: Value does not alias the buffer", k)
			}
		}
		i += j + 2
	}
	if !bytes.Equal(buf[i:], []byte("\r\n")) {
		t.Errorf("fields end at %d, not before the empty line: %q", i, buf[i:])
	}
}

func TestParseRequestAccepts(t *testing.T) {
	var req Request
	for _, tc := range requestAccepts {
		t.Run(fmt.Sprintf("row%d/%s", tc.row, tc.name), func(t *testing.T) {
			buf := []byte(tc.in)
			if err := ParseRequest(buf, tc.lim, &req); err != nil {
				t.Fatalf("ParseRequest: %v", err)
			}
			checkRequest(t, buf, &req, tc)

			// What follows the head is not looked at: a body or the
			// next pipelined request (docs/http-framing.md rule 5).
			for _, next := range []string{"GET / HTTP/1.1\r\nHost: b\r\n\r\n", "\x00\xff\n\r", "hello"} {
				buf := []byte(tc.in + next)
				if err := ParseRequest(buf, tc.lim, &req); err != nil {
					t.Fatalf("with %q after the head: %v", next, err)
				}
				checkRequest(t, buf, &req, tc)
			}
		})
	}
}

// Every proper prefix of a valid head is incomplete: never an error, whatever
// the read boundaries (checks the limits are applied consistently too).
func TestParseRequestPrefixesIncomplete(t *testing.T) {
	var req Request
	for _, tc := range requestAccepts {
		t.Run(tc.name, func(t *testing.T) {
			in := []byte(tc.in)
			for n := 0; n < len(in); n++ {
				// A fresh copy of exactly n bytes so the race detector and
				// bounds checks catch any read past the prefix.
				p := append([]byte(nil), in[:n]...)
				if err := ParseRequest(p, tc.lim, &req); err != ErrIncomplete {
					t.Fatalf("prefix %d/%d (%q): %v, want ErrIncomplete", n, len(in), trunc(string(p)), err)
				}
			}
		})
	}
}

func TestParseRequestLeadingEmptyLines(t *testing.T) {
	var req Request
	h := head("GET / HTTP/1.1", "Host: a")
	for n := 0; n <= 32; n++ {
		in := strings.Repeat("\r\n", n) + h
		if err := ParseRequest([]byte(in), Limits{}, &req); err != nil {
			t.Fatalf("%d empty lines: %v", n, err)
		}
		if req.HeadLen != len(in) || string(req.Path) != "/" {
			t.Fatalf("%d empty lines: HeadLen %d Path %q", n, req.HeadLen, req.Path)
		}
	}
	// Without bound they are a way to hold a connection: rejected.
	if err := ParseRequest([]byte(strings.Repeat("\r\n", 1000)+h), Limits{}, &req); statusOf(err) != 400 {
		t.Fatalf("1000 empty lines: %v, want 400", err)
	}
}

func TestParseRequestSlicing(t *testing.T) {
	in := "POST /up HTTP/1.1\r\nHost:  a.example \r\nX-Empty:\r\nX-Tabs:\t\tv 1\t\r\nContent-Length: 3\r\n\r\nabc"
	var req Request
	if err := ParseRequest([]byte(in), Limits{}, &req); err != nil {
		t.Fatal(err)
	}
	want := []struct{ name, value, line string }{
		{"Host", "a.example", "Host:  a.example \r\n"},
		{"X-Empty", "", "X-Empty:\r\n"},
		{"X-Tabs", "v 1", "X-Tabs:\t\tv 1\t\r\n"},
		{"Content-Length", "3", "Content-Length: 3\r\n"},
	}
	if len(req.Fields) != len(want) {
		t.Fatalf("%d fields, want %d", len(req.Fields), len(want))
	}
	for i, w := range want {
		f := req.Fields[i]
		if string(f.Name) != w.name || string(f.Value) != w.value || string(f.Line) != w.line || f.Drop {
			t.Errorf("field %d = {%q %q %q %v}, want {%q %q %q false}", i, f.Name, f.Value, f.Line, f.Drop, w.name, w.value, w.line)
		}
	}
	if req.HeadLen != len(in)-3 || in[req.HeadLen:] != "abc" {
		t.Errorf("HeadLen = %d", req.HeadLen)
	}
	if v, ok := req.Lookup("content-LENGTH"); !ok || string(v) != "3" {
		t.Errorf("Lookup = %q %v", v, ok)
	}
	if _, ok := req.Lookup("X-Missing"); ok {
		t.Error("Lookup of a missing field succeeded")
	}
	if !req.IsMethod("POST") || req.IsMethod("post") {
		t.Error("IsMethod is not exact")
	}
}

// The Fields slice is reused: no allocation per request once it has grown.
func TestParseRequestReuseNoAlloc(t *testing.T) {
	buf := []byte(benchHead)
	var req Request
	if err := ParseRequest(buf, Limits{}, &req); err != nil {
		t.Fatal(err)
	}
	first := &req.Fields[:1][0]
	allocs := testing.AllocsPerRun(100, func() {
		if err := ParseRequest(buf, Limits{}, &req); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Errorf("ParseRequest allocates %v times per call, want 0", allocs)
	}
	if &req.Fields[:1][0] != first {
		t.Error("Fields was not reused")
	}
	// A previous request's state never leaks into the next one.
	if err := ParseRequest([]byte(head("GET http://b/ HTTP/1.1", "X-Forwarded-For: 1", "Expect: 100-continue")), Limits{}, &req); err != nil {
		t.Fatal(err)
	}
	if err := ParseRequest([]byte(head("GET / HTTP/1.0")), Limits{}, &req); err != nil {
		t.Fatal(err)
	}
	if req.Host != nil || req.HostRewritten || req.XFF != nil || req.Expect100 || len(req.Fields) != 0 || req.ContentLength != -1 {
		t.Errorf("state leaked from the previous request: %+v", req)
	}
	// Also after an error.
	_ = ParseRequest([]byte(head("POST / HTTP/1.1", "Host: a", "Content-Length: 5", "Transfer-Encoding: chunked")), Limits{}, &req)
	if err := ParseRequest([]byte(head("GET / HTTP/1.1", "Host: a")), Limits{}, &req); err != nil || req.Chunked || req.ContentLength != -1 || len(req.Fields) != 1 {
		t.Errorf("state leaked after a rejection: %v %+v", err, req)
	}
}

// ---- responses ----

type respCase struct {
	name   string
	in     string
	status int // expected *Error status, 0 for success
	want   Response
	isHead bool
	kind   BodyKind
	drops  []string
}

var responseCases = []respCase{
	{name: "200 OK CL", in: head("HTTP/1.1 200 OK", "Content-Length: 5"), want: Response{Minor: 1, Status: 200, ContentLength: 5}, kind: BodyLength},
	{name: "204 no reason", in: head("HTTP/1.1 204"), want: Response{Minor: 1, Status: 204, ContentLength: -1}, kind: BodyNone},
	{name: "empty reason", in: head("HTTP/1.1 200 ", "Content-Length: 0"), want: Response{Minor: 1, Status: 200, ContentLength: 0}, kind: BodyLength},
	{name: "reason with spaces, tab and obs-text", in: head("HTTP/1.1 404 Not\tF\xf6und at all", "Content-Length: 0"), want: Response{Minor: 1, Status: 404, ContentLength: 0}, kind: BodyLength},
	{name: "HEAD with CL", in: head("HTTP/1.1 200 OK", "Content-Length: 5"), isHead: true, want: Response{Minor: 1, Status: 200, ContentLength: 5}, kind: BodyNone},
	{name: "HEAD with chunked", in: head("HTTP/1.1 200 OK", "Transfer-Encoding: chunked"), isHead: true, want: Response{Minor: 1, Status: 200, ContentLength: -1, Chunked: true}, kind: BodyNone},
	{name: "HEAD close-delimited", in: head("HTTP/1.1 200 OK"), isHead: true, want: Response{Minor: 1, Status: 200, ContentLength: -1}, kind: BodyNone},
	{name: "100 Continue", in: head("HTTP/1.1 100 Continue"), want: Response{Minor: 1, Status: 100, ContentLength: -1}, kind: BodyNone},
	{name: "101", in: head("HTTP/1.1 101 Switching Protocols", "Connection: upgrade", "Upgrade: websocket"), want: Response{Minor: 1, Status: 101, ContentLength: -1}, kind: BodyNone, drops: []string{"Connection", "Upgrade"}},
	{name: "103 with CL", in: head("HTTP/1.1 103 Early Hints", "Link: </a>", "Content-Length: 9"), want: Response{Minor: 1, Status: 103, ContentLength: 9}, kind: BodyNone},
	{name: "204 with CL", in: head("HTTP/1.1 204 No Content", "Content-Length: 9"), want: Response{Minor: 1, Status: 204, ContentLength: 9}, kind: BodyNone},
	{name: "304 with CL", in: head("HTTP/1.1 304 Not Modified", "Content-Length: 100"), want: Response{Minor: 1, Status: 304, ContentLength: 100}, kind: BodyNone},
	{name: "chunked", in: head("HTTP/1.1 200 OK", "Transfer-Encoding: Chunked"), want: Response{Minor: 1, Status: 200, ContentLength: -1, Chunked: true}, kind: BodyChunked},
	{name: "close-delimited", in: head("HTTP/1.1 200 OK", "Content-Type: text/plain"), want: Response{Minor: 1, Status: 200, ContentLength: -1}, kind: BodyClose},
	{name: "close-delimited 1.0", in: head("HTTP/1.0 200 OK"), want: Response{Minor: 0, Status: 200, ContentLength: -1, Close: true}, kind: BodyClose},
	{name: "1.0 keep-alive", in: head("HTTP/1.0 200 OK", "Connection: Keep-Alive", "Keep-Alive: timeout=5", "Content-Length: 1"), want: Response{Minor: 0, Status: 200, ContentLength: 1}, kind: BodyLength, drops: []string{"Connection", "Keep-Alive"}},
	{name: "1.1 Connection close", in: head("HTTP/1.1 200 OK", "Connection: close", "Content-Length: 1"), want: Response{Minor: 1, Status: 200, ContentLength: 1, Close: true}, kind: BodyLength, drops: []string{"Connection"}},
	{name: "1.1 Connection list close", in: head("HTTP/1.1 200 OK", "Connection: x-a, Close", "X-A: 1", "Content-Length: 1"), want: Response{Minor: 1, Status: 200, ContentLength: 1, Close: true}, kind: BodyLength, drops: []string{"Connection", "X-A"}},
	{name: "hop-by-hop", in: head("HTTP/1.1 200 OK", "Keep-Alive: 1", "Proxy-Connection: x", "TE: y", "Upgrade: z", "Trailer: X-Sum", "Transfer-Encoding: chunked"), want: Response{Minor: 1, Status: 200, ContentLength: -1, Chunked: true}, kind: BodyChunked, drops: []string{"Keep-Alive", "Proxy-Connection", "TE", "Upgrade"}}, // Trailer is end-to-end
	{name: "status 999", in: head("HTTP/1.1 999 X", "Content-Length: 0"), want: Response{Minor: 1, Status: 999, ContentLength: 0}, kind: BodyLength},

	// Bad status lines.
	{name: "status 200OK", in: head("HTTP/1.1 200OK"), status: 502},
	{name: "status 2 digits", in: head("HTTP/1.1 20 OK"), status: 502},
	{name: "status 4 digits", in: head("HTTP/1.1 2000 OK"), status: 502},
	{name: "status leading zero", in: head("HTTP/1.1 099 X"), status: 502},
	{name: "status letters", in: head("HTTP/1.1 abc OK"), status: 502},
	{name: "status sign", in: head("HTTP/1.1 +20 OK"), status: 502},
	{name: "two spaces", in: head("HTTP/1.1  200 OK"), status: 502},
	{name: "no status", in: head("HTTP/1.1"), status: 502},
	{name: "HTTP/1.2", in: head("HTTP/1.2 200 OK"), status: 502},
	{name: "HTTP/2", in: head("HTTP/2 200 OK"), status: 502},
	{name: "HTTP/2.0", in: head("HTTP/2.0 200 OK"), status: 502},
	{name: "lowercase http", in: head("http/1.1 200 OK"), status: 502},
	{name: "ICY", in: head("ICY 200 OK"), status: 502},
	{name: "HTTP/0.9 body", in: "<html>hello</html>\r\n\r\n", status: 502},
	{name: "empty status line", in: "\r\nHTTP/1.1 200 OK\r\n\r\n", status: 502},
	{name: "NUL in reason", in: head("HTTP/1.1 200 O\x00K"), status: 502},
	{name: "bare LF status line", in: "HTTP/1.1 200 OK\nContent-Length: 0\r\n\r\n", status: 502},
	{name: "bare CR status line", in: "HTTP/1.1 200 OK\rContent-Length: 0\r\n\r\n", status: 502},
	// Framing.
	{name: "CL+TE", in: head("HTTP/1.1 200 OK", "Content-Length: 5", "Transfer-Encoding: chunked"), status: 502},
	{name: "TE+CL", in: head("HTTP/1.1 200 OK", "Transfer-Encoding: chunked", "Content-Length: 5"), status: 502},
	// docs/http-framing.md rule 18 on the response side: Connection may not remove the framing.
	{name: "Connection names Content-Length", in: head("HTTP/1.1 200 OK", "Connection: Content-Length", "Content-Length: 2"), status: 502},
	{name: "Connection names Transfer-Encoding", in: head("HTTP/1.1 200 OK", "Connection: close, transfer-encoding", "Transfer-Encoding: chunked"), status: 502},
	{name: "Connection names CL, no CL", in: head("HTTP/1.1 200 OK", "Connection: content-length"), status: 502},
	{name: "duplicate CL same", in: head("HTTP/1.1 200 OK", "Content-Length: 5", "Content-Length: 5"), status: 502},
	{name: "duplicate CL different", in: head("HTTP/1.1 200 OK", "Content-Length: 5", "content-length: 6"), status: 502},
	{name: "CL list", in: head("HTTP/1.1 200 OK", "Content-Length: 5, 5"), status: 502},
	{name: "CL sign", in: head("HTTP/1.1 200 OK", "Content-Length: +5"), status: 502},
	{name: "CL hex", in: head("HTTP/1.1 200 OK", "Content-Length: 0x5"), status: 502},
	{name: "CL 20 digits", in: head("HTTP/1.1 200 OK", "Content-Length: 10000000000000000000"), status: 502},
	{name: "TE gzip", in: head("HTTP/1.1 200 OK", "Transfer-Encoding: gzip"), status: 502},
	{name: "TE gzip, chunked", in: head("HTTP/1.1 200 OK", "Transfer-Encoding: gzip, chunked"), status: 502},
	{name: "TE chunked twice", in: head("HTTP/1.1 200 OK", "Transfer-Encoding: chunked", "Transfer-Encoding: chunked"), status: 502},
	{name: "TE identity", in: head("HTTP/1.1 200 OK", "Transfer-Encoding: identity"), status: 502},
	{name: "TE empty", in: head("HTTP/1.1 200 OK", "Transfer-Encoding:"), status: 502},
	{name: "TE in 1.0", in: head("HTTP/1.0 200 OK", "Transfer-Encoding: chunked"), status: 502},
	{name: "obs-fold", in: head("HTTP/1.1 200 OK", "X-A: 1", " 2", "Content-Length: 0"), status: 502},
	{name: "obs-fold first", in: head("HTTP/1.1 200 OK", " X-A: 1"), status: 502},
	{name: "bare LF field", in: "HTTP/1.1 200 OK\r\nX-A: 1\nContent-Length: 0\r\n\r\n", status: 502},
	{name: "bare LF end", in: "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\n", status: 502},
	{name: "control byte", in: head("HTTP/1.1 200 OK", "X-A: \x01"), status: 502},
	{name: "space before colon", in: head("HTTP/1.1 200 OK", "Content-Length : 5"), status: 502},
	{name: "bad Connection", in: head("HTTP/1.1 200 OK", "Connection: a b"), status: 502},
}

func TestParseResponse(t *testing.T) {
	var resp Response
	for _, tc := range responseCases {
		t.Run(tc.name, func(t *testing.T) {
			buf := []byte(tc.in + "body")
			err := ParseResponse(buf, Limits{}, &resp)
			if got := statusOf(err); got != tc.status {
				t.Fatalf("ParseResponse(%q) = %v (status %d), want %d", tc.in, err, got, tc.status)
			}
			if tc.status != 0 {
				return
			}
			w := tc.want
			if resp.Minor != w.Minor || resp.Status != w.Status || resp.ContentLength != w.ContentLength ||
				resp.Chunked != w.Chunked || resp.Close != w.Close || resp.HeadLen != len(tc.in) {
				t.Errorf("got %+v\nwant %+v (HeadLen %d)", resp, w, len(tc.in))
			}
			if k := resp.Body(tc.isHead); k != tc.kind {
				t.Errorf("Body(%v) = %d, want %d", tc.isHead, k, tc.kind)
			}
			var drops []string
			for _, f := range resp.Fields {
				if f.Drop {
					drops = append(drops, string(f.Name))
				}
			}
			if strings.Join(drops, "|") != strings.Join(tc.drops, "|") {
				t.Errorf("dropped %q, want %q", drops, tc.drops)
			}
			checkFieldSlices(t, buf[:resp.HeadLen], resp.Fields)
			for n := 0; n < len(tc.in); n++ {
				p := append([]byte(nil), tc.in[:n]...)
				if err := ParseResponse(p, Limits{}, &resp); err != ErrIncomplete {
					t.Fatalf("prefix %d (%q): %v, want ErrIncomplete", n, p, err)
				}
			}
		})
	}
}

func TestParseResponseLimits(t *testing.T) {
	var resp Response
	big := head("HTTP/1.1 200 OK", "X-A: "+strings.Repeat("a", 300))
	if err := ParseResponse([]byte(big), Limits{Head: 200}, &resp); statusOf(err) != 502 {
		t.Errorf("large head: %v, want 502", err)
	}
	if err := ParseResponse([]byte(big[:250]), Limits{Head: 200}, &resp); statusOf(err) != 502 {
		t.Errorf("large incomplete head: %v, want 502", err)
	}
	if err := ParseResponse([]byte(strings.Repeat("H", 300)), Limits{Head: 200}, &resp); statusOf(err) != 502 {
		t.Errorf("large incomplete status line: %v, want 502", err)
	}
	many := head(append([]string{"HTTP/1.1 200 OK"}, repeatField("X-A: 1", 4)...)...)
	if err := ParseResponse([]byte(many), Limits{Fields: 3}, &resp); statusOf(err) != 502 {
		t.Errorf("too many fields: %v, want 502", err)
	}
	if err := ParseResponse([]byte(many), Limits{Fields: 4}, &resp); err != nil {
		t.Errorf("fields at the limit: %v", err)
	}
	if v, ok := resp.Lookup("x-a"); !ok || string(v) != "1" {
		t.Errorf("Lookup = %q %v", v, ok)
	}
}

func TestParseResponseReuseNoAlloc(t *testing.T) {
	buf := []byte(head("HTTP/1.1 200 OK", "Date: Mon, 01 Jan 2024 00:00:00 GMT", "Content-Type: text/html", "Content-Length: 1234", "Connection: keep-alive", "Cache-Control: no-cache"))
	var resp Response
	if err := ParseResponse(buf, Limits{}, &resp); err != nil {
		t.Fatal(err)
	}
	if allocs := testing.AllocsPerRun(100, func() { _ = ParseResponse(buf, Limits{}, &resp) }); allocs != 0 {
		t.Errorf("ParseResponse allocates %v times per call, want 0", allocs)
	}
}

// benchHead is a typical ~300-byte keep-alive POST head.
var benchHead = head(
	"POST /api/v1/orders?region=eu-west-1 HTTP/1.1",
	"Host: api.example.com",
	"User-Agent: Mozilla/5.0 (X11; Linux x86_64)",
	"Accept: application/json",
	"Accept-Encoding: gzip, deflate, br",
	"Content-Type: application/json",
	"Content-Length: 512",
	"Connection: keep-alive",
	"Cookie: session=8f14e45fceea167a5a36dedd4bea2543",
)

func BenchmarkParseRequest(b *testing.B) {
	buf := []byte(benchHead)
	var req Request
	b.SetBytes(int64(len(buf)))
	b.ReportAllocs()
	for b.Loop() {
		if err := ParseRequest(buf, Limits{}, &req); err != nil {
			b.Fatal(err)
		}
	}
	if !req.KeepAlive || req.ContentLength != 512 {
		b.Fatal("bad parse")
	}
}
