package fakepd

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/tether-rl/tether/testenv/fakeengine"
)

// noRoom is SGLang's answer to a generation request without bootstrap fields.
const noRoom = "Disaggregated request received without bootstrap room id"

// room is one bootstrap room on a prefill.
type room struct {
	held    bool          // registered by a prefill request, not freed
	ready   bool          // KV computed, waiting for the decode
	pulled  bool          // the decode took it
	aborted bool          // dropped, and the decode told (Notify)
	changed chan struct{} // closed on every change
	handoff handoffAnswer // the KV's version and cached tokens, once ready
}

// SGLangPrefill is a fake SGLang prefill engine with its bootstrap server.
type SGLangPrefill struct {
	server
	boot    *http.Server
	bootLn  net.Listener
	roomsMu sync.Mutex
	rooms   map[uint64]*room
}

// StartSGLangPrefill starts a prefill on 127.0.0.1 (HTTP and bootstrap
// ports of its own).
func StartSGLangPrefill(opts Options) (*SGLangPrefill, error) {
	opts.defaults()
	p := &SGLangPrefill{rooms: map[uint64]*room{}}
	p.opts = opts
	mux := http.NewServeMux()
	for _, path := range []string{"/generate", "/v1/completions", "/v1/chat/completions"} {
		mux.HandleFunc("POST "+path, p.generate)
	}
	mux.HandleFunc("POST /abort_request", p.abortRequest)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) {})
	mux.HandleFunc("GET /health_generate", func(w http.ResponseWriter, _ *http.Request) {})
	if err := p.start(mux); err != nil {
		return nil, err
	}
	if err := p.startEvents(); err != nil {
		p.kill()
		return nil, fmt.Errorf("fakepd: kv events: %w", err)
	}
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		p.kill()
		return nil, err
	}
	p.bootLn = ln
	bmux := http.NewServeMux()
	bmux.HandleFunc("GET /kv", p.kv)
	p.boot = &http.Server{Handler: bmux}
	go p.boot.Serve(ln)
	return p, nil
}

// BootstrapPort is the port of its bootstrap server.
func (p *SGLangPrefill) BootstrapPort() int { return p.bootLn.Addr().(*net.TCPAddr).Port }

// Kill closes both servers and drops every room (a crash).
func (p *SGLangPrefill) Kill() {
	// The rooms go first: a request its cancel ends finds its room gone
	// and tells no decode (a crash notifies nobody); then the servers.
	drop := func() {
		p.roomsMu.Lock()
		p.rooms = map[uint64]*room{}
		p.roomsMu.Unlock()
	}
	drop()
	p.boot.Close()
	p.kill()
	drop() // any a decode's poll made meanwhile
}

// Close is Kill.
func (p *SGLangPrefill) Close() { p.Kill() }

// Held is the number of rooms it holds.
func (p *SGLangPrefill) Held() int {
	p.roomsMu.Lock()
	defer p.roomsMu.Unlock()
	n := 0
	for _, r := range p.rooms {
		if r.held {
			n++
		}
	}
	return n
}

// roomLocked returns room id, made if absent.
func (p *SGLangPrefill) roomLocked(id uint64) *room {
	r := p.rooms[id]
	if r == nil {
		r = &room{changed: make(chan struct{})}
		p.rooms[id] = r
	}
	return r
}

func (r *room) signal() {
	close(r.changed)
	r.changed = make(chan struct{})
}

// bootstrap reads the bootstrap fields SGLang requires.
func bootstrap(g *genRequest) (host string, port int, id uint64, ok bool) {
	if err := json.Unmarshal(g.raw["bootstrap_room"], &id); err != nil {
		return "", 0, 0, false
	}
	if err := json.Unmarshal(g.raw["bootstrap_host"], &host); err != nil || host == "" {
		return "", 0, 0, false
	}
	port = 8998
	if v, ok := g.raw["bootstrap_port"]; ok && string(v) != "null" {
		if err := json.Unmarshal(v, &port); err != nil {
			return "", 0, 0, false
		}
	}
	return host, port, id, true
}

// read parses a generation request; false after answering it.
func (s *server) read(w http.ResponseWriter, r *http.Request, kind fakeengine.Kind) (*genRequest, bool) {
	s.Stats.Requests.Add(1)
	body, err := io.ReadAll(r.Body)
	if err != nil {
		return nil, false
	}
	g, err := parseGen(kind, r, body)
	if err != nil {
		s.Stats.Refused.Add(1)
		writeJSON(w, http.StatusBadRequest, map[string]any{"error": map[string]any{"message": err.Error(), "code": 400}})
		return nil, false
	}
	return g, true
}

