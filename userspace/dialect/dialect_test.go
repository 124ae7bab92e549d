package dialect

import (
	"encoding/json"
	"net/url"
	"reflect"
	"slices"
	"testing"
)

// Every call tether makes in each engine's words, byte for byte.
func TestCalls(t *testing.T) {
	sgl, vl := For(SGLang), For(VLLM)
	fields := map[string]json.RawMessage{"request_ids": json.RawMessage(`["x"]`), "reason": json.RawMessage(`"sync"`)}
	for _, tc := range []struct {
		name string
		got  []Call
		want []Call
	}{
		{"sglang pause abort", []Call{sgl.Pause(PauseAbort, false)}, []Call{{"POST", "/pause_generation", []byte(`{"mode":"abort"}`), nil}}},
		{"sglang pause wait", []Call{sgl.Pause(PauseWait, true)}, []Call{{"POST", "/pause_generation", []byte(`{"mode":"in_place"}`), nil}}},
		{"sglang pause keep", []Call{sgl.Pause(PauseKeep, false)}, []Call{{"POST", "/pause_generation", []byte(`{"mode":"in_place"}`), nil}}},
		{"sglang pause retract", []Call{sgl.Pause(PauseRetract, false)}, []Call{{"POST", "/pause_generation", []byte(`{"mode":"retract"}`), nil}}},
		{"sglang pause in the client's body", []Call{sgl.PauseAsClient(sgl.Pause(PauseKeep, true), PauseKeep, true, []byte(`{"mode":"in_place","x":1}`), url.Values{"a": {"b"}})},
			[]Call{{"POST", "/pause_generation", []byte(`{"mode":"in_place","x":1}`), nil}}},
		{"sglang pause, no client body", []Call{sgl.PauseAsClient(sgl.Pause(PauseAbort, true), PauseAbort, true, nil, nil)},
			[]Call{{"POST", "/pause_generation", []byte(`{"mode":"abort"}`), nil}}},
		{"sglang resume", []Call{sgl.Resume()}, []Call{{"POST", "/continue_generation", []byte(`{}`), nil}}},
		{"sglang abort all", []Call{sgl.AbortAll()}, []Call{{"POST", "/abort_request", []byte(`{"abort_all":true}`), nil}}},
		{"sglang abort as client", []Call{sgl.AbortAsClient([]byte(`{"rid":"a","x":1}`))}, []Call{{"POST", "/abort_request", []byte(`{"rid":"a","x":1}`), nil}}},
		{"sglang abort ids", sgl.AbortIDs([]string{"a", `b"<`}, fields), []Call{
			{"POST", "/abort_request", []byte(`{"rid":"a"}`), []string{"a"}},
			{"POST", "/abort_request", []byte(`{"rid":"b\"\u003c"}`), []string{`b"<`}}}},
		{"sglang flush", []Call{sgl.FlushCache()}, []Call{{"POST", "/flush_cache", nil, nil}}},
		{"sglang version", []Call{*sgl.Version}, []Call{{"GET", "/get_weight_version", nil, nil}}},
		{"sglang legacy load", []Call{*sgl.LegacyLoad}, []Call{{"GET", "/get_load", nil, nil}}},
		{"sglang loads", []Call{*sgl.Loads}, []Call{{"GET", "/v1/loads", nil, nil}}},

		{"vllm pause abort", []Call{vl.Pause(PauseAbort, false)}, []Call{{"POST", "/pause?mode=abort", nil, nil}}},
		{"vllm pause wait, quiet", []Call{vl.Pause(PauseWait, true)}, []Call{{"POST", "/pause?mode=wait", nil, nil}}},
		{"vllm pause wait, not drained", []Call{vl.Pause(PauseWait, false)}, []Call{{"POST", "/pause?mode=keep", nil, nil}}},
		{"vllm pause keep", []Call{vl.Pause(PauseKeep, false)}, []Call{{"POST", "/pause?mode=keep", nil, nil}}},
		{"vllm pause retract", []Call{vl.Pause(PauseRetract, true)}, []Call{{"POST", "/pause?mode=keep", nil, nil}}},
		{"vllm pause in the client's query", []Call{vl.PauseAsClient(vl.Pause(PauseWait, false), PauseWait, false, []byte(`{}`), url.Values{"mode": {"wait"}, "clear_cache": {"true"}})},
			[]Call{{"POST", "/pause?clear_cache=true&mode=keep", nil, nil}}},
		{"vllm pause, no client query", []Call{vl.PauseAsClient(vl.Pause(PauseAbort, true), PauseAbort, true, nil, nil)},
			[]Call{{"POST", "/pause?mode=abort", nil, nil}}},
		{"vllm resume", []Call{vl.Resume()}, []Call{{"POST", "/resume", nil, nil}}},
		{"vllm abort all", []Call{vl.AbortAll()}, []Call{{"POST", "/abort_requests", []byte(`{}`), nil}}},
		{"vllm abort as client", []Call{vl.AbortAsClient([]byte(`{}`))}, []Call{{"POST", "/abort_requests", []byte(`{}`), nil}}},
		{"vllm abort ids", vl.AbortIDs([]string{"a", "b"}, nil), []Call{{"POST", "/abort_requests", []byte(`{"request_ids":["a","b"]}`), []string{"a", "b"}}}},
		{"vllm abort ids, the client's fields", vl.AbortIDs([]string{"a"}, fields), []Call{{"POST", "/abort_requests", []byte(`{"reason":"sync","request_ids":["a"]}`), []string{"a"}}}},
		{"vllm flush", []Call{vl.FlushCache()}, []Call{{"POST", "/reset_prefix_cache", nil, nil}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if !reflect.DeepEqual(tc.got, tc.want) {
				t.Fatalf("got  %s\nwant %s", show(tc.got), show(tc.want))
			}
		})
	}
	if vl.Version != nil || vl.Loads != nil || vl.LegacyLoad != nil {
		t.Error("vLLM serves no version, loads or legacy load read")
	}
	if c := AnyVersionCall(); c.Path != "/get_weight_version" {
		t.Errorf("AnyVersionCall %+v", c)
	}
	if c := AnyLegacyLoadCall(); c.Path != "/get_load" {
		t.Errorf("AnyLegacyLoadCall %+v", c)
	}
	if c, k, ok := LoadsCall(); !ok || k != SGLang || c.Path != "/v1/loads" {
		t.Errorf("LoadsCall %+v %v %v", c, k, ok)
	}
	if c, ok := VersionCall(VLLM); ok {
		t.Errorf("VersionCall(VLLM) %+v", c)
	}
}

