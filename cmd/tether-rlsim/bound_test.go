package main

import (
	"strings"
	"testing"
	"time"
)

// TestBoundsOf checks a small sessions workload's bounds by hand: one
// session of two turns on one engine, one-token blocks.
func TestBoundsOf(t *testing.T) {
	c := config{engines: 1, blockToks: 1, kvBlocks: 1, sysTokens: 4, decode: time.Millisecond, prefillPer: time.Microsecond}
	sys := []int{1, 2, 3, 4}
	plans := []sessionPlan{{task: []int{5, 6}, tools: [][]int{{7}, {8}}, maxNew: []int{3, 2}}}
	costs := sessionCosts(c, sys, plans)
	// Turn 0: prompt 6 (system 4 + task 2), 2 computed, 3 out; turn 1:
	// prompt 6+3+1 = 10, 1 computed (the tool token), 2 out; at its end
	// the session holds 10+2-4 = 8 tokens of its own.
	if want := (sessionCost{steps: 5, prefill: 3, prompt: 16, final: 8}); costs[0] != want {
		t.Fatalf("costs %+v, want %+v", costs[0], want)
	}
	b := boundsOf(c, costs)
	if b.prefill != 7 || b.prompt != 16 || b.kvNeed != 12 || b.kvHave != 16 {
		t.Fatalf("bounds %+v: want prefill 7 (3 + the system prompt once), prompt 16, kvNeed 12, kvHave 16", b)
	}
	if b.alone != 5*time.Millisecond+3*time.Microsecond {
		t.Fatalf("alone %v", b.alone)
	}
	var out strings.Builder
	printBounds(&out, "keyless", b, []string{"kv"}, []time.Duration{10 * time.Millisecond})
	for _, want := range []string{"prefix hit at best 0.562", "at their ends 12 tokens, the fleet's caches 16 (0.75×)"} {
		if !strings.Contains(out.String(), want) {
			t.Fatalf("printBounds: no %q in\n%s", want, out.String())
		}
	}
	b.kvHave = 8 // a fleet's KV smaller than the contexts
	out.Reset()
	printBounds(&out, "keyless", b, []string{"kv"}, []time.Duration{10 * time.Millisecond})
	if !strings.Contains(out.String(), "(1.50×: past the fleet's KV if all were live") {
		t.Fatalf("printBounds: no overflow note in\n%s", out.String())
	}
}
