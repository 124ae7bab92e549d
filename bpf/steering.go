// Package bpf loads tether's SO_REUSEPORT steering program (steer.c) and the
// maps it shares with userspace, pins the maps in bpffs so that every tetherd
// process and tetherctl see one copy, and maps the counters arrays into
// memory for the stats package.
//
// Two ways in:
//   - Open (tetherd): loads the program, creating or reusing the maps pinned
//     under a directory (DefaultPinDir by default), and maps the counters
//     read-write. Insert and Attach then steer a listener group.
//   - OpenPinned (tetherctl): opens the maps an Open pinned, without the
//     program, read-only if asked.
package bpf

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/sysconn"
)

// ABIVersion mirrors TETHER_ABI_VERSION in headers/tether.h: it names the pin
// directory, so maps of an incompatible layout are never reused.
const ABIVersion = 1

// DefaultPinDir is where tetherd pins its maps and tetherctl finds them.
const DefaultPinDir = "/sys/fs/bpf/tether/v1"

// Sizes and limits mirrored from headers/tether.h (checked by the tests).
const (
	MaxSlots   = stats.MaxSlots   // TETHER_MAX_SLOTS
	MaxWorkers = stats.MaxWorkers // TETHER_MAX_WORKERS
	MaxSticky  = 65536            // TETHER_MAX_STICKY
	MaxWeight  = 65535            // TETHER_MAX_WEIGHT
)

// Mode says whether a listener group uses the steering program.
type Mode string

const (
	// ModeAuto uses BPF when it can, else warns once and runs on the
	// kernel's reuseport hash with counters in the process.
	ModeAuto Mode = "auto"
	// ModeRequired fails when BPF steering cannot be set up.
	ModeRequired Mode = "required"
	// ModeOff never tries BPF.
	ModeOff Mode = "off"
)

// ParseMode parses a --bpf flag value.
func ParseMode(s string) (Mode, error) {
	switch m := Mode(s); m {
	case ModeAuto, ModeRequired, ModeOff:
		return m, nil
	}
	return "", fmt.Errorf("bpf mode %q: want auto, required or off", s)
}

// SlotState mirrors enum tether_slot_state.
type SlotState uint32

const (
	SlotEmpty    SlotState = 0 // TETHER_SLOT_EMPTY: no socket, never selected
	SlotActive   SlotState = 1 // TETHER_SLOT_ACTIVE: gets new connections
	SlotDraining SlotState = 2 // TETHER_SLOT_DRAINING: no new connections
)

func (s SlotState) String() string {
	switch s {
	case SlotEmpty:
		return "empty"
	case SlotActive:
		return "active"
	case SlotDraining:
		return "draining"
	}
	return fmt.Sprintf("state(%d)", uint32(s))
}

// Indexes into decision_counters: enum tether_decision, from the object's BTF.
const (
	decisionSelected          = uint32(steerTetherDecisionTETHER_DECISION_SELECTED)
	decisionMigrated          = uint32(steerTetherDecisionTETHER_DECISION_MIGRATED)
	decisionFallbackNoSlot    = uint32(steerTetherDecisionTETHER_DECISION_FALLBACK_NO_SLOT)
	decisionFallbackSelectErr = uint32(steerTetherDecisionTETHER_DECISION_FALLBACK_SELECT_ERR)
	decisionMigratedTo        = uint32(steerTetherDecisionTETHER_DECISION_MIGRATED_TO)
	decisionMax               = uint32(steerTetherDecisionTETHER_DECISION_MAX)
)

// Decisions are the program's decision counters, summed over CPUs.
type Decisions struct {
	Selected          [MaxSlots]uint64 `json:"-"` // new connections steered to each slot
	MigratedTo        [MaxSlots]uint64 `json:"-"` // queued connections moved to each slot
	Migrated          uint64           `json:"migrated"`
	FallbackNoSlot    uint64           `json:"fallback_no_slot"`
	FallbackSelectErr uint64           `json:"fallback_select_err"`
}

// SlotInfo is one listener slot as the maps see it.
type SlotInfo struct {
	Slot     int
	State    SlotState
	Weight   uint32
	Load     stats.SlotSnapshot // slot_load: active, accepted, closed, pending, steered, steer_load
	Selected uint64             // new connections the program steered here
	Migrated uint64             // queued connections the program moved here
}

