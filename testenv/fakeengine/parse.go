package fakeengine

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
)

// Vocab is the size of the fake vocabulary: every token id is in [0, Vocab).
const Vocab = 32000

// Limits on a request, so that a bad or hostile body costs little.
const (
	MaxPromptTokens = 1 << 20
	MaxNewTokens    = 1 << 16
	DefaultMaxNew   = 16
)

// Tokenize turns text into tokens deterministically: one token per 4 bytes
// (the last chunk shorter), the FNV-1a hash of the chunk modulo Vocab. Equal
// text prefixes (at a multiple of 4 bytes) give equal token prefixes.
func Tokenize(s string) []int {
	out := make([]int, 0, (len(s)+3)/4)
	for i := 0; i < len(s); i += 4 {
		j := min(i+4, len(s))
		h := uint32(2166136261)
		for k := i; k < j; k++ {
			h ^= uint32(s[k])
			h *= 16777619
		}
		out = append(out, int(h%Vocab))
	}
	return out
}

// ChatPrompt renders chat messages into the prompt text the engine
// tokenizes: "<|role|>content\n" for each, then "<|assistant|>".
func ChatPrompt(msgs []ChatMessage) string {
	var b strings.Builder
	for _, m := range msgs {
		b.WriteString("<|")
		b.WriteString(m.Role)
		b.WriteString("|>")
		b.WriteString(m.Content)
		b.WriteString("\n")
	}
	b.WriteString("<|assistant|>")
	return b.String()
}

// ChatMessage is one chat message (string content; a list of text parts is
// joined).
type ChatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

func (m *ChatMessage) UnmarshalJSON(b []byte) error {
	var raw struct {
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	}
	if err := json.Unmarshal(b, &raw); err != nil {
		return err
	}
	m.Role = raw.Role
	c := bytes.TrimSpace(raw.Content)
	switch {
	case len(c) == 0 || string(c) == "null":
	case c[0] == '"':
		return json.Unmarshal(c, &m.Content)
	case c[0] == '[':
		var parts []struct {
			Type string `json:"type"`
			Text string `json:"text"`
		}
		if err := json.Unmarshal(c, &parts); err != nil {
			return err
		}
		for _, p := range parts {
			m.Content += p.Text
		}
	default:
		return errors.New("message content must be a string or a list of parts")
	}
	return nil
}

func mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// hashTokens is an FNV-1a style hash of a token list.
func hashTokens(h uint64, toks []int) uint64 {
	for _, t := range toks {
		h ^= uint64(uint32(t))
		h *= 1099511628211
	}
	return h
}

// chainHashes returns the hash chain of the full blocks of toks: block i's
// hash covers every token up to the end of block i and the cache epoch.
func chainHashes(toks []int, bt int, epoch uint64) []uint64 {
	full := len(toks) / bt
	out := make([]uint64, full)
	h := mix(epoch + 0x9e3779b97f4a7c15)
	for i := 0; i < full; i++ {
		h = mix(hashTokens(h, toks[i*bt:(i+1)*bt]))
		if h == 0 {
			h = 1
		}
		out[i] = h
	}
	return out
}

// OutputToken is the token an engine decodes at position pos of the output
// for a prompt and a seed: a test can compute what to expect.
func OutputToken(prompt []int, seed uint64, pos int) int {
	return outToken(hashTokens(14695981039346656037, prompt), seed, pos)
}

func outToken(phash, seed uint64, pos int) int {
	return int(mix(phash^mix(seed+1)^mix(uint64(pos)+0x51af)) % Vocab)
}

// TokenText is the text of one output token: " t<id>".
func TokenText(t int) string { return " t" + strconv.Itoa(t) }

func detokenize(toks []int) string {
	var b strings.Builder
	for _, t := range toks {
		b.WriteString(TokenText(t))
	}
	return b.String()
}

// api is the shape of a generation request and of its answer.
type api int

const (
	apiGenerate   api = iota // SGLang POST /generate
	apiCompletion            // OpenAI POST /v1/completions
	apiChat                  // OpenAI POST /v1/chat/completions
	apiTokens                // vLLM POST /inference/v1/generate (token ids in and out)
)

