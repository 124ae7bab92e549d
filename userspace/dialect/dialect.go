// Package dialect is everything tether knows of each inference engine's
// wire, one file per engine (sglang.go, vllm.go): the control calls in
// the engine's words (pause, resume, aborts, cache flush, weight version
// and updates), the endpoints tetherd serves in those words, the load
// endpoints and metric names and how to read them, the request-id and
// prompt fields, and which engine a worker serves, detected from what it
// answers. It does no I/O and never sees a worker: it returns Calls and
// parses bytes (userspace/workerclient carries the Calls).
//
// An engine is one file that declares its Kind and registers its Dialect
// in init (register); nothing outside this package names an engine path,
// metric or JSON field.
package dialect

import (
	"encoding/json"
	"net/url"
	"slices"
)

// Kind is what serves behind a worker's URL. Each engine file declares
// its own (SGLang, VLLM); the zero Kind is Unknown.
type Kind int32

const (
	Unknown Kind = 0   // not learned yet (or a plain session worker)
	Other   Kind = 255 // answers HTTP but is no engine tether speaks to
)

// String names k as tetherd reports it ("sglang", "vllm", "other",
// "unknown").
func (k Kind) String() string {
	if d := table[k]; d != nil {
		return d.Name
	}
	if k == Other {
		return "other"
	}
	return "unknown"
}

// ParseKind reads a Kind's name (String's inverse).
func ParseKind(s string) (Kind, bool) {
	switch s {
	case "unknown":
		return Unknown, true
	case "other":
		return Other, true
	}
	for _, d := range order {
		if d.Name == s {
			return d.Kind, true
		}
	}
	return Unknown, false
}

// Call is one HTTP call to a worker: the method, the path with its query,
// the body (nil: none) and the request ids it aborts (for the report).
type Call struct {
	Method string
	Path   string
	Body   []byte
	IDs    []string
}

// Mode is a pause's mode, normalized across engines.
type Mode string

const (
	PauseAbort   Mode = "abort"   // abort what runs
	PauseWait    Mode = "wait"    // let what runs finish
	PauseKeep    Mode = "keep"    // freeze what runs with its KV
	PauseRetract Mode = "retract" // move what runs back to waiting, freeing its KV
)

// Op is what an endpoint tetherd serves in an engine's words does.
type Op uint8

const (
	OpNone     Op = iota
	OpAbort       // abort requests (the engine's form: ParseAbort)
	OpFlush       // flush every worker's prefix cache
	OpLoads       // the loads list
	OpPause       // pause the fleet
	OpResume      // resume the fleet
	OpIsPaused    // is the fleet paused
	OpVersion     // the fleet's weight version
	OpUpdate      // a weight-sync call fanned out as it came (Update says what it does)
)

// Update says what a fanned-out control call does to the weights.
type Update uint8

const (
	Plain       Update = iota // no weights change (groups, memory, sleep)
	Weights                   // the weights change: a new version
	OpenUpdate                // weights in flux until CloseUpdate
	CloseUpdate               // the new version of an OpenUpdate
	SetVersion                // a new version name only
)

// Endpoint is a path tetherd serves in an engine's words.
type Endpoint struct {
	Kind   Kind // the engine whose words these are (the client's dialect)
	Op     Op
	Update Update // OpUpdate's
}

// AbortForm is how an engine's abort names requests.
type AbortForm uint8

const (
	OneID  AbortForm = iota // one id per call, or everything
	IDList                  // a list of ids per call, or everything
)

// Abort is a client's abort in an engine's words, parsed.
type Abort struct {
	All bool
	IDs []string // in the order given, not deduplicated
}

// Metric is what a metric name of an engine's Prometheus /metrics gives.
type Metric struct {
	Field  Field
	Detect bool // its presence says the engine is this one
}

// Field is a reading a metric feeds.
type Field uint8

const (
	Running    Field = iota // requests running (summed)
	Waiting                 // requests queued (summed)
	KVUsage                 // KV cache share in use (the highest)
	Queries                 // prefix cache queries, a counter (summed)
	Hits                    // prefix cache hits, a counter (summed)
	HitRate                 // prefix cache hit rate, a gauge
	MaxRunning              // the running batch bound (summed)
)

