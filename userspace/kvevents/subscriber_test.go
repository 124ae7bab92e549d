package kvevents

import (
	"fmt"
	"os"
	"sync"
	"testing"

	"github.com/tether-rl/tether/testenv"
)

func TestMain(m *testing.M) { os.Exit(testenv.RunNoLeaks(m)) }

// recorder is a Handler that keeps the sequence numbers applied and the
// clears, in order.
type recorder struct {
	mu     sync.Mutex
	seqs   []uint64
	hashes []uint64 // first block hash of each batch's first event
	clears []ClearReason
	log    []string
}

func (r *recorder) Apply(b *Batch) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seqs = append(r.seqs, b.Seq)
	if len(b.Events) > 0 && len(b.Events[0].Hashes) > 0 {
		r.hashes = append(r.hashes, b.Events[0].Hashes[0])
	}
	r.log = append(r.log, fmt.Sprintf("apply %d", b.Seq))
}

func (r *recorder) Clear(c ClearReason) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.clears = append(r.clears, c)
	r.log = append(r.log, "clear "+c.String())
}

func (r *recorder) snapshot() ([]uint64, []ClearReason, []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]uint64(nil), r.seqs...), append([]ClearReason(nil), r.clears...), append([]string(nil), r.log...)
}

func stored(h uint64) *Batch {
	return &Batch{TS: 1, Rank: -1, Events: []Event{{Kind: Stored, Hashes: []uint64{h}, Tokens: []uint32{1, 2}, BlockSize: 2}}}
}

