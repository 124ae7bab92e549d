// Package listener opens tether's K listening sockets in one SO_REUSEPORT
// group, puts them under the BPF steering program when it can, and retires
// them one at a time (Drain) without a client seeing a reset.
//
// Slot i of the group is listener i, listener_sockets[i], slot_table[i] and
// slot_load[i]. The proxy serves each listener and counts its connections
// with Stats().Slot(i).Opened/Finished. The load the program balances on is
// those connections plus the ones it steered to the listener that the proxy
// has not accepted yet (pending); the group's watcher takes off pending the
// SYNs that will never be accepted (see settle).
package listener

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tether-rl/tether/bpf"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/sysconn"
	"github.com/tether-rl/tether/userspace/sysd"
)

// Defaults for the options.
const (
	DefaultDrainTimeout   = 2 * time.Second
	DefaultPollInterval   = 200 * time.Millisecond
	DefaultHandshakeGrace = time.Second
)

type config struct {
	inherited      []*net.TCPListener
	lock           *os.File
	pinDir         string
	drainTimeout   time.Duration
	pollInterval   time.Duration
	handshakeGrace time.Duration
}

// Option tunes Listen.
type Option func(*config)

// WithInherited makes the group take over listeners (and the pin
// directory lock, when the old process had one) handed over by the
// process it replaces (package upgrade), instead of binding new ones.
func WithInherited(lns []*net.TCPListener, lock *os.File) Option {
	return func(c *config) { c.inherited, c.lock = lns, lock }
}

// WithPinDir pins the BPF maps in dir instead of bpf.DefaultPinDir.
func WithPinDir(dir string) Option { return func(c *config) { c.pinDir = dir } }

// WithDrainTimeout bounds how long Drain waits for a draining listener's
// accept queue to empty before it closes the listener (what is still queued
// then migrates to another listener).
func WithDrainTimeout(d time.Duration) Option { return func(c *config) { c.drainTimeout = d } }

// WithPollInterval sets how often the group looks for slots that tetherctl
// marked draining, and settles pending counts.
func WithPollInterval(d time.Duration) Option { return func(c *config) { c.pollInterval = d } }

// WithHandshakeGrace sets how long a connection the program steered (on
// its SYN) may take to reach the accept queue before the watcher counts it
// lost and takes it off the slot's pending count. Longer than any normal
// round trip; a handshake slower than that (a SYN-ACK lost and sent again
// after 1 s) only makes its slot look one connection lighter until it is
// accepted.
func WithHandshakeGrace(d time.Duration) Option { return func(c *config) { c.handshakeGrace = d } }

// Group is the K listeners of one address.
type Group struct {
	cfg      config
	log      *slog.Logger
	lns      []*net.TCPListener
	steering *bpf.Steering // nil without BPF
	stats    *stats.Table

	mu     sync.Mutex
	drains map[int]*drain // slots being or done draining

	stop      chan struct{}
	watcher   sync.WaitGroup
	closeOnce sync.Once
}

type drain struct {
	done chan struct{}
	err  error
}

// Listen opens k listeners on addr (":0" picks one port for all of them).
//
// mode auto uses BPF steering when it can (root or CAP_BPF, bpffs mounted at
// the pin directory, a kernel that loads the program) and otherwise logs one
// warning and runs on the kernel's reuseport hash, with the counters in this
// process; required returns the error instead; off never tries.
func Listen(addr string, k int, mode bpf.Mode, log *slog.Logger, opts ...Option) (*Group, error) {
	if k < 1 || k > bpf.MaxSlots {
		return nil, fmt.Errorf("listeners: %d, want 1..%d", k, bpf.MaxSlots)
	}
	if _, err := bpf.ParseMode(string(mode)); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.Default()
	}
	g := &Group{
		cfg: config{
			pinDir:         bpf.DefaultPinDir,
			drainTimeout:   DefaultDrainTimeout,
			pollInterval:   DefaultPollInterval,
			handshakeGrace: DefaultHandshakeGrace,
		},
		log:    log,
		drains: map[int]*drain{},
		stop:   make(chan struct{}),
	}
	for _, o := range opts {
		o(&g.cfg)
	}
	if in := g.cfg.inherited; in != nil {
		if len(in) != k {
			for _, ln := range in {
				ln.Close()
			}
			if g.cfg.lock != nil {
				g.cfg.lock.Close()
			}
			return nil, fmt.Errorf("listeners: %d handed over, want %d (--listeners cannot change in an upgrade: restart instead)", len(in), k)
		}
		g.lns = in
	} else if err := g.listen(addr, k); err != nil {
		return nil, err
	}
	if mode != bpf.ModeOff {
		err := g.steer()
		if err != nil && mode == bpf.ModeRequired {
			g.closeListeners()
			return nil, fmt.Errorf("bpf steering required: %w", err)
		}
		if err != nil {
			log.Warn("BPF steering unavailable: listeners balanced by the kernel's SO_REUSEPORT hash, counters kept in this process only (tetherctl sees nothing)",
				"err", err, "pin_dir", g.cfg.pinDir)
		}
	}
	if g.steering == nil {
		g.stats = stats.NewHeap()
	} else {
		g.stats = g.steering.Stats()
		g.watcher.Add(1)
		go g.watch()
	}
	return g, nil
}

