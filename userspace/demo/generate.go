// Generate: SGLang's /generate, whole or streamed as server-sent events of
// cumulative text, abortable by rid.

package demo

import (
	"io"
	"net/http"
	"time"
)

type generateRequest struct {
	Rid    string `json:"rid"`
	Stream bool   `json:"stream"`
}

func (w *Worker) generate(rw http.ResponseWriter, r *http.Request) {
	bp := getBuf()
	defer putBuf(bp)
	var req generateRequest
	body, ok := w.readJSON(rw, r, bp, &req)
	if !ok {
		return
	}
	promptTokens := int64(len(body) / 4)
	rid := req.Rid
	if rid == "" {
		rid = r.Header.Get("X-Request-Id") // canonical form: no allocation
	}
	if rid == "" {
		rid = w.newRid()
	}
	rn := w.register(rid)
	defer w.unregister(rn)

	// appendResult appends a generate result object after n chunks.
	appendResult := func(b []byte, n int, finish string) []byte {
		b = append(b, `{"text":`...)
		b = appendJSONString(b, w.genText[:w.genCuts[n]])
		b = append(b, `,"meta_info":{"id":`...)
		b = appendJSONString(b, rid)
		b = append(b, `,"finish_reason":`...)
		switch finish {
		case "":
			b = append(b, "null"...)
		case "abort":
			b = append(b, `{"type":"abort","message":"aborted by request"}`...)
		default:
			b = append(b, `{"type":"stop","matched":null}`...)
		}
		b = appendIntField(b, "prompt_tokens", promptTokens)
		b = appendIntField(b, "completion_tokens", int64(n))
		b = append(b, `},"index":0`...)
		b = append(b, w.workerField...)
		return append(b, '}')
	}
	send := func(n int, finish string) bool {
		b := append((*bp)[:0], "data: "...)
		b = appendResult(b, n, finish)
		b = append(b, "\n\n"...)
		*bp = b
		if _, err := rw.Write(b); err != nil {
			return false
		}
		flush(rw)
		return true
	}

	if req.Stream {
		h := rw.Header()
		h["Content-Type"] = ctSSE
		h["Cache-Control"] = noCache
		rw.WriteHeader(http.StatusOK)
		flush(rw)
	}
	var t *time.Timer
	defer func() { stopTimer(t) }()
	k := w.opts.StreamChunks
	n := 0
	why := stopNone
	for j := range k {
		d := w.opts.StreamDelay
		if j == 0 {
			d = 0
		}
		if why = pause(r.Context(), rn.abort, &t, d); why != stopNone {
			break
		}
		n = j + 1
		if req.Stream {
			finish := ""
			if n == k {
				finish = "stop"
			}
			if !send(n, finish) {
				why = stopGone
				break
			}
		}
	}
	if why == stopGone {
		w.cancelled.Add(1)
		return
	}
	if !req.Stream {
		finish := "stop"
		if why == stopAbort {
			finish = "abort"
		}
		b := appendResult((*bp)[:0], n, finish)
		b = append(b, '\n')
		*bp = b
		w.writeBody(rw, http.StatusOK, b)
		return
	}
	if why == stopAbort && !send(n, "abort") {
		w.cancelled.Add(1)
		return
	}
	if _, err := io.WriteString(rw, "data: [DONE]\n\n"); err != nil {
		w.cancelled.Add(1)
		return
	}
	flush(rw)
}
