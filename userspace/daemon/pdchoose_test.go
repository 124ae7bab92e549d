package daemon

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/fleet"
	"github.com/tether-rl/tether/userspace/pd"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/worker"
)

// chooserTable is a table of np prefills (slots 0..) and nd decodes.
func chooserTable(np, nd int) (*worker.Table, []*worker.Worker) {
	tab := worker.NewTable()
	var ws []*worker.Worker
	for i := 0; i < np+nd; i++ {
		w := &worker.Worker{Slot: i, URL: fmt.Sprintf("http://10.0.0.%d:8000", i+1), Stats: &stats.Worker{}}
		if i < np {
			w.SetRole(worker.Prefill, 8998)
		} else {
			w.SetRole(worker.Decode, 0)
		}
		tab.Put(w)
		ws = append(ws, w)
	}
	return tab, ws
}

func keyed(key, prompt string) *pd.Request {
	h := http.Header{}
	if key != "" {
		h.Set("X-Session-Id", key)
	}
	return &pd.Request{Method: "POST", Path: "/generate", Header: h, Body: []byte(`{"text":"` + prompt + `"}`)}
}

// TestPairChooser: the prefill by affinity (a key, else the prompt: the
// same prefill for the same key or prompt), the decode by load, both
// counted from Choose until Release, a retry off the failed sides, no
// pair across weight versions, none without a healthy prefill and decode.
func TestPairChooser(t *testing.T) {
	tab, ws := chooserTable(3, 3)
	f := fleet.New(fleet.Config{Table: tab})
	c := &pairChooser{table: tab, fleet: f, keyHeaders: keyHeadersOf([]string{"X-Session-ID"})}
	ctx := context.Background()

	first, err := c.Choose(ctx, keyed("s1", "a"), 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	if ws[first.Prefill.Slot].Stats.Pending() != 1 || ws[first.Decode.Slot].Stats.Pending() != 1 || first.Prefill.BootstrapPort != 8998 {
		t.Fatalf("pair %v not counted (%+v)", first, first)
	}
	// The same key, another prompt: the same prefill; the decode is
	// another (the first one has a request).
	again, _ := c.Choose(ctx, keyed("s1", "b"), 0, nil)
	if again.Prefill != first.Prefill || again.Decode == first.Decode {
		t.Errorf("second turn %v after %v", again, first)
	}
	c.Release(first, false)
	c.Release(again, false)
	for _, w := range ws {
		if w.Stats.Pending() != 0 || w.Admitted() != 0 {
			t.Fatalf("slot %d: %d in flight, %d admitted after Release", w.Slot, w.Stats.Pending(), w.Admitted())
		}
	}
	// No key: the prompt decides, the same for a GRPO group's samples.
	g1, _ := c.Choose(ctx, keyed("", "group prompt"), 0, nil)
	g2, _ := c.Choose(ctx, keyed("", "group prompt"), 0, nil)
	if g1.Prefill != g2.Prefill {
		t.Errorf("a group's samples on prefills %v and %v", g1.Prefill, g2.Prefill)
	}
	c.Release(g1, false)
	c.Release(g2, false)
	// A retry avoids the failed pair's sides.
	r, _ := c.Choose(ctx, keyed("s1", "a"), 1, &first)
	if r.Prefill == first.Prefill || r.Decode == first.Decode {
		t.Errorf("retry %v on a side of the failed %v", r, first)
	}
	c.Release(r, true)
	// Weight versions: a pair's sides agree.
	f.SetVersion(ws[0].URL, "v2")
	f.SetVersion(ws[1].URL, "v1")
	f.SetVersion(ws[2].URL, "v1")
	f.SetVersion(ws[3].URL, "v1")
	f.SetVersion(ws[4].URL, "v1")
	f.SetVersion(ws[5].URL, "v2")
	for i := 0; i < 8; i++ {
		p, err := c.Choose(ctx, keyed(fmt.Sprint("k", i), "x"), 0, nil)
		if err != nil {
			t.Fatal(err)
		}
		if f.Version(p.Prefill.URL) != f.Version(p.Decode.URL) {
			t.Errorf("pair %v across versions %q and %q", p, f.Version(p.Prefill.URL), f.Version(p.Decode.URL))
		}
		c.Release(p, false)
	}
	// No healthy decode: no pair.
	for _, w := range ws[3:] {
		w.SetState(worker.Unhealthy)
	}
	if _, err := c.Choose(ctx, keyed("", "x"), 0, nil); err != pd.ErrNoPair {
		t.Errorf("no decode: %v", err)
	}
}

// TestPairChooserHolds: while the fleet is paused a pair is not chosen:
// Choose waits in the fleet's hold and chooses once it resumes.
func TestPairChooserHolds(t *testing.T) {
	tab, _ := chooserTable(1, 1)
	f := fleet.New(fleet.Config{Table: tab})
	c := &pairChooser{table: tab, fleet: f}
	f.SetPhase(fleet.Paused, "abort")
	got := make(chan error, 1)
	go func() {
		p, err := c.Choose(context.Background(), keyed("", "x"), 0, nil)
		if err == nil {
			c.Release(p, false)
		}
		got <- err
	}()
	testenv.WaitFor(t, "Choose in the hold", func() bool { return f.HeldNow() == 1 })
	select {
	case err := <-got:
		t.Fatalf("chose while paused: %v", err)
	default:
	}
	f.SetPhase(fleet.Serving, "")
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	// One pair returned: counted once; a probe's pair is not counted.
	if p, err := c.pick(context.Background(), keyed("", "x"), nil, false); err != nil {
		t.Fatal(err)
	} else {
		c.Release(p, false)
	}
	var sum uint64
	for i := range c.by {
		sum += c.by[i].Load()
	}
	if sum != 1 {
		t.Fatalf("choices counted %d, want 1 (the probe's not counted)", sum)
	}
}

// TestPairChooserSpreadsGroups: keyless prompts that share a long system
// prompt are groups of their own, spread over the prefills (each group's
// samples together); and with two prefills, one holding every request in
// flight spills (a bound of twice the average never would: one prefill
// with all the load is at twice the average of two).
func TestPairChooserSpreadsGroups(t *testing.T) {
	tab, ws := chooserTable(2, 2)
	c := &pairChooser{table: tab, keyHeaders: keyHeadersOf([]string{"X-Session-ID"})}
	ctx := context.Background()
	system := strings.Repeat("You are a careful assistant. ", 200) // 5,800 bytes
	used := map[int]int{}
	for g := 0; g < 16; g++ {
		prompt := system + fmt.Sprintf("Problem %d: add %d and %d.", g, g, 2*g)
		var first pd.Pair
		for s := 0; s < 4; s++ {
			p, err := c.Choose(ctx, keyed("", prompt), 0, nil)
			if err != nil {
				t.Fatal(err)
			}
			if s == 0 {
				first = p
				used[p.Prefill.Slot]++
			} else if p.Prefill != first.Prefill {
				t.Errorf("group %d: sample %d on prefill %d, sample 0 on %d", g, s, p.Prefill.Slot, first.Prefill.Slot)
			}
			c.Release(p, false)
		}
	}
	if len(used) != 2 {
		t.Errorf("16 groups behind one system prompt on prefills %v: want both", used)
	}

	// One key, its requests held: past 1.25 times the average plus 2 the
	// other prefill takes them.
	var held []pd.Pair
	spilled := false
	for i := 0; i < 12 && !spilled; i++ {
		p, err := c.Choose(ctx, keyed("hot", "x"), 0, nil)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, p)
		spilled = p.Prefill != held[0].Prefill
	}
	if !spilled {
		t.Errorf("12 requests in flight on prefill %d, none spilled to the other (in flight %d, %d)", held[0].Prefill.Slot, ws[0].Stats.Pending(), ws[1].Stats.Pending())
	}
	for _, p := range held {
		c.Release(p, false)
	}
}
