package kvindex

import (
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"

	"github.com/tether-rl/tether/userspace/kvevents"
)

// engineSim stands for an engine's prefix cache: it announces the full
// blocks of prompts with its own (random-rooted) block hashes, as vLLM
// does, so the index must rely on token ids alone.
type engineSim struct {
	bs    int
	root  uint64
	known map[uint64]uint64 // token prefix (rolling hash) -> engine hash
}

func newEngineSim(bs int, seed uint64) *engineSim {
	return &engineSim{bs: bs, root: seed*0x9e3779b97f4a7c15 + 1, known: map[uint64]uint64{}}
}

// prefixIDs returns a rolling id of each full block's prefix (the test's
// own, unrelated to the index's hash).
func (s *engineSim) prefixIDs(t []uint32) []uint64 {
	var out []uint64
	h := uint64(14695981039346656037)
	for i, x := range t {
		h = (h ^ uint64(x)) * 1099511628211
		if (i+1)%s.bs == 0 {
			out = append(out, h)
		}
	}
	return out
}

// store returns the BlockStored event for the full blocks of tokens not
// announced yet (nil when none).
func (s *engineSim) store(tokens []uint32) *kvevents.Event {
	ev := &kvevents.Event{Kind: kvevents.Stored, BlockSize: s.bs}
	for i, p := range s.prefixIDs(tokens) {
		if h, ok := s.known[p]; ok {
			if len(ev.Hashes) > 0 {
				break // known after new ones: not from one prompt
			}
			ev.Parent, ev.HasParent = h, true
			continue
		}
		h := fmix(s.root ^ uint64(len(s.known)+1)*0x1234567)
		s.known[p] = h
		ev.Hashes = append(ev.Hashes, h)
		ev.Tokens = append(ev.Tokens, tokens[i*s.bs:(i+1)*s.bs]...)
	}
	if len(ev.Hashes) == 0 {
		return nil
	}
	return ev
}

func (s *engineSim) hashOf(tokens []uint32) uint64 {
	ids := s.prefixIDs(tokens)
	return s.known[ids[len(ids)-1]]
}

func body(tokens []uint32, extra string) []byte {
	var b strings.Builder
	b.WriteString(`{"rid":"x",` + extra + `"input_ids":[`)
	for i, t := range tokens {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(strconv.Itoa(int(t)))
	}
	b.WriteString(`],"sampling_params":{"max_new_tokens":8}}`)
	return []byte(b.String())
}

func toks(rng *rand.Rand, n int) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = uint32(rng.IntN(150000))
	}
	return t
}

