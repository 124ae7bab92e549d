package proxy

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/sticky"
	"github.com/tether-rl/tether/userspace/worker"
)

// sessionServer answers POST /sessions with {"session_id":id} written the
// way write says (in one piece, head and body apart, chunked in pieces...)
// and any other request with 200 "ok".
func sessionServer(t *testing.T, id func() string, write func(c net.Conn, body string)) string {
	return rawBackend(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		for {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			req.Body.Close()
			if req.Method == "POST" && req.URL.Path == "/sessions" {
				write(c, `{"session_id": "`+id()+`", "status": "created"}`)
				continue
			}
			fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
		}
	})
}

// The id of a create answer is learned however the answer is cut up, and
// before the client has it; the answer reaches the client byte-identical.
func TestLearnFromCreateAnswer(t *testing.T) {
	// The backend's pieces, apart in time so that the proxy reads them
	// apart (paced on the backend's goroutine, where a test cannot wait).
	pause := func() { time.Sleep(5 * time.Millisecond) }
	big := strings.Repeat("x", 200<<10)
	for _, tc := range []struct {
		name  string
		write func(c net.Conn, body string)
		tail  string // what follows the JSON in the body
	}{
		{"one write", func(c net.Conn, body string) {
			fmt.Fprintf(c, "HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		}, ""},
		{"head then body in pieces", func(c net.Conn, body string) {
			fmt.Fprintf(c, "HTTP/1.1 201 Created\r\nContent-Length: %d\r\n\r\n", len(body))
			pause()
			c.Write([]byte(body[:20]))
			pause()
			c.Write([]byte(body[20:]))
		}, ""},
		{"large body, id first (the rest is spliced)", func(c net.Conn, body string) {
			body = body[:len(body)-1] + `,"pad":"` + big + `"}`
			fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n", len(body))
			pause()
			c.Write([]byte(body))
		}, "pad"},
		{"chunked in pieces", func(c net.Conn, body string) {
			io := "HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n"
			c.Write([]byte(io))
			pause()
			for _, piece := range []string{body[:7], body[7:30], body[30:]} {
				fmt.Fprintf(c, "%x\r\n%s\r\n", len(piece), piece)
				pause()
			}
			c.Write([]byte("0\r\n\r\n"))
		}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id := "3f2a9c1e-4b7d-4e21-9a0b-1c2d3e4f5a6b"
			backends := []string{sessionServer(t, func() string { return "other-worker-id" }, tc.write),
				sessionServer(t, func() string { return id }, tc.write)}
			p := startProxy(t, backends, nil)
			st := sticky.NewMemory(0)
			l, err := route.NewLearning(route.LearnConfig{Table: st})
			if err != nil {
				t.Fatal(err)
			}
			p.router.SetLearning(l)
			// Only worker 1 is healthy for the create: the id is its.
			p.table.Get(0).SetState(worker.Unhealthy)
			resp, body := p.roundTrip("POST /sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
			if resp.StatusCode/100 != 2 || !strings.Contains(body, `"session_id": "`+id+`"`) {
				t.Fatalf("create: %d %q", resp.StatusCode, body)
			}
			if tc.tail != "" && !strings.HasSuffix(body, big+`"}`) {
				t.Fatalf("body altered: %d bytes", len(body))
			}
			if c := l.Counts(); c.Learned != 1 {
				t.Fatalf("counts %+v", c)
			}
			p.table.Get(0).SetState(worker.Healthy)
			for i := 0; i < 4; i++ {
				d := p.router.Route(parseHead(t, "GET /sessions/"+id+"/state HTTP/1.1\r\nHost: x\r\n\r\n"), nil)
				if d.Worker == nil || d.Worker.Slot != 1 || d.Reason != route.ReasonLearned {
					t.Fatalf("turn: %+v", d)
				}
			}
		})
	}
}

// The client may send its first turn the moment it has the id, on another
// connection: the entry is in place by then.
func TestLearnedBeforeClientSeesID(t *testing.T) {
	var n atomic.Int64
	mint := func() string { return fmt.Sprintf("0b5e0c3a-9d1f-4c7e-8a2b-%012d", n.Add(1)) }
	write := func(c net.Conn, body string) {
		fmt.Fprintf(c, "HTTP/1.1 201 Created\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	}
	p := startProxy(t, []string{sessionServer(t, mint, write)}, nil)
	l, _ := route.NewLearning(route.LearnConfig{Table: sticky.NewMemory(0)})
	p.router.SetLearning(l)
	p.router.SetBadSession(route.BadSessionReject)
	for i := 0; i < 50; i++ {
		c, br := p.dial()
		c.Write([]byte("POST /sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"))
		if _, err := br.ReadString('}'); err != nil { // the id has arrived
			t.Fatal(err)
		}
		id := fmt.Sprintf("0b5e0c3a-9d1f-4c7e-8a2b-%012d", i+1)
		c2, br2 := p.dial()
		c2.Write([]byte("GET /sessions/" + id + "/x HTTP/1.1\r\nHost: x\r\n\r\n"))
		resp, _ := readResp(t, br2, false)
		if resp.StatusCode != 200 {
			t.Fatalf("turn %d right after the create: %d", i, resp.StatusCode)
		}
		c.Close()
		c2.Close()
	}
}

// parseHead parses a request head for calling the router directly.
func parseHead(t *testing.T, raw string) *httphead.Request {
	t.Helper()
	req := &httphead.Request{}
	if err := httphead.ParseRequest([]byte(raw), httphead.Limits{}, req); err != nil {
		t.Fatal(err)
	}
	return req
}