// listen binds the first listener, then the others to its port.
func (g *Group) listen(addr string, k int) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("listen address %q: %w", addr, err)
	}
	lc := net.ListenConfig{Control: sysconn.ReusePort}
	// Since Go 1.24 listeners are MPTCP by default when the kernel has it;
	// a REUSEPORT_SOCKARRAY refuses MPTCP sockets (EOPNOTSUPP).
	lc.SetMultipathTCP(false)
	for i := range k {
		a := addr
		if i > 0 {
			a = net.JoinHostPort(host, fmt.Sprint(g.lns[0].Addr().(*net.TCPAddr).Port))
		}
		ln, err := lc.Listen(context.Background(), "tcp", a)
		if err != nil {
			g.closeListeners()
			return fmt.Errorf("listener %d on %s: %w", i, a, err)
		}
		g.lns = append(g.lns, ln.(*net.TCPListener))
	}
	return nil
}

// steer loads the program, inserts every listener into its slot, empties
// the slots this group does not own (left by an earlier tetherd with more
// listeners) and attaches the program to the group.
func (g *Group) steer() error {
	var s *bpf.Steering
	var err error
	if g.cfg.lock != nil {
		s, err = bpf.OpenInherited(g.cfg.pinDir, g.cfg.lock)
		g.cfg.lock = nil // the Steering's now (or closed)
	} else {
		s, err = bpf.Open(g.cfg.pinDir)
	}
	if err != nil {
		return err
	}
	err = func() error {
		for i, ln := range g.lns {
			if err := s.Insert(i, ln); err != nil {
				return err
			}
		}
		for i := len(g.lns); i < bpf.MaxSlots; i++ {
			if err := s.SetSlotState(i, bpf.SlotEmpty, 0); err != nil {
				return err
			}
		}
		return s.Attach(g.lns[0])
	}()
	if err != nil {
		for i := range g.lns {
			_ = s.SetSlotState(i, bpf.SlotEmpty, 0)
		}
		s.Close()
		return err
	}
	g.steering = s
	form, why := s.Form()
	g.log.Info("BPF steering on", "form", form, "why", why, "migrates", form.Migrates())
	return nil
}

// Listeners returns the listeners, index = slot. A drained slot's listener
// is closed.
func (g *Group) Listeners() []net.Listener {
	out := make([]net.Listener, len(g.lns))
	for i, ln := range g.lns {
		out[i] = ln
	}
	return out
}

// Stats returns the counters: in the BPF maps (shared with tetherctl) or in
// this process.
func (g *Group) Stats() *stats.Table { return g.stats }

// Steering returns the BPF steering, nil when running on the kernel hash.
func (g *Group) Steering() *bpf.Steering { return g.steering }

