package listener

import (
	"encoding/binary"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/bpf"
	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/sysconn"
)

// slotSum adds up one counter over the first k slots.
func slotSum(g *Group, k int, f func(stats.SlotSnapshot) uint64) uint64 {
	var sum uint64
	for i := range k {
		sum += f(g.Stats().Slot(i).Load())
	}
	return sum
}

func pendingOf(l stats.SlotSnapshot) uint64   { return l.Pending }
func steeredOf(l stats.SlotSnapshot) uint64   { return l.Steered }
func steerLoadOf(l stats.SlotSnapshot) uint64 { return l.SteerLoad }
func activeOf(l stats.SlotSnapshot) uint64    { return l.Active }

// TestPendingCountedOnSYN: the program counts a connection pending when it
// steers its SYN, before anything accepts it; the accept moves it to
// active (steer_load unchanged) and the close takes it off steer_load.
func TestPendingCountedOnSYN(t *testing.T) {
	const k, n = 2, 6
	ns := testenv.NewNetNS(t)
	// The watcher must not settle anything while nothing accepts.
	g := listen(t, ns, k, bpf.ModeRequired, WithPinDir(testenv.BPFFS(t)), WithPollInterval(time.Hour))
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
	// Dial returns once the handshake is done: the connections sit in the
	// accept queues, counted pending where the program sent them. A SYN
	// sent again before the first made a request socket (a slow emulator)
	// runs the program again and is counted twice (the watcher, off here,
	// would settle it): extra says how many, and balance on pending is
	// exact only without.
	extra := slotSum(g, k, steeredOf) - n
	for i := range k {
		l := g.Stats().Slot(i).Load()
		q, err := sysconn.AcceptQueue(g.Listeners()[i].(*net.TCPListener))
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("slot %d before accept: queued %d, %+v", i, q, l)
		if l.Pending < uint64(q) || l.SteerLoad != l.Pending || l.Steered != l.Pending || l.Active != 0 {
			t.Errorf("slot %d: queued %d, %+v: want pending = steer_load = steered >= queued", i, q, l)
		}
		if extra == 0 && q != n/k {
			t.Errorf("slot %d: %d queued, want %d (balanced on pending)", i, q, n/k)
		}
	}

	srv := serve(t, g, allSlots(k)...)
	for range n {
		srv.wait(t)
	}
	if extra > 0 {
		t.Logf("%d SYNs counted twice", extra)
	}
	if p, a, sl := slotSum(g, k, pendingOf), slotSum(g, k, activeOf), slotSum(g, k, steerLoadOf); p != extra || a != n || sl != n+extra {
		t.Errorf("after accepting: pending %d, active %d, steer_load %d; want %d, %d, %d", p, a, sl, extra, n, n+extra)
	}
	for _, c := range conns {
		c.Close()
	}
	testenv.WaitFor(t, "steer_load back to what was counted twice", func() bool { return slotSum(g, k, steerLoadOf) == extra })
}

// TestSettleLeak: counts the program left pending for connections that
// will never be accepted (simulated by writing them into slot_load) are
// taken off by the watcher once the handshake grace has passed, but not
// the counts of connections waiting in an accept queue.
func TestSettleLeak(t *testing.T) {
	const k = 2
	ns := testenv.NewNetNS(t)
	g := listen(t, ns, k, bpf.ModeRequired, WithPinDir(testenv.BPFFS(t)),
		WithPollInterval(20*time.Millisecond), WithHandshakeGrace(100*time.Millisecond))
	// Slot 0 is served; slot 1 has no accept loop, so what goes there waits.
	srv := serve(t, g, 0)
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for i := range 4 {
		c, err := ns.Dial(t, "tcp", addr(g))
		if err != nil {
			t.Fatalf("dial %d: %v", i, err)
		}
		conns = append(conns, c)
	}
	ln1 := g.Listeners()[1].(*net.TCPListener)
	q1, err := sysconn.AcceptQueue(ln1)
	if err != nil || q1 == 0 {
		t.Fatalf("slot 1 queue: %d, %v; want connections queued there", q1, err)
	}
	for range 4 - q1 {
		srv.wait(t)
	}

	// Leak 5 on the served slot and 3 on the queued one, as SYNs the
	// program counted whose handshakes never completed would.
	s0, s1 := g.Stats().Slot(0), g.Stats().Slot(1)
	for _, l := range []struct {
		s *stats.Slot
		n uint64
	}{{s0, 5}, {s1, 3}} {
		atomic.AddUint64(&l.s.SteerLoad, l.n)
		atomic.AddUint64(&l.s.Pending, l.n)
	}
	start := time.Now()
	testenv.WaitFor(t, "leaked counts settled", func() bool {
		return s0.Load().Pending == 0 && s1.Load().Pending == uint64(q1)
	})
	t.Logf("settled after %v", time.Since(start).Round(time.Millisecond))
	if l := s0.Load(); l.SteerLoad != l.Active {
		t.Errorf("slot 0: %+v: want steer_load = active", l)
	}
	// The queued connections keep their counts, however long they wait:
	// held for a span (15 polls, 3 graces), since that nothing happens has
	// no event to wait on.
	time.Sleep(300 * time.Millisecond)
	if l := s1.Load(); l.Pending != uint64(q1) || l.SteerLoad != uint64(q1) {
		t.Errorf("slot 1 with %d queued: %+v: want pending = steer_load = %d", q1, l, q1)
	}

	// Accepted, they leave pending for active.
	srv.start(g, 1)
	for range q1 {
		srv.wait(t)
	}
	if l := s1.Load(); l.Pending != 0 || l.Active != uint64(q1) || l.SteerLoad != uint64(q1) {
		t.Errorf("slot 1 after accepting %d: %+v", q1, l)
	}
}

