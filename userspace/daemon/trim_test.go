package daemon

import "testing"

// A trim comes once per large fall of the open connections, not on small
// ones, not while the crowd is still there, and not twice for one fall.
func TestTrimmer(t *testing.T) {
	var tr trimmer
	for _, c := range []struct {
		open int64
		want bool
	}{
		{0, false},
		{500, false},
		{100, false}, // a fall of 400: small
		{10000, false},
		{9000, false}, // a fall of 1000: most are still there
		{6000, false}, // 4000 fewer, but more than half remain
		{4000, true},  // 6000 fewer, under half the peak
		{3000, false}, // the same fall, already trimmed
		{0, true},     // 4000 below the last trim: a fall of its own
		{5000, false},
		{2000, true},
	} {
		if got := tr.observe(c.open); got != c.want {
			t.Fatalf("open %d (peak %d): trim %v, want %v", c.open, tr.peak, got, c.want)
		}
	}
}
