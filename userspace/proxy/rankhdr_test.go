package proxy

import (
	"testing"

	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/worker"
)

// TestRankHeader: a decision on one rank of a worker with several names
// the rank upstream in the header its engine reads (vLLM), and only then.
func TestRankHeader(t *testing.T) {
	vllm, sgl, unknown := &worker.Worker{Slot: 1}, &worker.Worker{Slot: 2}, &worker.Worker{Slot: 3}
	vllm.SetEngine(dialect.VLLM)
	sgl.SetEngine(dialect.SGLang)
	s := &Server{}
	for _, tc := range []struct {
		name string
		d    route.Decision
		want string
	}{
		{"vllm rank 2 of 4", route.Decision{Worker: vllm, Reason: route.ReasonKVPrefix, Rank: 2, Ranks: 4}, "X-data-parallel-rank: 2\r\n"},
		{"vllm rank 0 of 2", route.Decision{Worker: vllm, Reason: route.ReasonKVPrefix, Rank: 0, Ranks: 2}, "X-data-parallel-rank: 0\r\n"},
		{"vllm one rank", route.Decision{Worker: vllm, Reason: route.ReasonKVPrefix, Rank: 0, Ranks: 1}, ""},
		{"vllm no rank known", route.Decision{Worker: vllm, Reason: route.ReasonKVPrefix, Rank: -1, Ranks: 2}, ""},
		{"vllm other rule", route.Decision{Worker: vllm, Reason: route.ReasonSpread}, ""},
		{"sglang (body field)", route.Decision{Worker: sgl, Reason: route.ReasonKVPrefix, Rank: 1, Ranks: 2}, ""},
		{"engine unknown", route.Decision{Worker: unknown, Reason: route.ReasonKVPrefix, Rank: 1, Ranks: 2}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := string(appendRankHeader(nil, tc.d.Worker, s.routeNote(tc.d)))
			if got != tc.want {
				t.Fatalf("got %q, want %q", got, tc.want)
			}
		})
	}
	// The route header's own note is unchanged by the rank.
	s.cfg.RouteHeader = "X-Tether-Route"
	n := s.routeNote(route.Decision{Worker: vllm, Reason: route.ReasonKVPrefix, Matched: 48, Rank: 3, Ranks: 4})
	if !n.set || !n.ranked || n.rank != 3 || n.matched != 48 || n.slot != 1 {
		t.Fatalf("note %+v", n)
	}
	buf := make([]byte, 0, 64)
	if a := testing.AllocsPerRun(100, func() { buf = appendRankHeader(buf[:0], vllm, n) }); a != 0 {
		t.Fatalf("%v allocations", a)
	}
}
