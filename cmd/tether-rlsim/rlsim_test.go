package main

import (
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/userspace/kvevents"
)

func TestParseRange(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want tokRange
		err  string // a part of the error; "": none
	}{
		{in: "200-399", want: tokRange{200, 399}},
		{in: " 0-0 ", want: tokRange{0, 0}},
		{in: "64", want: tokRange{64, 64}},
		{in: "5 - 9", want: tokRange{5, 9}},
		{in: "", err: "empty"},
		{in: "9-5", err: "MIN 9 is more than MAX 5"},
		{in: "-5-10", err: "negative"},
		{in: "5--1", err: "negative"},
		{in: "-3", err: "negative"},
		{in: "a-b", err: "want MIN-MAX"},
		{in: "5-", err: "want MIN-MAX"},
		{in: "5-6-7", err: "want MIN-MAX"},
		{in: "1.5-2", err: "want MIN-MAX"},
	} {
		got, err := parseRange(tc.in)
		if tc.err == "" {
			if err != nil || got != tc.want {
				t.Errorf("parseRange(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tc.err) {
			t.Errorf("parseRange(%q) = %v, %v; want an error with %q", tc.in, got, err, tc.err)
		}
	}
}

// TestLengthFlags: the flags set their ranges, keep the defaults
// otherwise, and refuse a bad range at parse time.
func TestLengthFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want func(*lengths)
		err  bool
	}{
		{args: nil, want: func(*lengths) {}},
		{args: []string{"-task-tokens", "1000-2000"}, want: func(l *lengths) { l.task = tokRange{1000, 2000} }},
		{args: []string{"-tool-tokens=0-0", "-new-tokens", "8-8"}, want: func(l *lengths) { l.tool, l.newToks = tokRange{0, 0}, tokRange{8, 8} }},
		{args: []string{"-question-tokens", "16-32", "-sample-tokens", "1-4"}, want: func(l *lengths) { l.question, l.sample = tokRange{16, 32}, tokRange{1, 4} }},
		{args: []string{"-task-tokens", "400-200"}, err: true},
		{args: []string{"-sample-tokens", "-1-4"}, err: true},
	} {
		l := defaultLengths
		fs := flagSet()
		lengthFlags(fs, &l)
		err := fs.Parse(tc.args)
		if tc.err {
			if err == nil {
				t.Errorf("%v: parsed, want an error", tc.args)
			}
			continue
		}
		want := defaultLengths
		tc.want(&want)
		if err != nil || l != want {
			t.Errorf("%v: %+v, %v; want %+v", tc.args, l, err, want)
		}
	}
}

func TestCheckLengths(t *testing.T) {
	base := config{blockToks: 16, sysTokens: 1024, turns: 6, skew: 10, lengths: defaultLengths}
	all := []string{"grpo", "sessions", "skewed", "keyless", "restart"}
	for _, tc := range []struct {
		name string
		mod  func(*config)
		wls  []string
		kv   int
		err  string
	}{
		{name: "defaults", mod: func(*config) {}, wls: all, kv: 20480},
		{name: "no KV check", mod: func(c *config) { c.lengths.task = tokRange{1 << 20, 1 << 20} }, wls: all},
		{name: "zero new tokens", mod: func(c *config) { c.lengths.newToks = tokRange{0, 4} }, wls: all, err: "-new-tokens"},
		{name: "zero sample tokens", mod: func(c *config) { c.lengths.sample = tokRange{0, 4} }, wls: all, err: "-sample-tokens"},
		{name: "empty GRPO prompt", mod: func(c *config) { c.sysTokens, c.lengths.question = 0, tokRange{0, 8} }, wls: []string{"grpo"}, err: "empty"},
		{name: "empty task ok with a system prompt", mod: func(c *config) { c.lengths.task = tokRange{0, 8} }, wls: all, kv: 20480},
		// 1024 + 10*399 + 6*127 + 5*199 = 6771 tokens: 424 blocks.
		{name: "skewed fits 424 blocks", mod: func(*config) {}, wls: []string{"skewed"}, kv: 424 * 16},
		{name: "skewed over 423 blocks", mod: func(*config) {}, wls: []string{"skewed"}, kv: 423 * 16, err: "skewed: a session's last turn"},
		{name: "sessions unskewed fit 423 blocks", mod: func(*config) {}, wls: []string{"sessions", "keyless", "restart"}, kv: 423 * 16},
		// 1024 + 255 + 511 = 1790 tokens: 112 blocks.
		{name: "grpo over", mod: func(*config) {}, wls: []string{"grpo"}, kv: 111 * 16, err: "grpo: a GRPO sample"},
		{name: "grpo fits", mod: func(*config) {}, wls: []string{"grpo"}, kv: 112 * 16},
		{name: "task over", mod: func(c *config) { c.lengths.task = tokRange{10, 20000} }, wls: []string{"keyless"}, kv: 20480, err: "more than an engine's KV cache holds (20480)"},
	} {
		c := base
		tc.mod(&c)
		err := checkLengths(c, tc.wls, tc.kv)
		if tc.err == "" && err != nil || tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)) {
			t.Errorf("%s: %v; want error %q", tc.name, err, tc.err)
		}
	}
}

