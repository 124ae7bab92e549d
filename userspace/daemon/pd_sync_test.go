package daemon

import (
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/testenv/fakeengine"
	"github.com/tether-rl/tether/testenv/fakepd"
)

// TestPDWeightSyncUnderLoad: weight syncs through tetherd (pause, update,
// resume, in each engine's words) over a P/D fleet (2 prefills, 3
// decodes) under keyed and keyless load, whole and streamed: no request
// reaches a paused engine (parked), no answer spans two weight versions
// (the fake engines tag the prefill's KV and every decoded token), every
// prefill and decode engine at the new version after each update, every
// request answered 200 (an aborting pause's victims with their partial
// output and finish abort, and only those that ran across a pause), and
// nothing held by any engine or in flight in tetherd afterwards.
func TestPDWeightSyncUnderLoad(t *testing.T) {
	for _, rc := range []struct {
		name, pause, body, update, resume string
		proto                             PDProtocol
		aborting                          bool
	}{
		{"sglang-abort", "/pause_generation", `{"mode":"abort"}`, "/update_weights_from_disk", "/continue_generation", PDSGLang, true},
		{"vllm-wait", "/pause?mode=wait", "", "/update_weights", "/resume", PDVLLM, false},
		{"vllm-abort", "/pause?mode=abort", "", "/update_weights", "/resume", PDVLLM, true},
	} {
		t.Run(rc.name, func(t *testing.T) {
			o := fakepd.Options{WaitTimeout: 30 * time.Second, TokenDelay: time.Millisecond, PrefillPerToken: 200 * time.Microsecond, MaxPrefill: 2, CacheTokens: 1 << 14}
			f := startPDFleet(t, rc.proto, []fakepd.Options{o, o}, []fakepd.Options{o, o, o})
			fx := &fleetFixture{d: f.d, base: "http://" + f.d.Addr(), client: newClient(t)}
			kind := fakeengine.SGLang
			if rc.proto == PDVLLM {
				kind = fakeengine.VLLM
			}
			const cycles, clients = 3, 12
			var (
				mu   sync.Mutex
				outs []syncOut
				stop atomic.Bool
				wg   sync.WaitGroup
			)
			for i := 0; i < clients; i++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					key := ""
					if i%2 == 0 {
						key = fmt.Sprintf("agent-%d", i)
					}
					for turn := 0; !stop.Load(); turn++ {
						prompt := strings.Repeat(fmt.Sprintf("client %d turn %d. ", i, turn/3), 3+i%4+turn%3)
						o := fx.generateStream(kind, key, prompt, 10+i%3*10, i%3 == 0)
						mu.Lock()
						outs = append(outs, o)
						mu.Unlock()
					}
				}()
			}
			type window struct{ pauseAt, resumed time.Time }
			var windows []window
			engines := append(append([]pdEngine{}, f.prefills...), f.decodes...)
			for c := 1; c <= cycles; c++ {
				testenv.WaitFor(t, "requests between syncs", func() bool {
					mu.Lock()
					defer mu.Unlock()
					return len(outs) >= c*15
				})
				w := window{pauseAt: time.Now()}
				code, ans := fx.call(t, rc.pause+sep(rc.pause)+"timeout_s=30", rc.body)
				if code != 200 || ans["quiet"] != true || ans["phase"] != "paused" {
					t.Fatalf("cycle %d: pause: %d %v", c, code, ans)
				}
				version := fmt.Sprintf("v%d", c)
				if code, ans := fx.call(t, rc.update, fmt.Sprintf(`{"model_path":"/ckpt/%s","weight_version":%q}`, version, version)); code != 200 {
					t.Fatalf("cycle %d: update: %d %v", c, code, ans)
				}
				for _, e := range engines {
					if v := e.(interface{ WeightVersion() string }).WeightVersion(); v != version {
						t.Fatalf("cycle %d: %s at %q after the update to %q", c, e.URL(), v, version)
					}
				}
				if code, ans := fx.call(t, rc.resume, ""); code != 200 || ans["phase"] != "serving" {
					t.Fatalf("cycle %d: resume: %d %v", c, code, ans)
				}
				w.resumed = time.Now()
				windows = append(windows, w)
			}
			stop.Store(true)
			wg.Wait()
			var aborted int
			for _, o := range outs {
				if o.err != nil || o.status != 200 {
					t.Fatalf("a request failed: status %d, err %v", o.status, o.err)
				}
				if len(o.versions) != 1 {
					t.Errorf("an answer's weight versions %v (%v to %v)", o.versions, o.start, o.end)
				}
				if o.finish == "abort" {
					aborted++
					ran := false
					for _, w := range windows {
						ran = ran || o.start.Before(w.resumed) && o.end.After(w.pauseAt)
					}
					if !rc.aborting || !ran {
						t.Errorf("an answer aborted (%v to %v) that ran across no aborting pause", o.start, o.end)
					}
				}
			}
			if n := f.sum(func(s *fakepd.Stats) int64 { return s.ParkedWhilePaused.Load() }); n != 0 {
				t.Errorf("%d requests reached a paused engine", n)
			}
			if n := f.sum(func(s *fakepd.Stats) int64 { return s.MixedVersionOutputs.Load() }); n != 0 {
				t.Errorf("%d answers spanned two weight versions", n)
			}
			if n := f.sum(func(s *fakepd.Stats) int64 { return s.Recomputes.Load() }); n != 0 {
				t.Errorf("%d recomputes", n)
			}
			testenv.WaitFor(t, "the fleet to hold nothing", func() bool { return f.held() == 0 })
			testenv.WaitFor(t, "nothing in flight in tetherd", func() bool { return f.inFlight() == 0 })
			t.Logf("%s: %d requests, %d aborted by a pause with their partial output", rc.name, len(outs), aborted)
		})
	}
}

