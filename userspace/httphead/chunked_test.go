package httphead

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
)

// scanResult is the outcome of feeding a body to a Chunked.
type scanResult struct {
	n      int // bytes accepted as body
	status int // *Error status, 0 without error
	done   bool
}

func (r scanResult) String() string {
	return fmt.Sprintf("{n=%d status=%d done=%v}", r.n, r.status, r.done)
}

// feed scans p in the pieces given by cuts (increasing offsets), stopping at
// the first error or at the end of the body, as the proxy does.
func feed(p []byte, cuts []int) scanResult {
	var c Chunked
	total, prev := 0, 0
	for _, cut := range append(cuts, len(p)) {
		if cut < prev {
			continue
		}
		piece := p[prev:cut]
		prev = cut
		n, err := c.Scan(piece)
		if n < 0 || n > len(piece) {
			panic(fmt.Sprintf("Scan returned n=%d for %d bytes", n, len(piece)))
		}
		total += n
		if err != nil {
			return scanResult{total, statusOf(err), c.Done()}
		}
		if n < len(piece) && !c.Done() {
			panic(fmt.Sprintf("Scan stopped at %d/%d without error or end", n, len(piece)))
		}
		if c.Done() {
			break
		}
	}
	return scanResult{total, 0, c.Done()}
}

func whole(p []byte) scanResult { return feed(p, nil) }

func byteByByte(p []byte) scanResult {
	var c Chunked
	for i := range p {
		n, err := c.Scan(p[i : i+1])
		if err != nil {
			return scanResult{i, statusOf(err), c.Done()}
		}
		if c.Done() {
			return scanResult{i + n, 0, true}
		}
	}
	return scanResult{len(p), 0, c.Done()}
}

func randomSplit(p []byte, rng *rand.Rand) scanResult {
	var cuts []int
	for i := 0; i < len(p); i += 1 + rng.IntN(8) {
		cuts = append(cuts, i)
	}
	return feed(p, cuts)
}

// skipping moves chunk data with Data/Skip (as the splice path does) and
// scans only the framing, in pieces of at most step bytes.
func skipping(p []byte, step int) scanResult {
	var c Chunked
	i := 0
	for i < len(p) && !c.Done() {
		if d := c.Data(); d > 0 {
			k := min(d, int64(len(p)-i), int64(step))
			c.Skip(k)
			i += int(k)
			continue
		}
		c.Skip(0) // harmless outside data
		end := min(i+step, len(p))
		n, err := c.Scan(p[i:end])
		i += n
		if err != nil {
			return scanResult{i, statusOf(err), c.Done()}
		}
	}
	return scanResult{i, 0, c.Done()}
}

// allFeeds checks that every way of feeding p gives the same result and
// returns it.
func allFeeds(t *testing.T, p []byte) scanResult {
	t.Helper()
	w := whole(p)
	if r := byteByByte(p); r != w {
		t.Fatalf("byte by byte %v != whole %v", r, w)
	}
	rng := rand.New(rand.NewPCG(uint64(len(p)), 1))
	for range 20 {
		if r := randomSplit(p, rng); r != w {
			t.Fatalf("random split %v != whole %v", r, w)
		}
	}
	for _, step := range []int{1, 2, 3, 7, 1 << 20} {
		if r := skipping(p, step); r != w {
			t.Fatalf("Data/Skip with step %d: %v != whole %v", step, r, w)
		}
	}
	return w
}

