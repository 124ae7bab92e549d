package proxy

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
)

// The response is relayed by two drivers: the event loop's
// (loop_relay.go, loop_splice.go), for a request whose head and body came
// whole, and a goroutine's (gor_response.go) for the rest. They take the
// same decisions (framing.go: interimPolicy, frameResponse, frameFirst,
// frameChunk; outcome.go: decide) but move the bytes differently (epoll
// edges, the ring and splice pipes against blocking reads and
// ReadFrom), so FuzzRelayPaths checks one against the other: whatever a
// worker answers, however its bytes are cut up in time, the client must
// see the same bytes, ended the same way (EOF or reset), whether the loop
// ran the exchange (a GET) or a goroutine did (a POST with a chunked body,
// which the loop hands over).
func FuzzRelayPaths(f *testing.F) {
	for _, seed := range []struct{ resp, cuts string }{
		{"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", ""},
		{"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel", "\x05"},
		{"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhello", ""},
		{"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;x=y\r\nhello\r\n0\r\nT: v\r\n\r\n", "\x03\x09"},
		{"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel", "\x20"},
		{"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", ""},
		{"HTTP/1.1 200 OK\r\n\r\nuntil the close", "\x01\x02"},
		{"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx", "\x10"},
		{"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n", ""},
		{"HTTP/1.1 204 No Content\r\nContent-Length: 3\r\n\r\nabc", ""},
		{"HTTP/1.1 304 Not Modified\r\n\r\n", ""},
		{"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n", ""},
		{"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", ""},
		{"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nok", ""},
		{"garbage\r\n\r\n", ""},
		{"HTTP/1.1 200 OK\r\nContent-Len", "\x04"},
		{"", ""},
	} {
		f.Add([]byte(seed.resp), []byte(seed.cuts))
	}
	var cur atomic.Pointer[[2][]byte]
	var serving atomic.Int64 // backend connections not yet closed
	be := rawBackend(f, func(c net.Conn) {
		serving.Add(1)
		defer serving.Add(-1)
		defer c.Close()
		br := bufio.NewReader(c)
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		io.Copy(io.Discard, req.Body)
		cs := cur.Load()
		resp, cuts := cs[0], cs[1]
		// Each cut byte: write that many bytes (1..255), then pause, so
		// that the proxy reads the answer in those pieces.
		for _, k := range cuts {
			n := min(int(k)+1, len(resp))
			c.Write(resp[:n])
			resp = resp[n:]
			time.Sleep(200 * time.Microsecond)
		}
		c.Write(resp)
		// Then close (a close-delimited body ends here; a cut one is cut).
	})
	p := startProxy(f, []string{be}, func(c *Config) {
		c.ResponseTimeout, c.StreamIdleTimeout, c.IOTimeout = 3*time.Second, 3*time.Second, 3*time.Second
	})
	// The same with every body remainder (a Content-Length rest, a body to
	// the close, a chunk's data) moved by splice: the fuzzer's few bytes
	// take the paths a long body takes.
	ps := startProxy(f, []string{be}, func(c *Config) {
		c.ResponseTimeout, c.StreamIdleTimeout, c.IOTimeout = 3*time.Second, 3*time.Second, 3*time.Second
		c.SpliceMin = 1
	})
	fetch := func(t *testing.T, p *testProxy, raw string) string {
		// A pooled upstream connection the worker closed is dropped when
		// the close is seen (the loop) or peeked at reuse (the pool):
		// let the loop see it, so both paths start from a fresh connect.
		// The goroutine path's pool peeks at reuse: the worker's close
		// must have happened (it answers, then closes; without a
		// Connection: close the pool keeps the socket, and one reused
		// an instant before the close is a 502 no proxy could avoid).
		testenv.WaitFor(t, "the worker closed its connections", func() bool { return serving.Load() == 0 })
		// And the proxy saw those closes: a FIN not processed yet (the
		// softirq that delivers it can run late on a loaded host) leaves
		// a pooled socket that the pool's peek finds alive, and the
		// request it carries meets the close: 502 sent, where the loop
		// relayed the worker's answer (visible as a mismatch whenever
		// that answer is not itself a plain 502, as with a 103 before a
		// broken final head).
		testenv.WaitFor(t, "the proxy saw the worker's closes", func() bool { return openTo(t, be) == 0 })
		testenv.WaitFor(t, "no idle upstream connection in the loop", func() bool { return p.srv.Counters().UpstreamIdle.Load() == 0 })
		c, err := net.Dial("tcp", p.addr())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.WriteString(c, raw); err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(c)
		end := "EOF"
		switch {
		case errors.Is(err, syscall.ECONNRESET):
			end = "reset"
		case errors.Is(err, os.ErrDeadlineExceeded):
			end = "stalled"
		case err != nil:
			end = err.Error()
		}
		return string(got) + "\n[" + end + "]"
	}
	f.Fuzz(func(t *testing.T, resp, cuts []byte) {
		if len(resp) > 4096 || len(cuts) > 16 {
			return
		}
		cur.Store(&[2][]byte{resp, cuts})
		const get = "GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
		const post = "POST /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
		loop := fetch(t, p, get)
		goroutine := fetch(t, p, post)
		if loop != goroutine {
			t.Fatalf("worker answered %q (cuts %v):\nloop:      %q\ngoroutine: %q", resp, cuts, loop, goroutine)
		}
		if got := fetch(t, ps, get); got != loop {
			t.Fatalf("worker answered %q (cuts %v):\nloop:         %q\nloop, splice: %q", resp, cuts, loop, got)
		}
		if got := fetch(t, ps, post); got != loop {
			t.Fatalf("worker answered %q (cuts %v):\nloop:              %q\ngoroutine, splice: %q", resp, cuts, loop, got)
		}
		if bytes.Contains([]byte(loop), []byte("stalled")) {
			t.Fatalf("worker answered %q: the client stalled: %q", resp, loop)
		}
	})
}
