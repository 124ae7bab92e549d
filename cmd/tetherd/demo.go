package main

import (
	"fmt"

	"github.com/tether-rl/tether/userspace/daemon"
	"github.com/tether-rl/tether/userspace/demo"
)

// maxDemo bounds --demo.
const maxDemo = 256

// startDemos is --demo N: it starts N demo session workers
// (userspace/demo) on loopback and hands their URLs to the daemon as
// StartedWorkers, in the slots after --spawn's and --worker's (each
// worker's index, which it reports in X-Tether-Demo-Worker, is its slot).
// The daemon routes to them like to any worker; stop closes them once the
// daemon is done.
func startDemos(opts *daemon.Options, n int) (stop func(), err error) {
	if n < 0 || n > maxDemo {
		return nil, fmt.Errorf("--demo %d: want 0..%d", n, maxDemo)
	}
	var servers []*demo.Server
	stop = func() {
		for _, s := range servers {
			s.Close()
		}
	}
	first := opts.Spawn.N + len(opts.Workers)
	for i := range n {
		s, err := demo.Start("127.0.0.1:0", demo.Options{Index: first + i})
		if err != nil {
			stop()
			return nil, fmt.Errorf("start demo worker %d: %w", i, err)
		}
		servers = append(servers, s)
		opts.StartedWorkers = append(opts.StartedWorkers, s.URL())
	}
	return stop, nil
}
