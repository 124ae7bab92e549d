package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// DefaultPidfile is where the unit file has tetherd write its PID.
const DefaultPidfile = "/run/tetherd/tetherd.pid"

const upgradeUsage = "upgrade [--pidfile FILE] [--timeout 90s]   replace tetherd in place (SIGUSR2) and wait for the new process"

// cmdUpgrade signals the tetherd named by the pidfile to upgrade in place
// (SIGUSR2) and waits until the pidfile names a new, running process: the
// new tetherd took over. If the pidfile still names the old process when
// the timeout ends, the upgrade failed and the old process serves on (its
// log says why).
type upgradeOpts struct {
	pidfile *string
	timeout *time.Duration
}

func upgradeFlags() (*flag.FlagSet, upgradeOpts) {
	fs, _ := newFlags("upgrade")
	return fs, upgradeOpts{
		pidfile: fs.String("pidfile", DefaultPidfile, "tetherd's --pidfile"),
		timeout: fs.Duration("timeout", 90*time.Second, "wait this long for the new process"),
	}
}

func cmdUpgrade(args []string, stdout io.Writer) error {
	fs, o := upgradeFlags()
	pidfile, timeout := o.pidfile, o.timeout
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 0 {
		return usagef("unexpected argument %q", pos[0])
	}
	old, err := pidOf(*pidfile)
	if err != nil {
		return err
	}
	if err := syscall.Kill(old, syscall.SIGUSR2); err != nil {
		return fmt.Errorf("signal tetherd %d: %w", old, err)
	}
	deadline := time.Now().Add(*timeout)
	for time.Now().Before(deadline) {
		if p, err := pidOf(*pidfile); err == nil && p != old && syscall.Kill(p, 0) == nil {
			fmt.Fprintf(stdout, "upgraded: tetherd %d took over from %d (which finishes its requests in flight)\n", p, old)
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("no new tetherd after %v: the upgrade failed and %d serves on (see its log)", *timeout, old)
}

// pidOf reads a pidfile and checks that the process exists.
func pidOf(path string) (int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, fmt.Errorf("pidfile: %w (is tetherd running with --pidfile %s?)", err, path)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 {
		return 0, fmt.Errorf("pidfile %s: %q is not a pid", path, b)
	}
	if err := syscall.Kill(pid, 0); errors.Is(err, syscall.ESRCH) {
		return 0, fmt.Errorf("pidfile %s names %d, which is not running", path, pid)
	}
	return pid, nil
}
