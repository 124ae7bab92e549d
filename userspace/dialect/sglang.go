package dialect

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
)

// SGLang's wire (python/sglang/srt/entrypoints/http_server.py, v1_loads.py):
//
//	POST /pause_generation {"mode":"abort"|"in_place"|"retract"}
//	POST /continue_generation
//	POST /abort_request {"rid":ID} | {"abort_all":true}
//	POST /flush_cache                 400 while requests run or wait
//	GET  /get_weight_version          {"weight_version":V}
//	POST /update_weights_from_disk {"model_path", "weight_version"?}, ...
//	GET  /v1/loads                    {"loads":[{per DP rank}]}
//	GET  /get_load                    legacy
//	GET  /metrics                     sglang:* names
//
// A request names its id in "rid"; its prompt in "input_ids" or "text".

// SGLang is the kind of an SGLang engine.
const SGLang Kind = 1

func init() { register(sglang) }

var sglang = &Dialect{
	Kind:      SGLang,
	Name:      "sglang",
	RankField: "routed_dp_rank",
	Serves: map[string]Endpoint{
		"/abort_request":       {Op: OpAbort},
		"/flush_cache":         {Op: OpFlush},
		"/v1/loads":            {Op: OpLoads},
		"/get_loads":           {Op: OpLoads}, // sgl-model-gateway's
		"/pause_generation":    {Op: OpPause},
		"/continue_generation": {Op: OpResume},
		"/get_weight_version":  {Op: OpVersion},

		"/update_weights_from_disk":        {Op: OpUpdate, Update: Weights},
		"/update_weights_from_distributed": {Op: OpUpdate, Update: Weights},
		"/update_weights_from_tensor":      {Op: OpUpdate, Update: Weights},
		"/update_weights_from_ipc":         {Op: OpUpdate, Update: Weights},
		"/init_weights_update_group":       {Op: OpUpdate, Update: Plain},
		"/destroy_weights_update_group":    {Op: OpUpdate, Update: Plain},
		"/update_weight_version":           {Op: OpUpdate, Update: SetVersion},
		"/post_process_weights":            {Op: OpUpdate, Update: Plain},
		"/release_memory_occupation":       {Op: OpUpdate, Update: Plain},
		"/resume_memory_occupation":        {Op: OpUpdate, Update: Plain},
	},
	NeverHeld: []string{
		"/weight_checker", "/start_draft_weight_update", "/get_weights_by_name",
		"/load_lora_adapter", "/unload_lora_adapter", "/tokenize", "/detokenize",
		"/get_world_size", "/fetch_weights",
		"/init_weights_send_group_for_remote_instance", "/send_weights_to_remote_instance",
	},

	Generation: []string{"/generate", "/v1/completions", "/v1/chat/completions"},
	PDProtocol: "sglang",
	PD:         sglangPD,
	ServerInfo: &Call{Method: "GET", Path: "/server_info"},

	PauseInBody: true,
	PauseModes:  "abort, in_place or retract",
	ClientPause: func(body []byte, _ url.Values) (string, []byte, string) {
		b := bytes.TrimSpace(body)
		if len(b) == 0 {
			return "", nil, ""
		}
		var v struct {
			Mode *string `json:"mode"`
		}
		if b[0] != '{' || json.Unmarshal(b, &v) != nil {
			return "", nil, `body must be a JSON object such as {"mode":"abort"}`
		}
		mode := ""
		if v.Mode != nil {
			mode = *v.Mode
		}
		return mode, body, ""
	},
	PauseMode: func(mode string) (Mode, bool) {
		switch mode {
		case "", "abort":
			return PauseAbort, true
		case "in_place":
			return PauseKeep, true
		case "retract":
			return PauseRetract, true
		}
		return "", false
	},
	Pause: func(m Mode, _ bool) Call {
		return Call{Method: "POST", Path: "/pause_generation", Body: []byte(`{"mode":"` + sglangMode[m] + `"}`)}
	},
	PauseAsClient: func(c Call, _ Mode, _ bool, pass []byte, _ url.Values) Call {
		if pass != nil {
			c.Body = pass // the client's body byte for byte
		}
		return c
	},
	Resume: func() Call { return Call{Method: "POST", Path: "/continue_generation", Body: []byte(`{}`)} },

	AbortForm: OneID,
	ParseAbort: func(m map[string]json.RawMessage) (Abort, string) {
		var rid string
		var all bool
		if raw, ok := m["rid"]; ok {
			if err := json.Unmarshal(raw, &rid); err != nil || jsonKind(raw) != "a string" {
				return Abort{}, `"rid" must be a string, not ` + jsonKind(raw)
			}
		}
		if raw, ok := m["abort_all"]; ok {
			if err := json.Unmarshal(raw, &all); err != nil || jsonKind(raw) != "a boolean" {
				return Abort{}, `"abort_all" must be a boolean, not ` + jsonKind(raw)
			}
		}
		if rid == "" && !all {
			return Abort{}, `give "rid" (a non-empty string) or "abort_all": true`
		}
		a := Abort{All: all}
		if rid != "" {
			a.IDs = []string{rid}
		}
		return a, ""
	},
	AbortAsClient: func(body []byte) Call { return Call{Method: "POST", Path: "/abort_request", Body: body} },
	AbortAll:      func() Call { return Call{Method: "POST", Path: "/abort_request", Body: []byte(`{"abort_all":true}`)} },
	AbortIDs: func(ids []string, _ map[string]json.RawMessage) []Call {
		out := make([]Call, 0, len(ids))
		for _, id := range ids {
			body, _ := json.Marshal(map[string]any{"rid": id})
			out = append(out, Call{Method: "POST", Path: "/abort_request", Body: body, IDs: []string{id}})
		}
		return out
	},
	FlushCache: func() Call { return Call{Method: "POST", Path: "/flush_cache"} },

	Version:       &Call{Method: "GET", Path: "/get_weight_version"},
	VersionFields: []string{"weight_version", "new_version"},
	LegacyLoad:    &Call{Method: "GET", Path: "/get_load"},
	Loads:         &Call{Method: "GET", Path: "/v1/loads"},
	ParseLoads:    parseSGLangLoads,
	Metrics: map[string]Metric{
		"sglang:num_running_reqs":     {Field: Running, Detect: true},
		"sglang:num_queue_reqs":       {Field: Waiting, Detect: true},
		"sglang:token_usage":          {Field: KVUsage, Detect: true},
		"sglang:cache_hit_rate":       {Field: HitRate, Detect: true},
		"sglang:max_running_requests": {Field: MaxRunning},
	},

	RequestIDFields: []string{"rid"},
	PromptFields:    []string{"input_ids", "text"},
	TokenIDFields:   []string{"input_ids"},
}

