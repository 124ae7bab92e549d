package daemon

import (
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tether-rl/tether/userspace/health"
	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/proxy"
	"github.com/tether-rl/tether/userspace/registry"
)

// apiKeyEngine is a fake SGLang/vLLM engine started with --api-key: every
// path, /health included, wants "Authorization: Bearer <key>".
type apiKeyEngine struct {
	url   string
	srv   *http.Server
	mu    sync.Mutex
	calls map[string]int
}

func startAPIKeyEngine(t *testing.T, idx int, key string) *apiKeyEngine {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	e := &apiKeyEngine{url: "http://" + ln.Addr().String(), calls: map[string]int{}}
	e.srv = &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer "+key {
			w.WriteHeader(401)
			io.WriteString(w, `{"error":"invalid api key"}`)
			return
		}
		e.mu.Lock()
		e.calls[r.URL.Path]++
		e.mu.Unlock()
		w.Header().Set("X-Engine", strconv.Itoa(idx))
		w.Header().Set("Content-Type", "application/json")
		switch r.URL.Path {
		case "/get_load":
			io.WriteString(w, `{"num_reqs":0,"num_waiting_reqs":0}`)
		default:
			io.WriteString(w, `{"ok":true}`)
		}
	})}
	go e.srv.Serve(ln)
	t.Cleanup(func() { e.srv.Close() })
	return e
}

func (e *apiKeyEngine) count(path string) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.calls[path]
}

