package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"sync"
)

// generator sends one generation request: its output ids and the engine
// slot that served it (-1: not known).
type generator interface {
	generate(key string, ids []int, maxNew int, rid string) ([]int, int, error)
}

// The routing-mode client's wires (-engine):
//
//	sglang  POST /generate {"rid":..,"input_ids":[..],"sampling_params":
//	        {"max_new_tokens":N,"temperature":1.0}}; output_ids
//	vllm    POST /v1/completions {"model":..,"prompt":[..],"max_tokens":N,
//	        "temperature":1.0}, the id in X-Request-Id (vLLM's own
//	        request id header, which tetherd takes as the request's id);
//	        choices[0].token_ids
//
// A session's key goes in X-Session-ID on both.
const (
	engineSGLang = "sglang"
	engineVLLM   = "vllm"
)

// vllmModel is the model name the vLLM client sends (the fakes serve any).
const vllmModel = "fake-vllm"

type client struct {
	http     *http.Client
	target   string // tetherd; "": a random engine per request
	hashKeys bool   // no tetherd: a keyed request goes to crc32(key) mod engines
	vllm     bool   // vLLM's /v1/completions, else SGLang's /generate
	engines  []string
	mu       sync.Mutex
	rng      *rand.Rand
	trace    *trace
}

func writeIDs(b *bytes.Buffer, ids []int) {
	b.WriteByte('[')
	for i, t := range ids {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(t))
	}
	b.WriteByte(']')
}

// request builds one generation request to base in the client's wire.
func (c *client) request(base string, ids []int, maxNew int, rid string) (*http.Request, error) {
	var b bytes.Buffer
	path := "/generate"
	if c.vllm {
		path = "/v1/completions"
		b.WriteString(`{"model":"` + vllmModel + `","prompt":`)
		writeIDs(&b, ids)
		// vLLM answers choices[].token_ids only when asked to.
		fmt.Fprintf(&b, `,"max_tokens":%d,"temperature":1.0,"return_token_ids":true}`, maxNew)
	} else {
		b.WriteString(`{"rid":"`)
		b.WriteString(rid)
		b.WriteString(`","input_ids":`)
		writeIDs(&b, ids)
		fmt.Fprintf(&b, `,"sampling_params":{"max_new_tokens":%d,"temperature":1.0}}`, maxNew)
	}
	req, err := http.NewRequest("POST", base+path, &b)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	if c.vllm {
		req.Header.Set("X-Request-Id", rid)
	}
	return req, nil
}

// outputIDs reads the output ids from an answer in the client's wire.
func (c *client) outputIDs(body []byte) ([]int, error) {
	if !c.vllm {
		var out struct {
			OutputIDs []int `json:"output_ids"`
		}
		if err := json.Unmarshal(body, &out); err != nil {
			return nil, err
		}
		return out.OutputIDs, nil
	}
	var out struct {
		Choices []struct {
			TokenIDs []int `json:"token_ids"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(body, &out); err != nil {
		return nil, err
	}
	if len(out.Choices) != 1 {
		return nil, fmt.Errorf("/v1/completions: %d choices, want 1", len(out.Choices))
	}
	if len(out.Choices[0].TokenIDs) == 0 {
		// The next turn would miss this one's output.
		return nil, errors.New("/v1/completions: no token_ids in the answer")
	}
	return out.Choices[0].TokenIDs, nil
}

// generate sends one generation request and returns its output ids and
// the engine slot that served it (the route header, or the engine drawn).
func (c *client) generate(key string, ids []int, maxNew int, rid string) ([]int, int, error) {
	url, slot := c.target, -1
	if url == "" && c.hashKeys && key != "" {
		slot = int(crc32.ChecksumIEEE([]byte(key)) % uint32(len(c.engines)))
		url = c.engines[slot]
	}
	if url == "" {
		c.mu.Lock()
		slot = c.rng.IntN(len(c.engines))
		c.mu.Unlock()
		url = c.engines[slot]
	}
	req, err := c.request(url, ids, maxNew, rid)
	if err != nil {
		return nil, 0, err
	}
	if key != "" {
		req.Header.Set("X-Session-ID", key)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, 0, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, 0, err
	}
	if resp.StatusCode != 200 {
		return nil, 0, fmt.Errorf("%s: %d %s", req.URL.Path, resp.StatusCode, body)
	}
	if h := resp.Header.Get("X-Tether-Route"); h != "" {
		slot, _ = strconv.Atoi(strings.Fields(h)[0])
	}
	// The trace follows keyless sessions too (by their rid).
	sess := key
	if i := strings.LastIndex(rid, "-t"); sess == "" && strings.HasPrefix(rid, "agent-") && i > 0 {
		sess = rid[:i]
	}
	c.trace.note(sess, slot, len(ids), maxNew)
	out, err := c.outputIDs(body)
	if err != nil {
		return nil, 0, err
	}
	return out, slot, nil
}
