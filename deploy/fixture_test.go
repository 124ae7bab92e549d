package deploy

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv/fakeengine"
	"github.com/tether-rl/tether/userspace/config"
	"github.com/tether-rl/tether/userspace/daemon"
)

// fixture is tetherd in-process (no BPF: its counters in this process) in
// front of fake SGLang and vLLM engines, with its admin API.
type fixture struct {
	d       *daemon.Daemon
	engines []*fakeengine.Engine
	base    string // data port
	admin   string // admin API
	token   string
	client  *http.Client
	// tokens: the most tokens a load request generates (default 24).
	tokens int
}

func newFixture(t *testing.T, sglang, vllm int, token string) *fixture {
	t.Helper()
	return newFixturePoll(t, sglang, vllm, token, 100*time.Millisecond)
}

// newFixturePoll is newFixture with the engines' load read every poll.
func newFixturePoll(t *testing.T, sglang, vllm int, token string, poll time.Duration) *fixture {
	t.Helper()
	var engines []*fakeengine.Engine
	for _, c := range []struct {
		n    int
		kind fakeengine.Kind
	}{{sglang, fakeengine.SGLang}, {vllm, fakeengine.VLLM}} {
		if c.n == 0 {
			continue
		}
		es, err := fakeengine.StartFleet(c.n, fakeengine.Config{Kind: c.kind, DecodeStep: time.Millisecond, MaxRunning: 16, KVBlocks: 256, UpdateDelay: 20 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		engines = append(engines, es...)
	}
	t.Cleanup(func() {
		for _, e := range engines {
			e.Close()
		}
	})
	opts := daemon.Options{Listen: "127.0.0.1:0", Admin: "127.0.0.1:0", AdminToken: token, BPF: "off", Listeners: 2,
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	opts.Routing.EnginePoll = config.Some(poll)
	for _, e := range engines {
		opts.Workers = append(opts.Workers, e.URL())
	}
	d, err := daemon.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	d.Serve()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		d.Shutdown(ctx)
	})
	tr := &http.Transport{MaxIdleConnsPerHost: 64, DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	return &fixture{d: d, engines: engines, base: "http://" + d.Addr(), admin: "http://" + d.AdminAddr(), token: token,
		client: &http.Client{Transport: tr, Timeout: 60 * time.Second}}
}

// generate sends one generation request in the engine kind's API.
func (fx *fixture) generate(kind fakeengine.Kind, key string, tokens int) (int, error) {
	path, body := "/generate", fmt.Sprintf(`{"text":"prompt %s","sampling_params":{"max_new_tokens":%d}}`, key, tokens)
	if kind == fakeengine.VLLM {
		path, body = "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":"prompt %s","max_tokens":%d}`, key, tokens)
	}
	req, _ := http.NewRequest("POST", fx.base+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Session-ID", key)
	resp, err := fx.client.Do(req)
	if err != nil {
		return 0, err
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, nil
}

// load keeps n clients generating until the test ends (or stop is
// called); it returns how many requests were answered so far.
func (fx *fixture) load(t *testing.T, n int) (answered func() int64, stop func()) {
	t.Helper()
	var count atomic.Int64
	done := make(chan struct{})
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := 0; ; j++ {
				select {
				case <-done:
					return
				default:
				}
				kind := fakeengine.SGLang
				if i%2 == 1 {
					kind = fakeengine.VLLM
				}
				most := fx.tokens
				if most <= 0 {
					most = 24
				}
				if _, err := fx.generate(kind, fmt.Sprintf("c%d-%d", i, j%8), most/3+j%(most-most/3)); err == nil {
					count.Add(1)
				}
			}
		}()
	}
	var once sync.Once
	stop = func() { once.Do(func() { close(done); wg.Wait() }) }
	t.Cleanup(stop)
	return count.Load, stop
}

// post calls a data-port endpoint of tetherd's (pause, update, resume).
func (fx *fixture) post(t *testing.T, path, body string) (int, map[string]any) {
	t.Helper()
	resp, err := fx.client.Post(fx.base+path, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	defer resp.Body.Close()
	var m map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&m); err != nil {
		t.Fatalf("POST %s: answer: %v", path, err)
	}
	return resp.StatusCode, m
}

// adminGet reads an admin API path with the token.
func (fx *fixture) adminGet(t *testing.T, path string, into any) {
	t.Helper()
	req, _ := http.NewRequest("GET", fx.admin+path, nil)
	if fx.token != "" {
		req.Header.Set("Authorization", "Bearer "+fx.token)
	}
	resp, err := fx.client.Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("GET %s: %d %s", path, resp.StatusCode, b)
	}
	if err := json.NewDecoder(resp.Body).Decode(into); err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
}

// need finds a tool: absent, the test skips loudly, unless it runs as
// root (CI, where .ci/run installs it): then it fails.
func need(t *testing.T, tool, pkg string) string {
	t.Helper()
	p, err := exec.LookPath(tool)
	if err == nil {
		return p
	}
	if os.Geteuid() == 0 {
		t.Fatalf("%s not found: as root (CI) it must be there: apt-get install %s (.ci/run installs it)", tool, pkg)
	}
	t.Skipf("SKIPPED LOUDLY: %s not found (Debian package %s; CI installs it through .ci/run)", tool, pkg)
	return ""
}