// TestPDVLLMPrefillAbortedByPause: a vLLM prefill aborted by a pause
// (abort mode) answers finish abort without kv_transfer_params; tetherd
// takes it as a failed leg, not as a missing handoff (a 502): the
// request is tried again after the resume, on the new weights, and the
// client has a whole answer.
func TestPDVLLMPrefillAbortedByPause(t *testing.T) {
	o := fakepd.Options{PrefillDelay: 500 * time.Millisecond}
	f := startPDFleet(t, PDVLLM, []fakepd.Options{o}, []fakepd.Options{{}})
	fx := &fleetFixture{d: f.d, base: "http://" + f.d.Addr(), client: newClient(t)}
	done := make(chan syncOut, 1)
	go func() { done <- fx.generate(fakeengine.VLLM, "", "aborted in its prefill", 4) }()
	pre := f.prefills[0].(*fakepd.VLLMPrefill)
	testenv.WaitFor(t, "the request in its prefill", func() bool { return pre.Stats.Requests.Load() == 1 })
	if code, ans := fx.call(t, "/pause?mode=abort&timeout_s=30", ""); code != 200 {
		t.Fatalf("pause: %d %v", code, ans)
	}
	if code, ans := fx.call(t, "/update_weights", `{"weight_version":"v1"}`); code != 200 {
		t.Fatalf("update: %d %v", code, ans)
	}
	if code, ans := fx.call(t, "/resume", ""); code != 200 {
		t.Fatalf("resume: %d %v", code, ans)
	}
	out := <-done
	if out.err != nil || out.status != 200 || out.finish != "length" || fmt.Sprint(out.versions) != "[v1]" {
		t.Fatalf("answer: %+v", out)
	}
	if v := f.d.pd.vllm.Counters.Values(); v.PrefillFailed != 1 || v.Retries != 1 || v.MissingKVParams != 0 {
		t.Errorf("counters %+v", v)
	}
	if pre.Stats.Aborted.Load() != 1 || pre.Stats.Requests.Load() != 2 {
		t.Errorf("the prefill saw %d requests, %d aborted", pre.Stats.Requests.Load(), pre.Stats.Aborted.Load())
	}
	testenv.WaitFor(t, "the fleet to hold nothing", func() bool { return f.held() == 0 })
}
