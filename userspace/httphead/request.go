// Requests: ParseRequest, the request line and the target's forms, the
// Host rules, and what a request's fields decide (framing, Expect,
// Connection, X-Forwarded-For).

package httphead

import (
	"bytes"
	"net/netip"
)

// ParseRequest parses the request head at the start of buf into req
// (reusing its Fields slice). It returns ErrIncomplete when more bytes are
// needed, or an *Error naming the status to answer.
func ParseRequest(buf []byte, lim Limits, req *Request) error {
	lim = lim.withDefaults()
	fields := req.Fields[:0]
	*req = Request{Fields: fields, ContentLength: -1}

	// Tolerate empty lines before the request line (RFC 9112 §2.2).
	start := 0
	for start+1 < len(buf) && buf[start] == '\r' && buf[start+1] == '\n' {
		start += 2
		if start > 64 {
			return reject(400, "too many empty lines before request")
		}
	}
	it := lineIter{buf: buf, pos: start}
	line, _, err := it.next()
	if err == ErrIncomplete {
		// A final CR may be the start of the CRLF ending a line of
		// exactly RequestLine octets.
		if n := len(buf) - start; n > lim.RequestLine && !(n == lim.RequestLine+1 && buf[len(buf)-1] == '\r') {
			return reject(414, "request line too long")
		}
		if len(buf) >= lim.Head {
			return reject(431, "head too large")
		}
		return err
	}
	if err != nil {
		return err
	}
	if len(line) > lim.RequestLine {
		return reject(414, "request line too long")
	}
	if err := parseRequestLine(line, req); err != nil {
		return err
	}
	n, err := parseFields(&it, lim, &req.Fields)
	if err != nil {
		return err
	}
	req.HeadLen = n
	return req.interpret()
}

func parseRequestLine(line []byte, req *Request) error {
	sp1 := bytes.IndexByte(line, ' ')
	if sp1 <= 0 {
		return reject(400, "bad request line")
	}
	req.Method = line[:sp1]
	if !isToken(req.Method) {
		return reject(400, "method is not a token")
	}
	rest := line[sp1+1:]
	sp2 := bytes.IndexByte(rest, ' ')
	if sp2 <= 0 {
		return reject(400, "bad request line")
	}
	req.Target = rest[:sp2]
	version := rest[sp2+1:]
	switch string(version) {
	case "HTTP/1.1":
		req.Minor = 1
	case "HTTP/1.0":
		req.Minor = 0
	default:
		return reject(400, "unsupported HTTP version")
	}
	for _, c := range req.Target {
		if c <= ' ' || c >= 0x7f {
			return reject(400, "bad byte in request target")
		}
	}
	t := req.Target
	switch {
	case t[0] == '/':
		req.Path = t
	case len(t) == 1 && t[0] == '*':
		if !req.IsMethod("OPTIONS") {
			return reject(400, "asterisk-form only with OPTIONS")
		}
		req.Path = t
	case hasPrefixFold(t, "http://") || hasPrefixFold(t, "https://"):
		// absolute-form: forward origin-form, Host from the target.
		auth := t[bytes.IndexByte(t, ':')+3:]
		end := bytes.IndexAny(auth, "/?#")
		path := []byte(nil)
		if end >= 0 {
			path = auth[end:]
			auth = auth[:end]
		}
		if bytes.IndexByte(auth, '@') >= 0 || !validHost(auth) || len(auth) == 0 {
			return reject(400, "bad authority in absolute-form target")
		}
		if len(path) == 0 || path[0] != '/' {
			if len(path) > 0 && path[0] == '#' {
				return reject(400, "fragment in request target")
			}
			// "http://h" or "http://h?q": origin-form is "/" + query.
			req.Path = append([]byte{'/'}, path...)
		} else {
			req.Path = path
		}
		req.Host = auth
		req.HostRewritten = true
	default:
		if req.IsMethod("CONNECT") {
			return reject(405, "CONNECT not supported")
		}
		return reject(400, "bad request target form")
	}
	if req.IsMethod("CONNECT") {
		return reject(405, "CONNECT not supported")
	}
	if bytes.IndexByte(req.Path, '#') >= 0 {
		return reject(400, "fragment in request target")
	}
	return nil
}

