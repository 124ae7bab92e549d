package fakepd

import (
	"time"

	"github.com/tether-rl/tether/testenv/fakeengine"
	"github.com/tether-rl/tether/userspace/kvevents"
)

// KV-cache events (Options.KVEvents): an engine with a prefix cache (a
// prefill, a Regular engine) publishes every block its cache gains
// (BlockStored: a run of consecutive new blocks of a prompt, its parent
// the block before, the blocks' token ids) and every block it evicts
// (BlockRemoved) on a ZMQ PUB socket of its own: kvevents.Publisher, as
// testenv/fakeengine publishes, in the configured wire form (arrays or
// maps) and hash form, with a replay ROUTER when asked. The block hashes
// are the cache's own chain (FNV over the prompt's tokens): a router
// cannot recompute them, it learns them from the events. Kill closes the
// publisher (a crash: the subscriber sees its connection drop).

// startEvents starts the publisher when Options.KVEvents asks for one.
func (s *server) startEvents() error {
	c := s.opts.KVEvents
	if c == nil {
		return nil
	}
	p, err := kvevents.NewPublisher(kvevents.PublisherConfig{Replay: c.Replay, TopicInReplies: c.TopicInReplies})
	if err != nil {
		return err
	}
	s.pub = p
	s.cache.publish = s.publish
	return nil
}

// KVEventsEndpoint is the engine's PUB endpoint (tcp://host:port; "" when
// events are off).
func (s *server) KVEventsEndpoint() string {
	if s.pub == nil {
		return ""
	}
	return s.pub.Endpoint()
}

// KVEventsReplayEndpoint is its replay endpoint ("" when none).
func (s *server) KVEventsReplayEndpoint() string {
	if s.pub == nil {
		return ""
	}
	return s.pub.ReplayEndpoint()
}

// KVEventsSubscribers is how many subscribers its publisher has.
func (s *server) KVEventsSubscribers() int {
	if s.pub == nil {
		return 0
	}
	return s.pub.Subscribers()
}

// publish sends one batch of events (the cache's lock held: the events
// go out in the order the cache changed).
func (s *server) publish(evs []kvevents.Event) {
	if s.pub == nil || len(evs) == 0 {
		return
	}
	c := s.opts.KVEvents
	b := kvevents.Batch{TS: float64(time.Now().UnixNano()) / 1e9, Rank: 0, Events: evs}
	s.pub.Publish(&b, c.Form, c.Hashes) // a publish that fails is a gap the subscriber sees
}

// events returns the BlockStored events of the new blocks of prompt
// (news: their indexes, ascending; hashes: every full block's chained
// hash) and a BlockRemoved of the evicted ones.
func blockEvents(prompt []int, block int, hashes []uint64, news []int, evicted []uint64) []kvevents.Event {
	var evs []kvevents.Event
	for k := 0; k < len(news); {
		j := k + 1
		for j < len(news) && news[j] == news[j-1]+1 {
			j++
		}
		ev := kvevents.Event{Kind: kvevents.Stored, BlockSize: block, Medium: "GPU"}
		if first := news[k]; first > 0 {
			ev.Parent, ev.HasParent = hashes[first-1], true
		}
		for _, i := range news[k:j] {
			ev.Hashes = append(ev.Hashes, hashes[i])
			for _, t := range prompt[i*block : (i+1)*block] {
				ev.Tokens = append(ev.Tokens, uint32(t))
			}
		}
		evs = append(evs, ev)
		k = j
	}
	if len(evicted) > 0 {
		evs = append(evs, kvevents.Event{Kind: kvevents.Removed, Hashes: evicted, Medium: "GPU"})
	}
	return evs
}

// KVEventsConfig is fakeengine's: the wire form, the hash form, replay.
type KVEventsConfig = fakeengine.KVEventsConfig
