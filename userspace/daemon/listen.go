package daemon

import (
	"errors"
	"fmt"
	"log/slog"
	"os"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/bpf"
	"github.com/tether-rl/tether/userspace/listener"
)

// openListeners opens the SO_REUSEPORT group of opts.Listeners sockets,
// steered by the BPF program when opts.BPF allows and it loads.
func openListeners(opts Options) (*listener.Group, error) {
	mode := opts.BPF
	if mode == "" {
		mode = bpf.ModeAuto
	}
	var lopts []listener.Option
	if opts.PinDir != "" {
		lopts = append(lopts, listener.WithPinDir(opts.PinDir))
	} else if mode != bpf.ModeOff {
		if err := mountBPFFS(bpfRoot, opts.Log); err != nil {
			opts.Log.Warn("could not mount bpffs", "path", bpfRoot, "err", err)
		}
	}
	if opts.Inherited != nil {
		lns, lock, err := inheritedListeners(opts.Inherited, opts.Listeners)
		if err != nil {
			return nil, fmt.Errorf("upgrade: %w", err)
		}
		if lns != nil {
			lopts = append(lopts, listener.WithInherited(lns, lock))
		} else if lock != nil {
			lock.Close()
		}
	}
	g, err := listener.Listen(opts.Listen, opts.Listeners, mode, opts.Log, lopts...)
	if err != nil {
		return nil, err
	}
	return g, nil
}

// bpfRoot is where the default pin directory lives.
const bpfRoot = "/sys/fs/bpf"

// mountBPFFS mounts bpffs at path when root and nothing is mounted there,
// as systemd does at boot on most distributions (and cilium-agent does
// where it does not): pinned maps need it. Not root: nothing to do, the
// listener group reports what is missing.
func mountBPFFS(path string, log *slog.Logger) error {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil // no sysfs mount point: leave it to the group's error
		}
		return fmt.Errorf("statfs: %w", err)
	}
	if st.Type == unix.BPF_FS_MAGIC || os.Geteuid() != 0 {
		return nil
	}
	if err := unix.Mount("bpf", path, "bpf", 0, "mode=0700"); err != nil {
		return fmt.Errorf("mount -t bpf bpf %s: %w", path, err)
	}
	log.Info("mounted bpffs for the pinned maps", "path", path)
	return nil
}