// ErrNotPinned is returned by OpenPinned when no tether maps are pinned in
// the directory: tetherd is not running with BPF there.
var ErrNotPinned = errors.New("no tether maps pinned")

// ErrNoBPFFS is returned when the pin directory is not on a bpffs mount.
var ErrNoBPFFS = errors.New("not on a bpffs mount")

// ErrPinDirBusy: another running tetherd owns the pin directory.
var ErrPinDirBusy = errors.New("in use by another running tetherd (give each instance its own --bpf-pin-dir)")

// Steering is the loaded program (nil from OpenPinned) and its maps.
type Steering struct {
	form     Form   // the program's build (Open), "" from OpenPinned
	why      string // why that form
	pinDir   string
	readOnly bool

	prog    *ebpf.Program
	sockets *ebpf.Map // listener_sockets
	slots   *ebpf.Map // slot_table
	load    *ebpf.Map // slot_load
	decided *ebpf.Map // decision_counters
	workers *ebpf.Map // worker_stats
	sticky  *ebpf.Map // sticky_sessions

	stats *stats.Table

	lock *os.File // the flock(2)ed pin directory (Open), nil without
	// inherited: opened by OpenInherited, the counters of the present
	// belong to a process still draining: nothing is reset.
	inherited bool
}

// Open loads the steering program, in the best form the kernel takes
// (Probe, Form), and its maps. Maps already pinned in
// pinDir (by an earlier tetherd) are reused, so the counters carry on;
// missing ones are created and pinned. pinDir must be on a bpffs mount; it
// is created if needed.
//
// One tetherd owns a pin directory at a time (an flock(2) on it, held until
// Close or exit): the slot table describes one SO_REUSEPORT group, so a
// second process would overwrite the first's slots. Open fails with
// ErrPinDirBusy then. The owner being unique, what the counters say of the
// present (connections, requests in flight) is reset: a previous owner
// that was killed left its counts behind.
func Open(pinDir string) (*Steering, error) {
	if err := EnsurePinDir(pinDir); err != nil {
		return nil, err
	}
	lock, err := lockPinDir(pinDir)
	if err != nil {
		return nil, err
	}
	return open(pinDir, lock, false)
}

// OpenInherited is Open for the new process of an upgrade: lock is the
// pin directory's flock(2)ed descriptor handed over by the old process
// (one open file description, so the lock never lapses between them), and
// the counters are not reset: the old process's connections and requests
// are still running and will count down.
func OpenInherited(pinDir string, lock *os.File) (*Steering, error) {
	if lock == nil {
		return nil, errors.New("open inherited steering: no pin directory lock")
	}
	// The lock must be the one on this directory and still held.
	var want, got unix.Stat_t
	if err := unix.Stat(pinDir, &want); err != nil {
		lock.Close()
		return nil, fmt.Errorf("pin directory %s: %w", pinDir, err)
	}
	if err := unix.Fstat(int(lock.Fd()), &got); err != nil || got.Ino != want.Ino || got.Dev != want.Dev {
		lock.Close()
		return nil, fmt.Errorf("inherited lock is not on the pin directory %s (was --bpf-pin-dir changed?)", pinDir)
	}
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		lock.Close()
		return nil, fmt.Errorf("inherited pin directory lock: %w", err)
	}
	return open(pinDir, lock, true)
}

func open(pinDir string, lock *os.File, inherited bool) (*Steering, error) {
	form, why, err := chooseForm()
	if err != nil {
		lock.Close()
		return nil, err
	}
	spec, err := specFor(form)
	if err != nil {
		lock.Close()
		return nil, err
	}
	var objs steerObjects
	err = spec.LoadAndAssign(&objs, &ebpf.CollectionOptions{
		Maps: ebpf.MapOptions{PinPath: pinDir},
	})
	if err != nil {
		lock.Close()
		if errors.Is(err, ebpf.ErrMapIncompatible) {
			return nil, fmt.Errorf("load steering: maps pinned in %s have another layout (an older tetherd? remove the directory): %w", pinDir, err)
		}
		return nil, fmt.Errorf("load steering program (form %s: %s): %w", form, why, err)
	}
	s := &Steering{
		form:    form,
		why:     why,
		pinDir:  pinDir,
		prog:    objs.TetherSteer,
		sockets: objs.ListenerSockets,
		slots:   objs.SlotTable,
		load:    objs.SlotLoad,
		decided: objs.DecisionCounters,
		workers: objs.WorkerStats,
		sticky:  objs.StickySessions,
		lock:    lock,

		inherited: inherited,
	}
	if err := s.mapStats(); err != nil {
		s.Close()
		return nil, err
	}
	if !inherited {
		s.stats.ResetGauges()
	}
	return s, nil
}

