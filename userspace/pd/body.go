package pd

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"

	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/jsonedit"
)

// request is what Serve reads from a client's body.
type request struct {
	obj     *jsonedit.Object
	batch   int      // items of a batch; 0 for one prompt
	logprob bool     // input logprobs asked for (the bootstrap protocol's merge)
	rids    []string // the client's rid(s); nil when it sent none
}

// errSamples is a request for more than one sample.
var errSamples = errors.New("n > 1 is served over prefill/decode pairs only as n requests of one sample, " +
	"each with its own bootstrap room or KV handoff (a NIXL handoff has one consumer; a shared room hangs): " +
	"not streamed, without a seed, a request id of the client's or a batch, n at most " + strconv.Itoa(MaxSamples) +
	"; send n requests with n = 1")

// The protocols' words are dialect's (each engine's file): rooms is the
// bootstrap protocol's wire, handoff the NIXL protocol's.
var (
	rooms   = wireOf(SGLang)
	handoff = wireOf(VLLM)
)

func wireOf(p Protocol) *dialect.PDWire {
	w := dialect.PD(p.String())
	if w == nil {
		panic("pd: no engine in userspace/dialect speaks the " + p.String() + " P/D protocol")
	}
	return w
}

// inspect reads a client's body: a request for several samples in any
// engine's words is refused whatever the protocol; the batch, logprob and
// rid reads are the bootstrap protocol's (the NIXL protocol uses none).
func inspect(body []byte) (*request, error) {
	o, err := jsonedit.Parse(body)
	if err != nil {
		return nil, err
	}
	r := &request{obj: o}
	for _, f := range dialect.PDSamples() {
		if v, ok := o.Get(f.Field); ok && samples(v, f.Inner) {
			return nil, errSamples
		}
	}
	r.batch = batchSize(o)
	if rooms.LogprobFlag != "" {
		if v, ok := o.Get(rooms.LogprobFlag); ok {
			r.logprob = truthy(v)
		}
	}
	if rooms.RequestIDField != "" {
		if v, ok := o.Get(rooms.RequestIDField); ok {
			var one string
			var many []string
			switch {
			case json.Unmarshal(v, &one) == nil:
				r.rids = []string{one}
			case json.Unmarshal(v, &many) == nil:
				r.rids = many
			}
		}
	}
	return r, nil
}

// samples reports whether v asks for more than one sample: v itself (inner
// ""), or its field inner, v an object or a list of them.
func samples(v []byte, inner string) bool {
	if inner == "" {
		return moreThanOne(v)
	}
	if sp, err := jsonedit.Parse(v); err == nil {
		n, ok := sp.Get(inner)
		return ok && moreThanOne(n)
	}
	els, err := jsonedit.Elements(v)
	if err != nil {
		return false
	}
	for _, e := range els {
		if sp, err := jsonedit.Parse(e); err == nil {
			if n, ok := sp.Get(inner); ok && moreThanOne(n) {
				return true
			}
		}
	}
	return false
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

// batchSize is the number of items of a batch (the first of the
// bootstrap protocol's Batch fields present, a list of what makes one), 0
// for one prompt.
func batchSize(o *jsonedit.Object) int {
	for _, f := range rooms.Batch {
		v, ok := o.Get(f.Name)
		if !ok {
			continue
		}
		first, err := jsonedit.First(v)
		if err != nil || first == nil {
			return 0
		}
		if f.FirstItem == "" || strings.IndexByte(f.FirstItem, first[0]) >= 0 {
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
			jsonedit.Set(rooms.BootstrapHost, hostJSON),
			jsonedit.Set(rooms.BootstrapPort, port),
			jsonedit.Set(rooms.BootstrapRoom, strconv.AppendUint(nil, newRoom(), 10)))
		if rids == nil {
			rids = []string{newID("pd-")}
			edits = append(edits, jsonedit.SetString(rooms.RequestIDField, rids[0]))
		}
	} else {
		hosts, ports, roomList := []byte{'['}, []byte{'['}, []byte{'['}
		newRids := rids == nil
		for i := 0; i < r.batch; i++ {
			if i > 0 {
				hosts, ports, roomList = append(hosts, ','), append(ports, ','), append(roomList, ',')
			}
			hosts = append(hosts, hostJSON...)
			ports = append(ports, port...)
			roomList = strconv.AppendUint(roomList, newRoom(), 10)
			if newRids {
				rids = append(rids, newID("pd-"))
			}
		}
		edits = append(edits,
			jsonedit.Set(rooms.BootstrapHost, append(hosts, ']')),
			jsonedit.Set(rooms.BootstrapPort, append(ports, ']')),
			jsonedit.Set(rooms.BootstrapRoom, append(roomList, ']')))
		if newRids {
			l, _ := json.Marshal(rids)
			edits = append(edits, jsonedit.Set(rooms.RequestIDField, l))
		}
	}
	body, err := r.obj.Apply(edits...)
	if err != nil {
		return nil, nil, fmt.Errorf("pd: %w", err)
	}
	return body, rids, nil
}

// vllmPrefillBody is the prefill leg's body: the client's with the NIXL
// protocol's PrefillEdits (one token, not streamed, a remote decode).
func vllmPrefillBody(r *request) ([]byte, error) {
	edits := make([]jsonedit.Edit, 0, len(handoff.PrefillEdits))
	for _, e := range handoff.PrefillEdits {
		switch {
		case e.IfPresent && !r.obj.Has(e.Name):
		case e.Value == nil:
			edits = append(edits, jsonedit.Delete(e.Name))
		default:
			edits = append(edits, jsonedit.Set(e.Name, e.Value))
		}
	}
	return r.obj.Apply(edits...)
}

// kvParams returns the handoff object of a prefill's answer, nil when it
// has none (absent, null, not an object).
func kvParams(answer []byte) []byte {
	o, err := jsonedit.Parse(answer)
	if err != nil {
		return nil
	}
	v, ok := o.Get(handoff.KVParams)
	if !ok || len(v) == 0 || v[0] != '{' {
		return nil
	}
	return v
}
