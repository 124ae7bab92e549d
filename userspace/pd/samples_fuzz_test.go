package pd

import (
	"encoding/json"
	"net/http"
	"testing"
)

// FuzzSamples: a plan to split a request asks each sample alone (a valid
// JSON object whose own sample counts are 1), and the answers made one
// are valid JSON, whatever the bodies; nothing panics.
func FuzzSamples(f *testing.F) {
	f.Add([]byte(`{"prompt":"p","n":3}`), []byte(`{"choices":[{"text":"a","index":0}],"usage":{"prompt_tokens":2,"completion_tokens":1,"total_tokens":3}}`))
	f.Add([]byte(`{"text":"x","sampling_params":{"n":2,"max_new_tokens":1}}`), []byte(`{"text":"a","meta_info":{}}`))
	f.Add([]byte(`{"messages":[],"n":2,"stream":false}`), []byte(`{"choices":[{"message":{}}]}`))
	f.Fuzz(func(t *testing.T, body, answer []byte) {
		for _, p := range []Protocol{SGLang, VLLM} {
			s := New(Config{Protocol: p})
			plan, ok := s.planSamples(body)
			if !ok {
				continue
			}
			if plan.n < 2 || plan.n > MaxSamples || !json.Valid(plan.body) {
				t.Fatalf("%v: plan %d %s", p, plan.n, plan.body)
			}
			if again, ok := s.planSamples(plan.body); ok {
				t.Fatalf("%v: the sample's body %s asks for %d", p, plan.body, again.n)
			}
			outs := make([]*bufWriter, plan.n)
			for i := range outs {
				outs[i] = &bufWriter{h: http.Header{}, limit: 1 << 20, status: 200}
				outs[i].body.Write(answer)
			}
			if merged, err := s.mergeSamples(outs); err == nil && !json.Valid(merged) {
				t.Fatalf("%v: merged %s of %s", p, merged, answer)
			}
		}
	})
}
