package dialect

import (
	"encoding/json"
	"net/url"
	"strconv"
)

// vLLM's wire (its api_server and RLHF routes, and vime's delete-type
// abort):
//
//	POST /pause?mode=abort|wait|keep  new requests park in the scheduler
//	POST /resume
//	GET  /is_paused
//	POST /abort_requests {"request_ids":[...]} | {} (everything, parked too)
//	POST /reset_prefix_cache
//	POST /init_weight_transfer_engine, /start_weight_update,
//	     /update_weights, /finish_weight_update, /sleep, /wake_up
//	GET  /metrics                     vllm:* names
//
// A request names its id in "request_id" or X-Request-ID; its prompt in
// "prompt" or "messages" (OpenAI).

// VLLM is the kind of a vLLM engine.
const VLLM Kind = 2

func init() { register(vllm) }

var vllm = &Dialect{
	Kind:       VLLM,
	Name:       "vllm",
	RankHeader: "X-data-parallel-rank",

	Generation: []string{"/v1/completions", "/v1/chat/completions"},
	PDProtocol: "vllm",
	PD:         vllmPD,
	Serves: map[string]Endpoint{
		"/abort_requests": {Op: OpAbort},
		"/pause":          {Op: OpPause},
		"/resume":         {Op: OpResume},
		"/is_paused":      {Op: OpIsPaused},

		"/init_weight_transfer_engine": {Op: OpUpdate, Update: Plain},
		"/start_weight_update":         {Op: OpUpdate, Update: OpenUpdate},
		"/update_weights":              {Op: OpUpdate, Update: Weights},
		"/finish_weight_update":        {Op: OpUpdate, Update: CloseUpdate},
		"/sleep":                       {Op: OpUpdate, Update: Plain},
		"/wake_up":                     {Op: OpUpdate, Update: Plain},
		"/reset_prefix_cache":          {Op: OpUpdate, Update: Plain},
	},
	NeverHeld: []string{
		"/collective_rpc", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
		"/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize",
	},

	PauseModes: "abort, wait or keep",
	ClientPause: func(_ []byte, query url.Values) (string, []byte, string) {
		return query.Get("mode"), nil, ""
	},
	PauseMode: func(mode string) (Mode, bool) {
		switch mode {
		case "", "abort":
			return PauseAbort, true
		case "wait", "keep":
			return Mode(mode), true
		}
		return "", false
	},
	Pause: func(m Mode, quiet bool) Call {
		return Call{Method: "POST", Path: "/pause?mode=" + vllmMode(m, quiet)}
	},
	PauseAsClient: func(c Call, m Mode, quiet bool, _ []byte, query url.Values) Call {
		if query != nil {
			// The client's query, with the engine's mode.
			q := url.Values{}
			for k, v := range query {
				q[k] = v
			}
			q.Set("mode", vllmMode(m, quiet))
			c.Path = "/pause?" + q.Encode()
		}
		return c
	},
	Resume: func() Call { return Call{Method: "POST", Path: "/resume"} },

	AbortForm: IDList,
	ParseAbort: func(m map[string]json.RawMessage) (Abort, string) {
		raw, ok := m["request_ids"]
		if !ok && len(m) == 0 {
			return Abort{All: true}, ""
		}
		if !ok {
			// An SGLang {"rid":..} sent here must not abort everything.
			return Abort{}, `missing "request_ids" (a list of strings; {} aborts everything)`
		}
		if k := jsonKind(raw); k != "a list" {
			return Abort{}, `"request_ids" must be a list of strings, not ` + k
		}
		var items []json.RawMessage
		if err := json.Unmarshal(raw, &items); err != nil {
			return Abort{}, `"request_ids" must be a list of strings`
		}
		if len(items) == 0 {
			return Abort{}, `"request_ids" is empty`
		}
		ids := make([]string, 0, len(items))
		for i, it := range items {
			var s string
			if jsonKind(it) != "a string" || json.Unmarshal(it, &s) != nil || s == "" {
				return Abort{}, `"request_ids"[` + strconv.Itoa(i) + `] must be a non-empty string, not ` + jsonKind(it)
			}
			ids = append(ids, s)
		}
		return Abort{IDs: ids}, ""
	},
	AbortAsClient: func(body []byte) Call { return Call{Method: "POST", Path: "/abort_requests", Body: body} },
	AbortAll:      func() Call { return Call{Method: "POST", Path: "/abort_requests", Body: []byte(`{}`)} },
	AbortIDs: func(ids []string, fields map[string]json.RawMessage) []Call {
		mm := make(map[string]json.RawMessage, len(fields)+1)
		for k, v := range fields {
			mm[k] = v
		}
		mm["request_ids"], _ = json.Marshal(ids)
		body, _ := json.Marshal(mm)
		return []Call{{Method: "POST", Path: "/abort_requests", Body: body, IDs: ids}}
	},
	FlushCache: func() Call { return Call{Method: "POST", Path: "/reset_prefix_cache"} },

	Metrics: map[string]Metric{
		"vllm:num_requests_running":           {Field: Running, Detect: true},
		"vllm:num_requests_waiting":           {Field: Waiting, Detect: true},
		"vllm:kv_cache_usage_perc":            {Field: KVUsage, Detect: true},
		"vllm:gpu_cache_usage_perc":           {Field: KVUsage, Detect: true},
		"vllm:prefix_cache_queries_total":     {Field: Queries, Detect: true},
		"vllm:gpu_prefix_cache_queries_total": {Field: Queries, Detect: true},
		"vllm:prefix_cache_hits_total":        {Field: Hits, Detect: true},
		"vllm:gpu_prefix_cache_hits_total":    {Field: Hits, Detect: true},
	},
	HitRateFromCounters: true,

	RequestIDFields: []string{"request_id"},
	RequestIDHeader: "X-Request-ID",
	PromptFields:    []string{"prompt", "messages"},
	TokenIDFields:   []string{"prompt"},
}