// LockFile returns a new descriptor of the pin-directory lock, to hand to
// the process that takes over (upgrade); nil without a lock.
func (s *Steering) LockFile() (*os.File, error) {
	if s.lock == nil {
		return nil, nil
	}
	fd, err := unix.FcntlInt(s.lock.Fd(), unix.F_DUPFD_CLOEXEC, 3)
	if err != nil {
		return nil, fmt.Errorf("dup pin directory lock: %w", err)
	}
	return os.NewFile(uintptr(fd), s.lock.Name()), nil
}

// lockPinDir takes the pin directory's owner lock without waiting.
func lockPinDir(dir string) (*os.File, error) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("pin directory %s: %w", dir, err)
	}
	if err := unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB); err != nil {
		unix.Close(fd)
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("pin directory %s: %w", dir, ErrPinDirBusy)
		}
		return nil, fmt.Errorf("lock pin directory %s: %w", dir, err)
	}
	return os.NewFile(uintptr(fd), dir), nil
}

// OpenPinned opens the maps pinned in pinDir by Open, without loading the
// program (Insert and Attach fail). With readOnly the map descriptors are
// read-only, SetSlotState fails, and Stats is a snapshot taken now. Returns an error wrapping ErrNotPinned
// when nothing is pinned there.
func OpenPinned(pinDir string, readOnly bool) (*Steering, error) {
	spec, err := loadSteer()
	if err != nil {
		return nil, err
	}
	s := &Steering{pinDir: pinDir, readOnly: readOnly}
	for _, m := range []struct {
		name string
		dst  **ebpf.Map
	}{
		{steerMapListenerSockets, &s.sockets},
		{steerMapSlotTable, &s.slots},
		{steerMapSlotLoad, &s.load},
		{steerMapDecisionCounters, &s.decided},
		{steerMapWorkerStats, &s.workers},
		{steerMapStickySessions, &s.sticky},
	} {
		path := filepath.Join(pinDir, m.name)
		mp, err := ebpf.LoadPinnedMap(path, &ebpf.LoadPinOptions{ReadOnly: readOnly})
		if err != nil {
			s.Close()
			if errors.Is(err, os.ErrNotExist) {
				return nil, fmt.Errorf("%w at %s", ErrNotPinned, pinDir)
			}
			return nil, fmt.Errorf("open pinned map %s: %w", path, err)
		}
		*m.dst = mp
		if err := spec.Maps[m.name].Compatible(mp); err != nil {
			s.Close()
			return nil, fmt.Errorf("pinned map %s: %w", path, err)
		}
	}
	if err := s.mapStats(); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

// EnsurePinDir checks that dir is (or would be) on bpffs and creates it;
// nothing is created elsewhere.
func EnsurePinDir(dir string) error {
	// statfs the directory, or its nearest existing parent.
	p := filepath.Clean(dir)
	for {
		var st unix.Statfs_t
		err := unix.Statfs(p, &st)
		if err == nil {
			if st.Type != unix.BPF_FS_MAGIC {
				return fmt.Errorf("pin directory %s: %s is %w (mount one: mount -t bpf bpf /sys/fs/bpf)", dir, p, ErrNoBPFFS)
			}
			break
		}
		if !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("pin directory %s: statfs %s: %w", dir, p, err)
		}
		parent := filepath.Dir(p)
		if parent == p {
			return fmt.Errorf("pin directory %s: %w", dir, ErrNoBPFFS)
		}
		p = parent
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("create pin directory: %w", err)
	}
	return nil
}

// mapStats mmaps slot_load and worker_stats and views them as a stats.Table.
// Read-only, it copies them instead: the kernel refuses a shared mapping of
// a read-only map descriptor.
func (s *Steering) mapStats() error {
	get := mmapArray
	if s.readOnly {
		get = copyArray
	}
	slotMem, err := get(s.load)
	if err != nil {
		return fmt.Errorf("map slot_load: %w", err)
	}
	workerMem, err := get(s.workers)
	if err != nil {
		return fmt.Errorf("map worker_stats: %w", err)
	}
	t, err := stats.FromMemory(slotMem, workerMem)
	if err != nil {
		return err
	}
	s.stats = t
	return nil
}

