package cluster

import (
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv/etcdtest"
	"github.com/tether-rl/tether/userspace/sticky"
)

// The cost of sharing a new key: on the data path, a local lookup and put
// plus a queue send; in etcd, one put on a lease (writer throughput
// reported as puts/s).
func BenchmarkSharedSessionsNewKey(b *testing.B) {
	etcd := etcdtest.Start(b)
	store, err := Dial([]string{"http://" + etcd.Endpoint()}, "bench")
	if err != nil {
		b.Fatal(err)
	}
	defer store.Close()
	s := ShareSessions(store, sticky.NewMemory(0), slog.New(slog.NewTextHandler(io.Discard, nil)))
	defer s.Close()
	ttl := int64(2 * time.Minute)
	b.ResetTimer()
	start := time.Now()
	for i := range b.N {
		s.Put(uint64(i)*0x9e3779b97f4a7c15, sticky.Entry{Worker: 1, ID: 7, Expires: sticky.Now() + ttl})
	}
	b.StopTimer()
	// Let the writer catch up (or give up) to report its rate.
	deadline := time.Now().Add(10 * time.Second)
	for {
		w, _, d := s.Counts()
		if int(w+d) >= b.N || time.Now().After(deadline) {
			b.ReportMetric(float64(w)/time.Since(start).Seconds(), "etcd-puts/s")
			b.ReportMetric(float64(d), "dropped")
			return
		}
		// Polled, not testenv.WaitFor: a writer that has not caught up by
		// the deadline is reported (its rate), not a failure.
		time.Sleep(5 * time.Millisecond)
	}
}
