package main

import (
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/tether-rl/tether/testenv/fakeengine"
)

// trace records, per engine slot, what the client sent and when the last
// answer came (-per-engine): where a run's makespan went.
type trace struct {
	mu     sync.Mutex
	start  time.Time
	last   []time.Duration
	reqs   []int
	prompt []int64
	slots  map[string][]int // key -> the slot of each of its requests, in order
	steps  map[string]int   // key -> its requests' max new tokens, summed (decode steps)
}

func newTrace(n int) *trace {
	return &trace{last: make([]time.Duration, n), reqs: make([]int, n), prompt: make([]int64, n), slots: map[string][]int{}, steps: map[string]int{}}
}

func (t *trace) note(key string, slot, prompt, maxNew int) {
	if t == nil || slot < 0 || slot >= len(t.last) {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.last[slot] = time.Since(t.start)
	t.reqs[slot]++
	t.prompt[slot] += int64(prompt)
	if key != "" {
		t.slots[key] = append(t.slots[key], slot)
		t.steps[key] += maxNew
	}
}

// long reports whether session key is one of the skewed workload's long
// ones (runSessions: one in skewEvery, from 0).
func long(key string, skewEvery int) bool {
	n, err := strconv.Atoi(strings.TrimPrefix(key, "agent-"))
	return err == nil && skewEvery > 0 && n%skewEvery == 0
}

func (t *trace) print(w io.Writer, wl, mode string, engines []*fakeengine.Engine, c config) {
	skewEvery := c.skewEvery
	if wl != "skewed" {
		skewEvery = 0 // no long sessions
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	sessions := make([]int, len(t.last))
	longs := make([]int, len(t.last))
	moves := 0
	maxSteps := make([]int, len(t.last))
	for k, ss := range t.slots {
		maxSteps[ss[len(ss)-1]] = max(maxSteps[ss[len(ss)-1]], t.steps[k])
		sessions[ss[0]]++
		if long(k, skewEvery) {
			longs[ss[0]]++
		}
		for i := 1; i < len(ss); i++ {
			if ss[i] != ss[i-1] {
				moves++
			}
		}
	}
	order := make([]int, len(t.last))
	for i := range order {
		order[i] = i
	}
	sort.Slice(order, func(i, j int) bool { return t.last[order[i]] > t.last[order[j]] })
	fmt.Fprintf(w, "\n%s/%s per engine (latest last), session moves %d:\n", wl, mode, moves)
	for _, i := range order {
		s := engines[i].Stats()
		// The engine model's busy time (bound.go): its longest session's
		// steps and all its prefill.
		model := time.Duration(maxSteps[i])*c.decode + time.Duration(s.PrefillTokens)*c.prefillPer
		fmt.Fprintf(w, "  engine %d: last %.2fs (model %.2fs), longest session %d steps, %d requests, %d sessions (%d long), prompt %d, prefill %d, preempt %d, peak KV %.2f\n",
			i, t.last[i].Seconds(), model.Seconds(), maxSteps[i], t.reqs[i], sessions[i], longs[i], t.prompt[i], s.PrefillTokens, s.Preemptions, s.PeakKVUsage)
	}
	fmt.Fprintln(w)
}