// mmapArray maps a BPF_F_MMAPABLE array read-write. The mapping is never
// unmapped (see Stats); a failed Open leaks at most one such mapping.
func mmapArray(m *ebpf.Map) ([]byte, error) {
	page := os.Getpagesize()
	size := int(m.MaxEntries()) * int(m.ValueSize())
	size = (size + page - 1) / page * page
	return unix.Mmap(m.FD(), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
}

// copyArray reads an array map into 8-byte aligned memory.
func copyArray(m *ebpf.Map) ([]byte, error) {
	vs := int(m.ValueSize())
	words := make([]uint64, (int(m.MaxEntries())*vs+7)/8)
	mem := unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(words))), len(words)*8)
	for i := 0; i < int(m.MaxEntries()); i++ {
		if err := m.Lookup(uint32(i), mem[i*vs:(i+1)*vs]); err != nil {
			return nil, fmt.Errorf("read %s[%d]: %w", m.String(), i, err)
		}
	}
	return mem, nil
}

// Form is the build of the program loaded ("" from OpenPinned), and why
// tetherd chose it: what the kernel has (Probe), or TETHER_BPF_FORM.
func (s *Steering) Form() (Form, string) { return s.form, s.why }

// PinDir is the directory the maps are pinned in.
func (s *Steering) PinDir() string { return s.pinDir }

// Stats returns the counters living in slot_load and worker_stats. The
// memory stays mapped for the life of the process, also after Close, so
// that connections still finishing can count. From OpenPinned read-only it
// is a copy taken when the maps were opened.
func (s *Steering) Stats() *stats.Table { return s.stats }

// StickyMap is sticky_sessions (routing key hash -> struct tether_sticky).
func (s *Steering) StickyMap() *ebpf.Map { return s.sticky }

func checkSlot(slot int) error {
	if slot < 0 || slot >= MaxSlots {
		return fmt.Errorf("slot %d out of range [0, %d)", slot, MaxSlots)
	}
	return nil
}

// Insert puts a listening socket into listener_sockets[slot] and marks the
// slot active with weight 1. The slot's active, pending and steer_load counts
// restart at zero (a new socket has no connections, accepted or queued;
// connections a previous owner left uncounted are counted closed);
// accepted, closed and steered carry on (stats.Slot.Restart).
func (s *Steering) Insert(slot int, ln *net.TCPListener) error {
	if err := checkSlot(slot); err != nil {
		return err
	}
	if s.prog == nil {
		return errors.New("insert listener: steering opened without its program")
	}
	err := sysconn.Control(ln, func(fd int) error {
		err := s.sockets.Update(uint32(slot), uint64(fd), ebpf.UpdateAny)
		if err != nil && errors.Is(err, unix.EBUSY) {
			// The socket is already in the array (a socket can be in one
			// slot only): handed over by the old process in an upgrade,
			// or kept open across a restart by systemd (the fd store,
			// socket activation) while the pinned array still holds it.
			// Fine if that slot is this one.
			cookie, cerr := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_COOKIE)
			var have uint64
			if cerr == nil && s.sockets.Lookup(uint32(slot), &have) == nil && have == cookie {
				return nil
			}
		}
		return err
	})
	if err != nil {
		if errors.Is(err, ebpf.ErrNotSupported) || errors.Is(err, unix.EOPNOTSUPP) {
			return fmt.Errorf("insert listener into slot %d (an MPTCP socket? listen with SetMultipathTCP(false)): %w", slot, err)
		}
		return fmt.Errorf("insert listener into slot %d: %w", slot, err)
	}
	if !s.inherited {
		s.stats.Slot(slot).Restart() // a new socket: its counts start over
	}
	return s.SetSlotState(slot, SlotActive, 1)
}

// Attach attaches the program to the SO_REUSEPORT group of ln: it then
// chooses the listener for every new connection to the group, and where
// the queued connections of a closing listener go.
func (s *Steering) Attach(ln *net.TCPListener) error {
	if s.prog == nil {
		return errors.New("attach: steering opened without its program")
	}
	err := sysconn.Control(ln, func(fd int) error {
		return unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ATTACH_REUSEPORT_EBPF, s.prog.FD())
	})
	if err != nil {
		return fmt.Errorf("attach steering program (SO_ATTACH_REUSEPORT_EBPF): %w", err)
	}
	return nil
}