func TestIndexSemantics(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	sys := toks(rng, 64)
	a := append(append([]uint32(nil), sys...), toks(rng, 40)...) // 6 full blocks of 16, 8 left
	b := append(append([]uint32(nil), sys...), toks(rng, 32)...)

	x := New(Config{})
	e0, _ := x.Register("e0")
	e1, _ := x.Register("e1")
	s0, s1 := newEngineSim(16, 1), newEngineSim(16, 2)

	var m Match
	if !x.Scan(body(a, ""), -1, &m) || m.Engines != 0 || m.BlockSize != provisionalBlockSize {
		t.Fatalf("before any event: %+v", m)
	}
	x.Apply(e0, []kvevents.Event{*s0.store(a)})
	x.Apply(e1, []kvevents.Event{*s1.store(sys)})
	check := func(name string, tokens []uint32, want0, want1 int) {
		t.Helper()
		if !x.Scan(body(tokens, ""), -1, &m) {
			t.Fatalf("%s: no token ids found", name)
		}
		if m.Matched(e0) != want0 || m.Matched(e1) != want1 {
			t.Fatalf("%s: matched e0 %d e1 %d, want %d %d", name, m.Matched(e0), m.Matched(e1), want0, want1)
		}
	}
	check("stored", a, 96, 64)
	check("other question", b, 64, 64)

	// The parent is the engine's hash: b's question blocks chain on sys.
	x.Apply(e1, []kvevents.Event{*s1.store(b)})
	check("stored with a parent", b, 64, 96)

	// Removal of e0's last block of a.
	x.Apply(e0, []kvevents.Event{{Kind: kvevents.Removed, Hashes: []uint64{s0.hashOf(a[:96])}}})
	check("removed", a, 80, 64)
	// An offload tier's removal does not touch the device cache.
	x.Apply(e0, []kvevents.Event{{Kind: kvevents.Removed, Hashes: []uint64{s0.hashOf(a[:16])}, Medium: "CPU"}})
	check("removed from CPU", a, 80, 64)

	// AllBlocksCleared clears one engine.
	x.Apply(e1, []kvevents.Event{{Kind: kvevents.Cleared}})
	check("cleared", a, 80, 0)
	if st, _ := x.Engine(e1); st.Blocks != 0 || st.Cleared != 1 {
		t.Fatalf("e1 after clear: %+v", st)
	}

	// A restart (Clear by the subscriber) then a refill.
	x.Clear(e0)
	check("restarted", a, 0, 0)
	s0 = newEngineSim(16, 3)
	x.Apply(e0, []kvevents.Event{*s0.store(sys)})
	check("refilled", a, 64, 0)

	// An orphan (parent never announced) is counted, not indexed.
	orphan := kvevents.Event{Kind: kvevents.Stored, Hashes: []uint64{99}, Parent: 12345, HasParent: true, Tokens: a[:16], BlockSize: 16}
	x.Apply(e0, []kvevents.Event{orphan})
	// Another block size is counted, not indexed.
	x.Apply(e0, []kvevents.Event{{Kind: kvevents.Stored, Hashes: []uint64{98}, Tokens: a[:32], BlockSize: 32}})
	st := x.Stats()
	if st.Orphans != 1 || st.Mismatched != 1 || st.Entries != 4 || st.Keys != 4 {
		t.Fatalf("stats %+v", st)
	}

	// Unregister frees the id and the entries.
	x.Unregister(e0)
	if st := x.Stats(); st.Entries != 0 || st.Keys != 0 {
		t.Fatalf("after unregister: %+v", st)
	}
}

func TestIndexCap(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	x := New(Config{MaxEntries: 10})
	e0, _ := x.Register("e0")
	s := newEngineSim(4, 1)
	x.Apply(e0, []kvevents.Event{*s.store(toks(rng, 4*8))})
	x.Apply(e0, []kvevents.Event{*s.store(toks(rng, 4*8))})
	st := x.Stats()
	if st.Entries != 10 || st.CapDrops != 1 {
		t.Fatalf("at the cap: %+v", st)
	}
	if b, _ := x.Engine(e0); b.Blocks != 10 {
		t.Fatalf("engine blocks %d", b.Blocks)
	}
}

