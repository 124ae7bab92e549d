package evloop

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"testing"
	"time"
)

// The experiment proxies keep-alive requests by session path, pipelined
// ones in order, and answers 502 to what it does not handle (a chunked
// request), closing that connection.
func TestKeepAlivePath(t *testing.T) {
	var backends []string
	for i := range 2 {
		ln, err := net.Listen("tcp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			b, _ := io.ReadAll(r.Body)
			fmt.Fprintf(w, "w%d %s %s", i, r.URL.Path, b)
		})}
		go srv.Serve(ln)
		t.Cleanup(func() { srv.Close() })
		backends = append(backends, ln.Addr().String())
	}
	ln, _ := net.Listen("tcp4", "127.0.0.1:0")
	addr := ln.Addr().String()
	ln.Close()
	go Serve(addr, backends, 2)
	var c net.Conn
	var err error
	for i := 0; i < 200; i++ {
		if c, err = net.Dial("tcp4", addr); err == nil {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	br := bufio.NewReader(c)
	// Two pipelined requests, then one more on the same connection.
	io.WriteString(c, "POST /sessions/w1-abc/x HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhiGET /sessions/w0-abc/y HTTP/1.1\r\nHost: a\r\n\r\n")
	for _, want := range []string{"w1 /sessions/w1-abc/x hi", "w0 /sessions/w0-abc/y "} {
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != 200 || string(b) != want {
			t.Fatalf("got %d %q, want %q", resp.StatusCode, b, want)
		}
	}
	io.WriteString(c, "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n")
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != 502 || !resp.Close {
		t.Fatalf("chunked request: %v %v, want 502 and close", resp, err)
	}
}
