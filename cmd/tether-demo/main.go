// Command tether-demo serves one demo session worker (package
// userspace/demo) until SIGINT or SIGTERM:
//
//	tether-demo --listen 127.0.0.1:30001 --index 0 [--stream-delay 0] [--stream-chunks 4] [--bare-ids]
package main

import (
	"context"
	"flag"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/tether-rl/tether/userspace/demo"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:30001", "address to listen on")
	index := flag.Int("index", 0, "worker index: session ids are w<index>-<32 hex>")
	delay := flag.Duration("stream-delay", 0, "pause between stream chunks")
	chunks := flag.Int("stream-chunks", demo.DefaultStreamChunks, "content chunks per stream")
	bare := flag.Bool("bare-ids", false, "mint plain uuid session ids (no w<index>- prefix) and 404 turns of sessions not minted here, as a session server that knows nothing of tether")
	flag.Parse()
	if flag.NArg() > 0 {
		slog.Error("unexpected arguments", "args", flag.Args())
		os.Exit(2)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	s, err := demo.Start(*listen, demo.Options{Index: *index, StreamDelay: *delay, StreamChunks: *chunks, BareIDs: *bare})
	if err != nil {
		slog.Error("tether-demo: listen failed", "listen", *listen, "err", err)
		os.Exit(1)
	}
	slog.Info("tether-demo serving", "url", s.URL(), "index", *index,
		"stream_delay", *delay, "stream_chunks", *chunks)

	<-ctx.Done()
	stop() // a second signal kills the process at once

	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := s.Shutdown(sctx); err != nil {
		slog.Error("tether-demo: shutdown", "err", err)
		os.Exit(1)
	}
}
