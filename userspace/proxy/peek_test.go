package proxy

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/kvindex"
	"github.com/tether-rl/tether/userspace/route"
)

// moreRouter asks for more of a body (PeekMore) until it has upTo bytes,
// checks that every byte it is shown is the body's, and reports the body
// bytes each decision saw.
type moreRouter struct {
	inner Router
	upTo  int
	body  []byte // the body sent (its start is what the router must see)
	seen  chan int
	mu    sync.Mutex
	bad   string
}

func (r *moreRouter) check(what string, body []byte) {
	if len(body) > len(r.body) || !bytes.Equal(body, r.body[:len(body)]) {
		r.mu.Lock()
		r.bad = fmt.Sprintf("%s was shown %d bytes that are not the body's start", what, len(body))
		r.mu.Unlock()
	}
}

func (r *moreRouter) Route(req *httphead.Request, body []byte) route.Decision {
	if req.ContentLength == int64(len(r.body)) {
		r.check("Route", body)
		r.seen <- len(body)
	}
	return r.inner.Route(req, body)
}

func (r *moreRouter) PeekMore(req *httphead.Request, body []byte) int {
	r.check("PeekMore", body)
	if len(body) >= r.upTo {
		return 0
	}
	return min(2*len(body), r.upTo)
}

// sumBackend answers each request with its body's length and SHA-256.
func sumBackend(t *testing.T, arrived chan<- string) string {
	return httpBackend(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if arrived != nil {
			arrived <- r.URL.Path
		}
		h := sha256.New()
		n, err := io.Copy(h, r.Body)
		if err != nil {
			w.WriteHeader(400)
			return
		}
		fmt.Fprintf(w, "%d %x", n, h.Sum(nil))
	}))
}

func sumOf(b []byte) string { return fmt.Sprintf("%d %x", len(b), sha256.Sum256(b)) }

// chunk frames b as a chunked body of 10 KiB chunks.
func chunk(b []byte) []byte {
	var out []byte
	for len(b) > 0 {
		n := min(len(b), 10<<10)
		out = fmt.Appendf(out, "%x\r\n", n)
		out = append(out, b[:n]...)
		out = append(out, "\r\n"...)
		b = b[n:]
	}
	return append(out, "0\r\n\r\n"...)
}

// A request whose body the router reads further before it decides is
// relayed byte for byte, and the request pipelined behind it is intact,
// on the event loop and the goroutine path: the router shows what it
// asked for, within the Content-Length, Config.PeekMax and
// Config.PeekBudget; a chunked body keeps PeekBody's limit; the large
// buffers go back.
func TestPeekMoreRelayed(t *testing.T) {
	testenv.CheckLeaks(t)
	for _, tc := range []struct {
		name     string
		size     int // body bytes
		upTo     int // the router asks until it has this many
		peekMax  int
		budget   int64
		chunked  bool
		min, max int // body bytes the decision sees
	}{
		{name: "asked, within the body", size: 300 << 10, upTo: 200 << 10, min: 200 << 10, max: 200 << 10},
		{name: "Content-Length smaller than asked", size: 50<<10 + 7, upTo: 1 << 20, min: 50<<10 + 7, max: 50<<10 + 7},
		{name: "PeekMax", size: 300 << 10, upTo: 1 << 20, peekMax: 64 << 10, min: 64 << 10, max: 64 << 10},
		{name: "PeekBudget", size: 300 << 10, upTo: 1 << 20, budget: 1, min: 4096, max: bufSize},
		{name: "the router declines", size: 300 << 10, upTo: 0, min: 4096, max: bufSize},
		{name: "chunked", size: 300 << 10, upTo: 1 << 20, chunked: true, min: 1, max: bufSize},
	} {
		for _, gor := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/goroutines=%v", tc.name, gor), func(t *testing.T) {
				body := make([]byte, tc.size)
				rng := rand.New(rand.NewPCG(uint64(tc.size), 1))
				for i := range body {
					body[i] = byte(rng.IntN(256))
				}
				be := sumBackend(t, nil)
				r := &moreRouter{upTo: tc.upTo, body: body, seen: make(chan int, 4)}
				if tc.chunked {
					r.body = nil // (its framing is shown, not its bytes)
				}
				p := startProxyOn(t, []string{be}, func(c *Config) {
					c.PeekBody = 4096
					c.PeekMax, c.PeekBudget = tc.peekMax, tc.budget
					r.inner = c.Router
					c.Router = r
				}, gor)
				c, br := p.dial()
				head := fmt.Sprintf("POST /long HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n", len(body))
				wire := body
				if tc.chunked {
					head = "POST /long HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
					wire = chunk(body)
				}
				go func() {
					io.WriteString(c, head)
					for b := wire; len(b) > 0; {
						n := min(len(b), 40<<10)
						if _, err := c.Write(b[:n]); err != nil {
							return
						}
						b = b[n:]
					}
					io.WriteString(c, "POST /next HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\ntail")
				}()
				if resp, got := readResp(t, br, false); resp.StatusCode != 200 || got != sumOf(body) {
					t.Fatalf("long body: %d %q, want %q", resp.StatusCode, got, sumOf(body))
				}
				if resp, got := readResp(t, br, false); resp.StatusCode != 200 || got != sumOf([]byte("tail")) {
					t.Fatalf("pipelined: %d %q", resp.StatusCode, got)
				}
				if tc.chunked {
					close(r.seen) // (not seen: a chunked body has no Content-Length)
				} else if n := <-r.seen; n < tc.min || n > tc.max {
					t.Fatalf("the decision saw %d body bytes, want %d to %d", n, tc.min, tc.max)
				}
				r.mu.Lock()
				if r.bad != "" {
					t.Fatal(r.bad)
				}
				r.mu.Unlock()
				cs := p.srv.Counters()
				// (Within the budget, a request may be read further in
				// its 16 KiB buffer.)
				if n := cs.PeekMore.Load(); tc.min > bufSize && n != 1 || (tc.upTo == 0 || tc.chunked) && n != 0 {
					t.Fatalf("%d requests read further", n)
				}
				if tc.budget > 0 && cs.PeekBudgetFull.Load() == 0 {
					t.Fatal("the budget never said no")
				}
				c.Close()
				testenv.WaitFor(t, "the buffers back", func() bool { return cs.LargeBytes.Load() == 0 && cs.Buffers.Load() == 0 })
			})
		}
	}
}