func start(t *testing.T, pc PublisherConfig) (*Publisher, *Subscriber, *recorder) {
	t.Helper()
	p, err := NewPublisher(pc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	r := &recorder{}
	s, err := Start(Config{Endpoint: p.Endpoint(), Replay: p.ReplayEndpoint(), Topic: pc.Topic}, r)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	testenv.WaitFor(t, "subscribed", func() bool { return p.Subscribers() == 1 })
	return p, s, r
}

func TestSubscriberInOrder(t *testing.T) {
	for _, form := range []Form{ArrayForm, MapForm} {
		p, s, r := start(t, PublisherConfig{Replay: true})
		for i := 0; i < 5; i++ {
			if _, err := p.Publish(stored(uint64(100+i)), form, HashInt); err != nil {
				t.Fatal(err)
			}
		}
		testenv.WaitFor(t, "5 batches", func() bool { seqs, _, _ := r.snapshot(); return len(seqs) == 5 })
		seqs, clears, _ := r.snapshot()
		for i, q := range seqs {
			if q != uint64(i) || r.hashes[i] != uint64(100+i) {
				t.Fatalf("batch %d: seq %d hash %d", i, q, r.hashes[i])
			}
		}
		st := s.Stats()
		if len(clears) != 0 || st.Gaps != 0 || st.Events != 5 || !st.Connected {
			t.Fatalf("stats %+v clears %v", st, clears)
		}
	}
}

func TestSubscriberGapReplayed(t *testing.T) {
	for _, topicInReplies := range []bool{false, true} {
		p, s, r := start(t, PublisherConfig{Replay: true, Topic: "kv", TopicInReplies: topicInReplies})
		p.Publish(stored(1), ArrayForm, HashUint)
		testenv.WaitFor(t, "first batch", func() bool { seqs, _, _ := r.snapshot(); return len(seqs) == 1 })
		for i := 0; i < 3; i++ {
			payload, _ := Encode(stored(uint64(10+i)), MapForm, HashBytes)
			p.PublishPayload(payload, false) // lost on the wire, kept for replay
		}
		p.Publish(stored(2), ArrayForm, HashUint)
		testenv.WaitFor(t, "5 batches", func() bool { seqs, _, _ := r.snapshot(); return len(seqs) == 5 })
		seqs, clears, _ := r.snapshot()
		for i, q := range seqs {
			if q != uint64(i) {
				t.Fatalf("seqs %v", seqs)
			}
		}
		st := s.Stats()
		if len(clears) != 0 || st.Gaps != 1 || st.Replays != 1 || st.ReplayFailures != 0 {
			t.Fatalf("topic in replies %v: stats %+v clears %v", topicInReplies, st, clears)
		}
	}
}

func TestSubscriberGapWithoutReplay(t *testing.T) {
	p, s, r := start(t, PublisherConfig{})
	p.Publish(stored(1), ArrayForm, HashUint)
	payload, _ := Encode(stored(2), ArrayForm, HashUint)
	p.PublishPayload(payload, false)
	p.Publish(stored(3), ArrayForm, HashUint)
	testenv.WaitFor(t, "2 batches", func() bool { seqs, _, _ := r.snapshot(); return len(seqs) == 2 })
	_, _, log := r.snapshot()
	if want := "apply 0,clear gap,apply 2"; fmt.Sprint(log) != "["+replaceCommas(want)+"]" {
		t.Fatalf("log %q", log)
	}
	if st := s.Stats(); st.Gaps != 1 || st.Clears != 1 {
		t.Fatalf("stats %+v", st)
	}
}

func replaceCommas(s string) string {
	out := []byte(s)
	for i, c := range out {
		if c == ',' {
			out[i] = ' '
		}
	}
	return string(out)
}

func TestSubscriberReplayShort(t *testing.T) {
	// The engine's buffer keeps 2 batches: a gap of 4 cannot be filled.
	p, s, r := start(t, PublisherConfig{Replay: true, Buffer: 2})
	p.Publish(stored(1), ArrayForm, HashUint)
	testenv.WaitFor(t, "first", func() bool { seqs, _, _ := r.snapshot(); return len(seqs) == 1 })
	for i := 0; i < 4; i++ {
		payload, _ := Encode(stored(uint64(10+i)), ArrayForm, HashUint)
		p.PublishPayload(payload, false)
	}
	p.Publish(stored(2), ArrayForm, HashUint)
	testenv.WaitFor(t, "caught up", func() bool { seqs, _, _ := r.snapshot(); return len(seqs) >= 3 && seqs[len(seqs)-1] == 5 })
	_, _, log := r.snapshot()
	// Seqs 3 and 4 are in the buffer (4 is the newest before 5): the
	// entries are cleared, then 4.. applied.
	if got := fmt.Sprint(log); got != "[apply 0 clear replay-failed apply 4 apply 5]" {
		t.Fatalf("log %s", got)
	}
	if st := s.Stats(); st.ReplayFailures != 1 || st.Gaps != 1 {
		t.Fatalf("stats %+v", st)
	}
}

func TestSubscriberRestartAndLoss(t *testing.T) {
	p, s, r := start(t, PublisherConfig{Replay: true})
	for i := 0; i < 3; i++ {
		p.Publish(stored(uint64(i)), MapForm, HashInt)
	}
	testenv.WaitFor(t, "3 batches", func() bool { seqs, _, _ := r.snapshot(); return len(seqs) == 3 })
	// A sequence going backwards on the same connection: a restart.
	p.SendRaw(0, mustEncode(t, stored(50)))
	testenv.WaitFor(t, "restart", func() bool { return s.Stats().Restarts == 1 })
	// A malformed batch is counted, the next applied.
	p.SendRaw(1, []byte{0xc1, 0xc1})
	p.SendRaw(2, mustEncode(t, stored(51)))
	testenv.WaitFor(t, "after malformed", func() bool { return s.Stats().LastSeq == 2 && s.Stats().Malformed == 1 })
	// The engine process goes away: cleared at once, then refilled from
	// its replay buffer when it is back.
	p.Restart()
	testenv.WaitFor(t, "lost", func() bool { return s.Stats().Lost == 1 })
	testenv.WaitFor(t, "resubscribed", func() bool { return p.Subscribers() == 1 })
	payload := mustEncode(t, stored(60))
	p.PublishPayload(payload, false) // seq 0: before the subscriber joined
	p.Publish(stored(61), ArrayForm, HashUint)
	// LastSeq moves before the batch reaches the recorder: wait for the
	// recorder too.
	testenv.WaitFor(t, "refilled", func() bool {
		_, _, log := r.snapshot()
		return s.Stats().LastSeq == 1 && s.Stats().Connected && len(log) > 0 && log[len(log)-1] == "apply 1"
	})
	_, clears, log := r.snapshot()
	if fmt.Sprint(clears) != "[restart lost]" {
		t.Fatalf("clears %v, log %v", clears, log)
	}
	if tail := log[len(log)-3:]; fmt.Sprint(tail) != "[clear lost apply 0 apply 1]" {
		t.Fatalf("log %v", log)
	}
}

func mustEncode(t *testing.T, b *Batch) []byte {
	p, err := Encode(b, ArrayForm, HashUint)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestSubscriberNoPublisher(t *testing.T) {
	// Nothing listens: the subscriber keeps trying and closes cleanly.
	p, err := NewPublisher(PublisherConfig{})
	if err != nil {
		t.Fatal(err)
	}
	ep := p.Endpoint()
	p.Close()
	s, err := Start(Config{Endpoint: ep}, &recorder{})
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	if _, err := Start(Config{Endpoint: "http://x"}, &recorder{}); err == nil {
		t.Fatal("bad endpoint accepted")
	}
}

func FuzzZMTPFrames(f *testing.F) {
	f.Add([]byte{0, 3, 'a', 'b', 'c'})
	f.Add([]byte{1, 1, 'x', 2, 0, 0, 0, 0, 0, 0, 0, 0, 1, 'y'})
	f.Add([]byte{4, 5, 4, 'P', 'I', 'N', 'G', 0, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		z := &zconn{r: bufioReader(b), w: bufioWriter()}
		frames, err := z.recv(nil)
		if err == nil {
			split(frames)
		}
	})
}
