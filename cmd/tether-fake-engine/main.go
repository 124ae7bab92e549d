// Command tether-fake-engine serves fake SGLang or vLLM inference engines
// (package testenv/fakeengine) until SIGINT or SIGTERM:
//
//	tether-fake-engine --kind sglang --listen 127.0.0.1:30000
//	tether-fake-engine --kind vllm --count 8 --port-base 31000   # 127.0.0.1:31000..31007
//
// It prints the URL of each engine, one a line, on stdout once all of them
// listen.
package main

import (
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"strconv"
	"syscall"

	"github.com/tether-rl/tether/testenv/fakeengine"
)

func main() {
	var cfg fakeengine.Config
	kind := flag.String("kind", "sglang", "engine to imitate: sglang or vllm")
	listen := flag.String("listen", "127.0.0.1:30000", "address to listen on (one engine)")
	count := flag.Int("count", 1, "number of engines")
	portBase := flag.Int("port-base", 0, "with --count: engine i listens on --listen's host, port port-base+i (0: free ports)")
	name := flag.String("name", "", "model name in answers and metrics (default fake-<kind>, with -<i> when --count > 1)")
	flag.IntVar(&cfg.KVBlocks, "kv-blocks", 2048, "paged KV capacity in blocks")
	flag.IntVar(&cfg.BlockTokens, "block-tokens", 16, "tokens per KV block")
	flag.IntVar(&cfg.MaxRunning, "max-running", 64, "running batch size cap")
	flag.DurationVar(&cfg.PrefillPerToken, "prefill-per-token", 0, "compute per uncached prompt token (default 2µs)")
	flag.DurationVar(&cfg.DecodeStep, "decode-step", 0, "one decode step of the running batch (default 2ms)")
	flag.StringVar(&cfg.WeightVersion, "weight-version", "v0", "initial weight version")
	flag.DurationVar(&cfg.UpdateDelay, "update-delay", 0, "how long a weight update takes (default 50ms)")
	flag.StringVar(&cfg.APIKey, "api-key", "", "require Authorization: Bearer KEY")
	verbose := flag.Bool("v", false, "log at debug level")
	flag.Parse()
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "tether-fake-engine: unexpected arguments %q\n", flag.Args())
		os.Exit(2)
	}
	k, err := fakeengine.ParseKind(*kind)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	if *count < 1 {
		fmt.Fprintln(os.Stderr, "tether-fake-engine: --count must be at least 1")
		os.Exit(2)
	}
	cfg.Kind = k
	level := slog.LevelInfo
	if *verbose {
		level = slog.LevelDebug
	}
	cfg.Log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))

	host, port, err := net.SplitHostPort(*listen)
	if err != nil {
		fmt.Fprintf(os.Stderr, "tether-fake-engine: --listen %q: %v\n", *listen, err)
		os.Exit(2)
	}
	var engines []*fakeengine.Engine
	closeAll := func() {
		for _, e := range engines {
			e.Close()
		}
	}
	for i := 0; i < *count; i++ {
		c := cfg
		c.Name = *name
		if c.Name == "" {
			c.Name = "fake-" + k.String()
		}
		addr := *listen
		if *count > 1 {
			c.Name += "-" + strconv.Itoa(i)
			p := "0"
			if *portBase > 0 {
				p = strconv.Itoa(*portBase + i)
			}
			addr = net.JoinHostPort(host, p)
		} else if *portBase > 0 && port == "30000" {
			addr = net.JoinHostPort(host, strconv.Itoa(*portBase))
		}
		e, err := fakeengine.StartAt(c, addr)
		if err != nil {
			closeAll()
			fmt.Fprintf(os.Stderr, "tether-fake-engine: listen %s: %v\n", addr, err)
			os.Exit(1)
		}
		engines = append(engines, e)
	}
	for _, e := range engines {
		fmt.Println(e.URL())
	}

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	<-sig
	signal.Stop(sig) // a second signal kills the process at once
	closeAll()
}
