package route

import (
	"github.com/cespare/xxhash/v2"

	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/jsonpeek"
	"github.com/tether-rl/tether/userspace/keyhash"
)

// GRPO groups: the samples of one prompt are sent as separate requests
// that carry the same prompt and differ in their request id, seed or
// sampling parameters. GroupHash names the prompt: the hash of the value
// of the first prompt field of the body's top-level JSON object (the
// engines' APIs' prompt fields, dialect.PromptFields), as far as it lies
// within the peeked bytes. Everything else (the request id, sampling
// parameters, seed, stream) is left out, wherever it stands.
//
// A prompt longer than the peek is cut: then its prefix within the peek
// may be the same for every prompt (a long shared system prompt), so the
// length of the body from the prompt on (Content-Length minus where the
// value starts) is hashed too: prompts of the same start but other
// lengths are other groups. (Two samples of one prompt whose fields after
// it differ in length, such as a seed of another number of digits, are
// then two groups; fields before it do not matter.) The hash is xxhash64:
// about 10 GB/s, 1 µs for 12 KiB.

// groupFields are the prompt fields of every engine's API
// (dialect.PromptFields: a field's index is part of the hash).
var groupFields = dialect.PromptFields()

// GroupHash returns the group of a keyless request: ok false when the
// body holds no prompt field within the peeked bytes (or is no JSON
// object).
func GroupHash(req *httphead.Request, body []byte) (uint64, bool) {
	rest := int64(-1)
	if !req.Chunked {
		rest = req.ContentLength
	}
	return groupHash(PeekedBody(req, body), rest)
}

// PromptGroup is GroupHash of a whole body (a request read to its end, as
// a P/D request is): the same group for the same prompt, whatever else the
// body holds.
func PromptGroup(body []byte) (uint64, bool) { return groupHash(body, int64(len(body))) }

// groupHash hashes the first prompt field of b, the body's first bytes;
// length is the whole body's (-1: not known).
func groupHash(b []byte, length int64) (uint64, bool) {
	o := jsonpeek.Open(b)
	for {
		m, st := o.Next()
		if st != jsonpeek.OK {
			return 0, false
		}
		field := -1
		for f, name := range groupFields {
			if m.KeyIs(name) {
				field = f
				break
			}
		}
		if field < 0 {
			continue
		}
		i, end := m.Start, m.Start+len(m.Value)
		tag := uint64(field) + 1
		if !m.Complete {
			// Hash whole KiBs of the cut value: fields of other
			// lengths before it (a rid) shift where the peek cuts.
			if cut := (end - i) &^ 1023; cut > 0 {
				end = i + cut
			}
			rest := int64(-1)
			if length >= 0 {
				rest = length - int64(i)
			}
			tag ^= uint64(rest) << 8
		}
		return xxhash.Sum64(b[i:end]) ^ keyhash.Mix(tag), true
	}
}
