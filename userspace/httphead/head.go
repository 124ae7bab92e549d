// Package httphead parses HTTP/1.1 message heads (RFC 9112) strictly and
// without allocating: a parsed head is a set of slices into the caller's
// buffer, so the proxy can forward every field it keeps byte-identically.
// Bodies are never seen here, except chunked framing, which Chunked
// validates as a stream so that it can be forwarded as it arrives.
//
// The rules follow shared/http-framing-checklist.md; each rejection names
// the status the proxy answers.
package httphead

import (
	"bytes"
	"errors"
	"net/netip"
)

// ErrIncomplete means the buffer does not yet hold a whole head: read more.
var ErrIncomplete = errors.New("incomplete head")

// Error is a head that must be rejected with Status.
type Error struct {
	Status int
	Reason string // fixed text for logs and tests, never client data
}

func (e *Error) Error() string { return e.Reason }

func reject(status int, reason string) error { return &Error{Status: status, Reason: reason} }

// Limits bound a head. Zero values take the defaults.
type Limits struct {
	RequestLine int // longest request line (without CRLF); default 8192, then 414
	Head        int // longest head; default 65536, then 431
	Fields      int // most fields; default 128, then 431
	// ChunkExt: chunk-extension bytes allowed in one chunked request body
	// (Chunked.ExtLimit); default MaxChunkExtBytes, then 400.
	ChunkExt int
}

// Defaults for Limits.
const (
	DefaultRequestLine = 8192
	DefaultHead        = 64 << 10
	DefaultFields      = 128
)

func (l Limits) withDefaults() Limits {
	if l.RequestLine <= 0 {
		l.RequestLine = DefaultRequestLine
	}
	if l.Head <= 0 {
		l.Head = DefaultHead
	}
	if l.Fields <= 0 {
		l.Fields = DefaultFields
	}
	return l
}

// Field is one header line.
type Field struct {
	Name  []byte // as received
	Value []byte // without surrounding whitespace
	Line  []byte // the whole line including CRLF, forwarded as is
	Drop  bool   // hop-by-hop or replaced: not forwarded
}

// Request is a parsed request head.
type Request struct {
	Method []byte
	Target []byte // as received
	Path   []byte // origin-form target to forward (differs for absolute-form)
	Minor  int    // HTTP/1.Minor, 0 or 1
	Fields []Field
	// Host is the authority to forward: the Host field, or the authority of
	// an absolute-form target (then HostRewritten is set and every Host
	// field is dropped).
	Host          []byte
	HostRewritten bool
	ContentLength int64 // -1 without Content-Length
	Chunked       bool
	KeepAlive     bool // the client connection may serve another request
	Expect100     bool
	XFF           []byte // combined value of received X-Forwarded-For fields (dropped)
	HeadLen       int    // bytes of the head, CRLFCRLF included
}

// HasBody reports whether a body follows the head.
func (r *Request) HasBody() bool { return r.Chunked || r.ContentLength > 0 }

// IsMethod compares the method.
func (r *Request) IsMethod(m string) bool { return string(r.Method) == m }

// Lookup returns the value of the first field named name (case-insensitive).
func (r *Request) Lookup(name string) ([]byte, bool) { return lookup(r.Fields, name) }

// Response is a parsed response head.
type Response struct {
	Minor         int
	Status        int
	Fields        []Field
	ContentLength int64 // -1 without Content-Length
	Chunked       bool
	Close         bool // the backend will close (Connection: close, or HTTP/1.0 without keep-alive)
	HeadLen       int
}

// Lookup returns the value of the first field named name (case-insensitive).
func (r *Response) Lookup(name string) ([]byte, bool) { return lookup(r.Fields, name) }

func lookup(fs []Field, name string) ([]byte, bool) {
	for i := range fs {
		if equalFold(fs[i].Name, name) {
			return fs[i].Value, true
		}
	}
	return nil, false
}

// tchar per RFC 9110 §5.6.2.
var tchar = func() (t [256]bool) {
	for c := '0'; c <= '9'; c++ {
		t[c] = true
	}
	for c := 'a'; c <= 'z'; c++ {
		t[c] = true
		t[c-32] = true
	}
	for _, c := range "!#$%&'*+-.^_`|~" {
		t[c] = true
	}
	return t
}()

func isToken(b []byte) bool {
	if len(b) == 0 {
		return false
	}
	for _, c := range b {
		if !tchar[c] {
			return false
		}
	}
	return true
}

// IsToken reports whether s is an RFC 9110 token (a valid field name).
func IsToken(s string) bool { return isToken([]byte(s)) }

// EqualFold compares a received name with an ASCII name, case-insensitively.
func EqualFold(b []byte, s string) bool { return equalFold(b, s) }

// equalFold compares ASCII case-insensitively.
func equalFold(b []byte, s string) bool {
	if len(b) != len(s) {
		return false
	}
	for i := 0; i < len(b); i++ {
		c, d := b[i], s[i]
		if c == d {
			continue
		}
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if 'A' <= d && d <= 'Z' {
			d += 'a' - 'A'
		}
		if c != d {
			return false
		}
	}
	return true
}