// validHost checks a Host value: reg-name or IP-literal, optional port.
func validHost(h []byte) bool {
	if len(h) == 0 {
		return true // empty Host is allowed (RFC 9112 §3.2) for no-authority URIs
	}
	host := h
	if h[0] == '[' {
		end := bytes.IndexByte(h, ']')
		if end < 0 {
			return false
		}
		for _, c := range h[1:end] {
			if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F' || c == ':' || c == '.') {
				return false
			}
		}
		if a, err := netip.ParseAddr(string(h[1:end])); err != nil || !a.Is6() {
			return false // "[]", "[1]", "[:::]", "[1.2.3.4]"
		}
		host = h[end+1:]
		if len(host) == 0 {
			return true
		}
		if host[0] != ':' {
			return false
		}
		return allDigits(host[1:])
	}
	if i := bytes.LastIndexByte(h, ':'); i >= 0 {
		if !allDigits(h[i+1:]) {
			return false
		}
		host = h[:i]
	}
	for _, c := range host {
		// unreserved / pct-encoded / sub-delims
		if !(tchar[c] && c != '|' && c != '^' && c != '`' && c != '#' || c == '(' || c == ')' || c == ',' || c == ';' || c == '=' || c == '%') {
			return false
		}
	}
	return true
}

// interpret applies the framing and connection rules to parsed fields.
func (req *Request) interpret() error {
	var (
		hosts, cls, tes int
		te              []byte
		conn            connTokens
	)
	for i := range req.Fields {
		f := &req.Fields[i]
		switch {
		case equalFold(f.Name, "Host"):
			hosts++
			if !validHost(f.Value) {
				return reject(400, "invalid Host")
			}
			if req.HostRewritten {
				f.Drop = true
			} else {
				req.Host = f.Value
			}
		case equalFold(f.Name, "Content-Length"):
			cls++
			n, ok := parseContentLength(f.Value)
			if !ok {
				return reject(400, "bad Content-Length")
			}
			req.ContentLength = n
		case equalFold(f.Name, "Transfer-Encoding"):
			tes++
			te = f.Value
		case equalFold(f.Name, "Expect"):
			if !equalFold(f.Value, "100-continue") {
				return reject(417, "unsupported expectation")
			}
			// An HTTP/1.0 client cannot be sent a 1xx: its expectation is
			// ignored (RFC 9110 §10.1.1) and not passed on.
			if req.Minor == 1 {
				req.Expect100 = true
			} else {
				f.Drop = true
			}
		case equalFold(f.Name, "Connection"):
			if err := conn.add(f.Value); err != nil {
				return err
			}
			f.Drop = true
		case equalFold(f.Name, "HTTP2-Settings"):
			// An h2c offer (docs/http-framing.md rule 20) is served over HTTP/1.1 with
			// the upgrade removed (RFC 9110 §7.8 lets a server ignore it):
			// Upgrade is hop-by-hop (hopByHop), Connection and the tokens
			// it names go with it, and HTTP2-Settings, connection-specific
			// (RFC 9113 §3.2.1, named or not), never reaches a worker.
			f.Drop = true
		case equalFold(f.Name, "X-Forwarded-For"):
			if len(req.XFF) > 0 {
				req.XFF = append(append(req.XFF[:len(req.XFF):len(req.XFF)], ", "...), f.Value...)
			} else {
				req.XFF = f.Value
			}
			f.Drop = true
		}
	}
	if hosts > 1 {
		return reject(400, "several Host fields")
	}
	if hosts == 0 && req.Minor == 1 && !req.HostRewritten {
		return reject(400, "missing Host")
	}
	if cls > 1 {
		return reject(400, "several Content-Length fields")
	}
	if tes > 0 {
		if req.Minor == 0 {
			return reject(400, "Transfer-Encoding in HTTP/1.0 request")
		}
		if cls > 0 {
			return reject(400, "both Transfer-Encoding and Content-Length")
		}
		if tes > 1 {
			return reject(400, "several Transfer-Encoding fields")
		}
		if err := checkTE(te); err != nil {
			return err
		}
		req.Chunked = true
	}
	if err := conn.apply(req.Fields, true); err != nil {
		return err
	}
	req.KeepAlive = req.Minor == 1 && !conn.close
	return nil
}
