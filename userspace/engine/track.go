package engine

import (
	"encoding/json"

	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/route"
)

// requestIDHeaders are the headers that carry a request id.
var requestIDHeaders = dialect.RequestIDHeaders()

// Tracker is the data plane's router when request ids are tracked: it
// routes with Router, then records the worker serving the request's id in
// Owners until the exchange ends (route.Decision.Done). A request whose id
// is already in flight (a client retry) goes to the worker serving it, so
// that the engine sees the duplicate instead of generating twice, and an
// abort reaches both; session paths and X-SMG-Target-Worker keep
// precedence. Requests without an id cost one scan of the peeked body and
// allocate nothing.
type Tracker struct {
	Router *route.Router
	Owners *Owners
}

// Route implements proxy.Router.
func (t *Tracker) Route(req *httphead.Request, body []byte) route.Decision {
	rid := RequestID(req, body)
	if rid == nil {
		return t.Router.Route(req, body)
	}
	var d route.Decision
	pinned := false
	if slot, ok := t.Owners.Owner(rid); ok {
		if _, session := route.SessionID(req.Path); !session {
			if _, target := req.Lookup(route.TargetWorkerHeader); !target {
				d, pinned = t.Router.Pin(slot, route.ReasonRid)
			}
		}
	}
	if !pinned {
		d = t.Router.Route(req, body)
	}
	if d.Worker == nil {
		return d
	}
	release := t.Owners.Acquire(ridString(rid), d.Worker.Slot)
	if prev := d.Done; prev != nil {
		d.Done = func() { prev(); release() }
	} else {
		d.Done = release
	}
	return d
}

// Reroute implements proxy.Rerouter: the router places the request again
// (its first worker refused the connection), and the request id, if any,
// is recorded under the new worker.
func (t *Tracker) Reroute(req *httphead.Request, body []byte, d route.Decision) route.Decision {
	d = t.Router.Reroute(req, body, d)
	if d.Worker == nil {
		return d
	}
	if rid := RequestID(req, body); rid != nil {
		d.Done = t.Owners.Acquire(ridString(rid), d.Worker.Slot)
	}
	return d
}

// ridString returns the id, unescaping a JSON string body when needed.
func ridString(rid []byte) string {
	for _, c := range rid {
		if c == '\\' {
			var s string
			if json.Unmarshal(append(append([]byte{'"'}, rid...), '"'), &s) == nil {
				return s
			}
			break
		}
	}
	return string(rid)
}

// RequestID returns the request id of a request: the string value of the
// first request-id field (dialect.IsRequestIDField) of the top-level JSON
// object of the body, when it is within the peeked bytes, else a
// request-id header (dialect.RequestIDHeaders); nil when there is none.
// The body form is returned as in the JSON text (still escaped).
func RequestID(req *httphead.Request, body []byte) []byte {
	if body = route.PeekedBody(req, body); len(body) > 0 {
		if rid := bodyRID(body); len(rid) > 0 {
			return rid
		}
	}
	for i := range req.Fields {
		f := &req.Fields[i]
		if len(f.Value) == 0 {
			continue
		}
		for _, h := range requestIDHeaders {
			if len(f.Name) == len(h) && equalFold(f.Name, h) {
				return f.Value
			}
		}
	}
	return nil
}

func equalFold(b []byte, s string) bool {
	for i := 0; i < len(b); i++ {
		c, d := b[i]|0x20, s[i]|0x20
		if c != d {
			return false
		}
	}
	return true
}

// bodyRID scans the top-level object of a (possibly truncated) JSON body
// for the first request-id key (dialect.IsRequestIDField) with a string
// value, without allocating.
func bodyRID(b []byte) []byte {
	i := skipWS(b, 0)
	if i >= len(b) || b[i] != '{' {
		return nil
	}
	i++
	for {
		i = skipWS(b, i)
		if i >= len(b) || b[i] != '"' {
			return nil
		}
		ke, ok := route.ScanJSONString(b, i)
		if !ok {
			return nil
		}
		key := b[i+1 : ke-1]
		i = skipWS(b, ke)
		if i >= len(b) || b[i] != ':' {
			return nil
		}
		i = skipWS(b, i+1)
		if dialect.IsRequestIDField(key) {
			if i < len(b) && b[i] == '"' {
				if ve, ok := route.ScanJSONString(b, i); ok {
					return b[i+1 : ve-1]
				}
			}
			return nil // a list (batch) or another type: not tracked
		}
		if i, ok = route.SkipJSONValue(b, i); !ok {
			return nil
		}
		i = skipWS(b, i)
		if i >= len(b) || b[i] != ',' {
			return nil
		}
		i++
	}
}

func skipWS(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}
