package main

import (
	"flag"
	"fmt"
	"os"
	"runtime"
	"strings"

	"github.com/tether-rl/tether/userspace/evloop"
)

// runEvloopProxy is the "evloop-exp" target's process: the event-loop
// experiment of userspace/evloop (tether-bench evloop-proxy --listen ADDR
// --workers H:P,H:P).
func runEvloopProxy(args []string) {
	fs := flag.NewFlagSet("evloop-proxy", flag.ExitOnError)
	listen := fs.String("listen", "127.0.0.1:8080", "")
	workers := fs.String("workers", "", "comma list of host:port")
	loops := fs.Int("loops", runtime.NumCPU(), "event loops (threads)")
	fs.Parse(args)
	if err := evloop.Serve(*listen, strings.Split(*workers, ","), *loops); err != nil {
		fmt.Fprintln(os.Stderr, "evloop-proxy:", err)
		os.Exit(1)
	}
}

func (b *bench) startEvloop() (*instance, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	var ws []string
	for _, p := range b.workerPorts {
		ws = append(ws, fmt.Sprintf("127.0.0.1:%d", p))
	}
	p, port, err := b.m.startServer(b.ctx, "evloop-exp", self, func(port int) ([]string, error) {
		return []string{"evloop-proxy", "--listen", fmt.Sprintf("127.0.0.1:%d", port), "--workers", strings.Join(ws, ",")}, nil
	}, "/health")
	if err != nil {
		return nil, err
	}
	return &instance{port: port, procs: []*proc{p}, stop: func() { b.m.stop(p) }}, nil
}
