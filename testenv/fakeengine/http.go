package fakeengine

import (
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"time"
)

// maxBody bounds the request bodies read (a weight-update body a test sends
// whole included).
const maxBody = 64 << 20

type handler func(e *Engine, w http.ResponseWriter, r *http.Request, body []byte)

type route struct {
	methods string // "GET", "POST" or "GET,POST"
	h       handler
}

var sglangRoutes = map[string]route{
	"/generate":                        {"POST", (*Engine).generate},
	"/v1/completions":                  {"POST", (*Engine).generate},
	"/v1/chat/completions":             {"POST", (*Engine).generate},
	"/health":                          {"GET,POST", (*Engine).health},
	"/health_generate":                 {"GET,POST", (*Engine).health},
	"/v1/models":                       {"GET", (*Engine).models},
	"/v1/loads":                        {"GET", (*Engine).v1Loads},
	"/get_load":                        {"GET", (*Engine).getLoad},
	"/metrics":                         {"GET", (*Engine).metrics},
	"/pause_generation":                {"POST", (*Engine).sglPause},
	"/continue_generation":             {"POST", (*Engine).sglContinue},
	"/abort_request":                   {"POST", (*Engine).sglAbort},
	"/flush_cache":                     {"GET,POST", (*Engine).sglFlush},
	"/update_weights_from_disk":        {"POST", (*Engine).sglUpdate},
	"/update_weights_from_distributed": {"POST", (*Engine).sglUpdate},
	"/update_weights_from_tensor":      {"POST", (*Engine).sglUpdate},
	"/init_weights_update_group":       {"POST", (*Engine).sglOK},
	"/destroy_weights_update_group":    {"POST", (*Engine).sglOK},
	"/get_weight_version":              {"GET", (*Engine).getWeightVersion},
	"/update_weight_version":           {"POST", (*Engine).sglSetVersion},
	"/get_server_info":                 {"GET", (*Engine).serverInfo},
	"/get_model_info":                  {"GET", (*Engine).modelInfo},
	"/release_memory_occupation":       {"POST", (*Engine).sleep},
	"/resume_memory_occupation":        {"POST", (*Engine).wakeUp},
}

var vllmRoutes = map[string]route{
	"/v1/completions":              {"POST", (*Engine).generate},
	"/v1/chat/completions":         {"POST", (*Engine).generate},
	"/inference/v1/generate":       {"POST", (*Engine).generate},
	"/health":                      {"GET", (*Engine).health},
	"/v1/models":                   {"GET", (*Engine).models},
	"/metrics":                     {"GET", (*Engine).metrics},
	"/pause":                       {"POST", (*Engine).vllmPause},
	"/resume":                      {"POST", (*Engine).vllmResume},
	"/is_paused":                   {"GET", (*Engine).vllmIsPaused},
	"/abort_requests":              {"POST", (*Engine).vllmAbort},
	"/reset_prefix_cache":          {"POST", (*Engine).vllmResetCache},
	"/sleep":                       {"POST", (*Engine).sleep},
	"/wake_up":                     {"POST", (*Engine).wakeUp},
	"/is_sleeping":                 {"GET", (*Engine).isSleeping},
	"/init_weight_transfer_engine": {"POST", (*Engine).vllmOK},
	"/start_weight_update":         {"POST", (*Engine).vllmStartUpdate},
	"/update_weights":              {"POST", (*Engine).vllmUpdate},
	"/finish_weight_update":        {"POST", (*Engine).vllmFinishUpdate},
	"/get_world_size":              {"GET", (*Engine).worldSize},
	"/get_weight_version":          {"GET", (*Engine).getWeightVersion},
}

// ServeHTTP implements http.Handler.
func (e *Engine) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	routes := sglangRoutes
	if e.cfg.Kind == VLLM {
		routes = vllmRoutes
	}
	path := r.URL.Path
	if e.cfg.APIKey != "" && e.needsKey(path) {
		got := r.Header.Get("Authorization")
		want := "Bearer " + e.cfg.APIKey
		if subtle.ConstantTimeCompare([]byte(got), []byte(want)) != 1 {
			writeError(w, http.StatusUnauthorized, "Unauthorized")
			return
		}
	}
	rt, ok := routes[path]
	if !ok {
		writeError(w, http.StatusNotFound, "Not Found: "+path)
		return
	}
	if !strings.Contains(rt.methods, r.Method) || r.Method == "" {
		w.Header().Set("Allow", strings.ReplaceAll(rt.methods, ",", ", "))
		writeError(w, http.StatusMethodNotAllowed, "Method Not Allowed")
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
	if err != nil {
		var mb *http.MaxBytesError
		if errors.As(err, &mb) {
			writeError(w, http.StatusRequestEntityTooLarge, "body too large")
			return
		}
		writeError(w, http.StatusBadRequest, "reading the body: "+err.Error())
		return
	}
	e.mu.Lock()
	e.lastBody[path] = body
	e.mu.Unlock()
	rt.h(e, w, r, body)
}

