package proxy

// Interim (1xx) responses and the clients that may get them.

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
)

// HTTP/1.0 clients are never sent a 1xx (RFC 9110 §15.2).
func TestHTTP10NoContinue(t *testing.T) {
	be := rawBackend(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		if req.Header.Get("Expect") != "" {
			io.WriteString(c, "HTTP/1.1 100 Continue\r\n\r\n")
		}
		io.Copy(io.Discard, req.Body)
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
	})
	p := startProxy(t, []string{be}, nil)
	c, br := p.dial()
	io.WriteString(c, "POST /x HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\nhello")
	line, err := br.ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "HTTP/1.1 200") {
		t.Fatalf("first line %q (%v), want the final 200", line, err)
	}
}
