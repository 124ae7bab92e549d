// Sessions: minting session ids (tether's w<i>-<hex> or bare uuids), and
// the endpoints that create, read and delete a session.

package demo

import (
	"crypto/rand"
	"encoding/hex"
	"net/http"
)

// newSessionID returns a fresh id: w<i>-<32 hex>, or with BareIDs a uuid.
func (w *Worker) newSessionID(buf []byte) []byte {
	var raw [16]byte
	rand.Read(raw[:]) // never fails
	if !w.opts.BareIDs {
		buf = append(buf[:0], w.idPrefix...)
		n := len(buf)
		buf = append(buf, make([]byte, 32)...)
		hex.Encode(buf[n:], raw[:])
		return buf
	}
	raw[6] = raw[6]&0x0f | 0x40 // version 4
	raw[8] = raw[8]&0x3f | 0x80 // RFC 4122 variant
	var h [32]byte
	hex.Encode(h[:], raw[:])
	buf = append(buf[:0], h[0:8]...)
	for _, part := range [][]byte{h[8:12], h[12:16], h[16:20], h[20:32]} {
		buf = append(append(buf, '-'), part...)
	}
	return buf
}

func (w *Worker) createSession(rw http.ResponseWriter) {
	buf := make([]byte, 0, len(w.idPrefix)+36)
	var id string
	w.mu.Lock()
	for {
		buf = w.newSessionID(buf)
		if _, dup := w.sessions[string(buf)]; !dup {
			id = string(buf)
			w.sessions[id] = 0
			break
		}
	}
	w.mu.Unlock()

	bp := getBuf()
	defer putBuf(bp)
	b := append(*bp, `{"session_id":`...)
	b = appendJSONString(b, id)
	b = append(b, w.workerField...)
	b = append(b, "}\n"...)
	*bp = b
	w.writeBody(rw, http.StatusCreated, b)
}

func (w *Worker) getSession(rw http.ResponseWriter, id string) {
	w.mu.Lock()
	turns, ok := w.sessions[id]
	w.mu.Unlock()
	if !ok {
		w.writeError(rw, http.StatusNotFound, "not_found_error", "unknown session "+id)
		return
	}
	bp := getBuf()
	defer putBuf(bp)
	b := append(*bp, `{"session_id":`...)
	b = appendJSONString(b, id)
	b = append(b, w.workerField...)
	b = appendIntField(b, "turns", int64(turns))
	b = append(b, "}\n"...)
	*bp = b
	w.writeBody(rw, http.StatusOK, b)
}

func (w *Worker) deleteSession(rw http.ResponseWriter, id string) {
	w.mu.Lock()
	_, ok := w.sessions[id]
	delete(w.sessions, id)
	w.mu.Unlock()
	if !ok {
		w.writeError(rw, http.StatusNotFound, "not_found_error", "unknown session "+id)
		return
	}
	bp := getBuf()
	defer putBuf(bp)
	b := append(*bp, `{"deleted":true`...)
	b = append(b, w.workerField...)
	b = append(b, "}\n"...)
	*bp = b
	w.writeBody(rw, http.StatusOK, b)
}
