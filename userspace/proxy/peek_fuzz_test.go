package proxy

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/route"
)

// askRouter asks for more of a body as its current script says: the k-th
// question gets len(body) + asks[k] KiB (0, or past the script: decide).
type askRouter struct {
	inner Router
	asks  atomic.Pointer[[]byte]
	k     atomic.Int64
}

func (r *askRouter) Route(req *httphead.Request, body []byte) route.Decision {
	return r.inner.Route(req, body)
}

func (r *askRouter) PeekMore(req *httphead.Request, body []byte) int {
	asks := *r.asks.Load()
	k := int(r.k.Add(1)) - 1
	if k >= len(asks) || asks[k] == 0 {
		return 0
	}
	return len(body) + int(asks[k])<<10
}

// FuzzPeekMore: whatever the router asks for (a script of asks), however
// the client's bytes are cut up in time, a request whose body is read
// further before routing reaches the worker byte for byte, and the
// request pipelined behind it too, on the event loop and the goroutine
// path.
func FuzzPeekMore(f *testing.F) {
	f.Add(uint16(300), []byte{16, 64, 200}, []byte{3, 40, 90})
	f.Add(uint16(20), []byte{255}, []byte{})
	f.Add(uint16(1000), []byte{1, 1, 1, 1, 1, 1, 1, 1}, []byte{1, 2, 3, 200})
	f.Add(uint16(5), []byte{}, []byte{0})
	be := rawBackend(f, func(c net.Conn) {
		br := bufio.NewReader(c)
		for {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			b, err := io.ReadAll(req.Body)
			if err != nil {
				return
			}
			sum := sumOf(b)
			if _, err := fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(sum), sum); err != nil {
				return
			}
		}
	})
	var routers [2]*askRouter
	var proxies [2]*testProxy
	for i := range proxies {
		r := &askRouter{}
		routers[i] = r
		proxies[i] = startProxyOn(f, []string{be}, func(c *Config) {
			c.PeekBody = 4096
			r.inner = c.Router
			c.Router = r
		}, i == 1)
	}
	f.Fuzz(func(t *testing.T, kib uint16, asks, cuts []byte) {
		size := int(kib%1200)<<10 + int(kib)%1000
		body := make([]byte, size)
		for i := range body {
			body[i] = byte(i*7 + i>>8)
		}
		wire := fmt.Appendf(nil, "POST /f HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n", size)
		wire = append(wire, body...)
		wire = append(wire, "POST /g HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok"...)
		for i, p := range proxies {
			routers[i].asks.Store(&asks)
			routers[i].k.Store(0)
			c, err := net.Dial("tcp", p.addr())
			if err != nil {
				t.Fatal(err)
			}
			c.SetDeadline(time.Now().Add(20 * time.Second))
			done := make(chan struct{})
			go func() {
				defer close(done)
				b := wire
				for _, cut := range cuts {
					n := min(len(b), int(cut)<<9)
					if _, err := c.Write(b[:n]); err != nil {
						return
					}
					b = b[n:] // (each write its own segment: no Nagle)
				}
				c.Write(b)
			}()
			br := bufio.NewReader(c)
			for _, want := range []string{sumOf(body), sumOf([]byte("ok"))} {
				resp, got := readResp(t, br, false)
				if resp.StatusCode != 200 || got != want {
					t.Fatalf("goroutines=%v: %d %q, want %q", i == 1, resp.StatusCode, got, want)
				}
			}
			c.Close()
			<-done
		}
	})
}
