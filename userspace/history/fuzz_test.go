package history

import (
	"testing"
	"time"
)

// FuzzSteps: any answer body gives one or two steps of the call's kind
// (a quiesce first), never a panic, never a duration outside the call's.
func FuzzSteps(f *testing.F) {
	f.Add("pause", `{"mode":"abort","quiesce_s":0.5,"held":3,"successful":[{"worker":0,"elapsed_s":0.1}],"failed":[]}`, 200)
	f.Add("resume", `{"released":4,"fenced":[2]}`, 200)
	f.Add("update", `{"error":{"message":"x"}}`, 400)
	f.Add("pause", `{"mode":"wait","quiesce_s":9}`, 504)
	f.Fuzz(func(t *testing.T, kind, body string, status int) {
		st := Steps(kind, "/p", time.Unix(1, 0), time.Second, status, []byte(body), false)
		if len(st) == 0 || len(st) > 2 || st[len(st)-1].Kind != kind || (len(st) == 2 && st[0].Kind != "quiesce") {
			t.Fatalf("%q: %+v", body, st)
		}
		for _, s := range st {
			if s.DurationS < 0 || s.DurationS > 1 {
				t.Fatalf("negative duration: %+v", s)
			}
		}
		s := NewSyncs()
		s.Add(st...)
		if len(s.List()) != 1 {
			t.Fatal("steps not recorded")
		}
	})
}
