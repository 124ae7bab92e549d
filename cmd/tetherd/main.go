// Command tetherd is tether's router daemon: an HTTP/1.1 proxy that keeps
// every session of an RL rollout on the worker that owns it.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	_ "net/http/pprof"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/tether-rl/tether/userspace/daemon"
)

type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "tetherd:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	fs := flag.NewFlagSet("tetherd", flag.ContinueOnError)
	var workers multiFlag
	opts := daemon.Options{}
	fs.StringVar(&opts.Listen, "listen", "127.0.0.1:8080", "data-plane address")
	fs.Var(&workers, "worker", "backend worker URL (repeatable; slot = order given)")
	fs.IntVar(&opts.Demo, "demo", 0, "start N built-in demo session workers on loopback and route to them")
	fs.StringVar(&opts.BadSession, "bad-session", "spread", "session id naming no worker: spread or reject (404)")
	fs.DurationVar(&opts.ResponseTimeout, "response-timeout", 30*time.Minute, "wait for the first response byte before 504")
	fs.IntVar(&opts.Listeners, "listeners", 1, "listener sockets in the SO_REUSEPORT group")
	grace := fs.Duration("shutdown-grace", 30*time.Second, "on SIGTERM, time given to requests in progress")
	logLevel := fs.String("log-level", "info", "debug, info, warn or error")
	pprofAddr := fs.String("pprof", "", "serve net/http/pprof on this address (debugging; keep it on loopback)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(*logLevel)); err != nil {
		return fmt.Errorf("--log-level: %w", err)
	}
	opts.Log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl}))
	opts.Workers = workers

	if *pprofAddr != "" {
		go func() { opts.Log.Error("pprof stopped", "err", http.ListenAndServe(*pprofAddr, nil)) }()
	}
	d, err := daemon.New(opts)
	if err != nil {
		return err
	}
	d.Serve()
	if opts.Demo > 0 {
		fmt.Fprintf(os.Stderr, "\ntether is running with %d demo workers. Try:\n"+
			"  curl -s -XPOST http://%[2]s/sessions\n"+
			"  curl -s http://%[2]s/sessions/<session_id>/v1/chat/completions -d '{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}'\n"+
			"  curl -s http://%[2]s/health\n\n", opts.Demo, d.Addr())
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	s := <-sig
	opts.Log.Info("shutting down", "signal", s.String(), "grace", *grace)
	ctx, cancel := context.WithTimeout(context.Background(), *grace)
	defer cancel()
	return d.Shutdown(ctx)
}
