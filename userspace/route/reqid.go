package route

import (
	"strings"

	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/jsonpeek"
)

// Request ids: a client that retries a request (same id) while the first
// copy is still in flight has it sent to the worker serving that copy, so
// that the engine sees the duplicate instead of generating twice, and an
// abort of the id reaches the one worker that has it (package engine
// keeps the ids in flight: RequestOwners).

// requestIDFields are the top-level body members that carry a request id,
// in the engines' order (dialect.RequestIDKeys, unquoted), at most
// maxIDFields; requestIDHeaders the headers (dialect.RequestIDHeaders).
var (
	requestIDFields  = unquoted(dialect.RequestIDKeys())
	requestIDHeaders = dialect.RequestIDHeaders()
)

// maxIDFields bounds the request-id fields PrefixHash leaves out.
const maxIDFields = 4

func unquoted(keys []string) []string {
	out := make([]string, 0, len(keys))
	for _, k := range keys {
		out = append(out, strings.Trim(k, `"`))
	}
	return out[:min(len(out), maxIDFields)]
}

// isRequestIDField reports whether m is named by a request-id field, and
// which (its index in requestIDFields).
func isRequestIDField(m *jsonpeek.Member) (int, bool) {
	for k, name := range requestIDFields {
		if m.KeyIs(name) {
			return k, true
		}
	}
	return 0, false
}

// RequestOwners tracks which worker serves each request id in flight
// (engine.Owners).
type RequestOwners interface {
	// Owner returns the slot serving rid, if exactly one worker does.
	Owner(rid []byte) (slot int, ok bool)
	// Acquire records that rid is in flight on slot and returns the
	// function that releases it (called once, when the exchange ended).
	Acquire(rid string, slot int) (release func())
}

// RequestID returns the request id of a request: the string value of the
// first top-level request-id member of the body's JSON object (SGLang's
// rid, vLLM's request_id: dialect), when it is within the peeked bytes,
// else a request-id header; nil when there is none. The body form is
// returned as in the JSON text (still escaped: RequestIDString decodes
// it). A batch (a list of ids) is not tracked.
func RequestID(req *httphead.Request, body []byte) []byte {
	if b := PeekedBody(req, body); len(b) > 0 {
		o := jsonpeek.Open(b)
		for {
			m, st := o.Next()
			if st != jsonpeek.OK {
				break
			}
			if _, ok := isRequestIDField(&m); ok {
				if raw, _, ok := m.Str(); ok && len(raw) > 0 {
					return raw
				}
				break
			}
		}
	}
	for i := range req.Fields {
		f := &req.Fields[i]
		if len(f.Value) == 0 {
			continue
		}
		for _, h := range requestIDHeaders {
			if httphead.EqualFold(f.Name, h) {
				return f.Value
			}
		}
	}
	return nil
}

// RequestIDString returns a request id found by RequestID as a string,
// its JSON escapes decoded.
func RequestIDString(rid []byte) string {
	for _, c := range rid {
		if c == '\\' {
			if s, ok := jsonpeek.Unescape(nil, rid); ok {
				return string(s)
			}
			break
		}
	}
	return string(rid)
}

// trackRequestID records d's request id, if it has one, as in flight on
// d's worker until the exchange ends (d.Done).
func (rt *Router) trackRequestID(q *request, d *Decision) {
	if rt.Owners == nil || d.Worker == nil {
		return
	}
	rid := q.requestID()
	if rid == nil {
		return
	}
	release := rt.Owners.Acquire(RequestIDString(rid), d.Worker.Slot)
	if prev := d.Done; prev != nil {
		d.Done = func() { prev(); release() }
	} else {
		d.Done = release
	}
}
