package fakepd

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
)

func TestMain(m *testing.M) { os.Exit(testenv.RunNoLeaks(m)) }

func post(ctx context.Context, url string, body any) (int, []byte) {
	b, _ := json.Marshal(body)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(b))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil
	}
	defer resp.Body.Close()
	var out bytes.Buffer
	out.ReadFrom(resp.Body)
	return resp.StatusCode, out.Bytes()
}

func sglangPair(t *testing.T, popts, dopts Options) (*SGLangPrefill, *SGLangDecode) {
	p, err := StartSGLangPrefill(popts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	d, err := StartSGLangDecode(dopts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Kill)
	t.Cleanup(http.DefaultClient.CloseIdleConnections)
	return p, d
}

// TestSGLangDirect: the direct client's answer, and nothing held after.
func TestSGLangDirect(t *testing.T) {
	p, d := sglangPair(t, Options{}, Options{})
	st, out, err := DirectSGLang(context.Background(), http.DefaultClient, p.URL(), p.BootstrapPort(), d.URL(), "/generate",
		[]byte(`{"text":"hello","sampling_params":{"max_new_tokens":3}}`))
	if err != nil || st != 200 || !bytes.Contains(out, []byte(`"completion_tokens":3`)) {
		t.Fatalf("%d %v %s", st, err, out)
	}
	testenv.WaitFor(t, "nothing held", func() bool { return p.Held() == 0 && d.Held() == 0 })
}

// TestSGLangDecodeTimesOut: a decode whose prefill never gets the room
// fails after WaitTimeout and holds nothing.
func TestSGLangDecodeTimesOut(t *testing.T) {
	p, d := sglangPair(t, Options{}, Options{WaitTimeout: 200 * time.Millisecond})
	st, _ := post(context.Background(), d.URL()+"/generate", map[string]any{"text": "x", "bootstrap_host": "127.0.0.1",
		"bootstrap_port": p.BootstrapPort(), "bootstrap_room": 7})
	if st != 500 || d.Stats.Timeouts.Load() != 1 || d.Held() != 0 || p.Held() != 0 {
		t.Fatalf("status %d, timeouts %d, held %d/%d", st, d.Stats.Timeouts.Load(), d.Held(), p.Held())
	}
}

// TestSGLangNotify: a prefill request that ends before its decode pulled
// tells the decode with Notify (it fails at once); without, the decode
// waits out its timeout.
func TestSGLangNotify(t *testing.T) {
	for _, notify := range []bool{false, true} {
		t.Run(fmt.Sprint(notify), func(t *testing.T) {
			p, d := sglangPair(t, Options{PrefillDelay: time.Hour, Notify: notify}, Options{WaitTimeout: 300 * time.Millisecond, Notify: notify})
			body := map[string]any{"text": "x", "bootstrap_host": "127.0.0.1", "bootstrap_port": p.BootstrapPort(), "bootstrap_room": 9, "rid": "r9"}
			done := make(chan int, 1)
			go func() { st, _ := post(context.Background(), d.URL()+"/generate", body); done <- st }()
			pctx, cancel := context.WithCancel(context.Background())
			pdone := make(chan struct{})
			go func() { post(pctx, p.URL()+"/generate", body); close(pdone) }()
			testenv.WaitFor(t, "both sides to hold the room", func() bool { return p.Held() == 1 && d.Waiting() == 1 })
			cancel()
			<-pdone
			if st := <-done; st != 500 {
				t.Fatalf("decode answered %d", st)
			}
			testenv.WaitFor(t, "nothing held", func() bool { return p.Held() == 0 && d.Held() == 0 })
			if notify && (d.Stats.Notified.Load() != 1 || d.Stats.Timeouts.Load() != 0) {
				t.Errorf("notify: notified %d, timeouts %d", d.Stats.Notified.Load(), d.Stats.Timeouts.Load())
			}
			if !notify && (d.Stats.Notified.Load() != 0 || d.Stats.Timeouts.Load() != 1) {
				t.Errorf("no notify: notified %d, timeouts %d", d.Stats.Notified.Load(), d.Stats.Timeouts.Load())
			}
		})
	}
}

// TestSGLangAbortByRid: /abort_request {"rid"} ends a decode waiting for
// its room.
func TestSGLangAbortByRid(t *testing.T) {
	p, d := sglangPair(t, Options{}, Options{})
	done := make(chan int, 1)
	go func() {
		st, _ := post(context.Background(), d.URL()+"/generate", map[string]any{"text": "x", "bootstrap_host": "127.0.0.1",
			"bootstrap_port": p.BootstrapPort(), "bootstrap_room": 11, "rid": "abc"})
		done <- st
	}()
	testenv.WaitFor(t, "the decode to wait", func() bool { return d.Waiting() == 1 })
	if st, _ := post(context.Background(), d.URL()+"/abort_request", map[string]any{"rid": "abc"}); st != 200 {
		t.Fatalf("abort: %d", st)
	}
	<-done
	testenv.WaitFor(t, "nothing held", func() bool { return d.Held() == 0 && d.Stats.Aborted.Load() == 1 })
}

func vllmPair(t *testing.T, popts, dopts Options) (*VLLMPrefill, *VLLMDecode) {
	p, err := StartVLLMPrefill(popts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	d, err := StartVLLMDecode(dopts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Kill)
	t.Cleanup(http.DefaultClient.CloseIdleConnections)
	return p, d
}

// TestVLLMHandoff: the direct client pulls the blocks once; a second pull
// is refused (one consumer); a decode without params recomputes and says
// so; a lease frees unpulled blocks.
func TestVLLMHandoff(t *testing.T) {
	p, d := vllmPair(t, Options{Lease: 200 * time.Millisecond}, Options{})
	st, out, err := DirectVLLM(context.Background(), http.DefaultClient, p.URL(), d.URL(), "/v1/completions",
		[]byte(`{"prompt":"a prompt of some length, several blocks of it, more than sixty-four bytes long","max_tokens":3}`))
	if err != nil || st != 200 || d.Stats.Recomputes.Load() != 0 || p.Stats.Pulls.Load() != 1 || p.Held() != 0 {
		t.Fatalf("%d %v %s; recomputes %d, pulls %d, held %d", st, err, out, d.Stats.Recomputes.Load(), p.Stats.Pulls.Load(), p.Held())
	}
	// A prefill leg by hand: blocks pinned; pulled twice.
	st, out = post(context.Background(), p.URL()+"/v1/completions", map[string]any{"prompt": "some prompt", "max_tokens": 1,
		"kv_transfer_params": map[string]any{"do_remote_decode": true}})
	var ans struct {
		KV kvParams `json:"kv_transfer_params"`
	}
	if st != 200 || json.Unmarshal(out, &ans) != nil || p.Held() == 0 {
		t.Fatalf("%d %s, held %d", st, out, p.Held())
	}
	h := handoff{RemoteRequestID: ans.KV.RemoteRequestID, RemoteBlockIDs: ans.KV.RemoteBlockIDs}
	if st, _ := post(context.Background(), p.URL()+"/_nixl/pull", h); st != 200 {
		t.Fatalf("first pull %d", st)
	}
	if st, _ := post(context.Background(), p.URL()+"/_nixl/pull", h); st != 410 {
		t.Fatalf("second pull %d", st)
	}
	// No params: recomputed.
	if st, _ := post(context.Background(), d.URL()+"/v1/completions", map[string]any{"prompt": "x", "max_tokens": 2}); st != 200 || d.Stats.Recomputes.Load() != 1 {
		t.Fatalf("%d, recomputes %d", st, d.Stats.Recomputes.Load())
	}
	// A lease ends.
	post(context.Background(), p.URL()+"/v1/completions", map[string]any{"prompt": "y", "max_tokens": 1,
		"kv_transfer_params": map[string]any{"do_remote_decode": true}})
	testenv.WaitFor(t, "the lease to end", func() bool { return p.Held() == 0 && p.Stats.LeaseExpiry.Load() == 1 })
	if p.Stats.BadPrefill.Load() != 0 {
		t.Errorf("bad prefill legs counted: %d", p.Stats.BadPrefill.Load())
	}
	post(context.Background(), p.URL()+"/v1/completions", map[string]any{"prompt": "y", "max_tokens": 5, "stream": true,
		"kv_transfer_params": map[string]any{"do_remote_decode": true}})
	if p.Stats.BadPrefill.Load() != 1 {
		t.Errorf("a streamed prefill leg of 5 tokens not counted bad")
	}
}
