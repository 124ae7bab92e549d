package route

import (
	"bytes"

	"github.com/cespare/xxhash/v2"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/keyhash"
)

// GRPO groups: the samples of one prompt are sent as separate requests
// that carry the same prompt and differ in their request id, seed or
// sampling parameters. GroupHash names the prompt: the hash of the value
// of the first prompt field of the body's top-level JSON object
// ("input_ids", "text", "prompt" or "messages": SGLang /generate, OpenAI
// completions and chat), as far as it lies within the peeked bytes.
// Everything else (rid, request_id, sampling_params, seed, stream) is left
// out, wherever it stands.
//
// A prompt longer than the peek is cut: then its prefix within the peek
// may be the same for every prompt (a long shared system prompt), so the
// length of the body from the prompt on (Content-Length minus where the
// value starts) is hashed too: prompts of the same start but other
// lengths are other groups. (Two samples of one prompt whose fields after
// it differ in length, such as a seed of another number of digits, are
// then two groups; fields before it do not matter.) The hash is xxhash64:
// about 10 GB/s, 1 µs for 12 KiB.

// groupFields are the prompt fields, by engine API.
var groupFields = [...]string{"input_ids", "text", "prompt", "messages"}

// GroupHash returns the group of a keyless request: ok false when the
// body holds no prompt field within the peeked bytes (or is no JSON
// object).
func GroupHash(req *httphead.Request, body []byte) (uint64, bool) {
	b := PeekedBody(req, body)
	i := skipSpace(b, 0)
	if i >= len(b) || b[i] != '{' {
		return 0, false
	}
	i++
	for {
		i = skipSpace(b, i)
		if i >= len(b) || b[i] != '"' {
			return 0, false
		}
		ke, ok := ScanJSONString(b, i)
		if !ok {
			return 0, false
		}
		key := b[i+1 : ke-1]
		i = skipSpace(b, ke)
		if i >= len(b) || b[i] != ':' {
			return 0, false
		}
		i = skipSpace(b, i+1)
		field := -1
		for f, name := range groupFields {
			if string(key) == name {
				field = f
				break
			}
		}
		end, complete := SkipJSONValue(b, i)
		if field >= 0 {
			if end <= i {
				return 0, false // the value is not there at all
			}
			tag := uint64(field) + 1
			if !complete {
				// Hash whole KiBs of the cut value: fields of other
				// lengths before it (a rid) shift where the peek cuts.
				if cut := (end - i) &^ 1023; cut > 0 {
					end = i + cut
				}
				rest := int64(-1)
				if !req.Chunked && req.ContentLength >= 0 {
					rest = req.ContentLength - int64(i)
				}
				tag ^= uint64(rest) << 8
			}
			return xxhash.Sum64(b[i:end]) ^ keyhash.Mix(tag), true
		}
		if !complete {
			return 0, false
		}
		i = skipSpace(b, end)
		if i >= len(b) || b[i] != ',' {
			return 0, false
		}
		i++
	}
}

// ScanJSONString returns the index after the JSON string starting at
// b[i] == '"'; false when it is cut (engine's request ids use it too).
func ScanJSONString(b []byte, i int) (int, bool) {
	j := i + 1
	for {
		k := bytes.IndexByte(b[j:], '"')
		if k < 0 {
			return len(b), false
		}
		j += k
		n := 0 // backslashes before the quote
		for p := j - 1; p > i && b[p] == '\\'; p-- {
			n++
		}
		if n%2 == 0 {
			return j + 1, true
		}
		j++
	}
}

// SkipJSONValue returns the end of the JSON value at b[i] and whether it
// is complete within b (else the end is len(b)). A flat array of numbers
// (input_ids) is skipped with one scan for ']'.
func SkipJSONValue(b []byte, i int) (int, bool) {
	if i >= len(b) {
		return len(b), false
	}
	switch b[i] {
	case '"':
		return ScanJSONString(b, i)
	case '[', '{':
		if b[i] == '[' {
			if k := bytes.IndexByte(b[i+1:], ']'); k >= 0 {
				seg := b[i+1 : i+1+k]
				if bytes.IndexByte(seg, '[') < 0 && bytes.IndexByte(seg, '{') < 0 && bytes.IndexByte(seg, '"') < 0 {
					return i + 2 + k, true
				}
			} else if bytes.IndexByte(b[i+1:], '[') < 0 && bytes.IndexByte(b[i+1:], '{') < 0 && bytes.IndexByte(b[i+1:], '"') < 0 {
				return len(b), false
			}
		}
		depth := 0
		for j := i; j < len(b); j++ {
			switch b[j] {
			case '"':
				e, ok := ScanJSONString(b, j)
				if !ok {
					return len(b), false
				}
				j = e - 1
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					return j + 1, true
				}
			}
		}
		return len(b), false
	}
	for j := i; j < len(b); j++ {
		switch b[j] {
		case ',', '}', ']', ' ', '\t', '\n', '\r':
			return j, true
		}
	}
	return len(b), false
}
