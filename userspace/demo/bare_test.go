package demo

import (
	"net/http"
	"regexp"
	"testing"
)

// With BareIDs the worker mints plain uuids and, like a real session
// server, answers 404 to turns, GETs and DELETEs of ids it did not mint.
func TestBareIDs(t *testing.T) {
	s, c := start(t, Options{Index: 2, BareIDs: true})
	uuid := regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)
	chat := func(id string) reply {
		return call(t, c, "POST", s.URL()+"/sessions/"+id+"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}]}`)
	}
	seen := map[string]bool{}
	var id string
	for i := 0; i < 20; i++ {
		r := call(t, c, "POST", s.URL()+"/sessions", "")
		m := r.json(t)
		id, _ = m["session_id"].(string)
		if r.code != http.StatusCreated || !uuid.MatchString(id) || num(m, "worker") != 2 || seen[id] {
			t.Fatalf("create: %d %s", r.code, r.body)
		}
		seen[id] = true
	}
	for turn := 1; turn <= 2; turn++ {
		if r := chat(id); r.code != 200 || num(r.json(t), "turn") != turn {
			t.Fatalf("turn %d: %d %s", turn, r.code, r.body)
		}
	}
	if s.Turns(id) != 2 {
		t.Fatalf("Turns %d", s.Turns(id))
	}
	other := "0b5e0c3a-9d1f-4c7e-8a2b-6f4e3d2c1b0a" // never minted here
	for _, r := range []reply{chat(other), call(t, c, "GET", s.URL()+"/sessions/"+other, ""), call(t, c, "DELETE", s.URL()+"/sessions/"+other, "")} {
		if r.code != 404 {
			t.Errorf("unknown id: %d %s", r.code, r.body)
		}
	}
	if s.Turns(other) != 0 {
		t.Error("a turn of an unknown id created it")
	}
	if r := call(t, c, "DELETE", s.URL()+"/sessions/"+id, ""); r.code != 200 {
		t.Fatalf("delete: %d", r.code)
	}
	if r := chat(id); r.code != 404 {
		t.Fatalf("turn after delete: %d", r.code)
	}
}
