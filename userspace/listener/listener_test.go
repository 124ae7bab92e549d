package listener

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/bpf"
	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/sysconn"
)

// server stands in for the proxy: one accept loop per listener that counts
// Opened before reporting the connection, and echoes until the client
// closes, then counts Finished.
type server struct {
	accepted chan int // slot of each accepted connection
	wg       sync.WaitGroup
}

func serve(t *testing.T, g *Group, slots ...int) *server {
	s := &server{accepted: make(chan int, 1024)}
	for _, slot := range slots {
		s.start(g, slot)
	}
	t.Cleanup(func() {
		g.Close()
		s.wg.Wait()
	})
	return s
}

func (s *server) start(g *Group, slot int) {
	ln, st := g.Listeners()[slot], g.Stats().Slot(slot)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			st.Opened()
			s.accepted <- slot
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				_, _ = io.Copy(c, c)
				c.Close()
				st.Finished()
			}()
		}
	}()
}

// wait returns the slot of the next accepted connection.
func (s *server) wait(t *testing.T) int {
	t.Helper()
	select {
	case slot := <-s.accepted:
		return slot
	case <-time.After(5 * time.Second):
		t.Fatal("no connection accepted within 5s")
		return -1
	}
}

func quietLog() *slog.Logger { return slog.New(slog.DiscardHandler) }

// listen opens a group inside ns.
func listen(t *testing.T, ns *testenv.NetNS, k int, mode bpf.Mode, opts ...Option) *Group {
	t.Helper()
	var (
		g   *Group
		err error
	)
	ns.Do(t, func() { g, err = Listen("127.0.0.1:0", k, mode, quietLog(), opts...) })
	if err != nil {
		t.Fatalf("Listen: %v", err)
	}
	t.Cleanup(func() { g.Close() })
	return g
}

func addr(g *Group) string { return g.Listeners()[0].Addr().String() }

// openSequential opens n keep-alive connections one at a time, each
// accepted and counted before the next, and returns them.
func openSequential(t *testing.T, ns *testenv.NetNS, g *Group, srv *server, n int) []net.Conn {
	t.Helper()
	conns := make([]net.Conn, 0, n)
	t.Cleanup(func() {
		for _, c := range conns {
			c.Close()
		}
	})
	for range n {
		c, err := ns.Dial(t, "tcp", addr(g))
		if err != nil {
			t.Fatalf("dial: %v", err)
		}
		conns = append(conns, c)
		srv.wait(t)
	}
	return conns
}

func maxOverMean(g *Group, k int) (float64, []uint64) {
	var sum, mx uint64
	active := make([]uint64, k)
	for i := range k {
		active[i] = g.Stats().Slot(i).Load().Active
		sum += active[i]
		mx = max(mx, active[i])
	}
	return float64(mx) / (float64(sum) / float64(k)), active
}

func allSlots(k int) []int {
	s := make([]int, k)
	for i := range s {
		s[i] = i
	}
	return s
}

// TestPlainTCP: the listeners are plain TCP (not MPTCP, Go's default since
// 1.24) and insertable into the sockarray; an MPTCP listener is not, with
// an error that says why.
func TestPlainTCP(t *testing.T) {
	ns := testenv.NewNetNS(t)
	pin := testenv.BPFFS(t)
	g := listen(t, ns, 2, bpf.ModeRequired, WithPinDir(pin))
	for i, ln := range g.Listeners() {
		if p := protocol(t, ln); p != unix.IPPROTO_TCP {
			t.Errorf("listener %d protocol %d, want IPPROTO_TCP", i, p)
		}
	}

	var (
		mp  net.Listener
		err error
	)
	ns.Do(t, func() {
		var lc net.ListenConfig
		lc.SetMultipathTCP(true)
		mp, err = lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	})
	if err != nil {
		t.Fatal(err)
	}
	defer mp.Close()
	if protocol(t, mp) != unix.IPPROTO_MPTCP {
		t.Log("kernel without MPTCP: only the plain TCP half ran")
		return
	}
	err = g.Steering().Insert(5, mp.(*net.TCPListener))
	if err == nil || !strings.Contains(err.Error(), "MPTCP") {
		t.Errorf("inserting an MPTCP listener: %v, want an error naming MPTCP", err)
	}
}