// sglangMode is each normalized mode in SGLang's words.
var sglangMode = map[Mode]string{PauseAbort: "abort", PauseWait: "in_place", PauseKeep: "in_place", PauseRetract: "retract"}

// parseSGLangLoads reads /v1/loads: the sum over DP ranks of running and
// waiting, the token usage of all ranks together, the mean hit rate.
func parseSGLangLoads(body []byte) (Load, error) {
	var v struct {
		Loads []struct {
			Running    *float64 `json:"num_running_reqs"`
			Waiting    *float64 `json:"num_waiting_reqs"`
			Used       *float64 `json:"num_used_tokens"`
			MaxTotal   *float64 `json:"max_total_num_tokens"`
			Usage      *float64 `json:"token_usage"`
			HitRate    *float64 `json:"cache_hit_rate"`
			MaxRunning *float64 `json:"max_running_requests"`
		} `json:"loads"`
	}
	if err := json.Unmarshal(body, &v); err != nil {
		return Load{}, fmt.Errorf("GET /v1/loads: %w", err)
	}
	if len(v.Loads) == 0 {
		return Load{}, errors.New("GET /v1/loads: no loads")
	}
	s := Load{KVUsage: -1, HitRate: -1, Source: "v1/loads"}
	var used, total, usage, hit float64
	nUsage, nHit := 0, 0
	for _, l := range v.Loads {
		s.Running += count(l.Running)
		s.Waiting += count(l.Waiting)
		s.MaxRunning += count(l.MaxRunning)
		if l.Used != nil && l.MaxTotal != nil && *l.MaxTotal > 0 {
			used += *l.Used
			total += *l.MaxTotal
		}
		if u, ok := ratio(l.Usage); ok {
			usage += u
			nUsage++
		}
		if h, ok := ratio(l.HitRate); ok {
			hit += h
			nHit++
		}
	}
	switch {
	case nUsage > 0:
		s.KVUsage = usage / float64(nUsage)
	case total > 0:
		s.KVUsage = clamp01(used / total)
	}
	if nHit > 0 {
		s.HitRate = hit / float64(nHit)
	}
	return s, nil
}