// needsKey says which paths an API key guards: vLLM guards /v1/* only;
// SGLang everything but /health and /metrics.
func (e *Engine) needsKey(path string) bool {
	if e.cfg.Kind == VLLM {
		return strings.HasPrefix(path, "/v1/")
	}
	return path != "/health" && path != "/metrics"
}

// --- small writers ---

func writeJSON(w http.ResponseWriter, code int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		code, b = http.StatusInternalServerError, []byte(`{"error":{"message":"marshal"}}`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)+1))
	w.WriteHeader(code)
	w.Write(append(b, '\n'))
}

// writeError answers an OpenAI-shaped JSON error.
func writeError(w http.ResponseWriter, code int, msg string) {
	typ := "BadRequestError"
	switch code {
	case http.StatusNotFound:
		typ = "NotFoundError"
	case http.StatusMethodNotAllowed:
		typ = "MethodNotAllowed"
	case http.StatusUnauthorized:
		typ = "AuthenticationError"
	case http.StatusServiceUnavailable:
		typ = "ServiceUnavailableError"
	case http.StatusInternalServerError:
		typ = "InternalServerError"
	}
	writeJSON(w, code, map[string]any{"error": map[string]any{"message": msg, "type": typ, "code": code}})
}

// decodeObject decodes an optional JSON object body (empty is {}).
func decodeObject(body []byte, v any) error {
	if len(strings.TrimSpace(string(body))) == 0 {
		return nil
	}
	if err := json.Unmarshal(body, v); err != nil {
		return fmt.Errorf("invalid JSON: %v", err)
	}
	return nil
}

// --- generation ---

func (e *Engine) generate(w http.ResponseWriter, hr *http.Request, body []byte) {
	g, err := parseRequest(e.cfg.Kind, hr.URL.Path, body, hr.Header)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	bt := e.cfg.BlockTokens
	if blocks := (len(g.prompt) + g.maxNew + bt - 1) / bt; blocks > e.cfg.KVBlocks {
		writeError(w, http.StatusBadRequest, fmt.Sprintf(
			"the request needs %d tokens (prompt %d + max new %d), more than the KV cache holds (%d)",
			len(g.prompt)+g.maxNew, len(g.prompt), g.maxNew, e.cfg.KVBlocks*bt))
		return
	}
	ctx := hr.Context()
	r := &request{
		prompt: g.prompt,
		maxNew: g.maxNew,
		seed:   g.seed,
		phash:  hashTokens(14695981039346656037, g.prompt),
		done:   make(chan struct{}),
		notify: make(chan struct{}, 1),
	}
	start := time.Now()

	e.mu.Lock()
	if e.closing {
		e.mu.Unlock()
		writeError(w, http.StatusServiceUnavailable, "the engine is shutting down")
		return
	}
	e.ridN++
	if g.rank >= 0 {
		e.st.RoutedRanks[g.rank]++
	}
	r.rid = g.rid
	if r.rid == "" {
		r.rid = fmt.Sprintf("%s-%d", e.cfg.Name, e.ridN)
	}
	if _, dup := e.byID[r.rid]; dup {
		e.mu.Unlock()
		writeError(w, http.StatusBadRequest, "duplicate request id "+r.rid)
		return
	}
	// SGLang: the pause gate and an update's writer lock hold new requests
	// before the scheduler (abort_request does not reach them).
	if e.gate != nil {
		e.gated++
		if e.paused {
			e.st.ParkedWhilePaused++
		} else {
			e.st.HeldForUpdate++
		}
		for e.gate != nil && !e.closing {
			gate := e.gate
			e.mu.Unlock()
			select {
			case <-gate:
			case <-ctx.Done():
			case <-e.stopping:
			}
			e.mu.Lock()
			if ctx.Err() != nil || e.closing {
				break
			}
		}
		e.gated--
		if ctx.Err() != nil || e.closing {
			e.mu.Unlock()
			writeError(w, http.StatusServiceUnavailable, "gave up at the pause gate")
			return
		}
		if _, dup := e.byID[r.rid]; dup {
			e.mu.Unlock()
			writeError(w, http.StatusBadRequest, "duplicate request id "+r.rid)
			return
		}
	}
	if e.cfg.Kind == VLLM && e.paused {
		r.parked = true
		e.st.ParkedWhilePaused++
	}
	e.enqueueLocked(r)
	e.mu.Unlock()

	if g.stream {
		e.stream(w, hr, g, r, start)
		return
	}
	select {
	case <-r.done:
	case <-ctx.Done():
		e.mu.Lock()
		e.finishLocked(r, "abort") // the client went away: the engine aborts it
		e.mu.Unlock()
		return
	case <-e.quit:
		e.mu.Lock()
		e.finishLocked(r, "abort")
		e.mu.Unlock()
	}
	e.mu.Lock()
	res := e.resultLocked(r, len(r.out))
	e.mu.Unlock()
	writeJSON(w, http.StatusOK, e.answer(g, r, res, start))
}

