package main

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

// TestPDRun runs a small P/D run, both protocols, GRPO, keyed and keyless
// sessions, all four phases, the prefills publishing KV events: every zero holds (nothing failed, hung, wrong, orphaned,
// recomputed, parked or spanning two versions; every engine at the new
// version), and the same prompts get the same answers through tetherd
// and by the direct client. Throughput is printed, not asserted.
func TestPDRun(t *testing.T) {
	c := config{
		blockToks: 16, maxRunning: 16, prefillPer: time.Microsecond, decode: 2 * time.Millisecond,
		waves: 1, prompts: 4, samples: 3, sysTokens: 64, sessions: 4, turns: 3, seed: 1, lengths: defaultLengths,
	}
	var out bytes.Buffer
	pc := pdConfig{
		protocols: "sglang,vllm", prefills: 2, decodes: 3, cacheTokens: 4096, maxPrefill: 1,
		timeout: 60 * time.Second, sglangPause: "abort", vllmPause: "wait", phases: "pd,regular,regular-prefills,sync", kvEvents: true, out: &out,
	}
	err := runPDAll(c, pc, []string{"grpo", "sessions", "keyless"})
	t.Log("\n" + out.String())
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"| sglang | grpo |", "| vllm | sessions |", "| sglang | keyless |"} {
		if strings.Count(out.String(), want) != 2 {
			t.Errorf("the figures lack two rows of %q", want)
		}
	}
}
