package pd

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"

	"github.com/tether-rl/tether/userspace/jsonedit"
)

// request is what Serve reads from a client's body.
type request struct {
	obj     *jsonedit.Object
	batch   int      // items of a batch; 0 for one prompt
	logprob bool     // return_logprob set (SGLang's merge)
	rids    []string // the client's rid(s); nil when it sent none
}

// errSamples is a request for more than one sample.
var errSamples = errors.New("n > 1 is not served over prefill/decode pairs: each sample needs its own " +
	"bootstrap room or KV handoff (a NIXL handoff has one consumer; a shared room hangs); send n requests with n = 1")

func inspect(body []byte) (*request, error) {
	o, err := jsonedit.Parse(body)
	if err != nil {
		return nil, err
	}
	r := &request{obj: o}
	if v, ok := o.Get("n"); ok && moreThanOne(v) {
		return nil, errSamples
	}
	if v, ok := o.Get("sampling_params"); ok {
		if sp, err := jsonedit.Parse(v); err == nil {
			if n, ok := sp.Get("n"); ok && moreThanOne(n) {
				return nil, errSamples
			}
		} else if els, err := jsonedit.Elements(v); err == nil {
			for _, e := range els {
				if sp, err := jsonedit.Parse(e); err == nil {
					if n, ok := sp.Get("n"); ok && moreThanOne(n) {
						return nil, errSamples
					}
				}
			}
		}
	}
	r.batch = batchSize(o)
	if v, ok := o.Get("return_logprob"); ok {
		r.logprob = truthy(v)
	}
	if v, ok := o.Get("rid"); ok {
		var one string
		var many []string
		switch {
		case json.Unmarshal(v, &one) == nil:
			r.rids = []string{one}
		case json.Unmarshal(v, &many) == nil:
			r.rids = many
		}
	}
	return r, nil
}

func moreThanOne(v []byte) bool {
	f, err := strconv.ParseFloat(string(bytes.TrimSpace(v)), 64)
	return err == nil && f > 1
}

func truthy(v []byte) bool {
	v = bytes.TrimSpace(v)
	if string(v) == "true" {
		return true
	}
	var l []bool
	if json.Unmarshal(v, &l) == nil {
		for _, b := range l {
			if b {
				return true
			}
		}
	}
	return false
}

// batchSize is the number of items of a batch (text a list, input_ids a
// list of lists, prompt a list of strings or of lists), 0 for one prompt.
func batchSize(o *jsonedit.Object) int {
	for _, key := range []string{"text", "input_ids", "prompt"} {
		v, ok := o.Get(key)
		if !ok {
			continue
		}
		first, err := jsonedit.First(v)
		if err != nil || first == nil {
			return 0
		}
		if c := first[0]; key == "text" || c == '[' || (c == '"' && key == "prompt") {
			n, _ := jsonedit.Len(v)
			return n
		}
		return 0
	}
	return 0
}

// newRoom is a bootstrap room: uniform in 0..2^63-1 (SGLang picks a
// data-parallel prefill rank as room % dp_size).
func newRoom() uint64 { return rand.Uint64() >> 1 }

func newID(prefix string) string {
	var b [8]byte
	for i := range b {
		b[i] = byte(rand.Uint32())
	}
	return prefix + hex.EncodeToString(b[:])
}

// sglangBody sets the bootstrap fields (and a rid where the client sent
// none) for one attempt; it returns the body and the rids both legs carry.
func sglangBody(r *request, p Worker) ([]byte, []string, error) {
	host, err := hostOf(p.URL)
	if err != nil {
		return nil, nil, err
	}
	port := []byte("null")
	if p.BootstrapPort > 0 {
		port = strconv.AppendInt(nil, int64(p.BootstrapPort), 10)
	}
	hostJSON := jsonedit.AppendString(nil, host)
	edits := make([]jsonedit.Edit, 0, 4)
	rids := r.rids
	if r.batch == 0 {
		edits = append(edits,
			jsonedit.Set("bootstrap_host", hostJSON),
			jsonedit.Set("bootstrap_port", port),
			jsonedit.Set("bootstrap_room", strconv.AppendUint(nil, newRoom(), 10)))
		if rids == nil {
			rids = []string{newID("pd-")}
			edits = append(edits, jsonedit.SetString("rid", rids[0]))
		}
	} else {
		hosts, ports, rooms := []byte{'['}, []byte{'['}, []byte{'['}
		newRids := rids == nil
		for i := 0; i < r.batch; i++ {
			if i > 0 {
				hosts, ports, rooms = append(hosts, ','), append(ports, ','), append(rooms, ',')
			}
			hosts = append(hosts, hostJSON...)
			ports = append(ports, port...)
			rooms = strconv.AppendUint(rooms, newRoom(), 10)
			if newRids {
				rids = append(rids, newID("pd-"))
			}
		}
		edits = append(edits,
			jsonedit.Set("bootstrap_host", append(hosts, ']')),
			jsonedit.Set("bootstrap_port", append(ports, ']')),
			jsonedit.Set("bootstrap_room", append(rooms, ']')))
		if newRids {
			l, _ := json.Marshal(rids)
			edits = append(edits, jsonedit.Set("rid", l))
		}
	}
	body, err := r.obj.Apply(edits...)
	if err != nil {
		return nil, nil, fmt.Errorf("pd: %w", err)
	}
	return body, rids, nil
}

// prefillKVParams is what a vLLM prefill leg asks for.
var prefillKVParams = []byte(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,` +
	`"remote_block_ids":null,"remote_host":null,"remote_port":null}`)

// vllmPrefillBody is the prefill leg's body: one token, not streamed.
func vllmPrefillBody(r *request) ([]byte, error) {
	edits := []jsonedit.Edit{
		jsonedit.Set("kv_transfer_params", prefillKVParams),
		jsonedit.Set("stream", []byte("false")),
		jsonedit.Delete("stream_options"),
		jsonedit.Set("max_tokens", []byte("1")),
		jsonedit.Delete("min_tokens"),
		jsonedit.Delete("min_completion_tokens"),
	}
	if r.obj.Has("max_completion_tokens") {
		edits = append(edits, jsonedit.Set("max_completion_tokens", []byte("1")))
	}
	if r.obj.Has("n") {
		edits = append(edits, jsonedit.Set("n", []byte("1")))
	}
	return r.obj.Apply(edits...)
}

// kvParams returns the kv_transfer_params object of a prefill's answer,
// nil when it has none (absent, null, not an object).
func kvParams(answer []byte) []byte {
	o, err := jsonedit.Parse(answer)
	if err != nil {
		return nil
	}
	v, ok := o.Get("kv_transfer_params")
	if !ok || len(v) == 0 || v[0] != '{' {
		return nil
	}
	return v
}