// genRequest is a parsed generation request.
type genRequest struct {
	api    api
	rid    string
	prompt []int
	maxNew int
	seed   uint64
	stream bool
	model  string
	rank   int // SGLang routed_dp_rank (-1: none)
}

// MaxDPRanks bounds the routed_dp_rank a fake SGLang engine takes (it
// serves them all from one cache; Stats.RoutedRanks counts them).
const MaxDPRanks = 8

type samplingParams struct {
	MaxNewTokens *int64          `json:"max_new_tokens"`
	MaxTokens    *int64          `json:"max_tokens"`
	Seed         *int64          `json:"seed"`
	SamplingSeed *int64          `json:"sampling_seed"`
	N            json.RawMessage `json:"n"`
}

type rawRequest struct {
	// SGLang native
	Text           json.RawMessage `json:"text"`
	InputIDs       json.RawMessage `json:"input_ids"`
	SamplingParams *samplingParams `json:"sampling_params"`
	Rid            json.RawMessage `json:"rid"`
	RoutedDPRank   json.RawMessage `json:"routed_dp_rank"`
	// OpenAI
	Prompt              json.RawMessage `json:"prompt"`
	Messages            []ChatMessage   `json:"messages"`
	MaxTokens           *int64          `json:"max_tokens"`
	MaxCompletionTokens *int64          `json:"max_completion_tokens"`
	Seed                *int64          `json:"seed"`
	N                   *int64          `json:"n"`
	Model               string          `json:"model"`
	// vLLM
	RequestID string          `json:"request_id"`
	TokenIDs  json.RawMessage `json:"token_ids"`
	Stream    bool            `json:"stream"`
}

// ParseRequest parses the body of a generation request to path (one of
// /generate, /v1/completions, /v1/chat/completions,
// /inference/v1/generate) for kind. h may be nil. It never panics; a bad
// body is an error (a 400).
func ParseRequest(kind Kind, path string, body []byte, h http.Header) (rid string, prompt []int, maxNew int, seed uint64, stream bool, err error) {
	g, err := parseRequest(kind, path, body, h)
	if err != nil {
		return "", nil, 0, 0, false, err
	}
	return g.rid, g.prompt, g.maxNew, g.seed, g.stream, nil
}

