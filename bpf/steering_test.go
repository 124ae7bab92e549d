package bpf

import (
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"
	"unsafe"

	"github.com/cilium/ebpf"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/stats"
)

// TestHeaderMirror keeps the Go constants in step with headers/tether.h and
// the compiled object.
func TestHeaderMirror(t *testing.T) {
	src, err := os.ReadFile("../headers/tether.h")
	if err != nil {
		t.Fatal(err)
	}
	value := func(name string) int {
		t.Helper()
		m := regexp.MustCompile(`(?m)^\s*(?:#define\s+` + name + `\s+|` + name + `\s*=\s*)(\d+)`).FindSubmatch(src)
		if m == nil {
			t.Fatalf("%s not found in tether.h", name)
		}
		n, _ := strconv.Atoi(string(m[1]))
		return n
	}
	for _, c := range []struct {
		name string
		got  int
	}{
		{"TETHER_ABI_VERSION", ABIVersion},
		{"TETHER_MAX_SLOTS", MaxSlots},
		{"TETHER_MAX_WORKERS", MaxWorkers},
		{"TETHER_MAX_STICKY", MaxSticky},
		{"TETHER_MAX_WEIGHT", MaxWeight},
		{"TETHER_SLOT_EMPTY", int(SlotEmpty)},
		{"TETHER_SLOT_ACTIVE", int(SlotActive)},
		{"TETHER_SLOT_DRAINING", int(SlotDraining)},
	} {
		if want := value(c.name); c.got != want {
			t.Errorf("%s = %d in tether.h, %d in Go", c.name, want, c.got)
		}
	}
	if want := "/sys/fs/bpf/tether/v" + strconv.Itoa(ABIVersion); DefaultPinDir != want {
		t.Errorf("DefaultPinDir = %s, want %s", DefaultPinDir, want)
	}

	spec, err := loadSteer()
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name              string
		typ               ebpf.MapType
		maxEntries, value uint32
	}{
		{steerMapListenerSockets, ebpf.ReusePortSockArray, MaxSlots, 8},
		{steerMapSlotTable, ebpf.Array, MaxSlots, uint32(unsafe.Sizeof(steerTetherSlot{}))},
		{steerMapSlotLoad, ebpf.Array, MaxSlots, uint32(unsafe.Sizeof(stats.Slot{}))},
		{steerMapDecisionCounters, ebpf.PerCPUArray, decisionMax, 8},
		{steerMapWorkerStats, ebpf.Array, MaxWorkers, uint32(unsafe.Sizeof(stats.Worker{}))},
		{steerMapStickySessions, ebpf.LRUHash, MaxSticky, uint32(unsafe.Sizeof(steerTetherSticky{}))},
	} {
		m := spec.Maps[c.name]
		if m == nil {
			t.Errorf("map %s missing from the object", c.name)
			continue
		}
		if m.Type != c.typ || m.MaxEntries != c.maxEntries || m.ValueSize != c.value {
			t.Errorf("map %s: %s max_entries=%d value_size=%d, want %s %d %d",
				c.name, m.Type, m.MaxEntries, m.ValueSize, c.typ, c.maxEntries, c.value)
		}
		if m.Pinning != ebpf.PinByName {
			t.Errorf("map %s is not pinned by name", c.name)
		}
	}
	if unsafe.Sizeof(steerTetherSlotLoad{}) != unsafe.Sizeof(stats.Slot{}) ||
		unsafe.Sizeof(steerTetherWorkerStats{}) != unsafe.Sizeof(stats.Worker{}) {
		t.Error("stats layouts differ from the object's BTF")
	}
	var bl steerTetherSlotLoad
	var gl stats.Slot
	for _, f := range []struct {
		name      string
		btf, goes uintptr
	}{
		{"active", unsafe.Offsetof(bl.Active), unsafe.Offsetof(gl.Active)},
		{"accepted", unsafe.Offsetof(bl.Accepted), unsafe.Offsetof(gl.Accepted)},
		{"closed", unsafe.Offsetof(bl.Closed), unsafe.Offsetof(gl.Closed)},
		{"pending", unsafe.Offsetof(bl.Pending), unsafe.Offsetof(gl.Pending)},
		{"steered", unsafe.Offsetof(bl.Steered), unsafe.Offsetof(gl.Steered)},
		{"steer_load", unsafe.Offsetof(bl.SteerLoad), unsafe.Offsetof(gl.SteerLoad)},
	} {
		if f.btf != f.goes {
			t.Errorf("tether_slot_load.%s at offset %d in the object, %d in stats.Slot", f.name, f.btf, f.goes)
		}
	}
	p := spec.Programs[steerProgTetherSteer]
	if p.Type != ebpf.SkReuseport || p.AttachType != ebpf.AttachSkReuseportSelectOrMigrate {
		t.Errorf("program is %s/%s, want SkReuseport/SelectOrMigrate", p.Type, p.AttachType)
	}
}