// A client that stalls while the router waits for more of its body: the
// request is routed on what came once the I/O timeout passed (the loop's,
// then a goroutine's), and nothing is lost: the rest of the body, sent
// once the worker has the head, goes up after it, and the request
// pipelined behind it is answered.
func TestPeekMoreStall(t *testing.T) {
	testenv.CheckLeaks(t)
	for _, gor := range []bool{false, true} {
		t.Run(fmt.Sprintf("goroutines=%v", gor), func(t *testing.T) {
			body := bytes.Repeat([]byte("0123456789abcdef,"), 20000) // 340,000 bytes
			sent := 100 << 10
			arrived := make(chan string, 4)
			be := sumBackend(t, arrived)
			r := &moreRouter{upTo: 256 << 10, body: body, seen: make(chan int, 4)}
			p := startProxyOn(t, []string{be}, func(c *Config) {
				c.PeekBody = 4096
				c.IOTimeout = 300 * time.Millisecond
				r.inner = c.Router
				c.Router = r
			}, gor)
			c, br := p.dial()
			fmt.Fprintf(c, "POST /stall HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n", len(body))
			c.Write(body[:sent])
			select {
			case path := <-arrived:
				if path != "/stall" {
					t.Fatalf("%s arrived", path)
				}
			case <-time.After(15 * time.Second):
				t.Fatal("the stalled request was never routed")
			}
			go func() {
				c.Write(body[sent:])
				io.WriteString(c, "GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
			}()
			if resp, got := readResp(t, br, false); resp.StatusCode != 200 || got != sumOf(body) {
				t.Fatalf("stalled body: %d %q, want %q", resp.StatusCode, got, sumOf(body))
			}
			if resp, got := readResp(t, br, false); resp.StatusCode != 200 || got != sumOf(nil) {
				t.Fatalf("pipelined: %d %q", resp.StatusCode, got)
			}
			if n := <-r.seen; n < 4096 || n > sent {
				t.Fatalf("the decision saw %d body bytes, want 4096 to %d", n, sent)
			}
			r.mu.Lock()
			defer r.mu.Unlock()
			if r.bad != "" {
				t.Fatal(r.bad)
			}
		})
	}
}

// The head moved to a larger buffer is parsed again there: the head's
// fields (its path, its headers) go up as they came.
func TestPeekMoreHeadIntact(t *testing.T) {
	testenv.CheckLeaks(t)
	got := make(chan string, 1)
	be := httpBackend(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n, _ := io.Copy(io.Discard, r.Body)
		got <- fmt.Sprintf("%s %s %s %d", r.Method, r.URL.Path, r.Header.Get("X-Long"), n)
	}))
	body := bytes.Repeat([]byte("7,"), 100<<10)
	r := &moreRouter{upTo: 150 << 10, body: body, seen: make(chan int, 1)}
	p := startProxy(t, []string{be}, func(c *Config) {
		c.PeekBody = 4096
		r.inner = c.Router
		c.Router = r
	})
	long := strings.Repeat("v", 9000)
	c, br := p.dial()
	go func() {
		// Pipelined behind a short request: the head starts inside the
		// buffer, not at its start.
		io.WriteString(c, "GET /first HTTP/1.1\r\nHost: x\r\n\r\n")
		fmt.Fprintf(c, "PUT /second/path HTTP/1.1\r\nHost: x\r\nX-Long: %s\r\nContent-Length: %d\r\n\r\n", long, len(body))
		c.Write(body)
	}()
	for _, want := range []string{"GET /first  0", fmt.Sprintf("PUT /second/path %s %d", long, len(body))} {
		if resp, _ := readResp(t, br, false); resp.StatusCode != 200 {
			t.Fatalf("%d", resp.StatusCode)
		}
		if g := <-got; g != want {
			t.Fatalf("the worker got %.60q, want %.60q", g, want)
		}
	}
	if n := <-r.seen; n != 150<<10 {
		t.Fatalf("the decision saw %d", n)
	}
}

