package fakeengine

import (
	"bytes"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/kvevents"
	"github.com/tether-rl/tether/userspace/kvindex"
)

// indexHandler feeds a subscriber's batches into an index.
type indexHandler struct {
	x  *kvindex.Index
	id kvindex.EngineID
	mu sync.Mutex
	n  int
}

func (h *indexHandler) Apply(b *kvevents.Batch) {
	h.x.Apply(h.id, b.Events)
	h.mu.Lock()
	h.n++
	h.mu.Unlock()
}
func (h *indexHandler) Clear(kvevents.ClearReason) { h.x.Clear(h.id) }

func idsBody(ids []int, maxNew int) string {
	var b strings.Builder
	b.WriteString(`{"input_ids":[`)
	for i, t := range ids {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprint(&b, t)
	}
	fmt.Fprintf(&b, `],"sampling_params":{"max_new_tokens":%d}}`, maxNew)
	return b.String()
}

// TestKVEventsIndexed: the fake engine's events, in each form, build an
// index that matches exactly what its prefix cache holds: a prompt's blocks
// once admitted, its output's once done, none after a flush, none after a
// restart.
func TestKVEventsIndexed(t *testing.T) {
	for _, ec := range []KVEventsConfig{
		{Form: kvevents.ArrayForm, Hashes: kvevents.HashUint, Replay: true},
		{Form: kvevents.MapForm, Hashes: kvevents.HashInt, Replay: true, TopicInReplies: true},
		{Form: kvevents.MapForm, Hashes: kvevents.HashBytes},
	} {
		t.Run(fmt.Sprintf("form%d-hash%d", ec.Form, ec.Hashes), func(t *testing.T) {
			e, err := Start(Config{BlockTokens: 4, KVBlocks: 64, KVEvents: &ec})
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close()
			x := kvindex.New(kvindex.Config{})
			id, _ := x.Register("e")
			h := &indexHandler{x: x, id: id}
			s, err := kvevents.Start(kvevents.Config{Endpoint: e.KVEventsEndpoint(), Replay: e.KVEventsReplayEndpoint()}, h)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			testenv.WaitFor(t, "subscribed", func() bool { return e.KVEventsSubscribers() == 1 })

			prompt := make([]int, 18) // 4 full blocks and 2 tokens
			for i := range prompt {
				prompt[i] = 100 + i
			}
			resp, err := http.Post(e.URL()+"/generate", "application/json", strings.NewReader(idsBody(prompt, 6)))
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			// 18 + 6 = 24 tokens: 6 full blocks once the output is in.
			testenv.WaitFor(t, "6 blocks indexed", func() bool { st, _ := x.Engine(id); return st.Blocks == 6 })
			var m kvindex.Match
			body := []byte(idsBody(prompt, 6))
			if !x.Scan(body, int64(len(body)), &m) || m.Matched(id) != 16 {
				t.Fatalf("matched %d of the prompt, want 16", m.Matched(id))
			}
			// A flush: AllBlocksCleared.
			resp, err = http.Post(e.URL()+"/flush_cache", "application/json", bytes.NewReader(nil))
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			testenv.WaitFor(t, "cleared", func() bool { st, _ := x.Engine(id); return st.Blocks == 0 })
			// Fill again, then restart the process: gone without a word
			// from the engine.
			resp, _ = http.Post(e.URL()+"/generate", "application/json", strings.NewReader(idsBody(prompt, 6)))
			resp.Body.Close()
			testenv.WaitFor(t, "refilled", func() bool { st, _ := x.Engine(id); return st.Blocks == 6 })
			e.Restart()
			testenv.WaitFor(t, "restart cleared", func() bool { st, _ := x.Engine(id); return st.Blocks == 0 })
			if st := s.Stats(); st.Lost != 1 {
				t.Fatalf("subscriber %+v", st)
			}
		})
	}
}

// TestKVEventsEviction: blocks the engine evicts leave the index.
func TestKVEventsEviction(t *testing.T) {
	e, err := Start(Config{BlockTokens: 4, KVBlocks: 8, KVEvents: &KVEventsConfig{}})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	x := kvindex.New(kvindex.Config{})
	id, _ := x.Register("e")
	s, err := kvevents.Start(kvevents.Config{Endpoint: e.KVEventsEndpoint()}, &indexHandler{x: x, id: id})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	testenv.WaitFor(t, "subscribed", func() bool { return e.KVEventsSubscribers() == 1 })
	for p := 0; p < 4; p++ {
		prompt := make([]int, 16)
		for i := range prompt {
			prompt[i] = 1000*p + i
		}
		resp, err := http.Post(e.URL()+"/generate", "application/json", strings.NewReader(idsBody(prompt, 1)))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	testenv.WaitFor(t, "index as big as the cache", func() bool {
		st, _ := x.Engine(id)
		return st.Blocks == int64(e.Stats().CachedBlocks) && st.Removed > 0
	})
}