func show(cs []Call) string {
	var b []byte
	for _, c := range cs {
		b = append(b, c.Method+" "+c.Path+" "+string(c.Body)+" "...)
		b = append(b, '[')
		for _, id := range c.IDs {
			b = append(b, id+","...)
		}
		b = append(b, "]; "...)
	}
	return string(b)
}

func TestKinds(t *testing.T) {
	for _, tc := range []struct {
		k    Kind
		name string
	}{{Unknown, "unknown"}, {SGLang, "sglang"}, {VLLM, "vllm"}, {Other, "other"}} {
		if tc.k.String() != tc.name {
			t.Errorf("%d.String() = %q, want %q", tc.k, tc.k.String(), tc.name)
		}
		if k, ok := ParseKind(tc.name); !ok || k != tc.k {
			t.Errorf("ParseKind(%q) = %v %v", tc.name, k, ok)
		}
	}
	if _, ok := ParseKind("trtllm"); ok {
		t.Error("ParseKind took an engine tether does not speak")
	}
	if Kind(7).String() != "unknown" {
		t.Error("an unregistered kind is not unknown")
	}
	if !slices.Equal(Kinds(), []Kind{SGLang, VLLM}) || Default() != SGLang {
		t.Errorf("Kinds %v, Default %v", Kinds(), Default())
	}
	if OtherThan(SGLang) != VLLM || OtherThan(VLLM) != SGLang || OtherThan(Unknown) != SGLang {
		t.Error("OtherThan")
	}
	if Speaks(Unknown) || Speaks(Other) || !Speaks(SGLang) || !Speaks(VLLM) || For(Other) != nil {
		t.Error("Speaks/For")
	}
}

