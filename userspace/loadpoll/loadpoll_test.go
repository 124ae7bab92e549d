package loadpoll

import (
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/testenv/fakeengine"
	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/worker"
)

func TestMain(m *testing.M) { os.Exit(testenv.RunNoLeaks(m)) }

// setup returns a router over one worker per URL with engine placement
// on, and a poller for it (not started: the tests run rounds).
func setup(t *testing.T, urls ...string) (*route.Router, []*worker.Worker, *Poller) {
	t.Helper()
	st := stats.NewHeap()
	tab := worker.NewTable()
	for i, u := range urls {
		tab.Put(&worker.Worker{Slot: i, URL: u, Stats: st.Worker(i)})
	}
	rt := &route.Router{Table: tab}
	ep, err := route.NewEnginePlacement(route.EngineConfig{})
	if err != nil {
		t.Fatal(err)
	}
	rt.SetEnginePlacement(ep)
	p := New(Options{Config: Config{Interval: time.Hour, Timeout: 200 * time.Millisecond}, APIKey: "k", Table: tab, Router: rt,
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	t.Cleanup(p.Stop)
	return rt, tab.Snapshot(), p
}

// TestParse: the load endpoints of both engines, as stubs, each field by
// its name whatever the labels, and the engine kind learned.
func TestParse(t *testing.T) {
	for _, tc := range []struct {
		name    string
		loads   string // /v1/loads body ("" 404)
		metrics string // /metrics body ("" 404)
		want    worker.EngineSignals
		kind    dialect.Kind
		known   bool
	}{
		{
			name:  "sglang v1/loads, two DP ranks",
			loads: `{"timestamp":"x","version":"0.5","loads":[{"dp_rank":0,"num_running_reqs":3,"num_waiting_reqs":1,"token_usage":0.5,"cache_hit_rate":0.8,"max_running_requests":64},{"dp_rank":1,"num_running_reqs":5,"num_waiting_reqs":0,"token_usage":0.7,"cache_hit_rate":0.6,"max_running_requests":64}]}`,
			want:  worker.EngineSignals{Running: 8, Waiting: 1, KVUsage: 0.6, HitRate: 0.7, MaxRunning: 128, Source: "v1/loads"},
			kind:  dialect.SGLang, known: true,
		},
		{
			name: "vllm metrics with labels",
			metrics: "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n" +
				`vllm:num_requests_running{engine="0",model_name="m"} 7` + "\n" +
				`vllm:num_requests_waiting{engine="0",model_name="m"} 2` + "\n" +
				`vllm:kv_cache_usage_perc{engine="0",model_name="a}b"} 0.25` + "\n" +
				`vllm:prefix_cache_queries_total{model_name="m"} 1000` + "\n" +
				`vllm:prefix_cache_hits_total{model_name="m"} 900 1712345678` + "\n",
			want: worker.EngineSignals{Running: 7, Waiting: 2, KVUsage: 0.25, HitRate: 0.9, Source: "metrics"},
			kind: dialect.VLLM, known: true,
		},
		{
			name:    "sglang metrics only",
			metrics: "sglang:num_running_reqs{tp_rank=\"0\"} 4\nsglang:num_queue_reqs 6\nsglang:token_usage 0.91\nsglang:cache_hit_rate 0.5\n",
			want:    worker.EngineSignals{Running: 4, Waiting: 6, KVUsage: 0.91, HitRate: 0.5, Source: "metrics"},
			kind:    dialect.SGLang, known: true,
		},
		{
			name:    "lies: negative and NaN counts, usage beyond 100",
			metrics: "vllm:num_requests_running -5\nvllm:num_requests_waiting NaN\nvllm:kv_cache_usage_perc 4000\n",
			want:    worker.EngineSignals{KVUsage: -1, HitRate: -1, Source: "metrics"},
			kind:    dialect.VLLM, known: true,
		},
		{name: "neither", metrics: "go_goroutines 12\n", kind: dialect.Unknown},
		{name: "nothing", kind: dialect.Unknown},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var auth atomic.Value
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				auth.Store(r.Header.Get("Authorization"))
				body := ""
				switch r.URL.Path {
				case "/v1/loads":
					body = tc.loads
				case "/metrics":
					body = tc.metrics
				}
				if body == "" {
					http.NotFound(w, r)
					return
				}
				fmt.Fprint(w, body)
			}))
			defer srv.Close()
			rt, ws, p := setup(t, srv.URL)
			p.Round()
			w := ws[0]
			if w.EngineKnown() != tc.known || w.Engine() != tc.kind {
				t.Fatalf("known %v kind %v, want %v %v", w.EngineKnown(), w.Engine(), tc.known, tc.kind)
			}
			if got := auth.Load(); got != "Bearer k" {
				t.Errorf("Authorization %q", got)
			}
			if !tc.known {
				if rt.EnginePlacement() == nil {
					t.Fatal("no placement")
				}
				return
			}
			v, _ := w.EngineState()
			if v.EngineSignals != tc.want {
				t.Fatalf("signals %+v, want %+v", v.EngineSignals, tc.want)
			}
		})
	}
}

