package bpf

import (
	"errors"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/tether-rl/tether/testenv"
)

// TestBestForm: the probe's choice, from what it found.
func TestBestForm(t *testing.T) {
	no := errors.New("missing")
	for _, c := range []struct {
		k    Kernel
		want Form
	}{
		{Kernel{}, FormLoop},
		{Kernel{Loop: no}, FormBounded},
		{Kernel{Loop: no, Migrate: no}, FormBoundedSelect},
		{Kernel{Migrate: no}, FormBoundedSelect}, // bpf_loop backported alone
	} {
		got, why := c.k.Best()
		if got != c.want || why == "" {
			t.Errorf("%+v: %s (%q), want %s", c.k, got, why, c.want)
		}
		if err := c.k.takes(got); err != nil {
			t.Errorf("%+v: best form %s not taken: %v", c.k, got, err)
		}
	}
	if err := (Kernel{Loop: no}).takes(FormLoop); err == nil {
		t.Error("bpf_loop form taken without bpf_loop")
	}
	if err := (Kernel{}).takes("fast"); err == nil {
		t.Error("unknown form taken")
	}
}

// TestFormsLoad passes every form this kernel takes through its verifier,
// forced as TETHER_BPF_FORM does, and checks that Open says which.
func TestFormsLoad(t *testing.T) {
	testenv.RequireBPF(t)
	k := Probe()
	best, why := k.Best()
	t.Logf("this kernel: best form %s (%s)", best, why)
	for _, f := range []Form{FormLoop, FormBounded, FormBoundedSelect} {
		t.Run(string(f), func(t *testing.T) {
			if err := k.takes(f); err != nil {
				t.Skipf("this kernel cannot take form %s: %v", f, err)
			}
			t.Setenv(FormEnv, string(f))
			s, err := Open(testenv.BPFFS(t))
			if err != nil {
				var ve *ebpf.VerifierError
				if errors.As(err, &ve) {
					t.Fatalf("verifier: %+v", ve)
				}
				t.Fatal(err)
			}
			defer s.Close()
			if got, why := s.Form(); got != f || why == "" {
				t.Errorf("Form() = %s (%q), want %s", got, why, f)
			}
			if info, err := s.prog.Info(); err == nil {
				if n, ok := info.VerifiedInstructions(); ok {
					t.Logf("verifier processed %d instructions", n)
				}
			}
		})
	}
	t.Run("unknown", func(t *testing.T) {
		t.Setenv(FormEnv, "fast")
		if s, err := Open(testenv.BPFFS(t)); err == nil {
			s.Close()
			t.Fatal("Open with an unknown form succeeded")
		}
	})
}
