// Package httphead parses HTTP/1.1 message heads (RFC 9112) strictly and
// without allocating: a parsed head is a set of slices into the caller's
// buffer, so the proxy can forward every field it keeps byte-identically.
// Bodies are never seen here, except chunked framing, which Chunked
// validates as a stream so that it can be forwarded as it arrives.
//
// The rules follow docs/http-framing.md (cited as "docs/http-framing.md
// rule N"); each rejection names the status the proxy answers.
package httphead

import (
	"errors"
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
