package main

import (
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
)

// tokRange is a range of token counts, both ends included: a flag
// written MIN-MAX (or N for N-N).
type tokRange struct{ lo, hi int }

// draw is a count in the range: lo + rng.IntN(hi-lo+1), the draw the
// workloads made with their fixed ranges, so that the default ranges give
// the same workload for the same seed.
func (r tokRange) draw(rng *rand.Rand) int { return r.lo + rng.IntN(r.hi-r.lo+1) }

func (r tokRange) String() string { return strconv.Itoa(r.lo) + "-" + strconv.Itoa(r.hi) }

// parseRange parses MIN-MAX or N; it refuses negative ends and MIN > MAX.
func parseRange(s string) (tokRange, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return tokRange{}, errors.New("empty range (want MIN-MAX)")
	}
	if s[0] == '-' {
		return tokRange{}, fmt.Errorf("range %q: negative token count", s)
	}
	lo, hi, two := strings.Cut(s, "-")
	if !two {
		hi = lo
	}
	a, err := strconv.Atoi(strings.TrimSpace(lo))
	if err != nil {
		return tokRange{}, fmt.Errorf("range %q: want MIN-MAX, two token counts", s)
	}
	hi = strings.TrimSpace(hi)
	if strings.HasPrefix(hi, "-") {
		return tokRange{}, fmt.Errorf("range %q: negative token count", s)
	}
	b, err := strconv.Atoi(hi)
	if err != nil {
		return tokRange{}, fmt.Errorf("range %q: want MIN-MAX, two token counts", s)
	}
	if a > b {
		return tokRange{}, fmt.Errorf("range %q: MIN %d is more than MAX %d", s, a, b)
	}
	return tokRange{a, b}, nil
}

// rangeFlag is a tokRange as a flag.Value.
type rangeFlag struct{ r *tokRange }

func (f rangeFlag) String() string {
	if f.r == nil {
		return ""
	}
	return f.r.String()
}

func (f rangeFlag) Set(s string) error {
	r, err := parseRange(s)
	if err != nil {
		return err
	}
	*f.r = r
	return nil
}

// lengths are the workloads' drawn token counts.
type lengths struct {
	task     tokRange // sessions: a session's task (times -skew for a long one)
	tool     tokRange // sessions: a turn's tool result
	newToks  tokRange // sessions: a turn's max new tokens
	question tokRange // GRPO: a prompt's question after the system prompt
	sample   tokRange // GRPO: a sample's max new tokens
}

// defaultLengths are the ranges the workloads drew before they were flags.
var defaultLengths = lengths{
	task:     tokRange{200, 399},
	tool:     tokRange{50, 199},
	newToks:  tokRange{32, 127},
	question: tokRange{64, 255},
	sample:   tokRange{64, 511},
}

// lengthFlags registers the ranges' flags on fs, defaulting to l's.
func lengthFlags(fs *flag.FlagSet, l *lengths) {
	fs.Var(rangeFlag{&l.task}, "task-tokens", "sessions workloads: a session's task tokens, MIN-MAX (a long skewed session has -skew times as many)")
	fs.Var(rangeFlag{&l.tool}, "tool-tokens", "sessions workloads: a turn's tool-result tokens, MIN-MAX")
	fs.Var(rangeFlag{&l.newToks}, "new-tokens", "sessions workloads: a turn's max new tokens, MIN-MAX")
	fs.Var(rangeFlag{&l.question}, "question-tokens", "GRPO: a prompt's question tokens after the system prompt, MIN-MAX")
	fs.Var(rangeFlag{&l.sample}, "sample-tokens", "GRPO: a sample's max new tokens, MIN-MAX")
}

// checkLengths refuses ranges no request can be made of: max new tokens
// under 1, an empty prompt, and with kvTokens > 0 (the engines' KV cache
// in tokens, blockToks a block) a workload's longest request (prompt and
// max new tokens, in blocks) over the cache, as the fake engine would
// answer it with a 400 mid-run.
func checkLengths(c config, workloads []string, kvTokens int) error {
	l := c.lengths
	if l.newToks.lo < 1 {
		return fmt.Errorf("-new-tokens %v: max new tokens must be at least 1", l.newToks)
	}
	if l.sample.lo < 1 {
		return fmt.Errorf("-sample-tokens %v: max new tokens must be at least 1", l.sample)
	}
	if c.sysTokens < 0 {
		return fmt.Errorf("-system-tokens %d: negative", c.sysTokens)
	}
	bt := max(c.blockToks, 1)
	blocks := func(n int) int { return (n + bt - 1) / bt }
	for _, wl := range workloads {
		var what string
		var first, longest int // a request's shortest prompt; the longest prompt + max new
		switch wl {
		case "grpo":
			what = "a GRPO sample (-system-tokens + -question-tokens + -sample-tokens)"
			first = c.sysTokens + l.question.lo
			longest = c.sysTokens + l.question.hi + l.sample.hi
		case "sessions", "skewed", "keyless", "restart":
			skew, _ := sessionsSkew(c, wl)
			what = "a session's last turn (-system-tokens + -task-tokens (× -skew) + turns × (-new-tokens + -tool-tokens))"
			first = c.sysTokens + l.task.lo
			longest = c.sysTokens + max(skew, 1)*l.task.hi + c.turns*l.newToks.hi + max(c.turns-1, 0)*l.tool.hi
		default:
			continue
		}
		if first < 1 {
			return fmt.Errorf("%s: a prompt can be empty (-system-tokens %d and a range from 0)", wl, c.sysTokens)
		}
		if kvTokens > 0 && blocks(longest)*bt > kvTokens {
			return fmt.Errorf("%s: %s can need %d tokens, more than an engine's KV cache holds (%d)", wl, what, longest, kvTokens)
		}
	}
	return nil
}