var chunkedValid = []struct{ name, body string }{
	{"empty", "0\r\n\r\n"},
	{"one chunk", "5\r\nhello\r\n0\r\n\r\n"},
	{"two chunks", "5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"},
	{"upper hex", "A\r\n0123456789\r\n1F\r\n" + strings.Repeat("x", 31) + "\r\n0\r\n\r\n"},
	{"lower hex", "a\r\n0123456789\r\n1f\r\n" + strings.Repeat("x", 31) + "\r\n0\r\n\r\n"},
	{"leading zeros", "0005\r\nhello\r\n000\r\n\r\n"},
	{"16 hex digits", "000000000000000a\r\n0123456789\r\n0000000000000000\r\n\r\n"},
	{"CRLF inside data", "4\r\n\r\n\r\n\r\n0\r\n\r\n"},
	{"data looks like framing", "5\r\n0\r\n\r\n\r\n0\r\n\r\n"},
	{"extension name", "5;foo\r\nhello\r\n0\r\n\r\n"},
	{"extension name=token", "5;foo=bar\r\nhello\r\n0;last\r\n\r\n"},
	{"extension quoted", "5;foo=\"b a;r\"\r\nhello\r\n0\r\n\r\n"},
	{"extension quoted-pair", "5;foo=\"a\\\"b\\\\\"\r\nhello\r\n0\r\n\r\n"},
	{"several extensions", "5;a;b=1;c=\"2\"\r\nhello\r\n0\r\n\r\n"},
	{"extension BWS", "5 ;a = 1 ; b\t=\t\"x\"\r\nhello\r\n0\r\n\r\n"},
	{"extension at the cap", "1;" + strings.Repeat("e", MaxChunkExtBytes-1) + "\r\nx\r\n0\r\n\r\n"},
	{"trailer", "5\r\nhello\r\n0\r\nX-Sum: abc\r\n\r\n"},
	{"two trailers", "5\r\nhello\r\n0\r\nX-Sum: abc\r\nX-Other:1 2\t\r\n\r\n"},
	{"trailer empty value", "0\r\nX-Empty:\r\n\r\n"},
	{"trailer obs-text", "0\r\nX-A: caf\xc3\xa9\r\n\r\n"},
	{"trailer long name", "0\r\nX-A-Very-Long-Trailer-Field-Name-Content-Length: 1\r\n\r\n"},
	{"trailer name like forbidden", "0\r\nContent-Lengths: 1\r\nX-Host: a\r\nHost2: b\r\n\r\n"},
}

func TestChunkedValid(t *testing.T) {
	for _, tc := range chunkedValid {
		t.Run(tc.name, func(t *testing.T) {
			body := []byte(tc.body)
			if r := allFeeds(t, body); r != (scanResult{len(body), 0, true}) {
				t.Fatalf("got %v, want {n=%d done}", r, len(body))
			}
			// The next pipelined message is not consumed.
			for _, next := range []string{"GET / HTTP/1.1\r\nHost: a\r\n\r\n", "\r\n", "5\r\nhello\r\n0\r\n\r\n", "\x00"} {
				withNext := []byte(tc.body + next)
				if r := allFeeds(t, withNext); r != (scanResult{len(body), 0, true}) {
					t.Fatalf("with %q after: %v, want {n=%d done}", next, r, len(body))
				}
			}
			// Every proper prefix is valid so far and not done.
			for n := 0; n < len(body); n++ {
				if r := whole(body[:n]); r != (scanResult{n, 0, false}) {
					t.Fatalf("prefix %d: %v", n, r)
				}
			}
		})
	}
}

func TestChunkedDoneScansNothing(t *testing.T) {
	var c Chunked
	if n, err := c.Scan([]byte("0\r\n\r\nmore")); n != 5 || err != nil || !c.Done() {
		t.Fatalf("Scan = %d, %v, done %v", n, err, c.Done())
	}
	if n, err := c.Scan([]byte("more")); n != 0 || err != nil || !c.Done() {
		t.Fatalf("Scan after done = %d, %v", n, err)
	}
	if c.Data() != 0 {
		t.Fatalf("Data after done = %d", c.Data())
	}
	c.Skip(0)
	if !c.Done() {
		t.Fatal("Skip(0) after the end undid Done")
	}
}

// Skip(0) is allowed whenever Data() is 0 (n <= Data()) and changes nothing.
func TestChunkedSkipZero(t *testing.T) {
	body := []byte("5\r\nhello\r\n0\r\nX: y\r\n\r\n")
	for i := 0; i <= len(body); i++ {
		var c Chunked
		n, err := c.Scan(body[:i])
		if err != nil || n != i {
			t.Fatal(n, err)
		}
		if c.Data() == 0 {
			c.Skip(0)
		}
		n, err = c.Scan(body[i:])
		if err != nil || n != len(body)-i || !c.Done() {
			t.Fatalf("split at %d with Skip(0): n=%d err=%v done=%v", i, n, err, c.Done())
		}
	}
}

func TestChunkedData(t *testing.T) {
	var c Chunked
	if n, err := c.Scan([]byte("1a;x=y\r\n0123")); n != 12 || err != nil {
		t.Fatal(n, err)
	}
	if d := c.Data(); d != 0x1a-4 {
		t.Fatalf("Data = %d, want %d", d, 0x1a-4)
	}
	c.Skip(10)
	if d := c.Data(); d != 12 {
		t.Fatalf("Data after Skip = %d", d)
	}
	c.Skip(12)
	if c.Data() != 0 {
		t.Fatal("Data after the chunk")
	}
	if n, err := c.Scan([]byte("\r\n0\r\n\r\n")); n != 7 || err != nil || !c.Done() {
		t.Fatal(n, err, c.Done())
	}
	// A huge chunk is legal: its data is never buffered here.
	var h Chunked
	if _, err := h.Scan([]byte("7fffffffffffffff\r\n")); err != nil || h.Data() != 1<<63-1 {
		t.Fatalf("largest chunk: %v Data=%d", err, h.Data())
	}
}