// SetSlotState writes slot_table[slot]. weight 0 means 1.
func (s *Steering) SetSlotState(slot int, state SlotState, weight uint32) error {
	if err := checkSlot(slot); err != nil {
		return err
	}
	if weight > MaxWeight {
		return fmt.Errorf("weight %d above the maximum %d", weight, MaxWeight)
	}
	if state > SlotDraining {
		return fmt.Errorf("invalid slot state %d", state)
	}
	v := steerTetherSlot{State: uint32(state), Weight: weight}
	if err := s.slots.Update(uint32(slot), &v, ebpf.UpdateAny); err != nil {
		if errors.Is(err, unix.EPERM) && s.readOnly {
			return fmt.Errorf("set slot %d: maps opened read-only: %w", slot, err)
		}
		return fmt.Errorf("set slot %d: %w", slot, err)
	}
	return nil
}

// Slot reads one slot's state and weight from slot_table.
func (s *Steering) Slot(slot int) (SlotState, uint32, error) {
	if err := checkSlot(slot); err != nil {
		return 0, 0, err
	}
	var v steerTetherSlot
	if err := s.slots.Lookup(uint32(slot), &v); err != nil {
		return 0, 0, fmt.Errorf("read slot %d: %w", slot, err)
	}
	return SlotState(v.State), v.Weight, nil
}

// Serving returns the slots whose listener_sockets entry holds a socket.
// The kernel removes a socket from the sockarray when it closes, so this
// tells whether a tetherd is listening, even one that was killed without
// cleaning slot_table up.
func (s *Steering) Serving() ([]int, error) {
	var serving []int
	for i := uint32(0); i < MaxSlots; i++ {
		var cookie uint64
		err := s.sockets.Lookup(i, &cookie)
		switch {
		case err == nil:
			serving = append(serving, int(i))
		case errors.Is(err, ebpf.ErrKeyNotExist):
		default:
			return nil, fmt.Errorf("look up listener_sockets[%d]: %w", i, err)
		}
	}
	return serving, nil
}

// Slots returns every slot (index = slot): state, weight, load and the
// program's decisions for it.
func (s *Steering) Slots() ([]SlotInfo, error) {
	d, err := s.Decisions()
	if err != nil {
		return nil, err
	}
	out := make([]SlotInfo, MaxSlots)
	for i := range out {
		state, weight, err := s.Slot(i)
		if err != nil {
			return nil, err
		}
		out[i] = SlotInfo{
			Slot:     i,
			State:    state,
			Weight:   weight,
			Load:     s.stats.Slot(i).Load(),
			Selected: d.Selected[i],
			Migrated: d.MigratedTo[i],
		}
	}
	return out, nil
}

// Decisions reads decision_counters, summed over CPUs.
func (s *Steering) Decisions() (Decisions, error) {
	var d Decisions
	var perCPU []uint64
	for key := uint32(0); key < decisionMax; key++ {
		if err := s.decided.Lookup(key, &perCPU); err != nil {
			return d, fmt.Errorf("read decision counter %d: %w", key, err)
		}
		var sum uint64
		for _, v := range perCPU {
			sum += v
		}
		switch {
		case key >= decisionSelected && key < decisionSelected+MaxSlots:
			d.Selected[key-decisionSelected] = sum
		case key >= decisionMigratedTo && key < decisionMigratedTo+MaxSlots:
			d.MigratedTo[key-decisionMigratedTo] = sum
		case key == decisionMigrated:
			d.Migrated = sum
		case key == decisionFallbackNoSlot:
			d.FallbackNoSlot = sum
		case key == decisionFallbackSelectErr:
			d.FallbackSelectErr = sum
		}
	}
	return d, nil
}

// Close releases the program and the map descriptors; the pins stay (the
// counters carry on for the next tetherd and for tetherctl), and so does the
// counters memory (see Stats). Detaching is not needed: the program stays
// with the reuseport group until its last socket closes.
func (s *Steering) Close() error {
	var errs []error
	// Close is nil-safe on both types: a Steering half-built by Open or
	// OpenPinned closes too.
	for _, c := range []interface{ Close() error }{s.prog, s.sockets, s.slots, s.load, s.decided, s.workers, s.sticky} {
		if err := c.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	if s.lock != nil {
		s.lock.Close() // releases the pin directory
		s.lock = nil
	}
	return errors.Join(errs...)
}
