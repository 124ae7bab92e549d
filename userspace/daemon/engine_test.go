package daemon

import (
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/testenv/fakeengine"
	"github.com/tether-rl/tether/userspace/config"
	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/route"
)

// fakeFleet starts n fake SGLang engines.
func fakeFleet(t *testing.T, n int, cfg fakeengine.Config) ([]*fakeengine.Engine, []string) {
	t.Helper()
	es, err := fakeengine.StartFleet(n, cfg)
	if err != nil {
		t.Fatal(err)
	}
	urls := make([]string, n)
	for i, e := range es {
		t.Cleanup(e.Close)
		urls[i] = e.URL()
	}
	return es, urls
}

func waitKnown(t *testing.T, d *Daemon) {
	t.Helper()
	testenv.WaitFor(t, "every engine's load read", func() bool {
		for _, w := range d.Table.Snapshot() {
			if w != nil && !w.EngineKnown() {
				return false
			}
		}
		return true
	})
}

// TestEngineGroupsEndToEnd: GRPO samples sent at once through tetherd to
// fake engines: each prompt's samples on one engine (the route header
// says which), the prompts over all engines, and the decisions counted as
// group and engine-least.
func TestEngineGroupsEndToEnd(t *testing.T) {
	es, urls := fakeFleet(t, 4, fakeengine.Config{Kind: fakeengine.SGLang, DecodeStep: time.Millisecond})
	d, do := runRouting(t, Options{Workers: urls, BPF: "off", Routing: RoutingOptions{RouteHeader: "X-Tether-Route", StickyStore: "memory"}})
	waitKnown(t, d)
	for _, w := range d.Table.Snapshot() {
		if w.Engine() != dialect.SGLang {
			t.Fatalf("slot %d: kind %v", w.Slot, w.Engine())
		}
	}
	const prompts, samples = 12, 4
	sys := strings.Repeat("you are a careful solver. ", 200)
	var mu sync.Mutex
	on := make([]map[int]bool, prompts)
	var wg sync.WaitGroup
	for p := 0; p < prompts; p++ {
		on[p] = map[int]bool{}
		for s := 0; s < samples; s++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				body := fmt.Sprintf(`{"rid":"p%d-s%d","text":%q,"sampling_params":{"max_new_tokens":16,"seed":%d}}`, p, s, sys+fmt.Sprintf("question %d", p), s)
				st, h, b := do("POST", "/generate", body)
				if st != 200 {
					t.Errorf("generate: %d %s", st, b)
					return
				}
				f := strings.Fields(h.Get("X-Tether-Route"))
				if len(f) != 2 {
					t.Errorf("route header %q", h.Get("X-Tether-Route"))
					return
				}
				slot, _ := strconv.Atoi(f[0])
				mu.Lock()
				on[p][slot] = true
				mu.Unlock()
			}()
		}
	}
	wg.Wait()
	used := map[int]int{}
	for p, m := range on {
		if len(m) != 1 {
			t.Errorf("prompt %d on engines %v", p, m)
		}
		for s := range m {
			used[s]++
		}
	}
	if len(used) < 2 {
		t.Errorf("every prompt on one engine: %v", used)
	}
	if d.Router.Count(route.ReasonGroup) == 0 || d.Router.Count(route.ReasonEngineLeast) == 0 {
		t.Errorf("decisions: group %d engine-least %d", d.Router.Count(route.ReasonGroup), d.Router.Count(route.ReasonEngineLeast))
	}
	var hits, prompt int64
	for _, e := range es {
		st := e.Stats()
		hits += st.CachedTokens
		prompt += st.PromptTokens
	}
	if prompt == 0 || float64(hits)/float64(prompt) < 0.6 {
		t.Errorf("prefix hit rate %d/%d", hits, prompt)
	}
}

// TestEngineLoadEndpointFails: an engine whose load endpoint hangs is
// placed by tetherd's in-flight count after three rounds, and keeps
// serving; one that answers again is used again; the lie (idle) does not
// attract every request.
func TestEngineLoadEndpointFails(t *testing.T) {
	es, urls := fakeFleet(t, 3, fakeengine.Config{Kind: fakeengine.SGLang, DecodeStep: time.Millisecond})
	d, do := runRouting(t, Options{Workers: urls, BPF: "off", Routing: RoutingOptions{EnginePoll: config.Some(50 * time.Millisecond), StickyStore: "memory"}})
	waitKnown(t, d)
	w0 := d.Table.Get(0)
	es[0].SetLoadMode(fakeengine.LoadTimeout)
	testenv.WaitFor(t, "the silent engine's signals forgotten", func() bool { return !w0.EngineKnown() })
	for i := 0; i < 30; i++ {
		if st, _, b := do("POST", "/generate", fmt.Sprintf(`{"text":"q%d","sampling_params":{"max_new_tokens":4}}`, i)); st != 200 {
			t.Fatalf("generate: %d %s", st, b)
		}
	}
	if es[0].Stats().Requests == 0 {
		t.Error("the engine whose load endpoint hangs got no request")
	}
	es[0].SetLoadMode(fakeengine.LoadLie)
	testenv.WaitFor(t, "signals used again", w0.EngineKnown)
	// 30 requests at once: the one that says it is idle does not get them
	// all (tetherd counts its own requests there).
	before := es[0].Stats().Requests
	var wg sync.WaitGroup
	for i := 0; i < 30; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			do("POST", "/generate", fmt.Sprintf(`{"text":"lie %d","sampling_params":{"max_new_tokens":64}}`, i))
		}()
	}
	wg.Wait()
	if got := es[0].Stats().Requests - before; got > 20 {
		t.Errorf("the lying engine took %d of 30", got)
	}
}