// TestSettleAbandonedSYN: a real SYN whose handshake never completes (sent
// from a raw socket, so the client's kernel answers the SYN-ACK with a
// reset) is counted pending by the program and settled by the watcher.
// A bare ACK reaching the listener is steered but not counted.
func TestSettleAbandonedSYN(t *testing.T) {
	const k = 2
	ns := testenv.NewNetNS(t)
	g := listen(t, ns, k, bpf.ModeRequired, WithPinDir(testenv.BPFFS(t)),
		WithPollInterval(20*time.Millisecond), WithHandshakeGrace(100*time.Millisecond))
	serve(t, g, allSlots(k)...)
	port := g.Listeners()[0].Addr().(*net.TCPAddr).Port
	steering := g.Steering()

	selected := func() uint64 {
		d, err := steering.Decisions()
		if err != nil {
			t.Fatal(err)
		}
		var sum uint64
		for i := range k {
			sum += d.Selected[i]
		}
		return sum
	}

	// A bare ACK (no connection): the program chooses a listener for it,
	// which answers with a reset; nothing is counted pending.
	sendRaw(t, ns, 40001, port, tcpACK)
	testenv.WaitFor(t, "the ACK steered", func() bool { return selected() == 1 })
	if p, s := slotSum(g, k, pendingOf), slotSum(g, k, steeredOf); p != 0 || s != 0 {
		t.Errorf("after a bare ACK: pending %d, steered %d; want 0", p, s)
	}

	// A SYN: counted pending; the handshake dies on the client's reset.
	sendRaw(t, ns, 40002, port, tcpSYN)
	testenv.WaitFor(t, "the SYN steered", func() bool { return selected() == 2 })
	// Counted: steered (monotonic) says so; pending may already be
	// settled again on a slow machine (the grace is 100 ms).
	if s, p := slotSum(g, k, steeredOf), slotSum(g, k, pendingOf); s != 1 || p > 1 {
		t.Errorf("after a SYN: steered %d, pending %d; want 1, at most 1", s, p)
	}
	start := time.Now()
	testenv.WaitFor(t, "the abandoned SYN settled", func() bool {
		return slotSum(g, k, pendingOf) == 0 && slotSum(g, k, steerLoadOf) == 0
	})
	t.Logf("abandoned SYN settled after %v (grace 100ms, poll 20ms)", time.Since(start).Round(time.Millisecond))
}

const (
	tcpSYN = 0x02
	tcpACK = 0x10
)

// sendRaw sends one TCP segment with the given flags from 127.0.0.1:sport
// to 127.0.0.1:dport through a raw socket in ns (no socket owns sport).
func sendRaw(t *testing.T, ns *testenv.NetNS, sport, dport int, flags byte) {
	t.Helper()
	seg := make([]byte, 20) // a TCP header without options
	binary.BigEndian.PutUint16(seg[0:], uint16(sport))
	binary.BigEndian.PutUint16(seg[2:], uint16(dport))
	binary.BigEndian.PutUint32(seg[4:], 0x1000) // sequence number
	binary.BigEndian.PutUint32(seg[8:], 0x2000) // acknowledgment number
	seg[12] = 5 << 4                            // data offset: 5 words
	seg[13] = flags
	binary.BigEndian.PutUint16(seg[14:], 65535) // window
	lo := []byte{127, 0, 0, 1}
	pseudo := append(append(append([]byte{}, lo...), lo...), 0, unix.IPPROTO_TCP, 0, byte(len(seg)))
	binary.BigEndian.PutUint16(seg[16:], checksum(append(pseudo, seg...)))

	var err error
	ns.Do(t, func() {
		var fd int
		fd, err = unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_TCP)
		if err != nil {
			return
		}
		defer unix.Close(fd)
		err = unix.Sendto(fd, seg, 0, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}})
	})
	if err != nil {
		t.Fatalf("raw TCP segment: %v", err)
	}
}

// checksum is the Internet checksum (RFC 1071).
func checksum(b []byte) uint16 {
	var sum uint32
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	return ^uint16(sum)
}
