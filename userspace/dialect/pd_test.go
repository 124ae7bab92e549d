package dialect

import (
	"encoding/json"
	"slices"
	"testing"
)

// TestPDWires: each engine's P/D protocol is found by its name and holds
// what its protocol needs; a request for samples in any engine's words is
// in PDSamples, once.
func TestPDWires(t *testing.T) {
	rooms, handoff := PD(PDProtocol(SGLang)), PD(PDProtocol(VLLM))
	if rooms == nil || handoff == nil || PD("nope") != nil {
		t.Fatalf("PD: %v %v", rooms, handoff)
	}
	if rooms.Kind != SGLang || handoff.Kind != VLLM {
		t.Errorf("kinds %v %v", rooms.Kind, handoff.Kind)
	}
	if rooms.BootstrapHost == "" || rooms.BootstrapPort == "" || rooms.BootstrapRoom == "" ||
		rooms.RequestIDField == "" || !rooms.AbortsByID || rooms.KVParams != "" || len(rooms.Batch) == 0 {
		t.Errorf("bootstrap wire %+v", rooms)
	}
	if handoff.KVParams == "" || handoff.RequestIDHeader == "" || handoff.AbortsByID || handoff.BootstrapRoom != "" {
		t.Errorf("handoff wire %+v", handoff)
	}
	// The prefill's edits: valid JSON values, the handoff asked for first.
	if len(handoff.PrefillEdits) == 0 || handoff.PrefillEdits[0].Name != handoff.KVParams {
		t.Fatalf("prefill edits %+v", handoff.PrefillEdits)
	}
	for _, e := range handoff.PrefillEdits {
		if e.Value != nil && !json.Valid(e.Value) {
			t.Errorf("%s: %s", e.Name, e.Value)
		}
	}
	want := []FieldPath{{Field: "n"}, {Field: "sampling_params", Inner: "n"}}
	if got := PDSamples(); !slices.Equal(got, want) {
		t.Errorf("PDSamples %v, want %v", got, want)
	}
}
