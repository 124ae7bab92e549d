package route

import (
	"fmt"
	"testing"

	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/sticky"
	"github.com/tether-rl/tether/userspace/worker"
)

// Precedence: each row is a request that more than one rule could place;
// the first rule of the list (rules.go) that decides wins. The request id
// "busy" is in flight on slot 3 (alone: each row starts afresh), the bare session id "learned" was
// created on slot 2, and no slot 9 exists.
func TestRulePrecedence(t *testing.T) {
	st := stats.NewHeap()
	tab := worker.NewTable()
	for i := 0; i < 4; i++ {
		tab.Put(&worker.Worker{Slot: i, URL: fmt.Sprintf("http://10.0.0.%d:30000", i+1), Stats: st.Worker(i)})
	}
	table := sticky.NewMemory(0)
	p, err := NewPolicy(PolicyConfig{Sticky: table})
	if err != nil {
		t.Fatal(err)
	}
	l, err := NewLearning(LearnConfig{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	rt := &Router{Table: tab}
	rt.SetPolicy(p)
	rt.SetLearning(l)
	x := l.creating(Decision{Worker: tab.Get(2)}).Learn
	x.Status(201)
	x.Body([]byte(`{"session_id":"learned"}`))

	const rid = `{"rid":"busy","text":"hi"}`
	for _, tc := range []struct {
		rule, method, path, headers, body string
		want                              Reason
		slot                              int // -1: answered locally
	}{
		{"a session path over its request id", "POST", "/sessions/w1-a/generate", "", rid, ReasonSession, 1},
		{"a session path over a target", "POST", "/sessions/w0-a", "X-SMG-Target-Worker: 2\r\n", "", ReasonSession, 0},
		{"a learned id over its request id", "POST", "/sessions/learned/turn", "", rid, ReasonLearned, 2},
		{"a stamped id of no slot is a bad session, not a learned one", "POST", "/sessions/w9-a", "", rid, ReasonBadSessionSpread, -2},
		{"an unknown session over a target", "GET", "/sessions/nope", "X-SMG-Target-Worker: 2\r\n", "", ReasonBadSessionSpread, -2},
		{"a target over the request id", "POST", "/generate", "X-SMG-Target-Worker: 0\r\n", rid, ReasonTarget, 0},
		{"a target of no worker is 400, whatever the id", "POST", "/generate", "X-SMG-Target-Worker: 9\r\n", rid, ReasonBadTarget, -1},
		{"the request id over the key", "POST", "/generate", "X-Session-ID: k\r\n", rid, ReasonRid, 3},
		{"the request id in a header over the key", "POST", "/generate", "X-Session-ID: k\r\nX-Request-ID: busy\r\n", `{}`, ReasonRid, 3},
		{"a create request pinned by its id", "POST", "/sessions", "", rid, ReasonRid, 3},
		{"the key without an id in flight", "POST", "/generate", "X-Session-ID: k\r\n", `{"rid":"new"}`, ReasonHash, -2},
		{"least without key or id", "POST", "/generate", "", `{"rid":"new"}`, ReasonSpread, -2},
	} {
		t.Run(tc.rule, func(t *testing.T) {
			o := newFakeOwners()
			defer o.Acquire("busy", 3)()
			rt.Owners = o
			req := parseHead(t, tc.method+" "+tc.path+" HTTP/1.1\r\nHost: x\r\n"+tc.headers+fmt.Sprintf("Content-Length: %d\r\n\r\n", len(tc.body)))
			d := rt.Route(req, []byte(tc.body))
			if d.Done != nil {
				defer d.Done()
			}
			slot := -1
			if d.Worker != nil {
				slot = d.Worker.Slot
			}
			if d.Reason != tc.want || tc.slot != -2 && slot != tc.slot {
				t.Fatalf("%s, slot %d; want %s, slot %d", d.Reason, slot, tc.want, tc.slot)
			}
		})
	}
}