// Drain retires a listener: the slot is marked draining so the program
// stops sending it new connections, Drain waits (at most the drain timeout)
// until its accept queue is empty, then closes it. Whatever is still queued
// at close, including handshakes under way, migrates through the program to
// an active listener: no client sees a reset. The slot ends up empty.
//
// Without BPF nothing stops the kernel hash from choosing the listener and
// queued connections are reset at close unless net.ipv4.tcp_migrate_req=1.
//
// Draining a slot twice waits for the first drain and returns its result.
func (g *Group) Drain(slot int) error {
	if slot < 0 || slot >= len(g.lns) {
		return fmt.Errorf("drain slot %d: the group has slots 0..%d", slot, len(g.lns)-1)
	}
	g.mu.Lock()
	d, ok := g.drains[slot]
	if !ok && len(g.lns)-len(g.drains) <= 1 {
		g.mu.Unlock()
		// The last listener: nothing would accept, nothing would take
		// what is queued. It stays (active again if it was marked).
		if s := g.steering; s != nil {
			if _, weight, err := s.Slot(slot); err == nil {
				_ = s.SetSlotState(slot, bpf.SlotActive, max(weight, 1))
			}
		}
		return fmt.Errorf("drain slot %d: the last listener of the group stays", slot)
	}
	if !ok {
		d = &drain{done: make(chan struct{})}
		g.drains[slot] = d
	}
	g.mu.Unlock()
	if ok {
		<-d.done
		return d.err
	}
	d.err = g.drain(slot)
	close(d.done)
	return d.err
}

func (g *Group) drain(slot int) error {
	ln := g.lns[slot]
	if s := g.steering; s != nil {
		_, weight, err := s.Slot(slot)
		if err != nil {
			return err
		}
		if err := s.SetSlotState(slot, bpf.SlotDraining, weight); err != nil {
			return err
		}
	}
	start := time.Now()
	queued, err := sysconn.AcceptQueue(ln)
	for err == nil && queued > 0 && time.Since(start) < g.cfg.drainTimeout {
		time.Sleep(5 * time.Millisecond)
		queued, err = sysconn.AcceptQueue(ln)
	}
	if err != nil {
		// Closed already (by Close, or the listener failed): nothing to wait for.
		queued = 0
	}
	g.log.Info("listener drained", "slot", slot, "waited", time.Since(start).Round(time.Millisecond), "migrating", queued)
	cerr := ln.Close()
	if errors.Is(cerr, net.ErrClosed) {
		cerr = nil
	}
	if s := g.steering; s != nil {
		if err := s.SetSlotState(slot, bpf.SlotEmpty, 0); err != nil && cerr == nil {
			cerr = err
		}
	}
	// What was queued has migrated, counted pending on the slot the program
	// moved it to; handshakes still under way migrate (and are counted
	// there) when they complete. Nothing pending is left here.
	g.stats.Slot(slot).ResetPending()
	return cerr
}

// watch drains the slots that someone else (tetherctl listeners drain)
// marked draining in slot_table, and settles the pending counts of the
// active ones.
func (g *Group) watch() {
	defer g.watcher.Done()
	t := time.NewTicker(g.cfg.pollInterval)
	defer t.Stop()
	history := make([][]steeredAt, len(g.lns))
	for {
		select {
		case <-g.stop:
			return
		case <-t.C:
		}
		for slot := range g.lns {
			g.mu.Lock()
			_, started := g.drains[slot]
			g.mu.Unlock()
			if started {
				history[slot] = nil
				continue
			}
			state, _, err := g.steering.Slot(slot)
			if err != nil {
				continue
			}
			if state == bpf.SlotActive {
				history[slot] = g.settle(slot, history[slot])
				continue
			}
			history[slot] = nil
			if state != bpf.SlotDraining {
				continue
			}
			g.log.Info("slot marked draining in slot_table: draining its listener", "slot", slot)
			g.watcher.Add(1)
			go func() {
				defer g.watcher.Done()
				if err := g.Drain(slot); err != nil {
					g.log.Error("drain listener", "slot", slot, "err", err)
				}
			}()
		}
	}
}

// steeredAt is a slot's steered count (connections the program counted
// pending there, ever) at a time.
type steeredAt struct {
	at      time.Time
	steered uint64
}