var chunkedInvalid = []struct {
	name   string
	body   string
	at     int // offset of the offending byte: n returned with the error
	status int
}{
	{"0x prefix", "0x5\r\nhello\r\n0\r\n\r\n", 1, 400},
	{"plus", "+5\r\nhello\r\n0\r\n\r\n", 0, 400},
	{"minus", "-5\r\nhello\r\n0\r\n\r\n", 0, 400},
	{"space after size", "5 \r\nhello\r\n0\r\n\r\n", 2, 400},
	{"tab after size", "5\t\r\nhello\r\n0\r\n\r\n", 2, 400},
	{"space before size", " 5\r\nhello\r\n0\r\n\r\n", 0, 400},
	{"space inside size", "1 0\r\n", 2, 400},
	{"underscore", "_\r\n", 0, 400},
	{"underscore in size", "1_0\r\n", 1, 400},
	{"empty size", "\r\nhello\r\n0\r\n\r\n", 0, 400},
	{"non-hex", "g\r\n", 0, 400},
	{"17 hex digits", "00000000000000005\r\nhello\r\n0\r\n\r\n", 16, 400},
	{"17 hex digits zero", "00000000000000000\r\n\r\n", 16, 400},
	{"size overflows int64", "8000000000000000\r\n", 15, 400},
	{"size all f", "ffffffffffffffff\r\n", 15, 400},
	{"missing CRLF after data", "5\r\nhelloX\r\n0\r\n\r\n", 8, 400},
	{"data too long", "5\r\nhello world\r\n0\r\n\r\n", 8, 400},
	{"bare LF after data", "5\r\nhello\n0\r\n\r\n", 8, 400},
	{"bare CR after data", "5\r\nhello\r0\r\n\r\n", 9, 400},
	{"LF CR after data", "5\r\nhello\n\r0\r\n\r\n", 8, 400},
	// Go CVE-2025-22871: bare LF ending the size line.
	{"bare LF in size line", "5\nhello\r\n0\r\n\r\n", 1, 400},
	{"bare LF in last-chunk line", "5\r\nhello\r\n0\n\r\n", 11, 400},
	{"bare CR in size line", "5\rhello\r\n0\r\n\r\n", 2, 400},
	{"CR CR LF in size line", "5\r\r\nhello\r\n0\r\n\r\n", 2, 400},
	// Kestrel CVE-2025-55315: LF inside a chunk extension.
	{"LF in extension", "5;a\nhello\r\n0\r\n\r\n", 3, 400},
	{"LF in extension value", "5;a=b\nxx\r\nhello\r\n0\r\n\r\n", 5, 400},
	{"LF in quoted extension", "5;a=\"b\nc\"\r\nhello\r\n0\r\n\r\n", 6, 400},
	{"bare CR in extension", "5;a\rb\r\nhello\r\n0\r\n\r\n", 4, 400},
	{"NUL in extension", "5;a\x00\r\nhello\r\n0\r\n\r\n", 3, 400},
	{"DEL in extension", "5;a\x7f\r\nhello\r\n0\r\n\r\n", 3, 400},
	// chunk-ext = *( BWS ";" BWS chunk-ext-name [ BWS "=" BWS chunk-ext-val ] ): parsed strictly (docs/http-framing.md rule 15).
	{"empty extension", "5;\r\nhello\r\n0\r\n\r\n", 2, 400},
	{"empty extension name", "5;=1\r\nhello\r\n0\r\n\r\n", 2, 400},
	{"empty extension value", "5;a=\r\nhello\r\n0\r\n\r\n", 4, 400},
	{"extension space inside name", "5;a b\r\nhello\r\n0\r\n\r\n", 4, 400},
	{"extension space inside value", "5;a=b c\r\nhello\r\n0\r\n\r\n", 6, 400},
	{"extension BWS before CRLF", "5;a \r\nhello\r\n0\r\n\r\n", 4, 400},
	{"extension unterminated quote", "5;a=\"b\r\nhello\r\n0\r\n\r\n", 6, 400},
	{"extension junk after quote", "5;a=\"b\"c\r\nhello\r\n0\r\n\r\n", 7, 400},
	{"extension non-token name", "5;a@b\r\nhello\r\n0\r\n\r\n", 3, 400},
	{"extension double semicolon", "5;a;;b\r\nhello\r\n0\r\n\r\n", 4, 400},
	// Go CVE-2023-39326: extension amplification, capped per message.
	{"extension past the cap", "1;" + strings.Repeat("e", MaxChunkExtBytes) + "\r\nx\r\n0\r\n\r\n", 2 + MaxChunkExtBytes - 1, 400},
	{"extensions past the cap over chunks", strings.Repeat("1;"+strings.Repeat("e", 98)+"\r\nx\r\n", 50) + "0\r\n\r\n", -1, 400},
	{"BWS past the cap", "1" + strings.Repeat(" ", 2*MaxChunkExtBytes) + ";a\r\nx\r\n0\r\n\r\n", -1, 400},
	{"quoted extension past the cap", "1;a=\"" + strings.Repeat("q", 2*MaxChunkExtBytes) + "\"\r\nx\r\n0\r\n\r\n", -1, 400},
	// Trailers (docs/http-framing.md rule 16).
	{"trailer Content-Length", "5\r\nhello\r\n0\r\nContent-Length: 5\r\n\r\n", 27, 400},
	{"trailer Transfer-Encoding", "0\r\ntransfer-encoding: chunked\r\n\r\n", 20, 400},
	{"trailer Host", "0\r\nHOST: evil\r\n\r\n", 7, 400},
	{"trailer Trailer", "0\r\nTrailer: x\r\n\r\n", 10, 400},
	{"trailer Connection", "0\r\nConnection: close\r\n\r\n", 13, 400},
	{"trailer obs-fold", "0\r\nX-A: 1\r\n 2\r\n\r\n", 11, 400},
	{"trailer obs-fold tab", "0\r\nX-A: 1\r\n\t2\r\n\r\n", 11, 400},
	{"trailer leading space", "0\r\n X-A: 1\r\n\r\n", 3, 400},
	{"trailer space before colon", "0\r\nX-A : 1\r\n\r\n", 6, 400},
	{"trailer no colon", "0\r\nX-A\r\n\r\n", 6, 400},
	{"trailer empty name", "0\r\n: 1\r\n\r\n", 3, 400},
	{"trailer bad name", "0\r\nX(A): 1\r\n\r\n", 4, 400},
	{"trailer NUL", "0\r\nX-A: \x00\r\n\r\n", 8, 400},
	{"trailer bare LF", "0\r\nX-A: 1\n\r\n", 9, 400},
	{"trailer bare CR", "0\r\nX-A: 1\rX\r\n\r\n", 10, 400},
	{"trailer bare LF line", "0\r\nX-A: 1\r\n\n", 11, 400},
	{"final bare LF", "0\r\n\n", 3, 400},
	{"final bare CR", "0\r\n\rX", 4, 400},
	{"trailers too large", "0\r\nX-A: " + strings.Repeat("a", MaxTrailerBytes) + "\r\n\r\n", -1, 431},
	{"many trailers too large", "0\r\n" + strings.Repeat("X-A: "+strings.Repeat("a", 100)+"\r\n", MaxTrailerBytes/100) + "\r\n", -1, 431},
}

