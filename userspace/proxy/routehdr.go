package proxy

import (
	"strconv"

	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/worker"
)

// routeNote is the routing decision of a connection's exchange, kept for
// Config.RouteHeader.
type routeNote struct {
	slot    int32
	matched int32 // route.ReasonKVPrefix: the prompt tokens the engine held
	rank    int32 // the data-parallel rank to name upstream (ranked)
	reason  route.Reason
	set     bool // Config.RouteHeader names it
	ranked  bool // a worker of several DP ranks: appendRankHeader names rank
	// inBody: the rank goes in the body at bodyAt (appendUpstreamHead
	// decides, appendRankBody writes it).
	inBody bool
	bodyAt int32
}

// noteRoute records the decision the response head will name, for the
// goroutine's next exchange (proxy: exchange.rt; the loop's begin sets
// its exchange's from the decision).
func (c *conn) noteRoute(d route.Decision) {
	c.rt = c.s.routeNote(d)
}

// routeNote is what Config.RouteHeader will say of decision d.
func (s *Server) routeNote(d route.Decision) routeNote {
	if d.Worker == nil {
		return routeNote{}
	}
	n := routeNote{rank: int32(d.Rank), ranked: d.Ranks > 1 && d.Rank >= 0}
	if s.cfg.RouteHeader != "" {
		n.slot, n.matched, n.reason, n.set = int32(d.Worker.Slot), int32(d.Matched), d.Reason, true
	}
	return n
}

// appendRankHeader appends the engine's data-parallel rank header (vLLM
// X-data-parallel-rank) to the upstream head when the decision placed the
// request on one rank of a worker with several, and w's engine takes the
// rank in a header (dialect.Dialect.RankHeader; SGLang's routed_dp_rank
// is a body field: rankInBody). No allocation.
func appendRankHeader(out []byte, w *worker.Worker, rt routeNote) []byte {
	if !rt.ranked {
		return out
	}
	d := dialect.For(w.Engine())
	if d == nil || d.RankHeader == "" {
		return out
	}
	out = append(out, d.RankHeader...)
	out = append(out, ": "...)
	out = strconv.AppendInt(out, int64(rt.rank), 10)
	return append(out, "\r\n"...)
}

// appendRouteHeader appends "<RouteHeader>: <slot> <reason>" (no
// allocation: out is the connection's head buffer).
func (c *conn) appendRouteHeader(out []byte, rt routeNote) []byte {
	name := c.s.cfg.RouteHeader
	if name == "" || !rt.set {
		return out
	}
	out = append(out, name...)
	out = append(out, ": "...)
	out = strconv.AppendInt(out, int64(rt.slot), 10)
	out = append(out, ' ')
	if rt.reason == route.ReasonKVPrefix {
		// "prefix <matched tokens>".
		out = append(out, "prefix "...)
		out = strconv.AppendInt(out, int64(rt.matched), 10)
		return append(out, "\r\n"...)
	}
	out = append(out, rt.reason.String()...)
	return append(out, "\r\n"...)
}

// SGLang takes the rank in the body: routed_dp_rank, a top-level integer
// of GenerateReqInput and of its OpenAI requests (dialect.Dialect.RankField).
// The body is relayed unread (spliced past the bytes buffered with the
// head), so the field goes in at its start: right after the object's '{',
// "routed_dp_rank":<rank>, with the Content-Length raised by as much; the
// rest of the body moves as before, nothing more is buffered. Only for a
// Content-Length body whose buffered bytes open an object with a member,
// and no 100-continue wait (the head would go up before the body is seen);
// otherwise the engine's own balancer picks the rank, as without a rank.

// rankInBody returns where in c's buffered body (c.buf[c.r:]) the rank
// field goes (-1: it does not) and the field's name.
func (c *conn) rankInBody(w *worker.Worker, rt routeNote) (int, string) {
	req := c.req
	if !rt.ranked || req.ContentLength <= 0 || req.Chunked || req.Expect100 {
		return -1, ""
	}
	d := dialect.For(w.Engine())
	if d == nil || d.RankField == "" || d.RankHeader != "" {
		return -1, ""
	}
	b := c.buf[c.r:c.w]
	if int64(len(b)) > req.ContentLength {
		b = b[:req.ContentLength]
	}
	i := skipJSONSpace(b, 0)
	if i >= len(b) || b[i] != '{' {
		return -1, ""
	}
	if j := skipJSONSpace(b, i+1); j >= len(b) || b[j] != '"' {
		return -1, "" // an empty object, or its first member not buffered
	}
	return i + 1, d.RankField
}

func skipJSONSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// appendRankField appends "<field>":<rank>, to out.
func appendRankField(out []byte, field string, rank int32) []byte {
	out = append(out, '"')
	out = append(out, field...)
	out = append(out, '"', ':')
	out = strconv.AppendInt(out, int64(rank), 10)
	return append(out, ',')
}

// rankFieldLen is the length of appendRankField's text.
func rankFieldLen(field string, rank int32) int64 {
	var b [24]byte
	return int64(len(field) + 4 + len(strconv.AppendInt(b[:0], int64(rank), 10)))
}

// appendRankBody appends body, the request body's bytes buffered behind
// the head, to out, with the rank field where appendUpstreamHead placed
// it (rt.inBody). No allocation.
func (c *conn) appendRankBody(out, body []byte, w *worker.Worker, rt routeNote) []byte {
	out, rest := c.splitRankBody(out, body, w, rt, false)
	return append(out, rest...)
}

// splitRankBody is appendRankBody for a body read further for the router
// (peek.go), too long to copy: out takes what goes before the rank field
// and the field, rest is the body after it, to write from the buffer.
// Whole (split false, or no field in it): out takes all of body when it
// is no longer than a pooled buffer, else nothing of it.
func (c *conn) splitRankBody(out, body []byte, w *worker.Worker, rt routeNote, split bool) ([]byte, []byte) {
	if !rt.inBody || int(rt.bodyAt) > len(body) {
		if split && len(body) > bufSize {
			return out, body
		}
		return append(out, body...), nil
	}
	d := dialect.For(w.Engine())
	out = append(out, body[:rt.bodyAt]...)
	out = appendRankField(out, d.RankField, rt.rank)
	if split && len(body)-int(rt.bodyAt) > bufSize {
		return out, body[rt.bodyAt:]
	}
	return append(out, body[rt.bodyAt:]...), nil
}
