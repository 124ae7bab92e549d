package cluster

import (
	"fmt"
	"io"
	"log/slog"
	"reflect"
	"testing"
)

// TestApplyKV: the hook hears of each worker whose endpoints the table
// names, changes or stops naming (a removed entry, one without
// kv_events), once per change; a replay alone names nothing.
func TestApplyKV(t *testing.T) {
	r := NewReplica(nil, nil, slog.New(slog.NewTextHandler(io.Discard, nil)))
	var calls []string
	r.SetKVEventsHook(func(url, ep, rp string) { calls = append(calls, fmt.Sprintf("%s=%s,%s", url, ep, rp)) })
	const a, b = "http://a:1", "http://b:2"
	for _, step := range []struct {
		name    string
		table   map[int]Spec
		calls   []string
		applied map[string]KVEndpoints
	}{
		{"empty", map[int]Spec{}, nil, map[string]KVEndpoints{}},
		{"an entry without endpoints", map[int]Spec{0: {URL: a}}, nil, map[string]KVEndpoints{}},
		{"a replay alone", map[int]Spec{0: {URL: a, KVEventsReplay: "tcp://a:6"}}, nil, map[string]KVEndpoints{}},
		{"two named", map[int]Spec{0: {URL: a, KVEvents: "tcp://a:5"}, 1: {URL: b, KVEvents: "tcp://b:5", KVEventsReplay: "tcp://b:6"}},
			[]string{a + "=tcp://a:5,", b + "=tcp://b:5,tcp://b:6"},
			map[string]KVEndpoints{a: {"tcp://a:5", ""}, b: {"tcp://b:5", "tcp://b:6"}}},
		{"the same again", map[int]Spec{0: {URL: a, KVEvents: "tcp://a:5"}, 1: {URL: b, KVEvents: "tcp://b:5", KVEventsReplay: "tcp://b:6"}},
			nil, map[string]KVEndpoints{a: {"tcp://a:5", ""}, b: {"tcp://b:5", "tcp://b:6"}}},
		{"a's replay added, b moved to another slot", map[int]Spec{0: {URL: a, KVEvents: "tcp://a:5", KVEventsReplay: "tcp://a:6"}, 7: {URL: b, KVEvents: "tcp://b:5", KVEventsReplay: "tcp://b:6"}},
			[]string{a + "=tcp://a:5,tcp://a:6"},
			map[string]KVEndpoints{a: {"tcp://a:5", "tcp://a:6"}, b: {"tcp://b:5", "tcp://b:6"}}},
		{"a's entry names none, b removed", map[int]Spec{0: {URL: a}},
			[]string{a + "=,", b + "=,"}, map[string]KVEndpoints{}},
	} {
		calls = nil
		r.applyKV(step.table)
		if !reflect.DeepEqual(calls, step.calls) {
			t.Errorf("%s: hook calls %q, want %q", step.name, calls, step.calls)
		}
		if got := r.KVEvents(); !reflect.DeepEqual(got, step.applied) {
			t.Errorf("%s: applied %v, want %v", step.name, got, step.applied)
		}
	}
}
