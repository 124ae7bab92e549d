package fakepd

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/tether-rl/tether/testenv/fakeengine"
)

// lease is a prefill's pinned blocks for one handoff.
type lease struct {
	blocks  []int
	timer   *time.Timer
	handoff handoffAnswer // the KV's version and cached tokens
}

// VLLMPrefill is a fake vLLM prefill engine (NIXL producer).
type VLLMPrefill struct {
	server
	leaseMu    sync.Mutex
	leases     map[string]*lease
	nextBlock  int
	omitParams atomic32
}

// StartVLLMPrefill starts a prefill on 127.0.0.1.
func StartVLLMPrefill(opts Options) (*VLLMPrefill, error) {
	opts.defaults()
	p := &VLLMPrefill{leases: map[string]*lease{}}
	p.opts = opts
	mux := http.NewServeMux()
	for _, path := range []string{"/v1/completions", "/v1/chat/completions"} {
		mux.HandleFunc("POST "+path, p.generate)
	}
	mux.HandleFunc("POST /_nixl/pull", p.pull)
	mux.HandleFunc("POST /_nixl/release", p.release)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) {})
	mux.HandleFunc("GET /health_generate", func(w http.ResponseWriter, _ *http.Request) {})
	if err := p.start(mux); err != nil {
		return nil, err
	}
	if err := p.startEvents(); err != nil {
		p.kill()
		return nil, fmt.Errorf("fakepd: kv events: %w", err)
	}
	return p, nil
}

// OmitParams makes it answer without kv_transfer_params (an engine not
// configured as a producer), pinning nothing.
func (p *VLLMPrefill) OmitParams(on bool) {
	v := int32(0)
	if on {
		v = 1
	}
	p.omitParams.Store(v)
}

// Held is the number of blocks it keeps pinned.
func (p *VLLMPrefill) Held() int {
	p.leaseMu.Lock()
	defer p.leaseMu.Unlock()
	n := 0
	for _, l := range p.leases {
		n += len(l.blocks)
	}
	return n
}

// Kill closes it and drops its leases (a crash).
func (p *VLLMPrefill) Kill() {
	p.kill()
	p.leaseMu.Lock()
	for id, l := range p.leases {
		l.timer.Stop()
		delete(p.leases, id)
	}
	p.leaseMu.Unlock()
}

// Close is Kill.
func (p *VLLMPrefill) Close() { p.Kill() }

type kvParams struct {
	DoRemoteDecode  bool    `json:"do_remote_decode"`
	DoRemotePrefill bool    `json:"do_remote_prefill"`
	RemoteEngineID  *string `json:"remote_engine_id"`
	RemoteBlockIDs  [][]int `json:"remote_block_ids"`
	RemoteRequestID string  `json:"remote_request_id,omitempty"`
	RemoteHost      *string `json:"remote_host"`
	RemotePort      *int    `json:"remote_port"`
	TPSize          int     `json:"tp_size,omitempty"`
}

// badPrefill reports a prefill leg's body against the protocol.
func badPrefill(g *genRequest) bool {
	if string(g.raw["stream"]) == "true" || string(g.raw["max_tokens"]) != "1" {
		return true
	}
	if v, ok := g.raw["max_completion_tokens"]; ok && string(v) != "1" {
		return true
	}
	if v, ok := g.raw["n"]; ok && string(v) != "1" {
		return true
	}
	for _, k := range []string{"stream_options", "min_tokens", "min_completion_tokens"} {
		if _, ok := g.raw[k]; ok {
			return true
		}
	}
	return false
}

