package fakepd

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/url"
	"strconv"
)

// DirectSGLang is a client that does SGLang's P/D protocol itself, as a
// correct router would (the baseline): body decoded, the bootstrap fields
// set (a new room), the same body to P and D at once, D's status and body
// returned, P's read and dropped. A failed leg cancels the other. One
// prompt only (no batch); no logprob merge.
func DirectSGLang(ctx context.Context, c *http.Client, prefillURL string, bootstrapPort int, decodeURL, path string, body []byte) (int, []byte, error) {
	var m map[string]any
	if err := json.Unmarshal(body, &m); err != nil {
		return 0, nil, err
	}
	u, err := url.Parse(prefillURL)
	if err != nil {
		return 0, nil, err
	}
	m["bootstrap_host"] = u.Hostname()
	m["bootstrap_port"] = bootstrapPort
	m["bootstrap_room"] = rand.Uint64() >> 1
	if _, ok := m["rid"]; !ok {
		m["rid"] = "direct-" + strconv.FormatUint(rand.Uint64(), 16)
	}
	b, _ := json.Marshal(m)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type res struct {
		status int
		body   []byte
		err    error
	}
	post := func(base string) <-chan res {
		ch := make(chan res, 1)
		go func() {
			st, out, err := postJSON(ctx, c, base+path, b, "")
			ch <- res{st, out, err}
		}()
		return ch
	}
	pch, dch := post(prefillURL), post(decodeURL)
	var d res
	select {
	case p := <-pch:
		if p.err != nil || p.status != http.StatusOK {
			cancel()
			<-dch
			return p.status, p.body, fmt.Errorf("prefill: %v (status %d)", p.err, p.status)
		}
		d = <-dch
	case d = <-dch:
		if d.err != nil || d.status != http.StatusOK {
			cancel()
		}
		<-pch
	}
	return d.status, d.body, d.err
}

// DirectVLLM is a client that does vLLM's NIXL protocol itself: P with
// kv_transfer_params {do_remote_decode: true}, stream false, max_tokens 1,
// then D with the client's body and P's kv_transfer_params, one
// X-Request-Id on both.
func DirectVLLM(ctx context.Context, c *http.Client, prefillURL, decodeURL, path string, body []byte) (int, []byte, error) {
	var m map[string]any
	if err := json.Unmarshal(body, &m); err != nil {
		return 0, nil, err
	}
	id := "direct-" + strconv.FormatUint(rand.Uint64(), 16)
	pm := make(map[string]any, len(m)+2)
	for k, v := range m {
		pm[k] = v
	}
	pm["kv_transfer_params"] = map[string]any{"do_remote_decode": true, "do_remote_prefill": false,
		"remote_engine_id": nil, "remote_block_ids": nil, "remote_host": nil, "remote_port": nil}
	pm["stream"] = false
	pm["max_tokens"] = 1
	if _, ok := pm["max_completion_tokens"]; ok {
		pm["max_completion_tokens"] = 1
	}
	delete(pm, "stream_options")
	delete(pm, "min_tokens")
	delete(pm, "min_completion_tokens")
	pb, _ := json.Marshal(pm)
	st, out, err := postJSON(ctx, c, prefillURL+path, pb, id)
	if err != nil || st != http.StatusOK {
		return st, out, fmt.Errorf("prefill: %v (status %d)", err, st)
	}
	var pans struct {
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(out, &pans); err != nil || len(pans.KV) == 0 || string(pans.KV) == "null" {
		return http.StatusBadGateway, nil, fmt.Errorf("prefill answered without kv_transfer_params")
	}
	m["kv_transfer_params"] = pans.KV
	db, _ := json.Marshal(m)
	return postJSON(ctx, c, decodeURL+path, db, id)
}

func postJSON(ctx context.Context, c *http.Client, url string, body []byte, id string) (int, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	if id != "" {
		req.Header.Set("X-Request-Id", id)
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	return resp.StatusCode, out, err
}