// result is a request's output so far.
type result struct {
	out      []int
	vers     []string
	finish   string // "" while running
	cached   int
	prompt   int
	versions []string
}

func (e *Engine) resultLocked(r *request, upto int) result {
	upto = min(upto, len(r.out))
	res := result{
		out:    append([]int{}, r.out[:upto]...),
		vers:   append([]string{}, r.vers[:upto]...),
		cached: r.cached,
		prompt: len(r.prompt),
	}
	if upto == len(r.out) {
		res.finish = r.finish
	}
	res.versions = versionsOf(res.vers)
	return res
}

// version is the weight version of an output: its last token's, else the
// engine's now.
func (e *Engine) versionOf(res result) string {
	if len(res.vers) > 0 {
		return res.vers[len(res.vers)-1]
	}
	return e.WeightVersion()
}

func sglFinish(res result) any {
	switch res.finish {
	case "length":
		return map[string]any{"type": "length", "length": len(res.out)}
	case "abort":
		return map[string]any{"type": "abort", "message": "Abort request"}
	}
	return nil
}

func oaFinish(res result) any {
	if res.finish == "" {
		return nil
	}
	return res.finish
}

// answer builds the whole (non-stream) answer of a request.
func (e *Engine) answer(g *genRequest, r *request, res result, start time.Time) map[string]any {
	ver := e.versionOf(res)
	model := e.cfg.Name
	switch g.api {
	case apiGenerate:
		return map[string]any{
			"text":       detokenize(res.out),
			"output_ids": res.out,
			"meta_info":  e.metaInfo(r, res, ver, start),
		}
	case apiTokens:
		return map[string]any{
			"request_id": r.rid,
			"choices": []any{map[string]any{
				"index": 0, "token_ids": res.out, "finish_reason": oaFinish(res), "logprobs": nil,
			}},
			"weight_version":  ver,
			"weight_versions": res.versions,
		}
	}
	usage := map[string]any{
		"prompt_tokens": res.prompt, "completion_tokens": len(res.out),
		"total_tokens":          res.prompt + len(res.out),
		"prompt_tokens_details": map[string]any{"cached_tokens": res.cached},
	}
	m := map[string]any{
		"id": "cmpl-" + r.rid, "created": start.Unix(), "model": model,
		"usage": usage, "weight_version": ver, "weight_versions": res.versions,
	}
	if g.api == apiChat {
		m["id"] = "chatcmpl-" + r.rid
		m["object"] = "chat.completion"
		m["choices"] = []any{map[string]any{
			"index":         0,
			"message":       map[string]any{"role": "assistant", "content": detokenize(res.out)},
			"finish_reason": oaFinish(res),
		}}
	} else {
		m["object"] = "text_completion"
		m["choices"] = []any{map[string]any{
			"index": 0, "text": detokenize(res.out), "finish_reason": oaFinish(res),
			"token_ids": res.out, "logprobs": nil,
		}}
	}
	if e.cfg.Kind == SGLang {
		m["metadata"] = map[string]any{"weight_version": ver}
	}
	return m
}