func (p *VLLMPrefill) generate(w http.ResponseWriter, r *http.Request) {
	g, ok := p.read(w, r, fakeengine.VLLM)
	if !ok || p.failed(w) {
		return
	}
	g.rid = r.Header.Get("X-Request-Id")
	var kv kvParams
	if raw, ok := g.raw["kv_transfer_params"]; !ok || json.Unmarshal(raw, &kv) != nil || !kv.DoRemoteDecode {
		p.serveWhole(w, r, g) // an ordinary request
		return
	}
	if badPrefill(g) {
		p.Stats.BadPrefill.Add(1)
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	tr, untrack := p.track(g.rid, cancel)
	defer untrack()
	var handoff handoffAnswer
	ok = p.admit(ctx)
	if ok {
		handoff.CachedTokens, handoff.WeightVersion, ok = p.compute(ctx, g.prompt)
	}
	g.stream = false
	if !ok {
		p.Stats.Aborted.Add(1)
		if p.wasAborted(tr) {
			// vLLM answers an aborted request with finish reason abort,
			// and its connector gives no kv_transfer_params for it.
			answer(ctx, w, g, 1, p.newOut(ctx, tr, decoding{}), 0, nil)
		}
		return
	}
	if p.wasAborted(tr) {
		// Aborted as its compute ended: as above, nothing pinned.
		p.Stats.Aborted.Add(1)
		answer(ctx, w, g, 1, p.newOut(ctx, tr, decoding{}), 0, nil)
		return
	}
	// Computed: the answer is written whole even if an abort comes now
	// (the request is over; its blocks wait for the decode).
	ctx = context.WithoutCancel(ctx)
	if p.omitParams.Load() != 0 {
		answer(ctx, w, g, 1, nil, handoff.CachedTokens, nil)
		p.Stats.Served.Add(1)
		return
	}
	id := g.rid + "-" + strconv.Itoa(p.Port())
	p.leaseMu.Lock()
	if old := p.leases[id]; old != nil {
		old.timer.Stop()
	}
	nb := (len(g.prompt) + p.opts.BlockTokens - 1) / p.opts.BlockTokens
	l := &lease{handoff: handoff}
	for i := 0; i < nb; i++ {
		p.nextBlock++
		l.blocks = append(l.blocks, p.nextBlock)
	}
	l.timer = time.AfterFunc(p.opts.Lease, func() {
		p.leaseMu.Lock()
		defer p.leaseMu.Unlock()
		if p.leases[id] == l {
			delete(p.leases, id)
			p.Stats.LeaseExpiry.Add(1)
		}
	})
	p.leases[id] = l
	p.leaseMu.Unlock()
	engine, host, port := fmt.Sprintf("fake-%d", p.Port()), "127.0.0.1", p.Port()
	params := kvParams{DoRemotePrefill: true, RemoteEngineID: &engine, RemoteBlockIDs: [][]int{l.blocks},
		RemoteRequestID: id, RemoteHost: &host, RemotePort: &port, TPSize: 1}
	if answer(ctx, w, g, 1, nil, handoff.CachedTokens, map[string]any{"kv_transfer_params": params}) {
		p.Stats.Served.Add(1)
	}
}

type handoff struct {
	RemoteRequestID string  `json:"remote_request_id"`
	RemoteBlockIDs  [][]int `json:"remote_block_ids"`
}

// take frees a lease; false if it is gone or its blocks differ.
func (p *VLLMPrefill) take(h *handoff) (handoffAnswer, bool) {
	p.leaseMu.Lock()
	defer p.leaseMu.Unlock()
	l := p.leases[h.RemoteRequestID]
	if l == nil || len(h.RemoteBlockIDs) != 1 || fmt.Sprint(h.RemoteBlockIDs[0]) != fmt.Sprint(l.blocks) {
		return handoffAnswer{}, false
	}
	l.timer.Stop()
	delete(p.leases, h.RemoteRequestID)
	return l.handoff, true
}

// pull serves a decode's read of the blocks: the first frees them; the
// answer says the version they were computed at.
func (p *VLLMPrefill) pull(w http.ResponseWriter, r *http.Request) {
	var h handoff
	if json.NewDecoder(r.Body).Decode(&h) != nil {
		http.Error(w, "bad handoff", http.StatusBadRequest)
		return
	}
	a, ok := p.take(&h)
	if !ok {
		http.Error(w, "no such blocks", http.StatusGone)
		return
	}
	p.Stats.Pulls.Add(1)
	writeJSON(w, http.StatusOK, a)
}

// release serves a decode's notification that it will not pull.
func (p *VLLMPrefill) release(w http.ResponseWriter, r *http.Request) {
	var h handoff
	if json.NewDecoder(r.Body).Decode(&h) == nil {
		if _, ok := p.take(&h); ok {
			p.Stats.Notified.Add(1)
		}
	}
	w.WriteHeader(http.StatusOK)
}

// VLLMDecode is a fake vLLM decode engine (NIXL consumer).
type VLLMDecode struct {
	server
	running atomic32
	client  *http.Client
}

// StartVLLMDecode starts a decode on 127.0.0.1.
func StartVLLMDecode(opts Options) (*VLLMDecode, error) {
	opts.defaults()
	d := &VLLMDecode{client: &http.Client{Transport: &http.Transport{}, Timeout: 5 * time.Second}}
	d.opts = opts
	mux := http.NewServeMux()
	for _, path := range []string{"/v1/completions", "/v1/chat/completions"} {
		mux.HandleFunc("POST "+path, d.generate)
	}
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) {})
	mux.HandleFunc("GET /health_generate", func(w http.ResponseWriter, _ *http.Request) {})
	if err := d.start(mux); err != nil {
		return nil, err
	}
	return d, nil
}