func TestRegisterFull(t *testing.T) {
	x := New(Config{})
	for i := 0; i < MaxEngines; i++ {
		if _, err := x.Register(fmt.Sprint(i)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := x.Register("one more"); err != ErrFull {
		t.Fatalf("err %v", err)
	}
	id, _ := x.Register("7")
	if id != 7 {
		t.Fatalf("existing name: id %d", id)
	}
}

func TestTableDelete(t *testing.T) {
	// Random inserts and deletes against a map, through grow and
	// backward-shift deletion with colliding home slots.
	rng := rand.New(rand.NewPCG(5, 6))
	tb := newTable(64)
	ref := map[uint64]uint64{}
	for i := 0; i < 20000; i++ {
		k := uint64(rng.IntN(300))<<1 | 1
		k |= uint64(rng.IntN(4)) << 40 // same low bits: collisions
		if rng.IntN(3) == 0 {
			tb.andNot(k, ^uint64(0))
			delete(ref, k)
		} else {
			bit := uint64(1) << uint(rng.IntN(8))
			tb.or(k, bit)
			ref[k] |= bit
		}
	}
	if tb.n != len(ref) {
		t.Fatalf("n %d want %d", tb.n, len(ref))
	}
	for k, v := range ref {
		if got := tb.get(k); got != v {
			t.Fatalf("key %x: %b want %b", k, got, v)
		}
	}
}

func TestScanForms(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	a := toks(rng, 64)
	x := New(Config{})
	e0, _ := x.Register("e0")
	s := newEngineSim(16, 1)
	x.Apply(e0, []kvevents.Event{*s.store(a)})
	ids := strings.Trim(strings.ReplaceAll(fmt.Sprint(a), " ", ","), "[]")
	tests := []struct {
		name   string
		body   string
		ok     bool
		want   int
		prompt int
	}{
		{"sglang input_ids", `{"input_ids":[` + ids + `]}`, true, 64, 64},
		{"batch, first prompt", `{"input_ids":[[` + ids + `],[1,2]]}`, true, 64, 64},
		{"vllm prompt ids", `{"model":"m","prompt":[` + ids + `],"max_tokens":4}`, true, 64, 64},
		{"after other fields", `{"a":{"b":[1,"]"]},"text2":"x","input_ids":[` + ids + `]}`, true, 64, 64},
		{"text prompt", `{"prompt":"hello"}`, false, 0, 0},
		{"no prompt", `{"rid":"x"}`, false, 0, 0},
		{"not an object", `[1,2]`, false, 0, 0},
		{"negative id", `{"input_ids":[-1,2]}`, false, 0, 0},
		{"float id", `{"input_ids":[1.5,2]}`, false, 0, 0},
		{"another adapter", `{"lora_path":"l1","input_ids":[` + ids + `]}`, true, 0, 64},
		{"cut body", `{"input_ids":[` + ids[:len(ids)/2], true, -1, -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var m Match
			ok := x.Scan([]byte(tt.body), -1, &m)
			if ok != tt.ok {
				t.Fatalf("ok %v", ok)
			}
			if !ok || tt.want < 0 {
				return
			}
			if m.Matched(e0) != tt.want || m.Prompt != tt.prompt || !m.Complete {
				t.Fatalf("matched %d prompt %d complete %v", m.Matched(e0), m.Prompt, m.Complete)
			}
		})
	}
}

func TestScanLoRAAndCredit(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 10))
	a := toks(rng, 48)
	x := New(Config{})
	e0, _ := x.Register("e0")
	e1, _ := x.Register("e1")
	s := newEngineSim(16, 1)
	ev := s.store(a)
	ev.LoRA = "math"
	x.Apply(e0, []kvevents.Event{*ev})
	var m Match
	x.Scan(body(a, `"lora_path":"math",`), -1, &m)
	if m.Matched(e0) != 48 {
		t.Fatalf("lora_path: %d", m.Matched(e0))
	}
	x.Scan(body(a, `"model":"math",`), -1, &m) // vLLM names the adapter in model
	if m.Matched(e0) != 48 {
		t.Fatalf("model naming a known adapter: %d", m.Matched(e0))
	}
	x.Scan(body(a, ""), -1, &m)
	if m.Matched(e0) != 0 {
		t.Fatalf("base model matched the adapter's blocks: %d", m.Matched(e0))
	}
	// Credit: a new prompt placed on e1 is credited there for its siblings.
	b := toks(rng, 80)
	x.Scan(body(b, ""), -1, &m)
	if m.Engines != 0 {
		t.Fatalf("new prompt matched %b", m.Engines)
	}
	x.Credit(&m, e1)
	var m2 Match
	x.Scan(body(b, ""), -1, &m2)
	if m2.Matched(e1) != 80 || m2.Matched(e0) != 0 {
		t.Fatalf("sibling: e1 %d e0 %d", m2.Matched(e1), m2.Matched(e0))
	}
	x.Clear(e1)
	x.Scan(body(b, ""), -1, &m2)
	if m2.Matched(e1) != 0 {
		t.Fatalf("credit kept over a clear")
	}
}

func TestScanStopsAtFirstMiss(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	a := toks(rng, 16*100)
	x := New(Config{})
	e0, _ := x.Register("e0")
	x.Apply(e0, []kvevents.Event{*newEngineSim(16, 1).store(a[:16*40])})
	var m Match
	bb := body(a, "")
	x.Scan(bb, int64(len(bb)), &m)
	if m.Matched(e0) != 16*40 || m.NBlocks > 64 || m.Complete {
		t.Fatalf("matched %d, hashed %d blocks, complete %v", m.Matched(e0), m.NBlocks, m.Complete)
	}
	if m.Prompt < 1500 || m.Prompt > 1700 {
		t.Fatalf("prompt estimate %d, want about 1600", m.Prompt)
	}
}