// BenchmarkPeekPlain: a keep-alive request without token ids through the
// event loop, with the router's PeekMore (route.Router, placement by the
// engines' caches on) and without it (PeekMax -1): a body within the peek
// never asks; one past it asks once, and the router finds no token ids.
func BenchmarkPeekPlain(b *testing.B) {
	be := rawBackend(b, func(c net.Conn) {
		br := bufio.NewReader(c)
		for {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			io.Copy(io.Discard, req.Body)
			if _, err := io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"); err != nil {
				return
			}
		}
	})
	chat := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("hello ", 160) + `"}]}`
	text := `{"text":"` + strings.Repeat("a long text prompt ", 1700) + `","sampling_params":{"max_new_tokens":8}}`
	for _, body := range []struct{ name, b string }{{"chat-1KiB", chat}, {"text-32KiB", text}} {
		for _, more := range []bool{false, true} {
			b.Run(fmt.Sprintf("%s/PeekMore=%v", body.name, more), func(b *testing.B) {
				p := startProxy(b, []string{be}, func(c *Config) {
					c.PeekBody = 4096
					if !more {
						c.PeekMax = -1
					}
				})
				if more {
					x := kvindex.New(kvindex.Config{})
					pp, err := route.NewPrefixPlacement(route.PrefixConfig{Index: x})
					if err != nil {
						b.Fatal(err)
					}
					id, _ := x.Register("0")
					pp.SetEngines(0, []kvindex.EngineID{id})
					p.router.SetPrefixPlacement(pp)
				}
				c, err := net.Dial("tcp", p.addr())
				if err != nil {
					b.Fatal(err)
				}
				defer c.Close()
				br := bufio.NewReader(c)
				req := []byte(fmt.Sprintf("POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s", len(body.b), body.b))
				b.ReportAllocs()
				b.SetBytes(int64(len(req)))
				b.ResetTimer()
				cpu := processCPU()
				for i := 0; i < b.N; i++ {
					if _, err := c.Write(req); err != nil {
						b.Fatal(err)
					}
					resp, err := http.ReadResponse(br, nil)
					if err != nil {
						b.Fatal(err)
					}
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
				b.StopTimer()
				// The process's CPU (client, proxy, worker): the same but
				// for the proxy's share in both runs.
				b.ReportMetric(float64(processCPU()-cpu)/float64(b.N), "cpu-ns/op")
				if n := p.srv.Counters().PeekMore.Load(); n != 0 {
					b.Fatalf("%d plain requests read further", n)
				}
			})
		}
	}
}

// processCPU is the process's user and system CPU time so far, in ns.
func processCPU() int64 {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return ru.Utime.Nano() + ru.Stime.Nano()
}
