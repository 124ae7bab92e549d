package fakeengine

import (
	"net/http"
	"testing"
)

var fuzzPaths = []string{"/generate", "/v1/completions", "/v1/chat/completions", "/inference/v1/generate"}

// FuzzRequest feeds arbitrary bodies to the request parsers: they never
// panic, and what they accept is within the limits a handler relies on.
func FuzzRequest(f *testing.F) {
	seeds := []string{
		`{"text":"hello","sampling_params":{"max_new_tokens":4,"sampling_seed":3},"rid":"a","stream":true}`,
		`{"input_ids":[1,2,3],"sampling_params":{"n":1}}`,
		`{"prompt":"hi","max_tokens":2,"seed":-1,"n":1}`,
		`{"prompt":[[1,2]]}`, `{"prompt":["x"]}`, `{"prompt":[1.5]}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"x"}]}],"max_completion_tokens":3}`,
		`{"token_ids":[0,31999],"sampling_params":{"max_tokens":1,"seed":7}}`,
		`{"weight_version":"v9","update_info":{"weight_version":"w"}}`,
		`{}`, `null`, `[]`, ``, `{"rid":5}`, `{"text":["a","b"]}`, `{"prompt":"x"} {}`,
	}
	for i, s := range seeds {
		f.Add(uint8(i), []byte(s))
	}
	f.Fuzz(func(t *testing.T, sel uint8, body []byte) {
		kind := Kind(sel & 1)
		path := fuzzPaths[int(sel>>1)%len(fuzzPaths)]
		h := http.Header{"X-Request-Id": {"hdr"}}
		g, err := parseRequest(kind, path, body, h)
		if err == nil {
			if len(g.prompt) == 0 || len(g.prompt) > MaxPromptTokens {
				t.Fatalf("prompt of %d tokens accepted", len(g.prompt))
			}
			if g.maxNew < 1 || g.maxNew > MaxNewTokens {
				t.Fatalf("max new %d accepted", g.maxNew)
			}
			for _, tok := range g.prompt {
				if tok < 0 {
					t.Fatalf("negative token %d", tok)
				}
			}
			if len(g.rid) > 256 {
				t.Fatalf("rid of %d bytes", len(g.rid))
			}
			// Deterministic: the same body parses the same way.
			g2, err := parseRequest(kind, path, body, h)
			if err != nil || g2.maxNew != g.maxNew || len(g2.prompt) != len(g.prompt) || g2.rid != g.rid {
				t.Fatalf("parsed differently the second time: %v", err)
			}
		}
		bodyVersion(body)
		var obj map[string]any
		decodeObject(body, &obj)
		for _, tok := range Tokenize(string(body)) {
			if tok < 0 || tok >= Vocab {
				t.Fatalf("token %d out of the vocabulary", tok)
			}
		}
	})
}
