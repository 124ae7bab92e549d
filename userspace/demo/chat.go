// Chat: the OpenAI chat completion, with or without a session, whole or
// streamed as server-sent events.

package demo

import (
	"io"
	"net/http"
	"strconv"
	"time"
	"unicode/utf8"
)

type chatRequest struct {
	Model     string `json:"model"`
	Stream    bool   `json:"stream"`
	Rid       string `json:"rid"`
	RequestID string `json:"request_id"`
}

// chat answers an OpenAI chat completion. With session, id is the session
// whose turn it counts (created if unknown); without, the content names the
// rid instead.
func (w *Worker) chat(rw http.ResponseWriter, r *http.Request, id string, session bool) {
	bp := getBuf()
	defer putBuf(bp)
	var req chatRequest
	body, ok := w.readJSON(rw, r, bp, &req)
	if !ok {
		return
	}
	promptTokens := int64(len(body) / 4)

	rid := req.Rid
	if rid == "" {
		rid = req.RequestID
	}
	if rid == "" {
		rid = r.Header.Get("X-Request-Id") // canonical form: no allocation
	}
	model := req.Model
	if model == "" {
		model = "tether-demo"
	}
	turn := 0
	if session {
		w.mu.Lock()
		prev, known := w.sessions[id]
		if known || !w.opts.BareIDs {
			turn = prev + 1
			w.sessions[id] = turn
		}
		w.mu.Unlock()
		if !known && w.opts.BareIDs {
			w.writeError(rw, http.StatusNotFound, "not_found_error", "unknown session "+id)
			return
		}
	}

	if req.Stream {
		if rid == "" {
			rid = w.newRid()
		}
		w.chatStream(rw, r, id, session, turn, rid, model, bp)
		return
	}

	b := append((*bp)[:0], `{"id":"chatcmpl-`...)
	if rid != "" {
		b = appendJSONChars(b, rid)
	} else {
		b = append(b, w.idPrefix...)
		b = strconv.AppendUint(b, w.seq.Add(1), 10)
	}
	b = append(b, `","object":"chat.completion","created":`...)
	b = strconv.AppendInt(b, time.Now().Unix(), 10)
	b = appendStringField(b, "model", model)
	b = append(b, `,"choices":[{"index":0,"message":{"role":"assistant","content":"`...)
	b = appendJSONChars(b, w.chatPrefix)
	if session {
		b = append(b, "session "...)
		b = appendJSONChars(b, id)
		b = append(b, " turn "...)
		b = strconv.AppendInt(b, int64(turn), 10)
	} else {
		b = append(b, "rid "...)
		b = appendJSONChars(b, rid)
	}
	b = append(b, `"},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":`...)
	b = strconv.AppendInt(b, promptTokens, 10)
	b = appendIntField(b, "completion_tokens", int64(w.opts.StreamChunks))
	b = appendIntField(b, "total_tokens", promptTokens+int64(w.opts.StreamChunks))
	b = append(b, '}')
	b = append(b, w.workerField...)
	b = appendChatIdentity(b, session, id, turn, rid)
	b = append(b, "}\n"...)
	*bp = b
	w.writeBody(rw, http.StatusOK, b)
}

// appendChatIdentity appends the top-level fields naming the session and turn
// (or the rid for a chat without session).
func appendChatIdentity(b []byte, session bool, id string, turn int, rid string) []byte {
	if session {
		b = appendStringField(b, "session_id", id)
		b = appendIntField(b, "turn", int64(turn))
	}
	if rid != "" {
		b = appendStringField(b, "rid", rid)
	}
	return b
}

// chatContent is the assistant message of a chat.
func (w *Worker) chatContent(session bool, id string, turn int, rid string) string {
	if session {
		return w.chatPrefix + "session " + id + " turn " + strconv.Itoa(turn)
	}
	return w.chatPrefix + "rid " + rid
}

// cut returns the end of piece j of k pieces of s, on a rune boundary.
func cut(s string, j, k int) int {
	e := len(s) * j / k
	for e < len(s) && !utf8.RuneStart(s[e]) {
		e++
	}
	return e
}

func (w *Worker) chatStream(rw http.ResponseWriter, r *http.Request, id string, session bool, turn int, rid, model string, bp *[]byte) {
	rn := w.register(rid)
	defer w.unregister(rn)
	content := w.chatContent(session, id, turn, rid)

	// Every event is "data: " + head + delta + mid + finish + tail.
	b := append((*bp)[:0], `data: {"id":"chatcmpl-`...)
	b = appendJSONChars(b, rid)
	b = append(b, `","object":"chat.completion.chunk","created":`...)
	b = strconv.AppendInt(b, time.Now().Unix(), 10)
	b = appendStringField(b, "model", model)
	b = append(b, `,"choices":[{"index":0,"delta":{`...)
	headLen := len(b)
	b = append(b, `},"logprobs":null,"finish_reason":`...)
	midEnd := len(b)
	b = append(b, ']')
	b = append(b, w.workerField...)
	b = appendChatIdentity(b, session, id, turn, rid)
	b = append(b, "}\n\n"...)
	tailEnd := len(b)
	*bp = b
	fixed := b[:tailEnd:tailEnd]
	head, mid, tail := fixed[:headLen], fixed[headLen:midEnd], fixed[midEnd:]

	ev := getBuf()
	defer putBuf(ev)
	event := func(delta string, role bool, finish string) bool {
		e := append((*ev)[:0], head...)
		if role {
			e = append(e, `"role":"assistant",`...)
		}
		if finish == "" {
			e = append(e, `"content":`...)
			e = appendJSONString(e, delta)
		}
		e = append(e, mid...)
		if finish == "" {
			e = append(e, "null}"...)
		} else {
			e = append(e, '"')
			e = append(e, finish...)
			e = append(e, `"}`...)
		}
		e = append(e, tail...)
		*ev = e
		if _, err := rw.Write(e); err != nil {
			return false
		}
		flush(rw)
		return true
	}

	h := rw.Header()
	h["Content-Type"] = ctSSE
	h["Cache-Control"] = noCache
	rw.WriteHeader(http.StatusOK)

	var t *time.Timer
	defer func() { stopTimer(t) }()
	k := w.opts.StreamChunks
	why := stopNone
	for j := range k {
		d := w.opts.StreamDelay
		if j == 0 {
			d = 0
		}
		if why = pause(r.Context(), rn.abort, &t, d); why != stopNone {
			break
		}
		piece := content[cut(content, j, k):cut(content, j+1, k)]
		if !event(piece, j == 0, "") {
			why = stopGone
			break
		}
	}
	switch why {
	case stopGone:
		w.cancelled.Add(1)
		return
	case stopAbort:
		if !event("", false, "abort") {
			w.cancelled.Add(1)
			return
		}
	default:
		if !event("", false, "stop") {
			w.cancelled.Add(1)
			return
		}
	}
	if _, err := io.WriteString(rw, "data: [DONE]\n\n"); err != nil {
		w.cancelled.Add(1)
		return
	}
	flush(rw)
}