func protocol(t *testing.T, ln net.Listener) int {
	t.Helper()
	rc, err := ln.(*net.TCPListener).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var p int
	var perr error
	rc.Control(func(fd uintptr) { p, perr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PROTOCOL) })
	if perr != nil {
		t.Fatal(perr)
	}
	return p
}

// TestBalance: 64 keep-alive connections over 8 listeners, with the
// program and with the kernel hash, and the counters in the maps match
// what the clients did.
func TestBalance(t *testing.T) {
	const k, n = 8, 64

	hashNS := testenv.NewNetNS(t)
	hg := listen(t, hashNS, k, bpf.ModeOff)
	hashSrv := serve(t, hg, allSlots(k)...)
	openSequential(t, hashNS, hg, hashSrv, n)
	hashRatio, hashActive := maxOverMean(hg, k)

	ns := testenv.NewNetNS(t)
	g := listen(t, ns, k, bpf.ModeRequired, WithPinDir(testenv.BPFFS(t)))
	srv := serve(t, g, allSlots(k)...)
	conns := openSequential(t, ns, g, srv, n)
	ratio, active := maxOverMean(g, k)

	t.Logf("max/mean active over %d listeners, %d connections: BPF %.3f %v, kernel hash %.3f %v",
		k, n, ratio, active, hashRatio, hashActive)
	if ratio > 1.10 {
		t.Errorf("BPF max/mean = %.3f > 1.10 (%v)", ratio, active)
	}

	// Counters: every connection was steered by the program to the slot
	// that accepted it (a SYN sent again, as under a slow emulator, may
	// run the program again: selected at least accepted), none fell back,
	// each was accepted once.
	slots, err := g.Steering().Slots()
	if err != nil {
		t.Fatal(err)
	}
	d, err := g.Steering().Decisions()
	if err != nil {
		t.Fatal(err)
	}
	var selected, accepted uint64
	for i := range k {
		s := slots[i]
		selected += s.Selected
		accepted += s.Load.Accepted
		if s.State != bpf.SlotActive || s.Selected < s.Load.Accepted || s.Load.Active != s.Load.Accepted {
			t.Errorf("slot %d: %+v: want active, selected >= accepted = active", i, s)
		}
	}
	if accepted != n || selected < n || d.FallbackNoSlot != 0 || d.FallbackSelectErr != 0 || d.Migrated != 0 {
		t.Errorf("decisions: accepted %d, selected %d (want %d), %+v", accepted, selected, n, d)
	}

	// Each connection works; once the clients close, active drops to 0.
	for i, c := range conns {
		msg := fmt.Appendf(nil, "ping %d\n", i)
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write(msg); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(msg))
		if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, msg) {
			t.Fatalf("echo %d: %q, %v", i, got, err)
		}
		c.Close()
	}
	testenv.WaitFor(t, "all connections counted closed", func() bool {
		for i := range k {
			l := g.Stats().Slot(i).Load()
			if l.Active != 0 || l.Closed != l.Accepted {
				return false
			}
		}
		return true
	})
}

// TestDrainingSlotGetsNothing: a slot marked draining gets no new
// connection while its listener is still open.
func TestDrainingSlotGetsNothing(t *testing.T) {
	const k, n = 4, 40
	ns := testenv.NewNetNS(t)
	// A long poll interval: the watcher must not close the slot meanwhile.
	g := listen(t, ns, k, bpf.ModeRequired, WithPinDir(testenv.BPFFS(t)), WithPollInterval(time.Hour))
	srv := serve(t, g, allSlots(k)...)
	if err := g.Steering().SetSlotState(1, bpf.SlotDraining, 1); err != nil {
		t.Fatal(err)
	}
	openSequential(t, ns, g, srv, n)
	slots, err := g.Steering().Slots()
	if err != nil {
		t.Fatal(err)
	}
	for i := range k {
		t.Logf("slot %d %s: accepted %d", i, slots[i].State, slots[i].Load.Accepted)
	}
	if s := slots[1]; s.Load.Accepted != 0 || s.Selected != 0 {
		t.Errorf("draining slot 1 got connections: %+v", s)
	}
	for _, i := range []int{0, 2, 3} {
		if slots[i].Load.Accepted == 0 {
			t.Errorf("active slot %d got no connection", i)
		}
	}
}

