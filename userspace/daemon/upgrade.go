package daemon

// Upgrade in place (SIGUSR2, tetherctl upgrade): this process hands its
// listening sockets, admin socket, pin-directory lock and the workers
// added at run time to a new tetherd (package upgrade), waits for it to
// serve, then retires: it stops accepting and finishes what it has, while
// the new process accepts every new connection from the same sockets.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"time"

	"github.com/tether-rl/tether/userspace/fleet"
	"github.com/tether-rl/tether/userspace/proxy"
	"github.com/tether-rl/tether/userspace/registry"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/sysd"
	"github.com/tether-rl/tether/userspace/upgrade"
	"github.com/tether-rl/tether/userspace/upstream"
	"github.com/tether-rl/tether/userspace/worker"
)

// Names of the descriptors handed over.
const (
	fdData    = "data-" // + slot
	fdAdmin   = "admin"
	fdPinLock = "pinlock"
	fdState   = "state"
)

// handedState is what the successor learns besides the sockets.
type handedState struct {
	// InstanceID: /health's id stays the same across an upgrade (miles
	// reads a change as "session server identity changed").
	InstanceID string         `json:"instance_id"`
	Workers    []handedWorker `json:"workers"`
	// Fleet: the weight sync's phase and versions (a tetherd upgraded
	// while the fleet is paused keeps holding).
	Fleet *fleet.State `json:"fleet,omitempty"`
}

// handedWorker is a worker added at run time (admin API), carried over.
type handedWorker struct {
	Slot        int    `json:"slot"`
	URL         string `json:"url"`
	Draining    bool   `json:"draining,omitempty"`
	MaxInFlight uint64 `json:"max_in_flight,omitempty"`
}

// ErrUpgradeSpawn: --spawn workers are this process's children.
var ErrUpgradeSpawn = errors.New("upgrade with --spawn is not supported (the worker processes are children of this tetherd): restart instead")

// Upgrade starts exe with args as this tetherd's successor and waits up to
// timeout for it to serve. On success the caller retires this process
// (Retire); on failure this process goes on serving and the error says
// why.
func (d *Daemon) Upgrade(exe string, args []string, stderr *os.File, timeout time.Duration) (p *os.Process, err error) {
	defer func() {
		if d.Metrics != nil {
			d.Metrics.CountUpgrade(err == nil) // tether_upgrades_total
		}
	}()
	if d.Supervisor != nil {
		return nil, ErrUpgradeSpawn
	}
	files, err := d.handover()
	defer func() {
		for _, f := range files {
			f.File.Close()
		}
	}()
	if err != nil {
		return nil, fmt.Errorf("upgrade: %w", err)
	}
	p, err = upgrade.Start(exe, args, files, stderr, timeout)
	if err != nil {
		return nil, fmt.Errorf("upgrade: %w", err)
	}
	return p, nil
}

// handover collects the descriptors and state for the successor.
func (d *Daemon) handover() ([]upgrade.File, error) {
	var files []upgrade.File
	lns, lock, err := d.Group.Handover()
	if err != nil {
		return nil, err
	}
	for i, f := range lns {
		files = append(files, upgrade.File{Name: fdData + strconv.Itoa(i), File: f})
	}
	if lock != nil {
		files = append(files, upgrade.File{Name: fdPinLock, File: lock})
	}
	if ln, ok := d.ctl.adminLn.(*net.TCPListener); ok {
		f, err := sysd.Dup(ln)
		if err != nil {
			return files, fmt.Errorf("admin listener: %w", err)
		}
		files = append(files, upgrade.File{Name: fdAdmin, File: f})
	}
	var ws []handedWorker
	for _, in := range d.Registry.List() {
		if in.Origin != registry.OriginAdmin || in.State == registry.StatePending || in.State == registry.StateRemoved {
			continue
		}
		ws = append(ws, handedWorker{Slot: in.Slot, URL: in.URL, Draining: in.State == registry.StateDraining, MaxInFlight: in.MaxInFlight})
	}
	fst := d.Fleet.Export()
	state, _ := json.Marshal(handedState{InstanceID: d.InstanceID, Workers: ws, Fleet: &fst})
	f, err := upgrade.Memfd(fdState, state)
	if err != nil {
		return files, err
	}
	return append(files, upgrade.File{Name: fdState, File: f}), nil
}

// inheritedListeners turns the handed-over data sockets into listeners
// (nil when none were handed over).
func inheritedListeners(in *upgrade.Inherited, k int) ([]*net.TCPListener, *os.File, error) {
	var lns []*net.TCPListener
	for i := 0; ; i++ {
		f := in.Take(fdData + strconv.Itoa(i))
		if f == nil {
			break
		}
		ln, err := sysd.TCPListener(f)
		f.Close()
		if err != nil {
			for _, l := range lns {
				l.Close()
			}
			return nil, nil, err
		}
		lns = append(lns, ln)
	}
	return lns, in.Take(fdPinLock), nil
}

// handedOver reads the state the old process handed over (nil: none).
func handedOver(in *upgrade.Inherited) (*handedState, error) {
	f := in.Take(fdState)
	if f == nil {
		return nil, nil
	}
	defer f.Close()
	var st handedState
	if err := json.NewDecoder(f).Decode(&st); err != nil {
		return nil, fmt.Errorf("upgrade: unreadable state from the old process: %w", err)
	}
	return &st, nil
}