func TestParseMode(t *testing.T) {
	for _, s := range []string{"auto", "required", "off"} {
		if m, err := ParseMode(s); err != nil || string(m) != s {
			t.Errorf("ParseMode(%q) = %q, %v", s, m, err)
		}
	}
	if _, err := ParseMode("on"); err == nil {
		t.Error("ParseMode(on) succeeded")
	}
}

// TestProgramLoads passes the program through the verifier of this kernel.
func TestProgramLoads(t *testing.T) {
	pin := testenv.BPFFS(t)
	s, err := Open(pin)
	if err != nil {
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			t.Fatalf("verifier: %+v", ve)
		}
		t.Fatal(err)
	}
	defer s.Close()
	if info, err := s.prog.Info(); err == nil {
		if n, ok := info.VerifiedInstructions(); ok {
			t.Logf("verifier processed %d instructions", n)
		}
	}
	for _, name := range []string{"listener_sockets", "slot_table", "slot_load", "decision_counters", "worker_stats", "sticky_sessions"} {
		if _, err := os.Stat(filepath.Join(pin, name)); err != nil {
			t.Errorf("map %s not pinned: %v", name, err)
		}
	}
}

// TestPinsCarryOn: a second Open, and OpenPinned, see the first one's maps:
// totals carry on; what counted the first owner's present (its
// connections and requests in flight, gone with it) starts at 0.
func TestPinsCarryOn(t *testing.T) {
	pin := testenv.BPFFS(t)
	if _, err := OpenPinned(pin, true); !errors.Is(err, ErrNotPinned) {
		t.Fatalf("OpenPinned on an empty directory: %v, want ErrNotPinned", err)
	}
	a, err := Open(pin)
	if err != nil {
		t.Fatal(err)
	}
	a.Stats().Slot(3).Opened()
	a.Stats().Worker(7).Begin()
	if err := a.SetSlotState(3, SlotDraining, 5); err != nil {
		t.Fatal(err)
	}
	a.Close()

	b, err := Open(pin)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if got := b.Stats().Slot(3).Load(); got.Accepted != 1 || got.Active != 0 || got.Closed != 1 {
		t.Errorf("reopened slot 3 = %+v, want accepted 1, active 0, closed 1", got)
	}
	if got := b.Stats().Worker(7).Load(); got.Requests != 1 || got.InFlight != 0 {
		t.Errorf("reopened worker 7 = %+v, want requests 1, in flight 0", got)
	}
	b.Stats().Worker(7).End(false) // the first owner's request ending late
	if got := b.Stats().Worker(7).Load().InFlight; got != 0 {
		t.Errorf("in flight after a late end = %d, want 0 (never wrapped)", got)
	}

	ro, err := OpenPinned(pin, true)
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	slots, err := ro.Slots()
	if err != nil {
		t.Fatal(err)
	}
	if s := slots[3]; s.State != SlotDraining || s.Weight != 5 || s.Load.Accepted != 1 || s.Load.Active != 0 {
		t.Errorf("read-only slot 3 = %+v", s)
	}
	if got := ro.Stats().Worker(7).Load().Requests; got != 1 {
		t.Errorf("read-only worker 7 requests = %d, want 1", got)
	}
	if err := ro.SetSlotState(3, SlotActive, 1); err == nil {
		t.Error("SetSlotState through read-only pins succeeded")
	}
	if ro.Stats().Shared() != true {
		t.Error("pinned stats not shared")
	}
}

// One tetherd owns a pin directory: a second Open fails clearly while the
// first is open, and works once it closed (or died: the lock goes with
// the process).
func TestPinDirOwnedByOne(t *testing.T) {
	pin := testenv.BPFFS(t)
	a, err := Open(pin)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Open(pin); !errors.Is(err, ErrPinDirBusy) {
		t.Fatalf("second Open while the first is open: %v, want ErrPinDirBusy", err)
	}
	ro, err := OpenPinned(pin, true) // tetherctl reads meanwhile
	if err != nil {
		t.Fatal(err)
	}
	ro.Close()
	a.Close()
	b, err := Open(pin)
	if err != nil {
		t.Fatalf("Open after the owner closed: %v", err)
	}
	b.Close()
}

func TestOpenWithoutBPFFS(t *testing.T) {
	testenv.RequireRoot(t)
	_, err := Open(filepath.Join(t.TempDir(), "pins"))
	if !errors.Is(err, ErrNoBPFFS) {
		t.Fatalf("Open on a plain directory: %v, want ErrNoBPFFS", err)
	}
	t.Log(err)
}