// TestDrainMigratesFullQueue: a listener closed by Drain with a full accept
// queue loses no connection: all migrate to the active listener, none is
// reset, and the program counts them migrated. With a form that does not
// migrate (below 5.14) the kernel moves them (net.ipv4.tcp_migrate_req=1),
// uncounted by the program; without that sysctl either, nothing moves a
// queue and TestDrainWaitsForQueue is what holds.
func TestDrainMigratesFullQueue(t *testing.T) {
	const backlog = 16
	ns := testenv.NewNetNS(t)
	// The kernel caps listen()'s backlog at the namespace's somaxconn.
	ns.Sysctl(t, "net/core/somaxconn", fmt.Sprint(backlog))
	// No watcher: it would drain slot 1, marked draining below to keep it
	// out (a slow machine's watcher got there before the test, and Drain(0)
	// then refused the last listener).
	g := listen(t, ns, 2, bpf.ModeRequired, WithPinDir(testenv.BPFFS(t)), WithDrainTimeout(200*time.Millisecond), WithPollInterval(time.Hour))
	s := g.Steering()
	form, _ := s.Form()
	if !form.Migrates() {
		// The kernel's own move (tcp_migrate_req) came in 5.14 with the
		// program's: a kernel without ctx->migrating_sk moves nothing,
		// whatever sysctls it shows (Debian's 5.10 has the knob, not the
		// migration: its queue was reset, never accepted).
		if err := bpf.Probe().Migrate; err != nil {
			t.Skipf("form %s does not migrate and this kernel cannot move a closing listener's queue (%v): nothing moves it; TestDrainWaitsForQueue is what holds", form, err)
		}
		if _, err := os.Stat("/proc/sys/net/ipv4/tcp_migrate_req"); err != nil {
			t.Skipf("form %s does not migrate and this kernel has no tcp_migrate_req: nothing moves a closing listener's queue (TestDrainWaitsForQueue)", form)
		}
		ns.Sysctl(t, "net/ipv4/tcp_migrate_req", "1")
	}
	// Slot 0 has no accept loop; slot 1 is kept out until the queue is full.
	if err := s.SetSlotState(1, bpf.SlotDraining, 1); err != nil {
		t.Fatal(err)
	}
	srv := serve(t, g, 1)

	ln0 := g.Listeners()[0].(*net.TCPListener)
	n := backlog + 1 // the kernel queues backlog+1 before the queue counts as full
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for i := range n {
		c, err := ns.Dial(t, "tcp", addr(g))
		if err != nil {
			t.Fatalf("dial %d: %v", i, err)
		}
		conns = append(conns, c)
		// Sent before the migration: it travels with the connection.
		if _, err := fmt.Fprintf(c, "hello %d\n", i); err != nil {
			t.Fatal(err)
		}
	}
	testenv.WaitFor(t, "a full accept queue on slot 0", func() bool {
		q, err := sysconn.AcceptQueue(ln0)
		return err == nil && q == n
	})

	if l := g.Stats().Slot(0).Load(); l.Pending != uint64(n) || l.SteerLoad != uint64(n) {
		t.Errorf("slot 0 with %d queued: %+v: want them pending", n, l)
	}

	if err := s.SetSlotState(1, bpf.SlotActive, 1); err != nil {
		t.Fatal(err)
	}
	if err := g.Drain(0); err != nil {
		t.Fatal(err)
	}
	for range n {
		if slot := srv.wait(t); slot != 1 {
			t.Fatalf("accepted on slot %d", slot)
		}
	}
	for i, c := range conns {
		want := fmt.Sprintf("hello %d\n", i)
		c.SetDeadline(time.Now().Add(5 * time.Second))
		got := make([]byte, len(want))
		if _, err := io.ReadFull(c, got); err != nil || string(got) != want {
			t.Errorf("connection %d after migration: %q, %v", i, got, err)
		}
	}

	// The migrated connections were counted pending on slot 1 (by the
	// program, or on accept when the kernel moved them) and are now
	// active there; slot 0 has nothing left.
	steered := uint64(n)
	if !form.Migrates() {
		steered = 0
	}
	if l := g.Stats().Slot(1).Load(); l.Pending != 0 || l.Active != uint64(n) || l.SteerLoad != uint64(n) || l.Steered != steered {
		t.Errorf("slot 1 after the migration: %+v: want %d active, %d steered, none pending", l, n, steered)
	}
	if l := g.Stats().Slot(0).Load(); l.Pending != 0 || l.SteerLoad != 0 {
		t.Errorf("drained slot 0: %+v: want nothing pending", l)
	}

	d, err := s.Decisions()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("decisions: migrated %d (to slot 1: %d), fallbacks %d/%d", d.Migrated, d.MigratedTo[1], d.FallbackNoSlot, d.FallbackSelectErr)
	if d.Migrated != steered || d.MigratedTo[1] != steered {
		t.Errorf("migrated %d, to slot 1 %d, want %d (form %s)", d.Migrated, d.MigratedTo[1], steered, form)
	}
	if state, _, _ := s.Slot(0); state != bpf.SlotEmpty {
		t.Errorf("drained slot 0 is %s, want empty", state)
	}
	if _, err := ln0.Accept(); err == nil {
		t.Error("drained listener still accepts")
	}
}