func FuzzScan(f *testing.F) {
	rng := rand.New(rand.NewPCG(13, 14))
	a := toks(rng, 64)
	x := New(Config{})
	e0, _ := x.Register("e0")
	x.Apply(e0, []kvevents.Event{*newEngineSim(16, 1).store(a)})
	f.Add(body(a, ""))
	f.Add(body(a, `"lora_path":"x",`))
	f.Add([]byte(`{"input_ids":[[1,2,3],[4]],"prompt":"x"}`))
	f.Add([]byte(`{"a":"\"","prompt":[1,2`))
	f.Fuzz(func(t *testing.T, b []byte) {
		var m Match
		if !x.Scan(b, int64(len(b))+100, &m) {
			return
		}
		if m.Matched(e0) > m.NBlocks*16 || m.Tokens < m.NBlocks*16 || m.Prompt < m.Tokens {
			t.Fatalf("inconsistent match %+v", m)
		}
	})
}

// A credit claims the credited request's whole prompt only for a prompt
// of its length (a sibling); another prompt with the same start (sessions
// sharing a system prompt, nothing cached yet) is credited with the
// blocks up to the credit's key only, and is no sibling to follow.
func TestCreditOtherPromptSameStart(t *testing.T) {
	rng := rand.New(rand.NewPCG(15, 16))
	sys := toks(rng, 16*40)
	x := New(Config{})
	x.Register("e0")
	e1, _ := x.Register("e1")
	one := append(append([]uint32{}, sys...), toks(rng, 16*20)...)
	var m Match
	bb := body(one, "")
	x.Scan(bb, int64(len(bb)), &m)
	x.Credit(&m, e1)
	sib := body(one, "")
	var m2 Match
	x.Scan(sib, int64(len(sib)), &m2)
	if m2.Matched(e1) != len(one) {
		t.Fatalf("sibling credited with %d of %d", m2.Matched(e1), len(one))
	}
	other := append(append([]uint32{}, sys...), toks(rng, 16*200)...)
	ob := body(other, "")
	x.Scan(ob, int64(len(ob)), &m2)
	if m2.Credited || m2.Matched(e1) > m2.NBlocks*16 {
		t.Fatalf("other prompt, same start: credited %v with %d tokens, %d blocks hashed", m2.Credited, m2.Matched(e1), m2.NBlocks)
	}
}

// A sibling placed elsewhere (its group's engine too busy) leaves the
// credit where the group is: later samples still follow the first.
func TestCreditStaysWithGroup(t *testing.T) {
	rng := rand.New(rand.NewPCG(17, 18))
	a := toks(rng, 16*10)
	x := New(Config{})
	e0, _ := x.Register("e0")
	e1, _ := x.Register("e1")
	var m Match
	x.Scan(body(a, ""), -1, &m)
	x.Credit(&m, e1)
	var m2 Match
	x.Scan(body(a, ""), -1, &m2)
	if !m2.Credited || m2.CreditEngine != e1 {
		t.Fatalf("sibling not credited on e1: %+v", m2.CreditEngine)
	}
	if got := x.Credit(&m2, e0); got != e0 {
		t.Fatalf("a sibling placed on e0 was sent to %d", got)
	}
	var m3 Match
	x.Scan(body(a, ""), -1, &m3)
	if m3.CreditEngine != e1 || m3.Matched(e1) != len(a) || m3.Matched(e0) != 0 {
		t.Fatalf("after a sibling went elsewhere: credit on %d, e1 %d, e0 %d", m3.CreditEngine, m3.Matched(e1), m3.Matched(e0))
	}
}

