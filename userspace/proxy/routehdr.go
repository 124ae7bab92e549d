package proxy

import (
	"strconv"

	"github.com/tether-rl/tether/userspace/route"
)

// routeNote is the routing decision of a connection's exchange, kept for
// Config.RouteHeader.
type routeNote struct {
	slot   int32
	reason route.Reason
	set    bool
}

// noteRoute records the decision the response head will name.
func (c *conn) noteRoute(d route.Decision) {
	if c.s.cfg.RouteHeader == "" {
		return
	}
	if d.Worker == nil {
		c.rt = routeNote{}
		return
	}
	c.rt = routeNote{slot: int32(d.Worker.Slot), reason: d.Reason, set: true}
}

// appendRouteHeader appends "<RouteHeader>: <slot> <reason>" (no
// allocation: out is the connection's head buffer).
func (c *conn) appendRouteHeader(out []byte) []byte {
	name := c.s.cfg.RouteHeader
	if name == "" || !c.rt.set {
		return out
	}
	out = append(out, name...)
	out = append(out, ": "...)
	out = strconv.AppendInt(out, int64(c.rt.slot), 10)
	out = append(out, ' ')
	out = append(out, c.rt.reason.String()...)
	return append(out, "\r\n"...)
}
