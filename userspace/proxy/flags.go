package proxy

import (
	"flag"

	"github.com/tether-rl/tether/userspace/config"
	"github.com/tether-rl/tether/userspace/httphead"
)

// DefaultMaxBodyBytes is --max-body-bytes' default (RL bodies are large);
// Config.MaxBodyBytes 0, the library's zero, is no limit.
const DefaultMaxBodyBytes = 16 << 30

// settings declares Config's settings: tetherd's flags, their defaults
// and ranges (RegisterFlags, Validate).
func (c *Config) settings() []config.Setting {
	return []config.Setting{
		config.Num(&c.ResponseTimeout, "response-timeout", DefaultResponseTimeout, config.Positive, "wait for the first response byte before 504 (> 0)"),
		config.Num(&c.SpliceMin, "splice-min", DefaultSpliceMin, config.Positive, "body remainders of at least this many bytes move with splice(2), smaller ones are copied (> 0)"),
		config.Num(&c.IdleTimeout, "idle-timeout", DefaultIdleTimeout, config.Positive, "close a client keep-alive connection idle this long (> 0)"),
		config.Num(&c.ParkAfter, "park-after", 0, config.Any, "a connection a goroutine served (streamed body, Expect, local or queued request) goes back to its listener's event loop once idle this long (0: at once; -1s: never)").Type("duration"),
		config.Switch(&c.Ring, "io-uring", true, "event loops batch each wake-up's socket reads and writes through an io_uring (one io_uring_enter instead of a system call each); false, or a kernel that refuses io_uring: one system call each"),
		config.Num(&c.HeadTimeout, "head-timeout", DefaultHeadTimeout, config.Positive, "a request head not complete this long after its first byte gets 408 (slowloris) (> 0)"),
		config.Num(&c.IOTimeout, "io-timeout", DefaultIOTimeout, config.Positive, "a request or response body that makes no progress this long ends the exchange (> 0)"),
		config.Num(&c.StreamIdleTimeout, "stream-idle-timeout", DefaultStreamIdleTimeout, config.Positive, "a streamed response (SSE, chunked) whose worker sends nothing this long is cut, visibly to the client (a stopped engine frees its clients) (> 0)"),
		config.Num(&c.MaxBodyBytes, "max-body-bytes", DefaultMaxBodyBytes, config.NonNegative, "largest request body in bytes (RL bodies are large): a Content-Length above it gets 413 before anything is forwarded, a chunked body growing past it is cut with 413; 0: no limit").Type("int"),
		config.Num(&c.MaxConns, "max-conns", 0, config.NonNegative, "most client connections open at once; at it, accepting pauses and new connections wait in the kernel's queue (0: (descriptor limit - reserve) / 2, at least 16; the reserve is 256 descriptors, or an eighth of a limit under 2048)").Type("int"),
		config.Num(&c.QueueSize, "max-queue", DefaultQueueSize, config.PositiveOrNone, "requests that may wait per worker once it is at its max_in_flight; more: 503 with Retry-After (-1: no queue)"),
		config.Num(&c.QueueTimeout, "queue-timeout", DefaultQueueTimeout, config.Positive, "longest wait in a worker's queue; then 503 with Retry-After (> 0)"),
		config.Num(&c.PeekMax, "kv-peek-max", DefaultPeekMax, config.PositiveOrNone, "with KV-event placement (--kv-events), a Content-Length body of token ids is read before routing past --peek-bytes while every block read so far is cached on some engine, or until the list's end or its first 64 KiB (the prompt's identity, which its GRPO siblings follow) is in, up to this many bytes (buffered, pooled; then relayed, the rest spliced; at most 64 MiB; -1: only --peek-bytes)"),
		config.Num(&c.PeekBudget, "kv-peek-budget", DefaultPeekBudget, config.Positive, "bytes the buffers of bodies read past --peek-bytes (--kv-peek-max), with the other buffers over 16 KiB, may hold at once, across connections; past it a request is routed on what it has (> 0)"),
		config.Num(&c.LocalBodyBudget, "local-body-budget", DefaultLocalBodyBudget, config.Positive, "bytes the bodies of requests tetherd answers itself (abort, flush, admin on the data port) may hold at once, across connections; past it: 503 with Retry-After (> 0)"),
		config.Num(&c.Limits.RequestLine, "max-request-line", httphead.DefaultRequestLine, config.Positive, "longest request line in bytes; longer: 414 (> 0)"),
		config.Num(&c.Limits.Head, "max-head-bytes", httphead.DefaultHead, config.Positive, "largest request head in bytes; larger: 431 (> 0)"),
		config.Num(&c.Limits.ChunkExt, "max-chunk-ext-bytes", httphead.MaxChunkExtBytes, config.Positive, "most chunk-extension bytes in one chunked request body; more: 400 (> 0)"),
		config.Num(&c.Limits.Fields, "max-header-fields", httphead.DefaultFields, config.Positive, "most header fields in a request; more: 431 (> 0)"),
	}
}

// RegisterFlags registers tetherd's data-plane flags on fs, writing c's
// settings (each starting at its default; --max-body-bytes at
// DefaultMaxBodyBytes).
func (c *Config) RegisterFlags(fs *flag.FlagSet) { config.Register(fs, c.settings()) }