// TestDrainWaitsForQueue: Drain marks the slot draining and waits for its
// accept queue to empty before it closes the listener, so that what is
// queued is accepted there, on every form (the one thing that holds when
// nothing migrates: below 5.14 without tcp_migrate_req).
func TestDrainWaitsForQueue(t *testing.T) {
	const n = 8
	ns := testenv.NewNetNS(t)
	g := listen(t, ns, 2, bpf.ModeRequired, WithPinDir(testenv.BPFFS(t)), WithDrainTimeout(time.Minute), WithPollInterval(time.Hour))
	s := g.Steering()
	// Everything to slot 0, which accepts nothing yet.
	if err := s.SetSlotState(1, bpf.SlotDraining, 1); err != nil {
		t.Fatal(err)
	}
	ln0 := g.Listeners()[0].(*net.TCPListener)
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for i := range n {
		c, err := ns.Dial(t, "tcp", addr(g))
		if err != nil {
			t.Fatalf("dial %d: %v", i, err)
		}
		conns = append(conns, c)
	}
	testenv.WaitFor(t, "the connections queued on slot 0", func() bool {
		q, err := sysconn.AcceptQueue(ln0)
		return err == nil && q == n
	})
	if err := s.SetSlotState(1, bpf.SlotActive, 1); err != nil {
		t.Fatal(err)
	}
	drained := make(chan error, 1)
	go func() { drained <- g.Drain(0) }()
	testenv.WaitFor(t, "slot 0 marked draining", func() bool {
		state, _, err := s.Slot(0)
		return err == nil && state == bpf.SlotDraining
	})
	select {
	case err := <-drained:
		t.Fatalf("Drain returned with %d connections queued: %v", n, err)
	default:
	}
	srv := serve(t, g, 0) // the queue empties here
	for range n {
		if slot := srv.wait(t); slot != 0 {
			t.Fatalf("accepted on slot %d", slot)
		}
	}
	if err := <-drained; err != nil {
		t.Fatal(err)
	}
	for i, c := range conns {
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := fmt.Fprintf(c, "x"); err != nil {
			t.Errorf("connection %d after the drain: %v", i, err)
		}
	}
	if state, _, _ := s.Slot(0); state != bpf.SlotEmpty {
		t.Errorf("drained slot 0 is %s, want empty", state)
	}
}