// Dialect is one engine's wire. Every func is set; a nil *Call is a call
// the engine does not serve.
type Dialect struct {
	Kind Kind
	Name string // as tetherd reports it and --kind names it

	// Serves: the paths tetherd serves in this engine's words.
	Serves map[string]Endpoint
	// RankHeader: the request header that names the data-parallel rank
	// to serve a request ("": none; vLLM X-data-parallel-rank). RankField:
	// the body field that does (SGLang routed_dp_rank).
	RankHeader string
	RankField  string
	// NeverHeld: control paths a trainer may call while the fleet is
	// paused; the engine serves them paused, so tetherd never holds them.
	NeverHeld []string

	// Generation: the paths of generation requests, which a P/D fleet
	// serves over a prefill/decode pair (userspace/pd).
	Generation []string
	// PDProtocol: the prefill/decode protocol this engine's P/D fleets
	// speak (userspace/pd's: "sglang", bootstrap rooms; "vllm", NIXL),
	// and PD its wire (pd.go).
	PDProtocol string
	PD         *PDWire
	// ServerInfo: the call that tells an engine's P/D mode
	// (ParseDisaggregation reads its answer); nil: the engine has none.
	ServerInfo *Call
	// PauseInBody: a client's pause names its mode in a JSON body (else
	// in the query). PauseModes lists the modes for error messages.
	PauseInBody bool
	PauseModes  string
	// ClientPause reads a client's pause: its mode as given and the body
	// to pass on to engines of this kind (nil: none); msg: why refused.
	ClientPause func(body []byte, query url.Values) (mode string, pass []byte, msg string)
	// PauseMode normalizes a client's mode ("" is the engine's default).
	PauseMode func(mode string) (Mode, bool)
	// Pause is the pause call in mode m; quiet: nothing is in flight.
	Pause func(m Mode, quiet bool) Call
	// PauseAsClient is c (this engine's Pause) in the client's own words:
	// its body (pass) or its query (tetherd's own parameters removed).
	PauseAsClient func(c Call, m Mode, quiet bool, pass []byte, query url.Values) Call
	Resume        func() Call

	AbortForm AbortForm
	// ParseAbort reads a client's abort body; msg: why refused.
	ParseAbort func(fields map[string]json.RawMessage) (a Abort, msg string)
	// AbortAsClient is the abort call carrying a client's body as it came.
	AbortAsClient func(body []byte) Call
	AbortAll      func() Call
	// AbortIDs aborts ids; fields: the client's other fields, passed on
	// when the engine's form takes them (nil: none).
	AbortIDs   func(ids []string, fields map[string]json.RawMessage) []Call
	FlushCache func() Call

	// Version reads the engine's weight version (ParseVersion reads it).
	Version *Call
	// VersionFields: the fields of an update's body that name the new
	// weight version, in order (the last present wins).
	VersionFields []string
	// LegacyLoad: the engine's own load answer, passed on as it came.
	LegacyLoad *Call
	// Loads: a JSON load endpoint, read before /metrics.
	Loads *Call
	// ParseLoads reads Loads' answer (set with Loads).
	ParseLoads func(body []byte) (Load, error)
	// Metrics: the engine's Prometheus metric names.
	Metrics map[string]Metric
	// HitRateFromCounters: the hit rate comes from the Queries and Hits
	// counters over the interval (else from the HitRate gauge).
	HitRateFromCounters bool

	// RequestIDFields: the top-level body fields naming a request's id.
	RequestIDFields []string
	// RequestIDHeader: the header naming a request's id ("" none).
	RequestIDHeader string
	// PromptFields: the top-level body fields holding the prompt.
	PromptFields []string
	// TokenIDFields: the prompt fields that hold token ids when their
	// value is a list (of ids, or of lists of ids for a batch).
	TokenIDFields []string
}

var (
	table = map[Kind]*Dialect{}
	order []*Dialect // by Kind
	// Merged tables, built as engines register.
	served    = map[string]Endpoint{}
	neverHeld = map[string]bool{}
	metrics   = map[string]metricOf{}
	idFields  []string
	idQuoted  []string
	prompts   []string
	tokenIDs  []string
	verFields []string
)