func TestChunkedInvalid(t *testing.T) {
	for _, tc := range chunkedInvalid {
		t.Run(tc.name, func(t *testing.T) {
			r := allFeeds(t, []byte(tc.body))
			if r.status != tc.status || r.done || tc.at >= 0 && r.n != tc.at {
				t.Fatalf("got %v, want error %d at %d", r, tc.status, tc.at)
			}
			if r.n >= len(tc.body) {
				t.Fatalf("error reported past the input: n=%d", r.n)
			}
		})
	}
}

// The extension cap covers the whole message, not each chunk.
func TestChunkedExtensionCapPerMessage(t *testing.T) {
	ext := ";" + strings.Repeat("e", 99) // 100 bytes of extension per chunk
	ok := strings.Repeat("1"+ext+"\r\nx\r\n", MaxChunkExtBytes/100) + "0\r\n\r\n"
	if r := whole([]byte(ok)); r.status != 0 || !r.done {
		t.Fatalf("%d bytes of extensions: %v", MaxChunkExtBytes/100*100, r)
	}
	bad := strings.Repeat("1"+ext+"\r\nx\r\n", MaxChunkExtBytes/100+1) + "0\r\n\r\n"
	if r := whole([]byte(bad)); r.status != 400 {
		t.Fatalf("%d bytes of extensions: %v, want 400", (MaxChunkExtBytes/100+1)*100, r)
	}
}

func BenchmarkChunkedScan(b *testing.B) {
	body := []byte(strings.Repeat("400\r\n"+strings.Repeat("x", 1024)+"\r\n", 16) + "0\r\n\r\n")
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		var c Chunked
		if n, err := c.Scan(body); n != len(body) || err != nil {
			b.Fatal(n, err)
		}
	}
}
