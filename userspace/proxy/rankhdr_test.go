package proxy

import (
	"strconv"
	"strings"
	"testing"

	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/worker"
)

// TestRankHeader: a decision on one rank of a worker with several names
// the rank upstream in the header its engine reads (vLLM), and only then.
func TestRankHeader(t *testing.T) {
	vllm, sgl, unknown := &worker.Worker{Slot: 1}, &worker.Worker{Slot: 2}, &worker.Worker{Slot: 3}
	vllm.SetEngine(dialect.VLLM)
	sgl.SetEngine(dialect.SGLang)
	s := &Server{}
	for _, tc := range []struct {
		name string
		d    route.Decision
		want string
	}{
		{"vllm rank 2 of 4", route.Decision{Worker: vllm, Reason: route.ReasonKVPrefix, Rank: 2, Ranks: 4}, "X-data-parallel-rank: 2\r\n"},
		{"vllm rank 0 of 2", route.Decision{Worker: vllm, Reason: route.ReasonKVPrefix, Rank: 0, Ranks: 2}, "X-data-parallel-rank: 0\r\n"},
		{"vllm one rank", route.Decision{Worker: vllm, Reason: route.ReasonKVPrefix, Rank: 0, Ranks: 1}, ""},
		{"vllm no rank known", route.Decision{Worker: vllm, Reason: route.ReasonKVPrefix, Rank: -1, Ranks: 2}, ""},
		{"vllm other rule", route.Decision{Worker: vllm, Reason: route.ReasonSpread}, ""},
		{"sglang (body field)", route.Decision{Worker: sgl, Reason: route.ReasonKVPrefix, Rank: 1, Ranks: 2}, ""},
		{"engine unknown", route.Decision{Worker: unknown, Reason: route.ReasonKVPrefix, Rank: 1, Ranks: 2}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := string(appendRankHeader(nil, tc.d.Worker, s.routeNote(tc.d)))
			if got != tc.want {
				t.Fatalf("got %q, want %q", got, tc.want)
			}
		})
	}
	// The route header's own note is unchanged by the rank.
	s.cfg.RouteHeader = "X-Tether-Route"
	n := s.routeNote(route.Decision{Worker: vllm, Reason: route.ReasonKVPrefix, Matched: 48, Rank: 3, Ranks: 4})
	if !n.set || !n.ranked || n.rank != 3 || n.matched != 48 || n.slot != 1 {
		t.Fatalf("note %+v", n)
	}
	buf := make([]byte, 0, 64)
	if a := testing.AllocsPerRun(100, func() { buf = appendRankHeader(buf[:0], vllm, n) }); a != 0 {
		t.Fatalf("%v allocations", a)
	}
}

