package main

// Process lifecycle around the daemon: what an old tetherd or systemd
// handed over, the pidfile, and systemd's notify protocol.

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/userspace/daemon"
	"github.com/tether-rl/tether/userspace/sysd"
	"github.com/tether-rl/tether/userspace/upgrade"
)

// inherited returns the sockets handed to this process: by the tetherd it
// replaces (SIGUSR2), else by systemd (socket activation, or the fd store
// after a restart), else nil.
func inherited() (*upgrade.Inherited, error) {
	in, err := upgrade.Inherit()
	if err != nil || in != nil {
		return in, err
	}
	ls, err := sysd.Listeners()
	if err != nil {
		return nil, err
	}
	files := map[string]*os.File{}
	for _, l := range ls {
		if _, dup := files[l.Name]; dup {
			l.File.Close() // the same socket stored twice
			continue
		}
		files[l.Name] = l.File
	}
	return upgrade.FromFiles(files), nil
}

// writePidfile writes pid to path atomically (a temporary file renamed
// over it): a reader never sees it half written.
func writePidfile(path string, pid int) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return fmt.Errorf("--pidfile %s: %w", path, err)
	}
	_, err = tmp.WriteString(strconv.Itoa(pid) + "\n")
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Chmod(tmp.Name(), 0o644)
	}
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("--pidfile %s: %w", path, err)
	}
	return nil
}

// removePidfile removes path if it still names pid (after an upgrade it
// names the new process: left alone).
func removePidfile(path string, pid int) {
	b, err := os.ReadFile(path)
	if err == nil && strings.TrimSpace(string(b)) == strconv.Itoa(pid) {
		os.Remove(path)
	}
}

// notify sends state to systemd, if it runs us with a notify socket.
func notify(log *slog.Logger, state string, files ...*os.File) {
	if _, err := sysd.Notify(state, files...); err != nil {
		log.Warn("systemd notify failed", "err", err)
	}
}

// notifyMainPID tells systemd that this process, started by an upgrade
// of process from, is the unit's main process now, and waits until systemd
// has read it (BARRIER=1, systemd 246+; an older one closes the descriptor
// unread too) before the old process hears that this one serves and may
// exit: a main process that exits before systemd knows its successor stops
// the unit, and systemd kills the new tetherd (make vmtest, systemd 252:
// the first upgrade under the unit ended the service). The watchdog is
// this process's now: WATCHDOG_PID, inherited from the old process, names
// this one (else it would never send WATCHDOG=1, and systemd killed it
// WatchdogSec after the old one exited), and the first WATCHDOG=1 goes
// with MAINPID= (upgrades in a row faster than WatchdogSec/2 would
// otherwise starve the watchdog).
func notifyMainPID(log *slog.Logger, from int) {
	if os.Getenv("NOTIFY_SOCKET") == "" {
		return
	}
	state := "MAINPID=" + strconv.Itoa(os.Getpid())
	if os.Getenv("WATCHDOG_USEC") != "" && os.Getenv("WATCHDOG_PID") == strconv.Itoa(from) {
		os.Setenv("WATCHDOG_PID", strconv.Itoa(os.Getpid()))
		state += "\nWATCHDOG=1"
	}
	notify(log, state)
	r, w, err := os.Pipe()
	if err != nil {
		log.Warn("systemd notify barrier", "err", err)
		return
	}
	defer r.Close()
	_, err = sysd.Notify("BARRIER=1", w)
	w.Close()
	if err != nil {
		log.Warn("systemd notify barrier", "err", err)
		return
	}
	r.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := r.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		log.Warn("systemd did not confirm the new MAINPID within 5s", "err", err)
	}
}

// notifyReady tells systemd this process serves (and, after an upgrade,
// that it is the main process now), and parks the listening sockets in
// its file-descriptor store for the next restart. It reports whether it
// stored them.
func notifyReady(d *daemon.Daemon, log *slog.Logger) bool {
	if os.Getenv("NOTIFY_SOCKET") == "" {
		return false
	}
	notify(log, "READY=1\nMAINPID="+strconv.Itoa(os.Getpid())+"\nSTATUS=serving on "+d.Addr())
	files, err := d.Sockets()
	if err != nil {
		log.Warn("systemd fd store: sockets not stored", "err", err)
		return false
	}
	stored := true
	for _, f := range files {
		if _, err := sysd.Notify("FDSTORE=1\nFDNAME="+f.Name, f.File); err != nil {
			log.Warn("systemd fd store: socket not stored", "name", f.Name, "err", err)
			stored = false
		}
		f.File.Close()
	}
	return stored
}

// clusterSynced waits, in cluster mode, until the replica has applied its
// first list of etcd's table, so that systemd hears READY=1 only from a
// replica that knows the workers (docs/cluster.md). Not after an upgrade:
// the old process's table was handed over and routes, and systemd must
// learn the new MAINPID. A SIGINT or SIGTERM that comes first ends the
// wait (false: no READY=1); it and any other signal are handled by the
// main loop afterwards.
func clusterSynced(d *daemon.Daemon, in *upgrade.Inherited, sig chan os.Signal, log *slog.Logger) bool {
	synced := d.ClusterSynced()
	if synced == nil || (in != nil && in.From != 0) {
		return true
	}
	var later []os.Signal
	defer func() {
		for _, s := range later {
			select {
			case sig <- s:
			default: // full: signals that came meanwhile are in it
			}
		}
	}()
	select {
	case <-synced:
		return true
	default:
	}
	log.Info("cluster mode: ready (systemd READY=1) once the table in etcd is listed")
	for {
		select {
		case <-synced:
			log.Info("cluster: the table in etcd is listed and watched: ready")
			return true
		case s := <-sig:
			if s == syscall.SIGINT || s == syscall.SIGTERM {
				later = append([]os.Signal{s}, later...)
				return false
			}
			later = append(later, s)
		}
	}
}

// watchdog pings systemd at half its WatchdogSec; the returned func stops.
func watchdog(log *slog.Logger) func() {
	every := sysd.WatchdogInterval()
	if every <= 0 {
		return func() {}
	}
	stop := make(chan struct{})
	go func() {
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				notify(log, "WATCHDOG=1")
			}
		}
	}()
	return func() { close(stop) }
}

// monotonicUsec is CLOCK_MONOTONIC in µs (RELOADING=1 wants it).
func monotonicUsec() string {
	var ts unix.Timespec
	unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return strconv.FormatInt(ts.Nano()/1000, 10)
}
