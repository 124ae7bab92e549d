// Byte streams: the session endpoints that move raw bytes or plain
// events, not JSON (echo, sha256, blob, slow).

package demo

import (
	"crypto/sha256"
	"encoding/hex"
	"io"
	"net/http"
	"strconv"
	"time"
)

// echo copies the request body to the response as it arrives, flushing each
// read, in full duplex: nothing is buffered whole.
func (w *Worker) echo(rw http.ResponseWriter, r *http.Request) {
	_ = http.NewResponseController(rw).EnableFullDuplex() // unsupported: half duplex
	rw.Header()["Content-Type"] = ctOctets
	rw.WriteHeader(http.StatusOK)
	pp := piecePool.Get().(*[]byte)
	defer piecePool.Put(pp)
	buf := *pp
	for {
		n, err := r.Body.Read(buf)
		if n > 0 {
			if _, werr := rw.Write(buf[:n]); werr != nil {
				w.cancelled.Add(1)
				return
			}
			flush(rw)
		}
		if err == io.EOF {
			return
		}
		if err != nil {
			w.cancelled.Add(1)
			return
		}
	}
}

func (w *Worker) sha256(rw http.ResponseWriter, r *http.Request) {
	pp := piecePool.Get().(*[]byte)
	defer piecePool.Put(pp)
	h := sha256.New()
	n, err := io.CopyBuffer(h, struct{ io.Reader }{r.Body}, *pp)
	if err != nil {
		w.cancelled.Add(1)
		w.writeError(rw, http.StatusBadRequest, "invalid_request_error", "reading body: "+err.Error())
		return
	}
	var sum [sha256.Size]byte
	bp := getBuf()
	defer putBuf(bp)
	b := append(*bp, `{"sha256":"`...)
	b = hex.AppendEncode(b, h.Sum(sum[:0]))
	b = append(b, '"')
	b = appendIntField(b, "bytes", n)
	b = append(b, w.workerField...)
	b = append(b, "}\n"...)
	*bp = b
	w.writeBody(rw, http.StatusOK, b)
}

func (w *Worker) blob(rw http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	var size int64
	var seed uint64
	var chunked bool
	var err error
	if s := q.Get("size"); s != "" {
		if size, err = strconv.ParseInt(s, 10, 64); err != nil || size < 0 {
			w.writeError(rw, http.StatusBadRequest, "invalid_request_error", "bad size "+strconv.Quote(s))
			return
		}
	}
	if s := q.Get("seed"); s != "" {
		if seed, err = strconv.ParseUint(s, 10, 64); err != nil {
			w.writeError(rw, http.StatusBadRequest, "invalid_request_error", "bad seed "+strconv.Quote(s))
			return
		}
	}
	if s := q.Get("chunked"); s != "" {
		if chunked, err = strconv.ParseBool(s); err != nil {
			w.writeError(rw, http.StatusBadRequest, "invalid_request_error", "bad chunked "+strconv.Quote(s))
			return
		}
	}
	h := rw.Header()
	h["Content-Type"] = ctOctets
	if !chunked {
		h["Content-Length"] = []string{strconv.FormatInt(size, 10)}
	}
	rw.WriteHeader(http.StatusOK)

	pp := piecePool.Get().(*[]byte)
	defer piecePool.Put(pp)
	rng := newBlobRNG(seed)
	ctx := r.Context()
	for left := size; left > 0; {
		p := (*pp)[:min(left, blobPiece)]
		rng.Read(p)
		if _, err := rw.Write(p); err != nil || ctx.Err() != nil {
			w.cancelled.Add(1)
			return
		}
		if chunked {
			flush(rw)
		}
		left -= int64(len(p))
	}
}

// slow sends chunks server-sent events, the first at once and then delay_ms
// apart (defaults: StreamChunks and StreamDelay), and records in Cancelled
// a client that leaves before the end.
func (w *Worker) slow(rw http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	k := w.opts.StreamChunks
	d := w.opts.StreamDelay
	if s := q.Get("chunks"); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v < 0 {
			w.writeError(rw, http.StatusBadRequest, "invalid_request_error", "bad chunks "+strconv.Quote(s))
			return
		}
		k = v
	}
	if s := q.Get("delay_ms"); s != "" {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil || v < 0 {
			w.writeError(rw, http.StatusBadRequest, "invalid_request_error", "bad delay_ms "+strconv.Quote(s))
			return
		}
		d = time.Duration(v) * time.Millisecond
	}
	// Drain the body: the server notices a client going away (and cancels
	// the context) only once the body has been read.
	if _, err := io.Copy(io.Discard, r.Body); err != nil {
		w.cancelled.Add(1)
		return
	}
	h := rw.Header()
	h["Content-Type"] = ctSSE
	h["Cache-Control"] = noCache
	rw.WriteHeader(http.StatusOK)
	flush(rw)

	bp := getBuf()
	defer putBuf(bp)
	var t *time.Timer
	defer func() { stopTimer(t) }()
	for j := range k {
		dj := d
		if j == 0 {
			dj = 0
		}
		if pause(r.Context(), nil, &t, dj) != stopNone {
			w.cancelled.Add(1)
			return
		}
		b := append((*bp)[:0], `data: {"seq":`...)
		b = strconv.AppendInt(b, int64(j), 10)
		b = appendIntField(b, "chunks", int64(k))
		b = append(b, w.workerField...)
		b = append(b, "}\n\n"...)
		*bp = b
		if _, err := rw.Write(b); err != nil {
			w.cancelled.Add(1)
			return
		}
		flush(rw)
	}
}
