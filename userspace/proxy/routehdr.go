package proxy

import (
	"strconv"

	"github.com/tether-rl/tether/userspace/route"
)

// routeNote is the routing decision of a connection's exchange, kept for
// Config.RouteHeader.
type routeNote struct {
	slot    int32
	matched int32 // route.ReasonKVPrefix: the prompt tokens the engine held
	reason  route.Reason
	set     bool
}

// noteRoute records the decision the response head will name (the
// goroutine path: gor.rt; the loop's exchange keeps its own, lx.rt).
func (c *conn) noteRoute(d route.Decision) {
	c.rt = c.s.routeNote(d)
}

// routeNote is what Config.RouteHeader will say of decision d.
func (s *Server) routeNote(d route.Decision) routeNote {
	if s.cfg.RouteHeader == "" || d.Worker == nil {
		return routeNote{}
	}
	return routeNote{slot: int32(d.Worker.Slot), matched: int32(d.Matched), reason: d.Reason, set: true}
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