type metricOf struct {
	Metric
	kind Kind
}

// register adds an engine's dialect (from its file's init).
func register(d *Dialect) {
	if d.Kind == Unknown || d.Kind == Other || table[d.Kind] != nil {
		panic("dialect: bad or second registration of " + d.Name)
	}
	table[d.Kind] = d
	order = append(order, d)
	slices.SortFunc(order, func(a, b *Dialect) int { return int(a.Kind) - int(b.Kind) })
	served, neverHeld, metrics = map[string]Endpoint{}, map[string]bool{}, map[string]metricOf{}
	idFields, idQuoted, prompts, verFields, pdSamples = nil, nil, nil, nil, nil
	for _, d := range order {
		registerPD(d)
		for p, ep := range d.Serves {
			ep.Kind = d.Kind
			served[p] = ep
		}
		for _, p := range d.NeverHeld {
			neverHeld[p] = true
		}
		for n, m := range d.Metrics {
			metrics[n] = metricOf{m, d.Kind}
		}
		for _, f := range d.RequestIDFields {
			if !slices.Contains(idFields, f) {
				idFields = append(idFields, f)
				idQuoted = append(idQuoted, `"`+f+`"`)
			}
		}
		for _, f := range d.PromptFields {
			if !slices.Contains(prompts, f) {
				prompts = append(prompts, f)
			}
		}
		for _, f := range d.TokenIDFields {
			if !slices.Contains(tokenIDs, f) {
				tokenIDs = append(tokenIDs, f)
			}
		}
		for _, f := range d.VersionFields {
			if !slices.Contains(verFields, f) {
				verFields = append(verFields, f)
			}
		}
	}
}

// For returns the dialect of k, or nil for a kind tether does not speak.
func For(k Kind) *Dialect { return table[k] }

// Speaks reports whether tether speaks k's dialect (a known engine).
func Speaks(k Kind) bool { return table[k] != nil }

// Kinds returns the engines tether speaks, by Kind.
func Kinds() []Kind {
	out := make([]Kind, len(order))
	for i, d := range order {
		out[i] = d.Kind
	}
	return out
}

// OtherThan returns the engine to try when a worker of unknown kind answered
// 404 to every call in k's dialect: the first other engine.
func OtherThan(k Kind) Kind {
	for _, d := range order {
		if d.Kind != k {
			return d.Kind
		}
	}
	return k
}

// Served returns what tetherd serves at path (no query), in whose words;
// ok false: no engine's path. It allocates nothing.
func Served(path []byte) (Endpoint, bool) {
	ep, ok := served[string(path)]
	return ep, ok
}

// IsNeverHeld reports whether path (its query cut) is an engine control
// call never held while the fleet is paused. It allocates nothing.
func IsNeverHeld(path []byte) bool {
	for i, c := range path {
		if c == '?' {
			path = path[:i]
			break
		}
	}
	return neverHeld[string(path)]
}

// VersionCall returns the weight version read of k's engine.
func VersionCall(k Kind) (Call, bool) {
	if d := table[k]; d != nil && d.Version != nil {
		return *d.Version, true
	}
	return Call{}, false
}

// AnyVersionCall is the weight version read tetherd sends to a worker of
// any kind (the first engine that serves one; another answers 404).
func AnyVersionCall() Call {
	for _, d := range order {
		if d.Version != nil {
			return *d.Version
		}
	}
	return Call{}
}

// AnyLegacyLoadCall is the engine load read the data port's loads
// answer passes on from every worker (the first engine that serves one).
func AnyLegacyLoadCall() Call {
	for _, d := range order {
		if d.LegacyLoad != nil {
			return *d.LegacyLoad
		}
	}
	return Call{}
}

// BodyVersion returns the new weight version an update's body names (a
// non-empty string in one of the engines' VersionFields), or "".
func BodyVersion(fields map[string]json.RawMessage) string {
	version := ""
	for _, k := range verFields {
		if raw, ok := fields[k]; ok && isString(raw) {
			json.Unmarshal(raw, &version)
		}
	}
	return version
}

