package pd

import (
	"context"
	"testing"
)

func TestRoundRobin(t *testing.T) {
	w := func(u string) Worker { return Worker{URL: u} }
	c := &RoundRobin{Prefills: []Worker{w("p0"), w("p1")}, Decodes: []Worker{w("d0"), w("d1"), w("d2")}}
	var got []Pair
	for i := 0; i < 3; i++ {
		p, err := c.Choose(context.Background(), nil, 0, nil)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, p)
	}
	if got[0].Prefill.URL != "p0" || got[1].Prefill.URL != "p1" || got[2].Prefill.URL != "p0" {
		t.Errorf("prefills not in turn: %v", got)
	}
	if got[0].Decode.URL != "d0" || got[1].Decode.URL != "d1" || got[2].Decode.URL != "d2" {
		t.Errorf("decodes not spread by load: %v", got)
	}
	c.Release(got[1], false)
	if p, _ := c.Choose(context.Background(), nil, 0, nil); p.Decode.URL != "d1" {
		t.Errorf("the least loaded decode not chosen: %v", p)
	}
	failed := Pair{Prefill: w("p1"), Decode: w("d0")}
	for i := 0; i < 4; i++ {
		p, _ := c.Choose(context.Background(), nil, 1, &failed)
		if p.Prefill.URL == "p1" || p.Decode.URL == "d0" {
			t.Errorf("retry chose the failed side: %v", p)
		}
	}
	if _, err := (&RoundRobin{Prefills: []Worker{w("p")}}).Choose(context.Background(), nil, 0, nil); err != ErrNoPair {
		t.Errorf("no decodes: %v", err)
	}
}