// TestRankInBody: a decision on one rank of a multi-rank SGLang worker
// names the rank in the body (routed_dp_rank right after the object's
// '{', Content-Length raised by as much); a body it cannot take it that
// way (chunked, 100-continue, not an object with a member buffered), a
// vLLM worker (the header) or one rank go up unchanged.
func TestRankInBody(t *testing.T) {
	vllm, sgl := &worker.Worker{Slot: 1, Addr: "w:1"}, &worker.Worker{Slot: 2, Addr: "w:2"}
	vllm.SetEngine(dialect.VLLM)
	sgl.SetEngine(dialect.SGLang)
	s := &Server{}
	const body = ` {"input_ids":[1,2,3],"sampling_params":{}}`
	cl := func(b string) string { return "Content-Length: " + strconv.Itoa(len(b)) + "\r\n" }
	for _, tc := range []struct {
		name, fields, body string
		d                  route.Decision
		wantCL, wantBody   string // "": unchanged
	}{
		{"sglang rank 2 of 4", cl(body), body, route.Decision{Worker: sgl, Reason: route.ReasonKVPrefix, Rank: 2, Ranks: 4},
			"Content-Length: 62\r\n", ` {"routed_dp_rank":2,"input_ids":[1,2,3],"sampling_params":{}}`},
		{"sglang rank 13, head only buffered in part", cl(body + "    "), body, route.Decision{Worker: sgl, Reason: route.ReasonKVPrefix, Rank: 13, Ranks: 16},
			"Content-Length: 67\r\n", ` {"routed_dp_rank":13,"input_ids":[1,2,3],"sampling_params":{}}`},
		{"sglang one rank", cl(body), body, route.Decision{Worker: sgl, Reason: route.ReasonKVPrefix, Rank: 0, Ranks: 1}, "", ""},
		{"vllm (header)", cl(body), body, route.Decision{Worker: vllm, Reason: route.ReasonKVPrefix, Rank: 1, Ranks: 2}, "", ""},
		{"chunked", "Transfer-Encoding: chunked\r\n", "2d\r\n" + body + "\r\n0\r\n\r\n", route.Decision{Worker: sgl, Reason: route.ReasonKVPrefix, Rank: 1, Ranks: 2}, "", ""},
		{"100-continue", cl(body) + "Expect: 100-continue\r\n", "", route.Decision{Worker: sgl, Reason: route.ReasonKVPrefix, Rank: 1, Ranks: 2}, "", ""},
		{"empty object", cl("{}"), "{}", route.Decision{Worker: sgl, Reason: route.ReasonKVPrefix, Rank: 1, Ranks: 2}, "", ""},
		{"not an object", cl("[1]"), "[1]", route.Decision{Worker: sgl, Reason: route.ReasonKVPrefix, Rank: 1, Ranks: 2}, "", ""},
		{"first member not buffered", cl(body), " {", route.Decision{Worker: sgl, Reason: route.ReasonKVPrefix, Rank: 1, Ranks: 2}, "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			raw := "POST /generate HTTP/1.1\r\nHost: w\r\n" + tc.fields + "\r\n" + tc.body
			req := &httphead.Request{}
			if err := httphead.ParseRequest([]byte(raw), httphead.Limits{}, req); err != nil {
				t.Fatal(err)
			}
			c := &conn{s: s, req: req, buf: []byte(raw), r: req.HeadLen, w: len(raw)}
			rt := s.routeNote(tc.d)
			head := string(c.appendUpstreamHead(nil, tc.d.Worker, &rt))
			got := string(c.appendRankBody(nil, c.buf[c.r:c.w], tc.d.Worker, rt))
			if tc.wantBody == "" {
				if got != tc.body || !strings.Contains(head, tc.fields) {
					t.Fatalf("changed: head %q body %q", head, got)
				}
				return
			}
			if got != tc.wantBody || !strings.Contains(head, tc.wantCL) || strings.Count(head, "Content-Length") != 1 {
				t.Fatalf("head %q body %q", head, got)
			}
			out := make([]byte, 0, 512)
			if a := testing.AllocsPerRun(50, func() {
				r := rt
				out = c.appendUpstreamHead(out[:0], tc.d.Worker, &r)
				out = c.appendRankBody(out, c.buf[c.r:c.w], tc.d.Worker, r)
			}); a != 0 {
				t.Fatalf("%v allocations", a)
			}
		})
	}
}

// TestSplitRankBody: a body read further for the router (longer than a
// pooled buffer) goes up as appendRankBody would write it, the rank field
// included, but its bytes after the field are written from the buffer,
// not copied; a short one is copied whole.
func TestSplitRankBody(t *testing.T) {
	sgl := &worker.Worker{Slot: 2, Addr: "w:2"}
	sgl.SetEngine(dialect.SGLang)
	s := &Server{}
	long := ` {"input_ids":[` + strings.Repeat("12345,", 4000) + `6],"sampling_params":{}}`
	for _, tc := range []struct {
		name  string
		body  string
		d     route.Decision
		split bool // rest is the body's own bytes
	}{
		{"long, rank field", long, route.Decision{Worker: sgl, Reason: route.ReasonKVPrefix, Rank: 1, Ranks: 2}, true},
		{"long, no field", long, route.Decision{Worker: sgl, Reason: route.ReasonKVPrefix, Rank: 0, Ranks: 1}, true},
		{"short, rank field", ` {"input_ids":[1,2]}`, route.Decision{Worker: sgl, Reason: route.ReasonKVPrefix, Rank: 1, Ranks: 2}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			raw := "POST /generate HTTP/1.1\r\nHost: w\r\nContent-Length: " + strconv.Itoa(len(tc.body)) + "\r\n\r\n" + tc.body
			req := &httphead.Request{}
			if err := httphead.ParseRequest([]byte(raw), httphead.Limits{}, req); err != nil {
				t.Fatal(err)
			}
			c := &conn{s: s, req: req, buf: []byte(raw), r: req.HeadLen, w: len(raw)}
			rt := s.routeNote(tc.d)
			c.appendUpstreamHead(nil, tc.d.Worker, &rt)
			body := c.buf[c.r:c.w]
			whole := string(c.appendRankBody(nil, body, tc.d.Worker, rt))
			out, rest := c.splitRankBody(nil, body, tc.d.Worker, rt, true)
			if string(out)+string(rest) != whole {
				t.Fatalf("split %.40q + %.40q, whole %.40q", out, rest, whole)
			}
			if !tc.split {
				if rest != nil {
					t.Fatalf("a short body split: rest %d bytes", len(rest))
				}
				return
			}
			if len(rest) < bufSize || &rest[len(rest)-1] != &body[len(body)-1] || len(out) > 64 {
				t.Fatalf("out %d bytes, rest %d bytes, not the body's own", len(out), len(rest))
			}
		})
	}
}
