package fakeengine

import (
	"time"

	"github.com/tether-rl/tether/userspace/kvevents"
)

// KV-cache events (Config.KVEvents): the engine publishes every block its
// prefix cache gains (BlockStored, with the parent's hash and the block's
// token ids), every block it evicts (BlockRemoved) and every flush
// (AllBlocksCleared: flush_cache, a weight update, Reset) on a ZMQ PUB
// socket of its own (kvevents.Publisher: the wire of vLLM's
// --kv-events-config and SGLang's), in the configured form, with a replay
// ROUTER when asked. Its block hashes are its own chain (with the cache
// epoch in the root, as vLLM seeds its root per process): a router cannot
// recompute them. Restart acts out an engine process restart: sequence
// numbers from 0, connections dropped, the cache empty.

// KVEventsConfig turns KV-cache events on.
type KVEventsConfig struct {
	Form   kvevents.Form     // arrays (vLLM < 0.26) or maps keyed by type
	Hashes kvevents.HashForm // uint64 (vLLM), int64 (SGLang), bytes
	Replay bool              // serve a replay ROUTER
	// TopicInReplies: replay replies start with the topic (vLLM >= 0.26).
	TopicInReplies bool
}

func (e *Engine) startEvents() error {
	c := e.cfg.KVEvents
	if c == nil {
		return nil
	}
	p, err := kvevents.NewPublisher(kvevents.PublisherConfig{Replay: c.Replay, TopicInReplies: c.TopicInReplies})
	if err != nil {
		return err
	}
	e.pub = p
	return nil
}

// KVEventsEndpoint is the engine's PUB endpoint (tcp://host:port; "" when
// events are off).
func (e *Engine) KVEventsEndpoint() string {
	if e.pub == nil {
		return ""
	}
	return e.pub.Endpoint()
}

// KVEventsReplayEndpoint is its replay endpoint ("" when none).
func (e *Engine) KVEventsReplayEndpoint() string {
	if e.pub == nil {
		return ""
	}
	return e.pub.ReplayEndpoint()
}

// KVEventsSubscribers is how many subscribers its publisher has.
func (e *Engine) KVEventsSubscribers() int {
	if e.pub == nil {
		return 0
	}
	return e.pub.Subscribers()
}

// Restart acts out a restart of the engine's process: every request
// aborted, the prefix cache empty (without an AllBlocksCleared: a dead
// process says nothing), the event publisher's connections dropped and
// its sequence numbers from 0 again. The HTTP side keeps serving.
func (e *Engine) Restart() {
	e.mu.Lock()
	e.quiet = true
	e.mu.Unlock()
	e.Reset()
	e.mu.Lock()
	e.quiet = false
	e.mu.Unlock()
	if e.pub != nil {
		e.pub.Restart()
	}
}

func (e *Engine) publishLocked(evs ...kvevents.Event) {
	if e.pub == nil || e.quiet || len(evs) == 0 {
		return
	}
	b := kvevents.Batch{TS: float64(time.Now().UnixNano()) / 1e9, Rank: 0, Events: evs}
	if _, err := e.pub.Publish(&b, e.cfg.KVEvents.Form, e.cfg.KVEvents.Hashes); err != nil {
		e.log.Warn("kv events: publish failed", "err", err)
	}
}

// storedLocked publishes the blocks first..last-1 of toks (hashes: the
// chain) as one BlockStored.
func (e *Engine) storedLocked(toks []int, hashes []uint64, idx []int) {
	if e.pub == nil || e.quiet || len(idx) == 0 {
		return
	}
	bt := e.cfg.BlockTokens
	var evs []kvevents.Event
	for k := 0; k < len(idx); {
		// A run of consecutive blocks is one event, its parent the block
		// before it.
		j := k + 1
		for j < len(idx) && idx[j] == idx[j-1]+1 {
			j++
		}
		ev := kvevents.Event{Kind: kvevents.Stored, BlockSize: bt, Medium: "GPU"}
		if first := idx[k]; first > 0 {
			ev.Parent, ev.HasParent = hashes[first-1], true
		}
		for _, i := range idx[k:j] {
			ev.Hashes = append(ev.Hashes, hashes[i])
			for _, t := range toks[i*bt : (i+1)*bt] {
				ev.Tokens = append(ev.Tokens, uint32(t))
			}
		}
		evs = append(evs, ev)
		k = j
	}
	e.publishLocked(evs...)
}
