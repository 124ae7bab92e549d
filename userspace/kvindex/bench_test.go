package kvindex

import (
	"math/rand/v2"
	"runtime"
	"syscall"
	"testing"

	"github.com/tether-rl/tether/userspace/kvevents"
)

// benchIndex: 8 engines, each holding 2,000 prompts' blocks (sessions of
// 4,096 tokens sharing 1,024 of system prompt), the looked-up prompt held
// whole by one engine and its first half by another.
func benchIndex(b *testing.B) (*Index, []uint32) {
	rng := rand.New(rand.NewPCG(1, 1))
	x := New(Config{})
	sys := toks(rng, 1024)
	var ids [8]EngineID
	for e := range ids {
		ids[e], _ = x.Register(string(rune('a' + e)))
		s := newEngineSim(16, uint64(e))
		for p := 0; p < 250; p++ {
			t := append(append([]uint32(nil), sys...), toks(rng, 3072)...)
			x.Apply(ids[e], []kvevents.Event{*s.store(t)})
		}
	}
	prompt := append(append([]uint32(nil), sys...), toks(rng, 3072)...)
	x.Apply(ids[3], []kvevents.Event{*newEngineSim(16, 99).store(prompt)})
	x.Apply(ids[5], []kvevents.Event{*newEngineSim(16, 98).store(prompt[:2048])})
	return x, prompt
}

// BenchmarkLookup4096: the lookup of a 4,096-token prompt's ids (hash
// every block, walk the index) with 8 engines' events indexed.
func BenchmarkLookup4096(b *testing.B) {
	x, prompt := benchIndex(b)
	salt := uint64(0)
	var m Match
	b.ReportAllocs()
	b.ResetTimer()
	cpu := threadCPU()
	for i := 0; i < b.N; i++ {
		x.lookupTokens(prompt, salt, &m)
	}
	b.ReportMetric(float64(threadCPU()-cpu)/float64(b.N), "cpu-ns/op")
	if m.Matched(3) != 4096 || m.Matched(5) != 2048 {
		b.Fatalf("matched %d %d", m.Matched(3), m.Matched(5))
	}
}

// BenchmarkScanBody4096: the same prompt read from a JSON body (input_ids,
// ~ 27 KB): the JSON digits dominate.
func BenchmarkScanBody4096(b *testing.B) {
	x, prompt := benchIndex(b)
	bb := body(prompt, "")
	b.SetBytes(int64(len(bb)))
	var m Match
	b.ReportAllocs()
	b.ResetTimer()
	cpu := threadCPU()
	for i := 0; i < b.N; i++ {
		x.Scan(bb, int64(len(bb)), &m)
	}
	b.ReportMetric(float64(threadCPU()-cpu)/float64(b.N), "cpu-ns/op")
	if m.Matched(3) != 4096 {
		b.Fatalf("matched %d", m.Matched(3))
	}
}

// BenchmarkScanBodyCold4096: a 4,096-token body that no engine holds
// past its 1,024-token system prompt (a new prompt): the reading stops
// at the first batch of 32 blocks past it.
func BenchmarkScanBodyCold4096(b *testing.B) {
	x, prompt := benchIndex(b)
	rng := rand.New(rand.NewPCG(5, 5))
	cold := append(append([]uint32(nil), prompt[:1024]...), toks(rng, 3072)...)
	bb := body(cold, "")
	b.SetBytes(int64(len(bb)))
	var m Match
	b.ReportAllocs()
	b.ResetTimer()
	cpu := threadCPU()
	for i := 0; i < b.N; i++ {
		x.Scan(bb, int64(len(bb)), &m)
	}
	b.ReportMetric(float64(threadCPU()-cpu)/float64(b.N), "cpu-ns/op")
	if m.Matched(0) != 1024 || !m.Stopped {
		b.Fatalf("matched %d, stopped %v", m.Matched(0), m.Stopped)
	}
}

// TestMemoryPerBlock measures the index's heap per cached block per
// engine: 8 engines × 32,000 blocks, half shared.
func TestMemoryPerBlock(t *testing.T) {
	if testing.Short() {
		t.Skip("allocates ~20 MB")
	}
	rng := rand.New(rand.NewPCG(2, 2))
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	x := New(Config{})
	shared := toks(rng, 16*16000)
	for e := 0; e < 8; e++ {
		id, _ := x.Register(string(rune('a' + e)))
		s := newEngineSim(16, uint64(e))
		ev := s.store(shared)
		x.Apply(id, []kvevents.Event{*ev})
		ev = s.store(toks(rng, 16*16000))
		x.Apply(id, []kvevents.Event{*ev})
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	st := x.Stats()
	per := float64(after.HeapAlloc-before.HeapAlloc) / float64(st.Entries)
	t.Logf("index heap per engine × block: %.1f bytes (%d entries, %d keys; Stats.Bytes estimate %.1f/entry)",
		per, st.Entries, st.Keys, float64(st.Bytes)/float64(st.Entries))
	if per > 120 {
		t.Fatalf("%.1f bytes per engine × block", per)
	}
	runtime.KeepAlive(x)
}

// threadCPU is the calling thread's CPU time in ns (RUSAGE_THREAD): on a
// shared, loaded machine the wall time per op counts other processes'
// turns, the CPU time does not.
func threadCPU() int64 {
	runtime.LockOSThread()
	var ru syscall.Rusage
	syscall.Getrusage(1 /* RUSAGE_THREAD */, &ru)
	return ru.Utime.Nano() + ru.Stime.Nano()
}
