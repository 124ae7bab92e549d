package listener

import (
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/bpf"
	"github.com/tether-rl/tether/testenv"
)

// openBurst opens n keep-alive connections the way a client pool does
// (wrk, aiohttp/httpx): the sockets are made first, then n goroutines
// released at once connect concurrently, so that the SYNs are decided
// before the server has accepted (and counted) the earlier connections. It
// returns once the server accepted all n.
func openBurst(t *testing.T, ns *testenv.NetNS, g *Group, srv *server, n int) []net.Conn {
	t.Helper()
	ap := g.Listeners()[0].Addr().(*net.TCPAddr)
	to := unix.SockaddrInet4{Port: ap.Port}
	copy(to.Addr[:], ap.IP.To4())

	// Sockets belong to the namespace they are created in; connect works
	// from any thread.
	fds := make([]int, n)
	ns.Do(t, func() {
		for i := range fds {
			fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				t.Fatalf("socket: %v", err)
			}
			fds[i] = fd
		}
	})
	var (
		start       = make(chan struct{})
		ready, done sync.WaitGroup
		errs        = make([]error, n)
	)
	for i, fd := range fds {
		ready.Add(1)
		done.Add(1)
		go func() {
			defer done.Done()
			ready.Done()
			sa := to // Connect writes into the sockaddr: one each
			<-start
			errs[i] = unix.Connect(fd, &sa)
		}()
	}
	ready.Wait()
	close(start)
	done.Wait()

	conns := make([]net.Conn, 0, n)
	t.Cleanup(func() {
		for _, c := range conns {
			c.Close()
		}
	})
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), fmt.Sprint("burst-", i))
		c, err := net.FileConn(f)
		f.Close()
		if errs[i] != nil || err != nil {
			t.Fatalf("connection %d: connect: %v, FileConn: %v", i, errs[i], err)
		}
		conns = append(conns, c)
	}
	for range n {
		srv.wait(t)
	}
	return conns
}

// closeAll closes the clients and waits until the server counted them all
// closed.
func closeAll(t *testing.T, g *Group, k int, conns []net.Conn) {
	t.Helper()
	for _, c := range conns {
		c.Close()
	}
	testenv.WaitFor(t, "every connection counted closed", func() bool {
		for i := range k {
			if l := g.Stats().Slot(i).Load(); l.Active != 0 || l.SteerLoad != 0 {
				return false
			}
		}
		return true
	})
}

func burstRounds(t *testing.T) int {
	rounds := 5
	if v := os.Getenv("TETHER_BURST_ROUNDS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			t.Fatalf("TETHER_BURST_ROUNDS=%q", v)
		}
		rounds = n
	}
	return rounds
}

// TestBurstBalance: 64 keep-alive connections opened in one burst over 8
// listeners, as a client pool opens them, over several rounds
// (TETHER_BURST_ROUNDS, default 5), with the program and with the kernel
// hash. The program decides each SYN before the server accepts anything;
// it balances only because it counts the connections it steered and the
// server has not accepted yet (pending).
func TestBurstBalance(t *testing.T) {
	const k, n = 8, 64
	rounds := burstRounds(t)

	hashNS := testenv.NewNetNS(t)
	hg := listen(t, hashNS, k, bpf.ModeOff)
	hashSrv := serve(t, hg, allSlots(k)...)
	var hashRatios []float64
	for r := range rounds {
		conns := openBurst(t, hashNS, hg, hashSrv, n)
		ratio, active := maxOverMean(hg, k)
		hashRatios = append(hashRatios, ratio)
		t.Logf("round %d: kernel hash max/mean %.3f %v", r, ratio, active)
		closeAll(t, hg, k, conns)
	}

	ns := testenv.NewNetNS(t)
	g := listen(t, ns, k, bpf.ModeRequired, WithPinDir(testenv.BPFFS(t)))
	form, why := g.Steering().Form()
	t.Logf("steering form %s (%s)", form, why)
	srv := serve(t, g, allSlots(k)...)
	var ratios []float64
	for r := range rounds {
		d0, err := g.Steering().Decisions()
		if err != nil {
			t.Fatal(err)
		}
		var a0 [k]uint64
		for i := range k {
			a0[i] = g.Stats().Slot(i).Load().Accepted
		}
		conns := openBurst(t, ns, g, srv, n)
		ratio, active := maxOverMean(g, k)
		ratios = append(ratios, ratio)
		t.Logf("round %d: BPF max/mean %.3f %v", r, ratio, active)
		if ratio > 1.10 {
			t.Errorf("round %d: BPF max/mean = %.3f > 1.10 (%v)", r, ratio, active)
		}
		// Every connection was steered by the program (a SYN sent again,
		// as under a slow emulator, runs it again: at least once each),
		// none fell back to the kernel hash, and each was accepted once.
		// Counted pending on its SYN and taken off when accepted; what a
		// SYN sent again counted is settled by the watcher.
		d1, err := g.Steering().Decisions()
		if err != nil {
			t.Fatal(err)
		}
		var selected, accepted uint64
		for i := range k {
			selected += d1.Selected[i] - d0.Selected[i]
			accepted += g.Stats().Slot(i).Load().Accepted - a0[i]
		}
		if selected < n || d1.FallbackNoSlot != d0.FallbackNoSlot || d1.FallbackSelectErr != d0.FallbackSelectErr {
			t.Errorf("round %d: selected %d for %d connections, fallbacks %d/%d", r, selected, n,
				d1.FallbackNoSlot-d0.FallbackNoSlot, d1.FallbackSelectErr-d0.FallbackSelectErr)
		}
		if accepted != n {
			t.Errorf("round %d: %d accepted for %d connections", r, accepted, n)
		}
		testenv.WaitFor(t, "nothing left pending, steer_load = active on every slot", func() bool {
			for i := range k {
				if l := g.Stats().Slot(i).Load(); l.Pending != 0 || l.SteerLoad != l.Active {
					return false
				}
			}
			return true
		})
		closeAll(t, g, k, conns)
	}
	t.Logf("burst of %d connections over %d listeners, %d rounds: max/mean BPF median %.3f, worst %.3f; kernel hash median %.3f, worst %.3f",
		n, k, rounds, median(ratios), slices.Max(ratios), median(hashRatios), slices.Max(hashRatios))
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}
