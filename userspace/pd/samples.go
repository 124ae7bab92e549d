package pd

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"

	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/jsonedit"
)

// MaxSamples is the most samples a request is split into; above, n is
// refused.
const MaxSamples = 64

// sampleKeys are the quoted fields that ask for samples in the protocol's
// words (the innermost of each path).
func sampleKeys(w *dialect.PDWire) [][]byte {
	var out [][]byte
	for _, f := range w.Samples {
		k := f.Field
		if f.Inner != "" {
			k = f.Inner
		}
		out = append(out, []byte(`"`+k+`"`))
	}
	return out
}

// samplesPlan is a request for n samples as n requests of one sample.
type samplesPlan struct {
	n    int
	body []byte // the client's body asking for one sample
}

// planSamples reports whether body asks, in the protocol's words, for n >
// 1 samples in a form Serve splits: not streamed, no seed, no request id
// of the client's in the body (in any engine's words), one prompt (not a batch), n a whole number
// up to MaxSamples. Any other request goes on as it is (inspect refuses
// what asks for several samples).
func (s *Server) planSamples(body []byte) (*samplesPlan, bool) {
	w := s.wire
	mentioned := false
	for _, k := range s.sampleKeys {
		mentioned = mentioned || bytes.Contains(body, k)
	}
	if !mentioned {
		// Most requests: not parsed twice. (A key spelled with escapes
		// is not split: inspect refuses it.)
		return nil, false
	}
	o, err := jsonedit.Parse(body)
	if err != nil {
		return nil, false
	}
	n := 0
	var edits []jsonedit.Edit
	for _, f := range w.Samples {
		v, ok := o.Get(f.Field)
		if !ok {
			continue
		}
		if f.Inner == "" {
			k, ok := count(v)
			if !ok {
				return nil, false
			}
			n = max(n, k)
			edits = append(edits, jsonedit.Set(f.Field, []byte("1")))
			continue
		}
		inner, err := jsonedit.Parse(v) // an object (a list is a batch's: not split)
		if err != nil {
			return nil, false
		}
		if iv, ok := inner.Get(f.Inner); ok {
			k, ok := count(iv)
			if !ok {
				return nil, false
			}
			n = max(n, k)
			one, err := inner.Apply(jsonedit.Set(f.Inner, []byte("1")))
			if err != nil {
				return nil, false
			}
			edits = append(edits, jsonedit.Set(f.Field, one))
		}
	}
	if n < 2 || n > MaxSamples {
		return nil, false
	}
	if w.Stream != "" {
		if v, ok := o.Get(w.Stream); ok && truthy(v) {
			return nil, false
		}
	}
	for _, f := range w.Seeds {
		if v, ok := o.Get(f.Field); ok && (f.Inner == "" || hasField(v, f.Inner)) {
			return nil, false
		}
	}
	for _, k := range dialect.RequestIDKeys() {
		if o.Has(strings.Trim(k, `"`)) {
			return nil, false // n samples cannot share the client's id
		}
	}
	if batchSize(o) > 0 {
		return nil, false
	}
	one, err := o.Apply(edits...)
	if err != nil {
		return nil, false
	}
	return &samplesPlan{n: n, body: one}, true
}

// count reads a sample count: a whole number.
func count(v []byte) (int, bool) {
	f, err := strconv.ParseFloat(string(bytes.TrimSpace(v)), 64)
	if err != nil || f != math.Trunc(f) || f < 0 || f > math.MaxInt32 {
		return 0, false
	}
	return int(f), true
}

func hasField(obj []byte, key string) bool {
	o, err := jsonedit.Parse(obj)
	return err == nil && o.Has(key)
}

// serveSamples serves a request for n samples as n requests of one (at
// once, each over a pair of its own with its own room or handoff) and
// answers with their answers made one; a sample that was not answered 2xx
// is the answer (the first such, as it came).
func (s *Server) serveSamples(ctx context.Context, w ResponseWriter, req *Request, chooser PairChooser, plan *samplesPlan) error {
	s.Counters.Expanded.Add(1)
	outs := make([]*bufWriter, plan.n)
	errs := make([]error, plan.n)
	idHeader := s.wire.RequestIDHeader
	var wg sync.WaitGroup
	for i := range outs {
		outs[i] = &bufWriter{h: http.Header{}, limit: s.cfg.MaxPrefillAnswer}
		sub := &Request{Method: req.Method, Path: req.Path, Header: req.Header, Body: plan.body}
		if idHeader != "" {
			if id := req.Header.Get(idHeader); id != "" {
				// Each sample's legs carry an id of their own.
				sub.Header = req.Header.Clone()
				sub.Header.Set(idHeader, fmt.Sprintf("%s-%d", id, i))
			}
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = s.serveOne(ctx, outs[i], sub, chooser)
		}()
	}
	wg.Wait()
	if ctx.Err() != nil {
		return ctx.Err()
	}
	for i, o := range outs {
		if o.status < 200 || o.status > 299 || o.err != nil {
			if o.status == 0 || o.err != nil {
				writeError(w, http.StatusBadGateway, "upstream_error", fmt.Sprintf("sample %d of %d: no whole answer: %v", i, plan.n, firstErr(o.err, errs[i])))
				return firstErr(o.err, errs[i])
			}
			o.forward(w)
			return errs[i]
		}
	}
	merged, err := s.mergeSamples(outs)
	if err != nil {
		s.Counters.MergeFailed.Add(1)
		writeError(w, http.StatusBadGateway, "upstream_error", err.Error())
		return err
	}
	h := w.Header()
	copyHead(h, outs[0].h, false)
	h.Set("Content-Length", strconv.Itoa(len(merged)))
	if rh := s.cfg.RouteHeader; rh != "" {
		routes := make([]string, len(outs))
		for i, o := range outs {
			routes[i] = o.h.Get(rh)
		}
		h.Set(rh, strings.Join(routes, ", "))
	}
	w.WriteHeader(outs[0].status)
	if _, err := w.Write(merged); err != nil {
		return errClient
	}
	return nil
}

