package route

import (
	"fmt"
	"strings"
	"testing"

	"github.com/tether-rl/tether/userspace/kvindex"
)

// PeekMore asks for more body while every full block read is held by
// some engine and the prompt goes on past the bytes read, or while the
// bytes read hold neither the token-id list's end nor
// kvindex.CreditWindow of it (the prompt's identity, its credits' key,
// would depend on how much arrived); a credit (siblings of a request
// placed moments ago) never makes it ask by itself.
func TestPeekMore(t *testing.T) {
	rt, _, x, ids := prefixRouter(t, 3)
	held := tokenRun(1000, 2000) // 125 blocks on engine 1
	storeOn(x, ids[1], held, 0)
	long := idsBody(append(append([]uint32{}, held...), tokenRun(50000, 400)...))
	cold := idsBody(tokenRun(90000, 3000))
	heldEnd := strings.Index(long, "50000,")
	window := idsBody(tokenRun(200000, 12000)) // 84 KiB of ids
	// A cold prompt placed: its engine is credited with its blocks.
	if req, body := genReq(t, cold); rt.Route(req, body).Reason != ReasonKVPrefix {
		t.Fatal("the cold prompt was not placed by the index")
	}
	for _, tc := range []struct {
		name string
		body string
		cut  int // bytes of it buffered
		more bool
	}{
		{"held so far", long, 3000, true},
		{"held to the last byte read", long, heldEnd - 1, true},
		{"past the held prefix, the list's end unread", long, heldEnd + 400, true},
		{"whole prompt read", long, len(long) - 10, false},
		{"whole body", long, len(long), false},
		{"held by none, the list's end unread", idsBody(tokenRun(70000, 3000)), 3000, true},
		{"held by none, the list's end read", idsBody(tokenRun(70000, 300)), len(idsBody(tokenRun(70000, 300))) - 10, false},
		{"held by none, the window read", window, kvindex.CreditWindow + 600, false},
		{"a credited sibling, the list's end unread", cold, 3000, true},
		{"a credited sibling, the list's end read", cold, len(cold) - 10, false},
		{"text prompt", `{"text":"` + strings.Repeat("a", 5000) + `"}`, 3000, false},
		{"not JSON", strings.Repeat("x", 5000), 3000, false},
	} {
		req, body := genReq(t, tc.body)
		got := rt.PeekMore(req, body[:tc.cut])
		if tc.more && got != 2*tc.cut || !tc.more && got != 0 {
			t.Errorf("%s: PeekMore of %d bytes = %d (want more: %v)", tc.name, tc.cut, got, tc.more)
		}
	}
	// Without placement by the caches: never more.
	rt.SetPrefixPlacement(nil)
	req, body := genReq(t, long)
	if got := rt.PeekMore(req, body[:3000]); got != 0 {
		t.Fatalf("prefix placement off: %d", got)
	}
}

// BenchmarkPeekMore: the question asked each time the bytes asked for are
// in, for the first 16 KiB of a 4,096-token prompt that one of 8 engines
// holds (a scan from the body's start: asking twice as many bytes each
// time keeps a request's scans within twice its body's bytes).
func BenchmarkPeekMore(b *testing.B) {
	rt, ws := engineRouter(b, 8, PolicyHash, EngineConfig{})
	x := kvindex.New(kvindex.Config{})
	p, err := NewPrefixPlacement(PrefixConfig{Index: x})
	if err != nil {
		b.Fatal(err)
	}
	rt.SetPrefixPlacement(p)
	for i, w := range ws {
		id, _ := x.Register(fmt.Sprint(i))
		p.SetEngines(w.Slot, []kvindex.EngineID{id})
		if i == 3 {
			storeOn(x, id, tokenRun(100000, 4096), 0)
		}
	}
	toks := tokenRun(100000, 4096)
	req, body := genReq(b, idsBody(toks))
	body = body[:16<<10]
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for i := 0; i < b.N; i++ {
		if rt.PeekMore(req, body) == 0 {
			b.Fatal("no more asked")
		}
	}
}
