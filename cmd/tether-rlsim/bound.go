package main

import (
	"fmt"
	"io"
	"sort"
	"time"
)

// What no placement of a sessions workload can beat, in the fake
// engine's own model: a step of the running batch takes DecodeStep plus
// PrefillPerToken × the uncached prompt tokens admitted during it. An
// engine's busy time is therefore at least its longest session's decode
// steps × DecodeStep plus all the prefill it computes, and a session's
// own time at least its steps and its own prefill. Round trips, the
// wait for a step's end and queueing come on top.

// sessionCost is one session's work: decode steps (its turns' max new
// tokens) and the prompt tokens it must prefill with its context cached
// between turns (full blocks; the shared system prompt taken as cached);
// the prompt tokens of all its requests, and its own context at its end
// (the last prompt and output, less the system prompt), the KV it holds
// then.
type sessionCost struct {
	steps   int
	prefill int
	prompt  int
	final   int
}

func sessionCosts(c config, sys []int, plans []sessionPlan) []sessionCost {
	bt := max(c.blockToks, 1)
	out := make([]sessionCost, len(plans))
	for i, p := range plans {
		ctx := len(sys) + len(p.task)
		sc := sessionCost{prefill: ctx - len(sys)/bt*bt}
		prev := 0
		for t := range p.maxNew {
			if t > 0 {
				sc.prefill += ctx - prev/bt*bt
			}
			sc.steps += p.maxNew[t]
			sc.prompt += ctx
			prev = ctx + p.maxNew[t]
			sc.final = prev - len(sys)
			ctx = prev + len(p.tools[t])
		}
		out[i] = sc
	}
	return out
}

// sessionBounds are a workload's bounds (see bound.go's comment).
type sessionBounds struct {
	// alone: the longest session alone on an engine (its steps and its
	// own prefill): a lower bound for any placement.
	alone time.Duration
	// blind: the longest session's steps plus an even share of all the
	// prefill (each engine computing the system prompt once): what a
	// placement that balances prefill perfectly, not knowing how long
	// each session will decode, ends at.
	blind time.Duration
	// seer: the best placement found knowing every session's decode
	// length ahead (longest first onto the engine it fits, the
	// engine's end its longest session's steps plus its prefill,
	// bisected on the end): an estimate of the best any router could
	// do.
	seer time.Duration
	// prefill: the prompt tokens the sessions must compute at best.
	prefill int
	// prompt: the prompt tokens of all requests; 1 - prefill/prompt is
	// the best prefix hit rate.
	prompt int
	// kvNeed: the tokens the sessions' contexts would hold if all were
	// live at their ends (each engine's copy of the system prompt
	// counted once); kvHave: the fleet's KV caches. Sessions that end
	// early free theirs, so past 1 is a sign, not a proof, that contexts
	// are recomputed whatever the placement; the bounds above do not
	// count it.
	kvNeed, kvHave int
}

func boundsOf(c config, costs []sessionCost) sessionBounds {
	if len(costs) == 0 || c.engines <= 0 {
		return sessionBounds{}
	}
	d, p := c.decode, c.prefillPer
	sysTok := c.sysTokens / max(c.blockToks, 1) * max(c.blockToks, 1)
	var b sessionBounds
	maxSteps := 0
	for _, s := range costs {
		b.alone = max(b.alone, time.Duration(s.steps)*d+time.Duration(s.prefill)*p)
		maxSteps = max(maxSteps, s.steps)
		b.prefill += s.prefill
		b.prompt += s.prompt
		b.kvNeed += s.final
	}
	b.prefill += sysTok * min(c.engines, len(costs))
	b.kvNeed += c.sysTokens * min(c.engines, len(costs))
	bt := max(c.blockToks, 1)
	b.kvHave = c.engines * (c.kvBlocks * 16 / bt) * bt // main's engines' cache
	b.blind = time.Duration(maxSteps)*d + time.Duration(b.prefill/c.engines)*p
	sorted := append([]sessionCost(nil), costs...)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].steps > sorted[j].steps })
	fits := func(end time.Duration) bool {
		var left []time.Duration // each open engine's prefill time still free
		for _, s := range sorted {
			need := time.Duration(s.prefill) * p
			placed := false
			for i := range left {
				if left[i] >= need {
					left[i] -= need
					placed = true
					break
				}
			}
			if placed {
				continue
			}
			if len(left) == c.engines {
				return false
			}
			// A new engine, opened by the longest session left: its
			// steps bound the engine's decode.
			free := end - time.Duration(s.steps)*d - time.Duration(sysTok)*p - need
			if free < 0 {
				return false
			}
			left = append(left, free)
		}
		return true
	}
	lo, hi := b.alone, b.alone+time.Duration(b.prefill)*p
	for hi-lo > time.Millisecond {
		mid := lo + (hi-lo)/2
		if fits(mid) {
			hi = mid
		} else {
			lo = mid
		}
	}
	b.seer = hi
	return b
}

// printBounds writes a sessions workload's bounds against the modes'
// makespans (median runs) in this run.
func printBounds(w io.Writer, wl string, b sessionBounds, modes []string, makespans []time.Duration) {
	ratio := func(v time.Duration) string {
		var s string
		for i, m := range modes {
			if makespans[i] > 0 {
				s += fmt.Sprintf(" %.2f× %s", v.Seconds()/makespans[i].Seconds(), m)
			}
		}
		return s
	}
	fmt.Fprintf(w, "\n%s bounds (engine model, no overheads; prefill at best %d tokens):\n", wl, b.prefill)
	fmt.Fprintf(w, "  longest session alone %.2fs (%s)\n", b.alone.Seconds(), ratio(b.alone))
	fmt.Fprintf(w, "  even prefill + longest decode %.2fs (%s)\n", b.blind.Seconds(), ratio(b.blind))
	fmt.Fprintf(w, "  knowing every decode length %.2fs (%s)\n", b.seer.Seconds(), ratio(b.seer))
	if b.prompt > 0 {
		fmt.Fprintf(w, "  prefix hit at best %.3f (%d prompt tokens)\n", 1-float64(b.prefill)/float64(b.prompt), b.prompt)
	}
	if b.kvHave > 0 {
		over := ""
		if b.kvNeed > b.kvHave {
			over = ": past the fleet's KV if all were live, contexts are likely recomputed whatever the placement (not in the bounds above)"
		}
		fmt.Fprintf(w, "  KV: the sessions' contexts at their ends %d tokens, the fleet's caches %d (%.2f×%s)\n", b.kvNeed, b.kvHave, float64(b.kvNeed)/float64(b.kvHave), over)
	}
	fmt.Fprintln(w)
}
