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
// is a body field, not written here). No allocation.
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