// restoreWorkers puts the workers the old process had added at run time
// into their slots (healthy, as they were: the health checks go on).
func (d *Daemon) restoreWorkers(st *handedState) {
	if st == nil {
		return
	}
	for _, w := range st.Workers {
		if w.MaxInFlight > 0 {
			d.Registry.SetCapacity(w.URL, w.MaxInFlight)
		}
		if _, err := d.Registry.Put(w.Slot, w.URL, registry.OriginAdmin); err != nil {
			d.log.Warn("upgrade: worker of the old process not restored", "slot", w.Slot, "url", w.URL, "err", err)
			continue
		}
		if w.Draining {
			d.Registry.Drain(strconv.Itoa(w.Slot))
		}
	}
}

// Ready tells the old process of an upgrade that this one serves (it then
// retires); without one it does nothing.
func (d *Daemon) Ready() error { return d.opts.Inherited.Ready() }

// Retire finishes this process after an upgrade handed its sockets over:
// it stops accepting (the sockets stay open in the new process, with the
// connections queued on them), answers what it has in flight and every
// request still sent on its keep-alive connections, each with Connection:
// close, and releases its descriptors without touching the pinned slots.
//
// It closes no idle keep-alive connection before the idle timeout
// (--idle-timeout, as while serving: proxy.KeepIdle): a client that wrote
// on a pooled connection as it closed would lose that request, and a
// retiring process still has its workers to answer it. So it exits once
// its last connection ended: within --idle-timeout of the upgrade
// (default 2m) or of the end of its longest request, whichever is later,
// and at the latest when ctx ends (--drain-timeout, default 15m), which
// closes what is left.
func (d *Daemon) Retire(ctx context.Context) error {
	d.retired.Store(true)
	if srv := d.ctl.adminSrv; srv != nil {
		// The admin API is the successor's from now on (the admin socket
		// lives on there): no admin request may change or read this
		// process for the minutes it may still keep idle connections.
		// Shutdown with a context already done closes the listener and
		// the idle connections and returns; the requests in progress are
		// answered (stopControl waits for them).
		now, cancel := context.WithCancel(ctx)
		cancel()
		srv.Shutdown(now)
		d.log.Info("retiring: the admin API is the new tetherd's")
	}
	if d.Proxy != nil {
		go func() {
			// Only once this process accepts nothing more: a forwarded
			// request must reach the successor, not come back here.
			d.Proxy.WaitAcceptStopped()
			d.forwardHeld()
		}()
	}
	return d.ShutdownGently(ctx, proxy.KeepIdle)
}

// StopIdleGrace: stopped with its sockets in systemd's fd store (a
// restart), tetherd closes a keep-alive connection once it has been idle
// this long (proxy.ShutdownGently); the others get Connection: close on
// their next response. A stop cannot wait out the idle timeout (no process
// accepts until this one has exited), so a client that writes on such a
// connection just as it closes can still lose that request: an upgrade
// (Retire) is the way without that risk.
const StopIdleGrace = time.Second

// Sockets returns new descriptors of the listening sockets by name
// (data-<slot>, admin), for systemd's file-descriptor store: a restarted
// tetherd finds them there, and connections that arrive while no process
// runs wait in their backlog. (Never the pin lock: the store would hold it
// for the next process.)
func (d *Daemon) Sockets() ([]upgrade.File, error) {
	lns, lock, err := d.Group.Handover()
	if lock != nil {
		lock.Close()
	}
	if err != nil {
		return nil, err
	}
	var files []upgrade.File
	for i, f := range lns {
		files = append(files, upgrade.File{Name: fdData + strconv.Itoa(i), File: f})
	}
	if ln, ok := d.ctl.adminLn.(*net.TCPListener); ok {
		if f, err := sysd.Dup(ln); err == nil {
			files = append(files, upgrade.File{Name: fdAdmin, File: f})
		}
	}
	return files, nil
}

// forwardHeld: once retiring (its successor serves and this process
// accepts nothing more), this process sends every generation request it
// still reads on its open connections, and every request it holds, to
// its successor through the data port, and so do the sync's calls
// (engine.Local): the successor owns the fleet's phase from now on. A
// pause sent to the successor would not reach this process's hold, and
// one sent here would not reach the successor's; what this process holds
// would wait here until its pause timeout. Requests already at an engine
// finish here.
func (d *Daemon) forwardHeld() {
	addr := d.Addr()
	if host, port, err := net.SplitHostPort(addr); err == nil {
		if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
			lo := "127.0.0.1"
			if ip.To4() == nil {
				lo = "::1"
			}
			addr = net.JoinHostPort(lo, port)
		}
	}
	ws := stats.NewHeap().Worker(0)
	w := &worker.Worker{Slot: -1, URL: "http://" + addr, Addr: addr, Stats: ws, Pool: upstream.New(addr, ws, d.opts.Pool)}
	d.log.Info("retiring: generation requests still read here, and the held ones, go to the new tetherd", "held", d.Fleet.HeldNow(), "to", addr)
	d.Fleet.Forward(w)
}