// TestWatcherDrains: a slot marked draining from outside (tetherctl) is
// drained by the group's watcher.
func TestWatcherDrains(t *testing.T) {
	ns := testenv.NewNetNS(t)
	pin := testenv.BPFFS(t)
	g := listen(t, ns, 3, bpf.ModeRequired, WithPinDir(pin), WithPollInterval(20*time.Millisecond))
	srv := serve(t, g, allSlots(3)...)

	ctl, err := bpf.OpenPinned(pin, false)
	if err != nil {
		t.Fatal(err)
	}
	defer ctl.Close()
	if err := ctl.SetSlotState(2, bpf.SlotDraining, 1); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, "slot 2 drained", func() bool {
		state, _, err := ctl.Slot(2)
		return err == nil && state == bpf.SlotEmpty
	})
	openSequential(t, ns, g, srv, 12)
	if got := g.Stats().Slot(2).Load().Accepted; got != 0 {
		t.Errorf("drained slot 2 accepted %d", got)
	}
}

// The last listener of a group is never drained, by Drain or by a slot
// marked draining in the map: nothing would accept, nothing would take
// what is queued.
func TestLastListenerStays(t *testing.T) {
	ns := testenv.NewNetNS(t)
	pin := testenv.BPFFS(t)
	g := listen(t, ns, 2, bpf.ModeRequired, WithPinDir(pin), WithPollInterval(20*time.Millisecond))
	srv := serve(t, g, allSlots(2)...)
	if err := g.Drain(0); err != nil {
		t.Fatal(err)
	}
	if err := g.Drain(1); err == nil {
		t.Fatal("the last listener was drained")
	}
	ctl, err := bpf.OpenPinned(pin, false)
	if err != nil {
		t.Fatal(err)
	}
	defer ctl.Close()
	if err := ctl.SetSlotState(1, bpf.SlotDraining, 1); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, "slot 1 active again", func() bool {
		state, _, err := ctl.Slot(1)
		return err == nil && state == bpf.SlotActive
	})
	openSequential(t, ns, g, srv, 4)
	if got := g.Stats().Slot(1).Load().Accepted; got != 4 {
		t.Errorf("last listener accepted %d of 4", got)
	}
}

// TestModes: auto falls back to the kernel hash with one warning when BPF
// is unavailable (here: no bpffs at the pin directory), required fails,
// off does not try.
func TestModes(t *testing.T) {
	ns := testenv.NewNetNS(t)
	noBPFFS := t.TempDir()

	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&buf, nil))
	var (
		g   *Group
		err error
	)
	ns.Do(t, func() { g, err = Listen("127.0.0.1:0", 2, bpf.ModeAuto, log, WithPinDir(noBPFFS)) })
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if g.Steering() != nil || g.Stats().Shared() {
		t.Error("auto without bpffs: steering on")
	}
	if w := strings.Count(buf.String(), "level=WARN"); w != 1 {
		t.Errorf("auto without bpffs logged %d warnings, want 1:\n%s", w, buf.String())
	}
	srv := serve(t, g, 0, 1)
	openSequential(t, ns, g, srv, 4)
	if a := g.Stats().Slot(0).Load().Accepted + g.Stats().Slot(1).Load().Accepted; a != 4 {
		t.Errorf("heap counters: accepted %d, want 4", a)
	}

	ns.Do(t, func() { _, err = Listen("127.0.0.1:0", 2, bpf.ModeRequired, log, WithPinDir(noBPFFS)) })
	if err == nil {
		t.Error("required without bpffs: no error")
	}

	buf.Reset()
	ns.Do(t, func() { g, err = Listen("127.0.0.1:0", 2, bpf.ModeOff, log) })
	if err != nil {
		t.Fatal(err)
	}
	g.Close()
	if buf.Len() != 0 {
		t.Errorf("off logged: %s", buf.String())
	}
}