// What tetherd serves in each engine's words, and what it never holds.
func TestServed(t *testing.T) {
	for _, tc := range []struct {
		path string
		want Endpoint
	}{
		{"/abort_request", Endpoint{SGLang, OpAbort, Plain}},
		{"/abort_requests", Endpoint{VLLM, OpAbort, Plain}},
		{"/flush_cache", Endpoint{SGLang, OpFlush, Plain}},
		{"/get_loads", Endpoint{SGLang, OpLoads, Plain}},
		{"/v1/loads", Endpoint{SGLang, OpLoads, Plain}},
		{"/pause_generation", Endpoint{SGLang, OpPause, Plain}},
		{"/pause", Endpoint{VLLM, OpPause, Plain}},
		{"/continue_generation", Endpoint{SGLang, OpResume, Plain}},
		{"/resume", Endpoint{VLLM, OpResume, Plain}},
		{"/is_paused", Endpoint{VLLM, OpIsPaused, Plain}},
		{"/get_weight_version", Endpoint{SGLang, OpVersion, Plain}},
		{"/update_weights_from_disk", Endpoint{SGLang, OpUpdate, Weights}},
		{"/update_weights_from_distributed", Endpoint{SGLang, OpUpdate, Weights}},
		{"/update_weights_from_tensor", Endpoint{SGLang, OpUpdate, Weights}},
		{"/update_weights_from_ipc", Endpoint{SGLang, OpUpdate, Weights}},
		{"/init_weights_update_group", Endpoint{SGLang, OpUpdate, Plain}},
		{"/destroy_weights_update_group", Endpoint{SGLang, OpUpdate, Plain}},
		{"/update_weight_version", Endpoint{SGLang, OpUpdate, SetVersion}},
		{"/post_process_weights", Endpoint{SGLang, OpUpdate, Plain}},
		{"/release_memory_occupation", Endpoint{SGLang, OpUpdate, Plain}},
		{"/resume_memory_occupation", Endpoint{SGLang, OpUpdate, Plain}},
		{"/init_weight_transfer_engine", Endpoint{VLLM, OpUpdate, Plain}},
		{"/start_weight_update", Endpoint{VLLM, OpUpdate, OpenUpdate}},
		{"/update_weights", Endpoint{VLLM, OpUpdate, Weights}},
		{"/finish_weight_update", Endpoint{VLLM, OpUpdate, CloseUpdate}},
		{"/sleep", Endpoint{VLLM, OpUpdate, Plain}},
		{"/wake_up", Endpoint{VLLM, OpUpdate, Plain}},
		{"/reset_prefix_cache", Endpoint{VLLM, OpUpdate, Plain}},
	} {
		if got, ok := Served([]byte(tc.path)); !ok || got != tc.want {
			t.Errorf("Served(%s) = %+v %v, want %+v", tc.path, got, ok, tc.want)
		}
	}
	for _, p := range []string{"/generate", "/v1/chat/completions", "/fleet", "/abort_until_idle", "/pause_generation?x", ""} {
		if ep, ok := Served([]byte(p)); ok {
			t.Errorf("Served(%q) = %+v", p, ep)
		}
	}
	if n := len(served); n != 28 {
		t.Errorf("%d served paths, want 28", n)
	}
	held := []string{"/collective_rpc", "/weight_checker", "/start_draft_weight_update", "/get_weights_by_name",
		"/load_lora_adapter", "/unload_lora_adapter", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
		"/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize", "/get_world_size", "/fetch_weights",
		"/init_weights_send_group_for_remote_instance", "/send_weights_to_remote_instance"}
	for _, p := range held {
		if !IsNeverHeld([]byte(p)) || !IsNeverHeld([]byte(p+"?a=b")) {
			t.Errorf("%s is held", p)
		}
	}
	if len(neverHeld) != len(held) {
		t.Errorf("%d never-held paths, want %d", len(neverHeld), len(held))
	}
	for _, p := range []string{"/generate", "/update_weights_from_disk", "/collective_rpcx", "?/tokenize", ""} {
		if IsNeverHeld([]byte(p)) {
			t.Errorf("%q is never held", p)
		}
	}
	if n := testing.AllocsPerRun(100, func() { Served([]byte("/pause")); IsNeverHeld([]byte("/tokenize?x")) }); n != 0 {
		t.Errorf("%v allocations", n)
	}
}