func parseRequest(kind Kind, path string, body []byte, h http.Header) (*genRequest, error) {
	var raw rawRequest
	body = bytes.TrimSpace(body)
	if len(body) == 0 {
		return nil, errors.New("empty body")
	}
	if body[0] != '{' {
		return nil, errors.New("the body must be a JSON object")
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	if err := dec.Decode(&raw); err != nil {
		return nil, fmt.Errorf("invalid JSON: %v", err)
	}
	if dec.More() {
		return nil, errors.New("trailing data after the JSON object")
	}
	g := &genRequest{maxNew: DefaultMaxNew, stream: raw.Stream, model: raw.Model}
	var err error
	maxNew := raw.MaxTokens
	switch path {
	case "/generate":
		g.api = apiGenerate
		switch {
		case present(raw.InputIDs):
			g.prompt, err = parseIDs(raw.InputIDs, "input_ids")
		case present(raw.Text):
			var s string
			if err = json.Unmarshal(raw.Text, &s); err != nil {
				return nil, errors.New("text must be a string (batches are not supported)")
			}
			g.prompt = Tokenize(s)
		default:
			return nil, errors.New("either text or input_ids must be given")
		}
		if present(raw.Rid) {
			if err := json.Unmarshal(raw.Rid, &g.rid); err != nil {
				return nil, errors.New("rid must be a string")
			}
		}
		maxNew = nil
		if sp := raw.SamplingParams; sp != nil {
			maxNew = sp.MaxNewTokens
			if sp.SamplingSeed != nil {
				g.seed = uint64(*sp.SamplingSeed)
			} else if sp.Seed != nil {
				g.seed = uint64(*sp.Seed)
			}
			if err := checkN(sp.N); err != nil {
				return nil, err
			}
		}
	case "/v1/completions":
		g.api = apiCompletion
		if !present(raw.Prompt) {
			return nil, errors.New("prompt is required")
		}
		var s string
		if json.Unmarshal(raw.Prompt, &s) == nil {
			g.prompt = Tokenize(s)
		} else if g.prompt, err = parseIDs(raw.Prompt, "prompt"); err != nil {
			// One-element batches ([["..."]] or [[1,2]]) are taken as one prompt.
			var one []json.RawMessage
			if json.Unmarshal(raw.Prompt, &one) != nil || len(one) != 1 {
				return nil, errors.New("prompt must be a string or a list of token ids (batches are not supported)")
			}
			if json.Unmarshal(one[0], &s) == nil {
				g.prompt, err = Tokenize(s), nil
			} else if g.prompt, err = parseIDs(one[0], "prompt"); err != nil {
				return nil, err
			}
		}
	case "/v1/chat/completions":
		g.api = apiChat
		if len(raw.Messages) == 0 {
			return nil, errors.New("messages must be a non-empty list")
		}
		g.prompt = Tokenize(ChatPrompt(raw.Messages))
		if raw.MaxCompletionTokens != nil {
			maxNew = raw.MaxCompletionTokens
		}
	case "/inference/v1/generate":
		g.api = apiTokens
		if !present(raw.TokenIDs) {
			return nil, errors.New("token_ids is required")
		}
		if g.prompt, err = parseIDs(raw.TokenIDs, "token_ids"); err != nil {
			return nil, err
		}
		if sp := raw.SamplingParams; sp != nil {
			maxNew = sp.MaxTokens
			if sp.Seed != nil {
				g.seed = uint64(*sp.Seed)
			}
		}
	default:
		return nil, fmt.Errorf("not a generation path: %s", path)
	}
	if err != nil {
		return nil, err
	}
	if g.api != apiGenerate {
		if raw.Seed != nil {
			g.seed = uint64(*raw.Seed)
		}
		if raw.N != nil && *raw.N != 1 {
			return nil, errors.New("only n=1 is supported")
		}
		g.rid = raw.RequestID
		if g.rid == "" && h != nil {
			g.rid = h.Get("X-Request-Id")
		}
	}
	g.rank = -1
	if kind == SGLang && present(raw.RoutedDPRank) {
		// SGLang: an Optional[int] of GenerateReqInput and of its OpenAI
		// requests; a rank the engine does not run is refused.
		var r int
		if err := json.Unmarshal(raw.RoutedDPRank, &r); err != nil {
			return nil, errors.New("routed_dp_rank must be an integer")
		}
		if r < 0 || r >= MaxDPRanks {
			return nil, fmt.Errorf("routed_dp_rank %d out of range [0, %d)", r, MaxDPRanks)
		}
		g.rank = r
	}
	if maxNew != nil {
		if *maxNew < 1 || *maxNew > MaxNewTokens {
			return nil, fmt.Errorf("max tokens must be in [1, %d]", MaxNewTokens)
		}
		g.maxNew = int(*maxNew)
	}
	if len(g.prompt) == 0 {
		return nil, errors.New("the prompt is empty")
	}
	if len(g.rid) > 256 {
		return nil, errors.New("request id longer than 256 bytes")
	}
	return g, nil
}

func present(m json.RawMessage) bool { return len(m) > 0 && string(m) != "null" }

func checkN(n json.RawMessage) error {
	if !present(n) {
		return nil
	}
	var v int64
	if json.Unmarshal(n, &v) != nil || v != 1 {
		return errors.New("only n=1 is supported")
	}
	return nil
}

func parseIDs(m json.RawMessage, what string) ([]int, error) {
	var ids []json.Number
	d := json.NewDecoder(bytes.NewReader(m))
	d.UseNumber()
	if err := d.Decode(&ids); err != nil {
		return nil, fmt.Errorf("%s must be a list of token ids", what)
	}
	if len(ids) > MaxPromptTokens {
		return nil, fmt.Errorf("%s longer than %d tokens", what, MaxPromptTokens)
	}
	out := make([]int, len(ids))
	for i, n := range ids {
		v, err := n.Int64()
		if err != nil || v < 0 || v > math.MaxInt32 {
			return nil, fmt.Errorf("%s[%d] is not a token id", what, i)
		}
		out[i] = int(v)
	}
	return out, nil
}
