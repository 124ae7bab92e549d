package upstream

import (
	"slices"
	"testing"
)

// The one retry rule, one row per case.
func TestAttemptRetry(t *testing.T) {
	for _, tc := range []struct {
		name   string
		a      Attempt
		reason int
		ok     bool
	}{
		{"connect failed", Attempt{}, RetryConnect, true},
		{"connect failed, retried already", Attempt{Retried: true}, 0, false},
		{"this host's shortage", Attempt{Local: true}, 0, false},
		{"pooled, died before the first byte", Attempt{Reused: true, Connected: true}, RetryDeadPooled, true},
		{"pooled, a byte went up", Attempt{Reused: true, Connected: true, Sent: true}, 0, false},
		{"new connection failed on its first write", Attempt{Connected: true}, 0, false},
		{"new connection, retried already", Attempt{Connected: true, Retried: true}, 0, false},
	} {
		reason, ok := tc.a.Retry()
		if reason != tc.reason || ok != tc.ok {
			t.Errorf("%s: Retry = %d, %v; want %d, %v", tc.name, reason, ok, tc.reason, tc.ok)
		}
	}
}

// The idle set: the most recent first, the oldest evicted at the cap and
// first to expire, any one removable.
func TestIdleSet(t *testing.T) {
	var s Idle[int]
	if _, ok := s.Pop(); ok {
		t.Fatal("Pop of an empty set")
	}
	for i := 1; i <= 3; i++ {
		if _, ev := s.Push(i, 3); ev {
			t.Fatalf("Push %d under the cap evicted", i)
		}
	}
	if old, ev := s.Push(4, 3); !ev || old != 1 {
		t.Fatalf("Push at the cap evicted %d, %v; want 1", old, ev)
	}
	if v, _ := s.Oldest(); v != 2 {
		t.Fatalf("Oldest = %d, want 2", v)
	}
	if v, _ := s.Pop(); v != 4 {
		t.Fatalf("Pop = %d, want the most recent, 4", v)
	}
	if !s.Remove(2) || s.Remove(2) {
		t.Fatal("Remove: want true once, then false")
	}
	s.Push(5, 3)
	s.DropOldest()
	if got := s.TakeAll(); !slices.Equal(got, []int{5}) || s.Len() != 0 {
		t.Fatalf("TakeAll = %v (left %d), want [5]", got, s.Len())
	}
}
