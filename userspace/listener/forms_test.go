package listener

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/tether-rl/tether/bpf"
	"github.com/tether-rl/tether/testenv"
)

// TestBoundedForms runs the steering tests again with the bounded-loop
// program forced (TETHER_BPF_FORM), as kernels below 5.17 load it: with
// migration (5.14 to 5.16), and without, as 5.10 runs it; a form the
// kernel cannot take is skipped (5.10 has no migration).
func TestBoundedForms(t *testing.T) {
	if os.Getenv(bpf.FormEnv) != "" {
		t.Skipf("%s set: this run already tests one form", bpf.FormEnv)
	}
	testenv.RequireBPF(t)
	const tests = "^(TestBalance|TestBurstBalance|TestDrainingSlotGetsNothing|TestDrainMigratesFullQueue|TestDrainWaitsForQueue|TestWatcherDrains|TestPendingCountedOnSYN|TestSettleAbandonedSYN)$"
	for _, f := range []bpf.Form{bpf.FormBounded, bpf.FormBoundedSelect} {
		t.Run(string(f), func(t *testing.T) {
			if err := bpf.Probe().Takes(f); err != nil {
				t.Skipf("this kernel cannot take form %s: %v", f, err)
			}
			if best, _ := bpf.Probe().Best(); best == f {
				t.Skipf("form %s is this kernel's best: the tests above ran with it", f)
			}
			cmd := exec.Command(os.Args[0], "-test.run", tests, "-test.count=1", "-test.v")
			cmd.Env = append(os.Environ(), bpf.FormEnv+"="+string(f))
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("under form %s: %v\n%s", f, err, out)
			}
			o := string(out)
			if !strings.Contains(o, "steering form "+string(f)+" ") || !strings.Contains(o, "--- PASS: TestBurstBalance") {
				t.Fatalf("under form %s: the tests did not run with it:\n%s", f, out)
			}
			for _, l := range strings.Split(o, "\n") {
				if strings.Contains(l, "burst of") || strings.Contains(l, "--- ") {
					t.Log(strings.TrimSpace(l))
				}
			}
		})
	}
}