// TestFakeEngines: real fake engines of both kinds, polled; a veto at
// full KV; an endpoint that times out is forgotten after three rounds and
// used again once it answers; one that lies is read as idle (placement
// still counts tetherd's own requests in flight: route tests).
func TestFakeEngines(t *testing.T) {
	sgl, err := fakeengine.Start(fakeengine.Config{Kind: fakeengine.SGLang, KVBlocks: 64, BlockTokens: 16, MaxRunning: 8, DecodeStep: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer sgl.Close()
	vl, err := fakeengine.Start(fakeengine.Config{Kind: fakeengine.VLLM, KVBlocks: 64, BlockTokens: 16})
	if err != nil {
		t.Fatal(err)
	}
	defer vl.Close()
	rt, ws, p := setup(t, sgl.URL(), vl.URL())
	p.Round()
	if ws[0].Engine() != dialect.SGLang || ws[1].Engine() != dialect.VLLM {
		t.Fatalf("kinds %v %v", ws[0].Engine(), ws[1].Engine())
	}
	if !ws[0].EngineKnown() || !ws[1].EngineKnown() {
		t.Fatal("not known")
	}
	// Fill the SGLang engine's KV cache: long prompts that decode slowly.
	done := make(chan struct{})
	defer func() { <-done }()
	go func() {
		defer close(done)
		c := &http.Client{Timeout: 30 * time.Second}
		for i := 0; i < 8; i++ {
			go func() {
				prompt := strings.Repeat(fmt.Sprintf("word%d ", i), 200)
				resp, err := c.Post(sgl.URL()+"/generate", "application/json", strings.NewReader(fmt.Sprintf(`{"text":%q,"sampling_params":{"max_new_tokens":40}}`, prompt)))
				if err == nil {
					resp.Body.Close()
				}
			}()
		}
	}()
	testenv.WaitFor(t, "the SGLang engine vetoed", func() bool {
		p.Round()
		return ws[0].EngineVetoed()
	})
	// Every healthy engine vetoed? No: vLLM has room, so no hold.
	if ws[0].EngineHold() != 0 {
		t.Fatal("held while another engine has room")
	}
	// Timeout: kept for two rounds, then forgotten.
	vl.SetLoadMode(fakeengine.LoadTimeout)
	p.Round()
	p.Round()
	if !ws[1].EngineKnown() {
		t.Fatal("forgotten after two failed rounds")
	}
	p.Round()
	if ws[1].EngineKnown() {
		t.Fatal("still used after three failed rounds")
	}
	v, _ := ws[1].EngineState()
	if v.Failures != 3 || v.LastErr == "" {
		t.Fatalf("view %+v", v)
	}
	vl.SetLoadMode(fakeengine.LoadLie)
	p.Round()
	if !ws[1].EngineKnown() {
		t.Fatal("not used again once answering")
	}
	v, _ = ws[1].EngineState()
	if v.Running != 0 || v.KVUsage != 0 {
		t.Fatalf("lie read as %+v", v)
	}
	vl.SetLoadMode(fakeengine.LoadNone)
	p.Round()
	if ws[1].EngineKnown() {
		t.Fatal("a worker without load endpoints still has signals")
	}
	if rt.EnginePlacement() == nil {
		t.Fatal("placement gone")
	}
}

// TestHoldWhenAllVetoed: the poller holds admissions while every healthy
// engine is vetoed and lifts the hold when one has room again.
func TestHoldWhenAllVetoed(t *testing.T) {
	var usage atomic.Value
	usage.Store("0.95")
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			http.NotFound(w, r)
			return
		}
		fmt.Fprintf(w, "vllm:num_requests_running 3\nvllm:kv_cache_usage_perc %s\n", usage.Load())
	}))
	defer srv.Close()
	_, ws, p := setup(t, srv.URL, srv.URL+"/")
	p.Round()
	for _, w := range ws {
		if !w.EngineVetoed() || w.EngineHold() != 1 {
			t.Fatalf("slot %d: vetoed %v hold %d", w.Slot, w.EngineVetoed(), w.EngineHold())
		}
	}
	usage.Store("0.85") // within the hysteresis band: still vetoed
	p.Round()
	if !ws[0].EngineVetoed() || ws[0].EngineHold() == 0 {
		t.Fatal("veto lifted within the band")
	}
	usage.Store("0.5")
	p.Round()
	for _, w := range ws {
		if w.EngineVetoed() || w.EngineHold() != 0 {
			t.Fatalf("slot %d: vetoed %v hold %d", w.Slot, w.EngineVetoed(), w.EngineHold())
		}
	}
}