func (e *Engine) metaInfo(r *request, res result, ver string, start time.Time) map[string]any {
	return map[string]any{
		"id":                r.rid,
		"finish_reason":     sglFinish(res),
		"prompt_tokens":     res.prompt,
		"completion_tokens": len(res.out),
		"cached_tokens":     res.cached,
		"weight_version":    ver,
		"weight_versions":   res.versions,
		"e2e_latency":       time.Since(start).Seconds(),
	}
}

// stream answers with server-sent events, one per decoded token, flushed
// as the tokens come, then "data: [DONE]".
func (e *Engine) stream(w http.ResponseWriter, hr *http.Request, g *genRequest, r *request, start time.Time) {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	fl, _ := w.(http.Flusher)
	ctx := hr.Context()
	sent := 0
	first := true
	for {
		e.mu.Lock()
		ended := r.ended
		res := e.resultLocked(r, len(r.out))
		e.mu.Unlock()
		var events []any
		for i := sent; i < len(res.out); i++ {
			part := res
			part.out, part.vers, part.finish = res.out[:i+1], res.vers[:i+1], ""
			if i == len(res.out)-1 {
				part.finish = res.finish
			}
			part.versions = versionsOf(part.vers)
			events = append(events, e.chunk(g, r, part, i, first, start))
			first = false
		}
		if ended && len(res.out) == sent { // an end with no new token
			events = append(events, e.chunk(g, r, res, -1, first, start))
		}
		sent = len(res.out)
		for _, ev := range events {
			b, _ := json.Marshal(ev)
			if _, err := fmt.Fprintf(w, "data: %s\n\n", b); err != nil {
				e.mu.Lock()
				e.finishLocked(r, "abort")
				e.mu.Unlock()
				return
			}
		}
		if ended {
			io.WriteString(w, "data: [DONE]\n\n")
			if fl != nil {
				fl.Flush()
			}
			return
		}
		if fl != nil && len(events) > 0 {
			fl.Flush()
		}
		select {
		case <-r.notify:
		case <-r.done:
		case <-ctx.Done():
			e.mu.Lock()
			e.finishLocked(r, "abort")
			e.mu.Unlock()
			return
		case <-e.quit:
			e.mu.Lock()
			e.finishLocked(r, "abort")
			e.mu.Unlock()
		}
	}
}

// chunk is one stream event: the output so far (SGLang native: cumulative
// text and ids) or the token at i (OpenAI: a delta; i < 0 for none).
func (e *Engine) chunk(g *genRequest, r *request, res result, i int, first bool, start time.Time) any {
	ver := e.versionOf(res)
	switch g.api {
	case apiGenerate:
		return map[string]any{
			"text": detokenize(res.out), "output_ids": res.out,
			"meta_info": e.metaInfo(r, res, ver, start),
		}
	case apiTokens:
		ids := []int{}
		if i >= 0 {
			ids = res.out[i : i+1]
		}
		return map[string]any{
			"request_id":     r.rid,
			"choices":        []any{map[string]any{"index": 0, "token_ids": ids, "finish_reason": oaFinish(res)}},
			"weight_version": ver, "weight_versions": res.versions,
		}
	}
	text := ""
	var ids []int
	if i >= 0 {
		text = TokenText(res.out[i])
		ids = res.out[i : i+1]
	}
	m := map[string]any{
		"id": "cmpl-" + r.rid, "created": start.Unix(), "model": e.cfg.Name,
		"weight_version": ver, "weight_versions": res.versions,
	}
	if g.api == apiChat {
		delta := map[string]any{"content": text}
		if first {
			delta["role"] = "assistant"
		}
		m["id"] = "chatcmpl-" + r.rid
		m["object"] = "chat.completion.chunk"
		m["choices"] = []any{map[string]any{"index": 0, "delta": delta, "finish_reason": oaFinish(res)}}
	} else {
		m["object"] = "text_completion"
		m["choices"] = []any{map[string]any{"index": 0, "text": text, "token_ids": ids, "finish_reason": oaFinish(res)}}
	}
	if res.finish != "" {
		m["usage"] = map[string]any{
			"prompt_tokens": res.prompt, "completion_tokens": len(res.out),
			"total_tokens":          res.prompt + len(res.out),
			"prompt_tokens_details": map[string]any{"cached_tokens": res.cached},
		}
	}
	return m
}

// --- probes and info ---

func (e *Engine) health(w http.ResponseWriter, r *http.Request, _ []byte) {
	w.WriteHeader(http.StatusOK)
}