// hopByHop are removed whatever Connection says (RFC 9110 §7.6.1).
// Trailer is not among them: it is end-to-end (RFC 9110 §6.6.2), and the
// trailers it announces are forwarded with the chunked body.
var hopByHop = []string{"Connection", "Keep-Alive", "Proxy-Connection", "TE", "Upgrade"}

// lines splits the head in buf into lines ending in CRLF, enforcing the
// line-ending rules (no bare CR or LF). It returns the head length, or
// ErrIncomplete. firstMax bounds the first line (414 for requests).
type lineIter struct {
	buf []byte
	pos int
}

// next returns the next line without its CRLF and the line with it.
func (it *lineIter) next() (line, raw []byte, err error) {
	rest := it.buf[it.pos:]
	i := bytes.IndexByte(rest, '\n')
	if i < 0 {
		if j := bytes.IndexByte(rest, '\r'); j >= 0 && j+1 < len(rest) {
			return nil, nil, reject(400, "bare CR in head")
		}
		return nil, nil, ErrIncomplete
	}
	if i == 0 || rest[i-1] != '\r' {
		return nil, nil, reject(400, "bare LF in head")
	}
	line = rest[:i-1]
	if bytes.IndexByte(line, '\r') >= 0 {
		return nil, nil, reject(400, "bare CR in head")
	}
	raw = rest[:i+1]
	it.pos += i + 1
	return line, raw, nil
}

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

func hasPrefixFold(b []byte, p string) bool {
	return len(b) >= len(p) && equalFold(b[:len(p)], p)
}

// parseFields reads field lines up to the empty line, validating names and
// values. It returns the head length.
func parseFields(it *lineIter, lim Limits, out *[]Field) (int, error) {
	for {
		line, raw, err := it.next()
		if err == ErrIncomplete {
			if len(it.buf) >= lim.Head {
				return 0, reject(431, "head too large")
			}
			return 0, err
		}
		if err != nil {
			return 0, err
		}
		if it.pos > lim.Head {
			return 0, reject(431, "head too large")
		}
		if len(line) == 0 {
			return it.pos, nil
		}
		if line[0] == ' ' || line[0] == '\t' {
			return 0, reject(400, "obs-fold or whitespace before field")
		}
		colon := bytes.IndexByte(line, ':')
		if colon <= 0 {
			return 0, reject(400, "field without name or colon")
		}
		name := line[:colon]
		if !isToken(name) {
			return 0, reject(400, "bad field name")
		}
		value := line[colon+1:]
		for _, c := range value {
			if c < ' ' && c != '\t' || c == 0x7f {
				return 0, reject(400, "control byte in field value")
			}
		}
		if len(*out) >= lim.Fields {
			return 0, reject(431, "too many fields")
		}
		*out = append(*out, Field{Name: name, Value: trimOWS(value), Line: raw})
	}
}

