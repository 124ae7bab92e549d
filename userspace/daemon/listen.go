package daemon

import (
	"fmt"

	"github.com/tether-rl/tether/bpf"
	"github.com/tether-rl/tether/userspace/listener"
)

// openListeners opens the SO_REUSEPORT group of opts.Listeners sockets,
// steered by the BPF program when opts.BPF allows and it loads.
func openListeners(opts Options) (*listener.Group, error) {
	m := opts.BPF
	if m == "" {
		m = string(bpf.ModeAuto)
	}
	mode, err := bpf.ParseMode(m)
	if err != nil {
		return nil, fmt.Errorf("--bpf: %w", err)
	}
	var lopts []listener.Option
	if opts.PinDir != "" {
		lopts = append(lopts, listener.WithPinDir(opts.PinDir))
	}
	g, err := listener.Listen(opts.Listen, opts.Listeners, mode, opts.Log, lopts...)
	if err != nil {
		return nil, err
	}
	return g, nil
}