func (e *Engine) models(w http.ResponseWriter, r *http.Request, _ []byte) {
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": []any{map[string]any{
		"id": e.cfg.Name, "object": "model", "owned_by": "tether-fake-engine", "root": e.cfg.Name,
		"max_model_len": e.cfg.KVBlocks * e.cfg.BlockTokens,
	}}})
}

func (e *Engine) getWeightVersion(w http.ResponseWriter, r *http.Request, _ []byte) {
	writeJSON(w, http.StatusOK, map[string]any{"weight_version": e.WeightVersion()})
}

func (e *Engine) modelInfo(w http.ResponseWriter, r *http.Request, _ []byte) {
	writeJSON(w, http.StatusOK, map[string]any{
		"model_path": e.cfg.Name, "tokenizer_path": e.cfg.Name, "is_generation": true,
		"weight_version": e.WeightVersion(), "preferred_sampling_params": nil,
	})
}

func (e *Engine) serverInfo(w http.ResponseWriter, r *http.Request, _ []byte) {
	l := e.loadSnapshot()
	writeJSON(w, http.StatusOK, map[string]any{
		"model_path": e.cfg.Name, "served_model_name": e.cfg.Name,
		"weight_version":       e.WeightVersion(),
		"max_total_num_tokens": e.cfg.KVBlocks * e.cfg.BlockTokens,
		"max_running_requests": e.cfg.MaxRunning, "page_size": e.cfg.BlockTokens,
		"dp_size": 1, "tp_size": 1, "version": "fake",
		"internal_states": []any{map[string]any{
			"num_running_reqs": l.running, "num_waiting_reqs": l.waiting, "token_usage": l.usage,
		}},
	})
}

func (e *Engine) worldSize(w http.ResponseWriter, r *http.Request, _ []byte) {
	writeJSON(w, http.StatusOK, map[string]any{"world_size": 1})
}

// --- load endpoints ---

type loadSnap struct {
	running, waiting, usedTokens, cachedTokens int
	usage, hitRate, utilization                float64
	queries, hits                              int64
}

func (e *Engine) loadSnapshot() loadSnap {
	e.mu.Lock()
	defer e.mu.Unlock()
	l := loadSnap{
		running: len(e.running), waiting: len(e.waiting),
		usedTokens:   e.inUse * e.cfg.BlockTokens,
		cachedTokens: (e.inUse + e.evictable) * e.cfg.BlockTokens,
		usage:        e.usageLocked(),
		queries:      e.pqueries, hits: e.phits,
		utilization: float64(len(e.running)) / float64(e.cfg.MaxRunning),
	}
	if e.st.PromptTokens > 0 {
		l.hitRate = float64(e.st.CachedTokens) / float64(e.st.PromptTokens)
	}
	return l
}

// loadGate applies the load mode; false when it answered (or hung).
func (e *Engine) loadGate(w http.ResponseWriter, r *http.Request) (loadSnap, bool) {
	switch LoadMode(e.loadMode.Load()) {
	case LoadNone:
		writeError(w, http.StatusNotFound, "Not Found: "+r.URL.Path)
		return loadSnap{}, false
	case LoadTimeout:
		select {
		case <-r.Context().Done():
		case <-e.stopping:
		}
		return loadSnap{}, false
	case LoadLie:
		l := e.loadSnapshot()
		return loadSnap{queries: l.queries, hits: l.hits}, true
	}
	return e.loadSnapshot(), true
}

func (e *Engine) v1Loads(w http.ResponseWriter, r *http.Request, _ []byte) {
	l, ok := e.loadGate(w, r)
	if !ok {
		return
	}
	total := e.cfg.KVBlocks * e.cfg.BlockTokens
	writeJSON(w, http.StatusOK, map[string]any{
		"timestamp": time.Now().UTC().Format(time.RFC3339Nano),
		"version":   "fake",
		"loads": []any{map[string]any{
			"dp_rank":              0,
			"num_running_reqs":     l.running,
			"num_waiting_reqs":     l.waiting,
			"num_used_tokens":      l.usedTokens,
			"num_total_tokens":     l.cachedTokens,
			"max_total_num_tokens": total,
			"token_usage":          l.usage,
			"cache_hit_rate":       l.hitRate,
			"utilization":          l.utilization,
			"max_running_requests": e.cfg.MaxRunning,
			"queues":               map[string]any{"waiting": l.waiting},
		}},
	})
}