// failed answers an injected fault, if one is due.
func (s *server) failed(w http.ResponseWriter) bool {
	st := s.fault()
	if st == 0 {
		return false
	}
	s.Stats.Failed.Add(1)
	writeJSON(w, st, map[string]any{"error": map[string]any{"message": "injected fault", "code": st}})
	return true
}

func (p *SGLangPrefill) generate(w http.ResponseWriter, r *http.Request) {
	g, ok := p.read(w, r, fakeengine.SGLang)
	if !ok || p.failed(w) {
		return
	}
	_, _, id, ok := bootstrap(g)
	if !ok && p.opts.Regular {
		p.serveWhole(w, r, g)
		return
	}
	if !ok {
		p.Stats.Refused.Add(1)
		writeJSON(w, http.StatusBadRequest, map[string]any{"error": map[string]any{"message": noRoom, "code": 400}})
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), p.opts.WaitTimeout)
	defer cancel()
	_, untrack := p.track(g.rid, cancel)
	defer untrack()
	p.roomsMu.Lock()
	rm := p.roomLocked(id)
	rm.held = true
	p.roomsMu.Unlock()
	free := func(notify bool) {
		p.roomsMu.Lock()
		defer p.roomsMu.Unlock()
		if p.rooms[id] != rm {
			return // killed
		}
		rm.held = false
		if notify && !rm.pulled {
			rm.aborted = true
			rm.signal()
			return // kept for the decode to see; it deletes it
		}
		delete(p.rooms, id)
	}
	var handoff handoffAnswer
	if p.admit(ctx) {
		handoff.CachedTokens, handoff.WeightVersion, ok = p.compute(ctx, g.prompt)
	} else {
		ok = false
	}
	if !ok {
		p.ended(ctx, r)
		free(p.opts.Notify)
		return
	}
	p.roomsMu.Lock()
	rm.ready = true
	rm.handoff = handoff
	rm.signal()
	p.roomsMu.Unlock()
	for {
		p.roomsMu.Lock()
		pulled, ch := rm.pulled, rm.changed
		p.roomsMu.Unlock()
		if pulled {
			break
		}
		select {
		case <-ch:
		case <-ctx.Done():
			p.ended(ctx, r)
			free(p.opts.Notify)
			return
		}
	}
	free(false)
	p.Stats.Served.Add(1)
	if g.path == "/generate" {
		// A finish of length 0, with the prompt's logprob rows.
		ans := generateAnswer(g, "", nil, "length", nil, handoff.CachedTokens)
		if g.logprob {
			ans["meta_info"].(map[string]any)["input_token_logprobs"] = promptLogprobs(g.prompt)
		}
		if g.stream {
			startSSE(w)
			writeEvent(w, ans)
			w.Write([]byte("data: [DONE]\n\n"))
			return
		}
		writeJSON(w, http.StatusOK, ans)
		return
	}
	answer(ctx, w, g, 0, nil, handoff.CachedTokens, nil)
}

// ended counts a request ended early: aborted or timed out.
func (s *server) ended(ctx context.Context, r *http.Request) {
	if r.Context().Err() == nil && ctx.Err() == context.DeadlineExceeded {
		s.Stats.Timeouts.Add(1)
		return
	}
	s.Stats.Aborted.Add(1)
}

// kv serves a decode's long poll for a room: 200 once ready (the room is
// then pulled), 410 if dropped with a notification.
func (p *SGLangPrefill) kv(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.ParseUint(r.URL.Query().Get("room"), 10, 64)
	if err != nil {
		http.Error(w, "bad room", http.StatusBadRequest)
		return
	}
	for {
		p.roomsMu.Lock()
		rm := p.roomLocked(id)
		switch {
		case rm.aborted:
			delete(p.rooms, id)
			p.roomsMu.Unlock()
			p.Stats.Notified.Add(1)
			http.Error(w, "room aborted", http.StatusGone)
			return
		case rm.ready:
			rm.pulled = true
			rm.signal()
			h := rm.handoff
			p.roomsMu.Unlock()
			writeJSON(w, http.StatusOK, h)
			return
		}
		ch := rm.changed
		p.roomsMu.Unlock()
		select {
		case <-ch:
		case <-r.Context().Done():
			p.roomsMu.Lock()
			if rm := p.rooms[id]; rm != nil && !rm.held && !rm.ready {
				delete(p.rooms, id) // made by this poll alone
			}
			p.roomsMu.Unlock()
			return
		}
	}
}