// The samples of one prompt differ in their own fields only (a rid, a
// seed): bodies a few bytes apart, scanned before any engine holds their
// prompt, find the first sample's credit however their lengths fall
// against the credit key's length buckets (keyed by the body's length,
// with the neighbouring bucket looked at; keyed by an estimate of the
// prompt's tokens, a few bytes moved it to another bucket).
func TestCreditSiblingsOfSlightlyOtherLengths(t *testing.T) {
	rng := rand.New(rand.NewPCG(19, 20))
	for n := 16 * 50; n < 16*52; n++ {
		testCreditSiblings(t, toks(rng, n))
	}
}

func testCreditSiblings(t *testing.T, a []uint32) {
	for d := 0; d < lengthBucket/2; d++ {
		x := New(Config{})
		x.Register("e0")
		e1, _ := x.Register("e1")
		var m Match
		first := body(a, `"seed":1,`)
		x.Scan(first, int64(len(first)), &m)
		x.Credit(&m, e1)
		// Its own field after the token ids (where the estimate of the
		// prompt's tokens past the bytes scanned sees it).
		sib := append(first[:len(first)-1:len(first)-1], `,"seed":`+strconv.Itoa(1+d)+`,"pad":"`+strings.Repeat(" ", d)+`"}`...)
		if len(sib)-len(first) >= lengthBucket/2 {
			break
		}
		var m2 Match
		x.Scan(sib, int64(len(sib)), &m2)
		if !m2.Credited || m2.CreditEngine != e1 {
			t.Fatalf("%d tokens, a sibling %d bytes longer: credited %v on %d", len(a), len(sib)-len(first), m2.Credited, m2.CreditEngine)
		}
	}
}

// A credit is keyed by the prompt's identity, not by where the scan
// stopped: a sibling arriving after the group's engine published the
// prompt's blocks reads the whole prompt, where the first sample stopped
// at its first block, and still finds the group's credit. Prompts that
// share a system prompt and a body length (a GRPO wave's, scanned cold:
// every scan stops at the system prompt's first block) are no siblings.
func TestCreditIdentity(t *testing.T) {
	rng := rand.New(rand.NewPCG(21, 22))
	sys := toks(rng, 16*64)
	x := New(Config{})
	e0, _ := x.Register("e0")
	e1, _ := x.Register("e1")
	e2, _ := x.Register("e2")
	s := newEngineSim(16, 1)
	x.Apply(e0, []kvevents.Event{*s.store(toks(rng, 32))}) // the block size known
	mk := func() []uint32 {
		q := make([]uint32, 200)
		for i := range q {
			q[i] = 100000 + uint32(rng.IntN(9000)) // ids of one width: equal bodies
		}
		return append(append([]uint32{}, sys...), q...)
	}
	a, b := mk(), mk()
	ba, bb := body(a, ""), body(b, "")
	if len(ba) != len(bb) {
		t.Fatalf("bodies of %d and %d bytes", len(ba), len(bb))
	}
	var m Match
	x.Scan(ba, int64(len(ba)), &m)
	if !m.Stopped || m.NBlocks != 1 {
		t.Fatalf("cold scan: stopped %v after %d blocks", m.Stopped, m.NBlocks)
	}
	x.Credit(&m, e1)
	// Another prompt, the same start and length: not a sibling.
	var mb Match
	x.Scan(bb, int64(len(bb)), &mb)
	if mb.Credited || mb.Matched(e1) != 0 {
		t.Fatalf("another prompt of the wave credited on e1 (%v, %d tokens)", mb.Credited, mb.Matched(e1))
	}
	if got := x.Credit(&mb, e2); got != e2 {
		t.Fatalf("another prompt of the wave sent to %d, the first prompt's engine", got)
	}
	// The group's engine publishes the prompt: a later sibling reads it
	// whole, and still finds its group's credit.
	x.Apply(e1, []kvevents.Event{*s.store(a)})
	var m2 Match
	sib := body(a, `"seed":7,`)
	x.Scan(sib, int64(len(sib)), &m2)
	if m2.Stopped || !m2.Complete {
		t.Fatalf("a sibling after the events: stopped %v complete %v", m2.Stopped, m2.Complete)
	}
	if !m2.Credited || m2.CreditEngine != e1 || m2.Siblings != 1 {
		t.Fatalf("a sibling after the events: credited %v on %d, %d siblings", m2.Credited, m2.CreditEngine, m2.Siblings)
	}
	_ = e0
}