// vllmMode is mode m in vLLM's words; quiet: nothing is in flight (a wait
// not drained would block on what did not finish, so it goes as keep).
func vllmMode(m Mode, quiet bool) string {
	switch {
	case m == PauseRetract:
		return string(PauseKeep)
	case m == PauseWait && !quiet:
		return string(PauseKeep)
	}
	return string(m)
}

// vllmPD is vLLM's NIXL P/D protocol (NixlConnector; its
// disagg_proxy_server example and the llm-d sidecar): one X-Request-Id on
// both legs; the prefill gets the client's body with kv_transfer_params
// asking for a remote decode, not streamed, for one token (max_tokens, and
// max_completion_tokens where given), one sample, no minimum; it answers
// with the kv_transfer_params the decode is then sent in the client's
// body. Closing a leg's connection aborts it. n asks for several samples
// (one handoff has one consumer).
var vllmPD = &PDWire{
	Samples:         []FieldPath{{Field: "n"}},
	RequestIDHeader: "X-Request-ID", // as a request names its id
	KVParams:        "kv_transfer_params",
	PrefillEdits: []FieldEdit{
		{Name: "kv_transfer_params", Value: []byte(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,` +
			`"remote_block_ids":null,"remote_host":null,"remote_port":null}`)},
		{Name: "stream", Value: []byte("false")},
		{Name: "stream_options"},
		{Name: "max_tokens", Value: []byte("1")},
		{Name: "min_tokens"},
		{Name: "min_completion_tokens"},
		{Name: "max_completion_tokens", Value: []byte("1"), IfPresent: true},
		{Name: "n", Value: []byte("1"), IfPresent: true},
	},
	FinishReason:  "finish_reason",
	AbortedFinish: "abort",

	Stream:           "stream",
	Seeds:            []FieldPath{{Field: "seed"}},
	Choices:          "choices",
	ChoiceIndex:      "index",
	Usage:            "usage",
	PromptTokens:     "prompt_tokens",
	CompletionTokens: "completion_tokens",
	TotalTokens:      "total_tokens",
}