func TestPauseModes(t *testing.T) {
	sgl, vl := For(SGLang), For(VLLM)
	for _, tc := range []struct {
		d    *Dialect
		mode string
		want Mode
		ok   bool
	}{
		{sgl, "", PauseAbort, true}, {sgl, "abort", PauseAbort, true}, {sgl, "in_place", PauseKeep, true},
		{sgl, "retract", PauseRetract, true}, {sgl, "wait", "", false}, {sgl, "keep", "", false},
		{vl, "", PauseAbort, true}, {vl, "abort", PauseAbort, true}, {vl, "wait", PauseWait, true},
		{vl, "keep", PauseKeep, true}, {vl, "retract", "", false}, {vl, "in_place", "", false},
	} {
		if m, ok := tc.d.PauseMode(tc.mode); m != tc.want || ok != tc.ok {
			t.Errorf("%s PauseMode(%q) = %q %v", tc.d.Name, tc.mode, m, ok)
		}
	}
	for _, tc := range []struct {
		d          *Dialect
		body       string
		query      url.Values
		mode, pass string
		msg        bool
	}{
		{sgl, ``, nil, "", "", false},
		{sgl, "  \n", nil, "", "", false},
		{sgl, `{"mode":"retract"}`, url.Values{"mode": {"abort"}}, "retract", `{"mode":"retract"}`, false},
		{sgl, `{"other":1}`, nil, "", `{"other":1}`, false},
		{sgl, `[1]`, nil, "", "", true},
		{sgl, `{"mode":1}`, nil, "", "", true},
		{vl, `{"mode":"keep"}`, url.Values{"mode": {"wait"}}, "wait", "", false},
		{vl, ``, nil, "", "", false},
	} {
		mode, pass, msg := tc.d.ClientPause([]byte(tc.body), tc.query)
		if mode != tc.mode || string(pass) != tc.pass || (msg != "") != tc.msg {
			t.Errorf("%s ClientPause(%q, %v) = %q %q %q", tc.d.Name, tc.body, tc.query, mode, pass, msg)
		}
	}
	if !sgl.PauseInBody || vl.PauseInBody {
		t.Error("PauseInBody")
	}
}

func TestParseAbort(t *testing.T) {
	sgl, vl := For(SGLang), For(VLLM)
	obj := func(s string) map[string]json.RawMessage {
		var m map[string]json.RawMessage
		if err := json.Unmarshal([]byte(s), &m); err != nil {
			t.Fatal(err)
		}
		return m
	}
	for _, tc := range []struct {
		d    *Dialect
		body string
		want Abort
		msg  string
	}{
		{sgl, `{"rid":"a"}`, Abort{IDs: []string{"a"}}, ""},
		{sgl, `{"abort_all":true}`, Abort{All: true}, ""},
		{sgl, `{"rid":"a","abort_all":true}`, Abort{All: true, IDs: []string{"a"}}, ""},
		{sgl, `{"rid":1}`, Abort{}, `"rid" must be a string, not a number`},
		{sgl, `{"abort_all":"yes"}`, Abort{}, `"abort_all" must be a boolean, not a string`},
		{sgl, `{"rid":""}`, Abort{}, `give "rid" (a non-empty string) or "abort_all": true`},
		{sgl, `{}`, Abort{}, `give "rid" (a non-empty string) or "abort_all": true`},
		{vl, `{}`, Abort{All: true}, ""},
		{vl, `{"request_ids":["a","b","a"]}`, Abort{IDs: []string{"a", "b", "a"}}, ""},
		{vl, `{"rid":"a"}`, Abort{}, `missing "request_ids" (a list of strings; {} aborts everything)`},
		{vl, `{"request_ids":"a"}`, Abort{}, `"request_ids" must be a list of strings, not a string`},
		{vl, `{"request_ids":[]}`, Abort{}, `"request_ids" is empty`},
		{vl, `{"request_ids":["a",2]}`, Abort{}, `"request_ids"[1] must be a non-empty string, not a number`},
		{vl, `{"request_ids":["a",""]}`, Abort{}, `"request_ids"[1] must be a non-empty string, not a string`},
	} {
		a, msg := tc.d.ParseAbort(obj(tc.body))
		if !reflect.DeepEqual(a, tc.want) || msg != tc.msg {
			t.Errorf("%s ParseAbort(%s) = %+v %q, want %+v %q", tc.d.Name, tc.body, a, msg, tc.want, tc.msg)
		}
	}
	if sgl.AbortForm != OneID || vl.AbortForm != IDList {
		t.Error("AbortForm")
	}
}

