package dialect

import (
	"math"
	"testing"
)

// SGLang's /v1/loads as v1_loads.py writes it.
const sglangLoads = `{"timestamp":"2026-11-27T10:00:00Z","version":"0.5.4","loads":[
 {"dp_rank":0,"num_running_reqs":12,"num_waiting_reqs":3,"num_used_tokens":40000,"num_total_tokens":100000,
  "max_total_num_tokens":100000,"token_usage":0.4,"cache_hit_rate":0.75,"utilization":0.5,"max_running_requests":256,
  "queues":{"waiting":3,"grammar":0,"paused":0,"retracted":0}},
 {"dp_rank":1,"num_running_reqs":8,"num_waiting_reqs":0,"num_used_tokens":20000,"num_total_tokens":100000,
  "max_total_num_tokens":100000,"token_usage":0.2,"cache_hit_rate":0.25,"utilization":0.3,"max_running_requests":256}]}`

func TestParseLoads(t *testing.T) {
	for _, tc := range []struct {
		name string
		body string
		want Load
		err  bool
	}{
		{"two DP ranks", sglangLoads, Load{Running: 20, Waiting: 3, KVUsage: 0.30000000000000004, HitRate: 0.5, MaxRunning: 512, Source: "v1/loads"}, false},
		{"usage from tokens", `{"loads":[{"num_running_reqs":1,"num_used_tokens":30,"max_total_num_tokens":100},{"num_used_tokens":10,"max_total_num_tokens":100}]}`,
			Load{Running: 1, KVUsage: 0.2, HitRate: -1, Source: "v1/loads"}, false},
		{"percentages", `{"loads":[{"token_usage":45,"cache_hit_rate":80}]}`, Load{KVUsage: 0.45, HitRate: 0.8, Source: "v1/loads"}, false},
		{"lies", `{"loads":[{"num_running_reqs":-4,"num_waiting_reqs":1e300,"token_usage":400,"cache_hit_rate":-1}]}`,
			Load{Waiting: 1e9, KVUsage: -1, HitRate: -1, Source: "v1/loads"}, false},
		{"no loads", `{"loads":[]}`, Load{}, true},
		{"not JSON", `<html>`, Load{}, true},
		{"legacy list", `[{"dp_rank":0,"num_reqs":1}]`, Load{}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, err := ParseLoads(SGLang, []byte(tc.body))
			if (err != nil) != tc.err || l != tc.want {
				t.Fatalf("got %+v %v, want %+v (error %v)", l, err, tc.want, tc.err)
			}
		})
	}
}

func TestParseMetrics(t *testing.T) {
	vllmText := "# HELP vllm:num_requests_running Number of requests in model execution batches.\n" +
		"# TYPE vllm:num_requests_running gauge\n" +
		`vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 7.0` + "\n" +
		`vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-8B"} 2.0` + "\n" +
		`vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 2.0` + "\n" +
		`vllm:kv_cache_usage_perc{engine="0",model_name="a}b \"c\""} 0.25` + "\n" +
		`vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5` + "\n" +
		`vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0` + "\n" +
		`vllm:prefix_cache_hits_total{engine="0",model_name="m"} 900.0 1712345678000` + "\n" +
		`vllm:generation_tokens_total{engine="0"} 5` + "\n" + "go_goroutines 12\n"
	sglText := "sglang:num_running_reqs{tp_rank=\"0\"} 4\nsglang:num_queue_reqs 6\nsglang:token_usage 0.91\n" +
		"sglang:cache_hit_rate 0.5\nsglang:max_running_requests 128\n"
	for _, tc := range []struct {
		name string
		body string
		prev Counters
		want Load
		kind Kind
		next Counters
		ok   bool
	}{
		{"vllm", vllmText, Counters{}, Load{Running: 9, Waiting: 2, KVUsage: 0.5, HitRate: 0.9, Source: "metrics"}, VLLM, Counters{1000, 900}, true},
		{"vllm over the interval", vllmText, Counters{500, 500}, Load{Running: 9, Waiting: 2, KVUsage: 0.5, HitRate: 0.8, Source: "metrics"}, VLLM, Counters{1000, 900}, true},
		{"vllm counters reset", vllmText, Counters{5000, 10}, Load{Running: 9, Waiting: 2, KVUsage: 0.5, HitRate: 0.9, Source: "metrics"}, VLLM, Counters{1000, 900}, true},
		{"vllm older names", "vllm:gpu_cache_usage_perc 0.3\nvllm:gpu_prefix_cache_queries_total 10\nvllm:gpu_prefix_cache_hits_total 5\n",
			Counters{}, Load{KVUsage: 0.3, HitRate: 0.5, Source: "metrics"}, VLLM, Counters{10, 5}, true},
		{"vllm without counters", "vllm:num_requests_running 1\nsglang:cache_hit_rate 0.5\n", Counters{3, 2},
			Load{Running: 1, KVUsage: -1, HitRate: -1, Source: "metrics"}, VLLM, Counters{3, 2}, true},
		{"sglang", sglText, Counters{7, 7}, Load{Running: 4, Waiting: 6, KVUsage: 0.91, HitRate: 0.5, MaxRunning: 128, Source: "metrics"}, SGLang, Counters{7, 7}, true},
		{"lies", "vllm:num_requests_running -5\nvllm:num_requests_waiting NaN\nvllm:kv_cache_usage_perc 4000\n", Counters{},
			Load{KVUsage: -1, HitRate: -1, Source: "metrics"}, VLLM, Counters{}, true},
		{"max running alone detects nothing", "sglang:max_running_requests 128\n", Counters{}, Load{}, Unknown, Counters{}, false},
		{"neither", "go_goroutines 12\nprocess_cpu_seconds_total 3\n", Counters{1, 1}, Load{}, Unknown, Counters{1, 1}, false},
		{"nothing", "", Counters{}, Load{}, Unknown, Counters{}, false},
		{"cut label", "vllm:num_requests_running{engine=\"0 7\n", Counters{}, Load{}, Unknown, Counters{}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, k, next, ok := ParseMetrics([]byte(tc.body), tc.prev)
			if ok != tc.ok || k != tc.kind || next != tc.next {
				t.Fatalf("kind %v next %+v ok %v, want %v %+v %v", k, next, ok, tc.kind, tc.next, tc.ok)
			}
			if ok && l != tc.want {
				t.Fatalf("load %+v, want %+v", l, tc.want)
			}
		})
	}
}