// SharedPrefix: the deepest held prefix of a prompt is shared once
// another prompt's deepest held prefix was the same within the window;
// a sibling (the same prompt) or a prompt holding a deeper prefix of its
// own is not.
func TestSharedPrefix(t *testing.T) {
	rng := rand.New(rand.NewPCG(23, 24))
	sys := toks(rng, 16*8)
	x := New(Config{})
	e0, _ := x.Register("e0")
	s := newEngineSim(16, 1)
	x.Apply(e0, []kvevents.Event{*s.store(sys)})
	scan := func(p []uint32) *Match {
		var m Match
		b := body(p, "")
		x.Scan(b, int64(len(b)), &m)
		return &m
	}
	p1 := append(append([]uint32{}, sys...), toks(rng, 40)...)
	p2 := append(append([]uint32{}, sys...), toks(rng, 40)...)
	if x.SharedPrefix(scan(p1)) {
		t.Fatal("the first prompt's prefix is shared")
	}
	if x.SharedPrefix(scan(p1)) {
		t.Fatal("a sibling's prefix is shared")
	}
	if !x.SharedPrefix(scan(p2)) {
		t.Fatal("another prompt holding the same system prompt: not shared")
	}
	// A session's own context, deeper than the system prompt.
	x.Apply(e0, []kvevents.Event{*s.store(p1)})
	turn := append(append([]uint32{}, p1...), toks(rng, 40)...)
	if x.SharedPrefix(scan(turn)) {
		t.Fatal("a session's own context is shared")
	}
	// Nothing held: never shared.
	if x.SharedPrefix(scan(toks(rng, 64))) || x.SharedPrefix(scan(toks(rng, 64))) {
		t.Fatal("prompts holding nothing share a prefix")
	}
}

// GroupSize learns the samples per prompt from the keyless requests
// credited, and Pending counts, on a group's engine, the samples still
// expected of it: one fewer with each sibling placed (on the engine or,
// its engine too busy, elsewhere); keyed (Strict) requests count for
// neither.
func TestGroupSizeAndPending(t *testing.T) {
	rng := rand.New(rand.NewPCG(25, 26))
	x := New(Config{})
	e0, _ := x.Register("e0")
	e1, _ := x.Register("e1")
	if g := x.GroupSize(); g != 1 {
		t.Fatalf("no requests yet: group size %v", g)
	}
	place := func(p []uint32, id EngineID, strict bool) EngineID {
		var m Match
		b := body(p, "")
		x.Scan(b, int64(len(b)), &m)
		if strict {
			m.Strict = true
			m.DropSibling()
		}
		return x.Credit(&m, id)
	}
	for g := 0; g < 20; g++ {
		p := toks(rng, 64)
		for s := 0; s < 4; s++ {
			place(p, e0, false)
		}
	}
	if g := x.GroupSize(); g < 3.9 || g > 4.1 {
		t.Fatalf("groups of 4: group size %v", g)
	}
	if p := x.Pending(e0); p > 0.5 {
		t.Fatalf("every group complete: %v pending", p)
	}
	p := toks(rng, 64)
	place(p, e1, false)
	if got := x.Pending(e1); got < 2.5 || got > 3.01 {
		t.Fatalf("a new group's first sample: %v pending, want about 3", got)
	}
	place(p, e1, false)
	place(p, e0, false) // a sibling placed elsewhere still arrived
	if got := x.Pending(e1); got < 0.5 || got > 1.01 {
		t.Fatalf("two siblings in: %v pending, want about 1", got)
	}
	before := x.GroupSize()
	for i := 0; i < 10; i++ {
		place(toks(rng, 64), e0, true)
	}
	if x.GroupSize() != before || x.Pending(e0) > 0.5 {
		t.Fatalf("keyed requests moved the group size (%v to %v) or pending (%v)", before, x.GroupSize(), x.Pending(e0))
	}
}