func (e *Engine) getLoad(w http.ResponseWriter, r *http.Request, _ []byte) {
	l, ok := e.loadGate(w, r)
	if !ok {
		return
	}
	writeJSON(w, http.StatusOK, []any{map[string]any{
		"dp_rank": 0, "num_reqs": l.running + l.waiting, "num_waiting_reqs": l.waiting,
		"num_tokens": l.usedTokens,
	}})
}

func (e *Engine) metrics(w http.ResponseWriter, r *http.Request, _ []byte) {
	l, ok := e.loadGate(w, r)
	if !ok {
		return
	}
	var b strings.Builder
	lbl := `{model_name="` + strings.ReplaceAll(e.cfg.Name, `"`, `\"`) + `"}`
	gauge := func(name, help string, v float64) {
		fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s gauge\n%s%s %s\n", name, help, name, name, lbl,
			strconv.FormatFloat(v, 'g', -1, 64))
	}
	counter := func(name, help string, v int64) {
		fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s counter\n%s%s %d\n", name, help, name, name, lbl, v)
	}
	st := e.Stats()
	if e.cfg.Kind == VLLM {
		gauge("vllm:num_requests_running", "Number of requests in model execution batches.", float64(l.running))
		gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", float64(l.waiting))
		gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", l.usage)
		counter("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.", l.queries)
		counter("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.", l.hits)
		counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.", st.Preemptions)
		counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.", st.PromptTokens)
		counter("vllm:generation_tokens_total", "Number of generation tokens processed.", st.GeneratedTokens)
	} else {
		gauge("sglang:num_running_reqs", "The number of running requests.", float64(l.running))
		gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", float64(l.waiting))
		gauge("sglang:num_used_tokens", "The number of used tokens.", float64(l.usedTokens))
		gauge("sglang:token_usage", "The token usage.", l.usage)
		gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", l.hitRate)
		gauge("sglang:max_total_num_tokens", "Maximum total number of tokens.", float64(e.cfg.KVBlocks*e.cfg.BlockTokens))
		gauge("sglang:max_running_requests", "Maximum running requests.", float64(e.cfg.MaxRunning))
		counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.", st.PromptTokens)
		counter("sglang:generation_tokens_total", "Number of generation tokens processed.", st.GeneratedTokens)
		counter("sglang:num_retracted_reqs_total", "Number of retracted requests.", st.Preemptions)
	}
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	io.WriteString(w, b.String())
}

// --- SGLang control ---

func (e *Engine) sglPause(w http.ResponseWriter, r *http.Request, body []byte) {
	var req struct {
		Mode string `json:"mode"`
	}
	if err := decodeObject(body, &req); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	if req.Mode == "" {
		req.Mode = "abort"
	}
	if req.Mode != "abort" && req.Mode != "in_place" && req.Mode != "retract" {
		writeError(w, http.StatusBadRequest, "mode must be abort, in_place or retract")
		return
	}
	e.mu.Lock()
	e.pauseLocked(req.Mode)
	switch req.Mode {
	case "abort":
		e.abortLocked(nil, true)
	case "retract":
		for len(e.running) > 0 {
			r := e.running[len(e.running)-1]
			e.removeRunningLocked(r)
			e.releaseLocked(r)
			r.running = false
			e.waiting = append([]*request{r}, e.waiting...)
		}
	}
	e.broadcastLocked()
	e.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]any{"message": "Generation paused successfully.", "status": "ok"})
}

func (e *Engine) pauseLocked(mode string) {
	if !e.paused {
		e.st.Pauses++
	}
	e.paused = true
	e.pauseMode = mode
	e.gateLocked()
	e.log.Info("paused", "mode", mode)
}

func (e *Engine) resumeLocked() {
	if e.paused {
		e.st.Resumes++
	}
	e.paused = false
	e.pauseMode = ""
	for _, r := range e.waiting {
		r.parked = false
	}
	e.gateLocked()
	e.broadcastLocked()
	e.kick()
	e.log.Info("resumed")
}

func (e *Engine) sglContinue(w http.ResponseWriter, r *http.Request, _ []byte) {
	e.mu.Lock()
	e.resumeLocked()
	e.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]any{"message": "Generation continued successfully.", "status": "ok"})
}

func (e *Engine) sglAbort(w http.ResponseWriter, r *http.Request, body []byte) {
	var req struct {
		Rid      string `json:"rid"`
		AbortAll bool   `json:"abort_all"`
	}
	if err := decodeObject(body, &req); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	e.mu.Lock()
	if req.AbortAll || req.Rid != "" {
		e.abortLocked([]string{req.Rid}, req.AbortAll)
	}
	e.mu.Unlock()
	w.WriteHeader(http.StatusOK)
}

