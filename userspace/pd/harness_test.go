package pd_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/testenv/fakeengine"
	"github.com/tether-rl/tether/testenv/fakepd"
	"github.com/tether-rl/tether/userspace/pd"
)

func TestMain(m *testing.M) { os.Exit(testenv.RunNoLeaks(m)) }

// engine is what the tests ask of every fake.
type engine interface {
	URL() string
	Held() int
	Kill()
	FailNext(status, n int)
}

// fleet is a P/D fleet of one protocol.
type fleet struct {
	proto    pd.Protocol
	prefills []engine
	decodes  []engine
	workersP []pd.Worker
	workersD []pd.Worker
	stats    func(e engine) *fakepd.Stats
}

func newFleet(t *testing.T, proto pd.Protocol, np, nd int, popts, dopts fakepd.Options) *fleet {
	t.Helper()
	ps, ds := make([]fakepd.Options, np), make([]fakepd.Options, nd)
	for i := range ps {
		ps[i] = popts
	}
	for i := range ds {
		ds[i] = dopts
	}
	return newFleetOpts(t, proto, ps, ds)
}

// newFleetOpts starts a fleet with options per engine.
func newFleetOpts(t *testing.T, proto pd.Protocol, ps, ds []fakepd.Options) *fleet {
	t.Helper()
	f := &fleet{proto: proto}
	np, nd := len(ps), len(ds)
	for i := 0; i < np; i++ {
		popts := ps[i]
		var e engine
		w := pd.Worker{Slot: i}
		switch proto {
		case pd.SGLang:
			p, err := fakepd.StartSGLangPrefill(popts)
			if err != nil {
				t.Fatal(err)
			}
			w.BootstrapPort = p.BootstrapPort()
			e = p
		case pd.VLLM:
			p, err := fakepd.StartVLLMPrefill(popts)
			if err != nil {
				t.Fatal(err)
			}
			e = p
		}
		w.URL = e.URL()
		t.Cleanup(e.Kill)
		f.prefills, f.workersP = append(f.prefills, e), append(f.workersP, w)
	}
	for i := 0; i < nd; i++ {
		dopts := ds[i]
		var e engine
		switch proto {
		case pd.SGLang:
			d, err := fakepd.StartSGLangDecode(dopts)
			if err != nil {
				t.Fatal(err)
			}
			e = d
		case pd.VLLM:
			d, err := fakepd.StartVLLMDecode(dopts)
			if err != nil {
				t.Fatal(err)
			}
			e = d
		}
		t.Cleanup(e.Kill)
		f.decodes, f.workersD = append(f.decodes, e), append(f.workersD, pd.Worker{URL: e.URL(), Slot: np + i})
	}
	return f
}

func statsOf(e engine) *fakepd.Stats {
	switch e := e.(type) {
	case *fakepd.SGLangPrefill:
		return &e.Stats
	case *fakepd.SGLangDecode:
		return &e.Stats
	case *fakepd.VLLMPrefill:
		return &e.Stats
	case *fakepd.VLLMDecode:
		return &e.Stats
	}
	panic("unknown engine")
}

// held is what the whole fleet still holds.
func (f *fleet) held() int {
	n := 0
	for _, e := range append(append([]engine{}, f.prefills...), f.decodes...) {
		n += e.Held()
	}
	return n
}

func (f *fleet) sum(get func(s *fakepd.Stats) int64) int64 {
	var n int64
	for _, e := range append(append([]engine{}, f.prefills...), f.decodes...) {
		n += get(statsOf(e))
	}
	return n
}

// chooser hands out pairs: attempt 0 takes the next of seq, a retry the
// one after the failed pair; it keeps loads.
type chooser struct {
	f       *fleet
	mu      sync.Mutex
	next    int
	load    atomic.Int64
	chosen  atomic.Int64
	retries atomic.Int64
	fixed   []pd.Pair // if set: attempt i gets fixed[i]
	// pauses: a pause begins during each of the first pauses attempts
	// (Holds counts one more at their Choose).
	pauses   int
	holds    atomic.Uint64
	released []bool // Release's failed, in order
}

// Holds implements pd.PauseCounter.
func (c *chooser) Holds() (uint64, bool) { return c.holds.Load(), false }

func (c *chooser) Choose(_ context.Context, _ *pd.Request, attempt int, failed *pd.Pair) (pd.Pair, error) {
	c.chosen.Add(1)
	if attempt < c.pauses {
		c.holds.Add(1)
	}
	if attempt > 0 {
		c.retries.Add(1)
	}
	if c.fixed != nil {
		if attempt >= len(c.fixed) {
			return pd.Pair{}, pd.ErrNoPair
		}
		c.load.Add(1)
		return c.fixed[attempt], nil
	}
	c.mu.Lock()
	i := c.next
	c.next++
	c.mu.Unlock()
	p := pd.Pair{Prefill: c.f.workersP[i%len(c.f.workersP)], Decode: c.f.workersD[i%len(c.f.workersD)], Reason: "test"}
	if failed != nil && p == *failed {
		p.Decode = c.f.workersD[(i+1)%len(c.f.workersD)]
	}
	c.load.Add(1)
	return p, nil
}

