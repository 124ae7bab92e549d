package demo

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/iotest"
	"time"

	"github.com/tether-rl/tether/testenv"
)

// start serves a worker on loopback and returns it with a client of its own.
func start(t *testing.T, opts Options) (*Server, *http.Client) {
	t.Helper()
	s, err := Start("127.0.0.1:0", opts)
	if err != nil {
		t.Fatal(err)
	}
	tr := &http.Transport{MaxIdleConnsPerHost: 16}
	t.Cleanup(func() {
		tr.CloseIdleConnections()
		if err := s.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return s, &http.Client{Transport: tr, Timeout: 10 * time.Second}
}

type reply struct {
	code int
	hdr  http.Header
	body []byte
}

func (r reply) json(t *testing.T) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(r.body, &m); err != nil {
		t.Fatalf("body %q: %v", r.body, err)
	}
	return m
}

func call(t *testing.T, c *http.Client, method, url, body string, hdr ...string) reply {
	t.Helper()
	r, err := try(c, method, url, body, hdr...)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// try is call for goroutines other than the test's: it does not stop the test.
func try(c *http.Client, method, url, body string, hdr ...string) (reply, error) {
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, url, rd)
	if err != nil {
		return reply{}, err
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		return reply{}, fmt.Errorf("%s %s: %w", method, url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return reply{}, fmt.Errorf("%s %s: reading body: %w", method, url, err)
	}
	return reply{resp.StatusCode, resp.Header, b}, nil
}

// sse returns the data payloads of a server-sent event stream. It may run
// outside the test's goroutine: it reports with t.Errorf only.
func sse(t *testing.T, r io.Reader) []string {
	t.Helper()
	var out []string
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		if p, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			out = append(out, p)
		} else if sc.Text() != "" {
			t.Errorf("unexpected SSE line %q", sc.Text())
		}
	}
	if err := sc.Err(); err != nil {
		t.Error(err)
	}
	return out
}

func num(m map[string]any, k string) int {
	f, _ := m[k].(float64)
	return int(f)
}

func TestHealthAndRoutes(t *testing.T) {
	s, c := start(t, Options{Index: 5})
	for _, tc := range []struct {
		method, path string
		code         int
		want         string // substring of the body
	}{
		{"GET", "/health", 200, `{"status":"ok","worker":5}`},
		{"GET", "/get_load", 200, `{"worker":5,"num_reqs":0,"num_waiting_reqs":0}`},
		{"POST", "/flush_cache", 200, `{"flushed":true,"worker":5}`},
		{"GET", "/nope", 404, `"type":"not_found_error"`},
		{"POST", "/health", 404, `"code":404`},
		{"GET", "/generate", 404, `"worker":5`},
		{"GET", "/sessions/", 404, `"error"`},
		{"PUT", "/sessions/w5-x", 404, `"error"`},
		{"GET", "/sessions/w5-x/unknown", 404, `"error"`},
	} {
		t.Run(tc.method+tc.path, func(t *testing.T) {
			r := call(t, c, tc.method, s.URL()+tc.path, "")
			if r.code != tc.code || !bytes.Contains(r.body, []byte(tc.want)) {
				t.Errorf("got %d %s, want %d containing %s", r.code, r.body, tc.code, tc.want)
			}
			if got := r.hdr.Get("X-Tether-Demo-Worker"); got != "5" {
				t.Errorf("X-Tether-Demo-Worker = %q", got)
			}
			if got := r.hdr.Get("Content-Type"); got != "application/json" {
				t.Errorf("Content-Type = %q", got)
			}
			r.json(t)
		})
	}
	if got := s.Requests(); got != 9 {
		t.Errorf("Requests() = %d, want 9", got)
	}
	testenv.WaitFor(t, "Active() == 0", func() bool { return s.Active() == 0 })
}

