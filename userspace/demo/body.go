// Bodies: the pooled buffers, reading a request body (whole, bounded,
// decoded as JSON), writing a JSON answer or an OpenAI-shaped error, and
// generated request ids.

package demo

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"
	"sync"
)

var bufPool = sync.Pool{New: func() any { b := make([]byte, 0, 4096); return &b }}

func getBuf() *[]byte { return bufPool.Get().(*[]byte) }

func putBuf(b *[]byte) {
	if cap(*b) > 1<<20 {
		return
	}
	*b = (*b)[:0]
	bufPool.Put(b)
}

var piecePool = sync.Pool{New: func() any { b := make([]byte, blobPiece); return &b }}

// writeBody answers code with a JSON body.
func (w *Worker) writeBody(rw http.ResponseWriter, code int, body []byte) {
	rw.Header()["Content-Type"] = ctJSON
	rw.WriteHeader(code)
	rw.Write(body)
}

// writeError answers an OpenAI-shaped JSON error.
func (w *Worker) writeError(rw http.ResponseWriter, code int, typ, msg string) {
	bp := getBuf()
	defer putBuf(bp)
	b := append(*bp, `{"error":{"message":`...)
	b = appendJSONString(b, msg)
	b = appendStringField(b, "type", typ)
	b = appendIntField(b, "code", int64(code))
	b = append(b, '}')
	b = append(b, w.workerField...)
	b = append(b, "}\n"...)
	*bp = b
	w.writeBody(rw, code, b)
}

var errTooLarge = errors.New("request body too large")

// readBody appends the whole of r to b, at most maxBody bytes.
func readBody(r io.Reader, b []byte) ([]byte, error) {
	for {
		if len(b) == cap(b) {
			if len(b) >= maxBody {
				return b, errTooLarge
			}
			b = append(b, 0)[:len(b)]
		}
		n, err := r.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		if err == io.EOF {
			return b, nil
		}
		if err != nil {
			return b, err
		}
	}
}

// readJSON reads the request body whole into *bp and decodes it into v. An
// empty body decodes as {}. It answers the error itself and returns false.
func (w *Worker) readJSON(rw http.ResponseWriter, r *http.Request, bp *[]byte, v any) ([]byte, bool) {
	body, err := readBody(r.Body, (*bp)[:0])
	*bp = body
	if err != nil {
		if err == errTooLarge {
			w.writeError(rw, http.StatusRequestEntityTooLarge, "invalid_request_error", err.Error())
			return nil, false
		}
		w.cancelled.Add(1)
		w.writeError(rw, http.StatusBadRequest, "invalid_request_error", "reading body: "+err.Error())
		return nil, false
	}
	if len(bytes.TrimSpace(body)) == 0 {
		return body, true
	}
	if err := json.Unmarshal(body, v); err != nil {
		w.writeError(rw, http.StatusBadRequest, "invalid_request_error", "malformed JSON body: "+err.Error())
		return nil, false
	}
	return body, true
}

// newRid returns a generated request id, "w<i>-req-<n>".
func (w *Worker) newRid() string {
	return w.idPrefix + "req-" + strconv.FormatUint(w.seq.Add(1), 10)
}
