package pd_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/tether-rl/tether/testenv/fakepd"
	"github.com/tether-rl/tether/userspace/pd"
)

// standIn is an engine that answers at once with a fixed body: the
// benchmark measures the router, not a fake's work.
func standIn(b *testing.B, answer string) *httptest.Server {
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(answer)))
		w.Write([]byte(answer))
	}))
	b.Cleanup(s.Close)
	return s
}

type onePair struct{ p pd.Pair }

func (o onePair) Choose(context.Context, *pd.Request, int, *pd.Pair) (pd.Pair, error) {
	return o.p, nil
}
func (onePair) Release(pd.Pair, bool) {}

func cpuTime() int64 {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return ru.Utime.Nano() + ru.Stime.Nano()
}

// BenchmarkServe: one request through pd.Serve (SGLang, vLLM) against a
// plain single-leg relay on the same net/http client and transport, and
// against fakepd's direct clients (the protocol done by the client, no
// router hop, encoding/json), with stand-in engines answering at once; a
// 2,048-token prompt as input_ids. cpu-us/op is the whole process's CPU
// (client, router and stand-ins).
func BenchmarkServe(b *testing.B) {
	ids := make([]string, 2048)
	for i := range ids {
		ids[i] = strconv.Itoa(1000 + i*7)
	}
	answer := `{"text":"` + strings.Repeat(" t123", 64) + `","meta_info":{"id":"x","finish_reason":{"type":"length","length":64},"prompt_tokens":2048,"completion_tokens":64}}`
	kv := `{"choices":[{"index":0,"text":" t1","finish_reason":"length"}],"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2,3,4,5,6,7,8]],"remote_engine_id":"e","remote_request_id":"r","remote_host":"127.0.0.1","remote_port":1,"tp_size":1}}`
	cases := []struct {
		name, path, body string
		proto            pd.Protocol
		relay            bool
		prefill          string
		direct           bool
	}{
		{"relay", "/generate", `{"input_ids":[` + strings.Join(ids, ",") + `],"sampling_params":{"max_new_tokens":64}}`, 0, true, "", false},
		{"sglang", "/generate", `{"input_ids":[` + strings.Join(ids, ",") + `],"sampling_params":{"max_new_tokens":64}}`, pd.SGLang, false, `{"text":"","meta_info":{"finish_reason":{"type":"length","length":0}}}`, false},
		{"vllm", "/v1/completions", `{"model":"m","prompt":[` + strings.Join(ids, ",") + `],"max_tokens":64,"stream":false}`, pd.VLLM, false, kv, false},
		{"direct-sglang", "/generate", `{"input_ids":[` + strings.Join(ids, ",") + `],"sampling_params":{"max_new_tokens":64}}`, pd.SGLang, false, `{"text":"","meta_info":{"finish_reason":{"type":"length","length":0}}}`, true},
		{"direct-vllm", "/v1/completions", `{"model":"m","prompt":[` + strings.Join(ids, ",") + `],"max_tokens":64,"stream":false}`, pd.VLLM, false, kv, true},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			d := standIn(b, answer)
			if c.direct {
				// A client doing the protocol itself: no router hop.
				p := standIn(b, c.prefill)
				client := &http.Client{Transport: pd.NewTransport()}
				b.Cleanup(client.CloseIdleConnections)
				b.ReportAllocs()
				cpu0 := cpuTime()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					var st int
					var out []byte
					var err error
					if c.proto == pd.SGLang {
						st, out, err = fakepd.DirectSGLang(context.Background(), client, p.URL, 1, d.URL, c.path, []byte(c.body))
					} else {
						st, out, err = fakepd.DirectVLLM(context.Background(), client, p.URL, d.URL, c.path, []byte(c.body))
					}
					if err != nil || st != 200 || len(out) != len(answer) {
						b.Fatalf("status %d, %v", st, err)
					}
				}
				b.StopTimer()
				b.ReportMetric(float64(cpuTime()-cpu0)/1e3/float64(b.N), "cpu-us/op")
				return
			}
			var handler http.HandlerFunc
			tr := pd.NewTransport()
			b.Cleanup(tr.CloseIdleConnections)
			if c.relay {
				client := &http.Client{Transport: tr}
				handler = func(w http.ResponseWriter, r *http.Request) {
					body, _ := io.ReadAll(r.Body)
					req, _ := http.NewRequestWithContext(r.Context(), r.Method, d.URL+r.URL.Path, bytes.NewReader(body))
					req.Header.Set("Content-Type", "application/json")
					resp, err := client.Do(req)
					if err != nil {
						w.WriteHeader(502)
						return
					}
					defer resp.Body.Close()
					for k, v := range resp.Header {
						w.Header()[k] = v
					}
					w.WriteHeader(resp.StatusCode)
					io.Copy(w, resp.Body)
				}
			} else {
				p := standIn(b, c.prefill)
				srv := pd.New(pd.Config{Protocol: c.proto, Transport: tr})
				b.Cleanup(srv.Close)
				ch := onePair{pd.Pair{Prefill: pd.Worker{URL: p.URL}, Decode: pd.Worker{URL: d.URL}}}
				handler = func(w http.ResponseWriter, r *http.Request) {
					body, _ := io.ReadAll(r.Body)
					srv.Serve(r.Context(), w, &pd.Request{Method: r.Method, Path: r.URL.Path, Header: r.Header, Body: body}, ch)
				}
			}
			rt := httptest.NewServer(handler)
			b.Cleanup(rt.Close)
			client := rt.Client()
			b.ReportAllocs()
			b.SetBytes(int64(len(c.body)))
			cpu0 := cpuTime()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				resp, err := client.Post(rt.URL+c.path, "application/json", strings.NewReader(c.body))
				if err != nil {
					b.Fatal(err)
				}
				n, _ := io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 || n != int64(len(answer)) {
					b.Fatal(fmt.Sprintf("status %d, %d bytes", resp.StatusCode, n))
				}
			}
			b.StopTimer()
			b.ReportMetric(float64(cpuTime()-cpu0)/1e3/float64(b.N), "cpu-us/op")
		})
	}
}