// SGLangDecode is a fake SGLang decode engine.
type SGLangDecode struct {
	server
	waiting, running atomic32
	client           *http.Client
}

// StartSGLangDecode starts a decode on 127.0.0.1.
func StartSGLangDecode(opts Options) (*SGLangDecode, error) {
	opts.defaults()
	d := &SGLangDecode{client: &http.Client{Transport: &http.Transport{}}}
	d.opts = opts
	mux := http.NewServeMux()
	for _, path := range []string{"/generate", "/v1/completions", "/v1/chat/completions"} {
		mux.HandleFunc("POST "+path, d.generate)
	}
	mux.HandleFunc("POST /abort_request", d.abortRequest)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) {})
	mux.HandleFunc("GET /health_generate", func(w http.ResponseWriter, _ *http.Request) {})
	if err := d.start(mux); err != nil {
		return nil, err
	}
	return d, nil
}

// Kill closes it (a crash).
func (d *SGLangDecode) Kill() {
	d.kill()
	d.client.CloseIdleConnections()
}

// Close is Kill.
func (d *SGLangDecode) Close() { d.Kill() }

// Held is the number of requests waiting for a room or decoding.
func (d *SGLangDecode) Held() int { return int(d.waiting.Load() + d.running.Load()) }

// Waiting is the number waiting for their room.
func (d *SGLangDecode) Waiting() int { return int(d.waiting.Load()) }

func (d *SGLangDecode) generate(w http.ResponseWriter, r *http.Request) {
	g, ok := d.read(w, r, fakeengine.SGLang)
	if !ok || d.failed(w) {
		return
	}
	host, port, id, ok := bootstrap(g)
	if !ok {
		d.Stats.Refused.Add(1)
		writeJSON(w, http.StatusBadRequest, map[string]any{"error": map[string]any{"message": noRoom, "code": 400}})
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), d.opts.WaitTimeout)
	defer cancel()
	tr, untrack := d.track(g.rid, cancel)
	defer untrack()
	// Parked while paused, then a slot (its KV memory), then the room.
	d.waiting.Add(1)
	var h handoffAnswer
	var err error
	if !d.admit(ctx) || !d.decodeSlots.acquire(ctx) {
		err = ctx.Err()
	} else {
		defer d.decodeSlots.release()
		h, err = d.await(ctx, host, port, id)
	}
	d.waiting.Add(-1)
	if err != nil {
		d.ended(ctx, r)
		writeJSON(w, http.StatusInternalServerError, map[string]any{"error": map[string]any{"message": "KV transfer failed: " + err.Error(), "code": 500}})
		return
	}
	d.running.Add(1)
	defer d.running.Add(-1)
	o := d.newOut(ctx, tr, decoding{before: []string{h.WeightVersion}})
	if answer(ctx, w, g, g.maxNew, o, h.CachedTokens, nil) {
		d.Stats.Served.Add(1)
	} else {
		d.ended(ctx, r)
	}
}

// await waits for its room: polls the prefill's bootstrap server until the
// room is ready, dropped (410), or ctx ends; a prefill it cannot reach is
// tried again every 20 ms.
func (d *SGLangDecode) await(ctx context.Context, host string, port int, id uint64) (handoffAnswer, error) {
	url := "http://" + net.JoinHostPort(host, strconv.Itoa(port)) + "/kv?room=" + strconv.FormatUint(id, 10)
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		resp, err := d.client.Do(req)
		if err == nil {
			b, rerr := io.ReadAll(resp.Body)
			resp.Body.Close()
			switch {
			case resp.StatusCode == http.StatusOK && rerr == nil:
				var h handoffAnswer
				err := json.Unmarshal(b, &h)
				return h, err
			case resp.StatusCode == http.StatusGone:
				d.Stats.Notified.Add(1)
				return handoffAnswer{}, errGone
			}
		}
		if !sleep(ctx, 20*time.Millisecond) {
			return handoffAnswer{}, ctx.Err()
		}
	}
}

// HeldIDs names the rooms it holds (a diagnosis).
func (p *SGLangPrefill) HeldIDs() []string {
	p.roomsMu.Lock()
	defer p.roomsMu.Unlock()
	var ids []string
	for id, r := range p.rooms {
		if r.held {
			ids = append(ids, fmt.Sprintf("room %d (ready %v)", id, r.ready))
		}
	}
	return ids
}
