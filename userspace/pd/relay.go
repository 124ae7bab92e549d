package pd

import (
	"bytes"
	"context"
	"errors"
	"io"
	"strconv"
	"sync/atomic"

	"github.com/tether-rl/tether/userspace/jsonedit"
)

// merger puts a prefill's input logprobs in front of the decode's, by
// item index (0 for one prompt).
type merger struct {
	prefill map[int][]byte // item index -> P's input logprobs (rooms.InputLogprobs)
	n       *atomic.Uint64
}

// newMerger reads P's answer: a JSON object, an array of them (a batch),
// or an SSE stream (the first event of each index counts).
func newMerger(answer []byte, n *atomic.Uint64) *merger {
	m := &merger{prefill: map[int][]byte{}, n: n}
	a := bytes.TrimSpace(answer)
	switch {
	case len(a) > 0 && a[0] == '{':
		if lp := inputLogprobs(a); lp != nil {
			m.prefill[0] = lp
		}
	case len(a) > 0 && a[0] == '[':
		els, _ := jsonedit.Elements(a)
		for i, e := range els {
			if lp := inputLogprobs(e); lp != nil {
				m.prefill[i] = lp
			}
		}
	default:
		for _, ev := range bytes.Split(answer, []byte("\n\n")) {
			payload, ok := dataPayload(ev)
			if !ok {
				continue
			}
			idx := eventIndex(payload)
			if _, seen := m.prefill[idx]; !seen {
				if lp := inputLogprobs(payload); lp != nil {
					m.prefill[idx] = lp
				}
			}
		}
	}
	return m
}

func inputLogprobs(obj []byte) []byte {
	o, err := jsonedit.Parse(obj)
	if err != nil {
		return nil
	}
	mi, ok := o.Get(rooms.InputLogprobs.Field)
	if !ok {
		return nil
	}
	mo, err := jsonedit.Parse(mi)
	if err != nil {
		return nil
	}
	lp, ok := mo.Get(rooms.InputLogprobs.Inner)
	if !ok || len(lp) == 0 || lp[0] != '[' {
		return nil
	}
	return lp
}

func eventIndex(obj []byte) int {
	o, err := jsonedit.Parse(obj)
	if err != nil {
		return 0
	}
	if v, ok := o.Get(rooms.ItemIndex); ok {
		if i, err := strconv.Atoi(string(v)); err == nil {
			return i
		}
	}
	return 0
}

// dataPayload returns the payload of an SSE event made of one data line.
func dataPayload(ev []byte) ([]byte, bool) {
	ev = bytes.TrimLeft(ev, "\r\n")
	if !bytes.HasPrefix(ev, []byte("data:")) || bytes.IndexByte(bytes.TrimRight(ev, "\r\n"), '\n') >= 0 {
		return nil, false
	}
	return bytes.TrimSpace(ev[len("data:"):]), true
}

// one merges P's logprobs for index idx into one of D's objects; D's
// object comes back unchanged when there is nothing to merge.
func (m *merger) one(obj []byte, idx int) []byte {
	plp, ok := m.prefill[idx]
	if !ok {
		return obj
	}
	o, err := jsonedit.Parse(obj)
	if err != nil {
		return obj
	}
	mi, ok := o.Get(rooms.InputLogprobs.Field)
	if !ok {
		return obj
	}
	mo, err := jsonedit.Parse(mi)
	if err != nil {
		return obj
	}
	lp := plp
	if dlp, ok := mo.Get(rooms.InputLogprobs.Inner); ok && len(dlp) > 0 && dlp[0] == '[' {
		if lp, err = jsonedit.ConcatArrays(plp, dlp); err != nil {
			return obj
		}
	}
	mi2, err := mo.Apply(jsonedit.Set(rooms.InputLogprobs.Inner, lp))
	if err != nil {
		return obj
	}
	out, err := o.Apply(jsonedit.Set(rooms.InputLogprobs.Field, mi2))
	if err != nil {
		return obj
	}
	m.n.Add(1)
	return out
}