// The RL stacks' own client calls against tetherd in its drop-in recipe
// (admin verbs on the data port) and engines that require an API key:
// slime and miles (sglang-router clients), SkyRL (vllm-router
// X-Session-ID) and vime (vLLM aborts).
func TestDropInClients(t *testing.T) {
	const key = "sk-engine"
	engines := []*apiKeyEngine{startAPIKeyEngine(t, 0, key), startAPIKeyEngine(t, 1, key), startAPIKeyEngine(t, 2, key)}
	d := serveDaemon(t, Options{BPF: "off", AdminOnDataPort: true, WorkerAPIKey: key, InstanceID: "miles-7f3a",
		Health: health.Config{Interval: 50 * time.Millisecond}, Registry: registry.Config{StartupTimeout: 5 * time.Second}})
	base := "http://" + d.Addr()
	c := &http.Client{Timeout: 10 * time.Second}
	call := func(method, path, body string, hdr ...string) (int, http.Header, []byte) {
		t.Helper()
		req, _ := http.NewRequest(method, base+path, strings.NewReader(body))
		for i := 0; i+1 < len(hdr); i += 2 {
			req.Header.Set(hdr[i], hdr[i+1])
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, resp.Header, b
	}
	auth := []string{"Authorization", "Bearer " + key}

	t.Run("slime", func(t *testing.T) {
		// Registration: POST /add_worker?url=, then raise_for_status; an
		// engine restarted on the same host:port registers again.
		for _, e := range engines[:2] {
			for i := 0; i < 2; i++ {
				if st, _, b := call("POST", "/add_worker?url="+url.QueryEscape(e.url), ""); st != 200 {
					t.Fatalf("add_worker %s (try %d): %d %s", e.url, i, st, b)
				}
			}
		}
		// Listing: worker["id"] and worker["url"].
		st, _, b := call("GET", "/workers", "")
		var list struct {
			Workers []map[string]any `json:"workers"`
		}
		if json.Unmarshal(b, &list); st != 200 || len(list.Workers) != 2 {
			t.Fatalf("GET /workers: %d %s", st, b)
		}
		ids := map[string]string{}
		for _, w := range list.Workers {
			id, _ := w["id"].(string)
			u, _ := w["url"].(string)
			if id == "" || u == "" {
				t.Fatalf("worker entry without id or url: %v", w)
			}
			ids[u] = id
		}
		// Data: X-SMG-Routing-Key keeps a trajectory on one engine.
		first := ""
		for i := 0; i < 4; i++ {
			st, h, b := call("POST", "/generate", `{"text":"hi","sampling_params":{}}`, append(auth, "X-SMG-Routing-Key", "traj-9")...)
			if st != 200 {
				t.Fatalf("generate: %d %s", st, b)
			}
			if first == "" {
				first = h.Get("X-Engine")
			} else if h.Get("X-Engine") != first {
				t.Fatalf("routing key moved from engine %s to %s", first, h.Get("X-Engine"))
			}
		}
		// Abort and flush fan-outs reach engines that want the key.
		if st, _, b := call("POST", "/abort_request", `{"abort_all":true}`, auth...); st != 200 {
			t.Fatalf("abort_all: %d %s", st, b)
		}
		if st, _, b := call("POST", "/flush_cache", "", auth...); st != 200 {
			t.Fatalf("flush_cache: %d %s", st, b)
		}
		for i, e := range engines[:2] {
			if e.count("/abort_request") != 1 || e.count("/flush_cache") != 1 {
				t.Errorf("engine %d: abort %d flush %d", i, e.count("/abort_request"), e.count("/flush_cache"))
			}
		}
		// Loads: sgl-model-gateway's shape.
		st, _, b = call("GET", "/v1/loads", "")
		var loads struct {
			Loads []struct {
				Worker string `json:"worker"`
				Load   int    `json:"load"`
			} `json:"loads"`
		}
		if json.Unmarshal(b, &loads); st != 200 || len(loads.Loads) != 2 {
			t.Fatalf("/v1/loads: %d %s", st, b)
		}
		// Shutdown: DELETE /workers/{id} of the entry whose url matches.
		if st, _, b := call("DELETE", "/workers/"+ids[engines[0].url], ""); st != 200 {
			t.Fatalf("DELETE by id: %d %s", st, b)
		}
	})

	t.Run("miles", func(t *testing.T) {
		// POST /workers {"url","worker_type":"regular"}; DELETE /workers/{url}.
		if st, _, b := call("POST", "/workers", `{"url":"`+engines[2].url+`","worker_type":"regular"}`); st != 200 {
			t.Fatalf("POST /workers: %d %s", st, b)
		}
		if st, _, b := call("POST", "/workers", `{"url":"`+engines[2].url+`@1"}`); st != 400 || !strings.Contains(string(b), "rank") {
			t.Fatalf("dp-rank url: %d %s", st, b)
		}
		if st, _, b := call("DELETE", "/workers/"+url.PathEscape(engines[2].url), ""); st != 200 {
			t.Fatalf("DELETE by url: %d %s", st, b)
		}
		// The agent server's identity check.
		st, _, b := call("GET", "/health", "")
		var h map[string]any
		if json.Unmarshal(b, &h); st != 200 || h["session_server_instance_id"] != "miles-7f3a" {
			t.Fatalf("/health: %d %s", st, b)
		}
	})

	t.Run("skyrl", func(t *testing.T) {
		first := ""
		for i := 0; i < 3; i++ {
			st, h, b := call("POST", "/v1/chat/completions", `{"model":"m","messages":[]}`, append(auth, "X-Session-ID", "sampling_33680dc2:1")...)
			if st != 200 {
				t.Fatalf("chat: %d %s", st, b)
			}
			if first == "" {
				first = h.Get("X-Engine")
			} else if h.Get("X-Engine") != first {
				t.Fatal("X-Session-ID moved")
			}
		}
		if st, _, b := call("POST", "/finish_session?session_id=sampling_33680dc2:1", ""); st != 200 {
			t.Fatalf("finish_session: %d %s", st, b)
		}
	})

	t.Run("vime", func(t *testing.T) {
		before := engines[1].count("/abort_requests")
		if st, _, b := call("POST", "/abort_requests", `{}`, auth...); st != 200 {
			t.Fatalf("abort everything: %d %s", st, b)
		}
		if st, _, b := call("POST", "/abort_requests", `{"request_ids":["cmpl-1"]}`, auth...); st != 200 {
			t.Fatalf("abort ids: %d %s", st, b)
		}
		if got := engines[1].count("/abort_requests") - before; got != 2 {
			t.Fatalf("engine got %d abort_requests, want 2", got)
		}
	})
}

// A percent-encoded engine path is the endpoint it decodes to: tetherd
// answers it (the fan-out), instead of proxying it to one worker.
func TestEncodedLocalPath(t *testing.T) {
	d := startDaemon(t, Options{StartedWorkers: demoURLs(t, 0, 2)})
	for _, p := range []string{"/abort%5Frequest", "/%61bort_request", "/health%3F"} {
		resp, err := http.Post("http://"+d.Addr()+p, "application/json", strings.NewReader(`{"abort_all":true}`))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if p == "/health%3F" {
			// Decodes to "/health?": not /health itself, so proxied.
			if resp.Header.Get("X-Tether-Demo-Worker") == "" {
				t.Errorf("%s answered by tetherd: %d %s", p, resp.StatusCode, b)
			}
			continue
		}
		if resp.Header.Get("X-Tether-Demo-Worker") != "" || !strings.Contains(string(b), `"routed":"all"`) {
			t.Errorf("%s: proxied to a worker (%d %s), want tetherd's fan-out", p, resp.StatusCode, b)
		}
	}
}

// The head limits and timeouts are settings (--max-request-line,
// --max-head-bytes, --max-header-fields, --head-timeout), not constants.
func TestLimitsAreSettings(t *testing.T) {
	d := startDaemon(t, Options{StartedWorkers: demoURLs(t, 0, 1), Proxy: proxy.Config{HeadTimeout: 200 * time.Millisecond,
		Limits: httphead.Limits{RequestLine: 100, Head: 1024, Fields: 4, ChunkExt: 16}}})
	status := func(raw string) string {
		t.Helper()
		c, err := net.Dial("tcp", d.Addr())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		io.WriteString(c, raw)
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		b, _ := io.ReadAll(c)
		line, _, _ := strings.Cut(string(b), "\r\n")
		return line
	}
	long := "GET /" + strings.Repeat("a", 200) + " HTTP/1.1\r\nHost: x\r\n\r\n"
	if got := status(long); !strings.Contains(got, " 414 ") {
		t.Errorf("request line of 200: %q, want 414", got)
	}
	fields := "GET / HTTP/1.1\r\nHost: x\r\nA: 1\r\nB: 2\r\nC: 3\r\nD: 4\r\n\r\n"
	if got := status(fields); !strings.Contains(got, " 431 ") {
		t.Errorf("5 fields: %q, want 431", got)
	}
	big := "GET / HTTP/1.1\r\nHost: x\r\nA: " + strings.Repeat("b", 2000) + "\r\n\r\n"
	if got := status(big); !strings.Contains(got, " 431 ") {
		t.Errorf("2 KB head: %q, want 431", got)
	}
	ext := "POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1;" + strings.Repeat("e", 20) + "\r\nx\r\n0\r\n\r\n"
	if got := status(ext); !strings.Contains(got, " 400 ") {
		t.Errorf("20 bytes of chunk extension: %q, want 400", got)
	}
	ok := "POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n2;" + strings.Repeat("e", 10) + "\r\n{}\r\n0\r\n\r\n"
	if got := status(ok); !strings.Contains(got, " 200 ") {
		t.Errorf("10 bytes of chunk extension: %q, want 200", got)
	}
	start := time.Now()
	if got := status("GET / HTTP/1.1\r\nHost: x\r\n"); !strings.Contains(got, " 408 ") || time.Since(start) > 3*time.Second {
		t.Errorf("half a head: %q after %v, want 408 after 200ms", got, time.Since(start))
	}
	if got := status("GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"); !strings.Contains(got, " 200 ") {
		t.Errorf("a small request: %q", got)
	}
}
