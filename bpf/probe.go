package bpf

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/features"
	"github.com/cilium/ebpf/rlimit"
)

// Form names the build of the steering program loaded (steer.c, two
// builds) and what it uses of the kernel.
type Form string

const (
	// FormLoop is steer: walks as bpf_loop callbacks, compare-and-swap
	// reservations, attached as SK_REUSEPORT_SELECT_OR_MIGRATE (5.17+).
	FormLoop Form = "bpf_loop"
	// FormBounded is steerBounded attached as SELECT_OR_MIGRATE: bounded
	// loops instead of bpf_loop, choices counted with an atomic add (5.14
	// to 5.16).
	FormBounded Form = "bounded"
	// FormBoundedSelect is steerBounded attached as SK_REUSEPORT_SELECT
	// (5.10 to 5.13). Queued connections of a retired listener are drained
	// before it closes (userspace/listener); what is left at the drain
	// timeout is reset (the kernel's own move, net.ipv4.tcp_migrate_req,
	// is 5.14 too: Debian's 5.10 shows the sysctl, without the move).
	FormBoundedSelect Form = "bounded-select"
)

// Migrates says whether the form moves the queued connections of a closing
// listener itself (SK_REUSEPORT_SELECT_OR_MIGRATE).
func (f Form) Migrates() bool { return f == FormLoop || f == FormBounded }

// FormEnv forces a form (tests: a form below the best one this kernel
// takes, e.g. bounded-select on a 6.x kernel, as 5.10 runs it). A form the
// kernel cannot take fails to load.
const FormEnv = "TETHER_BPF_FORM"

// Kernel is what the probe found, once per process (Probe).
type Kernel struct {
	Loop    error // bpf_loop in sk_reuseport programs (5.17); nil if there
	Migrate error // SK_REUSEPORT_SELECT_OR_MIGRATE and ctx->migrating_sk (5.14)
}

// Best is the best form this kernel takes, and why.
func (k Kernel) Best() (Form, string) {
	var missing []string
	if k.Loop != nil {
		missing = append(missing, "no bpf_loop (5.17): bounded loops, choices counted with an atomic add")
	}
	if k.Migrate != nil {
		missing = append(missing, "no SK_REUSEPORT_SELECT_OR_MIGRATE (5.14): a retired listener's queue is drained before it closes")
	}
	switch {
	case k.Loop == nil && k.Migrate == nil:
		return FormLoop, "bpf_loop and SK_REUSEPORT_SELECT_OR_MIGRATE available"
	case k.Migrate == nil:
		return FormBounded, strings.Join(missing, "; ")
	}
	return FormBoundedSelect, strings.Join(missing, "; ")
}

// Takes says whether the kernel can load form f (nil if it can).
func (k Kernel) Takes(f Form) error { return k.takes(f) }

func (k Kernel) takes(f Form) error {
	need := map[Form][]error{
		FormLoop:          {k.Loop, k.Migrate},
		FormBounded:       {k.Migrate},
		FormBoundedSelect: nil,
	}
	errs, ok := need[f]
	if !ok {
		return fmt.Errorf("unknown steering form %q (want %s, %s or %s)", f, FormLoop, FormBounded, FormBoundedSelect)
	}
	return errors.Join(errs...)
}

var probed struct {
	once sync.Once
	k    Kernel
}

// Probe finds, once per process, which steering form the kernel takes.
// Each probe loads a small sk_reuseport program; one that fails for lack
// of privilege fails every form, as Open would.
//
// Before 5.11 BPF memory counts against RLIMIT_MEMLOCK (of the user, all
// its processes together): the maps of one Open nearly fill the usual 8
// MiB, so the limit is lifted first (a no-op on kernels that charge BPF
// memory to the cgroup; best effort, Open's error says when it was not
// enough).
func Probe() Kernel {
	probed.once.Do(func() {
		_ = rlimit.RemoveMemlock()
		probed.k = Kernel{Loop: probeLoop(), Migrate: probeMigrate()}
	})
	return probed.k
}

// chooseForm is the form Open loads: the best the kernel takes, or the
// one TETHER_BPF_FORM names. why says what decided.
func chooseForm() (Form, string, error) {
	k := Probe()
	best, why := k.Best()
	v := os.Getenv(FormEnv)
	if v == "" {
		return best, why, nil
	}
	f := Form(v)
	if err := k.takes(f); err != nil {
		return "", "", fmt.Errorf("%s=%s: this kernel cannot take it: %w", FormEnv, v, err)
	}
	return f, fmt.Sprintf("forced by %s (the best here: %s)", FormEnv, best), nil
}

func probeLoop() error {
	if err := features.HaveProgramHelper(ebpf.SkReuseport, asm.FnLoop); err != nil {
		return fmt.Errorf("bpf_loop: %w", err)
	}
	return nil
}

// probeMigrate loads a program that reads ctx->migrating_sk, attached as
// SELECT_OR_MIGRATE: older verifiers refuse the field.
func probeMigrate() error {
	const migratingSk = 48 // offsetof(struct sk_reuseport_md, migrating_sk)
	return probeProgram("SK_REUSEPORT_SELECT_OR_MIGRATE", ebpf.AttachSkReuseportSelectOrMigrate, asm.Instructions{
		asm.LoadMem(asm.R2, asm.R1, migratingSk, asm.DWord),
		asm.Mov.Imm(asm.R0, 1), // SK_PASS
		asm.Return(),
	})
}

func probeProgram(what string, attach ebpf.AttachType, insns asm.Instructions) error {
	p, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name:         "tether_probe",
		Type:         ebpf.SkReuseport,
		AttachType:   attach,
		Instructions: insns,
		License:      "GPL",
	})
	if err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	p.Close()
	return nil
}

// specFor returns the collection of form f, its constants set.
func specFor(f Form) (*ebpf.CollectionSpec, error) {
	if f == FormLoop {
		return loadSteer()
	}
	spec, err := loadSteerBounded()
	if err != nil {
		return nil, err
	}
	migrate := uint32(0)
	if f.Migrates() {
		migrate = 1
	}
	vs, ok := spec.Variables[steerBoundedVarTetherMigrate]
	if !ok {
		return nil, fmt.Errorf("steering form %s: no constant tether_migrate in the object", f)
	}
	if err := vs.Set(migrate); err != nil {
		return nil, fmt.Errorf("steering form %s: set tether_migrate: %w", f, err)
	}
	attach := ebpf.AttachSkReuseportSelect
	if f.Migrates() {
		attach = ebpf.AttachSkReuseportSelectOrMigrate
	}
	spec.Programs[steerBoundedProgTetherSteer].AttachType = attach
	return spec, nil
}