func TestSessions(t *testing.T) {
	s, c := start(t, Options{Index: 3})
	idRE := regexp.MustCompile(`^w3-[0-9a-f]{32}$`)

	r := call(t, c, "POST", s.URL()+"/sessions", "")
	if r.code != http.StatusCreated {
		t.Fatalf("create: %d %s", r.code, r.body)
	}
	id, _ := r.json(t)["session_id"].(string)
	if !idRE.MatchString(id) {
		t.Fatalf("session id %q", id)
	}
	get := func(id string) (int, int) {
		r := call(t, c, "GET", s.URL()+"/sessions/"+id, "")
		if r.code != 200 {
			return r.code, 0
		}
		m := r.json(t)
		if m["session_id"] != id || num(m, "worker") != 3 {
			t.Errorf("GET session: %s", r.body)
		}
		return r.code, num(m, "turns")
	}
	if code, turns := get(id); code != 200 || turns != 0 {
		t.Fatalf("new session: %d turns %d", code, turns)
	}
	for turn := 1; turn <= 3; turn++ {
		r := call(t, c, "POST", s.URL()+"/sessions/"+id+"/v1/chat/completions",
			`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
		m := r.json(t)
		if r.code != 200 || num(m, "turn") != turn || m["session_id"] != id {
			t.Fatalf("turn %d: %d %s", turn, r.code, r.body)
		}
	}
	if code, turns := get(id); code != 200 || turns != 3 || s.Turns(id) != 3 {
		t.Fatalf("after 3 turns: %d %d Turns=%d", code, turns, s.Turns(id))
	}

	// Reseeding: chat on a foreign id creates it; GET of an unknown id is 404.
	foreign := "w7-0123456789abcdef0123456789abcdef"
	if code, _ := get(foreign); code != 404 {
		t.Fatalf("GET unknown: %d", code)
	}
	r = call(t, c, "POST", s.URL()+"/sessions/"+foreign+"/v1/chat/completions", `{"messages":[]}`)
	if num(r.json(t), "turn") != 1 {
		t.Fatalf("reseed: %s", r.body)
	}
	if code, turns := get(foreign); code != 200 || turns != 1 {
		t.Fatalf("reseeded: %d %d", code, turns)
	}

	for _, tc := range []struct {
		id   string
		code int
	}{{id, 200}, {id, 404}, {"w3-never", 404}} {
		r := call(t, c, "DELETE", s.URL()+"/sessions/"+tc.id, "")
		if r.code != tc.code {
			t.Errorf("DELETE %s: %d %s, want %d", tc.id, r.code, r.body, tc.code)
		}
		if tc.code == 200 && r.json(t)["deleted"] != true {
			t.Errorf("DELETE body %s", r.body)
		}
	}
	if code, _ := get(id); code != 404 || s.Turns(id) != 0 {
		t.Fatalf("deleted session still there")
	}

	// Uniqueness, concurrently (run with -race).
	var mu sync.Mutex
	seen := map[string]bool{}
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 50 {
				r, err := try(c, "POST", s.URL()+"/sessions", "")
				if err != nil {
					t.Error(err)
					return
				}
				var m struct {
					SessionID string `json:"session_id"`
				}
				json.Unmarshal(r.body, &m)
				id := m.SessionID
				mu.Lock()
				if seen[id] || !idRE.MatchString(id) {
					t.Errorf("bad or duplicate id %q", id)
				}
				seen[id] = true
				mu.Unlock()
			}
		})
	}
	wg.Wait()
}

func TestConcurrentTurns(t *testing.T) {
	s, c := start(t, Options{Index: 1})
	const id = "w1-shared"
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 25 {
				if _, err := try(c, "POST", s.URL()+"/sessions/"+id+"/v1/chat/completions", "{}"); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if got := s.Turns(id); got != 200 {
		t.Fatalf("Turns = %d, want 200", got)
	}
}

func TestChat(t *testing.T) {
	const chunks = 5
	s, c := start(t, Options{Index: 2, StreamChunks: chunks})
	sid := "w2-00000000000000000000000000000abc"
	for _, tc := range []struct {
		name, path, body string
		hdr              []string
		wantContent      string
		stream           bool
	}{
		{"session", "/sessions/" + sid + "/v1/chat/completions", `{"model":"qwen","messages":[{"role":"user","content":"x"}]}`,
			nil, "worker 2 session " + sid + " turn 1", false},
		{"session stream", "/sessions/" + sid + "/v1/chat/completions", `{"model":"qwen","messages":[],"stream":true}`,
			nil, "worker 2 session " + sid + " turn 2", true},
		{"keyed", "/v1/chat/completions", `{"model":"qwen","messages":[],"rid":"r-1"}`,
			nil, "worker 2 rid r-1", false},
		{"keyed header rid", "/v1/chat/completions", `{"model":"qwen","messages":[]}`,
			[]string{"X-Request-ID", "hdr-7"}, "worker 2 rid hdr-7", false},
		{"keyed stream", "/v1/chat/completions", `{"model":"qwen","stream":true,"request_id":"r-2"}`,
			nil, "worker 2 rid r-2", true},
		{"escaping", "/sessions/" + "a%22%5Cb%E2%82%AC/v1/chat/completions", `{"model":"q\"\n","stream":true}`,
			nil, "worker 2 session a\"\\b€ turn 1", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := call(t, c, "POST", s.URL()+tc.path, tc.body, tc.hdr...)
			if r.code != 200 || r.hdr.Get("X-Tether-Demo-Worker") != "2" {
				t.Fatalf("%d %v %s", r.code, r.hdr, r.body)
			}
			if !tc.stream {
				if ct := r.hdr.Get("Content-Type"); ct != "application/json" {
					t.Errorf("Content-Type %q", ct)
				}
				var resp struct {
					Object  string
					Model   string
					Worker  int
					Choices []struct {
						Message      struct{ Role, Content string }
						FinishReason string `json:"finish_reason"`
					}
				}
				if err := json.Unmarshal(r.body, &resp); err != nil {
					t.Fatalf("%s: %v", r.body, err)
				}
				if resp.Object != "chat.completion" || resp.Model != "qwen" || resp.Worker != 2 ||
					len(resp.Choices) != 1 || resp.Choices[0].Message.Content != tc.wantContent ||
					resp.Choices[0].Message.Role != "assistant" || resp.Choices[0].FinishReason != "stop" {
					t.Errorf("response %s", r.body)
				}
				return
			}
			if ct := r.hdr.Get("Content-Type"); ct != "text/event-stream" {
				t.Errorf("Content-Type %q", ct)
			}
			events := sse(t, bytes.NewReader(r.body))
			if len(events) != chunks+2 || events[len(events)-1] != "[DONE]" {
				t.Fatalf("events %q", events)
			}
			var content strings.Builder
			for i, e := range events[:len(events)-1] {
				var ch struct {
					Object  string
					Worker  *int
					Choices []struct {
						Delta        struct{ Role, Content string }
						FinishReason *string `json:"finish_reason"`
					}
				}
				if err := json.Unmarshal([]byte(e), &ch); err != nil {
					t.Fatalf("event %q: %v", e, err)
				}
				if ch.Object != "chat.completion.chunk" || ch.Worker == nil || *ch.Worker != 2 || len(ch.Choices) != 1 {
					t.Fatalf("event %s", e)
				}
				last := i == len(events)-2
				if fr := ch.Choices[0].FinishReason; (fr != nil) != last || (last && *fr != "stop") {
					t.Errorf("event %d finish_reason in %s", i, e)
				}
				if (ch.Choices[0].Delta.Role == "assistant") != (i == 0) {
					t.Errorf("event %d role in %s", i, e)
				}
				content.WriteString(ch.Choices[0].Delta.Content)
			}
			if content.String() != tc.wantContent {
				t.Errorf("streamed content %q, want %q", content.String(), tc.wantContent)
			}
		})
	}
}

func TestBadRequests(t *testing.T) {
	s, c := start(t, Options{})
	for _, tc := range []struct{ method, path, body string }{
		{"POST", "/sessions/w0-x/v1/chat/completions", `{"stream": tru`},
		{"POST", "/v1/chat/completions", `{"stream":"yes"}`},
		{"POST", "/generate", `[1,2`},
		{"POST", "/abort_request", `nope`},
		{"GET", "/sessions/w0-x/blob?size=-1", ""},
		{"GET", "/sessions/w0-x/blob?size=1&chunked=maybe", ""},
		{"POST", "/sessions/w0-x/slow?chunks=x", ""},
	} {
		r := call(t, c, tc.method, s.URL()+tc.path, tc.body)
		if r.code != 400 || r.json(t)["error"] == nil {
			t.Errorf("%s %s %q: %d %s", tc.method, tc.path, tc.body, r.code, r.body)
		}
	}
	// An empty body is an empty request, not malformed.
	if r := call(t, c, "POST", s.URL()+"/v1/chat/completions", ""); r.code != 200 {
		t.Errorf("empty body: %d %s", r.code, r.body)
	}
}

func TestBlob(t *testing.T) {
	s, c := start(t, Options{})
	for _, size := range []int64{0, 1, 65535, 65536, 3<<20 + 7} {
		for _, chunked := range []bool{false, true} {
			t.Run(fmt.Sprintf("size=%d,chunked=%v", size, chunked), func(t *testing.T) {
				seed := uint64(size) * 31
				ch := "0"
				if chunked {
					ch = "1"
				}
				resp, err := c.Get(fmt.Sprintf("%s/sessions/w0-x/blob?size=%d&seed=%d&chunked=%s", s.URL(), size, seed, ch))
				if err != nil {
					t.Fatal(err)
				}
				defer resp.Body.Close()
				got := sha256.New()
				n, err := io.Copy(got, resp.Body)
				if err != nil {
					t.Fatal(err)
				}
				want := sha256.New()
				io.Copy(want, Blob(size, seed))
				if n != size || !bytes.Equal(got.Sum(nil), want.Sum(nil)) {
					t.Errorf("got %d bytes, digest mismatch %v", n, !bytes.Equal(got.Sum(nil), want.Sum(nil)))
				}
				isChunked := slices.Contains(resp.TransferEncoding, "chunked")
				if chunked && (resp.ContentLength != -1 || !isChunked) && size > 0 {
					t.Errorf("chunked: ContentLength %d TE %v", resp.ContentLength, resp.TransferEncoding)
				}
				if !chunked && (resp.ContentLength != size || isChunked) {
					t.Errorf("ContentLength %d TE %v", resp.ContentLength, resp.TransferEncoding)
				}
				if ct := resp.Header.Get("Content-Type"); ct != "application/octet-stream" {
					t.Errorf("Content-Type %q", ct)
				}
			})
		}
	}
}

func TestBlobReader(t *testing.T) {
	want, err := io.ReadAll(Blob(100_003, 9))
	if err != nil || len(want) != 100_003 {
		t.Fatalf("%d %v", len(want), err)
	}
	// The same bytes whatever the read sizes.
	if err := iotest.TestReader(Blob(100_003, 9), want); err != nil {
		t.Fatal(err)
	}
	one, _ := io.ReadAll(iotest.OneByteReader(Blob(1000, 9)))
	if !bytes.Equal(one, want[:1000]) {
		t.Fatal("one-byte reads differ")
	}
	other, _ := io.ReadAll(Blob(1000, 10))
	if bytes.Equal(other, want[:1000]) {
		t.Fatal("seed ignored")
	}
}

func TestSha256AndEcho(t *testing.T) {
	s, c := start(t, Options{Index: 4})
	for _, size := range []int64{0, 10, 5<<20 + 3} {
		data, _ := io.ReadAll(Blob(size, 77))
		sum := sha256.Sum256(data)

		r := call(t, c, "POST", s.URL()+"/sessions/w4-x/sha256", string(data))
		m := r.json(t)
		if r.code != 200 || m["sha256"] != hex.EncodeToString(sum[:]) || num(m, "bytes") != int(size) || num(m, "worker") != 4 {
			t.Errorf("sha256 of %d bytes: %d %s", size, r.code, r.body)
		}

		r = call(t, c, "POST", s.URL()+"/sessions/w4-x/echo", string(data))
		if r.code != 200 || !bytes.Equal(r.body, data) {
			t.Errorf("echo of %d bytes: %d, got %d bytes", size, r.code, len(r.body))
		}
	}
}

// TestEchoStreams checks that echo answers each piece before the request
// body has ended (full duplex, no buffering).
func TestEchoStreams(t *testing.T) {
	s, c := start(t, Options{})
	pr, pw := io.Pipe()
	req, _ := http.NewRequest("POST", s.URL()+"/sessions/w0-x/echo", pr)
	type result struct {
		resp *http.Response
		err  error
	}
	done := make(chan result, 1)
	go func() {
		resp, err := c.Do(req)
		done <- result{resp, err}
	}()
	if _, err := pw.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	res := <-done
	if res.err != nil {
		t.Fatal(res.err)
	}
	defer res.resp.Body.Close()
	for _, word := range []string{"ping", "pong"} {
		if word == "pong" {
			pw.Write([]byte(word))
		}
		buf := make([]byte, 4)
		if _, err := io.ReadFull(res.resp.Body, buf); err != nil || string(buf) != word {
			t.Fatalf("echo read %q %v, want %q", buf, err, word)
		}
	}
	pw.Close()
	if rest, err := io.ReadAll(res.resp.Body); err != nil || len(rest) != 0 {
		t.Fatalf("tail %q %v", rest, err)
	}
}

type genResult struct {
	Text     string
	MetaInfo struct {
		ID           string
		FinishReason *struct{ Type string } `json:"finish_reason"`
	} `json:"meta_info"`
	Worker int
}

// generate posts /generate and returns the final result (the last event
// before [DONE] when streaming).
func generate(t *testing.T, c *http.Client, url, body string, hdr ...string) (genResult, int) {
	t.Helper()
	req, _ := http.NewRequest("POST", url+"/generate", strings.NewReader(body))
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Error(err)
		return genResult{}, 0
	}
	defer resp.Body.Close()
	var res genResult
	if resp.Header.Get("Content-Type") != "text/event-stream" {
		if err := json.NewDecoder(resp.Body).Decode(&res); err != nil {
			t.Error(err)
		}
		return res, 1
	}
	events := sse(t, resp.Body)
	if len(events) < 2 || events[len(events)-1] != "[DONE]" {
		t.Errorf("events %q", events)
		return res, 0
	}
	for _, e := range events[:len(events)-2] {
		var mid genResult
		if json.Unmarshal([]byte(e), &mid); mid.MetaInfo.FinishReason != nil {
			t.Errorf("finish_reason before the end: %s", e)
		}
	}
	if err := json.Unmarshal([]byte(events[len(events)-2]), &res); err != nil {
		t.Error(err)
	}
	return res, len(events) - 1
}

func TestGenerate(t *testing.T) {
	s, c := start(t, Options{Index: 6, StreamChunks: 3})
	for _, stream := range []bool{false, true} {
		res, events := generate(t, c, s.URL(), fmt.Sprintf(`{"rid":"g1","text":"hi","stream":%v,"sampling_params":{"max_new_tokens":8}}`, stream))
		if res.MetaInfo.ID != "g1" || res.Worker != 6 || res.MetaInfo.FinishReason == nil ||
			res.MetaInfo.FinishReason.Type != "stop" || res.Text != "w6-t0 w6-t1 w6-t2 " {
			t.Errorf("stream=%v: %+v", stream, res)
		}
		if stream && events != 3 {
			t.Errorf("%d events, want 3", events)
		}
	}
	res, _ := generate(t, c, s.URL(), `{"text":"hi"}`, "X-Request-ID", "from-header")
	if res.MetaInfo.ID != "from-header" {
		t.Errorf("X-Request-ID not honoured: %+v", res)
	}
}

func TestAbort(t *testing.T) {
	for _, tc := range []struct {
		name, path, body string
		chat             bool
	}{
		{"sglang rid", "/abort_request", `{"rid":"R"}`, false},
		{"sglang abort_all", "/abort_request", `{"abort_all":true}`, false},
		{"vllm", "/abort_requests", `{"request_ids":["other","R"]}`, false},
		{"chat stream vllm", "/abort_requests", `{"request_ids":["R"]}`, true},
	} {
		for _, stream := range []bool{false, true} {
			if tc.chat && !stream {
				continue
			}
			t.Run(fmt.Sprintf("%s/stream=%v", tc.name, stream), func(t *testing.T) {
				t.Parallel()
				// Unaborted, a request would take 100 × 20 ms = 2 s.
				s, c := start(t, Options{StreamChunks: 100, StreamDelay: 20 * time.Millisecond})
				type out struct {
					finish string
					took   time.Duration
				}
				done := make(chan out, 1)
				go func() {
					t0 := time.Now()
					if tc.chat {
						r, err := try(c, "POST", s.URL()+"/v1/chat/completions", `{"stream":true}`, "X-Request-ID", "R")
						if err != nil {
							t.Error(err)
						}
						ev := strings.Split(strings.TrimSpace(strings.ReplaceAll(string(r.body), "data: ", "")), "\n\n")
						var last struct {
							Choices []struct {
								FinishReason string `json:"finish_reason"`
							}
						}
						if len(ev) >= 2 {
							json.Unmarshal([]byte(ev[len(ev)-2]), &last)
						}
						if len(last.Choices) == 1 {
							done <- out{last.Choices[0].FinishReason, time.Since(t0)}
							return
						}
						done <- out{"?", time.Since(t0)}
						return
					}
					res, _ := generate(t, c, s.URL(), fmt.Sprintf(`{"rid":"R","text":"x","stream":%v}`, stream))
					if res.MetaInfo.FinishReason == nil {
						done <- out{"none", time.Since(t0)}
						return
					}
					done <- out{res.MetaInfo.FinishReason.Type, time.Since(t0)}
				}()
				testenv.WaitFor(t, "rid R running", func() bool { return slices.Equal(s.Running(), []string{"R"}) })
				r := call(t, c, "POST", s.URL()+tc.path, tc.body)
				if r.code != 200 || string(r.json(t)["aborted"].([]any)[0].(string)) != "R" {
					t.Fatalf("abort: %d %s", r.code, r.body)
				}
				o := <-done
				if o.finish != "abort" || o.took > time.Second {
					t.Errorf("finish %q after %v", o.finish, o.took)
				}
				if got := s.Aborted(); !slices.Equal(got, []string{"R"}) {
					t.Errorf("Aborted() = %q", got)
				}
				// Nothing left to abort.
				r = call(t, c, "POST", s.URL()+"/abort_request", `{"abort_all":true}`)
				if !bytes.Contains(r.body, []byte(`"aborted":[]`)) {
					t.Errorf("second abort: %s", r.body)
				}
			})
		}
	}
}

func TestSlowAndCancelled(t *testing.T) {
	s, c := start(t, Options{Index: 8})

	// Timing: 3 events 50 ms apart, the first at once. Scheduling jitter
	// can only delay a read, so the third event arriving before 100 ms is
	// a pacing bug on any machine; the first one's bound gets retries.
	testenv.Timed(t, func() error {
		t0 := time.Now()
		resp, err := c.Post(s.URL()+"/sessions/w8-x/slow?chunks=3&delay_ms=50", "text/plain", strings.NewReader("ignored"))
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		br := bufio.NewReader(resp.Body)
		var at []time.Duration
		for {
			line, err := br.ReadString('\n')
			if err != nil {
				break
			}
			if strings.HasPrefix(line, "data: ") {
				at = append(at, time.Since(t0))
			}
		}
		if len(at) != 3 || at[2] < 100*time.Millisecond {
			t.Fatalf("event times %v: want 3 events, the last no sooner than 100 ms", at)
		}
		if at[0] > 40*time.Millisecond {
			return fmt.Errorf("first event after %v, want at once", at[0])
		}
		return nil
	})
	if s.Cancelled() != 0 {
		t.Fatalf("Cancelled() = %d after a complete stream", s.Cancelled())
	}

	// The client goes away after the first event.
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", s.URL()+"/sessions/w8-x/slow?chunks=1000&delay_ms=20", nil)
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if line, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil || !strings.Contains(line, `"seq":0`) {
		t.Fatalf("first event %q %v", line, err)
	}
	cancel()
	resp.Body.Close()
	testenv.WaitFor(t, "Cancelled() == 1", func() bool { return s.Cancelled() == 1 })
	testenv.WaitFor(t, "Active() == 0", func() bool { return s.Active() == 0 })
}

func TestCloseKillsConnections(t *testing.T) {
	s, c := start(t, Options{})
	resp, err := c.Post(s.URL()+"/sessions/w0-x/slow?chunks=1000&delay_ms=50", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	if _, err := br.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	_, err = io.ReadAll(br)
	if err == nil || errors.Is(err, io.EOF) || time.Since(t0) > time.Second {
		t.Fatalf("stream after Close: err %v after %v", err, time.Since(t0))
	}
	if _, err := c.Get(s.URL() + "/health"); err == nil {
		t.Fatal("request succeeded after Close")
	}
	testenv.WaitFor(t, "the handler to notice", func() bool { return s.Cancelled() == 1 && s.Active() == 0 })
}

func TestLastHeaders(t *testing.T) {
	s, c := start(t, Options{})
	if s.LastHeaders() != nil {
		t.Fatal("headers before any request")
	}
	call(t, c, "POST", s.URL()+"/sessions", "", "X-Forwarded-For", "10.0.0.1", "X-Custom", "a")
	call(t, c, "GET", s.URL()+"/health", "") // probes do not count
	call(t, c, "GET", s.URL()+"/get_load", "")
	h := s.LastHeaders()
	if h.Get("X-Forwarded-For") != "10.0.0.1" || h.Get("X-Custom") != "a" {
		t.Fatalf("LastHeaders = %v", h)
	}
	h.Set("X-Custom", "changed")
	if s.LastHeaders().Get("X-Custom") != "a" {
		t.Fatal("LastHeaders is not a copy")
	}
}

func TestGetLoadCountsInFlight(t *testing.T) {
	s, c := start(t, Options{StreamChunks: 50, StreamDelay: 10 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for i := range 2 {
		req, _ := http.NewRequestWithContext(ctx, "POST", s.URL()+"/generate", strings.NewReader(fmt.Sprintf(`{"rid":"l%d"}`, i)))
		go func() {
			if resp, err := c.Do(req); err == nil {
				resp.Body.Close()
			}
		}()
	}
	testenv.WaitFor(t, "2 running", func() bool { return len(s.Running()) == 2 })
	if m := call(t, c, "GET", s.URL()+"/get_load", "").json(t); num(m, "num_reqs") != 2 {
		t.Errorf("get_load %v", m)
	}
	cancel()
	testenv.WaitFor(t, "idle", func() bool { return s.Active() == 0 })
}

// discardWriter is a minimal ResponseWriter, so that the benchmark measures
// the handler's own allocations.
type discardWriter struct{ h http.Header }

func (d *discardWriter) Header() http.Header         { return d.h }
func (d *discardWriter) Write(p []byte) (int, error) { return len(p), nil }
func (d *discardWriter) WriteHeader(int)             {}
func (d *discardWriter) Flush()                      {}

func BenchmarkChatHandler(b *testing.B) {
	for _, stream := range []bool{false, true} {
		b.Run(fmt.Sprintf("stream=%v", stream), func(b *testing.B) {
			w := New(Options{Index: 1})
			body := fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"hello there"}],"stream":%v}`, stream)
			req := httptest.NewRequest("POST", "/sessions/w1-0123456789abcdef0123456789abcdef/v1/chat/completions", nil)
			rd := strings.NewReader(body)
			req.Body = io.NopCloser(rd)
			rw := &discardWriter{h: http.Header{}}
			b.ReportAllocs()
			for b.Loop() {
				rd.Reset(body)
				clear(rw.h)
				w.ServeHTTP(rw, req)
			}
		})
	}
}

func BenchmarkChatLoopback(b *testing.B) {
	s, err := Start("127.0.0.1:0", Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	c := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	url := s.URL() + "/sessions/w0-0123456789abcdef0123456789abcdef/v1/chat/completions"
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			resp, err := c.Post(url, "application/json", strings.NewReader(`{"model":"m","messages":[]}`))
			if err != nil {
				b.Error(err)
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	})
}
