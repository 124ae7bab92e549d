package pd

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// countingServer is an engine stand-in that counts the connections it
// accepted.
func countingServer(t *testing.T, h http.HandlerFunc) (*httptest.Server, *atomic.Int64) {
	var conns atomic.Int64
	s := httptest.NewUnstartedServer(h)
	s.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			conns.Add(1)
		}
	}
	s.Start()
	t.Cleanup(s.Close)
	return s, &conns
}

func post(t *testing.T, c *http.Client, ctx context.Context, url, body string) (*http.Response, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	return c.Do(req)
}

func TestLegTransport(t *testing.T) {
	echo := func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if r.URL.Query().Get("chunked") != "" {
			w.Write(b[:1])
			w.(http.Flusher).Flush()
			w.Write(b[1:])
			return
		}
		w.Write(b)
	}
	cases := []struct {
		name      string
		between   func(s *httptest.Server)
		readWhole bool
		wantConns int64
	}{
		{"reused once read to its end", nil, true, 1},
		{"chunked answers reused too", nil, true, 1},
		{"a body closed early is not reused", nil, false, 3},
		{"an idle connection the engine closed is not reused", func(s *httptest.Server) { s.CloseClientConnections() }, true, 3},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			s, conns := countingServer(t, echo)
			tr := newLegTransport()
			defer tr.CloseIdleConnections()
			client := &http.Client{Transport: tr}
			url := s.URL + "/x"
			if strings.HasPrefix(c.name, "chunked") {
				url += "?chunked=1"
			}
			for i := 0; i < 3; i++ {
				resp, err := post(t, client, context.Background(), url, "hello")
				if err != nil {
					t.Fatalf("request %d: %v", i, err)
				}
				if c.readWhole {
					b, err := io.ReadAll(resp.Body)
					if err != nil || string(b) != "hello" {
						t.Fatalf("request %d: %q %v", i, b, err)
					}
					// A read past the end still says the end.
					if n, err := resp.Body.Read(make([]byte, 8)); n != 0 || err != io.EOF {
						t.Fatalf("read past the end: %d %v", n, err)
					}
				}
				resp.Body.Close()
				if c.between != nil {
					c.between(s)
				}
			}
			if got := conns.Load(); got != c.wantConns {
				t.Errorf("%d connections for 3 requests, want %d", got, c.wantConns)
			}
		})
	}
}

// TestLegTransportCancel: cancelling a request closes its connection (the
// engine sees its client gone), whether the answer's head came or not.
func TestLegTransportCancel(t *testing.T) {
	for _, headFirst := range []bool{false, true} {
		arrived, gone := make(chan struct{}, 1), make(chan struct{}, 1)
		s, _ := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
			io.ReadAll(r.Body)
			arrived <- struct{}{}
			if headFirst {
				w.WriteHeader(200)
				w.(http.Flusher).Flush()
			}
			<-r.Context().Done()
			gone <- struct{}{}
		})
		tr := newLegTransport()
		client := &http.Client{Transport: tr}
		ctx, cancel := context.WithCancel(context.Background())
		errc, headc := make(chan error, 1), make(chan struct{}, 1)
		go func() {
			resp, err := post(t, client, ctx, s.URL, "x")
			if err == nil {
				headc <- struct{}{}
				_, err = io.ReadAll(resp.Body)
				resp.Body.Close()
			}
			errc <- err
		}()
		select {
		case <-arrived:
		case <-time.After(10 * time.Second):
			t.Fatalf("headFirst=%v: the request never reached the engine", headFirst)
		}
		if headFirst {
			// The head is in: the body is being read when the cancel comes.
			select {
			case <-headc:
			case <-time.After(10 * time.Second):
				t.Fatal("the answer's head never came")
			}
		}
		cancel()
		select {
		case err := <-errc:
			if err == nil {
				t.Errorf("headFirst=%v: a cancelled request ended without an error", headFirst)
			} else if !headFirst && !errors.Is(err, context.Canceled) {
				t.Errorf("headFirst=%v: %v, want the context's error", headFirst, err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("headFirst=%v: the cancelled request did not end", headFirst)
		}
		select {
		case <-gone:
		case <-time.After(10 * time.Second):
			t.Fatalf("headFirst=%v: the engine never saw its client gone", headFirst)
		}
		tr.CloseIdleConnections()
	}
}