// TestDefaultLengthsDrawAsBefore: the default ranges draw what the
// workloads' fixed ranges drew, so a seed's workload is unchanged.
func TestDefaultLengthsDrawAsBefore(t *testing.T) {
	a, b := rand.New(rand.NewPCG(1, 2)), rand.New(rand.NewPCG(1, 2))
	l := defaultLengths
	for i := 0; i < 1000; i++ {
		got := []int{l.task.draw(a), l.tool.draw(a), l.newToks.draw(a), l.question.draw(a), l.sample.draw(a)}
		want := []int{200 + b.IntN(200), 50 + b.IntN(150), 32 + b.IntN(96), 64 + b.IntN(192), 64 + b.IntN(448)}
		for j := range got {
			if got[j] != want[j] {
				t.Fatalf("draw %d.%d: %d, want %d", i, j, got[j], want[j])
			}
		}
	}
}

// decisionCounts parses a result's decisions ("kv_prefix=12 veto=1").
func decisionCounts(t *testing.T, s string) map[string]int {
	t.Helper()
	m := map[string]int{}
	for _, f := range strings.Fields(s) {
		k, v, ok := strings.Cut(f, "=")
		n, err := strconv.Atoi(v)
		if !ok || err != nil {
			t.Fatalf("decisions %q: %q", s, f)
		}
		m[k] = n
	}
	return m
}

// TestRunKV runs a tiny keyless sessions workload and a GRPO workload on
// fake vLLM engines (/v1/completions with the prompt's token ids, the id
// in X-Request-Id), both event wire forms, and on fake SGLang engines
// (/generate with input_ids), through tetherd's kv mode: every request
// answered by an engine, every one placed by the engines' KV events
// (kv_prefix decisions, no other), a GRPO prompt's samples kept together
// (at most 1.5 engines a prompt on the mean: the credits make siblings
// follow; 1.00 in every run seen). Makespans are logged, not asserted.
func TestRunKV(t *testing.T) {
	for _, run := range []struct {
		engine string
		form   kvevents.Form
	}{{engineVLLM, kvevents.MapForm}, {engineVLLM, kvevents.ArrayForm}, {engineSGLang, kvevents.MapForm}} {
		name := fmt.Sprintf("%s, array form", run.engine)
		if run.form == kvevents.MapForm {
			name = fmt.Sprintf("%s, map form", run.engine)
		}
		c := config{
			engines: 3, kvBlocks: 512, blockToks: 16, maxRunning: 32, prefillPer: time.Microsecond, decode: 2 * time.Millisecond,
			waves: 1, prompts: 4, samples: 4, sysTokens: 64, sessions: 6, turns: 3, seed: 1, engine: run.engine, kvForm: run.form,
			lengths: lengths{task: tokRange{64, 128}, tool: tokRange{16, 32}, newToks: tokRange{8, 16}, question: tokRange{32, 64}, sample: tokRange{8, 16}},
			log:     io.Discard,
		}
		if err := checkLengths(c, []string{"keyless", "grpo"}, c.kvBlocks*c.blockToks); err != nil {
			t.Fatal(err)
		}
		engines, err := startFleet(c)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range engines {
			defer e.Close()
		}
		for _, tc := range []struct {
			wl   string
			reqs int
		}{
			{"keyless", c.sessions * c.turns},
			{"grpo", c.waves * c.prompts * c.samples},
		} {
			r, err := runOne(c, engines, tc.wl, "kv")
			if err != nil {
				t.Fatalf("%s, %s: %v", name, tc.wl, err)
			}
			t.Logf("%s, %s: makespan %v, hit %.3f, engines per prompt %.2f, decisions %s", name, tc.wl, r.makespan, r.hit, r.groupEngines, r.decisions)
			var completed int64
			for _, e := range engines {
				s := e.Stats()
				completed += s.Completed
				if s.Aborted != 0 {
					t.Errorf("%s, %s: %s aborted %d", name, tc.wl, e.Name(), s.Aborted)
				}
			}
			if completed != int64(tc.reqs) {
				t.Errorf("%s, %s: %d requests completed, want %d", name, tc.wl, completed, tc.reqs)
			}
			if d := decisionCounts(t, r.decisions); d["kv_prefix"] != tc.reqs {
				t.Errorf("%s, %s: decisions %q, want kv_prefix=%d", name, tc.wl, r.decisions, tc.reqs)
			}
			if tc.wl == "grpo" && (r.groupEngines < 1 || r.groupEngines > 1.5) {
				t.Errorf("%s: engines per prompt %.2f, want at most 1.5", name, r.groupEngines)
			}
		}
	}
}

func flagSet() *flag.FlagSet {
	fs := flag.NewFlagSet("tether-rlsim", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	return fs
}

// TestParseKVForm: -kv-form's default, map, runs the map form (Form's
// zero is the array form: main once left it unset for map).
func TestParseKVForm(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want kvevents.Form
		ok   bool
	}{
		{"map", kvevents.MapForm, true},
		{"array", kvevents.ArrayForm, true},
		{"", 0, false},
		{"Map", 0, false},
		{"msgpack", 0, false},
	} {
		got, err := parseKVForm(tc.in)
		if (err == nil) != tc.ok || tc.ok && got != tc.want {
			t.Errorf("parseKVForm(%q) = %v, %v; want %v (ok %v)", tc.in, got, err, tc.want, tc.ok)
		}
	}
}