// whole merges a whole answer: an object, or a batch's array.
func (m *merger) whole(answer []byte) []byte {
	a := bytes.TrimSpace(answer)
	if len(a) == 0 {
		return answer
	}
	if a[0] == '{' {
		return m.one(a, 0)
	}
	els, err := jsonedit.Elements(a)
	if a[0] != '[' || err != nil {
		return answer
	}
	out := []byte{'['}
	for i, e := range els {
		if i > 0 {
			out = append(out, ',')
		}
		out = append(out, m.one(e, i)...)
	}
	return append(out, ']')
}

// sse rewrites the data events of a stream as they complete; [DONE] and
// any event that is not one JSON data line pass untouched.
type sse struct {
	m   *merger
	buf []byte
}

func (x *sse) feed(dst, p []byte) []byte {
	x.buf = append(x.buf, p...)
	for {
		i, sep := bytes.Index(x.buf, []byte("\n\n")), 2
		if j := bytes.Index(x.buf, []byte("\r\n\r\n")); j >= 0 && (i < 0 || j < i) {
			i, sep = j, 4
		}
		if i < 0 {
			if len(x.buf) > maxEvent {
				// Not SSE as we know it: passed on as it comes.
				dst = append(dst, x.buf...)
				x.buf = x.buf[:0]
			}
			return dst
		}
		ev := x.buf[:i+sep]
		merged := false
		if x.m != nil && len(x.m.prefill) > 0 {
			if payload, ok := dataPayload(ev[:i]); ok && len(payload) > 0 && payload[0] == '{' {
				if out := x.m.one(payload, eventIndex(payload)); !bytes.Equal(out, payload) {
					dst = append(dst, "data: "...)
					dst = append(dst, out...)
					dst = append(dst, ev[i:]...)
					merged = true
				}
			}
		}
		if !merged {
			dst = append(dst, ev...)
		}
		x.buf = x.buf[i+sep:]
	}
}

// maxEvent is the longest SSE event held back whole.
const maxEvent = 4 << 20

// rest is what is left at the stream's end (an event without its blank
// line, passed as it came).
func (x *sse) rest(dst []byte) []byte { return append(dst, x.buf...) }

// errDecodeBroke is a decode answer that failed after the client had bytes.
var errDecodeBroke = errors.New("pd: the decode's answer broke off")

// relay writes D's 2xx answer: its head, the bytes already read, then the
// rest as it comes, flushed after each read. With tx, SSE events are
// rewritten (logprob merge). The error is errClient (the client left or
// could not be written to) or wraps errDecodeBroke.
func (s *Server) relay(ctx context.Context, w ResponseWriter, d *legResult, route string, tx *sse, whole []byte) error {
	h := w.Header()
	copyHead(h, d.resp.Header, tx == nil && whole == nil)
	if whole != nil {
		h.Set("Content-Length", strconv.Itoa(len(whole)))
	}
	if s.cfg.RouteHeader != "" {
		h.Set(s.cfg.RouteHeader, route)
	}
	w.WriteHeader(d.resp.StatusCode)
	if whole != nil {
		if _, err := w.Write(whole); err != nil {
			return errClient
		}
		return nil
	}
	sseOut := isSSE(d.resp.Header)
	if sseOut && tx == nil {
		// Whole events only reach the client, so that an error event
		// after a failure is never glued to half an event.
		tx = &sse{}
	}
	var out []byte
	write := func(p []byte) error {
		if tx != nil {
			out = tx.feed(out[:0], p)
			p = out
		}
		if len(p) > 0 {
			if _, err := w.Write(p); err != nil {
				return errClient
			}
			flush(w)
		}
		return nil
	}
	if err := write(d.body); err != nil {
		return err
	}
	bp := getBuf()
	defer putBuf(bp)
	buf := *bp
	for {
		n, err := d.resp.Body.Read(buf)
		if n > 0 {
			if werr := write(buf[:n]); werr != nil {
				return werr
			}
		}
		if err == io.EOF {
			if tx != nil {
				if _, err := w.Write(tx.rest(out[:0])); err != nil {
					return errClient
				}
			}
			return nil
		}
		if err != nil {
			if ctx.Err() != nil {
				return errClient
			}
			if sseOut {
				ev := append([]byte("data: "), errorJSON(502, "decode_failed", "the decode engine failed mid-stream: "+err.Error())...)
				w.Write(append(ev, "\n\n"...))
				flush(w)
			}
			return errors.Join(errDecodeBroke, err)
		}
	}
}