// Held is the number of requests it is decoding.
func (d *VLLMDecode) Held() int { return int(d.running.Load()) }

// Kill closes it (a crash).
func (d *VLLMDecode) Kill() {
	d.kill()
	d.client.CloseIdleConnections()
}

// Close is Kill.
func (d *VLLMDecode) Close() { d.Kill() }

// call posts a handoff to the prefill's side channel; a pull's answer
// says the KV's version and cached tokens.
func (d *VLLMDecode) call(kv *kvParams, what string) (handoffAnswer, bool) {
	b, _ := json.Marshal(handoff{RemoteRequestID: kv.RemoteRequestID, RemoteBlockIDs: kv.RemoteBlockIDs})
	url := fmt.Sprintf("http://%s:%d/_nixl/%s", *kv.RemoteHost, *kv.RemotePort, what)
	resp, err := d.client.Post(url, "application/json", bytesReader(b))
	if err != nil {
		return handoffAnswer{}, false
	}
	out, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	var a handoffAnswer
	if what == "pull" && (err != nil || json.Unmarshal(out, &a) != nil) {
		return a, false
	}
	return a, err == nil && resp.StatusCode == http.StatusOK
}

func (d *VLLMDecode) generate(w http.ResponseWriter, r *http.Request) {
	var kv kvParams
	var complete bool
	release := func() {
		if complete && d.opts.Notify {
			d.call(&kv, "release")
		}
	}
	g, ok := d.read(w, r, fakeengine.VLLM)
	if !ok {
		return
	}
	g.rid = r.Header.Get("X-Request-Id")
	if raw, ok := g.raw["kv_transfer_params"]; ok && json.Unmarshal(raw, &kv) == nil {
		complete = kv.DoRemotePrefill && kv.RemoteEngineID != nil && kv.RemoteHost != nil && kv.RemotePort != nil &&
			len(kv.RemoteBlockIDs) > 0 && kv.RemoteRequestID != ""
	}
	if d.failed(w) {
		release()
		return
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	tr, untrack := d.track(g.rid, cancel)
	defer untrack()
	d.running.Add(1)
	defer d.running.Add(-1)
	if !d.admit(ctx) || !d.decodeSlots.acquire(ctx) {
		d.Stats.Aborted.Add(1)
		release()
		if d.wasAborted(tr) {
			answer(ctx, w, g, g.maxNew, d.newOut(ctx, tr, decoding{}), 0, nil)
		}
		return
	}
	defer d.decodeSlots.release()
	var h handoffAnswer
	pulled := false
	if complete {
		h, pulled = d.call(&kv, "pull")
	}
	if !pulled {
		// vLLM logs a warning and recomputes the prompt, at its own version.
		d.Stats.Recomputes.Add(1)
		h = handoffAnswer{WeightVersion: d.WeightVersion()}
	}
	if answer(ctx, w, g, g.maxNew, d.newOut(ctx, tr, decoding{before: []string{h.WeightVersion}}), h.CachedTokens, nil) {
		d.Stats.Served.Add(1)
	} else {
		d.Stats.Aborted.Add(1)
	}
}

// HeldIDs names the handoffs whose blocks it keeps pinned (a diagnosis).
func (p *VLLMPrefill) HeldIDs() []string {
	p.leaseMu.Lock()
	defer p.leaseMu.Unlock()
	var ids []string
	for id, l := range p.leases {
		ids = append(ids, fmt.Sprintf("%s (%d blocks)", id, len(l.blocks)))
	}
	return ids
}