func firstErr(errs ...error) error {
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return fmt.Errorf("pd: a sample's answer is empty")
}

// mergeSamples makes one answer of the samples' answers (in the
// protocol's words, dialect.PDWire's Choices and Usage, or ListOfAnswers).
func (s *Server) mergeSamples(outs []*bufWriter) ([]byte, error) {
	w := s.wire
	first, err := jsonedit.Parse(outs[0].body.Bytes())
	if err == nil && w.Choices != "" && first.Has(w.Choices) {
		return s.mergeChoices(outs)
	}
	if !w.ListOfAnswers {
		return nil, fmt.Errorf("pd: the samples' answers cannot be made one: no %q", w.Choices)
	}
	out := []byte{'['}
	for i, o := range outs {
		if i > 0 {
			out = append(out, ',')
		}
		b := bytes.TrimSpace(o.body.Bytes())
		if !jsonedit.Valid(b) {
			return nil, fmt.Errorf("pd: sample %d's answer is not JSON", i)
		}
		out = append(out, b...)
	}
	return append(out, ']'), nil
}

// mergeChoices is the first answer with every sample's choices, indexed
// 0..n-1, and the usage of them all.
func (s *Server) mergeChoices(outs []*bufWriter) ([]byte, error) {
	w := s.wire
	choices := []byte{'['}
	k := 0
	var completion int64
	usageOK := w.Usage != ""
	var first *jsonedit.Object
	for i, o := range outs {
		obj, err := jsonedit.Parse(o.body.Bytes())
		if err != nil {
			return nil, fmt.Errorf("pd: sample %d's answer: %w", i, err)
		}
		if i == 0 {
			first = obj
		}
		v, _ := obj.Get(w.Choices)
		els, err := jsonedit.Elements(v)
		if err != nil {
			return nil, fmt.Errorf("pd: sample %d's %s: %w", i, w.Choices, err)
		}
		for _, e := range els {
			c, err := jsonedit.Apply(e, jsonedit.Set(w.ChoiceIndex, strconv.AppendInt(nil, int64(k), 10)))
			if err != nil {
				return nil, fmt.Errorf("pd: sample %d's choice: %w", i, err)
			}
			if k > 0 {
				choices = append(choices, ',')
			}
			choices = append(choices, c...)
			k++
		}
		if usageOK {
			n, ok := usageField(obj, w.Usage, w.CompletionTokens)
			completion += n
			usageOK = ok
		}
	}
	edits := []jsonedit.Edit{jsonedit.Set(w.Choices, append(choices, ']'))}
	if usageOK {
		u, _ := first.Get(w.Usage)
		prompt, ok := usageField(first, w.Usage, w.PromptTokens)
		if uo, err := jsonedit.Parse(u); err == nil && ok {
			nu, err := uo.Apply(
				jsonedit.Set(w.CompletionTokens, strconv.AppendInt(nil, completion, 10)),
				jsonedit.Set(w.TotalTokens, strconv.AppendInt(nil, prompt+completion, 10)))
			if err == nil {
				edits = append(edits, jsonedit.Set(w.Usage, nu))
			}
		}
	}
	return first.Apply(edits...)
}

// usageField reads a whole number in the object at field usage of obj.
func usageField(obj *jsonedit.Object, usage, key string) (int64, bool) {
	u, ok := obj.Get(usage)
	if !ok {
		return 0, false
	}
	uo, err := jsonedit.Parse(u)
	if err != nil {
		return 0, false
	}
	v, ok := uo.Get(key)
	if !ok {
		return 0, false
	}
	n, err := strconv.ParseInt(string(v), 10, 64)
	return n, err == nil
}

// bufWriter keeps a sample's answer whole (up to limit).
type bufWriter struct {
	h      http.Header
	status int
	body   bytes.Buffer
	limit  int64
	err    error
}

func (b *bufWriter) Header() http.Header { return b.h }

func (b *bufWriter) WriteHeader(status int) {
	if b.status == 0 {
		b.status = status
	}
}

func (b *bufWriter) Write(p []byte) (int, error) {
	if b.status == 0 {
		b.status = http.StatusOK
	}
	if b.err != nil {
		return 0, b.err
	}
	if int64(b.body.Len()+len(p)) > b.limit {
		b.err = fmt.Errorf("pd: a sample's answer is over %d bytes", b.limit)
		return 0, b.err
	}
	return b.body.Write(p)
}

// forward writes the kept answer as it came.
func (b *bufWriter) forward(w ResponseWriter) {
	copyHead(w.Header(), b.h, false)
	w.Header().Set("Content-Length", strconv.Itoa(b.body.Len()))
	w.WriteHeader(b.status)
	w.Write(b.body.Bytes())
}