// sglangPD is SGLang's P/D protocol (disaggregation/prefill.py,
// decode.py; sgl-model-gateway's pd_router): the same body to the prefill
// and the decode, with bootstrap_host, bootstrap_port and bootstrap_room
// at its top level (lists, one per item, for a batch of text, input_ids
// or prompt); both legs carry one rid, and either is aborted by it
// (/abort_request). With return_logprob the prefill's
// meta_info.input_token_logprobs go in front of the decode's. n, on the
// OpenAI paths, and sampling_params.n (an object, or a list for a batch)
// ask for several samples; the native answer to n is a list of n answers,
// the OpenAI paths' one object with n choices.
var sglangPD = &PDWire{
	Samples: []FieldPath{{Field: "n"}, {Field: "sampling_params", Inner: "n"}},
	Batch: []BatchField{
		{Name: "text"},                      // a list of prompts
		{Name: "input_ids", FirstItem: "["}, // a list of lists of ids
		{Name: "prompt", FirstItem: `"[`},   // a list of strings or of id lists
	},
	BootstrapHost:  "bootstrap_host",
	BootstrapPort:  "bootstrap_port",
	BootstrapRoom:  "bootstrap_room",
	RequestIDField: "rid",
	AbortsByID:     true,
	LogprobFlag:    "return_logprob",
	InputLogprobs:  FieldPath{Field: "meta_info", Inner: "input_token_logprobs"},
	ItemIndex:      "index",

	Stream:           "stream",
	Seeds:            []FieldPath{{Field: "seed"}, {Field: "sampling_params", Inner: "sampling_seed"}},
	Choices:          "choices",
	ChoiceIndex:      "index",
	Usage:            "usage",
	PromptTokens:     "prompt_tokens",
	CompletionTokens: "completion_tokens",
	TotalTokens:      "total_tokens",
	ListOfAnswers:    true,
}

// SGLang's P/D disaggregation: GET /server_info names the engine's mode
// ("prefill", "decode", or "null" for a regular engine) and a prefill's
// bootstrap port.

// HealthGenerate is the path that checks an engine by a one-token
// generation (a P/D fleet answers it over one pair).
const HealthGenerate = "/health_generate"

// ParseDisaggregation reads /server_info's disaggregation_mode ("prefill",
// "decode"; "" for none or "null") and disaggregation_bootstrap_port (0:
// not given). ok is false for a body that is not a JSON object.
func ParseDisaggregation(body []byte) (mode string, bootstrapPort int, ok bool) {
	var v struct {
		Mode *string         `json:"disaggregation_mode"`
		Port json.RawMessage `json:"disaggregation_bootstrap_port"`
	}
	if err := json.Unmarshal(body, &v); err != nil {
		return "", 0, false
	}
	if v.Mode != nil && *v.Mode != "null" {
		mode = *v.Mode
	}
	var port int
	if json.Unmarshal(v.Port, &port) == nil && port > 0 && port < 65536 {
		bootstrapPort = port
	}
	return mode, bootstrapPort, true
}