func isString(raw json.RawMessage) bool {
	for _, c := range raw {
		switch c {
		case ' ', '\t', '\n', '\r':
			continue
		}
		return c == '"'
	}
	return false
}

// VersionFieldNames lists the update body fields that name a version, for
// error messages.
func VersionFieldNames() []string { return slices.Clone(verFields) }

// IsRequestIDField reports whether key (unquoted, as in the body) is a
// request-id field of some engine. It allocates nothing.
func IsRequestIDField(key []byte) bool {
	for _, f := range idFields {
		if string(key) == f {
			return true
		}
	}
	return false
}

// RequestIDKeys returns the request-id fields quoted ("rid" with its
// quotes), in order; the caller must not change the slice.
func RequestIDKeys() []string { return idQuoted }

// RequestIDHeaders returns the headers naming a request's id.
func RequestIDHeaders() []string {
	var out []string
	for _, d := range order {
		if d.RequestIDHeader != "" && !slices.Contains(out, d.RequestIDHeader) {
			out = append(out, d.RequestIDHeader)
		}
	}
	return out
}

// PromptFields returns the prompt fields of every engine's API, in a
// fixed order (a field's index names it in a group hash); the caller must
// not change the slice.
func PromptFields() []string { return prompts }

// IsTokenIDField reports whether a top-level body field holds token ids
// when its value is a list (SGLang's input_ids, vLLM's prompt). It
// allocates nothing.
func IsTokenIDField(key []byte) bool {
	for _, f := range tokenIDs {
		if string(key) == f {
			return true
		}
	}
	return false
}

// jsonKind names the JSON type of a raw value for error messages.
func jsonKind(raw json.RawMessage) string {
	i := 0
	for i < len(raw) && (raw[i] == ' ' || raw[i] == '\t' || raw[i] == '\n' || raw[i] == '\r') {
		i++
	}
	if i == len(raw) {
		return "nothing"
	}
	switch raw[i] {
	case '"':
		return "a string"
	case '[':
		return "a list"
	case '{':
		return "an object"
	case 't', 'f':
		return "a boolean"
	case 'n':
		return "null"
	}
	return "a number"
}

// Default is the dialect tetherd speaks first, on its own account, to a
// worker of unknown kind (the first engine; another is tried on a 404).
func Default() Kind {
	if len(order) == 0 {
		return Unknown
	}
	return order[0].Kind
}

// SetVersionMissing is the refusal of a SetVersion update whose body
// names no version.
const SetVersionMissing = `"new_version" must be a non-empty string`

// GenerationOf returns the one engine whose generation paths hold path
// (with or without a query); ok false when none or several do.
func GenerationOf(path []byte) (k Kind, ok bool) {
	for _, d := range order {
		if IsGeneration(d.Kind, path) {
			if ok {
				return Unknown, false
			}
			k, ok = d.Kind, true
		}
	}
	return k, ok
}

// PDProtocol returns the P/D protocol of engine k ("" unknown).
func PDProtocol(k Kind) string {
	if d := For(k); d != nil {
		return d.PDProtocol
	}
	return ""
}

// ServerInfo returns engine k's P/D mode call; ok false: it has none.
func ServerInfo(k Kind) (Call, bool) {
	if d := For(k); d != nil && d.ServerInfo != nil {
		return *d.ServerInfo, true
	}
	return Call{}, false
}

// AnyServerInfo is the P/D mode call of the first engine that has one,
// for a worker whose engine is not known yet.
func AnyServerInfo() (Call, bool) {
	for _, d := range order {
		if d.ServerInfo != nil {
			return *d.ServerInfo, true
		}
	}
	return Call{}, false
}

// IsGeneration reports whether path (with or without a query) is a
// generation path of engine k (Unknown: of any engine).
func IsGeneration(k Kind, path []byte) bool {
	if q := indexByte(path, '?'); q >= 0 {
		path = path[:q]
	}
	for _, d := range order {
		if k != Unknown && d.Kind != k {
			continue
		}
		for _, g := range d.Generation {
			if string(path) == g {
				return true
			}
		}
	}
	return false
}

func indexByte(b []byte, c byte) int {
	for i, x := range b {
		if x == c {
			return i
		}
	}
	return -1
}
