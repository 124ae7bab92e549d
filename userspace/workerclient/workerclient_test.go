package workerclient

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/dialect"
)

func TestMain(m *testing.M) { os.Exit(testenv.RunNoLeaks(m)) }

// seen is what a test server saw of each request.
type seen struct {
	mu   sync.Mutex
	reqs []http.Header
	body []string
	addr []string
}

func (s *seen) add(r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reqs = append(s.reqs, r.Header.Clone())
	s.body = append(s.body, r.Method+" "+r.URL.RequestURI()+" "+string(b))
	s.addr = append(s.addr, r.RemoteAddr)
}

func server(t *testing.T, h http.HandlerFunc) (*httptest.Server, *seen) {
	s := &seen{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.add(r)
		h(w, r)
	}))
	t.Cleanup(srv.Close)
	return srv, s
}

func client(t *testing.T, o Options) *Client {
	c := New(o)
	t.Cleanup(c.Close)
	return c
}

func TestHeaders(t *testing.T) {
	srv, s := server(t, func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, `{"ok":true}`) })
	for _, tc := range []struct {
		name   string
		o      Options
		call   dialect.Call
		auth   string
		want   map[string]string
		gzip   bool
		record string
	}{
		{"bearer from the key", Options{APIKey: "k1", UserAgent: "tetherd-test"}, dialect.Call{Method: "GET", Path: "/x"}, "",
			map[string]string{"Authorization": "Bearer k1", "User-Agent": "tetherd-test", "Content-Type": ""}, true, "GET /x "},
		{"the caller's authorization wins", Options{APIKey: "k1", DisableCompression: true}, dialect.Call{Method: "POST", Path: "/a?b=c", Body: []byte(`{"x":1}`)}, "Basic zz",
			map[string]string{"Authorization": "Basic zz", "User-Agent": "Go-http-client/1.1", "Content-Type": "application/json"}, false, `POST /a?b=c {"x":1}`},
		{"no key, no authorization", Options{}, dialect.Call{Method: "POST", Path: "/p", Body: []byte{}}, "",
			map[string]string{"Authorization": "", "Content-Type": "application/json"}, true, "POST /p "},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := client(t, tc.o)
			a, err := c.Do(context.Background(), srv.URL, tc.call, tc.auth)
			if err != nil || a.Status != 200 || !a.OK() || a.StatusText != "200 OK" || string(a.Body) != `{"ok":true}` {
				t.Fatalf("%+v %v", a, err)
			}
			s.mu.Lock()
			h, rec := s.reqs[len(s.reqs)-1], s.body[len(s.body)-1]
			s.mu.Unlock()
			for k, v := range tc.want {
				if h.Get(k) != v {
					t.Errorf("%s: %q, want %q", k, h.Get(k), v)
				}
			}
			if got := h.Get("Accept-Encoding") == "gzip"; got != tc.gzip {
				t.Errorf("Accept-Encoding %q", h.Get("Accept-Encoding"))
			}
			if rec != tc.record {
				t.Errorf("request %q, want %q", rec, tc.record)
			}
		})
	}
}

func TestReadBound(t *testing.T) {
	big := bytes.Repeat([]byte("x"), 1<<20)
	srv, _ := server(t, func(w http.ResponseWriter, r *http.Request) { w.Write(big) })
	for _, bound := range []int64{0, 10, 100 << 10} {
		c := client(t, Options{MaxBody: bound})
		a, err := c.Do(context.Background(), srv.URL, dialect.Call{Method: "GET", Path: "/"}, "")
		want := bound
		if want == 0 {
			want = 64 << 10
		}
		if err != nil || int64(len(a.Body)) != want {
			t.Fatalf("bound %d: read %d bytes, %v", bound, len(a.Body), err)
		}
	}
}

func TestCutShort(t *testing.T) {
	srv, _ := server(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "100")
		w.WriteHeader(503)
		w.Write([]byte("short"))
	})
	c := client(t, Options{})
	a, err := c.Do(context.Background(), srv.URL, dialect.Call{Method: "GET", Path: "/"}, "")
	if !errors.Is(err, ErrCutShort) || a.Status != 503 || a.OK() {
		t.Fatalf("%+v %v", a, err)
	}
}

func TestBadURL(t *testing.T) {
	c := client(t, Options{})
	if _, err := c.Do(context.Background(), "http://[::1", dialect.Call{Method: "GET", Path: "/"}, ""); !errors.Is(err, ErrBadURL) {
		t.Fatalf("%v", err)
	}
	if _, err := c.Do(context.Background(), "http://x", dialect.Call{Method: "BAD METHOD", Path: "/"}, ""); !errors.Is(err, ErrBadURL) {
		t.Fatalf("%v", err)
	}
}

// A worker that never answers: the call ends at Timeout, or at the
// context's end when no Timeout is set.
func TestTimeout(t *testing.T) {
	release := make(chan struct{})
	srv, _ := server(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	})
	defer close(release)
	c := client(t, Options{Timeout: 50 * time.Millisecond})
	_, err := c.Do(context.Background(), srv.URL, dialect.Call{Method: "GET", Path: "/"}, "")
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("want a timeout, got %v", err)
	}
	c2 := client(t, Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := c2.Do(ctx, srv.URL, dialect.Call{Method: "GET", Path: "/"}, ""); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("want the context's deadline, got %v", err)
	}
}

func TestRedirects(t *testing.T) {
	srv, _ := server(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/from" {
			http.Redirect(w, r, "/to", http.StatusFound)
			return
		}
		fmt.Fprint(w, "here")
	})
	for _, follow := range []bool{false, true} {
		c := client(t, Options{FollowRedirects: follow})
		a, err := c.Do(context.Background(), srv.URL, dialect.Call{Method: "GET", Path: "/from"}, "")
		if err != nil {
			t.Fatal(err)
		}
		if follow && (a.Status != 200 || string(a.Body) != "here") || !follow && a.Status != http.StatusFound {
			t.Fatalf("follow %v: %+v", follow, a)
		}
	}
}

// MaxIdlePerHost 0: a fresh connection per call; otherwise one is reused.
func TestConnections(t *testing.T) {
	srv, s := server(t, func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "ok") })
	for _, tc := range []struct {
		idle  int
		conns int
	}{{0, 3}, {1, 1}} {
		s.mu.Lock()
		s.addr = nil
		s.mu.Unlock()
		c := client(t, Options{MaxIdlePerHost: tc.idle})
		for range 3 {
			if _, err := c.Do(context.Background(), srv.URL, dialect.Call{Method: "GET", Path: "/"}, ""); err != nil {
				t.Fatal(err)
			}
		}
		s.mu.Lock()
		distinct := map[string]bool{}
		for _, a := range s.addr {
			distinct[a] = true
		}
		s.mu.Unlock()
		if len(distinct) != tc.conns {
			t.Errorf("MaxIdlePerHost %d: %d connections for 3 calls, want %d", tc.idle, len(distinct), tc.conns)
		}
		c.Close()
	}
}