func (e *Engine) sglFlush(w http.ResponseWriter, r *http.Request, _ []byte) {
	e.mu.Lock()
	busy := len(e.running) > 0 || len(e.waiting) > 0
	if busy {
		e.st.FlushRefused++
	} else {
		e.dropCacheLocked()
		e.st.Flushes++
	}
	e.mu.Unlock()
	if busy {
		w.WriteHeader(http.StatusBadRequest)
		io.WriteString(w, "Cache not flushed. Please check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n")
		return
	}
	io.WriteString(w, "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n")
}

// bodyVersion reads an optional JSON object body and the weight version it
// names ("weight_version", at the top or in "update_info"; "" if none).
// Any other field is accepted and ignored.
func bodyVersion(body []byte) (string, error) {
	var obj map[string]json.RawMessage
	if err := decodeObject(body, &obj); err != nil {
		return "", errors.New("the body must be a JSON object")
	}
	str := func(m json.RawMessage) string {
		var s string
		if json.Unmarshal(m, &s) != nil {
			return ""
		}
		return s
	}
	if v := str(obj["weight_version"]); v != "" {
		return v, nil
	}
	var info map[string]json.RawMessage
	if json.Unmarshal(obj["update_info"], &info) == nil {
		return str(info["weight_version"]), nil
	}
	return "", nil
}

func (e *Engine) sglUpdate(w http.ResponseWriter, r *http.Request, body []byte) {
	ver, err := bodyVersion(body)
	if err != nil {
		writeJSON(w, http.StatusBadRequest, map[string]any{"success": false, "message": err.Error()})
		return
	}
	v, err := e.update(r.Context(), ver, true)
	if err != nil {
		writeJSON(w, http.StatusInternalServerError, map[string]any{"success": false, "message": "Failed to update weights: " + err.Error()})
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{
		"success": true, "message": "Succeeded to update model weights.", "num_paused_requests": 0,
		"weight_version": v,
	})
}

func (e *Engine) sglOK(w http.ResponseWriter, r *http.Request, body []byte) {
	var obj map[string]json.RawMessage
	if err := decodeObject(body, &obj); err != nil {
		writeJSON(w, http.StatusBadRequest, map[string]any{"success": false, "message": err.Error()})
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"success": true, "message": "ok"})
}

func (e *Engine) sglSetVersion(w http.ResponseWriter, r *http.Request, body []byte) {
	var req struct {
		NewVersion       string `json:"new_version"`
		AbortAllRequests bool   `json:"abort_all_requests"`
	}
	if err := decodeObject(body, &req); err != nil || req.NewVersion == "" {
		writeError(w, http.StatusBadRequest, "new_version is required")
		return
	}
	e.mu.Lock()
	if req.AbortAllRequests {
		e.abortLocked(nil, true)
	}
	e.version = req.NewVersion
	e.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]any{"success": true, "message": "Weight version updated to " + req.NewVersion, "new_version": req.NewVersion})
}

// sleep: SGLang release_memory_occupation, vLLM /sleep. Nothing is
// scheduled while asleep; the prefix cache is dropped.
func (e *Engine) sleep(w http.ResponseWriter, r *http.Request, _ []byte) {
	e.mu.Lock()
	e.sleeping = true
	e.dropCacheLocked()
	e.mu.Unlock()
	e.okAnswer(w)
}

func (e *Engine) wakeUp(w http.ResponseWriter, r *http.Request, _ []byte) {
	e.mu.Lock()
	e.sleeping = false
	e.broadcastLocked()
	e.kick()
	e.mu.Unlock()
	e.okAnswer(w)
}

func (e *Engine) okAnswer(w http.ResponseWriter) {
	if e.cfg.Kind == SGLang {
		writeJSON(w, http.StatusOK, map[string]any{"success": true, "message": "ok"})
		return
	}
	w.WriteHeader(http.StatusOK)
}

func (e *Engine) isSleeping(w http.ResponseWriter, r *http.Request, _ []byte) {
	e.mu.Lock()
	s := e.sleeping
	e.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]any{"is_sleeping": s})
}

// --- vLLM control ---