// The one weight version parser: a string or a number, nothing else.
func TestParseVersion(t *testing.T) {
	for _, tc := range []struct {
		body string
		want string
		ok   bool
	}{
		{`{"weight_version":"v7"}`, "v7", true},
		{`{"weight_version":""}`, "", true},
		{`{"weight_version":7}`, "7", true},
		{`{"weight_version":1.5}`, "1.5", true},
		{`{"weight_version":1e21}`, "1000000000000000000000", true},
		{`{"Weight_Version":"v1"}`, "v1", true}, // as encoding/json matches fields
		{`{"weight_version":null}`, "", false},
		{`{"weight_version":true}`, "", false},
		{`{"weight_version":["v"]}`, "", false},
		{`{"other":"v"}`, "", false},
		{`["v"]`, "", false},
		{`garbage`, "", false},
		{``, "", false},
	} {
		if v, ok := ParseVersion([]byte(tc.body)); v != tc.want || ok != tc.ok {
			t.Errorf("ParseVersion(%s) = %q %v, want %q %v", tc.body, v, ok, tc.want, tc.ok)
		}
	}
}

func TestBodyVersion(t *testing.T) {
	for _, tc := range []struct{ body, want string }{
		{`{"weight_version":"a"}`, "a"},
		{`{"new_version":"b"}`, "b"},
		{`{"weight_version":"a","new_version":"b"}`, "b"},
		{`{"weight_version":3}`, ""},
		{`{"weight_version":" x"}`, " x"},
		{`{}`, ""},
	} {
		var m map[string]json.RawMessage
		json.Unmarshal([]byte(tc.body), &m)
		if got := BodyVersion(m); got != tc.want {
			t.Errorf("BodyVersion(%s) = %q, want %q", tc.body, got, tc.want)
		}
	}
}

func TestFields(t *testing.T) {
	if got := RequestIDKeys(); !slices.Equal(got, []string{`"rid"`, `"request_id"`}) {
		t.Errorf("RequestIDKeys %q", got)
	}
	if got := PromptFields(); !slices.Equal(got, []string{"input_ids", "text", "prompt", "messages"}) {
		t.Errorf("PromptFields %q", got)
	}
	if got := RequestIDHeaders(); !slices.Equal(got, []string{"X-Request-ID"}) {
		t.Errorf("RequestIDHeaders %q", got)
	}
	for _, k := range []string{"rid", "request_id"} {
		if !IsRequestIDField([]byte(k)) {
			t.Errorf("%s is no request-id field", k)
		}
	}
	for _, k := range []string{"Rid", "id", "", "request_ids"} {
		if IsRequestIDField([]byte(k)) {
			t.Errorf("%q is a request-id field", k)
		}
	}
	if n := testing.AllocsPerRun(100, func() { IsRequestIDField([]byte("request_id")) }); n != 0 {
		t.Errorf("%v allocations", n)
	}
}