// checkLoad: what placement may be handed, whatever the bytes.
func checkLoad(t *testing.T, l Load) {
	t.Helper()
	if l.Running < 0 || l.Waiting < 0 || l.MaxRunning < 0 || l.Running > 1e9*64 {
		t.Fatalf("counts %+v", l)
	}
	for _, v := range []float64{l.KVUsage, l.HitRate} {
		if math.IsNaN(v) || v > 1 || (v < 0 && v != -1) {
			t.Fatalf("shares %+v", l)
		}
	}
}

func FuzzParseLoads(f *testing.F) {
	for _, s := range []string{sglangLoads, `{"loads":[{"token_usage":45}]}`, `{"loads":[]}`, `[]`, `{"loads":[{"num_used_tokens":5,"max_total_num_tokens":1e-300}]}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		l, err := ParseLoads(SGLang, body)
		if err == nil {
			checkLoad(t, l)
		}
	})
}

func FuzzParseMetrics(f *testing.F) {
	for _, s := range []string{"vllm:num_requests_running{a=\"}\"} 3\nvllm:prefix_cache_queries_total 10\nvllm:prefix_cache_hits_total 4\n",
		"sglang:token_usage 0.5 123\n", "# x\n\n", "vllm:kv_cache_usage_perc{a=\"\\\"\"} 1e400\n"} {
		f.Add([]byte(s), 3.0, 1.0)
	}
	f.Fuzz(func(t *testing.T, body []byte, q, h float64) {
		l, k, next, ok := ParseMetrics(body, Counters{q, h})
		if !ok {
			if k != Unknown || next != (Counters{q, h}) && !(math.IsNaN(q) || math.IsNaN(h)) {
				t.Fatalf("nothing read but kind %v, counters %+v", k, next)
			}
			return
		}
		if !Speaks(k) {
			t.Fatalf("kind %v", k)
		}
		checkLoad(t, l)
	})
}

func FuzzParseVersion(f *testing.F) {
	for _, s := range []string{`{"weight_version":"v1"}`, `{"weight_version":12}`, `{"weight_version":null}`, `1`, `{"weight_version":-0.0}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		v, ok := ParseVersion(body)
		if !ok && v != "" {
			t.Fatalf("%q without ok", v)
		}
	})
}

func FuzzParseAbort(f *testing.F) {
	for _, s := range []string{`{"rid":"a"}`, `{"abort_all":true}`, `{"request_ids":["a"]}`, `{}`, `{"request_ids":[1]}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		m, ok := object(body)
		if !ok {
			return
		}
		for _, k := range Kinds() {
			a, msg := For(k).ParseAbort(m)
			if msg == "" && !a.All && len(a.IDs) == 0 {
				t.Fatalf("%v: an abort of nothing from %q", k, body)
			}
			for _, id := range a.IDs {
				if id == "" {
					t.Fatalf("%v: an empty id from %q", k, body)
				}
			}
		}
	})
}

func FuzzClientPause(f *testing.F) {
	for _, s := range []string{`{"mode":"in_place"}`, ``, `{"mode":null}`, `[`, `{"mode":"x"}`} {
		f.Add([]byte(s), "mode=wait&timeout_s=3")
	}
	f.Fuzz(func(t *testing.T, body []byte, rawQuery string) {
		q, _ := parseQuery(rawQuery)
		for _, k := range Kinds() {
			d := For(k)
			mode, pass, msg := d.ClientPause(body, q)
			if msg != "" {
				continue
			}
			m, ok := d.PauseMode(mode)
			if !ok {
				continue
			}
			c := d.PauseAsClient(d.Pause(m, false), m, false, pass, q)
			if c.Method != "POST" || c.Path == "" {
				t.Fatalf("%v: call %+v", k, c)
			}
		}
	})
}