func (e *Engine) vllmPause(w http.ResponseWriter, r *http.Request, _ []byte) {
	q := r.URL.Query()
	mode := q.Get("mode")
	if mode == "" {
		mode = "abort"
		if b, _ := strconv.ParseBool(q.Get("wait_for_inflight_requests")); b {
			mode = "wait"
		}
	}
	if mode != "abort" && mode != "wait" && mode != "keep" {
		writeJSON(w, http.StatusBadRequest, map[string]any{"error": "mode must be abort, wait or keep"})
		return
	}
	clear := true
	if s := q.Get("clear_cache"); s != "" {
		b, err := strconv.ParseBool(s)
		if err != nil {
			writeJSON(w, http.StatusBadRequest, map[string]any{"error": "clear_cache must be a boolean"})
			return
		}
		clear = b
	}
	e.mu.Lock()
	if e.paused {
		e.mu.Unlock()
		writeJSON(w, http.StatusOK, map[string]any{"status": "paused"})
		return
	}
	e.pauseLocked(mode)
	switch mode {
	case "abort":
		e.abortLocked(nil, true)
	case "wait":
		e.kick()
		ok := e.waitLocked(r.Context(), func() bool {
			for _, x := range append(append([]*request(nil), e.running...), e.waiting...) {
				if !x.parked {
					return false
				}
			}
			return true
		})
		if !ok {
			e.mu.Unlock()
			return // the client gave up; the engine stays paused
		}
	}
	if mode != "keep" && clear {
		e.dropCacheLocked()
		e.st.Flushes++
	}
	e.broadcastLocked()
	e.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]any{"status": "paused"})
}

func (e *Engine) vllmResume(w http.ResponseWriter, r *http.Request, _ []byte) {
	e.mu.Lock()
	e.resumeLocked()
	e.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]any{"status": "resumed"})
}

func (e *Engine) vllmIsPaused(w http.ResponseWriter, r *http.Request, _ []byte) {
	writeJSON(w, http.StatusOK, map[string]any{"is_paused": e.Paused()})
}

func (e *Engine) vllmAbort(w http.ResponseWriter, r *http.Request, body []byte) {
	var req struct {
		RequestIDs []string `json:"request_ids"`
	}
	if err := decodeObject(body, &req); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	e.mu.Lock()
	ids := e.abortLocked(req.RequestIDs, req.RequestIDs == nil)
	e.mu.Unlock()
	sort.Strings(ids)
	writeJSON(w, http.StatusOK, map[string]any{"aborted": ids})
}

func (e *Engine) vllmResetCache(w http.ResponseWriter, r *http.Request, _ []byte) {
	e.mu.Lock()
	e.dropCacheLocked()
	e.st.Flushes++
	e.mu.Unlock()
	w.WriteHeader(http.StatusOK)
}

func (e *Engine) vllmOK(w http.ResponseWriter, r *http.Request, body []byte) {
	var obj map[string]json.RawMessage
	if err := decodeObject(body, &obj); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"message": "Weight transfer initialized"})
}

func (e *Engine) vllmStartUpdate(w http.ResponseWriter, r *http.Request, body []byte) {
	ver, err := bodyVersion(body)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	e.mu.Lock()
	e.staging = true
	e.staged = ver
	e.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]any{"message": "Weight update started"})
}

func (e *Engine) vllmUpdate(w http.ResponseWriter, r *http.Request, body []byte) {
	ver, err := bodyVersion(body)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	e.mu.Lock()
	staging := e.staging
	if staging && ver != "" {
		e.staged = ver
	}
	e.mu.Unlock()
	if _, err := e.update(r.Context(), ver, !staging); err != nil {
		writeError(w, http.StatusInternalServerError, err.Error())
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"message": "Weights updated"})
}

func (e *Engine) vllmFinishUpdate(w http.ResponseWriter, r *http.Request, body []byte) {
	ver, err := bodyVersion(body)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	e.mu.Lock()
	if e.failUpdates.Load() {
		e.st.FailedUpdates++
		e.mu.Unlock()
		writeError(w, http.StatusInternalServerError, errUpdateFailed.Error())
		return
	}
	v := ver
	if v == "" {
		v = e.staged
	}
	e.staging, e.staged = false, ""
	e.applyVersionLocked(v)
	v = e.version
	e.broadcastLocked()
	e.kick()
	e.mu.Unlock()
	writeJSON(w, http.StatusOK, map[string]any{"message": "Weight update finished", "weight_version": v})
}
