package dialect

// The prefill/decode protocols' words: each engine's file gives its P/D
// fleets' wire as a PDWire (Dialect.PD), which userspace/pd speaks without
// naming a field of its own. Values are JSON, spliced into the client's
// body at its top level as they are.

// PDWire is the P/D protocol of an engine's fleets, in its words: the body
// fields a pair's legs carry (SGLang's bootstrap rooms, vLLM's NIXL
// handoff), the request id both legs share, and what of an answer is
// read or merged.
type PDWire struct {
	// Kind is the engine's (set at registration).
	Kind Kind

	// Samples: where a request asks for several samples (a number above
	// 1 there is a request for n): a top-level field, or a field of the
	// object (or of each object of the list) in a top-level field.
	Samples []FieldPath
	// Batch: the prompt fields, in order, whose list value makes the
	// request a batch (one item per element); the first present decides.
	Batch []BatchField

	// Bootstrap rooms (the same body to both legs): the fields naming the
	// prefill's host (a JSON string), its bootstrap port (a number, or
	// null for the engine's default) and the room (a number in
	// 0..2^63-1); a list of each, one per item, for a batch. "": the
	// protocol has no rooms.
	BootstrapHost, BootstrapPort, BootstrapRoom string
	// RequestIDField: the body field naming a request's id (a string, or
	// a list of them for a batch), set where the client sent none so both
	// legs can be aborted by it; "": ids go in RequestIDHeader.
	RequestIDField string
	// RequestIDHeader: the header both legs carry one id in ("": none).
	RequestIDHeader string
	// AbortsByID: a leg is aborted by an abort call naming its ids
	// (Dialect.AbortIDs); else closing its connection aborts it.
	AbortsByID bool

	// LogprobFlag: the body field asking for input logprobs (true, or a
	// list with a true for a batch): the prefill's InputLogprobs go in
	// front of the decode's, in each answer object (Answer.ItemIndex
	// names an SSE event's item).
	LogprobFlag   string
	InputLogprobs FieldPath
	ItemIndex     string

	// KV handoff (the prefill first, then the decode with what it
	// answered): KVParams is the field that carries the handoff, both in
	// the prefill's answer and in the decode's body; PrefillEdits turn the
	// client's body into the prefill leg's, in order. "": no handoff.
	KVParams     string
	PrefillEdits []FieldEdit
	// AbortedFinish: the finish reason of a prefill's answer (in each of
	// its Choices' FinishReason) when it was aborted (a pause in abort
	// mode, an abort by id) and has no KV to hand over. "": none.
	FinishReason, AbortedFinish string

	// A request for n samples that is not streamed is sent as n requests
	// of one sample each (each with its own room or handoff), and their
	// answers make one. Stream: the field asking for a streamed answer.
	// Seeds: the fields fixing the sampling seed (such a request is not
	// split: n requests of one seed would be one sample n times).
	Stream string
	Seeds  []FieldPath
	// The answers make one: on the OpenAI paths, one object whose Choices
	// list every sample's, each with its ChoiceIndex (0..n-1), and whose
	// Usage has the PromptTokens once and the CompletionTokens summed
	// (TotalTokens their sum); an answer without Choices, where
	// ListOfAnswers, is one item of a list (SGLang's native answer to n).
	Choices, ChoiceIndex                               string
	Usage, PromptTokens, CompletionTokens, TotalTokens string
	ListOfAnswers                                      bool
}

// FieldPath is a top-level field (Inner "") or the field Inner of the
// object, or of each object of a list, in top-level field Field.
type FieldPath struct {
	Field, Inner string
}

// BatchField is a prompt field whose list value makes a batch when its
// first element starts with one of FirstItem's bytes ("": any element).
type BatchField struct {
	Name      string
	FirstItem string
}

// FieldEdit is one top-level edit of a body: Value set (a JSON value) or,
// with Value nil, the field deleted; IfPresent: only where the body has
// the field.
type FieldEdit struct {
	Name      string
	Value     []byte
	IfPresent bool
}

// PD returns the wire of the P/D protocol named proto (Dialect.PDProtocol,
// "sglang" or "vllm"); nil when no engine speaks it.
func PD(proto string) *PDWire {
	for _, d := range order {
		if d.PD != nil && d.PDProtocol == proto {
			return d.PD
		}
	}
	return nil
}

// PDSamples returns every engine's Samples paths (a request for several
// samples in any engine's words is one, whatever the pair's protocol);
// the caller must not change the slice.
func PDSamples() []FieldPath { return pdSamples }

var pdSamples []FieldPath

// registerPD merges d's P/D wire into the tables (from register).
func registerPD(d *Dialect) {
	if d.PD == nil {
		return
	}
	d.PD.Kind = d.Kind
	for _, p := range d.PD.Samples {
		seen := false
		for _, q := range pdSamples {
			seen = seen || q == p
		}
		if !seen {
			pdSamples = append(pdSamples, p)
		}
	}
}
