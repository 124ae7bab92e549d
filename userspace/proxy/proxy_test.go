package proxy

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

func echoHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.Header().Set("X-Method", r.Method)
		w.Header().Set("X-Path", r.URL.RequestURI())
		w.Header().Set("X-XFF", r.Header.Get("X-Forwarded-For"))
		w.Header().Set("X-Host", r.Host)
		fmt.Fprintf(w, "%s", b)
	})
}

func TestBasicRequests(t *testing.T) {
	be := httpBackend(t, echoHandler())
	p := startProxy(t, []string{be}, nil)
	cases := []struct {
		name, raw, wantBody string
		wantStatus          int
		check               func(*http.Response) error
	}{
		{name: "get", raw: "GET /x?y=1 HTTP/1.1\r\nHost: a\r\n\r\n", wantStatus: 200, check: func(r *http.Response) error {
			if r.Header.Get("X-Path") != "/x?y=1" || r.Header.Get("X-Host") != "a" || r.Header.Get("X-XFF") != "127.0.0.1" {
				return fmt.Errorf("headers %v", r.Header)
			}
			return nil
		}},
		{name: "post cl", raw: "POST /p HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello", wantStatus: 200, wantBody: "hello"},
		{name: "post chunked", raw: "POST /p HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nhel\r\n2\r\nlo\r\n0\r\n\r\n", wantStatus: 200, wantBody: "hello"},
		{name: "xff appended", raw: "GET / HTTP/1.1\r\nHost: a\r\nX-Forwarded-For: 10.1.1.1\r\n\r\n", wantStatus: 200, check: func(r *http.Response) error {
			if got := r.Header.Get("X-XFF"); got != "10.1.1.1, 127.0.0.1" {
				return fmt.Errorf("xff %q", got)
			}
			return nil
		}},
		{name: "absolute form", raw: "GET http://example.org:81/abs?q HTTP/1.1\r\nHost: other\r\n\r\n", wantStatus: 200, check: func(r *http.Response) error {
			if r.Header.Get("X-Path") != "/abs?q" || r.Header.Get("X-Host") != "example.org:81" {
				return fmt.Errorf("headers %v", r.Header)
			}
			return nil
		}},
		{name: "te+cl rejected", raw: "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", wantStatus: 400},
		{name: "health local", raw: "GET /health HTTP/1.1\r\nHost: a\r\n\r\n", wantStatus: 200, check: func(r *http.Response) error {
			if r.Header.Get("X-Method") != "" {
				return fmt.Errorf("health was proxied")
			}
			return nil
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			resp, body := p.roundTrip(tc.raw)
			if resp.StatusCode != tc.wantStatus {
				t.Fatalf("status %d, want %d (body %q)", resp.StatusCode, tc.wantStatus, body)
			}
			if tc.wantBody != "" && body != tc.wantBody {
				t.Fatalf("body %q, want %q", body, tc.wantBody)
			}
			if tc.check != nil {
				if err := tc.check(resp); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}

func TestPipelining(t *testing.T) {
	be := httpBackend(t, echoHandler())
	p := startProxy(t, []string{be}, nil)
	c, br := p.dial()
	var raw strings.Builder
	for i := 0; i < 10; i++ {
		body := fmt.Sprintf("req-%d", i)
		if i%2 == 0 {
			fmt.Fprintf(&raw, "POST /%d HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n%s", i, len(body), body)
		} else {
			fmt.Fprintf(&raw, "POST /%d HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n", i, len(body), body)
		}
	}
	io.WriteString(c, raw.String())
	for i := 0; i < 10; i++ {
		resp, body := readResp(t, br, false)
		if want := fmt.Sprintf("req-%d", i); body != want || resp.Header.Get("X-Path") != fmt.Sprintf("/%d", i) {
			t.Fatalf("response %d: body %q path %q", i, body, resp.Header.Get("X-Path"))
		}
	}
}

// Each event reaches the client before the worker writes the next: the
// worker writes event 1 only once the client has read event 0, so a proxy
// that held an event back until more came (or until the end) never lets
// the client see it, and the client's deadline fails the test.
func TestSSEStreaming(t *testing.T) {
	read := make(chan struct{}, 3)
	be := httpBackend(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := 0; i < 3; i++ {
			fmt.Fprintf(w, "data: %d\n\n", i)
			w.(http.Flusher).Flush()
			select {
			case <-read:
			case <-time.After(30 * time.Second):
				return
			}
		}
	}))
	p := startProxy(t, []string{be}, nil)
	c, br := p.dial()
	defer c.Close()
	io.WriteString(c, "GET /s HTTP/1.1\r\nHost: a\r\n\r\n")
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	events := bufio.NewReader(resp.Body)
	for i := 0; i < 3; i++ {
		line, err := events.ReadString('\n')
		if want := fmt.Sprintf("data: %d\n", i); err != nil || line != want {
			t.Fatalf("event %d: %q %v, want %q before the worker writes the next (buffered?)", i, line, err, want)
		}
		events.ReadString('\n') // the blank line ending the event
		read <- struct{}{}
	}
}

func TestRefusedConnectRetriesOnceThen502(t *testing.T) {
	ln, _ := net.Listen("tcp4", "127.0.0.1:0")
	dead := ln.Addr().String()
	ln.Close()
	p := startProxy(t, []string{dead}, nil)
	resp, body := p.roundTrip("GET / HTTP/1.1\r\nHost: a\r\n\r\n")
	if resp.StatusCode != 502 || strings.Contains(body, "127.0.0.1") || strings.Contains(body, "refused") {
		t.Fatalf("got %d %q", resp.StatusCode, body)
	}
	if r := p.table.Get(0).Pool.Retries(0); r != 1 {
		t.Fatalf("connect retries %d, want 1", r)
	}
}