func trimOWS(b []byte) []byte {
	for len(b) > 0 && (b[0] == ' ' || b[0] == '\t') {
		b = b[1:]
	}
	for len(b) > 0 && (b[len(b)-1] == ' ' || b[len(b)-1] == '\t') {
		b = b[:len(b)-1]
	}
	return b
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

func allDigits(b []byte) bool {
	for _, c := range b {
		if c < '0' || c > '9' {
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
			// An h2c offer (checklist rule 20) is served over HTTP/1.1 with
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

// checkTE accepts exactly "chunked" (case-insensitive, OWS trimmed).
func checkTE(v []byte) error {
	if equalFold(v, "chunked") {
		return nil
	}
	// Tell a well-formed list ending in one chunked (an unsupported coding:
	// 501) from anything else (400).
	var chunked, bad bool
	elems := bytes.Split(v, []byte{','})
	for i, e := range elems {
		e = trimOWS(e)
		if !isToken(e) {
			bad = true
			break
		}
		if equalFold(e, "chunked") {
			if chunked || i != len(elems)-1 {
				bad = true
			}
			chunked = true
		}
		if equalFold(e, "identity") {
			bad = true
		}
	}
	if !bad && chunked && len(elems) > 1 {
		return reject(501, "unsupported transfer coding")
	}
	return reject(400, "bad Transfer-Encoding")
}

// parseContentLength accepts 1*DIGIT, at most 19 digits.
func parseContentLength(v []byte) (int64, bool) {
	if len(v) == 0 || len(v) > 19 {
		return 0, false
	}
	var n int64
	for _, c := range v {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int64(c-'0')
	}
	if n < 0 {
		return 0, false
	}
	return n, true
}

// connTokens collects the Connection field's tokens.
type connTokens struct {
	close, keepAlive bool
	named            [8][]byte
	n                int
	more             [][]byte
}

func (c *connTokens) add(v []byte) error {
	for len(v) > 0 {
		var tok []byte
		if i := bytes.IndexByte(v, ','); i >= 0 {
			tok, v = trimOWS(v[:i]), v[i+1:]
		} else {
			tok, v = trimOWS(v), nil
		}
		if len(tok) == 0 {
			continue
		}
		if !isToken(tok) {
			return reject(400, "bad Connection token")
		}
		switch {
		case equalFold(tok, "close"):
			c.close = true
		case equalFold(tok, "keep-alive"):
			c.keepAlive = true
		default:
			if c.n < len(c.named) {
				c.named[c.n] = tok
				c.n++
			} else {
				c.more = append(c.more, tok)
			}
		}
	}
	return nil
}

// apply marks as dropped every field Connection names and every fixed
// hop-by-hop field. For requests, naming a framing field or one tether
// adds is an attack: 400.
func (c *connTokens) apply(fs []Field, request bool) error {
	names := append(c.named[:c.n:c.n], c.more...)
	// Connection may not remove the framing (either direction: the peer
	// would then be left without one), nor the fields tether sets.
	protected, status := protectedResponse, 502
	if request {
		protected, status = protectedRequest, 400
	}
	for _, n := range names {
		for _, bad := range protected {
			if equalFold(n, bad) {
				return reject(status, "Connection names a protected field")
			}
		}
	}
	for i := range fs {
		f := &fs[i]
		if f.Drop {
			continue
		}
		for _, h := range hopByHop {
			if equalFold(f.Name, h) {
				f.Drop = true
				break
			}
		}
		for _, n := range names {
			if bytes.EqualFold(f.Name, n) {
				f.Drop = true
				break
			}
		}
	}
	return nil
}

var (
	protectedRequest  = []string{"Content-Length", "Transfer-Encoding", "Host", "X-Forwarded-For"}
	protectedResponse = []string{"Content-Length", "Transfer-Encoding"}
)

// ParseResponse parses the response head at the start of buf into resp.
// It returns ErrIncomplete, or an *Error (status 502: the backend broke the
// protocol).
func ParseResponse(buf []byte, lim Limits, resp *Response) error {
	lim = lim.withDefaults()
	fields := resp.Fields[:0]
	*resp = Response{Fields: fields, ContentLength: -1}
	it := lineIter{buf: buf}
	line, _, err := it.next()
	if err == ErrIncomplete {
		if len(buf) >= lim.Head {
			return reject(502, "response head too large")
		}
		return err
	}
	if err != nil {
		return reject(502, "bad line ending in response head")
	}
	// status-line = HTTP-version SP 3DIGIT SP [reason]
	if len(line) < 12 || !bytes.HasPrefix(line, []byte("HTTP/1.")) || line[8] != ' ' {
		return reject(502, "bad status line")
	}
	switch line[7] {
	case '0':
		resp.Minor = 0
	case '1':
		resp.Minor = 1
	default:
		return reject(502, "bad response version")
	}
	code := line[9:12]
	if !allDigits(code) || code[0] == '0' || len(line) > 12 && line[12] != ' ' {
		return reject(502, "bad status code")
	}
	resp.Status = int(code[0]-'0')*100 + int(code[1]-'0')*10 + int(code[2]-'0')
	for _, c := range line[12:] {
		if c < ' ' && c != '\t' || c == 0x7f {
			return reject(502, "control byte in reason")
		}
	}
	n, err := parseFields(&it, lim, &resp.Fields)
	if err == ErrIncomplete {
		return err
	}
	if err != nil {
		return reject(502, "bad response field")
	}
	resp.HeadLen = n
	var (
		cls, tes int
		conn     connTokens
	)
	for i := range resp.Fields {
		f := &resp.Fields[i]
		switch {
		case equalFold(f.Name, "Content-Length"):
			cls++
			v, ok := parseContentLength(f.Value)
			if !ok {
				return reject(502, "bad Content-Length in response")
			}
			resp.ContentLength = v
		case equalFold(f.Name, "Transfer-Encoding"):
			tes++
			if !equalFold(f.Value, "chunked") {
				return reject(502, "unsupported Transfer-Encoding in response")
			}
		case equalFold(f.Name, "Connection"):
			if err := conn.add(f.Value); err != nil {
				return reject(502, "bad Connection in response")
			}
			f.Drop = true
		}
	}
	if cls > 1 || tes > 1 || cls > 0 && tes > 0 {
		return reject(502, "ambiguous response framing")
	}
	resp.Chunked = tes == 1
	if tes == 1 && resp.Minor == 0 {
		return reject(502, "Transfer-Encoding in HTTP/1.0 response")
	}
	if err := conn.apply(resp.Fields, false); err != nil {
		return err
	}
	resp.Close = conn.close || resp.Minor == 0 && !conn.keepAlive
	return nil
}

// BodyKind says how a response body is framed.
type BodyKind int

const (
	BodyNone   BodyKind = iota // HEAD, 1xx, 204, 304
	BodyLength                 // Content-Length bytes
	BodyChunked
	BodyClose // until the backend closes
)

// Body returns the framing of the response to a request with method
// isHead/not.
func (r *Response) Body(isHead bool) BodyKind {
	switch {
	case isHead || r.Status < 200 || r.Status == 204 || r.Status == 304:
		return BodyNone
	case r.Chunked:
		return BodyChunked
	case r.ContentLength >= 0:
		return BodyLength
	default:
		return BodyClose
	}
}