func (c *chooser) Release(_ pd.Pair, failed bool) {
	c.mu.Lock()
	c.released = append(c.released, failed)
	c.mu.Unlock()
	c.load.Add(-1)
}

func (c *chooser) pair(pi, di int) pd.Pair {
	return pd.Pair{Prefill: c.f.workersP[pi], Decode: c.f.workersD[di]}
}

// router serves Serve over HTTP for the tests' clients.
type router struct {
	srv  *pd.Server
	ch   *chooser
	http *httptest.Server
	errs chan error
}

func newRouter(t *testing.T, f *fleet, cfg pd.Config) *router {
	t.Helper()
	cfg.Protocol = f.proto
	cfg.RouteHeader = "X-Tether-Route"
	r := &router{srv: pd.New(cfg), ch: &chooser{f: f}, errs: make(chan error, 1024)}
	r.http = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) {
		body, err := io.ReadAll(q.Body)
		if err != nil {
			return
		}
		err = r.srv.Serve(q.Context(), w, &pd.Request{Method: q.Method, Path: q.URL.RequestURI(), Header: q.Header, Body: body}, r.ch)
		select {
		case r.errs <- err:
		default:
		}
	}))
	t.Cleanup(func() {
		r.http.CloseClientConnections()
		r.http.Close()
		r.srv.Close()
	})
	return r
}

func (r *router) post(t testing.TB, path, body string) (*http.Response, []byte) {
	t.Helper()
	resp, err := r.http.Client().Post(r.http.URL+path, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading the answer: %v", err)
	}
	return resp, b
}

// expected is the text a fake decodes for a prompt text (seed 0).
func expected(prompt string, n int) string {
	var b strings.Builder
	toks := fakeengine.Tokenize(prompt)
	for i := 0; i < n; i++ {
		b.WriteString(fakeengine.TokenText(fakeengine.OutputToken(toks, 0, i)))
	}
	return b.String()
}

// textOf reads the generated text from an answer of any shape, whole or
// streamed.
func textOf(t testing.TB, path string, body []byte) string {
	t.Helper()
	if bytes.HasPrefix(bytes.TrimSpace(body), []byte("{")) {
		var a struct {
			Text    string `json:"text"`
			Choices []struct {
				Text    string `json:"text"`
				Message struct {
					Content string `json:"content"`
				} `json:"message"`
			} `json:"choices"`
		}
		if err := json.Unmarshal(body, &a); err != nil {
			t.Fatalf("answer %s: %v", body, err)
		}
		if path == "/generate" {
			return a.Text
		}
		return a.Choices[0].Text + a.Choices[0].Message.Content
	}
	var out strings.Builder
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || line == "[DONE]" {
			continue
		}
		var ev struct {
			Text    string `json:"text"`
			Error   any    `json:"error"`
			Choices []struct {
				Text  string `json:"text"`
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(line), &ev); err != nil {
			t.Fatalf("event %q: %v", line, err)
		}
		if ev.Error != nil {
			t.Fatalf("error event %s", line)
		}
		if path == "/generate" {
			out.Reset() // cumulative
			out.WriteString(ev.Text)
			continue
		}
		for _, c := range ev.Choices {
			out.WriteString(c.Text + c.Delta.Content)
		}
	}
	return out.String()
}

// body is a request body for path.
func body(path, prompt string, n int, stream bool, extra string) string {
	var b string
	switch path {
	case "/generate":
		b = fmt.Sprintf(`{"text":%q,"sampling_params":{"max_new_tokens":%d},"stream":%v`, prompt, n, stream)
	case "/v1/chat/completions":
		b = fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":%q}],"max_tokens":%d,"stream":%v`, prompt, n, stream)
	default:
		b = fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":%d,"stream":%v`, prompt, n, stream)
	}
	if extra != "" {
		b += "," + extra
	}
	return b + "}"
}

func chatPrompt(prompt string) string {
	return fakeengine.ChatPrompt([]fakeengine.ChatMessage{{Role: "user", Content: prompt}})
}

// settled waits for every Serve to return: a whole answer can reach the
// client before Serve counts it and releases its pair.
func (r *router) settled(t testing.TB) {
	t.Helper()
	testenv.WaitFor(t, "every Serve to return", func() bool { return r.ch.load.Load() == 0 })
}