// settle takes off slot's pending count the connections that will never be
// accepted: SYNs the program counted whose handshake never completed
// (client gone, SYN dropped on a full queue and sent again, a syncookie
// SYN). A counted connection that will still be accepted is either in the
// listener's accept queue or still in its handshake, and a handshake takes
// a round trip: at most the handshake grace. So
//
//	pending <= accept queue + steered during the last grace
//
// and whatever pending holds above that is settled (stats.Slot.Settle,
// which also takes it off steer_load). The accept queue is read before
// pending and pending before steered (the program raises steered before
// pending), so a connection moving along meanwhile is never missed; the
// settle is a compare-and-swap against the pending value read, so a SYN
// steered or an accept made since makes it a no-op until the next poll.
// What is left:
//   - a leaked count stays on the slot (which then looks one connection
//     heavier) for up to the grace plus a poll interval, longer while the
//     accept queue holds connections the program did not count (the kernel
//     hash chose them), since the queue length covers for them;
//   - a handshake slower than the grace (a lost SYN-ACK), or a connection
//     accepted but not yet counted Opened, is settled too early: its slot
//     looks one connection lighter until it is accepted, and then exact
//     again, because Opened adds to steer_load a connection it finds no
//     pending count for.
//
// history holds the steered samples of the last grace (and one older); the
// slot is settled only once it reaches back that far.
func (g *Group) settle(slot int, history []steeredAt) []steeredAt {
	queued, err := sysconn.AcceptQueue(g.lns[slot])
	if err != nil {
		return nil // closed: Drain or Close resets its counts
	}
	st := g.stats.Slot(slot)
	pending := atomic.LoadUint64(&st.Pending)
	now := time.Now()
	history = append(history, steeredAt{now, atomic.LoadUint64(&st.Steered)})
	horizon := now.Add(-g.cfg.handshakeGrace)
	// Keep one sample at or before the horizon: the steered count then.
	for len(history) > 1 && !history[1].at.After(horizon) {
		history = history[1:]
	}
	if history[0].at.After(horizon) {
		return history // not watched for a grace yet
	}
	recent := history[len(history)-1].steered - history[0].steered
	if bound := uint64(queued) + recent; pending > bound && st.Settle(pending, pending-bound) {
		g.log.Debug("settled pending connections that will not be accepted",
			"slot", slot, "settled", pending-bound, "queued", queued, "steered_recently", recent)
	}
	return history
}

// Close stops the watcher, empties the group's slots and closes the
// listeners and the steering descriptors (the pinned maps stay, and so does
// the counters memory: connections still finishing may count).
func (g *Group) Close() error {
	var err error
	g.closeOnce.Do(func() {
		close(g.stop)
		if s := g.steering; s != nil {
			for i := range g.lns {
				_ = s.SetSlotState(i, bpf.SlotEmpty, 0)
			}
		}
		err = g.closeListeners()
		g.watcher.Wait()
		// Nothing queued survives the close of the last listener.
		for i := range g.lns {
			g.stats.Slot(i).ResetPending()
		}
		if s := g.steering; s != nil {
			if cerr := s.Close(); cerr != nil && err == nil {
				err = cerr
			}
		}
	})
	return err
}

// Handover returns new descriptors of the listeners (index = slot) and of
// the pin directory lock (nil without BPF), for the process that takes
// over (package upgrade). The group keeps its own.
func (g *Group) Handover() ([]*os.File, *os.File, error) {
	var files []*os.File
	closeAll := func() {
		for _, f := range files {
			f.Close()
		}
	}
	for i, ln := range g.lns {
		f, err := sysd.Dup(ln) // not ln.File(): it would make ln blocking
		if err != nil {
			closeAll()
			return nil, nil, fmt.Errorf("listener %d: %w", i, err)
		}
		files = append(files, f)
	}
	var lock *os.File
	if g.steering != nil {
		var err error
		if lock, err = g.steering.LockFile(); err != nil {
			closeAll()
			return nil, nil, err
		}
	}
	return files, lock, nil
}

// Detach is Close for a group handed over to a new process: it stops the
// watcher and closes this process's descriptors, but leaves the slots as
// they are (the sockets live on in the new process, which owns the pins)
// and resets nothing.
func (g *Group) Detach() error {
	var err error
	g.closeOnce.Do(func() {
		close(g.stop)
		err = g.closeListeners()
		g.watcher.Wait()
		if s := g.steering; s != nil {
			if cerr := s.Close(); cerr != nil && err == nil {
				err = cerr
			}
		}
	})
	return err
}

func (g *Group) closeListeners() error {
	var errs []error
	for _, ln := range g.lns {
		if err := ln.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
